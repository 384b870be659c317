//! A real single-member etcd 3.4 process for tests.
//!
//! Each server gets free loopback ports and its own temp dir (data dirs and `etcd.log`
//! inside it), and is SIGKILLed and reaped on drop. Faults are injected on the real
//! process: [`EtcdServer::kill`], [`EtcdServer::pause`] (SIGSTOP), and
//! [`EtcdServer::restore`] from a snapshot, which rewinds the revision and, depending on
//! [`RestoreFlags`], keeps or changes the cluster ID.
//!
//! [`EtcdServer::start_with`] can serve clients over TLS ([`EtcdTls`], certificates
//! from a dev CA of its own, see [`etcd_certs`]), require client certificates
//! (`--client-cert-auth`) and, with [`EtcdServer::enable_auth`], users and passwords.

use std::fs::{self, OpenOptions};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use std::sync::OnceLock;

use anyhow::{Context, bail, ensure};
use latchctl::dev_certs::{self, DevTrustDomain, SvidFiles};
use latchkey_etcd::auth::{Permission, PermissionType};
use latchkey_etcd::{Client, Connection, Login, TlsPem};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tempfile::TempDir;

use crate::eventually;

const ETCD_BIN: &str = "etcd";
const ETCDCTL_BIN: &str = "etcdctl";
/// A cold single-member start (election included) takes about a second on a busy CI box.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const LOG_TAIL_LINES: usize = 40;
/// Retries of `start` when a port picked as free was taken before etcd bound it.
const START_ATTEMPTS: usize = 3;

/// How [`EtcdServer::restore`] runs `etcdctl snapshot restore`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreFlags {
    /// The same `--name`, `--initial-cluster` and `--initial-cluster-token` as the running
    /// member: etcd comes back with the SAME cluster ID, so the ID alone does not reveal
    /// the restore.
    Same,
    /// A new `--initial-cluster-token`: the restored cluster gets a new cluster ID.
    Different,
}

/// The trust domain of the dev CA that issues etcd's server certificate and
/// the client certificates etcd accepts; separate from the arbiter's callers'.
pub const ETCD_TRUST_DOMAIN: &str = "etcd.latchkey";
/// etcd's own certificate (SANs `localhost` and `127.0.0.1`, where it listens).
pub const ETCD_SERVER_NAME: &str = "etcd/server";
/// The arbiter's client certificate for etcd.
pub const ETCD_ARBITER_NAME: &str = "etcd/arbiter";
/// The harness's own client certificate (readiness polls, `client()`, `etcdctl`).
pub const ETCD_HARNESS_NAME: &str = "etcd/harness";

/// The etcd dev CA for this test process (generated once). Its certificates are
/// SVID-shaped (ECDSA P-256, server and client usage, SANs `localhost` and
/// `127.0.0.1`); etcd checks only the chain and, for its own, the IP SAN.
pub fn etcd_certs() -> anyhow::Result<&'static DevTrustDomain> {
    static CERTS: OnceLock<Result<(TempDir, DevTrustDomain), String>> = OnceLock::new();
    let made = CERTS.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-etcd-certs-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let td = dev_certs::generate(
            dir.path(),
            ETCD_TRUST_DOMAIN,
            &[ETCD_SERVER_NAME, ETCD_ARBITER_NAME, ETCD_HARNESS_NAME],
        )
        .map_err(|e| format!("{e:#}"))?;
        Ok((dir, td))
    });
    match made {
        Ok((_, td)) => Ok(td),
        Err(e) => bail!("etcd dev certificates: {e}"),
    }
}

/// How [`EtcdServer::start_with`] starts etcd.
#[derive(Debug, Clone, Default)]
pub struct EtcdOptions {
    /// Serve clients over TLS (`https://`); `None` is plain http.
    pub tls: Option<EtcdTls>,
}

/// etcd's client TLS: `--cert-file`, `--key-file`, `--trusted-ca-file` and,
/// with `client_cert_auth`, `--client-cert-auth`.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// Signs etcd's certificate and every client certificate etcd accepts.
    pub ca: PathBuf,
    pub server: SvidFiles,
    pub client_cert_auth: bool,
    /// What the harness's own clients present.
    pub harness: SvidFiles,
}

impl EtcdTls {
    /// TLS from [`etcd_certs`], requiring client certificates.
    pub fn mutual() -> anyhow::Result<Self> {
        let certs = etcd_certs()?;
        Ok(Self {
            ca: certs.ca(),
            server: certs.svid(ETCD_SERVER_NAME),
            client_cert_auth: true,
            harness: certs.svid(ETCD_HARNESS_NAME),
        })
    }

    /// The client certificate made for the arbiter, chaining to [`Self::ca`].
    pub fn arbiter_cert(&self) -> anyhow::Result<SvidFiles> {
        Ok(etcd_certs()?.svid(ETCD_ARBITER_NAME))
    }
}

/// A running (or deliberately stopped) etcd member.
#[derive(Debug)]
pub struct EtcdServer {
    name: String,
    client_port: u16,
    peer_port: u16,
    cluster_token: String,
    data_dir: PathBuf,
    log_path: PathBuf,
    child: Option<Child>,
    /// Bumped per restore so each restore gets a fresh data dir and token.
    generation: u32,
    tls: Option<EtcdTls>,
    /// The harness's user once [`Self::enable_auth`] ran (root, password).
    login: Option<(String, String)>,
    // Last field: dropped after the process is killed in `Drop`.
    dir: TempDir,
}

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it serves requests.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(EtcdOptions::default()).await
    }

    /// [`Self::start`] with TLS (see [`EtcdOptions`]).
    pub async fn start_with(options: EtcdOptions) -> anyhow::Result<Self> {
        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            let mut server = Self::new(options.clone())?;
            match server.spawn_and_wait().await {
                Ok(()) => return Ok(server),
                // Only a lost port race is worth another try with new ports.
                Err(err) if server.log_tail().contains("address already in use") => {
                    tracing::warn!(error = %format!("{err:#}"), "etcd lost a port race; retrying");
                    last_err = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("etcd did not start")))
    }

    fn new(options: EtcdOptions) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-etcd-")
            .tempdir()
            .context("creating etcd temp dir")?;
        let (client_port, peer_port) = free_port_pair()?;
        let name = "latchkey-test".to_owned();
        Ok(Self {
            cluster_token: format!("latchkey-test-{peer_port}"),
            data_dir: dir.path().join("data-0"),
            log_path: dir.path().join("etcd.log"),
            name,
            client_port,
            peer_port,
            child: None,
            generation: 0,
            tls: options.tls,
            login: None,
            dir,
        })
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS), stable across restarts
    /// and restores.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The TLS etcd serves with, if any.
    pub fn tls(&self) -> Option<&EtcdTls> {
        self.tls.as_ref()
    }

    /// How the harness's own clients connect: TLS with its client certificate,
    /// and the root user once auth is enabled.
    fn connection(&self) -> anyhow::Result<Connection> {
        let mut connection = Connection::new([self.endpoint()]);
        if let Some(tls) = &self.tls {
            let read = |p: &Path| fs::read(p).with_context(|| format!("reading {}", p.display()));
            connection.tls = Some(TlsPem {
                ca: read(&tls.ca)?,
                identity: Some((read(&tls.harness.cert)?, read(&tls.harness.key)?)),
            });
        }
        if let Some((user, password)) = &self.login {
            connection.login = Some(Login::new(user.clone(), password.clone()));
        }
        Ok(connection)
    }

    /// `etcdctl` flags for TLS and the root user.
    fn etcdctl_flags(&self) -> anyhow::Result<Vec<String>> {
        let mut flags = Vec::new();
        if let Some(tls) = &self.tls {
            for (flag, path) in [
                ("--cacert", &tls.ca),
                ("--cert", &tls.harness.cert),
                ("--key", &tls.harness.key),
            ] {
                flags.push(flag.to_owned());
                flags.push(path_str(path)?.to_owned());
            }
        }
        if let Some((user, password)) = &self.login {
            flags.push(format!("--user={user}:{password}"));
        }
        Ok(flags)
    }

    /// Turns on etcd's auth: a `root` user (which etcd 3.4 requires) with
    /// `root_password`, used by the harness's own clients from now on.
    pub async fn enable_auth(&mut self, root_password: &str) -> anyhow::Result<()> {
        let mut client = self.client().await?;
        client
            .user_add("root", root_password, None)
            .await
            .context("adding etcd user root")?;
        client
            .user_grant_role("root", "root")
            .await
            .context("granting role root")?;
        client.auth_enable().await.context("enabling etcd auth")?;
        self.login = Some(("root".into(), root_password.into()));
        Ok(())
    }

    /// Adds `user` with read-write access to the keys under `prefix` only
    /// (after [`Self::enable_auth`]).
    pub async fn add_user(&self, user: &str, password: &str, prefix: &str) -> anyhow::Result<()> {
        let mut client = self.client().await?;
        let role = format!("{user}-rw");
        client
            .role_add(role.as_str())
            .await
            .context("adding role")?;
        client
            .role_grant_permission(
                role.as_str(),
                Permission::new(PermissionType::Readwrite, prefix).with_prefix(),
            )
            .await
            .context("granting the prefix")?;
        client
            .user_add(user, password, None)
            .await
            .context("adding user")?;
        client
            .user_grant_role(user, role.as_str())
            .await
            .context("granting the role")?;
        Ok(())
    }

    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The current data dir (a new one after each restore).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// etcd's stdout and stderr, appended across restarts.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The process id, if the process is running (or paused).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A fresh client. Connecting fails fast while etcd is down; requests to a paused
    /// etcd hang, so wrap them in a timeout when that matters.
    pub async fn client(&self) -> anyhow::Result<Client> {
        let connection = Connection {
            connect_timeout: Some(Duration::from_secs(2)),
            ..self.connection()?
        };
        latchkey_etcd::connect(&connection)
            .await
            .with_context(|| format!("connecting to etcd at {}", self.endpoint()))
    }

    /// The cluster ID from a status response header.
    pub async fn cluster_id(&self) -> anyhow::Result<u64> {
        let status = self.client().await?.status().await.context("etcd status")?;
        let header = status.header().context("status response without header")?;
        Ok(header.cluster_id())
    }

    /// The current store revision from a status response header.
    pub async fn revision(&self) -> anyhow::Result<i64> {
        let status = self.client().await?.status().await.context("etcd status")?;
        let header = status.header().context("status response without header")?;
        Ok(header.revision())
    }

    /// `etcdctl snapshot save` into `path`.
    pub async fn snapshot_save(&self, path: &Path) -> anyhow::Result<()> {
        let endpoint = self.endpoint();
        let flags = self.etcdctl_flags()?;
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        args.extend([
            "--endpoints",
            &endpoint,
            "snapshot",
            "save",
            path_str(path)?,
        ]);
        run_etcdctl(&args).await
    }

    /// Stops etcd, restores `snapshot` into a fresh data dir and starts it again on the
    /// same ports. See [`RestoreFlags`] for what happens to the cluster ID.
    pub async fn restore(&mut self, snapshot: &Path, flags: RestoreFlags) -> anyhow::Result<()> {
        self.kill()?;
        self.generation += 1;
        if flags == RestoreFlags::Different {
            self.cluster_token = format!("{}-restored-{}", self.cluster_token, self.generation);
        }
        let data_dir = self.dir.path().join(format!("data-{}", self.generation));
        let peer_url = self.peer_url();
        let initial_cluster = self.initial_cluster();
        run_etcdctl(&[
            "snapshot",
            "restore",
            path_str(snapshot)?,
            "--name",
            &self.name,
            "--initial-cluster",
            &initial_cluster,
            "--initial-cluster-token",
            &self.cluster_token,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--data-dir",
            path_str(&data_dir)?,
        ])
        .await?;
        self.data_dir = data_dir;
        self.spawn_and_wait().await
    }

    /// SIGKILLs the process and reaps it. A no-op if it is not running.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            // A stopped process still dies on SIGKILL.
            child.kill().context("killing etcd")?;
            child.wait().context("reaping etcd")?;
        }
        Ok(())
    }

    /// Kills (if running) and starts again with the same data dir and ports.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill()?;
        self.spawn_and_wait().await
    }

    /// SIGSTOP: the process keeps its sockets but answers nothing.
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal(Signal::SIGSTOP)?;
        // kill(2) returns before the stop takes effect: on a loaded machine
        // etcd's threads may still answer a request sent right after it. Wait
        // until every thread is stopped, so "paused" means paused.
        let child = self.child.as_ref().context("etcd is not running")?;
        let tasks = format!("/proc/{}/task", child.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            if all_stopped(&tasks)? {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                anyhow::bail!("etcd did not stop within 5 s of SIGSTOP");
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// SIGCONT after [`Self::pause`].
    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal(Signal::SIGCONT)
    }

    fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let child = self.child.as_ref().context("etcd is not running")?;
        let pid = i32::try_from(child.id()).context("pid out of range")?;
        kill(Pid::from_raw(pid), signal).with_context(|| format!("sending {signal} to etcd"))
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    fn initial_cluster(&self) -> String {
        format!("{}={}", self.name, self.peer_url())
    }

    async fn spawn_and_wait(&mut self) -> anyhow::Result<()> {
        self.spawn()?;
        if let Err(err) = self.wait_ready().await {
            let tail = self.log_tail();
            let _ = self.kill();
            eprintln!(
                "etcd did not become ready; last lines of {}:\n{tail}",
                self.log_path.display()
            );
            return Err(err.context(format!(
                "etcd at {} did not become ready; log tail ({}):\n{tail}",
                self.endpoint(),
                self.log_path.display()
            )));
        }
        tracing::debug!(endpoint = %self.endpoint(), data_dir = %self.data_dir.display(), "etcd ready");
        Ok(())
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .with_context(|| format!("opening {}", self.log_path.display()))?;
        let stderr = log.try_clone().context("cloning log file handle")?;
        let mut tls_flags: Vec<std::ffi::OsString> = Vec::new();
        if let Some(tls) = &self.tls {
            tls_flags.extend([
                "--cert-file".into(),
                tls.server.cert.clone().into(),
                "--key-file".into(),
                tls.server.key.clone().into(),
                "--trusted-ca-file".into(),
                tls.ca.clone().into(),
            ]);
            if tls.client_cert_auth {
                tls_flags.push("--client-cert-auth".into());
            }
        }
        let child = Command::new(ETCD_BIN)
            .args(member_flags(&MemberFlags {
                name: &self.name,
                data_dir: &self.data_dir,
                client_url: &self.endpoint(),
                peer_url: &self.peer_url(),
                initial_cluster: &self.initial_cluster(),
                cluster_token: &self.cluster_token,
            }))
            .args(tls_flags)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr))
            .spawn()
            .with_context(|| {
                format!("spawning `{ETCD_BIN}` (is etcd 3.4 installed? run scripts/setup)")
            })?;
        self.child = Some(child);
        Ok(())
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let endpoint = self.endpoint();
        let peer_url = self.peer_url();
        let connection = Connection {
            connect_timeout: Some(Duration::from_millis(500)),
            request_timeout: Some(Duration::from_secs(1)),
            ..self.connection()?
        };
        let child = self.child.as_mut().context("etcd is not running")?;
        let exited = eventually("etcd to answer status", READY_TIMEOUT, || {
            // Checked first so a crashed etcd fails now, not at the deadline.
            let exited = child.try_wait().ok().flatten();
            let endpoint = endpoint.clone();
            let peer_url = peer_url.clone();
            let connection = connection.clone();
            async move {
                if exited.is_some() {
                    return Ok(exited);
                }
                let mut client = latchkey_etcd::connect(&connection).await?;
                let status = client.status().await?;
                // Another test's etcd may hold this port (it was free when
                // picked; ours then failed to bind it): only our member
                // counts, known by its peer URL.
                let answering = status.header().map(|h| h.member_id());
                let members = client.member_list().await?;
                let ours = members
                    .members()
                    .iter()
                    .any(|m| Some(m.id()) == answering && m.peer_urls().contains(&peer_url));
                ensure!(
                    ours,
                    "another etcd answers at {endpoint}, not ours (peer {peer_url})"
                );
                Ok(None)
            }
        })
        .await?;
        if let Some(status) = exited {
            self.child = None;
            bail!("etcd exited during startup with {status}");
        }
        Ok(())
    }

    fn log_tail(&self) -> String {
        log_tail(&self.log_path)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Two distinct free loopback ports. Both listeners are held until both are picked, so
/// the two never coincide; etcd binds them right after.
fn free_port_pair() -> anyhow::Result<(u16, u16)> {
    let a = TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    let b = TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

pub(crate) fn path_str(path: &Path) -> anyhow::Result<&str> {
    path.to_str()
        .with_context(|| format!("path is not UTF-8: {}", path.display()))
}

pub(crate) async fn run_etcdctl(args: &[&str]) -> anyhow::Result<()> {
    let output = tokio::process::Command::new(ETCDCTL_BIN)
        .env("ETCDCTL_API", "3")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running `{ETCDCTL_BIN}` (is etcd-client installed?)"))?;
    if !output.status.success() {
        bail!(
            "`{ETCDCTL_BIN} {}` failed with {}:\n{}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// The last lines of an etcd log, for error messages.
pub(crate) fn log_tail(path: &Path) -> String {
    let Ok(log) = fs::read_to_string(path) else {
        return String::from("(no log)");
    };
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

/// The flags that identify an etcd member (and must stay the same across a
/// restore for the cluster id to stay the same).
pub(crate) struct MemberFlags<'a> {
    pub name: &'a str,
    pub data_dir: &'a Path,
    pub client_url: &'a str,
    pub peer_url: &'a str,
    pub initial_cluster: &'a str,
    pub cluster_token: &'a str,
}

/// `etcd` arguments for a member of a new cluster, logging to stderr.
pub(crate) fn member_flags(m: &MemberFlags<'_>) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut flag = |name: &str, value: &std::ffi::OsStr| {
        args.push(name.into());
        args.push(value.into());
    };
    flag("--name", m.name.as_ref());
    flag("--data-dir", m.data_dir.as_os_str());
    flag("--listen-client-urls", m.client_url.as_ref());
    flag("--advertise-client-urls", m.client_url.as_ref());
    flag("--listen-peer-urls", m.peer_url.as_ref());
    flag("--initial-advertise-peer-urls", m.peer_url.as_ref());
    flag("--initial-cluster", m.initial_cluster.as_ref());
    flag("--initial-cluster-token", m.cluster_token.as_ref());
    flag("--initial-cluster-state", "new".as_ref());
    flag("--logger", "zap".as_ref());
    flag("--log-outputs", "stderr".as_ref());
    // Long runs (benchmarks, soaks) otherwise grow the database with every
    // revision (issue 18). etcd 3.4's revision compactor runs every 5 min and
    // keeps the last 10,000 revisions: short tests never see a compaction,
    // and a waiter's watch from a compacted revision falls back to polling.
    flag("--auto-compaction-mode", "revision".as_ref());
    flag("--auto-compaction-retention", "10000".as_ref());
    args
}

/// Whether every thread under `/proc/<pid>/task` is stopped (state `T` or
/// `t` in its `stat`).
fn all_stopped(tasks: &str) -> anyhow::Result<bool> {
    for entry in std::fs::read_dir(tasks).with_context(|| format!("reading {tasks}"))? {
        let stat = match std::fs::read_to_string(entry?.path().join("stat")) {
            Ok(stat) => stat,
            // a thread that exited meanwhile
            Err(_) => continue,
        };
        // the state follows the command name in parentheses
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        if !matches!(state, Some('T' | 't')) {
            return Ok(false);
        }
    }
    Ok(true)
}
