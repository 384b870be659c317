//! The MySQL/MariaDB fence (issue 35): the guarded write and the record's
//! mark in ONE statement, [`GUARDED_WRITE_SQL`]:
//!
//! ```sql
//! INSERT INTO latchkey_fenced_rows (id, fence, payload, writes)
//!   VALUES (?, ?, ?, LAST_INSERT_ID(1))
//! ON DUPLICATE KEY UPDATE
//!   payload = IF(fence < ?, ?, payload),
//!   writes  = IF(fence < ?, LAST_INSERT_ID(writes + 1), writes),
//!   fence   = IF(fence < ?, ?, fence)
//! ```
//!
//! bound as `(id, token, payload, token, payload, token, token, token)`. A missing
//! record is inserted; an existing one is overwritten, and its mark raised
//! to the token, only when its mark is strictly below the token. InnoDB
//! locks the row for the statement, so the comparison and the write are one
//! atomic step.
//!
//! The answer is the affected-row count, which MySQL and MariaDB define for
//! `INSERT … ON DUPLICATE KEY UPDATE` as: **1** the row was inserted, **2**
//! an existing row was updated, **0** an existing row was left as it was
//! (here: fenced out). That holds only while the connection does NOT set
//! `CLIENT_FOUND_ROWS`: with it, an unchanged row counts **1**, the same as
//! an insert, and a fenced-out write would read as applied. mysql_async
//! leaves the flag off unless the URL says `client_found_rows=true`;
//! [`MysqlStore::connect`] refuses that URL, and checks the server's
//! answer on a temporary table before trusting the count (a proxy between
//! the driver and the server could change it too).
//!
//! Three details the statement depends on:
//! - **assignment order**: MySQL applies `ON DUPLICATE KEY UPDATE`
//!   assignments left to right and a later one sees the earlier ones'
//!   values. `payload` must be assigned before `fence`; the other way round
//!   the payload's `IF` already sees the new mark and never writes;
//! - **strictly `<`**: a replayed token (equal to the mark) is refused;
//! - **one unique key**: with a second unique index the insert could
//!   collide on it and update another row. The reference table's only
//!   unique key is `id`, a `VARBINARY` so that record names compare
//!   byte-for-byte (a `VARCHAR` with the default collation would treat
//!   `A` and `a` as one record).
//!
//! `writes` counts the record's applied writes; `LAST_INSERT_ID(expr)` sets
//! the connection's last-insert id to it, which the server returns in the
//! statement's OK packet, so the applied write's version comes back without
//! a second statement (a table with triggers gets 0 there, and the adapter
//! then asks `SELECT LAST_INSERT_ID()` on the same connection). [`MysqlStore::connect`] checks that an existing table
//! of the reference name has the reference columns and no second unique key
//! ([`check_schema`]): `CREATE TABLE IF NOT EXISTS` leaves a foreign one alone.
//!
//! A record whose `fence` is `NULL` (a table that adopted fencing after
//! rows existed) is never overwritten: `NULL < token` is not true, the
//! statement leaves it, and the adapter answers [`FenceError::Unfenced`].
//!
//! Tokens are capabilities: the driver's error text is scrubbed of the
//! token before it is kept (`Duplicate entry '…'` echoes values), and
//! nothing here formats a token or a mark.

use latchkey_fence::{BoxFuture, FenceError, FencedStore, Guarded, Mark, Record};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, OptsBuilder, Pool, Row};

/// The store kind, as in `mysql://…`.
pub const KIND: &str = "mysql";

/// The reference table. Copy the pattern (a nullable `fence BIGINT
/// UNSIGNED` per record, the statement above) into your own table.
pub const TABLE: &str = "latchkey_fenced_rows";

/// Creates the reference table if it is missing.
pub const CREATE_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS latchkey_fenced_rows (
    id      VARBINARY(255)  NOT NULL PRIMARY KEY,
    fence   BIGINT UNSIGNED NULL,
    payload LONGBLOB        NOT NULL,
    writes  BIGINT UNSIGNED NOT NULL DEFAULT 0
) ENGINE=InnoDB";

/// The guarded write; bind `(id, token, payload, token, payload, token,
/// token, token)`. Affected rows: 1 inserted, 2 updated, 0 fenced out (or
/// the record's `fence` is `NULL`). An applied write's version (the
/// record's write count) is the connection's last-insert id.
pub const GUARDED_WRITE_SQL: &str = "INSERT INTO latchkey_fenced_rows (id, fence, payload, writes)
  VALUES (?, ?, ?, LAST_INSERT_ID(1))
ON DUPLICATE KEY UPDATE
  payload = IF(fence < ?, ?, payload),
  writes  = IF(fence < ?, LAST_INSERT_ID(writes + 1), writes),
  fence   = IF(fence < ?, ?, fence)";

/// Reads a record's mark (`NULL`: unfenced) and payload; bind `(id)`.
pub const READ_SQL: &str = "SELECT fence, payload FROM latchkey_fenced_rows WHERE id = ?";

/// The naive writer: overwrites the payload and never compares or raises
/// the mark (a record it creates gets mark 0); bind `(id, payload,
/// payload)`. For the pause test's "a naive writer FAILs" run and the
/// benchmark's baseline only.
pub const PLAIN_WRITE_SQL: &str =
    "INSERT INTO latchkey_fenced_rows (id, fence, payload, writes) VALUES (?, 0, ?, 1)
ON DUPLICATE KEY UPDATE payload = ?, writes = writes + 1";

/// What the affected-row count of [`GUARDED_WRITE_SQL`] means (without
/// `CLIENT_FOUND_ROWS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affected {
    /// 1: the record did not exist and was inserted.
    Inserted,
    /// 2: the record existed and was overwritten; its mark is the token.
    Updated,
    /// 0: the record exists and was left as it was.
    Unchanged,
}

impl Affected {
    /// `None` for any other count: refuse to guess.
    pub fn from_count(count: u64) -> Option<Self> {
        match count {
            1 => Some(Affected::Inserted),
            2 => Some(Affected::Updated),
            0 => Some(Affected::Unchanged),
            _ => None,
        }
    }
}

/// The fence over a MySQL or MariaDB database, through a connection pool.
pub struct MysqlStore {
    pool: Pool,
}

impl MysqlStore {
    /// Connects with a `mysql://user:password@host:port/db` URL (no TLS),
    /// creates the reference table if it is missing and checks that the
    /// server reports an unchanged row as 0 affected. Refuses a URL with
    /// `client_found_rows=true`. Errors name neither the URL nor its password.
    pub async fn connect(url: &str) -> Result<Self, FenceError> {
        let opts = Opts::from_url(url).map_err(|e| {
            FenceError::store(
                KIND,
                "reading the URL",
                format!("not a usable mysql:// URL: {e}"),
                false,
                &[],
            )
        })?;
        Self::with_opts(opts).await
    }

    /// [`MysqlStore::connect`] with options already built.
    pub async fn with_opts(opts: Opts) -> Result<Self, FenceError> {
        if opts.client_found_rows() {
            return Err(found_rows_refused(
                "the connection options set CLIENT_FOUND_ROWS",
            ));
        }
        // Strict mode on every connection (set again after a pool reset): a
        // record name or payload too long for its column is an error, never
        // cut onto another record or short (the hostile review).
        let mut setup = opts.setup().to_vec();
        // mysql_async runs setup commands last to first: ours goes first in
        // the list so it runs after the caller's (a caller's `sql_mode = ''`
        // must not undo it: the second hostile review).
        setup.insert(0, STRICT_SQL.to_owned());
        let opts: Opts = OptsBuilder::from_opts(opts).setup(setup).into();
        let pool = Pool::new(opts);
        let mut conn = pool
            .get_conn()
            .await
            .map_err(|e| store_error("connecting", &e, &[]))?;
        conn.query_drop(CREATE_TABLE_SQL)
            .await
            .map_err(|e| store_error("creating the reference table", &e, &[]))?;
        check_schema(&mut conn).await?;
        check_affected_rows(&mut conn).await?;
        drop(conn);
        Ok(Self { pool })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    async fn conn(&self, op: &'static str) -> Result<Conn, FenceError> {
        self.pool
            .get_conn()
            .await
            .map_err(|e| store_error(op, &e, &[]))
    }

    async fn read_with(conn: &mut Conn, record: &str) -> Result<Option<Record>, FenceError> {
        let row: Option<Row> = conn
            .exec_first(READ_SQL, (record.as_bytes(),))
            .await
            .map_err(|e| store_error("reading a record", &e, &[]))?;
        let Some(row) = row else { return Ok(None) };
        let unfenced = |why: &str| FenceError::Unfenced {
            store: KIND,
            record: record.to_owned(),
            why: why.to_owned(),
        };
        let mark = match row.get_opt::<Option<u64>, usize>(0) {
            Some(Ok(Some(mark))) => mark,
            Some(Ok(None)) => return Err(unfenced("its fence column is NULL")),
            _ => {
                return Err(unfenced(
                    "its fence column is not an unsigned 64-bit number",
                ));
            }
        };
        let payload = match row.get_opt::<Vec<u8>, usize>(1) {
            Some(Ok(payload)) => payload,
            _ => {
                return Err(FenceError::store(
                    KIND,
                    "reading a record",
                    "the payload column is not bytes",
                    false,
                    &[],
                ));
            }
        };
        Ok(Some(Record {
            mark: Mark::new(mark),
            payload,
        }))
    }
}

/// Turns on `STRICT_ALL_TABLES` for the session, keeping its other modes.
pub const STRICT_SQL: &str = "SET SESSION sql_mode = IF(@@SESSION.sql_mode = '', \
     'STRICT_ALL_TABLES', CONCAT(@@SESSION.sql_mode, ',STRICT_ALL_TABLES'))";

/// The reference table's columns: name, the `DATA_TYPE`s accepted, and
/// whether the `COLUMN_TYPE` must be unsigned.
const REQUIRED_COLUMNS: [(&str, &[&str], bool); 4] = [
    // VARBINARY: record names compare byte for byte (BINARY pads with
    // zero bytes, so `a` and `a\0` would be one record).
    ("id", &["varbinary"], false),
    ("fence", &["bigint"], true),
    (
        "payload",
        &["longblob", "mediumblob", "blob", "varbinary"],
        false,
    ),
    ("writes", &["bigint"], true),
];

const COLUMNS_SQL: &str = "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, \
 CAST(COALESCE(CHARACTER_MAXIMUM_LENGTH, 0) AS UNSIGNED), EXTRA FROM information_schema.COLUMNS
 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'latchkey_fenced_rows'";

/// Triggers that run before a row is written: they can change the mark or
/// the write count the statement set (`SET NEW.fence = OLD.fence` lets a
/// stale write land and reads as applied).
const BEFORE_TRIGGERS_SQL: &str = "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS
 WHERE EVENT_OBJECT_SCHEMA = DATABASE() AND EVENT_OBJECT_TABLE = 'latchkey_fenced_rows'
   AND ACTION_TIMING = 'BEFORE'";

/// Every unique index's columns, one row per (index, column).
const UNIQUE_SQL: &str =
    "SELECT INDEX_NAME, COLUMN_NAME, SUB_PART IS NOT NULL FROM information_schema.STATISTICS
 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'latchkey_fenced_rows' AND NON_UNIQUE = 0";

/// The table's storage engine: InnoDB locks the row for the statement and
/// keeps a committed mark through a crash (BLACKHOLE keeps nothing; MyISAM
/// and MEMORY lose marks).
const ENGINE_SQL: &str = "SELECT ENGINE FROM information_schema.TABLES
 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'latchkey_fenced_rows'";

/// Checks that the table the statements write is the reference one: the
/// columns' types (`REQUIRED_COLUMNS`) and `id` as its only unique key
/// (with a second one, the upsert can collide there and update another
/// row). A table of the reference name from an older version or from
/// someone else is refused with what differs, before anything is written.
pub async fn check_schema(conn: &mut Conn) -> Result<(), FenceError> {
    const OP: &str = "checking the reference table";
    let columns: Vec<(String, String, String, u64, String)> = conn
        .query(COLUMNS_SQL)
        .await
        .map_err(|e| store_error(OP, &e, &[]))?;
    let unique: Vec<(String, String, bool)> = conn
        .query(UNIQUE_SQL)
        .await
        .map_err(|e| store_error(OP, &e, &[]))?;
    // NULL for a view: read as no engine (refused), never a panic.
    let engine: Option<String> = conn
        .query_first::<Option<String>, _>(ENGINE_SQL)
        .await
        .map_err(|e| store_error(OP, &e, &[]))?
        .flatten();
    let before_triggers: Vec<String> = conn
        .query(BEFORE_TRIGGERS_SQL)
        .await
        .map_err(|e| store_error(OP, &e, &[]))?;
    let table = Table {
        columns,
        unique,
        before_triggers,
        engine,
    };
    schema_problems(&table).map_or(Ok(()), |why| {
        Err(FenceError::store(
            KIND,
            OP,
            format!(
                "the table {TABLE} is not the fence's: {why}; drop or rename it, or migrate it \
                 to the reference schema"
            ),
            false,
            &[],
        ))
    })
}

/// What the server says about the table.
struct Table {
    /// Name, `DATA_TYPE`, `COLUMN_TYPE`, `CHARACTER_MAXIMUM_LENGTH` (0 if
    /// none), `EXTRA`.
    columns: Vec<(String, String, String, u64, String)>,
    /// (index, column, indexes only a prefix of it) of every unique index.
    unique: Vec<(String, String, bool)>,
    before_triggers: Vec<String>,
    engine: Option<String>,
}

/// What differs from the reference table, if anything.
fn schema_problems(table: &Table) -> Option<String> {
    let (columns, unique) = (&table.columns, &table.unique);
    let mut wrong = Vec::new();
    for (name, types, unsigned) in REQUIRED_COLUMNS {
        match columns.iter().find(|c| c.0.eq_ignore_ascii_case(name)) {
            None => wrong.push(format!("it has no `{name}` column")),
            Some((_, data_type, column_type, _, _)) => {
                let data_type = data_type.to_ascii_lowercase();
                if !types.contains(&data_type.as_str())
                    || (unsigned && !column_type.to_ascii_lowercase().contains("unsigned"))
                {
                    wrong.push(format!(
                        "its `{name}` column is {column_type}, not {}{}",
                        types.join(" or "),
                        if unsigned { " unsigned" } else { "" }
                    ));
                }
            }
        }
    }
    if let Some((_, _, column_type, length, _)) =
        columns.iter().find(|c| c.0.eq_ignore_ascii_case("id"))
        && *length < MAX_RECORD_BYTES as u64
    {
        wrong.push(format!(
            "its `id` column is {column_type}, shorter than the {MAX_RECORD_BYTES} bytes a record \
             name may have"
        ));
    }
    for (name, _, _, _, extra) in columns {
        if extra.to_ascii_lowercase().contains("auto_increment") {
            wrong.push(format!(
                "its `{name}` column is AUTO_INCREMENT, whose last-insert id would be read as the \
                 write count"
            ));
        }
    }
    if !table.before_triggers.is_empty() {
        wrong.push(format!(
            "it has BEFORE triggers ({}), which can change the mark or the write count the \
             guarded statement sets",
            table.before_triggers.join(", ")
        ));
    }
    let keys: Vec<String> = unique
        .iter()
        .filter(|(index, column, _)| !(index == "PRIMARY" && column.eq_ignore_ascii_case("id")))
        .map(|(index, column, _)| format!("{index}({column})"))
        .collect();
    if !keys.is_empty() {
        wrong.push(format!(
            "it has unique keys besides the primary key on `id` ({}), on which the upsert \
             could update another row",
            keys.join(", ")
        ));
    }
    if !unique
        .iter()
        .any(|(index, column, _)| index == "PRIMARY" && column.eq_ignore_ascii_case("id"))
    {
        wrong.push("its primary key is not `id`".to_owned());
    }
    if unique.iter().any(|(_, _, prefix)| *prefix) {
        wrong.push(
            "a unique key indexes only a prefix of its column (`id(4)`), so records sharing the \
             prefix are one row"
                .to_owned(),
        );
    }
    match table.engine.as_deref() {
        Some(engine) if engine.eq_ignore_ascii_case("InnoDB") => {}
        Some(engine) => wrong.push(format!(
            "its engine is {engine}, not InnoDB (which locks the row for the statement and keeps \
             a committed mark through a crash)"
        )),
        None => wrong.push("its engine is unknown".to_owned()),
    }
    (!wrong.is_empty()).then(|| wrong.join("; "))
}

/// Runs the guarded statement twice on a temporary table's row and checks
/// the counts the adapter relies on: 1 for an insert, 0 for a row left as
/// it was. Anything else (`CLIENT_FOUND_ROWS` set somewhere on the way)
/// would make a fenced-out write read as applied.
async fn check_affected_rows(conn: &mut Conn) -> Result<(), FenceError> {
    const OP: &str = "checking the affected-row count";
    conn.query_drop(
        "CREATE TEMPORARY TABLE latchkey_fence_probe (id INT PRIMARY KEY, fence BIGINT UNSIGNED)",
    )
    .await
    .map_err(|e| store_error(OP, &e, &[]))?;
    let probe = "INSERT INTO latchkey_fence_probe (id, fence) VALUES (1, 5) \
                 ON DUPLICATE KEY UPDATE fence = IF(fence < 5, 5, fence)";
    let mut counts = [0u64; 2];
    for count in &mut counts {
        conn.query_drop(probe)
            .await
            .map_err(|e| store_error(OP, &e, &[]))?;
        *count = conn.affected_rows();
    }
    conn.query_drop("DROP TEMPORARY TABLE latchkey_fence_probe")
        .await
        .map_err(|e| store_error(OP, &e, &[]))?;
    if counts != [1, 0] {
        return Err(found_rows_refused(&format!(
            "the server reported {} then {} affected rows for an insert and an unchanged row \
             (expected 1 then 0)",
            counts[0], counts[1]
        )));
    }
    Ok(())
}

/// The reference table's `id` holds 255 bytes. A longer name is refused
/// before any statement: without a strict `sql_mode` the server would cut
/// it and the write would land on another record (the hostile review).
const MAX_RECORD_BYTES: usize = 255;

fn check_record(record: &str) -> Result<(), FenceError> {
    if record.len() > MAX_RECORD_BYTES {
        return Err(FenceError::store(
            KIND,
            "naming the record",
            format_args!(
                "the record name is {} bytes; the fenced table's id holds {MAX_RECORD_BYTES} \
                 (a longer one would be cut by a non-strict server and land on another record)",
                record.len()
            ),
            false,
            &[],
        ));
    }
    Ok(())
}

fn found_rows_refused(why: &str) -> FenceError {
    FenceError::store(
        KIND,
        "checking the affected-row count",
        format!(
            "{why}: with CLIENT_FOUND_ROWS an unchanged (fenced-out) row counts as 1 affected, \
             the same as an insert, so the fence's answer cannot be read; connect without \
             client_found_rows"
        ),
        false,
        &[],
    )
}

/// A driver error as a [`FenceError`], scrubbed of `secrets`. Only the
/// error's text is kept (its `Debug` can hold a row's values).
pub fn store_error(op: &'static str, err: &mysql_async::Error, secrets: &[u64]) -> FenceError {
    use mysql_async::Error as E;
    let (message, transient) = match err {
        E::Server(s) => (
            format!("{} (errno {}, SQLSTATE {})", s.message, s.code, s.state),
            // lock wait timeout, deadlock, too many connections, shutdown,
            // connection killed, read-only (a failover in progress)
            matches!(s.code, 1205 | 1213 | 1040 | 1053 | 1927 | 1290 | 1792),
        ),
        E::Io(_) => (err.to_string(), true),
        E::Driver(mysql_async::DriverError::ConnectionClosed) => (err.to_string(), true),
        E::Driver(mysql_async::DriverError::PoolDisconnected) => (err.to_string(), false),
        // FromValue/FromRow errors hold the value: say only what kind.
        E::Driver(mysql_async::DriverError::FromValue { .. })
        | E::Driver(mysql_async::DriverError::FromRow { .. }) => (
            "a column did not convert to the expected type".to_owned(),
            false,
        ),
        _ => (err.to_string(), false),
    };
    FenceError::store(KIND, op, message, transient, secrets)
}

impl FencedStore for MysqlStore {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn guarded_write<'a>(
        &'a self,
        record: &'a str,
        token: u64,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<Guarded, FenceError>> {
        Box::pin(async move {
            check_record(record)?;
            let mut conn = self.conn("guarded write").await?;
            let id = record.as_bytes();
            conn.exec_drop(
                GUARDED_WRITE_SQL,
                (id, token, payload, token, payload, token, token, token),
            )
            .await
            .map_err(|e| store_error("guarded write", &e, &[token]))?;
            let count = conn.affected_rows();
            match Affected::from_count(count) {
                Some(Affected::Inserted | Affected::Updated) => {
                    let version = match conn.last_insert_id() {
                        Some(version) if version > 0 => Some(version),
                        // A trigger on the table (an audit trigger that
                        // inserts elsewhere) leaves the OK packet's id 0;
                        // the connection's LAST_INSERT_ID() still holds the
                        // statement's value (triggers' changes are undone
                        // when they end).
                        _ => conn
                            .query_first::<u64, _>("SELECT LAST_INSERT_ID()")
                            .await
                            .map_err(|e| store_error("reading the write count", &e, &[token]))?
                            .filter(|v| *v > 0),
                    };
                    match version {
                        Some(version) => Ok(Guarded::Applied { version }),
                        // The write landed; only its version is unknown.
                        // Not a fence answer to guess at.
                        None => Err(FenceError::store(
                            KIND,
                            "guarded write",
                            "the write was applied but the server reports no last-insert id \
                             (the record's write count)",
                            false,
                            &[token],
                        )),
                    }
                }
                // Left as it was: a mark at or above the token, or none at
                // all (read says which). The read only reports.
                Some(Affected::Unchanged) => match Self::read_with(&mut conn, record).await? {
                    Some(found) => Ok(Guarded::FencedOut { mark: found.mark }),
                    // Nothing changed, yet the record is not there: the
                    // insert met another unique key (and left that row), or
                    // the record was deleted since. Not a fence answer.
                    None => Err(FenceError::store(
                        KIND,
                        "guarded write",
                        "0 rows affected and the record is missing: the table has another \
                         unique key (the upsert matched another row), or the record was \
                         deleted meanwhile; nothing was written",
                        false,
                        &[token],
                    )),
                },
                None => Err(FenceError::store(
                    KIND,
                    "guarded write",
                    format!(
                        "{count} rows affected by a write of one record (expected 0, 1 or 2): \
                         the table has another unique key, or the count is not MySQL's; \
                         refusing to read it"
                    ),
                    false,
                    &[token],
                )),
            }
        })
    }

    fn read<'a>(&'a self, record: &'a str) -> BoxFuture<'a, Result<Option<Record>, FenceError>> {
        Box::pin(async move {
            let mut conn = self.conn("reading a record").await?;
            Self::read_with(&mut conn, record).await
        })
    }

    fn plain_write<'a>(
        &'a self,
        record: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), FenceError>> {
        Box::pin(async move {
            check_record(record)?;
            let mut conn = self.conn("plain write").await?;
            conn.exec_drop(PLAIN_WRITE_SQL, (record.as_bytes(), payload, payload))
                .await
                .map_err(|e| store_error("plain write", &e, &[]))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_names_longer_than_the_id_column_are_refused() {
        assert!(check_record(&"a".repeat(255)).is_ok());
        let err = check_record(&"a".repeat(256)).unwrap_err();
        assert!(err.to_string().contains("256 bytes"), "{err}");
        assert!(!err.is_transient());
    }

    #[test]
    fn only_the_documented_counts_are_read() {
        assert_eq!(Affected::from_count(0), Some(Affected::Unchanged));
        assert_eq!(Affected::from_count(1), Some(Affected::Inserted));
        assert_eq!(Affected::from_count(2), Some(Affected::Updated));
        assert_eq!(Affected::from_count(3), None);
    }

    #[test]
    fn the_statement_compares_strictly_and_assigns_the_payload_first() {
        let sql = GUARDED_WRITE_SQL;
        assert!(!sql.contains("<="), "{sql}");
        assert_eq!(sql.matches("fence < ?").count(), 3, "{sql}");
        let payload = sql.find("payload = IF").unwrap();
        let writes = sql.find("writes  = IF").unwrap();
        let fence = sql.find("fence   = IF").unwrap();
        assert!(payload < fence, "payload must be assigned before fence");
        assert!(writes < fence, "writes must be assigned before fence");
        assert_eq!(sql.matches('?').count(), 8);
        assert!(!sql.contains(';'));
    }

    #[test]
    fn a_foreign_table_is_refused_with_what_differs() {
        let col = |n: &str, d: &str, c: &str, len: u64| {
            (n.to_owned(), d.to_owned(), c.to_owned(), len, String::new())
        };
        let reference = vec![
            col("id", "varbinary", "varbinary(255)", 255),
            col("fence", "bigint", "bigint(20) unsigned", 0),
            col("payload", "longblob", "longblob", 4294967295),
            col("writes", "bigint", "bigint(20) unsigned", 0),
        ];
        let primary = vec![("PRIMARY".to_owned(), "id".to_owned(), false)];
        let table = |columns: Vec<_>, unique: Vec<_>, before_triggers: Vec<String>| Table {
            columns,
            unique,
            before_triggers,
            engine: Some("InnoDB".to_owned()),
        };
        assert_eq!(
            schema_problems(&table(reference.clone(), primary.clone(), vec![])),
            None
        );

        let older = vec![
            col("id", "varchar", "varchar(255)", 255),
            col("fence", "bigint", "bigint(20)", 0),
            col("payload", "longblob", "longblob", 4294967295),
        ];
        let mut unique = primary.clone();
        unique.push(("one_payload".to_owned(), "payload".to_owned(), false));
        let why = schema_problems(&table(older, unique, vec![])).unwrap();
        assert!(why.contains("`id` column is varchar(255)"), "{why}");
        assert!(
            why.contains("`fence` column is bigint(20), not bigint unsigned"),
            "{why}"
        );
        assert!(why.contains("no `writes` column"), "{why}");
        assert!(why.contains("one_payload(payload)"), "{why}");
        let why = schema_problems(&table(reference.clone(), vec![], vec![])).unwrap();
        assert!(why.contains("primary key is not `id`"), "{why}");

        // A short id aliases records on a lax server; BINARY pads; an
        // AUTO_INCREMENT column and BEFORE triggers corrupt the answer.
        let mut short = reference.clone();
        short[0] = col("id", "varbinary", "varbinary(16)", 16);
        let why = schema_problems(&table(short, primary.clone(), vec![])).unwrap();
        assert!(why.contains("shorter than the 255 bytes"), "{why}");
        let mut padded = reference.clone();
        padded[0] = col("id", "binary", "binary(255)", 255);
        assert!(schema_problems(&table(padded, primary.clone(), vec![])).is_some());
        let mut counted = reference.clone();
        counted.push((
            "seq".into(),
            "bigint".into(),
            "bigint(20)".into(),
            0,
            "auto_increment".into(),
        ));
        let why = schema_problems(&table(counted, primary.clone(), vec![])).unwrap();
        assert!(why.contains("`seq` column is AUTO_INCREMENT"), "{why}");
        let why = schema_problems(&table(reference, primary, vec!["keep_mark".into()])).unwrap();
        assert!(why.contains("BEFORE triggers (keep_mark)"), "{why}");

        // A prefix primary key (`id(4)`) makes `acct-1` and `acct-2` one row;
        // a BLACKHOLE table keeps no mark.
        let prefix = vec![("PRIMARY".to_owned(), "id".to_owned(), true)];
        let why = schema_problems(&table(reference_for_tests(), prefix, vec![])).unwrap();
        assert!(why.contains("only a prefix"), "{why}");
        let mut blackhole = table(
            reference_for_tests(),
            vec![("PRIMARY".to_owned(), "id".to_owned(), false)],
            vec![],
        );
        blackhole.engine = Some("BLACKHOLE".to_owned());
        let why = schema_problems(&blackhole).unwrap();
        assert!(why.contains("engine is BLACKHOLE"), "{why}");
    }

    fn reference_for_tests() -> Vec<(String, String, String, u64, String)> {
        [
            ("id", "varbinary", "varbinary(255)", 255),
            ("fence", "bigint", "bigint(20) unsigned", 0),
            ("payload", "longblob", "longblob", 4294967295),
            ("writes", "bigint", "bigint(20) unsigned", 0),
        ]
        .into_iter()
        .map(|(n, d, c, l)| (n.to_owned(), d.to_owned(), c.to_owned(), l, String::new()))
        .collect()
    }

    #[test]
    fn a_found_rows_url_is_refused() {
        let opts =
            Opts::from_url("mysql://u:secret@127.0.0.1:1/db?client_found_rows=true").unwrap();
        assert!(opts.client_found_rows());
        let plain = Opts::from_url("mysql://u:secret@127.0.0.1:1/db").unwrap();
        assert!(!plain.client_found_rows(), "mysql_async's default changed");
    }

    #[tokio::test]
    async fn connect_refuses_found_rows_before_connecting_and_hides_the_password() {
        let err =
            match MysqlStore::connect("mysql://u:hunter2@127.0.0.1:1/db?client_found_rows=true")
                .await
            {
                Ok(_) => panic!("accepted client_found_rows"),
                Err(e) => e,
            };
        let text = format!("{err} {err:?}");
        assert!(text.contains("CLIENT_FOUND_ROWS"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(!err.is_transient());
    }
}
