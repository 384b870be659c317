//! Durable waiters (ADR-14): a waiter record per (key, session) on the
//! session's lease, ordered by create revision. The grant transaction
//! compares the queue (holds.rs); these are the records' own writes.

use latchkey_etcd::kv::{GetOptions, PutOptions, SortOrder, SortTarget, count_prefix};
use latchkey_etcd::txn::{self, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use super::{EtcdLog, answer, kv, unavailable, unavailable_on};
use crate::lock_log::{Kv, LogResult, Queued, StoreError};

/// Puts the waiter record on the session's lease if the session record is
/// the caller's; over an existing one etcd keeps its create revision (the
/// waiter's place).
pub(super) async fn enqueue(
    log: &EtcdLog,
    key: &str,
    session: i64,
    session_record: &[u8],
    record: Vec<u8>,
) -> LogResult<Option<Queued>> {
    let waiter = log.layout.waiter(key, session);
    put_on_lease(log, waiter, session, session_record, record)
        .await
        .map_err(|e| unavailable_on("cannot queue a durable waiter", session, e))?
}

/// Puts `session`'s writer intent on lock `name` (a waiter record's twin
/// in its own range: see `DurableQueueLog::put_intent`).
pub(super) async fn put_intent(
    log: &EtcdLog,
    name: &str,
    session: i64,
    session_record: &[u8],
    record: Vec<u8>,
) -> LogResult<Option<Queued>> {
    let intent = log.layout.intent(name, session);
    put_on_lease(log, intent, session, session_record, record)
        .await
        .map_err(|e| unavailable_on("cannot put a writer's intent", session, e))?
}

/// Puts `record` at `key` on `session`'s lease if the session record is
/// `session_record`; over an existing record etcd keeps its create
/// revision.
async fn put_on_lease(
    log: &EtcdLog,
    key: String,
    session: i64,
    session_record: &[u8],
    record: Vec<u8>,
) -> Result<LogResult<Option<Queued>>, latchkey_etcd::Error> {
    let txn = Txn::new()
        .when([Compare::value(
            log.layout.session(session),
            CompareOp::Equal,
            session_record,
        )])
        .and_then([TxnOp::put(
            key,
            record,
            Some(PutOptions::new().with_lease(session).with_prev_key()),
        )]);
    let resp = txn::run(&log.client, txn).await?;
    Ok(queued(resp))
}

fn queued(resp: latchkey_etcd::txn::TxnResponse) -> LogResult<Option<Queued>> {
    let modified = txn::revision(&resp)
        .ok_or_else(|| StoreError::Malformed("etcd answered a txn without a header".into()))?;
    let queued = match (resp.succeeded(), resp.op_responses().first()) {
        (false, _) => None,
        (true, Some(TxnOpResponse::Put(put))) => Some(Queued {
            created: put.prev_key().map_or(modified, |kv| kv.create_revision()),
            modified,
        }),
        (true, _) => {
            return Err(StoreError::Malformed(
                "etcd answered a queued waiter without its put".into(),
            ));
        }
    };
    answer(resp.header(), queued)
}

/// How many waiter records `key` has (a count-only read).
pub(super) async fn count_queued(log: &EtcdLog, key: &str) -> LogResult<i64> {
    let count = count_prefix(&log.client, log.layout.queue_of(key))
        .await
        .map_err(|e| unavailable("cannot count durable waiters", e))?;
    answer(count.header.as_ref(), count.value)
}

/// `key`'s oldest waiter record.
pub(super) async fn queue_head(log: &EtcdLog, key: &str) -> LogResult<Option<Kv>> {
    let resp = log
        .client
        .kv_client()
        .get(
            log.layout.queue_of(key),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend)
                    .with_limit(1),
            ),
        )
        .await
        .map_err(|e| unavailable("cannot read a durable queue", e))?;
    let head = resp.kvs().first().map(kv);
    answer(resp.header(), head)
}

/// Deletes `session`'s waiter record on `key` if it was last written at
/// `modified`; whether it did.
pub(super) async fn dequeue(
    log: &EtcdLog,
    key: &str,
    session: i64,
    modified: i64,
) -> LogResult<bool> {
    delete_at(log, log.layout.waiter(key, session), modified)
        .await
        .map_err(|e| unavailable("cannot remove a durable waiter", e))?
}

/// Deletes `session`'s intent on lock `name` if it was last written at
/// `modified`.
pub(super) async fn drop_intent(
    log: &EtcdLog,
    name: &str,
    session: i64,
    modified: i64,
) -> LogResult<bool> {
    delete_at(log, log.layout.intent(name, session), modified)
        .await
        .map_err(|e| unavailable("cannot remove a writer's intent", e))?
}

/// Deletes `key` if it was last written at `modified`; whether it did.
async fn delete_at(
    log: &EtcdLog,
    key: String,
    modified: i64,
) -> Result<LogResult<bool>, latchkey_etcd::Error> {
    let txn = Txn::new()
        .when([Compare::mod_revision(
            key.clone(),
            CompareOp::Equal,
            modified,
        )])
        .and_then([TxnOp::delete(key, None)]);
    let resp = txn::run(&log.client, txn).await?;
    Ok(answer(resp.header(), resp.succeeded()))
}
