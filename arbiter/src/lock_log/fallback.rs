//! The plain forms of the [`LockLog`](super::LockLog) operations a log may
//! lack the means for: a release-if-owned in two requests, a batch of one,
//! holds read one by one, and the answers of a log that keeps no shadow
//! marks or watches no queue.
//!
//! They are not trait defaults on purpose: a log that wraps another (a
//! fault layer, the simulation's id mapping) must forward every operation,
//! and a default would silently stand in for the inner log's own, so the
//! wrapped arbiter would run a path production never runs. A log names the
//! fallback it takes.

use super::{
    Answer, BatchOp, BatchOutcome, HeldAt, HoldLog, KeyWatch, Kv, LogResult, ReleaseTxn,
    ReleasedIf, StoreError, alone,
};

/// [`HoldLog::release_if_owned`] in two requests: reads the hold, checks it,
/// then releases exactly what it read (the answer carries the header of the
/// last).
pub async fn release_if_owned<L: HoldLog + ?Sized>(
    log: &L,
    txn: &ReleaseTxn,
) -> LogResult<ReleasedIf> {
    let read = log.holder(&txn.key).await?;
    let owned = read.value.as_ref().is_some_and(|kv| {
        kv.lease == txn.session
            && kv.mod_revision == txn.revision
            && kv.value.starts_with(&txn.owner)
    });
    let Some(kv) = read.value.clone().filter(|_| owned) else {
        return Ok(read.map(|holder| ReleasedIf::No { holder }));
    };
    let held = HeldAt {
        key: txn.key.clone(),
        session: txn.session,
        revision: txn.revision,
        value: kv.value,
    };
    let released = log.release(&held).await?;
    Ok(Answer {
        header: released.header,
        value: match released.value {
            Some(bytes) => ReleasedIf::Yes(bytes),
            // changed since the read: report it as it was read
            None => ReleasedIf::No { holder: read.value },
        },
    })
}

/// [`HoldLog::batch`] of a log whose [`HoldLog::batch_limit`] is 1: a batch
/// of one is that member's own transaction; none, or more, are refused.
pub async fn batch<L: HoldLog + ?Sized>(
    log: &L,
    ops: Vec<BatchOp<'_>>,
) -> LogResult<Vec<BatchOutcome>> {
    let mut ops = ops.into_iter();
    match (ops.next(), ops.next()) {
        (Some(op), None) => Ok(alone(log, op).await?.map(|outcome| vec![outcome])),
        (None, _) => Err(StoreError::Refused {
            context: "an empty batch".into(),
        }),
        (Some(_), Some(_)) => Err(StoreError::Refused {
            context: "this log runs one transaction at a time".into(),
        }),
    }
}

/// [`HoldLog::holders_of`] one key at a time.
pub async fn holders_of<L: HoldLog + ?Sized>(
    log: &L,
    keys: &[String],
) -> LogResult<Vec<Option<Kv>>> {
    let mut out = Vec::with_capacity(keys.len());
    let mut header = None;
    for key in keys {
        let read = log.holder(key).await?;
        header = Some(read.header);
        out.push(read.value);
    }
    match header {
        Some(header) => Ok(Answer { header, value: out }),
        None => Ok(log.count_holds().await?.map(|_| out)),
    }
}

/// [`HoldLog::held_keys_page`] from a read of every hold (in-memory logs).
pub async fn held_keys_page<L: HoldLog + ?Sized>(
    log: &L,
    after: Option<&str>,
    limit: usize,
) -> LogResult<Vec<String>> {
    let all = log.holders_under("").await?;
    Ok(all.map(|holds| {
        holds
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| after.is_none_or(|a| k.as_str() > a))
            .take(limit)
            .collect()
    }))
}

/// The answer of a log that keeps no shadow marks (it never serves entity
/// shards): unavailable, so a caller that needs one refuses.
pub fn no_shadow_marks() -> StoreError {
    StoreError::unavailable("this lock log keeps no shadow marks")
}

/// The answer of a log that does not watch writers' intents: its readers
/// poll.
pub fn no_intent_watch() -> Result<Box<dyn KeyWatch>, StoreError> {
    Err(StoreError::Malformed(
        "this log does not watch writers' intents".into(),
    ))
}

/// The answer of a log that does not watch durable queues: its waiters
/// poll.
pub fn no_queue_watch() -> Result<Box<dyn KeyWatch>, StoreError> {
    Err(StoreError::Malformed(
        "this log does not watch durable queues".into(),
    ))
}
