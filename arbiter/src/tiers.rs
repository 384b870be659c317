//! Two cluster tiers (ADR-07): coord and entity, each its own etcd cluster
//! with its own [`LockTable`] (log, seal, high-water mark, witness), hold
//! count, quorum probe and force-release store.
//!
//! **A key's tier is the key's, not the caller's.** A caller names a class on
//! every Acquire, so routing by the class alone would let one key be held on
//! both clusters at once (a double grant no transaction can see). The
//! policies decide instead: keys in a namespace some coord-tier class names
//! (`namespaces = [...]`) are coord keys, every other key is an entity key
//! ([`latchkey_policies::PolicySet::tier_of_key`]). With the tiers split, an
//! Acquire whose class is of the other tier is refused, and so is a session
//! of the other tier.
//!
//! **A session lives in one cluster** (it is a lease). OpenSession opens it
//! on its class's tier; the coord table tags its session ids with
//! [`COORD_SESSION_BIT`], so a session-scoped call finds its cluster from
//! the id alone.
//!
//! With the tiers not split (no `--split-tiers`) there is one cluster: every
//! key, class and session is served by the entity cluster, as before.
//!
//! **The policies propose, the binding decides**: arbiters reload policies
//! at different moments, so a namespace's cluster is recorded once on the
//! coord cluster ([`bindings`]) and every arbiter routes by that record.

pub mod bindings;

use std::sync::Arc;

use latchkey_policies::{LockClass, LockKey, PolicySet, Tier};
use tokio_util::task::AbortOnDrop;

use crate::error::ArbiterError;
use crate::force_release::ForceRelease;
use crate::hold_counts::HoldCounts;
use crate::quorum_loss::QuorumLoss;
use crate::session_counts::SessionCounts;
use crate::shards::routing::ShardRouting;
use crate::table::LockTable;
pub use crate::table::sessions::COORD_SESSION_BIT;

/// One lock cluster and everything the arbiter keeps for it.
pub struct Cluster {
    /// Which tier it serves (with the tiers not split, the entity cluster
    /// serves both).
    pub tier: Tier,
    /// Decides every grant, memory grant and release of this cluster's
    /// keys (issue 32): the handlers ask it, never the parts below.
    pub(crate) owner: crate::owner::KeyOwner,
    /// Decides every election of this cluster (latchkey.election.v1).
    pub(crate) elections: Arc<crate::election::Elections>,
    pub(crate) table: Arc<LockTable>,
    /// Holds per identity, counted from this cluster's log.
    pub(crate) holds: Arc<HoldCounts>,
    /// Open sessions per subject, counted from this cluster's session
    /// index; followed only on the clusters sessions are opened on
    /// ([`Tiers::session_clusters`]).
    pub(crate) sessions: Arc<SessionCounts>,
    /// ADR-04: this cluster's quorum verdict, open classes' memory grants and spool.
    pub(crate) quorum: Arc<QuorumLoss>,
    /// Two-person force-release of this cluster's holds; `None` without OIDC.
    pub(crate) force: Option<Arc<ForceRelease>>,
    /// Its followers (holds, sessions) and quorum probe: they stop with it.
    pub(crate) _tasks: Vec<AbortOnDrop>,
}

impl Cluster {
    pub fn table(&self) -> &Arc<LockTable> {
        &self.table
    }

    /// The owner of this cluster's keys.
    pub fn owner(&self) -> &crate::owner::KeyOwner {
        &self.owner
    }

    /// The tier's name, for errors and logs.
    pub fn name(&self) -> &'static str {
        tier_name(self.tier)
    }
}

pub fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Coord => "coord",
        Tier::Entity => "entity",
    }
}

/// The clusters of this arbiter: the entity cluster always, the coord
/// cluster when the tiers are split; the namespace bindings whenever there
/// is a coord cluster.
pub struct Tiers {
    entity: Arc<Cluster>,
    coord: Option<Arc<Cluster>>,
    bindings: Option<bindings::Bindings>,
    /// The entity tier's shards, with a coord cluster (ADR-09).
    shards: Option<Arc<ShardRouting>>,
    _follow: Option<AbortOnDrop>,
}

/// Where an Acquire is served, and by which shard map version it was
/// routed (`None`: the coord tier, which is not sharded).
pub struct AcquireRoute {
    pub cluster: Arc<Cluster>,
    pub map_version: Option<u64>,
    /// The entity shard's name when it is not the lock cluster (the key is
    /// held on a shadow of the session there).
    pub other_shard: Option<String>,
}

impl Tiers {
    pub fn new(
        entity: Arc<Cluster>,
        coord: Option<Arc<Cluster>>,
        bindings: Option<bindings::Bindings>,
    ) -> Self {
        Self {
            entity,
            coord,
            bindings,
            shards: None,
            _follow: None,
        }
    }

    /// Routes entity keys by the shard map `shards` follows.
    pub fn with_shards(mut self, shards: Arc<ShardRouting>, follow: AbortOnDrop) -> Self {
        self.shards = Some(shards);
        self._follow = Some(follow);
        self
    }

    pub fn shards(&self) -> Option<&Arc<ShardRouting>> {
        self.shards.as_ref()
    }

    /// The entity tier's clusters: the home cluster, then every other
    /// connected shard.
    pub fn entity_clusters(&self) -> Vec<Arc<Cluster>> {
        let mut all = vec![self.entity.clone()];
        if let Some(shards) = &self.shards {
            all.extend(shards.others());
        }
        all
    }

    /// The clusters sessions are opened on: the entity (home) cluster and
    /// the coord cluster when split. Other shards hold only shadows.
    pub fn session_clusters(&self) -> impl Iterator<Item = &Arc<Cluster>> {
        std::iter::once(&self.entity).chain(self.coord.iter())
    }

    /// Whether coord-tier keys live on a cluster of their own.
    pub fn split(&self) -> bool {
        self.coord.is_some()
    }

    pub fn entity(&self) -> &Arc<Cluster> {
        &self.entity
    }

    pub fn coord(&self) -> Option<&Arc<Cluster>> {
        self.coord.as_ref()
    }

    /// Every cluster: the entity cluster first, the coord cluster, then
    /// the other connected shards.
    pub fn all(&self) -> Vec<Arc<Cluster>> {
        let mut all: Vec<_> = self.session_clusters().cloned().collect();
        if let Some(shards) = &self.shards {
            all.extend(shards.others());
        }
        all
    }

    /// The cluster serving `tier`.
    pub fn for_tier(&self, tier: Tier) -> &Arc<Cluster> {
        match (tier, &self.coord) {
            (Tier::Coord, Some(coord)) => coord,
            _ => &self.entity,
        }
    }

    /// The cluster a session lives in, from its id.
    pub fn for_session(&self, session: i64) -> &Arc<Cluster> {
        match &self.coord {
            Some(coord) if session & COORD_SESSION_BIT != 0 => coord,
            _ => &self.entity,
        }
    }

    /// The tier this arbiter would serve `key` on, by its policies alone.
    fn proposed(&self, policies: &PolicySet, key: &LockKey) -> Tier {
        match self.split() {
            true => policies.tier_of_key(key),
            false => Tier::Entity,
        }
    }

    /// The cluster holding `key`'s holds (Release, Inspect, force-release):
    /// by the namespace's binding; an unbound namespace has no holds but
    /// those from before bindings existed, on the entity cluster.
    pub async fn for_key(&self, key: &LockKey) -> Result<Arc<Cluster>, ArbiterError> {
        let Some(bindings) = &self.bindings else {
            // No coord cluster, no bindings: every key is an entity key,
            // on its shard when the entity tier is sharded (an arbiter
            // assembled over shards without a coord cluster: the
            // simulation's).
            return match &self.shards {
                Some(shards) => Ok(shards.holding(key.as_str())?.cluster),
                None => Ok(self.entity.clone()),
            };
        };
        match bindings
            .bound(key.namespace())
            .await
            .map_err(bindings_error)?
        {
            Some(Tier::Coord) => self.coord.clone().ok_or_else(|| not_split(key)),
            _ => match &self.shards {
                Some(shards) => Ok(shards.holding(key.as_str())?.cluster),
                None => Ok(self.entity.clone()),
            },
        }
    }

    /// The cluster serving an Acquire of `key` with `class` on `session`:
    /// the namespace's bound tier (binding it to the tier this arbiter's
    /// policies propose, if nobody has yet). Refused when the binding and
    /// the policies disagree, or — with the tiers split — when the class
    /// belongs to the other tier, or the session is an entity session and
    /// the key a coord key. (A session of the other cluster is refused by
    /// the grant transaction itself, which compares the session record on
    /// the key's cluster.)
    pub async fn for_acquire(
        &self,
        policies: &PolicySet,
        key: &LockKey,
        class: &LockClass,
        session: i64,
    ) -> Result<AcquireRoute, ArbiterError> {
        let proposed = self.proposed(policies, key);
        // A class of the other tier is bad input: refused before anything
        // (a binding) is written.
        if self.split() && class.tier != proposed {
            return Err(ArbiterError::WrongTier(wrong_class_tier(
                key.as_str(),
                key.namespace(),
                &class.name,
                class.tier,
                proposed,
            )));
        }
        let tier = match &self.bindings {
            None => proposed,
            Some(bindings) => self.bind(bindings, key, proposed).await?,
        };
        if tier != proposed {
            let namespace = key.namespace();
            return Err(match (self.split(), proposed) {
                (false, _) => not_split(key),
                (true, Tier::Coord) => ArbiterError::TierBound(format!(
                    "namespace {namespace:?} is bound to the entity tier (recorded when it was first served), but the policies now name it in a coord-tier class: moving a namespace between tiers is not supported yet; use a namespace not served before for the coord tier (docs/tiers-and-shards.md)"
                )),
                (true, Tier::Entity) => ArbiterError::TierBound(format!(
                    "namespace {namespace:?} is bound to the coord tier (recorded when it was first served), but no coord-tier class names it any more: moving a namespace between tiers is not supported yet; name it in a coord-tier class again (docs/tiers-and-shards.md)"
                )),
            });
        }
        if self.split() && tier == Tier::Coord && session & COORD_SESSION_BIT == 0 {
            return Err(ArbiterError::SessionWrongTier(format!(
                "session {session:#x} was opened for an entity-tier class, and key {:?} lives on the coord tier: open a session for class {:?} and acquire with it",
                key.as_str(),
                class.name
            )));
        }
        Ok(match (tier, &self.shards) {
            (Tier::Entity, Some(shards)) => {
                // A quota's places live in one lock cluster, beside the
                // holds they count: over several shards it would hold per
                // shard, not per subject. Refused rather than overshot.
                let sharded = shards.map().is_some_and(|m| m.all_shards().count() > 1);
                if sharded && let Some(max) = class.max_holds_per_subject {
                    return Err(ArbiterError::TierBound(format!(
                        "class {:?} has a quota (maxHoldsPerSubject = {max}), which is kept in one lock cluster, and key {:?} is on the entity tier, sharded over several: a quota there would hold per shard, not per subject; serve the key's namespace from the coord tier (name it in a coord-tier class's namespaces, docs/tiers-and-shards.md) or remove maxHoldsPerSubject",
                        class.name,
                        key.as_str()
                    )));
                }
                let route = shards.granting(key.as_str())?;
                let other = route.shard != shards.home_name();
                AcquireRoute {
                    cluster: route.cluster,
                    map_version: Some(route.version),
                    other_shard: other.then_some(route.shard),
                }
            }
            _ => AcquireRoute {
                cluster: self.for_tier(tier).clone(),
                map_version: match tier {
                    Tier::Coord => None,
                    Tier::Entity => Some(0),
                },
                other_shard: None,
            },
        })
    }

    /// The namespace's binding, written as `proposed` if there is none. A
    /// namespace is bound to the coord tier only while the entity cluster
    /// holds nothing in it, and with the coord tier's epoch above the
    /// entity tier's, so a key that had holds on the entity cluster before
    /// never gets a smaller token on the coord cluster.
    async fn bind(
        &self,
        bindings: &bindings::Bindings,
        key: &LockKey,
        proposed: Tier,
    ) -> Result<Tier, ArbiterError> {
        let namespace = key.namespace();
        if let Some(tier) = bindings.bound(namespace).await.map_err(bindings_error)? {
            return Ok(tier);
        }
        if let (Tier::Coord, Some(coord)) = (proposed, &self.coord) {
            for entity in self.entity_clusters() {
                let table = &entity.table;
                if table.holds_any_under(&format!("{namespace}/")).await?
                    || table.holder(namespace).await?.is_some()
                {
                    return Err(ArbiterError::TierMoving(format!(
                        "namespace {namespace:?} is moving to the coord tier and is not served until the entity tier's earlier holds in it end (released or expired); retry later"
                    )));
                }
            }
            self.raise_coord_epoch(coord, namespace).await?;
        }
        bindings
            .bind(namespace, proposed)
            .await
            .map_err(bindings_error)
    }

    /// Makes the coord tier's epoch greater than the entity tier's: every
    /// coord token is then above every entity token (epoch × 2^48
    /// dominates any revision). An advance ends every coord hold, so it is
    /// made only while the coord cluster holds nothing; otherwise an
    /// operator must.
    async fn raise_coord_epoch(
        &self,
        coord: &Cluster,
        namespace: &str,
    ) -> Result<(), ArbiterError> {
        for _ in 0..3 {
            let mut entity = 0;
            for cluster in self.entity_clusters() {
                entity = entity.max(cluster.table.seal().load_epoch().await?.epoch());
            }
            let now = coord.table.seal().load_epoch().await?.epoch();
            if now > entity {
                return Ok(());
            }
            // A sealed tier is unsealed by an operator only.
            coord.table.seal().guard().serving()?;
            if coord.table.holds_any_under("").await? {
                return Err(ArbiterError::TierBound(format!(
                    "namespace {namespace:?} would move to the coord tier, whose epoch ({now}) is not above the entity tier's ({entity}), so its tokens could be below ones handed out on the entity cluster; an operator must run `latchctl admin advance-epoch --tier coord --expected {now} --at-least {} --reason ...` (it ends every coord-tier hold)",
                    entity + 1
                )));
            }
            let reason = format!(
                "the coord tier's epoch raised above the entity tier's ({entity}) before namespace {namespace:?} is served there"
            );
            match coord
                .table
                .seal()
                .advance_epoch_at_least(now, &reason, entity + 1)
                .await
            {
                Ok((record, _)) => {
                    tracing::warn!(
                        epoch = record.epoch,
                        namespace,
                        "coord tier's epoch raised above the entity tier's"
                    );
                }
                // Another arbiter advanced it first: read again.
                Err(ArbiterError::BadRequest(_) | ArbiterError::Sealed { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Err(ArbiterError::TierMoving(format!(
            "namespace {namespace:?}: the coord tier's epoch kept changing while it was raised; retry"
        )))
    }

    /// The cluster a session lives in: its id's tier, or the entity cluster
    /// for a session from before the tiers were split whose id happens to
    /// carry the coord bit (ids were drawn below 2^53 then).
    pub async fn session_cluster(&self, session: i64) -> Result<&Arc<Cluster>, ArbiterError> {
        let tagged = self.for_session(session);
        if tagged.tier == Tier::Coord && tagged.table.session(session).await?.is_none() {
            return Ok(&self.entity);
        }
        Ok(tagged)
    }
}

fn bindings_error(e: crate::lock_log::StoreError) -> ArbiterError {
    match e {
        crate::lock_log::StoreError::Malformed(what) => ArbiterError::internal(what),
        other => {
            ArbiterError::store_caused(format!("the tier bindings: {}", other.detail()), other)
        }
    }
}

fn not_split(key: &LockKey) -> ArbiterError {
    ArbiterError::TierMoving(format!(
        "namespace {:?} is bound to the coord tier, and this arbiter runs without --split-tiers (a rollout in progress?): its keys are served by arbiters with --split-tiers; retry",
        key.namespace()
    ))
}

fn wrong_class_tier(
    key: &str,
    namespace: &str,
    class: &str,
    class_tier: Tier,
    key_tier: Tier,
) -> String {
    let why = match key_tier {
        Tier::Coord => format!("namespace {namespace:?} is named by a coord-tier class"),
        Tier::Entity => format!("no coord-tier class names namespace {namespace:?}"),
    };
    format!(
        "class {class:?} is a {}-tier class, but key {key:?} lives on the {} tier ({why}): acquire it with a {}-tier class, or ask the policy owners to move the namespace (a coord class's namespaces)",
        tier_name(class_tier),
        tier_name(key_tier),
        tier_name(key_tier),
    )
}
