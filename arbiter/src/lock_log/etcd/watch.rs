//! A watch on one holder record, or on a key's durable queue, over an etcd
//! watch stream. Only ever a hint to try a grant: the grant transaction
//! decides.

use async_trait::async_trait;
use latchkey_etcd::watch::{EventType, WatchOptions, WatchStream, watch_from};

use super::{EtcdLog, unavailable};
use crate::lock_log::{KeyWatch, StoreError, WatchSignal};

/// Watches `key`'s holder record from `from_revision` (inclusive), so
/// nothing between a failed grant and the watch is missed. A prefix of
/// holds ([`latchkey_records::is_holds_prefix`]: a semaphore's slots
/// prefix, `<name>//s/`, or a lock's shared holds prefix, `<name>//r/`,
/// which no lock key ends with) watches every hold under it.
pub(super) async fn watch(
    log: &EtcdLog,
    key: &str,
    from_revision: i64,
) -> Result<Box<dyn KeyWatch>, StoreError> {
    let options = match latchkey_records::is_holds_prefix(key) {
        true => WatchOptions::new().with_prefix(),
        false => WatchOptions::new(),
    };
    open(log, log.layout.holder(key), options, from_revision)
        .await
        .map_err(|e| unavailable("cannot watch a holder record", e))
}

/// Watches `key`'s durable queue (every waiter record) from
/// `from_revision` (inclusive): a waiter leaving may make another first.
pub(super) async fn watch_queue(
    log: &EtcdLog,
    key: &str,
    from_revision: i64,
) -> Result<Box<dyn KeyWatch>, StoreError> {
    let prefix = WatchOptions::new().with_prefix();
    open(log, log.layout.queue_of(key), prefix, from_revision)
        .await
        .map_err(|e| unavailable("cannot watch a durable queue", e))
}

/// Watches the writers' intents on lock `name` from `from_revision`
/// (inclusive): an intent leaving may let readers in.
pub(super) async fn watch_intents(
    log: &EtcdLog,
    name: &str,
    from_revision: i64,
) -> Result<Box<dyn KeyWatch>, StoreError> {
    let prefix = WatchOptions::new().with_prefix();
    open(log, log.layout.intents_of(name), prefix, from_revision)
        .await
        .map_err(|e| unavailable("cannot watch writers' intents", e))
}

async fn open(
    log: &EtcdLog,
    key: String,
    options: WatchOptions,
    from_revision: i64,
) -> Result<Box<dyn KeyWatch>, latchkey_etcd::Error> {
    let stream = watch_from(&log.client, key, from_revision, options).await?;
    Ok(Box::new(EtcdKeyWatch { stream }))
}

/// The stream of one watch; dropping it ends the watch.
struct EtcdKeyWatch {
    stream: WatchStream,
}

#[async_trait]
impl KeyWatch for EtcdKeyWatch {
    async fn next(&mut self) -> WatchSignal {
        loop {
            match self.stream.message().await {
                Ok(Some(resp)) => {
                    let events = resp.events().iter().map(|e| e.event_type());
                    if let Some(signal) = signal(resp.canceled(), events) {
                        return signal;
                    }
                }
                Ok(None) | Err(_) => return WatchSignal::Lost,
            }
        }
    }
}

/// What one watch response means: `None` for one with nothing in it (the
/// creation notice, a progress notify), to be skipped. A delete anywhere
/// in the response frees the key, even if a put follows in the same
/// response: an attempt costs little and finds out.
fn signal(canceled: bool, events: impl Iterator<Item = EventType>) -> Option<WatchSignal> {
    if canceled {
        return Some(WatchSignal::Lost);
    }
    let mut any = false;
    for event in events {
        if event == EventType::Delete {
            return Some(WatchSignal::Freed);
        }
        any = true;
    }
    any.then_some(WatchSignal::Changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_watch_responses_as_the_store_did() {
        use EventType::{Delete, Put};
        assert_eq!(signal(true, [Delete].into_iter()), Some(WatchSignal::Lost));
        assert_eq!(signal(false, [].into_iter()), None);
        assert_eq!(signal(false, [Put].into_iter()), Some(WatchSignal::Changed));
        assert_eq!(
            signal(false, [Put, Delete].into_iter()),
            Some(WatchSignal::Freed)
        );
    }
}
