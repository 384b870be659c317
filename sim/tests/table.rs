//! The LockTable on the in-memory log, one scenario at a time, under paused
//! time: what used to need a multi-process run on a real etcd.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use latchkey_arbiter::lock_log::{EpochLog, HoldLog};
use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::ArbiterError;
use latchkey_arbiter::epoch::EpochGuard;
use latchkey_arbiter::high_water::HighWater;
use latchkey_arbiter::table::{GrantRequest, LockTable, MapVersion, TableOptions};
use latchkey_sim::{ClusterId, MemLog};

const TTL: u32 = 5;

fn table(log: &MemLog, high_water: Option<latchkey_arbiter::high_water::Mark>) -> Arc<LockTable> {
    routing_by(log, high_water, MapVersion::default())
}

/// A table whose arbiter routes by the shard map `map_version` says.
fn routing_by(
    log: &MemLog,
    high_water: Option<latchkey_arbiter::high_water::Mark>,
    map_version: MapVersion,
) -> Arc<LockTable> {
    LockTable::new(
        Arc::new(log.clone()),
        Arc::new(EpochGuard::default()),
        Arc::new(HighWater::in_memory(high_water)),
        TableOptions {
            poll: Duration::from_millis(200),
            max_waiters_per_identity: 8,
            seed: 7,
            map_version,
            ..TableOptions::default()
        },
    )
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

async fn session(t: &LockTable, identity: &str) -> Result<i64, ArbiterError> {
    t.open_session(identity, TTL, 10).await
}

/// Waits (on the paused clock) until `key` has `n` waiters queued; fails
/// after a simulated second.
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

#[tokio::test(start_paused = true)]
async fn a_held_key_is_handed_over_in_arrival_order_with_rising_tokens() -> anyhow::Result<()> {
    let log = MemLog::new(1);
    let t = table(&log, None);
    t.start().await?;
    let (a, b, c) = (
        session(&t, "a").await?,
        session(&t, "b").await?,
        session(&t, "c").await?,
    );
    let first = t.acquire(req("a", a, "k"), None, 8).await?.grant;
    let busy = t.acquire(req("b", b, "k"), None, 8).await;
    assert!(matches!(busy, Err(ArbiterError::Held { .. })), "{busy:?}");

    let wait = Some(Duration::from_secs(30));
    let tb = t.clone();
    let b_waits = tokio::spawn(async move { tb.acquire(req("b", b, "k"), wait, 8).await });
    queued(&t, "k", 1).await?;
    let tc = t.clone();
    let c_waits = tokio::spawn(async move { tc.acquire(req("c", c, "k"), wait, 8).await });
    queued(&t, "k", 2).await?;
    assert_eq!(t.waiting("k"), 2);

    let token = first.token().unwrap_or(0);
    let released = t.release("a", "k", a, token).await?;
    assert!(released.handed_over, "b was queued: one transaction");
    let second = b_waits.await??.grant;
    assert_eq!(second.session, b);
    assert!(second.token() > first.token());

    t.release("b", "k", b, second.token().unwrap_or(0)).await?;
    let third = c_waits.await??.grant;
    assert_eq!(third.session, c);
    assert!(third.token() > second.token());
    t.shutdown().await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn an_abandoned_wait_leaves_no_hold_behind() -> anyhow::Result<()> {
    let log = MemLog::new(2);
    let t = table(&log, None);
    t.start().await?;
    let (a, b) = (session(&t, "a").await?, session(&t, "b").await?);
    let first = t.acquire(req("a", a, "k"), None, 8).await?.grant;
    let tb = t.clone();
    let waiting = tokio::spawn(async move {
        tb.acquire(req("b", b, "k"), Some(Duration::from_secs(30)), 8)
            .await
    });
    queued(&t, "k", 1).await?;
    waiting.abort();
    let _ = waiting.await;
    assert_eq!(t.waiting("k"), 0, "the cancelled call left the queue");
    t.release("a", "k", a, first.token().unwrap_or(0)).await?;
    // the queue is empty, so the release handed nothing over
    assert!(t.holder("k").await?.is_none(), "nobody holds k");
    assert_eq!(t.waiting("k"), 0);
    t.shutdown().await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_waiter_is_granted_when_the_holders_session_expires() -> anyhow::Result<()> {
    let log = MemLog::new(3);
    let t = table(&log, None);
    t.start().await?;
    let (a, b) = (session(&t, "a").await?, session(&t, "b").await?);
    let first = t.acquire(req("a", a, "k"), None, 8).await?.grant;
    // b renews; a does not.
    let tb = t.clone();
    let renewer = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = tb.renew(b).await;
        }
    });
    let got = t
        .acquire(req("b", b, "k"), Some(Duration::from_secs(60)), 8)
        .await?;
    assert!(got.waited);
    assert!(got.grant.token() > first.token());
    renewer.abort();
    t.shutdown().await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_restore_seals_until_the_advance_and_tokens_never_go_back() -> anyhow::Result<()> {
    for cluster in [ClusterId::Same, ClusterId::New] {
        let log = MemLog::new(4);
        let t = table(&log, None);
        t.start().await?;
        let a = session(&t, "a").await?;
        let snapshot = log.snapshot();
        let mut highest = 0;
        for _ in 0..5 {
            let g = t.acquire(req("a", a, "k"), None, 8).await?.grant;
            highest = highest.max(g.token().unwrap_or(0));
            t.release("a", "k", a, g.token().unwrap_or(0)).await?;
        }
        log.restore(&snapshot, cluster);
        let sealed = t.acquire(req("a", a, "k"), None, 8).await;
        assert!(
            matches!(sealed, Err(ArbiterError::Sealed { .. })),
            "{cluster:?}: {sealed:?}"
        );
        // A second arbiter that never granted reads the seal record.
        let other = table(&log, None);
        other.start().await?;
        assert!(other.seal().guard().seal_reason().is_some(), "{cluster:?}");

        let epoch = t.seal().guard().state().map_or(0, |s| s.epoch());
        t.seal().advance_epoch(epoch, "restored").await?;
        let a = session(&t, "a").await?;
        let g = t.acquire(req("a", a, "k"), None, 8).await?.grant;
        assert!(g.token().unwrap_or(0) > highest, "{cluster:?}");
        t.shutdown().await;
        other.shutdown().await;
    }
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_every_driver_and_answers_every_waiter() -> anyhow::Result<()> {
    let log = MemLog::new(5);
    let t = table(&log, None);
    t.start().await?;
    let a = session(&t, "a").await?;
    let b = session(&t, "b").await?;
    t.acquire(req("a", a, "k"), None, 8).await?;
    let tb = t.clone();
    let waiting = tokio::spawn(async move {
        tb.acquire(req("b", b, "k"), Some(Duration::from_secs(300)), 8)
            .await
    });
    queued(&t, "k", 1).await?;
    t.shutdown().await;
    let answer = waiting.await?;
    assert!(
        matches!(answer, Err(ArbiterError::StoreUnavailable { .. })),
        "{answer:?}"
    );
    Ok(())
}

/// The table's view of the shard-map fence: (mod revision, version).
fn fence_seen(t: &LockTable) -> Option<(i64, u64)> {
    t.seal()
        .guard()
        .state()
        .map(|s| (s.fence_at, s.fence_version))
}

#[tokio::test(start_paused = true)]
async fn an_arbiter_behind_the_fence_grants_once_its_map_catches_up() -> anyhow::Result<()> {
    let log = MemLog::new(6);
    assert!(log.raise_map_fence(3).await?.value);
    let version = MapVersion::new(2);
    let t = routing_by(&log, None, version.clone());
    t.start().await?;
    let a = session(&t, "a").await?;
    let before = log.revision();
    let refused = t.acquire(req("a", a, "k"), None, 8).await;
    assert!(
        matches!(
            refused,
            Err(ArbiterError::ShardMapAhead {
                cluster: 3,
                arbiter: 2
            })
        ),
        "{refused:?}"
    );
    // a waiting acquire is refused at once too, and nothing was written
    let waiting = t
        .acquire(req("a", a, "k"), Some(Duration::from_secs(5)), 8)
        .await;
    assert!(
        matches!(waiting, Err(ArbiterError::ShardMapAhead { .. })),
        "{waiting:?}"
    );
    assert_eq!(log.revision(), before);
    assert!(t.holder("k").await?.is_none());

    // the map it routes by catches up: the next grant goes through, on
    // the records already read
    version.set(3);
    let granted = t.acquire(req("a", a, "k"), None, 8).await?.grant;
    assert_eq!(granted.revision, before + 1);
    t.shutdown().await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_table_raises_a_fence_below_its_map_when_it_reads_it() -> anyhow::Result<()> {
    // a restore rolled the fence back below the map this arbiter routes by:
    // reading the records raises it again, fencing older arbiters out
    let log = MemLog::new(9);
    assert!(log.raise_map_fence(1).await?.value);
    let t = routing_by(&log, None, MapVersion::new(3));
    t.start().await?;
    let fence = log.map_fence().await?.value.map(|kv| kv.value);
    assert_eq!(fence, Some(latchkey_records::encode_map_fence(3)));
    // and an arbiter routing by no map raises nothing
    let log = MemLog::new(10);
    let t0 = routing_by(&log, None, MapVersion::new(0));
    t0.start().await?;
    assert!(log.map_fence().await?.value.is_none());
    t.shutdown().await;
    t0.shutdown().await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_fence_raised_under_a_table_is_read_again_before_it_grants() -> anyhow::Result<()> {
    let log = MemLog::new(7);
    assert!(log.raise_map_fence(1).await?.value);
    let version = MapVersion::new(1);
    let t = routing_by(&log, None, version.clone());
    t.start().await?;
    let first_fence = fence_seen(&t).map(|(at, _)| at);
    let a = session(&t, "a").await?;
    t.acquire(req("a", a, "k1"), None, 8).await?;

    // a move fences the cluster at version 2, which this arbiter has
    // adopted: its grant fails the compare, re-reads the records and goes
    // through
    version.set(2);
    let raised = log.raise_map_fence(2).await?.header.revision;
    let granted = t.acquire(req("a", a, "k2"), None, 8).await?.grant;
    assert_eq!(granted.revision, raised + 1);
    assert_eq!(fence_seen(&t), Some((raised, 2)));
    assert_ne!(first_fence, Some(raised));

    // and at version 3, which it does not: the re-read refuses
    log.raise_map_fence(3).await?;
    let refused = t.acquire(req("a", a, "k3"), None, 8).await;
    assert!(
        matches!(
            refused,
            Err(ArbiterError::ShardMapAhead {
                cluster: 3,
                arbiter: 2
            })
        ),
        "{refused:?}"
    );
    t.shutdown().await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_hand_over_over_a_stale_fence_ends_in_a_fresh_grant() -> anyhow::Result<()> {
    let log = MemLog::new(8);
    let version = MapVersion::new(0);
    let t = routing_by(&log, None, version.clone());
    t.start().await?;
    let (a, b) = (session(&t, "a").await?, session(&t, "b").await?);
    let first = t.acquire(req("a", a, "k"), None, 8).await?.grant;
    let tb = t.clone();
    let b_waits = tokio::spawn(async move {
        tb.acquire(req("b", b, "k"), Some(Duration::from_secs(30)), 8)
            .await
    });
    queued(&t, "k", 1).await?;
    // the arbiter adopts map 2 and a move fences the cluster at it
    version.set(2);
    let raised = log.raise_map_fence(2).await?.header.revision;

    // the hand-over compares the fence the table read before the raise:
    // refused, so the release is a plain one, and the waiter's own grant
    // reads the records again and goes through
    let released = t.release("a", "k", a, first.token().unwrap_or(0)).await?;
    assert!(!released.handed_over, "the stale hand-over committed");
    let second = b_waits.await??.grant;
    assert_eq!(second.session, b);
    assert!(second.revision > raised);
    assert_eq!(fence_seen(&t), Some((raised, 2)));
    t.shutdown().await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_release_on_a_cluster_fenced_ahead_still_releases() -> anyhow::Result<()> {
    let log = MemLog::new(9);
    let t = routing_by(&log, None, MapVersion::new(2));
    t.start().await?;
    let (a, b) = (session(&t, "a").await?, session(&t, "b").await?);
    let first = t.acquire(req("a", a, "k"), None, 8).await?.grant;
    let tb = t.clone();
    let b_waits = tokio::spawn(async move {
        tb.acquire(req("b", b, "k"), Some(Duration::from_secs(30)), 8)
            .await
    });
    queued(&t, "k", 1).await?;
    log.raise_map_fence(3).await?;
    t.seal().load_epoch().await?;
    assert_eq!(fence_seen(&t).map(|(_, v)| v), Some(3));

    // no hand-over (this arbiter may not grant here), but the release goes
    // through; the waiter hears why it is not granted
    let released = t.release("a", "k", a, first.token().unwrap_or(0)).await?;
    assert!(!released.handed_over);
    assert!(log.holder("k").await?.value.is_none());
    let refused = b_waits.await?;
    assert!(
        matches!(refused, Err(ArbiterError::ShardMapAhead { .. })),
        "{refused:?}"
    );
    t.shutdown().await;
    Ok(())
}

fn quota_req(identity: &str, session: i64, key: &str, max: u32) -> GrantRequest {
    GrantRequest {
        quota: Some(max),
        permits: None,
        bound: "spiffe://sim/quota/*".into(),
        ..req(identity, session, key)
    }
}

/// A quota lowered from 4 to 2 (a policy reload) while 4 holds last: the
/// places above the new quota keep as many below it out of use, so the
/// subject is back under 2 holds before it is granted again (issue 34).
#[tokio::test(start_paused = true)]
async fn a_lowered_quota_counts_the_places_above_it_until_their_holds_end() -> anyhow::Result<()> {
    let log = MemLog::new(34);
    let t = table(&log, None);
    t.start().await?;
    let s = session(&t, "pod-1").await?;
    let mut grants = Vec::new();
    for i in 0..4 {
        grants.push(
            t.acquire(quota_req("pod-1", s, &format!("q{i}"), 4), None, 8)
                .await?
                .grant,
        );
    }
    let refused = t.acquire(quota_req("pod-1", s, "q4", 4), None, 8).await;
    assert!(
        matches!(refused, Err(ArbiterError::QuotaExceeded { max: 4, .. })),
        "{refused:?}"
    );
    // Which key took which place: release the two below the new quota.
    let mut by_place = std::collections::BTreeMap::new();
    for g in &grants {
        let view = t.holder(&g.key).await?.expect("held");
        by_place.insert(view.record.quota_place.expect("a place"), g.clone());
    }
    assert_eq!(
        by_place.keys().copied().collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    for place in [0, 1] {
        let g = &by_place[&place];
        t.release("pod-1", &g.key, s, g.token().unwrap_or(0))
            .await?;
    }
    // Two holds left, both above the lowered quota: nothing more.
    let refused = t.acquire(quota_req("pod-1", s, "q5", 2), None, 8).await;
    assert!(
        matches!(refused, Err(ArbiterError::QuotaExceeded { max: 2, .. })),
        "{refused:?}"
    );
    // One of them ends: one place below the quota is usable again.
    let g = &by_place[&2];
    t.release("pod-1", &g.key, s, g.token().unwrap_or(0))
        .await?;
    t.acquire(quota_req("pod-1", s, "q5", 2), None, 8).await?;
    let refused = t.acquire(quota_req("pod-1", s, "q6", 2), None, 8).await;
    assert!(
        matches!(refused, Err(ArbiterError::QuotaExceeded { .. })),
        "{refused:?}"
    );
    // A retry of a held key at a full quota is that grant, not a refusal.
    let g = &by_place[&3];
    let again = t
        .acquire(quota_req("pod-1", s, &g.key, 2), None, 8)
        .await?
        .grant;
    assert_eq!(again.token(), g.token());
    t.shutdown().await;
    Ok(())
}

/// At a full quota, a place naming another session of the same subject is
/// no "already yours": a caller naming that session id gets no grant (the
/// hold is pod-2's, its session and identity checked), and no claim.
#[tokio::test(start_paused = true)]
async fn a_full_quota_never_hands_out_another_sessions_grant() -> anyhow::Result<()> {
    let log = MemLog::new(35);
    let t = table(&log, None);
    t.start().await?;
    let s1 = session(&t, "pod-1").await?;
    let s2 = session(&t, "pod-2").await?;
    let theirs = t
        .acquire(quota_req("pod-2", s2, "k", 2), None, 8)
        .await?
        .grant;
    t.acquire(quota_req("pod-1", s1, "mine", 2), None, 8)
        .await?;
    // pod-1 names pod-2's session: refused, not pod-2's grant.
    let stolen = t.acquire(quota_req("pod-1", s2, "k", 2), None, 8).await;
    assert!(stolen.is_err(), "pod-1 got pod-2's grant: {stolen:?}");
    // pod-2's own retry is its grant.
    let again = t
        .acquire(quota_req("pod-2", s2, "k", 2), None, 8)
        .await?
        .grant;
    assert_eq!(again.token(), theirs.token());
    t.shutdown().await;
    Ok(())
}

/// Lowered from 4 to 3 with live holds between the new quota's free places
/// and its top (the second hostile review of issue 34): still at most 3.
#[tokio::test(start_paused = true)]
async fn a_quota_lowered_by_one_never_lets_a_fourth_hold_through() -> anyhow::Result<()> {
    let log = MemLog::new(36);
    let t = table(&log, None);
    t.start().await?;
    let s = session(&t, "pod-1").await?;
    let mut by_place = std::collections::BTreeMap::new();
    for i in 0..4 {
        let g = t
            .acquire(quota_req("pod-1", s, &format!("q{i}"), 4), None, 8)
            .await?
            .grant;
        let view = t.holder(&g.key).await?.expect("held");
        by_place.insert(view.record.quota_place.expect("a place"), g);
    }
    for place in [0, 1] {
        let g = &by_place[&place];
        t.release("pod-1", &g.key, s, g.token().unwrap_or(0))
            .await?;
    }
    // Places 2 and 3 live under a quota of 3: one more, not two.
    t.acquire(quota_req("pod-1", s, "n1", 3), None, 8).await?;
    let refused = t.acquire(quota_req("pod-1", s, "n2", 3), None, 8).await;
    assert!(
        matches!(refused, Err(ArbiterError::QuotaExceeded { max: 3, .. })),
        "{refused:?}"
    );
    t.shutdown().await;
    Ok(())
}

fn permit_req(identity: &str, session: i64, name: &str, permits: u32) -> GrantRequest {
    GrantRequest {
        permits: Some(permits),
        ..req(identity, session, name)
    }
}

/// Semaphore classes' permits as a policy reload sets them.
struct Permits(std::sync::atomic::AtomicU32);

impl latchkey_arbiter::table::ClassPermits for Permits {
    fn permits(&self, _class: &str) -> Option<u32> {
        Some(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// A semaphore of 3 lowered to 1 (a policy reload) while 3 slots are held
/// and a waiter queued with the old number: the waiter is granted by the
/// new number, only once the slots held drop below it, and then in slot 0
/// (issue 34; the hostile review found waiters keeping their old number).
#[tokio::test(start_paused = true)]
async fn a_waiter_is_granted_by_the_permits_the_policies_give_now() -> anyhow::Result<()> {
    let log = MemLog::new(36);
    let t = table(&log, None);
    t.start().await?;
    let permits = Arc::new(Permits(std::sync::atomic::AtomicU32::new(3)));
    t.set_permits_source(permits.clone());
    let mut holds = Vec::new();
    for pod in ["pod-1", "pod-2", "pod-3"] {
        let s = session(&t, pod).await?;
        holds.push((
            pod,
            s,
            t.acquire(permit_req(pod, s, "pool", 3), None, 8)
                .await?
                .grant,
        ));
    }
    let mut slots: Vec<u32> = holds
        .iter()
        .filter_map(|(_, _, g)| latchkey_arbiter::records::split_slot(&g.key).map(|(_, s)| s))
        .collect();
    slots.sort_unstable();
    assert_eq!(slots, vec![0, 1, 2]);
    let s4 = session(&t, "pod-4").await?;
    let waiter = {
        let t = t.clone();
        tokio::spawn(async move {
            t.acquire(
                permit_req("pod-4", s4, "pool", 3),
                Some(Duration::from_secs(30)),
                8,
            )
            .await
        })
    };
    queued(&t, "pool", 1).await?;
    permits.0.store(1, std::sync::atomic::Ordering::SeqCst);
    // Two of three released: one still held, which is the new number.
    for (pod, s, g) in holds.drain(..2) {
        t.release(pod, &g.key, s, g.token().unwrap_or(0)).await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !waiter.is_finished(),
        "granted a second slot under permits = 1"
    );
    assert_eq!(t.slot_holders("pool").await?.len(), 1);
    let (pod, s, g) = holds.remove(0);
    // The release without its slot: the token names the caller's slot.
    let own = t.own_slot("pool", pod, s, g.token().unwrap_or(0)).await?;
    assert_eq!(own.as_deref(), Some(g.key.as_str()));
    assert_eq!(
        t.own_slot("pool", "pod-9", s, g.token().unwrap_or(0))
            .await?,
        None
    );
    t.release(pod, &g.key, s, g.token().unwrap_or(0)).await?;
    let got = waiter.await??.grant;
    assert_eq!(got.key, latchkey_arbiter::records::slot_key("pool", 0));
    t.shutdown().await;
    Ok(())
}
