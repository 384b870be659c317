//! Shared holds on the LockTable over the in-memory log, under paused time
//! (issue 34): readers together, a writer alone, phase-fair queues, readers
//! granted in one batch, an atomic downgrade, an upgrade refused.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::ArbiterError;
use latchkey_arbiter::epoch::EpochGuard;
use latchkey_arbiter::high_water::HighWater;
use latchkey_arbiter::records::reader_key;
use latchkey_arbiter::table::{Acquired, Grant, GrantRequest, LockTable, TableOptions};
use latchkey_sim::MemLog;
use tokio::task::JoinHandle;

const TTL: u32 = 5;
const WAIT: Option<Duration> = Some(Duration::from_secs(60));

fn table(log: &MemLog) -> Arc<LockTable> {
    LockTable::new(
        Arc::new(log.clone()),
        Arc::new(EpochGuard::default()),
        Arc::new(HighWater::in_memory(None)),
        TableOptions {
            poll: Duration::from_millis(200),
            seed: 11,
            ..TableOptions::default()
        },
    )
}

fn req(identity: &str, session: i64, key: &str, shared: bool) -> GrantRequest {
    GrantRequest {
        key: key.into(),
        identity: identity.into(),
        session,
        class: "demo".into(),
        ttl_seconds: TTL,
        annotations: Default::default(),
        routed_by: None,
        quota: None,
        permits: None,
        instance: String::new(),
        bound: String::new(),
        shared,
    }
}

/// A session of its own for `identity`, and a request of `key` in a mode.
async fn caller(t: &LockTable, identity: &str, key: &str, shared: bool) -> GrantRequest {
    let session = t.open_session(identity, TTL, 10).await.unwrap();
    req(identity, session, key, shared)
}

fn waiting(t: &Arc<LockTable>, r: &GrantRequest) -> JoinHandle<Result<Acquired, ArbiterError>> {
    let (t, r) = (t.clone(), r.clone());
    tokio::spawn(async move { t.acquire(r, WAIT, 16).await })
}

async fn queued(t: &LockTable, key: &str, n: usize) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while t.waiting(key) < n {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{key} has {} waiters, not {n}",
            t.waiting(key)
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

async fn release(t: &Arc<LockTable>, r: &GrantRequest, g: &Grant) -> anyhow::Result<()> {
    t.release(&r.identity, &g.key, r.session, g.token().unwrap_or(0))
        .await?;
    Ok(())
}

/// Two readers hold at once; a writer waits for both; a reader arriving
/// after the writer queues behind it (a waiting writer blocks later
/// readers) even though readers hold; each token is above the last
/// exclusive grant's, and the writer's above every reader's.
#[tokio::test(start_paused = true)]
async fn a_waiting_writer_keeps_later_readers_behind_it() -> anyhow::Result<()> {
    let log = MemLog::new(41);
    let t = table(&log);
    t.start().await?;
    let (r1, r2) = (
        caller(&t, "reader-1", "db", true).await,
        caller(&t, "reader-2", "db", true).await,
    );
    let g1 = t.acquire(r1.clone(), None, 16).await?.grant;
    let g2 = t.acquire(r2.clone(), None, 16).await?.grant;
    assert_eq!(g1.key, reader_key("db", r1.session));
    assert_eq!(g2.key, reader_key("db", r2.session));
    assert_eq!(t.reader_holders("db").await?.len(), 2);
    // Re-entrant: the same grant again.
    assert_eq!(t.acquire(r1.clone(), None, 16).await?.grant, g1);

    let w = caller(&t, "writer", "db", false).await;
    assert!(matches!(
        t.acquire(w.clone(), None, 16).await,
        Err(ArbiterError::Held { .. })
    ));
    let writer = waiting(&t, &w);
    queued(&t, "db", 1).await?;
    // A reader asking to upgrade while the writer waits: refused at once,
    // not queued behind a writer that waits for it.
    let upgrade = GrantRequest {
        shared: false,
        ..r1.clone()
    };
    assert!(matches!(
        t.acquire(upgrade, WAIT, 16).await,
        Err(ArbiterError::UpgradeRefused { .. })
    ));
    // A later reader: behind the writer, and a try-lock of one is HELD.
    let r3 = caller(&t, "reader-3", "db", true).await;
    let late = caller(&t, "reader-4", "db", true).await;
    assert!(matches!(
        t.acquire(late, None, 16).await,
        Err(ArbiterError::Held { .. })
    ));
    let reader = waiting(&t, &r3);
    queued(&t, "db", 2).await?;

    release(&t, &r1, &g1).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!writer.is_finished(), "the writer beside reader-2");
    release(&t, &r2, &g2).await?;
    let gw = writer.await??.grant;
    assert_eq!(gw.key, "db");
    assert!(gw.token() > g1.token() && gw.token() > g2.token());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!reader.is_finished(), "reader-3 beside the writer");
    release(&t, &w, &gw).await?;
    let g3 = reader.await??.grant;
    assert!(
        g3.token() > gw.token(),
        "a reader's token is above the writer's"
    );
    t.shutdown().await;
    Ok(())
}

/// Readers queued behind a writer are granted together when it releases:
/// one batch, so one revision (and one token value) for all of them.
#[tokio::test(start_paused = true)]
async fn readers_behind_a_writer_go_in_one_batch() -> anyhow::Result<()> {
    let log = MemLog::new(42);
    let t = table(&log);
    t.start().await?;
    let w = caller(&t, "writer", "db", false).await;
    let gw = t.acquire(w.clone(), None, 16).await?.grant;
    let mut readers = Vec::new();
    for i in 0..4 {
        let r = caller(&t, &format!("reader-{i}"), "db", true).await;
        readers.push(waiting(&t, &r));
        queued(&t, "db", i + 1).await?;
    }
    release(&t, &w, &gw).await?;
    let mut revisions = Vec::new();
    for r in readers {
        revisions.push(r.await??.grant.revision);
    }
    assert!(
        revisions
            .iter()
            .all(|r| *r == revisions[0] && *r > gw.revision),
        "{revisions:?}"
    );
    assert_eq!(t.reader_holders("db").await?.len(), 4);
    t.shutdown().await;
    Ok(())
}

/// A session's shared request of its exclusive hold downgrades it in one
/// transaction (a new grant above the old one; the exclusive hold gone, so
/// other readers join at once); its exclusive request of its shared hold is
/// refused UPGRADE_REFUSED, and writes nothing.
#[tokio::test(start_paused = true)]
async fn a_downgrade_is_one_step_and_an_upgrade_is_refused() -> anyhow::Result<()> {
    let log = MemLog::new(43);
    let t = table(&log);
    t.start().await?;
    let w = caller(&t, "writer", "db", false).await;
    let gw = t.acquire(w.clone(), None, 16).await?.grant;
    let other = caller(&t, "reader", "db", true).await;
    let reader = waiting(&t, &other);
    queued(&t, "db", 1).await?;
    let down = GrantRequest {
        shared: true,
        ..w.clone()
    };
    // With a reader queued, the downgrade is answered without queueing.
    let gd = t.acquire(down.clone(), WAIT, 16).await?.grant;
    assert_eq!(gd.key, reader_key("db", w.session));
    assert!(gd.revision > gw.revision);
    assert!(t.holder("db").await?.is_none(), "the exclusive hold ended");
    // The queued reader joins the downgraded holder.
    let gr = reader.await??.grant;
    assert!(gr.revision > gd.revision);
    let before = log.revision();
    let refused = t.acquire(w.clone(), WAIT, 16).await;
    assert!(
        matches!(refused, Err(ArbiterError::UpgradeRefused { .. })),
        "{refused:?}"
    );
    assert_eq!(log.revision(), before, "a refused upgrade writes nothing");
    // The old exclusive token releases nothing; the shared one does.
    assert!(release(&t, &w, &gw).await.is_err());
    release(&t, &down, &gd).await?;
    assert_eq!(t.reader_holders("db").await?.len(), 1);
    t.shutdown().await;
    Ok(())
}

/// A downgrade that names its exclusive hold's token (what the clients
/// send) converts that hold and nothing else: another token, another
/// session, or a hold that ended (a writer holding the key since) is
/// refused NOT_HELD with nothing written, never granted a fresh reader; a
/// repeat, on this arbiter or another, is answered with the hold the
/// downgrade made while it lives.
#[tokio::test(start_paused = true)]
async fn a_downgrade_from_converts_its_own_hold_and_nothing_else() -> anyhow::Result<()> {
    let log = MemLog::new(47);
    let t = table(&log);
    t.start().await?;
    let t2 = table(&log);
    t2.start().await?;
    let not_held = |r: Result<Grant, ArbiterError>, what: &str| {
        assert!(
            matches!(r, Err(ArbiterError::DowngradeNotHeld { .. })),
            "{what}: {r:?}"
        );
    };
    let w = caller(&t, "writer", "db", false).await;
    let down = GrantRequest {
        shared: true,
        ..w.clone()
    };
    let gw = t.acquire(w.clone(), None, 16).await?.grant;
    let token = gw.token().unwrap();
    let stranger = caller(&t, "writer", "db", true).await;
    let before = log.revision();
    not_held(t.downgrade_from(&down, token + 1).await, "another revision");
    not_held(
        t.downgrade_from(&stranger, token).await,
        "another session naming the token",
    );
    assert_eq!(log.revision(), before, "a refused downgrade writes nothing");

    let gd = t.downgrade_from(&down, token).await?;
    assert_eq!(gd.key, reader_key("db", w.session));
    assert!(gd.revision > gw.revision);
    assert!(t.holder("db").await?.is_none(), "the exclusive hold ended");
    let again = t2.downgrade_from(&down, token).await?;
    assert_eq!(
        (again.key.as_str(), again.revision),
        (gd.key.as_str(), gd.revision),
        "a repeat on another arbiter is answered with the same hold"
    );
    release(&t, &down, &gd).await?;
    let before = log.revision();
    not_held(
        t.downgrade_from(&down, token).await,
        "a repeat after the shared hold ended",
    );
    assert_eq!(log.revision(), before, "a refused downgrade writes nothing");

    // The hold ended before its downgrade came, and a writer holds the key.
    let gw2 = t.acquire(w.clone(), None, 16).await?.grant;
    release(&t, &w, &gw2).await?;
    let x = caller(&t2, "other", "db", false).await;
    let gx = t2.acquire(x.clone(), None, 16).await?.grant;
    let before = log.revision();
    not_held(
        t.downgrade_from(&down, gw2.token().unwrap()).await,
        "a downgrade of a hold that ended",
    );
    assert_eq!(log.revision(), before, "a refused downgrade writes nothing");
    assert_eq!(t.holder("db").await?.map(|h| h.lease), Some(x.session));
    assert!(
        t.reader_holders("db").await?.is_empty(),
        "no reader beside the writer"
    );
    release(&t2, &x, &gx).await?;
    t.shutdown().await;
    t2.shutdown().await;
    Ok(())
}

/// A queued reader's attempt never changes a hold its session took since
/// through another call. The simulation caught it: a shared wait timed out
/// while its attempt was on its way; the session's next call was granted
/// the lock exclusively; the attempt then found that hold and downgraded it,
/// and the shared hold (its caller gone) was released as an orphan — the
/// exclusive holder held nothing, and another writer was granted. Here the
/// session's exclusive call waits on a second arbiter, which the holder's
/// release hands the lock to, so the first arbiter's driver finds it.
#[tokio::test(start_paused = true)]
async fn a_queued_reader_never_downgrades_its_sessions_newer_exclusive_hold() -> anyhow::Result<()>
{
    let log = MemLog::new(47);
    let (a, b) = (table(&log), table(&log));
    a.start().await?;
    b.start().await?;
    let holder = caller(&a, "holder", "db", false).await;
    let held = a.acquire(holder.clone(), None, 16).await?.grant;
    let reader = caller(&a, "app", "db", true).await;
    let shared = waiting(&a, &reader);
    queued(&a, "db", 1).await?;
    let writer = GrantRequest {
        shared: false,
        ..reader.clone()
    };
    let exclusive = waiting(&b, &writer);
    queued(&b, "db", 1).await?;
    // Released through the second arbiter: handed over to its waiter.
    release(&b, &holder, &held).await?;
    let ge = exclusive.await??.grant;
    assert_eq!(ge.key, "db");
    // The first arbiter's driver sees the hand-over and tries its reader.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let now = b.holder("db").await?.expect("the exclusive hold stays");
    assert_eq!(now.revision, ge.revision, "the exclusive hold is unchanged");
    assert!(
        a.reader_holders("db").await?.is_empty(),
        "no shared hold beside it"
    );
    assert!(!shared.is_finished(), "the reader waits for it to end");
    // Released, the reader is granted like any other.
    release(&b, &writer, &ge).await?;
    let gs = shared.await??.grant;
    assert_eq!(gs.key, reader_key("db", reader.session));
    assert!(gs.revision > ge.revision);
    a.shutdown().await;
    b.shutdown().await;
    Ok(())
}

/// A writer waiting on one arbiter keeps readers that ask another out (its
/// intent in the log, issue 34): without it the second arbiter granted them
/// beside the readers already there, and renewing readers starved the
/// writer. The writer goes next, the late reader after it, and the intent
/// is gone once the writer's wait ends.
#[tokio::test(start_paused = true)]
async fn a_writer_waiting_on_one_arbiter_keeps_readers_of_another_out() -> anyhow::Result<()> {
    let log = MemLog::new(53);
    let (a, b) = (table(&log), table(&log));
    a.start().await?;
    b.start().await?;
    let r1 = caller(&a, "reader-1", "db", true).await;
    let g1 = a.acquire(r1.clone(), None, 16).await?.grant;
    let w = caller(&b, "writer", "db", false).await;
    let writer = waiting(&b, &w);
    queued(&b, "db", 1).await?;
    // The writer's driver finds the reader and says so in the log.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r2 = caller(&a, "reader-2", "db", true).await;
    assert!(
        matches!(
            a.acquire(r2.clone(), None, 16).await,
            Err(ArbiterError::Held { .. })
        ),
        "a reader beside a writer waiting on another arbiter"
    );
    let late = waiting(&a, &r2);
    queued(&a, "db", 1).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !late.is_finished(),
        "the late reader waits behind the writer"
    );
    assert!(!writer.is_finished(), "the writer waits for reader-1");

    release(&a, &r1, &g1).await?;
    let gw = writer.await??.grant;
    assert_eq!(gw.key, "db");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!late.is_finished(), "the late reader beside the writer");
    release(&b, &w, &gw).await?;
    let g2 = late.await??.grant;
    assert_eq!(g2.key, reader_key("db", r2.session));
    assert!(g2.token() > gw.token());
    // The writer's intent went with its wait: a new reader is let in at
    // once beside reader-2.
    let r3 = caller(&a, "reader-3", "db", true).await;
    a.acquire(r3, None, 16).await?;
    a.shutdown().await;
    b.shutdown().await;
    Ok(())
}

/// An intent whose writer's call ended without deleting it (its arbiter
/// died) is removed by a reader's arbiter once it has seen it unchanged for
/// longer than the writer's wait and `STALE_AFTER`, while the writer's
/// session lives on; before that the reader waits.
#[tokio::test(start_paused = true)]
async fn a_writers_intent_left_behind_is_removed_as_stale() -> anyhow::Result<()> {
    use latchkey_arbiter::lock_log::DurableQueueLog;
    use latchkey_arbiter::records::{SessionRecord, WaiterRecord, encode};
    use latchkey_arbiter::table::durable::STALE_AFTER;
    let log = MemLog::new(59);
    let t = table(&log);
    t.start().await?;
    let w = caller(&t, "writer", "db", false).await;
    let _alive = renewing(&t, w.session);
    let own = encode(&SessionRecord {
        identity: w.identity.clone(),
        ttl_seconds: TTL,
    });
    let wait = Duration::from_secs(3);
    let record = encode(&WaiterRecord {
        identity: w.identity.clone(),
        session: w.session,
        class: w.class.clone(),
        wait_ms: 3000,
    });
    let put = log.put_intent("db", w.session, &own, record).await?;
    assert!(put.value.is_some(), "the intent was put");
    let r = caller(&t, "reader", "db", true).await;
    let _reader_alive = renewing(&t, r.session);
    let started = tokio::time::Instant::now();
    let reader = waiting(&t, &r);
    queued(&t, "db", 1).await?;
    tokio::time::sleep(wait).await;
    assert!(!reader.is_finished(), "the reader waits behind the intent");
    let g = reader.await??.grant;
    assert_eq!(g.key, reader_key("db", r.session));
    let waited = started.elapsed();
    assert!(
        waited >= wait + STALE_AFTER && waited < wait + STALE_AFTER + Duration::from_secs(5),
        "removed after the writer's wait and STALE_AFTER: {waited:?}"
    );
    assert_eq!(t.durable_stats().stale_removed, 1);
    t.shutdown().await;
    Ok(())
}

fn waiting_durable(
    t: &Arc<LockTable>,
    r: &GrantRequest,
) -> JoinHandle<Result<Acquired, ArbiterError>> {
    let (t, r) = (t.clone(), r.clone());
    tokio::spawn(async move { t.acquire_durable(r, WAIT, 16).await })
}

async fn queued_durable(t: &LockTable, key: &str, n: u32) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while t.durable_waiting(key).await? < n {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{key} has fewer than {n} durable waiters"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// A durable class takes shared holds: readers hold together, a writer
/// queued in the log (through another arbiter) keeps later readers behind
/// it, and they follow it in queue order; a writer's downgrade with a
/// reader queued behind it is one step, and that reader joins.
#[tokio::test(start_paused = true)]
async fn a_durable_queue_orders_readers_and_writers_across_arbiters() -> anyhow::Result<()> {
    let log = MemLog::new(61);
    let (a, b) = (table(&log), table(&log));
    a.start().await?;
    b.start().await?;
    let r1 = caller(&a, "reader-1", "db", true).await;
    let g1 = a.acquire_durable(r1.clone(), None, 16).await?.grant;
    assert_eq!(g1.key, reader_key("db", r1.session));
    let w = caller(&b, "writer", "db", false).await;
    let writer = waiting_durable(&b, &w);
    queued_durable(&b, "db", 1).await?;
    let r2 = caller(&a, "reader-2", "db", true).await;
    assert!(
        matches!(
            a.acquire_durable(r2.clone(), None, 16).await,
            Err(ArbiterError::Held { .. })
        ),
        "a reader's try-lock passes a queued writer"
    );
    let late = waiting_durable(&a, &r2);
    queued_durable(&a, "db", 2).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!writer.is_finished() && !late.is_finished());

    release(&a, &r1, &g1).await?;
    let gw = writer.await??.grant;
    assert_eq!(gw.key, "db");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!late.is_finished(), "the late reader beside the writer");

    // The writer downgrades while reader-2 is queued behind it: at once,
    // and reader-2 joins.
    let down = GrantRequest {
        shared: true,
        ..w.clone()
    };
    let gd = b.acquire_durable(down.clone(), None, 16).await?.grant;
    assert_eq!(gd.key, reader_key("db", w.session));
    assert!(gd.token() > gw.token());
    let g2 = late.await??.grant;
    assert_eq!(g2.key, reader_key("db", r2.session));
    assert!(g2.token() > gw.token());
    assert_eq!(a.reader_holders("db").await?.len(), 2);
    assert_eq!(a.durable_waiting("db").await?, 0);
    a.shutdown().await;
    b.shutdown().await;
    Ok(())
}

/// Class facts for the tests: every class's hold lasts at most `max`.
struct MaxHold(Duration);

impl latchkey_arbiter::table::ClassPermits for MaxHold {
    fn permits(&self, _class: &str) -> Option<u32> {
        None
    }
    fn max_hold(&self, _class: &str) -> Option<Duration> {
        Some(self.0)
    }
    fn any_max_hold(&self) -> bool {
        true
    }
}

/// Keeps `session` alive on `t` every second until the handle is dropped.
fn renewing(t: &Arc<LockTable>, session: i64) -> tokio::task::JoinHandle<()> {
    let t = t.clone();
    tokio::spawn(async move {
        loop {
            let _ = t.renew(session).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// A class's `maxHoldSeconds` ends a renewing reader's hold that long after
/// its grant, as an expiry would, so a waiting writer gets in; a hold
/// granted through another arbiter (no timer here) is found by the sweep
/// and ended too.
#[tokio::test(start_paused = true)]
async fn a_renewing_reader_is_ended_at_its_classs_max_hold() -> anyhow::Result<()> {
    let log = MemLog::new(44);
    let t = table(&log);
    t.start().await?;
    let r = caller(&t, "reader", "db", true).await;
    let keep = renewing(&t, r.session);
    let g = t.acquire(r.clone(), None, 16).await?.grant;
    t.end_after(&g.key, g.session, g.revision, Duration::from_secs(12));
    let w = caller(&t, "writer", "db", false).await;
    let keep_w = renewing(&t, w.session);
    let started = tokio::time::Instant::now();
    let gw = waiting(&t, &w).await??.grant;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(11) && waited <= Duration::from_secs(14),
        "the writer waited {waited:?} for a reader bounded at 12 s"
    );
    assert!(t.holder(&g.key).await?.is_none(), "the reader's hold ended");
    assert!(t.renew(r.session).await.is_ok(), "its session lives on");
    release(&t, &w, &gw).await?;

    // Another arbiter's grant: no timer here until the sweep sees it.
    let r2 = caller(&t, "reader-2", "db", true).await;
    let keep_2 = renewing(&t, r2.session);
    let g2 = t.acquire(r2.clone(), None, 16).await?.grant;
    t.set_permits_source(Arc::new(MaxHold(Duration::from_secs(40))));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while t.holder(&g2.key).await?.is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweep never ended it"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for k in [keep, keep_w, keep_2] {
        k.abort();
    }
    t.shutdown().await;
    Ok(())
}
