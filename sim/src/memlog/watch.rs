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

#[async_trait]
impl KeyWatch for MemWatch {
    async fn next(&mut self) -> WatchSignal {
        loop {
            let id = self.id;
            let changed = &mut self.changed;
            // Checked and marked seen under the store's lock, and every
            // change is announced under it too: no wake-up is missed.
            let deadline = match self.shared.with(|inner, _| {
                let polled = inner.store.poll_watch(id);
                changed.borrow_and_update();
                polled.ok_or(inner.store.earliest_deadline())
            }) {
                Ok(signal) => return signal,
                Err(deadline) => deadline,
            };
            let woke = match deadline {
                Some(deadline) => tokio::select! {
                    woke = self.changed.changed() => woke,
                    () = tokio::time::sleep_until(deadline) => Ok(()),
                },
                None => self.changed.changed().await,
            };
            if woke.is_err() {
                // the store is gone
                return WatchSignal::Lost;
            }
        }
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
        loop {
            let id = self.id;
            let changed = &mut self.changed;
            let deadline = match self.shared.with(|inner, _| {
                let polled = inner.store.poll_prefix_watch(id);
                changed.borrow_and_update();
                polled.ok_or(inner.store.earliest_deadline())
            }) {
                Ok(signal) => return signal,
                Err(deadline) => deadline,
            };
            let woke = match deadline {
                Some(deadline) => tokio::select! {
                    woke = self.changed.changed() => woke,
                    () = tokio::time::sleep_until(deadline) => Ok(()),
                },
                None => self.changed.changed().await,
            };
            if woke.is_err() {
                return FollowSignal::Lost;
            }
        }
    }
}

impl Drop for MemPrefixWatch {
    fn drop(&mut self) {
        let id = self.id;
        self.shared.lock().store.close_prefix_watch(id);
    }
}
