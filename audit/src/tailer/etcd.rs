//! Everything the tailer asks etcd, through the workspace's etcd toolkit
//! ([`latchkey_etcd`]). Only reads: a range at a revision, the current revision,
//! and a watch, so a credential with read permission on the prefix (and
//! nothing else) is all the tailer needs.

use std::time::Duration;

use latchkey_etcd::scan::scan_prefix;
use latchkey_etcd::watch::{Event, EventType, WatchOptions, WatchStream, watch_from};
use latchkey_etcd::{Client, Connection, ErrorKind};

use super::TailError;
use crate::derive::{Change, LogState, Op};

/// Keys per page of the state read.
const PAGE: i64 = 1000;

pub(super) async fn connect(c: &Connection) -> Result<Client, TailError> {
    // No request timeout on the client: it would end the watch stream too
    // (the tailer bounds its own reads instead).
    let c = Connection {
        request_timeout: None,
        ..c.clone()
    };
    latchkey_etcd::connect(&c).await.map_err(etcd("connecting"))
}

pub(super) fn etcd<E: Into<latchkey_etcd::Error>>(
    context: &'static str,
) -> impl FnOnce(E) -> TailError {
    move |source| TailError::Etcd {
        context,
        source: source.into(),
    }
}

/// etcd's cluster id and current revision (a count-only read of one key).
pub(super) async fn head(
    client: &Client,
    prefix: &str,
    timeout: Duration,
) -> Result<(u64, i64), TailError> {
    let read = latchkey_etcd::kv::head(client, prefix);
    let header = tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| TailError::Timeout("reading etcd's revision"))?
        .map_err(etcd("reading etcd's revision"))?
        .ok_or(TailError::NoHeader)?;
    Ok((header.cluster_id(), header.revision()))
}

/// Why a state read failed.
pub(super) enum LoadError {
    Compacted,
    Other(TailError),
}

/// The state under `prefix` at `revision` (empty at 0), read in pages.
pub(super) async fn load(
    client: &Client,
    prefix: &str,
    revision: i64,
) -> Result<LogState, LoadError> {
    if revision == 0 {
        return Ok(LogState::default());
    }
    let mut kvs: Vec<(String, Vec<u8>, i64, i64)> = Vec::new();
    let read = scan_prefix(client, prefix, PAGE, Some(revision), |kv| {
        if let Ok(key) = std::str::from_utf8(kv.key())
            && let Some(relative) = key.strip_prefix(prefix)
        {
            kvs.push((
                relative.to_string(),
                kv.value().to_vec(),
                kv.lease(),
                kv.mod_revision(),
            ));
        }
    })
    .await;
    if let Err(e) = read {
        return Err(match e.kind() {
            ErrorKind::Compacted => LoadError::Compacted,
            _ => LoadError::Other(etcd("reading the prefix")(e)),
        });
    }
    Ok(LogState::load(kvs.iter().map(|(k, v, lease, rev)| {
        (k.as_str(), v.as_slice(), *lease, *rev)
    })))
}

/// The revision etcd has compacted to, given that `below` is compacted:
/// a watch from `below` is cancelled with it.
pub(super) async fn compact_revision(
    client: &Client,
    prefix: &str,
    below: i64,
    timeout: Duration,
) -> Result<i64, TailError> {
    let ask = async {
        let options = WatchOptions::new().with_prefix();
        let mut stream = watch_from(client, prefix, below.max(1), options)
            .await
            .map_err(etcd("watching for the compact revision"))?;
        loop {
            let Some(resp) = stream
                .message()
                .await
                .map_err(etcd("watching for the compact revision"))?
            else {
                return Err(TailError::WatchEnded);
            };
            if resp.compact_revision() > 0 {
                return Ok(resp.compact_revision());
            }
            if !resp.events().is_empty() || resp.canceled() {
                // Not compacted after all (the read raced a restart):
                // nothing is missing.
                return Ok(below);
            }
        }
    };
    tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| TailError::Timeout("asking for the compact revision"))?
}

/// A watch of everything under `prefix` from `revision` (inclusive).
///
/// No progress notifications: etcd 3.4.23 may send one ahead of events
/// still in flight (fixed in 3.4.24), and a checkpoint moved by it could
/// skip them. The checkpoint moves only with events.
pub(super) async fn watch(
    client: &Client,
    prefix: &str,
    revision: i64,
) -> Result<WatchStream, TailError> {
    let options = WatchOptions::new().with_prefix();
    watch_from(client, prefix, revision, options)
        .await
        .map_err(etcd("watching the prefix"))
}

/// A watch response's events as changes, grouped by revision in order.
/// etcd never splits a revision over responses unless asked to.
pub(super) fn revisions(prefix: &str, events: &[Event]) -> Vec<(i64, Vec<Change>)> {
    let mut out: Vec<(i64, Vec<Change>)> = Vec::new();
    for event in events {
        let Some(kv) = event.kv() else { continue };
        let revision = kv.mod_revision();
        let Some(key) = std::str::from_utf8(kv.key())
            .ok()
            .and_then(|k| k.strip_prefix(prefix))
        else {
            continue;
        };
        let change = Change {
            op: match event.event_type() {
                EventType::Put => Op::Put,
                EventType::Delete => Op::Delete,
            },
            key: key.to_string(),
            value: kv.value().to_vec(),
            lease: kv.lease(),
        };
        match out.last_mut() {
            Some((r, changes)) if *r == revision => changes.push(change),
            _ => out.push((revision, vec![change])),
        }
    }
    out
}
