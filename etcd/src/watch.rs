//! Watches: etcd-client's types, and opening one from a revision, which is
//! how every watcher here starts (right after the read it follows, so no
//! change between the two is missed).

pub use etcd_client::{Event, EventType, WatchClient, WatchOptions, WatchResponse, WatchStream};

use etcd_client::Client;

use crate::Error;

/// The largest watch response a watcher takes. One revision can be large:
/// a session's end deletes every hold on its lease at once, and with
/// `prev_kv` each deleted record comes back whole (20,000 holds of 400
/// bytes are ~10 MB). gRPC's default of 4 MiB broke the holds' watch on
/// such a revision, and every lock-loss notice until the next full read
/// with it. What one revision can carry is bounded by the per-subject hold
/// and session bounds, not by this.
pub const MAX_WATCH_RESPONSE_BYTES: usize = 256 << 20;

/// Watches `key` (every key under it, with `options.with_prefix()`) from
/// `from_revision` on, that revision included, taking responses up to
/// [`MAX_WATCH_RESPONSE_BYTES`].
pub async fn watch_from(
    client: &Client,
    key: impl Into<Vec<u8>>,
    from_revision: i64,
    options: WatchOptions,
) -> Result<WatchStream, Error> {
    let options = options.with_start_revision(from_revision);
    Ok(client
        .watch_client()
        .max_decoding_message_size(MAX_WATCH_RESPONSE_BYTES)
        .watch(key, Some(options))
        .await?)
}
