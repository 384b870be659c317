//! What the pages show, read from the lock log and this arbiter's memory.
//!
//! Holds come from every cluster's log (one range read each), shared for a
//! moment between the pages and live streams that ask at once; queues and
//! renewals are this arbiter's own (other arbiters' in-memory waiters are
//! theirs; durable waiters are in the log). No revision is ever read into
//! a view: with the epoch, a revision is a fencing token.

use std::sync::Arc;
use std::time::{Duration, Instant};

use latchkey_policies::Enforcement;

use super::Console;
use crate::bounds::LastRenewal;
use crate::error::ArbiterError;
use crate::records::{HoldKind, HolderRecord, decode, hold_kind, split_slot};
use crate::table::{QueueView, WaiterView};

/// How long one read of every hold serves the pages and streams that ask.
const HOLDS_FRESH_FOR: Duration = Duration::from_millis(250);

/// One hold, as the pages show it.
#[derive(Debug, Clone)]
pub(super) struct HoldRow {
    /// The key as its caller named it (a semaphore's name, a shared lock's).
    pub key: String,
    pub kind: HoldKind,
    pub slot: Option<u32>,
    pub identity: String,
    pub class: String,
    /// "fenced", "advisory", or why neither is known.
    pub enforcement: &'static str,
    pub acquired_at_unix_ms: i64,
    pub session: i64,
    /// This arbiter's last renewal of the holder's session.
    pub renewal: Option<LastRenewal>,
    /// The cluster's tier (entity, coord) or shard.
    pub cluster: String,
}

impl HoldRow {
    pub fn mode(&self) -> String {
        match (self.kind, self.slot) {
            (HoldKind::Shared, _) => "shared".into(),
            (HoldKind::Slot, Some(slot)) => format!("slot {slot}"),
            _ => "exclusive".into(),
        }
    }

    pub fn age(&self) -> Duration {
        let now = crate::records::now_unix_ms();
        Duration::from_millis(u64::try_from(now - self.acquired_at_unix_ms).unwrap_or(0))
    }

    pub fn namespace(&self) -> &str {
        self.key.split('/').next().unwrap_or("")
    }
}

/// Every hold, read at `at`.
pub(super) struct Holds {
    pub rows: Vec<HoldRow>,
    pub at: Instant,
}

/// The last read of every hold, shared while fresh; one read at a time.
#[derive(Default)]
pub(super) struct HoldsCache {
    last: parking_lot::Mutex<Option<Arc<Holds>>>,
    reading: tokio::sync::Mutex<()>,
}

impl Console {
    /// Every hold on every cluster (fresh within [`HOLDS_FRESH_FOR`]).
    pub(super) async fn holds(&self) -> Result<Arc<Holds>, ArbiterError> {
        let fresh = |last: &Option<Arc<Holds>>| {
            last.as_ref()
                .filter(|h| h.at.elapsed() < HOLDS_FRESH_FOR)
                .cloned()
        };
        if let Some(h) = fresh(&self.holds.last.lock()) {
            return Ok(h);
        }
        let _reading = self.holds.reading.lock().await;
        if let Some(h) = fresh(&self.holds.last.lock()) {
            return Ok(h);
        }
        let at = Instant::now();
        let policies = self.arbiter.policies.current();
        let mut rows = Vec::new();
        for cluster in self.arbiter.tiers.all() {
            let held = cluster.table.log().holders_under("").await?;
            let name = cluster_name(&cluster);
            for (key, kv) in held.value {
                let Some(record) = decode::<HolderRecord>(&kv.value) else {
                    continue;
                };
                let (kind, named) = hold_kind(&key);
                let enforcement = match policies.class(&record.class).map(|c| c.enforcement) {
                    Some(Enforcement::Fenced) => "fenced",
                    Some(Enforcement::Advisory) => "advisory",
                    None => "class not in the policies",
                };
                rows.push(HoldRow {
                    key: named.to_string(),
                    kind,
                    slot: split_slot(&key).map(|(_, s)| s),
                    renewal: self.arbiter.bounds.last_renewal(record.session),
                    identity: record.identity,
                    class: record.class,
                    enforcement,
                    acquired_at_unix_ms: record.acquired_at_unix_ms,
                    session: record.session,
                    cluster: name.clone(),
                });
            }
        }
        rows.sort_by(|a, b| a.key.cmp(&b.key).then(a.slot.cmp(&b.slot)));
        let holds = Arc::new(Holds { rows, at });
        *self.holds.last.lock() = Some(holds.clone());
        Ok(holds)
    }

    /// Every key's queue here, over every cluster.
    pub(super) fn queues(&self) -> Vec<QueueView> {
        let mut all: Vec<QueueView> = self
            .arbiter
            .tiers
            .all()
            .iter()
            .flat_map(|c| c.table.queues())
            .collect();
        all.sort_by(|a, b| a.key.cmp(&b.key));
        all
    }

    /// `key`'s queue here (on whichever cluster has one for it).
    pub(super) fn queue(&self, key: &str) -> QueueView {
        let mut out = QueueView {
            key: key.to_string(),
            waiters: Vec::new(),
            durable_here: 0,
        };
        for cluster in self.arbiter.tiers.all() {
            let q = cluster.table.queue(key);
            out.waiters.extend(q.waiters);
            out.durable_here += q.durable_here;
        }
        out
    }

    /// Durable waiters of `key` in the lock log (every arbiter's).
    pub(super) async fn durable_waiting(&self, key: &str) -> Option<u32> {
        let parsed = latchkey_policies::LockKey::parse(key).ok()?;
        let cluster = self.arbiter.tiers.for_key(&parsed).await.ok()?;
        cluster.table.durable_waiting(key).await.ok()
    }
}

fn cluster_name(cluster: &crate::tiers::Cluster) -> String {
    cluster.name().to_string()
}

/// The oldest waiter's wait, for sorting queues.
pub(super) fn oldest(q: &QueueView) -> Duration {
    q.waiters
        .iter()
        .map(|w: &WaiterView| w.waited)
        .max()
        .unwrap_or_default()
}
