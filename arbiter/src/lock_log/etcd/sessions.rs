//! Sessions: a lease with an id of the arbiter's drawing, its record and
//! its entry in the identity's session count (both on the lease), the
//! close, the revoke and the renewals.

use latchkey_etcd::ErrorKind;
use latchkey_etcd::kv::{GetOptions, PutOptions, count_prefix, get_one};
use latchkey_etcd::lease::LeaseGrantOptions;
use latchkey_etcd::txn::{self, Compare, CompareOp, Txn, TxnOp};

use super::{EtcdLog, answer, kv, unavailable, unavailable_on};
use crate::lock_log::{Kv, LogResult, StoreError};

/// Grants lease `id`. etcd's "lease already exists" is
/// [`StoreError::LeaseExists`], so the caller can draw another id; a lease
/// under another id than asked for is an answer the protocol cannot use.
pub(super) async fn grant_lease(log: &EtcdLog, id: i64, ttl_seconds: u32) -> LogResult<()> {
    let lease = log
        .client
        .lease_client()
        .grant(
            i64::from(ttl_seconds),
            Some(LeaseGrantOptions::new().with_id(id)),
        )
        .await
        .map_err(|e| {
            let e = latchkey_etcd::Error::from(e);
            if e.kind() == ErrorKind::LeaseExists {
                StoreError::LeaseExists { lease: id }
            } else {
                unavailable("cannot grant a session lease", e)
            }
        })?;
    if lease.id() != id {
        return Err(StoreError::Malformed(format!(
            "etcd granted lease {:#x} when asked for {id:#x}",
            lease.id()
        )));
    }
    answer(lease.header(), ())
}

/// The session record and the identity's count entry, in one transaction,
/// both on the session's lease (so both end with it).
pub(super) async fn put_session(
    log: &EtcdLog,
    session: i64,
    identity: &str,
    record: Vec<u8>,
) -> LogResult<()> {
    let on_lease = || Some(PutOptions::new().with_lease(session));
    let txn = Txn::new().and_then([
        TxnOp::put(log.layout.session(session), record, on_lease()),
        TxnOp::put(
            log.layout.identity_session(identity, session),
            "",
            on_lease(),
        ),
    ]);
    let resp = txn::run(&log.client, txn)
        .await
        .map_err(|e| unavailable_on("cannot write the session record", session, e))?;
    answer(resp.header(), ())
}

/// `session`'s record (a linearizable read).
pub(super) async fn session(log: &EtcdLog, session: i64) -> LogResult<Option<Kv>> {
    let read = get_one(&log.client, log.layout.session(session))
        .await
        .map_err(|e| unavailable("cannot read a session record", e))?;
    answer(read.header.as_ref(), read.value.as_ref().map(kv))
}

/// How many sessions `identity` has open, over every arbiter: a count of
/// its entries (count only). A walk over all of them in etcd: the arbiter
/// bounds opens by the counts its watch keeps instead
/// ([`crate::session_counts`]); this serves the simulation's table and the
/// log contract.
pub(super) async fn count_sessions_of(log: &EtcdLog, identity: &str) -> LogResult<u32> {
    let count = count_prefix(&log.client, log.layout.identity_sessions(identity))
        .await
        .map_err(|e| unavailable("cannot count an identity's sessions", e))?;
    answer(
        count.header.as_ref(),
        u32::try_from(count.value).unwrap_or(u32::MAX),
    )
}

/// Deletes the session record and its count entry (under grant subject
/// `counted_as`, as [`put_session`] wrote it) if the record is still
/// `record` on the session's lease, so from then on no grant, renewal or
/// hand-over uses it. The holds go with the revoke that follows.
pub(super) async fn delete_session(
    log: &EtcdLog,
    session: i64,
    counted_as: &str,
    record: Vec<u8>,
) -> LogResult<bool> {
    let session_key = log.layout.session(session);
    let txn = Txn::new()
        .when([
            Compare::value(session_key.clone(), CompareOp::Equal, record),
            Compare::lease(session_key.clone(), CompareOp::Equal, session),
        ])
        .and_then([
            TxnOp::delete(session_key, None),
            TxnOp::delete(log.layout.identity_session(counted_as, session), None),
        ]);
    let resp = txn::run(&log.client, txn)
        .await
        .map_err(|e| unavailable("cannot delete a session record", e))?;
    answer(resp.header(), resp.succeeded())
}

/// Revokes `lease`; one etcd no longer has is already what was asked for.
pub(super) async fn revoke(log: &EtcdLog, lease: i64) -> Result<(), StoreError> {
    let revoked = log.client.lease_client().revoke(lease).await;
    match revoked.map_err(latchkey_etcd::Error::from) {
        Ok(_) => Ok(()),
        Err(e) if not_found(&e) => Ok(()),
        Err(e) => Err(unavailable("cannot revoke a session lease", e)),
    }
}

/// Marks `session`'s shadow on `shard`, on the session's lease. A session
/// gone already answers [`StoreError::LeaseGone`].
pub(super) async fn mark_shadow(log: &EtcdLog, session: i64, shard: &str) -> LogResult<()> {
    let resp = log
        .client
        .kv_client()
        .put(
            log.layout.shadow_mark(session, shard),
            "",
            Some(PutOptions::new().with_lease(session)),
        )
        .await
        .map_err(|e| {
            let e = latchkey_etcd::Error::from(e);
            if not_found(&e) {
                StoreError::LeaseGone { lease: session }
            } else {
                unavailable("cannot mark a session's shadow", e)
            }
        })?;
    answer(resp.header(), ())
}

/// The shards `session` has marked shadows on (keys only).
pub(super) async fn shadow_marks(log: &EtcdLog, session: i64) -> LogResult<Vec<String>> {
    let prefix = log.layout.shadow_marks(session);
    let resp = log
        .client
        .kv_client()
        .get(
            prefix.as_str(),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .map_err(|e| unavailable("cannot read a session's shadow marks", e))?;
    let shards = resp
        .kvs()
        .iter()
        .filter_map(|kv| std::str::from_utf8(kv.key()).ok())
        .filter_map(|k| k.strip_prefix(prefix.as_str()))
        .map(str::to_string)
        .collect();
    answer(resp.header(), shards)
}

/// Any NotFound answer: to a revoke, the lease is gone already; to a put on
/// a lease, the session expired.
fn not_found(err: &latchkey_etcd::Error) -> bool {
    matches!(err.kind(), ErrorKind::LeaseNotFound | ErrorKind::NotFound)
}
