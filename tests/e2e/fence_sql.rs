//! The SQL fence adapters (issue 35) against real servers: the reference
//! PostgreSQL fence behind the adapter contract, and the MySQL/MariaDB fence
//! on a private MariaDB (tests/src/mariadb.rs), with the affected-row counts
//! it reads pinned.

use std::sync::Arc;

use anyhow::Context;
use latchkey_fence::{FenceError, FencedStore, Guarded, Mark};
use latchkey_fence_mysql::{self as mysql_fence, MysqlStore};
use latchkey_fence_postgres::PostgresStore;
use latchkey_tests::fence_contract::{EPOCH, check_contract, check_race, ensure_scrubbed};
use latchkey_tests::mariadb::MariaDbServer;
use latchkey_tests::postgres::PostgresServer;
use mysql_async::prelude::Queryable;

// --- PostgreSQL ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn postgres_store_keeps_the_contract() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let pg = PostgresServer::start().await?;
    let store = PostgresStore::connect(&pg.url()).await?;
    assert_eq!(store.kind(), "postgresql");
    check_contract(&store, "pg").await?;
    check_race(
        Arc::new(PostgresStore::connect(&pg.url()).await?),
        "pg/race",
    )
    .await?;

    // A token above bigint is refused before PostgreSQL sees it.
    let huge = u64::MAX - 3;
    let err = store
        .guarded_write("pg/r1", huge, b"huge")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::TokenOutOfRange {
                store: "postgresql"
            }
        ),
        "{err}"
    );
    ensure_scrubbed(&err, huge)?;

    // The reference table's fence is NOT NULL: no record there lacks a mark.
    assert!(store.read("pg/unknown").await?.is_none());
    let db = pg.client().await?;

    // PostgreSQL's DETAIL would echo the token; the error must not.
    db.batch_execute("CREATE UNIQUE INDEX one_mark ON latchkey_fenced_rows (fence)")
        .await?;
    let token = EPOCH + 777;
    assert!(
        store
            .guarded_write("pg/u1", token, b"a")
            .await?
            .is_applied()
    );
    let err = store.guarded_write("pg/u2", token, b"b").await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("one_mark"), "{text}");
    ensure_scrubbed(&err, token)?;
    assert!(!err.is_transient());
    db.batch_execute("DROP INDEX one_mark").await?;

    // A negative mark is no token's: never overwritten (it compares below
    // every token), refused as unfenced, and left as it was.
    db.batch_execute("INSERT INTO latchkey_fenced_rows VALUES ('pg/negative', -1, 'theirs', 1)")
        .await?;
    let err = store
        .guarded_write("pg/negative", EPOCH + 5, b"ours")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::Unfenced {
                store: "postgresql",
                ..
            }
        ),
        "{err}"
    );
    let payload: String = db
        .query_one(
            "SELECT payload FROM latchkey_fenced_rows WHERE id = 'pg/negative'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(payload, "theirs");

    // A BEFORE row trigger could undo the mark the statement sets: refused
    // at connect.
    db.batch_execute(
        "CREATE FUNCTION keep_mark() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN NEW.fence := OLD.fence; RETURN NEW; END $$; \
         CREATE TRIGGER keep_mark BEFORE UPDATE ON latchkey_fenced_rows \
           FOR EACH ROW EXECUTE FUNCTION keep_mark()",
    )
    .await?;
    let err = match PostgresStore::connect(&pg.url()).await {
        Ok(_) => anyhow::bail!("a table with a BEFORE trigger was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("BEFORE row triggers (keep_mark)"), "{err}");
    db.batch_execute("DROP TRIGGER keep_mark ON latchkey_fenced_rows")
        .await?;

    // A second unique index on `id` (here case-folded): `ON CONFLICT (id)`
    // may take it, and `Orders` would land on `orders`. Refused at connect.
    db.batch_execute("CREATE UNIQUE INDEX folded ON latchkey_fenced_rows (lower(id))")
        .await?;
    let err = match PostgresStore::connect(&pg.url()).await {
        Ok(_) => anyhow::bail!("a second unique index was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("2 unique indexes"), "{err}");
    db.batch_execute("DROP INDEX folded").await?;
    assert!(PostgresStore::connect(&pg.url()).await.is_ok());

    // A table of the reference name that is not the fence's (an older
    // version's, someone else's) is refused at connect, saying what differs.
    db.batch_execute(
        "ALTER TABLE latchkey_fenced_rows RENAME TO kept; \
         CREATE TABLE latchkey_fenced_rows (id text PRIMARY KEY, fence text NOT NULL, payload text NOT NULL)",
    )
    .await?;
    let err = match PostgresStore::connect(&pg.url()).await {
        Ok(_) => anyhow::bail!("a table with a text fence column was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("`fence` column is text, not bigint"), "{err}");
    assert!(err.contains("no `writes` column"), "{err}");

    // A view of the reference name routes writes to a table nobody checked.
    db.batch_execute(
        "DROP TABLE latchkey_fenced_rows; \
         CREATE VIEW latchkey_fenced_rows AS SELECT * FROM kept",
    )
    .await?;
    let err = match PostgresStore::connect(&pg.url()).await {
        Ok(_) => anyhow::bail!("a view was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("not a plain table"), "{err}");
    Ok(())
}

// --- MariaDB -------------------------------------------------------------------

/// The affected-row counts the adapter reads, as the server reports them
/// through mysql_async: 1 inserted, 2 updated, 0 left as it was; and with
/// CLIENT_FOUND_ROWS, 1 for a row left as it was (the same as an insert),
/// which is why the adapter refuses that flag.
#[tokio::test(flavor = "multi_thread")]
async fn mariadb_affected_rows_are_pinned() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let db = MariaDbServer::start().await?;
    // Creates the table (and runs the adapter's own probe).
    let _store = MysqlStore::connect(&db.url()).await?;
    let base = EPOCH;
    let counts = |found_rows: bool| {
        let url = format!("{}?client_found_rows={found_rows}", db.url());
        async move {
            let mut conn = mysql_async::Conn::new(mysql_async::Opts::from_url(&url)?).await?;
            let mut counts = Vec::new();
            let record = format!("pin/{found_rows}");
            for (token, payload) in [
                (base + 1, "a"),
                (base + 2, "b"),
                (base + 2, "c"),
                (base + 1, "d"),
            ] {
                conn.exec_drop(
                    mysql_fence::GUARDED_WRITE_SQL,
                    (
                        record.as_bytes(),
                        token,
                        payload,
                        token,
                        payload,
                        token,
                        token,
                        token,
                    ),
                )
                .await?;
                counts.push((conn.affected_rows(), conn.last_insert_id()));
            }
            anyhow::Ok(counts)
        }
    };
    // insert, update, same token (unchanged), older token (unchanged); an
    // applied write's version (the write count) is the OK packet's
    // last-insert id, which LAST_INSERT_ID(expr) set.
    let without = counts(false).await?;
    assert_eq!(
        without.iter().map(|c| c.0).collect::<Vec<_>>(),
        [1, 2, 0, 0]
    );
    assert_eq!((without[0].1, without[1].1), (Some(1), Some(2)));
    assert_eq!(
        counts(true).await?.iter().map(|c| c.0).collect::<Vec<_>>(),
        [1, 2, 1, 1],
        "CLIENT_FOUND_ROWS: unchanged reads as 1"
    );

    // The adapter refuses the flag, and says why without the password.
    let err = match MysqlStore::connect(&format!("{}?client_found_rows=true", db.url())).await {
        Ok(_) => anyhow::bail!("the adapter accepted CLIENT_FOUND_ROWS"),
        Err(e) => e,
    };
    let text = format!("{err} {err:?}");
    assert!(text.contains("CLIENT_FOUND_ROWS"), "{text}");
    assert!(!text.contains(db.password()), "the password leaked: {text}");

    // Assignment order: with fence assigned first, the payload's IF already
    // sees the new mark, and the "write" raises the mark without the payload.
    let mut conn = db.conn().await?;
    let reversed = "INSERT INTO latchkey_fenced_rows (id, fence, payload) VALUES (?, ?, ?)
        ON DUPLICATE KEY UPDATE fence = IF(fence < ?, ?, fence), payload = IF(fence < ?, ?, payload)";
    for (token, payload) in [(base + 1, "first"), (base + 2, "second")] {
        conn.exec_drop(
            reversed,
            (
                b"pin/order".as_slice(),
                token,
                payload,
                token,
                token,
                token,
                payload,
            ),
        )
        .await?;
    }
    let (fence, payload): (u64, Vec<u8>) = conn
        .exec_first(
            "SELECT fence, payload FROM latchkey_fenced_rows WHERE id = ?",
            (b"pin/order".as_slice(),),
        )
        .await?
        .context("the record")?;
    assert!(
        fence == base + 2 && payload == b"first",
        "the reversed order writes the mark only"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn mariadb_store_keeps_the_contract() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let db = MariaDbServer::start().await?;
    let store = MysqlStore::connect(&db.url()).await?;
    assert_eq!(store.kind(), "mysql");
    check_contract(&store, "my").await?;
    check_race(Arc::new(MysqlStore::connect(&db.url()).await?), "my/race").await?;

    // BIGINT UNSIGNED holds every token.
    assert_eq!(
        store.guarded_write("my/max", u64::MAX - 1, b"x").await?,
        Guarded::Applied { version: 1 }
    );
    assert_eq!(
        store.guarded_write("my/max", u64::MAX, b"y").await?,
        Guarded::Applied { version: 2 }
    );
    assert!(matches!(
        store.guarded_write("my/max", u64::MAX, b"z").await?,
        Guarded::FencedOut { mark } if mark == Mark::new(u64::MAX)
    ));

    // Record names compare byte for byte (VARBINARY): case matters.
    assert!(
        store
            .guarded_write("my/Case", EPOCH, b"upper")
            .await?
            .is_applied()
    );
    assert!(
        store
            .guarded_write("my/case", EPOCH, b"lower")
            .await?
            .is_applied()
    );

    // A record without a mark (fence NULL) is refused, and left as it was.
    let mut conn = db.conn().await?;
    conn.query_drop(
        "INSERT INTO latchkey_fenced_rows (id, fence, payload) VALUES ('my/legacy', NULL, 'theirs')",
    )
    .await?;
    let err = store
        .guarded_write("my/legacy", EPOCH + 5, b"ours")
        .await
        .unwrap_err();
    assert!(
        matches!(err, FenceError::Unfenced { store: "mysql", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("NULL"), "{err}");
    let payload: Option<Vec<u8>> = conn
        .exec_first(
            "SELECT payload FROM latchkey_fenced_rows WHERE id = 'my/legacy'",
            (),
        )
        .await?;
    assert_eq!(payload.as_deref(), Some(b"theirs".as_slice()));
    assert!(matches!(
        store.read("my/legacy").await,
        Err(FenceError::Unfenced { .. })
    ));

    // A server error that echoes the token (here a trigger's message, as
    // "Duplicate entry '…'" would) never shows it.
    conn.query_drop(
        "CREATE TRIGGER no_boom BEFORE INSERT ON latchkey_fenced_rows FOR EACH ROW \
         BEGIN \
           DECLARE m VARCHAR(128) DEFAULT CONCAT('no boom at ', NEW.fence); \
           IF NEW.payload = 'boom' THEN SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = m; END IF; \
         END",
    )
    .await?;
    let token = EPOCH + 4242;
    let err = store
        .guarded_write("my/u1", token, b"boom")
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("no boom at <redacted>"), "{text}");
    ensure_scrubbed(&err, token)?;
    assert!(!err.is_transient());

    // Triggers that insert elsewhere (an audit table with its own
    // AUTO_INCREMENT) leave the OK packet without the write count; the
    // version is still the record's count.
    conn.query_drop(
        "CREATE TABLE audit_rows (n INT AUTO_INCREMENT PRIMARY KEY, f BIGINT UNSIGNED)",
    )
    .await?;
    for (name, event) in [("audit_ins", "INSERT"), ("audit_upd", "UPDATE")] {
        conn.query_drop(format!(
            "CREATE TRIGGER {name} AFTER {event} ON latchkey_fenced_rows FOR EACH ROW \
             INSERT INTO audit_rows (f) VALUES (NEW.fence)"
        ))
        .await?;
    }
    for (i, version) in (1..=3u64).enumerate() {
        assert_eq!(
            store
                .guarded_write("my/audited", EPOCH + 100 + i as u64, b"a")
                .await?,
            Guarded::Applied { version },
            "write {version} under audit triggers"
        );
    }

    // BEFORE triggers (one that keeps the old mark lets a stale write
    // land and read as applied) are refused at connect; AFTER triggers
    // (the audit ones above) are fine.
    conn.query_drop(
        "CREATE TRIGGER keep_mark BEFORE UPDATE ON latchkey_fenced_rows FOR EACH ROW \
         SET NEW.fence = OLD.fence",
    )
    .await?;
    let err = match MysqlStore::connect(&db.url()).await {
        Ok(_) => anyhow::bail!("a table with a BEFORE trigger was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("BEFORE triggers"), "{err}");
    assert!(err.contains("keep_mark"), "{err}");
    conn.query_drop("DROP TRIGGER keep_mark").await?;

    // A table of the reference name that is not the fence's (a VARCHAR id
    // compares case-insensitively, a signed fence, a second unique key) is
    // refused at connect, saying what differs.
    conn.query_drop("RENAME TABLE latchkey_fenced_rows TO kept")
        .await?;
    conn.query_drop(
        "CREATE TABLE latchkey_fenced_rows (id VARCHAR(255) PRIMARY KEY, fence BIGINT NULL, \
           payload LONGBLOB NOT NULL, writes BIGINT UNSIGNED NOT NULL DEFAULT 0, \
           tag INT, UNIQUE KEY one_tag (tag))",
    )
    .await?;
    let err = match MysqlStore::connect(&db.url()).await {
        Ok(_) => anyhow::bail!("a foreign table was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("`id` column is varchar(255)"), "{err}");
    assert!(err.contains("`fence` column is bigint"), "{err}");
    assert!(err.contains("one_tag(tag)"), "{err}");
    // A lax server would cut a long name onto another record: the adapter's
    // sessions are strict, so a too-long id is an error there, not an alias.
    conn.query_drop("DROP TABLE latchkey_fenced_rows").await?;
    conn.query_drop(
        "CREATE TABLE latchkey_fenced_rows (id VARBINARY(16) NOT NULL PRIMARY KEY, \
           fence BIGINT UNSIGNED NULL, payload LONGBLOB NOT NULL, \
           writes BIGINT UNSIGNED NOT NULL DEFAULT 0)",
    )
    .await?;
    let err = match MysqlStore::connect(&db.url()).await {
        Ok(_) => anyhow::bail!("a 16-byte id column was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("shorter than the 255 bytes"), "{err}");
    assert!(!err.contains(db.password()), "{err}");
    Ok(())
}
