//! The MemLog's own knobs: faults, lease expiry on paused time, compaction,
//! snapshot and restore. (The etcd semantics every log must have are in the
//! contract suite, `tests/src/log_contract.rs`, run against MemLog and a
//! real etcd.)

use super::*;
use latchkey_arbiter::lock_log::{GrantTxn, Granted, HeldAt, HoldLog, WatchSignal};

const EPOCH: &[u8] = b"epoch-1";
const TTL: u32 = 10;

fn record(identity: &str) -> Vec<u8> {
    format!("session of {identity}").into_bytes()
}

/// A log with an epoch record and one session `lease` of `identity`.
async fn with_session(log: &MemLog, lease: i64, identity: &str) {
    log.grant_lease(lease, TTL).await.unwrap();
    log.put_session(lease, identity, record(identity))
        .await
        .unwrap();
}

async fn grant(log: &MemLog, key: &str, lease: i64, identity: &str) -> LogResult<Granted> {
    let rec = record(identity);
    log.grant(GrantTxn {
        key,
        session: lease,
        holder_record: format!("{key} held by {lease}").into_bytes(),
        epoch: EPOCH,
        fence_at: 0,
        session_record: &rec,
        queue: Default::default(),
        quota: None,
    })
    .await
}

async fn ready(log: &MemLog) {
    assert!(log.create_epoch(EPOCH.to_vec()).await.unwrap().value);
}

#[tokio::test(start_paused = true)]
async fn a_fresh_log_is_at_revision_one_and_reads_do_not_write() {
    let log = MemLog::new(1);
    let a = log.records().await.unwrap();
    assert_eq!(a.header.revision, 1);
    assert_eq!(a.header.cluster_id, log.cluster_id());
    assert_ne!(log.cluster_id(), 0);
    log.holder("k").await.unwrap();
    log.count_holds().await.unwrap();
    assert_eq!(log.revision(), 1);
    // a lease grant and a revoke of a lease with no keys write nothing
    log.grant_lease(5, TTL).await.unwrap();
    log.revoke(5).await.unwrap();
    assert_eq!(log.revision(), 1);
}

#[tokio::test(start_paused = true)]
async fn fail_before_commit_applies_nothing() {
    let log = MemLog::new(2);
    log.set_faults(FaultRates {
        fail_before_commit: 100,
        ..FaultRates::NONE
    });
    for _ in 0..20 {
        let err = log.create_epoch(EPOCH.to_vec()).await.unwrap_err();
        assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
        assert!(log.grant_lease(7, TTL).await.is_err());
        assert!(log.renew(7).await.is_err());
    }
    assert_eq!(log.revision(), 1);
    assert!(log.lease_ids().is_empty());
    log.set_faults(FaultRates::NONE);
    assert!(log.records().await.unwrap().value.epoch.is_none());
    let counts = log.fault_counts();
    assert_eq!(counts.failed_before_commit, 60);
    assert_eq!(counts.lost_responses, 0);
}

#[tokio::test(start_paused = true)]
async fn a_lost_response_was_applied() {
    let log = MemLog::new(3);
    log.set_faults(FaultRates {
        lose_response: 100,
        ..FaultRates::NONE
    });
    assert!(matches!(
        log.create_epoch(EPOCH.to_vec()).await,
        Err(StoreError::Unavailable { .. })
    ));
    assert!(log.grant_lease(9, TTL).await.is_err());
    log.set_faults(FaultRates::NONE);
    let records = log.records().await.unwrap();
    assert_eq!(records.value.epoch.unwrap().value, EPOCH);
    assert_eq!(records.header.revision, 2);
    // the retry of the lost lease grant finds it taken
    assert!(matches!(
        log.grant_lease(9, TTL).await,
        Err(StoreError::LeaseExists { lease: 9 })
    ));
    assert_eq!(log.fault_counts().lost_responses, 2);
}

#[tokio::test(start_paused = true)]
async fn delays_are_bounded_and_on_tokios_clock() {
    let log = MemLog::new(4);
    let max = Duration::from_secs(3);
    log.set_faults(FaultRates {
        delay: 100,
        max_delay: max,
        ..FaultRates::NONE
    });
    let mut delays = Vec::new();
    for _ in 0..50 {
        let start = Instant::now();
        log.count_holds().await.unwrap();
        let took = start.elapsed();
        assert!(took <= max, "{took:?}");
        delays.push(took);
    }
    assert!(delays.iter().any(|d| *d > Duration::from_millis(100)));
    assert!(delays.windows(2).any(|w| w[0] != w[1]), "delays vary");
    assert_eq!(log.fault_counts().delayed, 50);
}

#[tokio::test(start_paused = true)]
async fn a_delayed_call_is_overtaken() {
    let log = MemLog::new(5);
    ready(&log).await;
    log.set_faults(FaultRates {
        delay: 100,
        max_delay: Duration::from_secs(5),
        ..FaultRates::NONE
    });
    // Two puts of the seal racing: the one drawn the shorter delay lands
    // first, whatever the order they were sent in.
    let (a, b) = tokio::join!(
        log.put_seal(b"a".to_vec(), None, Some(2)),
        log.put_seal(b"b".to_vec(), None, Some(2)),
    );
    let (a, b) = (a.unwrap().value, b.unwrap().value);
    assert!(a ^ b, "exactly one seal put wins: {a} {b}");
}

/// Runs a fixed script under faults and returns everything it observed.
async fn script(seed: u64) -> Vec<String> {
    let log = MemLog::new(seed);
    log.set_faults(FaultRates {
        fail_before_commit: 20,
        lose_response: 20,
        delay: 30,
        max_delay: Duration::from_millis(500),
    });
    let mut seen = Vec::new();
    let start = Instant::now();
    let _ = log.create_epoch(EPOCH.to_vec()).await;
    for i in 0..40 {
        let lease = 100 + i64::from(i % 4);
        seen.push(format!("{:?}", log.grant_lease(lease, TTL).await.ok()));
        let put = log.put_session(lease, "id", record("id")).await;
        seen.push(format!("{:?}", put.map(|a| a.header)));
        let g = grant(&log, &format!("k{}", i % 3), lease, "id").await;
        seen.push(format!("{:?}", g.map(|a| (a.header, a.value))));
        seen.push(format!("{:?}", start.elapsed()));
    }
    seen.push(format!("{:?} {}", log.fault_counts(), log.revision()));
    seen
}

#[tokio::test(start_paused = true)]
async fn a_seed_is_a_run() {
    let first = script(11).await;
    assert_eq!(first, script(11).await);
    assert_ne!(first, script(12).await);
}

#[tokio::test(start_paused = true)]
async fn rates_are_roughly_what_was_asked() {
    let log = MemLog::new(6);
    log.set_faults(FaultRates {
        fail_before_commit: 10,
        lose_response: 30,
        ..FaultRates::NONE
    });
    for _ in 0..2000 {
        let _ = log.count_holds().await;
    }
    let c = log.fault_counts();
    assert_eq!(c.calls, 2000);
    assert!((120..=280).contains(&c.failed_before_commit), "{c:?}");
    assert!((480..=720).contains(&c.lost_responses), "{c:?}");
    assert_eq!(c.delayed, 0);
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_deletes_its_keys_at_one_revision() {
    let log = MemLog::new(7);
    ready(&log).await;
    with_session(&log, 21, "alice").await;
    assert_eq!(
        grant(&log, "a", 21, "alice").await.unwrap().value,
        Granted::Yes
    );
    assert_eq!(
        grant(&log, "b", 21, "alice").await.unwrap().value,
        Granted::Yes
    );
    let before = log.revision();

    tokio::time::sleep(Duration::from_secs(u64::from(TTL) - 1)).await;
    assert!(log.holder("a").await.unwrap().value.is_some());
    assert_eq!(log.renew(21).await.unwrap().ttl_seconds, i64::from(TTL));
    tokio::time::sleep(Duration::from_secs(u64::from(TTL) - 1)).await;
    assert!(log.holder("a").await.unwrap().value.is_some(), "renewed");
    assert_eq!(log.revision(), before);

    tokio::time::sleep(Duration::from_secs(2)).await;
    let gone = log.holder("a").await.unwrap();
    assert_eq!(gone.value, None);
    assert_eq!(
        gone.header.revision,
        before + 1,
        "one revision for every key"
    );
    assert!(log.session(21).await.unwrap().value.is_none());
    assert_eq!(log.count_sessions_of("alice").await.unwrap().value, 0);
    assert_eq!(log.renew(21).await.unwrap().ttl_seconds, 0);
    assert!(log.lease_ids().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_blocked_watch_sees_expiry_with_no_other_call() {
    let log = MemLog::new(8);
    ready(&log).await;
    with_session(&log, 31, "bob").await;
    grant(&log, "w", 31, "bob").await.unwrap();
    let from = log.revision() + 1;
    let mut watch = log.watch("w", from).await.unwrap();
    let start = Instant::now();
    let signal = tokio::time::timeout(Duration::from_secs(60), watch.next())
        .await
        .unwrap();
    assert_eq!(signal, WatchSignal::Freed);
    assert_eq!(start.elapsed(), Duration::from_secs(u64::from(TTL)));
    assert_eq!(log.revision(), from);
}

#[tokio::test(start_paused = true)]
async fn a_blocked_watch_follows_a_renewed_deadline() {
    let log = MemLog::new(9);
    ready(&log).await;
    with_session(&log, 41, "carol").await;
    grant(&log, "r", 41, "carol").await.unwrap();
    let mut watch = log.watch("r", log.revision() + 1).await.unwrap();
    let renewer = {
        let log = log.clone();
        async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_secs(5)).await;
                log.renew(41).await.unwrap();
            }
        }
    };
    let start = Instant::now();
    let (signal, ()) = tokio::join!(watch.next(), renewer);
    assert_eq!(signal, WatchSignal::Freed);
    // renewed at 5, 10 and 15 s: expires at 25 s
    assert_eq!(start.elapsed(), Duration::from_secs(25));
}

#[tokio::test(start_paused = true)]
async fn short_ttls_are_raised_to_etcds_minimum() {
    let log = MemLog::new(10);
    log.grant_lease(3, 1).await.unwrap();
    assert_eq!(log.renew(3).await.unwrap().ttl_seconds, 2);
    assert_eq!(log.lease_remaining(3), Some(Duration::from_secs(2)));
}

#[tokio::test(start_paused = true)]
async fn renewal_reports_when_it_was_sent() {
    let log = MemLog::new(12);
    log.grant_lease(4, TTL).await.unwrap();
    log.set_faults(FaultRates {
        delay: 100,
        max_delay: Duration::from_secs(2),
        ..FaultRates::NONE
    });
    let sent = Instant::now().into_std();
    let renewal = log.renew(4).await.unwrap();
    assert_eq!(renewal.sent, sent);
    assert!(renewal.sent_to_store);
    assert_eq!(renewal.ttl_seconds, i64::from(TTL));
}

#[tokio::test(start_paused = true)]
async fn compaction_loses_watches_from_below_it_only() {
    let log = MemLog::new(13);
    ready(&log).await;
    with_session(&log, 51, "dave").await;
    let granted_at = {
        grant(&log, "c", 51, "dave").await.unwrap();
        log.revision()
    };
    let mut following = log.watch("c", granted_at + 1).await.unwrap();
    log.revoke(51).await.unwrap();
    let freed_at = log.revision();
    log.compact(freed_at).unwrap();
    assert_eq!(log.compaction_revision(), freed_at);
    assert!(matches!(
        log.compact(freed_at),
        Err(CompactError::Compacted { .. })
    ));
    assert!(matches!(
        log.compact(freed_at + 5),
        Err(CompactError::Future { .. })
    ));
    // pushed before the compaction: kept
    assert_eq!(following.next().await, WatchSignal::Freed);
    let mut below = log.watch("c", granted_at).await.unwrap();
    assert_eq!(below.next().await, WatchSignal::Lost);
    assert_eq!(below.next().await, WatchSignal::Lost, "ended for good");
    let mut at = log.watch("c", freed_at).await.unwrap();
    assert_eq!(at.next().await, WatchSignal::Freed);
}

#[tokio::test(start_paused = true)]
async fn history_is_compacted_on_its_own() {
    let log = MemLog::with_config(MemLogConfig {
        seed: 14,
        history_revisions: Some(10),
        ..MemLogConfig::default()
    });
    ready(&log).await;
    for _ in 0..30 {
        let seal = log
            .records()
            .await
            .unwrap()
            .value
            .seal
            .map(|s| s.mod_revision);
        assert!(
            log.put_seal(b"s".to_vec(), seal, Some(2))
                .await
                .unwrap()
                .value
        );
    }
    let rev = log.revision();
    assert!(log.compaction_revision() >= rev - 20);
    assert!(log.compaction_revision() <= rev - 10);
}

#[tokio::test(start_paused = true)]
async fn restore_goes_back_and_ends_every_watch() {
    let log = MemLog::new(15);
    ready(&log).await;
    with_session(&log, 61, "erin").await;
    grant(&log, "x", 61, "erin").await.unwrap();
    let snapshot = log.snapshot();
    let id = log.cluster_id();

    tokio::time::sleep(Duration::from_secs(4)).await;
    let held = log.holder("x").await.unwrap().value.unwrap();
    log.release(&HeldAt {
        key: "x".into(),
        session: 61,
        revision: held.mod_revision,
        value: held.value.clone(),
    })
    .await
    .unwrap();
    let mut watch = log.watch("x", log.revision() + 1).await.unwrap();
    assert!(log.revision() > snapshot.revision());

    log.restore(&snapshot, ClusterId::Same);
    assert_eq!(log.revision(), snapshot.revision());
    assert_eq!(log.cluster_id(), id);
    assert_eq!(log.holder("x").await.unwrap().value, Some(held));
    assert_eq!(watch.next().await, WatchSignal::Lost);
    assert_eq!(log.open_watches(), 0);
    // the lease came back with its whole TTL
    assert_eq!(
        log.lease_remaining(61),
        Some(Duration::from_secs(u64::from(TTL)))
    );

    log.restore(&snapshot, ClusterId::New);
    assert_ne!(log.cluster_id(), id);
    assert_eq!(
        log.records().await.unwrap().header.cluster_id,
        log.cluster_id()
    );
}

#[tokio::test(start_paused = true)]
async fn broken_watches_report_what_reached_them_then_lost() {
    let log = MemLog::new(16);
    ready(&log).await;
    with_session(&log, 71, "fay").await;
    let mut watch = log.watch("y", 0).await.unwrap();
    grant(&log, "y", 71, "fay").await.unwrap();
    log.break_watches();
    assert_eq!(watch.next().await, WatchSignal::Changed);
    assert_eq!(watch.next().await, WatchSignal::Lost);
}

#[tokio::test(start_paused = true)]
async fn a_watch_from_the_future_skips_what_came_before() {
    let log = MemLog::new(17);
    ready(&log).await;
    with_session(&log, 81, "gus").await;
    let from = log.revision() + 2;
    let mut watch = log.watch("z", from).await.unwrap();
    grant(&log, "z", 81, "gus").await.unwrap(); // at from - 1: not the watch's
    log.revoke(81).await.unwrap(); // at from
    assert_eq!(log.revision(), from);
    assert_eq!(watch.next().await, WatchSignal::Freed);
}

mod elections {
    use latchkey_arbiter::lock_log::{
        ElectionLog, FollowSignal, LeadFrom, LeadTo, LeadTxn, PrefixWatch,
    };

    use super::*;

    async fn stand(log: &MemLog, lease: i64, identity: &str) -> LogResult<Option<Queued>> {
        log.stand("e", lease, 1, &record(identity), b"candidate".to_vec())
            .await
    }

    /// The store keeps each record where the etcd log does, below its
    /// prefix (the layouts' keys agree: `latchkey-records`' own test).
    #[tokio::test(start_paused = true)]
    async fn records_are_where_the_etcd_layout_puts_them_below_its_prefix() {
        let log = MemLog::new(19);
        ready(&log).await;
        with_session(&log, 91, "hal").await;
        grant(&log, "k", 91, "hal").await.unwrap();
        stand(&log, 91, "hal").await.unwrap();
        let etcd = latchkey_records::Layout::new("/latchkey");
        for key in [
            etcd.epoch(),
            etcd.session(91),
            etcd.identity_session("hal", 91),
            etcd.holder("k"),
            etcd.candidate("e", 1, 91),
        ] {
            let below = key.strip_prefix("/latchkey/").unwrap_or_default();
            assert!(log.stored(below).is_some(), "{key}");
        }
    }

    fn lead_txn(to: i64, created: i64) -> LeadTxn<'static> {
        LeadTxn {
            election: "e",
            epoch: EPOCH,
            fence_at: 0,
            term_at: 0,
            term_record: b"term 1".to_vec(),
            creates_for: None,
            from: LeadFrom::Vacant,
            to: Some(LeadTo {
                session: to,
                priority: 1,
                created,
                lead_record: b"lead".to_vec(),
                session_record: None,
                subject: "s",
            }),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn election_calls_meet_the_faults() {
        let log = MemLog::new(21);
        ready(&log).await;
        with_session(&log, 91, "hal").await;
        let before = log.revision();

        log.lose_quorum();
        assert!(log.election("e", 4).await.is_err());
        assert!(stand(&log, 91, "hal").await.is_err());
        assert!(log.lead(lead_txn(91, 0)).await.is_err());
        assert!(log.watch_election("e", 0).await.is_err());
        assert_eq!(log.revision(), before, "nothing commits without a majority");
        log.regain_quorum();

        log.set_faults(FaultRates {
            fail_before_commit: 100,
            ..FaultRates::NONE
        });
        assert!(stand(&log, 91, "hal").await.is_err());
        assert_eq!(log.revision(), before);
        log.set_faults(FaultRates {
            lose_response: 100,
            ..FaultRates::NONE
        });
        let lost = stand(&log, 91, "hal").await;
        assert!(
            matches!(lost, Err(StoreError::Unavailable { .. })),
            "{lost:?}"
        );
        assert_eq!(log.revision(), before + 1, "applied, its answer lost");
        log.set_faults(FaultRates::NONE);
        let read = log.election("e", 4).await.unwrap().value;
        assert_eq!(read.candidates.len(), 1);
        assert_eq!(log.open_watches(), 0, "no watch opened by a failed call");
    }

    async fn next(watch: &mut Box<dyn PrefixWatch>) -> FollowSignal {
        watch.next().await
    }

    /// A watch from below the compaction is lost (etcd cancels it); from
    /// the compaction revision on it replays, but the value before a
    /// change at that revision is compacted away (etcd reads it at the
    /// revision before).
    #[tokio::test(start_paused = true)]
    async fn a_compacted_election_watch_is_lost() {
        let log = MemLog::new(22);
        ready(&log).await;
        with_session(&log, 92, "ida").await;
        let first = stand(&log, 92, "ida").await.unwrap().value.unwrap();
        let again = stand(&log, 92, "ida").await.unwrap().value.unwrap();
        assert_eq!(again.created, first.created);
        log.compact(again.modified).unwrap();

        let mut below = log.watch_election("e", first.modified).await.unwrap();
        assert_eq!(next(&mut below).await, FollowSignal::Lost);
        let mut at = log.watch_election("e", again.modified).await.unwrap();
        match next(&mut at).await {
            FollowSignal::Events { events, through } => {
                assert_eq!(through, again.modified);
                assert_eq!(events.len(), 1);
                assert!(
                    events[0].put.is_some() && events[0].prev.is_none(),
                    "{events:?}"
                );
            }
            FollowSignal::Lost => panic!("a watch from the compaction revision was lost"),
        }
        log.revoke(92).await.unwrap();
        match next(&mut at).await {
            FollowSignal::Events { events, .. } => {
                assert_eq!(events.len(), 1);
                assert!(
                    events[0].put.is_none() && events[0].prev.is_some(),
                    "{events:?}"
                );
            }
            FollowSignal::Lost => panic!("lost after a revoke"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lead_on_a_lease_gone_is_refused_whole() {
        let log = MemLog::new(23);
        ready(&log).await;
        with_session(&log, 93, "jo").await;
        log.revoke(93).await.unwrap();
        let before = log.revision();
        // The candidate record (gone with the lease) is compared first, on
        // its lease, as etcd does: refused, nothing written.
        let gone = log.lead(lead_txn(93, 0)).await;
        assert!(matches!(gone, Ok(ref a) if !a.value), "{gone:?}");
        assert_eq!(log.revision(), before);
    }
}
