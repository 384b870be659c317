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
//! and holds ended by release, hand-over, expiry or an operator alike. The
//! counting is shared with the session bound ([`crate::subject_counts`],
//! followed by [`crate::follow`]).
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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tracing::info;

use crate::error::{ArbiterError, IdentityBound};
use crate::follow::{Event, Followed};
use crate::lock_log::Kv;
use crate::records::{HolderRecord, decode};
use crate::subject_counts::{self, SubjectCounts};

mod notices;
pub use notices::Notices;
use notices::Unclaimed;
pub use subject_counts::Admitted;

/// The default `--max-holds-per-identity`.
pub const DEFAULT_MAX_HOLDS_PER_IDENTITY: u32 = 20_000;

pub struct HoldCounts {
    counts: Arc<SubjectCounts>,
    /// Per session, the KeepAlive streams (by id) that renew it here and
    /// want to hear of its holds' ends.
    watchers: Mutex<HashMap<i64, Vec<(u64, Notices)>>>,
    /// Ended holds of sessions no stream here watched yet, newest last: a
    /// stream that starts watching a session soon after (a hold taken and
    /// ended right after the session opened, before its first renewal)
    /// still hears of them. Bounded in count and age.
    unclaimed: Mutex<Unclaimed>,
    next_stream: AtomicU64,
    /// Every held key in the log and its holder's session (lease), as far
    /// as the watch has seen: what an open class's memory grant must not
    /// take during a quorum loss.
    keys: Mutex<HashMap<String, i64>>,
    /// `keys` follows the log: read, and the watch since unbroken.
    following: AtomicBool,
}

impl HoldCounts {
    pub fn new(max: u32) -> Arc<Self> {
        Arc::new(Self {
            counts: SubjectCounts::new(max, IdentityBound::Holds, "holds"),
            watchers: Mutex::new(HashMap::new()),
            unclaimed: Mutex::new(Unclaimed::default()),
            next_stream: AtomicU64::new(1),
            keys: Mutex::new(HashMap::new()),
            following: AtomicBool::new(false),
        })
    }

    /// [`Self::admit`], but an Acquire that arrives before the first count
    /// is in (an arbiter that just started) waits for it, at most `wait`,
    /// instead of being refused at once.
    pub async fn admit_within(
        &self,
        identity: &str,
        key: &str,
        wait: Duration,
    ) -> Result<Admitted, ArbiterError> {
        self.admit_within_beside(identity, key, 0, wait).await
    }

    /// [`Self::admit_within`], counting `beside` more holds of `identity`
    /// (its holds on the other tier's cluster: the bound is over both).
    pub async fn admit_within_beside(
        &self,
        identity: &str,
        key: &str,
        beside: u32,
        wait: Duration,
    ) -> Result<Admitted, ArbiterError> {
        self.counts.counted_within(wait).await?;
        self.counts.admit_beside(identity, key, beside)
    }

    /// Admits one Acquire of `key` by `identity`, or refuses it:
    /// `IdentityLimit` at the bound, `StoreUnavailable` before the first
    /// count is in. Dropped without [`Admitted::written`] (the grant's
    /// revision), it stops counting at once.
    pub fn admit(&self, identity: &str, key: &str) -> Result<Admitted, ArbiterError> {
        self.counts.admit_beside(identity, key, 0)
    }

    /// Holds of `identity` as counted (log plus pending); `None` before the
    /// first count.
    pub fn held(&self, identity: &str) -> Option<u32> {
        self.counts.held(identity)
    }

    /// Whether `key` may be held in the log by a session other than
    /// `session`: as last seen by the watch, and `true` for every key while
    /// the count does not follow the log (before the first read, and from a
    /// broken watch until the next read), when a hold granted meanwhile
    /// would go unseen. (What a grant from memory during a quorum loss must
    /// not take: the simulation's quorum losses found such a grant of a key
    /// held since before the loss.)
    pub fn held_by_other(&self, key: &str, session: i64) -> bool {
        if !self.following.load(Ordering::Acquire) {
            return true;
        }
        self.keys.lock().get(key).is_some_and(|s| *s != session)
    }

    /// Replaces the count with a fresh one read at `revision`.
    fn install(&self, in_log: HashMap<String, u32>, keys: HashMap<String, i64>, revision: i64) {
        *self.keys.lock() = keys;
        self.following.store(true, Ordering::Release);
        self.counts.install(in_log, revision);
    }

    /// Applies one watch response's changes, all at or below `revision`.
    fn apply(&self, changes: &[Change], revision: i64) {
        {
            let mut keys = self.keys.lock();
            for change in changes {
                match (&change.counted.after, change.session) {
                    (Some(_), session) => keys.insert(change.counted.key.clone(), session),
                    (None, _) => keys.remove(&change.counted.key),
                };
            }
        }
        let counted: Vec<_> = changes.iter().map(|c| c.counted.clone()).collect();
        self.counts.apply(&counted, revision);
    }
}

/// Read from scratch: holds per subject, and each held key's session.
#[derive(Default)]
pub struct Reading {
    counted: HashMap<String, u32>,
    keys: HashMap<String, i64>,
}

impl Followed for HoldCounts {
    type Reading = Reading;
    const WHAT: &'static str = "holds";
    // A deleted holder record says whose hold it was only in its value.
    const PREV_KV: bool = true;

    fn read(reading: &mut Reading, key: &str, kv: &Kv) {
        if let Some(h) = decode::<HolderRecord>(&kv.value) {
            *reading
                .counted
                .entry(h.bounded_as().to_string())
                .or_insert(0) += 1;
            reading.keys.insert(key.to_string(), kv.lease);
        }
    }

    fn install(&self, reading: Reading, revision: i64) {
        let first = !self.counts.is_counted();
        let (identities, holds) = (reading.counted.len(), reading.counted.values().sum::<u32>());
        self.install(reading.counted, reading.keys, revision);
        if first {
            info!(holds, identities, "counted the holds in the lock log");
        }
    }

    fn apply(&self, events: &[Event], revision: i64) -> bool {
        let Some(changes) = events.iter().map(Change::of).collect::<Option<Vec<_>>>() else {
            // A delete whose previous value etcd no longer had.
            return false;
        };
        self.apply(&changes, revision);
        self.notify(&changes);
        true
    }

    fn lost(&self) {
        self.following.store(false, Ordering::Release);
    }
}

/// Whose hold a change of one holder record ended and whose it started.
#[derive(Debug, PartialEq, Eq)]
struct Change {
    /// The lock key (the holder record's key without the prefix) and whose
    /// hold it was and is.
    counted: subject_counts::Change,
    /// The new holder's session (lease), for a put.
    session: i64,
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
    /// previous value): the caller counts again.
    fn of(event: &Event) -> Option<Self> {
        // Counted per grant subject (a pattern for per-pod identities).
        let owner = |kv: &Kv| decode::<HolderRecord>(&kv.value).map(|h| h.bounded_as().to_string());
        if event.put.is_none() {
            event.prev.as_ref()?;
        }
        // Any change of a holder record ends the hold it replaces: a
        // release, a hand-over (a put with the next holder) or an expiry.
        let ended = event.prev.as_ref().map(|p| Ended {
            session: p.lease,
            key: event.key.clone(),
            revision: p.mod_revision,
        });
        Some(Self {
            counted: subject_counts::Change {
                key: event.key.clone(),
                before: event.prev.as_ref().and_then(owner),
                after: event.put.as_ref().and_then(owner),
            },
            session: event.put.as_ref().map_or(0, |kv| kv.lease),
            ended,
        })
    }
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
            counted: subject_counts::Change {
                key: "k".into(),
                before: before.map(str::to_string),
                after: after.map(str::to_string),
            },
            session: 1,
            ended: None,
        }
    }

    fn keyed(mut change: Change, key: &str, session: i64) -> Change {
        change.counted.key = key.into();
        change.session = session;
        change
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
        admitted.map(|a| a.written(12)).ok();
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
        c.apply(&[keyed(change(None, Some("a")), "k1", 1)], 11);
        assert_eq!(c.held("a"), Some(2), "k1 once (in the log), k2 in flight");
        // then its answer arrives: still once
        one.map(|a| a.written(11)).ok();
        assert_eq!(c.held("a"), Some(2));
        // a grant of another key of a's (another arbiter's) matches nothing here
        c.apply(&[keyed(change(None, Some("a")), "k9", 1)], 12);
        assert_eq!(c.held("a"), Some(3));
        drop(two);
        assert_eq!(c.held("a"), Some(2));
    }

    #[test]
    fn a_grant_the_watch_already_showed_is_not_pending() {
        let c = counted(&[("a", 1)], 20);
        c.admit("a", "k").map(|a| a.written(15)).ok();
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
        assert_eq!(c.counts.subjects_in_log(), Some(0));
        assert_eq!(c.counts.pending_subjects(), 0);
    }

    #[test]
    fn a_delete_without_its_previous_value_asks_for_a_recount() {
        let delete = Event {
            key: "k".into(),
            put: None,
            prev: None,
        };
        assert_eq!(Change::of(&delete), None);
        let c = counted(&[("a", 1)], 5);
        assert!(!Followed::apply(c.as_ref(), &[delete], 6));
        assert_eq!(c.held("a"), Some(1), "nothing applied");
    }

    #[test]
    fn a_holder_record_says_whose_hold_it_is() {
        let record = |identity: &str, bound: &str, session: i64, revision: i64| Kv {
            value: crate::records::encode(&HolderRecord {
                identity: identity.into(),
                session,
                class: "demo".into(),
                acquired_at_unix_ms: 1,
                annotations: Default::default(),
                instance: String::new(),
                bound: bound.into(),
            }),
            create_revision: revision,
            mod_revision: revision,
            lease: session,
        };
        let mut reading = Reading::default();
        HoldCounts::read(&mut reading, "k1", &record("p1", "pods/*", 7, 3));
        HoldCounts::read(&mut reading, "k2", &record("b", "", 8, 4));
        let c = HoldCounts::new(3);
        Followed::install(c.as_ref(), reading, 4);
        assert_eq!((c.held("pods/*"), c.held("b")), (Some(1), Some(1)));
        assert!(c.held_by_other("k1", 8));
        // a hand-over of k1 from the pod to b
        let handed = Event {
            key: "k1".into(),
            put: Some(record("b", "", 8, 5)),
            prev: Some(record("p1", "pods/*", 7, 3)),
        };
        assert!(Followed::apply(c.as_ref(), &[handed], 5));
        assert_eq!((c.held("pods/*"), c.held("b")), (Some(0), Some(2)));
        assert!(!c.held_by_other("k1", 8));
    }

    #[test]
    fn held_keys_follow_the_log_for_the_quorum_loss_check() {
        let c = HoldCounts::new(3);
        assert!(
            c.held_by_other("k1", 7),
            "before the first count every key may be held"
        );
        c.install(
            HashMap::from([("a".to_string(), 1)]),
            HashMap::from([("k1".to_string(), 7)]),
            10,
        );
        assert!(c.held_by_other("k1", 8));
        assert!(!c.held_by_other("k1", 7), "the holder's own session");
        // a hand-over to session 9, a new hold of k2, then k1 released
        let handed = keyed(change(Some("a"), Some("b")), "k1", 9);
        let granted = keyed(change(None, Some("a")), "k2", 7);
        c.apply(&[handed, granted], 11);
        assert!(c.held_by_other("k1", 7) && !c.held_by_other("k1", 9));
        assert!(c.held_by_other("k2", 9));
        let released = keyed(change(Some("b"), None), "k1", 0);
        c.apply(&[released], 12);
        assert!(!c.held_by_other("k1", 7));
        // The watch broke: a hold granted now would go unseen until the
        // next read, so every key may be held again.
        Followed::lost(c.as_ref());
        assert!(c.held_by_other("k1", 7) && c.held_by_other("k3", 7));
        c.install(HashMap::new(), HashMap::new(), 13);
        assert!(!c.held_by_other("k1", 7));
    }
}
