//! In-memory FIFO waiters per key (ADR-14, ADR-15).
//!
//! Envoy ring-hashes on the key, so every waiter for a key lands on one
//! arbiter, which queues them in arrival order. One driver task per contended
//! key attempts a grant for the head waiter whenever something suggests the
//! key may be free: a delete event on the key's watch, a kick from a local
//! release or cancellation, or a poll tick (~1 s with jitter) when the watch
//! is lost. Every attempt is a full grant transaction; a notification never
//! grants.
//!
//! Delivery is exactly-once per waiter: the waiter's sender is taken out of a
//! shared slot by whichever path delivers first (the driver, or a release that
//! handed the key over in its own transaction). A grant that finds its waiter
//! gone (cancelled, timed out) is released at once, so an abandoned call never
//! leaves a hold behind.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tracing::{debug, warn};

use crate::error::ArbiterError;
use crate::store::{Grant, GrantOutcome, GrantRequest, KeyWatch, Store, WatchSignal};
use crate::test_fault::TestFault;

/// The default `--max-waiters-per-identity`: the edge's own per-identity
/// bound, so a direct caller gets no more than one through the edge.
pub const DEFAULT_MAX_WAITERS_PER_IDENTITY: u32 = 64;

type Reply = Result<Grant, ArbiterError>;
type Slot = Arc<Mutex<Option<oneshot::Sender<Reply>>>>;

struct Waiter {
    id: u64,
    req: GrantRequest,
    slot: Slot,
}

struct KeyQueue {
    waiters: VecDeque<Waiter>,
    kick: Arc<Notify>,
}

/// Grants that reached a caller as "already yours" (key -> revision), and
/// grants being released because their caller went away. One lock over both:
/// a session's existing grant is either handed to its new call or released
/// as an orphan, never both. (Found by the release gate: a waiter timed out
/// while the hand-over for it was committing, the same session's next call
/// got the grant as "already yours", and the orphan release then deleted
/// it under that call: a double grant.)
///
/// A claim is made before the grant is re-checked in etcd and delivered: a
/// grant read as "yours" may already have been deleted by an orphan release
/// that finished after the read (found by the hooks/waiting e2e tests under
/// load), so only a claim followed by a fresh read that still finds the hold
/// may deliver it. Claims count the calls holding them.
#[derive(Default)]
struct Reuse {
    /// key -> (revision, calls that claimed it)
    claimed: HashMap<String, (i64, usize)>,
    orphaned: HashMap<String, i64>,
}

impl Reuse {
    fn claimed(&self, grant: &Grant) -> bool {
        self.claimed
            .get(&grant.key)
            .is_some_and(|(rev, _)| *rev == grant.revision)
    }

    fn claim(&mut self, grant: &Grant) -> bool {
        if self.orphaned.get(&grant.key) == Some(&grant.revision) {
            return false;
        }
        match self.claimed.get_mut(&grant.key) {
            Some((rev, n)) if *rev == grant.revision => *n += 1,
            _ => {
                self.claimed.insert(grant.key.clone(), (grant.revision, 1));
            }
        }
        true
    }

    fn unclaim(&mut self, grant: &Grant) {
        if let Some((rev, n)) = self.claimed.get_mut(&grant.key)
            && *rev == grant.revision
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.claimed.remove(&grant.key);
            }
        }
    }
}

/// The queues of every key, and how many waiters each identity has in them
/// (an entry only while it has one, so the map is bounded by the waiters).
#[derive(Default)]
struct Book {
    keys: HashMap<String, KeyQueue>,
    per_identity: HashMap<String, u32>,
}

impl Book {
    /// Removes waiter `id` from `key`'s queue; whether it was the head.
    fn remove(&mut self, key: &str, id: u64) -> bool {
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

    fn leave(&mut self, identity: &str) {
        if let Some(n) = self.per_identity.get_mut(identity) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_identity.remove(identity);
            }
        }
    }
}

pub struct Queues {
    keys: Mutex<Book>,
    /// Waiting calls one identity may have queued here, over all keys.
    max_per_identity: u32,
    reuse: Mutex<Reuse>,
    next_id: AtomicU64,
    store: Store,
    poll: Duration,
    #[cfg_attr(not(feature = "test-faults"), allow(dead_code))]
    fault: TestFault,
}

/// What [`Queues::claim_verified`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Still held by the session, and now claimed: deliver it.
    Claimed,
    /// Being released as an orphan: wait for the delete.
    Orphaned,
    /// Gone since it was read: try again.
    Gone,
}

/// The head of a key's queue, as seen by a release that may hand over.
pub struct Head {
    pub id: u64,
    pub req: GrantRequest,
    slot: Slot,
}

impl Queues {
    /// Queues in which one identity may have `max_per_identity` waiting
    /// calls over all keys.
    pub fn with_identity_bound(
        store: Store,
        poll: Duration,
        fault: TestFault,
        max_per_identity: u32,
    ) -> Arc<Self> {
        Arc::new(Self {
            keys: Mutex::new(Book::default()),
            max_per_identity,
            reuse: Mutex::new(Reuse::default()),
            next_id: AtomicU64::new(1),
            store,
            poll,
            fault,
        })
    }

    pub fn waiting(&self, key: &str) -> usize {
        self.keys
            .lock()
            .map(|k| k.keys.get(key).map_or(0, |q| q.waiters.len()))
            .unwrap_or(0)
    }

    /// (keys with a queue, waiters over all keys), for the metrics.
    pub fn totals(&self) -> (usize, usize) {
        self.keys
            .lock()
            .map(|k| {
                let queued = k.keys.values().filter(|q| !q.waiters.is_empty());
                queued.fold((0, 0), |(keys, n), q| (keys + 1, n + q.waiters.len()))
            })
            .unwrap_or((0, 0))
    }

    pub fn head(&self, key: &str) -> Option<Head> {
        let keys = self.keys.lock().ok()?;
        let w = keys.keys.get(key)?.waiters.front()?;
        Some(Head {
            id: w.id,
            req: w.req.clone(),
            slot: w.slot.clone(),
        })
    }

    /// Joins the tail of `req.key`'s queue. Starts the key's driver if the
    /// queue was empty. Refused when the key's queue holds `limit` waiters
    /// or the caller's identity has its bound of waiters queued here.
    pub fn enqueue(
        self: &Arc<Self>,
        req: GrantRequest,
        watch_from: Option<i64>,
        limit: u32,
    ) -> Result<Ticket, ArbiterError> {
        let (tx, rx) = oneshot::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let key = req.key.clone();
        let mut keys = self
            .keys
            .lock()
            .map_err(|_| ArbiterError::Internal("waiter queues poisoned".into()))?;
        let book = &mut *keys;
        let mine = book.per_identity.get(&req.identity).copied().unwrap_or(0);
        if mine >= self.max_per_identity {
            return Err(ArbiterError::TooManyWaiters {
                limit: self.max_per_identity,
            });
        }
        let start_driver = !book.keys.contains_key(&key);
        let queue = book.keys.entry(key.clone()).or_insert_with(|| KeyQueue {
            waiters: VecDeque::new(),
            kick: Arc::new(Notify::new()),
        });
        if queue.waiters.len() >= limit as usize {
            if queue.waiters.is_empty() {
                book.keys.remove(&key);
            }
            return Err(ArbiterError::QueueFull { key, limit });
        }
        *book.per_identity.entry(req.identity.clone()).or_insert(0) += 1;
        queue.waiters.push_back(Waiter {
            id,
            req,
            slot: Arc::new(Mutex::new(Some(tx))),
        });
        let kick = queue.kick.clone();
        drop(keys);
        if start_driver {
            tokio::spawn(drive(self.clone(), key.clone(), kick, watch_from));
        }
        Ok(Ticket {
            queues: self.clone(),
            key,
            id,
            rx: Some(rx),
        })
    }

    /// Wakes the key's driver (a local release, or a cancelled head).
    pub fn kick(&self, key: &str) {
        if let Ok(keys) = self.keys.lock()
            && let Some(q) = keys.keys.get(key)
        {
            q.kick.notify_one();
        }
    }

    fn remove(&self, key: &str, id: u64) {
        if let Ok(mut keys) = self.keys.lock() {
            keys.remove(key, id);
        }
    }

    /// Delivers a session's existing grant, claimed and re-checked by
    /// [`Queues::claim_verified`], to its waiting call.
    fn deliver_claimed(self: &Arc<Self>, head: &Head, grant: Grant) {
        let tx = head.slot.lock().ok().and_then(|mut s| s.take());
        let Some(tx) = tx else {
            // delivered already by another path: this call's claim is moot
            self.unclaim(&grant);
            return;
        };
        self.remove(&head.req.key, head.id);
        if let Err(Ok(grant)) = tx.send(Ok(grant)) {
            // Its caller went away too: an orphan after all, unless another
            // call of the session holds a claim on it.
            self.unclaim(&grant);
            self.release_orphan(grant);
        }
    }

    /// Delivers to the waiter in `head` unless another path already did.
    pub fn deliver(self: &Arc<Self>, head: &Head, reply: Reply) {
        self.deliver_to(&head.req.key, head.id, &head.slot, reply);
    }

    fn deliver_to(self: &Arc<Self>, key: &str, id: u64, slot: &Slot, reply: Reply) {
        let tx = slot.lock().ok().and_then(|mut s| s.take());
        let Some(tx) = tx else {
            return; // delivered already (e.g. by a hand-over): nothing to do
        };
        self.remove(key, id);
        if let Err(Ok(grant)) = tx.send(reply) {
            self.release_orphan(grant);
        }
    }

    /// Claims a session's existing grant (read from etcd a moment ago) for
    /// a new call of that session, then re-reads the hold: `Claimed` only if
    /// it still exists after the claim, so no orphan release can delete it
    /// any more. `Orphaned` when it is being released as an orphan (wait for
    /// the delete like for any other holder); `Gone` when it went between the
    /// read and the claim (try again).
    pub async fn claim_verified(&self, grant: &Grant) -> Result<Claim, ArbiterError> {
        #[cfg(feature = "test-faults")]
        if self.fault == TestFault::SlowReuse {
            tokio::time::sleep(crate::test_fault::SLOW_REUSE).await;
        }
        let claimed = match self.reuse.lock() {
            Ok(mut reuse) => reuse.claim(grant),
            Err(_) => false,
        };
        if !claimed {
            return Ok(Claim::Orphaned);
        }
        match self
            .store
            .holds(&grant.key, grant.session, grant.revision)
            .await
        {
            Ok(true) => Ok(Claim::Claimed),
            Ok(false) => {
                self.unclaim(grant);
                Ok(Claim::Gone)
            }
            Err(e) => {
                self.unclaim(grant);
                Err(e)
            }
        }
    }

    /// Gives back one call's claim (its caller went away before delivery).
    pub fn unclaim(&self, grant: &Grant) {
        if let Ok(mut reuse) = self.reuse.lock() {
            reuse.unclaim(grant);
        }
    }

    /// A grant or release at `revision` makes a claim on an older grant of
    /// `key` moot. (Never a claim on this grant or a newer one: a call of the
    /// same session may have claimed it a moment ago.)
    pub fn forget_claims_before(&self, key: &str, revision: i64) {
        if let Ok(mut reuse) = self.reuse.lock()
            && reuse
                .claimed
                .get(key)
                .is_some_and(|(claimed, _)| *claimed < revision)
        {
            reuse.claimed.remove(key);
        }
    }

    /// A grant whose caller went away: release it now rather than leave a
    /// hold on a session that may live for a long time — unless a new call
    /// of the same session has claimed it meanwhile.
    pub fn release_orphan(self: &Arc<Self>, grant: Grant) {
        {
            let Ok(mut reuse) = self.reuse.lock() else {
                return;
            };
            if reuse.claimed(&grant) {
                debug!(key = %grant.key, "an abandoned grant was claimed by its session's next call; keeping it");
                return;
            }
            reuse.orphaned.insert(grant.key.clone(), grant.revision);
        }
        let this = self.clone();
        tokio::spawn(async move {
            debug!(key = %grant.key, "releasing a grant whose caller went away");
            if let Err(e) = this
                .store
                .release_orphan(&grant.key, grant.session, grant.revision)
                .await
            {
                warn!(key = %grant.key, error = %e, "could not release an abandoned grant; it ends with its session");
            }
            if let Ok(mut reuse) = this.reuse.lock()
                && reuse.orphaned.get(&grant.key) == Some(&grant.revision)
            {
                reuse.orphaned.remove(&grant.key);
            }
            this.kick(&grant.key);
        });
    }

    /// Removes the key's queue if it is empty; returns the head otherwise.
    fn head_or_retire(&self, key: &str) -> Option<Head> {
        let mut keys = self.keys.lock().ok()?;
        let q = keys.keys.get(key)?;
        match q.waiters.front() {
            Some(w) => Some(Head {
                id: w.id,
                req: w.req.clone(),
                slot: w.slot.clone(),
            }),
            None => {
                keys.keys.remove(key);
                None
            }
        }
    }
}

/// A queued Acquire. Dropping it (cancelled call, timeout) leaves the queue at
/// once; a grant that raced with the drop is released.
pub struct Ticket {
    queues: Arc<Queues>,
    key: String,
    id: u64,
    rx: Option<oneshot::Receiver<Reply>>,
}

impl Ticket {
    pub async fn wait(&mut self) -> Reply {
        match self.rx.as_mut() {
            Some(rx) => {
                let reply = rx
                    .await
                    .unwrap_or_else(|_| Err(ArbiterError::Internal("waiter dropped".into())));
                self.rx = None;
                reply
            }
            None => Err(ArbiterError::Internal("waited twice".into())),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.queues.remove(&self.key, self.id);
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if let Ok(Ok(grant)) = rx.try_recv() {
                self.queues.release_orphan(grant);
            }
        }
    }
}

fn jittered(base: Duration) -> Duration {
    let ms = u64::try_from(base.as_millis()).unwrap_or(1000).max(1);
    Duration::from_millis(ms / 2 + fastrand::u64(0..=ms))
}

/// Waits for a kick or one jittered poll period, whichever comes first.
async fn poll_later(kick: &Notify, poll: Duration) {
    tokio::select! {
        _ = kick.notified() => {}
        _ = tokio::time::sleep(jittered(poll)) => {}
    }
}

async fn drive(queues: Arc<Queues>, key: String, kick: Arc<Notify>, watch_from: Option<i64>) {
    let mut watch: Option<KeyWatch> = None;
    let mut from = watch_from;
    while let Some(head) = queues.head_or_retire(&key) {
        match queues.store.try_grant(&head.req).await {
            Ok(GrantOutcome::Granted(grant)) => {
                queues.forget_claims_before(&key, grant.revision);
                queues.deliver(&head, Ok(grant));
                continue;
            }
            Ok(GrantOutcome::Reused(grant)) => match queues.claim_verified(&grant).await {
                Ok(Claim::Claimed) => {
                    queues.deliver_claimed(&head, grant);
                    continue;
                }
                // Deleted since the read: the next attempt sees what is there now.
                Ok(Claim::Gone) => continue,
                // Being released as an orphan: wait for its delete.
                Ok(Claim::Orphaned) => {
                    if from.is_none() {
                        from = Some(grant.revision + 1);
                    }
                }
                Err(e) => {
                    debug!(key = %key, error = %e, "re-reading a reused grant failed; polling");
                    watch = None;
                    poll_later(&kick, queues.poll).await;
                    continue;
                }
            },
            Ok(GrantOutcome::Held { watch_from }) => {
                if from.is_none() {
                    from = Some(watch_from);
                }
            }
            Err(e) if matches!(e, ArbiterError::StoreUnavailable { .. }) => {
                debug!(key = %key, error = %e, "grant attempt failed; polling");
                watch = None;
                poll_later(&kick, queues.poll).await;
                continue;
            }
            Err(e) => {
                queues.deliver(&head, Err(e));
                continue;
            }
        }
        if watch.is_none()
            && let Some(rev) = from.take()
        {
            watch = queues.store.watch(&key, rev).await.ok();
        }
        // Wait for a hint; every hint leads to a full grant transaction.
        match watch.as_mut() {
            Some(w) => {
                tokio::select! {
                    signal = w.next() => {
                        #[cfg(feature = "test-faults")]
                        if signal != WatchSignal::Lost
                            && queues.fault == TestFault::GrantOnWatch
                            && let Some(head) = queues.head_or_retire(&key)
                        {
                            let reply = queues.store.grant_blind(&head.req).await;
                            queues.deliver(&head, reply);
                            continue;
                        }
                        if signal == WatchSignal::Lost {
                            debug!(key = %key, "watch lost; polling until re-watched");
                            watch = None;
                        }
                    }
                    _ = kick.notified() => {}
                    _ = tokio::time::sleep(jittered(queues.poll * 5)) => {}
                }
            }
            None => poll_later(&kick, queues.poll).await,
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

    fn join(book: &mut Book, w: Waiter) {
        *book.per_identity.entry(w.req.identity.clone()).or_insert(0) += 1;
        book.keys
            .entry(w.req.key.clone())
            .or_insert_with(|| KeyQueue {
                waiters: VecDeque::new(),
                kick: Arc::new(Notify::new()),
            })
            .waiters
            .push_back(w);
    }

    #[test]
    fn waiters_are_counted_per_identity_and_forgotten_when_they_leave() {
        let mut book = Book::default();
        join(&mut book, waiter(1, "alice", "k1"));
        join(&mut book, waiter(2, "alice", "k2"));
        join(&mut book, waiter(3, "bob", "k1"));
        assert_eq!(book.per_identity.get("alice"), Some(&2));
        assert!(book.remove("k1", 1), "alice's waiter was k1's head");
        assert!(!book.remove("k1", 1), "gone already: counted once");
        assert_eq!(book.per_identity.get("alice"), Some(&1));
        assert!(!book.remove("k2", 99));
        assert!(book.remove("k2", 2));
        assert!(book.remove("k1", 3));
        assert!(book.per_identity.is_empty(), "no entry without a waiter");
    }
}
