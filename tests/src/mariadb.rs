//! A private MariaDB server for tests (the MySQL/MariaDB fence, its pause
//! test, the fence benchmark): `mariadb-install-db` into a temp dir, then
//! `mariadbd` on a free loopback port with its unix socket in that dir.
//!
//! The server reads no option files (`--no-defaults`), keeps no binary log
//! and does not flush InnoDB's log at each commit: a test server is thrown
//! away. As root (CI) it runs as root (`--user=root`; mariadbd refuses root
//! otherwise). The harness's own admin connection is root over the socket;
//! tests connect over TCP as [`USER`] with a password ([`MariaDbServer::url`]),
//! as an application would. Dropping the handle kills the server (SIGKILL)
//! and removes the dir.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, OptsBuilder};
use std::process::Child;
use tempfile::TempDir;

use tokio::process::Command;

use crate::eventually;

/// The database tests use.
pub const DATABASE: &str = "latchkey";
/// The application user [`MariaDbServer::url`] names.
pub const USER: &str = "latchkey";
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const START_ATTEMPTS: usize = 3;
const LOG_TAIL_LINES: usize = 40;

/// A running mariadbd owned by this handle.
#[derive(Debug)]
pub struct MariaDbServer {
    child: Option<Child>,
    port: u16,
    password: String,
    log_path: PathBuf,
    // Last field: removed after the server is killed in `Drop`.
    dir: TempDir,
}

impl MariaDbServer {
    /// Installs a data dir, starts the server on a free port, waits until it
    /// answers, and creates [`DATABASE`] and [`USER`].
    pub async fn start() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-mariadb-")
            .tempdir()
            .context("creating the MariaDB temp dir")?;
        let as_root = crate::postgres::running_as_root()?;
        let mut install = Command::new(binary("mariadb-install-db")?);
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            // Its own tmpdir: bootstraps running at once in the shared /tmp
            // collide on their temporary tables ("Unknown table
            // 'mysql.tmp_user_sys'", one install in four here).
            .arg(format!("--tmpdir={}", dir.path().display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .args(as_root.then_some("--user=root"))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let out = install
            .output()
            .await
            .context("running mariadb-install-db")?;
        if !out.status.success() {
            bail!(
                "mariadb-install-db failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut server = Self {
            child: None,
            port: 0,
            password: format!("pw-{:016x}", fastrand::u64(..)),
            log_path: dir.path().join("mariadbd.log"),
            dir,
        };
        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            server.port = crate::postgres::free_port()?;
            match server.spawn_and_wait(as_root).await {
                Ok(()) => {
                    last_err = None;
                    break;
                }
                Err(err) if server.log_tail().contains("Address already in use") => {
                    tracing::warn!(error = %format!("{err:#}"), "mariadb lost a port race; retrying");
                    server.kill();
                    last_err = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        if let Some(err) = last_err {
            return Err(err);
        }
        let mut admin = server.admin().await?;
        admin
            .query_drop(format!(
                "CREATE DATABASE {DATABASE}; \
                 CREATE USER '{USER}'@'127.0.0.1' IDENTIFIED BY '{}'; \
                 GRANT ALL ON {DATABASE}.* TO '{USER}'@'127.0.0.1'",
                server.password
            ))
            .await
            .context("creating the test database and user")?;
        tracing::debug!(port = server.port, dir = %server.dir.path().display(), "mariadb ready");
        Ok(server)
    }

    async fn spawn_and_wait(&mut self, as_root: bool) -> anyhow::Result<()> {
        let log = std::fs::File::create(&self.log_path).context("creating the MariaDB log")?;
        let mut cmd = std::process::Command::new(binary("mariadbd")?);
        let d = self.dir.path();
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", d.join("data").display()))
            .arg(format!("--socket={}", self.socket().display()))
            .arg(format!("--pid-file={}", d.join("mariadbd.pid").display()))
            .arg(format!("--tmpdir={}", d.display()))
            .arg(format!("--port={}", self.port))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--skip-log-bin",
                "--innodb-flush-log-at-trx-commit=0",
                "--innodb-doublewrite=0",
                "--innodb-buffer-pool-size=32M",
                "--innodb-use-native-aio=0",
                "--performance-schema=0",
                "--max-connections=400",
            ])
            .args(as_root.then_some("--user=root"))
            .current_dir(d)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.child = Some(cmd.spawn().context("starting mariadbd")?);
        let log_path = self.log_path.clone();
        let ready = eventually("MariaDB to accept connections", READY_TIMEOUT, || async {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            if log.contains("Address already in use") || log.contains("[ERROR] Aborting") {
                // Not worth waiting for: say so at once (the caller reads the log).
                return Ok(Err(anyhow::anyhow!("mariadbd gave up")));
            }
            let mut conn = self.admin().await?;
            conn.query_drop("SELECT 1").await?;
            Ok(Ok(()))
        })
        .await
        .and_then(|inner| inner);
        ready.with_context(|| format!("MariaDB log tail:\n{}", self.log_tail()))
    }

    /// root over the unix socket.
    pub async fn admin(&self) -> anyhow::Result<Conn> {
        let opts = OptsBuilder::default()
            .socket(Some(self.socket().display().to_string()))
            .user(Some("root"))
            .prefer_socket(true);
        Conn::new(opts)
            .await
            .with_context(|| format!("connecting to MariaDB's socket {}", self.socket().display()))
    }

    /// `mysql://latchkey:PASSWORD@127.0.0.1:PORT/latchkey`: holds a password.
    pub fn url(&self) -> String {
        format!(
            "mysql://{USER}:{}@127.0.0.1:{}/{DATABASE}",
            self.password, self.port
        )
    }

    pub fn password(&self) -> &str {
        &self.password
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// An application connection (TCP, [`USER`], [`DATABASE`]).
    pub async fn conn(&self) -> anyhow::Result<Conn> {
        let opts = mysql_async::Opts::from_url(&self.url()).context("the harness's URL")?;
        Conn::new(opts)
            .await
            .with_context(|| format!("connecting to MariaDB on port {}", self.port))
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("mariadbd.sock")
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last lines of the server log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Reaped, so the port and the data dir's locks are free.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A MariaDB program: on PATH, or in /usr/sbin or /usr/bin (Debian's
/// `mariadb-server`, which scripts/setup installs).
fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{name} not found (PATH, /usr/sbin): scripts/setup installs Debian's mariadb-server"
            )
        })
}
