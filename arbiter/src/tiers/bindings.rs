//! Which tier's cluster serves a namespace, recorded once on the coord
//! cluster and never changed by an arbiter: `{coord prefix}/sys/tiers/<ns>`
//! holds `"coord"` or `"entity"`.
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
//! prefix: no caller can make up new ones).

use std::collections::HashMap;

use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use latchkey_policies::Tier;
use parking_lot::RwLock;

use crate::lock_log::StoreError;
use crate::lock_log::etcd::unavailable;

use super::tier_name;

/// The namespace bindings on the coord cluster, cached.
pub struct Bindings {
    client: Client,
    prefix: String,
    cache: RwLock<HashMap<String, Tier>>,
}

fn parse(bytes: &[u8]) -> Option<Tier> {
    match bytes {
        b"coord" => Some(Tier::Coord),
        b"entity" => Some(Tier::Entity),
        _ => None,
    }
}

impl Bindings {
    /// Bindings under `{coord_prefix}/sys/tiers/` on the coord cluster.
    pub fn new(client: Client, coord_prefix: &str) -> Self {
        Self {
            client,
            prefix: format!("{}/sys/tiers/", coord_prefix.trim_end_matches('/')),
            cache: RwLock::new(HashMap::new()),
        }
    }

    /// Reads every binding into the cache (at start).
    pub async fn load(&self) -> Result<usize, StoreError> {
        let resp = self
            .client
            .kv_client()
            .get(self.prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| unavailable("cannot read the tier bindings", e))?;
        let mut cache = self.cache.write();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            if let (Some(ns), Some(tier)) = (key.strip_prefix(&self.prefix), parse(kv.value())) {
                cache.insert(ns.to_string(), tier);
            }
        }
        Ok(cache.len())
    }

    /// The tier `namespace` is bound to, from the cache or the coord
    /// cluster; `None`: not bound (nobody has served it since bindings exist).
    pub async fn bound(&self, namespace: &str) -> Result<Option<Tier>, StoreError> {
        if let Some(tier) = self.cache.read().get(namespace) {
            return Ok(Some(*tier));
        }
        let resp = self
            .client
            .kv_client()
            .get(self.key(namespace), None)
            .await
            .map_err(|e| unavailable("cannot read the tier binding", e))?;
        let tier = resp.kvs().first().and_then(|kv| parse(kv.value()));
        if let Some(tier) = tier {
            self.cache.write().insert(namespace.to_string(), tier);
        }
        Ok(tier)
    }

    /// Binds `namespace` to `wanted` unless it is bound already; the tier
    /// it is bound to either way.
    pub async fn bind(&self, namespace: &str, wanted: Tier) -> Result<Tier, StoreError> {
        let key = self.key(namespace);
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), tier_name(wanted), None)])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let resp = self
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(|e| unavailable("cannot write the tier binding", e))?;
        let tier = if resp.succeeded() {
            wanted
        } else {
            resp.op_responses()
                .into_iter()
                .find_map(|op| match op {
                    TxnOpResponse::Get(get) => get.kvs().first().and_then(|kv| parse(kv.value())),
                    _ => None,
                })
                .ok_or_else(|| {
                    StoreError::Malformed(format!(
                        "the tier binding {key} is neither \"coord\" nor \"entity\""
                    ))
                })?
        };
        self.cache.write().insert(namespace.to_string(), tier);
        Ok(tier)
    }

    fn key(&self, namespace: &str) -> String {
        format!("{}{namespace}", self.prefix)
    }
}
