//! ClickHouse over its HTTP interface (plain HTTP, JSONEachRow), written
//! for the oldest server we run against, Debian's 18.16: no query
//! parameters (string literals are escaped here), no `TTL`, and version
//! columns of `ReplacingMergeTree` only unsigned.
//!
//! Events: `ReplacingMergeTree` ordered by (cluster_id, revision, key) and
//! not partitioned by time (copies are only merged within a partition, and
//! a replay's copy carries a later observation time); every read says
//! `FINAL`. Checkpoints: one row per checkpoint, read as the maximum.

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{AuditStore, HistoryQuery, StoreError};
use crate::event::{Event, Row, StoredEvent, now_unix_ms};

const EVENTS: &str = "latchkey_audit_events";
const CHECKPOINTS: &str = "latchkey_audit_checkpoints";
const COLUMNS: &str = "cluster_id, revision, `key`, kind, ended, epoch, identity, `session`, \
     class, hold_revision, prev_identity, prev_session, detail, observed_at_unix_ms";
/// One request's limit: a slow server is an outage to retry, not a hang.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub struct ClickHouseStore {
    /// `host:port`.
    addr: String,
    database: String,
    /// `Authorization: Basic …`, if the URL had a user.
    authorization: Option<String>,
}

impl ClickHouseStore {
    /// From `[user[:password]@]host:port[/database]` (the URL after
    /// `clickhouse://`).
    pub fn new(rest: &str) -> Result<Self, StoreError> {
        let bad = || StoreError::Url(format!("clickhouse://{}", super::redact(rest)));
        let (userinfo, hostpart) = match rest.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, rest),
        };
        let (addr, database) = match hostpart.split_once('/') {
            Some((a, d)) => (a, d.trim_end_matches('/')),
            None => (hostpart, ""),
        };
        let database = if database.is_empty() {
            "default"
        } else {
            database
        };
        let plain_name =
            |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if addr.is_empty() || !addr.contains(':') || !plain_name(database) {
            return Err(bad());
        }
        Ok(Self {
            addr: addr.to_string(),
            database: database.to_string(),
            authorization: userinfo.map(|u| format!("Basic {}", base64(u.as_bytes()))),
        })
    }

    /// Runs `query` (in the URL) with `body`; the response body on 200.
    async fn request(
        &self,
        context: &'static str,
        query: &str,
        body: &str,
    ) -> Result<String, StoreError> {
        let fail = |detail: String| StoreError::ClickHouse { context, detail };
        let exchange = async {
            let mut stream = TcpStream::connect(&self.addr)
                .await
                .map_err(|e| fail(format!("connecting to {}: {e}", self.addr)))?;
            let mut head = format!(
                // Every statement names its database: `?database=` would
                // refuse the one that creates it.
                "POST /?query={} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n\
                 Content-Type: text/plain; charset=utf-8\r\nConnection: close\r\n",
                percent_encode(query),
                self.addr,
                body.len()
            );
            if let Some(auth) = &self.authorization {
                head.push_str(&format!("Authorization: {auth}\r\n"));
            }
            head.push_str("\r\n");
            stream
                .write_all(head.as_bytes())
                .await
                .map_err(|e| fail(e.to_string()))?;
            stream
                .write_all(body.as_bytes())
                .await
                .map_err(|e| fail(e.to_string()))?;
            let mut response = Vec::new();
            stream
                .read_to_end(&mut response)
                .await
                .map_err(|e| fail(e.to_string()))?;
            Ok(response)
        };
        let response = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| fail(format!("no answer within {REQUEST_TIMEOUT:?}")))??;
        let (status, text) = parse_response(&response).map_err(fail)?;
        if status != 200 {
            return Err(fail(format!("HTTP {status}: {}", text.trim())));
        }
        Ok(text)
    }

    fn events(&self) -> String {
        format!("{}.{EVENTS}", self.database)
    }

    fn checkpoints(&self) -> String {
        format!("{}.{CHECKPOINTS}", self.database)
    }

    async fn select(
        &self,
        context: &'static str,
        sql: String,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        let text = self
            .request(context, &format!("{sql} FORMAT JSONEachRow"), "")
            .await?;
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|line| {
                serde_json::from_str::<Row>(line)
                    .map_err(|e| StoreError::Malformed(format!("{e}: {line}")))?
                    .into_stored()
                    .map_err(|e| StoreError::Malformed(e.to_string()))
            })
            .collect()
    }
}

#[async_trait]
impl AuditStore for ClickHouseStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        let database = format!("CREATE DATABASE IF NOT EXISTS {}", self.database);
        self.request("creating the database", &database, "").await?;
        let events = format!(
            "CREATE TABLE IF NOT EXISTS {} (\
             cluster_id UInt64, revision Int64, `key` String, kind String, ended String, \
             epoch UInt32, identity String, `session` Int64, class String, \
             hold_revision Int64, prev_identity String, prev_session Int64, detail String, \
             observed_at_unix_ms Int64\
             ) ENGINE = ReplacingMergeTree() ORDER BY (cluster_id, revision, `key`)",
            self.events()
        );
        self.request("creating the events table", &events, "")
            .await?;
        let checkpoints = format!(
            "CREATE TABLE IF NOT EXISTS {} (\
             cluster_id UInt64, revision Int64, written_at_unix_ms Int64\
             ) ENGINE = MergeTree() ORDER BY (cluster_id, revision)",
            self.checkpoints()
        );
        self.request("creating the checkpoints table", &checkpoints, "")
            .await?;
        Ok(())
    }

    async fn checkpoint(&self, cluster_id: u64) -> Result<Option<i64>, StoreError> {
        let sql = format!(
            "SELECT count() AS n, max(revision) AS revision FROM {} WHERE cluster_id = {cluster_id} \
             FORMAT JSONEachRow",
            self.checkpoints()
        );
        let text = self.request("reading the checkpoint", &sql, "").await?;
        let value: serde_json::Value = serde_json::from_str(text.trim())
            .map_err(|e| StoreError::Malformed(format!("{e}: {text}")))?;
        let number = |v: &serde_json::Value| {
            v.as_i64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        };
        match number(&value["n"]) {
            Some(0) => Ok(None),
            Some(_) => number(&value["revision"])
                .map(Some)
                .ok_or_else(|| StoreError::Malformed(text.clone())),
            None => Err(StoreError::Malformed(text)),
        }
    }

    async fn put_checkpoint(&self, cluster_id: u64, revision: i64) -> Result<(), StoreError> {
        let row = serde_json::json!({
            "cluster_id": cluster_id,
            "revision": revision,
            "written_at_unix_ms": now_unix_ms(),
        });
        let query = format!("INSERT INTO {} FORMAT JSONEachRow", self.checkpoints());
        self.request("writing the checkpoint", &query, &format!("{row}\n"))
            .await?;
        Ok(())
    }

    async fn write(&self, cluster_id: u64, events: &[Event]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let observed = now_unix_ms();
        let mut body = String::new();
        for event in events {
            let row = serde_json::to_string(&Row::new(cluster_id, event, observed))
                .map_err(|e| StoreError::Malformed(e.to_string()))?;
            body.push_str(&row);
            body.push('\n');
        }
        let query = format!("INSERT INTO {} FORMAT JSONEachRow", self.events());
        self.request("writing events", &query, &body).await?;
        Ok(())
    }

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredEvent>, StoreError> {
        let mut filter = format!("`key` = {}", literal(&query.key));
        if let Some(since) = query.since_unix_ms {
            filter.push_str(&format!(" AND observed_at_unix_ms >= {since}"));
        }
        if let Some(cluster) = query.cluster_id {
            filter.push_str(&format!(" AND cluster_id = {cluster}"));
        }
        let sql = format!(
            "SELECT {COLUMNS} FROM {} FINAL WHERE {filter} \
             ORDER BY observed_at_unix_ms DESC, revision DESC LIMIT {}",
            self.events(),
            query.limit
        );
        let mut events = self.select("reading a key's history", sql).await?;
        events.reverse();
        Ok(events)
    }

    async fn all(&self, cluster_id: u64) -> Result<Vec<StoredEvent>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {} FINAL WHERE cluster_id = {cluster_id} ORDER BY revision, `key`",
            self.events()
        );
        self.select("reading events", sql).await
    }
}

/// A ClickHouse string literal.
fn literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('\'');
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
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

/// The status and body of an HTTP/1.x response read to its end (chunked or not).
fn parse_response(raw: &[u8]) -> Result<(u16, String), String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("a response without a header end")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let status = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or("a response without a status")?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut raw: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk without a size line")?;
        let size_text = String::from_utf8_lossy(&raw[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("a bad chunk size {size_text:?}"))?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = raw.get(..size).ok_or("a truncated chunk")?;
        out.extend_from_slice(chunk);
        raw = raw.get(size + 2..).ok_or("a truncated chunk")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let s = ClickHouseStore::new("127.0.0.1:8123/audit").unwrap();
        assert_eq!(
            (s.addr.as_str(), s.database.as_str()),
            ("127.0.0.1:8123", "audit")
        );
        assert!(s.authorization.is_none());
        let s = ClickHouseStore::new("u:p@h:1").unwrap();
        assert_eq!(s.database, "default");
        assert_eq!(s.authorization.as_deref(), Some("Basic dTpw"));
        assert!(ClickHouseStore::new("h:1/bad;name").is_err());
        assert!(ClickHouseStore::new("nohost").is_err());
    }

    #[test]
    fn encodes() {
        assert_eq!(literal(r"a'b\c"), r"'a\'b\\c'");
        assert_eq!(percent_encode("SELECT 1"), "SELECT%201");
        assert_eq!(base64(b"user:pass"), "dXNlcjpwYXNz");
        assert_eq!(base64(b"ab"), "YWI=");
    }

    #[test]
    fn reads_plain_and_chunked_responses() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
        assert_eq!(parse_response(plain), Ok((200, "ok".into())));
        let chunked =
            b"HTTP/1.1 500 Error\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked), Ok((500, "abcde".into())));
    }
}
