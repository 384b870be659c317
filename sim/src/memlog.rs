//! [`MemLog`]: an in-memory [`LockLog`] with etcd's semantics, for the
//! deterministic simulation.
//!
//! What it keeps from etcd, because the grant protocol leans on it:
//!
//! - one revision counter for the whole store; each write transaction that
//!   changes something commits at the next revision, reads and failed
//!   transactions do not move it, and every answer's header carries the
//!   revision and the cluster id;
//! - per key `create_revision`, `mod_revision` and lease; compares fail as
//!   etcd's do (a value compare on a missing key always fails, the others
//!   compare a missing key as zeros); a put on a missing lease refuses the
//!   whole transaction ([`StoreError::LeaseGone`]);
//! - leases on tokio's clock: under paused time the simulation decides when
//!   they expire. An expired lease is revoked at its deadline, its keys
//!   deleted at one new revision, before anything else the store does
//!   after that instant, and a watch blocked in [`KeyWatch::next`] wakes at
//!   the deadline by itself (no background task);
//! - watches from a revision: a per-key history replayed from there, then
//!   live events; compaction drops history, and a watch from below it is
//!   `Lost`. Prefix watches (an election's, from any revision; the
//!   followers', from the revision after their read) replay every change
//!   under the prefix with its values, the value before a change included
//!   (`prev_kv`);
//! - elections ([`ElectionLog`](latchkey_arbiter::lock_log::ElectionLog),
//!   `memlog/elections.rs`) with the etcd log's compares and writes, each
//!   one call under the same faults as every other call.
//!
//! What it adds: faults drawn from a seed per call ([`FaultRates`]), and
//! the operator-side events a simulation needs (compaction, snapshot and
//! restore with the same or a new cluster id, broken watch streams).
//!
//! Nothing here reads the wall clock, spawns a task or iterates a hash
//! map: on a current-thread runtime with paused time, a seed and a script
//! of calls give the same answers every run.
//!
//! [`LockLog`]: latchkey_arbiter::lock_log::LockLog

mod batch;
mod call;
mod elections;
mod holds;
mod store;
#[cfg(test)]
mod tests;
mod watch;

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use async_trait::async_trait;
use latchkey_arbiter::lock_log::{
    Answer, Counted, DurableQueueLog, EpochLog, FollowLog, Header, KeyWatch, Kv, LogResult,
    PrefixWatch, Queued, Records, Renewal, RevokeSessionTxn, SessionLog, SessionRevoked,
    ShadowMarks, StoreError, fallback,
};
use latchkey_records::{Layout, decode_map_fence, encode_map_fence, keys};
use tokio::time::{Duration, Instant};

use crate::rng::Rng;
pub use batch::BatchCounts;
pub use store::CompactError;
use store::{Compare, Image, NoLease, Op, OpResult, Store};

/// Where each record lives in the store: the arbiter's etcd layout
/// without its prefix (`l/<key>`, `s/<lease:016x>`, `sys/epoch`, ...).
pub(crate) static LAYOUT: Layout = Layout::bare();

/// How often, in percent of calls, each fault strikes. Every call of the
/// [`LockLog`] draws its fate once, whatever the rates, so changing one rate
/// does not reshuffle the others' stream.
///
/// [`LockLog`]: latchkey_arbiter::lock_log::LockLog
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultRates {
    /// The call fails before it reaches the store: nothing applied,
    /// [`StoreError::Unavailable`].
    pub fail_before_commit: u32,
    /// The call is applied, then its answer is lost:
    /// [`StoreError::Unavailable`] for a write that happened.
    pub lose_response: u32,
    /// The call waits a random time up to [`Self::max_delay`] (on tokio's
    /// clock) before the store applies it, so calls overtake each other.
    pub delay: u32,
    pub max_delay: Duration,
}

impl FaultRates {
    /// No faults.
    pub const NONE: FaultRates = FaultRates {
        fail_before_commit: 0,
        lose_response: 0,
        delay: 0,
        max_delay: Duration::ZERO,
    };
}

/// How many faults were injected so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultCounts {
    pub calls: u64,
    pub failed_before_commit: u64,
    pub lost_responses: u64,
    pub delayed: u64,
}

/// How a [`MemLog`] starts.
#[derive(Debug, Clone)]
pub struct MemLogConfig {
    /// Seeds the fault stream and any new cluster id.
    pub seed: u64,
    /// The cluster id headers carry (`None`: drawn from the seed).
    pub cluster_id: Option<u64>,
    pub faults: FaultRates,
    /// Keep at least this many revisions of watch history, compacting
    /// older ones on its own (etcd's revision auto-compaction), so a long
    /// simulation stays bounded. `None`: only [`MemLog::compact`] compacts.
    pub history_revisions: Option<u64>,
    /// etcd raises a shorter TTL to this (1.5 election timeouts: 2 s with
    /// etcd's defaults), so a session's TTL behaves as on a real etcd.
    pub min_ttl_seconds: u32,
    /// Every call takes half of this to all of it (on tokio's clock) before
    /// the store applies it: the round trip to etcd, during which calls
    /// that arrive meet a batch in flight. Drawn apart from the faults.
    pub latency: Duration,
}

impl Default for MemLogConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            cluster_id: None,
            faults: FaultRates::NONE,
            history_revisions: Some(10_000),
            min_ttl_seconds: 2,
            latency: Duration::ZERO,
        }
    }
}

/// Which cluster id a restored store answers with (as an `etcdctl snapshot
/// restore` with the same or a new `--initial-cluster-token`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterId {
    Same,
    New,
}

/// The store at one revision, to [`MemLog::restore`] later (an etcd
/// snapshot: keys, history since the last compaction, leases).
#[derive(Debug, Clone)]
pub struct Snapshot {
    image: Image,
}

impl Snapshot {
    pub fn revision(&self) -> i64 {
        self.image.revision
    }

    /// The value of `key` (unprefixed, as the log stores it: `sys/epoch`,
    /// `sys/coord-seen`, ...) in this snapshot, if it was there.
    pub fn value(&self, key: &str) -> Option<&[u8]> {
        self.image.get(key).map(|s| s.value.as_slice())
    }
}

struct Inner {
    store: Store,
    cluster_id: u64,
    faults: FaultRates,
    /// Draws the faults: one draw set per call.
    rng: Rng,
    /// Draws new cluster ids, apart from the faults so a restore does not
    /// shift the fault stream.
    ids: Rng,
    counts: FaultCounts,
    latency: Duration,
    /// Draws each call's latency, apart from the faults.
    latency_rng: Rng,
    batches: BatchCounts,
    /// Batches of more than one member on their way to the store.
    batches_in_flight: usize,
    /// Lease renewals fail (the rest of the store answers).
    renewals_fail: bool,
}

impl Inner {
    fn header(&self) -> Header {
        Header {
            cluster_id: self.cluster_id,
            revision: self.store.revision(),
        }
    }

    fn answer<T>(&self, value: T) -> LogResult<T> {
        Ok(Answer {
            header: self.header(),
            value,
        })
    }
}

pub(crate) struct Shared {
    inner: Mutex<Inner>,
    /// Bumped whenever a watch may have something new (an event, an ended
    /// stream, a lease deadline that moved).
    changed: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    /// The state (parking_lot: a panic elsewhere while it was held leaves
    /// it usable, and the simulation reports that panic).
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Runs `f` on the state after applying every lease expiry due by now,
    /// then wakes the watches if anything they wait for changed.
    fn with<T>(&self, f: impl FnOnce(&mut Inner, Instant) -> T) -> T {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.store.expire_due(now);
        let out = f(&mut inner, now);
        if inner.store.take_dirty() {
            self.changed.send_modify(|n| *n = n.wrapping_add(1));
        }
        out
    }
}

/// The in-memory lock log. A cheap handle: clones share one store.
#[derive(Clone)]
pub struct MemLog {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.shared.lock();
        f.debug_struct("MemLog")
            .field("cluster_id", &inner.cluster_id)
            .field("revision", &inner.store.revision())
            .field("faults", &inner.faults)
            .finish_non_exhaustive()
    }
}

impl MemLog {
    /// An empty store (revision 1, as a fresh etcd) with no faults.
    pub fn new(seed: u64) -> Self {
        Self::with_config(MemLogConfig {
            seed,
            ..MemLogConfig::default()
        })
    }

    pub fn with_config(config: MemLogConfig) -> Self {
        let mut ids = Rng::new(config.seed ^ 0x5EED_C1D5_0000_0001);
        let cluster_id = config.cluster_id.unwrap_or_else(|| nonzero(ids.next_u64()));
        let (changed, _) = tokio::sync::watch::channel(0);
        Self {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    store: Store::new(config.history_revisions, config.min_ttl_seconds),
                    cluster_id,
                    faults: config.faults,
                    rng: Rng::new(config.seed),
                    ids,
                    counts: FaultCounts::default(),
                    latency: config.latency,
                    latency_rng: Rng::new(config.seed ^ 0x1A7E_0C70_0000_0001),
                    batches: BatchCounts::default(),
                    batches_in_flight: 0,
                    renewals_fail: false,
                }),
                changed,
            }),
        }
    }

    // --- fault knobs ---

    pub fn set_faults(&self, faults: FaultRates) {
        self.shared.lock().faults = faults;
    }

    pub fn faults(&self) -> FaultRates {
        self.shared.lock().faults
    }

    pub fn fault_counts(&self) -> FaultCounts {
        self.shared.lock().counts
    }

    /// Batches of more than one member on their way to the store now.
    pub fn batches_in_flight(&self) -> usize {
        self.shared.lock().batches_in_flight
    }

    /// What happened to the batches of more than one member so far.
    pub fn batch_counts(&self) -> BatchCounts {
        self.shared.lock().batches
    }

    // --- the operator's side ---

    /// Compacts history below `revision` (etcd's `compact`): a watch from
    /// below it is `Lost`; watches already following are not affected.
    pub fn compact(&self, revision: i64) -> Result<(), CompactError> {
        self.shared.with(|inner, _| inner.store.compact(revision))
    }

    /// Ends every open watch, as a broken watch stream or a restarted
    /// member does: each reports what reached it, then `Lost`.
    pub fn break_watches(&self) {
        self.shared.with(|inner, _| inner.store.end_watches());
    }

    /// The members lose their majority (issue 32's quorum-loss windows):
    /// every call fails with "no leader" without reaching the store, no
    /// lease expires, and watches see nothing (nothing commits), until
    /// [`Self::regain_quorum`].
    pub fn lose_quorum(&self) {
        self.shared.with(|inner, _| inner.store.lose_quorum());
    }

    /// A majority again: every lease gets its whole TTL from now, as a new
    /// etcd leader's lessor gives it.
    pub fn regain_quorum(&self) {
        self.shared
            .with(|inner, now| inner.store.regain_quorum(now));
    }

    /// Every lease renewal fails from now until `false` (the rest of the
    /// store answers): sessions whose clients cannot renew expire.
    pub fn fail_renewals(&self, fail: bool) {
        self.shared.lock().renewals_fail = fail;
    }

    /// Whether the members have no majority now.
    pub fn quorum_lost(&self) -> bool {
        self.shared.lock().store.quorum_lost()
    }

    /// Counts the holds of `class` per grant subject after every commit
    /// from now on ([`Self::quota_violations`]): the quota invariant.
    pub fn watch_quota(&self, class: &str, max: u32) {
        self.shared.lock().store.watch_quota(class, max);
    }

    /// Counts the held slots of every semaphore after every commit from now
    /// on ([`Self::quota_violations`] reports a semaphore over `permits`).
    pub fn watch_permits(&self, permits: u32) {
        self.shared.lock().store.watch_permits(permits);
    }

    /// Every commit after which a grant subject held more keys of the
    /// watched class than its quota.
    pub fn quota_violations(&self) -> Vec<String> {
        self.shared.lock().store.quota_violations.clone()
    }

    /// The store as it is now.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.with(|inner, _| Snapshot {
            image: inner.store.image(),
        })
    }

    /// Goes back to `snapshot`: its keys and revision (revisions after it
    /// will be reused, as after an etcd restore), its leases with their
    /// TTL restarted, every open watch ending with `Lost`; with
    /// [`ClusterId::New`] headers carry a new cluster id from now on.
    pub fn restore(&self, snapshot: &Snapshot, cluster_id: ClusterId) {
        self.shared.with(|inner, now| {
            inner.batches.restored_under += u64::from(inner.batches_in_flight > 0);
            inner.store.restore(&snapshot.image, now);
            if cluster_id == ClusterId::New {
                let old = inner.cluster_id;
                let mut new = nonzero(inner.ids.next_u64());
                while new == old {
                    new = nonzero(inner.ids.next_u64());
                }
                inner.cluster_id = new;
            }
        });
    }

    // --- inspection (no faults, no effect but due expiries) ---

    /// The holder record of lock key `key` as stored now, if it is held.
    pub fn holder_now(&self, key: &str) -> Option<Kv> {
        self.stored(&LAYOUT.holder(key))
    }

    pub fn revision(&self) -> i64 {
        self.shared.with(|inner, _| inner.store.revision())
    }

    pub fn cluster_id(&self) -> u64 {
        self.shared.lock().cluster_id
    }

    /// `key` as the store has it now (unprefixed, as the log stores it:
    /// `sys/epoch`, `sys/shardmap`, ...).
    pub fn stored(&self, key: &str) -> Option<Kv> {
        self.shared.with(|inner, _| kv_of(&inner.store, key))
    }

    pub fn compaction_revision(&self) -> i64 {
        self.shared.lock().store.compacted()
    }

    /// The leases the store has now, in id order.
    pub fn lease_ids(&self) -> Vec<i64> {
        self.shared.with(|inner, _| inner.store.lease_ids())
    }

    /// How long until `lease` expires, if the store still has it.
    pub fn lease_remaining(&self, lease: i64) -> Option<Duration> {
        self.shared.with(|inner, now| {
            inner
                .store
                .lease(lease)
                .map(|l| l.deadline.saturating_duration_since(now))
        })
    }

    /// Watches not ended yet.
    pub fn open_watches(&self) -> usize {
        self.shared.lock().store.open_watches()
    }
}

fn nonzero(id: u64) -> u64 {
    if id == 0 { 1 } else { id }
}

fn lease_gone(NoLease(lease): NoLease) -> StoreError {
    StoreError::LeaseGone { lease }
}

/// A compare on a record expected at `at` (`None`: absent).
fn at_revision(key: String, at: Option<i64>) -> Compare {
    match at {
        Some(rev) => Compare::ModRevision(key, rev),
        None => Compare::CreateRevision(key, 0),
    }
}

fn kv_of(store: &Store, key: &str) -> Option<Kv> {
    store.get(key).map(|kv| kv.kv())
}

#[async_trait]
impl FollowLog for MemLog {
    async fn follow(
        &self,
        counted: Counted,
        _prev_kv: bool,
        each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
    ) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError> {
        // Deletes always carry their value here (etcd's prev_kv, asked
        // for or not: a follower that did not ask ignores it).
        let prefix = match counted {
            Counted::Holds => LAYOUT.holders(),
            Counted::SessionIndex => LAYOUT.session_index(),
        };
        // The call's fate first (a failure, a delay); then the read and
        // the watch together, so a lost answer cannot leave a watch open
        // that nobody reads.
        self.call("follow", |_, _| Ok(())).await?;
        let rx = self.shared.changed.subscribe();
        let (read, revision, id) = self.shared.with(|inner, _| inner.store.follow(&prefix));
        for (key, kv) in &read {
            each(key, kv);
        }
        let watch: Box<dyn PrefixWatch> =
            Box::new(watch::MemPrefixWatch::new(self.shared.clone(), id, rx));
        Ok((revision, Ok(watch)))
    }
}

#[async_trait]
impl EpochLog for MemLog {
    async fn records(&self) -> LogResult<Records> {
        self.call("records", |inner, _| {
            let records = Records {
                epoch: kv_of(&inner.store, &LAYOUT.epoch()),
                seal: kv_of(&inner.store, &LAYOUT.seal()),
                coord_seen: kv_of(&inner.store, &LAYOUT.coord_seen()),
                map_fence: kv_of(&inner.store, &LAYOUT.map_fence()),
            };
            inner.answer(records)
        })
        .await
    }

    async fn create_epoch(&self, record: Vec<u8>) -> LogResult<bool> {
        self.call("create epoch", |inner, _| {
            let created = inner
                .store
                .all(&[Compare::CreateRevision(LAYOUT.epoch(), 0)]);
            if created {
                commit(&mut inner.store, vec![put(LAYOUT.epoch(), record, 0)])?;
            }
            inner.answer(created)
        })
        .await
    }

    async fn put_seal(
        &self,
        record: Vec<u8>,
        seal_at: Option<i64>,
        epoch_at: Option<i64>,
    ) -> LogResult<bool> {
        self.call("put seal", |inner, _| {
            let ok = inner.store.all(&[
                at_revision(LAYOUT.seal(), seal_at),
                at_revision(LAYOUT.epoch(), epoch_at),
            ]);
            if ok {
                commit(&mut inner.store, vec![put(LAYOUT.seal(), record, 0)])?;
            }
            inner.answer(ok)
        })
        .await
    }

    async fn put_coord_seen(&self, record: Vec<u8>, at: Option<i64>) -> LogResult<bool> {
        self.call("put coord-seen", |inner, _| {
            let ok = inner.store.all(&[at_revision(LAYOUT.coord_seen(), at)]);
            if ok {
                commit(&mut inner.store, vec![put(LAYOUT.coord_seen(), record, 0)])?;
            }
            inner.answer(ok)
        })
        .await
    }

    async fn advance(
        &self,
        expected: Vec<u8>,
        seal_at: Option<i64>,
        record: Vec<u8>,
    ) -> LogResult<Option<i64>> {
        self.call("advance", |inner, _| {
            let ok = inner.store.all(&[
                Compare::Value(LAYOUT.epoch(), expected),
                at_revision(LAYOUT.seal(), seal_at),
            ]);
            if !ok {
                return inner.answer(None);
            }
            let results = commit(
                &mut inner.store,
                vec![
                    put(LAYOUT.epoch(), record, 0),
                    Op::DeletePrefix(LAYOUT.holders()),
                    Op::DeletePrefix(LAYOUT.durable_waiters()),
                    Op::Delete(LAYOUT.seal()),
                    Op::DeletePrefix(LAYOUT.claims()),
                    // every leadership and candidacy ends, as on etcd
                    Op::DeletePrefix(LAYOUT.elections()),
                    Op::DeletePrefix(LAYOUT.all_quota_places()),
                    Op::DeletePrefix(LAYOUT.all_intents()),
                ],
            )?;
            let deleted = match results.get(1) {
                Some(OpResult::Deleted(prev)) => i64::try_from(prev.len()).unwrap_or(i64::MAX),
                _ => 0,
            };
            inner.answer(Some(deleted))
        })
        .await
    }

    async fn raise_map_fence(&self, version: u64) -> LogResult<bool> {
        // One call is one step of the store: the read and the
        // compare-and-put the etcd log makes cannot be raced here.
        self.call("raise map fence", |inner, _| {
            let key = LAYOUT.map_fence();
            if let Some(found) = inner.store.get(&key) {
                let current = decode_map_fence(&found.value).ok_or_else(|| {
                    StoreError::Malformed("the shard-map fence is not a 20-digit version".into())
                })?;
                if current >= version {
                    return inner.answer(false);
                }
            }
            commit(
                &mut inner.store,
                vec![put(key, encode_map_fence(version), 0)],
            )?;
            inner.answer(true)
        })
        .await
    }

    async fn map_fence(&self) -> LogResult<Option<Kv>> {
        self.call("map fence", |inner, _| {
            let kv = kv_of(&inner.store, &LAYOUT.map_fence());
            inner.answer(kv)
        })
        .await
    }
}

#[async_trait]
impl DurableQueueLog for MemLog {
    /// Not watched: the simulation's durable waiters poll.
    async fn watch_queue(
        &self,
        _key: &str,
        _from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError> {
        fallback::no_queue_watch()
    }

    async fn enqueue(
        &self,
        key: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        let waiter = LAYOUT.waiter(key, session);
        self.put_on_lease("enqueue", waiter, session, session_record, record)
            .await
    }

    async fn put_intent(
        &self,
        name: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        let intent = LAYOUT.intent(name, session);
        self.put_on_lease("put intent", intent, session, session_record, record)
            .await
    }

    async fn drop_intent(&self, name: &str, session: i64, modified: i64) -> LogResult<bool> {
        self.delete_at("drop intent", LAYOUT.intent(name, session), modified)
            .await
    }

    async fn watch_intents(
        &self,
        name: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError> {
        let intents = LAYOUT.intents_of(name);
        let rx = self.shared.changed.subscribe();
        let id = self
            .call("watch intents", |inner, _| {
                Ok(inner.store.open_watch(&intents, from_revision))
            })
            .await?;
        Ok(Box::new(watch::MemWatch::new(self.shared.clone(), id, rx)))
    }

    async fn queue_head(&self, key: &str) -> LogResult<Option<Kv>> {
        let queue = LAYOUT.queue_of(key);
        self.call("queue head", |inner, _| {
            let head = inner.store.oldest_under(&queue);
            inner.answer(head)
        })
        .await
    }

    async fn count_queued(&self, key: &str) -> LogResult<i64> {
        let queue = LAYOUT.queue_of(key);
        self.call("count queued", |inner, _| {
            let n = inner.store.count(&queue);
            inner.answer(n)
        })
        .await
    }

    async fn dequeue(&self, key: &str, session: i64, modified: i64) -> LogResult<bool> {
        self.delete_at("dequeue", LAYOUT.waiter(key, session), modified)
            .await
    }
}

/// Keys outside the lock protocol, as a client of the cluster reads and
/// writes them (the tier bindings' copies, `sim::simulation::tiers`):
/// each a call with the log's faults and delays.
impl MemLog {
    /// The value at `key`.
    pub async fn plain_get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.call("plain get", |inner, _| {
            Ok(inner.store.get(key).map(|kv| kv.kv().value))
        })
        .await
    }

    /// Puts `value` at `key` if nothing is there (no lease); the value
    /// there after, either way.
    pub async fn plain_create(&self, key: &str, value: Vec<u8>) -> Result<Vec<u8>, StoreError> {
        self.call("plain create", |inner, _| {
            if let Some(there) = inner.store.get(key) {
                return Ok(there.kv().value);
            }
            commit(
                &mut inner.store,
                vec![put(key.to_string(), value.clone(), 0)],
            )?;
            Ok(value)
        })
        .await
    }

    /// Every key under `prefix` and its value.
    pub async fn plain_under(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        self.call("plain range", |inner, _| {
            Ok(inner
                .store
                .range(prefix)
                .map(|(k, v)| (k.clone(), v.kv().value))
                .collect())
        })
        .await
    }
}

impl MemLog {
    /// Puts `record` at `key` on `session`'s lease if the session record is
    /// `session_record` (a put over an existing record keeps its create
    /// revision).
    async fn put_on_lease(
        &self,
        what: &'static str,
        key: String,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        let own = Compare::Value(LAYOUT.session(session), session_record.to_vec());
        self.call(what, |inner, _| {
            if !inner.store.all(&[own]) {
                return inner.answer(None);
            }
            commit(&mut inner.store, vec![put(key.clone(), record, session)])?;
            let queued = inner.store.get(&key).map(|kv| Queued {
                created: kv.create_revision,
                modified: kv.mod_revision,
            });
            let queued = queued.ok_or_else(|| StoreError::Malformed("a put not stored".into()))?;
            inner.answer(Some(queued))
        })
        .await
    }

    /// Deletes `key` if it was last written at `modified`; whether it did.
    async fn delete_at(&self, what: &'static str, key: String, modified: i64) -> LogResult<bool> {
        self.call(what, |inner, _| {
            let ok = inner
                .store
                .all(&[Compare::ModRevision(key.clone(), modified)]);
            if ok {
                commit(&mut inner.store, vec![Op::Delete(key)])?;
            }
            inner.answer(ok)
        })
        .await
    }
}

#[async_trait]
impl SessionLog for MemLog {
    /// On the session's lease, as etcd: a session gone answers
    /// [`StoreError::LeaseGone`].
    async fn mark_shadow(&self, session: i64, shard: &str) -> LogResult<()> {
        let mark = LAYOUT.shadow_mark(session, shard);
        self.call("mark shadow", |inner, _| {
            commit(
                &mut inner.store,
                vec![put(mark.clone(), Vec::new(), session)],
            )?;
            inner.answer(())
        })
        .await
    }

    async fn shadow_marks(&self, session: i64) -> LogResult<ShadowMarks> {
        let prefix = LAYOUT.shadow_marks(session);
        let record = LAYOUT.session(session);
        self.call("shadow marks", |inner, _| {
            let mut marks = ShadowMarks::default();
            for (key, stored) in inner.store.range(&prefix) {
                let Some(name) = key.strip_prefix(prefix.as_str()) else {
                    continue;
                };
                match name == keys::SHADOW_VOUCH {
                    true => marks.since = marks.since.max(stored.kv().mod_revision),
                    false => marks.shards.push(name.to_string()),
                }
            }
            if let Some(kv) = kv_of(&inner.store, &record) {
                marks.since = marks.since.max(kv.create_revision);
            }
            marks.epoch_at = kv_of(&inner.store, &LAYOUT.epoch()).map_or(0, |kv| kv.mod_revision);
            marks.sealed = kv_of(&inner.store, &LAYOUT.seal()).is_some();
            inner.answer(marks)
        })
        .await
    }

    /// On the session's lease, as etcd: a session gone answers
    /// [`StoreError::LeaseGone`] (when the compares hold).
    async fn vouch_shadows(&self, session: i64, epoch_at: i64) -> LogResult<bool> {
        let vouch = LAYOUT.shadow_vouch(session);
        self.call("vouch shadows", |inner, _| {
            let unchanged = match epoch_at {
                0 => Compare::CreateRevision(LAYOUT.epoch(), 0),
                at => Compare::ModRevision(LAYOUT.epoch(), at),
            };
            let unsealed = Compare::CreateRevision(LAYOUT.seal(), 0);
            let holds = inner.store.all(&[unchanged, unsealed]);
            if holds {
                commit(
                    &mut inner.store,
                    vec![put(vouch.clone(), Vec::new(), session)],
                )?;
            }
            inner.answer(holds)
        })
        .await
    }

    async fn grant_lease(&self, id: i64, ttl_seconds: u32) -> LogResult<()> {
        self.call("grant lease", |inner, now| {
            if id == 0 {
                return Err(StoreError::Malformed(
                    "lease id 0 asks the store to choose one; the log always names its own".into(),
                ));
            }
            if !inner.store.grant_lease(id, ttl_seconds, now) {
                return Err(StoreError::LeaseExists { lease: id });
            }
            inner.answer(())
        })
        .await
    }

    async fn put_session(&self, session: i64, identity: &str, record: Vec<u8>) -> LogResult<()> {
        let ops = vec![
            put(LAYOUT.session(session), record, session),
            put(
                LAYOUT.identity_session(identity, session),
                Vec::new(),
                session,
            ),
        ];
        self.call("put session", |inner, _| {
            commit(&mut inner.store, ops)?;
            inner.answer(())
        })
        .await
    }

    async fn session(&self, session: i64) -> LogResult<Option<Kv>> {
        let key = LAYOUT.session(session);
        self.call("session", |inner, _| {
            let kv = kv_of(&inner.store, &key);
            inner.answer(kv)
        })
        .await
    }

    async fn count_sessions_of(&self, identity: &str) -> LogResult<u32> {
        let prefix = LAYOUT.identity_sessions(identity);
        self.call("count sessions", |inner, _| {
            let n = u32::try_from(inner.store.count(&prefix)).unwrap_or(u32::MAX);
            inner.answer(n)
        })
        .await
    }

    async fn delete_session(
        &self,
        session: i64,
        identity: &str,
        record: Vec<u8>,
    ) -> LogResult<bool> {
        let key = LAYOUT.session(session);
        let entry = LAYOUT.identity_session(identity, session);
        self.call("delete session", |inner, _| {
            let ok = inner.store.all(&[
                Compare::Value(key.clone(), record),
                Compare::Lease(key.clone(), session),
            ]);
            if ok {
                commit(&mut inner.store, vec![Op::Delete(key), Op::Delete(entry)])?;
            }
            inner.answer(ok)
        })
        .await
    }

    async fn revoke(&self, lease: i64) -> Result<(), StoreError> {
        self.call("revoke", |inner, _| {
            // a lease that is gone already is not an error
            inner.store.revoke(lease);
            Ok(())
        })
        .await
    }

    async fn revoke_session(
        &self,
        txn: RevokeSessionTxn<'_>,
    ) -> Result<SessionRevoked, StoreError> {
        let session = txn.session;
        let key = LAYOUT.session(session);
        let entry = LAYOUT.identity_session(txn.counted_as, session);
        let marker = txn.marker.to_vec();
        let ttl = txn.marker_ttl_seconds;
        let marked = self
            .call("revoke session: end its record", |inner, now| {
                if !inner.store.all(&[Compare::Lease(key.clone(), session)]) {
                    return Ok(false);
                }
                // the marker's own lease: ids far from the sessions'
                let mut lease = 0x4000_0000_0000_0000 ^ session;
                while !inner.store.grant_lease(lease, ttl, now) {
                    lease += 1;
                }
                commit(
                    &mut inner.store,
                    vec![
                        Op::Delete(key),
                        Op::Delete(entry),
                        put(LAYOUT.revoked_session(session), marker, lease),
                    ],
                )?;
                Ok(true)
            })
            .await?;
        let had_lease = self
            .call("revoke session: its lease", |inner, _| {
                Ok(inner.store.revoke(session))
            })
            .await?;
        // as etcd answers: a lease the revoke did not find had ended
        Ok(match (marked, had_lease) {
            (_, false) => SessionRevoked::Ended,
            (true, true) => SessionRevoked::Revoked,
            (false, true) => SessionRevoked::RecordGone,
        })
    }

    async fn renew(&self, lease: i64) -> Result<Renewal, StoreError> {
        let sent = Instant::now();
        let ttl_seconds = self
            .call("renew", |inner, now| Ok(inner.store.renew(lease, now)))
            .await?;
        Ok(Renewal {
            ttl_seconds,
            sent: sent.into_std(),
            sent_to_store: true,
        })
    }
}

fn put(key: String, value: Vec<u8>, lease: i64) -> Op {
    Op::Put { key, value, lease }
}

fn commit(store: &mut Store, ops: Vec<Op>) -> Result<Vec<OpResult>, StoreError> {
    store.commit(ops).map_err(lease_gone)
}
