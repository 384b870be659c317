//! Stats by name, defined with the host on first use.

use std::collections::HashMap;

use crate::host::{Host, MetricKind};

/// FNV-1a for the VM's own maps (metric names, SAN strings, stat scopes):
/// far cheaper than SipHash in Wasm, and every key comes from a bounded set
/// (stat names, certificates the listener accepted, the grant table), so
/// hash flooding is not a concern; each map is capped anyway.
pub(crate) type FnvMap<K, V> = HashMap<K, V, fnv::FnvBuildHasher>;

/// Metric ids by name, defined on first use. Names come from bounded sets
/// (see `metrics`), and the map is capped anyway.
#[derive(Default)]
pub struct MetricIds {
    ids: FnvMap<String, u32>,
}

const MAX_METRICS: usize = 4096;

impl MetricIds {
    pub fn id(&mut self, host: &impl Host, kind: MetricKind, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        if self.ids.len() >= MAX_METRICS {
            return None;
        }
        let id = host.define_metric(kind, name)?;
        self.ids.insert(name.to_owned(), id);
        Some(id)
    }

    pub fn add(&mut self, host: &impl Host, name: &str, delta: i64) {
        if let Some(id) = self.id(host, MetricKind::Counter, name) {
            host.increment_metric(id, delta);
        }
    }

    pub fn gauge_add(&mut self, host: &impl Host, name: &str, delta: i64) {
        if let Some(id) = self.id(host, MetricKind::Gauge, name) {
            host.increment_metric(id, delta);
        }
    }

    pub fn gauge_set(&mut self, host: &impl Host, name: &str, value: u64) {
        if let Some(id) = self.id(host, MetricKind::Gauge, name) {
            host.record_metric(id, value);
        }
    }

    pub fn histogram(&mut self, host: &impl Host, name: &str, value: u64) {
        if let Some(id) = self.id(host, MetricKind::Histogram, name) {
            host.record_metric(id, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::fake::FakeHost;

    #[test]
    fn a_stat_is_defined_once_and_the_map_is_bounded() {
        let host = FakeHost::default();
        let mut ids = MetricIds::default();
        ids.add(&host, "a", 1);
        ids.add(&host, "a", 2);
        assert_eq!(host.stat("a"), Some(3));
        assert_eq!(host.defined(), 1);
        for i in 0..MAX_METRICS {
            ids.gauge_set(&host, &format!("g{i}"), 1);
        }
        // Full: a new name is not defined (and not counted), old ones still are.
        assert_eq!(host.defined(), MAX_METRICS);
        ids.add(&host, "a", 1);
        assert_eq!(host.stat("a"), Some(4));
    }

    #[test]
    fn a_stat_the_host_refuses_is_skipped() {
        let host = FakeHost::default();
        host.refuse_metrics.set(true);
        let mut ids = MetricIds::default();
        ids.add(&host, "a", 1);
        assert_eq!(host.stat("a"), None);
        host.refuse_metrics.set(false);
        ids.add(&host, "a", 1);
        assert_eq!(host.stat("a"), Some(1));
    }
}
