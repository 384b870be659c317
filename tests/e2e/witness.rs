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
//!
//! The reverse direction (issue 15's second half): the lock cluster
//! witnesses the coord cluster. Each arbiter records in the lock log
//! (`{prefix}/sys/coord-seen`) the coord cluster's mark and epoch for this
//! lock cluster as it reads them; a coord cluster restored with the same
//! member flags answers below that record (or below an earlier read of a
//! running arbiter), and the arbiter seals. A restore of the coord cluster
//! that lost nothing about this lock cluster serves on.

use std::path::Path;
use std::time::Duration;

use latchkey_proto::adminv1::{AdvanceEpochRequest, GetStatusRequest, GetStatusResponse};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, Coord};
use latchkey_tests::etcd::{EtcdServer, RestoreFlags};
use latchkey_tests::eventually;
use tonic::Code;

use crate::support::*;

/// The revision half of a token (`latchkey_records::token::unpack`).
fn revision_of(token: u64) -> i64 {
    latchkey_records::token::unpack(token).1
}

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

/// Restores `etcd` (the lock or the coord cluster) from `snapshot` with the
/// same member flags and checks that the cluster id did not change (the
/// case only a mark can reveal).
async fn restore_same_flags(etcd: &mut EtcdServer, snapshot: &Path) -> anyhow::Result<()> {
    let before = etcd.cluster_id().await?;
    etcd.restore(snapshot, RestoreFlags::Same).await?;
    anyhow::ensure!(
        etcd.cluster_id().await? == before,
        "etcd changed the cluster id on a restore with the same flags"
    );
    Ok(())
}

/// `admin status` of `arbiter`.
async fn status(arbiter: &Arbiter) -> anyhow::Result<GetStatusResponse> {
    let mut op = arbiter.admin("latchkey/operator").await?;
    Ok(op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner())
}

/// Polls until the lock cluster's coord-seen record covers the grant of
/// `token` (its epoch and revision): the coord cluster's mark as the lock
/// cluster remembers it.
async fn wait_coord_seen(arbiter: &Arbiter, token: u64) -> anyhow::Result<GetStatusResponse> {
    let op = arbiter.admin("latchkey/operator").await?;
    let (epoch, revision) = latchkey_records::token::unpack(token);
    eventually(
        &format!("the lock cluster to record the coord mark e{epoch}:r{revision}"),
        Duration::from_secs(10),
        || {
            let mut op = op.clone();
            async move {
                let status = op
                    .get_status(GetStatusRequest::default())
                    .await?
                    .into_inner();
                anyhow::ensure!(
                    (status.coord_seen_mark_epoch, status.coord_seen_revision) >= (epoch, revision),
                    "coord-seen e{}:r{} (epoch {})",
                    status.coord_seen_mark_epoch,
                    status.coord_seen_revision,
                    status.coord_seen_epoch
                );
                Ok(status)
            }
        },
    )
    .await
}

/// The coord cluster's epoch record for the default lock cluster name.
async fn coord_epoch_record(coord: &EtcdServer) -> anyhow::Result<Option<Vec<u8>>> {
    let got = coord
        .client()
        .await?
        .get("/latchkey-coord/witness/default/epoch", None)
        .await?;
    Ok(got.kvs().first().map(|kv| kv.value().to_vec()))
}

/// The seal reason names the coord cluster and a restore.
fn assert_coord_restore_reason(status: &GetStatusResponse) {
    assert!(status.sealed, "{status:?}");
    assert!(
        status.seal_reason.contains("coord cluster") && status.seal_reason.contains("restored"),
        "the reason names the coord cluster's restore: {status:?}"
    );
}

/// The operator's advance from epoch 1 through `arbiter`; the new epoch.
async fn advance_from_1(arbiter: &Arbiter, reason: &str) -> anyhow::Result<u32> {
    let mut op = arbiter.admin("latchkey/operator").await?;
    Ok(op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: reason.into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .epoch)
}

/// One grant (released again) through `arbiter` on a fresh session.
async fn one_grant(arbiter: &Arbiter) -> anyhow::Result<latchkey_proto::lockv1::Grant> {
    let mut alice = arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let g = try_lock(&mut alice, "demo/after", "demo", session).await?;
    release(&mut alice, &g).await?;
    Ok(g)
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
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
    assert!(status.witness.contains("coord etcd"), "{status:?}");
    assert_eq!(
        (status.witnessed_mark_epoch, status.witnessed_revision),
        (1, revision_of(before_restore)),
        "the coord cluster vouches for the last grant: {status:?}"
    );
    stop_and_forget(first).await?;

    // restore with the same flags; the next arbiter has no state at all
    restore_same_flags(&mut lock, snapshot.path()).await?;
    let second = arbiter(&lock, Some(&coord), &state_dir).await?;
    expect_sealed(&second).await?;
    let mut op = second.admin("latchkey/operator").await?;
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
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
            ..Default::default()
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
        revision_of(before_snapshot),
        revision_of(before_restore),
        after_advance.epoch,
        revision_of(after_advance.token),
        revision_of(epoch2_high)
    );
    stop_and_forget(second).await?;

    // the same snapshot again: etcd says epoch 1, the arbiter has no memory
    restore_same_flags(&mut lock, snapshot.path()).await?;
    let third = arbiter(&lock, Some(&coord), &state_dir).await?;
    expect_sealed(&third).await?;
    let mut op = third.admin("latchkey/operator").await?;
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
    assert!(status.sealed, "{status:?}");
    assert_eq!(status.epoch, 1, "the restored epoch record: {status:?}");
    assert_eq!(status.witnessed_epoch, 2, "{status:?}");
    let again = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "second restore, state lost again".into(),
            ..Default::default()
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
        revision_of(g.token)
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
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
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
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
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
        revision_of(before_restore),
        g.epoch,
        revision_of(g.token)
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
        ..Default::default()
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
                split_tiers: false,
                coord_tier_witness: Vec::new(),
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

/// The coord cluster restored with the same member flags (same cluster id)
/// after every arbiter lost its state directory: the coord's mark for this
/// lock cluster is back below what the lock cluster recorded of it
/// (coord-seen), so a fresh arbiter seals with a reason naming the coord
/// cluster's restore. The advance allocates epoch 2 on the (restored) coord
/// cluster, and its tokens are above every token issued before.
#[tokio::test(flavor = "multi_thread")]
async fn a_restore_of_the_coord_cluster_is_sealed_by_the_lock_clusters_record() -> anyhow::Result<()>
{
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let mut coord = EtcdServer::start().await?;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().join("state");

    let first = arbiter(&lock, Some(&coord), &state_dir).await?;
    let fresh = status(&first).await?;
    assert_eq!(
        fresh.witnessed_epoch, 1,
        "the coord's epoch is raised to the lock log's at start: {fresh:?}"
    );
    let mut alice = first.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let before_snapshot = churn(&mut alice, session, 3).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    coord.snapshot_save(snapshot.path()).await?;
    // the coord's mark rises past its snapshot; the lock cluster records it
    let before_restore = churn(&mut alice, session, 20).await?;
    let seen = wait_coord_seen(&first, before_restore).await?;
    assert_eq!(seen.coord_seen_epoch, 1, "{seen:?}");
    stop_and_forget(first).await?;

    restore_same_flags(&mut coord, snapshot.path()).await?;
    let second = arbiter(&lock, Some(&coord), &state_dir).await?;
    expect_sealed(&second).await?;
    let sealed = status(&second).await?;
    assert_coord_restore_reason(&sealed);
    assert_eq!(sealed.epoch, 1, "{sealed:?}");
    let advanced = advance_from_1(&second, "coord cluster restored, state lost").await?;
    assert_eq!(advanced, 2);
    assert_eq!(
        coord_epoch_record(&coord).await?.as_deref(),
        Some(&b"00000002"[..]),
        "the advance's epoch is allocated on the coord cluster"
    );
    let g = one_grant(&second).await?;
    assert_eq!(g.epoch, 2);
    assert!(
        g.token > before_restore,
        "token regression: {:#x} after {before_restore:#x}",
        g.token
    );
    eprintln!(
        "coord restore: coord snapshot after e1:r{}, coord-seen e{}:r{} (epoch {}), before restore e1:r{}, after the advance e{}:r{}",
        revision_of(before_snapshot),
        seen.coord_seen_mark_epoch,
        seen.coord_seen_revision,
        seen.coord_seen_epoch,
        revision_of(before_restore),
        g.epoch,
        revision_of(g.token)
    );
    Ok(())
}

/// The coord cluster restored under a running arbiter (its coord etcd
/// restarts from the snapshot, same cluster id): the arbiter's next read of
/// the coord finds the mark below an earlier read in the same lock epoch
/// and seals; the seal is in the lock log, so a fresh arbiter refuses too.
/// After the advance the tokens go up.
#[tokio::test(flavor = "multi_thread")]
async fn a_running_arbiter_sees_the_coord_cluster_go_back() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let mut coord = EtcdServer::start().await?;
    let state = tempfile::tempdir()?;

    let running = arbiter(&lock, Some(&coord), &state.path().join("running")).await?;
    let mut alice = running.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let before_snapshot = churn(&mut alice, session, 3).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    coord.snapshot_save(snapshot.path()).await?;
    let before_restore = churn(&mut alice, session, 20).await?;
    wait_coord_seen(&running, before_restore).await?;

    restore_same_flags(&mut coord, snapshot.path()).await?;
    // The arbiter's coord client reconnects: UNAVAILABLE meanwhile; a grant
    // would be a token the coord cluster no longer vouches above.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match try_lock(&mut alice, "demo/r0", "demo", session).await {
            Ok(g) => anyhow::bail!(
                "granted {:#x} (e{}:r{}) after the coord cluster went back",
                g.token,
                g.epoch,
                revision_of(g.token)
            ),
            Err(s) if refusal(&s) == (Code::FailedPrecondition, "SEALED".into()) => break,
            Err(s) if s.code() == Code::Unavailable => {
                anyhow::ensure!(
                    tokio::time::Instant::now() < deadline,
                    "still UNAVAILABLE after 20 s ({attempts} attempts): {}",
                    s.message()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) => anyhow::bail!(
                "expected SEALED (or UNAVAILABLE while reconnecting), got {:?}: {}",
                refusal(&s),
                s.message()
            ),
        }
    }
    let sealed = status(&running).await?;
    assert_coord_restore_reason(&sealed);
    // every arbiter refuses, even one with no memory of the coord's old mark
    let other = arbiter(&lock, Some(&coord), &state.path().join("other")).await?;
    expect_sealed(&other).await?;
    other.stop().await?;

    let advanced = advance_from_1(&running, "coord cluster restored under the arbiter").await?;
    assert_eq!(advanced, 2);
    let g = one_grant(&running).await?;
    assert_eq!(g.epoch, 2);
    assert!(
        g.token > before_restore,
        "token regression: {:#x} after {before_restore:#x}",
        g.token
    );
    eprintln!(
        "coord restore under a running arbiter: coord snapshot after e1:r{}, before restore e1:r{}, sealed after {attempts} attempts, after the advance e{}:r{}",
        revision_of(before_snapshot),
        revision_of(before_restore),
        g.epoch,
        revision_of(g.token)
    );
    Ok(())
}

/// Which of the two snapshots is the older one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Older {
    Lock,
    Coord,
}

/// Both clusters restored, every arbiter's state lost, the snapshots taken
/// at different times (grants between them): sealed either way, and after
/// the advance every token is above every token issued before the restores.
///
/// What the design guarantees: a restore of both clusters is detected when
/// the two snapshots are apart by at least one vouched grant (and, when the
/// coord snapshot is the older, by one write of the lock cluster's
/// coord-seen record after it): with the lock snapshot older, the coord's
/// mark lies above the restored lock log; with the coord snapshot older,
/// the lock log's coord-seen record lies above the restored coord. Tokens
/// issued after BOTH snapshots were taken are remembered by neither, so a
/// restore of both from the same moment (or a backup job that snapshots
/// both at once) cannot be detected by the clusters alone: only an
/// arbiter's state directory still remembers those tokens. Likewise an
/// epoch allocated after both snapshots is forgotten by both.
#[tokio::test(flavor = "multi_thread")]
async fn both_clusters_restored_from_snapshots_taken_at_different_times() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    restore_both(Older::Lock).await?;
    restore_both(Older::Coord).await?;
    Ok(())
}

async fn restore_both(older: Older) -> anyhow::Result<()> {
    let mut lock = EtcdServer::start().await?;
    let mut coord = EtcdServer::start().await?;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().join("state");
    let lock_snapshot = tempfile::NamedTempFile::new()?;
    let coord_snapshot = tempfile::NamedTempFile::new()?;
    let (older_etcd, older_snapshot, newer_etcd, newer_snapshot) = match older {
        Older::Lock => (&lock, &lock_snapshot, &coord, &coord_snapshot),
        Older::Coord => (&coord, &coord_snapshot, &lock, &lock_snapshot),
    };

    let first = arbiter(&lock, Some(&coord), &state_dir).await?;
    let mut alice = first.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let before_older = churn(&mut alice, session, 3).await?;
    older_etcd.snapshot_save(older_snapshot.path()).await?;
    let between = churn(&mut alice, session, 10).await?;
    if older == Older::Coord {
        // the lock cluster's record of the coord passes the coord snapshot
        wait_coord_seen(&first, between).await?;
    }
    newer_etcd.snapshot_save(newer_snapshot.path()).await?;
    // remembered by neither snapshot (only by the state dir, wiped next)
    let after_both = churn(&mut alice, session, 5).await?;
    stop_and_forget(first).await?;

    restore_same_flags(&mut lock, lock_snapshot.path()).await?;
    restore_same_flags(&mut coord, coord_snapshot.path()).await?;
    let second = arbiter(&lock, Some(&coord), &state_dir).await?;
    expect_sealed(&second).await?;
    let sealed = status(&second).await?;
    match older {
        // the coord's mark is above the restored lock log
        Older::Lock => {
            assert!(sealed.sealed, "{sealed:?}");
            assert!(
                sealed.seal_reason.contains("lock log was restored"),
                "{older:?} older: {sealed:?}"
            );
        }
        // the lock log's coord-seen record is above the restored coord
        Older::Coord => assert_coord_restore_reason(&sealed),
    }
    let advanced = advance_from_1(&second, "both clusters restored, state lost").await?;
    assert_eq!(advanced, 2, "{older:?} older");
    let g = one_grant(&second).await?;
    assert_eq!(g.epoch, 2);
    let issued_before = before_older.max(between).max(after_both);
    assert!(
        g.token > issued_before,
        "{older:?} older: token regression {:#x} after {issued_before:#x}",
        g.token
    );
    eprintln!(
        "both restored, {older:?} snapshot older: before it e1:r{}, between the snapshots up to e1:r{}, after both up to e1:r{}, after the advance e{}:r{}",
        revision_of(before_older),
        revision_of(between),
        revision_of(after_both),
        g.epoch,
        revision_of(g.token)
    );
    Ok(())
}

/// A coord restore that lost nothing about this lock cluster (no grant
/// after its snapshot, only a session opened) is not sealed: its mark and
/// epoch are what the lock cluster recorded. A fresh arbiter serves, and
/// its tokens are above every earlier one.
#[tokio::test(flavor = "multi_thread")]
async fn a_coord_restore_that_lost_nothing_does_not_seal() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let mut coord = EtcdServer::start().await?;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().join("state");

    let first = arbiter(&lock, Some(&coord), &state_dir).await?;
    let mut alice = first.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let before_snapshot = churn(&mut alice, session, 5).await?;
    // everything recorded on both sides before the snapshot
    let seen = wait_coord_seen(&first, before_snapshot).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    coord.snapshot_save(snapshot.path()).await?;
    // no grant after it: a session only
    let mut bob = first.lock("workload/bob").await?;
    open(&mut bob, "demo").await?;
    stop_and_forget(first).await?;

    restore_same_flags(&mut coord, snapshot.path()).await?;
    let second = arbiter(&lock, Some(&coord), &state_dir).await?;
    let g = one_grant(&second).await?;
    let after = status(&second).await?;
    assert!(!after.sealed, "nothing was lost: {after:?}");
    assert_eq!(g.epoch, 1);
    assert!(
        g.token > before_snapshot,
        "token regression: {:#x} after {before_snapshot:#x}",
        g.token
    );
    eprintln!(
        "coord restore that lost nothing: up to e1:r{} before the snapshot, coord-seen e{}:r{}, after the restore e{}:r{}",
        revision_of(before_snapshot),
        seen.coord_seen_mark_epoch,
        seen.coord_seen_revision,
        g.epoch,
        revision_of(g.token)
    );
    Ok(())
}

/// The documented limit, and the operator's way out of it: both clusters
/// restored from backups taken at one moment, before an epoch advance, every
/// arbiter's state lost. Nothing left remembers epoch 2 or its tokens, so
/// nothing seals, and an advance by the arbiter's own knowledge would give
/// epoch 2 again. The operator reads the highest token a fenced resource
/// stored and advances with `at_least_epoch` above its epoch: every token
/// after that is above every token handed out before. A floor beyond the
/// epoch space is refused with INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread")]
async fn after_both_clusters_lost_an_epoch_the_operators_floor_puts_tokens_above_it()
-> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let mut lock = EtcdServer::start().await?;
    let mut coord = EtcdServer::start().await?;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().join("state");
    let lock_snapshot = tempfile::NamedTempFile::new()?;
    let coord_snapshot = tempfile::NamedTempFile::new()?;

    let first = arbiter(&lock, Some(&coord), &state_dir).await?;
    let mut alice = first.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    churn(&mut alice, session, 3).await?;
    // one backup job, both clusters at once
    lock.snapshot_save(lock_snapshot.path()).await?;
    coord.snapshot_save(coord_snapshot.path()).await?;
    assert_eq!(advance_from_1(&first, "a drill after the backup").await?, 2);
    let g = one_grant(&first).await?;
    let mut alice = first.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    // what a fenced resource stored last: an epoch-2 token
    let highest_fenced = churn(&mut alice, session, 5).await?.max(g.token);
    assert_eq!(highest_fenced >> 48, 2);
    stop_and_forget(first).await?;

    restore_same_flags(&mut lock, lock_snapshot.path()).await?;
    restore_same_flags(&mut coord, coord_snapshot.path()).await?;
    let second = arbiter(&lock, Some(&coord), &state_dir).await?;
    let before = status(&second).await?;
    assert!(
        !before.sealed && before.epoch == 1 && before.witnessed_epoch == 1,
        "both backups from one moment: nothing remembers epoch 2: {before:?}"
    );
    let mut op = second.admin("latchkey/operator").await?;
    let beyond = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "a floor beyond the epoch space".into(),
            at_least_epoch: u32::MAX,
            ..Default::default()
        })
        .await;
    match beyond {
        Err(s) => assert!(
            s.code() == Code::InvalidArgument && s.message().contains("epoch space"),
            "{s:?}"
        ),
        Ok(r) => anyhow::bail!("a floor beyond the epoch space was taken: {r:?}"),
    }
    assert_eq!(
        status(&second).await?.epoch,
        1,
        "the refused advance wrote nothing"
    );
    let floor = u32::try_from(highest_fenced >> 48)? + 1;
    let advanced = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "both clusters restored from one backup; floor from the fence".into(),
            at_least_epoch: floor,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(advanced.epoch, 3, "one above the fence's epoch 2");
    let g = one_grant(&second).await?;
    assert!(
        g.token > highest_fenced,
        "token {:#x} not above the fenced {highest_fenced:#x}",
        g.token
    );
    eprintln!(
        "witness e2e: both restored from one moment; fenced e2:r{}, after the operator's floor e{}:r{}",
        revision_of(highest_fenced),
        g.epoch,
        revision_of(g.token)
    );
    Ok(())
}
