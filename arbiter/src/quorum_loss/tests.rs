//! The quorum-loss posture, piece by piece.

use std::collections::BTreeMap;

use super::*;
use crate::error::IdentityBound;
use crate::table::GrantRequest;

/// Nothing held in the lock log.
static FREE: fn(&str, i64) -> bool = |_, _| false;

fn req(key: &str, identity: &str, session: i64) -> GrantRequest {
    GrantRequest {
        key: key.into(),
        identity: identity.into(),
        session,
        class: "batch".into(),
        ttl_seconds: 30,
        annotations: BTreeMap::new(),
        routed_by: None,
        quota: None,
        permits: None,
        instance: format!("{identity}-process"),
        bound: String::new(),
        shared: false,
    }
}

fn posture(dir: &Path, limit: u64) -> QuorumLoss {
    posture_with(dir, limit, 2)
}

/// A posture whose cluster is lost, `max_holds` per identity.
fn posture_with(dir: &Path, limit: u64, max_holds: u32) -> QuorumLoss {
    let q = QuorumLoss::new(
        QuorumLossConfig {
            spool_limit_bytes: limit,
            ..QuorumLossConfig::default()
        },
        dir,
        max_holds,
        1,
    )
    .unwrap();
    q.lose_for_test();
    q
}

#[tokio::test]
async fn lost_after_failures_in_a_row_healthy_after_one_answer() {
    let dir = tempfile::tempdir().unwrap();
    let q = QuorumLoss::new(QuorumLossConfig::default(), dir.path(), 2, 1).unwrap();
    assert!(!q.is_lost());
    q.observe_for_test(Err("no leader".into())).await;
    q.observe_for_test(Err("no leader".into())).await;
    q.observe_for_test(Ok(())).await;
    q.observe_for_test(Err("no leader".into())).await;
    q.observe_for_test(Err("no leader".into())).await;
    assert!(!q.is_lost(), "an answer resets the count");
    q.observe_for_test(Err("no leader".into())).await;
    assert!(q.is_lost());
    let msg = q.closed_refusal("ledger").to_string();
    assert!(msg.contains("lost quorum"), "{msg}");
    assert!(
        msg.contains("class \"ledger\" is closed on quorum loss"),
        "{msg}"
    );
    assert!(msg.contains("retry later"), "{msg}");
    q.observe_for_test(Ok(())).await;
    assert!(!q.is_lost());
}

#[tokio::test]
async fn a_memory_grant_is_spooled_before_it_is_answered_and_exclusive() {
    let dir = tempfile::tempdir().unwrap();
    let q = posture(dir.path(), 1 << 20);
    q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
    // On disk (synced) by the time the caller hears of it.
    let lines = spool::read(&q.spool_path()).unwrap();
    assert_eq!(lines.len(), 1);
    assert_eq!((lines[0].token, lines[0].unprotected), (0, true));
    assert_eq!(lines[0].kind, SpoolKind::Grant);
    // Exclusive in memory; the same session hears "already yours".
    assert!(matches!(
        q.acquire(&req("k/1", "b", 2), None, &FREE).await,
        Err(ArbiterError::Held { .. })
    ));
    assert!(matches!(
        q.acquire(&req("k/1", "a", 3), None, &FREE).await,
        Err(ArbiterError::Leak { .. })
    ));
    // Another instance of the same identity (a replica): contention.
    let mut replica = req("k/1", "a", 4);
    replica.instance = "a-replica".into();
    assert!(matches!(
        q.acquire(&replica, None, &FREE).await,
        Err(ArbiterError::Held { .. })
    ));
    q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
    assert_eq!(spool::read(&q.spool_path()).unwrap().len(), 1);
    // A waiter gets it on release; the release is spooled too.
    let b = req("k/1", "b", 2);
    let waiter = q.acquire(&b, Some(Duration::from_secs(5)), &FREE);
    let release = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        q.release("a", "k/1", 1, 0).await
    };
    let (granted, released) = tokio::join!(waiter, release);
    granted.unwrap();
    assert!(matches!(released, Some(Ok(()))));
    let kinds: Vec<SpoolKind> = spool::read(&q.spool_path())
        .unwrap()
        .iter()
        .map(|r| r.kind)
        .collect();
    assert_eq!(
        kinds,
        [SpoolKind::Grant, SpoolKind::Release, SpoolKind::Grant]
    );
    // A real token is never a memory release.
    assert!(q.release("b", "k/1", 2, 5).await.is_none());
}

#[tokio::test]
async fn bounded_per_identity_and_by_the_spool() {
    let dir = tempfile::tempdir().unwrap();
    let q = posture(dir.path(), 1 << 20);
    q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
    q.acquire(&req("k/2", "a", 1), None, &FREE).await.unwrap();
    assert!(matches!(
        q.acquire(&req("k/3", "a", 1), None, &FREE).await,
        Err(ArbiterError::IdentityLimit { .. })
    ));
    // One waiter per identity here.
    let b1 = req("k/1", "b", 2);
    let first = q.acquire(&b1, Some(Duration::from_millis(300)), &FREE);
    let second = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        q.acquire(&req("k/2", "b", 2), Some(Duration::from_millis(300)), &FREE)
            .await
    };
    let (first, second) = tokio::join!(first, second);
    assert!(matches!(first, Err(ArbiterError::WaitTimeout { .. })));
    assert!(matches!(second, Err(ArbiterError::TooManyWaiters { .. })));

    // A full spool refuses and keeps nothing (here: files the audit
    // tailer has not collected fill it).
    let small = tempfile::tempdir().unwrap();
    let ready = small.path().join("quorum-loss").join("ready");
    std::fs::create_dir_all(&ready).unwrap();
    std::fs::write(ready.join("1-1-1.jsonl"), vec![b'x'; 64 << 10]).unwrap();
    let q = posture(small.path(), 64 << 10);
    let err = q
        .acquire(&req("k/1", "a", 1), None, &FREE)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("spool is full"), "{err}");
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert_eq!(q.memory_holds(), 0);
}

#[tokio::test]
async fn one_identity_cannot_use_up_the_spool_for_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let q = posture_with(dir.path(), 64 << 10, 10_000);
    let mut granted = 0;
    let refused = loop {
        match q
            .acquire(&req(&format!("a/{granted}"), "a", 1), None, &FREE)
            .await
        {
            Ok(_) => granted += 1,
            Err(e) => break e,
        }
    };
    assert!(granted > 0, "{refused}");
    assert!(
        matches!(
            refused,
            ArbiterError::IdentityLimit {
                bound: IdentityBound::Spool,
                ..
            }
        ),
        "{refused}"
    );
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(refused.to_string().contains("share"), "{refused}");
    // Another identity still gets its unprotected grants.
    q.acquire(&req("b/0", "b", 2), None, &FREE).await.unwrap();
    // Every grant taken keeps room for its release line.
    for i in 0..granted {
        let released = q.release("a", &format!("a/{i}"), 1, 0).await;
        assert!(matches!(released, Some(Ok(()))), "{released:?}");
    }
    let lines = spool::read(&q.spool_path()).unwrap();
    assert_eq!(lines.len(), 2 * granted + 1);
}

/// Per-pod identities under one pattern grant share its spool share
/// (issue 30), and a restart restores each hold against the pattern
/// and with its instance.
#[tokio::test]
async fn pods_under_one_pattern_share_one_spool_share() {
    let dir = tempfile::tempdir().unwrap();
    let q = posture_with(dir.path(), 64 << 10, 10_000);
    let pod = |i: usize| {
        let mut r = req(&format!("a/{i}"), &format!("pods/p{i}"), 1);
        r.bound = "pods/*".into();
        r
    };
    let mut granted = 0;
    let refused = loop {
        match q.acquire(&pod(granted), None, &FREE).await {
            Ok(_) => granted += 1,
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            refused,
            ArbiterError::IdentityLimit {
                bound: IdentityBound::Spool,
                ..
            }
        ),
        "every pod its own share would have filled the spool: {refused}"
    );
    // Another subject still gets its unprotected grants.
    q.acquire(&req("b/0", "b", 2), None, &FREE).await.unwrap();
    let lines = spool::read(&q.spool_path()).unwrap();
    assert!(
        lines
            .iter()
            .all(|l| l.identity == "b" || l.bounded_as() == "pods/*")
    );
    assert!(lines.iter().any(|l| l.instance == "pods/p0-process"));
}

#[tokio::test]
async fn a_key_held_in_etcd_by_another_session_is_not_granted_from_memory() {
    let dir = tempfile::tempdir().unwrap();
    let q = posture(dir.path(), 1 << 20);
    let held_by_7 = |key: &str, session: i64| key == "k/1" && session != 7;
    let refused = q.acquire(&req("k/1", "a", 1), None, &held_by_7).await;
    assert!(
        matches!(refused, Err(ArbiterError::Held { .. })),
        "{refused:?}"
    );
    // waiting: until the deadline, or the loss ends
    let refused = q
        .acquire(
            &req("k/1", "a", 1),
            Some(Duration::from_millis(600)),
            &held_by_7,
        )
        .await;
    assert!(
        matches!(refused, Err(ArbiterError::WaitTimeout { .. })),
        "{refused:?}"
    );
    // the holder's own session, and other keys, are served
    q.acquire(&req("k/1", "h", 7), None, &held_by_7)
        .await
        .unwrap();
    q.acquire(&req("k/2", "a", 1), None, &held_by_7)
        .await
        .unwrap();
    assert_eq!(q.memory_holds(), 2);
}

#[tokio::test]
async fn a_live_memory_grant_gates_the_table_for_every_other_session() {
    use crate::table::KeyGate as _;
    let dir = tempfile::tempdir().unwrap();
    let q = posture(dir.path(), 1 << 20);
    q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
    assert!(q.blocked(&req("k/1", "b", 2)), "another identity");
    assert!(
        q.blocked(&req("k/1", "a", 3)),
        "another session of the holder"
    );
    assert!(
        !q.blocked(&req("k/1", "a", 1)),
        "the memory grant's own session"
    );
    assert!(!q.blocked(&req("k/2", "b", 2)), "another key");
    q.release("a", "k/1", 1, 0).await.unwrap().unwrap();
    assert!(!q.blocked(&req("k/1", "b", 2)), "ended");
}

#[tokio::test]
async fn a_restart_during_the_loss_replays_live_grants_and_recovery_ships() {
    let dir = tempfile::tempdir().unwrap();
    {
        let q = posture(dir.path(), 1 << 20);
        q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
        q.acquire(&req("k/2", "a", 1), None, &FREE).await.unwrap();
        q.release("a", "k/2", 1, 0).await.unwrap().unwrap();
    }
    let q = posture(dir.path(), 1 << 20);
    assert_eq!(q.memory_holds(), 1);
    assert!(matches!(
        q.acquire(&req("k/1", "b", 2), None, &FREE).await,
        Err(ArbiterError::Held { .. })
    ));
    q.acquire(&req("k/2", "b", 2), None, &FREE).await.unwrap();
    // Quorum back: the spool goes to ready/, whole.
    q.observe_for_test(Ok(())).await;
    assert!(!q.spool_path().exists());
    let ready: Vec<_> = std::fs::read_dir(q.ready_dir())
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(ready.len(), 1);
    assert_eq!(spool::read(&ready[0].path()).unwrap().len(), 4);
    // A live memory grant keeps its key from etcd grants to others.
    assert!(matches!(
        q.before_log_grant(&req("k/1", "b", 2), None).await,
        Err(ArbiterError::Held { .. })
    ));
    q.before_log_grant(&req("k/1", "a", 1), None).await.unwrap();
    q.before_log_grant(&req("k/9", "b", 2), None).await.unwrap();
    q.granted_in_log("k/1", 1);
    q.before_log_grant(&req("k/1", "b", 2), None).await.unwrap();
}

/// A memory Acquire cancelled while its grant line is being spooled leaves
/// a pending hold that ends at its expiry, not one that keeps the key from
/// everyone for good, and that its session cannot use (its line may never
/// reach the disk) — the hostile reviews of this stop.
#[tokio::test]
async fn a_grant_cancelled_while_it_is_spooled_ends_at_its_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let q = posture(dir.path(), 1 << 20);
    let a = req("k/1", "a", 1);
    {
        let acquire = q.acquire(&a, None, &FREE);
        tokio::pin!(acquire);
        tokio::select! {
            biased;
            _ = &mut acquire => panic!("the spool's fsync answered within one poll"),
            () = std::future::ready(()) => {}
        }
        // dropped here, with the grant line on the blocking pool
    }
    let other = req("k/1", "b", 2);
    {
        let mut holds = q.holds.lock();
        let hold = holds.get_mut("k/1").expect("held until it expires");
        assert!(hold.pending, "never answered, so never its session's");
    }
    assert!(crate::table::KeyGate::blocked(&q, &other));
    {
        // Its expiry comes (30 s on the clock): then it is over.
        let mut holds = q.holds.lock();
        let hold = holds.get_mut("k/1").expect("held until it expires");
        hold.expires = tokio::time::Instant::now();
    }
    assert!(!crate::table::KeyGate::blocked(&q, &other));
    q.acquire(&other, None, &FREE).await.unwrap();
}
