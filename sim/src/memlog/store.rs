//! The store under [`super::MemLog`]: keys with etcd's metadata, one
//! revision counter, leases, per-key event history, every revision's
//! changes with their values (for prefix watches from a past revision) and
//! watch queues. Pure
//! state, no clock of its own and no `await`: the log passes `now` in, so
//! every step is a plain function of the calls made and the time they were
//! made at.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use latchkey_arbiter::lock_log::{FollowEvent, FollowSignal, Kv, WatchSignal};
use latchkey_records::keys;
use tokio::time::{Duration, Instant};

/// A stored key as etcd keeps it (the version counter is left out: no
/// compare the protocol makes reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub lease: i64,
}

impl Stored {
    pub fn kv(&self) -> Kv {
        Kv {
            value: self.value.clone(),
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            lease: self.lease,
        }
    }
}

/// One compare of a transaction: `=`, and `>` / `<` on values (byte-wise,
/// as etcd orders them: the owner check of a release).
#[derive(Debug, Clone)]
pub(crate) enum Compare {
    CreateRevision(String, i64),
    ModRevision(String, i64),
    /// etcd's `NOT_EQUAL` on the mod revision (a missing key has 0).
    ModRevisionNot(String, i64),
    Lease(String, i64),
    Value(String, Vec<u8>),
    ValueGreater(String, Vec<u8>),
    ValueLess(String, Vec<u8>),
    /// No key under the prefix (etcd: a version compare of 0 over a range).
    NoneUnder(String),
    /// Every key under the prefix created after the revision (etcd: a
    /// create-revision `>` compare over a range; an empty range compares
    /// as one missing key, created at 0).
    AllCreatedAfter(String, i64),
}

/// One write of a transaction.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: i64,
    },
    Delete(String),
    DeletePrefix(String),
}

/// What one write did: the previous key(s), as etcd's `prev_kv` returns them.
#[derive(Debug, Clone)]
pub(crate) enum OpResult {
    Put(Option<Stored>),
    Deleted(Vec<(String, Stored)>),
}

/// A put named a lease the store does not have (etcd: "lease not found",
/// and the whole transaction is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoLease(pub i64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventKind {
    Put,
    Delete,
}

impl EventKind {
    fn signal(self) -> WatchSignal {
        match self {
            EventKind::Put => WatchSignal::Changed,
            EventKind::Delete => WatchSignal::Freed,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Lease {
    /// The TTL as granted (after the floor), which a renewal restores.
    pub ttl_seconds: i64,
    pub deadline: Instant,
    pub keys: BTreeSet<String>,
}

/// A watch's queue of responses, filled at commit time, as etcd pushes
/// events to a synced watcher: a compaction after the push loses nothing.
#[derive(Debug)]
struct WatchSlot {
    key: String,
    /// Events below this revision are not the watch's.
    from: i64,
    pending: VecDeque<WatchSignal>,
    /// The stream ended: after `pending`, every `next` is `Lost`.
    ended: bool,
}

/// A watch of every key under a prefix, with values (and `prev_kv`): the
/// followers' watch (hold and session counts) and an election's. Filled at
/// commit time; one opened at a past revision starts with the changes since
/// then, from the store's [`Change`] log.
#[derive(Debug)]
struct PrefixSlot {
    prefix: String,
    /// Changes below this revision are not the watch's.
    from: i64,
    pending: VecDeque<FollowSignal>,
    ended: bool,
}

/// One change of one key: the key, the value put (`None`: a delete) and
/// the value before it.
type Change = (String, Option<Kv>, Option<Kv>);

/// The store's content at one revision (see [`super::Snapshot`]).
#[derive(Debug, Clone)]
pub(crate) struct Image {
    pub revision: i64,
    pub compacted: i64,
    kvs: BTreeMap<String, Stored>,
    history: BTreeMap<String, VecDeque<(i64, EventKind)>>,
    changes: VecDeque<(i64, Vec<Change>)>,
    /// Lease id → (granted TTL, keys); deadlines restart on restore.
    leases: BTreeMap<i64, (i64, BTreeSet<String>)>,
}

impl Image {
    /// A key as it was at this revision.
    pub fn get(&self, key: &str) -> Option<&Stored> {
        self.kvs.get(key)
    }
}

/// Why a compaction was refused (etcd's two refusals).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CompactError {
    #[error("revision {requested} is compacted already (compaction at {compacted})")]
    Compacted { requested: i64, compacted: i64 },
    #[error("revision {requested} is in the future (current {current})")]
    Future { requested: i64, current: i64 },
}

#[derive(Debug)]
pub(crate) struct Store {
    revision: i64,
    /// Events below this revision are gone; a watch from below it is `Lost`.
    compacted: i64,
    kvs: BTreeMap<String, Stored>,
    history: BTreeMap<String, VecDeque<(i64, EventKind)>>,
    /// Every revision's changes since the compaction, in order, with their
    /// values: what a prefix watch from a past revision replays (etcd
    /// reads them from its backend; the per-key `history` serves key
    /// watches, which want no values).
    changes: VecDeque<(i64, Vec<Change>)>,
    leases: BTreeMap<i64, Lease>,
    watches: BTreeMap<u64, WatchSlot>,
    prefix_watches: BTreeMap<u64, PrefixSlot>,
    next_watch: u64,
    /// Keep at least this many revisions of history (etcd's revision
    /// auto-compaction); `None`: never compact on its own.
    retention: Option<i64>,
    /// etcd raises shorter TTLs to its minimum (1.5 election timeouts,
    /// 2 s with the defaults).
    min_ttl_seconds: i64,
    /// Something a watch may be waiting for changed since the last
    /// [`Self::take_dirty`].
    dirty: bool,
    /// No majority: nothing commits and no lease expires (etcd's lessor
    /// runs on the leader only) until [`Self::regain_quorum`].
    quorum_lost: bool,
    /// A class whose holds per grant subject are counted after every
    /// commit (`maxHoldsPerSubject`, issue 34), and the most allowed.
    quota_check: Option<(String, u32)>,
    /// Every semaphore's permits, checked after every commit.
    permits_check: Option<u32>,
    /// Every commit after which a subject held more than that.
    pub(crate) quota_violations: Vec<String>,
}

impl Store {
    pub fn new(retention: Option<u64>, min_ttl_seconds: u32) -> Self {
        Self {
            // etcd starts at revision 1 (an empty store's header says 1).
            revision: 1,
            compacted: 0,
            kvs: BTreeMap::new(),
            history: BTreeMap::new(),
            changes: VecDeque::new(),
            leases: BTreeMap::new(),
            watches: BTreeMap::new(),
            prefix_watches: BTreeMap::new(),
            next_watch: 0,
            retention: retention.map(|r| i64::try_from(r.max(1)).unwrap_or(i64::MAX)),
            min_ttl_seconds: i64::from(min_ttl_seconds),
            dirty: false,
            quorum_lost: false,
            quota_check: None,
            permits_check: None,
            quota_violations: Vec::new(),
        }
    }

    pub fn quorum_lost(&self) -> bool {
        self.quorum_lost
    }

    /// The members lose their majority: from now on nothing commits and no
    /// lease expires.
    pub fn lose_quorum(&mut self) {
        self.quorum_lost = true;
    }

    /// A majority again: a new leader's lessor gives every lease its whole
    /// TTL from now (etcd's `Promote`), so no holder loses a lease to the
    /// time nobody could renew it.
    pub fn regain_quorum(&mut self, now: Instant) {
        if !std::mem::take(&mut self.quorum_lost) {
            return;
        }
        for lease in self.leases.values_mut() {
            let whole = now + Duration::from_secs(u64::try_from(lease.ttl_seconds).unwrap_or(0));
            lease.deadline = lease.deadline.max(whole);
        }
        self.dirty = true;
    }

    pub fn revision(&self) -> i64 {
        self.revision
    }

    pub fn compacted(&self) -> i64 {
        self.compacted
    }

    /// Whether a watch may have something new to see; resets the flag.
    pub fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    // --- reads ---

    pub fn get(&self, key: &str) -> Option<&Stored> {
        self.kvs.get(key)
    }

    pub fn range<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a String, &'a Stored)> {
        self.kvs
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(move |(k, _)| k.starts_with(prefix))
    }

    /// The key under `prefix` created first (etcd: a range sorted by
    /// create revision, limit 1).
    pub fn oldest_under(&self, prefix: &str) -> Option<Kv> {
        self.range(prefix)
            .min_by_key(|(_, kv)| kv.create_revision)
            .map(|(_, kv)| kv.kv())
    }

    /// The first key under `prefix` in key order.
    pub fn first_under(&self, prefix: &str) -> Option<Kv> {
        self.range(prefix).next().map(|(_, kv)| kv.kv())
    }

    pub fn count(&self, prefix: &str) -> i64 {
        i64::try_from(self.range(prefix).count()).unwrap_or(i64::MAX)
    }

    /// etcd's compare: on a missing key a value compare (of any operator)
    /// always fails and the others compare against zero.
    pub fn holds(&self, compare: &Compare) -> bool {
        match compare {
            Compare::NoneUnder(prefix) => return self.range(prefix).next().is_none(),
            Compare::AllCreatedAfter(prefix, r) => {
                let mut keys = self.range(prefix).peekable();
                if keys.peek().is_none() {
                    return 0 > *r;
                }
                return keys.all(|(_, kv)| kv.create_revision > *r);
            }
            _ => {}
        }
        let key = match compare {
            Compare::CreateRevision(k, _)
            | Compare::ModRevision(k, _)
            | Compare::ModRevisionNot(k, _)
            | Compare::Lease(k, _)
            | Compare::Value(k, _)
            | Compare::ValueGreater(k, _)
            | Compare::ValueLess(k, _) => k,
            Compare::NoneUnder(_) | Compare::AllCreatedAfter(..) => return false,
        };
        let kv = self.kvs.get(key);
        match compare {
            Compare::CreateRevision(_, r) => kv.map_or(0, |kv| kv.create_revision) == *r,
            Compare::ModRevision(_, r) => kv.map_or(0, |kv| kv.mod_revision) == *r,
            Compare::ModRevisionNot(_, r) => kv.map_or(0, |kv| kv.mod_revision) != *r,
            Compare::Lease(_, l) => kv.map_or(0, |kv| kv.lease) == *l,
            Compare::Value(_, v) => kv.is_some_and(|kv| kv.value == *v),
            Compare::ValueGreater(_, v) => kv.is_some_and(|kv| kv.value > *v),
            Compare::ValueLess(_, v) => kv.is_some_and(|kv| kv.value < *v),
            Compare::NoneUnder(_) | Compare::AllCreatedAfter(..) => false,
        }
    }

    /// Counts the holds of the checked class per grant subject from now on.
    pub fn watch_quota(&mut self, class: &str, max: u32) {
        self.quota_check = Some((class.to_string(), max));
    }

    pub fn watch_permits(&mut self, permits: u32) {
        self.permits_check = Some(permits);
    }

    /// More slots of one semaphore held than its permits.
    fn check_permits(&mut self, rev: i64) {
        let Some(permits) = self.permits_check else {
            return;
        };
        let mut held: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for (key, _) in self.range(keys::HOLDERS) {
            let key = key.strip_prefix(keys::HOLDERS).unwrap_or(key);
            if let Some((name, slot)) = latchkey_records::split_slot(key) {
                held.entry(name).or_default().push(slot);
            }
        }
        let over: Vec<String> = held
            .iter()
            .filter(|(_, slots)| slots.len() > permits as usize || slots.iter().any(|s| *s >= permits))
            .map(|(name, slots)| {
                format!("at revision {rev} semaphore {name} (permits {permits}) had slots {slots:?} held")
            })
            .collect();
        self.quota_violations.extend(over);
    }

    /// An exclusive hold of a key beside anything under its name (a
    /// shared hold, a semaphore slot), or a shared hold beside a slot:
    /// checked after every commit of every run, so every preset judges
    /// "one kind, and one mode, at a time" on the log itself.
    fn check_modes(&mut self, rev: i64) {
        use latchkey_records::{HoldKind, hold_kind};
        let mut kinds: BTreeMap<&str, BTreeMap<HoldKind, usize>> = BTreeMap::new();
        for (key, _) in self.range(keys::HOLDERS) {
            let key = key.strip_prefix(keys::HOLDERS).unwrap_or(key);
            let (kind, name) = hold_kind(key);
            *kinds.entry(name).or_default().entry(kind).or_insert(0) += 1;
        }
        let mixed: Vec<String> = kinds
            .iter()
            .filter(|(_, held)| held.len() > 1)
            .map(|(name, held)| format!("at revision {rev} {name} was held as {held:?} at once"))
            .collect();
        self.quota_violations.extend(mixed);
    }

    fn check_quota(&mut self, rev: i64) {
        let Some((class, max)) = &self.quota_check else {
            return;
        };
        let mut held: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for (key, stored) in self.range(keys::HOLDERS) {
            if let Some(h) =
                latchkey_records::decode::<latchkey_records::HolderRecord>(&stored.value)
                && h.class == *class
            {
                held.entry(h.bounded_as().to_string())
                    .or_default()
                    .push(key);
            }
        }
        let over: Vec<String> = held
            .iter()
            .filter(|(_, keys)| keys.len() > *max as usize)
            .map(|(subject, keys)| {
                format!("at revision {rev} {subject} held {} keys of class {class} (quota {max}): {keys:?}", keys.len())
            })
            .collect();
        self.quota_violations.extend(over);
    }

    pub fn all(&self, compares: &[Compare]) -> bool {
        compares.iter().all(|c| self.holds(c))
    }

    // --- writes ---

    /// Applies `ops` as one transaction: every put's lease is checked first
    /// (a missing one refuses the whole transaction, as etcd does); the
    /// revision goes up by one only if something changed (a delete of
    /// nothing is no write, as in etcd's mvcc).
    pub fn commit(&mut self, ops: Vec<Op>) -> Result<Vec<OpResult>, NoLease> {
        for op in &ops {
            if let Op::Put { lease, .. } = op
                && *lease != 0
                && !self.leases.contains_key(lease)
            {
                return Err(NoLease(*lease));
            }
        }
        let rev = self.revision + 1;
        let mut events: Vec<(String, EventKind)> = Vec::new();
        // (key, put, prev) of each change, for the prefix watches.
        let mut changes: Vec<Change> = Vec::new();
        let mut results = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                Op::Put { key, value, lease } => {
                    let prev = self.put(rev, &key, value, lease);
                    let put = self.kvs.get(&key).map(Stored::kv);
                    changes.push((key.clone(), put, prev.as_ref().map(Stored::kv)));
                    events.push((key, EventKind::Put));
                    results.push(OpResult::Put(prev));
                }
                Op::Delete(key) => {
                    let prev: Vec<(String, Stored)> = self
                        .remove(&key)
                        .map(|kv| (key.clone(), kv))
                        .into_iter()
                        .collect();
                    if let Some((_, kv)) = prev.first() {
                        changes.push((key.clone(), None, Some(kv.kv())));
                        events.push((key, EventKind::Delete));
                    }
                    results.push(OpResult::Deleted(prev));
                }
                Op::DeletePrefix(prefix) => {
                    let keys: Vec<String> = self.range(&prefix).map(|(k, _)| k.clone()).collect();
                    let mut prev = Vec::with_capacity(keys.len());
                    for key in keys {
                        if let Some(kv) = self.remove(&key) {
                            changes.push((key.clone(), None, Some(kv.kv())));
                            events.push((key.clone(), EventKind::Delete));
                            prev.push((key, kv));
                        }
                    }
                    results.push(OpResult::Deleted(prev));
                }
            }
        }
        if !events.is_empty() {
            self.revision = rev;
            self.push_to_prefix_watches(rev, &changes);
            self.changes.push_back((rev, changes));
            self.record(rev, events);
            self.check_quota(rev);
            self.check_permits(rev);
            self.check_modes(rev);
        }
        Ok(results)
    }

    fn put(&mut self, rev: i64, key: &str, value: Vec<u8>, lease: i64) -> Option<Stored> {
        let prev = self.kvs.get(key).cloned();
        if let Some(old) = &prev
            && old.lease != lease
        {
            self.detach(key, old.lease);
        }
        if lease != 0
            && let Some(l) = self.leases.get_mut(&lease)
        {
            l.keys.insert(key.to_string());
        }
        self.kvs.insert(
            key.to_string(),
            Stored {
                value,
                create_revision: prev.as_ref().map_or(rev, |p| p.create_revision),
                mod_revision: rev,
                lease,
            },
        );
        prev
    }

    fn remove(&mut self, key: &str) -> Option<Stored> {
        let prev = self.kvs.remove(key)?;
        self.detach(key, prev.lease);
        Some(prev)
    }

    fn detach(&mut self, key: &str, lease: i64) {
        if lease != 0
            && let Some(l) = self.leases.get_mut(&lease)
        {
            l.keys.remove(key);
        }
    }

    /// Keeps the events of revision `rev` and hands them to the watches.
    /// (A watch of a semaphore's slots prefix, `<name>//s/`, as the etcd
    /// log opens one, sees every slot: [`watches`].)
    fn record(&mut self, rev: i64, events: Vec<(String, EventKind)>) {
        for (key, kind) in events {
            for slot in self.watches.values_mut() {
                if watches(&slot.key, &key) && !slot.ended && rev >= slot.from {
                    slot.pending.push_back(kind.signal());
                }
            }
            self.history.entry(key).or_default().push_back((rev, kind));
        }
        self.dirty = true;
        if let Some(keep) = self.retention
            && self.revision - self.compacted >= keep.saturating_mul(2)
        {
            self.drop_history_below(self.revision - keep);
        }
    }

    /// Hands one revision's changes to every prefix watch they concern,
    /// as one response.
    fn push_to_prefix_watches(&mut self, rev: i64, changes: &[Change]) {
        for slot in self.prefix_watches.values_mut() {
            if slot.ended || rev < slot.from {
                continue;
            }
            let events = events_under(&slot.prefix, changes, true);
            if !events.is_empty() {
                slot.pending.push_back(FollowSignal::Events {
                    events,
                    through: rev,
                });
            }
        }
    }

    /// Every key under `prefix` now, and a watch of the prefix from the
    /// next revision on (one call: nothing falls between the read and the
    /// watch). Keys come without the prefix.
    pub fn follow(&mut self, prefix: &str) -> (Vec<(String, Kv)>, i64, u64) {
        let read = self
            .range(prefix)
            .map(|(k, kv)| (k.strip_prefix(prefix).unwrap_or(k).to_string(), kv.kv()))
            .collect();
        let id = self.open_prefix_watch(prefix, self.revision + 1);
        (read, self.revision, id)
    }

    /// A watch of every key under `prefix` from revision `from` (`<= 0`:
    /// from the next revision), keys without the prefix, every change with
    /// the value before it (etcd's `prev_kv`). From below the compaction it
    /// is born ended (etcd cancels a watch whose start is compacted);
    /// otherwise the changes since `from` come first, one response per
    /// revision, as a synced watch would have had them.
    pub fn open_prefix_watch(&mut self, prefix: &str, from: i64) -> u64 {
        let id = self.next_watch;
        self.next_watch += 1;
        let from = if from <= 0 { self.revision + 1 } else { from };
        let mut slot = PrefixSlot {
            prefix: prefix.to_string(),
            from,
            pending: VecDeque::new(),
            ended: false,
        };
        if from < self.compacted {
            slot.ended = true;
        } else {
            for (rev, changes) in self.changes.iter().filter(|(rev, _)| *rev >= from) {
                // etcd reads a replayed event's previous value at the
                // revision before it, which a compaction there has removed.
                let events = events_under(prefix, changes, *rev > self.compacted);
                if !events.is_empty() {
                    slot.pending.push_back(FollowSignal::Events {
                        events,
                        through: *rev,
                    });
                }
            }
        }
        self.prefix_watches.insert(id, slot);
        id
    }

    /// The prefix watch's next response, if it has one now (`Lost` once
    /// ended, or if it is unknown).
    pub fn poll_prefix_watch(&mut self, id: u64) -> Option<FollowSignal> {
        let Some(slot) = self.prefix_watches.get_mut(&id) else {
            return Some(FollowSignal::Lost);
        };
        if let Some(signal) = slot.pending.pop_front() {
            return Some(signal);
        }
        slot.ended.then_some(FollowSignal::Lost)
    }

    pub fn close_prefix_watch(&mut self, id: u64) {
        self.prefix_watches.remove(&id);
    }

    // --- compaction ---

    /// etcd's compaction at `rev`: history below it is gone, so a watch
    /// from below it can only be `Lost`. Watches already following keep
    /// what was pushed to them.
    pub fn compact(&mut self, rev: i64) -> Result<(), CompactError> {
        if rev <= self.compacted {
            return Err(CompactError::Compacted {
                requested: rev,
                compacted: self.compacted,
            });
        }
        if rev > self.revision {
            return Err(CompactError::Future {
                requested: rev,
                current: self.revision,
            });
        }
        self.drop_history_below(rev);
        Ok(())
    }

    fn drop_history_below(&mut self, rev: i64) {
        self.compacted = self.compacted.max(rev);
        let floor = self.compacted;
        while self.changes.front().is_some_and(|(r, _)| *r < floor) {
            self.changes.pop_front();
        }
        self.history.retain(|_, events| {
            while events.front().is_some_and(|(r, _)| *r < floor) {
                events.pop_front();
            }
            !events.is_empty()
        });
    }

    // --- leases ---

    /// Grants `id` with `ttl_seconds` (raised to the floor); `false` if the
    /// id is taken.
    pub fn grant_lease(&mut self, id: i64, ttl_seconds: u32, now: Instant) -> bool {
        if self.leases.contains_key(&id) {
            return false;
        }
        let ttl = i64::from(ttl_seconds).max(self.min_ttl_seconds);
        self.leases.insert(
            id,
            Lease {
                ttl_seconds: ttl,
                deadline: now + secs(ttl),
                keys: BTreeSet::new(),
            },
        );
        // a waiting watch may have to wake earlier now
        self.dirty = true;
        true
    }

    /// Restarts the lease's TTL: the granted TTL, or 0 if it is gone.
    pub fn renew(&mut self, id: i64, now: Instant) -> i64 {
        match self.leases.get_mut(&id) {
            Some(l) => {
                l.deadline = now + secs(l.ttl_seconds);
                self.dirty = true;
                l.ttl_seconds
            }
            None => 0,
        }
    }

    /// Revokes `id`: every key on it goes in one revision (none if it had
    /// no keys). Whether the lease existed.
    pub fn revoke(&mut self, id: i64) -> bool {
        let Some(lease) = self.leases.remove(&id) else {
            return false;
        };
        self.dirty = true;
        let ops = lease.keys.into_iter().map(Op::Delete).collect();
        // deletes name no lease: cannot be refused
        let _ = self.commit(ops);
        true
    }

    /// Revokes every lease whose deadline is at or before `now`, earliest
    /// first (ties by id), each at its own revision, as etcd's lessor
    /// would have by now.
    pub fn expire_due(&mut self, now: Instant) {
        if self.quorum_lost {
            return;
        }
        while let Some(id) = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .min_by_key(|(id, l)| (l.deadline, **id))
            .map(|(id, _)| *id)
        {
            self.revoke(id);
        }
    }

    pub fn earliest_deadline(&self) -> Option<Instant> {
        if self.quorum_lost {
            return None;
        }
        self.leases.values().map(|l| l.deadline).min()
    }

    pub fn lease(&self, id: i64) -> Option<&Lease> {
        self.leases.get(&id)
    }

    pub fn lease_ids(&self) -> Vec<i64> {
        self.leases.keys().copied().collect()
    }

    // --- watches ---

    /// A watch on `key` from `from` (`<= 0`: from the next revision). From
    /// below the compaction it is born ended; otherwise the events it asked
    /// for that happened already come first, in one response (etcd syncs
    /// an unsynced watcher's backlog in one batch).
    pub fn open_watch(&mut self, key: &str, from: i64) -> u64 {
        let id = self.next_watch;
        self.next_watch += 1;
        let from = if from <= 0 { self.revision + 1 } else { from };
        let mut slot = WatchSlot {
            key: key.to_string(),
            from,
            pending: VecDeque::new(),
            ended: false,
        };
        if from < self.compacted {
            slot.ended = true;
        } else {
            let backlog: Vec<EventKind> = self
                .history
                .range(key.to_string()..)
                .take_while(|(k, _)| watches(key, k))
                .flat_map(|(_, events)| events.iter())
                .filter(|(r, _)| *r >= from)
                .map(|(_, k)| *k)
                .collect();
            if !backlog.is_empty() {
                let freed = backlog.contains(&EventKind::Delete);
                slot.pending.push_back(if freed {
                    WatchSignal::Freed
                } else {
                    WatchSignal::Changed
                });
            }
        }
        self.watches.insert(id, slot);
        id
    }

    /// The watch's next response, if it has one now (`Lost` once ended or
    /// if it is unknown).
    pub fn poll_watch(&mut self, id: u64) -> Option<WatchSignal> {
        let Some(slot) = self.watches.get_mut(&id) else {
            return Some(WatchSignal::Lost);
        };
        if let Some(signal) = slot.pending.pop_front() {
            return Some(signal);
        }
        slot.ended.then_some(WatchSignal::Lost)
    }

    pub fn close_watch(&mut self, id: u64) {
        self.watches.remove(&id);
    }

    /// Ends every open watch (a broken stream, a restarted member): each
    /// reports what was pushed to it, then `Lost`.
    pub fn end_watches(&mut self) {
        for slot in self.watches.values_mut() {
            slot.ended = true;
        }
        for slot in self.prefix_watches.values_mut() {
            slot.ended = true;
        }
        self.dirty = true;
    }

    /// Key watches and prefix watches not ended yet.
    pub fn open_watches(&self) -> usize {
        self.watches.values().filter(|s| !s.ended).count()
            + self.prefix_watches.values().filter(|s| !s.ended).count()
    }

    // --- snapshot and restore ---

    pub fn image(&self) -> Image {
        Image {
            revision: self.revision,
            compacted: self.compacted,
            kvs: self.kvs.clone(),
            history: self.history.clone(),
            changes: self.changes.clone(),
            leases: self
                .leases
                .iter()
                .map(|(id, l)| (*id, (l.ttl_seconds, l.keys.clone())))
                .collect(),
        }
    }

    /// Goes back to `image`: its keys, history and revision; its leases
    /// with their TTL restarted from `now` (etcd's lessor after a restart,
    /// without checkpoints); every open watch ends.
    pub fn restore(&mut self, image: &Image, now: Instant) {
        self.revision = image.revision;
        self.compacted = image.compacted;
        self.kvs = image.kvs.clone();
        self.history = image.history.clone();
        self.changes = image.changes.clone();
        self.leases = image
            .leases
            .iter()
            .map(|(id, (ttl, keys))| {
                (
                    *id,
                    Lease {
                        ttl_seconds: *ttl,
                        deadline: now + secs(*ttl),
                        keys: keys.clone(),
                    },
                )
            })
            .collect();
        self.end_watches();
    }
}

/// The changes of one revision under `prefix`, keys below it; `prev`
/// says whether the values before them are still readable.
fn events_under(prefix: &str, changes: &[Change], prev: bool) -> Vec<FollowEvent> {
    changes
        .iter()
        .filter_map(|(key, put, before)| {
            Some(FollowEvent {
                key: key.strip_prefix(prefix)?.to_string(),
                put: put.clone(),
                prev: if prev { before.clone() } else { None },
            })
        })
        .collect()
}

fn secs(ttl: i64) -> Duration {
    Duration::from_secs(u64::try_from(ttl).unwrap_or(0))
}

/// Whether a key watch opened on `watched` sees a change of `key`: the key
/// itself, or any hold under a prefix of holds
/// ([`latchkey_records::is_holds_prefix`]: a semaphore's slots, a lock's
/// shared holds).
fn watches(watched: &str, key: &str) -> bool {
    watched == key
        || (latchkey_records::is_holds_prefix(watched) && key.starts_with(watched))
        // a lock's writers' intents (`w/<name>//`: no lock key ends in `//`)
        || (watched.starts_with(keys::INTENTS)
            && watched.ends_with("//")
            && key.starts_with(watched))
}
