//! Entity shards in the simulation (ADR-09, [`SimConfig::shards`]): each
//! shard's log, and the shard map the arbiters follow, kept in memory as
//! the coord cluster keeps it (one document, changed by compare-and-swap on
//! its revision, every version sent to every follower).
//!
//! [`SimConfig::shards`]: super::SimConfig::shards

use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::lock_log::StoreError;
use latchkey_arbiter::shards::{PublishError, Shard, ShardMap, ShardMaps, check_publish, newer};
use latchkey_arbiter::witness::Witness;
use latchkey_proto::adminv1::change_shards_request::Change;
use latchkey_proto::adminv1::{AddShard, CancelMove, ChangeShardsRequest, StepShardMoveRequest};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use super::clusters::{HOME_SHARD, shard_endpoint};
use super::idlog::{IdLog, TracedWitness};
use super::nemesis::{done, fault, pause};
use super::policies::OPERATOR;
use super::worker::calls::request;
use super::world::World;
use crate::memlog::{FaultRates, MemLog, MemLogConfig};
use crate::rng::Rng;
use crate::witness::MemWitness;

/// One shard other than the lock cluster: its log, and the same log with
/// the run's lease ids (a shadow has its session's id).
pub(crate) struct ShardLog {
    pub(crate) name: String,
    pub(crate) memlog: MemLog,
    pub(crate) idlog: Arc<IdLog>,
    /// Its witness on the coord cluster (by shard name, as `start.rs`
    /// connects one per shard), shared by every arbiter's table of it.
    pub(crate) witness: Arc<dyn Witness>,
}

impl ShardLog {
    /// The shard's epoch as its log holds it now.
    pub(crate) fn epoch(&self) -> Option<u32> {
        super::nemesis::epoch_of(&self.memlog.snapshot())
    }
}

/// The other shards' logs, when the run has them ([`SimConfig::shards`],
/// with the whole arbiter): seeded from the run's seed, not from its rng,
/// so a run without them draws what it always drew.
///
/// [`SimConfig::shards`]: super::SimConfig::shards
pub(crate) fn logs(cfg: &super::SimConfig, idlog: &Arc<IdLog>) -> Vec<ShardLog> {
    if !cfg.whole_arbiter {
        return Vec::new();
    }
    (1..=cfg.shards)
        .map(|n| {
            let memlog = untouched_log(cfg, cfg.seed ^ (0x5AAD_0000_0000_0000 + n as u64));
            let idlog = Arc::new(IdLog::sharing(memlog.clone(), idlog));
            let witness = MemWitness::new(cfg.seed ^ (0xC00D_5AAD_0000_0000 + n as u64));
            ShardLog {
                name: format!("s{n}"),
                memlog,
                witness: Arc::new(TracedWitness::new(witness, idlog.clone())),
                idlog,
            }
        })
        .collect()
}

/// The log of a cluster the nemesis leaves alone (another shard, the coord
/// tier's): no faults, the run's latency.
pub(crate) fn untouched_log(cfg: &super::SimConfig, seed: u64) -> MemLog {
    MemLog::with_config(MemLogConfig {
        seed,
        cluster_id: None,
        faults: FaultRates::NONE,
        history_revisions: Some(10_000),
        min_ttl_seconds: 2,
        latency: cfg.log_latency,
    })
}

/// The coord cluster's id as the map's store answers it (no shard's).
const COORD_CLUSTER_ID: u64 = 0xC00D;

/// The shard map's store.
pub(crate) struct MemShardMaps {
    /// The map and its revision (0: never written).
    state: Mutex<(Option<ShardMap>, i64)>,
    published: watch::Sender<Option<ShardMap>>,
}

impl MemShardMaps {
    /// A store holding `map` as its first version.
    pub(crate) fn with(map: ShardMap) -> Self {
        Self {
            state: Mutex::new((Some(map.clone()), 1)),
            published: watch::channel(Some(map)).0,
        }
    }

    /// Writes `map` as the next revision and sends it to every follower.
    fn put(&self, state: &mut (Option<ShardMap>, i64), map: ShardMap) {
        *state = (Some(map.clone()), state.1 + 1);
        self.published.send_replace(Some(map));
    }

    /// The map as it is now.
    pub(crate) fn current(&self) -> Option<ShardMap> {
        self.state.lock().0.clone()
    }
}

/// Shard `name` as a map names it: its endpoint, weight 1.
fn shard(name: &str) -> Shard {
    Shard {
        name: name.to_string(),
        endpoints: vec![shard_endpoint(name)],
        weight: 1,
    }
}

/// The first map: the lock cluster and `others`.
pub(crate) fn first_map(others: &[&ShardLog]) -> ShardMap {
    ShardMap {
        version: 1,
        shards: std::iter::once(shard(HOME_SHARD))
            .chain(others.iter().map(|s| shard(&s.name)))
            .collect(),
        overrides: Default::default(),
        moving: None,
    }
}

#[async_trait::async_trait]
impl ShardMaps for MemShardMaps {
    async fn cluster_id(&self) -> Result<u64, StoreError> {
        Ok(COORD_CLUSTER_ID)
    }

    async fn load(&self) -> Result<Option<(ShardMap, i64)>, StoreError> {
        let state = self.state.lock();
        Ok(state.0.clone().map(|m| (m, state.1)))
    }

    async fn publish(
        &self,
        current: Option<&ShardMap>,
        read_at: Option<i64>,
        next: &ShardMap,
    ) -> Result<(), PublishError> {
        check_publish(current, next)?;
        let mut state = self.state.lock();
        let unchanged = match read_at {
            Some(rev) => state.1 == rev && state.0.is_some(),
            None => state.0.is_none(),
        };
        if !unchanged {
            return Err(PublishError::Raced {
                current: state.0.as_ref().map_or(0, |m| m.version),
            });
        }
        self.put(&mut state, next.clone());
        Ok(())
    }

    async fn follow(&self, tx: watch::Sender<Option<ShardMap>>) {
        let mut rx = self.published.subscribe();
        loop {
            newer(&tx, rx.borrow_and_update().clone());
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return },
                () = tx.closed() => return,
            }
        }
    }
}

/// How long a move may take before the operator cancels it.
const MOVE_PATIENCE: Duration = Duration::from_secs(60);

/// The operator's shard moves ([`FaultKnobs::shard_moves`]): after a warm-up,
/// each shard the first map lacks is added through a random arbiter's
/// `ChangeShards` and the move stepped (`StepShardMove`, every 0.3–1 s,
/// through any arbiter, as an operator re-runs `latchctl admin shards
/// step`) until it finishes, or cancelled after [`MOVE_PATIENCE`]. A lost
/// answer is asked again; whatever the map shows decides what comes next.
/// Recorded as a fault from the add to the end.
///
/// [`FaultKnobs::shard_moves_unfenced`] publishes the new homes at once
/// instead (the bug every step of the move guards against).
///
/// [`FaultKnobs::shard_moves`]: super::FaultKnobs::shard_moves
/// [`FaultKnobs::shard_moves_unfenced`]: super::FaultKnobs::shard_moves_unfenced
pub(crate) async fn mover(world: Arc<World>, mut rng: Rng) {
    let world = world.as_ref();
    let rng = &mut rng;
    let Some(maps) = world.shard_maps.clone() else {
        return;
    };
    if !pause(world, Duration::from_millis(3000 + rng.below(5000))).await {
        return;
    }
    let unmapped: Vec<String> = world
        .shards
        .iter()
        .map(|s| s.name.clone())
        .filter(|n| maps.current().is_some_and(|m| m.shard(n).is_none()))
        .collect();
    for name in unmapped {
        let op = fault(world, format!("shard {name} added: ranges move to it"));
        let (added, finished) = match world.cfg.faults.shard_moves_unfenced {
            true => {
                let published = publish_with(&maps, &name);
                (published, published)
            }
            false => match add(world, rng, &maps, &name).await {
                true => (true, step_until_done(world, rng, &maps, &name).await),
                false => (false, false),
            },
        };
        if finished {
            *super::world::lock(&world.shard_moves) += 1;
        }
        world.note(format!(
            "shard {name}: {}",
            match (added, finished) {
                (false, _) => "not added (the run ended first)",
                (true, true) => "added, its ranges moved",
                (true, false) => "added, the move cancelled or unfinished",
            }
        ));
        done(world, op);
    }
}

/// `ChangeShards` adding `name`, asked until the map shows the move (or
/// the shard). Whether it did before the run ended.
async fn add(world: &World, rng: &mut Rng, maps: &MemShardMaps, name: &str) -> bool {
    loop {
        if maps
            .current()
            .is_some_and(|m| m.all_shards().any(|s| s.name == name))
        {
            return true;
        }
        if !pause(world, Duration::from_millis(100 + rng.below(400))).await {
            return false;
        }
        let Some(service) = world.any(rng).and_then(|a| a.service) else {
            continue;
        };
        let change = ChangeShardsRequest {
            change: Some(Change::Add(AddShard {
                name: name.to_string(),
                endpoints: vec![shard_endpoint(name)],
                weight: 1,
            })),
            reason: "the simulation scales out".into(),
        };
        if let Err(e) = service.change_shards(request(OPERATOR, None, change)).await
            && !e.is_transient()
        {
            world.note(format!("shard {name}: add refused: {e}"));
        }
    }
}

/// Steps the move until the map names `name` with no move under way; past
/// [`MOVE_PATIENCE`], cancels it instead. Whether the ranges moved.
async fn step_until_done(world: &World, rng: &mut Rng, maps: &MemShardMaps, name: &str) -> bool {
    let since = Instant::now();
    loop {
        match maps.current() {
            Some(m) if m.moving.is_none() => return m.shard(name).is_some(),
            _ => {}
        }
        if !pause(world, Duration::from_millis(300 + rng.below(700))).await {
            return false;
        }
        let Some(service) = world.any(rng).and_then(|a| a.service) else {
            continue;
        };
        if Instant::now() >= since + MOVE_PATIENCE {
            let cancel = ChangeShardsRequest {
                change: Some(Change::Cancel(CancelMove {})),
                reason: "the simulation's move took too long".into(),
            };
            let _ = service.change_shards(request(OPERATOR, None, cancel)).await;
            continue;
        }
        let step = StepShardMoveRequest {
            allow_ending_holds: false,
        };
        if let Err(e) = service.step_shard_move(request(OPERATOR, None, step)).await
            && !e.is_transient()
        {
            world.note(format!("shard {name}: step refused: {e}"));
        }
    }
}

/// The bug [`FaultKnobs::shard_moves_unfenced`] puts in: the next map,
/// with `name` added and whatever ranges it homes moved to it, published
/// at once.
///
/// [`FaultKnobs::shard_moves_unfenced`]: super::FaultKnobs::shard_moves_unfenced
fn publish_with(maps: &MemShardMaps, name: &str) -> bool {
    let mut state = maps.state.lock();
    let Some(map) = state.0.clone() else {
        return false;
    };
    let mut next = ShardMap {
        version: map.version + 1,
        moving: None,
        ..map
    };
    next.shards.push(shard(name));
    maps.put(&mut state, next);
    true
}
