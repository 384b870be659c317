//! The contract's durable-queue cases (ADR-14): waiter records ordered by
//! create revision, a grant that takes its turn, and every other grant and
//! hand-over deferring to a non-empty queue.

use anyhow::{Context, ensure};
use latchkey_arbiter::lock_log::{
    GrantTxn, Granted, HandOverFrom, HandOverTxn, LockLog, QueueTurn, StoreError,
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
            session_record: record,
            queue,
        })
        .await?;
    Ok((answer.value, answer.header.revision))
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

    let before = revision(log).await?;
    let qa = log.enqueue(key, ia, b"a waits".to_vec()).await?;
    ensure!(qa.value.created == qa.value.modified && qa.value.created == before + 1);
    let qb = log.enqueue(key, ib, b"b waits".to_vec()).await?;
    ensure!(qb.value.created == qa.value.created + 1, "{:?}", qb.value);

    // a grant outside the queue, and b out of turn: refused, a's record read
    let before = revision(log).await?;
    let (outside, _) = grant(log, key, ic, &epoch, &rc, QueueTurn::Empty).await?;
    ensure!(
        matches!(&outside, Granted::No { holder: None, .. })
            && head_of(&outside) == Some(qa.value.created),
        "{outside:?}"
    );
    let (early, _) = grant(
        log,
        key,
        ib,
        &epoch,
        &rb,
        QueueTurn::Mine {
            created: qb.value.created,
        },
    )
    .await?;
    ensure!(head_of(&early) == Some(qa.value.created), "{early:?}");
    unchanged(log, before, "grants out of turn").await?;

    // b asks again: same place, a new write
    let again = log.enqueue(key, ib, b"b waits longer".to_vec()).await?;
    ensure!(
        again.value.created == qb.value.created && again.value.modified == before + 1,
        "{:?}",
        again.value
    );

    // a's turn: granted, its record gone in the same revision
    let (granted, at) = grant(
        log,
        key,
        ia,
        &epoch,
        &ra,
        QueueTurn::Mine {
            created: qa.value.created,
        },
    )
    .await?;
    ensure!(granted == Granted::Yes, "{granted:?}");
    one_write(log, again.value.modified, "a's grant").await?;
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
            created: qb.value.created,
        },
    )
    .await?;
    ensure!(
        matches!(&held, Granted::No { holder: Some(h), .. } if h.lease == ia)
            && head_of(&held) == Some(qb.value.created),
        "{held:?}"
    );

    // a dequeue compares the last write: b's first write is stale
    let before = revision(log).await?;
    let stale = log.dequeue(key, ib, qb.value.modified).await?;
    ensure!(!stale.value, "a dequeue of an overwritten record");
    unchanged(log, before, "a refused dequeue").await?;
    let gone = log.dequeue(key, ib, again.value.modified).await?;
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
            created: qb.value.created,
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
/// that is gone is `LeaseGone` and writes nothing.
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
    open(log, ic, c).await?;
    let key = "contract/queue-hand/k";
    let held = take(log, key, ia, a, &epoch).await?;
    let queued = log.enqueue(key, ic, b"c waits".to_vec()).await?;

    let refused = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: ib,
            holder_record: holder_record(key, ib),
            epoch: &epoch,
            next_session_record: &rb,
        })
        .await?;
    ensure!(refused.value.is_none(), "{:?}", refused.value);
    unchanged(
        log,
        queued.value.modified,
        "a hand-over past a durable waiter",
    )
    .await?;

    // c's session ends: its record goes with the lease
    log.revoke(ic).await?;
    let handed = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: ib,
            holder_record: holder_record(key, ib),
            epoch: &epoch,
            next_session_record: &rb,
        })
        .await?;
    ensure!(handed.value.is_some(), "{:?}", handed.value);

    let before = revision(log).await?;
    match log.enqueue(key, ic, b"c again".to_vec()).await {
        Err(StoreError::LeaseGone { lease }) => ensure!(lease == ic),
        other => anyhow::bail!("an enqueue on a revoked lease: {other:?}"),
    }
    unchanged(log, before, "an enqueue on a revoked lease").await?;
    revoke_all(log, &[ia, ib]).await
}
