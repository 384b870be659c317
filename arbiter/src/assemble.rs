//! An [`Arbiter`] built around parts made elsewhere.
//!
//! `start.rs` connects to etcd and builds every part itself. The
//! simulation (`sim/`) builds the same parts over its in-memory log (the
//! table, the hold and session counts following it, the quorum-loss
//! posture with its probe) and assembles them here into the arbiter whose
//! handlers its clients call: the handlers it runs are the ones tonic
//! serves. One tier (the entity cluster serves every class), no shards, no
//! class hooks, no force-release credentials, workloads calling directly
//! in the insecure dev mode (identity from the dev header).

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
use crate::table::LockTable;
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

/// An arbiter's parts around its one cluster.
pub struct ArbiterParts {
    pub cluster: ClusterParts,
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

/// The assembled arbiter, and the owner of its one cluster's keys (what
/// force-release approvals call).
pub fn arbiter(parts: ArbiterParts) -> (Arc<Arbiter>, Arc<OwnerHandle>) {
    let c = parts.cluster;
    c.table.set_permits_source(parts.policies.clone());
    let owner = KeyOwner::new(c.table.clone(), c.holds.clone(), c.quorum.clone());
    let cluster = Arc::new(Cluster {
        tier: Tier::Entity,
        owner,
        elections: Arc::new(crate::election::Elections::new(c.table.clone())),
        table: c.table.clone(),
        holds: c.holds,
        sessions: c.sessions,
        quorum: c.quorum.clone(),
        force: None,
        _tasks: c.tasks,
    });
    let tiers = Tiers::new(cluster.clone(), None, None);
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
    (arbiter, Arc::new(OwnerHandle(cluster)))
}

/// The owner of an assembled arbiter's keys.
pub struct OwnerHandle(Arc<Cluster>);

impl OwnerHandle {
    pub fn owner(&self) -> &KeyOwner {
        &self.0.owner
    }
}
