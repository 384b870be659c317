//! What one VM keeps across its contexts: the active configuration and grant
//! table, metric ids and the per-VM caches (SPIFFE IDs by SAN, stat scopes).

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::Hasher;
use std::rc::Rc;

use latchkey_filter_core::admission::Admission;
use latchkey_filter_core::config::FilterConfig;
use latchkey_filter_core::decision;
use latchkey_filter_core::grant_table::{GrantTable, LastGood};
use latchkey_filter_core::identity::identity_from_san;
use latchkey_filter_core::metrics;
use latchkey_filter_core::request::Method;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{LogLevel, MetricType};

use crate::host_store::HostStore;

/// FNV-1a for the VM's own maps (metric names, SAN strings, stat scopes):
/// far cheaper than SipHash in Wasm, and every key comes from a bounded set
/// (stat names, certificates the listener accepted, the grant table), so
/// hash flooding is not a concern; each map is capped anyway.
pub(crate) type FnvMap<K, V> = HashMap<K, V, fnv::FnvBuildHasher>;

fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h = fnv::FnvHasher::default();
    for p in parts {
        h.write(p);
        h.write(&[0]);
    }
    h.finish()
}

/// Metric ids by name, defined on first use. Names come from bounded sets
/// (see `metrics`), and the map is capped anyway.
#[derive(Default)]
pub(crate) struct Metrics {
    ids: FnvMap<String, u32>,
}

const MAX_METRICS: usize = 4096;

impl Metrics {
    pub(crate) fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        if self.ids.len() >= MAX_METRICS {
            return None;
        }
        let id = hostcalls::define_metric(kind, name).ok()?;
        self.ids.insert(name.to_owned(), id);
        Some(id)
    }

    pub(crate) fn add(&mut self, name: &str, delta: i64) {
        if let Some(id) = self.id(MetricType::Counter, name) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    pub(crate) fn gauge_add(&mut self, name: &str, delta: i64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    pub(crate) fn gauge_set(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    pub(crate) fn histogram(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

/// What the root context shares with the stream contexts of the same VM.
pub(crate) struct Active {
    pub(crate) config: FilterConfig,
    pub(crate) table: GrantTable,
    pub(crate) admission: Admission,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) active: Option<Rc<Active>>,
    pub(crate) metrics: Metrics,
    /// Peer URI SAN (the exact bytes of the property Envoy gives for this
    /// request's connection) -> the SPIFFE ID it validated to in
    /// `identities_domain`: the SAN is read on every request, the parse need
    /// not be (`identity_from_san` depends on the SAN and the trust domain
    /// only, so an entry can only ever answer for a certificate with the
    /// same SAN). Only valid SANs are kept; at most `MAX_CACHED`.
    pub(crate) identities: FnvMap<Box<[u8]>, Rc<str>>,
    /// The trust domain the cached identities were validated in; a stream
    /// of another configuration empties the cache first.
    identities_domain: String,
    /// `(method, granted prefix, class label)` -> the stat scope and the id
    /// of its `allowed` counter (the same for every table: a scope depends
    /// on the granted prefix and class label only).
    scopes: FnvMap<u64, ScopeEntry>,
}

/// Bound on each per-VM cache; a full cache is emptied and refilled.
const MAX_CACHED: usize = 4096;

struct ScopeEntry {
    method: Method,
    granted: Box<str>,
    class_label: Box<str>,
    scope: Rc<str>,
    allowed: Option<u32>,
}

impl State {
    /// The caller's SPIFFE ID for a peer URI SAN (cached), or the refusal.
    pub(crate) fn identity(&mut self, san: &[u8], trust_domain: &str) -> Option<Rc<str>> {
        if self.identities_domain != trust_domain {
            self.identities.clear();
            trust_domain.clone_into(&mut self.identities_domain);
        }
        if let Some(id) = self.identities.get(san) {
            return Some(id.clone());
        }
        let id: Rc<str> = identity_from_san(Some(san), trust_domain).ok()?.into();
        if self.identities.len() >= MAX_CACHED {
            self.identities.clear();
        }
        self.identities.insert(san.into(), id.clone());
        Some(id)
    }

    /// The stat scope of an authorised call and the id of its `allowed`
    /// counter (cached: formatting and looking up stat names is slow in Wasm).
    pub(crate) fn scope(
        &mut self,
        method: Method,
        authorised: &decision::Authorised<'_>,
    ) -> (Rc<str>, Option<u32>) {
        let key = fnv(&[
            method.label().as_bytes(),
            authorised.granted.as_bytes(),
            authorised.class_label.as_bytes(),
        ]);
        if let Some(e) = self.scopes.get(&key)
            && e.method == method
            && *e.granted == *authorised.granted
            && *e.class_label == *authorised.class_label
        {
            return (e.scope.clone(), e.allowed);
        }
        let scope: Rc<str> = authorised.scope().into();
        let allowed = self.metrics.id(
            MetricType::Counter,
            &metrics::allowed(method.label(), &scope),
        );
        if self.scopes.len() >= MAX_CACHED {
            self.scopes.clear();
        }
        // A colliding entry is simply replaced.
        self.scopes.insert(
            key,
            ScopeEntry {
                method,
                granted: authorised.granted.into(),
                class_label: authorised.class_label.into(),
                scope: scope.clone(),
                allowed,
            },
        );
        (scope, allowed)
    }
}

pub(crate) type SharedState = Rc<RefCell<State>>;

pub(crate) fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

/// The host clock in milliseconds since the Unix epoch (0 if unreadable).
pub(crate) fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The last good table in shared data; a store error reads as none (logged).
pub(crate) fn load_last_good() -> Option<LastGood> {
    match LastGood::load(&HostStore) {
        Ok(stored) => stored,
        Err(e) => {
            log(
                LogLevel::Warn,
                &format!("latchkey edge: cannot read the last good grant table: {e}"),
            );
            None
        }
    }
}
