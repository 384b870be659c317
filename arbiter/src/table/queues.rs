//! The table's memory: FIFO waiters per key (ADR-14, ADR-15), and the
//! claims that keep a session's grant from going both to its new call and to
//! an orphan release. Plain data under one lock each; no I/O here.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::{Grant, GrantRequest};
use crate::error::ArbiterError;

pub(super) type Reply = Result<Grant, ArbiterError>;
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
pub struct Head {
    pub id: u64,
    pub req: GrantRequest,
    pub(super) slot: Slot,
}

/// The queues of every key, and how many waiters each identity has in them
/// (an entry only while it has one, so the map is bounded by the waiters).
#[derive(Default)]
pub(super) struct Book {
    pub(super) keys: HashMap<String, KeyQueue>,
    pub(super) per_identity: HashMap<String, u32>,
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

    /// Every waiter, taken out (the table is stopping).
    pub(super) fn drain(&mut self) -> Vec<Waiter> {
        self.per_identity.clear();
        self.keys
            .drain()
            .flat_map(|(_, q)| {
                q.kick.notify_one();
                q.waiters
            })
            .collect()
    }
}

/// A grant that reached (or is about to reach) a call as "already yours".
#[derive(Debug, Clone, Copy)]
pub(super) struct ClaimEntry {
    pub(super) revision: i64,
    pub(super) session: i64,
    /// Calls holding the claim.
    pub(super) calls: usize,
    pub(super) since: Instant,
}

/// Grants that reached a caller as "already yours" (key -> claim), and
/// grants being released because their caller went away. One lock over both:
/// a session's existing grant is either handed to its new call or released
/// as an orphan, never both. (Found by the release gate: a waiter timed out
/// while the hand-over for it was committing, the same session's next call
/// got the grant as "already yours", and the orphan release then deleted
/// it under that call: a double grant.)
///
/// A claim is made before the grant is re-checked in the log and delivered:
/// a grant read as "yours" may already have been deleted by an orphan
/// release that finished after the read, so only a claim followed by a
/// fresh read that still finds the hold may deliver it.
///
/// Pruning: a claim goes when a later grant or release of its key passes
/// through this table, and the sweeper drops claims whose hold has ended
/// (expired, or released through another arbiter).
#[derive(Default)]
pub(super) struct Reuse {
    pub(super) claimed: BTreeMap<String, ClaimEntry>,
    pub(super) orphaned: BTreeMap<String, i64>,
}

impl Reuse {
    pub(super) fn claimed(&self, grant: &Grant) -> bool {
        self.claimed
            .get(&grant.key)
            .is_some_and(|c| c.revision == grant.revision)
    }

    /// Claims `grant` for one more call; false when it is being released
    /// as an orphan.
    pub(super) fn claim(&mut self, grant: &Grant, now: Instant) -> bool {
        if self.orphaned.get(&grant.key) == Some(&grant.revision) {
            return false;
        }
        match self.claimed.get_mut(&grant.key) {
            Some(c) if c.revision == grant.revision => c.calls += 1,
            _ => {
                self.claimed.insert(
                    grant.key.clone(),
                    ClaimEntry {
                        revision: grant.revision,
                        session: grant.session,
                        calls: 1,
                        since: now,
                    },
                );
            }
        }
        true
    }

    pub(super) fn unclaim(&mut self, grant: &Grant) {
        if let Some(c) = self.claimed.get_mut(&grant.key)
            && c.revision == grant.revision
        {
            c.calls = c.calls.saturating_sub(1);
            if c.calls == 0 {
                self.claimed.remove(&grant.key);
            }
        }
    }

    /// A grant or release at `revision` makes a claim on an older grant of
    /// `key` moot. (Never a claim on this grant or a newer one: a call of the
    /// same session may have claimed it a moment ago.)
    pub(super) fn forget_before(&mut self, key: &str, revision: i64) {
        if self
            .claimed
            .get(key)
            .is_some_and(|c| c.revision < revision)
        {
            self.claimed.remove(key);
        }
    }

    /// Claims older than `before`, oldest first, at most `n`: the sweeper
    /// checks whether their holds still exist.
    pub(super) fn stale(&self, before: Instant, n: usize) -> Vec<(String, ClaimEntry)> {
        let mut old: Vec<_> = self
            .claimed
            .iter()
            .filter(|(_, c)| c.since < before)
            .map(|(k, c)| (k.clone(), *c))
            .collect();
        old.sort_by_key(|(_, c)| c.since);
        old.truncate(n);
        old
    }

    /// Drops the claim on `key` if it is still the one at `revision`.
    pub(super) fn drop_claim(&mut self, key: &str, revision: i64) {
        if self.claimed.get(key).is_some_and(|c| c.revision == revision) {
            self.claimed.remove(key);
        }
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
            },
            slot: Arc::new(Mutex::new(None)),
        }
    }

    fn grant(key: &str, revision: i64) -> Grant {
        Grant {
            key: key.into(),
            session: 7,
            epoch: 1,
            revision,
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

    #[tokio::test(start_paused = true)]
    async fn a_grant_is_claimed_or_orphaned_never_both() {
        let now = Instant::now();
        let mut reuse = Reuse::default();
        let g = grant("k", 10);
        reuse.orphaned.insert("k".into(), 10);
        assert!(!reuse.claim(&g, now), "being released as an orphan");
        reuse.orphaned.clear();
        assert!(reuse.claim(&g, now));
        assert!(reuse.claim(&g, now), "a second call of the session");
        reuse.unclaim(&g);
        assert!(reuse.claimed(&g), "one call still holds it");
        reuse.unclaim(&g);
        assert!(!reuse.claimed(&g));
    }

    #[tokio::test(start_paused = true)]
    async fn claims_are_pruned_by_later_revisions_and_by_age() {
        let now = Instant::now();
        let mut reuse = Reuse::default();
        assert!(reuse.claim(&grant("a", 10), now));
        reuse.forget_before("a", 10);
        assert!(reuse.claimed(&grant("a", 10)), "not by its own revision");
        reuse.forget_before("a", 11);
        assert!(!reuse.claimed(&grant("a", 10)));

        assert!(reuse.claim(&grant("b", 5), now));
        tokio::time::advance(std::time::Duration::from_secs(60)).await;
        assert!(reuse.claim(&grant("c", 6), Instant::now()));
        let stale = reuse.stale(Instant::now() - std::time::Duration::from_secs(30), 10);
        assert_eq!(
            stale.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            vec!["b"]
        );
        reuse.drop_claim("b", 4);
        assert!(reuse.claimed(&grant("b", 5)), "another revision: kept");
        reuse.drop_claim("b", 5);
        assert!(!reuse.claimed(&grant("b", 5)));
    }
}
