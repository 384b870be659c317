//! The contract's durable-queue cases (ADR-14): waiter records ordered by
//! create revision, a grant that takes its turn, and every other grant and
//! hand-over deferring to a non-empty queue.

use anyhow::{Context, ensure};
use latchkey_arbiter::lock_log::{
    GrantTxn, Granted, HandOverFrom, HandOverTxn, LockLog, QueueTurn, Queued, StoreError,
};

use super::{epoch, holder_record, lease, one_write, open, revision, revoke_all, take, unchanged};

async fn grant(
    log: &dyn LockLog,
    key: &str,
    session: i64,
    epoch: &[u8],
    record: &[u8],
    queue: QueueTurn,
) -> anyhow::Result<(Granted, i64)> {
    let answer = log
        .grant(GrantTxn {
            key,
            session,
            holder_record: holder_record(key, session),
            epoch,
            fence_at: 0,
            session_record: record,
            queue,
            quota: None,
        })
        .await?;
    Ok((answer.value, answer.header.revision))
}

/// Queues `session` (whose record is `own`) on `key`; refused is an error.
async fn enqueue(
    log: &dyn LockLog,
    key: &str,
    session: i64,
    own: &[u8],
    payload: &str,
) -> anyhow::Result<Queued> {
    log.enqueue(key, session, own, payload.as_bytes().to_vec())
        .await?
        .value
        .with_context(|| format!("the enqueue of {session:x} on {key} was refused"))
}

fn head_of(granted: &Granted) -> Option<i64> {
    match granted {
        Granted::No { queue_head, .. } => queue_head.as_ref().map(|kv| kv.create_revision),
        Granted::Yes => None,
    }
}

/// Waiters are served by create revision: a grant at a later place, or
/// without one, is refused (nothing written, the oldest record read back);
/// the first's grant deletes its record with the put; a session's second
/// enqueue keeps its place; a dequeue compares the record's last write.
pub async fn durable_waiters_go_in_create_revision_order(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b, c) = (
        "spiffe://contract/queue/a",
        "spiffe://contract/queue/b",
        "spiffe://contract/queue/c",
    );
    let (ia, ib, ic) = (lease(60, 0), lease(60, 1), lease(60, 2));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let rc = open(log, ic, c).await?;
    let key = "contract/queue/k";

    // Only the session's own record queues it: another's is refused, and
    // nothing is written.
    let before = revision(log).await?;
    let forged = log.enqueue(key, ia, &rc, b"c as a".to_vec()).await?;
    ensure!(forged.value.is_none(), "{:?}", forged.value);
    unchanged(log, before, "an enqueue on another's session").await?;
    let qa = enqueue(log, key, ia, &ra, "a waits").await?;
    ensure!(qa.created == qa.modified && qa.created == before + 1);
    let qb = enqueue(log, key, ib, &rb, "b waits").await?;
    ensure!(qb.created == qa.created + 1, "{qb:?}");

    // a grant outside the queue, and b out of turn: refused, a's record read
    let before = revision(log).await?;
    let (outside, _) = grant(log, key, ic, &epoch, &rc, QueueTurn::Empty).await?;
    ensure!(
        matches!(&outside, Granted::No { holder: None, .. })
            && head_of(&outside) == Some(qa.created),
        "{outside:?}"
    );
    let (early, _) = grant(
        log,
        key,
        ib,
        &epoch,
        &rb,
        QueueTurn::Mine {
            created: qb.created,
        },
    )
    .await?;
    ensure!(head_of(&early) == Some(qa.created), "{early:?}");
    unchanged(log, before, "grants out of turn").await?;

    // b asks again: same place, a new write
    let again = enqueue(log, key, ib, &rb, "b waits longer").await?;
    ensure!(
        again.created == qb.created && again.modified == before + 1,
        "{again:?}"
    );

    // a's turn: granted, its record gone in the same revision
    let (granted, at) = grant(
        log,
        key,
        ia,
        &epoch,
        &ra,
        QueueTurn::Mine {
            created: qa.created,
        },
    )
    .await?;
    ensure!(granted == Granted::Yes, "{granted:?}");
    one_write(log, again.modified, "a's grant").await?;
    let holder = log.holder(key).await?.value.context("a holds")?;
    ensure!(holder.lease == ia && holder.mod_revision == at);

    // b is first now, but the key is held: refused with the holder read
    let (held, _) = grant(
        log,
        key,
        ib,
        &epoch,
        &rb,
        QueueTurn::Mine {
            created: qb.created,
        },
    )
    .await?;
    ensure!(
        matches!(&held, Granted::No { holder: Some(h), .. } if h.lease == ia)
            && head_of(&held) == Some(qb.created),
        "{held:?}"
    );

    // a dequeue compares the last write: b's first write is stale
    let before = revision(log).await?;
    let stale = log.dequeue(key, ib, qb.modified).await?;
    ensure!(!stale.value, "a dequeue of an overwritten record");
    unchanged(log, before, "a refused dequeue").await?;
    let gone = log.dequeue(key, ib, again.modified).await?;
    ensure!(gone.value);
    one_write(log, before, "b's dequeue").await?;

    // b's place is gone: its grant says so (no record at or before it)
    let (unqueued, _) = grant(
        log,
        key,
        ib,
        &epoch,
        &rb,
        QueueTurn::Mine {
            created: qb.created,
        },
    )
    .await?;
    ensure!(
        matches!(&unqueued, Granted::No { .. }) && head_of(&unqueued).is_none(),
        "{unqueued:?}"
    );
    revoke_all(log, &[ia, ib, ic]).await
}

/// A non-empty queue stops a hand-over; a waiter record lives on its
/// session's lease (revoking it empties the queue); an enqueue on a lease
/// that is gone is refused and writes nothing.
pub async fn a_durable_queue_stops_hand_overs_and_ends_with_its_session(
    log: &dyn LockLog,
) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b, c) = (
        "spiffe://contract/queue-hand/a",
        "spiffe://contract/queue-hand/b",
        "spiffe://contract/queue-hand/c",
    );
    let (ia, ib, ic) = (lease(61, 0), lease(61, 1), lease(61, 2));
    open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let rc = open(log, ic, c).await?;
    let key = "contract/queue-hand/k";
    let held = take(log, key, ia, a, &epoch).await?;
    let queued = enqueue(log, key, ic, &rc, "c waits").await?;

    let refused = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: ib,
            holder_record: holder_record(key, ib),
            epoch: &epoch,
            fence_at: 0,
            next_session_record: &rb,
        })
        .await?;
    ensure!(refused.value.is_none(), "{:?}", refused.value);
    unchanged(log, queued.modified, "a hand-over past a durable waiter").await?;

    // c's session ends: its record goes with the lease
    log.revoke(ic).await?;
    let handed = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: ib,
            holder_record: holder_record(key, ib),
            epoch: &epoch,
            fence_at: 0,
            next_session_record: &rb,
        })
        .await?;
    ensure!(handed.value.is_some(), "{:?}", handed.value);

    let before = revision(log).await?;
    // revoked: the session record went with the lease
    let gone = log.enqueue(key, ic, &rc, b"c again".to_vec()).await;
    ensure!(
        matches!(&gone, Ok(a) if a.value.is_none())
            || matches!(&gone, Err(StoreError::LeaseGone { lease }) if *lease == ic),
        "an enqueue on a revoked lease: {gone:?}"
    );
    unchanged(log, before, "an enqueue on a revoked lease").await?;
    revoke_all(log, &[ia, ib]).await
}
