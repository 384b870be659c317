//! The contract's forced end of a hold (two-person force-release): the
//! named hold only — never one granted since, not even to the same session
//! — and the approval's records in the same transaction.

use anyhow::{Context, ensure};
use latchkey_arbiter::lock_log::{
    ForceEndTxn, ForceEnded, ForceRecords, HandOverFrom, HandOverTxn, HeldAt, LockLog,
};

use super::{epoch, holder_record, lease, one_write, open, revision, revoke_all, take, unchanged};

async fn force_end(
    log: &dyn LockLog,
    held: &HeldAt,
    records: &ForceRecords,
) -> anyhow::Result<(ForceEnded, i64)> {
    let answer = log
        .force_end(ForceEndTxn {
            key: &held.key,
            lease: held.session,
            revision: held.revision,
            records,
        })
        .await?;
    Ok((answer.value, answer.header.revision))
}

/// A forced end deletes exactly the hold it names and writes its records
/// at one revision; a hold handed over, or granted again to the same
/// session, since the request read it is left alone and the failed
/// transaction says what holds the key now; a record that moved writes
/// nothing.
pub async fn a_forced_end_ends_only_the_named_hold(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = ("spiffe://contract/force/a", "spiffe://contract/force/b");
    let (ia, ib) = (lease(73, 0), lease(73, 1));
    open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let key = "contract/force/k";
    let record = "sys/force/contract-73";

    // Ended: the hold goes, the record is written on a lease of its own,
    // one revision.
    let held = take(log, key, ia, a, &epoch).await?;
    let before = revision(log).await?;
    let written = ForceRecords {
        unchanged: Vec::new(),
        put: vec![(record.into(), b"approved".to_vec())],
        ttl_seconds: 600,
        delete: Vec::new(),
    };
    let (ended, at) = force_end(log, &held, &written).await?;
    ensure!(ended == ForceEnded::Ended, "{ended:?}");
    let at_write = one_write(log, before, "a forced end").await?;
    ensure!(at == at_write, "answered at {at}, written at {at_write}");
    ensure!(
        log.holder(key).await?.value.is_none(),
        "the hold is still there after a forced end"
    );

    // The record is there at that revision: a forced end that compares it
    // there goes through, one that compares another revision does not.
    let again = take(log, key, ia, a, &epoch).await?;
    let moved = ForceRecords {
        unchanged: vec![(record.into(), at - 1)],
        ..ForceRecords::default()
    };
    let before = revision(log).await?;
    let (ended, _) = force_end(log, &again, &moved).await?;
    ensure!(ended == ForceEnded::RecordsChanged, "{ended:?}");
    unchanged(log, before, "a forced end whose record moved").await?;
    ensure!(log.holder(key).await?.value.is_some(), "the hold is gone");

    // A hold granted again to the same session has another revision: a
    // request for the earlier one ends nothing.
    let (ended, _) = force_end(log, &held, &ForceRecords::default()).await?;
    match &ended {
        ForceEnded::HoldChanged { now: Some(kv) } => ensure!(
            kv.mod_revision == again.revision && kv.lease == ia,
            "{kv:?}"
        ),
        other => anyhow::bail!("a forced end of an earlier hold: {other:?}"),
    }
    unchanged(log, before, "a forced end of an earlier hold").await?;

    // Handed over to b: a request for a's hold ends nothing, b keeps it.
    let handed = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&again),
            next_session: ib,
            holder_record: holder_record(key, ib),
            epoch: &epoch,
            fence_at: 0,
            next_session_record: &rb,
        })
        .await?;
    ensure!(handed.value.is_some(), "the hand-over failed");
    let before = revision(log).await?;
    let named = ForceRecords {
        unchanged: vec![(record.into(), at)],
        put: Vec::new(),
        ttl_seconds: 0,
        delete: vec![record.into()],
    };
    let (ended, _) = force_end(log, &again, &named).await?;
    match &ended {
        ForceEnded::HoldChanged { now: Some(kv) } => ensure!(kv.lease == ib, "{kv:?}"),
        other => anyhow::bail!("a forced end of a hold handed over: {other:?}"),
    }
    unchanged(log, before, "a forced end of a hold handed over").await?;
    let kv = log.holder(key).await?.value.context("b lost the key")?;
    ensure!(kv.lease == ib, "{kv:?}");

    // b's own hold, named right: ended, and the record deleted with it.
    let b_held = HeldAt {
        key: key.into(),
        session: ib,
        revision: handed.header.revision,
        value: holder_record(key, ib),
    };
    let (ended, _) = force_end(log, &b_held, &named).await?;
    ensure!(ended == ForceEnded::Ended, "{ended:?}");
    one_write(log, before, "a forced end with a delete").await?;
    let (ended, _) = force_end(log, &b_held, &named).await?;
    ensure!(
        ended == ForceEnded::RecordsChanged,
        "the record was not deleted: {ended:?}"
    );

    // Not held at all: the failed transaction says so.
    let (ended, _) = force_end(log, &b_held, &ForceRecords::default()).await?;
    ensure!(ended == ForceEnded::HoldChanged { now: None }, "{ended:?}");
    revoke_all(log, &[ia, ib]).await
}
