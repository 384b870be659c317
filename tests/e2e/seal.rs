//! ADR-03 on a real etcd: a restored lock log never re-issues a token.
//!
//! Both restore shapes are exercised: with the same member flags (etcd keeps
//! the cluster id — only the revision high-water mark reveals it) and with
//! different flags (new cluster id). After either, every grant is refused with
//! SEALED until an operator advances the epoch, and every token issued after
//! the advance is larger than every token issued before the restore.

use std::time::Duration;

use latchkey_proto::adminv1::{AdvanceEpochRequest, GetStatusRequest};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
use latchkey_tests::etcd::RestoreFlags;
use latchkey_tests::eventually;
use tonic::Code;

use latchkey_records::token::unpack;

use crate::support::*;

async fn restore_is_sealed_until_the_epoch_advances(flags: RestoreFlags) -> anyhow::Result<()> {
    let mut s = stack().await?;
    let state_dir = s.arbiter.state_dir().to_path_buf();
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    churn(&mut alice, session, 3).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    s.etcd.snapshot_save(snapshot.path()).await?;
    // tokens issued after the snapshot: a naive restore would issue them again
    let before_restore = churn(&mut alice, session, 20).await?;
    let cluster_before = s.etcd.cluster_id().await?;

    s.etcd.restore(snapshot.path(), flags).await?;
    let cluster_after = s.etcd.cluster_id().await?;
    match flags {
        RestoreFlags::Same => assert_eq!(cluster_before, cluster_after, "etcd kept the cluster id"),
        RestoreFlags::Different => assert_ne!(cluster_before, cluster_after),
    }

    // the running arbiter refuses, naming the way out
    let sealed = eventually("the arbiter to seal", Duration::from_secs(20), || {
        let mut alice = alice.clone();
        async move {
            let mut alice2 = alice.clone();
            // the session may or may not be in the snapshot; use a fresh one when it is not
            let session = match open(&mut alice2, "demo").await {
                Ok(id) => id,
                Err(_) => session,
            };
            match try_lock(&mut alice, "demo/after", "demo", session).await {
                // a grant in the restored log ends the wait: it is the failure
                Ok(g) => Ok(Err(g)),
                Err(st) if refusal(&st) == (Code::FailedPrecondition, "SEALED".to_string()) => {
                    Ok(Ok(st))
                }
                Err(st) => anyhow::bail!("not sealed yet: {st}"),
            }
        }
    })
    .await?;
    let sealed = match sealed {
        Ok(st) => st,
        Err(g) => anyhow::bail!(
            "granted in the restored log (token above every earlier one: {})",
            g.token > before_restore
        ),
    };
    assert!(
        sealed.message().contains("advance-epoch"),
        "{}",
        sealed.message()
    );

    // an arbiter restarted on the same state dir is still sealed
    let Stack { etcd, arbiter } = s;
    arbiter.stop().await?;
    let arbiter = Arbiter::start(
        &etcd,
        ArbiterOptions {
            state_dir: Some(state_dir),
            ..Default::default()
        },
    )
    .await?;
    let mut alice = arbiter.lock("workload/alice").await?;
    expect_refusal(
        open(&mut alice, "demo").await.map_err(status_of),
        Code::FailedPrecondition,
        "SEALED",
    )?;
    // an arbiter with no memory of the old log is sealed by the seal record
    let fresh = Arbiter::start(&etcd, ArbiterOptions::default()).await?;
    let mut fresh_alice = fresh.lock("workload/alice").await?;
    expect_refusal(
        open(&mut fresh_alice, "demo").await.map_err(status_of),
        Code::FailedPrecondition,
        "SEALED",
    )?;

    // status shows it; only an operator may advance
    let mut op = arbiter.admin("latchkey/operator").await?;
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
    assert!(status.sealed, "{status:?}");
    assert_eq!(status.epoch, 1);
    let mut not_op = arbiter.admin("workload/alice").await?;
    expect_refusal(
        not_op
            .advance_epoch(AdvanceEpochRequest {
                expected_epoch: 1,
                reason: "x".into(),
                ..Default::default()
            })
            .await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    expect_refusal(
        op.advance_epoch(AdvanceEpochRequest {
            expected_epoch: 7,
            reason: "restore drill".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    let advanced = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "restore drill".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(advanced.epoch, 2);
    assert_eq!(advanced.cluster_id, cluster_after);

    // every arbiter serves again (the others see the new epoch), and every new
    // token is above every token issued before the restore
    for a in [&arbiter, &fresh] {
        let mut c = a.lock("workload/alice").await?;
        let session = open(&mut c, "demo").await?;
        let g = try_lock(&mut c, "demo/after", "demo", session).await?;
        assert_eq!(g.epoch, 2);
        assert!(g.token > before_restore, "token regression after restore");
        release(&mut c, &g).await?;
    }
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
    assert!(!status.sealed, "{status:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_with_the_same_member_flags_is_sealed_by_the_high_water_mark()
-> anyhow::Result<()> {
    restore_is_sealed_until_the_epoch_advances(RestoreFlags::Same).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_with_new_member_flags_is_sealed_by_the_cluster_id() -> anyhow::Result<()> {
    restore_is_sealed_until_the_epoch_advances(RestoreFlags::Different).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_to_before_an_epoch_advance_is_sealed_too() -> anyhow::Result<()> {
    let mut s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    churn(&mut alice, session, 2).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    s.etcd.snapshot_save(snapshot.path()).await?;
    let mut op = s.arbiter.admin("latchkey/operator").await?;
    op.advance_epoch(AdvanceEpochRequest {
        expected_epoch: 1,
        reason: "rehome".into(),
        ..Default::default()
    })
    .await?;
    let session = open(&mut alice, "demo").await?;
    let high = churn(&mut alice, session, 2).await?;
    assert_eq!(unpack(high).0, 2);
    s.etcd.restore(snapshot.path(), RestoreFlags::Same).await?;
    wait_sealed(&alice).await
}

/// `Ok` when `e` is a SEALED refusal; the error otherwise.
fn expect_sealed(e: anyhow::Error) -> anyhow::Result<()> {
    let st = status_of(e);
    anyhow::ensure!(refusal(&st).1 == "SEALED", "{st}");
    Ok(())
}

/// Waits until opening a session on `c` is refused with SEALED.
async fn wait_sealed(c: &Client) -> anyhow::Result<()> {
    eventually("sealed", Duration::from_secs(20), || {
        let mut c = c.clone();
        async move {
            match open(&mut c, "demo").await {
                Err(e) => expect_sealed(e),
                Ok(_) => anyhow::bail!("served"),
            }
        }
    })
    .await
}

/// Found by the release gate: restoring the same snapshot twice put etcd's
/// epoch record back to 1 both times, and the second advance moved it to 2
/// again — an epoch that had already issued tokens. The arbiter that had
/// granted in epoch 2 stayed sealed for good; an arbiter without that memory
/// would have issued epoch-2 tokens below earlier ones. The advance now goes
/// above every epoch a sealing arbiter has used.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_restore_of_the_same_snapshot_never_reuses_an_epoch() -> anyhow::Result<()> {
    let mut s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    churn(&mut alice, session, 2).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    s.etcd.snapshot_save(snapshot.path()).await?;
    churn(&mut alice, session, 5).await?;
    let mut op = s.arbiter.admin("latchkey/operator").await?;

    // first restore: sealed, advanced to epoch 2, many grants in epoch 2
    s.etcd.restore(snapshot.path(), RestoreFlags::Same).await?;
    wait_sealed(&alice).await?;
    let first = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "first restore".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(first.epoch, 2);
    let session = open(&mut alice, "demo").await?;
    let epoch2_high = churn(&mut alice, session, 30).await?;
    assert_eq!(unpack(epoch2_high).0, 2);

    // second restore of the same snapshot: etcd says epoch 1 again
    s.etcd.restore(snapshot.path(), RestoreFlags::Same).await?;
    wait_sealed(&alice).await?;
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
    assert_eq!(status.epoch, 1, "the restored record: {status:?}");
    let second = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "second restore".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(second.epoch, 3, "epoch 2 already issued tokens");

    // the arbiter that granted in epoch 2 serves again, and so does one with
    // no memory at all; every token is above every epoch-2 token
    let fresh = Arbiter::start(&s.etcd, ArbiterOptions::default()).await?;
    for a in [&s.arbiter, &fresh] {
        let mut c = a.lock("workload/alice").await?;
        let session = open(&mut c, "demo").await?;
        let g = try_lock(&mut c, "demo/after", "demo", session).await?;
        assert_eq!(g.epoch, 3);
        assert!(
            g.token > epoch2_high,
            "token regression after the second restore"
        );
        release(&mut c, &g).await?;
    }
    Ok(())
}

/// Found by the release gate's soak: after a restore, one arbiter sealed and
/// the operator advanced the epoch through it; a second arbiter noticed the
/// restore only afterwards (its first etcd answer still showed a revision
/// below its mark) and published the seal record into the advanced epoch,
/// which shut every arbiter for the rest of the run. A late observer now
/// leaves an epoch alone that is above everything it served.
#[tokio::test(flavor = "multi_thread")]
async fn an_arbiter_that_notices_a_restore_after_the_advance_does_not_seal_the_new_epoch()
-> anyhow::Result<()> {
    let mut s = stack().await?;
    let late = Arbiter::start(&s.etcd, ArbiterOptions::default()).await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    churn(&mut alice, session, 2).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    s.etcd.snapshot_save(snapshot.path()).await?;
    // both arbiters grant past the snapshot, so both marks are above it
    let mut bob = late.lock("workload/bob").await?;
    let bob_session = open(&mut bob, "demo").await?;
    let late_high = churn(&mut bob, bob_session, 20).await?;
    churn(&mut alice, session, 2).await?;

    s.etcd.restore(snapshot.path(), RestoreFlags::Same).await?;
    // the first arbiter seals (its status read sees the restore) and the
    // operator advances through it; the late arbiter has not looked yet
    wait_sealed(&alice).await?;
    let mut op = s.arbiter.admin("latchkey/operator").await?;
    let advanced = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "restore drill".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(advanced.epoch, 2);

    // now the late arbiter is asked: it sees the low revision, but the epoch
    // already moved past it. Both arbiters serve, with tokens above all
    // earlier ones.
    eventually("both arbiters to serve", Duration::from_secs(20), || {
        let (first, late) = (&s.arbiter, &late);
        async move {
            for a in [late, first] {
                let mut c = a.lock("workload/bob").await?;
                let session = open(&mut c, "demo").await?;
                let g = try_lock(&mut c, "demo/after-late", "demo", session).await?;
                anyhow::ensure!(g.epoch == 2, "epoch {}", g.epoch);
                anyhow::ensure!(g.token > late_high, "token regression");
                release(&mut c, &g).await?;
            }
            Ok(())
        }
    })
    .await?;
    let status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
    assert!(!status.sealed, "{status:?}");
    Ok(())
}

/// Two arbiters; every grant of the first predates the snapshot, so its own
/// high-water mark says nothing about the restore. It has seen the other
/// arbiter's later revisions, though, and that is enough: it seals before
/// granting a token below the other's, without waiting for the other to
/// notice and publish the seal.
#[tokio::test(flavor = "multi_thread")]
async fn an_arbiter_whose_own_grants_predate_the_snapshot_still_seals_after_a_restore()
-> anyhow::Result<()> {
    let mut s = stack().await?;
    let other = Arbiter::start(&s.etcd, ArbiterOptions::default()).await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    churn(&mut alice, session, 2).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    s.etcd.snapshot_save(snapshot.path()).await?;
    let mut bob = other.lock("workload/bob").await?;
    let bob_session = open(&mut bob, "demo").await?;
    let other_high = churn(&mut bob, bob_session, 20).await?;
    // the first arbiter reads the log once more (a refused try-lock): it
    // now knows the log went past the snapshot
    let held = try_lock(&mut bob, "demo/r9", "demo", bob_session).await?;
    assert!(
        try_lock(&mut alice, "demo/r9", "demo", session)
            .await
            .is_err()
    );
    release(&mut bob, &held).await?;
    drop(other);

    s.etcd.restore(snapshot.path(), RestoreFlags::Same).await?;
    let refused = eventually(
        "the first arbiter to answer",
        Duration::from_secs(20),
        || {
            let mut alice = alice.clone();
            async move {
                // refused at the session or at the grant; a grant is the failure
                let session = match open(&mut alice, "demo").await {
                    Ok(session) => session,
                    Err(e) => return expect_sealed(e).map(Ok),
                };
                match try_lock(&mut alice, "demo/r0", "demo", session).await {
                    Ok(g) => Ok(Err(g.token)),
                    Err(st) => expect_sealed(st.into()).map(Ok),
                }
            }
        },
    )
    .await?;
    if let Err(token) = refused {
        panic!(
            "granted in the restored log; token above the other arbiter's: {}",
            token > other_high
        );
    }
    Ok(())
}
