//! What the simulated processes share: the log, the arbiters (each up or
//! down), the fenced resource, and the history being recorded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};

use latchkey_arbiter::epoch::EpochGuard;
use latchkey_arbiter::error::ArbiterError;
use latchkey_arbiter::high_water::{HighWater, Mark};
use latchkey_arbiter::lock_log::LockLog;
use latchkey_arbiter::table::durable::DurableStats;
use latchkey_arbiter::table::{BatchStats, LockTable, MapVersion, TableOptions};
use latchkey_arbiter::witness::Witness;
use latchkey_checker::{Completion, Function, Operation, Outcome};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::SimConfig;
use super::fences::Fences;
use crate::memlog::MemLog;
use crate::rng::Rng;
use crate::witness::MemWitness;

/// Locks a mutex (parking_lot: a panic elsewhere while it was held leaves
/// the data usable, and the simulation reports that panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// One arbiter process: its table while it runs, and its state directory
/// (the high-water mark), which outlives a restart unless the nemesis
/// throws it away.
pub(crate) struct ArbiterSlot {
    pub(crate) table: Option<Arc<LockTable>>,
    /// Cancelled when this incarnation is killed: every call in flight
    /// through it ends at once, as a connection to a dead process does.
    pub(crate) killed: CancellationToken,
    pub(crate) high_water: Arc<HighWater>,
    pub(crate) restarts: u32,
    /// Cut off from the clients and the operator (its connection to the log
    /// intact): no call reaches it, so it learns of nothing until it is
    /// reachable again.
    pub(crate) isolated: bool,
    /// The shard map version it routes by: what it has loaded of the map,
    /// kept across restarts (every incarnation's table shares it).
    pub(crate) map_version: MapVersion,
}

/// A live arbiter a client may call.
#[derive(Clone)]
pub(crate) struct Arbiter {
    pub(crate) index: usize,
    pub(crate) table: Arc<LockTable>,
    pub(crate) killed: CancellationToken,
}

/// The fenced resource: per key the highest token accepted, one commit
/// sequence for all (the reference fence's `WHERE fence < EXCLUDED.fence`).
#[derive(Default)]
pub(crate) struct Resource {
    fence: BTreeMap<String, u64>,
    seq: i64,
}

impl Resource {
    /// Accepts only a token strictly above the key's mark; the commit
    /// sequence number when it did.
    pub(crate) fn write(&mut self, key: &str, token: u64) -> Option<i64> {
        let mark = self.fence.entry(key.to_string()).or_insert(0);
        if token <= *mark {
            return None;
        }
        *mark = token;
        self.seq += 1;
        Some(self.seq)
    }
}

/// What the liveness watchdog needs: when the last advance finished, when
/// an acquire last succeeded, and whether one was tried since.
#[derive(Default)]
pub(crate) struct Liveness {
    pub(crate) last_advance: Option<Instant>,
    /// An acquire was invoked since the later of the last grant and the
    /// last advance.
    pub(crate) tried_since: bool,
    /// When an acquire last succeeded.
    pub(crate) last_grant: Option<Instant>,
    pub(crate) last_restore: Option<Instant>,
}

impl Liveness {
    /// A grant succeeded after the last advance (or there was none) and
    /// within `within` of now: the service is serving.
    pub(crate) fn serving(&self, now: Instant, within: Duration) -> bool {
        let restore_pending = self
            .last_restore
            .is_some_and(|r| self.last_advance.is_none_or(|a| a < r));
        !restore_pending
            && self
                .last_grant
                .is_some_and(|g| self.last_advance.is_none_or(|a| g >= a) && now < g + within)
    }
}

/// The history as it is recorded: operations in the order they were
/// invoked, op ids counted per process.
pub(crate) struct Recorder {
    start: Instant,
    ops: Vec<Operation>,
    next_op: BTreeMap<String, u64>,
}

/// Names one recorded operation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpId(usize);

impl Recorder {
    fn ns(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.start).as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Everything the tasks of one run share.
pub(crate) struct World {
    pub(crate) cfg: SimConfig,
    pub(crate) memlog: MemLog,
    pub(crate) log: Arc<dyn LockLog>,
    /// The coord cluster's witness, when the run has one: its handle for
    /// the nemesis, and what every table is built with (one for all).
    pub(crate) memwitness: Option<MemWitness>,
    pub(crate) witness: Option<Arc<dyn Witness>>,
    pub(crate) arbiters: Vec<Mutex<ArbiterSlot>>,
    pub(crate) resource: Mutex<Resource>,
    pub(crate) recorder: Mutex<Recorder>,
    pub(crate) liveness: Mutex<Liveness>,
    /// Set once enough operations are recorded (or the run is stuck):
    /// workers finish their cycle, the nemesis its fault.
    pub(crate) stop: CancellationToken,
    pub(crate) start: Instant,
    /// Notes for the run's summary (seals not seen, retries).
    pub(crate) notes: Mutex<Vec<String>>,
    /// The batches of every table that has stopped, added up.
    pub(crate) batches: Mutex<BatchStats>,
    /// The durable waiters of every table that has stopped, added up.
    pub(crate) durable: Mutex<DurableStats>,
    /// The shard-map fences raised, and every grant to judge against them.
    pub(crate) fences: Mutex<Fences>,
    /// Whose each grant answered with a token is, by (key, token): the
    /// process a forced end of that hold is recorded for, and the session
    /// it holds on (a hold read later must be on it too: a restore can
    /// reuse a revision, and a stale arbiter an epoch).
    pub(crate) granted_to: Mutex<BTreeMap<(String, u64), (String, i64)>>,
    pub(crate) forced: Mutex<super::ForcedEnds>,
}

impl World {
    pub(crate) fn new(
        cfg: SimConfig,
        memlog: MemLog,
        log: Arc<dyn LockLog>,
        memwitness: Option<MemWitness>,
        witness: Option<Arc<dyn Witness>>,
    ) -> Self {
        let start = Instant::now();
        let arbiters = (0..cfg.arbiters.max(1))
            .map(|_| {
                Mutex::new(ArbiterSlot {
                    table: None,
                    killed: CancellationToken::new(),
                    high_water: Arc::new(HighWater::in_memory(None)),
                    restarts: 0,
                    isolated: false,
                    map_version: MapVersion::default(),
                })
            })
            .collect();
        Self {
            cfg,
            memlog,
            log,
            memwitness,
            witness,
            arbiters,
            resource: Mutex::new(Resource::default()),
            recorder: Mutex::new(Recorder {
                start,
                ops: Vec::new(),
                next_op: BTreeMap::new(),
            }),
            liveness: Mutex::new(Liveness::default()),
            stop: CancellationToken::new(),
            start,
            notes: Mutex::new(Vec::new()),
            batches: Mutex::new(BatchStats::default()),
            durable: Mutex::new(DurableStats::default()),
            fences: Mutex::new(Fences::default()),
            granted_to: Mutex::new(BTreeMap::new()),
            forced: Mutex::new(super::ForcedEnds::default()),
        }
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    pub(crate) fn note(&self, note: String) {
        lock(&self.notes).push(note);
    }

    /// Milliseconds of simulated time since the start, for notes.
    pub(crate) fn ms(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.start).as_secs_f64() * 1e3
    }

    pub(crate) fn ops_recorded(&self) -> usize {
        lock(&self.recorder).ops.len()
    }

    pub(crate) fn take_ops(&self) -> Vec<Operation> {
        std::mem::take(&mut lock(&self.recorder).ops)
    }

    // --- recording ---

    pub(crate) fn invoke(
        &self,
        process: &str,
        f: Function,
        key: Option<&str>,
        token: Option<u64>,
        detail: Option<String>,
        at: Instant,
    ) -> OpId {
        if f == Function::Acquire {
            lock(&self.liveness).tried_since = true;
        }
        let mut rec = lock(&self.recorder);
        let counter = rec.next_op.entry(process.to_string()).or_insert(0);
        *counter += 1;
        let op = *counter;
        let invoke_time = rec.ns(at);
        rec.ops.push(Operation {
            process: process.to_string(),
            op,
            f,
            key: key.map(str::to_string),
            token,
            detail,
            invoke_time,
            completion: None,
        });
        OpId(rec.ops.len() - 1)
    }

    /// Completes `op` now.
    pub(crate) fn complete(
        &self,
        op: OpId,
        outcome: Outcome,
        token: Option<u64>,
        seq: Option<i64>,
        detail: Option<String>,
    ) {
        let mut rec = lock(&self.recorder);
        let time = rec.ns(Instant::now());
        let Some(o) = rec.ops.get_mut(op.0) else {
            return;
        };
        if o.f == Function::Acquire && outcome == Outcome::Ok {
            let mut live = lock(&self.liveness);
            live.last_grant = Some(Instant::now());
            live.tried_since = false;
        }
        o.completion = Some(Completion {
            outcome,
            time,
            token,
            seq,
            detail,
        });
    }

    // --- arbiters ---

    /// Arbiter `i` if it is up and reachable (not isolated).
    pub(crate) fn arbiter(&self, i: usize) -> Option<Arbiter> {
        let slot = lock(self.arbiters.get(i)?);
        if slot.isolated {
            return None;
        }
        slot.table.as_ref().map(|table| Arbiter {
            index: i,
            table: table.clone(),
            killed: slot.killed.clone(),
        })
    }

    /// Arbiter `i`'s table if it is up, reachable or not (for reports).
    pub(crate) fn table(&self, i: usize) -> Option<(Arc<LockTable>, bool)> {
        let slot = lock(self.arbiters.get(i)?);
        slot.table.clone().map(|t| (t, slot.isolated))
    }

    /// Makes arbiter `i` route by shard map `version` from now on.
    pub(crate) fn set_map_version(&self, i: usize, version: u64) {
        if let Some(slot) = self.arbiters.get(i) {
            lock(slot).map_version.set(version);
        }
    }

    /// Cuts arbiter `i` off from every caller, or reconnects it.
    pub(crate) fn set_isolated(&self, i: usize, isolated: bool) {
        if let Some(slot) = self.arbiters.get(i) {
            lock(slot).isolated = isolated;
        }
    }

    /// Every arbiter that is up and reachable.
    pub(crate) fn up(&self) -> Vec<Arbiter> {
        (0..self.arbiters.len())
            .filter_map(|i| self.arbiter(i))
            .collect()
    }

    /// An arbiter for a call about `key`: its home arbiter (a stable hash
    /// of the key, as the edge's ring hash routes) unless `stray` or the
    /// home is down, then any arbiter that is up.
    pub(crate) fn route(&self, key: &str, stray: bool, rng: &mut Rng) -> Option<Arbiter> {
        let n = self.arbiters.len();
        let home = usize::try_from(fnv1a(key) % n.max(1) as u64).unwrap_or(0);
        if !stray && let Some(a) = self.arbiter(home) {
            return Some(a);
        }
        self.any(rng)
    }

    /// Any arbiter that is up.
    pub(crate) fn any(&self, rng: &mut Rng) -> Option<Arbiter> {
        let up = self.up();
        let i = usize::try_from(rng.below(up.len() as u64)).unwrap_or(0);
        up.get(i).cloned()
    }

    /// Starts arbiter `i` with the state directory it has (a fresh mark when
    /// `lose_state`), retrying its first epoch read until the log answers.
    pub(crate) async fn start_arbiter(&self, i: usize, lose_state: bool, seed: u64) {
        let Some(slot) = self.arbiters.get(i) else {
            return;
        };
        let (high_water, map_version) = {
            let mut slot = lock(slot);
            if lose_state {
                slot.high_water = Arc::new(HighWater::in_memory(None));
            } else {
                let mark: Option<Mark> = slot.high_water.current();
                slot.high_water = Arc::new(HighWater::in_memory(mark));
            }
            (slot.high_water.clone(), slot.map_version.clone())
        };
        let table = LockTable::witnessed(
            self.log.clone(),
            Arc::new(EpochGuard::default()),
            high_water,
            self.witness.clone(),
            TableOptions {
                poll: self.cfg.poll,
                max_waiters_per_identity: 64,
                seed,
                batch_limit: self.cfg.batch_limit,
                batches_in_flight: latchkey_arbiter::table::DEFAULT_BATCHES_IN_FLIGHT,
                session_tag: 0,
                map_version,
            },
        );
        // An arbiter that cannot read the epoch record does not serve: it
        // retries, as the real one's startup does.
        loop {
            match table.start().await {
                Ok(_) => break,
                Err(ArbiterError::StoreUnavailable { .. }) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    self.note(format!("arbiter-{i} start: {e}"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        let mut slot = lock(slot);
        slot.table = Some(table);
        slot.killed = CancellationToken::new();
    }

    /// Kills arbiter `i`: every call in flight through it ends (its clients
    /// see a broken connection), then its table stops. Returns once it is
    /// down.
    pub(crate) async fn kill_arbiter(&self, i: usize) {
        let Some(slot) = self.arbiters.get(i) else {
            return;
        };
        let (table, killed) = {
            let mut slot = lock(slot);
            slot.restarts += 1;
            (slot.table.take(), slot.killed.clone())
        };
        killed.cancel();
        // Let every client whose call was cut off drop it (leaving the
        // table's queues) before the table answers the waiters that are
        // left: the shutdown would answer them in hash-map order.
        tokio::time::sleep(Duration::from_millis(1)).await;
        if let Some(table) = table {
            table.shutdown().await;
            let done = table.batch_stats();
            let mut all = lock(&self.batches);
            all.batches += done.batches;
            all.members += done.members;
            all.shared += done.shared;
            all.largest = all.largest.max(done.largest);
            all.split += done.split;
            let d = table.durable_stats();
            let mut all = lock(&self.durable);
            all.queued += d.queued;
            all.served += d.served;
            all.requeued += d.requeued;
            all.stale_removed += d.stale_removed;
        }
    }

    /// Shuts every arbiter down at the end of the run.
    pub(crate) async fn stop_arbiters(&self) {
        for i in 0..self.arbiters.len() {
            self.kill_arbiter(i).await;
        }
    }
}

/// FNV-1a: a stable hash (std's hashers are seeded per process).
fn fnv1a(s: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(s.as_bytes());
    h.finish()
}
