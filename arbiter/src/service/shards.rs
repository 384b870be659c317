//! admin.v1 shard calls (ADR-09): the shard map's status, a change of it,
//! and the steps of a move.
//!
//! A move goes from map v to map v+2 through v+1, and every step can be
//! run again by any arbiter, from the map's state alone:
//!
//! 1. **Publish v+1**: the homes of v, plus the map they move to. Arbiters
//!    that see it refuse new grants in the ranges whose home changes
//!    (`RANGE_MOVING`).
//! 2. **Fence every old shard at v+1** (the map fence, compared in every
//!    grant transaction): from then on no arbiter still routing by v can
//!    grant anything there, whatever it believes.
//! 3. **Wait** until no old shard holds anything in a moving range
//!    (released, or expired: at most the longest class TTL).
//! 4. **Raise each destination's epoch** above every old shard's, on the
//!    coord cluster's witness of that shard: every token it issues is then
//!    above every token the sources issued (epoch × 2^48 dominates any
//!    revision). A new shard holds nothing, so the advance costs nothing;
//!    an existing one loses its holds, so that needs the operator's
//!    `allow_ending_holds`.
//! 5. **Publish v+2**, the new homes; fence every shard at v+2.

use std::collections::BTreeSet;
use std::sync::Arc;

use latchkey_policies::LockKey;
use latchkey_proto::adminv1::{
    ChangeShardsRequest, GetShardsRequest, ShardInfo, ShardMove, ShardStatus, StepShardMoveRequest,
    change_shards_request::Change,
};
use tonic::Request;
use tracing::{info, warn};

use super::Arbiter;
use crate::error::ArbiterError;
use crate::records::now_unix_ms;
use crate::shards::PublishError;
use crate::shards::routing::{ConnectError, ShardRouting};
use crate::shards::{Move, Shard, ShardMap};
use crate::tiers::Cluster;

/// How long a step waits for this arbiter to adopt the map it published.
const ADOPT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Arbiter {
    pub async fn get_shards(
        &self,
        request: Request<GetShardsRequest>,
    ) -> Result<ShardStatus, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        let routing = self.routing()?;
        let map = routing.store().load().await?.map(|(m, _)| m);
        Ok(status(routing, map.as_ref(), "").await)
    }

    /// The shard map and each shard's state (the console's System page);
    /// `None`: the entity tier is not sharded.
    pub(crate) async fn shard_status(&self) -> Result<Option<ShardStatus>, ArbiterError> {
        let Some(routing) = self.tiers.shards() else {
            return Ok(None);
        };
        let map = routing.store().load().await?.map(|(m, _)| m);
        Ok(Some(status(routing, map.as_ref(), "").await))
    }

    pub async fn change_shards(
        &self,
        request: Request<ChangeShardsRequest>,
    ) -> Result<ShardStatus, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        let routing = self.routing()?;
        let req = request.into_inner();
        let reason = req.reason.trim();
        if reason.is_empty() || reason.len() > 512 {
            return Err(ArbiterError::BadRequest(
                "a change of the shard map needs a reason (1..=512 bytes): it is kept in the map while the move runs and logged".into(),
            ));
        }
        let Some(change) = req.change else {
            return Err(ArbiterError::BadRequest(
                "name a change: add a shard, or pin a namespace to a shard".into(),
            ));
        };
        let loaded = routing.store().load().await?;
        let (current, read_at) = match &loaded {
            Some((map, rev)) => (map.clone(), Some(*rev)),
            None => (
                ShardMap {
                    version: 0,
                    shards: vec![routing.home_shard()],
                    overrides: Default::default(),
                    moving: None,
                },
                None,
            ),
        };
        if let Change::Cancel(_) = change {
            let Some(m) = &current.moving else {
                return Err(ArbiterError::BadRequest(
                    "no move is under way to cancel".into(),
                ));
            };
            // The next version with the current homes: no range changes
            // home, and no destination has served a moving range yet.
            let next = ShardMap {
                version: current.version + 1,
                moving: None,
                ..current.clone()
            };
            not_behind(routing, &current, next.version).await?;
            publish_result(
                routing
                    .store()
                    .publish(Some(&current), read_at, &next)
                    .await,
            )?;
            warn!(operator = %caller.identity, version = next.version, reason, moved = %m.reason, "shard move cancelled");
            return Ok(status(routing, Some(&next), "").await);
        }
        if let Some(m) = &current.moving {
            return Err(ArbiterError::BadRequest(format!(
                "a move is already under way (shard map version {}, reason {:?}): finish it (`latchctl admin shards step`) or cancel it (`latchctl admin shards cancel`), then change the map again",
                current.version, m.reason
            )));
        }
        let (mut shards, mut overrides) = (current.shards.clone(), current.overrides.clone());
        let mut added = None;
        match change {
            Change::Add(add) => {
                let shard = Shard {
                    name: add.name.trim().to_string(),
                    endpoints: add.endpoints.iter().map(|e| e.trim().to_string()).collect(),
                    weight: if add.weight == 0 { 1 } else { add.weight },
                };
                check_endpoints(&shard.endpoints)?;
                if current.shards.iter().any(|s| s.name == shard.name) {
                    return Err(ArbiterError::BadRequest(format!(
                        "the shard map already has a shard named {:?}",
                        shard.name
                    )));
                }
                if let Some(s) = current
                    .shards
                    .iter()
                    .find(|s| s.endpoints.iter().any(|e| shard.endpoints.contains(e)))
                {
                    return Err(ArbiterError::BadRequest(format!(
                        "shard {:?} already uses one of these endpoints: a shard is its own etcd cluster",
                        s.name
                    )));
                }
                shards.push(shard.clone());
                check_alone(&shards, &overrides)?;
                // Reach it before any map names it, and make sure it is not
                // one of the shards already there, nor the coord cluster,
                // under another address.
                let cluster = routing.connect_now(&shard).await.map_err(|e| {
                    let detail = format!("cannot reach the new shard {:?}: {e}", shard.name);
                    match e {
                        ConnectError::Refused(_) => ArbiterError::store(detail),
                        unreachable => ArbiterError::store_caused(detail, unreachable),
                    }
                })?;
                let distinct = self
                    .distinct_cluster(routing, &current, &shard.name, &cluster)
                    .await;
                if distinct.is_err() {
                    routing.forget(&shard.name);
                }
                distinct?;
                added = Some(shard.name.clone());
            }
            Change::Cancel(_) => unreachable!("answered above"),
            Change::Pin(pin) => {
                let namespace = pin.namespace.trim();
                let valid = LockKey::parse(namespace).is_ok_and(|k| k.namespace() == namespace);
                if !valid {
                    return Err(ArbiterError::BadRequest(format!(
                        "{namespace:?} is not a namespace (a lock key's first segment)"
                    )));
                }
                if !current.shards.iter().any(|s| s.name == pin.shard) {
                    return Err(ArbiterError::BadRequest(format!(
                        "the shard map has no shard named {:?}",
                        pin.shard
                    )));
                }
                overrides.insert(namespace.to_string(), pin.shard.clone());
            }
        }
        let next = ShardMap {
            version: current.version + 1,
            shards: current.shards.clone(),
            overrides: current.overrides.clone(),
            moving: Some(Move {
                shards,
                overrides,
                reason: reason.to_string(),
                started_at_unix_ms: now_unix_ms(),
            }),
        };
        let behind = not_behind(routing, &current, next.version).await;
        if let (Err(_), Some(name)) = (&behind, &added) {
            routing.forget(name);
        }
        behind?;
        let published = routing
            .store()
            .publish(loaded.as_ref().map(|(m, _)| m), read_at, &next)
            .await;
        if let (Err(_), Some(name)) = (&published, &added) {
            routing.forget(name);
        }
        publish_result(published)?;
        warn!(operator = %caller.identity, version = next.version, reason, "shard move started: the moving ranges take no new grants until it ends");
        self.step(routing, &next, false).await
    }

    pub async fn step_shard_move(
        &self,
        request: Request<StepShardMoveRequest>,
    ) -> Result<ShardStatus, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        let routing = self.routing()?;
        let allow = request.get_ref().allow_ending_holds;
        let Some((map, _)) = routing.store().load().await? else {
            return Ok(status(routing, None, "").await);
        };
        self.step(routing, &map, allow).await
    }

    /// Refuses a new shard that is one of the map's shards, or the coord
    /// cluster, under another address (compared by etcd cluster id).
    async fn distinct_cluster(
        &self,
        routing: &ShardRouting,
        current: &ShardMap,
        name: &str,
        cluster: &Cluster,
    ) -> Result<(), ArbiterError> {
        let id = cluster.table.current_cluster_id().await?;
        if routing.store().cluster_id().await? == id {
            return Err(ArbiterError::BadRequest(format!(
                "the new shard {name:?} is the coord cluster (id {id:#x}): shards are etcd clusters of their own"
            )));
        }
        for s in &current.shards {
            let Some(c) = routing.cluster(&s.name) else {
                return Err(ArbiterError::store(format!(
                    "shard {:?} is not connected to this arbiter, so the new shard cannot be told apart from it; retry when it is",
                    s.name
                )));
            };
            if c.table.current_cluster_id().await? == id {
                return Err(ArbiterError::BadRequest(format!(
                    "the new shard {name:?} is the same etcd cluster (id {id:#x}) as shard {:?}",
                    s.name
                )));
            }
        }
        Ok(())
    }

    fn routing(&self) -> Result<&Arc<ShardRouting>, ArbiterError> {
        self.tiers.shards().ok_or_else(|| {
            ArbiterError::BadRequest(
                "entity shards need a coord cluster (--coord-etcd), where the shard map lives"
                    .into(),
            )
        })
    }

    /// Takes the move under way in `map` as far as it can go now.
    async fn step(
        &self,
        routing: &Arc<ShardRouting>,
        map: &ShardMap,
        allow_ending_holds: bool,
    ) -> Result<ShardStatus, ArbiterError> {
        let Some(target) = map.target() else {
            return Ok(status(routing, Some(map), "").await);
        };
        // Connected to every shard the move names.
        if !routing.wait_for(map.version, ADOPT_WAIT).await {
            return Err(ArbiterError::store(format!(
                "this arbiter has not adopted shard map version {} yet (is every shard reachable?); step again",
                map.version
            )));
        }
        let mut sources = Vec::new();
        for shard in &map.shards {
            let cluster = connected(routing, &shard.name)?;
            // Step 2: fenced, so no arbiter on an older map grants there.
            cluster.table.log().raise_map_fence(map.version).await?;
            sources.push((shard.name.clone(), cluster));
        }
        // Step 3: nothing held in a moving range on its old shard.
        for (name, cluster) in &sources {
            let (count, first) = moving_holds(cluster, map).await?;
            if let Some(first) = first {
                let detail = format!(
                    "waiting for {count} hold(s) in moving ranges on shard {name:?} to end (released, or their sessions ended), e.g. key {first:?}; step again, or cancel the move"
                );
                return Ok(status(routing, Some(map), &detail).await);
            }
        }
        // Step 4: every destination's epoch above every other source's. A
        // sealed source's epoch says nothing of the tokens it issued before
        // its restore: it is advanced first.
        let mut epochs = Vec::new();
        for (name, cluster) in &sources {
            let epoch = cluster.table.seal().load_epoch().await?.epoch();
            cluster.table.seal().guard().serving().map_err(|_| {
                ArbiterError::BadRequest(format!(
                    "shard {name:?} is sealed: advance its epoch (latchctl admin advance-epoch) before the move can go on"
                ))
            })?;
            epochs.push((name.clone(), epoch));
        }
        for name in destinations(map, &target) {
            // An advance ends holds: only for the move still under way (a
            // cancel, or another arbiter's step 5, may have come since).
            let still = routing.store().load().await?.map(|(m, _)| m);
            if still.as_ref() != Some(map) {
                return Ok(status(routing, still.as_ref(), "").await);
            }
            let floor = epochs
                .iter()
                .filter(|(n, _)| *n != name)
                .map(|(_, e)| *e)
                .max()
                .unwrap_or(0);
            let new = !map.shards.iter().any(|s| s.name == name);
            let cluster = connected(routing, &name)?;
            if let Some(detail) =
                raise_above(&cluster, &name, floor, new || allow_ending_holds).await?
            {
                return Ok(status(routing, Some(map), &detail).await);
            }
        }
        // Step 5: the new homes.
        let (now, read_at) = routing
            .store()
            .load()
            .await?
            .ok_or_else(|| ArbiterError::internal("the shard map disappeared"))?;
        if now.version != map.version {
            return Ok(status(routing, Some(&now), "").await);
        }
        not_behind(routing, &now, target.version).await?;
        publish_result(
            routing
                .store()
                .publish(Some(&now), Some(read_at), &target)
                .await,
        )?;
        info!(
            version = target.version,
            "shard move finished: the moved ranges are served from their new homes"
        );
        for shard in &target.shards {
            if let Some(cluster) = routing.cluster(&shard.name)
                && let Err(e) = cluster.table.log().raise_map_fence(target.version).await
            {
                warn!(shard = %shard.name, error = %e, "could not fence a shard at the new map version (arbiters on the older map are fenced at the next move)");
            }
        }
        Ok(status(routing, Some(&target), "").await)
    }
}

/// Endpoints an operator typed: 1 to 8 http(s) URLs of a sensible length.
fn check_endpoints(endpoints: &[String]) -> Result<(), ArbiterError> {
    if endpoints.is_empty() || endpoints.len() > 8 {
        return Err(ArbiterError::BadRequest(
            "a shard needs 1 to 8 etcd client URLs".into(),
        ));
    }
    for e in endpoints {
        let url = e
            .strip_prefix("https://")
            .or_else(|| e.strip_prefix("http://"));
        let ok = url.is_some_and(|rest| {
            !rest.is_empty()
                && e.len() <= 256
                && rest
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._:[]/".contains(c))
        });
        if !ok {
            return Err(ArbiterError::BadRequest(format!(
                "{e:?} is not an etcd client URL (http:// or https://, host and port)"
            )));
        }
    }
    Ok(())
}

fn check_alone(
    shards: &[Shard],
    overrides: &std::collections::BTreeMap<String, String>,
) -> Result<(), ArbiterError> {
    ShardMap {
        version: 1,
        shards: shards.to_vec(),
        overrides: overrides.clone(),
        moving: None,
    }
    .check()
    .map_err(|e| ArbiterError::BadRequest(e.to_string()))
}

/// Refuses to publish map `version` when a shard of `map` is already
/// fenced at it or above: a map of that version was published before, and
/// the coord cluster's copy went back (a restore). Publishing another map
/// under the same version would let arbiters follow two different maps
/// that pass the same fences.
async fn not_behind(
    routing: &ShardRouting,
    map: &ShardMap,
    version: u64,
) -> Result<(), ArbiterError> {
    for shard in map.all_shards() {
        let Some(cluster) = routing.cluster(&shard.name) else {
            continue;
        };
        let (fence, _) = cluster
            .table
            .seal()
            .checked(cluster.table.log().map_fence())
            .await?;
        let fenced = fence
            .and_then(|kv| crate::records::decode_map_fence(&kv.value))
            .unwrap_or(0);
        if fenced >= version {
            return Err(ArbiterError::BadRequest(format!(
                "shard {:?} is fenced at shard map version {fenced}, at or above the version this change would publish ({version}): the coord cluster's shard map is older than one the shards have seen (was it restored?); publish a map above version {fenced} by hand before changing it (docs/tiers-and-shards.md)",
                shard.name
            )));
        }
    }
    Ok(())
}

fn publish_result(result: Result<(), PublishError>) -> Result<(), ArbiterError> {
    result.map_err(|e| match e {
        PublishError::Invalid(e) => ArbiterError::BadRequest(e.to_string()),
        PublishError::Raced { current } => ArbiterError::BadRequest(format!(
            "the shard map changed meanwhile (now version {current}): read the status and try again"
        )),
        PublishError::Store(e) => e.into(),
    })
}

fn connected(routing: &ShardRouting, name: &str) -> Result<Arc<Cluster>, ArbiterError> {
    routing.cluster(name).ok_or_else(|| {
        ArbiterError::store(format!(
            "shard {name:?} is not connected to this arbiter; step again once it is reachable"
        ))
    })
}

/// The shards that may gain ranges in `target`: the new ones, and those a
/// new or changed override names.
fn destinations(map: &ShardMap, target: &ShardMap) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = target
        .shards
        .iter()
        .filter(|s| !map.shards.iter().any(|c| c.name == s.name))
        .map(|s| s.name.clone())
        .collect();
    for (namespace, shard) in &target.overrides {
        if map.overrides.get(namespace) != Some(shard) {
            names.insert(shard.clone());
        }
    }
    names
}

/// Makes `cluster`'s epoch greater than `floor`. `Some(why not)` when that
/// needs an advance and the operator has not allowed it: an advance ends
/// every hold on the shard, and a shard that serves ranges may take a hold
/// between any check and the advance, so only a shard new in this move
/// (which homes no range yet) is advanced without the operator's say.
async fn raise_above(
    cluster: &Cluster,
    name: &str,
    floor: u32,
    allowed: bool,
) -> Result<Option<String>, ArbiterError> {
    let seal = cluster.table.seal();
    for _ in 0..3 {
        let now = seal.load_epoch().await?.epoch();
        if now > floor {
            return Ok(None);
        }
        seal.guard().serving()?;
        if !allowed {
            return Ok(Some(format!(
                "shard {name:?}'s epoch ({now}) must be raised above the other shards' ({floor}) before it takes the moving ranges, and that ends every hold on it: step again with --allow-ending-holds"
            )));
        }
        let reason =
            format!("shard {name:?}'s epoch raised above its sources' ({floor}) for a shard move");
        match seal.advance_epoch_at_least(now, &reason, floor + 1).await {
            Ok((record, deleted)) => {
                warn!(
                    shard = name,
                    epoch = record.epoch,
                    holds_deleted = deleted,
                    "shard's epoch raised for a move"
                );
            }
            // Another arbiter advanced it first: read again.
            Err(ArbiterError::BadRequest(_) | ArbiterError::Sealed { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Err(ArbiterError::store(format!(
        "shard {name:?}'s epoch kept changing while it was raised; step again"
    )))
}

/// Keys read per page when scanning a shard's holds.
const SCAN_PAGE: usize = 1_000;

/// How many of `cluster`'s holds are in ranges `map` is moving, and the
/// first of them: a keys-only scan in pages, so a shard with any number of
/// holds can be scanned.
async fn moving_holds(
    cluster: &Cluster,
    map: &ShardMap,
) -> Result<(i64, Option<String>), ArbiterError> {
    let (mut count, mut first) = (0, None);
    let mut after: Option<String> = None;
    loop {
        let (page, _) = cluster
            .table
            .seal()
            .checked(
                cluster
                    .table
                    .log()
                    .held_keys_page(after.as_deref(), SCAN_PAGE),
            )
            .await?;
        let Some(last) = page.last().cloned() else {
            break;
        };
        for key in page.into_iter().filter(|k| map.is_moving(k)) {
            count += 1;
            first.get_or_insert(key);
        }
        after = Some(last);
    }
    Ok((count, first))
}

/// The shard map and each shard as this arbiter reads them now.
async fn status(routing: &ShardRouting, map: Option<&ShardMap>, detail: &str) -> ShardStatus {
    let Some(map) = map else {
        return ShardStatus {
            version: 0,
            shards: vec![info(routing, &routing.home_shard(), None).await],
            overrides: Default::default(),
            r#move: None,
        };
    };
    let mut shards = Vec::new();
    for shard in &map.shards {
        shards.push(info(routing, shard, Some(map)).await);
    }
    let r#move = match &map.moving {
        None => None,
        Some(m) => {
            let mut next_shards = Vec::new();
            for shard in &m.shards {
                next_shards.push(info(routing, shard, None).await);
            }
            Some(ShardMove {
                next_shards,
                next_overrides: m.overrides.clone().into_iter().collect(),
                phase: "draining".into(),
                detail: detail.to_string(),
                reason: m.reason.clone(),
                started_at_unix_ms: m.started_at_unix_ms,
            })
        }
    };
    ShardStatus {
        version: map.version,
        shards,
        overrides: map.overrides.clone().into_iter().collect(),
        r#move,
    }
}

async fn info(routing: &ShardRouting, shard: &Shard, map: Option<&ShardMap>) -> ShardInfo {
    let mut out = ShardInfo {
        name: shard.name.clone(),
        endpoints: shard.endpoints.clone(),
        weight: shard.weight,
        ..ShardInfo::default()
    };
    let Some(cluster) = routing.cluster(&shard.name) else {
        out.error = "not connected to this arbiter".into();
        return out;
    };
    let table = &cluster.table;
    let read = async {
        let state = table.seal().load_epoch().await?;
        let (holds, _) = table.seal().checked(table.log().count_holds()).await?;
        let moving = match map {
            Some(m) if m.moving.is_some() => moving_holds(&cluster, m).await?.0,
            _ => 0,
        };
        Ok::<_, ArbiterError>((state, holds, moving))
    };
    match read.await {
        Ok((state, holds, moving)) => {
            out.epoch = state.epoch();
            out.fence_version = state.fence_version;
            out.holds = holds;
            out.moving_holds = moving;
        }
        Err(e) => out.error = e.to_string(),
    }
    out.sealed = table.seal().guard().seal_reason().is_some();
    out
}
