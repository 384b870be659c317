//! The table's memory: FIFO waiters per key (ADR-14, ADR-15). Plain data
//! under one lock; no I/O here.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

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
    pub(super) req: GrantRequest,
    pub(super) slot: Slot,
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
}

/// The queues of every key, and how many waiters each identity has in them
/// (an entry only while it has one, so the map is bounded by the waiters).
#[derive(Default)]
pub(super) struct Book {
    pub(super) keys: HashMap<String, KeyQueue>,
    /// Waiting calls per identity: in-memory and durable ones together.
    pub(super) per_identity: HashMap<String, u32>,
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
            self.leave(&w.req.identity);
        }
        was_head
    }

    pub(super) fn join(&mut self, w: Waiter) -> Arc<Notify> {
        *self.per_identity.entry(w.req.identity.clone()).or_insert(0) += 1;
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
    /// (the identity's waiting calls here; the key's waiters here).
    pub(super) fn join_durable(
        &mut self,
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
        let on_key = self.durable.get(key).copied().unwrap_or(0)
            + self.keys.get(key).map_or(0, |q| q.waiters.len() as u32);
        if on_key >= max_per_key {
            return Err(ArbiterError::QueueFull {
                key: key.to_string(),
                limit: max_per_key,
            });
        }
        *self.per_identity.entry(identity.to_string()).or_insert(0) += 1;
        *self.durable.entry(key.to_string()).or_insert(0) += 1;
        Ok(())
    }

    pub(super) fn leave_durable(&mut self, identity: &str, key: &str) {
        self.leave(identity);
        if let Some(n) = self.durable.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.durable.remove(key);
            }
        }
    }

    fn leave(&mut self, identity: &str) {
        if let Some(n) = self.per_identity.get_mut(identity) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_identity.remove(identity);
            }
        }
    }

    pub(super) fn head(&self, key: &str) -> Option<Head> {
        let w = self.keys.get(key)?.waiters.front()?;
        Some(Head {
            id: w.id,
            req: w.req.clone(),
            slot: w.slot.clone(),
        })
    }

    /// Every waiter, taken out in arrival order (the table is stopping).
    pub(super) fn drain(&mut self) -> Vec<Waiter> {
        self.per_identity.clear();
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
            req: GrantRequest {
                key: key.into(),
                identity: identity.into(),
                session: 1,
                class: "demo".into(),
                ttl_seconds: 15,
                annotations: Default::default(),
                routed_by: None,
            },
            slot: Arc::new(Mutex::new(None)),
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
}
