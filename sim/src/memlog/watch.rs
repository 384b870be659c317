//! A key watch on the [`super::MemLog`]: one response per `next`, from the
//! queue the store fills at commit time.
//!
//! While it waits, a watch also sleeps until the earliest lease deadline and
//! then applies the expiries itself: lease expiry needs no other call and no
//! background task, and under paused time tokio's clock jumps straight to
//! the deadline.

use std::sync::Arc;

use async_trait::async_trait;
use latchkey_arbiter::lock_log::{FollowSignal, KeyWatch, PrefixWatch, WatchSignal};

use super::Shared;

pub(crate) struct MemWatch {
    shared: Arc<Shared>,
    id: u64,
    changed: tokio::sync::watch::Receiver<u64>,
}

impl MemWatch {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: u64,
        changed: tokio::sync::watch::Receiver<u64>,
    ) -> Self {
        Self {
            shared,
            id,
            changed,
        }
    }
}

/// The next response `poll` finds, waiting for the store to change (or
/// for the earliest lease deadline, applying the expiries due) until there
/// is one; `lost` once the store is gone. Checked and marked seen under the
/// store's lock, and every change is announced under it too: no wake-up is
/// missed.
async fn next_response<T>(
    shared: &Shared,
    changed: &mut tokio::sync::watch::Receiver<u64>,
    mut poll: impl FnMut(&mut super::Inner) -> Option<T>,
    lost: T,
) -> T {
    loop {
        let deadline = match shared.with(|inner, _| {
            let polled = poll(inner);
            changed.borrow_and_update();
            polled.ok_or(inner.store.earliest_deadline())
        }) {
            Ok(response) => return response,
            Err(deadline) => deadline,
        };
        let woke = match deadline {
            Some(deadline) => tokio::select! {
                woke = changed.changed() => woke,
                () = tokio::time::sleep_until(deadline) => Ok(()),
            },
            None => changed.changed().await,
        };
        if woke.is_err() {
            // the store is gone
            return lost;
        }
    }
}

#[async_trait]
impl KeyWatch for MemWatch {
    async fn next(&mut self) -> WatchSignal {
        let id = self.id;
        next_response(
            &self.shared,
            &mut self.changed,
            |inner| inner.store.poll_watch(id),
            WatchSignal::Lost,
        )
        .await
    }
}

impl Drop for MemWatch {
    fn drop(&mut self) {
        let id = self.id;
        self.shared.lock().store.close_watch(id);
    }
}

/// A prefix watch on the [`super::MemLog`] (the followers'): one response
/// per `next`, woken like [`MemWatch`], lease expiries applied while it
/// waits.
pub(crate) struct MemPrefixWatch {
    shared: Arc<Shared>,
    id: u64,
    changed: tokio::sync::watch::Receiver<u64>,
}

impl MemPrefixWatch {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: u64,
        changed: tokio::sync::watch::Receiver<u64>,
    ) -> Self {
        Self {
            shared,
            id,
            changed,
        }
    }
}

#[async_trait]
impl PrefixWatch for MemPrefixWatch {
    async fn next(&mut self) -> FollowSignal {
        let id = self.id;
        next_response(
            &self.shared,
            &mut self.changed,
            |inner| inner.store.poll_prefix_watch(id),
            FollowSignal::Lost,
        )
        .await
    }
}

impl Drop for MemPrefixWatch {
    fn drop(&mut self) {
        let id = self.id;
        self.shared.lock().store.close_prefix_watch(id);
    }
}
