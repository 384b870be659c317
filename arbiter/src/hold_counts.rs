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
//! Holds that end while the watch is down are told when the log is read
//! again: every hold the last view showed that the fresh read does not (the
//! key gone, or held again since) ended unseen.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;
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
    /// Every held key in the log and its hold, as far as the watch has
    /// seen: what an open class's memory grant must not take during a
    /// quorum loss, and what a read from scratch is compared with to tell
    /// of the holds that ended while the watch was down.
    keys: Mutex<BTreeMap<String, Hold>>,
    /// How far `keys` follows the log ([`View`]).
    view: Mutex<View>,
}

/// One hold in the log, as the follower last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hold {
    /// The holder's session (lease).
    session: i64,
    /// Its holder record's mod revision: the revision it was granted at,
    /// which tells it from a later hold of the key (by any session).
    revision: i64,
    /// The subject it is counted under (whose share of the unclaimed notices
    /// its end takes).
    owner: Arc<str>,
}

impl HoldCounts {
    pub fn new(max: u32) -> Arc<Self> {
        Arc::new(Self {
            counts: SubjectCounts::new(max, IdentityBound::Holds, "holds"),
            watchers: Mutex::new(HashMap::new()),
            unclaimed: Mutex::new(Unclaimed::default()),
            next_stream: AtomicU64::new(1),
            keys: Mutex::new(BTreeMap::new()),
            view: Mutex::new(View::Unread),
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

    /// The log revision the held keys reflect; `None` before the first read.
    pub fn seen_through(&self) -> Option<i64> {
        self.counts.revision()
    }

    /// Holds of `identity` as counted (log plus pending); `None` before the
    /// first count.
    pub fn held(&self, identity: &str) -> Option<u32> {
        self.counts.held(identity)
    }

    /// Whether `key` may be held in the log by a session other than
    /// `session`, as last seen by the watch: what a grant from memory during
    /// a quorum loss must not take. `true` for every key before the first
    /// read, and while the watch is broken if it broke before
    /// `log_answered` (the last time the lock cluster answered this
    /// arbiter's probe): the cluster went on committing after the break,
    /// and a hold granted then would be unseen. A watch that broke after
    /// that (with the loss, as it does when the members go) still shows
    /// what the cluster held, but for holds granted between the last answer
    /// and the loss's start after the watch broke (at most one probe
    /// interval).
    pub fn held_by_other(&self, key: &str, session: i64, log_answered: Option<Instant>) -> bool {
        match *self.view.lock() {
            View::Following => {}
            View::Unread => return true,
            View::Broken(at) if log_answered.is_some_and(|answered| at < answered) => {
                return true;
            }
            View::Broken(_) => {}
        }
        let keys = self.keys.lock();
        if keys.get(key).is_some_and(|h| h.session != session) {
            return true;
        }
        // A key is one kind, and one mode, at a time: a semaphore's held
        // slot or a lock's shared hold, whoever holds it, keeps the name
        // from a lock's memory grant too (one range read of the ordered
        // map: everything under `<key>//`).
        let under = crate::records::under_name(key);
        keys.range::<str, _>((
            std::ops::Bound::Included(under.as_str()),
            std::ops::Bound::Unbounded,
        ))
        .next()
        .is_some_and(|(held, _)| held.starts_with(&under))
    }

    /// Replaces the count with a fresh one read at `revision`, and tells of
    /// every hold that ended unseen since the last view (the watch was
    /// lost): as the watch would have told of its delete.
    fn install(&self, in_log: HashMap<String, u32>, keys: BTreeMap<String, Hold>, revision: i64) {
        let ended = {
            let mut held = self.keys.lock();
            let ended = ended_unseen(&held, &keys);
            *held = keys;
            ended
        };
        *self.view.lock() = View::Following;
        self.counts.install(in_log, revision);
        self.notify(&ended);
    }

    /// Applies one watch response's changes, all at or below `revision`.
    fn apply(&self, changes: &[Change], revision: i64) {
        {
            let mut keys = self.keys.lock();
            for change in changes {
                match &change.counted.after {
                    Some(owner) => keys.insert(
                        change.counted.key.clone(),
                        Hold {
                            session: change.session,
                            revision: change.revision,
                            owner: owner.as_str().into(),
                        },
                    ),
                    None => keys.remove(&change.counted.key),
                };
            }
        }
        let counted: Vec<_> = changes.iter().map(|c| c.counted.clone()).collect();
        self.counts.apply(&counted, revision);
    }
}

/// The holds `before` showed that `now` (a read from scratch) does not:
/// the key is gone, or held again since (a later hold, by whatever
/// session). Each ended as a delete or a put seen on the watch would have
/// said; in key order.
fn ended_unseen(before: &BTreeMap<String, Hold>, now: &BTreeMap<String, Hold>) -> Vec<Ended> {
    let mut ended: Vec<Ended> = before
        .iter()
        .filter(|(key, hold)| {
            now.get(*key)
                .is_none_or(|n| (n.session, n.revision) != (hold.session, hold.revision))
        })
        .map(|(key, hold)| Ended {
            session: hold.session,
            key: key.clone(),
            revision: hold.revision,
            owner: hold.owner.to_string(),
        })
        .collect();
    ended.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    ended
}

/// How far the held keys follow the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum View {
    /// Never read.
    Unread,
    /// Read, and the watch unbroken since.
    Following,
    /// The watch broke then, and has not been read again since.
    Broken(Instant),
}

/// Read from scratch: holds per subject, and each held key's hold.
#[derive(Default)]
pub struct Reading {
    counted: HashMap<String, u32>,
    keys: BTreeMap<String, Hold>,
    /// Each subject once, shared by its holds.
    owners: HashSet<Arc<str>>,
}

impl Reading {
    fn owner(&mut self, subject: &str) -> Arc<str> {
        if let Some(owner) = self.owners.get(subject) {
            return Arc::clone(owner);
        }
        let owner: Arc<str> = subject.into();
        self.owners.insert(Arc::clone(&owner));
        owner
    }
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
            let owner = reading.owner(h.bounded_as());
            reading.keys.insert(
                key.to_string(),
                Hold {
                    session: kv.lease,
                    revision: kv.mod_revision,
                    owner,
                },
            );
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
        self.notify(changes.iter().filter_map(|c| c.ended.as_ref()));
        true
    }

    fn lost(&self) {
        let mut view = self.view.lock();
        if *view == View::Following {
            *view = View::Broken(Instant::now());
        }
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
    /// The new hold's revision (its holder record's mod revision), for a put.
    revision: i64,
    /// The hold the change ended, if one did.
    ended: Option<Ended>,
}

/// A hold that ended, as its session's streams hear of it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ended {
    session: i64,
    key: String,
    revision: i64,
    /// The subject it was counted under (empty: not known).
    owner: String,
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
        let before = event.prev.as_ref().and_then(owner);
        let ended = event.prev.as_ref().map(|p| Ended {
            session: p.lease,
            key: event.key.clone(),
            revision: p.mod_revision,
            owner: before.clone().unwrap_or_default(),
        });
        Some(Self {
            counted: subject_counts::Change {
                key: event.key.clone(),
                before,
                after: event.put.as_ref().and_then(owner),
            },
            session: event.put.as_ref().map_or(0, |kv| kv.lease),
            revision: event.put.as_ref().map_or(0, |kv| kv.mod_revision),
            ended,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_proto::lockv1::EndedHold;

    pub(super) fn counted(pairs: &[(&str, u32)], revision: i64) -> Arc<HoldCounts> {
        let c = HoldCounts::new(3);
        c.install(
            pairs.iter().map(|(i, n)| ((*i).to_string(), *n)).collect(),
            BTreeMap::new(),
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
            revision: 1,
            ended: None,
        }
    }

    fn hold(session: i64, revision: i64, owner: &str) -> Hold {
        Hold {
            session,
            revision,
            owner: owner.into(),
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
        c.install(HashMap::new(), BTreeMap::new(), 3);
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
                quota_place: None,
                downgraded_from: None,
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
        assert!(c.held_by_other("k1", 8, None));
        // a hand-over of k1 from the pod to b
        let handed = Event {
            key: "k1".into(),
            put: Some(record("b", "", 8, 5)),
            prev: Some(record("p1", "pods/*", 7, 3)),
        };
        assert!(Followed::apply(c.as_ref(), &[handed], 5));
        assert_eq!((c.held("pods/*"), c.held("b")), (Some(0), Some(2)));
        assert!(!c.held_by_other("k1", 8, None));
    }

    #[test]
    fn held_keys_follow_the_log_for_the_quorum_loss_check() {
        let c = HoldCounts::new(3);
        assert!(
            c.held_by_other("k1", 7, None),
            "before the first count every key may be held"
        );
        c.install(
            HashMap::from([("a".to_string(), 1)]),
            BTreeMap::from([("k1".to_string(), hold(7, 10, "a"))]),
            10,
        );
        assert!(c.held_by_other("k1", 8, None));
        assert!(!c.held_by_other("k1", 7, None), "the holder's own session");
        // a hand-over to session 9, a new hold of k2, then k1 released
        let handed = keyed(change(Some("a"), Some("b")), "k1", 9);
        let granted = keyed(change(None, Some("a")), "k2", 7);
        c.apply(&[handed, granted], 11);
        assert!(c.held_by_other("k1", 7, None) && !c.held_by_other("k1", 9, None));
        assert!(c.held_by_other("k2", 9, None));
        let released = keyed(change(Some("b"), None), "k1", 0);
        c.apply(&[released], 12);
        assert!(!c.held_by_other("k1", 7, None));
        // The watch broke: a hold granted now would go unseen until the
        // next read, so every key may be held again.
        // The watch broke. If the lock cluster answered after that, it may
        // have committed holds the count did not see: every key may be
        // held. If it has not (the watch broke with the loss), what the
        // count saw stands.
        let before = Instant::now();
        Followed::lost(c.as_ref());
        let after = before + std::time::Duration::from_secs(1);
        assert!(c.held_by_other("k1", 7, Some(after)) && c.held_by_other("k3", 7, Some(after)));
        assert!(!c.held_by_other("k1", 7, Some(before)) && !c.held_by_other("k3", 7, None));
        c.install(HashMap::new(), BTreeMap::new(), 13);
        assert!(!c.held_by_other("k1", 7, Some(after)));
    }

    /// A holder record as the log stores it.
    fn record(identity: &str, session: i64, revision: i64) -> Kv {
        Kv {
            value: crate::records::encode(&HolderRecord {
                identity: identity.into(),
                session,
                class: "demo".into(),
                acquired_at_unix_ms: 1,
                annotations: Default::default(),
                instance: String::new(),
                bound: String::new(),
                quota_place: None,
                downgraded_from: None,
            }),
            create_revision: revision,
            mod_revision: revision,
            lease: session,
        }
    }

    fn reading(holds: &[(&str, &str, i64, i64)]) -> Reading {
        let mut reading = Reading::default();
        for (key, identity, session, revision) in holds {
            HoldCounts::read(&mut reading, key, &record(identity, *session, *revision));
        }
        reading
    }

    fn notices(rx: &mut tokio::sync::mpsc::Receiver<(i64, EndedHold)>) -> Vec<(i64, String, i64)> {
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|(session, hold)| (session, hold.key, hold.revision))
            .collect()
    }

    #[test]
    fn a_read_from_scratch_tells_of_the_holds_that_ended_unseen() {
        let c = HoldCounts::new(3);
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        c.watch_session(7, c.stream_id(), &tx);
        c.watch_session(8, c.stream_id(), &tx);
        // The first read tells of nothing: nothing was known before it.
        Followed::install(
            c.as_ref(),
            reading(&[
                ("k1", "a", 7, 3),
                ("k2", "b", 8, 4),
                ("k3", "a", 7, 5),
                ("k4", "a", 7, 6),
                ("k5", "c", 9, 6),
            ]),
            6,
        );
        assert_eq!(notices(&mut rx), vec![]);
        // The watch is lost; meanwhile k1 is released, k2 handed to session
        // 9, k4 released and taken again by its own session, k5 (session 9,
        // which no stream here renews) expires. k3 stays as it was.
        Followed::install(
            c.as_ref(),
            reading(&[("k2", "c", 9, 8), ("k3", "a", 7, 5), ("k4", "a", 7, 9)]),
            10,
        );
        assert_eq!(
            notices(&mut rx),
            vec![
                (7, "k1".to_string(), 3),
                (8, "k2".to_string(), 4),
                (7, "k4".to_string(), 6),
            ],
            "each ended hold at the revision it was granted at, as a delete on the watch would tell"
        );
        // k5's end waits for a stream that renews session 9.
        let (tx9, mut rx9) = tokio::sync::mpsc::channel(16);
        c.watch_session(9, c.stream_id(), &tx9);
        assert_eq!(notices(&mut rx9), vec![(9, "k5".to_string(), 6)]);
        // The view is the new read: counts and keys alike.
        assert_eq!(
            (c.held("a"), c.held("b"), c.held("c")),
            (Some(2), Some(0), Some(1))
        );
        assert!(c.held_by_other("k2", 8, None) && !c.held_by_other("k2", 9, None));
        assert!(!c.held_by_other("k1", 8, None));
    }

    /// The follow loop over a scripted log: each follow hands out the next
    /// read and a watch that gives its signals, then waits for good.
    struct ScriptedLog {
        rounds: Mutex<std::collections::VecDeque<Round>>,
    }

    struct Round {
        read: Vec<(&'static str, Kv)>,
        revision: i64,
        signals: Vec<crate::lock_log::FollowSignal>,
    }

    struct ScriptedWatch(std::collections::VecDeque<crate::lock_log::FollowSignal>);

    #[async_trait::async_trait]
    impl crate::lock_log::PrefixWatch for ScriptedWatch {
        async fn next(&mut self) -> crate::lock_log::FollowSignal {
            match self.0.pop_front() {
                Some(signal) => signal,
                None => std::future::pending().await,
            }
        }
    }

    #[async_trait::async_trait]
    impl crate::lock_log::FollowLog for ScriptedLog {
        async fn follow(
            &self,
            counted: crate::lock_log::Counted,
            prev_kv: bool,
            each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
        ) -> Result<
            (
                i64,
                Result<Box<dyn crate::lock_log::PrefixWatch>, crate::lock_log::StoreError>,
            ),
            crate::lock_log::StoreError,
        > {
            assert_eq!(counted, crate::lock_log::Counted::Holds);
            assert!(prev_kv, "a delete must say whose hold it was");
            let Some(round) = self.rounds.lock().pop_front() else {
                return std::future::pending().await;
            };
            for (key, kv) in &round.read {
                each(key, kv);
            }
            let watch: Box<dyn crate::lock_log::PrefixWatch> =
                Box::new(ScriptedWatch(round.signals.into()));
            Ok((round.revision, Ok(watch)))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_deleted_while_the_watch_was_lost_is_told_after_the_read_again() {
        use crate::lock_log::FollowSignal;
        let c = HoldCounts::new(3);
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        c.watch_session(7, c.stream_id(), &tx);
        let log = ScriptedLog {
            rounds: Mutex::new(
                [
                    // k1 held at 3; the watch shows k2 granted at 4, then
                    // breaks. k1 is released at 5, unseen.
                    Round {
                        read: vec![("k1", record("a", 7, 3))],
                        revision: 3,
                        signals: vec![
                            FollowSignal::Events {
                                events: vec![Event {
                                    key: "k2".into(),
                                    put: Some(record("a", 7, 4)),
                                    prev: None,
                                }],
                                through: 4,
                            },
                            FollowSignal::Lost,
                        ],
                    },
                    // The read again, at 5: only k2.
                    Round {
                        read: vec![("k2", record("a", 7, 4))],
                        revision: 5,
                        signals: vec![],
                    },
                ]
                .into(),
            ),
        };
        let follower = tokio::spawn(crate::follow::follow(
            Arc::clone(&c),
            Arc::new(log),
            crate::lock_log::Counted::Holds,
        ));
        let told = tokio::time::timeout(Duration::from_secs(30), rx.recv()).await;
        follower.abort();
        let (session, hold) = told.expect("told within the retry").expect("a notice");
        assert_eq!((session, hold.key.as_str(), hold.revision), (7, "k1", 3));
        assert_eq!(notices(&mut rx), vec![], "k2 lives on: nothing told of it");
        assert_eq!(c.held("a"), Some(1));
    }
}
