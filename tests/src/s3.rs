//! A real S3-compatible server for the S3 fence's tests and benchmark:
//! moto's S3 (PyPI `moto[server]`, pinned and installed by `scripts/setup`),
//! started on a free loopback port with its log in a temp dir, and killed on
//! drop.
//!
//! moto implements `PutObject`'s `If-Match` (412 on a stale ETag, 404 on a
//! missing object) and `If-None-Match: *` (412 over an existing object),
//! keeps `x-amz-meta-*` metadata and returns it on `HEAD`/`GET`, and uses
//! AWS's ETag (the MD5 of the bytes, quoted). It never answers 409
//! `ConditionalRequestConflict`.
//!
//! Signatures are verified: moto is started with IAM authentication on
//! (`INITIAL_NO_AUTH_ACTION_COUNT=3`: the first three requests, which create
//! an IAM user, its `s3:*` policy and its access key, go unchecked), and
//! every S3 request after that must carry a valid SigV4 signature by that
//! key (a wrong one answers 403 `SignatureDoesNotMatch`).
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
/// IAM actions moto lets through unauthenticated: the three of [`BOOTSTRAP`].
const UNAUTHENTICATED_ACTIONS: &str = "3";
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

/// Creates the IAM user the tests sign as, and prints its key pair.
const BOOTSTRAP: &str = r#"
import json, sys, boto3
iam = boto3.client("iam", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}", region_name="us-east-1",
                   aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
iam.create_user(UserName="latchkey-fence")
iam.put_user_policy(UserName="latchkey-fence", PolicyName="s3", PolicyDocument=json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
key = iam.create_access_key(UserName="latchkey-fence")["AccessKey"]
print(key["AccessKeyId"], key["SecretAccessKey"])
"#;

/// A running moto S3 server owned by this handle.
pub struct S3Server {
    child: Option<Child>,
    port: u16,
    credentials: Credentials,
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
                .env("INITIAL_NO_AUTH_ACTION_COUNT", UNAUTHENTICATED_ACTIONS)
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .context("starting moto's S3 server with python3 (run scripts/setup)")?;
            match wait_ready(&mut child, port).await {
                Ok(()) => {
                    let mut server = Self {
                        child: Some(child),
                        port,
                        credentials: Credentials::new("", ""),
                        log,
                        _dir: dir,
                    };
                    server.credentials = bootstrap(port).await.with_context(|| {
                        format!("creating moto's IAM user\n{}", server.log_tail())
                    })?;
                    return Ok(server);
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

    /// The key pair moto checks signatures against.
    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// What `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` would hold for
    /// this server (for `latchkey_fence_s3::config_from_url`).
    pub fn env(&self, name: &str) -> Option<String> {
        match name {
            "AWS_ACCESS_KEY_ID" => Some(self.credentials.access_key().to_string()),
            "AWS_SECRET_ACCESS_KEY" => Some(self.credentials.secret_key().to_string()),
            _ => None,
        }
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
            credentials: self.credentials.clone(),
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
    let child = parking_lot::Mutex::new(child);
    eventually("moto's S3 server to listen", READY_TIMEOUT, || async {
        if let Some(status) = child.lock().try_wait()? {
            bail!("moto exited: {status}");
        }
        // Listening is serving (werkzeug binds, then serves). Not an HTTP
        // request: moto would count it among the unauthenticated actions.
        tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        Ok(())
    })
    .await
}

async fn bootstrap(port: u16) -> anyhow::Result<Credentials> {
    let out = tokio::process::Command::new("python3")
        .args(["-W", "ignore", "-c", BOOTSTRAP, &port.to_string()])
        .stdin(Stdio::null())
        .output()
        .await
        .context("running python3 (boto3 comes with moto)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    match (out.status.success(), words.next(), words.next()) {
        (true, Some(id), Some(secret)) => Ok(Credentials::new(id, secret)),
        _ => bail!(
            "the IAM bootstrap failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
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
