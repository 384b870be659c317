//! `maxHoldSeconds` (issue 34): a hold of such a class ends when that long
//! has passed since its grant, however its session renews, as an expiry
//! does — the hold is deleted (exactly that hold: its bytes, lease and
//! revision compared), its waiters are woken, and its holder hears of it
//! on its KeepAlive stream (`ended_holds`) and fences. So renewing readers
//! cannot keep a writer out for longer than the class says.
//!
//! Who ends it: the arbiter that answered the grant sets a timer
//! ([`LockTable::end_after`]); a sweep (every [`SWEEP_EVERY`], only while a
//! class sets `maxHoldSeconds`) finds holds whose arbiter went away and
//! times them too. The due time is the grant's `acquiredAtUnixMs` (the
//! granting arbiter's clock) plus the class's bound: arbiters' clocks
//! apart by a second end a hold a second early or late. Ending a hold is
//! never unsafe (the token fences whatever its holder still does); it
//! is how soon a writer gets in that depends on it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info};

use super::LockTable;
use crate::lock_log::HeldAt;
use crate::records::{HolderRecord, decode, now_unix_ms};

/// How often the sweep looks for holds past their class's bound.
pub const SWEEP_EVERY: Duration = Duration::from_secs(30);
/// Keys the sweep reads per page (then their records, 64 per request).
const SWEEP_PAGE: usize = 512;

/// The holds a timer is set for, by (key, revision): one timer per hold.
pub(super) type Timed = parking_lot::Mutex<HashSet<(String, i64)>>;

impl LockTable {
    /// Ends the hold on `key` granted to `session` at `revision` once `max`
    /// has passed since its grant (its record's time), unless it ended
    /// first. One timer per hold, however many calls were answered with it.
    pub fn end_after(self: &Arc<Self>, key: &str, session: i64, revision: i64, max: Duration) {
        let id = (key.to_string(), revision);
        if !self.max_holds.lock().insert(id.clone()) {
            return;
        }
        let table = self.clone();
        self.tasks.spawn(async move {
            table.end_when_due(&id.0, session, revision, max).await;
            table.max_holds.lock().remove(&id);
        });
    }

    async fn end_when_due(&self, key: &str, session: i64, revision: i64, max: Duration) {
        let Some(record) = self.hold_at(key, session, revision).await else {
            return;
        };
        let bound = i64::try_from(max.as_millis()).unwrap_or(i64::MAX);
        let due = decode::<HolderRecord>(&record)
            .map_or(now_unix_ms(), |r| r.acquired_at_unix_ms)
            .saturating_add(bound);
        let left = due.saturating_sub(now_unix_ms());
        if left > 0 {
            let pause = Duration::from_millis(u64::try_from(left).unwrap_or(0));
            tokio::select! {
                biased;
                () = self.stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
        // Still that hold: ended exactly, as a release of it would be.
        let Some(value) = self.hold_at(key, session, revision).await else {
            return;
        };
        let held = HeldAt {
            key: key.to_string(),
            session,
            revision,
            value,
        };
        match self.release_owned(&held).await {
            Ok(_) => {
                info!(key = %key, bound_s = max.as_secs(), "ended a hold at its class's maxHoldSeconds");
                self.kick(key);
            }
            Err(e) => {
                debug!(key = %key, error = %e, "a hold past its class's maxHoldSeconds was not ended (it changed, or the log did not answer)")
            }
        }
    }

    /// The record of the hold on `key` if it is still `session`'s at
    /// `revision`.
    async fn hold_at(&self, key: &str, session: i64, revision: i64) -> Option<Vec<u8>> {
        let (kv, _) = self.seal.checked(self.log.holder(key)).await.ok()?;
        kv.filter(|kv| kv.lease == session && kv.mod_revision == revision)
            .map(|kv| kv.value)
    }

    /// Starts the sweep once (see the module doc).
    pub(super) fn start_max_hold_sweep(self: &Arc<Self>) {
        if self
            .sweeping
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        let table = self.clone();
        self.tasks.spawn(async move {
            loop {
                let pause = table.jittered(SWEEP_EVERY);
                tokio::select! {
                    biased;
                    () = table.stop.cancelled() => return,
                    () = tokio::time::sleep(pause) => {}
                }
                if table.any_max_hold() {
                    table.sweep_max_holds().await;
                }
            }
        });
    }

    /// One pass over every hold: a timer for each of a class with
    /// `maxHoldSeconds` that has none here.
    async fn sweep_max_holds(self: &Arc<Self>) {
        let mut after: Option<String> = None;
        loop {
            let Ok(page) = self
                .seal
                .checked(self.log.held_keys_page(after.as_deref(), SWEEP_PAGE))
                .await
            else {
                return;
            };
            let (keys, _) = page;
            let Some(last) = keys.last().cloned() else {
                return;
            };
            for chunk in keys.chunks(crate::lock_log::HOLDERS_OF_AT_ONCE) {
                let Ok((holds, _)) = self.seal.checked(self.log.holders_of(chunk)).await else {
                    return;
                };
                for (key, kv) in chunk.iter().zip(holds) {
                    let Some(kv) = kv else { continue };
                    let Some(record) = decode::<HolderRecord>(&kv.value) else {
                        continue;
                    };
                    if let Some(max) = self.max_hold_of(&record.class) {
                        self.end_after(key, kv.lease, kv.mod_revision, max);
                    }
                }
            }
            if keys.len() < SWEEP_PAGE {
                return;
            }
            after = Some(last);
        }
    }
}
