//! Quorum loss (ADR-04, issue 16) on a real 3-member etcd cluster: with 2
//! of 3 members down, a closed class refuses with UNAVAILABLE and grants
//! nothing; an open class grants from the arbiter's memory with token 0,
//! marked unprotected, and the grant is in the fsynced spool before the
//! answer. After recovery the spool is shipped for the audit tailer, the
//! memory grant keeps its key until it ends, and closed-class grants work
//! again with tokens above every earlier one.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_proto::adminv1::GetStatusRequest;
use latchkey_proto::lockv1::InspectRequest;
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
use latchkey_tests::cluster::{ClusterOptions, EtcdCluster};
use latchkey_tests::envoy::admin_get;
use latchkey_tests::postgres::PostgresServer;
use latchkey_tests::{copy_dev_policies, eventually, init_tracing};
use tonic::Code;

use crate::support::{Client, expect_refusal, open, refusal, release, try_lock};

/// An advisory efficiency class that stays open on quorum loss.
pub(crate) const OPEN_CLASS: &str = r#"
[[class]]
name = "spare-capacity"
description = "Warms caches; two holders only waste work."
tier = "entity"
enforcement = "advisory"
ttlSeconds = 30
onQuorumLoss = "open"
riskOwner = "team-platform@example.com"
waiverExpires = "2099-12-31"
"#;

/// Noticing the loss takes a few failed probes; a new leader an election.
const CONVERGE: Duration = Duration::from_secs(30);

fn spool_lines(path: &Path) -> anyhow::Result<Vec<latchkey_audit::spool::SpoolLine>> {
    Ok(latchkey_audit::spool::read(path)?)
}

fn ready_files(state_dir: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    Ok(latchkey_audit::spool::ready_files(
        &state_dir.join("quorum-loss").join("ready"),
    )?)
}

async fn holder_of(c: &mut Client, key: &str) -> anyhow::Result<bool> {
    let resp = c
        .inspect(InspectRequest { key: key.into() })
        .await?
        .into_inner();
    Ok(resp.holder.is_some())
}

#[tokio::test(flavor = "multi_thread")]
async fn two_of_three_down_closed_refuses_open_grants_unprotected_and_spools() -> anyhow::Result<()>
{
    init_tracing();
    let mut cluster = EtcdCluster::start(ClusterOptions::default()).await?;
    let policies = tempfile::tempdir()?;
    copy_dev_policies(policies.path())?;
    std::fs::write(policies.path().join("classes/quorum-loss.toml"), OPEN_CLASS)?;
    let state = tempfile::tempdir()?;
    let arbiter = Arbiter::start_on(
        cluster.endpoints(),
        ArbiterOptions {
            policies_dir: policies.path().to_path_buf(),
            state_dir: Some(state.path().to_path_buf()),
            metrics: true,
            ..ArbiterOptions::default()
        },
    )
    .await?;
    let mut alice = arbiter.lock("workload/alice").await?;
    let mut bob = arbiter.lock("workload/bob").await?;
    let alice_closed = open(&mut alice, "demo").await?;
    let alice_open = open(&mut alice, "spare-capacity").await?;
    let bob_open = open(&mut bob, "spare-capacity").await?;

    let before = try_lock(&mut alice, "demo/quorum/before", "demo", alice_closed).await?;
    ensure!(before.token > 0 && !before.unprotected, "{before:?}");
    release(&mut alice, &before).await?;
    // An open-class key held in etcd when the quorum goes: its holder
    // cannot renew, but nobody else gets it from memory meanwhile.
    let held_in_etcd = eventually("an etcd grant of the open class", CONVERGE, || {
        let mut alice = alice.clone();
        async move {
            Ok(try_lock(
                &mut alice,
                "shared/quorum/etcd",
                "spare-capacity",
                alice_open,
            )
            .await?)
        }
    })
    .await?;
    ensure!(held_in_etcd.token > 0, "{held_in_etcd:?}");

    // Two of three members down: no majority.
    let leader = cluster.leader().await?;
    cluster.kill(leader)?;
    cluster.kill((leader + 1) % 3)?;

    // A closed class: UNAVAILABLE, saying why and what to do.
    let refused = eventually(
        "the closed class to be refused for quorum loss",
        CONVERGE,
        || {
            let mut alice = alice.clone();
            async move {
                let r = try_lock(&mut alice, "demo/quorum/during", "demo", alice_closed).await;
                let status = expect_refusal(r, Code::Unavailable, "STORE_UNAVAILABLE")?;
                ensure!(
                    status.message().contains("lost quorum"),
                    "{}",
                    status.message()
                );
                Ok(status)
            }
        },
    )
    .await?;
    let message = refused.message();
    assert!(
        message.contains("class \"demo\" is closed on quorum loss") && message.contains("retry"),
        "{message}"
    );

    // An open class: token 0, unprotected, spooled before the answer.
    let memory = try_lock(&mut alice, "shared/quorum/a", "spare-capacity", alice_open).await?;
    assert_eq!((memory.token, memory.epoch, memory.revision), (0, 0, 0));
    assert!(memory.unprotected, "{memory:?}");
    let spool = state.path().join("quorum-loss").join("spool.jsonl");
    let lines = spool_lines(&spool)?;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        (
            lines[0].key.as_str(),
            lines[0].kind.as_str(),
            lines[0].token,
            lines[0].unprotected
        ),
        ("shared/quorum/a", "grant", 0, true)
    );
    // Still exclusive within this arbiter's memory.
    let r = try_lock(&mut bob, "shared/quorum/a", "spare-capacity", bob_open).await;
    expect_refusal(r, Code::Aborted, "HELD")?;
    // A key held in etcd before the loss is not granted from memory.
    let r = try_lock(&mut bob, "shared/quorum/etcd", "spare-capacity", bob_open).await;
    expect_refusal(r, Code::Aborted, "HELD")?;
    // A second open grant, released during the loss: both in the spool.
    let other = try_lock(&mut bob, "shared/quorum/b", "spare-capacity", bob_open).await?;
    release(&mut bob, &other).await?;
    let kinds: Vec<&str> = spool_lines(&spool)?
        .into_iter()
        .map(|l| l.kind.as_str())
        .collect();
    assert_eq!(kinds, ["grant", "grant", "release"]);

    // Operators see the loss: admin status answers without etcd, and the
    // metrics say it too.
    let status = arbiter
        .admin("latchkey/operator")
        .await?
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
    assert!(
        status.quorum_lost && status.quorum_lost_for_ms > 0,
        "{status:?}"
    );
    assert!(!status.quorum_last_error.is_empty(), "{status:?}");
    assert_eq!(status.unprotected_memory_grants, 1, "{status:?}");
    assert!(status.quorum_loss_spool_bytes > 0, "{status:?}");
    let metrics_addr = arbiter.metrics_addr().context("metrics")?;
    let text = admin_get(metrics_addr, "/metrics").await?;
    for line in [
        "latchkey_arbiter_quorum_lost 1",
        "latchkey_arbiter_unprotected_memory_grants 1",
        "latchkey_arbiter_unprotected_grants_total 2",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
    }

    // Quorum back.
    cluster.restart(leader).await?;
    cluster.restart((leader + 1) % 3).await?;
    cluster.wait_healthy(CONVERGE).await?;

    // The spool is shipped: a ready file the audit tailer reads, whole.
    let shipped = eventually("the spool to be shipped", CONVERGE, || async {
        let files = ready_files(state.path())?;
        ensure!(files.len() == 1, "ready: {files:?}");
        ensure!(!spool.exists(), "the open spool is still there");
        Ok(files[0].clone())
    })
    .await?;
    let lines = spool_lines(&shipped)?;
    assert_eq!(lines.len(), 3);
    let events = latchkey_audit::spool::events(&lines, "f");
    assert!(
        events
            .iter()
            .all(|(_, e)| e.detail["unprotected"] == true && e.revision < 0),
        "{events:?}"
    );

    // The closed class grants again, above every earlier token; its refusal
    // during the loss wrote nothing.
    let after = eventually("the closed class to grant again", CONVERGE, || {
        let mut alice = alice.clone();
        async move {
            let session = open(&mut alice, "demo").await?;
            Ok(try_lock(&mut alice, "demo/quorum/after", "demo", session).await?)
        }
    })
    .await?;
    assert!(
        after.token > before.token && !after.unprotected,
        "{after:?}"
    );
    assert!(!holder_of(&mut alice, "demo/quorum/during").await?);
    let text = admin_get(metrics_addr, "/metrics").await?;
    assert!(
        text.lines().any(|l| l == "latchkey_arbiter_quorum_lost 0"),
        "{text}"
    );

    // The live memory grant keeps its key from an etcd grant to another
    // session until it ends (here: released with token 0).
    let bob_open = open(&mut bob, "spare-capacity").await?;
    let r = try_lock(&mut bob, "shared/quorum/a", "spare-capacity", bob_open).await;
    expect_refusal(r, Code::Aborted, "HELD")?;
    release(&mut alice, &memory).await?;
    let real = try_lock(&mut bob, "shared/quorum/a", "spare-capacity", bob_open)
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", refusal(&s), s.message()))
        .context("the etcd grant after the memory grant ended")?;
    assert!(real.token > after.token && !real.unprotected, "{real:?}");
    arbiter.stop().await?;

    // The audit tailer's collection (`--quorum-loss-spool-dir`): every
    // unprotected grant lands in the audit store, marked so, and the files
    // move to shipped/; a second pass writes nothing twice.
    let pg = PostgresServer::start().await?;
    let store = latchkey_audit::store::open(&pg.url()).await?;
    store.migrate().await?;
    let ready = state.path().join("quorum-loss").join("ready");
    let written = latchkey_audit::spool::collect_once(&ready, store.as_ref()).await?;
    assert!(written >= 3, "{written} events");
    assert!(latchkey_audit::spool::ready_files(&ready)?.is_empty());
    let cluster_id = lines[0].cluster_id;
    assert_ne!(cluster_id, 0);
    let events = store.all(cluster_id).await?;
    let unprotected: Vec<_> = events
        .iter()
        .filter(|e| e.event.detail["unprotected"] == true)
        .collect();
    let grants: Vec<&str> = unprotected
        .iter()
        .filter(|e| e.event.kind == latchkey_audit::Kind::Grant)
        .map(|e| e.event.key.as_str())
        .collect();
    assert_eq!(grants, ["shared/quorum/a", "shared/quorum/b"], "{events:?}");
    assert_eq!(
        latchkey_audit::spool::collect_once(&ready, store.as_ref()).await?,
        0
    );
    Ok(())
}
