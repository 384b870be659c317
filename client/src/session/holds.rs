//! ADR-13's re-entrancy count: per key within one session, kept here and
//! never in the lock log. Only the outermost acquire and the final release
//! reach the arbiter; while either is in flight, other acquirers of the key
//! wait for it to settle.

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
    /// A shared hold (`Mode::Shared`); `false`: exclusive.
    pub(crate) shared: bool,
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
            count: AtomicU32::new(0),
            ended: AtomicBool::new(false),
            shared: false,
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
            Some(Entry::Acquiring(settled)) | Some(Entry::Releasing(settled)) => {
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
        match self.keys.get(key) {
            Some(Entry::Held(hold)) if hold.revision == revision => {
                hold.ended.store(true, Ordering::Release);
                self.keys.remove(key);
                true
            }
            _ => false,
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
    if let Some(Entry::Acquiring(settled) | Entry::Releasing(settled)) = entry {
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
