//! The reference fence's guarded read for shared holders (issue 34) on a
//! real PostgreSQL: a read with token `t` is accepted only while the
//! record's write mark is at or below `t`, and raises the read mark to `t`
//! in the same statement, after which no write with a token at or below it
//! lands (docs/fencing.md, "Fenced reads"). Marks are compared in-process;
//! nothing here prints one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, ensure};
use latchkey_fence::{FenceError, FencedStore, Guarded, Mark};
use latchkey_fence_postgres::{
    self as fence, PostgresStore, READ_REFUSED, ReadOutcome, UpdateOutcome,
};
use latchkey_tests::fence_contract::{EPOCH, ensure_scrubbed};
use latchkey_tests::postgres::PostgresServer;

/// The record's read mark as stored.
async fn read_mark(db: &tokio_postgres::Client, record: &str) -> anyhow::Result<i64> {
    let row = db
        .query_one(
            "SELECT read_fence FROM latchkey_fenced_rows WHERE id = $1",
            &[&record],
        )
        .await?;
    Ok(row.try_get(0)?)
}

fn mark(token: u64) -> Mark {
    Mark::new(token)
}

#[tokio::test(flavor = "multi_thread")]
async fn guarded_reads_refuse_after_a_newer_write_and_fence_out_stale_writers() -> anyhow::Result<()>
{
    latchkey_tests::init_tracing();
    let pg = PostgresServer::start().await?;
    let store = PostgresStore::connect(&pg.url()).await?;
    let db = pg.client().await?;
    let base = EPOCH;
    let r = "reads/r1";

    // A record no write has created: current, nothing written yet. The read
    // leaves a row carrying its read mark, which plain reads do not see.
    let got = store.guarded_read(r, base + 10).await?;
    ensure!(
        got == ReadOutcome::Current {
            payload: None,
            write_seq: 0
        },
        "a missing record reads as current and empty: {got:?}"
    );
    ensure!(
        store.read(r).await?.is_none(),
        "a read-only row is no record"
    );
    ensure!(read_mark(&db, r).await? == i64::try_from(base + 10)?);

    // A stale writer (granted before the reader: a smaller token) is fenced
    // out by the read mark alone, and so is one with the reader's token.
    for stale in [base + 5, base + 10] {
        let g = store.guarded_write(r, stale, b"stale").await?;
        ensure!(
            g == Guarded::FencedOut {
                mark: mark(base + 10)
            },
            "a write at or below the read mark is fenced out, reporting the read mark: {g}"
        );
    }
    ensure!(store.read(r).await?.is_none(), "nothing was written");

    // A writer granted after the reader writes.
    let g = store.guarded_write(r, base + 20, b"twenty").await?;
    ensure!(
        g == Guarded::Applied { version: 1 },
        "a newer writer writes: {g}"
    );

    // The reader whose hold that writer ended is refused, with its reason.
    let got = store.guarded_read(r, base + 15).await?;
    ensure!(
        got == ReadOutcome::WrittenSince,
        "a read below the write mark is refused: {got:?}"
    );
    ensure!(got.to_string() == READ_REFUSED);
    ensure!(!got.to_string().contains(&(base + 15).to_string()));

    // Readers granted after that writer read it (the mark's own token is no
    // later writer's), and readers with different tokens do not refuse each
    // other: a smaller token after a larger one still reads, and the read
    // mark is never lowered.
    for t in [base + 20, base + 25, base + 22] {
        let got = store.guarded_read(r, t).await?;
        let ReadOutcome::Current { payload, write_seq } = got else {
            bail!("a reader above the write mark reads: {got:?}");
        };
        ensure!(payload.as_deref() == Some("twenty") && write_seq == 1);
    }
    ensure!(read_mark(&db, r).await? == i64::try_from(base + 25)?);

    // Writers meet the read mark: below it fenced out, above it written.
    let g = store.guarded_write(r, base + 23, b"stale again").await?;
    ensure!(
        g == Guarded::FencedOut {
            mark: mark(base + 25)
        },
        "{g}"
    );
    let g = store.guarded_write(r, base + 30, b"thirty").await?;
    ensure!(g == Guarded::Applied { version: 2 }, "{g}");
    ensure!(
        store.guarded_read(r, base + 25).await? == ReadOutcome::WrittenSince,
        "the last readers' hold is over"
    );
    // A refused read changes nothing.
    ensure!(read_mark(&db, r).await? == i64::try_from(base + 25)?);

    // The plain UPDATE form compares the read mark too.
    let read = fence::guarded_read(&db, r, base + 40).await?;
    ensure!(read.is_current(), "{read:?}");
    let u = fence::guarded_update(&db, r, base + 35, "stale update").await?;
    ensure!(u == UpdateOutcome::FencedOutOrMissing, "{u:?}");
    let u = fence::guarded_update(&db, r, base + 45, "fresh update").await?;
    ensure!(u == UpdateOutcome::Updated, "{u:?}");

    // A token above bigint is refused before PostgreSQL sees it, and never
    // printed.
    let huge = u64::MAX - 11;
    let err = match store.guarded_read(r, huge).await {
        Ok(got) => bail!("a token above bigint was read with: {got:?}"),
        Err(e) => e,
    };
    ensure!(
        matches!(
            err,
            FenceError::TokenOutOfRange {
                store: "postgresql"
            }
        ),
        "{err}"
    );
    ensure_scrubbed(&err, huge)?;

    // A negative mark is no token's: the read is refused as unfenced, not
    // answered "written since".
    db.batch_execute("INSERT INTO latchkey_fenced_rows VALUES ('reads/negative', -1, 'theirs', 1)")
        .await?;
    let token = base + 50;
    match store.guarded_read("reads/negative", token).await {
        Err(e @ FenceError::Unfenced { .. }) => ensure_scrubbed(&e, token)?,
        other => bail!("a negative mark must be unfenced: {other:?}"),
    }
    Ok(())
}

/// A table made before guarded reads (no `read_fence`) gains the read mark
/// at connect, its rows at 0; a `read_fence` that is not `bigint` is refused.
#[tokio::test(flavor = "multi_thread")]
async fn an_older_reference_table_gains_the_read_mark() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let pg = PostgresServer::start().await?;
    let db = pg.client().await?;
    db.batch_execute(
        "CREATE TABLE latchkey_fenced_rows (
            id text PRIMARY KEY, fence bigint NOT NULL, payload text NOT NULL, writes bigint NOT NULL);
         INSERT INTO latchkey_fenced_rows VALUES ('old/r1', 281474976710666, 'kept', 3)",
    )
    .await?;
    let store = PostgresStore::connect(&pg.url()).await?;
    ensure!(read_mark(&db, "old/r1").await? == 0);
    let base = EPOCH;
    let got = store.guarded_read("old/r1", base + 12).await?;
    ensure!(
        got == ReadOutcome::Current {
            payload: Some("kept".to_owned()),
            write_seq: 3
        },
        "{got:?}"
    );
    let g = store.guarded_write("old/r1", base + 11, b"stale").await?;
    ensure!(!g.is_applied(), "{g}");
    // Connecting again changes nothing.
    drop(PostgresStore::connect(&pg.url()).await?);
    ensure!(read_mark(&db, "old/r1").await? == i64::try_from(base + 12)?);

    db.batch_execute(
        "ALTER TABLE latchkey_fenced_rows DROP COLUMN read_fence;
         ALTER TABLE latchkey_fenced_rows ADD COLUMN read_fence text NOT NULL DEFAULT '0'",
    )
    .await?;
    let err = match PostgresStore::connect(&pg.url()).await {
        Ok(_) => bail!("a text read mark was accepted"),
        Err(e) => e.to_string(),
    };
    ensure!(
        err.contains("`read_fence` column is text, not bigint"),
        "{err}"
    );
    Ok(())
}

/// The compare and the raise are one statement: stale writers (tokens
/// below the reader's) racing one guarded read never land after it. Each
/// round, the writes that landed all have write counts at or below the one
/// the read saw, and every write invoked after the read returned is refused.
#[tokio::test(flavor = "multi_thread")]
async fn no_stale_write_lands_after_a_racing_guarded_read() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let pg = PostgresServer::start().await?;
    let mut writers = Vec::new();
    for _ in 0..4 {
        writers.push(Arc::new(PostgresStore::connect(&pg.url()).await?));
    }
    let reader = PostgresStore::connect(&pg.url()).await?;
    let base = EPOCH;
    let (mut mid_stream, mut after_read) = (0usize, 0usize);
    for round in 0..40u64 {
        let record = format!("race/{round}");
        let reader_token = base + 1_000;
        let read_done = Arc::new(AtomicBool::new(false));
        let tasks: Vec<_> = writers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let (w, record, read_done) =
                    (Arc::clone(w), record.clone(), Arc::clone(&read_done));
                tokio::spawn(async move {
                    // (version if it landed, invoked after the read returned)
                    let mut attempts = Vec::new();
                    for n in 0..5u64 {
                        // Rising tokens per writer, all below the reader's.
                        let token = base + 1 + n * 10 + i as u64;
                        let after = read_done.load(Ordering::SeqCst);
                        let landed = match w.guarded_write(&record, token, b"stale").await? {
                            Guarded::Applied { version } => Some(version),
                            _ => None,
                        };
                        attempts.push((landed, after));
                        tokio::time::sleep(Duration::from_micros(700)).await;
                    }
                    anyhow::Ok(attempts)
                })
            })
            .collect();
        // Somewhere among the writes: first, or after some have landed.
        tokio::time::sleep(Duration::from_micros((round % 8) * 600)).await;
        let got = reader.guarded_read(&record, reader_token).await?;
        read_done.store(true, Ordering::SeqCst);
        let ReadOutcome::Current { write_seq, .. } = got else {
            bail!("no write above the reader's token: the read is current ({got:?})");
        };
        let seen = u64::try_from(write_seq)?;
        let mut attempts = Vec::new();
        for task in tasks {
            attempts.extend(task.await??);
        }
        let landed: Vec<u64> = attempts.iter().filter_map(|(v, _)| *v).collect();
        ensure!(
            landed.iter().all(|&v| v <= seen),
            "round {round}: a stale write landed after the guarded read (write count {seen}, \
             landed {landed:?})"
        );
        ensure!(
            attempts.iter().all(|(v, after)| !after || v.is_none()),
            "round {round}: a stale write invoked after the read returned landed"
        );
        let late = attempts.iter().filter(|(_, after)| *after).count();
        if seen > 0 && late > 0 {
            mid_stream += 1;
        }
        after_read += late;
    }
    println!(
        "guarded read raced stale writers: {mid_stream} of 40 rounds read mid-stream; \
         {after_read} stale writes invoked after a read, all refused"
    );
    ensure!(mid_stream > 0, "no round raced the read against the writes");
    Ok(())
}
