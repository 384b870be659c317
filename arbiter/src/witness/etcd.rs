//! The witness on a coord etcd cluster, separate from the lock cluster it
//! witnesses (ADR-03, ADR-07): a restore of the lock cluster cannot roll it
//! back, so an arbiter with no state directory still learns there what was
//! handed out before.
//!
//! Two keys per lock cluster, under the coord prefix:
//!
//! - `{prefix}/witness/{name}/mark`: the highest grant vouched for, as
//!   `{epoch:08x}:{revision:016x}:{cluster_id:016x}` (lowercase hex, fixed
//!   width). Byte order is numeric order on (epoch, revision), so etcd itself
//!   compares marks and a raise is one conditional write that can never
//!   lower the mark, whichever arbiter's write lands last;
//! - `{prefix}/witness/{name}/epoch`: the highest epoch allocated, `{epoch:08x}`.
//!
//! A restore of the coord cluster itself (with the same member flags etcd
//! keeps its cluster id) is seen the other way round: the lock cluster
//! records what it saw here (`sys/coord-seen`, see
//! [`crate::table::seal`]), and these records must never show less. A coord
//! cluster whose id changes under a running arbiter is refused outright:
//! see [`EtcdWitness`].

use std::sync::OnceLock;

use async_trait::async_trait;
use latchkey_etcd::txn::{self, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use latchkey_etcd::{Client, ResponseHeader};

use super::{Witness, Witnessed};
use crate::high_water::Mark;
use crate::lock_log::etcd::{StoreConfig, connect_client, header, unavailable};
use crate::lock_log::{Header, StoreError};

/// Conditional writes tried before giving up on a contended record.
const ATTEMPTS: usize = 5;

/// The coord cluster's record of one lock cluster.
///
/// Every answer's cluster id must be the one the first answer carried: a
/// coord cluster whose id changes under a running arbiter was replaced or
/// restored (with new member flags), its records may lie below tokens
/// already handed out, and every read, raise and allocation then fails with
/// [`StoreError::Malformed`] (the arbiter refuses grants) until an operator
/// looks. The id is remembered only in memory: an arbiter that starts
/// afresh against a replaced coord cluster does not notice this way.
pub struct EtcdWitness {
    client: Client,
    mark_key: String,
    epoch_key: String,
    endpoints: String,
    /// The coord cluster id of the first answer.
    cluster_id: OnceLock<u64>,
}

impl std::fmt::Debug for EtcdWitness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdWitness")
            .field("endpoints", &self.endpoints)
            .field("mark_key", &self.mark_key)
            .field("epoch_key", &self.epoch_key)
            .finish_non_exhaustive()
    }
}

impl EtcdWitness {
    /// Connects to the coord cluster (`config.prefix` is the coord prefix)
    /// for the lock cluster called `lock_cluster_name`. Nothing is read yet.
    pub async fn connect(
        config: &StoreConfig,
        lock_cluster_name: &str,
    ) -> Result<Self, StoreError> {
        let client = connect_client(config).await?;
        let base = format!(
            "{}/witness/{lock_cluster_name}",
            config.prefix.trim_end_matches('/')
        );
        Ok(Self {
            client,
            mark_key: format!("{base}/mark"),
            epoch_key: format!("{base}/epoch"),
            endpoints: config.endpoints.join(","),
            cluster_id: OnceLock::new(),
        })
    }

    /// The coord cluster's id, once an answer has come.
    pub fn coord_cluster_id(&self) -> Option<u64> {
        self.cluster_id.get().copied()
    }

    /// An answer's header, from the coord cluster first seen.
    fn check(&self, h: Option<&ResponseHeader>) -> Result<Header, StoreError> {
        let header = header(h)?;
        let first = *self.cluster_id.get_or_init(|| header.cluster_id);
        if first != header.cluster_id {
            return Err(StoreError::Malformed(format!(
                "the coord cluster at {} changed its cluster id from {first:#018x} to {:#018x}: it was replaced or restored from a snapshot, so its witness records may lie below tokens already handed out; refusing to use it (check the coord cluster, then restart the arbiters and advance the epoch)",
                self.endpoints, header.cluster_id
            )));
        }
        Ok(header)
    }

    /// Both records in one read, with the epoch record's mod revision
    /// (`None`: absent).
    async fn read_records(&self) -> Result<(Witnessed, Option<i64>), StoreError> {
        let txn = Txn::new().and_then([
            TxnOp::get(self.mark_key.clone(), None),
            TxnOp::get(self.epoch_key.clone(), None),
        ]);
        let resp = txn::run(&self.client, txn).await.map_err(|e| {
            unavailable("cannot read the witness records on the witness cluster", e)
        })?;
        self.check(resp.header())?;
        let ops = resp.op_responses();
        let mark = match ops.first().and_then(first_kv) {
            Some((value, _)) => {
                Some(decode_mark(&value).map_err(|e| self.malformed(&self.mark_key, &e))?)
            }
            None => None,
        };
        let (epoch, epoch_at) = match ops.get(1).and_then(first_kv) {
            Some((value, mod_revision)) => (
                decode_epoch(&value).map_err(|e| self.malformed(&self.epoch_key, &e))?,
                Some(mod_revision),
            ),
            None => (0, None),
        };
        Ok((Witnessed { mark, epoch }, epoch_at))
    }

    fn malformed(&self, key: &str, detail: &str) -> StoreError {
        StoreError::Malformed(format!(
            "the witness record {key} on the coord cluster at {} is not valid ({detail}); refusing to guess what it vouched for",
            self.endpoints
        ))
    }

    /// The epoch record is still at `at` (`None`: absent).
    fn epoch_unchanged(&self, at: Option<i64>) -> Compare {
        match at {
            Some(revision) => {
                Compare::mod_revision(self.epoch_key.clone(), CompareOp::Equal, revision)
            }
            None => Compare::create_revision(self.epoch_key.clone(), CompareOp::Equal, 0),
        }
    }

    /// Creates the mark if there is none; whether this call did.
    async fn create_mark(&self, value: &str) -> Result<bool, StoreError> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.mark_key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(self.mark_key.clone(), value, None)]);
        let resp = txn::run(&self.client, txn)
            .await
            .map_err(|e| unavailable("cannot create the witness mark on the witness cluster", e))?;
        self.check(resp.header())?;
        Ok(resp.succeeded())
    }
}

#[async_trait]
impl Witness for EtcdWitness {
    async fn read(&self) -> Result<Witnessed, StoreError> {
        Ok(self.read_records().await?.0)
    }

    /// `when mark < new then put new else get mark`: etcd compares the fixed
    /// width records byte-wise, so concurrent raises from several arbiters
    /// leave the highest. A value compare on a missing key always fails in
    /// etcd, so the first mark is a separate create-if-absent.
    async fn raise(&self, mark: Mark) -> Result<(), StoreError> {
        let new = encode_mark(&mark)?;
        for _ in 0..ATTEMPTS {
            let txn = Txn::new()
                .when([Compare::value(
                    self.mark_key.clone(),
                    CompareOp::Less,
                    new.clone(),
                )])
                .and_then([TxnOp::put(self.mark_key.clone(), new.clone(), None)])
                .or_else([TxnOp::get(self.mark_key.clone(), None)]);
            let resp = txn::run(&self.client, txn).await.map_err(|e| {
                unavailable("cannot raise the witness mark on the witness cluster", e)
            })?;
            self.check(resp.header())?;
            if resp.succeeded() {
                return Ok(());
            }
            match resp.op_responses().first().and_then(first_kv) {
                // The compare failed on a record at or above `new`: covered.
                // (Checked to be a valid mark, so a corrupt record that
                // merely sorts high is not taken as a witness.)
                Some((existing, _)) => {
                    decode_mark(&existing).map_err(|e| self.malformed(&self.mark_key, &e))?;
                    return Ok(());
                }
                None if self.create_mark(&new).await? => return Ok(()),
                // Another arbiter created it first: compare against theirs.
                None => continue,
            }
        }
        Err(StoreError::unavailable(
            "the witness mark on the coord cluster kept changing while it was being raised",
        ))
    }

    /// Above the recorded epoch and the mark's epoch, at least `at_least`;
    /// written only if the epoch record is still the one read.
    async fn allocate_epoch(&self, at_least: u32) -> Result<u32, StoreError> {
        for _ in 0..ATTEMPTS {
            let (witnessed, epoch_at) = self.read_records().await?;
            let next = witnessed
                .epoch
                .saturating_add(1)
                .max(witnessed.mark.map_or(0, |m| m.epoch.saturating_add(1)))
                .max(at_least);
            let txn = Txn::new()
                .when([self.epoch_unchanged(epoch_at)])
                .and_then([TxnOp::put(self.epoch_key.clone(), encode_epoch(next), None)]);
            let resp = txn::run(&self.client, txn)
                .await
                .map_err(|e| unavailable("cannot allocate an epoch on the witness cluster", e))?;
            self.check(resp.header())?;
            if resp.succeeded() {
                return Ok(next);
            }
        }
        Err(StoreError::unavailable(
            "the witness's epoch record on the coord cluster kept changing while an epoch was being allocated",
        ))
    }

    /// Written only if the epoch record is still the one read, and only
    /// when it is below `epoch`.
    async fn note_epoch(&self, epoch: u32) -> Result<(), StoreError> {
        for _ in 0..ATTEMPTS {
            let (witnessed, epoch_at) = self.read_records().await?;
            if witnessed.epoch >= epoch {
                return Ok(());
            }
            let txn = Txn::new()
                .when([self.epoch_unchanged(epoch_at)])
                .and_then([TxnOp::put(
                    self.epoch_key.clone(),
                    encode_epoch(epoch),
                    None,
                )]);
            let resp = txn::run(&self.client, txn)
                .await
                .map_err(|e| unavailable("cannot record the epoch on the witness cluster", e))?;
            self.check(resp.header())?;
            if resp.succeeded() {
                return Ok(());
            }
        }
        Err(StoreError::unavailable(
            "the witness's epoch record on the coord cluster kept changing while an epoch was being recorded",
        ))
    }

    fn describe(&self) -> String {
        let base = self.mark_key.trim_end_matches("/mark");
        match self.coord_cluster_id() {
            Some(id) => format!(
                "coord etcd cluster {id:#018x} at {} ({base}/)",
                self.endpoints
            ),
            None => format!("coord etcd cluster at {} ({base}/)", self.endpoints),
        }
    }
}

/// The value and mod revision of the first key a get operation found.
fn first_kv(resp: &TxnOpResponse) -> Option<(Vec<u8>, i64)> {
    txn::first_kv(resp).map(|kv| (kv.value().to_vec(), kv.mod_revision()))
}

/// `{epoch:08x}:{revision:016x}:{cluster_id:016x}`: byte order is (epoch,
/// revision) order. A negative revision (never sent by etcd) has no place
/// in that order and is refused.
fn encode_mark(mark: &Mark) -> Result<String, StoreError> {
    let revision = u64::try_from(mark.revision).map_err(|_| {
        StoreError::Malformed(format!(
            "a negative revision ({}) cannot be witnessed",
            mark.revision
        ))
    })?;
    Ok(format!(
        "{:08x}:{revision:016x}:{:016x}",
        mark.epoch, mark.cluster_id
    ))
}

fn decode_mark(bytes: &[u8]) -> Result<Mark, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
    let mut parts = text.split(':');
    let (Some(epoch), Some(revision), Some(cluster_id), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        // Not quoted: a mark's parts are a token's (its epoch and revision).
        return Err(format!(
            "it is not epoch:revision:cluster_id ({} bytes, {} parts)",
            text.len(),
            text.split(':').count()
        ));
    };
    let revision = i64::try_from(hex::<u64>(revision, 16)?)
        .map_err(|_| "its revision is out of range".to_string())?;
    Ok(Mark {
        epoch: hex::<u32>(epoch, 8)?,
        cluster_id: hex::<u64>(cluster_id, 16)?,
        revision,
    })
}

fn encode_epoch(epoch: u32) -> String {
    format!("{epoch:08x}")
}

fn decode_epoch(bytes: &[u8]) -> Result<u32, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
    hex::<u32>(text, 8)
}

/// Exactly `width` lowercase hex digits: any other spelling would break the
/// byte-wise order etcd compares by.
fn hex<T: FromHex>(text: &str, width: usize) -> Result<T, String> {
    // The part is not quoted: it may be a token's half.
    if text.len() != width || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(format!(
            "a part of {} characters is not {width} lowercase hex digits",
            text.len()
        ));
    }
    T::from_hex(text).ok_or_else(|| "a part is out of range".to_string())
}

trait FromHex: Sized {
    fn from_hex(text: &str) -> Option<Self>;
}

impl FromHex for u32 {
    fn from_hex(text: &str) -> Option<Self> {
        u32::from_str_radix(text, 16).ok()
    }
}

impl FromHex for u64 {
    fn from_hex(text: &str) -> Option<Self> {
        u64::from_str_radix(text, 16).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(epoch: u32, revision: i64, cluster_id: u64) -> Mark {
        Mark {
            epoch,
            cluster_id,
            revision,
        }
    }

    #[test]
    fn marks_round_trip() {
        for mark in [
            m(1, 1, 0),
            m(2, 1 << 40, u64::MAX),
            m(u32::MAX, i64::MAX, 7),
        ] {
            let encoded = encode_mark(&mark).unwrap();
            assert_eq!(decode_mark(encoded.as_bytes()).unwrap(), mark);
        }
        assert_eq!(decode_epoch(encode_epoch(42).as_bytes()).unwrap(), 42);
    }

    /// etcd compares values byte-wise; that must be `covers` order.
    #[test]
    fn byte_order_is_epoch_then_revision() {
        let marks = [
            m(1, 5, u64::MAX),
            m(1, 16, 0),
            m(1, 255, 3),
            m(1, 256, 3),
            m(2, 1, 0),
            m(16, 0, 0),
            m(300, 9, 9),
        ];
        for a in &marks {
            for b in &marks {
                let (ea, eb) = (encode_mark(a).unwrap(), encode_mark(b).unwrap());
                assert_eq!(
                    ea.as_bytes() >= eb.as_bytes(),
                    a.covers(b),
                    "{a:?} vs {b:?}"
                );
            }
        }
    }

    #[test]
    fn malformed_records_are_refused() {
        for bad in [
            "",
            "1:2:3",
            "00000001:0000000000000002",
            "00000001:000000000000000A:0000000000000003",
            "00000001:0000000000000002:0000000000000003:00",
            "00000001:8000000000000000:0000000000000003",
        ] {
            assert!(decode_mark(bad.as_bytes()).is_err(), "{bad:?}");
        }
        assert!(decode_epoch(b"2").is_err());
        assert!(encode_mark(&m(1, -1, 0)).is_err());
    }
}
