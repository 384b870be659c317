//! What the console shows of the queues this table keeps: each key's
//! waiters in the order they will be served, and how long each has waited.
//! Read under the book's lock, copied out, never held across an await.

use std::time::Duration;

use super::LockTable;

/// One waiting call, as an operator sees it: never its session's token
/// (it has none yet), only who waits, for what and since when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaiterView {
    pub identity: String,
    pub session: i64,
    pub class: String,
    /// How long it has waited so far.
    pub waited: Duration,
    /// A shared (reader) request.
    pub shared: bool,
}

/// One key's queue on this arbiter: its in-memory waiters in order, and
/// how many durable waiters (`durable = true`, in the lock log) this
/// arbiter serves for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueView {
    pub key: String,
    pub waiters: Vec<WaiterView>,
    pub durable_here: u32,
}

impl LockTable {
    /// `key`'s queue here, in order (head first).
    pub fn queue(&self, key: &str) -> QueueView {
        let book = self.book.lock();
        let waiters = book
            .keys
            .get(key)
            .map(|q| q.waiters.iter().map(view).collect())
            .unwrap_or_default();
        QueueView {
            key: key.to_string(),
            waiters,
            durable_here: book.durable.get(key).copied().unwrap_or(0),
        }
    }

    /// Every key with waiters here, each queue in order.
    pub fn queues(&self) -> Vec<QueueView> {
        let book = self.book.lock();
        let mut keys: Vec<&String> = book
            .keys
            .iter()
            .filter(|(_, q)| !q.waiters.is_empty())
            .map(|(k, _)| k)
            .chain(book.durable.keys())
            .collect();
        keys.sort();
        keys.dedup();
        keys.into_iter()
            .map(|key| QueueView {
                key: key.clone(),
                waiters: book
                    .keys
                    .get(key)
                    .map(|q| q.waiters.iter().map(view).collect())
                    .unwrap_or_default(),
                durable_here: book.durable.get(key).copied().unwrap_or(0),
            })
            .collect()
    }
}

fn view(w: &super::queues::Waiter) -> WaiterView {
    WaiterView {
        identity: w.req.identity.clone(),
        session: w.req.session,
        class: w.req.class.clone(),
        waited: w.since.elapsed(),
        shared: w.req.shared,
    }
}
