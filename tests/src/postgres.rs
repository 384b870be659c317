//! A private PostgreSQL server for tests: its own cluster in a temp dir, on a
//! free loopback port, with its unix socket inside the temp dir.
//!
//! PostgreSQL refuses to run as root, so when the tests run as root (they do
//! on CI) `initdb` and `pg_ctl` run as the `postgres` user through `runuser`,
//! and the temp dir is handed to that user first. The server trusts every
//! local connection (`--auth=trust`): it listens on 127.0.0.1 only and lives
//! as long as the test. Dropping the handle stops it (`pg_ctl stop -m
//! immediate`) and removes the dir.

use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tempfile::TempDir;
use tokio::process::Command;

use crate::eventually;

/// The database [`PostgresServer::start`] creates and [`PostgresServer::url`] names.
pub const DATABASE: &str = "latchkey";
/// The superuser `initdb` creates.
const SUPERUSER: &str = "postgres";
/// The OS user that owns the cluster when we run as root.
const OS_USER: &str = "postgres";
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const LOG_TAIL_LINES: usize = 40;
/// Retries of the server start when a port picked as free was taken first.
const START_ATTEMPTS: usize = 3;

/// A running PostgreSQL cluster owned by this handle.
#[derive(Debug)]
pub struct PostgresServer {
    bindir: PathBuf,
    data_dir: PathBuf,
    log_path: PathBuf,
    port: u16,
    as_postgres: bool,
    running: bool,
    // Last field: removed after the server is stopped in `Drop`.
    dir: TempDir,
}

impl PostgresServer {
    /// initdb, start on a free port, wait until it answers, create [`DATABASE`].
    pub async fn start() -> anyhow::Result<Self> {
        let bindir = bindir()?;
        let as_postgres = running_as_root()?;
        let dir = tempfile::Builder::new()
            .prefix("latchkey-pg-")
            .tempdir()
            .context("creating the PostgreSQL temp dir")?;
        if as_postgres {
            run(
                Command::new("chown")
                    .arg(format!("{OS_USER}:"))
                    .arg(dir.path()),
                "chown the PostgreSQL temp dir",
            )
            .await?;
        }
        let mut server = Self {
            data_dir: dir.path().join("data"),
            log_path: dir.path().join("postgres.log"),
            bindir,
            port: 0,
            as_postgres,
            running: false,
            dir,
        };
        server.initdb().await?;

        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            server.port = free_port()?;
            match server.start_server().await {
                Ok(()) => {
                    last_err = None;
                    break;
                }
                Err(err) if server.log_tail().contains("Address already in use") => {
                    tracing::warn!(error = %format!("{err:#}"), "postgres lost a port race; retrying");
                    last_err = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        if let Some(err) = last_err {
            return Err(err);
        }
        server.wait_ready().await?;
        let admin = server.connect("postgres").await?;
        admin
            .batch_execute(&format!("CREATE DATABASE {DATABASE}"))
            .await
            .with_context(|| format!("CREATE DATABASE {DATABASE}"))?;
        tracing::debug!(port = server.port, dir = %server.dir.path().display(), "postgres ready");
        Ok(server)
    }

    /// A tokio-postgres (and libpq) connection string for [`DATABASE`].
    pub fn url(&self) -> String {
        self.url_for(DATABASE)
    }

    fn url_for(&self, db: &str) -> String {
        format!("postgresql://{SUPERUSER}@127.0.0.1:{}/{db}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The unix socket directory (inside the temp dir).
    pub fn socket_dir(&self) -> PathBuf {
        self.dir.path().join("sock")
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// A connected client for [`DATABASE`]; its connection task is spawned.
    pub async fn client(&self) -> anyhow::Result<tokio_postgres::Client> {
        self.connect(DATABASE).await
    }

    async fn connect(&self, db: &str) -> anyhow::Result<tokio_postgres::Client> {
        let (client, connection) =
            tokio_postgres::connect(&self.url_for(db), tokio_postgres::NoTls)
                .await
                .with_context(|| format!("connecting to PostgreSQL on port {}", self.port))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "postgres connection ended");
            }
        });
        Ok(client)
    }

    /// The last lines of the server log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    /// A command that runs `program` from the PostgreSQL bindir as the cluster's owner.
    fn pg_command(&self, program: &str) -> Command {
        let binary = self.bindir.join(program);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.arg("-u").arg(OS_USER).arg("--").arg(binary);
            c
        } else {
            Command::new(binary)
        };
        // runuser keeps the cwd; a root-only cwd would make initdb warn.
        cmd.current_dir(self.dir.path())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        cmd
    }

    async fn initdb(&self) -> anyhow::Result<()> {
        let mut cmd = self.pg_command("initdb");
        cmd.arg("-D").arg(&self.data_dir).args([
            "--auth=trust",
            "-U",
            SUPERUSER,
            "--locale=C",
            "--encoding=UTF8",
            "--no-sync",
        ]);
        run(&mut cmd, "initdb").await
    }

    async fn start_server(&mut self) -> anyhow::Result<()> {
        let sock = self.socket_dir();
        if !sock.exists() {
            std::fs::create_dir(&sock).context("creating the socket dir")?;
            if self.as_postgres {
                run(
                    Command::new("chown").arg(format!("{OS_USER}:")).arg(&sock),
                    "chown the socket dir",
                )
                .await?;
            }
        }
        // Durability off: a test cluster is thrown away, and fsync is most of initdb's cost.
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} \
             -c fsync=off -c synchronous_commit=off -c full_page_writes=off",
            self.port,
            sock.display()
        );
        let mut cmd = self.pg_command("pg_ctl");
        cmd.arg("-D")
            .arg(&self.data_dir)
            .arg("-l")
            .arg(&self.log_path)
            .arg("-o")
            .arg(options)
            // pg_ctl's own readiness poll; ours below checks a real connection.
            .args(["-w", "-t", "30", "start"]);
        let result = run(&mut cmd, "pg_ctl start").await;
        // Even a failed start may have left a postmaster behind; Drop stops it.
        self.running = true;
        result.with_context(|| format!("PostgreSQL log tail:\n{}", self.log_tail()))
    }

    async fn wait_ready(&self) -> anyhow::Result<()> {
        eventually(
            "PostgreSQL to accept connections",
            READY_TIMEOUT,
            || async {
                let client = self.connect("postgres").await?;
                client.simple_query("SELECT 1").await?;
                Ok(())
            },
        )
        .await
        .with_context(|| format!("PostgreSQL log tail:\n{}", self.log_tail()))
    }

    fn stop(&mut self) {
        if !self.running {
            return;
        }
        self.running = false;
        let binary = self.bindir.join("pg_ctl");
        let mut cmd = if self.as_postgres {
            let mut c = std::process::Command::new("runuser");
            c.arg("-u").arg(OS_USER).arg("--").arg(binary);
            c
        } else {
            std::process::Command::new(binary)
        };
        let _ = cmd
            .current_dir(self.dir.path())
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-m", "immediate", "-w", "stop"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `cmd` to completion; on failure the error carries its output.
async fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .await
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The server binaries: `pg_config --bindir` if it has `initdb`, else the
/// newest `/usr/lib/postgresql/*/bin` (Debian's layout).
pub fn bindir() -> anyhow::Result<PathBuf> {
    if let Ok(out) = std::process::Command::new("pg_config")
        .arg("--bindir")
        .output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
            return Ok(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, bin)) => Ok(bin),
        None => bail!(
            "no PostgreSQL server binaries (initdb, pg_ctl): neither `pg_config --bindir` nor \
             /usr/lib/postgresql/*/bin has them; scripts/setup installs Debian's postgresql"
        ),
    }
}

/// Whether this process runs as root (then PostgreSQL must run as `postgres`).
pub fn running_as_root() -> anyhow::Result<bool> {
    // /proc/self is owned by the process's effective uid.
    Ok(std::fs::metadata("/proc/self")
        .context("reading /proc/self")?
        .uid()
        == 0)
}

pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}
