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
