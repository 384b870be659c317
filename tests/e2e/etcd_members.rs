//! The arbiter keeps serving while one etcd member refuses connections (a
//! member down for a rolling restart): tonic's balanced channel keeps such
//! a member "ready" and fails the calls it routes there, so before the
//! arbiter retried connect errors about a third of its calls failed with
//! UNAVAILABLE "tcp connect error".

use latchkey_proto::lockv1::InspectRequest;
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
use latchkey_tests::etcd::EtcdServer;

use crate::support::{open, release, try_lock};

#[tokio::test(flavor = "multi_thread")]
async fn a_member_that_refuses_connections_fails_no_call() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    // A port nobody listens on: every connection to it is refused.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        format!("http://{}", l.local_addr()?)
    };
    let arbiter = Arbiter::start_on(vec![dead, etcd.endpoint()], ArbiterOptions::default()).await?;
    let mut alice = arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    // Unary etcd calls of every kind: reads, grant and release transactions.
    for i in 0..40 {
        let key = format!("demo/members/{i}");
        let g = try_lock(&mut alice, &key, "demo", session).await?;
        let held = alice
            .inspect(InspectRequest { key: key.clone() })
            .await?
            .into_inner();
        assert!(held.holder.is_some(), "{key}: {held:?}");
        release(&mut alice, &g).await?;
    }
    arbiter.stop().await?;
    Ok(())
}
