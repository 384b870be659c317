//! [`IdLog`]: the simulation's [`LockLog`] layer that gives sessions
//! deterministic lease ids.
//!
//! The arbiter draws each session id from the OS's CSPRNG
//! (`latchkey_arbiter::table::sessions::random_lease_id`, on purpose: one
//! session id must say nothing about another). The ids reach the store, and
//! the store orders same-instant lease expiries by id (as etcd's lessor
//! does by deadline, then id): under paused time many sessions share a
//! deadline, so random ids would reorder expiry revisions and with them the
//! tokens, and a seed would no longer replay byte for byte.
//!
//! So the simulation stands between the arbiters and the [`MemLog`]: the
//! first time a lease id is granted it is given the next id of a counter,
//! and every call translates the arbiter's id to the store's and every
//! answer the store's back. The arbiters see only their own ids; the store
//! sees only the counter's. Ids the layer never granted pass unchanged
//! (the counter's ids start at 2^56, above every id the arbiter draws).

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use async_trait::async_trait;
use latchkey_arbiter::high_water::Mark;
use latchkey_arbiter::lock_log::{
    BatchOp, BatchOutcome, Claimed, Counted, DowngradeTxn, DurableQueueLog, ElectionLog,
    ElectionRead, EpochLog, FollowEvent, FollowLog, FollowSignal, ForceEndTxn, ForceEnded,
    ForceTermTxn, GrantTxn, Granted, HandOverFrom, HandOverTxn, HeldAt, HoldLog, KeyWatch, Kv,
    LeadFrom, LeadTo, LeadTxn, LogResult, PrefixWatch, ProclaimTxn, Queued, Records, ReleaseTxn,
    ReleasedIf, Renewal, RevokeSessionTxn, SessionLog, SessionRevoked, ShadowMarks, StoreError,
    fallback,
};

use latchkey_arbiter::witness::{Witness, Witnessed};

use super::ordered::Dispatch;
use crate::memlog::MemLog;
use crate::witness::MemWitness;

/// The first id the layer hands the store: above the arbiter's 53-bit ids.
const FIRST_ID: i64 = 1 << 56;

#[derive(Default)]
struct Ids {
    /// arbiter's id -> store's id
    to_store: BTreeMap<i64, i64>,
    /// store's id -> arbiter's id
    to_arbiter: BTreeMap<i64, i64>,
    next: i64,
}

/// A [`MemLog`] whose lease ids are drawn in call order (see the module
/// docs).
pub(crate) struct IdLog {
    log: MemLog,
    ids: Arc<Mutex<Ids>>,
    /// Every call, when tracing (`LATCHKEY_SIM_TRACE`): simulated time,
    /// the store's revision as the call starts, the call.
    trace: Option<Mutex<Vec<String>>>,
    start: tokio::time::Instant,
    watches: Arc<Dispatch>,
    /// [`FaultKnobs::shadow_marks_trusted`](super::FaultKnobs::shadow_marks_trusted):
    /// the marks' read never shows an epoch advance.
    marks_trusted: bool,
}

impl IdLog {
    pub(crate) fn new(log: MemLog, watches: Arc<Dispatch>, trace: bool) -> Self {
        Self {
            log,
            ids: Arc::new(Mutex::new(Ids {
                next: FIRST_ID,
                ..Ids::default()
            })),
            trace: trace.then(|| Mutex::new(Vec::new())),
            start: tokio::time::Instant::now(),
            watches,
            marks_trusted: false,
        }
    }

    /// The bug [`FaultKnobs::shadow_marks_trusted`] puts in: every read of
    /// a session's shadow marks says they are complete.
    ///
    /// [`FaultKnobs::shadow_marks_trusted`]: super::FaultKnobs::shadow_marks_trusted
    pub(crate) fn with_marks_trusted(mut self, trusted: bool) -> Self {
        self.marks_trusted = trusted;
        self
    }

    /// Another cluster's log (a shard) with the same ids as `other`: a
    /// session's shadow there has the session's id, in the store and in
    /// the history alike.
    pub(crate) fn sharing(log: MemLog, other: &IdLog) -> Self {
        Self {
            log,
            ids: other.ids.clone(),
            trace: other.trace.as_ref().map(|_| Mutex::new(Vec::new())),
            start: other.start,
            watches: other.watches.clone(),
            marks_trusted: false,
        }
    }

    fn ids(&self) -> parking_lot::MutexGuard<'_, Ids> {
        self.ids.lock()
    }

    /// The store's id for a lease the arbiter names `id`, drawing one the
    /// first time a lease is granted.
    fn grant_id(&self, id: i64) -> i64 {
        let mut ids = self.ids();
        if let Some(&mapped) = ids.to_store.get(&id) {
            return mapped;
        }
        let mapped = ids.next;
        ids.next += 1;
        ids.to_store.insert(id, mapped);
        ids.to_arbiter.insert(mapped, id);
        mapped
    }

    /// Notes a call in the trace (a closure: nothing is formatted when not
    /// tracing).
    fn t(&self, what: impl FnOnce() -> String) {
        if let Some(trace) = &self.trace {
            let at = tokio::time::Instant::now() - self.start;
            let line = format!("{at:?} r{} {}", self.log.revision(), what());
            trace.lock().push(line);
        }
    }

    /// The trace so far (empty when not tracing).
    pub(crate) fn take_trace(&self) -> Vec<String> {
        self.trace
            .as_ref()
            .map_or_else(Vec::new, |t| std::mem::take(&mut *t.lock()))
    }

    fn store_id(&self, id: i64) -> i64 {
        self.ids().to_store.get(&id).copied().unwrap_or(id)
    }

    /// `key` as the store (and the history) names it: a shared hold's key
    /// spells its session, so it is given the store's (counted) id, as the
    /// lease is; a seed then replays byte for byte (the store orders keys,
    /// and random ids in them reordered its answers).
    pub(crate) fn history_key(&self, key: &str) -> String {
        self.key_in(key)
    }

    /// `text` (an error's detail for the history) with every shared hold's
    /// key in it spelled as [`IdLog::history_key`] spells it: an error that
    /// names a reader key names the arbiter's random session id.
    pub(crate) fn history_text(&self, text: &str) -> String {
        const MARK: &str = latchkey_records::READERS;
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find(MARK) {
            let (before, after) = rest.split_at(at + MARK.len());
            out.push_str(before);
            let spelled = after
                .get(..16)
                .filter(|d| {
                    d.bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                })
                .and_then(|d| u64::from_str_radix(d, 16).ok());
            match spelled {
                Some(session) => {
                    let stored = self.store_id(session as i64);
                    out.push_str(&format!("{:016x}", stored as u64));
                    rest = after.get(16..).unwrap_or("");
                }
                None => rest = after,
            }
        }
        out.push_str(rest);
        out
    }

    fn key_in(&self, key: &str) -> String {
        match latchkey_records::split_reader(key) {
            Some((name, session)) => latchkey_records::reader_key(name, self.store_id(session)),
            None => key.to_string(),
        }
    }

    /// The session (the arbiters' id) holding `key` in the store now, read
    /// past every fault.
    pub(crate) fn holder_now(&self, key: &str) -> Option<i64> {
        self.log
            .holder_now(&self.key_in(key))
            .map(|kv| self.arbiter_id(kv.lease))
    }

    /// Whether the lease of session `id` (the arbiters' id) is in the store
    /// now, read past every fault.
    pub(crate) fn lease_alive(&self, id: i64) -> bool {
        self.log.lease_remaining(self.store_id(id)).is_some()
    }

    fn arbiter_id(&self, id: i64) -> i64 {
        self.ids().to_arbiter.get(&id).copied().unwrap_or(id)
    }

    fn kv_back(&self, kv: Kv) -> Kv {
        kv_back(&self.ids, kv)
    }

    fn error_back(&self, e: StoreError) -> StoreError {
        match e {
            StoreError::LeaseGone { lease } => StoreError::LeaseGone {
                lease: self.arbiter_id(lease),
            },
            StoreError::LeaseExists { lease } => StoreError::LeaseExists {
                lease: self.arbiter_id(lease),
            },
            other => other,
        }
    }

    fn granted_back(&self, granted: Granted) -> Granted {
        match granted {
            Granted::No {
                holder,
                epoch,
                sealed,
                session,
                queue_head,
                fence_at,
                other_kind,
                other_mode,
                intent,
            } => Granted::No {
                holder: holder.map(|kv| self.kv_back(kv)),
                epoch,
                sealed,
                session,
                queue_head: queue_head.map(|kv| self.kv_back(kv)),
                fence_at,
                other_kind,
                other_mode: other_mode.map(|kv| self.kv_back(kv)),
                intent: intent.map(|kv| self.kv_back(kv)),
            },
            yes => yes,
        }
    }

    fn released_back(&self, released: ReleasedIf) -> ReleasedIf {
        match released {
            ReleasedIf::No { holder } => ReleasedIf::No {
                holder: holder.map(|kv| self.kv_back(kv)),
            },
            yes => yes,
        }
    }

    /// The store's view of a release: its lease id (the record bytes, and so
    /// the owner prefix, hold the arbiter's ids, as the holder records do).
    fn release_txn(&self, txn: &ReleaseTxn) -> ReleaseTxn {
        ReleaseTxn {
            key: self.key_in(&txn.key),
            session: self.store_id(txn.session),
            ..txn.clone()
        }
    }

    fn held(&self, held: &HeldAt) -> HeldAt {
        HeldAt {
            key: self.key_in(&held.key),
            session: self.store_id(held.session),
            ..held.clone()
        }
    }
}

#[async_trait]
impl FollowLog for IdLog {
    async fn follow(
        &self,
        counted: Counted,
        prev_kv: bool,
        each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
    ) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError> {
        self.t(|| format!("follow {counted:?}"));
        let mut read = Vec::new();
        let (revision, watch) = self
            .log
            .follow(counted, prev_kv, &mut |key, kv| {
                read.push((key.to_string(), kv.clone()));
            })
            .await
            .map_err(|e| self.error_back(e))?;
        for (key, kv) in read {
            each(&reader_key_back(&self.ids, &key), &self.kv_back(kv));
        }
        let ids = self.ids.clone();
        // Woken in a fixed order as every other watch (`ordered`): the
        // hold and session counts of every arbiter follow the log, and a
        // change (or a broken watch) woke their tasks in tokio's random
        // order, so they read the log again in a different order each run.
        let watch = watch.map(|watch| {
            self.watches.wrap_prefix(Box::new(IdPrefixWatch {
                ids,
                watch,
                keys: WatchedKeys::AsStored,
            }))
        });
        Ok((revision, watch))
    }
}

/// `kv` with its lease as the arbiter names it.
fn kv_back(ids: &Mutex<Ids>, mut kv: Kv) -> Kv {
    if kv.lease != 0 {
        kv.lease = ids
            .lock()
            .to_arbiter
            .get(&kv.lease)
            .copied()
            .unwrap_or(kv.lease);
    }
    kv
}

/// A shared hold's key with its session as the arbiter names it; any
/// other key as it is.
fn reader_key_back(ids: &Mutex<Ids>, key: &str) -> String {
    match latchkey_records::split_reader(key) {
        Some((name, stored)) => match ids.lock().to_arbiter.get(&stored) {
            Some(arbiter) => latchkey_records::reader_key(name, *arbiter),
            None => key.to_string(),
        },
        None => key.to_string(),
    }
}

/// A candidate record's key below an election's candidates prefix
/// ([`latchkey_records::candidate_entry`]), or below the election's prefix
/// ([`latchkey_records::election_candidate`]), with the lease as the
/// arbiter names it; any other key as it is.
fn candidate_key_back(ids: &Mutex<Ids>, key: &str) -> String {
    use latchkey_records::{CANDIDATES, candidate_entry, split_candidate_entry};
    let (head, entry) = match key.strip_prefix(CANDIDATES) {
        Some(entry) => (CANDIDATES, entry),
        None => ("", key),
    };
    let Some((priority, stored)) = split_candidate_entry(entry) else {
        return key.to_string();
    };
    match ids.lock().to_arbiter.get(&stored) {
        Some(arbiter) => format!("{head}{}", candidate_entry(priority, *arbiter)),
        None => key.to_string(),
    }
}

/// Which watched keys name a session (and are given the arbiter's id).
#[derive(Clone, Copy)]
enum WatchedKeys {
    /// Keys as the store has them (the followers' watches).
    AsStored,
    /// An election's: its candidate records' keys name their sessions.
    Election,
}

/// A prefix watch whose leases (and, for an election, candidate keys)
/// read as the arbiter's ids.
struct IdPrefixWatch {
    ids: Arc<Mutex<Ids>>,
    watch: Box<dyn PrefixWatch>,
    keys: WatchedKeys,
}

#[async_trait]
impl PrefixWatch for IdPrefixWatch {
    async fn next(&mut self) -> FollowSignal {
        match self.watch.next().await {
            FollowSignal::Events { events, through } => FollowSignal::Events {
                events: events
                    .into_iter()
                    .map(|e| FollowEvent {
                        key: match self.keys {
                            WatchedKeys::AsStored => reader_key_back(&self.ids, &e.key),
                            WatchedKeys::Election => candidate_key_back(&self.ids, &e.key),
                        },
                        put: e.put.map(|kv| kv_back(&self.ids, kv)),
                        prev: e.prev.map(|kv| kv_back(&self.ids, kv)),
                    })
                    .collect(),
                through,
            },
            FollowSignal::Lost => FollowSignal::Lost,
        }
    }
}

#[async_trait]
impl HoldLog for IdLog {
    async fn holders_of(&self, keys: &[String]) -> LogResult<Vec<Option<Kv>>> {
        // one by one through this log, so every hold's lease is mapped back
        fallback::holders_of(self, keys).await
    }

    async fn held_keys_page(&self, after: Option<&str>, limit: usize) -> LogResult<Vec<String>> {
        fallback::held_keys_page(self, after, limit).await
    }

    async fn grant(&self, txn: GrantTxn<'_>) -> LogResult<Granted> {
        self.t(|| {
            format!(
                "grant {} {}",
                self.key_in(txn.key),
                self.store_id(txn.session)
            )
        });
        let key = self.key_in(txn.key);
        let txn = GrantTxn {
            key: &key,
            session: self.store_id(txn.session),
            ..txn
        };
        let answer = self.log.grant(txn).await.map_err(|e| self.error_back(e))?;
        Ok(answer.map(|granted| self.granted_back(granted)))
    }

    async fn hand_over(&self, txn: HandOverTxn<'_>) -> LogResult<Option<Option<Vec<u8>>>> {
        self.t(|| "hand_over".into());
        let (held, owned);
        let from = match txn.from {
            HandOverFrom::Exact(h) => {
                held = self.held(h);
                HandOverFrom::Exact(&held)
            }
            HandOverFrom::Owned(o) => {
                owned = self.release_txn(o);
                HandOverFrom::Owned(&owned)
            }
        };
        let txn = HandOverTxn {
            from,
            next_session: self.store_id(txn.next_session),
            ..txn
        };
        self.log
            .hand_over(txn)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn downgrade(&self, txn: DowngradeTxn<'_>) -> LogResult<bool> {
        self.t(|| format!("downgrade {}", self.key_in(&txn.held.key)));
        let held = self.held(txn.held);
        let reader = self.key_in(txn.reader_key);
        let txn = DowngradeTxn {
            held: &held,
            reader_key: &reader,
            ..txn
        };
        self.log
            .downgrade(txn)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn release(&self, held: &HeldAt) -> LogResult<Option<Vec<u8>>> {
        self.t(|| "release".into());
        let held = self.held(held);
        self.log
            .release(&held)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn release_if_owned(&self, txn: &ReleaseTxn) -> LogResult<ReleasedIf> {
        self.t(|| format!("release_if_owned {}", self.key_in(&txn.key)));
        let txn = self.release_txn(txn);
        let answer = self
            .log
            .release_if_owned(&txn)
            .await
            .map_err(|e| self.error_back(e))?;
        Ok(answer.map(|released| self.released_back(released)))
    }

    fn batch_limit(&self) -> usize {
        self.log.batch_limit()
    }

    async fn batch(&self, ops: Vec<BatchOp<'_>>) -> LogResult<Vec<BatchOutcome>> {
        self.t(|| {
            let keys: Vec<String> = ops.iter().map(|op| self.key_in(op.key())).collect();
            format!("batch {}", keys.join(" "))
        });
        let grant_keys: Vec<String> = ops
            .iter()
            .map(|op| match op {
                BatchOp::Grant(txn) => self.key_in(txn.key),
                BatchOp::Release(_) => String::new(),
            })
            .collect();
        let releases: Vec<Option<ReleaseTxn>> = ops
            .iter()
            .map(|op| match op {
                BatchOp::Release(txn) => Some(self.release_txn(txn)),
                BatchOp::Grant(_) => None,
            })
            .collect();
        let ops = ops
            .into_iter()
            .zip(&releases)
            .zip(&grant_keys)
            .map(|((op, release), key)| match (op, release) {
                (BatchOp::Grant(txn), _) => BatchOp::Grant(GrantTxn {
                    key,
                    session: self.store_id(txn.session),
                    ..txn
                }),
                (BatchOp::Release(txn), None) => BatchOp::Release(txn),
                (BatchOp::Release(_), Some(mapped)) => BatchOp::Release(mapped),
            })
            .collect();
        let answer = self.log.batch(ops).await.map_err(|e| self.error_back(e))?;
        Ok(answer.map(|outcomes| {
            outcomes
                .into_iter()
                .map(|outcome| match outcome {
                    BatchOutcome::Grant(granted) => BatchOutcome::Grant(self.granted_back(granted)),
                    BatchOutcome::Release(released) => {
                        BatchOutcome::Release(self.released_back(released))
                    }
                })
                .collect()
        }))
    }

    async fn claim(&self, key: &str, session: i64, revision: i64) -> LogResult<Claimed> {
        self.t(|| format!("claim {}", self.key_in(key)));
        self.log
            .claim(&self.key_in(key), self.store_id(session), revision)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn release_orphan(&self, key: &str, session: i64, revision: i64) -> LogResult<bool> {
        self.t(|| "release_orphan".into());
        self.log
            .release_orphan(&self.key_in(key), self.store_id(session), revision)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn force_end(&self, txn: ForceEndTxn<'_>) -> LogResult<ForceEnded> {
        self.t(|| format!("force_end {}", self.key_in(txn.key)));
        let key = self.key_in(txn.key);
        let txn = ForceEndTxn {
            key: &key,
            lease: self.store_id(txn.lease),
            ..txn
        };
        let answer = self
            .log
            .force_end(txn)
            .await
            .map_err(|e| self.error_back(e))?;
        Ok(answer.map(|ended| match ended {
            ForceEnded::HoldChanged { now } => ForceEnded::HoldChanged {
                now: now.map(|kv| self.kv_back(kv)),
            },
            other => other,
        }))
    }

    async fn quota_places(&self, class: &str, subject: &str) -> LogResult<Vec<(u32, Kv)>> {
        self.t(|| format!("quota places {class}"));
        let answer = self.log.quota_places(class, subject).await?;
        Ok(answer.map(|places| {
            places
                .into_iter()
                .map(|(index, kv)| (index, self.kv_back(kv)))
                .collect()
        }))
    }

    async fn free_quota_place(
        &self,
        class: &str,
        subject: &str,
        index: u32,
        revision: i64,
    ) -> LogResult<bool> {
        self.t(|| format!("free quota place {class} {index}"));
        self.log
            .free_quota_place(class, subject, index, revision)
            .await
    }

    async fn holder(&self, key: &str) -> LogResult<Option<Kv>> {
        self.t(|| format!("holder {}", self.key_in(key)));
        let answer = self.log.holder(&self.key_in(key)).await?;
        Ok(answer.map(|kv| kv.map(|kv| self.kv_back(kv))))
    }

    async fn holders_under(&self, prefix: &str) -> LogResult<Vec<(String, Kv)>> {
        self.t(|| "holders_under".into());
        let answer = self.log.holders_under(prefix).await?;
        Ok(answer.map(|holds| {
            holds
                .into_iter()
                .map(|(key, kv)| (reader_key_back(&self.ids, &key), self.kv_back(kv)))
                .collect()
        }))
    }

    async fn count_holds(&self) -> LogResult<i64> {
        self.t(|| "count_holds".into());
        self.log.count_holds().await
    }

    async fn watch(&self, key: &str, from_revision: i64) -> Result<Box<dyn KeyWatch>, StoreError> {
        self.t(|| format!("watch {} {from_revision}", self.key_in(key)));
        let watch = self.log.watch(key, from_revision).await?;
        Ok(self.watches.wrap(watch))
    }
}

#[async_trait]
impl EpochLog for IdLog {
    async fn records(&self) -> LogResult<Records> {
        self.t(|| "records".into());
        self.log.records().await
    }

    async fn create_epoch(&self, record: Vec<u8>) -> LogResult<bool> {
        self.t(|| "create_epoch".into());
        self.log.create_epoch(record).await
    }

    async fn put_seal(
        &self,
        record: Vec<u8>,
        seal_at: Option<i64>,
        epoch_at: Option<i64>,
    ) -> LogResult<bool> {
        self.t(|| "put_seal".into());
        self.log.put_seal(record, seal_at, epoch_at).await
    }

    async fn put_coord_seen(&self, record: Vec<u8>, at: Option<i64>) -> LogResult<bool> {
        self.t(|| "put_coord_seen".into());
        self.log.put_coord_seen(record, at).await
    }

    async fn advance(
        &self,
        expected: Vec<u8>,
        seal_at: Option<i64>,
        record: Vec<u8>,
    ) -> LogResult<Option<i64>> {
        self.t(|| "advance".into());
        self.log.advance(expected, seal_at, record).await
    }

    async fn raise_map_fence(&self, version: u64) -> LogResult<bool> {
        self.t(|| format!("raise_map_fence {version}"));
        self.log.raise_map_fence(version).await
    }

    async fn map_fence(&self) -> LogResult<Option<Kv>> {
        self.t(|| "map_fence".into());
        self.log.map_fence().await
    }
}

#[async_trait]
impl DurableQueueLog for IdLog {
    async fn watch_queue(
        &self,
        key: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError> {
        self.t(|| format!("watch_queue {key}"));
        self.log.watch_queue(key, from_revision).await
    }

    async fn enqueue(
        &self,
        key: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        self.t(|| format!("enqueue {key} {}", self.store_id(session)));
        self.log
            .enqueue(key, self.store_id(session), session_record, record)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn queue_head(&self, key: &str) -> LogResult<Option<Kv>> {
        self.t(|| format!("queue_head {key}"));
        let answer = self.log.queue_head(key).await?;
        Ok(answer.map(|head| head.map(|kv| self.kv_back(kv))))
    }

    async fn count_queued(&self, key: &str) -> LogResult<i64> {
        self.t(|| format!("count_queued {key}"));
        self.log.count_queued(key).await
    }

    async fn dequeue(&self, key: &str, session: i64, modified: i64) -> LogResult<bool> {
        self.t(|| format!("dequeue {key} {}", self.store_id(session)));
        self.log
            .dequeue(key, self.store_id(session), modified)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn put_intent(
        &self,
        name: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        self.t(|| format!("put_intent {name} {}", self.store_id(session)));
        self.log
            .put_intent(name, self.store_id(session), session_record, record)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn drop_intent(&self, name: &str, session: i64, modified: i64) -> LogResult<bool> {
        self.t(|| format!("drop_intent {name} {}", self.store_id(session)));
        self.log
            .drop_intent(name, self.store_id(session), modified)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn watch_intents(
        &self,
        name: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError> {
        self.t(|| format!("watch_intents {name}"));
        self.log.watch_intents(name, from_revision).await
    }
}

#[async_trait]
impl SessionLog for IdLog {
    async fn revoke_session(
        &self,
        txn: RevokeSessionTxn<'_>,
    ) -> Result<SessionRevoked, StoreError> {
        self.t(|| format!("revoke_session {}", self.store_id(txn.session)));
        let txn = RevokeSessionTxn {
            session: self.store_id(txn.session),
            ..txn
        };
        self.log
            .revoke_session(txn)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn mark_shadow(&self, session: i64, shard: &str) -> LogResult<()> {
        self.t(|| format!("mark_shadow {} {shard}", self.store_id(session)));
        self.log
            .mark_shadow(self.store_id(session), shard)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn shadow_marks(&self, session: i64) -> LogResult<ShadowMarks> {
        self.t(|| format!("shadow_marks {}", self.store_id(session)));
        let mut answer = self
            .log
            .shadow_marks(self.store_id(session))
            .await
            .map_err(|e| self.error_back(e))?;
        if self.marks_trusted {
            answer.value.epoch_at = 0;
            answer.value.sealed = false;
        }
        Ok(answer)
    }

    async fn vouch_shadows(&self, session: i64, epoch_at: i64) -> LogResult<bool> {
        self.t(|| format!("vouch_shadows {} at {epoch_at}", self.store_id(session)));
        self.log
            .vouch_shadows(self.store_id(session), epoch_at)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn grant_lease(&self, id: i64, ttl_seconds: u32) -> LogResult<()> {
        let mapped = self.grant_id(id);
        self.t(|| format!("grant_lease {mapped}"));
        self.log
            .grant_lease(mapped, ttl_seconds)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn put_session(&self, session: i64, identity: &str, record: Vec<u8>) -> LogResult<()> {
        self.t(|| "put_session".into());
        self.log
            .put_session(self.store_id(session), identity, record)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn session(&self, session: i64) -> LogResult<Option<Kv>> {
        self.t(|| "session".into());
        let answer = self.log.session(self.store_id(session)).await?;
        Ok(answer.map(|kv| kv.map(|kv| self.kv_back(kv))))
    }

    async fn count_sessions_of(&self, identity: &str) -> LogResult<u32> {
        self.t(|| "count_sessions_of".into());
        self.log.count_sessions_of(identity).await
    }

    async fn delete_session(
        &self,
        session: i64,
        identity: &str,
        record: Vec<u8>,
    ) -> LogResult<bool> {
        self.t(|| "delete_session".into());
        self.log
            .delete_session(self.store_id(session), identity, record)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn revoke(&self, lease: i64) -> Result<(), StoreError> {
        self.t(|| format!("revoke {}", self.store_id(lease)));
        self.log
            .revoke(self.store_id(lease))
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn renew(&self, lease: i64) -> Result<Renewal, StoreError> {
        self.t(|| format!("renew {}", self.store_id(lease)));
        let answer = self
            .log
            .renew(self.store_id(lease))
            .await
            .map_err(|e| self.error_back(e));
        if let Ok(r) = &answer {
            self.t(|| format!("renewed {}: ttl {}", self.store_id(lease), r.ttl_seconds));
        }
        answer
    }
}

/// The witness as the tables see it: a [`MemWitness`] whose calls go into
/// the same trace as the log's (`LATCHKEY_SIM_TRACE`), with their answers.
pub(crate) struct TracedWitness {
    witness: MemWitness,
    log: Arc<IdLog>,
}

impl TracedWitness {
    pub(crate) fn new(witness: MemWitness, log: Arc<IdLog>) -> Self {
        Self { witness, log }
    }
}

fn mark(m: Option<Mark>) -> String {
    m.map_or_else(
        || "none".into(),
        |m| format!("e{}:r{} (cluster {})", m.epoch, m.revision, m.cluster_id),
    )
}

#[async_trait]
impl Witness for TracedWitness {
    async fn read(&self) -> Result<Witnessed, StoreError> {
        let out = self.witness.read().await;
        self.log.t(|| match &out {
            Ok(w) => format!("witness read: mark {}, epoch {}", mark(w.mark), w.epoch),
            Err(e) => format!("witness read: {e}"),
        });
        out
    }

    async fn raise(&self, to: Mark) -> Result<(), StoreError> {
        let out = self.witness.raise(to).await;
        self.log.t(|| match &out {
            Ok(()) => format!("witness raise {}", mark(Some(to))),
            Err(e) => format!("witness raise {}: {e}", mark(Some(to))),
        });
        out
    }

    async fn allocate_epoch(&self, at_least: u32) -> Result<u32, StoreError> {
        let out = self.witness.allocate_epoch(at_least).await;
        self.log.t(|| match &out {
            Ok(e) => format!("witness allocate_epoch {at_least}: {e}"),
            Err(e) => format!("witness allocate_epoch {at_least}: {e}"),
        });
        out
    }

    async fn note_epoch(&self, epoch: u32) -> Result<(), StoreError> {
        let out = self.witness.note_epoch(epoch).await;
        self.log.t(|| match &out {
            Ok(()) => format!("witness note_epoch {epoch}"),
            Err(e) => format!("witness note_epoch {epoch}: {e}"),
        });
        out
    }

    fn describe(&self) -> String {
        self.witness.describe()
    }
}

/// Sessions in the store's ids on the way in; leases and candidate keys in
/// the arbiter's on the way back. The records themselves (leader,
/// candidate, session) are the arbiter's bytes and pass as they are.
/// Candidates come back in the store's key order (rank, then the store's
/// id, that is grant order): ordered by the arbiter's random ids instead,
/// a read's first `limit` would differ from run to run.
#[async_trait]
impl ElectionLog for IdLog {
    async fn election(&self, election: &str, limit: usize) -> LogResult<ElectionRead> {
        self.t(|| format!("election {election} {limit}"));
        let answer = self.log.election(election, limit).await?;
        Ok(answer.map(|read| ElectionRead {
            lead: read.lead.map(|kv| self.kv_back(kv)),
            term: read.term.map(|kv| self.kv_back(kv)),
            candidates: read
                .candidates
                .into_iter()
                .map(|(key, kv)| (candidate_key_back(&self.ids, &key), self.kv_back(kv)))
                .collect(),
        }))
    }

    async fn stand(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        self.t(|| format!("stand {election} {} {priority}", self.store_id(session)));
        self.log
            .stand(
                election,
                self.store_id(session),
                priority,
                session_record,
                record,
            )
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn withdraw(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        modified: i64,
    ) -> LogResult<bool> {
        self.t(|| format!("withdraw {election} {} {priority}", self.store_id(session)));
        self.log
            .withdraw(election, self.store_id(session), priority, modified)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn lead(&self, txn: LeadTxn<'_>) -> LogResult<bool> {
        let from = match txn.from {
            LeadFrom::Vacant => LeadFrom::Vacant,
            LeadFrom::Leader { session, subject } => LeadFrom::Leader {
                session: self.store_id(session),
                subject,
            },
        };
        let to = txn.to.map(|to| LeadTo {
            session: self.store_id(to.session),
            ..to
        });
        self.t(|| {
            let to = to.as_ref().map(|to| to.session);
            format!("lead {} {from:?} -> {to:?}", txn.election)
        });
        let txn = LeadTxn { from, to, ..txn };
        self.log.lead(txn).await.map_err(|e| self.error_back(e))
    }

    async fn proclaim(&self, txn: ProclaimTxn<'_>) -> LogResult<bool> {
        let txn = ProclaimTxn {
            session: self.store_id(txn.session),
            ..txn
        };
        self.t(|| format!("proclaim {} {}", txn.election, txn.session));
        self.log.proclaim(txn).await.map_err(|e| self.error_back(e))
    }

    async fn force_end_term(&self, txn: ForceTermTxn<'_>) -> LogResult<ForceEnded> {
        self.t(|| format!("force_end_term {}", txn.election));
        let txn = ForceTermTxn {
            session: self.store_id(txn.session),
            ..txn
        };
        let answer = self
            .log
            .force_end_term(txn)
            .await
            .map_err(|e| self.error_back(e))?;
        Ok(answer.map(|ended| match ended {
            ForceEnded::HoldChanged { now } => ForceEnded::HoldChanged {
                now: now.map(|kv| self.kv_back(kv)),
            },
            other => other,
        }))
    }
    async fn count_leaderships(&self, subject: &str) -> LogResult<i64> {
        self.log
            .count_leaderships(subject)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn count_elections(&self, subject: &str) -> LogResult<i64> {
        self.log
            .count_elections(subject)
            .await
            .map_err(|e| self.error_back(e))
    }

    async fn watch_election(
        &self,
        election: &str,
        from_revision: i64,
    ) -> Result<Box<dyn PrefixWatch>, StoreError> {
        self.t(|| format!("watch_election {election} {from_revision}"));
        let watch = self
            .log
            .watch_election(election, from_revision)
            .await
            .map_err(|e| self.error_back(e))?;
        let watch = Box::new(IdPrefixWatch {
            ids: self.ids.clone(),
            watch,
            keys: WatchedKeys::Election,
        });
        Ok(self.watches.wrap_prefix(watch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidate_keys_name_the_arbiters_sessions() {
        let ids = Mutex::new(Ids::default());
        ids.lock().to_arbiter.insert(FIRST_ID, 0xab);
        let stored = format!("fffffffe/{FIRST_ID:016x}");
        assert_eq!(
            candidate_key_back(&ids, &stored),
            "fffffffe/00000000000000ab"
        );
        assert_eq!(
            candidate_key_back(&ids, &format!("c/{stored}")),
            "c/fffffffe/00000000000000ab"
        );
        // not a candidate's key, or a lease the layer never granted
        for key in ["lead", "term", "c/fffffffe/0000000000000007", "c/x/yy"] {
            assert_eq!(candidate_key_back(&ids, key), key);
        }
    }

    /// The arbiter names its sessions; the store sees the layer's ids;
    /// every answer (candidate keys, leases, watch events, a lease gone)
    /// comes back in the arbiter's.
    #[tokio::test(start_paused = true)]
    async fn elections_go_through_in_the_arbiters_ids() {
        let dispatch = Arc::new(Dispatch::default());
        tokio::spawn(dispatch.clone().run());
        let log = IdLog::new(MemLog::new(7), dispatch, false);
        let own = b"session".as_slice();
        log.create_epoch(b"epoch".to_vec()).await.unwrap();
        // a's id is the higher, but a's lease is granted first
        let (a, b) = (0x1234_5678, 0x42);
        for id in [a, b] {
            log.grant_lease(id, 10).await.unwrap();
            log.put_session(id, "spiffe://td/x", own.to_vec())
                .await
                .unwrap();
        }
        let mut watch = log.watch_election("e", 0).await.unwrap();
        let stand = async |id: i64| {
            let stood = log.stand("e", id, 1, own, b"candidate".to_vec()).await;
            stood.unwrap().value.unwrap()
        };
        let qa = stand(a).await;
        let qb = stand(b).await;
        let read = log.election("e", 8).await.unwrap().value;
        let found: Vec<(String, i64)> = read
            .candidates
            .iter()
            .map(|(key, kv)| (key.clone(), kv.lease))
            .collect();
        // the store's order (grant order), in the arbiter's ids
        assert_eq!(
            found,
            [
                (format!("fffffffe/{a:016x}"), a),
                (format!("fffffffe/{b:016x}"), b)
            ]
        );

        let txn = |from, to: i64, created, term_at| LeadTxn {
            election: "e",
            epoch: b"epoch",
            fence_at: 0,
            term_at,
            term_record: b"term".to_vec(),
            creates_for: None,
            from,
            to: Some(LeadTo {
                session: to,
                priority: 1,
                created,
                lead_record: b"lead".to_vec(),
                session_record: None,
                subject: "s",
            }),
        };
        let led = log
            .lead(txn(LeadFrom::Vacant, a, qa.created, 0))
            .await
            .unwrap();
        assert!(led.value);
        let t1 = led.header.revision;
        let proclaimed = log
            .proclaim(ProclaimTxn {
                election: "e",
                session: a,
                term_at: t1,
                epoch: b"epoch",
                lead_record: b"news".to_vec(),
            })
            .await
            .unwrap();
        assert!(proclaimed.value);
        let handed = log
            .lead(txn(
                LeadFrom::Leader {
                    session: a,
                    subject: "s",
                },
                b,
                qb.created,
                t1,
            ))
            .await
            .unwrap();
        assert!(handed.value);
        let lead = log.election("e", 8).await.unwrap().value.lead.unwrap();
        assert_eq!(lead.lease, b);

        match watch.next().await {
            FollowSignal::Events { events, .. } => {
                assert_eq!(events[0].key, format!("c/fffffffe/{a:016x}"));
                assert_eq!(events[0].put.as_ref().map(|kv| kv.lease), Some(a));
            }
            FollowSignal::Lost => panic!("the election's watch was lost"),
        }

        log.revoke(a).await.unwrap();
        let gone = log
            .lead(txn(
                LeadFrom::Leader {
                    session: b,
                    subject: "s",
                },
                a,
                0,
                handed.header.revision,
            ))
            .await;
        // No candidate record on the revoked lease: refused by the
        // candidate's lease compare, in the arbiter's ids as in the log's.
        assert!(matches!(gone, Ok(ref answer) if !answer.value), "{gone:?}");
    }
}
