//! A real S3-compatible server for the S3 fence's tests and benchmark:
//! moto's S3 (PyPI `moto[server]`, pinned and installed by `scripts/setup`),
//! started on a free loopback port with its log in a temp dir, and killed on
//! drop.
//!
//! moto implements `PutObject`'s `If-Match` (412 on a stale ETag, 404 on a
//! missing object) and `If-None-Match: *` (412 over an existing object),
//! keeps `x-amz-meta-*` metadata and returns it on `HEAD`/`GET`, and uses
//! AWS's ETag (the MD5 of the bytes, quoted). It answers unsigned requests
//! for existing objects with 403 (anonymous access), so requests must carry
//! a SigV4 `Authorization` header, though it does not verify the signature.
//! It never answers 409 `ConditionalRequestConflict`.
//!
//! It is served single-threaded here (werkzeug `threaded=False`, one request
//! at a time) rather than through `moto_server` (threaded): moto checks the
//! precondition and stores the object as two steps of one request handler,
//! so only one request at a time makes each conditional PUT atomic by
//! construction, as a real store's is. docs/fencing-s3.md has what was
//! verified.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use latchkey_fence_s3::{Credentials, S3Config, S3Store};
use tempfile::TempDir;

use crate::eventually;

/// The moto release `scripts/setup` installs and these tests were verified with.
pub const MOTO_VERSION: &str = "5.2.1";
pub const ACCESS_KEY: &str = "latchkey-test";
pub const SECRET_KEY: &str = "latchkey-test-secret";
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const START_ATTEMPTS: usize = 3;
const LOG_TAIL_LINES: usize = 40;

/// moto's S3 app under werkzeug, one request at a time.
const LAUNCHER: &str = r#"
import sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
run_simple("127.0.0.1", int(sys.argv[1]), DomainDispatcherApplication(create_backend_app), threaded=False)
"#;

/// A running moto S3 server owned by this handle.
pub struct S3Server {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
    _dir: TempDir,
}

impl S3Server {
    pub async fn start() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-s3-")
            .tempdir()
            .context("creating the S3 server's temp dir")?;
        let log = dir.path().join("moto.log");
        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let out = std::fs::File::create(&log)?;
            let mut child = Command::new("python3")
                .args(["-W", "ignore", "-c", LAUNCHER, &port.to_string()])
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .context("starting moto's S3 server with python3 (run scripts/setup)")?;
            match wait_ready(&mut child, port).await {
                Ok(()) => {
                    return Ok(Self {
                        child: Some(child),
                        port,
                        log,
                        _dir: dir,
                    });
                }
                Err(err) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let tail = tail_of(&log);
                    if !tail.contains("Address already in use") {
                        bail!(
                            "moto did not start (is moto[server] {MOTO_VERSION} installed? \
                             scripts/setup): {err:#}\n{tail}"
                        );
                    }
                    tracing::warn!("moto lost a port race; retrying");
                    last_err = Some(err);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("moto did not start")))
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A store URL for `S3Store::from_url` (credentials from the environment).
    pub fn url(&self, bucket: &str, prefix: &str) -> String {
        format!(
            "s3://{bucket}/{prefix}?endpoint={}&region=us-east-1",
            self.endpoint()
        )
    }

    /// A path-style config for `bucket` under `prefix`, with the test credentials.
    pub fn config(&self, bucket: &str, prefix: &str) -> S3Config {
        S3Config {
            endpoint: self.endpoint(),
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            region: "us-east-1".to_string(),
            credentials: Credentials::new(ACCESS_KEY, SECRET_KEY),
            path_style: true,
            attempts: latchkey_fence_s3::DEFAULT_ATTEMPTS,
            timeout: Duration::from_secs(10),
        }
    }

    /// A store on `bucket` (created if missing) under `prefix`.
    pub async fn store(&self, bucket: &str, prefix: &str) -> anyhow::Result<S3Store> {
        let store = S3Store::new(self.config(bucket, prefix))?;
        store.create_bucket().await?;
        Ok(store)
    }

    /// The last lines of moto's log (werkzeug's request lines and any traceback).
    pub fn log_tail(&self) -> String {
        tail_of(&self.log)
    }

    /// How many requests moto answered with `status` so far (from its log).
    pub fn answers_with(&self, status: u16) -> usize {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.matches(&format!("\" {status} ")).count()
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

async fn wait_ready(child: &mut Child, port: u16) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let url = format!("http://127.0.0.1:{port}/");
    let child = parking_lot::Mutex::new(child);
    eventually("moto's S3 server to answer", READY_TIMEOUT, || async {
        if let Some(status) = child.lock().try_wait()? {
            bail!("moto exited: {status}");
        }
        // Any HTTP answer means it serves.
        http.get(&url).send().await?;
        Ok(())
    })
    .await
}

fn tail_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
