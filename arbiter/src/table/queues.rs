//! The table's memory: FIFO waiters per key (ADR-14, ADR-15). Plain data
//! under one lock; no I/O here.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::Mutex;

use tokio::sync::{Notify, oneshot};

use super::{Grant, GrantRequest};
use crate::error::ArbiterError;

/// What reaches a waiter: a grant, and whether it was made for this waiter
/// (`fresh`: a grant transaction or hand-over for it) or is its session's
/// existing hold, claimed for it. Only a fresh grant whose caller went away
/// is released as an orphan.
#[derive(Debug)]
pub(super) struct Delivery {
    pub(super) grant: Grant,
    pub(super) fresh: bool,
}

pub(super) type Reply = Result<Delivery, ArbiterError>;
/// A waiter's reply channel, taken by whichever path delivers first.
pub(super) type Slot = Arc<Mutex<Option<oneshot::Sender<Reply>>>>;

pub(super) struct Waiter {
    pub(super) id: u64,
    /// When it joined the queue (the console shows each waiter's age).
    pub(super) since: std::time::Instant,
    pub(super) req: GrantRequest,
    pub(super) slot: Slot,
    /// Whether a grant for this waiter may have committed without it
    /// hearing: see [`Unknown`].
    pub(super) uncertain: Arc<Unknown>,
    /// A writer's intent on the lock while it waits for shared holds to
    /// end (`super::intent`).
    pub(super) intent: Arc<super::intent::Intent>,
}

impl Waiter {
    /// The driver's handle on this waiter.
    fn head(&self) -> Head {
        Head {
            id: self.id,
            req: self.req.clone(),
            slot: self.slot.clone(),
            uncertain: self.uncertain.clone(),
            intent: self.intent.clone(),
        }
    }
}

/// Whether a waiter's grant may have committed without the waiter hearing
/// of it: a grant transaction (or a hand-over) for it failed without an
/// answer, or one is on its way. A wait that ends then must not say "not
/// granted" (WAIT_TIMEOUT) but "unknown": the session may hold the key, and
/// a grant whose answer was lost is never released as an orphan (the
/// release gate caught a WAIT_TIMEOUT beside such a grant; the second
/// hostile review of this stop, one whose transaction was still on its way
/// when the wait ended).
#[derive(Debug, Default)]
pub(super) struct Unknown {
    in_flight: AtomicU32,
    failed: AtomicBool,
    /// Woken when the last transaction on its way lands.
    settled: Notify,
}

impl Unknown {
    /// Whether the outcome of some grant for the waiter is unknown now.
    pub(super) fn now(&self) -> bool {
        self.failed.load(Ordering::Acquire) || self.in_flight.load(Ordering::Acquire) > 0
    }

    /// A grant transaction for the waiter failed without an answer.
    fn failed(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// The answer to a wait for `key` that ended ungranted (after
    /// [`Self::settle`]): WAIT_TIMEOUT only when no grant for it can have
    /// committed; otherwise unknown, and the caller asks again on the same
    /// session and learns its real token.
    pub(super) fn timed_out(&self, key: String) -> ArbiterError {
        if !self.now() {
            return ArbiterError::WaitTimeout { key };
        }
        ArbiterError::store(format!(
            "the wait for key {key:?} ended while a grant transaction for it had failed \
             without an answer or was still on its way: it may have committed; ask again on \
             the same session to learn whether this session holds the key"
        ))
    }

    /// Waits up to `bound` for every transaction on its way to land;
    /// whether they all did.
    pub(super) async fn settle(&self, bound: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let landed = self.settled.notified();
            tokio::pin!(landed);
            landed.as_mut().enable();
            if self.in_flight.load(Ordering::Acquire) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, landed).await.is_err() {
                return self.in_flight.load(Ordering::Acquire) == 0;
            }
        }
    }

    /// A grant transaction for the waiter is about to be sent: on its way
    /// until the guard drops (after a failure is marked).
    pub(super) fn sending(self: &Arc<Self>) -> Sending {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Sending {
            unknown: self.clone(),
            armed: true,
        }
    }
}

/// A grant transaction on its way ([`Unknown::sending`]). Ended with
/// [`Sending::done`] once its outcome is known and the waiter answered (or
/// it settled on waiting); dropped without that (an error, or the future
/// that sent it dropped — a cancelled Release mid-hand-over, a driver
/// stopped), the outcome is unknown and the waiter's wait says so (the
/// third hostile review of this stop).
pub(super) struct Sending {
    unknown: Arc<Unknown>,
    armed: bool,
}

impl Sending {
    /// The transaction's outcome is known and was acted on.
    pub(super) fn done(mut self) {
        self.armed = false;
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        if self.armed {
            self.unknown.failed();
        }
        if self.unknown.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.unknown.settled.notify_waiters();
        }
    }
}

pub(super) struct KeyQueue {
    pub(super) waiters: VecDeque<Waiter>,
    pub(super) kick: Arc<Notify>,
}

/// The head of a key's queue, as a driver or a hand-over sees it.
pub(super) struct Head {
    pub id: u64,
    pub req: GrantRequest,
    pub(super) slot: Slot,
    pub(super) uncertain: Arc<Unknown>,
    pub(super) intent: Arc<super::intent::Intent>,
}

impl Head {
    /// Whether the waiter's caller is gone (its wait ended, or the call was
    /// dropped) or it was answered already: nothing may be done for it
    /// that cannot be undone when nobody hears of it.
    pub(super) fn caller_gone(&self) -> bool {
        self.slot.lock().as_ref().is_none_or(|tx| tx.is_closed())
    }

    /// A grant transaction for this waiter is on its way until the guard
    /// drops.
    pub(super) fn sending(&self) -> Sending {
        self.uncertain.sending()
    }
}

/// The waiting places one identity may take on one key whose class allows
/// `max_waiters_per_key`: half of them, rounded up. So one identity never
/// fills a key another identity waits for (whenever the class allows two or
/// more waiters, the other half stays open to everyone else), and a key one
/// identity alone contends for still queues half the class's bound. The
/// edge filter applies the same rule (`filter/core/src/admission.rs`,
/// `identity_share`).
pub const fn identity_share(max_waiters_per_key: u32) -> u32 {
    max_waiters_per_key.div_ceil(2)
}

/// The queues of every key, and how many waiters each identity has in them
/// (an entry only while it has one, so the maps are bounded by the waiters).
#[derive(Default)]
pub(super) struct Book {
    pub(super) keys: HashMap<String, KeyQueue>,
    /// Waiting calls per identity: in-memory and durable ones together.
    pub(super) per_identity: HashMap<String, u32>,
    /// Waiting calls per key and identity, in-memory and durable together:
    /// held against the identity's share of the key.
    per_key_identity: HashMap<String, HashMap<String, u32>>,
    /// Durable waiters this table serves, per key.
    pub(super) durable: HashMap<String, u32>,
}

impl Book {
    /// Removes waiter `id` from `key`'s queue; whether it was the head.
    pub(super) fn remove(&mut self, key: &str, id: u64) -> bool {
        let Some(q) = self.keys.get_mut(key) else {
            return false;
        };
        let Some(at) = q.waiters.iter().position(|w| w.id == id) else {
            return false;
        };
        let was_head = at == 0;
        if was_head {
            q.kick.notify_one();
        }
        if let Some(w) = q.waiters.remove(at) {
            self.leave(w.req.bounded_as(), key);
        }
        was_head
    }

    /// Whether `identity` may queue one more waiting call on `key`: within
    /// its bound of waiting calls here, its share of the key
    /// ([`identity_share`]), and the key's bound (in-memory and durable
    /// waiters here). Checked in that order, so a caller at its share hears
    /// about its share, not about the key, and counts nothing on a refusal.
    pub(super) fn admit(
        &self,
        identity: &str,
        key: &str,
        max_per_identity: u32,
        max_per_key: u32,
    ) -> Result<(), ArbiterError> {
        if self.per_identity.get(identity).copied().unwrap_or(0) >= max_per_identity {
            return Err(ArbiterError::TooManyWaiters {
                limit: max_per_identity,
            });
        }
        let share = identity_share(max_per_key);
        if self.on_key_of(identity, key) >= share {
            return Err(ArbiterError::QueueShareFull {
                key: key.to_string(),
                share,
                limit: max_per_key,
            });
        }
        let on_key = self.durable.get(key).copied().unwrap_or(0)
            + self.keys.get(key).map_or(0, |q| q.waiters.len() as u32);
        if on_key >= max_per_key {
            return Err(ArbiterError::QueueFull {
                key: key.to_string(),
                limit: max_per_key,
            });
        }
        Ok(())
    }

    /// `identity`'s waiting calls on `key` here.
    pub(super) fn on_key_of(&self, identity: &str, key: &str) -> u32 {
        self.per_key_identity
            .get(key)
            .and_then(|ids| ids.get(identity))
            .copied()
            .unwrap_or(0)
    }

    fn count_in(&mut self, identity: &str, key: &str) {
        *self.per_identity.entry(identity.to_string()).or_insert(0) += 1;
        *self
            .per_key_identity
            .entry(key.to_string())
            .or_default()
            .entry(identity.to_string())
            .or_insert(0) += 1;
    }

    pub(super) fn join(&mut self, w: Waiter) -> Arc<Notify> {
        self.count_in(w.req.bounded_as(), &w.req.key);
        let queue = self
            .keys
            .entry(w.req.key.clone())
            .or_insert_with(|| KeyQueue {
                waiters: VecDeque::new(),
                kick: Arc::new(Notify::new()),
            });
        queue.waiters.push_back(w);
        queue.kick.clone()
    }

    /// Counts a durable waiter of `identity` on `key`, within the bounds
    /// ([`Book::admit`]).
    pub(super) fn join_durable(
        &mut self,
        identity: &str,
        key: &str,
        max_per_identity: u32,
        max_per_key: u32,
    ) -> Result<(), ArbiterError> {
        self.admit(identity, key, max_per_identity, max_per_key)?;
        self.count_in(identity, key);
        *self.durable.entry(key.to_string()).or_insert(0) += 1;
        Ok(())
    }

    pub(super) fn leave_durable(&mut self, identity: &str, key: &str) {
        self.leave(identity, key);
        if let Some(n) = self.durable.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.durable.remove(key);
            }
        }
    }

    fn leave(&mut self, identity: &str, key: &str) {
        if let Some(n) = self.per_identity.get_mut(identity) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_identity.remove(identity);
            }
        }
        if let Some(ids) = self.per_key_identity.get_mut(key) {
            if let Some(n) = ids.get_mut(identity) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    ids.remove(identity);
                }
            }
            if ids.is_empty() {
                self.per_key_identity.remove(key);
            }
        }
    }

    pub(super) fn head(&self, key: &str) -> Option<Head> {
        let w = self.keys.get(key)?.waiters.front()?;
        Some(w.head())
    }

    /// The shared waiters at the head of `key`'s queue, in order (every
    /// one before the first exclusive waiter), at most `limit`.
    pub(super) fn readers_at_head(&self, key: &str, limit: usize) -> Vec<Head> {
        self.keys.get(key).map_or_else(Vec::new, |q| {
            q.waiters
                .iter()
                .take_while(|w| w.req.shared)
                .take(limit)
                .map(Waiter::head)
                .collect()
        })
    }

    /// Every waiter, taken out in arrival order (the table is stopping).
    pub(super) fn drain(&mut self) -> Vec<Waiter> {
        self.per_identity.clear();
        self.per_key_identity.clear();
        let mut all: Vec<Waiter> = self
            .keys
            .drain()
            .flat_map(|(_, q)| {
                q.kick.notify_one();
                q.waiters
            })
            .collect();
        all.sort_by_key(|w| w.id);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter(id: u64, identity: &str, key: &str) -> Waiter {
        Waiter {
            id,
            since: std::time::Instant::now(),
            req: GrantRequest {
                key: key.into(),
                identity: identity.into(),
                session: 1,
                class: "demo".into(),
                ttl_seconds: 15,
                annotations: Default::default(),
                routed_by: None,
                quota: None,
                permits: None,
                shared: false,
                instance: String::new(),
                bound: String::new(),
            },
            slot: Arc::new(Mutex::new(None)),
            uncertain: Default::default(),
            intent: super::super::intent::Intent::new(tokio::time::Instant::now()),
        }
    }

    #[test]
    fn waiters_are_counted_per_identity_and_forgotten_when_they_leave() {
        let mut book = Book::default();
        book.join(waiter(1, "alice", "k1"));
        book.join(waiter(2, "alice", "k2"));
        book.join(waiter(3, "bob", "k1"));
        assert_eq!(book.per_identity.get("alice"), Some(&2));
        assert_eq!(book.head("k1").map(|h| h.id), Some(1));
        assert!(book.remove("k1", 1), "alice's waiter was k1's head");
        assert!(!book.remove("k1", 1), "gone already: counted once");
        assert_eq!(book.per_identity.get("alice"), Some(&1));
        assert!(!book.remove("k2", 99));
        assert!(book.remove("k2", 2));
        assert!(book.remove("k1", 3));
        assert!(book.per_identity.is_empty(), "no entry without a waiter");
    }

    #[test]
    fn an_identitys_share_is_half_the_keys_places_rounded_up() {
        assert_eq!(
            [1, 2, 3, 4, 64, 10_000].map(identity_share),
            [1, 1, 2, 2, 32, 5_000]
        );
        for max in 2..=10_000 {
            assert!(identity_share(max) >= 1 && identity_share(max) < max);
        }
    }

    fn refusal(r: Result<(), ArbiterError>) -> Option<String> {
        r.err().map(|e| format!("{:?}", e.reason()))
    }

    /// Issue 31, finding 5: bob cannot fill a shared key's queue (memory and
    /// durable waiters together); demo still gets a place, and the key's
    /// own bound still holds for everyone.
    #[test]
    fn one_identity_takes_at_most_its_share_of_a_key() {
        let mut book = Book::default();
        book.join(waiter(1, "bob", "k"));
        book.join_durable("bob", "k", 64, 4).unwrap();
        let share = book.admit("bob", "k", 64, 4);
        assert!(
            matches!(
                share,
                Err(ArbiterError::QueueShareFull {
                    share: 2,
                    limit: 4,
                    ..
                })
            ),
            "{share:?}"
        );
        let message = share.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            message.contains("share") && message.contains("retry"),
            "{message}"
        );
        assert!(matches!(
            book.join_durable("bob", "k", 64, 4),
            Err(ArbiterError::QueueShareFull { .. })
        ));
        // A refusal counts nothing; bob queues on other keys.
        assert_eq!(book.per_identity.get("bob"), Some(&2));
        assert!(book.admit("bob", "other", 64, 4).is_ok());
        // demo takes the other half ...
        book.admit("demo", "k", 64, 4).unwrap();
        book.join(waiter(2, "demo", "k"));
        book.join_durable("demo", "k", 64, 4).unwrap();
        // ... and then the key is full for a third identity, while bob
        // hears about his share first.
        assert!(matches!(
            book.admit("alice", "k", 64, 4),
            Err(ArbiterError::QueueFull { limit: 4, .. })
        ));
        assert!(matches!(
            book.admit("bob", "k", 64, 4),
            Err(ArbiterError::QueueShareFull { .. })
        ));
        assert_eq!(
            refusal(book.admit("alice", "k", 64, 4)),
            Some("QueueFull".into())
        );
        // bob's places come back as his waiters leave.
        assert!(book.remove("k", 1));
        book.leave_durable("bob", "k");
        assert_eq!(book.on_key_of("bob", "k"), 0);
        assert!(book.admit("bob", "k", 64, 6).is_ok());
        assert!(book.remove("k", 2));
        book.leave_durable("demo", "k");
        assert!(
            book.per_key_identity.is_empty(),
            "no entry without a waiter"
        );
        assert!(book.per_identity.is_empty());
    }

    #[test]
    fn the_identity_bound_comes_before_the_share() {
        let mut book = Book::default();
        book.join(waiter(1, "bob", "a"));
        assert!(matches!(
            book.admit("bob", "b", 1, 64),
            Err(ArbiterError::TooManyWaiters { limit: 1 })
        ));
    }
}
