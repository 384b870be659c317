//! Entity shards (ADR-09): which etcd cluster of the entity tier is a key's
//! home, by rendezvous hashing over a versioned shard map.
//!
//! **The homing unit is a range**, not a key: the key's namespace and its
//! first path segment (`payments/orders/123` → `payments/orders`; a key of
//! two segments, `demo/x`, is in its namespace's range `demo`). Every key
//! of a range lives on one shard, so a move drains and moves whole ranges,
//! and a caller's keys under one prefix share a cluster (and its revision
//! space: their tokens compare).
//!
//! **Rendezvous hashing**: each shard scores each range with a stable
//! 64-bit hash of (shard name, range), weighted; the highest score is the
//! range's home. Adding a shard moves exactly the ranges whose highest
//! score becomes the new shard's, about 1/N of them, and never moves a
//! range between two old shards; removing one moves only its own ranges.
//! **Overrides** pin a whole namespace to a named shard (ADR-09's "manual
//! range assignment" for a tenant that wants its own cluster).
//!
//! The map is a versioned document (`version` goes up by one on every
//! change); arbiters compare versions, never contents. A move between
//! versions is fenced by the epoch of the destination (the move protocol,
//! not this module): [`ShardMap::moves_to`] lists what changes home.

pub mod etcd;
pub mod routing;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::lock_log::StoreError;

/// Where the shard map is kept and followed: one document, changed only by
/// a compare-and-swap on its revision. On the coord cluster in production
/// ([`etcd::ShardMapStore`]); in memory in the simulation.
#[async_trait::async_trait]
pub trait ShardMaps: Send + Sync + 'static {
    /// The id of the cluster keeping the map (a shard may not be it).
    async fn cluster_id(&self) -> Result<u64, StoreError>;

    /// The map and its revision; `None` before the first publish.
    async fn load(&self) -> Result<Option<(ShardMap, i64)>, StoreError>;

    /// Publishes `next` as the change that follows the map read at
    /// `read_at` (`None`: there was none, and `next` is version 1).
    /// Refused without writing if the map changed since, or if `next` does
    /// not follow the map as it is ([`check_publish`]).
    async fn publish(
        &self,
        current: Option<&ShardMap>,
        read_at: Option<i64>,
        next: &ShardMap,
    ) -> Result<(), PublishError>;

    /// Follows the map: `tx` gets every version as it lands (and the map
    /// as it is at the start, [`newer`]). Runs until `tx` has no receivers.
    async fn follow(&self, tx: watch::Sender<Option<ShardMap>>);
}

/// Why a change of the map was refused.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{0}")]
    Invalid(#[from] MapError),
    #[error(
        "the shard map changed since it was read (now version {current}): read it again and retry"
    )]
    Raced { current: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Whether `next` may follow `current` (`None`: no map yet, and `next` must
/// be version 1): what every [`ShardMaps::publish`] checks before it writes.
pub fn check_publish(current: Option<&ShardMap>, next: &ShardMap) -> Result<(), MapError> {
    match current {
        Some(map) => map.check_next(next),
        None if next.version != 1 => Err(MapError::Version {
            current: 0,
            next: next.version,
        }),
        None => next.check(),
    }
}

/// Sends `map` if it is newer than what `tx` holds: versions only go up.
pub fn newer(tx: &watch::Sender<Option<ShardMap>>, map: Option<ShardMap>) {
    let Some(map) = map else { return };
    tx.send_if_modified(|held| match held {
        Some(h) if h.version >= map.version => false,
        _ => {
            *held = Some(map);
            true
        }
    });
}

/// One etcd cluster of the entity tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Shard {
    /// A stable name (it is hashed: renaming a shard moves its ranges).
    pub name: String,
    /// Its etcd client URLs.
    pub endpoints: Vec<String>,
    /// Relative capacity, 1 to 100 (1 by default): a shard of weight 2
    /// homes about twice the ranges of a shard of weight 1.
    #[serde(default = "one")]
    pub weight: u32,
}

fn one() -> u32 {
    1
}

/// The shard map, as stored on the coord cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ShardMap {
    /// Goes up by one on every change.
    pub version: u64,
    pub shards: Vec<Shard>,
    /// Namespaces pinned to a shard by name.
    #[serde(default)]
    pub overrides: BTreeMap<String, String>,
    /// A move under way: the map it leads to. A range whose home differs
    /// there is *moving*: it takes no new grants until the move ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving: Option<Move>,
}

/// A change of the map under way (ADR-09): published as version v+1 with
/// the current homes still in force, finished as version v+2 with the
/// `shards` and `overrides` here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Move {
    pub shards: Vec<Shard>,
    #[serde(default)]
    pub overrides: BTreeMap<String, String>,
    /// The operator's reason, as given.
    pub reason: String,
    pub started_at_unix_ms: i64,
}

/// Why a shard map is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("a shard map needs at least one shard")]
    NoShards,
    #[error("shard name {0:?} is not valid: 1 to 63 characters, lowercase letters, digits and '-'")]
    BadName(String),
    #[error("shard {0:?} appears twice")]
    Duplicate(String),
    #[error("shard {name:?} has weight {weight}: weights are 1 to 100")]
    BadWeight { name: String, weight: u32 },
    #[error("shard {0:?} has no endpoints")]
    NoEndpoints(String),
    #[error("namespace {namespace:?} is pinned to shard {shard:?}, which the map does not have")]
    UnknownOverride { namespace: String, shard: String },
    #[error(
        "version {next} does not follow {current}: a change takes the next version (read the map again and retry)"
    )]
    Version { current: u64, next: u64 },
    #[error("the move under way would drop shard {0:?}: removing a shard is not supported")]
    DropsShard(String),
    #[error(
        "the move under way changes shard {0:?}'s endpoints or weight: a shard keeps both (a weight change would move ranges between old shards)"
    )]
    ChangesShard(String),
}

/// The range of `key` (its homing unit): the namespace and the first path
/// segment, or the namespace alone for a key of two segments. A semaphore
/// slot's key is in its semaphore's range: a slot lives, moves and drains
/// with the name its callers route by.
pub fn range_of(key: &str) -> &str {
    let key = crate::records::named_key(key);
    let mut cuts = key.match_indices('/').map(|(i, _)| i);
    match (cuts.next(), cuts.next()) {
        (Some(_), Some(second)) => &key[..second],
        (Some(first), None) => &key[..first],
        _ => key,
    }
}

fn namespace_of(range: &str) -> &str {
    range.split('/').next().unwrap_or(range)
}

/// A stable 64-bit hash of (shard, range): FNV-1a, then a finaliser
/// (splitmix64) so that names differing in one byte score independently.
fn score_hash(shard: &str, range: &str) -> u64 {
    use std::hash::Hasher as _;
    let mut h = fnv::FnvHasher::default();
    h.write(shard.as_bytes());
    h.write(&[0]);
    h.write(range.as_bytes());
    let mut x = h.finish();
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Weighted rendezvous score: `-weight / ln(u)` for `u` uniform in (0, 1)
/// (the logarithmic method), so shares follow the weights.
fn score(shard: &Shard, range: &str) -> f64 {
    // 53 bits into (0, 1): never 0, never 1.
    let u = ((score_hash(&shard.name, range) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    f64::from(shard.weight) / -u.ln()
}

/// The home of `range` among `shards` with `overrides` (a map that passed
/// [`ShardMap::check`]: at least one shard).
fn home_among<'s>(
    shards: &'s [Shard],
    overrides: &BTreeMap<String, String>,
    range: &str,
) -> &'s Shard {
    if let Some(pinned) = overrides.get(namespace_of(range))
        && let Some(shard) = shards.iter().find(|s| &s.name == pinned)
    {
        return shard;
    }
    let mut best = &shards[0];
    let mut best_score = f64::MIN;
    for shard in shards {
        let s = score(shard, range);
        // Ties (practically never) go to the smaller name: stable.
        if s > best_score || (s == best_score && shard.name < best.name) {
            best = shard;
            best_score = s;
        }
    }
    best
}

impl ShardMap {
    /// Checks a map on its own.
    pub fn check(&self) -> Result<(), MapError> {
        if self.shards.is_empty() {
            return Err(MapError::NoShards);
        }
        let mut names = BTreeSet::new();
        for s in &self.shards {
            let valid = !s.name.is_empty()
                && s.name.len() <= 63
                && s.name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !valid {
                return Err(MapError::BadName(s.name.clone()));
            }
            if !names.insert(s.name.as_str()) {
                return Err(MapError::Duplicate(s.name.clone()));
            }
            if !(1..=100).contains(&s.weight) {
                return Err(MapError::BadWeight {
                    name: s.name.clone(),
                    weight: s.weight,
                });
            }
            if s.endpoints.is_empty() {
                return Err(MapError::NoEndpoints(s.name.clone()));
            }
        }
        for (namespace, shard) in &self.overrides {
            if !names.contains(shard.as_str()) {
                return Err(MapError::UnknownOverride {
                    namespace: namespace.clone(),
                    shard: shard.clone(),
                });
            }
        }
        if let Some(target) = self.target() {
            target.check()?;
            for s in &self.shards {
                match target.shards.iter().find(|t| t.name == s.name) {
                    None => return Err(MapError::DropsShard(s.name.clone())),
                    Some(t) if t.endpoints != s.endpoints || t.weight != s.weight => {
                        return Err(MapError::ChangesShard(s.name.clone()));
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(())
    }

    /// The map a move under way leads to (the next version, with no move).
    pub fn target(&self) -> Option<ShardMap> {
        self.moving.as_ref().map(|m| ShardMap {
            version: self.version + 1,
            shards: m.shards.clone(),
            overrides: m.overrides.clone(),
            moving: None,
        })
    }

    /// Whether `key`'s range is moving to another shard (it takes no new
    /// grants until the move ends).
    pub fn is_moving(&self, key: &str) -> bool {
        let range = range_of(key);
        self.moving.as_ref().is_some_and(|m| {
            home_among(&m.shards, &m.overrides, range).name != self.home_of_range(range).name
        })
    }

    /// Every shard the map names, the move's new ones included.
    pub fn all_shards(&self) -> impl Iterator<Item = &Shard> {
        let new = self.moving.iter().flat_map(move |m| {
            m.shards
                .iter()
                .filter(move |s| !self.shards.iter().any(|c| c.name == s.name))
        });
        self.shards.iter().chain(new)
    }

    /// A shard of the map (or of its move) by name.
    pub fn shard(&self, name: &str) -> Option<&Shard> {
        self.all_shards().find(|s| s.name == name)
    }

    /// Checks `next` as the change that follows this map.
    pub fn check_next(&self, next: &ShardMap) -> Result<(), MapError> {
        if next.version != self.version + 1 {
            return Err(MapError::Version {
                current: self.version,
                next: next.version,
            });
        }
        next.check()
    }

    /// The home shard of `key` (a map that passed [`Self::check`]).
    pub fn home(&self, key: &str) -> &Shard {
        self.home_of_range(range_of(key))
    }

    /// The home shard of a range.
    pub fn home_of_range(&self, range: &str) -> &Shard {
        home_among(&self.shards, &self.overrides, range)
    }

    /// The ranges among `ranges` whose home differs in `next`, with their
    /// old and new shard names: what a move must drain and fence.
    pub fn moves_to<'r>(
        &self,
        next: &ShardMap,
        ranges: impl IntoIterator<Item = &'r str>,
    ) -> Vec<(&'r str, String, String)> {
        ranges
            .into_iter()
            .filter_map(|r| {
                let (from, to) = (&self.home_of_range(r).name, &next.home_of_range(r).name);
                (from != to).then(|| (r, from.clone(), to.clone()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(name: &str) -> Shard {
        Shard {
            name: name.into(),
            endpoints: vec![format!("https://{name}:2379")],
            weight: 1,
        }
    }

    fn map(version: u64, names: &[&str]) -> ShardMap {
        ShardMap {
            version,
            shards: names.iter().map(|n| shard(n)).collect(),
            overrides: BTreeMap::new(),
            moving: None,
        }
    }

    /// 100,000 keys over 5,000 ranges (50 namespaces × 100 first segments).
    fn keys() -> Vec<String> {
        (0..100_000)
            .map(|i| format!("ns{}/p{}/k{i}", i % 50, (i / 50) % 100))
            .collect()
    }

    #[test]
    fn a_range_is_the_namespace_and_the_first_path_segment() {
        assert_eq!(range_of("payments/orders/123"), "payments/orders");
        assert_eq!(range_of("payments/orders/123/lines/4"), "payments/orders");
        assert_eq!(range_of("demo/x"), "demo");
        assert_eq!(range_of("solo"), "solo");
        // a slot is in its semaphore's range (found by the hostile review:
        // "ns/a//s/0000" was in range "ns/a", so a move of "ns" did not
        // drain the slots of "ns/a")
        let slot = crate::records::slot_key("ns/a", 0);
        assert_eq!(range_of(&slot), "ns");
        assert_eq!(range_of(&crate::records::slot_key("solo", 3)), "solo");
        assert_eq!(range_of(&crate::records::slot_key("p/o/1", 3)), "p/o");
    }

    #[test]
    fn homing_is_stable_and_spreads_ranges() {
        let m = map(1, &["entity-a", "entity-b", "entity-c"]);
        m.check().unwrap();
        let mut counts = BTreeMap::new();
        for k in keys() {
            let home = &m.home(&k).name;
            // the same answer every time, and for every key of the range
            assert_eq!(home, &m.home(&k).name);
            assert_eq!(home, &m.home_of_range(range_of(&k)).name);
            *counts.entry(home.clone()).or_insert(0u32) += 1;
        }
        // each shard homes its third within a few percent
        for (name, n) in &counts {
            let share = f64::from(*n) / 100_000.0;
            assert!((0.28..0.39).contains(&share), "{name}: {share}");
        }
    }

    #[test]
    fn adding_a_fourth_shard_moves_about_a_quarter_and_only_to_it() {
        let three = map(1, &["entity-a", "entity-b", "entity-c"]);
        let four = map(2, &["entity-a", "entity-b", "entity-c", "entity-d"]);
        three.check_next(&four).unwrap();
        let keys = keys();
        let moved: Vec<_> = three.moves_to(&four, keys.iter().map(String::as_str));
        let fraction = moved.len() as f64 / keys.len() as f64;
        println!(
            "adding a fourth shard moved {} of {} keys ({:.1} %); expected about 25 %",
            moved.len(),
            keys.len(),
            fraction * 100.0
        );
        assert!((0.20..0.30).contains(&fraction), "{fraction}");
        assert!(moved.iter().all(|(_, _, to)| to == "entity-d"));
        // removing it again moves exactly those back
        let back = three.moves_to(&four, keys.iter().map(String::as_str)).len();
        let undo = four.moves_to(&three, keys.iter().map(String::as_str));
        assert_eq!(undo.len(), back);
        assert!(undo.iter().all(|(_, from, _)| from == "entity-d"));
    }

    #[test]
    fn weights_skew_the_shares() {
        let mut m = map(1, &["entity-a", "entity-b"]);
        m.shards[1].weight = 3;
        let on_b = keys()
            .iter()
            .filter(|k| m.home(k).name == "entity-b")
            .count();
        let share = on_b as f64 / 100_000.0;
        assert!((0.68..0.82).contains(&share), "{share}");
    }

    #[test]
    fn an_override_pins_a_namespace() {
        let mut m = map(1, &["entity-a", "entity-b", "entity-c"]);
        m.overrides.insert("ns7".into(), "entity-c".into());
        m.check().unwrap();
        for k in keys().iter().filter(|k| k.starts_with("ns7/")) {
            assert_eq!(m.home(k).name, "entity-c");
        }
        m.overrides.insert("ns8".into(), "entity-z".into());
        assert!(matches!(m.check(), Err(MapError::UnknownOverride { .. })));
    }

    #[test]
    fn bad_maps_and_versions_are_refused_with_reasons() {
        assert_eq!(map(1, &[]).check(), Err(MapError::NoShards));
        assert!(matches!(
            map(1, &["Bad_Name"]).check(),
            Err(MapError::BadName(_))
        ));
        assert!(matches!(
            map(1, &["a", "a"]).check(),
            Err(MapError::Duplicate(_))
        ));
        let mut m = map(1, &["a"]);
        m.shards[0].weight = 0;
        assert!(matches!(m.check(), Err(MapError::BadWeight { .. })));
        let mut m = map(1, &["a"]);
        m.shards[0].endpoints.clear();
        assert!(matches!(m.check(), Err(MapError::NoEndpoints(_))));
        let err = map(3, &["a"]).check_next(&map(5, &["a", "b"])).unwrap_err();
        assert!(err.to_string().contains("read the map again"), "{err}");
        // the stored form is camelCase and refuses unknown fields
        let json = r#"{"version":1,"shards":[{"name":"a","endpoints":["https://a:2379"]}]}"#;
        let parsed: ShardMap = serde_json::from_str(json).unwrap();
        assert_eq!(parsed.shards[0].weight, 1);
        let unknown = r#"{"version":1,"shards":[],"shardz":[]}"#;
        assert!(serde_json::from_str::<ShardMap>(unknown).is_err());
    }

    fn moving(from: &ShardMap, to: &ShardMap) -> ShardMap {
        ShardMap {
            version: from.version + 1,
            moving: Some(Move {
                shards: to.shards.clone(),
                overrides: to.overrides.clone(),
                reason: "grow".into(),
                started_at_unix_ms: 1,
            }),
            ..from.clone()
        }
    }

    #[test]
    fn a_move_routes_by_the_old_homes_and_marks_what_changes() {
        let three = map(1, &["a", "b", "c"]);
        let four = map(0, &["a", "b", "c", "d"]);
        let during = moving(&three, &four);
        during.check().unwrap();
        let target = during.target().unwrap();
        assert_eq!(target.version, 3);
        assert!(target.moving.is_none());
        assert_eq!(
            during
                .all_shards()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>(),
            ["a", "b", "c", "d"]
        );
        for key in keys().iter().take(5_000) {
            // Homes are the old ones until the move ends.
            assert_eq!(during.home(key), three.home(key));
            let changes = three.home(key).name != target.home(key).name;
            assert_eq!(during.is_moving(key), changes, "{key}");
            if changes {
                assert_eq!(target.home(key).name, "d");
            }
        }
        // The move round-trips through the stored form.
        let json = serde_json::to_string(&during).unwrap();
        assert!(
            json.contains("\"moving\"") && json.contains("startedAtUnixMs"),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<ShardMap>(&json).unwrap(), during);
        // A map with no move stores no `moving` field.
        assert!(!serde_json::to_string(&three).unwrap().contains("moving"));
    }

    #[test]
    fn a_move_keeps_every_shard_and_its_endpoints() {
        let three = map(1, &["a", "b", "c"]);
        let dropped = moving(&three, &map(0, &["a", "b"]));
        assert_eq!(dropped.check(), Err(MapError::DropsShard("c".into())));
        let mut readdressed = map(0, &["a", "b", "c"]);
        readdressed.shards[1].endpoints = vec!["https://elsewhere:2379".into()];
        assert_eq!(
            moving(&three, &readdressed).check(),
            Err(MapError::ChangesShard("b".into()))
        );
        let mut bad_pin = map(0, &["a", "b", "c"]);
        bad_pin.overrides.insert("payments".into(), "z".into());
        assert!(matches!(
            moving(&three, &bad_pin).check(),
            Err(MapError::UnknownOverride { .. })
        ));
    }
}
