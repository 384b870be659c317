//! What the simulated processes share: the log, the arbiters (each up or
//! down), the fenced resource, and the history being recorded.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};

use latchkey_arbiter::Arbiter as Service;
use latchkey_arbiter::assemble::{self, ArbiterParts, OwnerHandle, ShardParts};
use latchkey_arbiter::epoch::EpochGuard;
use latchkey_arbiter::error::ArbiterError;
use latchkey_arbiter::high_water::{HighWater, Mark};
use latchkey_arbiter::lock_log::LockLog;
use latchkey_arbiter::policy::Policies;
use latchkey_arbiter::table::durable::DurableStats;
use latchkey_arbiter::table::{BatchStats, LockTable, MapVersion, TableOptions};
use latchkey_arbiter::witness::Witness;
use latchkey_checker::{Completion, Function, Mode, Operation, Outcome};
use latchkey_hook_host::HookHost;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::SimConfig;
use super::clusters::{
    ClusterKit, HOME_SHARD, MAX_SESSIONS_PER_IDENTITY, SimConnect, shard_endpoint,
};
use super::elections::ElectionLedger;
use super::fences::Fences;
use super::idlog::IdLog;
use super::memory::MemoryGrants;
use super::shards::{MemShardMaps, ShardLog};
use super::tiers::CoordLog;
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
    /// The whole arbiter around the table ([`SimConfig::whole_arbiter`]):
    /// its handlers, and the owner of its keys.
    pub(crate) service: Option<(Arc<Service>, Arc<OwnerHandle>)>,
    /// Its state directory's quorum-loss spool (the high-water mark is kept
    /// in memory beside it): under the run's scratch directory, replaced by
    /// a fresh one when the state is lost.
    pub(crate) state_dir: PathBuf,
    state_dirs: u32,
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
    /// The whole arbiter's handlers ([`SimConfig::whole_arbiter`]).
    pub(crate) service: Option<Arc<Service>>,
    pub(crate) owner: Option<Arc<OwnerHandle>>,
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
    /// Which session holds a key in the log now, read past every fault
    /// (the judge's ground truth), in the arbiters' session ids.
    pub(crate) idlog: Arc<IdLog>,
    /// The grants from memory during quorum losses, judged apart from the
    /// checker's history ([`MemoryGrants`]).
    pub(crate) memory: Mutex<MemoryGrants>,
    /// The electors' leaderships ([`ElectionLedger`]).
    pub(crate) elections: Mutex<ElectionLedger>,
    /// Where the arbiters' state directories are (removed at the end).
    pub(crate) scratch: PathBuf,
    /// The policy files the whole arbiter's handlers read.
    pub(crate) policies: Option<Arc<Policies>>,
    /// The files the odd-numbered arbiters read instead, with
    /// [`SimConfig::coord_rollout`].
    rollout: Option<Arc<Policies>>,
    /// The entity shards other than the lock cluster ([`SimConfig::shards`]).
    pub(crate) shards: Vec<ShardLog>,
    /// The shard map the arbiters follow, with shards.
    pub(crate) shard_maps: Option<Arc<MemShardMaps>>,
    /// Shard moves that finished.
    pub(crate) shard_moves: Mutex<usize>,
    /// Grants answered with shards, and of them those on a shard other
    /// than the lock cluster (by the map when they were answered).
    pub(crate) shard_grants: Mutex<(usize, usize)>,
    /// With shards, the shard each grant answered with a token was made on
    /// (by the map when it was answered), by (key, token).
    granted_on: Mutex<BTreeMap<(String, u64), String>>,
    pub(crate) hook_host: Arc<HookHost>,
    /// The coord tier's cluster ([`SimConfig::coord_keys`]).
    pub(crate) coord: Option<CoordLog>,
}

impl World {
    pub(crate) fn new(
        cfg: SimConfig,
        memlog: MemLog,
        idlog: Arc<IdLog>,
        memwitness: Option<MemWitness>,
        witness: Option<Arc<dyn Witness>>,
        shards: Vec<ShardLog>,
        coord: Option<CoordLog>,
    ) -> Self {
        // With moves, the last shard is added by the operator, not mapped.
        let mapped = shards.len() - usize::from(cfg.faults.shard_moves && !shards.is_empty());
        let first: Vec<&ShardLog> = shards.iter().take(mapped).collect();
        let shard_maps = (!shards.is_empty())
            .then(|| Arc::new(MemShardMaps::with(super::shards::first_map(&first))));
        let start = Instant::now();
        let scratch = scratch_dir(cfg.seed);
        let log: Arc<dyn LockLog> = idlog.clone();
        let mut notes = Vec::new();
        let mut load = |dir: &str, rollout: bool| {
            let dir = scratch.join(dir);
            let loaded = super::policies::write(&dir, cfg.ttl_seconds, rollout)
                .map_err(|e| e.to_string())
                .and_then(|()| Policies::load(&dir).map_err(|e| e.to_string()));
            match loaded {
                Ok(p) => Some(Arc::new(p)),
                Err(e) => {
                    notes.push(format!("cannot load the policy files: {e}"));
                    None
                }
            }
        };
        let policies = cfg.whole_arbiter.then(|| load("policies", false)).flatten();
        let rollout = (cfg.whole_arbiter && cfg.coord_rollout)
            .then(|| load("policies-rollout", true))
            .flatten();
        let arbiters = (0..cfg.arbiters.max(1))
            .map(|i| {
                Mutex::new(ArbiterSlot {
                    table: None,
                    service: None,
                    state_dir: scratch.join(format!("arbiter-{i}.0")),
                    state_dirs: 0,
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
            notes: Mutex::new(notes),
            batches: Mutex::new(BatchStats::default()),
            durable: Mutex::new(DurableStats::default()),
            fences: Mutex::new(Fences::default()),
            granted_to: Mutex::new(BTreeMap::new()),
            forced: Mutex::new(super::ForcedEnds::default()),
            idlog,
            memory: Mutex::new(MemoryGrants::default()),
            elections: Mutex::default(),
            policies,
            rollout,
            scratch,
            hook_host: assemble::idle_hook_host(),
            shards,
            shard_maps,
            shard_moves: Mutex::new(0),
            shard_grants: Mutex::new((0, 0)),
            granted_on: Mutex::new(BTreeMap::new()),
            coord,
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
        let detail = detail.map(|d| self.idlog.history_text(&d));
        rec.ops.push(Operation {
            process: process.to_string(),
            op,
            f,
            key: key.map(|k| self.idlog.history_key(k)),
            token,
            detail,
            invoke_time,
            completion: None,
            mode: Mode::Exclusive,
            permits: None,
            slot: None,
        });
        OpId(rec.ops.len() - 1)
    }

    /// Completes `op` now.
    /// Names `key` as the key of operation `op` (a semaphore's grant: the
    /// slot it holds).
    pub(crate) fn rekey(&self, op: OpId, key: &str) {
        let key = self.idlog.history_key(key);
        if let Some(o) = lock(&self.recorder).ops.get_mut(op.0) {
            o.key = Some(key);
        }
    }

    pub(crate) fn complete(
        &self,
        op: OpId,
        outcome: Outcome,
        token: Option<u64>,
        seq: Option<i64>,
        detail: Option<String>,
    ) {
        let detail = detail.map(|d| self.idlog.history_text(&d));
        let mut rec = lock(&self.recorder);
        let time = rec.ns(Instant::now());
        let Some(o) = rec.ops.get_mut(op.0) else {
            return;
        };
        if o.f == Function::Acquire && outcome == Outcome::Ok {
            let mut live = lock(&self.liveness);
            live.last_grant = Some(Instant::now());
            live.tried_since = false;
            // Where it was granted, by the map as it is now.
            if let Some(map) = self.shard_maps.as_ref().and_then(|m| m.current())
                && let Some(key) = &o.key
            {
                let shard = map.home(key).name.clone();
                let mut shards = lock(&self.shard_grants);
                shards.0 += 1;
                if shard != HOME_SHARD {
                    shards.1 += 1;
                }
                if let Some(token) = token {
                    lock(&self.granted_on).insert((key.clone(), token), shard);
                }
            }
        }
        o.completion = Some(Completion {
            outcome,
            time,
            token,
            seq,
            term: None,
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
            service: slot.service.as_ref().map(|(s, _)| s.clone()),
            owner: slot.service.as_ref().map(|(_, o)| o.clone()),
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
    ///
    /// The key is hashed as the store spells it: a shared hold's key names
    /// its session, and the arbiter draws session ids at random, so hashing
    /// the arbiter's spelling sent a reader's release to a different
    /// arbiter on every run (whether that arbiter's queue of the lock was
    /// kicked at once or waited for the watch), and a seed did not replay.
    pub(crate) fn route(&self, key: &str, stray: bool, rng: &mut Rng) -> Option<Arbiter> {
        let n = self.arbiters.len();
        let home =
            usize::try_from(fnv1a(&self.idlog.history_key(key)) % n.max(1) as u64).unwrap_or(0);
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
        let (high_water, map_version, state_dir) = {
            let mut slot = lock(slot);
            if lose_state {
                slot.high_water = Arc::new(HighWater::in_memory(None));
                slot.state_dirs += 1;
                slot.state_dir = self
                    .scratch
                    .join(format!("arbiter-{i}.{}", slot.state_dirs));
                // Its memory grants are gone with the spool.
                lock(&self.memory).forget(i, Instant::now());
            } else {
                let mark: Option<Mark> = slot.high_water.current();
                slot.high_water = Arc::new(HighWater::in_memory(mark));
            }
            (
                slot.high_water.clone(),
                slot.map_version.clone(),
                slot.state_dir.clone(),
            )
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
                map_version: map_version.clone(),
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
        let service = match self.cfg.whole_arbiter {
            true => self.whole(i, &table, &state_dir, map_version, seed).await,
            false => None,
        };
        let mut slot = lock(slot);
        slot.table = Some(table);
        slot.service = service;
        slot.killed = CancellationToken::new();
    }

    /// The rest of the arbiter around a started table, as `start.rs`
    /// builds it: the hold and session counts following the log, the
    /// quorum-loss posture (its spool in the state dir, replayed) and its
    /// probe, assembled with the policy files into the arbiter whose
    /// handlers the clients call; with shards, the map followed and every
    /// other shard's cluster built by [`SimConnect`].
    async fn whole(
        &self,
        i: usize,
        table: &Arc<LockTable>,
        state_dir: &std::path::Path,
        map_version: MapVersion,
        seed: u64,
    ) -> Option<(Arc<Service>, Arc<OwnerHandle>)> {
        let policies = match (&self.rollout, i % 2) {
            (Some(rollout), 1) => Some(rollout.clone()),
            _ => self.policies.clone(),
        };
        let Some(policies) = policies else {
            self.note(format!("arbiter-{i}: no policies"));
            return None;
        };
        let kit = self.kit(self.idlog.clone());
        let cluster = match kit.parts(table, state_dir, true) {
            Ok(parts) => parts,
            Err(e) => {
                self.note(format!("arbiter-{i}: {e}"));
                return None;
            }
        };
        let shards = self.shard_maps.as_ref().map(|maps| ShardParts {
            home_name: HOME_SHARD.into(),
            home_endpoints: vec![shard_endpoint(HOME_SHARD)],
            maps: maps.clone(),
            connect: Arc::new(SimConnect {
                shards: self
                    .shards
                    .iter()
                    .map(|s| {
                        (
                            s.name.clone(),
                            (self.kit(s.idlog.clone()), s.witness.clone()),
                        )
                    })
                    .collect(),
                state_dir: state_dir.to_path_buf(),
                map_version: map_version.clone(),
                policies: policies.clone(),
                poll: self.cfg.poll,
                batch_limit: self.cfg.batch_limit,
                seed,
            }),
            map_version,
        });
        let coord = match &self.coord {
            Some(coord) => Some(self.coord_parts(i, coord, state_dir, seed).await?),
            None => None,
        };
        let assembled = assemble::arbiter(ArbiterParts {
            cluster,
            shards,
            coord,
            policies,
            trust_domain: super::policies::TRUST_DOMAIN.into(),
            max_wait: Duration::from_secs(300),
            max_sessions: MAX_SESSIONS_PER_IDENTITY,
            hook_host: self.hook_host.clone(),
        })
        .await;
        match assembled {
            Ok(whole) => Some(whole),
            Err(e) => {
                self.note(format!(
                    "arbiter-{i}: cannot read the shard map or the tier bindings: {e}"
                ));
                None
            }
        }
    }

    /// What a cluster of an arbiter is built from, over `log`.
    pub(crate) fn kit(&self, log: Arc<IdLog>) -> ClusterKit {
        ClusterKit {
            log,
            blind_follower: self.cfg.faults.blind_hold_follower,
            start: self.start,
        }
    }

    /// Every key's holder in the log now (the arbiters' session ids).
    pub(crate) fn holders_now(&self) -> BTreeMap<String, i64> {
        (0..self.cfg.keys)
            .filter_map(|n| {
                let key = self.cfg.key(n as u64);
                self.held_in_log(&key).map(|s| (key, s))
            })
            .collect()
    }

    /// Which session (the arbiters' id) holds `key` in the log now, read
    /// past every fault: the judge's ground truth.
    pub(crate) fn held_in_log(&self, key: &str) -> Option<i64> {
        self.idlog_of(key).holder_now(key)
    }

    /// The log of the shard `key` is homed on (the lock cluster's without
    /// shards): by the map as it is now; a coord key's, the coord tier's.
    pub(crate) fn idlog_of(&self, key: &str) -> &Arc<IdLog> {
        if let Some(coord) = self.coord.as_ref().filter(|_| self.is_coord_key(key))
            && self.bound_to_coord(coord)
        {
            return &coord.idlog;
        }
        let home = self
            .shard_maps
            .as_ref()
            .and_then(|maps| maps.current())
            .map(|map| map.home(key).name.clone());
        self.idlog_named(home.as_deref())
    }

    /// The log of the shard named `shard` (the lock cluster's for its own
    /// name, or none).
    fn idlog_named(&self, shard: Option<&str>) -> &Arc<IdLog> {
        shard
            .and_then(|name| self.shards.iter().find(|s| s.name == name))
            .map_or(&self.idlog, |s| &s.idlog)
    }

    /// What an epoch advance of the lock cluster ends, as the history's
    /// advance scopes: every hold (one advance, no scope) without shards
    /// or a coord tier; with shards, the holds of each key homed on the
    /// lock cluster now (one advance per key): another shard's epoch does
    /// not move; with a coord tier, the holds of the keys held on the lock
    /// cluster only.
    pub(crate) fn advance_scopes(&self) -> Vec<Option<String>> {
        match self.shard_maps.as_ref().and_then(|m| m.current()) {
            // A coord key bound to the entity tier (a policy rollout) is
            // held on the lock cluster: its advance ends it too.
            Some(_) | None if self.coord.is_some() => (0..self.cfg.keys)
                .map(|n| self.cfg.key(n as u64))
                .filter(|k| Arc::ptr_eq(self.idlog_of(k), &self.idlog))
                .map(Some)
                .collect(),
            None => vec![None],
            Some(map) => (0..self.cfg.keys)
                .map(|n| self.cfg.key(n as u64))
                .filter(|k| map.home(k).name == HOME_SHARD)
                .map(Some)
                .collect(),
        }
    }

    /// The log the grant of `key` answered with `token` was made on: the
    /// shard it was homed on then (a move since may have homed its range
    /// elsewhere; the hold stayed where it was made).
    pub(crate) fn idlog_of_grant(&self, key: &str, token: u64) -> &Arc<IdLog> {
        let shard = lock(&self.granted_on)
            .get(&(key.to_string(), token))
            .cloned();
        match shard {
            Some(name) => self.idlog_named(Some(&name)),
            None => self.idlog_of(key),
        }
    }

    /// Every cluster's log: the lock cluster's, then the other shards',
    /// then the coord tier's.
    pub(crate) fn idlogs(&self) -> Vec<&Arc<IdLog>> {
        std::iter::once(&self.idlog)
            .chain(self.shards.iter().map(|s| &s.idlog))
            .chain(self.coord.iter().map(|c| &c.idlog))
            .collect()
    }

    /// Kills arbiter `i`: every call in flight through it ends (its clients
    /// see a broken connection), then its table stops. Returns once it is
    /// down.
    pub(crate) async fn kill_arbiter(&self, i: usize) {
        let Some(slot) = self.arbiters.get(i) else {
            return;
        };
        let (table, killed, shard_tables) = {
            let mut slot = lock(slot);
            slot.restarts += 1;
            // The other shards' tables and the coord tier's die with it
            // (their clusters were connected by its routing, or built
            // with it).
            let shard_tables: Vec<Arc<LockTable>> = slot
                .service
                .take()
                .map(|(_, owner)| owner.other_clusters())
                .unwrap_or_default()
                .into_iter()
                .map(|c| c.table().clone())
                .collect();
            (slot.table.take(), slot.killed.clone(), shard_tables)
        };
        killed.cancel();
        // Let every client whose call was cut off drop it (leaving the
        // table's queues) before the table answers the waiters that are
        // left: the shutdown would answer them in hash-map order.
        tokio::time::sleep(Duration::from_millis(1)).await;
        for table in shard_tables {
            table.shutdown().await;
        }
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

/// A run's scratch directory (the arbiters' state dirs): unique per seed
/// and process, removed when the run ends.
fn scratch_dir(seed: u64) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static RUNS: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "latchkey-sim-{}-{seed}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ))
}

/// FNV-1a: a stable hash (std's hashers are seeded per process).
pub(crate) fn fnv1a(s: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(s.as_bytes());
    h.finish()
}
