//! The reference fence for PostgreSQL (ADR-16): the guarded write and the
//! fencing high-water mark in one statement, as code meant to be copied.
//!
//! A write flows through it like this. The workload holds a Latchkey lock and
//! takes its token with `LockGuard::token().get()`. It calls
//! [`guarded_write`] with the record's id, that token and the new payload.
//! One `INSERT ... ON CONFLICT DO UPDATE ... WHERE t.fence < EXCLUDED.fence
//! RETURNING writes` either creates the record, or overwrites it and raises
//! its mark to the token, or — when the record already carries a mark at or
//! above the token — changes nothing and returns no row. No row back is the
//! rejection ([`WriteOutcome::FencedOut`]): a holder that was frozen past its
//! TTL and resumed after a later holder wrote cannot overwrite that write.
//!
//! Why it is built this way (docs/fencing.md has the long form):
//! - the comparison and the write are one statement, so PostgreSQL's row lock
//!   makes them atomic; a `SELECT fence` followed by an `UPDATE` is a race;
//! - strictly `<`: a holder presenting the mark's own token again (a reused
//!   or replayed token) is refused; `<=` would let it through;
//! - one mark per record (the `fence` column), not per table: a table-wide
//!   mark lets one key's writer fence out every other key's writer, and
//!   tempts people into a separate "mark" row read in a second statement.
//!
//! Tokens are capabilities: nothing in this crate formats one into an error
//! or a log line, and PostgreSQL's error text is scrubbed of the token before
//! it is kept (a constraint violation's DETAIL can echo the parameters).
//!
//! A shared holder (a reader) fences its *read* with [`guarded_read`]: one
//! `INSERT ... ON CONFLICT DO UPDATE ... WHERE t.fence <= $token RETURNING`
//! returns the record only if no write with a larger token has landed (the
//! reader's hold was not superseded by a writer that wrote), and raises the
//! record's *read mark* (`read_fence`) to the token in the same statement,
//! so a stale writer whose token is at or below it can no longer write the
//! record afterwards: both guarded write statements compare the read mark
//! too. The rule and its reasoning: docs/fencing.md, "Fenced reads".
//!
//! [`PostgresStore`] is the same fence behind the adapter contract
//! (`latchkey_fence::FencedStore`), for callers that pick a store at run
//! time (`latchctl pause-test --resource-url postgresql://…`).

use std::fmt;

use tokio_postgres::Client;

mod store;
pub use store::{KIND, MARKS_SQL, PLAIN_WRITE_SQL, PostgresStore, READ_SQL};
use tokio_postgres::error::SqlState;

/// The reference table. Copy the pattern (a `fence bigint` per record, the
/// guarded statement below) into your own table rather than using this one.
pub const TABLE: &str = "latchkey_fenced_rows";

/// Creates the reference table if it is missing. `read_fence` is the read
/// mark: the greatest token a [`guarded_read`] was accepted with (0: none).
/// It is last and has a default, so an older table gains it in place
/// ([`ADD_READ_FENCE_SQL`]) and inserts that name four columns still work.
pub const CREATE_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS latchkey_fenced_rows (
    id         text   PRIMARY KEY,
    fence      bigint NOT NULL,
    payload    text   NOT NULL,
    writes     bigint NOT NULL,
    read_fence bigint NOT NULL DEFAULT 0
)";

/// Adds the read mark to a reference table made before fenced reads (every
/// row starts at 0: no read yet). [`ensure_schema`] runs it only when the
/// table is otherwise the reference one and lacks the column.
pub const ADD_READ_FENCE_SQL: &str = "ALTER TABLE latchkey_fenced_rows ADD COLUMN IF NOT EXISTS read_fence bigint NOT NULL DEFAULT 0";

/// The guarded upsert: `$1` id, `$2` token (bigint), `$3` payload. Creates a
/// missing record; otherwise writes only if the record's mark is strictly
/// below the token *and* its read mark is too (no reader with this or a
/// later token has read it: a writer granted before that reader is stale),
/// and raises the mark in the same statement. A negative mark is no token's
/// (a table that marks unfenced rows with -1): such a record is never
/// overwritten. One row back (the record's write count) means accepted;
/// zero rows means fenced out.
pub const GUARDED_WRITE_SQL: &str =
    "INSERT INTO latchkey_fenced_rows AS t (id, fence, payload, writes)
VALUES ($1, $2, $3, 1)
ON CONFLICT (id) DO UPDATE
   SET fence = EXCLUDED.fence, payload = EXCLUDED.payload, writes = t.writes + 1
 WHERE t.fence < EXCLUDED.fence AND t.read_fence < EXCLUDED.fence AND t.fence >= 0
RETURNING writes";

/// The plain guarded update for a record that already exists: `$1` id, `$2`
/// token, `$3` payload. The affected row count is the answer: 1 = written,
/// 0 = fenced out (or no such record — this form never creates one).
pub const GUARDED_UPDATE_SQL: &str = "UPDATE latchkey_fenced_rows
   SET payload = $3, fence = $2, writes = writes + 1
 WHERE id = $1 AND fence < $2 AND read_fence < $2 AND fence >= 0";

/// The guarded read of a shared holder: `$1` id, `$2` the reader's token
/// (bigint). Accepted if and only if the record's mark is at or below the
/// token (no write with a larger token has landed: no writer granted after
/// this reader has written), and then the read mark is raised to the token
/// (never lowered: readers do not refuse each other) in the same statement,
/// under the same row lock as the writes. A missing record is created
/// empty (mark 0, write count 0, the read mark the token), so that a stale
/// writer cannot create it after the read either. One row back (payload and
/// write count; 0 writes: nothing written yet) means accepted; zero rows
/// means refused ([`ReadOutcome::WrittenSince`]). `<=`, not `<`: a mark equal
/// to the token is no later writer's (a writer's token is above every
/// earlier grant, a reader's above the last writer's), but the reader's own
/// write made as a writer before it downgraded, or a misused reader token.
pub const GUARDED_READ_SQL: &str =
    "INSERT INTO latchkey_fenced_rows AS t (id, fence, payload, writes, read_fence)
VALUES ($1, 0, '', 0, $2)
ON CONFLICT (id) DO UPDATE
   SET read_fence = GREATEST(t.read_fence, EXCLUDED.read_fence)
 WHERE t.fence <= EXCLUDED.read_fence AND t.fence >= 0
RETURNING payload, writes";

/// What a [`guarded_write`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The write landed and the record's mark is now the token.
    /// `write_seq` counts the writes the record has accepted (1 = created).
    Accepted { write_seq: i64 },
    /// The record carries a mark at or above the token: a later (or the
    /// same) grant already wrote. Nothing changed.
    FencedOut,
}

impl WriteOutcome {
    pub fn is_accepted(self) -> bool {
        matches!(self, WriteOutcome::Accepted { .. })
    }
}

/// What a [`guarded_read`] found.
#[derive(Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// No write with a larger token than the reader's has landed: what was
    /// read is current for this shared hold. `payload` is `None` when no
    /// write has landed yet; `write_seq` counts the writes the record has
    /// accepted (0: none), the same count [`WriteOutcome::Accepted`] gives,
    /// so a read is ordered among the writes. The record's read mark is now
    /// at least the token: a writer with a token at or below it is fenced out
    /// from here on.
    Current {
        payload: Option<String>,
        write_seq: i64,
    },
    /// Refused: a writer granted after this reader has written the record,
    /// so this reader's shared hold is over. Discard what it read and stop;
    /// nothing changed.
    WrittenSince,
}

impl ReadOutcome {
    pub fn is_current(&self) -> bool {
        matches!(self, ReadOutcome::Current { .. })
    }
}

impl fmt::Debug for ReadOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadOutcome::Current { payload, write_seq } => f
                .debug_struct("Current")
                .field("payload_bytes", &payload.as_ref().map(String::len))
                .field("write_seq", write_seq)
                .finish(),
            ReadOutcome::WrittenSince => f.write_str("WrittenSince"),
        }
    }
}

/// The refusal reason of a [`ReadOutcome::WrittenSince`], in words (no
/// token, no mark).
pub const READ_REFUSED: &str = "guarded read refused: a writer granted after this reader has \
                                written the record, so the shared hold is over";

impl fmt::Display for ReadOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadOutcome::Current { write_seq: 0, .. } => f.write_str("current (no write yet)"),
            ReadOutcome::Current { write_seq, .. } => {
                write!(f, "current (after write #{write_seq})")
            }
            ReadOutcome::WrittenSince => f.write_str(READ_REFUSED),
        }
    }
}

/// What a [`guarded_update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateOutcome {
    /// One row updated; its mark is now the token.
    Updated,
    /// No row updated: the record's mark is at or above the token, or the
    /// record does not exist. (The upsert form, [`guarded_write`], tells the
    /// two apart by creating the record.)
    FencedOutOrMissing,
}

/// Why a fenced write could not be attempted or did not complete. The text
/// never contains the token.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// PostgreSQL's `bigint` is signed: a token above `i64::MAX` cannot be
    /// stored as a mark, so it is refused rather than wrapped negative
    /// (a wrapped token would compare below every real mark).
    #[error(
        "the fencing token does not fit PostgreSQL's bigint (it is above 2^63-1); \
         refusing to write rather than store a wrapped mark"
    )]
    TokenOutOfRange,
    /// The existing `latchkey_fenced_rows` table is not the reference table
    /// (`CREATE TABLE IF NOT EXISTS` leaves an older or foreign one alone):
    /// a `fence` column of another type would compare wrongly (text compares
    /// `"9" > "10"`), so nothing is written through it.
    #[error(
        "the table {TABLE} is not the fence's: {why}; drop or rename it, or migrate it to the reference schema"
    )]
    Schema { why: String },
    /// PostgreSQL refused or the connection failed; `message` is scrubbed of
    /// the token.
    #[error("{op}: {message}")]
    Postgres {
        op: &'static str,
        /// The SQLSTATE, when the server answered with an error.
        code: Option<SqlState>,
        message: String,
        /// The connection is gone (reconnect before retrying).
        closed: bool,
    },
}

impl FenceError {
    /// Whether the same write may succeed if retried: connection trouble,
    /// serialization failures, deadlocks, a server shutting down. A fenced-out
    /// write is not an error and never transient.
    pub fn is_transient(&self) -> bool {
        match self {
            FenceError::TokenOutOfRange | FenceError::Schema { .. } => false,
            FenceError::Postgres { code, closed, .. } => {
                *closed
                    || code.as_ref().is_some_and(|c| {
                        let c = c.code();
                        c.starts_with("08") // connection exception
                            || c.starts_with("40") // serialization failure, deadlock
                            || c.starts_with("57P") // operator intervention (shutdown)
                            || c == "53300" // too many connections
                    })
            }
        }
    }

    /// Wraps a driver error, removing every occurrence of `token` (as its
    /// decimal digits) from the text kept. Also for callers that run their
    /// own guarded statement with the token as a parameter.
    pub fn from_postgres(
        op: &'static str,
        err: &tokio_postgres::Error,
        token: Option<u64>,
    ) -> Self {
        let mut message = match err.as_db_error() {
            // Severity, message and SQLSTATE only; DETAIL may echo the row.
            Some(db) => format!(
                "{}: {} (SQLSTATE {})",
                db.severity(),
                db.message(),
                db.code().code()
            ),
            None => err.to_string(),
        };
        if let Some(token) = token {
            message = redact(&message, token);
        }
        FenceError::Postgres {
            op,
            code: err.code().cloned(),
            message,
            closed: err.is_closed(),
        }
    }
}

/// `text` with every occurrence of `token`'s decimal digits replaced.
pub fn redact(text: &str, token: u64) -> String {
    text.replace(&token.to_string(), "<redacted>")
}

/// The token as the `bigint` parameter the guarded statements take, or
/// [`FenceError::TokenOutOfRange`].
pub fn token_param(token: u64) -> Result<i64, FenceError> {
    i64::try_from(token).map_err(|_| FenceError::TokenOutOfRange)
}

/// The reference table's columns and their types, as `format_type` names
/// them. Other columns may exist (with defaults); these must.
pub const REQUIRED_COLUMNS: [(&str, &[&str]); 4] = [
    // `text`: a `varchar(3)` silently trims trailing spaces, so `'abc  '`
    // and `abc` are one record (the second hostile review).
    ("id", &["text"]),
    ("fence", &["bigint"]),
    ("payload", &["text"]),
    ("writes", &["bigint"]),
];

/// The read mark's column: added by [`ensure_schema`] when missing, and
/// `bigint` when present (a text read mark would compare `"9" > "10"`).
pub const READ_FENCE_COLUMN: (&str, &[&str]) = ("read_fence", &["bigint"]);

/// The columns of the table the unqualified name resolves to (the one the
/// statements write), with their types.
const COLUMNS_SQL: &str = "SELECT a.attname::text, format_type(a.atttypid, NULL)
  FROM pg_attribute a
 WHERE a.attrelid = to_regclass('latchkey_fenced_rows') AND a.attnum > 0 AND NOT a.attisdropped";

/// The relation the name resolves to: its kind (`r` a plain table; a view
/// or a partitioned table routes writes elsewhere), whether tables inherit
/// from it, and whether `id`'s collation is deterministic (a
/// case-insensitive ICU collation makes `Orders` and `orders` one record).
const RELATION_SQL: &str = "SELECT c.relkind::text,
       EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhparent = c.oid),
       COALESCE((SELECT coll.collisdeterministic FROM pg_attribute a
                   JOIN pg_collation coll ON coll.oid = a.attcollation
                  WHERE a.attrelid = c.oid AND a.attname = 'id'), true)
  FROM pg_class c WHERE c.oid = to_regclass('latchkey_fenced_rows')";

/// The table's unique indexes, and whether one of them is the primary key on
/// `id` alone. `ON CONFLICT (id)` uses any unique index on `id`, whatever its
/// collation (`CREATE UNIQUE INDEX … (id COLLATE ci)` made `orders` and
/// `ORDERS` one record: the fourth hostile review), so the primary key on
/// `id` must be the only one.
const KEYS_SQL: &str = "SELECT count(*),
       COALESCE(bool_or(ix.indisprimary AND ix.indnatts = 1 AND ix.indexprs IS NULL
                        AND ix.indpred IS NULL
                        AND ix.indkey[0] = (SELECT attnum FROM pg_attribute
                                             WHERE attrelid = ix.indrelid AND attname = 'id')), false)
  FROM pg_index ix WHERE ix.indrelid = to_regclass('latchkey_fenced_rows') AND ix.indisunique";

/// Row triggers that run BEFORE the write (`tgtype` bits: 1 row, 2 before);
/// they can change the mark or the write count the statement sets.
const BEFORE_TRIGGERS_SQL: &str = "SELECT tgname::text FROM pg_trigger
 WHERE tgrelid = to_regclass('latchkey_fenced_rows') AND NOT tgisinternal
   AND (tgtype & 3) = 3";

/// Creates the reference table (idempotent) and checks that the table the
/// statements will write is the reference one: a table of that name created
/// by someone else, or by an older version, is refused with what differs.
pub async fn ensure_schema(client: &Client) -> Result<(), FenceError> {
    client
        .batch_execute(CREATE_TABLE_SQL)
        .await
        .map_err(|e| FenceError::from_postgres("creating the fenced table", &e, None))?;
    let rows = client
        .query(COLUMNS_SQL, &[])
        .await
        .map_err(|e| FenceError::from_postgres("reading the fenced table's columns", &e, None))?;
    let mut columns = Vec::with_capacity(rows.len());
    for row in &rows {
        let name: String = row.try_get(0).map_err(|e| {
            FenceError::from_postgres("reading the fenced table's columns", &e, None)
        })?;
        let ty: String = row.try_get(1).map_err(|e| {
            FenceError::from_postgres("reading the fenced table's columns", &e, None)
        })?;
        columns.push((name, ty));
    }
    check_columns(&columns)?;
    let relation = client
        .query_opt(RELATION_SQL, &[])
        .await
        .map_err(|e| FenceError::from_postgres("reading the fenced table's kind", &e, None))?;
    if let Some(row) = relation {
        let kind: String = row.try_get(0).unwrap_or_default();
        let inherited: bool = row.try_get(1).unwrap_or(true);
        let deterministic: bool = row.try_get(2).unwrap_or(false);
        check_relation(&kind, inherited, deterministic)?;
    }
    let keys = client
        .query_one(KEYS_SQL, &[])
        .await
        .map_err(|e| FenceError::from_postgres("reading the fenced table's keys", &e, None))?;
    let unique: i64 = keys.try_get(0).unwrap_or(-1);
    let primary_on_id: bool = keys.try_get(1).unwrap_or(false);
    check_keys(unique, primary_on_id)?;
    let triggers = client
        .query(BEFORE_TRIGGERS_SQL, &[])
        .await
        .map_err(|e| FenceError::from_postgres("reading the fenced table's triggers", &e, None))?;
    let names: Vec<String> = triggers
        .iter()
        .filter_map(|row| row.try_get::<_, String>(0).ok())
        .collect();
    if !names.is_empty() {
        return Err(FenceError::Schema {
            why: format!(
                "it has BEFORE row triggers ({}), which can change the mark or the write count \
                 the guarded statement sets",
                names.join(", ")
            ),
        });
    }
    // A reference table made before fenced reads: add the read mark, only
    // now that everything else about the table is known to be the fence's
    // (a foreign table is refused above, never altered).
    if !columns.iter().any(|(n, _)| n == READ_FENCE_COLUMN.0) {
        client
            .batch_execute(ADD_READ_FENCE_SQL)
            .await
            .map_err(|e| FenceError::from_postgres("adding the read mark column", &e, None))?;
    }
    Ok(())
}

/// A plain table, nothing inheriting from it, and a deterministic `id`
/// collation.
pub fn check_relation(kind: &str, inherited: bool, deterministic: bool) -> Result<(), FenceError> {
    let mut wrong = Vec::new();
    if kind != "r" {
        wrong.push(format!(
            "it is not a plain table (pg_class.relkind {kind:?}: a view or a partitioned table \
             routes the write to a table whose triggers and keys are not checked)"
        ));
    }
    if inherited {
        wrong.push("other tables inherit from it".to_owned());
    }
    if !deterministic {
        wrong.push(
            "its `id` collation is not deterministic (a case-insensitive collation makes two \
             record names one record)"
                .to_owned(),
        );
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(FenceError::Schema {
            why: wrong.join("; "),
        })
    }
}

/// The primary key on `id` alone, and no other unique index.
pub fn check_keys(unique: i64, primary_on_id: bool) -> Result<(), FenceError> {
    let mut wrong = Vec::new();
    if !primary_on_id {
        wrong.push("its primary key is not `id` alone".to_owned());
    }
    if unique != 1 {
        wrong.push(format!(
            "it has {unique} unique indexes where the fence needs exactly one, the primary key on \
             `id` (`ON CONFLICT (id)` takes any unique index on `id`, whatever its collation, and \
             another unique key can refuse or redirect writes)"
        ));
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(FenceError::Schema {
            why: wrong.join("; "),
        })
    }
}

/// [`REQUIRED_COLUMNS`] against what the table has.
pub fn check_columns(columns: &[(String, String)]) -> Result<(), FenceError> {
    let mut wrong = Vec::new();
    for (name, types) in REQUIRED_COLUMNS {
        match columns.iter().find(|(n, _)| n == name) {
            None => wrong.push(format!("it has no `{name}` column")),
            Some((_, ty)) if !types.contains(&ty.as_str()) => wrong.push(format!(
                "its `{name}` column is {ty}, not {}",
                types.join(" or ")
            )),
            Some(_) => {}
        }
    }
    let (name, types) = READ_FENCE_COLUMN;
    if let Some((_, ty)) = columns.iter().find(|(n, _)| n == name)
        && !types.contains(&ty.as_str())
    {
        wrong.push(format!(
            "its `{name}` column is {ty}, not {}",
            types.join(" or ")
        ));
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(FenceError::Schema {
            why: wrong.join("; "),
        })
    }
}

/// The guarded write: creates the record or overwrites it, if and only if the
/// record's mark is strictly below `token`, in one statement. Pass
/// `guard.token().get()` of the grant under which this unit of work started.
pub async fn guarded_write(
    client: &Client,
    id: &str,
    token: u64,
    payload: &str,
) -> Result<WriteOutcome, FenceError> {
    let fence = token_param(token)?;
    let rows = client
        .query(GUARDED_WRITE_SQL, &[&id, &fence, &payload])
        .await
        .map_err(|e| FenceError::from_postgres("guarded write", &e, Some(token)))?;
    // The row-count check: no row back means the WHERE refused the update.
    match rows.first() {
        None => Ok(WriteOutcome::FencedOut),
        Some(row) => {
            let write_seq: i64 = row.try_get(0).map_err(|e| {
                FenceError::from_postgres("reading the write count", &e, Some(token))
            })?;
            Ok(WriteOutcome::Accepted { write_seq })
        }
    }
}

/// The guarded read of a shared holder whose grant's token is `token`:
/// the record's payload if and only if no write with a larger token has
/// landed, raising the record's read mark to `token` in the same statement
/// ([`GUARDED_READ_SQL`]). Pass `guard.token().get()` of the shared grant
/// under which the read is made; act on the payload only if this answers
/// [`ReadOutcome::Current`]. A shared holder must never call
/// [`guarded_write`] (its token would pass, and raise the mark above the
/// next writer's).
pub async fn guarded_read(
    client: &Client,
    id: &str,
    token: u64,
) -> Result<ReadOutcome, FenceError> {
    let fence = token_param(token)?;
    let rows = client
        .query(GUARDED_READ_SQL, &[&id, &fence])
        .await
        .map_err(|e| FenceError::from_postgres("guarded read", &e, Some(token)))?;
    // The row-count check, as for the write: no row back is the refusal.
    let Some(row) = rows.first() else {
        return Ok(ReadOutcome::WrittenSince);
    };
    let (payload, write_seq): (String, i64) = match (row.try_get(0), row.try_get(1)) {
        (Ok(p), Ok(w)) => (p, w),
        (Err(e), _) | (_, Err(e)) => {
            return Err(FenceError::from_postgres(
                "reading the guarded read's row",
                &e,
                Some(token),
            ));
        }
    };
    Ok(ReadOutcome::Current {
        payload: (write_seq != 0).then_some(payload),
        write_seq,
    })
}

/// The plain guarded `UPDATE` (see [`GUARDED_UPDATE_SQL`]): the affected row
/// count is the answer. Never creates a record.
pub async fn guarded_update(
    client: &Client,
    id: &str,
    token: u64,
    payload: &str,
) -> Result<UpdateOutcome, FenceError> {
    let fence = token_param(token)?;
    let updated = client
        .execute(GUARDED_UPDATE_SQL, &[&id, &fence, &payload])
        .await
        .map_err(|e| FenceError::from_postgres("guarded update", &e, Some(token)))?;
    Ok(if updated == 0 {
        UpdateOutcome::FencedOutOrMissing
    } else {
        UpdateOutcome::Updated
    })
}

impl fmt::Display for WriteOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteOutcome::Accepted { write_seq } => write!(f, "accepted (write #{write_seq})"),
            WriteOutcome::FencedOut => f.write_str("fenced out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_above_bigint_are_refused_without_printing_them() {
        let token = u64::MAX - 7;
        let err = token_param(token).unwrap_err();
        assert!(matches!(err, FenceError::TokenOutOfRange));
        assert!(!err.to_string().contains(&token.to_string()));
        assert!(!format!("{err:?}").contains(&token.to_string()));
        assert!(!err.is_transient());
        assert_eq!(token_param(i64::MAX as u64).unwrap(), i64::MAX);
        assert_eq!(token_param(0).unwrap(), 0);
    }

    #[test]
    fn redact_removes_every_occurrence() {
        let token = 281_474_976_710_699u64;
        let text = format!("Failing row contains (a, {token}, x) and again {token}");
        let clean = redact(&text, token);
        assert!(!clean.contains(&token.to_string()), "{clean}");
        assert_eq!(clean.matches("<redacted>").count(), 2);
    }

    #[test]
    fn the_statements_compare_strictly_and_in_one_statement() {
        for sql in [GUARDED_WRITE_SQL, GUARDED_UPDATE_SQL] {
            assert!(sql.contains("fence <"), "{sql}");
            // Writers meet the readers' mark too, strictly.
            assert!(sql.contains("read_fence <"), "{sql}");
            assert!(!sql.contains("<="), "{sql}");
            assert_eq!(sql.matches(';').count(), 0, "one statement: {sql}");
        }
        assert!(GUARDED_WRITE_SQL.contains("RETURNING writes"));
        assert!(GUARDED_WRITE_SQL.contains("t.fence >= 0"));
        assert!(GUARDED_UPDATE_SQL.contains("fence >= 0"));
    }

    #[test]
    fn the_guarded_read_compares_and_raises_in_one_statement() {
        let sql = GUARDED_READ_SQL;
        assert_eq!(sql.matches(';').count(), 0, "one statement: {sql}");
        // At or below: a mark equal to the reader's token is no later writer's.
        assert!(sql.contains("t.fence <= EXCLUDED.read_fence"), "{sql}");
        assert!(sql.contains("t.fence >= 0"), "{sql}");
        // Raised, never lowered: readers do not refuse each other.
        assert!(
            sql.contains("read_fence = GREATEST(t.read_fence, EXCLUDED.read_fence)"),
            "{sql}"
        );
        // The writes' mark is left alone.
        assert!(!sql.contains("SET fence"), "{sql}");
        assert!(sql.contains("RETURNING payload, writes"), "{sql}");
        assert!(CREATE_TABLE_SQL.contains("read_fence bigint NOT NULL DEFAULT 0"));
    }

    #[test]
    fn read_outcomes_never_print_the_payload_and_say_why() {
        let current = ReadOutcome::Current {
            payload: Some("secret ledger line".to_owned()),
            write_seq: 4,
        };
        assert!(current.is_current());
        assert!(!format!("{current:?}").contains("secret"));
        assert_eq!(current.to_string(), "current (after write #4)");
        let empty = ReadOutcome::Current {
            payload: None,
            write_seq: 0,
        };
        assert_eq!(empty.to_string(), "current (no write yet)");
        let refused = ReadOutcome::WrittenSince;
        assert!(!refused.is_current());
        assert!(
            refused
                .to_string()
                .contains("a writer granted after this reader"),
            "{refused}"
        );
    }

    #[test]
    fn a_foreign_table_is_refused_with_what_differs() {
        let cols = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(n, t)| (n.to_string(), t.to_string()))
                .collect()
        };
        let reference = cols(&[
            ("id", "text"),
            ("fence", "bigint"),
            ("payload", "text"),
            ("writes", "bigint"),
            ("extra", "integer"),
        ]);
        assert!(check_columns(&reference).is_ok());
        // The read mark may be missing (ensure_schema adds it), never of
        // another type.
        let mut with_read_mark = reference.clone();
        with_read_mark.push(("read_fence".to_owned(), "bigint".to_owned()));
        assert!(check_columns(&with_read_mark).is_ok());
        let text_read_mark = cols(&[
            ("id", "text"),
            ("fence", "bigint"),
            ("payload", "text"),
            ("writes", "bigint"),
            ("read_fence", "text"),
        ]);
        let err = check_columns(&text_read_mark).unwrap_err().to_string();
        assert!(
            err.contains("`read_fence` column is text, not bigint"),
            "{err}"
        );
        let older = cols(&[("id", "text"), ("fence", "text"), ("payload", "text")]);
        let err = check_columns(&older).unwrap_err().to_string();
        assert!(err.contains("`fence` column is text, not bigint"), "{err}");
        assert!(err.contains("no `writes` column"), "{err}");
        assert!(err.contains("drop or rename it"), "{err}");
    }

    #[test]
    fn views_partitions_children_and_loose_collations_are_refused() {
        assert!(check_relation("r", false, true).is_ok());
        for (kind, inherited, deterministic, says) in [
            ("v", false, true, "not a plain table"),
            ("p", false, true, "not a plain table"),
            ("r", true, true, "inherit"),
            ("r", false, false, "not deterministic"),
        ] {
            let err = check_relation(kind, inherited, deterministic)
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{err}");
        }
        let varchar = [
            ("id".to_owned(), "character varying".to_owned()),
            ("fence".to_owned(), "bigint".to_owned()),
            ("payload".to_owned(), "text".to_owned()),
            ("writes".to_owned(), "bigint".to_owned()),
        ];
        assert!(check_columns(&varchar).is_err());
        assert!(check_keys(1, true).is_ok());
        assert!(
            check_keys(2, true)
                .unwrap_err()
                .to_string()
                .contains("2 unique indexes")
        );
        assert!(
            check_keys(1, false)
                .unwrap_err()
                .to_string()
                .contains("not `id` alone")
        );
    }

    #[test]
    fn outcomes_read_as_words() {
        assert_eq!(
            WriteOutcome::Accepted { write_seq: 3 }.to_string(),
            "accepted (write #3)"
        );
        assert_eq!(WriteOutcome::FencedOut.to_string(), "fenced out");
        assert!(WriteOutcome::Accepted { write_seq: 1 }.is_accepted());
        assert!(!WriteOutcome::FencedOut.is_accepted());
    }
}
