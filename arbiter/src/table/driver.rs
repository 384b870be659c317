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
    // What the watch is on: the key, its shared holds, or a semaphore's
    // slots (`watched`).
    let mut watching = String::new();
    let mut from = watch_from;
    // The last attempt found the key held shared (an exclusive head waits
    // for the shared holds to end).
    let mut readers_hold = false;
    while let Some(head) = table.head_or_retire(&key) {
        if stop.is_cancelled() {
            return;
        }
        if watch.is_some() && watching != watched(&key, &head.req, readers_hold) {
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
        readers_hold = false;
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
            Ok(Attempt::Held { watch_from }) => {
                sending.done();
                // Held exclusively now: a watch on the shared holds would
                // miss its end (the hostile review).
                if watch.is_some() && watching != watched(&key, &head.req, readers_hold) {
                    watch = None;
                }
                if from.is_none() || watch.is_none() {
                    from = Some(watch_from);
                }
            }
            Ok(Attempt::Readers { watch_from }) => {
                sending.done();
                readers_hold = true;
                if watch.is_some() && watching != watched(&key, &head.req, readers_hold) {
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
            watching = watched(&key, &head.req, readers_hold);
            watch = table.log.watch(&watching, rev).await.ok();
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

/// What a head waiting on `key` watches: a semaphore's waiter any of its
/// slots, an exclusive waiter held up by shared holds those holds, any
/// other waiter the key's exclusive hold.
fn watched(key: &str, head: &super::GrantRequest, readers_hold: bool) -> String {
    match (head.permits, readers_hold && !head.shared) {
        (Some(_), _) => crate::records::slots_of(key),
        (None, true) => crate::records::readers_of(key),
        (None, false) => key.to_string(),
    }
}
