//! The etcd side of following a counted key space ([`FollowLog`]): every
//! key under the prefix in pages at one revision, then a prefix watch from
//! the next revision on. What the keys mean is the follower's
//! (`crate::follow`).

use async_trait::async_trait;
use latchkey_etcd::scan::scan_prefix;
use latchkey_etcd::watch::{EventType, WatchOptions, WatchResponse, WatchStream, watch_from};
use latchkey_etcd::{Client, KeyValue};
use tracing::warn;

use super::{EtcdLog, kv, unavailable};
use crate::lock_log::{Counted, FollowEvent, FollowLog, FollowSignal, Kv, PrefixWatch, StoreError};
use crate::records::Layout;

/// Keys read per request when reading from scratch (a holder record is a
/// few hundred bytes, a session entry none: well inside a gRPC message).
const PAGE: i64 = 2_000;

/// A follower's own connection to etcd: the watches of every holder record
/// and session entry must not queue behind grants on the lock log's.
#[derive(Clone)]
pub struct EtcdFollower {
    client: Client,
    layout: Layout,
}

impl EtcdFollower {
    pub fn new(client: Client, prefix: &str) -> Self {
        Self {
            client,
            layout: Layout::new(prefix),
        }
    }
}

#[async_trait]
impl FollowLog for EtcdFollower {
    async fn follow(
        &self,
        counted: Counted,
        prev_kv: bool,
        each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
    ) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError> {
        follow_on(&self.client, &self.layout, counted, prev_kv, each).await
    }
}

/// On the lock log's own connection: a `LockLog` can follow, but the
/// arbiter's counts follow through an [`EtcdFollower`] of their own, so
/// their watches never queue behind grants.
#[async_trait]
impl FollowLog for EtcdLog {
    async fn follow(
        &self,
        counted: Counted,
        prev_kv: bool,
        each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
    ) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError> {
        follow_on(&self.client, &self.layout, counted, prev_kv, each).await
    }
}

fn prefix_of(layout: &Layout, counted: Counted) -> String {
    match counted {
        Counted::Holds => layout.holders(),
        Counted::SessionIndex => layout.session_index(),
    }
}

async fn follow_on(
    client: &Client,
    layout: &Layout,
    counted: Counted,
    prev_kv: bool,
    each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError> {
    let prefix = prefix_of(layout, counted);
    let revision = scan_prefix(client, &prefix, PAGE, None, |entry| {
        if let Some(key) = entry
            .key_str()
            .ok()
            .and_then(|k| k.strip_prefix(prefix.as_str()))
        {
            each(key, &kv(entry));
        }
    })
    .await
    .map_err(|e| unavailable("cannot read the counted keys", e))?;
    let mut options = WatchOptions::new().with_prefix();
    if prev_kv {
        options = options.with_prev_key();
    }
    let watch = watch_from(client, prefix.as_str(), revision + 1, options)
        .await
        .map(|stream| Box::new(EtcdPrefixWatch { stream, prefix }) as Box<dyn PrefixWatch>)
        .map_err(|e| unavailable("cannot watch the counted keys", e));
    Ok((revision, watch))
}

pub(super) struct EtcdPrefixWatch {
    pub(super) stream: WatchStream,
    pub(super) prefix: String,
}

#[async_trait]
impl PrefixWatch for EtcdPrefixWatch {
    async fn next(&mut self) -> FollowSignal {
        loop {
            let resp = match self.stream.message().await {
                Ok(Some(resp)) => resp,
                Ok(None) => return FollowSignal::Lost,
                Err(e) => {
                    warn!(error = %e, "the watch of the counted keys failed");
                    return FollowSignal::Lost;
                }
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                // Events were lost (compaction): only a fresh read is exact.
                return FollowSignal::Lost;
            }
            // etcd's first answer says nothing about how far the log is known.
            let Some(through) = known_through(&resp) else {
                continue;
            };
            let prefix = self.prefix.as_str();
            let events = resp
                .events()
                .iter()
                .map(|e| FollowEvent {
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
            return FollowSignal::Events { events, through };
        }
    }
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
