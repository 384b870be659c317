//! Following a counted key space of the log: one read of every key (at one
//! revision), then a watch from the next revision on; read again from
//! scratch whenever the watch breaks or its events were compacted away,
//! since only a fresh read is exact then. The log does the reading and the
//! watching ([`FollowLog`]: etcd's paged reads and prefix watch, or the
//! simulation's in-memory log); what the keys mean is the follower's
//! ([`Followed`]): the hold counts read holder records
//! ([`crate::hold_counts`]), the session counts the session index
//! ([`crate::session_counts`]).

use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::lock_log::{Counted, FollowLog, FollowSignal, Kv, StoreError};

/// One change of a followed key, as the log reported it.
pub type Event = crate::lock_log::FollowEvent;

/// Pause before reading again after the watch broke (a watch that keeps
/// being refused must not become a loop of full reads).
const RETRY: Duration = Duration::from_secs(1);

/// What a key space's keys mean to the one following them.
pub trait Followed: Send + Sync + 'static {
    /// What a read from scratch builds, key by key, before it is installed.
    type Reading: Default + Send;
    /// What is followed, for logs ("holds", "sessions").
    const WHAT: &'static str;
    /// Whether a delete must carry the deleted value (etcd's `prev_kv`):
    /// only when the value, not the key, says whose the key was.
    const PREV_KV: bool;

    /// Adds one key read from scratch (`key` without the prefix).
    fn read(reading: &mut Self::Reading, key: &str, kv: &Kv);
    /// Replaces what was followed with a fresh read at `revision`. After a
    /// lost watch, what was followed and the reading does not show changed
    /// unseen: a follower that tells of changes tells of these here.
    fn install(&self, reading: Self::Reading, revision: i64);
    /// One watch response's events, all at or below `revision`. `false`:
    /// an event it cannot attribute (applied none of them); read again.
    fn apply(&self, events: &[Event], revision: i64) -> bool;
    /// The watch broke: what was followed may fall behind the log until the
    /// next [`Self::install`].
    fn lost(&self) {}
}

/// Keeps `followed` up to date with every key of `counted` in `log`. Runs
/// until the arbiter stops (the task is aborted).
pub async fn follow<F: Followed>(followed: Arc<F>, log: Arc<dyn FollowLog>, counted: Counted) {
    loop {
        match read_and_watch(followed.as_ref(), log.as_ref(), counted).await {
            Ok(()) => warn!(what = F::WHAT, "the watch ended; reading everything again"),
            Err(e) => {
                warn!(what = F::WHAT, error = %e.detail(), "cannot read or watch the counted keys; trying again");
            }
        }
        followed.lost();
        tokio::time::sleep(RETRY).await;
    }
}

async fn read_and_watch<F: Followed>(
    followed: &F,
    log: &dyn FollowLog,
    counted: Counted,
) -> Result<(), StoreError> {
    let mut reading = F::Reading::default();
    let (revision, watch) = log
        .follow(counted, F::PREV_KV, &mut |key, kv| {
            F::read(&mut reading, key, kv);
        })
        .await?;
    // Installed before the watch's outcome is known: a watch that keeps
    // failing still leaves a count at most a retry old.
    followed.install(reading, revision);
    let mut watch = watch?;
    loop {
        match watch.next().await {
            FollowSignal::Events { events, through } => {
                if !followed.apply(&events, through) {
                    return Ok(());
                }
            }
            FollowSignal::Lost => return Ok(()),
        }
    }
}
