//! A private ClickHouse server for tests (Debian's `clickhouse-server`,
//! 18.16): its own config, data and logs in a temp dir, HTTP and native
//! ports on free loopback ports, and the audit store's users as deployed
//! (docs/operations.md, "The audit store"): no `default` user (a
//! connection without credentials is refused), the tailer's writer, and a
//! reader with the `readonly = 1` profile; both with random passwords
//! (stored as SHA-256), from 127.0.0.1 only, confined to one database.
//! SIGKILLed and reaped on drop.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::eventually;

const READY_TIMEOUT: Duration = Duration::from_secs(60);
const LOG_TAIL_LINES: usize = 40;

/// The one database the users may use.
pub const DATABASE: &str = "latchkey_audit";
/// The tailer's user: writes (and creates, migrates) the audit tables.
pub const WRITER: &str = "latchkey_audit_writer";
/// `latchctl audit`'s user: the `readonly = 1` profile.
pub const READER: &str = "latchkey_audit_reader";

/// A running ClickHouse server owned by this handle.
#[derive(Debug)]
pub struct ClickHouseServer {
    http_port: u16,
    writer_password: String,
    reader_password: String,
    child: Option<Child>,
    // Last field: removed after the process is killed in `Drop`.
    dir: TempDir,
}

impl ClickHouseServer {
    /// Writes a config, starts the server and waits until HTTP answers.
    pub async fn start() -> anyhow::Result<Self> {
        let binary = binary()?;
        let dir = tempfile::Builder::new()
            .prefix("latchkey-clickhouse-")
            .tempdir()
            .context("creating the ClickHouse temp dir")?;
        let http_port = free_port()?;
        let tcp_port = free_port()?;
        let root = dir.path();
        let writer_password = password();
        let reader_password = password();
        private_file(&root.join("writer.password"), &writer_password)?;
        private_file(&root.join("reader.password"), &reader_password)?;
        private_file(
            &root.join("users.xml"),
            &users(&writer_password, &reader_password),
        )?;
        std::fs::write(
            root.join("config.xml"),
            config(root, http_port, tcp_port).context("writing the config")?,
        )?;
        let stdout = std::fs::File::create(root.join("stdout.log"))?;
        let child = Command::new(&binary)
            .arg(format!(
                "--config-file={}",
                root.join("config.xml").display()
            ))
            .current_dir(root)
            .stdin(Stdio::null())
            .stdout(stdout.try_clone()?)
            .stderr(stdout)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut server = Self {
            http_port,
            writer_password,
            reader_password,
            child: Some(child),
            dir,
        };
        let ready = eventually("ClickHouse to answer over HTTP", READY_TIMEOUT, || {
            let port = server.http_port;
            let writer = Some((WRITER, server.writer_password.clone()));
            async move { query(port, writer, "SELECT 1").await.map(drop) }
        })
        .await;
        if let Err(e) = ready {
            let exited = server
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            bail!(
                "{e:#} (exited: {exited:?})\nClickHouse log tail:\n{}",
                server.log_tail()
            );
        }
        Ok(server)
    }

    /// The tailer's store URL (no password: it is in [`Self::writer_password_file`]).
    pub fn writer_url(&self) -> String {
        format!(
            "clickhouse://{WRITER}@127.0.0.1:{}/{DATABASE}",
            self.http_port
        )
    }

    /// The readers' store URL (the password in [`Self::reader_password_file`]).
    pub fn reader_url(&self) -> String {
        format!(
            "clickhouse://{READER}@127.0.0.1:{}/{DATABASE}",
            self.http_port
        )
    }

    pub fn writer_password_file(&self) -> PathBuf {
        self.dir.path().join("writer.password")
    }

    pub fn reader_password_file(&self) -> PathBuf {
        self.dir.path().join("reader.password")
    }

    pub fn writer_password(&self) -> &str {
        &self.writer_password
    }

    pub fn reader_password(&self) -> &str {
        &self.reader_password
    }

    pub fn http_port(&self) -> u16 {
        self.http_port
    }

    /// Runs `sql` over HTTP as the writer; the response body.
    pub async fn query(&self, sql: &str) -> anyhow::Result<String> {
        query(
            self.http_port,
            Some((WRITER, self.writer_password.clone())),
            sql,
        )
        .await
    }

    /// Runs `sql` as `user` with `password` (None: no credentials at all).
    pub async fn query_as(
        &self,
        credentials: Option<(&str, &str)>,
        sql: &str,
    ) -> anyhow::Result<String> {
        let credentials = credentials.map(|(u, p)| (u, p.to_string()));
        query(self.http_port, credentials, sql).await
    }

    /// The last lines of the server's logs.
    pub fn log_tail(&self) -> String {
        let mut out = String::new();
        for name in ["stdout.log", "server.log", "err.log"] {
            let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {name}\n"));
            out.push_str(&lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n"));
            out.push('\n');
        }
        out
    }
}

impl Drop for ClickHouseServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `clickhouse-server` on PATH, or where Debian puts it (`/usr/sbin`, not
/// on every user's PATH).
pub fn binary() -> anyhow::Result<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.join("clickhouse-server"))
        .find(|p| p.is_file());
    let sbin = PathBuf::from("/usr/sbin/clickhouse-server");
    match on_path {
        Some(p) => Ok(p),
        None if sbin.is_file() => Ok(sbin),
        None => bail!(
            "no clickhouse-server binary (on PATH or /usr/sbin); scripts/setup installs Debian's clickhouse-server"
        ),
    }
}

/// `sql` over HTTP, by hand (the server is old; no client crate needed),
/// with Basic credentials if any: the body of a 200 answer, not chunked
/// (HTTP/1.0).
async fn query(
    port: u16,
    credentials: Option<(&str, String)>,
    sql: &str,
) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let auth = match credentials {
        Some((user, password)) => format!(
            "Authorization: Basic {}\r\n",
            base64(format!("{user}:{password}").as_bytes())
        ),
        None => String::new(),
    };
    let request = format!(
        "POST / HTTP/1.0\r\nHost: localhost\r\n{auth}Content-Length: {}\r\n\r\n{sql}",
        sql.len()
    );
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if !head.contains(" 200 ") {
        bail!("{}: {}", head.lines().next().unwrap_or(""), body.trim());
    }
    Ok(body.to_string())
}

fn config(root: &Path, http_port: u16, tcp_port: u16) -> anyhow::Result<String> {
    let dir = root.to_str().context("a non-UTF-8 temp dir")?;
    Ok(format!(
        r#"<yandex>
  <logger>
    <level>warning</level>
    <log>{dir}/server.log</log>
    <errorlog>{dir}/err.log</errorlog>
    <console>0</console>
  </logger>
  <http_port>{http_port}</http_port>
  <tcp_port>{tcp_port}</tcp_port>
  <listen_host>127.0.0.1</listen_host>
  <path>{dir}/data/</path>
  <tmp_path>{dir}/tmp/</tmp_path>
  <user_files_path>{dir}/user_files/</user_files_path>
  <format_schema_path>{dir}/format_schemas/</format_schema_path>
  <users_config>{dir}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <mark_cache_size>104857600</mark_cache_size>
  <uncompressed_cache_size>104857600</uncompressed_cache_size>
</yandex>
"#
    ))
}

/// users.xml: no `default` user; the writer and the read-only reader,
/// each from loopback only and confined to [`DATABASE`].
fn users(writer_password: &str, reader_password: &str) -> String {
    let sha = latchkey_audit::pseudonym::sha256_hex;
    format!(
        r#"<yandex>
  <profiles>
    <default></default>
    <writer></writer>
    <reader><readonly>1</readonly></reader>
  </profiles>
  <users>
    <{WRITER}>
      <password_sha256_hex>{}</password_sha256_hex>
      <networks><ip>127.0.0.1</ip></networks>
      <profile>writer</profile>
      <quota>default</quota>
      <allow_databases><database>{DATABASE}</database></allow_databases>
    </{WRITER}>
    <{READER}>
      <password_sha256_hex>{}</password_sha256_hex>
      <networks><ip>127.0.0.1</ip></networks>
      <profile>reader</profile>
      <quota>default</quota>
      <allow_databases><database>{DATABASE}</database></allow_databases>
    </{READER}>
  </users>
  <quotas><default></default></quotas>
</yandex>
"#,
        sha(writer_password.as_bytes()),
        sha(reader_password.as_bytes())
    )
}

/// 32 random alphanumerics (a test server's password; not a CSPRNG).
fn password() -> String {
    std::iter::repeat_with(fastrand::alphanumeric)
        .take(32)
        .collect()
}

/// Writes `text` readable by its owner only.
fn private_file(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    file.write_all(text.as_bytes())?;
    Ok(())
}

fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(TABLE[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}
