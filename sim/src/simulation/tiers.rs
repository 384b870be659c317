//! The coord tier on a cluster of its own ([`SimConfig::coord_keys`],
//! ADR-07): its log, and the namespace bindings' two copies kept in the
//! simulation's logs, as `start.rs` keeps them in the coord and entity
//! clusters. The entity copy is in the lock cluster's log, so a restore
//! of it takes the copy back, and the arbiters write it back from the
//! coord copy (tiers/bindings.rs).
//!
//! What differs from production: the coord tier's cluster and its own
//! witness are separate stores here that are never restored, slowed or
//! failed (the nemesis acts on the lock cluster only). In production the
//! coord tier's cluster is the coord etcd cluster, and its witness is the
//! lock cluster unless `--coord-tier-witness-etcd` names another, so a
//! restore of the lock cluster rolls that witness back too. The entity
//! copy of the bindings is seldom read here: every arbiter loads the
//! coord copy into its cache at start.
//!
//! [`SimConfig::coord_keys`]: super::SimConfig::coord_keys

use std::sync::Arc;

use async_trait::async_trait;
use latchkey_arbiter::lock_log::StoreError;
use latchkey_arbiter::tiers::bindings::{BindingCopy, malformed, parse_tier};
use latchkey_arbiter::tiers::tier_name;
use latchkey_arbiter::witness::Witness;
use latchkey_policies::Tier;

use latchkey_arbiter::assemble::CoordParts;
use latchkey_arbiter::epoch::EpochGuard;
use latchkey_arbiter::high_water::HighWater;
use latchkey_arbiter::table::{LockTable, MapVersion, TableOptions};
use latchkey_arbiter::tiers::bindings::Bindings;
use tokio::time::Duration;

use super::clusters::HOME_SHARD;
use super::idlog::{IdLog, TracedWitness};
use super::world::{World, fnv1a};
use crate::memlog::MemLog;
use crate::witness::MemWitness;

/// The coord tier's cluster: its log, and the same log with the run's
/// lease ids.
pub(crate) struct CoordLog {
    pub(crate) memlog: MemLog,
    pub(crate) idlog: Arc<IdLog>,
    /// Its witness (`--coord-tier-witness-etcd`), shared by every
    /// arbiter's table of it.
    pub(crate) witness: Arc<dyn Witness>,
}

/// The coord tier's cluster, when split off ([`SimConfig::coord_keys`],
/// with the whole arbiter): seeded from the run's seed, not from its rng,
/// so a run without it draws what it always drew.
///
/// [`SimConfig::coord_keys`]: super::SimConfig::coord_keys
pub(crate) fn coord_log(cfg: &super::SimConfig, idlog: &Arc<IdLog>) -> Option<CoordLog> {
    (cfg.whole_arbiter && cfg.coord_keys > 0).then(|| {
        let memlog = super::shards::untouched_log(cfg, cfg.seed ^ 0xC00D_7133_0000_0000);
        let idlog = Arc::new(IdLog::sharing(memlog.clone(), idlog));
        let witness = MemWitness::new(cfg.seed ^ 0xC00D_7133_5EE5_0000);
        CoordLog {
            memlog,
            witness: Arc::new(TracedWitness::new(witness, idlog.clone())),
            idlog,
        }
    })
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
        malformed(&self.key(namespace))
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

/// The coord tier as the world's arbiters and judge see it.
impl World {
    /// The coord tier's parts for arbiter `i`, as `start.rs` builds them
    /// with `--split-tiers`: a table of its own over the coord tier's log
    /// (session ids with the coord bit, its own witness, its quorum spool
    /// under the arbiter's state dir, a high-water mark in memory that a
    /// restart loses: the witness vouches), started; the bindings' copies
    /// in the coord tier's log and in the lock cluster's.
    pub(crate) async fn coord_parts(
        &self,
        i: usize,
        coord: &CoordLog,
        state_dir: &std::path::Path,
        seed: u64,
    ) -> Option<CoordParts> {
        let table = LockTable::witnessed(
            coord.idlog.clone(),
            Arc::new(EpochGuard::default()),
            Arc::new(HighWater::in_memory(None)),
            Some(coord.witness.clone()),
            TableOptions {
                poll: self.cfg.poll,
                max_waiters_per_identity: 64,
                seed: seed ^ fnv1a("coord-tier"),
                batch_limit: self.cfg.batch_limit,
                batches_in_flight: latchkey_arbiter::table::DEFAULT_BATCHES_IN_FLIGHT,
                session_tag: latchkey_arbiter::tiers::COORD_SESSION_BIT,
                map_version: MapVersion::default(),
            },
        );
        while table.start().await.is_err() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let parts =
            match self
                .kit(coord.idlog.clone())
                .parts(&table, &state_dir.join("coord-tier"), true)
            {
                Ok(parts) => parts,
                Err(e) => {
                    self.note(format!("arbiter-{i} coord tier: {e}"));
                    return None;
                }
            };
        let (coord_copy, entity_copy) = match self.cfg.faults.tier_bindings_unshared {
            // The bug: a store of this arbiter's own (this start's).
            true => {
                let own = MemLog::new(seed ^ fnv1a("bindings"));
                (own.clone(), own)
            }
            false => (coord.memlog.clone(), self.memlog.clone()),
        };
        let bindings = Bindings::over(
            Arc::new(MemBindingCopy {
                log: coord_copy,
                prefix: format!("sys/tiers/{HOME_SHARD}/"),
            }),
            Arc::new(MemBindingCopy {
                log: entity_copy,
                prefix: "sys/tiers/".into(),
            }),
        );
        Some(CoordParts {
            cluster: parts,
            bindings,
        })
    }

    /// The log a session lives in: the coord tier's for an id with the
    /// coord bit, when the run has one; the lock cluster's.
    pub(crate) fn session_log(&self, session: i64) -> &Arc<IdLog> {
        match &self.coord {
            Some(coord) if session & latchkey_arbiter::tiers::COORD_SESSION_BIT != 0 => {
                &coord.idlog
            }
            _ => &self.idlog,
        }
    }

    /// Where `key` is held, for a hold of `session` granted with `token`:
    /// a coord session's holds are in the coord tier's log; an entity
    /// session's hold of a coord key is on the lock cluster (its namespace
    /// bound to the entity tier, [`SimConfig::coord_rollout`]); any other
    /// as [`Self::idlog_of_grant`] says.
    pub(crate) fn idlog_of_hold(&self, key: &str, token: u64, session: Option<i64>) -> &Arc<IdLog> {
        match (&self.coord, session) {
            (Some(coord), Some(id)) if id & latchkey_arbiter::tiers::COORD_SESSION_BIT != 0 => {
                &coord.idlog
            }
            (Some(_), Some(_)) if self.is_coord_key(key) => &self.idlog,
            _ => self.idlog_of_grant(key, token),
        }
    }

    /// Whether a coord key's namespace is bound to the coord tier, or not
    /// bound yet, as the coord tier's copy of the bindings says now.
    pub(crate) fn bound_to_coord(&self, coord: &CoordLog) -> bool {
        let key = format!(
            "sys/tiers/{HOME_SHARD}/{}",
            super::policies::COORD_NAMESPACE
        );
        coord.memlog.stored(&key).map(|kv| kv.value).as_deref() != Some(b"entity".as_slice())
    }

    /// Whether `key` is a coord key (in the namespace the coord-tier class
    /// names; served by the coord tier's cluster unless bound elsewhere).
    pub(crate) fn is_coord_key(&self, key: &str) -> bool {
        self.coord.is_some()
            && self
                .cfg
                .key_number(key)
                .is_some_and(|n| self.cfg.is_coord_key(n as u64))
    }
}
