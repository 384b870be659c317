//! Which tier's cluster serves a namespace, recorded once and never changed
//! by an arbiter: `{coord prefix}/sys/tiers/{lock cluster name}/<ns>` on the
//! coord cluster and `{prefix}/sys/tiers/<ns>` on the entity cluster hold
//! `"coord"` or `"entity"`.
//!
//! Why a record and not only the policies: arbiters reload their policies
//! at different moments, restart one by one, and may run with and without
//! `--split-tiers` during a rollout. If a namespace's tier followed the
//! policies each arbiter happens to have, one arbiter could grant `ns/x` on
//! the entity cluster while another grants it on the coord cluster: a
//! double grant no transaction can see. So the first arbiter to serve a
//! namespace binds it (a create-if-absent transaction: of two arbiters
//! racing, one binding lands and both obey it), and every arbiter routes by
//! the binding. A policy that later puts the namespace on the other tier is
//! refused for its keys with the reason and what to do: moving a namespace
//! between clusters needs its holds drained first (not built yet).
//!
//! An arbiter without `--split-tiers` binds what it serves to the entity
//! tier (its one lock cluster), so a split arbiter beside it cannot take
//! the namespace to the coord cluster under its holds. Before binding a
//! namespace to the coord tier an arbiter checks that the entity cluster
//! holds nothing in it (holds from before the tiers were split).
//!
//! Bindings are immutable, so each arbiter caches them forever; the set is
//! bounded by the policies (a namespace is the first segment of a granted
//! prefix: no caller can make up new ones). Each binding is kept on both
//! clusters (the coord cluster's copy per lock cluster name, the entity
//! cluster's under its prefix): a restore of one cluster loses no binding,
//! and a binding found on one only is written back to the other.
//!
//! Each copy is a [`BindingCopy`]: [`EtcdCopy`] on a cluster in
//! production; the simulation keeps its copies in its in-memory logs, so
//! a restore of its lock cluster takes the entity copy back with it.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use latchkey_etcd::Client;
use latchkey_etcd::kv::{GetOptions, get_one};
use latchkey_etcd::txn::{self, Compare, CompareOp, Txn, TxnOp};
use latchkey_policies::Tier;
use parking_lot::RwLock;

use crate::lock_log::StoreError;
use crate::lock_log::etcd::unavailable;

use super::tier_name;

/// The spelling of a binding's value (`"coord"` or `"entity"`); `None`
/// for anything else.
pub fn parse_tier(bytes: &[u8]) -> Option<Tier> {
    match bytes {
        b"coord" => Some(Tier::Coord),
        b"entity" => Some(Tier::Entity),
        _ => None,
    }
}

/// One copy of the bindings: where a namespace's record is read and
/// created.
#[async_trait]
pub trait BindingCopy: Send + Sync {
    /// The tier `namespace` is bound to in this copy (`None`: no record).
    async fn get(&self, namespace: &str) -> Result<Option<Tier>, StoreError>;
    /// Writes `tier` unless a record is there; the record either way.
    async fn create(&self, namespace: &str, tier: Tier) -> Result<Tier, StoreError>;
    /// Every record of this copy (read at start).
    async fn all(&self) -> Result<Vec<(String, Tier)>, StoreError>;
}

/// A copy on an etcd cluster, under a prefix.
pub struct EtcdCopy {
    client: Client,
    prefix: String,
    what: &'static str,
}

impl EtcdCopy {
    fn key(&self, namespace: &str) -> String {
        format!("{}{namespace}", self.prefix)
    }
}

#[async_trait]
impl BindingCopy for EtcdCopy {
    async fn get(&self, namespace: &str) -> Result<Option<Tier>, StoreError> {
        let key = self.key(namespace);
        let read = get_one(&self.client, key.as_str()).await.map_err(|e| {
            unavailable(&format!("cannot read the tier binding on {}", self.what), e)
        })?;
        match read.value {
            None => Ok(None),
            Some(kv) => parse_tier(kv.value())
                .map(Some)
                .ok_or_else(|| malformed(&key)),
        }
    }

    async fn create(&self, namespace: &str, tier: Tier) -> Result<Tier, StoreError> {
        let key = self.key(namespace);
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), tier_name(tier), None)])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let resp = txn::run(&self.client, txn).await.map_err(|e| {
            unavailable(
                &format!("cannot write the tier binding on {}", self.what),
                e,
            )
        })?;
        if resp.succeeded() {
            return Ok(tier);
        }
        resp.op_responses()
            .iter()
            .find_map(|op| txn::first_kv(op).and_then(|kv| parse_tier(kv.value())))
            .ok_or_else(|| malformed(&key))
    }

    async fn all(&self) -> Result<Vec<(String, Tier)>, StoreError> {
        let resp = self
            .client
            .kv_client()
            .get(self.prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| unavailable("cannot read the tier bindings", e))?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = String::from_utf8_lossy(kv.key());
                let namespace = key.strip_prefix(&self.prefix)?.to_string();
                Some((namespace, parse_tier(kv.value())?))
            })
            .collect())
    }
}

/// A binding record at `key` that [`parse_tier`] cannot read.
pub fn malformed(key: &str) -> StoreError {
    StoreError::Malformed(format!(
        "the tier binding {key} is neither \"coord\" nor \"entity\""
    ))
}

/// The namespace bindings, kept on two clusters (the coord cluster and the
/// entity cluster) so that a restore of either one alone loses none, and
/// cached.
pub struct Bindings {
    coord: Arc<dyn BindingCopy>,
    entity: Arc<dyn BindingCopy>,
    cache: RwLock<HashMap<String, Tier>>,
}

impl Bindings {
    /// Bindings under `{coord_prefix}/sys/tiers/{lock_cluster_name}/` on
    /// the coord cluster and `{prefix}/sys/tiers/` on the entity cluster.
    pub fn new(
        coord: Client,
        coord_prefix: &str,
        lock_cluster_name: &str,
        entity: Client,
        prefix: &str,
    ) -> Self {
        Self::over(
            Arc::new(EtcdCopy {
                client: coord,
                prefix: format!(
                    "{}/sys/tiers/{lock_cluster_name}/",
                    coord_prefix.trim_end_matches('/')
                ),
                what: "the coord cluster",
            }),
            Arc::new(EtcdCopy {
                client: entity,
                prefix: format!("{}/sys/tiers/", prefix.trim_end_matches('/')),
                what: "the entity cluster",
            }),
        )
    }

    /// Bindings kept in `coord` and `entity` (the simulation's copies).
    pub fn over(coord: Arc<dyn BindingCopy>, entity: Arc<dyn BindingCopy>) -> Self {
        Self {
            coord,
            entity,
            cache: RwLock::new(HashMap::new()),
        }
    }

    /// Reads the coord cluster's bindings into the cache (at start).
    pub async fn load(&self) -> Result<usize, StoreError> {
        let all = self.coord.all().await?;
        let mut cache = self.cache.write();
        cache.extend(all);
        Ok(cache.len())
    }

    /// The tier `namespace` is bound to, from the cache or the clusters
    /// (a copy one cluster lost in a restore is written back from the
    /// other); `None`: not bound.
    pub async fn bound(&self, namespace: &str) -> Result<Option<Tier>, StoreError> {
        if let Some(tier) = self.cache.read().get(namespace) {
            return Ok(Some(*tier));
        }
        let (coord, entity) = tokio::join!(self.coord.get(namespace), self.entity.get(namespace));
        let tier = match (coord?, entity?) {
            (None, None) => return Ok(None),
            (Some(c), Some(e)) if c != e => return Err(disagree(namespace, c, e)),
            (Some(t), Some(_)) => t,
            (Some(t), None) => self.entity.create(namespace, t).await?,
            (None, Some(t)) => self.coord.create(namespace, t).await?,
        };
        self.cache.write().insert(namespace.to_string(), tier);
        Ok(Some(tier))
    }

    /// Binds `namespace` to `wanted` unless it is bound already; the tier
    /// it is bound to either way. The entity cluster's copy is written
    /// first: of two racing arbiters, the one whose write lands there wins.
    pub async fn bind(&self, namespace: &str, wanted: Tier) -> Result<Tier, StoreError> {
        let tier = self.entity.create(namespace, wanted).await?;
        let coord = self.coord.create(namespace, tier).await?;
        if coord != tier {
            return Err(disagree(namespace, coord, tier));
        }
        self.cache.write().insert(namespace.to_string(), tier);
        Ok(tier)
    }
}

fn disagree(namespace: &str, coord: Tier, entity: Tier) -> StoreError {
    StoreError::Malformed(format!(
        "the tier bindings of namespace {namespace:?} disagree (coord cluster: {}, entity cluster: {}): both clusters restored from different moments? An operator must delete the wrong one",
        tier_name(coord),
        tier_name(entity)
    ))
}
