//! Writers' intents (issue 34): a writer that waits for a lock's shared
//! holds to end says so in the log, so readers that come later wait behind
//! it whichever arbiter they ask. Without it a writer queued on one arbiter
//! was starved by readers renewing through another: the in-memory queue
//! orders only the waiters of one arbiter (measured: 0 of 3 writers granted
//! in 5 s against readers on a second arbiter).
//!
//! - **The record.** `w/<name>//<session>`, on the writer's session lease
//!   (it ends with the session), put once the writer's queue attempt finds
//!   the lock held shared. Its value is a [`WaiterRecord`]: how long the
//!   writer still waits.
//! - **What it does.** Every shared grant of `name` compares the lock's
//!   intents absent in its transaction and reads the oldest on failure; the
//!   reader then waits, watching the intents. Nothing else compares them: an
//!   intent only holds readers back, never grants anything (safety does not
//!   depend on it) and never delays a writer.
//! - **Its end.** The writer's wait ending (granted, timed out, cancelled)
//!   deletes it, compared by its last write. An intent whose writer's
//!   arbiter died before that is removed by a reader's arbiter once it has
//!   seen it unchanged for longer than the writer's wait and
//!   [`super::durable::STALE_AFTER`], on its own clock (the durable
//!   waiters' rule, [`LockTable::note_intent`]).
//! - **Fairness it gives.** Across arbiters a waiting writer keeps later
//!   readers out (writer preference, bounded by each writer's wait); within
//!   one arbiter the queue is phase-fair as before.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::time::Instant;
use tracing::debug;

use super::LockTable;
use super::queues::Head;
use crate::lock_log::StoreError;
use crate::records::{WaiterRecord, encode};

/// A queued writer's intent: whether it is in the log, at which write.
#[derive(Debug)]
pub(super) struct Intent {
    /// When the writer's wait ends (what the record says it waits).
    until: Instant,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The record's last write, while it may be in the log.
    put: Option<i64>,
    /// A put is on its way.
    putting: bool,
    /// The wait ended: no put starts, and one that lands is deleted.
    ended: bool,
}

impl Intent {
    pub(super) fn new(until: Instant) -> Arc<Self> {
        Arc::new(Self {
            until,
            state: Mutex::new(State::default()),
        })
    }
}

impl LockTable {
    /// The head of lock `head.req.key`'s queue, a writer, found the lock
    /// held shared: puts its intent unless it has one. Failing costs only
    /// fairness, so a failure is logged and the next attempt tries again.
    pub(super) async fn declare_intent(self: &Arc<Self>, head: &Head) {
        {
            let mut state = head.intent.state.lock();
            if state.ended || state.putting || state.put.is_some() {
                return;
            }
            state.putting = true;
        }
        let req = &head.req;
        let wait = head.intent.until.saturating_duration_since(Instant::now());
        let record = encode(&WaiterRecord {
            identity: req.identity.clone(),
            session: req.session,
            class: req.class.clone(),
            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        });
        let put = self
            .log
            .put_intent(&req.key, req.session, &req.session_bytes(), record)
            .await;
        let mut state = head.intent.state.lock();
        state.putting = false;
        match put {
            Ok(answer) => match answer.value {
                Some(queued) if state.ended => {
                    drop(state);
                    self.drop_intent(&req.key, req.session, queued.modified);
                }
                Some(queued) => state.put = Some(queued.modified),
                // Not the caller's session (any more): its grant says so.
                None => {}
            },
            // It may have been written: a later put over it learns its
            // revision, and otherwise it is removed as stale.
            Err(e) => debug!(key = %req.key, error = %e, "could not put a writer's intent"),
        }
    }

    /// The writer's wait ended: its intent goes (in the background; the
    /// grant or answer does not wait for it).
    pub(super) fn end_intent(self: &Arc<Self>, key: &str, session: i64, intent: &Intent) {
        let put = {
            let mut state = intent.state.lock();
            state.ended = true;
            state.put.take()
        };
        if let Some(modified) = put {
            self.drop_intent(key, session, modified);
        }
    }

    fn drop_intent(self: &Arc<Self>, key: &str, session: i64, modified: i64) {
        let (table, key) = (self.clone(), key.to_string());
        self.tasks.spawn(async move {
            match table.log.drop_intent(&key, session, modified).await {
                Ok(_) | Err(StoreError::LeaseGone { .. }) => {}
                Err(e) => {
                    debug!(key = %key, error = %e, "could not remove a writer's intent; it ends with its session or is removed as stale");
                }
            }
        });
    }
}
