//! ClickHouse over its HTTP interface (plain HTTP, JSONEachRow), written
//! for the oldest server we run against, Debian's 18.16: no query
//! parameters (string literals are escaped here), no `TTL`, no SQL users or
//! GRANTs (users, `readonly` profiles and `allow_databases` live in the
//! server's users.xml), and version columns of `ReplacingMergeTree` only
//! unsigned.
//!
//! Events: `ReplacingMergeTree(first_copy)` ordered by (cluster_id,
//! event_id), not partitioned by time (copies are only merged within a
//! partition); `first_copy` falls as the position rises, so the copy a
//! merge keeps is the first one written, as PostgreSQL's `ON CONFLICT DO
//! NOTHING` does. Every read says `FINAL`. Checkpoints: one sealed row per
//! checkpoint, the newest that opens wins.
//!
//! Credentials: `clickhouse://user@host:port/db` with the password from a
//! file ([`StoreOptions::password`]) or in the URL, sent as HTTP Basic auth.

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::migrate_v1::{PAGE, V1Row, V1Tables};
use super::{AuditStore, HistoryQuery, Positions, StoreError, StoreOptions};
use crate::event::{Event, Row, StoredEvent, now_unix_ms};
use crate::pseudonym::AuditKey;

const EVENTS: &str = "latchkey_audit_events_v2";
const CHECKPOINTS: &str = "latchkey_audit_checkpoints_v2";
const META: &str = "latchkey_audit_meta";
/// Schema 1 (raw revisions), moved over and dropped by `migrate`.
const V1_EVENTS: &str = "latchkey_audit_events";
const V1_CHECKPOINTS: &str = "latchkey_audit_checkpoints";
const COLUMNS: &str = "cluster_id, event_id, position, `key`, kind, ended, epoch, identity, \
     `session`, class, hold_id, prev_hold_id, prev_identity, prev_session, detail, \
     observed_at_unix_ms";
const V1_COLUMNS: &str = "cluster_id, revision, `key`, kind, ended, epoch, identity, `session`, \
     class, hold_revision, prev_identity, prev_session, detail, observed_at_unix_ms";
/// Checkpoint rows read back: the newest that opens counts.
const CHECKPOINTS_READ: u32 = 8;
/// One request's limit: a slow server is an outage to retry, not a hang.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub struct ClickHouseStore {
    /// `host:port`.
    addr: String,
    database: String,
    /// `Authorization: Basic …`, if there is a user.
    authorization: Option<String>,
    audit_key: Option<AuditKey>,
    positions: Positions,
}

impl ClickHouseStore {
    /// From `[user[:password]@]host:port[/database]` (the URL after
    /// `clickhouse://`); a password in `options` goes with the URL's user.
    pub fn new(rest: &str, options: StoreOptions) -> Result<Self, StoreError> {
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
        let credentials = match (userinfo, options.password) {
            (Some(u), Some(_)) if u.contains(':') => return Err(StoreError::PasswordTwice),
            (Some(u), Some(password)) => Some(format!("{u}:{password}")),
            (None, Some(_)) => return Err(bad()),
            (userinfo, None) => userinfo.map(str::to_string),
        };
        Ok(Self {
            addr: addr.to_string(),
            database: database.to_string(),
            authorization: credentials.map(|c| format!("Basic {}", base64(c.as_bytes()))),
            audit_key: options.audit_key,
            positions: Positions::default(),
        })
    }

    /// Runs `query` (in the URL) with `body`; the response body on 200.
    async fn request(
        &self,
        context: &'static str,
        query: &str,
        body: &str,
    ) -> Result<String, StoreError> {
        let fail = |detail: String| StoreError::ClickHouse {
            context,
            detail,
            source: None,
        };
        let failed_io = |detail: String, source: std::io::Error| StoreError::ClickHouse {
            context,
            detail,
            source: Some(source),
        };
        let exchange = async {
            let mut stream = TcpStream::connect(&self.addr)
                .await
                .map_err(|e| failed_io(format!("connecting to {}: {e}", self.addr), e))?;
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
                .map_err(|e| failed_io(e.to_string(), e))?;
            stream
                .write_all(body.as_bytes())
                .await
                .map_err(|e| failed_io(e.to_string(), e))?;
            let mut response = Vec::new();
            stream
                .read_to_end(&mut response)
                .await
                .map_err(|e| failed_io(e.to_string(), e))?;
            Ok::<_, StoreError>(response)
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

    fn table(&self, name: &str) -> String {
        format!("{}.{name}", self.database)
    }

    /// Each line of a JSONEachRow answer as `T`.
    async fn rows<T: serde::de::DeserializeOwned>(
        &self,
        context: &'static str,
        sql: &str,
    ) -> Result<Vec<T>, StoreError> {
        let text = self
            .request(context, &format!("{sql} FORMAT JSONEachRow"), "")
            .await?;
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|line| {
                serde_json::from_str(line).map_err(|e| StoreError::Malformed {
                    detail: format!("{e}: {line}"),
                    source: Some(Box::new(e)),
                })
            })
            .collect()
    }

    async fn select(
        &self,
        context: &'static str,
        sql: &str,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        self.rows::<Row>(context, sql)
            .await?
            .into_iter()
            .map(|r| r.into_stored().map_err(StoreError::malformed_by))
            .collect()
    }

    async fn exists(&self, table: &str) -> Result<bool, StoreError> {
        let sql = format!("EXISTS TABLE {}", self.table(table));
        let text = self.request("looking for a table", &sql, "").await?;
        Ok(text.trim() == "1")
    }

    /// One number a query answers as `{"n": …}` (0 for none).
    async fn number(&self, context: &'static str, sql: &str) -> Result<i64, StoreError> {
        #[derive(serde::Deserialize)]
        struct N {
            #[serde(deserialize_with = "crate::event::number_or_string")]
            n: i64,
        }
        Ok(self
            .rows::<N>(context, sql)
            .await?
            .first()
            .map_or(0, |r| r.n))
    }

    /// Refuses a key other than the one the store was written with; the
    /// first tailer's key is recorded.
    async fn check_key(&self, audit_key: &AuditKey) -> Result<(), StoreError> {
        #[derive(serde::Deserialize)]
        struct Value {
            value: String,
        }
        let sql = format!(
            "SELECT value FROM {} FINAL WHERE name = 'key_check'",
            self.table(META)
        );
        let recorded = self.rows::<Value>("reading the key check", &sql).await?;
        match recorded.first() {
            Some(v) if v.value == audit_key.check_value() => Ok(()),
            Some(_) => Err(StoreError::WrongKey),
            None => self.put_meta("key_check", &audit_key.check_value()).await,
        }
    }

    async fn put_meta(&self, name: &str, value: &str) -> Result<(), StoreError> {
        let row = serde_json::json!({
            "name": name, "value": value, "written_at_unix_ms": now_unix_ms(),
        });
        let query = format!("INSERT INTO {} FORMAT JSONEachRow", self.table(META));
        self.request(
            "writing the store's schema record",
            &query,
            &format!("{row}\n"),
        )
        .await?;
        Ok(())
    }
}

#[async_trait]
impl AuditStore for ClickHouseStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        let database = format!("CREATE DATABASE IF NOT EXISTS {}", self.database);
        self.request("creating the database", &database, "").await?;
        let events = format!(
            "CREATE TABLE IF NOT EXISTS {} (\
             cluster_id UInt64, event_id String, position Int64, `key` String, kind String, \
             ended String, epoch UInt32, identity String, `session` Int64, class String, \
             hold_id String, prev_hold_id String, prev_identity String, prev_session Int64, \
             detail String, observed_at_unix_ms Int64, first_copy UInt64\
             ) ENGINE = ReplacingMergeTree(first_copy) ORDER BY (cluster_id, event_id)",
            self.table(EVENTS)
        );
        self.request("creating the events table", &events, "")
            .await?;
        let checkpoints = format!(
            "CREATE TABLE IF NOT EXISTS {} (\
             cluster_id UInt64, position Int64, sealed String, written_at_unix_ms Int64\
             ) ENGINE = MergeTree() ORDER BY (cluster_id, position)",
            self.table(CHECKPOINTS)
        );
        self.request("creating the checkpoints table", &checkpoints, "")
            .await?;
        let meta = format!(
            "CREATE TABLE IF NOT EXISTS {} (\
             name String, value String, written_at_unix_ms Int64\
             ) ENGINE = ReplacingMergeTree() ORDER BY name",
            self.table(META)
        );
        self.request("creating the schema record", &meta, "")
            .await?;
        if let Some(audit_key) = &self.audit_key {
            self.check_key(audit_key).await?;
        }
        for table in [EVENTS, CHECKPOINTS] {
            let sql = format!("SELECT max(position) AS n FROM {}", self.table(table));
            let highest = self.number("reading the last position", &sql).await?;
            self.positions.at_least(highest);
        }
        super::migrate_v1(self, self.audit_key.as_ref()).await?;
        self.put_meta("schema_version", "2").await
    }

    async fn checkpoint(&self, cluster_id: u64) -> Result<Option<i64>, StoreError> {
        let audit_key = self.audit_key.as_ref().ok_or(crate::pseudonym::NeedsKey)?;
        #[derive(serde::Deserialize)]
        struct Sealed {
            #[serde(deserialize_with = "crate::event::number_or_string")]
            position: i64,
            sealed: String,
        }
        let sql = format!(
            "SELECT position, sealed FROM {} WHERE cluster_id = {cluster_id} \
             ORDER BY position DESC LIMIT {CHECKPOINTS_READ}",
            self.table(CHECKPOINTS)
        );
        let rows = self.rows::<Sealed>("reading the checkpoint", &sql).await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let opened: Vec<i64> = rows
            .iter()
            .filter_map(|r| audit_key.open_checkpoint(cluster_id, r.position, &r.sealed))
            .collect();
        // Two tailers may interleave: the highest of the newest rows.
        opened
            .into_iter()
            .max()
            .map(Some)
            .ok_or(StoreError::WrongKey)
    }

    async fn put_checkpoint(&self, cluster_id: u64, revision: i64) -> Result<(), StoreError> {
        let audit_key = self.audit_key.as_ref().ok_or(crate::pseudonym::NeedsKey)?;
        let position = self.positions.next();
        let row = serde_json::json!({
            "cluster_id": cluster_id,
            "position": position,
            "sealed": audit_key.seal_checkpoint(cluster_id, position, revision),
            "written_at_unix_ms": now_unix_ms(),
        });
        let query = format!("INSERT INTO {} FORMAT JSONEachRow", self.table(CHECKPOINTS));
        self.request("writing the checkpoint", &query, &format!("{row}\n"))
            .await?;
        Ok(())
    }

    async fn write(&self, cluster_id: u64, events: &[Event]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let rows = super::rows(cluster_id, events, self.audit_key.as_ref(), &self.positions)?;
        self.insert_rows(&rows).await
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
            "SELECT {COLUMNS} FROM {} FINAL WHERE {filter} ORDER BY position DESC LIMIT {}",
            self.table(EVENTS),
            query.limit
        );
        let mut events = self.select("reading a key's history", &sql).await?;
        events.reverse();
        Ok(events)
    }

    async fn all(&self, cluster_id: u64) -> Result<Vec<StoredEvent>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {} FINAL WHERE cluster_id = {cluster_id} ORDER BY position, `key`",
            self.table(EVENTS)
        );
        self.select("reading events", &sql).await
    }
}

#[async_trait]
impl V1Tables for ClickHouseStore {
    async fn v1_events_exist(&self) -> Result<bool, StoreError> {
        self.exists(V1_EVENTS).await
    }

    async fn v1_clusters(&self) -> Result<Vec<u64>, StoreError> {
        #[derive(serde::Deserialize)]
        struct Cluster {
            #[serde(deserialize_with = "crate::event::number_or_string")]
            cluster_id: u64,
        }
        let sql = format!(
            "SELECT DISTINCT cluster_id FROM {} ORDER BY cluster_id",
            self.table(V1_EVENTS)
        );
        let rows = self
            .rows::<Cluster>("listing schema 1's clusters", &sql)
            .await?;
        Ok(rows.into_iter().map(|c| c.cluster_id).collect())
    }

    async fn v1_page(
        &self,
        cluster_id: u64,
        after: Option<&(i64, String)>,
    ) -> Result<Vec<V1Row>, StoreError> {
        let after = match after {
            Some((revision, key)) => format!(
                " AND (revision > {revision} OR (revision = {revision} AND `key` > {}))",
                literal(key)
            ),
            None => String::new(),
        };
        let sql = format!(
            "SELECT {V1_COLUMNS} FROM {} FINAL WHERE cluster_id = {cluster_id}{after} \
             ORDER BY revision, `key` LIMIT {PAGE}",
            self.table(V1_EVENTS)
        );
        self.rows("reading schema 1's events", &sql).await
    }

    async fn v1_checkpoints(&self) -> Result<Option<Vec<(u64, i64)>>, StoreError> {
        if !self.exists(V1_CHECKPOINTS).await? {
            return Ok(None);
        }
        #[derive(serde::Deserialize)]
        struct Checkpoint {
            #[serde(deserialize_with = "crate::event::number_or_string")]
            cluster_id: u64,
            #[serde(deserialize_with = "crate::event::number_or_string")]
            revision: i64,
        }
        let sql = format!(
            "SELECT cluster_id, max(revision) AS revision FROM {} GROUP BY cluster_id",
            self.table(V1_CHECKPOINTS)
        );
        let rows = self
            .rows::<Checkpoint>("reading schema 1's checkpoints", &sql)
            .await?;
        Ok(Some(
            rows.into_iter()
                .map(|c| (c.cluster_id, c.revision))
                .collect(),
        ))
    }

    async fn insert_rows(&self, rows: &[Row]) -> Result<(), StoreError> {
        let mut body = String::new();
        for row in rows {
            let mut value = serde_json::to_value(row).map_err(StoreError::malformed_by)?;
            if let Some(map) = value.as_object_mut() {
                // The first copy has the highest: ReplacingMergeTree keeps it.
                let first_copy = u64::try_from(i64::MAX - row.position.max(0)).unwrap_or(0);
                map.insert("first_copy".into(), first_copy.into());
            }
            body.push_str(&value.to_string());
            body.push('\n');
        }
        let query = format!("INSERT INTO {} FORMAT JSONEachRow", self.table(EVENTS));
        self.request("writing events", &query, &body).await?;
        Ok(())
    }

    async fn drop_v1_events(&self) -> Result<(), StoreError> {
        let sql = format!("DROP TABLE IF EXISTS {}", self.table(V1_EVENTS));
        self.request("dropping schema 1's events", &sql, "").await?;
        Ok(())
    }

    async fn drop_v1_checkpoints(&self) -> Result<(), StoreError> {
        let sql = format!("DROP TABLE IF EXISTS {}", self.table(V1_CHECKPOINTS));
        self.request("dropping schema 1's checkpoints", &sql, "")
            .await?;
        Ok(())
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

    fn new(rest: &str) -> Result<ClickHouseStore, StoreError> {
        ClickHouseStore::new(rest, StoreOptions::default())
    }

    #[test]
    fn parses_urls() {
        let s = new("127.0.0.1:8123/audit").unwrap();
        assert_eq!(
            (s.addr.as_str(), s.database.as_str()),
            ("127.0.0.1:8123", "audit")
        );
        assert!(s.authorization.is_none());
        let s = new("u:p@h:1").unwrap();
        assert_eq!(s.database, "default");
        assert_eq!(s.authorization.as_deref(), Some("Basic dTpw"));
        assert!(new("h:1/bad;name").is_err());
        assert!(new("nohost").is_err());
    }

    #[test]
    fn a_password_file_goes_with_the_urls_user() {
        let with = |rest: &str| {
            ClickHouseStore::new(
                rest,
                StoreOptions {
                    password: Some("p".into()),
                    audit_key: None,
                },
            )
        };
        assert_eq!(
            with("u@h:1/db").unwrap().authorization.as_deref(),
            Some("Basic dTpw")
        );
        assert!(matches!(with("u:q@h:1/db"), Err(StoreError::PasswordTwice)));
        assert!(with("h:1/db").is_err(), "a password needs a user");
    }

    #[test]
    fn encodes() {
        assert_eq!(literal(r"a'b\c"), r"'a\'b\\c'");
        assert_eq!(percent_encode("SELECT 1"), "SELECT%201");
        assert_eq!(base64(b"user:pass"), "dXNlcjpwYXNz");
        assert_eq!(base64(b"ab"), "YWI=");
    }

    /// Issue 32: a connection that fails keeps the socket's error as the
    /// source; the message is what it was.
    #[tokio::test]
    async fn a_failed_connection_keeps_its_io_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let store = new(&format!("{addr}/audit")).unwrap();
        let err = store.request("a test", "SELECT 1", "").await.unwrap_err();
        let source = std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .unwrap_or_else(|| panic!("no io source: {err:?}"));
        assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            err.to_string(),
            format!("ClickHouse: a test: connecting to {addr}: {source}")
        );
    }

    #[test]
    fn a_row_that_does_not_decode_keeps_the_decoders_error() {
        let e = serde_json::from_str::<Row>("{").unwrap_err();
        let err = StoreError::malformed_by(e);
        let source = std::error::Error::source(&err).map(ToString::to_string);
        assert_eq!(
            err.to_string(),
            format!(
                "the store returned a row this version cannot read: {}",
                source.unwrap_or_default()
            )
        );
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
