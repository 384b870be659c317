//! Routing entity keys to their home shard by the shard map this arbiter
//! follows (ADR-09).
//!
//! Every arbiter with a coord cluster follows the map with a watch and keeps
//! one [`Cluster`] per shard it names (its own log, seal, witness, hold
//! count, quorum probe). The arbiter's own lock cluster (`--etcd`, named by
//! `--lock-cluster-name`) is the shard of that name, and it keeps the
//! sessions: a session is opened there, and a key homed on another shard
//! is held on a *shadow* of the session there (the same id and TTL, renewed
//! with it; `service/shadow.rs`).
//!
//! **A route carries the map version it was made by.** A move fences its
//! source clusters at the new version first (the map fence, compared in
//! every grant transaction), so a grant routed by an older map is refused
//! there whatever this arbiter has learnt since: the table compares the
//! cluster's fence with the route's version, not with the newest map.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::RwLock;
use tokio::sync::watch;
use tokio_util::task::AbortOnDrop;
use tracing::{info, warn};

use super::{Shard, ShardMap, ShardMaps, range_of};
use crate::RunError;
use crate::error::ArbiterError;
use crate::table::MapVersion;
use crate::tiers::Cluster;

/// Connects to a shard's cluster (the arbiter's etcd credentials, its own
/// witness on the coord cluster, a state directory of its own).
pub trait Connect: Send + Sync + 'static {
    fn connect(&self, shard: Shard) -> BoxFuture<'static, Result<Arc<Cluster>, Box<RunError>>>;
}

/// Why [`ShardRouting::connect_now`] did not connect a shard.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The name is taken here (the lock cluster's, or another shard's at
    /// other endpoints).
    #[error("{0}")]
    Refused(String),
    /// The cluster could not be reached or set up; its error, chain and all.
    #[error(transparent)]
    Unreachable(Box<RunError>),
}

/// Where an entity key is served, and by which map version.
#[derive(Clone)]
pub struct Route {
    pub cluster: Arc<Cluster>,
    /// The shard's name (the home cluster's name before any map).
    pub shard: String,
    /// The map version the route was made by (0: no map).
    pub version: u64,
}

#[derive(Default)]
struct Routed {
    map: Option<Arc<ShardMap>>,
    /// Connected shards other than the home cluster.
    clusters: BTreeMap<String, Arc<Cluster>>,
    /// The endpoints each was connected at: a name is one cluster.
    endpoints: BTreeMap<String, Vec<String>>,
}

/// The entity tier's shards as this arbiter sees them.
pub struct ShardRouting {
    home_name: String,
    home_endpoints: Vec<String>,
    home: Arc<Cluster>,
    connect: Arc<dyn Connect>,
    store: Arc<dyn ShardMaps>,
    routed: RwLock<Routed>,
    /// The version routed by, for whoever waits for the map to move on.
    version: watch::Sender<u64>,
    /// The same, as every entity table checks it (a table refuses to grant
    /// on a cluster fenced at a newer map than this).
    tables_version: MapVersion,
}

impl ShardRouting {
    pub fn new(
        home_name: &str,
        home_endpoints: Vec<String>,
        home: Arc<Cluster>,
        store: Arc<dyn ShardMaps>,
        connect: Arc<dyn Connect>,
        tables_version: MapVersion,
    ) -> Self {
        Self {
            home_name: home_name.to_string(),
            home_endpoints,
            home,
            connect,
            store,
            routed: RwLock::new(Routed::default()),
            version: watch::channel(0).0,
            tables_version,
        }
    }

    pub fn store(&self) -> &Arc<dyn ShardMaps> {
        &self.store
    }

    pub fn home_name(&self) -> &str {
        &self.home_name
    }

    pub fn home(&self) -> &Arc<Cluster> {
        &self.home
    }

    /// The home cluster as the first shard of the first map.
    pub fn home_shard(&self) -> Shard {
        Shard {
            name: self.home_name.clone(),
            endpoints: self.home_endpoints.clone(),
            weight: 1,
        }
    }

    /// Connects `shard` now (an operator adding it: a cluster that cannot
    /// be reached is refused before any map names it).
    pub async fn connect_now(&self, shard: &Shard) -> Result<Arc<Cluster>, ConnectError> {
        if shard.name == self.home_name {
            return Err(ConnectError::Refused(format!(
                "{:?} is the lock cluster's name",
                shard.name
            )));
        }
        {
            let routed = self.routed.read();
            if let Some(cluster) = routed.clusters.get(&shard.name) {
                return match routed.endpoints.get(&shard.name) == Some(&shard.endpoints) {
                    true => Ok(cluster.clone()),
                    false => Err(ConnectError::Refused(format!(
                        "a shard named {:?} is connected here at other endpoints",
                        shard.name
                    ))),
                };
            }
        }
        let cluster = self
            .connect
            .connect(shard.clone())
            .await
            .map_err(ConnectError::Unreachable)?;
        let mut routed = self.routed.write();
        // Another call may have connected the name meanwhile: one cluster
        // per name, and only at the endpoints it was connected at.
        if let Some(existing) = routed.clusters.get(&shard.name) {
            return match routed.endpoints.get(&shard.name) == Some(&shard.endpoints) {
                true => Ok(existing.clone()),
                false => Err(ConnectError::Refused(format!(
                    "a shard named {:?} was connected here at other endpoints meanwhile",
                    shard.name
                ))),
            };
        }
        routed
            .endpoints
            .insert(shard.name.clone(), shard.endpoints.clone());
        routed.clusters.insert(shard.name.clone(), cluster.clone());
        Ok(cluster)
    }

    /// Drops a connection the map does not name (a refused addition).
    pub fn forget(&self, name: &str) {
        let mut routed = self.routed.write();
        let named = routed.map.as_ref().is_some_and(|m| m.shard(name).is_some());
        if !named {
            routed.clusters.remove(name);
            routed.endpoints.remove(name);
        }
    }

    /// The map routed by (`None`: none published yet).
    pub fn map(&self) -> Option<Arc<ShardMap>> {
        self.routed.read().map.clone()
    }

    /// The map version routed by (0: none).
    pub fn version(&self) -> u64 {
        *self.version.borrow()
    }

    /// Waits until the map routed by is at least `version`, or `timeout`.
    pub async fn wait_for(&self, version: u64, timeout: Duration) -> bool {
        let mut rx = self.version.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|v| *v >= version))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// The connected shards other than the home cluster.
    pub fn others(&self) -> Vec<Arc<Cluster>> {
        self.routed.read().clusters.values().cloned().collect()
    }

    /// The names of every shard the map names (its move's new ones
    /// included) other than the home cluster, connected or not.
    pub fn other_names(&self) -> Vec<String> {
        let routed = self.routed.read();
        let mut names: std::collections::BTreeSet<String> =
            routed.clusters.keys().cloned().collect();
        if let Some(map) = &routed.map {
            names.extend(map.all_shards().map(|s| s.name.clone()));
        }
        names.remove(&self.home_name);
        names.into_iter().collect()
    }

    /// A shard's cluster by name, if connected.
    pub fn cluster(&self, name: &str) -> Option<Arc<Cluster>> {
        match name == self.home_name {
            true => Some(self.home.clone()),
            false => self.routed.read().clusters.get(name).cloned(),
        }
    }

    /// Where `key` is held now (Release, Inspect, force-release): its home
    /// by the map, moving or not.
    pub fn holding(&self, key: &str) -> Result<Route, ArbiterError> {
        self.route_in(key, false)
    }

    /// Where `key` may be granted (Acquire): its home by the map, unless its
    /// range is moving.
    pub fn granting(&self, key: &str) -> Result<Route, ArbiterError> {
        self.route_in(key, true)
    }

    fn route_in(&self, key: &str, granting: bool) -> Result<Route, ArbiterError> {
        let routed = self.routed.read();
        let Some(map) = &routed.map else {
            return Ok(Route {
                cluster: self.home.clone(),
                shard: self.home_name.clone(),
                version: 0,
            });
        };
        let shard = &map.home(key).name;
        if granting && map.is_moving(key) {
            let to = map.target().map(|t| t.home(key).name.clone());
            return Err(ArbiterError::RangeMoving(format!(
                "range {:?} is moving from shard {shard:?} to shard {:?} (shard map version {}): it takes no new grants until its holds there end and the move finishes; retry",
                range_of(key),
                to.unwrap_or_default(),
                map.version
            )));
        }
        let cluster = match shard == &self.home_name {
            true => self.home.clone(),
            false => routed.clusters.get(shard).cloned().ok_or_else(|| {
                ArbiterError::store(format!(
                    "shard {shard:?}, the home of key {key:?} in shard map version {}, is not connected to this arbiter yet",
                    map.version
                ))
            })?,
        };
        Ok(Route {
            cluster,
            shard: shard.clone(),
            version: map.version,
        })
    }

    /// Adopts `map`: connects every shard it names that is not connected
    /// yet, then routes by it. A shard that cannot be reached is tried
    /// again on the next round; its keys are unavailable meanwhile.
    async fn adopt(&self, map: ShardMap, connect: &dyn Connect) -> bool {
        let mut complete = true;
        let missing: Vec<Shard> = {
            let mut routed = self.routed.write();
            // A name connected at other endpoints than the map says is not
            // that shard: dropped, and connected again as the map says.
            let stale: Vec<String> = map
                .all_shards()
                .filter(|s| {
                    routed
                        .endpoints
                        .get(&s.name)
                        .is_some_and(|e| *e != s.endpoints)
                })
                .map(|s| s.name.clone())
                .collect();
            for name in stale {
                warn!(shard = %name, "connected at other endpoints than the shard map says; reconnecting");
                routed.clusters.remove(&name);
                routed.endpoints.remove(&name);
            }
            // A connection the map no longer names (a cancelled addition,
            // which never homed a range) is dropped.
            let unnamed: Vec<String> = routed
                .clusters
                .keys()
                .filter(|n| map.shard(n).is_none())
                .cloned()
                .collect();
            for name in unnamed {
                info!(shard = %name, "no longer in the shard map; disconnecting");
                routed.clusters.remove(&name);
                routed.endpoints.remove(&name);
            }
            map.all_shards()
                .filter(|s| s.name != self.home_name && !routed.clusters.contains_key(&s.name))
                .cloned()
                .collect()
        };
        let mut connected = Vec::new();
        for shard in missing {
            let (name, endpoints) = (shard.name.clone(), shard.endpoints.clone());
            match connect.connect(shard).await {
                Ok(cluster) => {
                    info!(shard = %name, "connected to an entity shard");
                    connected.push((name, endpoints, cluster));
                }
                Err(e) => {
                    complete = false;
                    // As an error, so the log shows its sources: the
                    // message of an unreachable etcd does not say why.
                    let error: &dyn std::error::Error = &*e;
                    warn!(shard = %name, error, "cannot connect to an entity shard; its keys are unavailable until it can be");
                }
            }
        }
        let version = map.version;
        {
            let mut routed = self.routed.write();
            for (name, endpoints, cluster) in connected {
                routed.endpoints.insert(name.clone(), endpoints);
                routed.clusters.insert(name, cluster);
            }
            if routed.map.as_ref().is_none_or(|m| m.version <= version) {
                routed.map = Some(Arc::new(map));
                self.tables_version.set(version);
            }
        }
        self.version.send_if_modified(|v| {
            let newer = *v < version;
            if newer {
                *v = version;
            }
            newer
        });
        complete
    }

    /// Follows the map on the coord cluster, adopting each version.
    pub fn follow(self: &Arc<Self>) -> AbortOnDrop {
        let connect = self.connect.clone();
        let (tx, mut rx) = watch::channel(None);
        let store = self.store.clone();
        let reader = tokio::spawn(async move { store.follow(tx).await });
        let this = self.clone();
        let adopter = tokio::spawn(async move {
            let _reader = AbortOnDrop::new(reader.abort_handle());
            loop {
                let map = rx.borrow_and_update().clone();
                let complete = match map {
                    Some(map) => this.adopt(map, connect.as_ref()).await,
                    None => true,
                };
                let retry = async {
                    match complete {
                        true => std::future::pending().await,
                        false => tokio::time::sleep(Duration::from_secs(2)).await,
                    }
                };
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    () = retry => {}
                }
            }
        });
        AbortOnDrop::new(adopter.abort_handle())
    }

    /// Reads the map once and adopts it (at start, before serving).
    pub async fn load(&self) -> Result<(), crate::lock_log::StoreError> {
        if let Some((map, _)) = self.store.load().await? {
            self.adopt(map, self.connect.as_ref()).await;
        }
        Ok(())
    }
}
