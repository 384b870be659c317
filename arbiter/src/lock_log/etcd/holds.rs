//! Holder records: the grant and hand-over transactions, the releases, and
//! the reads of who holds what.

use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};

use super::{EtcdLog, answer, first_kv, kv, unavailable, unavailable_on};
use crate::lock_log::{Claimed, GrantTxn, Granted, HandOverTxn, HeldAt, Kv, LogResult, StoreError};

/// One grant: the holder record on the session's lease if the key is
/// absent, the epoch record is the caller's, there is no seal and the
/// session record is the caller's. On a compare failure the same
/// transaction reads all four, so the caller learns why at that revision.
pub(super) async fn grant(log: &EtcdLog, txn: GrantTxn<'_>) -> LogResult<Granted> {
    let holder_key = log.layout.holder(txn.key);
    let session_key = log.layout.session(txn.session);
    let epoch_key = log.layout.epoch();
    let seal_key = log.layout.seal();
    let etcd_txn = Txn::new()
        .when([
            Compare::create_revision(holder_key.clone(), CompareOp::Equal, 0),
            Compare::value(epoch_key.clone(), CompareOp::Equal, txn.epoch),
            Compare::create_revision(seal_key.clone(), CompareOp::Equal, 0),
            Compare::value(session_key.clone(), CompareOp::Equal, txn.session_record),
        ])
        .and_then([TxnOp::put(
            holder_key.clone(),
            txn.holder_record,
            Some(PutOptions::new().with_lease(txn.session)),
        )])
        .or_else([
            TxnOp::get(holder_key, None),
            TxnOp::get(epoch_key, None),
            TxnOp::get(seal_key, None),
            TxnOp::get(session_key, None),
        ]);
    let resp = log
        .client
        .kv_client()
        .txn(etcd_txn)
        .await
        .map_err(|e| unavailable_on("cannot run the grant transaction", txn.session, e))?;
    if resp.succeeded() {
        return answer(resp.header(), Granted::Yes);
    }
    let ops = resp.op_responses();
    let granted = Granted::No {
        holder: ops.first().and_then(first_kv),
        epoch: ops.get(1).and_then(first_kv).map(|kv| kv.value),
        sealed: ops.get(2).and_then(first_kv).is_some(),
        session: ops.get(3).and_then(first_kv).map(|kv| kv.value),
    };
    answer(resp.header(), granted)
}

/// Compares that make a write act only on the hold `held` found: the same
/// record bytes (the caller's identity and session), on the same lease, at
/// the same revision.
fn still_held(log: &EtcdLog, held: &HeldAt) -> [Compare; 3] {
    let holder_key = log.layout.holder(&held.key);
    [
        Compare::mod_revision(holder_key.clone(), CompareOp::Equal, held.revision),
        Compare::lease(holder_key.clone(), CompareOp::Equal, held.session),
        Compare::value(holder_key, CompareOp::Equal, held.value.clone()),
    ]
}

/// Hands the hold straight to the next session in one transaction: the
/// release's compares, plus the grant's (epoch, no seal, the next
/// session's record). The put returns the record it replaced.
pub(super) async fn hand_over(
    log: &EtcdLog,
    txn: HandOverTxn<'_>,
) -> LogResult<Option<Option<Vec<u8>>>> {
    let mut compares = still_held(log, txn.from).to_vec();
    compares.extend([
        Compare::value(log.layout.epoch(), CompareOp::Equal, txn.epoch),
        Compare::create_revision(log.layout.seal(), CompareOp::Equal, 0),
        Compare::value(
            log.layout.session(txn.next_session),
            CompareOp::Equal,
            txn.next_session_record,
        ),
    ]);
    let etcd_txn = Txn::new().when(compares).and_then([
        TxnOp::put(
            log.layout.holder(&txn.from.key),
            txn.holder_record,
            Some(
                PutOptions::new()
                    .with_lease(txn.next_session)
                    .with_prev_key(),
            ),
        ),
        TxnOp::delete(
            log.layout.claims_of(&txn.from.key),
            Some(DeleteOptions::new().with_prefix()),
        ),
    ]);
    let resp =
        log.client.kv_client().txn(etcd_txn).await.map_err(|e| {
            unavailable_on("cannot run the hand-over transaction", txn.next_session, e)
        })?;
    let replaced = resp.succeeded().then(|| match resp.op_responses().first() {
        Some(TxnOpResponse::Put(p)) => p.prev_key().map(|kv| kv.value().to_vec()),
        _ => None,
    });
    answer(resp.header(), replaced)
}

/// Deletes the hold if it is still exactly `held`; the deleted record's
/// bytes (empty if etcd did not return them).
pub(super) async fn release(log: &EtcdLog, held: &HeldAt) -> LogResult<Option<Vec<u8>>> {
    let txn = Txn::new().when(still_held(log, held)).and_then([
        TxnOp::delete(
            log.layout.holder(&held.key),
            Some(DeleteOptions::new().with_prev_key()),
        ),
        TxnOp::delete(
            log.layout.claims_of(&held.key),
            Some(DeleteOptions::new().with_prefix()),
        ),
    ]);
    let resp = log
        .client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| unavailable("cannot run the release transaction", e))?;
    let released = resp.succeeded().then(|| match resp.op_responses().first() {
        Some(TxnOpResponse::Delete(d)) => d
            .prev_kvs()
            .first()
            .map(|kv| kv.value().to_vec())
            .unwrap_or_default(),
        _ => Vec::new(),
    });
    answer(resp.header(), released)
}

/// Claims the hold at `revision` for a call of `session`: the claim record,
/// on the session's lease, if the hold is still exactly that.
pub(super) async fn claim(
    log: &EtcdLog,
    key: &str,
    session: i64,
    revision: i64,
) -> LogResult<Claimed> {
    let holder_key = log.layout.holder(key);
    let claim_key = log.layout.claim(key, revision);
    let txn = Txn::new()
        .when([
            Compare::mod_revision(holder_key.clone(), CompareOp::Equal, revision),
            Compare::lease(holder_key.clone(), CompareOp::Equal, session),
            Compare::create_revision(claim_key.clone(), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::put(
            claim_key.clone(),
            "",
            Some(PutOptions::new().with_lease(session)),
        )])
        .or_else([TxnOp::get(holder_key, None), TxnOp::get(claim_key, None)]);
    let resp = log
        .client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| unavailable_on("cannot claim a hold", session, e))?;
    let claimed = if resp.succeeded() {
        Claimed::Now
    } else {
        let ops = resp.op_responses();
        let held = ops
            .first()
            .and_then(first_kv)
            .is_some_and(|kv| kv.mod_revision == revision && kv.lease == session);
        let recorded = ops.get(1).and_then(first_kv).is_some();
        if held && recorded {
            Claimed::Already
        } else {
            Claimed::Gone
        }
    };
    answer(resp.header(), claimed)
}

/// Deletes a grant whose caller went away, if `session` still holds `key`
/// at `revision` and no call has claimed that hold (never on a caller's
/// say-so, so no record compare).
pub(super) async fn release_orphan(
    log: &EtcdLog,
    key: &str,
    session: i64,
    revision: i64,
) -> LogResult<bool> {
    let holder_key = log.layout.holder(key);
    let txn = Txn::new()
        .when([
            Compare::mod_revision(holder_key.clone(), CompareOp::Equal, revision),
            Compare::lease(holder_key.clone(), CompareOp::Equal, session),
            Compare::create_revision(log.layout.claim(key, revision), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::delete(holder_key, None)]);
    let resp = log
        .client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| unavailable("cannot release an orphaned grant", e))?;
    answer(resp.header(), resp.succeeded())
}

/// The hold on `key`; etcd reads are linearizable unless asked otherwise.
pub(super) async fn holder(log: &EtcdLog, key: &str) -> LogResult<Option<Kv>> {
    let resp = log
        .client
        .kv_client()
        .get(log.layout.holder(key), None)
        .await
        .map_err(|e| unavailable("cannot read a holder record", e))?;
    answer(resp.header(), resp.kvs().first().map(kv))
}

/// Every hold under `prefix`, keyed by lock key, in etcd's (key) order.
pub(super) async fn holders_under(log: &EtcdLog, prefix: &str) -> LogResult<Vec<(String, Kv)>> {
    let resp = log
        .client
        .kv_client()
        .get(
            log.layout.holder(prefix),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .map_err(|e| unavailable("cannot read the holder records", e))?;
    let holders = log.layout.holders();
    let held = resp
        .kvs()
        .iter()
        .map(|found| Ok((strip_holders(&holders, found.key())?, kv(found))))
        .collect::<Result<Vec<_>, StoreError>>()?;
    answer(resp.header(), held)
}

/// The lock key of a holder record's etcd `key`, found under `holders`
/// (the layout's holder prefix).
fn strip_holders(holders: &str, key: &[u8]) -> Result<String, StoreError> {
    std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(holders))
        .map(str::to_string)
        .ok_or_else(|| {
            StoreError::Malformed(format!(
                "etcd returned {} under the holder prefix {holders}",
                String::from_utf8_lossy(key)
            ))
        })
}

/// How many keys are held (count only: nothing but the count is sent).
pub(super) async fn count_holds(log: &EtcdLog) -> LogResult<i64> {
    let resp = log
        .client
        .kv_client()
        .get(
            log.layout.holders(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .map_err(|e| unavailable("cannot count the holds", e))?;
    answer(resp.header(), resp.count())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::Layout;

    #[test]
    fn lock_keys_lose_the_layout_prefix() {
        let holders = Layout::new("/latchkey/").holders();
        let key = Layout::new("/latchkey").holder("ledger/inv-1");
        assert!(matches!(
            strip_holders(&holders, key.as_bytes()).as_deref(),
            Ok("ledger/inv-1")
        ));
    }

    #[test]
    fn a_key_outside_the_prefix_or_not_utf8_is_malformed() {
        let holders = Layout::new("/latchkey").holders();
        assert!(matches!(
            strip_holders(&holders, b"/other/l/x"),
            Err(StoreError::Malformed(_))
        ));
        let mut key = holders.clone().into_bytes();
        key.push(0xff);
        assert!(matches!(
            strip_holders(&holders, &key),
            Err(StoreError::Malformed(_))
        ));
    }
}
