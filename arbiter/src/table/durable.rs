//! Durable waiters (ADR-14, a class with `fairness = "durable"`): the queue
//! lives in the lock log, not in this arbiter's memory. A waiting call puts
//! its session's waiter record `q/<key>//<session>` on the session's lease
//! and is granted only when its record is the oldest (by create revision)
//! and the key is free — one grant transaction that compares both and
//! deletes the record. Every other grant and hand-over compares the queue
//! empty. So the order survives an arbiter restart (the client's retry on
//! the same session finds its record and keeps its place) and holds across
//! arbiters (any arbiter can serve any waiter; the log orders them).
//!
//! The grant transaction is the one every grant uses, with more compares:
//! a queue can only refuse grants, never make one (safety does not depend
//! on it). Watches of the holder record and of the queue are hints; a
//! waiter also polls.
//!
//! A waiter that is not first does not send grant transactions on every
//! hint: it reads the queue's head (a read, no consensus write) and tries
//! only once nothing older is left, and it ignores the holder record's
//! changes meanwhile. A release thus costs one grant attempt, not one per
//! waiter.
//!
//! A record whose call ended without removing it (its arbiter died, or
//! stopped and the caller never came back) would hold up the queue while
//! its session lives. It says how long its call waits; an arbiter that has
//! seen the same record at the head (the same last write) for longer than
//! that and [`STALE_AFTER`], on its own monotonic clock and across all its
//! calls on the key (try-locks included), removes it — compared by that
//! last write, so a retry that renewed the record keeps it. No two
//! arbiters' clocks are compared, and a live call's record is never
//! removed: it was written after its call began, first seen after that,
//! and its call ends within its budget.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::debug;

use super::{Acquired, Asker, Attempt, Grant, GrantRequest, LockTable, Next};
use crate::error::ArbiterError;
use crate::lock_log::{KeyWatch, Kv, QueueTurn, Queued, StoreError, WatchSignal};
use crate::records::{WaiterRecord, decode, encode};

/// How long beyond its call's budget a waiter record at the head may stay
/// unchanged before the waiter behind it removes it: time for a caller
/// whose arbiter died to ask again on the same session and keep its place.
pub const STALE_AFTER: Duration = Duration::from_secs(5);

/// What the durable waiters of a table did (for tests and the simulation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DurableStats {
    /// Waiter records written (a first enqueue, a retry's, a requeue).
    pub queued: u64,
    /// Grants to a waiter at its turn in the queue.
    pub served: u64,
    /// Waiters whose record was gone and who queued again.
    pub requeued: u64,
    /// Stale records of others removed (durable waiters, and writers'
    /// intents).
    pub stale_removed: u64,
}

#[derive(Default)]
pub(super) struct DurableCounters {
    queued: AtomicU64,
    served: AtomicU64,
    requeued: AtomicU64,
    stale_removed: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl LockTable {
    /// What the durable waiters did so far.
    pub fn durable_stats(&self) -> DurableStats {
        let c = &self.durable;
        DurableStats {
            queued: c.queued.load(Ordering::Relaxed),
            served: c.served.load(Ordering::Relaxed),
            requeued: c.requeued.load(Ordering::Relaxed),
            stale_removed: c.stale_removed.load(Ordering::Relaxed),
        }
    }

    /// How many durable waiters `key` has in the log (any arbiter's).
    pub async fn durable_waiting(&self, key: &str) -> Result<u32, ArbiterError> {
        let (n, _) = self.seal.checked(self.log.count_queued(key)).await?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// [`LockTable::acquire`] for a durable class: a try-lock is any grant
    /// (refused `Held` while a durable waiter is queued); a waiting call
    /// queues in the log for at most `wait`.
    pub async fn acquire_durable(
        self: &Arc<Self>,
        req: GrantRequest,
        wait: Option<Duration>,
        max_waiters_per_key: u32,
    ) -> Result<Acquired, ArbiterError> {
        if !self.gated(&req) {
            let first = self.attempt(&req, Asker::Caller).await?;
            if matches!(first, Attempt::Granted(_) | Attempt::Reused(_))
                && let Next::Deliver(grant) = self.next_after(first).await?
            {
                return Ok(Acquired {
                    grant,
                    waited: false,
                });
            }
        }
        let Some(budget) = wait else {
            return Err(ArbiterError::Held { key: req.key });
        };
        if self.stop.is_cancelled() || self.waits_end.is_cancelled() {
            return Err(ArbiterError::store("the arbiter is shutting down"));
        }
        self.book.lock().join_durable(
            req.bounded_as(),
            &req.key,
            self.options.max_waiters_per_identity,
            max_waiters_per_key,
        )?;
        let counted = Counted {
            table: self.clone(),
            identity: req.bounded_as().to_string(),
            key: req.key.clone(),
        };
        // The wait runs in its own task; a grant that commits as the
        // caller gives up is released as an orphan, by the task or by the
        // ticket's drop, never left.
        let (tx, rx) = oneshot::channel();
        let key = req.key.clone();
        let wait_ms = u64::try_from(budget.as_millis()).unwrap_or(u64::MAX);
        // Set when an attempt for this waiter failed without an answer: it
        // may have committed, so a timeout is not "not granted".
        let uncertain = Arc::new(super::queues::Unknown::default());
        self.tasks.spawn(
            self.clone()
                .wait_durable(req, wait_ms, tx, counted, uncertain.clone()),
        );
        let mut ticket = DurableTicket {
            table: self.clone(),
            rx,
        };
        // Waiting is not new work: the call's admission place goes back
        // (the waiter's record is bounded by the waiter bounds above).
        crate::overload::parked();
        let settle = super::settle_time(budget);
        match tokio::time::timeout(budget - settle, &mut ticket.rx).await {
            Ok(Ok(answer)) => answer.map(|(grant, _)| Acquired {
                grant,
                waited: true,
            }),
            Ok(Err(_)) => Err(ArbiterError::store(
                "the arbiter stopped while the call waited",
            )),
            Err(_) => {
                // As `acquire`'s wait: a transaction on its way decides if
                // it lands at once; one that failed without an answer, or
                // is still on its way, may have committed.
                uncertain.settle(settle).await;
                if let Ok(answer) = ticket.rx.try_recv() {
                    return answer.map(|(grant, _)| Acquired {
                        grant,
                        waited: true,
                    });
                }
                Err(uncertain.timed_out(key))
            }
        }
    }

    /// Queues `req` in the log and attempts whenever a hint says it may be
    /// its turn, until granted, refused, or its caller is gone.
    async fn wait_durable(
        self: Arc<Self>,
        req: GrantRequest,
        wait_ms: u64,
        mut tx: oneshot::Sender<DurableReply>,
        counted: Counted,
        uncertain: Arc<super::queues::Unknown>,
    ) {
        // A grant or claim made for the caller stays "on its way" until
        // the answer is in the caller's ticket (or released as an orphan).
        let mut pending = None;
        let answer = self
            .serve_durable(&req, wait_ms, &mut tx, &uncertain, &mut pending)
            .await;
        drop(counted);
        match tx.send(answer) {
            Ok(()) => {
                if let Some(sending) = pending {
                    sending.done();
                }
            }
            Err(Ok((grant, true))) => {
                // Its caller went away after the grant committed for it.
                self.release_orphan(grant);
                if let Some(sending) = pending {
                    sending.done();
                }
            }
            // A session's existing hold, claimed, stays its session's: if
            // a claim was made for a caller gone meanwhile, `pending` drops
            // unfinished (nobody is left to hear it, but the rule holds).
            Err(_) => {}
        }
    }

    async fn serve_durable(
        self: &Arc<Self>,
        req: &GrantRequest,
        wait_ms: u64,
        tx: &mut oneshot::Sender<DurableReply>,
        uncertain: &Arc<super::queues::Unknown>,
        pending: &mut Option<super::queues::Sending>,
    ) -> Result<(Grant, bool), ArbiterError> {
        let record = encode(&WaiterRecord {
            identity: req.identity.clone(),
            session: req.session,
            class: req.class.clone(),
            wait_ms,
        });
        let mut queued = self.queue_in_log(req, &record).await?;
        let mut place = Place {
            table: self.clone(),
            key: req.key.clone(),
            session: req.session,
            modified: Some(queued.modified),
        };
        let mut hold_watch: Option<Box<dyn KeyWatch>> = None;
        let mut queue_watch: Option<Box<dyn KeyWatch>> = None;
        // Someone older was ahead at the last look: read before trying.
        let mut behind = false;
        // The hold watch is on the lock's shared holds (`readers_of`), not
        // its exclusive hold.
        let mut watch_readers = false;
        loop {
            if self.waits_end.is_cancelled() {
                // The record stays: the caller's retry (through another
                // arbiter, or this one restarted) finds its place.
                place.modified = None;
                return Err(ArbiterError::store(
                    "the arbiter is shutting down; retry on the same session to keep the place",
                ));
            }
            if tx.is_closed() {
                return Err(ArbiterError::store("the call ended while it waited"));
            }
            let attempt = if self.gated(req) {
                Ok(Attempt::Held {
                    watch_from: queued.modified + 1,
                })
            } else if behind && let Some(at) = self.older_head(req, queued.created).await {
                Ok(Attempt::Behind { watch_from: at + 1 })
            } else {
                let sending = uncertain.sending();
                let turn = QueueTurn::Mine {
                    created: queued.created,
                };
                // A reader's grant is of its own reader key, at its place
                // in the lock's queue.
                let attempted = match req.shared {
                    true => {
                        let reader = super::shared::reader_request(req);
                        self.attempt_in(&reader, turn, Asker::Queue).await
                    }
                    false => self.attempt_in(req, turn, Asker::Queue).await,
                };
                match &attempted {
                    // on its way until the caller has it
                    Ok(Attempt::Granted(_)) => *pending = Some(sending),
                    // It may have committed without its answer.
                    Err(ArbiterError::StoreUnavailable { .. }) => drop(sending),
                    _ => sending.done(),
                }
                attempted
            };
            behind = false;
            let from = match attempt {
                Ok(Attempt::Granted(grant)) => {
                    place.modified = None; // the grant deleted the record
                    bump(&self.durable.served);
                    return Ok((grant, true));
                }
                // Its caller is gone: no claim (one cannot be undone), and
                // the session's hold stays what it was.
                Ok(Attempt::Reused(_)) if tx.is_closed() => {
                    return Err(ArbiterError::store("the caller went away"));
                }
                Ok(Attempt::Reused(grant)) => {
                    // The claim is on its way until the caller has it; an
                    // error leaves it unknown (`sending` drops unfinished).
                    let sending = uncertain.sending();
                    match self.reuse(grant).await? {
                        // Its session holds the key already (a retry): the
                        // record goes with `place`.
                        Next::Deliver(grant) => {
                            *pending = Some(sending);
                            return Ok((grant, false));
                        }
                        Next::Queue(from) => {
                            sending.done();
                            from
                        }
                    }
                }
                // A writer held up by shared holds watches them; anyone
                // else the lock's exclusive hold. (A writer's intent is
                // for in-memory queues: a durable queue keeps its readers
                // behind its writer itself.)
                Ok(Attempt::Readers { watch_from }) => {
                    if !watch_readers {
                        hold_watch = None;
                    }
                    watch_readers = true;
                    Some(watch_from)
                }
                Ok(Attempt::Held { watch_from } | Attempt::Intent { watch_from }) => {
                    if watch_readers {
                        hold_watch = None;
                    }
                    watch_readers = false;
                    Some(watch_from)
                }
                // Kept from it by a memory grant made a moment ago: as the
                // gated wait above.
                Ok(Attempt::Gated) => Some(queued.modified + 1),
                Ok(Attempt::Behind { watch_from, .. }) => {
                    behind = true;
                    Some(watch_from)
                }
                Ok(Attempt::Unqueued) => {
                    debug!(key = %req.key, "a durable waiter's record was gone; queueing again");
                    bump(&self.durable.requeued);
                    queued = self.queue_in_log(req, &record).await?;
                    place.modified = Some(queued.modified);
                    hold_watch = None;
                    queue_watch = None;
                    continue;
                }
                Err(e @ ArbiterError::StoreUnavailable { .. }) => {
                    debug!(key = %req.key, error = %e, "durable waiter's attempt failed; polling");
                    hold_watch = None;
                    queue_watch = None;
                    None
                }
                Err(e) => return Err(e),
            };
            if let Some(rev) = from {
                if hold_watch.is_none() {
                    let watched = match watch_readers {
                        true => crate::records::readers_of(&req.key),
                        false => req.key.clone(),
                    };
                    hold_watch = self.log.watch(&watched, rev).await.ok();
                }
                if queue_watch.is_none() {
                    queue_watch = self.log.watch_queue(&req.key, rev).await.ok();
                }
            }
            let pause = self.jittered(self.options.poll);
            tokio::select! {
                biased;
                () = self.waits_end.cancelled() => {}
                () = tx.closed() => {}
                // Behind someone: the holder's changes are not this
                // waiter's business, the queue's are.
                signal = next(&mut hold_watch), if !behind => if signal == WatchSignal::Lost { hold_watch = None },
                signal = next(&mut queue_watch) => if signal == WatchSignal::Lost { queue_watch = None },
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Puts (or renews) the session's waiter record, if the session is the
    /// caller's (compared in the same transaction, as a grant compares it);
    /// another identity's session, or one gone, is `SessionExpired`.
    async fn queue_in_log(
        &self,
        req: &GrantRequest,
        record: &[u8],
    ) -> Result<Queued, ArbiterError> {
        let (queued, _) = self
            .seal
            .checked(
                self.log
                    .enqueue(&req.key, req.session, &req.session_bytes(), record.to_vec()),
            )
            .await?;
        let queued = queued.ok_or(ArbiterError::SessionExpired {
            session: req.session,
        })?;
        bump(&self.durable.queued);
        Ok(queued)
    }

    /// The revision the queue was read at if its head is older than
    /// `created` (someone is still ahead); `None` to try a grant (the read
    /// failed, or nothing older is left).
    async fn older_head(&self, req: &GrantRequest, created: i64) -> Option<i64> {
        let (head, header) = self
            .seal
            .checked(self.log.queue_head(&req.key))
            .await
            .ok()?;
        let head = head.filter(|h| h.create_revision < created)?;
        self.note_head(&req.key, req.session, &head).await;
        Some(header.revision)
    }

    /// Notes `head`, the oldest waiter record of `key` as a call of
    /// `session` found it, and removes it once this arbiter has seen it
    /// unchanged for longer than its call's budget and [`STALE_AFTER`].
    pub(super) async fn note_head(&self, key: &str, session: i64, head: &Kv) {
        self.note_stale(Stale::Waiter, key, session, head).await;
    }

    /// Notes `intent`, the oldest writer's intent on lock `name` as a
    /// reader of `session` found it, and removes it by the same rule: an
    /// intent whose writer's call ended without removing it (its arbiter
    /// died) would keep readers out while the writer's session lives.
    pub(super) async fn note_intent(&self, name: &str, session: i64, intent: &Kv) {
        self.note_stale(Stale::Intent, name, session, intent).await;
    }

    async fn note_stale(&self, stale: Stale, key: &str, session: i64, head: &Kv) {
        let Some(record) = decode::<WaiterRecord>(&head.value) else {
            return;
        };
        // A session's own waiter record is its place; its own intent is
        // removed by the same rule (a live one lasts at most its wait), or
        // a leftover one would keep the session's own readers out.
        if record.session == session && matches!(stale, Stale::Waiter) {
            return;
        }
        // One entry per key and range (`//` occurs in no key).
        let seen_as = match stale {
            Stale::Waiter => key.to_string(),
            Stale::Intent => format!("{key}//w"),
        };
        let key_seen = seen_as.as_str();
        let since = {
            let mut heads = self.stale_heads.lock();
            match heads.get(key_seen) {
                Some(s) if s.session == record.session && s.modified == head.mod_revision => {
                    s.since
                }
                _ => {
                    if heads.len() >= STALE_HEADS_KEPT && !heads.contains_key(key_seen) {
                        // Bounded: forget the longest-watched (its clock
                        // starts again if it is seen again).
                        let oldest = heads
                            .iter()
                            .min_by_key(|(_, s)| s.since)
                            .map(|(k, _)| k.clone());
                        if let Some(oldest) = oldest {
                            heads.remove(&oldest);
                        }
                    }
                    heads.insert(
                        seen_as.clone(),
                        Seen {
                            session: record.session,
                            modified: head.mod_revision,
                            since: Instant::now(),
                        },
                    );
                    return;
                }
            }
        };
        let budget = Duration::from_millis(record.wait_ms).saturating_add(STALE_AFTER);
        if since.elapsed() < budget {
            return;
        }
        let removed = match stale {
            Stale::Waiter => {
                debug!(key, "removing a durable waiter whose call ended long ago");
                self.log
                    .dequeue(key, record.session, head.mod_revision)
                    .await
            }
            Stale::Intent => {
                debug!(key, "removing a writer's intent whose call ended long ago");
                self.log
                    .drop_intent(key, record.session, head.mod_revision)
                    .await
            }
        };
        if let Ok(answer) = removed
            && answer.value
        {
            bump(&self.durable.stale_removed);
        }
        let mut heads = self.stale_heads.lock();
        if heads
            .get(key_seen)
            .is_some_and(|s| s.session == record.session && s.modified == head.mod_revision)
        {
            heads.remove(key_seen);
        }
    }
}

/// Which record [`LockTable::note_stale`] watches: a durable queue's head,
/// or a lock's oldest writer's intent.
#[derive(Clone, Copy)]
enum Stale {
    Waiter,
    Intent,
}

/// How many keys' queue heads a table keeps watching for staleness.
const STALE_HEADS_KEPT: usize = 4096;

/// What a durable waiter's task answers: the grant, and whether it was made
/// for this call (a fresh grant) or is its session's existing hold.
type DurableReply = Result<(Grant, bool), ArbiterError>;

/// The caller's side of a durable wait: dropped (the call gave up or went
/// away), a fresh grant that arrived meanwhile is released as an orphan.
struct DurableTicket {
    table: Arc<LockTable>,
    rx: oneshot::Receiver<DurableReply>,
}

impl Drop for DurableTicket {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok(Ok((grant, true))) = self.rx.try_recv() {
            self.table.release_orphan(grant);
        }
    }
}

/// The head record an arbiter has seen, and since when (its monotonic clock).
#[derive(Debug, Clone, Copy)]
pub(super) struct Seen {
    session: i64,
    modified: i64,
    since: Instant,
}

/// The next hint of a watch, or never without one.
async fn next(watch: &mut Option<Box<dyn KeyWatch>>) -> WatchSignal {
    match watch.as_mut() {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}

/// A durable waiter counted against its identity's and key's bounds here.
struct Counted {
    table: Arc<LockTable>,
    identity: String,
    key: String,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.table
            .book
            .lock()
            .leave_durable(&self.identity, &self.key);
    }
}

/// The session's waiter record while it may still be there: removed when
/// the call ends without the grant that deletes it (not when the arbiter
/// stops: the record keeps the caller's place for its retry).
struct Place {
    table: Arc<LockTable>,
    key: String,
    session: i64,
    modified: Option<i64>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let Some(modified) = self.modified.take() else {
            return;
        };
        let (table, key, session) = (self.table.clone(), self.key.clone(), self.session);
        self.table.tasks.spawn(async move {
            match table.log.dequeue(&key, session, modified).await {
                Ok(_) => table.kick(&key),
                Err(StoreError::LeaseGone { .. }) => {}
                Err(e) => {
                    debug!(key = %key, error = %e, "could not remove a durable waiter; it ends with its session or is removed as stale");
                }
            }
        });
    }
}
