//! Envoy's active gRPC health checks on the `arbiter` cluster (issue 20,
//! envoy/edge.yaml): a real Envoy in front of a real arbiter over real etcd.
//! The arbiter is healthy from the start (the edge serves at once), turns
//! unhealthy when a restore of its lock log seals it, and healthy again when an
//! operator advances the epoch. While it is the only arbiter and sealed,
//! Envoy's panic mode still routes to it, so callers get SEALED with the way
//! out, not "no healthy upstream".

use std::time::Duration;

use latchkey_proto::adminv1::AdvanceEpochRequest;
use latchkey_tests::deploy::ENVOY_BUILTIN_METRICS;
use latchkey_tests::envoy::Envoy;
use latchkey_tests::etcd::RestoreFlags;
use latchkey_tests::eventually;
use tonic::Code;

use crate::edge::{edge, lock};
use crate::support::*;

/// The `health_flags` Envoy's admin `/clusters` shows for the arbiter cluster's
/// one host (`healthy`, or e.g. `/failed_active_hc`).
async fn arbiter_health(envoy: &Envoy) -> anyhow::Result<String> {
    let clusters = latchkey_tests::envoy::admin_get_unix(envoy.admin_socket(), "/clusters").await?;
    let flags: Vec<&str> = clusters
        .lines()
        .filter(|l| l.starts_with("arbiter::") && l.contains("::health_flags::"))
        .filter_map(|l| l.rsplit("::").next())
        .collect();
    match flags.as_slice() {
        [one] => Ok((*one).to_string()),
        _ => anyhow::bail!("not one arbiter host in /clusters:\n{clusters}"),
    }
}

async fn wait_health(envoy: &Envoy, want: &str) -> anyhow::Result<()> {
    eventually(
        &format!("the arbiter to be {want} in /clusters"),
        Duration::from_secs(30),
        || async {
            let flags = arbiter_health(envoy).await?;
            anyhow::ensure!(flags == want, "health_flags {flags}");
            Ok(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sealed_arbiter_turns_unhealthy_in_envoy_and_healthy_after_the_advance()
-> anyhow::Result<()> {
    let mut e = edge(serde_json::json!({})).await?;
    // healthy from the start: the edge serves right away
    assert_eq!(arbiter_health(&e.envoy).await?, "healthy");
    let checks = e
        .envoy
        .counter("cluster.arbiter.health_check.success")
        .await?;
    assert!(
        checks >= 1,
        "no successful gRPC health check yet ({checks})"
    );
    // the Envoy built-ins deploy/'s alerts and dashboard use, as Envoy names them
    let prom = e.envoy.prometheus().await?;
    for name in ENVOY_BUILTIN_METRICS {
        let sample = format!("{name}{{envoy_cluster_name=\"arbiter\"}} 1");
        assert!(
            prom.lines().any(|l| l == sample),
            "no {sample:?} on /stats/prometheus"
        );
    }
    let mut alice = e.client("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let g = lock(&mut alice, "demo/health", "demo", session).await?;
    release(&mut alice, &g).await?;

    // seal it: restore the lock log under a new cluster id
    let snapshot = tempfile::NamedTempFile::new()?;
    e._stack.etcd.snapshot_save(snapshot.path()).await?;
    e._stack
        .etcd
        .restore(snapshot.path(), RestoreFlags::Different)
        .await?;
    // the arbiter notices the restore on its next etcd answer: a call through
    // the edge gets SEALED with the way out
    let refused = eventually("SEALED through the edge", Duration::from_secs(20), || {
        let mut alice = alice.clone();
        async move {
            let session = open(&mut alice, "demo").await.unwrap_or(session);
            match lock(&mut alice, "demo/health", "demo", session).await {
                // a grant in the restored log ends the wait: it is the failure
                Ok(g) => Ok(Err(g)),
                Err(st) if refusal(&st) == (Code::FailedPrecondition, "SEALED".into()) => {
                    Ok(Ok(st))
                }
                Err(st) => anyhow::bail!("not SEALED: {st}"),
            }
        }
    })
    .await?
    .map_err(|g| anyhow::anyhow!("granted while sealed (epoch {})", g.epoch))?;
    assert!(
        refused.message().contains("advance-epoch"),
        "{}",
        refused.message()
    );

    // Envoy's gRPC health checks take it out of the ring
    wait_health(&e.envoy, "/failed_active_hc").await?;
    let failed = e
        .envoy
        .counter("cluster.arbiter.health_check.failure")
        .await?;
    assert!(failed >= 1, "no failed health check counted");

    // the only arbiter, unhealthy: Envoy's panic mode still routes to it, so
    // callers keep getting SEALED with the way out, not "no healthy upstream"
    let mut again = e.client("workload/alice").await?;
    let session = open(&mut again, "demo").await.unwrap_or(session);
    match lock(&mut again, "demo/health", "demo", session).await {
        Ok(g) => anyhow::bail!("granted while sealed (epoch {})", g.epoch),
        Err(st) => assert_eq!(
            refusal(&st),
            (Code::FailedPrecondition, "SEALED".to_string()),
            "{st}"
        ),
    }

    // the operator's advance unseals it: healthy again, grants again
    let mut op = e._stack.arbiter.admin("latchkey/operator").await?;
    op.advance_epoch(AdvanceEpochRequest {
        expected_epoch: 1,
        reason: "health check drill".into(),
        ..Default::default()
    })
    .await?;
    wait_health(&e.envoy, "healthy").await?;
    let session = open(&mut alice, "demo").await?;
    let g = lock(&mut alice, "demo/health", "demo", session).await?;
    assert_eq!(g.epoch, 2);
    release(&mut alice, &g).await?;
    Ok(())
}
