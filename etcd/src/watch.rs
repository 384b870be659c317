//! Watches: etcd-client's types, and opening one from a revision, which is
//! how every watcher here starts (right after the read it follows, so no
//! change between the two is missed).

pub use etcd_client::{Event, EventType, WatchClient, WatchOptions, WatchResponse, WatchStream};

use etcd_client::Client;

use crate::Error;

/// Watches `key` (every key under it, with `options.with_prefix()`) from
/// `from_revision` on, that revision included.
pub async fn watch_from(
    client: &Client,
    key: impl Into<Vec<u8>>,
    from_revision: i64,
    options: WatchOptions,
) -> Result<WatchStream, Error> {
    let options = options.with_start_revision(from_revision);
    Ok(client.watch_client().watch(key, Some(options)).await?)
}
