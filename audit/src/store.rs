//! Where events go: ClickHouse (ADR-21's choice) or PostgreSQL (small
//! estates). Both are idempotent on the event key (cluster id, revision,
//! key), so a replay after a crash writes nothing twice:
//!
//! - PostgreSQL: a primary key and `INSERT … ON CONFLICT DO NOTHING`;
//! - ClickHouse: `ReplacingMergeTree` ordered by the key; reads use `FINAL`,
//!   so copies not yet merged are never shown twice.
//!
//! The checkpoint (the last revision whose events are all written) lives in
//! the same store, and is only ever written after the events it covers.

mod clickhouse;
mod postgres;

use async_trait::async_trait;

pub use self::clickhouse::ClickHouseStore;
pub use self::postgres::PostgresStore;
use crate::event::{Event, StoredEvent};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "unsupported store URL {0:?} (postgres://…, postgresql://… or clickhouse://host:port/database)"
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
    },
    #[error("the store returned a row this version cannot read: {0}")]
    Malformed(String),
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
    /// Creates the tables if they are missing.
    async fn migrate(&self) -> Result<(), StoreError>;
    /// The last revision of `cluster_id` whose events are all written.
    async fn checkpoint(&self, cluster_id: u64) -> Result<Option<i64>, StoreError>;
    /// Records that every event of `cluster_id` up to `revision` is written.
    async fn put_checkpoint(&self, cluster_id: u64, revision: i64) -> Result<(), StoreError>;
    /// Writes events; any already there are left as they are.
    async fn write(&self, cluster_id: u64, events: &[Event]) -> Result<(), StoreError>;
    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredEvent>, StoreError>;
    /// Every event of a cluster, oldest first (tests and exports).
    async fn all(&self, cluster_id: u64) -> Result<Vec<StoredEvent>, StoreError>;
}

/// The store a URL names: `postgres://` / `postgresql://` (a libpq-style
/// connection string), or `clickhouse://host:port/database` (ClickHouse's
/// HTTP interface, plain HTTP).
pub async fn open(url: &str) -> Result<Box<dyn AuditStore>, StoreError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(Box::new(PostgresStore::connect(url).await?));
    }
    if let Some(rest) = url.strip_prefix("clickhouse://") {
        return Ok(Box::new(ClickHouseStore::new(rest)?));
    }
    Err(StoreError::Url(redact(url)))
}

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
}
