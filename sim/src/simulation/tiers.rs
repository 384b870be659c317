//! The coord tier on a cluster of its own ([`SimConfig::coord_keys`],
//! ADR-07): its log, and the namespace bindings' two copies kept in the
//! simulation's logs, as `start.rs` keeps them in the coord and entity
//! clusters. The entity copy is in the lock cluster's log, so a restore
//! of it takes the copy back, and the arbiters write it back from the
//! coord copy (tiers/bindings.rs).
//!
//! What differs from production: the coord tier's cluster, the coord
//! cluster's witness ([`MemWitness`](crate::witness::MemWitness)) and
//! the shard maps are separate stores here, where production keeps all
//! three on the coord etcd cluster; the nemesis restores, slows and
//! fails the lock cluster only, not the coord tier's log.
//!
//! [`SimConfig::coord_keys`]: super::SimConfig::coord_keys

use std::sync::Arc;

use async_trait::async_trait;
use latchkey_arbiter::lock_log::StoreError;
use latchkey_arbiter::tiers::bindings::{BindingCopy, parse_tier};
use latchkey_arbiter::tiers::tier_name;
use latchkey_arbiter::witness::Witness;
use latchkey_policies::Tier;

use super::idlog::IdLog;
use crate::memlog::MemLog;

/// The coord tier's cluster: its log, and the same log with the run's
/// lease ids.
pub(crate) struct CoordLog {
    pub(crate) memlog: MemLog,
    pub(crate) idlog: Arc<IdLog>,
    /// Its witness (`--coord-tier-witness-etcd`), shared by every
    /// arbiter's table of it.
    pub(crate) witness: Arc<dyn Witness>,
}

/// One copy of the bindings, in a simulated log under `prefix`.
pub(crate) struct MemBindingCopy {
    pub(crate) log: MemLog,
    pub(crate) prefix: String,
}

impl MemBindingCopy {
    fn key(&self, namespace: &str) -> String {
        format!("{}{namespace}", self.prefix)
    }

    fn malformed(&self, namespace: &str) -> StoreError {
        StoreError::Malformed(format!(
            "the tier binding {} is neither \"coord\" nor \"entity\"",
            self.key(namespace)
        ))
    }
}

#[async_trait]
impl BindingCopy for MemBindingCopy {
    async fn get(&self, namespace: &str) -> Result<Option<Tier>, StoreError> {
        match self.log.plain_get(&self.key(namespace)).await? {
            None => Ok(None),
            Some(value) => parse_tier(&value)
                .map(Some)
                .ok_or_else(|| self.malformed(namespace)),
        }
    }

    async fn create(&self, namespace: &str, tier: Tier) -> Result<Tier, StoreError> {
        let there = self
            .log
            .plain_create(&self.key(namespace), tier_name(tier).as_bytes().to_vec())
            .await?;
        tracing::debug!(
            key = %self.key(namespace),
            wanted = tier_name(tier),
            there = %String::from_utf8_lossy(&there),
            "tier binding created"
        );
        parse_tier(&there).ok_or_else(|| self.malformed(namespace))
    }

    async fn all(&self) -> Result<Vec<(String, Tier)>, StoreError> {
        Ok(self
            .log
            .plain_under(&self.prefix)
            .await?
            .into_iter()
            .filter_map(|(key, value)| {
                let namespace = key.strip_prefix(&self.prefix)?.to_string();
                Some((namespace, parse_tier(&value)?))
            })
            .collect())
    }
}
