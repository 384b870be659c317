//! What the pause test writes to: a fence adapter picked by URL
//! (`--resource-url`, or `--postgres` with the reference table), or the
//! owner's own PostgreSQL statements (`--write-sql`, `--read-sql`).
//!
//! [`open`] is the one place a URL becomes an adapter. A new store is one
//! more arm there. An S3-compatible store is certified only after its
//! conditional writes are probed: one that accepts a stale `If-Match` or an
//! `If-None-Match: *` over an existing object is refused before the kit
//! runs, never declared fenced.

use latchkey_fence::{FenceError, FencedStore, Guarded, guarded_write_retrying};
pub use latchkey_fence_open::{check_resource_kind, locator, open};
use latchkey_fence_postgres as pg_fence;

/// How often the kit repeats a guarded write the store answered `Retry`
/// (it changed nothing) before calling it an error.
const RETRY_ATTEMPTS: usize = 5;

/// A write's or read's failure, in words (never with a token or a password).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteError {
    pub message: String,
    /// The same write may succeed on a fresh connection.
    pub transient: bool,
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<FenceError> for WriteError {
    fn from(e: FenceError) -> Self {
        WriteError {
            transient: e.is_transient(),
            message: e.to_string(),
        }
    }
}

impl From<pg_fence::FenceError> for WriteError {
    fn from(e: pg_fence::FenceError) -> Self {
        WriteError {
            transient: e.is_transient(),
            message: e.to_string(),
        }
    }
}

/// Where the record lives and how it is written.
pub enum Target {
    /// An adapter's guarded write, or with `naive` its plain write (a
    /// naive writer, which the kit must FAIL).
    Store {
        store: Box<dyn FencedStore>,
        naive: bool,
    },
    /// The owner's statements on PostgreSQL: `write` with `$1` id, `$2`
    /// token (bigint), `$3` payload, accepted when it affects a row; `read`
    /// with `$1` id, one text column.
    Owner {
        pg: tokio_postgres::Client,
        write: String,
        read: String,
    },
}

impl Target {
    /// The adapter's kind and caveats, when the target is one.
    pub fn store_info(&self) -> Option<(&'static str, Vec<String>)> {
        match self {
            Target::Store { store, .. } => Some((store.kind(), store.caveats())),
            Target::Owner { .. } => None,
        }
    }

    /// Accepted (`true`) or refused by the fence (`false`).
    pub async fn write(&self, row: &str, token: u64, payload: &str) -> Result<bool, WriteError> {
        match self {
            Target::Store { store, naive: true } => {
                store.plain_write(row, payload.as_bytes()).await?;
                Ok(true)
            }
            Target::Store {
                store,
                naive: false,
            } => {
                match guarded_write_retrying(
                    store.as_ref(),
                    row,
                    token,
                    payload.as_bytes(),
                    RETRY_ATTEMPTS,
                )
                .await?
                {
                    Guarded::Applied { .. } => Ok(true),
                    Guarded::FencedOut { .. } => Ok(false),
                    Guarded::Retry => Err(WriteError {
                        message: format!(
                            "{}: the store could not decide the write in {RETRY_ATTEMPTS} attempts",
                            store.kind()
                        ),
                        transient: true,
                    }),
                }
            }
            Target::Owner { pg, write, .. } => {
                let param = pg_fence::token_param(token)?;
                let affected = pg
                    .execute(write.as_str(), &[&row, &param, &payload])
                    .await
                    .map_err(|e| {
                        pg_fence::FenceError::from_postgres("--write-sql", &e, Some(token))
                    })?;
                Ok(affected > 0)
            }
        }
    }

    /// The record's payload now, `None` when there is no record.
    pub async fn read(&self, row: &str) -> Result<Option<String>, WriteError> {
        match self {
            Target::Store { store, .. } => Ok(store
                .read(row)
                .await?
                .map(|r| String::from_utf8_lossy(&r.payload).into_owned())),
            Target::Owner { pg, read, .. } => {
                let op = "reading the record back";
                let rows = pg
                    .query(read.as_str(), &[&row])
                    .await
                    .map_err(|e| pg_fence::FenceError::from_postgres(op, &e, None))?;
                match rows.first() {
                    None => Ok(None),
                    Some(r) => Ok(r
                        .try_get::<_, Option<String>>(0)
                        .map_err(|e| pg_fence::FenceError::from_postgres(op, &e, None))?),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn open_err(url: &str) -> String {
        match open(url).await {
            Ok(_) => panic!("opened a store"),
            Err(e) => e.to_string(),
        }
    }

    #[tokio::test]
    async fn unknown_or_missing_schemes_say_what_is_known_without_the_url() {
        let why = open_err("ftp://u:hunter2@host/x").await;
        assert!(why.contains("\"ftp\"") && why.contains("redis://"), "{why}");
        assert!(!why.contains("hunter2"), "{why}");
        let why = open_err(":hunter2@127.0.0.1:6379/0?next=redis://x").await;
        assert!(
            why.contains("no scheme") && !why.contains("hunter2"),
            "{why}"
        );
        let why = open_err("u:hunter2@host").await;
        assert!(
            why.contains("no scheme") && !why.contains("hunter2"),
            "{why}"
        );
        let why = open_err("s3://AKIA:hunter2@bucket/prefix").await;
        assert!(why.contains("cannot open the s3 resource"), "{why}");
        assert!(!why.contains("hunter2"), "{why}");
    }

    #[tokio::test]
    async fn a_store_that_cannot_be_reached_says_which_without_the_password() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        for (url, kind) in [
            (format!("mysql://u:hunter2@127.0.0.1:{port}/db"), "mysql"),
            (format!("redis://:hunter2@127.0.0.1:{port}/0"), "redis"),
            (
                format!("postgresql://u:hunter2@127.0.0.1:{port}/db"),
                "postgresql",
            ),
        ] {
            let why = open_err(&url).await;
            assert!(
                why.starts_with(&format!("cannot open the {kind} resource")),
                "{why}"
            );
            assert!(!why.contains("hunter2"), "{why}");
        }
    }
}
