//! How the simulation's keys are named: `sim/k<n>` (`sim/k<n>/x` with
//! shards, a range each), and the coord keys in `simc`.

use super::SimConfig;

impl SimConfig {
    /// Key number `n` as the clients name it (see [`Self::shards`]).
    pub fn key(&self, n: u64) -> String {
        let namespace = match self.is_coord_key(n) {
            true => "simc",
            false => "sim",
        };
        match self.shards {
            0 => format!("{namespace}/k{n}"),
            _ => format!("{namespace}/k{n}/x"),
        }
    }

    /// Whether key number `n` is a coord key ([`Self::coord_keys`]).
    pub fn is_coord_key(&self, n: u64) -> bool {
        n as usize + self.coord_keys >= self.keys && self.coord_keys > 0
    }

    /// The number of a key [`Self::key`] named.
    pub fn key_number(&self, key: &str) -> Option<usize> {
        let rest = key
            .strip_prefix("sim/k")
            .or_else(|| key.strip_prefix("simc/k"))?;
        let n = match self.shards {
            0 => rest,
            _ => rest.strip_suffix("/x")?,
        };
        n.parse().ok()
    }
}
