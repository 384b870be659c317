//! Key watches (and prefix watches: an election's) whose wake-ups reach
//! their tasks in a fixed order.
//!
//! The [`MemLog`](crate::memlog::MemLog)'s watches wait on a
//! `tokio::sync::watch` channel, whose receivers park on one of eight
//! `Notify`s picked by tokio's thread-local random generator (`BigNotify`,
//! tokio 1.x; the generator's seed is settable only under
//! `--cfg tokio_unstable`). One change then wakes the waiting tasks in a
//! different order on every run, they reach the log in that order, and a
//! seed no longer gives the same revisions, tokens and fault draws.
//!
//! Until the log notifies its watches deterministically, this layer sits
//! between each watch and the task awaiting it: the watch is polled with a
//! waker of ours that only marks it woken, and one dispatcher task wakes
//! the marked watches' tasks in watch-id order (ids are drawn in call
//! order). Which watches a change wakes does not depend on the order tokio
//! calls their wakers, so neither does the order their tasks run in.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use parking_lot::Mutex;

use async_trait::async_trait;
use latchkey_arbiter::lock_log::{FollowSignal, KeyWatch, PrefixWatch, WatchSignal};
use tokio::sync::Notify;

use super::world::lock;

#[derive(Default)]
struct State {
    /// The task awaiting each watch now.
    waiting: BTreeMap<u64, Waker>,
    /// Watches woken since the dispatcher last ran.
    woken: BTreeSet<u64>,
    next_id: u64,
}

/// Wakes woken watches' tasks in id order.
#[derive(Default)]
pub(crate) struct Dispatch {
    state: Mutex<State>,
    notify: Notify,
}

impl Dispatch {
    /// The dispatcher: one task for the run.
    pub(crate) async fn run(self: Arc<Self>) {
        loop {
            self.notify.notified().await;
            let wakers: Vec<Waker> = {
                let mut s = lock(&self.state);
                let woken = std::mem::take(&mut s.woken);
                woken
                    .iter()
                    .filter_map(|id| s.waiting.get(id).cloned())
                    .collect()
            };
            for w in wakers {
                w.wake();
            }
        }
    }

    /// Wraps a watch.
    pub(crate) fn wrap(self: &Arc<Self>, inner: Box<dyn KeyWatch>) -> Box<dyn KeyWatch> {
        let (id, flag) = self.register();
        Box::new(OrderedWatch {
            id,
            inner,
            dispatch: self.clone(),
            flag,
        })
    }

    /// Wraps a prefix watch (ids from the same counter as key watches').
    pub(crate) fn wrap_prefix(
        self: &Arc<Self>,
        inner: Box<dyn PrefixWatch>,
    ) -> Box<dyn PrefixWatch> {
        let (id, flag) = self.register();
        Box::new(OrderedPrefixWatch {
            id,
            inner,
            dispatch: self.clone(),
            flag,
        })
    }

    /// A new watch's id and the waker it is polled with.
    fn register(self: &Arc<Self>) -> (u64, Waker) {
        let id = {
            let mut s = lock(&self.state);
            s.next_id += 1;
            s.next_id
        };
        let flag = Waker::from(Arc::new(Flag {
            id,
            dispatch: self.clone(),
        }));
        (id, flag)
    }

    fn forget(&self, id: u64) {
        let mut s = lock(&self.state);
        s.waiting.remove(&id);
        s.woken.remove(&id);
    }
}

/// The waker a watch is polled with: marks it woken, nothing more.
struct Flag {
    id: u64,
    dispatch: Arc<Dispatch>,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        lock(&self.dispatch.state).woken.insert(self.id);
        self.dispatch.notify.notify_one();
    }
}

struct OrderedWatch {
    id: u64,
    inner: Box<dyn KeyWatch>,
    dispatch: Arc<Dispatch>,
    flag: Waker,
}

#[async_trait]
impl KeyWatch for OrderedWatch {
    async fn next(&mut self) -> WatchSignal {
        Ordered {
            id: self.id,
            dispatch: &self.dispatch,
            flag: &self.flag,
            inner: self.inner.next(),
        }
        .await
    }
}

struct OrderedPrefixWatch {
    id: u64,
    inner: Box<dyn PrefixWatch>,
    dispatch: Arc<Dispatch>,
    flag: Waker,
}

#[async_trait]
impl PrefixWatch for OrderedPrefixWatch {
    async fn next(&mut self) -> FollowSignal {
        Ordered {
            id: self.id,
            dispatch: &self.dispatch,
            flag: &self.flag,
            inner: self.inner.next(),
        }
        .await
    }
}

struct Ordered<'a, T> {
    id: u64,
    dispatch: &'a Arc<Dispatch>,
    flag: &'a Waker,
    inner: Pin<Box<dyn Future<Output = T> + Send + 'a>>,
}

impl<T> Future for Ordered<'_, T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.get_mut();
        lock(&this.dispatch.state)
            .waiting
            .insert(this.id, cx.waker().clone());
        let mut inner_cx = Context::from_waker(this.flag);
        match this.inner.as_mut().poll(&mut inner_cx) {
            Poll::Ready(signal) => {
                this.dispatch.forget(this.id);
                Poll::Ready(signal)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T> Drop for Ordered<'_, T> {
    fn drop(&mut self) {
        self.dispatch.forget(self.id);
    }
}
