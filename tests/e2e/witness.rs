//! Issue 15 on real etcd: a lock cluster restored from a snapshot with the
//! same member flags (same cluster id) after every arbiter lost its state
//! directory. The arbiter's own high-water mark is gone with its state, so
//! only a witness outside the lock cluster can tell: here a second etcd, the
//! coord cluster, which holds the highest grant vouched for and the epochs
//! allocated. With it the fresh arbiter seals, and after the operator's
//! advance every token is above every token issued before. Without it (one
//! cluster for everything) the same scenario re-issues tokens: the
//! documented single-cluster limit, asserted here so it cannot change
//! unnoticed.

use std::path::Path;

use latchkey_proto::adminv1::{AdvanceEpochRequest, GetStatusRequest};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, Coord};
use latchkey_tests::etcd::{EtcdServer, RestoreFlags};
use tonic::Code;

use crate::support::*;

/// The revision part of a token (`epoch × 2^48 + revision`).
const REVISION_BITS: u64 = (1 << 48) - 1;

/// An arbiter on `lock` with `state_dir`, witnessed by `coord` when given.
async fn arbiter(
    lock: &EtcdServer,
    coord: Option<&EtcdServer>,
    state_dir: &Path,
) -> anyhow::Result<Arbiter> {
    Arbiter::start(
        lock,
        ArbiterOptions {
            state_dir: Some(state_dir.to_path_buf()),
            coord: coord.map(Coord::on),
            ..Default::default()
        },
    )
    .await
}

/// Stops `arbiter` and deletes its state directory: an arbiter run as a
/// stateless Deployment, rescheduled.
async fn stop_and_forget(arbiter: Arbiter) -> anyhow::Result<()> {
    let state_dir = arbiter.state_dir().to_path_buf();
    arbiter.stop().await?;
    std::fs::remove_dir_all(&state_dir)?;
    Ok(())
}

/// Opening a session on `arbiter` is refused with SEALED.
async fn expect_sealed(arbiter: &Arbiter) -> anyhow::Result<()> {
    let mut alice = arbiter.lock("workload/alice").await?;
    expect_refusal(
        open(&mut alice, "demo").await.map_err(status_of),
        Code::FailedPrecondition,
        "SEALED",
    )?;
    Ok(())
}

/// Restores `lock` from `snapshot` with the same member flags and checks
/// that the cluster id did not change (the case only a mark can reveal).
async fn restore_same_flags(lock: &mut EtcdServer, snapshot: &Path) -> anyhow::Result<()> {
    let before = lock.cluster_id().await?;
    lock.restore(snapshot, RestoreFlags::Same).await?;
    anyhow::ensure!(
        lock.cluster_id().await? == before,
        "etcd changed the cluster id on a restore with the same flags"
    );
    Ok(())
}

/// The scenario, twice: restore + state wiped seals a fresh arbiter
/// through the coord witness; the advance issues tokens above all earlier
/// ones. Then the same snapshot restored again (its epoch record says 1
/// again) after grants in epoch 2, state wiped again: sealed, and the epoch
/// the coord cluster allocates is above both earlier epochs.
#[tokio::test(flavor = "multi_thread")]
async fn a_restore_after_every_arbiter_lost_its_state_is_sealed_by_the_coord_witness()
-> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let mut lock = EtcdServer::start().await?;
    let coord = EtcdServer::start().await?;
    anyhow::ensure!(lock.cluster_id().await? != coord.cluster_id().await?);
    let state = tempfile::tempdir()?;
    let state_dir = state.path().join("state");

    let first = arbiter(&lock, Some(&coord), &state_dir).await?;
    let mut alice = first.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let before_snapshot = churn(&mut alice, session, 3).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    lock.snapshot_save(snapshot.path()).await?;
    // tokens after the snapshot: a restore to it would issue them again
    let before_restore = churn(&mut alice, session, 20).await?;
    assert_eq!(before_restore >> 48, 1);
    let mut op = first.admin("latchkey/operator").await?;
    let status = op.get_status(GetStatusRequest {}).await?.into_inner();
    assert!(status.witness.contains("coord etcd"), "{status:?}");
    assert_eq!(
        (status.witnessed_mark_epoch, status.witnessed_revision),
        (1, i64::try_from(before_restore & REVISION_BITS)?),
        "the coord cluster vouches for the last grant: {status:?}"
    );
    stop_and_forget(first).await?;

    // restore with the same flags; the next arbiter has no state at all
    restore_same_flags(&mut lock, snapshot.path()).await?;
    let second = arbiter(&lock, Some(&coord), &state_dir).await?;
    expect_sealed(&second).await?;
    let mut op = second.admin("latchkey/operator").await?;
    let status = op.get_status(GetStatusRequest {}).await?.into_inner();
    assert!(status.sealed, "{status:?}");
    assert_eq!(status.epoch, 1, "the restored epoch record: {status:?}");
    assert_eq!(
        status.revision_high_water_mark, 0,
        "no state of its own: {status:?}"
    );
    let advanced = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "restore drill, state lost".into(),
        })
        .await?
        .into_inner();
    assert_eq!(advanced.epoch, 2);
    let mut alice = second.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let after_advance = try_lock(&mut alice, "demo/after", "demo", session).await?;
    release(&mut alice, &after_advance).await?;
    assert_eq!(after_advance.epoch, 2);
    assert!(
        after_advance.token > before_restore,
        "token regression: {:#x} after {before_restore:#x}",
        after_advance.token
    );
    let epoch2_high = churn(&mut alice, session, 10)
        .await?
        .max(after_advance.token);
    eprintln!(
        "witness e2e: before snapshot e1:r{}, before restore e1:r{}, after the advance e{}:r{}, epoch 2 up to r{}",
        before_snapshot & REVISION_BITS,
        before_restore & REVISION_BITS,
        after_advance.epoch,
        after_advance.token & REVISION_BITS,
        epoch2_high & REVISION_BITS
    );
    stop_and_forget(second).await?;

    // the same snapshot again: etcd says epoch 1, the arbiter has no memory
    restore_same_flags(&mut lock, snapshot.path()).await?;
    let third = arbiter(&lock, Some(&coord), &state_dir).await?;
    expect_sealed(&third).await?;
    let mut op = third.admin("latchkey/operator").await?;
    let status = op.get_status(GetStatusRequest {}).await?.into_inner();
    assert!(status.sealed, "{status:?}");
    assert_eq!(status.epoch, 1, "the restored epoch record: {status:?}");
    assert_eq!(status.witnessed_epoch, 2, "{status:?}");
    let again = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "second restore, state lost again".into(),
        })
        .await?
        .into_inner();
    assert_eq!(
        again.epoch, 3,
        "above epochs 1 and 2, both of which issued tokens"
    );
    // ... and allocated on the coord cluster, where the next advance starts
    let allocated = coord
        .client()
        .await?
        .get("/latchkey-coord/witness/default/epoch", None)
        .await?;
    let allocated = allocated.kvs().first().map(|kv| kv.value().to_vec());
    assert_eq!(allocated.as_deref(), Some(&b"00000003"[..]));
    let mut alice = third.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let g = try_lock(&mut alice, "demo/after", "demo", session).await?;
    assert_eq!(g.epoch, 3);
    assert!(
        g.token > epoch2_high && g.token > before_restore,
        "token regression after the second restore"
    );
    eprintln!(
        "witness e2e: after the second restore and advance e{}:r{}",
        g.epoch,
        g.token & REVISION_BITS
    );
    release(&mut alice, &g).await?;
    Ok(())
}

/// One cluster for everything, no coord witness: the arbiter's state
/// directory is the only witness, and an arbiter that lost it cannot tell a
/// restore with the same member flags. So it does not grant (the safe
/// default) until an operator says so: an epoch advance, or a restart with
/// `--trust-unwitnessed-log` — and that flag is exactly as dangerous as its
/// help says: after such a restore it grants a token below one already
/// handed out.
#[tokio::test(flavor = "multi_thread")]
async fn without_a_witness_a_stateless_arbiter_refuses_until_an_operator_says_so()
-> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let mut lock = EtcdServer::start().await?;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().join("state");

    let first = arbiter(&lock, None, &state_dir).await?;
    let mut alice = first.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    churn(&mut alice, session, 3).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    lock.snapshot_save(snapshot.path()).await?;
    let before_restore = churn(&mut alice, session, 20).await?;
    let mut op = first.admin("latchkey/operator").await?;
    let status = op.get_status(GetStatusRequest {}).await?.into_inner();
    assert!(
        status.witness.contains("state directory only"),
        "{status:?}"
    );
    stop_and_forget(first).await?;
    restore_same_flags(&mut lock, snapshot.path()).await?;

    // The safe default: no memory, no witness, an existing lock log.
    let cautious = Arbiter::start(
        &lock,
        ArbiterOptions {
            state_dir: Some(state_dir.clone()),
            trust_unwitnessed_log: false,
            ..Default::default()
        },
    )
    .await?;
    expect_sealed(&cautious).await?;
    let mut op = cautious.admin("latchkey/operator").await?;
    let status = op.get_status(GetStatusRequest {}).await?.into_inner();
    assert!(status.sealed, "{status:?}");
    assert!(
        status.seal_reason.contains("--trust-unwitnessed-log"),
        "the reason says what to do: {status:?}"
    );
    stop_and_forget(cautious).await?;

    // The operator's word as a flag: it serves, and after this restore it
    // hands out a token below one handed out before.
    let trusting = arbiter(&lock, None, &state_dir).await?;
    let mut alice = trusting.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let g = try_lock(&mut alice, "demo/r0", "demo", session).await?;
    eprintln!(
        "single cluster, --trust-unwitnessed-log: e1:r{} handed out before the restore, e{}:r{} after it",
        before_restore & REVISION_BITS,
        g.epoch,
        g.token & REVISION_BITS
    );
    assert!(
        g.token < before_restore,
        "--trust-unwitnessed-log after a restore: {:#x} is not below {before_restore:#x}",
        g.token
    );
    Ok(())
}

/// Without a witness, the operator's advance lifts the safe default's seal;
/// the advanced epoch's tokens are above every token of the old epoch.
#[tokio::test(flavor = "multi_thread")]
async fn the_safe_default_is_lifted_by_an_epoch_advance() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let state = tempfile::tempdir()?;
    let first = arbiter(&lock, None, &state.path().join("first")).await?;
    let mut alice = first.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let before = churn(&mut alice, session, 5).await?;
    stop_and_forget(first).await?;

    let cautious = Arbiter::start(
        &lock,
        ArbiterOptions {
            state_dir: Some(state.path().join("second")),
            trust_unwitnessed_log: false,
            ..Default::default()
        },
    )
    .await?;
    expect_sealed(&cautious).await?;
    let mut op = cautious.admin("latchkey/operator").await?;
    op.advance_epoch(AdvanceEpochRequest {
        expected_epoch: 1,
        reason: "the state directory was lost; no restore happened".into(),
    })
    .await?;
    let mut alice = cautious.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let g = try_lock(&mut alice, "demo/after", "demo", session).await?;
    assert_eq!(g.epoch, 2);
    assert!(g.token > before);
    release(&mut alice, &g).await?;
    Ok(())
}

/// `--coord-etcd` naming the lock cluster under another address is refused
/// at start: a restore of that cluster would roll back its own witness.
#[tokio::test(flavor = "multi_thread")]
async fn the_lock_cluster_cannot_witness_itself() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let refused = Arbiter::start(
        &lock,
        ArbiterOptions {
            coord: Some(Coord {
                endpoints: vec![format!("http://localhost:{}", lock.client_port())],
                prefix: None,
                lock_cluster_name: None,
            }),
            ..Default::default()
        },
    )
    .await;
    let Err(err) = refused else {
        anyhow::bail!("the arbiter started with its lock cluster as its coord cluster");
    };
    let msg = format!("{err:#}");
    assert!(msg.contains("is the lock cluster"), "{msg}");
    Ok(())
}
