//! The edge's view of policy: the compiled prefix grants (ADR-19) and the
//! per-class waiter bounds, with a version.
//!
//! The first table comes from the plugin configuration; the arbiter's
//! `GetEdgePolicy` answer replaces it when its version differs. A table that
//! fails to decode or validate is refused whole and the last good one stays.

use std::collections::HashMap;

use latchkey_policies::{LockKey, PolicyError, PrefixGrants};
use thiserror::Error;

use crate::config::FilterConfig;
use crate::wire::{Reader, WireError};

/// gRPC service and method of the arbiter's edge-policy call.
pub const EDGE_POLICY_SERVICE: &str = "latchkey.admin.v1.Admin";
pub const EDGE_POLICY_METHOD: &str = "GetEdgePolicy";

#[derive(Debug, Error)]
pub enum PolicyBuildError {
    #[error("grant table: {0}")]
    Grants(#[from] PolicyError),
    #[error("class {name:?}: max_waiters_per_key must be between 1 and {max}")]
    ClassLimit { name: String, max: u32 },
    #[error("edge policy message: {0}")]
    Wire(#[from] WireError),
}

#[derive(Debug, Clone)]
pub struct EdgePolicy {
    grants: PrefixGrants,
    classes: HashMap<String, u32>,
    default_max_waiters_per_key: u32,
    version: u64,
}

impl EdgePolicy {
    pub fn from_config(config: &FilterConfig) -> Result<EdgePolicy, PolicyBuildError> {
        let grants = PrefixGrants::from_entries(
            config
                .grants
                .iter()
                .map(|g| (g.identity.as_str(), g.prefixes.iter())),
        )?;
        let classes = config
            .classes
            .iter()
            .map(|c| (c.name.clone(), c.max_waiters_per_key));
        let version = grants.version();
        Self::new(grants, classes, config.default_max_waiters_per_key, version)
    }

    fn new(
        grants: PrefixGrants,
        classes: impl IntoIterator<Item = (String, u32)>,
        default_max_waiters_per_key: u32,
        version: u64,
    ) -> Result<EdgePolicy, PolicyBuildError> {
        let max = latchkey_policies::MAX_WAITERS_PER_KEY_LIMIT;
        let mut map = HashMap::new();
        for (name, limit) in classes {
            if !(1..=max).contains(&limit) {
                return Err(PolicyBuildError::ClassLimit { name, max });
            }
            map.insert(name, limit);
        }
        Ok(EdgePolicy {
            grants,
            classes: map,
            default_max_waiters_per_key,
            version,
        })
    }

    /// Decodes the arbiter's `EdgePolicy` message:
    /// `{uint64 version = 1; repeated EdgeGrant grants = 2; repeated EdgeClass classes = 3}`,
    /// `EdgeGrant{string identity = 1; repeated string prefixes = 2}`,
    /// `EdgeClass{string name = 1; uint32 max_waiters_per_key = 2}`.
    pub fn from_arbiter(
        message: &[u8],
        default_max_waiters_per_key: u32,
    ) -> Result<EdgePolicy, PolicyBuildError> {
        let mut version = 0u64;
        let mut builder = PrefixGrants::builder();
        let mut classes = Vec::new();
        let mut reader = Reader::new(message);
        while let Some((field, value)) = reader.next_field()? {
            match field {
                1 => version = value.varint(field)?,
                2 => {
                    let mut identity = "";
                    let mut prefixes = Vec::new();
                    let mut r = Reader::new(value.bytes(field)?);
                    while let Some((f, v)) = r.next_field()? {
                        match f {
                            1 => identity = v.string(f)?,
                            2 => prefixes.push(v.string(f)?),
                            _ => {}
                        }
                    }
                    // An identity without prefixes grants nothing.
                    if !prefixes.is_empty() {
                        builder.grant(identity, prefixes)?;
                    }
                }
                3 => {
                    let mut name = String::new();
                    let mut limit = default_max_waiters_per_key;
                    let mut r = Reader::new(value.bytes(field)?);
                    while let Some((f, v)) = r.next_field()? {
                        match f {
                            1 => name = v.string(f)?.to_owned(),
                            2 => limit = v.u32(f)?,
                            _ => {}
                        }
                    }
                    classes.push((name, limit));
                }
                _ => {}
            }
        }
        Self::new(
            builder.build(),
            classes,
            default_max_waiters_per_key,
            version,
        )
    }

    pub fn grants(&self) -> &PrefixGrants {
        &self.grants
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// The longest granted prefix covering `key` for `identity`.
    pub fn authorise(&self, identity: &str, key: &LockKey) -> Option<&str> {
        self.grants.authorise(identity, key)
    }

    /// The grant subject `identity` is bounded as (issue 30): itself, or the
    /// pattern (`spiffe://td/ns/x/sa/y/*`) its per-pod identity falls under,
    /// exactly as the arbiter decides it; `identity` when it has no grant.
    pub fn bound_subject<'a>(&'a self, identity: &'a str) -> &'a str {
        self.grants.subject(identity).unwrap_or(identity)
    }

    pub fn max_waiters_per_key(&self, class: &str) -> u32 {
        self.classes
            .get(class)
            .copied()
            .unwrap_or(self.default_max_waiters_per_key)
    }

    /// Whether `other` would decide exactly as this table does (same grants
    /// version, same class bounds).
    pub fn same_as(&self, other: &EdgePolicy) -> bool {
        self.version == other.version
            && self.classes == other.classes
            && self.default_max_waiters_per_key == other.default_max_waiters_per_key
    }

    pub fn knows_class(&self, class: &str) -> bool {
        self.classes.contains_key(class)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::wire::Writer;

    pub(crate) fn edge_policy_message(
        version: u64,
        grants: &[(&str, &[&str])],
        classes: &[(&str, u32)],
    ) -> Vec<u8> {
        let mut w = Writer::new();
        w.varint(1, version);
        for (identity, prefixes) in grants {
            let mut g = Writer::new();
            g.string(1, identity);
            for p in *prefixes {
                g.string(2, p);
            }
            w.bytes(2, &g.finish());
        }
        for (name, limit) in classes {
            let mut c = Writer::new();
            c.string(1, name).varint(2, u64::from(*limit));
            w.bytes(3, &c.finish());
        }
        w.finish()
    }

    #[test]
    fn decodes_the_arbiters_answer() {
        let msg = edge_policy_message(
            9,
            &[
                ("spiffe://dev.latchkey/workload/a", &["a/b", "c"]),
                ("spiffe://dev.latchkey/workload/b", &[]),
            ],
            &[("demo", 3)],
        );
        let p = EdgePolicy::from_arbiter(&msg, 16).unwrap();
        assert_eq!(p.version(), 9);
        assert_eq!(p.grants().len(), 2);
        assert_eq!(p.max_waiters_per_key("demo"), 3);
        assert_eq!(p.max_waiters_per_key("x"), 16);
        let key = LockKey::parse("a/b/c").unwrap();
        assert_eq!(
            p.authorise("spiffe://dev.latchkey/workload/a", &key),
            Some("a/b")
        );
        let key = LockKey::parse("a/bc").unwrap();
        assert_eq!(p.authorise("spiffe://dev.latchkey/workload/a", &key), None);
    }

    #[test]
    fn a_bad_table_is_refused_whole() {
        let msg = edge_policy_message(1, &[("not-spiffe", &["a"])], &[]);
        assert!(EdgePolicy::from_arbiter(&msg, 16).is_err());
        let msg = edge_policy_message(1, &[], &[("demo", 0)]);
        assert!(EdgePolicy::from_arbiter(&msg, 16).is_err());
        assert!(EdgePolicy::from_arbiter(&[0x12, 0x05, 0x0a], 16).is_err());
    }
}
