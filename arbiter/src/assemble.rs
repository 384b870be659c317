//! An [`Arbiter`] built around parts made elsewhere.
//!
//! `start.rs` connects to etcd and builds every part itself. The
//! simulation (`sim/`) builds the same parts over its in-memory log (the
//! table, the hold and session counts following it, the quorum-loss
//! posture with its probe) and assembles them here into the arbiter whose
//! handlers its clients call: the handlers it runs are the ones tonic
//! serves. The entity tier, shards of it when the parts name them (their
//! map kept where [`ShardParts::maps`] says, their clusters made by
//! [`ShardParts::connect`] with [`cluster`]), the coord tier on a cluster
//! of its own when they name one ([`CoordParts`]: keys routed between the
//! tiers by the namespace bindings), no class hooks, no force-release
//! credentials, workloads calling directly in the insecure dev mode
//! (identity from the dev header).

use std::sync::Arc;
use std::time::Duration;

use latchkey_hook_host::{HookHost, HostSettings};
use latchkey_policies::Tier;
use tokio_util::task::AbortOnDrop;

use crate::hold_counts::HoldCounts;
use crate::hook::NoHooks;
use crate::identity::IdentitySource;
use crate::metrics::Metrics;
use crate::owner::KeyOwner;
use crate::policy::Policies;
use crate::quorum_loss::QuorumLoss;
use crate::service::Arbiter;
use crate::session_counts::SessionCounts;
use crate::shards::ShardMaps;
use crate::shards::routing::{Connect, ShardRouting};
use crate::table::{LockTable, MapVersion};
use crate::tiers::bindings::Bindings;
use crate::tiers::{Cluster, Tiers};

/// One cluster's parts.
pub struct ClusterParts {
    pub table: Arc<LockTable>,
    pub holds: Arc<HoldCounts>,
    pub sessions: Arc<SessionCounts>,
    pub quorum: Arc<QuorumLoss>,
    /// What runs as long as the cluster (its followers and probe).
    pub tasks: Vec<AbortOnDrop>,
}

/// The entity tier's shards (ADR-09): the lock cluster is the shard named
/// `home_name`; the others are connected as the map names them.
pub struct ShardParts {
    pub home_name: String,
    /// The lock cluster's endpoints, as a first map names its shard.
    pub home_endpoints: Vec<String>,
    /// Where the shard map is kept and followed.
    pub maps: Arc<dyn ShardMaps>,
    /// Makes the cluster of a shard the map names (with [`cluster`]).
    pub connect: Arc<dyn Connect>,
    /// The map version this arbiter routes by, as every entity table
    /// compares it with its cluster's map fence.
    pub map_version: MapVersion,
}

/// The coord tier on a cluster of its own (ADR-07, `--split-tiers`): its
/// parts (a table whose session ids carry
/// [`COORD_SESSION_BIT`](crate::tiers::COORD_SESSION_BIT)), and the
/// namespace bindings every key is routed by.
pub struct CoordParts {
    pub cluster: ClusterParts,
    pub bindings: Bindings,
}

/// An arbiter's parts around its lock cluster.
pub struct ArbiterParts {
    pub cluster: ClusterParts,
    /// The entity tier's other shards, if it has any.
    pub shards: Option<ShardParts>,
    /// The coord tier, when it is split off.
    pub coord: Option<CoordParts>,
    pub policies: Arc<Policies>,
    /// The trust domain the dev header's SPIFFE IDs must be in.
    pub trust_domain: String,
    /// The longest an Acquire waits (`--max-wait`).
    pub max_wait: Duration,
    /// Open sessions per identity (`--max-sessions-per-identity`).
    pub max_sessions: u32,
    /// Shared by the arbiters of one process (no engine is made without hooks).
    pub hook_host: Arc<HookHost>,
}

/// A hook host for [`ArbiterParts::hook_host`] that never runs a hook.
pub fn idle_hook_host() -> Arc<HookHost> {
    Arc::new(HookHost::new(HostSettings {
        cache_dir: None,
        ..HostSettings::default()
    }))
}

/// One cluster of the entity tier around its parts: the owner of its keys
/// (with the table's key gate), its elections.
pub fn cluster(parts: ClusterParts, policies: &Arc<Policies>) -> Arc<Cluster> {
    cluster_of(Tier::Entity, parts, policies)
}

/// One cluster of `tier` around its parts.
fn cluster_of(tier: Tier, parts: ClusterParts, policies: &Arc<Policies>) -> Arc<Cluster> {
    let c = parts;
    c.table.set_permits_source(policies.clone());
    let owner = KeyOwner::new(c.table.clone(), c.holds.clone(), c.quorum.clone());
    Arc::new(Cluster {
        tier,
        owner,
        elections: Arc::new(crate::election::Elections::new(c.table.clone())),
        table: c.table,
        holds: c.holds,
        sessions: c.sessions,
        quorum: c.quorum,
        force: None,
        _tasks: c.tasks,
    })
}

/// The assembled arbiter, and the owner of its lock cluster's keys (what
/// force-release approvals call). With shards, the map is read before this
/// returns and followed after; an arbiter that cannot read it does not
/// serve (as `start.rs`: it would route every key to its lock cluster).
/// With the coord tier, the bindings are read first too.
pub async fn arbiter(
    parts: ArbiterParts,
) -> Result<(Arc<Arbiter>, Arc<OwnerHandle>), crate::lock_log::StoreError> {
    let cluster = self::cluster(parts.cluster, &parts.policies);
    let c = &cluster;
    let (coord, bindings) = match parts.coord {
        Some(coord) => {
            coord.bindings.load().await?;
            let cluster = cluster_of(Tier::Coord, coord.cluster, &parts.policies);
            (Some(cluster), Some(coord.bindings))
        }
        None => (None, None),
    };
    let mut tiers = Tiers::new(cluster.clone(), coord, bindings);
    if let Some(shards) = parts.shards {
        let routing = Arc::new(ShardRouting::new(
            &shards.home_name,
            shards.home_endpoints,
            cluster.clone(),
            shards.maps,
            shards.connect,
            shards.map_version,
        ));
        routing.load().await?;
        let follow = routing.follow();
        tiers = tiers.with_shards(routing, follow);
    }
    let metrics = {
        let table = c.table.clone();
        let quorum = c.quorum.clone();
        Metrics::new(
            Arc::new(move || table.totals()),
            c.table.seal().guard_shared(),
            parts.hook_host,
            Arc::new(move || quorum.snapshot()),
        )
    };
    if let Some(coord) = tiers.coord() {
        let quorum = coord.quorum.clone();
        metrics.set_coord_tier(
            coord.table.seal().guard_shared(),
            Arc::new(move || quorum.snapshot()),
        );
    }
    let metrics = Arc::new(metrics);
    let admission = crate::overload::Admission::new(crate::overload::OverloadConfig::default());
    metrics.set_admission(Arc::clone(&admission));
    let bounds = Arc::new(crate::bounds::Bounds::new(parts.max_sessions));
    let arbiter = Arc::new(Arbiter {
        tiers,
        policies: parts.policies,
        identity: IdentitySource::InsecureDev {
            trust_domain: parts.trust_domain,
        },
        direct_workloads: true,
        hooks: Arc::new(NoHooks),
        max_wait: parts.max_wait,
        metrics,
        bounds,
        admission,
        campaign_calls: Arc::default(),
        observe_calls: Arc::default(),
        max_campaigns_per_subject: crate::table::DEFAULT_MAX_WAITERS_PER_IDENTITY,
        max_leaderships: crate::hold_counts::DEFAULT_MAX_HOLDS_PER_IDENTITY,
    });
    Ok((arbiter.clone(), Arc::new(OwnerHandle { cluster, arbiter })))
}

/// The owner of an assembled arbiter's keys.
pub struct OwnerHandle {
    cluster: Arc<Cluster>,
    arbiter: Arc<Arbiter>,
}

impl OwnerHandle {
    /// The owner of the lock cluster's keys (every key, unsharded).
    pub fn owner(&self) -> &KeyOwner {
        &self.cluster.owner
    }

    /// The cluster holding `key` now (its shard by the map this arbiter
    /// routes by), whose [`Cluster::owner`] decides its fate.
    pub async fn cluster_of(&self, key: &str) -> Result<Arc<Cluster>, crate::error::ArbiterError> {
        let key = latchkey_policies::LockKey::parse(key)
            .map_err(|e| crate::error::ArbiterError::BadKey(e.to_string()))?;
        self.arbiter.tiers.for_key(&key).await
    }

    /// The entity tier's clusters: the lock cluster, then every other
    /// connected shard.
    pub fn entity_clusters(&self) -> Vec<Arc<Cluster>> {
        self.arbiter.tiers.entity_clusters()
    }

    /// Every cluster but the lock cluster: the coord tier's (split off),
    /// then the other connected shards.
    pub fn other_clusters(&self) -> Vec<Arc<Cluster>> {
        self.arbiter.tiers.all().into_iter().skip(1).collect()
    }
}
