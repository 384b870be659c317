//! Holds per identity, over every arbiter: the bound on what a caller can
//! make Latchkey keep open in etcd.
//!
//! Every hold is a key in the lock log. Without a bound one workload could
//! take keys under its prefix grants until etcd's quota refuses every write
//! in the cluster (NOSPACE), everyone's grants and renewals included. Holds
//! are bounded per identity (`--max-holds-per-identity`), counted from the
//! log itself: each arbiter reads every holder record once at start and
//! then follows the holder key space with a watch (`prev_kv`, so a deleted
//! hold still says whose it was), which counts holds granted by any arbiter
//! and holds ended by release, hand-over, expiry or an operator alike.
//!
//! An Acquire is admitted while the identity's holds in the log, plus the
//! Acquires this arbiter has admitted and not yet seen in the log, are below
//! the bound. The bound can be passed by no more than what other arbiters
//! admit for the same identity before their grants reach this arbiter's
//! watch (milliseconds): Acquires in flight, themselves bounded per identity
//! at the edge. The count never decides a grant; it only refuses early.
//!
//! The same watch tells holders at once when a hold ends by anything but
//! their own release (issue 13): a KeepAlive stream that renews a session
//! asks to hear of its holds' ends ([`HoldCounts::watch_session`]), and gets
//! each as a notice it pushes to the client, who fences that hold without
//! waiting for its deadline. Releases are told too (the log does not say
//! why a hold ended); the client knows what it released and ignores those.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use parking_lot::{Mutex, MutexGuard};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use tracing::{info, warn};

use crate::error::{ArbiterError, IdentityBound};
use crate::records::{HolderRecord, decode};

mod notices;
pub use notices::Notices;
use notices::Unclaimed;

/// The default `--max-holds-per-identity`.
pub const DEFAULT_MAX_HOLDS_PER_IDENTITY: u32 = 20_000;

/// Holder records read per request when counting from scratch (each a
/// few hundred bytes: well inside a gRPC message).
const PAGE: i64 = 2_000;
/// Pause before counting again after the watch broke.
const RETRY: Duration = Duration::from_secs(1);

pub struct HoldCounts {
    max: u32,
    state: Mutex<State>,
    /// Per session, the KeepAlive streams (by id) that renew it here and
    /// want to hear of its holds' ends.
    watchers: Mutex<HashMap<i64, Vec<(u64, Notices)>>>,
    /// Ended holds of sessions no stream here watched yet, newest last: a
    /// stream that starts watching a session soon after (a hold taken and
    /// ended right after the session opened, before its first renewal)
    /// still hears of them. Bounded in count and age.
    unclaimed: Mutex<Unclaimed>,
    next_stream: AtomicU64,
    /// Wakes Acquires that arrived before the first count was in.
    counted: tokio::sync::Notify,
    /// Every held key in the log and its holder's session (lease), as far
    /// as the watch has seen: what an open class's memory grant must not
    /// take during a quorum loss.
    keys: Mutex<HashMap<String, i64>>,
}

#[derive(Default)]
struct State {
    /// Live holds in the log per identity; `None` until the first count is in.
    /// Identities with no hold leave the map.
    in_log: Option<HashMap<String, u32>>,
    /// The log revision `in_log` reflects.
    revision: i64,
    /// Acquires admitted here, per identity, that count beside `in_log`.
    pending: HashMap<String, Vec<Pending>>,
    /// Ids for [`Pending`] entries.
    next_id: u64,
}

/// One Acquire admitted here and not (yet) in `in_log`.
struct Pending {
    id: u64,
    key: String,
    /// 0 while in flight; then the grant's revision, until the watch
    /// reaches it.
    revision: i64,
    /// The watch showed a new hold of this key for this identity while the
    /// call was in flight: the grant reached the log (and `in_log`) before
    /// its answer reached the call. It no longer counts, or it would count
    /// twice.
    in_log: bool,
}

impl State {
    fn held(&self, identity: &str) -> Option<u32> {
        let in_log = self.in_log.as_ref()?;
        let pending = self
            .pending
            .get(identity)
            .map_or(0, |p| p.iter().filter(|p| !p.in_log).count());
        Some(
            in_log
                .get(identity)
                .copied()
                .unwrap_or(0)
                .saturating_add(u32::try_from(pending).unwrap_or(u32::MAX)),
        )
    }

    fn add(&mut self, identity: &str, delta: i32) {
        let Some(in_log) = self.in_log.as_mut() else {
            return;
        };
        let n = in_log.entry(identity.to_string()).or_insert(0);
        *n = n.saturating_add_signed(delta);
        if *n == 0 {
            in_log.remove(identity);
        }
    }

    /// The watch shows a new hold of `key` for `identity`: an Acquire of
    /// that key in flight here is the one that got it (matched by key, so a
    /// grant by another arbiter never cancels an unrelated call here).
    fn seen_grant(&mut self, identity: &str, key: &str) {
        if let Some(p) = self.pending.get_mut(identity).and_then(|p| {
            p.iter_mut()
                .find(|p| p.revision == 0 && !p.in_log && p.key == key)
        }) {
            p.in_log = true;
        }
    }

    /// The log is now known up to `revision`: grants at or below it are in
    /// `in_log`, so they stop counting as pending.
    fn reached(&mut self, revision: i64) {
        self.revision = self.revision.max(revision);
        let seen = self.revision;
        self.pending.retain(|_, p| {
            p.retain(|p| p.revision == 0 || p.revision > seen);
            !p.is_empty()
        });
    }
}

/// One admitted Acquire. Dropped without [`Admitted::granted`], it stops
/// counting at once; granted, it counts until the watch shows the grant.
pub struct Admitted {
    counts: Arc<HoldCounts>,
    identity: String,
    id: u64,
    revision: i64,
}

impl Admitted {
    /// The Acquire was granted at `revision` (a grant of a hold the caller
    /// already had included: the watch has seen that one already).
    pub fn granted(mut self, revision: i64) {
        self.revision = revision;
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut state = self.counts.lock();
        let seen = state.revision;
        let Some(pending) = state.pending.get_mut(&self.identity) else {
            return;
        };
        if let Some(i) = pending.iter().position(|p| p.id == self.id) {
            if self.revision > seen && !pending[i].in_log {
                pending[i].revision = self.revision;
            } else {
                pending.swap_remove(i);
            }
        }
        if pending.is_empty() {
            state.pending.remove(&self.identity);
        }
    }
}

impl HoldCounts {
    pub fn new(max: u32) -> Arc<Self> {
        Arc::new(Self {
            max,
            state: Mutex::new(State::default()),
            watchers: Mutex::new(HashMap::new()),
            unclaimed: Mutex::new(Unclaimed::default()),
            next_stream: AtomicU64::new(1),
            counted: tokio::sync::Notify::new(),
            keys: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is plain counts, consistent after every statement: a
        // panic elsewhere while holding the lock leaves nothing half-done.
        self.state.lock()
    }

    /// [`Self::admit`], but an Acquire that arrives before the first count
    /// is in (an arbiter that just started) waits for it, at most `wait`,
    /// instead of being refused at once.
    pub async fn admit_within(
        self: &Arc<Self>,
        identity: &str,
        key: &str,
        wait: Duration,
    ) -> Result<Admitted, ArbiterError> {
        self.admit_within_beside(identity, key, 0, wait).await
    }

    /// [`Self::admit_within`], counting `beside` more holds of `identity`
    /// (its holds on the other tier's cluster: the bound is over both).
    pub async fn admit_within_beside(
        self: &Arc<Self>,
        identity: &str,
        key: &str,
        beside: u32,
        wait: Duration,
    ) -> Result<Admitted, ArbiterError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before the check, so a count installed in between
            // still wakes this call.
            let counted = self.counted.notified();
            if self.lock().in_log.is_some() {
                return self.admit_beside(identity, key, beside);
            }
            if tokio::time::timeout_at(deadline, counted).await.is_err() {
                return self.admit_beside(identity, key, beside);
            }
        }
    }

    /// Admits one Acquire of `key` by `identity`, or refuses it:
    /// `IdentityLimit` at the bound, `StoreUnavailable` before the first
    /// count is in.
    pub fn admit(self: &Arc<Self>, identity: &str, key: &str) -> Result<Admitted, ArbiterError> {
        self.admit_beside(identity, key, 0)
    }

    /// [`Self::admit`] with `beside` holds of `identity` counted elsewhere.
    pub fn admit_beside(
        self: &Arc<Self>,
        identity: &str,
        key: &str,
        beside: u32,
    ) -> Result<Admitted, ArbiterError> {
        let mut state = self.lock();
        let Some(held) = state.held(identity) else {
            return Err(ArbiterError::store(
                "this arbiter is still counting the holds in the lock log (it just started and etcd has not answered yet)",
            ));
        };
        if held.saturating_add(beside) >= self.max {
            return Err(ArbiterError::IdentityLimit {
                bound: IdentityBound::Holds,
                limit: self.max,
            });
        }
        state.next_id += 1;
        let id = state.next_id;
        state
            .pending
            .entry(identity.to_string())
            .or_default()
            .push(Pending {
                id,
                key: key.to_string(),
                revision: 0,
                in_log: false,
            });
        Ok(Admitted {
            counts: Arc::clone(self),
            identity: identity.to_string(),
            id,
            revision: 0,
        })
    }

    /// Holds of `identity` as counted (log plus pending); `None` before the
    /// first count.
    pub fn held(&self, identity: &str) -> Option<u32> {
        self.lock().held(identity)
    }

    /// Whether `key` is held in the log by a session other than `session`
    /// (as last seen by the watch; `false` before the first count).
    pub fn held_by_other(&self, key: &str, session: i64) -> bool {
        self.keys.lock().get(key).is_some_and(|s| *s != session)
    }

    /// Replaces the count with a fresh one read at `revision`.
    fn install(&self, in_log: HashMap<String, u32>, keys: HashMap<String, i64>, revision: i64) {
        *self.keys.lock() = keys;
        {
            let mut state = self.lock();
            state.in_log = Some(in_log);
            state.revision = 0;
            state.reached(revision);
        }
        self.counted.notify_waiters();
    }

    /// Applies one watch response's events, all at or below `revision`.
    fn apply(&self, changes: &[Change], revision: i64) {
        {
            let mut keys = self.keys.lock();
            for change in changes {
                match (&change.after, change.session) {
                    (Some(_), session) => keys.insert(change.key.clone(), session),
                    (None, _) => keys.remove(&change.key),
                };
            }
        }
        let mut state = self.lock();
        for change in changes {
            if let Some(before) = &change.before {
                state.add(before, -1);
            }
            if let Some(after) = &change.after {
                state.add(after, 1);
                if change.before.as_ref() != Some(after) {
                    state.seen_grant(after, &change.key);
                }
            }
        }
        state.reached(revision);
    }

    /// Keeps the count: reads every holder record, then follows the watch;
    /// counts again from scratch whenever the watch breaks. Runs until the
    /// arbiter stops.
    pub async fn follow(self: Arc<Self>, client: Client, holders_prefix: String) {
        let mut first = true;
        loop {
            match self
                .count_and_watch(&client, &holders_prefix, &mut first)
                .await
            {
                Ok(()) => warn!("the watch on the holder records ended; counting holds again"),
                Err(e) => warn!(error = %e, "cannot count the holds in the lock log; trying again"),
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    async fn count_and_watch(
        &self,
        client: &Client,
        prefix: &str,
        first: &mut bool,
    ) -> Result<(), etcd_client::Error> {
        let (counted, keys, revision) = count(client, prefix).await?;
        let (identities, holds) = (counted.len(), counted.values().sum::<u32>());
        self.install(counted, keys, revision);
        if std::mem::take(first) {
            info!(
                holds,
                identities,
                max_per_identity = self.max,
                "counted the holds in the lock log"
            );
        }
        let mut stream = client
            .watch_client()
            .watch(
                prefix,
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_prev_key()
                        .with_start_revision(revision + 1),
                ),
            )
            .await?;
        while let Some(resp) = stream.message().await? {
            if resp.canceled() || resp.compact_revision() > 0 {
                // Events were lost (compaction): only a fresh count is exact.
                return Ok(());
            }
            let mut changes = Vec::with_capacity(resp.events().len());
            for event in resp.events() {
                let Some(change) =
                    Change::of(prefix, event.event_type(), event.kv(), event.prev_kv())
                else {
                    // A delete whose previous value etcd no longer had.
                    return Ok(());
                };
                changes.push(change);
            }
            // How far the log is known: the last event's revision (a
            // catching-up watch may send a later header with earlier
            // events); the header's only for a progress notice.
            let at = resp
                .events()
                .iter()
                .filter_map(|e| e.kv().map(KeyValue::mod_revision))
                .max()
                .or_else(|| resp.header().map(|h| h.revision()))
                .unwrap_or(0);
            self.apply(&changes, at);
            self.notify(&changes);
        }
        Ok(())
    }
}

/// Whose hold a change of one holder record ended and whose it started.
#[derive(Debug, PartialEq, Eq)]
struct Change {
    /// The lock key (the holder record's key without the prefix).
    key: String,
    /// The new holder's session (lease), for a put.
    session: i64,
    before: Option<String>,
    after: Option<String>,
    /// The hold the change ended, if one did.
    ended: Option<Ended>,
}

#[derive(Debug, PartialEq, Eq)]
struct Ended {
    session: i64,
    key: String,
    revision: i64,
}

impl Change {
    /// `None` when the change cannot be attributed (a delete without its
    /// previous value): the caller counts again. `holders` is the prefix
    /// of the holder records.
    fn of(
        holders: &str,
        kind: EventType,
        kv: Option<&KeyValue>,
        prev: Option<&KeyValue>,
    ) -> Option<Self> {
        // Counted per grant subject (a pattern for per-pod identities).
        let owner =
            |kv: &KeyValue| decode::<HolderRecord>(kv.value()).map(|h| h.bounded_as().to_string());
        let before = prev.and_then(owner);
        let key = kv
            .or(prev)
            .and_then(|kv| kv.key_str().ok()?.strip_prefix(holders).map(str::to_string))
            .unwrap_or_default();
        // Any change of a holder record ends the hold it replaces: a
        // release, a hand-over (a put with the next holder) or an expiry.
        let ended = prev.and_then(|p| {
            Some(Ended {
                session: p.lease(),
                key: p.key_str().ok()?.strip_prefix(holders)?.to_string(),
                revision: p.mod_revision(),
            })
        });
        match kind {
            EventType::Put => Some(Self {
                key,
                session: kv.map_or(0, KeyValue::lease),
                before,
                after: kv.and_then(owner),
                ended,
            }),
            EventType::Delete => {
                prev?;
                Some(Self {
                    key,
                    session: 0,
                    before,
                    after: None,
                    ended,
                })
            }
        }
    }
}

/// Every holder record's identity, counted, with the revision of the read:
/// one page after another, all at the first page's revision.
async fn count(
    client: &Client,
    prefix: &str,
) -> Result<(HashMap<String, u32>, HashMap<String, i64>, i64), etcd_client::Error> {
    let mut kv = client.kv_client();
    let range_end = prefix_end(prefix);
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = 0;
    let mut counted = HashMap::new();
    let mut keys = HashMap::new();
    loop {
        let mut options = GetOptions::new()
            .with_range(range_end.clone())
            .with_limit(PAGE);
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let resp = kv.get(from.clone(), Some(options)).await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        for kv in resp.kvs() {
            if let Some(h) = decode::<HolderRecord>(kv.value()) {
                *counted.entry(h.bounded_as().to_string()).or_insert(0u32) += 1;
                if let Some(key) = kv.key_str().ok().and_then(|k| k.strip_prefix(prefix)) {
                    keys.insert(key.to_string(), kv.lease());
                }
            }
        }
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok((counted, keys, revision)),
        }
    }
}

/// The end of the range of keys starting with `prefix` (etcd's convention).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn counted(pairs: &[(&str, u32)], revision: i64) -> Arc<HoldCounts> {
        let c = HoldCounts::new(3);
        c.install(
            pairs.iter().map(|(i, n)| ((*i).to_string(), *n)).collect(),
            HashMap::new(),
            revision,
        );
        c
    }

    fn change(before: Option<&str>, after: Option<&str>) -> Change {
        Change {
            key: "k".into(),
            session: 1,
            before: before.map(str::to_string),
            after: after.map(str::to_string),
            ended: None,
        }
    }

    #[test]
    fn nothing_is_admitted_before_the_first_count() {
        let c = HoldCounts::new(3);
        assert!(matches!(
            c.admit("a", "k"),
            Err(ArbiterError::StoreUnavailable { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn an_acquire_before_the_first_count_waits_for_it_within_its_bound() {
        let c = HoldCounts::new(3);
        // no count within the wait: refused, saying why
        let refused = c.admit_within("a", "k", Duration::from_secs(2)).await;
        assert!(matches!(
            refused,
            Err(ArbiterError::StoreUnavailable { .. })
        ));
        // a count that arrives during the wait admits it
        let waiting = {
            let c = Arc::clone(&c);
            tokio::spawn(async move {
                c.admit_within("a", "k", Duration::from_secs(5))
                    .await
                    .is_ok()
            })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        c.install(HashMap::new(), HashMap::new(), 3);
        assert!(waiting.await.unwrap_or(false));
        assert_eq!(
            c.held("a"),
            Some(0),
            "the admitted call ended without a grant"
        );
    }

    #[test]
    fn the_bound_counts_holds_in_the_log_and_acquires_in_flight() {
        let c = counted(&[("a", 2)], 10);
        let first = c.admit("a", "k");
        assert!(first.is_ok());
        // 2 in the log + 1 in flight = 3: the next is refused
        assert!(matches!(
            c.admit("a", "k"),
            Err(ArbiterError::IdentityLimit {
                bound: IdentityBound::Holds,
                limit: 3
            })
        ));
        // another identity is not affected
        assert!(c.admit("b", "k").is_ok());
        // an Acquire that ends without a grant stops counting at once
        drop(first);
        assert_eq!(c.held("a"), Some(2));
        assert!(c.admit("a", "k").is_ok());
    }

    #[test]
    fn a_grant_counts_until_the_watch_shows_it_then_once() {
        let c = counted(&[], 10);
        let admitted = c.admit("a", "k").map_err(|e| e.to_string());
        admitted.map(|a| a.granted(12)).ok();
        assert_eq!(c.held("a"), Some(1));
        // the watch shows revision 11 only: still pending
        c.apply(&[], 11);
        assert_eq!(c.held("a"), Some(1));
        // the watch shows the grant at 12: counted in the log, not twice
        c.apply(&[change(None, Some("a"))], 12);
        assert_eq!(c.held("a"), Some(1));
    }

    #[test]
    fn a_grant_the_watch_shows_before_its_answer_counts_once() {
        let c = counted(&[], 10);
        let one = c.admit("a", "k1").map_err(|e| e.to_string());
        let two = c.admit("a", "k2").map_err(|e| e.to_string());
        assert_eq!(c.held("a"), Some(2));
        // k1's grant reaches the watch while its call is still in flight
        let mut granted = change(None, Some("a"));
        granted.key = "k1".into();
        c.apply(&[granted], 11);
        assert_eq!(c.held("a"), Some(2), "k1 once (in the log), k2 in flight");
        // then its answer arrives: still once
        one.map(|a| a.granted(11)).ok();
        assert_eq!(c.held("a"), Some(2));
        // a grant of another key of a's (another arbiter's) matches nothing here
        let mut elsewhere = change(None, Some("a"));
        elsewhere.key = "k9".into();
        c.apply(&[elsewhere], 12);
        assert_eq!(c.held("a"), Some(3));
        drop(two);
        assert_eq!(c.held("a"), Some(2));
    }

    #[test]
    fn a_grant_the_watch_already_showed_is_not_pending() {
        let c = counted(&[("a", 1)], 20);
        c.admit("a", "k").map(|a| a.granted(15)).ok();
        assert_eq!(c.held("a"), Some(1));
    }

    #[test]
    fn releases_hand_overs_and_expiries_move_the_count() {
        let c = counted(&[("a", 2), ("b", 1)], 5);
        // a hand-over from a to b
        c.apply(&[change(Some("a"), Some("b"))], 6);
        assert_eq!((c.held("a"), c.held("b")), (Some(1), Some(2)));
        // an expiry ends b's two holds in one revision
        c.apply(&[change(Some("b"), None), change(Some("b"), None)], 7);
        assert_eq!(c.held("b"), Some(0));
        // a rewrite of a's hold (same owner) changes nothing
        c.apply(&[change(Some("a"), Some("a"))], 8);
        assert_eq!(c.held("a"), Some(1));
    }

    #[test]
    fn identities_without_holds_leave_the_map() {
        let c = counted(&[("a", 1)], 5);
        c.apply(&[change(Some("a"), None)], 6);
        assert!(c.lock().in_log.as_ref().is_some_and(HashMap::is_empty));
        assert!(c.lock().pending.is_empty());
    }

    #[test]
    fn a_delete_without_its_previous_value_asks_for_a_recount() {
        assert_eq!(Change::of("/l/", EventType::Delete, None, None), None);
    }

    #[test]
    fn held_keys_follow_the_log_for_the_quorum_loss_check() {
        let c = HoldCounts::new(3);
        assert!(!c.held_by_other("k1", 7), "nothing before the first count");
        c.install(
            HashMap::from([("a".to_string(), 1)]),
            HashMap::from([("k1".to_string(), 7)]),
            10,
        );
        assert!(c.held_by_other("k1", 8));
        assert!(!c.held_by_other("k1", 7), "the holder's own session");
        // a hand-over to session 9, a new hold of k2, then k1 released
        let mut handed = change(Some("a"), Some("b"));
        (handed.key, handed.session) = ("k1".into(), 9);
        let mut granted = change(None, Some("a"));
        (granted.key, granted.session) = ("k2".into(), 7);
        c.apply(&[handed, granted], 11);
        assert!(c.held_by_other("k1", 7) && !c.held_by_other("k1", 9));
        assert!(c.held_by_other("k2", 9));
        let mut released = change(Some("b"), None);
        released.key = "k1".into();
        c.apply(&[released], 12);
        assert!(!c.held_by_other("k1", 7));
    }

    #[test]
    fn prefix_end_is_etcds() {
        assert_eq!(prefix_end("/latchkey/l/"), b"/latchkey/l0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }
}
