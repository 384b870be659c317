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
