//! A private Redis server for tests (the Redis fence, its pause test, the
//! fence benchmark): `redis-server` on a free loopback port with its working
//! dir in a temp dir, no persistence (`--save '' --appendonly no`), and a
//! password (`--requirepass`), so the URL the tests hand around carries a
//! secret as a real deployment's would. Dropping the handle kills it.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use anyhow::Context;
use tempfile::TempDir;

use crate::eventually;

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const START_ATTEMPTS: usize = 3;
const LOG_TAIL_LINES: usize = 40;

/// A running redis-server owned by this handle.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    password: String,
    log_path: PathBuf,
    // Last field: removed after the server is killed in `Drop`.
    dir: TempDir,
}

impl RedisServer {
    /// Starts redis-server on a free port and waits until it answers PING.
    pub async fn start() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-redis-")
            .tempdir()
            .context("creating the Redis temp dir")?;
        let mut server = Self {
            child: None,
            port: 0,
            password: format!("pw-{:016x}", fastrand::u64(..)),
            log_path: dir.path().join("redis.log"),
            dir,
        };
        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            server.port = crate::postgres::free_port()?;
            match server.spawn_and_wait().await {
                Ok(()) => return Ok(server),
                Err(err) if server.log_tail().contains("Address already in use") => {
                    tracing::warn!(error = %format!("{err:#}"), "redis lost a port race; retrying");
                    server.kill();
                    last_err = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("redis did not start")))
    }

    async fn spawn_and_wait(&mut self) -> anyhow::Result<()> {
        let log = std::fs::File::create(&self.log_path).context("creating the Redis log")?;
        let child = std::process::Command::new("redis-server")
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--requirepass")
            .arg(&self.password)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting redis-server (scripts/setup installs Debian's redis-server)")?;
        self.child = Some(child);
        let log_path = self.log_path.clone();
        eventually("Redis to answer PING", READY_TIMEOUT, || async {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            if log.contains("Address already in use") {
                return Ok(Err(anyhow::anyhow!("redis-server could not bind its port")));
            }
            let mut conn = self.connection().await?;
            let pong: String = ::redis::cmd("PING").query_async(&mut conn).await?;
            anyhow::ensure!(pong == "PONG", "PING answered {pong}");
            Ok(Ok(()))
        })
        .await
        .and_then(|inner| inner)
        .with_context(|| format!("Redis log tail:\n{}", self.log_tail()))
    }

    /// `redis://:PASSWORD@127.0.0.1:PORT/0`: holds a password.
    pub fn url(&self) -> String {
        format!("redis://:{}@127.0.0.1:{}/0", self.password, self.port)
    }

    pub fn password(&self) -> &str {
        &self.password
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A fresh multiplexed connection, authenticated.
    pub async fn connection(&self) -> anyhow::Result<::redis::aio::MultiplexedConnection> {
        let client = ::redis::Client::open(self.url()).context("the harness's URL")?;
        client
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("connecting to Redis on port {}", self.port))
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
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
