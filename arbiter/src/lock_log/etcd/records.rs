//! The epoch record and the seal: one read of both, the first-start
//! create, the conditional seal and the operator's advance; and the
//! shard-map fence (read with them, raised on its own).

use latchkey_etcd::kv::{DeleteOptions, get_one};
use latchkey_etcd::txn::{self, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use super::{EtcdLog, answer, first_kv, kv, unavailable};
use crate::lock_log::{Kv, LogResult, Records, StoreError};
use crate::records::{decode_map_fence, encode_map_fence};

/// The epoch record, the seal, the coord-seen record and the shard-map
/// fence in one transaction, so all are of the same revision.
pub(super) async fn read(log: &EtcdLog) -> LogResult<Records> {
    let txn = Txn::new().and_then([
        TxnOp::get(log.layout.epoch(), None),
        TxnOp::get(log.layout.seal(), None),
        TxnOp::get(log.layout.coord_seen(), None),
        TxnOp::get(log.layout.map_fence(), None),
    ]);
    let resp = txn::run(&log.client, txn)
        .await
        .map_err(|e| unavailable("cannot read the epoch record", e))?;
    let ops = resp.op_responses();
    let records = Records {
        epoch: ops.first().and_then(first_kv),
        seal: ops.get(1).and_then(first_kv),
        coord_seen: ops.get(2).and_then(first_kv),
        map_fence: ops.get(3).and_then(first_kv),
    };
    answer(resp.header(), records)
}

/// Puts the epoch record only if there is none: two arbiters starting at
/// once both try, one wins and the other reads the winner's.
pub(super) async fn create_epoch(log: &EtcdLog, record: Vec<u8>) -> LogResult<bool> {
    let epoch_key = log.layout.epoch();
    let txn = Txn::new()
        .when([Compare::create_revision(
            epoch_key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then([TxnOp::put(epoch_key, record, None)]);
    let resp = txn::run(&log.client, txn)
        .await
        .map_err(|e| unavailable("cannot create the epoch record", e))?;
    answer(resp.header(), resp.succeeded())
}

/// "Absent" for `None`, "last modified at" for `Some`: a write that acts
/// only on the record the caller read.
fn unchanged(key: &str, at: Option<i64>) -> Compare {
    match at {
        Some(revision) => Compare::mod_revision(key, CompareOp::Equal, revision),
        None => Compare::create_revision(key, CompareOp::Equal, 0),
    }
}

/// Writes (or raises) the seal if neither the seal nor the epoch record
/// changed since the caller read them: an advance in between must not be
/// sealed by a seal meant for the epoch before it.
pub(super) async fn put_seal(
    log: &EtcdLog,
    record: Vec<u8>,
    seal_at: Option<i64>,
    epoch_at: Option<i64>,
) -> LogResult<bool> {
    let seal = log.layout.seal();
    let txn = Txn::new()
        .when([
            unchanged(&seal, seal_at),
            unchanged(&log.layout.epoch(), epoch_at),
        ])
        .and_then([TxnOp::put(seal, record, None)]);
    let resp = txn::run(&log.client, txn)
        .await
        .map_err(|e| unavailable("cannot write the seal record", e))?;
    answer(resp.header(), resp.succeeded())
}

/// Writes the coord-seen record if it is still the one the caller read.
pub(super) async fn put_coord_seen(
    log: &EtcdLog,
    record: Vec<u8>,
    at: Option<i64>,
) -> LogResult<bool> {
    let key = log.layout.coord_seen();
    let txn = Txn::new()
        .when([unchanged(&key, at)])
        .and_then([TxnOp::put(key, record, None)]);
    let resp = txn::run(&log.client, txn)
        .await
        .map_err(|e| unavailable("cannot write the coord-seen record", e))?;
    answer(resp.header(), resp.succeeded())
}

/// ADR-03's unseal in one transaction: if the epoch record is still
/// `expected` and the seal unchanged (a seal raised meanwhile may carry a
/// higher floor), writes the new epoch and deletes every hold, every
/// durable waiter and the seal. The count is the holds deleted.
pub(super) async fn advance(
    log: &EtcdLog,
    expected: Vec<u8>,
    seal_at: Option<i64>,
    record: Vec<u8>,
) -> LogResult<Option<i64>> {
    let epoch_key = log.layout.epoch();
    let seal_key = log.layout.seal();
    let txn = Txn::new()
        .when([
            Compare::value(epoch_key.clone(), CompareOp::Equal, expected),
            unchanged(&seal_key, seal_at),
        ])
        .and_then([
            TxnOp::put(epoch_key, record, None),
            TxnOp::delete(
                log.layout.holders(),
                Some(DeleteOptions::new().with_prefix()),
            ),
            TxnOp::delete(
                log.layout.durable_waiters(),
                Some(DeleteOptions::new().with_prefix()),
            ),
            TxnOp::delete(seal_key, None),
            TxnOp::delete(
                log.layout.claims(),
                Some(DeleteOptions::new().with_prefix()),
            ),
            // Every leadership ends and every candidacy with it; terms go
            // on from the new epoch's range (`latchkey_records::term_of`).
            TxnOp::delete(
                log.layout.elections(),
                Some(DeleteOptions::new().with_prefix()),
            ),
            // Every quota place goes with the holds that took them.
            TxnOp::delete(
                log.layout.all_quota_places(),
                Some(DeleteOptions::new().with_prefix()),
            ),
            // Every writer's intent: no arbiter's wait knows them now.
            TxnOp::delete(
                log.layout.all_intents(),
                Some(DeleteOptions::new().with_prefix()),
            ),
        ]);
    let resp = txn::run(&log.client, txn)
        .await
        .map_err(|e| unavailable("cannot advance the epoch", e))?;
    let deleted = resp.succeeded().then(|| match resp.op_responses().get(1) {
        Some(TxnOpResponse::Delete(d)) => d.deleted(),
        _ => 0,
    });
    answer(resp.header(), deleted)
}

/// How many times a raise of the shard-map fence reads and compares again
/// when another raise came between its read and its write.
const RAISE_ATTEMPTS: usize = 5;

/// The shard-map fence record.
pub(super) async fn map_fence(log: &EtcdLog) -> LogResult<Option<Kv>> {
    let read = get_one(&log.client, log.layout.map_fence())
        .await
        .map_err(|e| unavailable("cannot read the shard-map fence", e))?;
    answer(read.header.as_ref(), read.value.as_ref().map(kv))
}

/// Raises the shard-map fence to `version` unless it is there already or
/// higher: a compare-and-put on the record as read (created only if still
/// absent, version 0; replaced only if unchanged since the read), read
/// again when another raise won the race.
pub(super) async fn raise_map_fence(log: &EtcdLog, version: u64) -> LogResult<bool> {
    let key = log.layout.map_fence();
    for _ in 0..RAISE_ATTEMPTS {
        let read = map_fence(log).await?;
        let compare = match &read.value {
            None => Compare::version(key.clone(), CompareOp::Equal, 0),
            Some(found) => {
                let at = decode_map_fence(&found.value).ok_or_else(|| {
                    StoreError::Malformed(format!(
                        "the shard-map fence {key} is not a 20-digit version: {:?}",
                        String::from_utf8_lossy(&found.value)
                    ))
                })?;
                if at >= version {
                    return Ok(read.map(|_| false));
                }
                Compare::mod_revision(key.clone(), CompareOp::Equal, found.mod_revision)
            }
        };
        let txn = Txn::new().when([compare]).and_then([TxnOp::put(
            key.clone(),
            encode_map_fence(version),
            None,
        )]);
        let resp = txn::run(&log.client, txn)
            .await
            .map_err(|e| unavailable("cannot raise the shard-map fence", e))?;
        if resp.succeeded() {
            return answer(resp.header(), true);
        }
    }
    Err(StoreError::unavailable(
        "the shard-map fence kept changing while it was being raised",
    ))
}
