//! How one arbiter's clusters are built in the simulation, as `start.rs`
//! builds them: its lock cluster's parts around its table ([`ClusterKit`]),
//! and every other shard the map names ([`SimConnect`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::assemble::{self, ClusterParts};
use latchkey_arbiter::epoch::EpochGuard;
use latchkey_arbiter::high_water::HighWater;
use latchkey_arbiter::hold_counts::{DEFAULT_MAX_HOLDS_PER_IDENTITY, HoldCounts};
use latchkey_arbiter::lock_log::{
    Counted, FollowLog, FollowSignal, Kv, LockLog, PrefixWatch, StoreError,
};
use latchkey_arbiter::policy::Policies;
use latchkey_arbiter::quorum_loss::{QuorumLoss, QuorumLossConfig, Seams};
use latchkey_arbiter::session_counts::SessionCounts;
use latchkey_arbiter::table::{LockTable, MapVersion, TableOptions};
use latchkey_arbiter::witness::Witness;
use tokio::time::Instant;
use tokio_util::task::AbortOnDrop;

use super::idlog::IdLog;
use super::world::fnv1a;

/// What one arbiter's cluster is built from (its lock cluster, or one of
/// the other shards): the log, and how the hold count follows it.
#[derive(Clone)]
pub(crate) struct ClusterKit {
    pub(crate) log: Arc<IdLog>,
    pub(crate) blind_follower: bool,
    pub(crate) start: Instant,
}

impl ClusterKit {
    /// The parts around a started `table`, as `start.rs` builds a cluster:
    /// the hold count following the log, the session count too when
    /// sessions are opened there (the lock cluster; other shards hold only
    /// shadows), the quorum-loss posture with its spool in `state_dir` and
    /// its probe.
    pub(crate) fn parts(
        &self,
        table: &Arc<LockTable>,
        state_dir: &std::path::Path,
        opens_sessions: bool,
    ) -> Result<ClusterParts, String> {
        let mut tasks = Vec::new();
        let follow: Arc<dyn FollowLog> = self.log.clone();
        let sessions = SessionCounts::new(MAX_SESSIONS_PER_IDENTITY);
        if opens_sessions {
            let session_counts = tokio::spawn(latchkey_arbiter::follow::follow(
                sessions.clone(),
                follow.clone(),
                Counted::SessionIndex,
            ));
            tasks.push(AbortOnDrop::new(session_counts.abort_handle()));
        }
        let holds = HoldCounts::new(DEFAULT_MAX_HOLDS_PER_IDENTITY);
        let follow_log: Arc<dyn FollowLog> = match self.blind_follower {
            true => Arc::new(BlindFollower(follow)),
            false => follow,
        };
        let counts = tokio::spawn(latchkey_arbiter::follow::follow(
            holds.clone(),
            follow_log,
            Counted::Holds,
        ));
        tasks.push(AbortOnDrop::new(counts.abort_handle()));
        let start = self.start;
        let seams = Seams {
            // The paused clock, as wall time from a fixed moment.
            wall_ms: Arc::new(move || {
                SIM_EPOCH_MS
                    + i64::try_from(Instant::now().saturating_duration_since(start).as_millis())
                        .unwrap_or(i64::MAX / 2)
            }),
            inline_io: true,
        };
        let quorum = QuorumLoss::with_seams(
            QuorumLossConfig::default(),
            state_dir,
            DEFAULT_MAX_HOLDS_PER_IDENTITY,
            MAX_MEMORY_WAITERS,
            seams,
        )
        .map(Arc::new)
        .map_err(|e| format!("cannot open its spool: {e}"))?;
        let log: Arc<dyn LockLog> = self.log.clone();
        tasks.push(quorum.spawn_probe(log));
        Ok(ClusterParts {
            table: table.clone(),
            holds,
            sessions,
            quorum,
            tasks,
        })
    }
}

/// The lock cluster's name as a shard.
pub(crate) const HOME_SHARD: &str = "home";

/// A shard's endpoints in the map (never dialled: [`SimConnect`] builds
/// the cluster over the shard's log by name).
pub(crate) fn shard_endpoint(name: &str) -> String {
    format!("http://{name}.sim.test:2379")
}

/// Connects an arbiter to the other shards the map names, as `start.rs`'s
/// connector does: a table of its own over the shard's log with the
/// shard's witness, started, with the cluster's parts around it and a
/// state directory of its own under the arbiter's.
pub(crate) struct SimConnect {
    pub(crate) shards: BTreeMap<String, (ClusterKit, Arc<dyn Witness>)>,
    pub(crate) state_dir: PathBuf,
    pub(crate) map_version: MapVersion,
    pub(crate) policies: Arc<Policies>,
    pub(crate) poll: Duration,
    pub(crate) batch_limit: usize,
    pub(crate) seed: u64,
}

impl latchkey_arbiter::shards::routing::Connect for SimConnect {
    fn connect(
        &self,
        shard: latchkey_arbiter::shards::Shard,
    ) -> futures::future::BoxFuture<
        'static,
        Result<Arc<latchkey_arbiter::tiers::Cluster>, Box<latchkey_arbiter::RunError>>,
    > {
        let kit = self.shards.get(&shard.name).cloned();
        let state_dir = self.state_dir.join("shards").join(&shard.name);
        let (map_version, policies) = (self.map_version.clone(), self.policies.clone());
        let options = TableOptions {
            poll: self.poll,
            max_waiters_per_identity: 64,
            seed: self.seed ^ fnv1a(&shard.name),
            batch_limit: self.batch_limit,
            batches_in_flight: latchkey_arbiter::table::DEFAULT_BATCHES_IN_FLIGHT,
            session_tag: 0,
            map_version,
        };
        Box::pin(async move {
            let unreachable = |what: String| {
                Box::new(latchkey_arbiter::RunError::Store(
                    StoreError::unavailable(what).into(),
                ))
            };
            let Some((kit, witness)) = kit else {
                return Err(unreachable(format!(
                    "no shard named {:?} in the run",
                    shard.name
                )));
            };
            let table = LockTable::witnessed(
                kit.log.clone(),
                Arc::new(EpochGuard::default()),
                Arc::new(HighWater::in_memory(None)),
                Some(witness),
                options,
            );
            // As the lock cluster's: it serves once it has read the epoch.
            while table.start().await.is_err() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let parts = kit.parts(&table, &state_dir, false).map_err(unreachable)?;
            Ok(assemble::cluster(parts, &policies))
        })
    }
}

/// The wall clock's reading at a run's start, as the spools see it.
pub(crate) const SIM_EPOCH_MS: i64 = 1_700_000_000_000;

/// Open sessions per grant subject (every worker is one subject; dead
/// incarnations' sessions linger until their TTL).
pub(crate) const MAX_SESSIONS_PER_IDENTITY: u32 = 10_000;

/// Waiters for memory grants one identity may have on one arbiter.
pub(crate) const MAX_MEMORY_WAITERS: u32 = 64;

/// The bug [`FaultKnobs::blind_hold_follower`] puts in: a hold count that
/// never sees a hold, so every key looks free in etcd to a memory grant.
///
/// [`FaultKnobs::blind_hold_follower`]: super::FaultKnobs::blind_hold_follower
struct BlindFollower(Arc<dyn FollowLog>);

#[async_trait::async_trait]
impl FollowLog for BlindFollower {
    async fn follow(
        &self,
        counted: Counted,
        prev_kv: bool,
        _each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
    ) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError> {
        let (revision, watch) = self.0.follow(counted, prev_kv, &mut |_, _| {}).await?;
        let watch = watch.map(|w| Box::new(BlindWatch(w)) as Box<dyn PrefixWatch>);
        Ok((revision, watch))
    }
}

struct BlindWatch(Box<dyn PrefixWatch>);

#[async_trait::async_trait]
impl PrefixWatch for BlindWatch {
    async fn next(&mut self) -> FollowSignal {
        match self.0.next().await {
            FollowSignal::Events { through, .. } => FollowSignal::Events {
                events: Vec::new(),
                through,
            },
            FollowSignal::Lost => FollowSignal::Lost,
        }
    }
}
