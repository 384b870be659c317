//! Following every key under a prefix: one read of them all (paginated, at
//! one revision), then a watch from the next revision on; read again from
//! scratch whenever the watch breaks or its events were compacted away,
//! since only a fresh read is exact then. What the keys mean is the
//! follower's ([`Followed`]): the hold counts read holder records
//! ([`crate::hold_counts`]), the session counts the session index
//! ([`crate::session_counts`]). Neither names etcd.

use std::sync::Arc;
use std::time::Duration;

use latchkey_etcd::scan::scan_prefix;
use latchkey_etcd::watch::{EventType, WatchOptions, WatchResponse, watch_from};
use latchkey_etcd::{Client, KeyValue};
use tracing::warn;

use super::kv;
use crate::lock_log::Kv;

/// Keys read per request when reading from scratch (a holder record is a
/// few hundred bytes, a session entry none: well inside a gRPC message).
const PAGE: i64 = 2_000;
/// Pause before reading again after the watch broke (a watch that keeps
/// being refused must not become a loop of full reads).
const RETRY: Duration = Duration::from_secs(1);

/// One change of a followed key, as the watch reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The key without the prefix.
    pub key: String,
    /// The value put; `None` for a delete (an expiry's included).
    pub put: Option<Kv>,
    /// The value before the change, when the follower asks for it
    /// ([`Followed::PREV_KV`]) and etcd still had it.
    pub prev: Option<Kv>,
}

/// What a prefix's keys mean to the one following them.
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
    /// Replaces what was followed with a fresh read at `revision`.
    fn install(&self, reading: Self::Reading, revision: i64);
    /// One watch response's events, all at or below `revision`. `false`:
    /// an event it cannot attribute (applied none of them); read again.
    fn apply(&self, events: &[Event], revision: i64) -> bool;
    /// The watch broke: what was followed may fall behind the log until the
    /// next [`Self::install`].
    fn lost(&self) {}
}

/// Keeps `followed` up to date with every key under `prefix`. Runs until
/// the arbiter stops (the task is aborted).
pub async fn follow<F: Followed>(followed: Arc<F>, client: Client, prefix: String) {
    loop {
        match read_and_watch(followed.as_ref(), &client, &prefix).await {
            Ok(()) => warn!(what = F::WHAT, "the watch ended; reading everything again"),
            Err(e) => {
                warn!(what = F::WHAT, error = %e, "cannot read or watch the counted keys; trying again");
            }
        }
        followed.lost();
        tokio::time::sleep(RETRY).await;
    }
}

async fn read_and_watch<F: Followed>(
    followed: &F,
    client: &Client,
    prefix: &str,
) -> Result<(), latchkey_etcd::Error> {
    let (reading, revision) = read_all::<F>(client, prefix).await?;
    followed.install(reading, revision);
    let mut options = WatchOptions::new().with_prefix();
    if F::PREV_KV {
        options = options.with_prev_key();
    }
    let mut stream = watch_from(client, prefix, revision + 1, options).await?;
    while let Some(resp) = stream.message().await? {
        if resp.canceled() || resp.compact_revision() > 0 {
            // Events were lost (compaction): only a fresh read is exact.
            return Ok(());
        }
        // etcd's first answer says nothing about how far the log is known.
        let Some(at) = known_through(&resp) else {
            continue;
        };
        let events: Vec<Event> = resp
            .events()
            .iter()
            .map(|e| Event {
                key: e
                    .kv()
                    .and_then(|kv| kv.key_str().ok()?.strip_prefix(prefix))
                    .unwrap_or_default()
                    .to_string(),
                put: match e.event_type() {
                    EventType::Put => e.kv().map(kv),
                    EventType::Delete => None,
                },
                prev: e.prev_kv().map(kv),
            })
            .collect();
        if !followed.apply(&events, at) {
            return Ok(());
        }
    }
    Ok(())
}

/// How far the log is known once `resp` is applied: its last event's
/// revision (a catching-up watch may send a later header with earlier
/// events), or the header's for a progress notice; `None` for etcd's
/// `created` answer, which carries no events and etcd's *current* revision
/// while the events from the start revision on are still to come (taken as
/// known, it let opens and grants made here since the read stop counting
/// before the watch showed them: found by a hostile review, issue 31).
pub fn known_through(resp: &WatchResponse) -> Option<i64> {
    let last = resp
        .events()
        .iter()
        .filter_map(|e| e.kv().map(KeyValue::mod_revision))
        .max();
    match (last, resp.created()) {
        (Some(at), _) => Some(at),
        (None, true) => None,
        (None, false) => Some(resp.header().map_or(0, |h| h.revision())),
    }
}

/// Every key under `prefix`, one page after another, all at the first
/// page's revision; with that revision.
async fn read_all<F: Followed>(
    client: &Client,
    prefix: &str,
) -> Result<(F::Reading, i64), latchkey_etcd::Error> {
    let mut reading = F::Reading::default();
    let revision = scan_prefix(client, prefix, PAGE, None, |entry| {
        if let Some(key) = entry.key_str().ok().and_then(|k| k.strip_prefix(prefix)) {
            F::read(&mut reading, key, &kv(entry));
        }
    })
    .await?;
    Ok((reading, revision))
}
