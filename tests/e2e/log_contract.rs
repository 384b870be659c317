//! The lock log contract (`latchkey_tests::log_contract`) against both
//! logs: the simulation's MemLog on a paused clock, and the arbiter's
//! EtcdLog on a real etcd. A case that passes on one and fails on the
//! other is a MemLog that is not etcd (or an EtcdLog that is not the
//! protocol's).

use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::bounds::Bounds;
use latchkey_arbiter::lock_log::LockLog;
use latchkey_arbiter::lock_log::etcd::{EtcdLog, StoreConfig};
use latchkey_sim::MemLog;
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::init_tracing;
use latchkey_tests::log_contract::{TtlClock, run_all};

#[tokio::test(start_paused = true)]
async fn memlog_keeps_the_log_contract() -> anyhow::Result<()> {
    init_tracing();
    let log: Arc<dyn LockLog> = Arc::new(MemLog::new(0x10c));
    run_all(
        log,
        TtlClock::Tokio {
            within: Duration::from_secs(30),
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_log_keeps_the_log_contract() -> anyhow::Result<()> {
    init_tracing();
    let etcd = EtcdServer::start().await?;
    let log = EtcdLog::connect(
        &StoreConfig {
            endpoints: vec![etcd.endpoint()],
            prefix: format!("contract-{}", std::process::id()),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            tls: None,
            login: None,
        },
        Arc::new(Bounds::new(64)),
    )
    .await?;
    // etcd expires a 2 s lease within a second or so of its TTL
    run_all(
        Arc::new(log),
        TtlClock::Tokio {
            within: Duration::from_secs(15),
        },
    )
    .await
}

/// An election's watch from a compacted revision is lost on both logs
/// (etcd cancels it); from the compaction revision itself it replays, and
/// the value before a change at that revision is gone with the revision
/// before it (etcd reads `prev_kv` there). Compaction is no `LockLog`
/// call, so this runs outside the contract suite, each log compacted its
/// own way.
async fn a_compacted_election_watch_is_lost(
    log: &dyn LockLog,
    compact: impl AsyncFnOnce(i64) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use latchkey_arbiter::lock_log::{FollowSignal, PrefixWatch};

    async fn next(watch: &mut Box<dyn PrefixWatch>) -> anyhow::Result<FollowSignal> {
        Ok(tokio::time::timeout(Duration::from_secs(10), watch.next()).await?)
    }

    let session = 0x4C4B_0000_F000;
    let record = b"session of spiffe://contract/compacted".to_vec();
    log.grant_lease(session, 60).await?;
    log.put_session(session, "spiffe://contract/compacted", record.clone())
        .await?;
    let election = "contract/compacted";
    let stand = async |value: &[u8]| {
        log.stand(election, session, 1, &record, value.to_vec())
            .await?
            .value
            .ok_or_else(|| anyhow::anyhow!("the stand was refused"))
    };
    let first = stand(b"first").await?;
    let again = stand(b"again").await?;
    anyhow::ensure!(again.created == first.created, "{again:?} after {first:?}");
    compact(again.modified).await?;

    let mut below = log.watch_election(election, first.modified).await?;
    anyhow::ensure!(
        next(&mut below).await? == FollowSignal::Lost,
        "a watch from below the compaction was not lost"
    );
    let mut at = log.watch_election(election, again.modified).await?;
    match next(&mut at).await? {
        FollowSignal::Events { events, through } => {
            anyhow::ensure!(through == again.modified, "through {through}");
            anyhow::ensure!(events.len() == 1, "{events:?}");
            let put = events[0].put.as_ref().map(|kv| kv.value.as_slice());
            anyhow::ensure!(put == Some(&b"again"[..]), "{events:?}");
            anyhow::ensure!(
                events[0].prev.is_none(),
                "a prev_kv below the compaction: {events:?}"
            );
        }
        FollowSignal::Lost => anyhow::bail!("a watch from the compaction revision was lost"),
    }
    log.revoke(session).await?;
    match next(&mut at).await? {
        FollowSignal::Events { events, .. } => {
            anyhow::ensure!(events.len() == 1 && events[0].put.is_none(), "{events:?}");
            let prev = events[0].prev.as_ref().map(|kv| kv.value.as_slice());
            anyhow::ensure!(prev == Some(&b"again"[..]), "{events:?}");
        }
        FollowSignal::Lost => anyhow::bail!("lost after a revoke"),
    }
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn memlog_loses_a_compacted_election_watch() -> anyhow::Result<()> {
    init_tracing();
    let log = MemLog::new(0xe1);
    a_compacted_election_watch_is_lost(&log, async |revision| {
        log.compact(revision)?;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_log_loses_a_compacted_election_watch() -> anyhow::Result<()> {
    init_tracing();
    let etcd = EtcdServer::start().await?;
    let log = EtcdLog::connect(
        &StoreConfig {
            endpoints: vec![etcd.endpoint()],
            prefix: "compacted".into(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            tls: None,
            login: None,
        },
        Arc::new(Bounds::new(64)),
    )
    .await?;
    let client = etcd.client().await?;
    a_compacted_election_watch_is_lost(&log, async |revision| {
        client.kv_client().compact(revision, None).await?;
        Ok(())
    })
    .await
}

/// A session holding thousands of keys ends in one revision whose watch
/// response carries every deleted record (`prev_kv`): far more than
/// gRPC's default 4 MiB a message. The holds' follower must get it as
/// events, not lose its watch (which dropped the lock-loss notices of
/// every hold that ended until it had read everything again). Found by the
/// review of the follow's move to the log (issue 32).
#[tokio::test(flavor = "multi_thread")]
async fn a_session_ending_thousands_of_holds_reaches_the_follower_whole() -> anyhow::Result<()> {
    use latchkey_arbiter::lock_log::etcd::follow::EtcdFollower;
    use latchkey_arbiter::lock_log::{Counted, FollowLog, FollowSignal};
    use latchkey_etcd::kv::PutOptions;
    use latchkey_etcd::txn::{Txn, TxnOp};

    init_tracing();
    let etcd = EtcdServer::start().await?;
    let client = etcd.client().await?;
    let prefix = "big-revoke";
    const HOLDS: usize = 20_000;
    let lease = client.lease_client().grant(600, None).await?.id();
    // A holder record's size: identity, session, class, annotations.
    let record = vec![b'x'; 400];
    let mut kv = client.kv_client();
    for chunk in (0..HOLDS).collect::<Vec<_>>().chunks(100) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|i| {
                TxnOp::put(
                    format!("{prefix}/l/ns/key-{i:06}"),
                    record.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )
            })
            .collect();
        kv.txn(Txn::new().and_then(ops)).await?;
    }
    let follower = EtcdFollower::new(client.clone(), prefix);
    let mut read = 0usize;
    let (_, watch) = follower
        .follow(Counted::Holds, true, &mut |_, _| read += 1)
        .await?;
    let mut watch = watch?;
    assert_eq!(read, HOLDS);
    client.lease_client().revoke(lease).await?;
    let mut deleted = 0usize;
    while deleted < HOLDS {
        match tokio::time::timeout(Duration::from_secs(30), watch.next()).await? {
            FollowSignal::Events { events, .. } => {
                assert!(events.iter().all(|e| e.put.is_none() && e.prev.is_some()));
                deleted += events.len();
            }
            FollowSignal::Lost => {
                anyhow::bail!("the watch was lost after {deleted} of {HOLDS} deletes")
            }
        }
    }
    assert_eq!(deleted, HOLDS);
    Ok(())
}
