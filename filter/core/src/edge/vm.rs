//! What one VM keeps across its contexts: the active configuration and grant
//! table, stat ids and the per-VM caches (SPIFFE IDs by SAN, stat scopes).

use std::cell::RefCell;
use std::hash::Hasher;
use std::rc::Rc;

use crate::admission::Admission;
use crate::config::FilterConfig;
use crate::decision::Authorised;
use crate::edge::metric_ids::{FnvMap, MetricIds};
use crate::grant_table::GrantTable;
use crate::host::{Host, MetricKind};
use crate::identity::identity_from_san;
use crate::metrics;
use crate::request::Method;

/// What the root context shares with the stream contexts of the same VM: a
/// stream decides with the configuration and table it started with.
pub struct Active {
    pub config: FilterConfig,
    pub table: GrantTable,
    pub admission: Admission,
}

/// The VM's state, shared by its root context and its streams.
#[derive(Default)]
pub struct Vm {
    pub active: Option<Rc<Active>>,
    pub metrics: MetricIds,
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

pub type SharedVm = Rc<RefCell<Vm>>;

/// Bound on each per-VM cache; a full cache is emptied and refilled.
const MAX_CACHED: usize = 4096;

struct ScopeEntry {
    method: Method,
    granted: Box<str>,
    class_label: Box<str>,
    scope: Rc<str>,
    allowed: Option<u32>,
}

fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h = fnv::FnvHasher::default();
    for p in parts {
        h.write(p);
        h.write(&[0]);
    }
    h.finish()
}

impl Vm {
    /// The caller's SPIFFE ID for a peer URI SAN (cached), or `None`: the
    /// caller is unauthenticated.
    pub fn identity(&mut self, san: &[u8], trust_domain: &str) -> Option<Rc<str>> {
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
    pub fn scope(
        &mut self,
        host: &impl Host,
        method: Method,
        authorised: &Authorised<'_>,
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
            host,
            MetricKind::Counter,
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

#[cfg(test)]
mod tests {
    use super::*;

    const TD: &str = "dev.latchkey";
    const ALICE: &[u8] = b"spiffe://dev.latchkey/workload/alice";

    #[test]
    fn identities_are_cached_per_san_and_trust_domain() {
        let mut vm = Vm::default();
        assert_eq!(
            vm.identity(ALICE, TD).as_deref(),
            Some("spiffe://dev.latchkey/workload/alice")
        );
        assert_eq!(vm.identities.len(), 1);
        assert!(vm.identity(ALICE, TD).is_some());
        assert_eq!(vm.identities.len(), 1);
        // Invalid SANs are refused and never cached.
        assert!(vm.identity(b"spiffe://other.td/x", TD).is_none());
        assert!(vm.identity(b"", TD).is_none());
        assert_eq!(vm.identities.len(), 1);
        // Another trust domain: the cache answers nothing it validated before.
        assert!(vm.identity(ALICE, "other.td").is_none());
        assert!(vm.identities.is_empty());
    }

    #[test]
    fn the_identity_cache_is_bounded() {
        let mut vm = Vm::default();
        for i in 0..=MAX_CACHED {
            let san = format!("spiffe://dev.latchkey/w/{i}");
            assert!(vm.identity(san.as_bytes(), TD).is_some());
        }
        assert!(vm.identities.len() <= MAX_CACHED);
    }
}
