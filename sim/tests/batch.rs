//! Group commit in the LockTable, on the in-memory log with a round trip
//! (so callers arriving together meet a batch in flight), under paused
//! time: grants and releases that arrive together go as one transaction,
//! each caller hears what its own transaction would have said, and a lost
//! answer is every member's unknown outcome.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::ArbiterError;
use latchkey_arbiter::epoch::EpochGuard;
use latchkey_arbiter::high_water::HighWater;
use latchkey_arbiter::table::{Acquired, GrantRequest, LockTable, TableOptions};
use latchkey_sim::{FaultRates, MemLog, MemLogConfig};
use tokio::task::JoinSet;

const TTL: u32 = 5;

fn log() -> MemLog {
    MemLog::with_config(MemLogConfig {
        seed: 11,
        latency: Duration::from_millis(2),
        ..MemLogConfig::default()
    })
}

fn table(log: &MemLog) -> (Arc<LockTable>, Arc<HighWater>) {
    table_with(log, TableOptions::default().batches_in_flight)
}

fn table_with(log: &MemLog, in_flight: usize) -> (Arc<LockTable>, Arc<HighWater>) {
    let high_water = Arc::new(HighWater::in_memory(None));
    let table = LockTable::new(
        Arc::new(log.clone()),
        Arc::new(EpochGuard::default()),
        high_water.clone(),
        TableOptions {
            poll: Duration::from_millis(200),
            seed: 7,
            batches_in_flight: in_flight,
            ..TableOptions::default()
        },
    );
    (table, high_water)
}

fn req(identity: &str, session: i64, key: &str) -> GrantRequest {
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
        shared: false,
    }
}

/// `n` callers, each with its own session, try-locking `key(i)` at once.
async fn acquire_all(
    t: &Arc<LockTable>,
    sessions: &[i64],
    key: impl Fn(usize) -> String,
) -> Vec<Result<Acquired, ArbiterError>> {
    let mut calls = JoinSet::new();
    for (i, &s) in sessions.iter().enumerate() {
        let (t, r) = (t.clone(), req("w", s, &key(i)));
        calls.spawn(async move { (i, t.acquire(r, None, 8).await) });
    }
    let mut out: Vec<Option<Result<Acquired, ArbiterError>>> =
        sessions.iter().map(|_| None).collect();
    while let Some(Ok((i, r))) = calls.join_next().await {
        out[i] = Some(r);
    }
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(ArbiterError::internal("a call panicked"))))
        .collect()
}

async fn sessions(t: &LockTable, n: usize) -> anyhow::Result<Vec<i64>> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(t.open_session("w", TTL, 100).await?);
    }
    Ok(out)
}

#[tokio::test(start_paused = true)]
async fn grants_that_arrive_together_share_one_transaction_and_one_mark_write() -> anyhow::Result<()>
{
    let log = log();
    let (t, high_water) = table(&log);
    t.start().await?;
    let s = sessions(&t, 8).await?;
    let writes = high_water.writes();
    let grants: Vec<_> = acquire_all(&t, &s, |i| format!("k{i}"))
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let stats = t.batch_stats();
    // Whoever finds no batch in flight goes at once; the rest, arriving
    // meanwhile, go together with the next.
    assert_eq!(stats.members, 8, "{stats:?}");
    assert!(stats.batches <= 2 && stats.largest >= 7, "{stats:?}");
    let mut revisions: Vec<i64> = grants.iter().map(|a| a.grant.revision).collect();
    revisions.sort_unstable();
    revisions.dedup();
    assert_eq!(revisions.len() as u64, stats.batches, "{revisions:?}");
    assert_eq!(
        high_water.writes() - writes,
        stats.batches,
        "one mark write per batch"
    );
    let mark = high_water.current().map(|m| m.revision);
    assert_eq!(mark, revisions.last().copied());

    // Their releases, together too: every hold gone, one revision more.
    let before = log.revision();
    let mut releases = JoinSet::new();
    for a in grants {
        let t = t.clone();
        let token = a.grant.token().unwrap_or_default();
        releases.spawn(async move { t.release("w", &a.grant.key, a.grant.session, token).await });
    }
    while let Some(r) = releases.join_next().await {
        r??;
    }
    let released = t.batch_stats().batches - stats.batches;
    assert!(released <= 2, "{released} batches for 8 releases");
    assert_eq!(log.revision(), before + released as i64);
    for i in 0..8 {
        assert!(t.holder(&format!("k{i}")).await?.is_none());
    }
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn each_member_hears_its_own_answer() -> anyhow::Result<()> {
    let log = log();
    let (t, _) = table(&log);
    t.start().await?;
    let s = sessions(&t, 6).await?;
    // k-held is another identity's; s[1] asks for it among five asking
    // for free keys.
    let other = t.open_session("other", TTL, 100).await?;
    let held = t
        .acquire(req("other", other, "k-held"), None, 8)
        .await?
        .grant;
    let keys = |i: usize| match i {
        1 => "k-held".to_string(),
        i => format!("k{i}"),
    };
    let results = acquire_all(&t, &s, keys).await;
    let stats = t.batch_stats();
    assert!(stats.largest >= 4, "{stats:?}");
    for (i, r) in results.iter().enumerate() {
        match (i, r) {
            (1, Err(ArbiterError::Held { key })) => assert_eq!(key, "k-held"),
            (i, Ok(a)) if i != 1 => assert_eq!(a.grant.key, format!("k{i}")),
            (i, r) => panic!("caller {i}: {r:?}"),
        }
    }
    // A release of another identity's hold (its session and token in
    // hand), batched with real ones: refused alone, as if it had gone by
    // itself.
    let mut releases = JoinSet::new();
    for (i, r) in results.into_iter().enumerate().skip(2) {
        let a = r?;
        let (t, token) = (t.clone(), a.grant.token().unwrap_or_default());
        releases.spawn(async move {
            let own = t.release("w", &a.grant.key, a.grant.session, token).await;
            (i, own.map(|_| ()))
        });
    }
    let (t2, token) = (t.clone(), held.token().unwrap_or_default());
    releases.spawn(async move {
        let stolen = t2.release("w", "k-held", other, token).await;
        (99, stolen.map(|_| ()))
    });
    while let Some(Ok((i, r))) = releases.join_next().await {
        match (i, r) {
            (99, Err(ArbiterError::NotHeld { .. })) => {}
            (i, Ok(())) if i < 99 => {}
            (i, r) => panic!("release {i}: {r:?}"),
        }
    }
    assert!(t.holder("k-held").await?.is_some(), "the hold stayed");
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_lost_batch_answer_is_every_members_unknown_outcome() -> anyhow::Result<()> {
    let log = log();
    let (t, _) = table(&log);
    t.start().await?;
    let s = sessions(&t, 5).await?;
    log.set_faults(FaultRates {
        lose_response: 100,
        ..FaultRates::NONE
    });
    for r in acquire_all(&t, &s, |i| format!("k{i}")).await {
        assert!(
            matches!(r, Err(ArbiterError::StoreUnavailable { .. })),
            "{r:?}"
        );
    }
    assert!(t.batch_stats().largest >= 2);
    assert!(log.batch_counts().lost >= 1);
    // The grants did commit: each session's next call gets its own.
    log.set_faults(FaultRates::NONE);
    let again = acquire_all(&t, &s, |i| format!("k{i}")).await;
    for (i, r) in again.into_iter().enumerate() {
        let a = r?;
        let holder = t.holder(&format!("k{i}")).await?;
        assert_eq!(holder.map(|h| h.revision), Some(a.grant.revision));
    }
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_its_batch_leaves_no_hold() -> anyhow::Result<()> {
    let log = log();
    let (t, _) = table_with(&log, 1);
    t.start().await?;
    let s = sessions(&t, 2).await?;
    // The first occupies the log; the second's call is dropped while it
    // waits for the next batch or rides in it: it is never sent, or its
    // grant is released as an orphan.
    let t1 = t.clone();
    let s0 = s[0];
    let first = tokio::spawn(async move { t1.acquire(req("w", s0, "a"), None, 8).await });
    tokio::time::sleep(Duration::from_micros(10)).await;
    let gone = tokio::time::timeout(
        Duration::from_micros(1500),
        t.acquire(req("w", s[1], "b"), None, 8),
    )
    .await;
    assert!(
        gone.is_err(),
        "the call should still be in flight: {gone:?}"
    );
    first.await??;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while t.holder("b").await?.is_some() {
        assert!(tokio::time::Instant::now() < deadline, "b is still held");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(t.holder("a").await?.is_some());
    Ok(())
}
