//! The contract's forced end of a hold (two-person force-release): the
//! named hold only — never one granted since, not even to the same session
//! — and the approval's records in the same transaction.

use anyhow::{Context, ensure};
use latchkey_arbiter::lock_log::{
    ForceEndTxn, ForceEnded, ForceRecords, HandOverFrom, HandOverTxn, HeldAt, LockLog,
    RevokeSessionTxn, SessionRevoked,
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

/// An operator's revocation of a session: its record and count entry go at
/// once (no grant can be made on it from then on), then its lease and every
/// hold on it. A session whose record is already gone is `RecordGone`, its
/// lease revoked all the same; one whose lease is gone is `Ended`.
pub async fn an_operators_revocation_ends_the_session_record_first(
    log: &dyn LockLog,
) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = ("spiffe://contract/revoke/a", "spiffe://contract/revoke/b");
    let (ia, ib) = (lease(75, 0), lease(75, 1));
    let record_a = open(log, ia, a).await?;
    open(log, ib, b).await?;
    let key = "contract/revoke/k";
    take(log, key, ia, a, &epoch).await?;
    let other = take(log, "contract/revoke/other", ib, b, &epoch).await?;
    ensure!(
        log.count_sessions_of(a).await?.value == 1,
        "a's session is not counted"
    );

    let revoke = |session, counted_as| RevokeSessionTxn {
        session,
        counted_as,
        marker: b"revoked by an operator",
        marker_ttl_seconds: 600,
    };
    let revoked = log.revoke_session(revoke(ia, a)).await?;
    ensure!(revoked == SessionRevoked::Revoked, "{revoked:?}");
    ensure!(
        log.session(ia).await?.value.is_none(),
        "the revoked session's record is still there"
    );
    ensure!(
        log.count_sessions_of(a).await?.value == 0,
        "the revoked session is still counted"
    );
    ensure!(
        log.holder(key).await?.value.is_none(),
        "the revoked session's hold is still there"
    );
    // no grant on it from then on
    log.grant_lease(ia, 60)
        .await
        .context("the revoked session's lease id is free again")?;
    let refused = log
        .grant(latchkey_arbiter::lock_log::GrantTxn {
            key,
            session: ia,
            holder_record: holder_record(key, ia),
            epoch: &epoch,
            fence_at: 0,
            session_record: &record_a,
            queue: Default::default(),
            quota: None,
        })
        .await?
        .value;
    ensure!(
        refused != latchkey_arbiter::lock_log::Granted::Yes,
        "a grant on the revoked session's record: {refused:?}"
    );
    log.revoke(ia).await?;

    // the other session is untouched
    ensure!(
        log.holder(&other.key).await?.value.map(|kv| kv.lease) == Some(ib),
        "another session's hold went with the revocation"
    );
    // again: the lease is gone now
    let again = log.revoke_session(revoke(ia, a)).await?;
    ensure!(again == SessionRevoked::Ended, "{again:?}");

    // a record already gone (closed, or expiring): no marker, lease revoked
    let rb = super::session_record(b);
    ensure!(log.delete_session(ib, b, rb).await?.value, "close of b");
    let gone = log.revoke_session(revoke(ib, b)).await?;
    ensure!(gone == SessionRevoked::RecordGone, "{gone:?}");
    ensure!(
        log.holder(&other.key).await?.value.is_none(),
        "a revoked lease's hold is still there"
    );
    Ok(())
}
