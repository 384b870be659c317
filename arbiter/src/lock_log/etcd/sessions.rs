//! Sessions: a lease with an id of the arbiter's drawing, its record and
//! its entry in the identity's session count (both on the lease), the
//! close, the revoke and the renewals.

use crate::records::keys;
use latchkey_etcd::ErrorKind;
use latchkey_etcd::kv::{GetOptions, PutOptions, count_prefix, get_one};
use latchkey_etcd::lease::LeaseGrantOptions;
use latchkey_etcd::txn::{self, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use super::{EtcdLog, answer, kv, unavailable, unavailable_on};
use crate::lock_log::{Kv, LogResult, RevokeSessionTxn, SessionRevoked, ShadowMarks, StoreError};

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

/// [`crate::lock_log::SessionLog::revoke_session`] with the arbiter's own
/// client (etcd lets a user revoke a lease only with write permission on
/// every key attached to it).
pub(super) async fn revoke_session(
    log: &EtcdLog,
    txn: RevokeSessionTxn<'_>,
) -> Result<SessionRevoked, StoreError> {
    let session = txn.session;
    let marker_lease = log
        .client
        .lease_client()
        .grant(i64::from(txn.marker_ttl_seconds.max(1)), None)
        .await
        .map_err(|e| unavailable("cannot grant the revocation marker's lease", e))?
        .id();
    let session_key = log.layout.session(session);
    let ending = Txn::new()
        .when([Compare::lease(
            session_key.as_str(),
            CompareOp::Equal,
            session,
        )])
        .and_then([
            TxnOp::delete(session_key.as_str(), None),
            TxnOp::delete(log.layout.identity_session(txn.counted_as, session), None),
            TxnOp::put(
                log.layout.revoked_session(session),
                txn.marker.to_vec(),
                Some(PutOptions::new().with_lease(marker_lease)),
            ),
        ]);
    let marked = match txn::run(&log.client, ending).await {
        Ok(resp) => resp.succeeded(),
        Err(e) => {
            drop_lease(log, marker_lease).await;
            return Err(unavailable("cannot end the session's record", e));
        }
    };
    if !marked {
        drop_lease(log, marker_lease).await;
    }
    let revoked = log.client.lease_client().revoke(session).await;
    match revoked.map_err(latchkey_etcd::Error::from) {
        Ok(_) if marked => Ok(SessionRevoked::Revoked),
        Ok(_) => Ok(SessionRevoked::RecordGone),
        Err(e) if not_found(&e) => Ok(SessionRevoked::Ended),
        Err(e) => Err(unavailable(
            "cannot revoke the session's lease (its record is deleted, so it grants nothing more; its holds end when the lease lapses)",
            e,
        )),
    }
}

/// Revokes a lease this log granted and no longer needs; it expires by
/// itself if the revoke fails.
async fn drop_lease(log: &EtcdLog, lease: i64) {
    if let Err(e) = log.client.lease_client().revoke(lease).await {
        tracing::warn!(lease, error = %e, "could not revoke an unused lease (it expires by itself)");
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

/// The shards `session` has marked shadows on, its vouch, its record and
/// the epoch record, keys only, in one transaction (one revision).
pub(super) async fn shadow_marks(log: &EtcdLog, session: i64) -> LogResult<ShadowMarks> {
    let prefix = log.layout.shadow_marks(session);
    let keys_only = || Some(GetOptions::new().with_keys_only());
    let txn = Txn::new().and_then([
        TxnOp::get(
            prefix.as_str(),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        ),
        TxnOp::get(log.layout.session(session), keys_only()),
        TxnOp::get(log.layout.epoch(), keys_only()),
        TxnOp::get(log.layout.seal(), keys_only()),
    ]);
    let resp = txn::run(&log.client, txn)
        .await
        .map_err(|e| unavailable("cannot read a session's shadow marks", e))?;
    let ops = resp.op_responses();
    let mut marks = ShadowMarks::default();
    if let Some(TxnOpResponse::Get(get)) = ops.first() {
        for entry in get.kvs() {
            let Some(name) = entry
                .key_str()
                .ok()
                .and_then(|k| k.strip_prefix(prefix.as_str()))
            else {
                continue;
            };
            match name == keys::SHADOW_VOUCH {
                true => marks.since = marks.since.max(entry.mod_revision()),
                false => marks.shards.push(name.to_string()),
            }
        }
    }
    if let Some(record) = ops.get(1).and_then(txn::first_kv) {
        marks.since = marks.since.max(record.create_revision());
    }
    marks.epoch_at = ops
        .get(2)
        .and_then(txn::first_kv)
        .map_or(0, |kv| kv.mod_revision());
    marks.sealed = ops.get(3).and_then(txn::first_kv).is_some();
    answer(resp.header(), marks)
}

/// Vouches for `session`'s marks: a key beside them, on its lease, if the
/// epoch record is still at `epoch_at` (0: absent) and there is no seal.
/// A session gone answers [`StoreError::LeaseGone`].
pub(super) async fn vouch_shadows(log: &EtcdLog, session: i64, epoch_at: i64) -> LogResult<bool> {
    let epoch = log.layout.epoch();
    let unchanged = match epoch_at {
        0 => Compare::create_revision(epoch.as_str(), CompareOp::Equal, 0),
        at => Compare::mod_revision(epoch.as_str(), CompareOp::Equal, at),
    };
    let txn = Txn::new()
        .when([
            unchanged,
            Compare::create_revision(log.layout.seal(), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::put(
            log.layout.shadow_vouch(session),
            "",
            Some(PutOptions::new().with_lease(session)),
        )]);
    let resp = txn::run(&log.client, txn).await.map_err(|e| {
        if not_found(&e) {
            StoreError::LeaseGone { lease: session }
        } else {
            unavailable("cannot vouch for a session's shadow marks", e)
        }
    })?;
    answer(resp.header(), resp.succeeded())
}

/// Any NotFound answer: to a revoke, the lease is gone already; to a put on
/// a lease, the session expired.
fn not_found(err: &latchkey_etcd::Error) -> bool {
    matches!(err.kind(), ErrorKind::LeaseNotFound | ErrorKind::NotFound)
}
