//! ADR-13's re-entrancy count: per key within one session, kept here and
//! never in the lock log. Only the outermost acquire and the final release
//! reach the arbiter; while either is in flight, other acquirers of the key
//! wait for it to settle. A downgrade (exclusive to shared) of a hold with
//! one guard is in flight the same way: the key's entry is the old hold
//! until the arbiter's answer replaces it with the shared one.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

use crate::token::FencingToken;

/// One grant of a key, shared by every guard of the same hold.
#[derive(Debug)]
pub(crate) struct Hold {
    pub(crate) key: String,
    pub(crate) session_id: i64,
    pub(crate) token: FencingToken,
    pub(crate) epoch: u32,
    pub(crate) revision: i64,
    /// The semaphore slot held (a semaphore class's grant); `None`: a lock.
    pub(crate) slot: Option<u32>,
    /// A semaphore class's permits, as its grant said (`Grant.permits`).
    pub(crate) permits: Option<u32>,
    /// A shared hold (`Mode::Shared`); `false`: exclusive.
    pub(crate) shared: bool,
    /// The class and metadata of the acquire that was granted: a downgrade
    /// is an Acquire of the key again, which the class's hooks see too.
    pub(crate) class: String,
    pub(crate) metadata: HashMap<String, String>,
    /// Changed only under the session's state lock; read anywhere.
    count: AtomicU32,
    /// The arbiter said this hold ended before it was released.
    ended: AtomicBool,
}

impl Hold {
    pub(crate) fn new(
        key: String,
        session_id: i64,
        token: FencingToken,
        epoch: u32,
        revision: i64,
    ) -> Self {
        Self {
            key,
            session_id,
            token,
            epoch,
            revision,
            slot: None,
            permits: None,
            count: AtomicU32::new(0),
            ended: AtomicBool::new(false),
            shared: false,
            class: String::new(),
            metadata: HashMap::new(),
        }
    }

    pub(crate) fn count(&self) -> u32 {
        self.count.load(Ordering::Acquire)
    }

    /// Whether the arbiter said this hold ended (it was fenced for it).
    pub(crate) fn has_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }
}

pub(crate) enum Begin {
    /// The key is already held: the count went up, no call needed.
    Reentered(Arc<Hold>),
    /// An outermost acquire or a final release of the key is in flight.
    /// The future resolves when it settles; then try again.
    Wait(OwnedNotified),
    /// The caller must send Acquire, then call `granted` or `failed`.
    Outermost,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decrement {
    Remaining(u32),
    /// The count reached zero: the caller sends Release (or not, if the
    /// session is dead), then calls `released`.
    Last,
    /// The guard's hold is not the key's current hold (already settled).
    NotHeld,
}

enum Entry {
    Acquiring(Arc<Notify>),
    Held(Arc<Hold>),
    Releasing(Arc<Notify>),
    /// `hold`, held exclusively with one guard, is being downgraded.
    /// `ended`: the arbiter said meanwhile that `hold` ended — what a
    /// downgrade that landed looks like too, so it is acted on only if the
    /// downgrade fails. `ended_after`: the arbiter said a later hold of the
    /// key ended (at that revision) — the downgrade's own shared hold, whose
    /// notice can beat the answer (its `maxHoldSeconds` counts from the
    /// exclusive grant): acted on when the downgrade is answered.
    Downgrading {
        hold: Arc<Hold>,
        settled: Arc<Notify>,
        ended: bool,
        ended_after: Option<i64>,
    },
}

/// Why a hold cannot be downgraded now.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NoDowngrade {
    /// It is not the key's current hold (it ended, or was released).
    NotHeld,
    /// Other guards of the hold (nested acquires) exist: each expects the
    /// exclusive hold it acquired.
    Nested(u32),
}

#[derive(Default)]
pub(crate) struct Holds {
    keys: HashMap<String, Entry>,
}

impl Holds {
    pub(crate) fn begin(&mut self, key: &str) -> Begin {
        match self.keys.get(key) {
            Some(Entry::Held(hold)) => {
                hold.count.fetch_add(1, Ordering::AcqRel);
                Begin::Reentered(Arc::clone(hold))
            }
            // The Notified is created under the caller's lock, so a
            // notify_waiters between unlock and await is not lost.
            Some(Entry::Acquiring(settled))
            | Some(Entry::Releasing(settled))
            | Some(Entry::Downgrading { settled, .. }) => {
                Begin::Wait(Arc::clone(settled).notified_owned())
            }
            None => {
                self.keys
                    .insert(key.to_owned(), Entry::Acquiring(Arc::new(Notify::new())));
                Begin::Outermost
            }
        }
    }

    pub(crate) fn granted(&mut self, hold: Arc<Hold>) {
        hold.count.store(1, Ordering::Release);
        let previous = self.keys.insert(hold.key.clone(), Entry::Held(hold));
        wake(previous);
    }

    /// The hold of `key` at `revision` ended at the arbiter: if it is the
    /// key's current hold, it leaves (its guards count down to nothing and
    /// send no Release). Whether it was.
    pub(crate) fn ended(&mut self, key: &str, revision: i64) -> bool {
        match self.keys.get_mut(key) {
            Some(Entry::Held(hold)) if hold.revision == revision => {
                hold.ended.store(true, Ordering::Release);
                self.keys.remove(key);
                true
            }
            // The downgrade's own end of the exclusive hold, or another:
            // which one is known when the downgrade is answered.
            Some(Entry::Downgrading { hold, ended, .. }) if hold.revision == revision => {
                *ended = true;
                false
            }
            Some(Entry::Downgrading {
                hold, ended_after, ..
            }) if revision > hold.revision => {
                *ended_after = Some(revision);
                false
            }
            _ => false,
        }
    }

    /// Starts a downgrade of `hold`: it must be the key's current hold and
    /// have no other guard. Until [`Holds::downgraded`] or
    /// [`Holds::downgrade_failed`], other acquirers of the key wait.
    pub(crate) fn begin_downgrade(&mut self, hold: &Arc<Hold>) -> Result<(), NoDowngrade> {
        let Some(Entry::Held(current)) = self.keys.get(&hold.key) else {
            return Err(NoDowngrade::NotHeld);
        };
        if !Arc::ptr_eq(current, hold) {
            return Err(NoDowngrade::NotHeld);
        }
        let count = hold.count();
        if count > 1 {
            return Err(NoDowngrade::Nested(count));
        }
        self.keys.insert(
            hold.key.clone(),
            Entry::Downgrading {
                hold: Arc::clone(hold),
                settled: Arc::new(Notify::new()),
                ended: false,
                ended_after: None,
            },
        );
        Ok(())
    }

    /// The arbiter granted the downgrade: `shared` is the key's hold now,
    /// with the one guard the exclusive hold had — unless the arbiter said
    /// already that it ended: then it leaves at once, as [`Holds::ended`]
    /// would have done. Whether it ended.
    pub(crate) fn downgraded(&mut self, shared: Arc<Hold>) -> bool {
        let Some(Entry::Downgrading { ended_after, .. }) = self.keys.get(&shared.key) else {
            return false;
        };
        shared.count.store(1, Ordering::Release);
        if *ended_after == Some(shared.revision) {
            shared.ended.store(true, Ordering::Release);
            wake(self.keys.remove(&shared.key));
            return true;
        }
        let previous = self.keys.insert(shared.key.clone(), Entry::Held(shared));
        wake(previous);
        false
    }

    /// The downgrade of `key` failed: its exclusive hold is the key's hold
    /// again — unless the arbiter said meanwhile that it ended; then it
    /// leaves, as [`Holds::ended`] would have done. Whether it ended.
    pub(crate) fn downgrade_failed(&mut self, key: &str) -> bool {
        let Some(Entry::Downgrading { hold, ended, .. }) = self.keys.get(key) else {
            return false;
        };
        let (hold, ended) = (Arc::clone(hold), *ended);
        let previous = if ended {
            hold.ended.store(true, Ordering::Release);
            self.keys.remove(key)
        } else {
            self.keys.insert(key.to_owned(), Entry::Held(hold))
        };
        wake(previous);
        ended
    }

    /// The downgrade of `key` left its guard without a hold: the exclusive
    /// hold ends here (its guard is fenced). With `cleaning`, the key stays
    /// in flight until [`Holds::downgrade_cleaned`] (the downgrade may have
    /// landed, and is asked again so that its shared hold is released; a
    /// new acquire of the key meanwhile could be answered with a hold that
    /// clean-up is about to convert). Whether it was the key's downgrade.
    pub(crate) fn downgrade_lost(&mut self, key: &str, cleaning: bool) -> bool {
        let Some(Entry::Downgrading { hold, .. }) = self.keys.get(key) else {
            return false;
        };
        hold.ended.store(true, Ordering::Release);
        if !cleaning {
            wake(self.keys.remove(key));
        }
        true
    }

    /// See [`Holds::downgrade_lost`].
    pub(crate) fn downgrade_cleaned(&mut self, key: &str) {
        if matches!(self.keys.get(key), Some(Entry::Downgrading { hold, .. }) if hold.has_ended()) {
            wake(self.keys.remove(key));
        }
    }

    pub(crate) fn failed(&mut self, key: &str) {
        if matches!(self.keys.get(key), Some(Entry::Acquiring(_))) {
            wake(self.keys.remove(key));
        }
    }

    pub(crate) fn decrement(&mut self, hold: &Arc<Hold>) -> Decrement {
        let Some(Entry::Held(current)) = self.keys.get(&hold.key) else {
            return Decrement::NotHeld;
        };
        if !Arc::ptr_eq(current, hold) {
            return Decrement::NotHeld;
        }
        let before = hold.count.fetch_sub(1, Ordering::AcqRel);
        if before > 1 {
            return Decrement::Remaining(before - 1);
        }
        self.keys
            .insert(hold.key.clone(), Entry::Releasing(Arc::new(Notify::new())));
        Decrement::Last
    }

    pub(crate) fn released(&mut self, key: &str) {
        if matches!(self.keys.get(key), Some(Entry::Releasing(_))) {
            wake(self.keys.remove(key));
        }
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

fn wake(entry: Option<Entry>) {
    if let Some(
        Entry::Acquiring(settled) | Entry::Releasing(settled) | Entry::Downgrading { settled, .. },
    ) = entry
    {
        settled.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn hold(key: &str) -> Arc<Hold> {
        Arc::new(Hold::new(key.into(), 7, FencingToken::new(42), 1, 42))
    }

    #[test]
    fn only_outermost_acquire_and_final_release_reach_the_arbiter() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("a/b"), Begin::Outermost));
        let h = hold("a/b");
        holds.granted(Arc::clone(&h));
        assert_eq!(h.count(), 1);

        for expected in 2..=3 {
            let Begin::Reentered(again) = holds.begin("a/b") else {
                panic!("nested acquire must not go to the arbiter");
            };
            assert!(Arc::ptr_eq(&again, &h));
            assert_eq!(h.count(), expected);
        }

        assert_eq!(holds.decrement(&h), Decrement::Remaining(2));
        assert_eq!(holds.decrement(&h), Decrement::Remaining(1));
        assert_eq!(holds.decrement(&h), Decrement::Last);
        assert_eq!(h.count(), 0);
        holds.released("a/b");
        assert!(holds.is_empty());
        assert!(matches!(holds.begin("a/b"), Begin::Outermost));
    }

    #[test]
    fn keys_are_counted_separately() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("a"), Begin::Outermost));
        assert!(matches!(holds.begin("b"), Begin::Outermost));
        let (a, b) = (hold("a"), hold("b"));
        holds.granted(Arc::clone(&a));
        holds.granted(Arc::clone(&b));
        assert!(matches!(holds.begin("a"), Begin::Reentered(_)));
        assert_eq!(a.count(), 2);
        assert_eq!(b.count(), 1);
        assert_eq!(holds.decrement(&b), Decrement::Last);
        assert_eq!(holds.decrement(&a), Decrement::Remaining(1));
    }

    #[test]
    fn acquirers_wait_while_the_outermost_acquire_is_in_flight() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let Begin::Wait(waiter) = holds.begin("k") else {
            panic!("second acquirer must wait for the first");
        };
        let mut waiter = Box::pin(waiter);
        assert!(waiter.as_mut().now_or_never().is_none());
        holds.granted(hold("k"));
        assert!(waiter.now_or_never().is_some());
        assert!(matches!(holds.begin("k"), Begin::Reentered(_)));
    }

    #[test]
    fn a_failed_outermost_acquire_frees_the_key_and_wakes_waiters() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let Begin::Wait(waiter) = holds.begin("k") else {
            panic!("must wait");
        };
        holds.failed("k");
        assert!(waiter.now_or_never().is_some());
        assert!(holds.is_empty());
    }

    #[test]
    fn acquirers_wait_while_the_final_release_is_in_flight() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let h = hold("k");
        holds.granted(Arc::clone(&h));
        assert_eq!(holds.decrement(&h), Decrement::Last);
        let Begin::Wait(waiter) = holds.begin("k") else {
            panic!("a new acquire must not overtake the release");
        };
        holds.released("k");
        assert!(waiter.now_or_never().is_some());
        assert!(matches!(holds.begin("k"), Begin::Outermost));
    }

    fn shared(key: &str, revision: i64) -> Arc<Hold> {
        let mut h = Hold::new(
            key.into(),
            7,
            FencingToken::new(revision as u64),
            1,
            revision,
        );
        h.shared = true;
        Arc::new(h)
    }

    #[test]
    fn a_downgrade_replaces_the_hold_and_acquirers_wait_for_it() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let old = hold("k");
        holds.granted(Arc::clone(&old));
        holds.begin_downgrade(&old).unwrap();
        let Begin::Wait(waiter) = holds.begin("k") else {
            panic!("an acquirer must wait for the downgrade");
        };
        // The arbiter's notice of the exclusive hold's end (the downgrade's
        // own) fences nothing while the downgrade is in flight.
        assert!(!holds.ended("k", 42));
        let new = shared("k", 50);
        holds.downgraded(Arc::clone(&new));
        assert!(waiter.now_or_never().is_some());
        assert!(!old.has_ended());
        assert_eq!(new.count(), 1);
        // The old hold's guard is stale; the new one counts down.
        assert_eq!(holds.decrement(&old), Decrement::NotHeld);
        assert_eq!(holds.decrement(&new), Decrement::Last);
    }

    #[test]
    fn a_failed_downgrade_keeps_the_exclusive_hold_unless_it_ended_meanwhile() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let old = hold("k");
        holds.granted(Arc::clone(&old));
        holds.begin_downgrade(&old).unwrap();
        assert!(!holds.downgrade_failed("k"));
        assert!(!old.has_ended());
        assert!(matches!(holds.begin("k"), Begin::Reentered(_)));
        assert_eq!(holds.begin_downgrade(&old), Err(NoDowngrade::Nested(2)));
        assert_eq!(holds.decrement(&old), Decrement::Remaining(1));

        holds.begin_downgrade(&old).unwrap();
        assert!(!holds.ended("k", 42));
        assert!(holds.downgrade_failed("k"));
        assert!(old.has_ended());
        assert!(holds.is_empty());
        assert_eq!(holds.begin_downgrade(&old), Err(NoDowngrade::NotHeld));
    }

    #[test]
    fn the_shared_holds_end_heard_before_the_downgrades_answer_ends_it() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let old = hold("k");
        holds.granted(Arc::clone(&old));
        holds.begin_downgrade(&old).unwrap();
        // The shared hold's end (a later revision) comes first.
        assert!(!holds.ended("k", old.revision + 5));
        let mut shared = Hold::new(
            "k".into(),
            old.session_id,
            crate::token::FencingToken::new(old.token.get() + 5),
            old.epoch,
            old.revision + 5,
        );
        shared.shared = true;
        let shared = Arc::new(shared);
        assert!(holds.downgraded(Arc::clone(&shared)), "it ended already");
        assert!(shared.has_ended());
        assert!(holds.is_empty());

        // A notice of another revision leaves the downgraded hold alone.
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let next = hold("k");
        holds.granted(Arc::clone(&next));
        holds.begin_downgrade(&next).unwrap();
        assert!(!holds.ended("k", next.revision + 1));
        let mut shared = Hold::new(
            "k".into(),
            next.session_id,
            crate::token::FencingToken::new(next.token.get() + 2),
            next.epoch,
            next.revision + 2,
        );
        shared.shared = true;
        let shared = Arc::new(shared);
        assert!(!holds.downgraded(Arc::clone(&shared)));
        assert!(!shared.has_ended());
    }

    #[test]
    fn a_lost_downgrade_fences_its_hold_and_a_cleaning_one_keeps_acquirers_waiting() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let old = hold("k");
        holds.granted(Arc::clone(&old));
        holds.begin_downgrade(&old).unwrap();
        // NOT_HELD: fenced, the key free at once.
        assert!(holds.downgrade_lost("k", false));
        assert!(old.has_ended());
        assert!(holds.is_empty());
        assert_eq!(holds.decrement(&old), Decrement::NotHeld);

        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let next = hold("k");
        holds.granted(Arc::clone(&next));
        holds.begin_downgrade(&next).unwrap();
        // Unknown: fenced now, the key in flight until the clean-up ends.
        assert!(holds.downgrade_lost("k", true));
        assert!(next.has_ended());
        let Begin::Wait(waiter) = holds.begin("k") else {
            panic!("an acquirer must wait for the clean-up");
        };
        holds.downgrade_cleaned("k");
        assert!(waiter.now_or_never().is_some());
        assert!(holds.is_empty());
        assert!(matches!(holds.begin("k"), Begin::Outermost));
    }

    #[test]
    fn a_stale_guard_cannot_decrement_a_newer_hold() {
        let mut holds = Holds::default();
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let old = hold("k");
        holds.granted(Arc::clone(&old));
        assert_eq!(holds.decrement(&old), Decrement::Last);
        holds.released("k");
        assert!(matches!(holds.begin("k"), Begin::Outermost));
        let new = hold("k");
        holds.granted(Arc::clone(&new));
        assert_eq!(holds.decrement(&old), Decrement::NotHeld);
        assert_eq!(new.count(), 1);
    }
}
