//! The forced end of a hold or of a leadership (two-person force-release):
//! one transaction on the force-release path's own client, logged in as the
//! restricted force-release user when one is configured.

use latchkey_etcd::ErrorKind;
use latchkey_etcd::kv::{DeleteOptions, PutOptions};
use latchkey_etcd::txn::{Compare, CompareOp, Txn, TxnOp};
use tracing::warn;

use super::{EtcdLog, answer, first_kv};
use crate::lock_log::{ForceEndTxn, ForceEnded, ForceRecords, ForceTermTxn, LogResult, StoreError};

/// Deletes the named hold with its claims, writes the approval's records,
/// all in one transaction if the hold and the records are as named. On a
/// compare failure the same transaction reads the hold and the records, so
/// the caller learns which moved.
pub(super) async fn force_end(log: &EtcdLog, txn: ForceEndTxn<'_>) -> LogResult<ForceEnded> {
    let holder = log.layout.holder(txn.key);
    let when = vec![
        Compare::mod_revision(holder.as_str(), CompareOp::Equal, txn.revision),
        Compare::lease(holder.as_str(), CompareOp::Equal, txn.lease),
    ];
    let then = vec![
        TxnOp::delete(holder.as_str(), None),
        TxnOp::delete(
            log.layout.claims_of(txn.key),
            Some(DeleteOptions::new().with_prefix()),
        ),
    ];
    let otherwise = vec![TxnOp::get(holder.as_str(), None)];
    run(log, txn.records, when, then, otherwise).await
}

/// Ends the named leadership (deletes the leader record and the
/// leadership's entry, puts the term record ended), writes the approval's
/// records, all in one transaction if the leader record, the term record
/// and the records are as named. On a compare failure the same transaction
/// reads the leader record and the records, so the caller learns which
/// moved.
pub(super) async fn force_end_term(log: &EtcdLog, txn: ForceTermTxn<'_>) -> LogResult<ForceEnded> {
    let lead = log.layout.election_lead(txn.election);
    let term = log.layout.election_term(txn.election);
    let when = vec![
        Compare::lease(lead.as_str(), CompareOp::Equal, txn.session),
        // A missing term record compares as mod revision 0, which no
        // request names (it read a leader, so a term record).
        Compare::mod_revision(term.as_str(), CompareOp::Equal, txn.term_at),
    ];
    // The term record first: an observer reads a batch in this order (as
    // the leadership transaction writes it).
    let then = vec![
        TxnOp::put(term.as_str(), txn.term_record, None),
        TxnOp::delete(lead.as_str(), None),
        TxnOp::delete(log.layout.leadership_entry(txn.subject, txn.election), None),
    ];
    let otherwise = vec![TxnOp::get(lead.as_str(), None)];
    run(log, txn.records, when, then, otherwise).await
}

/// One forced end: `when` and `then` of the target (a hold or a term),
/// plus the approval's records; `otherwise` reads the target first, then
/// the records that must not have moved.
async fn run(
    log: &EtcdLog,
    records: &ForceRecords,
    mut when: Vec<Compare>,
    mut then: Vec<TxnOp>,
    mut otherwise: Vec<TxnOp>,
) -> LogResult<ForceEnded> {
    let client = &log.force;
    let lease = match records.put.is_empty() {
        true => None,
        false => Some(
            client
                .lease_client()
                .grant(i64::from(records.ttl_seconds.max(1)), None)
                .await
                .map_err(|e| refused("cannot grant the force record's lease", e))?
                .id(),
        ),
    };
    for (name, revision) in &records.unchanged {
        let key = log.layout.under(name);
        when.push(Compare::mod_revision(
            key.as_str(),
            CompareOp::Equal,
            *revision,
        ));
        otherwise.push(TxnOp::get(key, None));
    }
    for (name, value) in &records.put {
        let options = lease.map(|l| PutOptions::new().with_lease(l));
        then.push(TxnOp::put(log.layout.under(name), value.clone(), options));
    }
    for name in &records.delete {
        then.push(TxnOp::delete(log.layout.under(name), None));
    }
    let resp = match client
        .kv_client()
        .txn(Txn::new().when(when).and_then(then).or_else(otherwise))
        .await
    {
        Ok(resp) => resp,
        // The outcome is unknown: the transaction may have committed, and
        // revoking the lease would delete the force record of a hold that
        // did end. Unused, the lease expires with its TTL.
        Err(e) => return Err(refused("cannot run the force-release transaction", e)),
    };
    if resp.succeeded() {
        return answer(resp.header(), ForceEnded::Ended);
    }
    drop_lease(log, lease).await;
    let answers = resp.op_responses();
    let records_moved = records
        .unchanged
        .iter()
        .zip(answers.iter().skip(1))
        .any(|((_, revision), got)| first_kv(got).is_none_or(|kv| kv.mod_revision != *revision));
    let ended = match records_moved {
        true => ForceEnded::RecordsChanged,
        false => ForceEnded::HoldChanged {
            now: answers.first().and_then(first_kv),
        },
    };
    answer(resp.header(), ended)
}

/// etcd's PermissionDenied is [`StoreError::Denied`] (the force-release
/// user's role lacks a permission: nothing was written); anything else is
/// unavailable, its outcome unknown.
fn refused(context: &str, err: impl Into<latchkey_etcd::Error>) -> StoreError {
    let err = err.into();
    if err.kind() == ErrorKind::PermissionDenied {
        return StoreError::Denied {
            context: format!("{context}: {}", err.grpc_message().unwrap_or_default()),
            source: Some(Box::new(err)),
        };
    }
    super::unavailable(context, err)
}

/// Best effort: a lease granted for a write that did not happen.
async fn drop_lease(log: &EtcdLog, lease: Option<i64>) {
    if let Some(lease) = lease
        && let Err(e) = log.force.lease_client().revoke(lease).await
    {
        warn!(lease, error = %e, "could not revoke an unused force-release lease (it expires by itself)");
    }
}
