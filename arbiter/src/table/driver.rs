//! A table's background work: one driver per contended key. Each ends when
//! its queue empties or the table stops.

use std::sync::Arc;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::queues::Delivery;
use super::{Asker, Attempt, Claim, LockTable};
use crate::error::ArbiterError;
use crate::lock_log::{KeyWatch, WatchSignal};

/// Waits for a kick or one jittered poll period, whichever comes first.
/// `biased`: the same inputs take the same branch (the simulation replays).
async fn poll_later(table: &LockTable, kick: &Notify, stop: &CancellationToken) {
    let pause = table.jittered(table.options.poll);
    tokio::select! {
        biased;
        _ = stop.cancelled() => {}
        _ = kick.notified() => {}
        _ = tokio::time::sleep(pause) => {}
    }
}

/// Attempts a grant for the head of `key`'s queue whenever something
/// suggests the key may be free, until the queue is empty or the table
/// stops. Every hint leads to a full grant transaction.
pub(super) async fn drive(
    table: Arc<LockTable>,
    key: String,
    kick: Arc<Notify>,
    watch_from: Option<i64>,
    stop: CancellationToken,
) {
    let mut watch: Option<Box<dyn KeyWatch>> = None;
    // What the watch is on: the key, its shared holds, its writers'
    // intents, or a semaphore's slots (`watched`).
    let mut watching = Watched::default();
    let mut from = watch_from;
    // What the last attempt found in the way.
    let mut blocked = Blocked::Holder;
    while let Some(head) = table.head_or_retire(&key) {
        if stop.is_cancelled() {
            return;
        }
        if watch.is_some() && watching != watched(&key, &head.req, blocked) {
            // The head waits on something else than the watch was opened
            // for (a new head of another kind or mode): watch that.
            watch = None;
        }
        if table.gated(&head.req) {
            // Kept from this session for now (a memory grant of a quorum
            // loss): its end wakes nobody here, so poll.
            poll_later(&table, &kick, &stop).await;
            continue;
        }
        if head.req.shared {
            // Readers at the head go together, in one batch.
            let readers = table.book.lock().readers_at_head(&key, table.batch_limit());
            if readers.len() > 1 && table.grant_readers(readers).await {
                continue;
            }
        }
        blocked = Blocked::Holder;
        // On its way until the waiter is answered, or the attempt settled
        // on waiting (a wait that ends meanwhile settles on it first).
        let sending = head.sending();
        match table.attempt(&head.req, Asker::Queue).await {
            Ok(Attempt::Granted(grant)) => {
                table.deliver(&head, grant);
                sending.done();
                continue;
            }
            // The session holds the key already. A claim keeps that hold
            // from any orphan release and cannot be undone, so it is not
            // made for a waiter whose caller is seen gone: that waiter
            // leaves the queue, and the hold stays what it was (a fresh
            // grant for a gone call still goes as an orphan). A caller that
            // goes during the claim's round trip leaves a claimed hold,
            // which ends with its session or the session's next call.
            Ok(Attempt::Reused(_)) if head.caller_gone() => {
                table.remove(&key, head.id);
                sending.done();
                continue;
            }
            Ok(Attempt::Reused(grant)) => match table.claim_verified(&grant).await {
                Ok(Claim::Claimed) => {
                    let delivery = Delivery {
                        grant,
                        fresh: false,
                    };
                    table.answer(&head, Ok(delivery));
                    sending.done();
                    continue;
                }
                // Gone since the read: the next attempt sees what is there now.
                Ok(Claim::Gone) => {
                    sending.done();
                    continue;
                }
                Err(e) => {
                    debug!(key = %key, error = %e, "re-reading a reused grant failed; polling");
                    // The claim may have committed: the outcome is unknown.
                    drop(sending);
                    watch = None;
                    poll_later(&table, &kick, &stop).await;
                    continue;
                }
            },
            Ok(
                attempt @ (Attempt::Held { watch_from }
                | Attempt::Readers { watch_from }
                | Attempt::Intent { watch_from }),
            ) => {
                sending.done();
                blocked = match attempt {
                    Attempt::Readers { .. } => Blocked::Readers,
                    Attempt::Intent { .. } => Blocked::Intent,
                    _ => Blocked::Holder,
                };
                if blocked == Blocked::Readers {
                    // A writer waiting for shared holds: readers that come
                    // later, on any arbiter, wait behind it.
                    table.declare_intent(&head).await;
                }
                // Held exclusively now: a watch on the shared holds would
                // miss its end (the hostile review).
                if watch.is_some() && watching != watched(&key, &head.req, blocked) {
                    watch = None;
                }
                if from.is_none() || watch.is_none() {
                    from = Some(watch_from);
                }
            }
            Ok(Attempt::Behind { .. } | Attempt::Unqueued | Attempt::Gated) => {
                // Durable waiters first (a key whose callers mix classes):
                // their comings and goings do not touch the holder record
                // this driver watches, so poll.
                sending.done();
                watch = None;
                poll_later(&table, &kick, &stop).await;
                continue;
            }
            Err(e @ ArbiterError::StoreUnavailable { .. }) => {
                // It may have committed without its answer: `sending` drops
                // unfinished, so the outcome is unknown.
                drop(sending);
                debug!(key = %key, error = %e, "grant attempt failed; polling");
                watch = None;
                poll_later(&table, &kick, &stop).await;
                continue;
            }
            Err(e) => {
                table.answer(&head, Err(e));
                sending.done();
                continue;
            }
        }
        if watch.is_none()
            && let Some(rev) = from.take()
        {
            watching = watched(&key, &head.req, blocked);
            watch = match &watching {
                Watched::Intents(name) => table.log.watch_intents(name, rev).await.ok(),
                Watched::Holds(of) => table.log.watch(of, rev).await.ok(),
            };
        }
        // Wait for a hint.
        match watch.as_mut() {
            Some(w) => {
                let pause = table.jittered(table.options.poll * 5);
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = kick.notified() => {}
                    signal = w.next() => {
                        if signal == WatchSignal::Lost {
                            debug!(key = %key, "watch lost; polling until re-watched");
                            watch = None;
                        }
                    }
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            None => poll_later(&table, &kick, &stop).await,
        }
    }
}

/// What the head's last attempt found in its way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocked {
    /// A hold of the key (or nothing: the first attempt).
    Holder,
    /// Shared holds, and the head asks exclusively.
    Readers,
    /// A writer's intent, and the head asks shared.
    Intent,
}

/// What a driver watches.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Watched {
    /// Holder records: one key's, or every one under a prefix.
    Holds(String),
    /// The writers' intents on a lock.
    Intents(String),
}

impl Default for Watched {
    fn default() -> Self {
        Self::Holds(String::new())
    }
}

/// What a head waiting on `key` watches: a semaphore's waiter any of its
/// slots, an exclusive waiter held up by shared holds those holds, a
/// reader held up by a writer's intent the lock's intents, any other
/// waiter the key's exclusive hold.
fn watched(key: &str, head: &super::GrantRequest, blocked: Blocked) -> Watched {
    match (head.permits, blocked, head.shared) {
        (Some(_), ..) => Watched::Holds(crate::records::slots_of(key)),
        (None, Blocked::Readers, false) => Watched::Holds(crate::records::readers_of(key)),
        (None, Blocked::Intent, true) => Watched::Intents(key.to_string()),
        _ => Watched::Holds(key.to_string()),
    }
}
