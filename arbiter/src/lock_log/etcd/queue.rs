//! Durable waiters (ADR-14): a waiter record per (key, session) on the
//! session's lease, ordered by create revision. The grant transaction
//! compares the queue (holds.rs); these are the records' own writes.

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};

use super::{EtcdLog, answer, unavailable, unavailable_on};
use crate::lock_log::{LogResult, Queued, StoreError};

/// Puts the waiter record on the session's lease; over an existing one
/// etcd keeps its create revision (the waiter's place).
pub(super) async fn enqueue(
    log: &EtcdLog,
    key: &str,
    session: i64,
    record: Vec<u8>,
) -> LogResult<Queued> {
    let resp = log
        .client
        .kv_client()
        .put(
            log.layout.waiter(key, session),
            record,
            Some(PutOptions::new().with_lease(session).with_prev_key()),
        )
        .await
        .map_err(|e| unavailable_on("cannot queue a durable waiter", session, e))?;
    let modified = resp
        .header()
        .map(|h| h.revision())
        .ok_or_else(|| StoreError::Malformed("etcd answered a put without a header".into()))?;
    let created = resp.prev_key().map_or(modified, |kv| kv.create_revision());
    answer(resp.header(), Queued { created, modified })
}

/// Deletes `session`'s waiter record on `key` if it was last written at
/// `modified`; whether it did.
pub(super) async fn dequeue(
    log: &EtcdLog,
    key: &str,
    session: i64,
    modified: i64,
) -> LogResult<bool> {
    let waiter = log.layout.waiter(key, session);
    let txn = Txn::new()
        .when([Compare::mod_revision(
            waiter.clone(),
            CompareOp::Equal,
            modified,
        )])
        .and_then([TxnOp::delete(waiter, None)]);
    let resp = log
        .client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| unavailable("cannot remove a durable waiter", e))?;
    answer(resp.header(), resp.succeeded())
}
