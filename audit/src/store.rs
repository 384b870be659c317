//! Where events go: ClickHouse (ADR-21's choice) or PostgreSQL (small
//! estates). Both are idempotent on the event's id (keyed by the cluster,
//! the revision and the key, [`crate::pseudonym`]), so a replay after a
//! crash writes nothing twice, and both keep the first copy:
//!
//! - PostgreSQL: a primary key and `INSERT … ON CONFLICT DO NOTHING`;
//! - ClickHouse: `ReplacingMergeTree` on the id, versioned so the first
//!   copy wins; reads use `FINAL`, so copies not yet merged never show twice.
//!
//! The checkpoint (the last revision whose events are all written) lives in
//! the same store, sealed under the audit key, and is only ever written
//! after the events it covers.
//!
//! Schema 2 (`latchkey_audit_events_v2`, `latchkey_audit_checkpoints_v2`,
//! `latchkey_audit_meta`) keeps no revision. A store with the first
//! schema's tables (raw revisions: tokens) is moved over by the first
//! `migrate` with the key, which then drops them (`migrate_v1`).

mod clickhouse;
mod migrate_v1;
mod postgres;

use std::sync::atomic::{AtomicI64, Ordering};

use async_trait::async_trait;

pub use self::clickhouse::ClickHouseStore;
pub use self::postgres::PostgresStore;
use crate::event::{Event, Row, StoredEvent};
use crate::pseudonym::{AuditKey, NeedsKey};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "unsupported store URL {0:?} (postgres://…, postgresql://… or clickhouse://[user@]host:port/database)"
    )]
    Url(String),
    #[error("PostgreSQL: {context}: {source}")]
    Postgres {
        context: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("ClickHouse: {context}: {detail}")]
    ClickHouse {
        context: &'static str,
        detail: String,
        /// The connection's own error, when one failed (`detail` says it
        /// in words; this keeps its chain for the logs).
        #[source]
        source: Option<std::io::Error>,
    },
    #[error("the store returned a row this version cannot read: {detail}")]
    Malformed {
        detail: String,
        /// The decoder's error, when one refused the row.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    #[error(transparent)]
    NeedsKey(#[from] NeedsKey),
    #[error(
        "the audit store was written with another audit key: its event ids and checkpoint \
         would not match this one's (give the tailer the key it was written with, or a new database)"
    )]
    WrongKey,
    #[error(
        "the audit store holds events of schema 1, whose revisions rebuild fencing tokens; \
         start latchkey-audit with --audit-key-file once to move them to schema 2 and drop them"
    )]
    MigrationNeedsKey,
    #[error("a password is given both in the store URL and in a password file")]
    PasswordTwice,
}

impl StoreError {
    /// [`StoreError::Malformed`] with nothing underneath.
    pub(crate) fn malformed(detail: impl Into<String>) -> Self {
        Self::Malformed {
            detail: detail.into(),
            source: None,
        }
    }

    /// [`StoreError::Malformed`] because a decoder refused: its message is
    /// the detail, and it stays the source.
    pub(crate) fn malformed_by(source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Malformed {
            detail: source.to_string(),
            source: Some(Box::new(source)),
        }
    }
}

/// How a store is opened: a reader needs only its credentials; the tailer
/// also needs the audit key.
#[derive(Clone, Default)]
pub struct StoreOptions {
    /// The user's password, from a file (`--store-password-file`): not in
    /// the URL, so not in `ps` when the URL is on a command line.
    pub password: Option<String>,
    /// The audit key; without it nothing with a revision can be written.
    pub audit_key: Option<AuditKey>,
}

impl std::fmt::Debug for StoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOptions")
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("audit_key", &self.audit_key)
            .finish()
    }
}

/// A key's history, newest last.
#[derive(Debug, Clone)]
pub struct HistoryQuery {
    pub key: String,
    /// Only events the tailer wrote at or after this time.
    pub since_unix_ms: Option<i64>,
    /// At most this many (the newest).
    pub limit: u32,
    /// One cluster's events only.
    pub cluster_id: Option<u64>,
}

#[async_trait]
pub trait AuditStore: Send + Sync {
    /// Creates the tables if they are missing; with the audit key, refuses
    /// a store written under another key and moves schema 1 over.
    async fn migrate(&self) -> Result<(), StoreError>;
    /// The last revision of `cluster_id` whose events are all written
    /// (needs the audit key: it is stored sealed).
    async fn checkpoint(&self, cluster_id: u64) -> Result<Option<i64>, StoreError>;
    /// Records that every event of `cluster_id` up to `revision` is written.
    async fn put_checkpoint(&self, cluster_id: u64, revision: i64) -> Result<(), StoreError>;
    /// Writes events; any already there are left as they are.
    async fn write(&self, cluster_id: u64, events: &[Event]) -> Result<(), StoreError>;
    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredEvent>, StoreError>;
    /// Every event of a cluster, in the order written (tests and exports).
    async fn all(&self, cluster_id: u64) -> Result<Vec<StoredEvent>, StoreError>;
}

/// The store a URL names, with the URL's own credentials and no audit key
/// (enough to read, and to write unprotected grants, which have no revision).
pub async fn open(url: &str) -> Result<Box<dyn AuditStore>, StoreError> {
    open_with(url, StoreOptions::default()).await
}

/// The store a URL names: `postgres://` / `postgresql://` (a libpq-style
/// connection string), or `clickhouse://[user[:password]@]host:port/database`
/// (ClickHouse's HTTP interface, plain HTTP).
pub async fn open_with(
    url: &str,
    options: StoreOptions,
) -> Result<Box<dyn AuditStore>, StoreError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(Box::new(PostgresStore::connect(url, options).await?));
    }
    if let Some(rest) = url.strip_prefix("clickhouse://") {
        return Ok(Box::new(ClickHouseStore::new(rest, options)?));
    }
    Err(StoreError::Url(redact(url)))
}

/// The password in a store URL, if it has one (to refuse it on a command line).
pub fn url_password(url: &str) -> Option<&str> {
    let scheme = url.find("://")?;
    let at = url.rfind('@')?;
    let userinfo = url.get(scheme + 3..at)?;
    userinfo
        .split_once(':')
        .map(|(_, p)| p)
        .filter(|p| !p.is_empty())
}

/// Where each written event goes in the order: microseconds since the
/// epoch, strictly rising within a writer and never below a position the
/// store already has (a clock that stepped back does not reorder).
#[derive(Debug, Default)]
pub(crate) struct Positions {
    last: AtomicI64,
}

impl Positions {
    pub fn next(&self) -> i64 {
        let now = crate::event::now_unix_ms().saturating_mul(1000);
        let bump = |last: i64| now.max(last.saturating_add(1));
        let before = self
            .last
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| Some(bump(last)))
            .unwrap_or_else(|last| last);
        bump(before)
    }

    pub fn at_least(&self, position: i64) {
        self.last.fetch_max(position, Ordering::SeqCst);
    }
}

/// The rows of `events`, at fresh positions, observed now.
pub(crate) fn rows(
    cluster_id: u64,
    events: &[Event],
    audit_key: Option<&AuditKey>,
    positions: &Positions,
) -> Result<Vec<Row>, StoreError> {
    let observed = crate::event::now_unix_ms();
    events
        .iter()
        .map(|e| {
            Ok(Row::new(
                cluster_id,
                e,
                audit_key,
                positions.next(),
                observed,
            )?)
        })
        .collect()
}

pub(crate) use migrate_v1::migrate_v1;

/// A URL without its password, for errors and logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_passwords() {
        assert_eq!(
            redact("postgresql://audit:s3cret@db:5432/x"),
            "postgresql://audit:***@db:5432/x"
        );
        assert_eq!(
            redact("clickhouse://127.0.0.1:8123/x"),
            "clickhouse://127.0.0.1:8123/x"
        );
    }

    #[tokio::test]
    async fn unknown_schemes_are_refused() {
        let err = open("mysql://u:pw@h/db").await.err().map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(err.contains("unsupported store URL"), "{err}");
        assert!(!err.contains("pw"), "{err}");
    }

    #[test]
    fn finds_a_password_in_a_url() {
        assert_eq!(url_password("clickhouse://w:s3cret@h:1/db"), Some("s3cret"));
        assert_eq!(url_password("clickhouse://w@h:1/db"), None);
        assert_eq!(url_password("clickhouse://h:1/db"), None);
    }

    #[test]
    fn positions_rise_strictly() {
        let p = Positions::default();
        p.at_least(i64::MAX / 2);
        let a = p.next();
        let b = p.next();
        assert!(a > i64::MAX / 2 && b == a + 1);
    }
}
