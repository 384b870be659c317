//! The reference fence behind the adapter contract ([`FencedStore`]), for
//! callers that pick a store at run time (`latchctl pause-test
//! --resource-url postgresql://…`, the fence benchmark).
//!
//! It writes the reference table ([`crate::TABLE`]) with the reference
//! statement ([`crate::GUARDED_WRITE_SQL`]): the decision is that one
//! statement's. A fenced-out write reads the record's mark afterwards, only
//! to report it ([`Guarded::FencedOut`]); nothing is decided by that read.
//! [`PostgresStore::guarded_read`] is the readers' half
//! ([`crate::GUARDED_READ_SQL`]), outside the contract: the other adapters
//! have no fenced read yet.

use latchkey_fence::{self as contract, BoxFuture, FencedStore, Guarded, Mark, Record};
use tokio_postgres::Client;

use crate::{FenceError, ReadOutcome, WriteOutcome};

/// The store kind, as in `postgresql://…`.
pub const KIND: &str = "postgresql";

/// Reads a record's mark and payload. A row only a guarded read made (no
/// write yet: `writes = 0`) is no record.
pub const READ_SQL: &str =
    "SELECT fence, payload FROM latchkey_fenced_rows WHERE id = $1 AND writes <> 0";

/// What refused a write, to report it: the record's write mark and read
/// mark (a write is fenced out by the greater of the two).
pub const MARKS_SQL: &str = "SELECT fence, read_fence FROM latchkey_fenced_rows WHERE id = $1";

/// The naive writer: overwrites the payload, never compares or raises the
/// mark (a record it creates gets mark 0). For the pause test's "a naive
/// writer FAILs" run and the benchmark's baseline only.
pub const PLAIN_WRITE_SQL: &str =
    "INSERT INTO latchkey_fenced_rows AS t (id, fence, payload, writes)
VALUES ($1, 0, $2, 1)
ON CONFLICT (id) DO UPDATE
   SET payload = EXCLUDED.payload, writes = t.writes + 1";

/// The reference table as a [`FencedStore`]. Payloads are the table's
/// `text` column, so they must be UTF-8.
pub struct PostgresStore {
    client: Client,
}

impl PostgresStore {
    /// Wraps a connected client; the reference table must exist
    /// ([`crate::ensure_schema`]).
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// Connects (no TLS), spawns the connection task and creates the
    /// reference table if it is missing. The error names neither the
    /// connection string nor its password.
    pub async fn connect(conninfo: &str) -> Result<Self, contract::FenceError> {
        let (client, connection) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
            .await
            .map_err(|e| {
                contract::FenceError::store(KIND, "connecting", with_causes(&e), true, &[])
            })?;
        tokio::spawn(async move {
            // The client sees the connection end as a closed-connection error.
            let _ = connection.await;
        });
        crate::ensure_schema(&client)
            .await
            .map_err(|e| to_contract("creating the reference table", e, &[]))?;
        Ok(Self { client })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The guarded read of a shared holder ([`crate::guarded_read`]): the
    /// record as it is if no write with a larger token than `token` has
    /// landed, raising its read mark to `token`; or the refusal. Errors are
    /// the contract's, scrubbed of the token.
    pub async fn guarded_read(
        &self,
        record: &str,
        token: u64,
    ) -> Result<ReadOutcome, contract::FenceError> {
        match crate::guarded_read(&self.client, record, token).await {
            Ok(ReadOutcome::WrittenSince) => {
                // The statement refuses a negative mark too: that record
                // was never the fence's, and saying "written since" would
                // hide it.
                match self.marks(record, token).await? {
                    Some((write_mark, _)) if write_mark < 0 => {
                        Err(contract::FenceError::Unfenced {
                            store: KIND,
                            record: record.to_owned(),
                            why: "its fence column is negative, which no token is".to_owned(),
                        })
                    }
                    _ => Ok(ReadOutcome::WrittenSince),
                }
            }
            Ok(current) => Ok(current),
            Err(e) => Err(to_contract("guarded read", e, &[token])),
        }
    }

    /// The record's write mark and read mark, as stored.
    async fn marks(
        &self,
        record: &str,
        token: u64,
    ) -> Result<Option<(i64, i64)>, contract::FenceError> {
        let failed = |e: &tokio_postgres::Error| {
            to_contract(
                "reading a record's marks",
                FenceError::from_postgres("reading a record's marks", e, Some(token)),
                &[token],
            )
        };
        let row = self
            .client
            .query_opt(MARKS_SQL, &[&record])
            .await
            .map_err(|e| failed(&e))?;
        let Some(row) = row else { return Ok(None) };
        // The reference table's columns are NOT NULL; a copy's may not be.
        let write_mark: Option<i64> = row.try_get(0).map_err(|e| failed(&e))?;
        let read_mark: Option<i64> = row.try_get(1).map_err(|e| failed(&e))?;
        let Some(write_mark) = write_mark else {
            return Err(contract::FenceError::Unfenced {
                store: KIND,
                record: record.to_owned(),
                why: "its fence column is NULL".to_owned(),
            });
        };
        Ok(Some((write_mark, read_mark.unwrap_or(0))))
    }

    async fn read_record(&self, record: &str) -> Result<Option<Record>, contract::FenceError> {
        let row = self
            .client
            .query_opt(READ_SQL, &[&record])
            .await
            .map_err(|e| {
                to_contract(
                    "reading a record",
                    FenceError::from_postgres("reading a record", &e, None),
                    &[],
                )
            })?;
        let Some(row) = row else { return Ok(None) };
        let (fence, payload): (Option<i64>, String) = match (row.try_get(0), row.try_get(1)) {
            (Ok(f), Ok(p)) => (f, p),
            (Err(e), _) | (_, Err(e)) => {
                return Err(to_contract(
                    "reading a record",
                    FenceError::from_postgres("reading a record", &e, None),
                    &[],
                ));
            }
        };
        // The reference table's fence is NOT NULL; a copy of it may not be.
        let unfenced = |why: &str| contract::FenceError::Unfenced {
            store: KIND,
            record: record.to_owned(),
            why: why.to_owned(),
        };
        let fence = fence.ok_or_else(|| unfenced("its fence column is NULL"))?;
        let mark = u64::try_from(fence)
            .map_err(|_| unfenced("its fence column is negative, which no token is"))?;
        Ok(Some(Record {
            mark: Mark::new(mark),
            payload: payload.into_bytes(),
        }))
    }
}

/// The core error for one of this crate's, scrubbed of `secrets`.
fn to_contract(op: &'static str, err: FenceError, secrets: &[u64]) -> contract::FenceError {
    match err {
        FenceError::TokenOutOfRange => contract::FenceError::TokenOutOfRange { store: KIND },
        FenceError::Schema { .. } => contract::FenceError::store(KIND, op, err, false, secrets),
        FenceError::Postgres { .. } => {
            let transient = err.is_transient();
            let message = match &err {
                FenceError::Postgres { message, .. } => message.clone(),
                FenceError::TokenOutOfRange | FenceError::Schema { .. } => String::new(),
            };
            contract::FenceError::store(KIND, op, message, transient, secrets)
        }
    }
}

/// The driver's error with its causes ("error connecting to server" alone
/// does not say why).
fn with_causes(err: &tokio_postgres::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn utf8<'a>(payload: &'a [u8], op: &'static str) -> Result<&'a str, contract::FenceError> {
    std::str::from_utf8(payload).map_err(|_| {
        contract::FenceError::store(
            KIND,
            op,
            "the reference table keeps text payloads and this payload is not UTF-8",
            false,
            &[],
        )
    })
}

impl FencedStore for PostgresStore {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn guarded_write<'a>(
        &'a self,
        record: &'a str,
        token: u64,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<Guarded, contract::FenceError>> {
        Box::pin(async move {
            let payload = utf8(payload, "guarded write")?;
            match crate::guarded_write(&self.client, record, token, payload).await {
                // The write count is at least 1 (`writes = 1` on create); one
                // that is not (a row someone set to -5) cannot order
                // anything: the write landed, its version is unknown.
                Ok(WriteOutcome::Accepted { write_seq }) => match u64::try_from(write_seq) {
                    Ok(version) if version > 0 => Ok(Guarded::Applied { version }),
                    _ => Err(contract::FenceError::Unfenced {
                        store: KIND,
                        record: record.to_owned(),
                        why: "the write landed, but its writes column is not a positive count, \
                              so the write has no version; repair the column"
                            .to_owned(),
                    }),
                },
                // Refused by the write mark or the read mark (a reader with
                // this or a later token read the record): the greater one is
                // the mark it met.
                Ok(WriteOutcome::FencedOut) => match self.marks(record, token).await? {
                    Some((write_mark, read_mark)) => match u64::try_from(write_mark) {
                        Ok(write_mark) => Ok(Guarded::FencedOut {
                            mark: Mark::new(write_mark.max(u64::try_from(read_mark).unwrap_or(0))),
                        }),
                        Err(_) => Err(contract::FenceError::Unfenced {
                            store: KIND,
                            record: record.to_owned(),
                            why: "its fence column is negative, which no token is".to_owned(),
                        }),
                    },
                    // Deleted since: nothing changed, and the same write may land now.
                    None => Ok(Guarded::Retry),
                },
                Err(e) => Err(to_contract("guarded write", e, &[token])),
            }
        })
    }

    fn read<'a>(
        &'a self,
        record: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, contract::FenceError>> {
        Box::pin(self.read_record(record))
    }

    fn plain_write<'a>(
        &'a self,
        record: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), contract::FenceError>> {
        Box::pin(async move {
            let payload = utf8(payload, "plain write")?;
            self.client
                .execute(PLAIN_WRITE_SQL, &[&record, &payload])
                .await
                .map_err(|e| {
                    to_contract(
                        "plain write",
                        FenceError::from_postgres("plain write", &e, None),
                        &[],
                    )
                })?;
            Ok(())
        })
    }
}
