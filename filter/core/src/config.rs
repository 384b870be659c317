//! The plugin configuration (JSON, in the ECDS resource) and its validation.
//!
//! Unknown fields are refused, so a typo in a limit name fails `on_configure`
//! (Envoy then keeps the previous filter) instead of silently using a default.
//!
//! Field names are camelCase (`trustDomain`, `refresh.periodMs`), as in every
//! file a Latchkey user writes (policy files, hook configs). The snake_case
//! names of earlier releases (`trust_domain`) are still accepted, reported by
//! [`FilterConfig::parse_reporting_deprecated`] so the filter can log them once;
//! one field given in both spellings is refused.

use serde::Deserialize;
use thiserror::Error;

use crate::identity::valid_trust_domain;
use crate::keyed_hash::AdmissionSecret;
use crate::policy::{EdgePolicy, PolicyBuildError};

/// Upper bound on admission slot tables (each slot is one shared-data entry,
/// which Envoy never deletes).
pub const MAX_SLOTS: u32 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantConfig {
    pub identity: String,
    pub prefixes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassConfig {
    pub name: String,
    pub max_waiters_per_key: u32,
}

/// Where and how often to refresh the grant table from the arbiter.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RefreshConfig {
    /// The Envoy cluster of the arbiter.
    pub cluster: String,
    #[serde(default = "default_period_ms")]
    pub period_ms: u64,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// How long after the arbiter last confirmed the grant table it counts as
    /// stale: a key the stale table does not cover is then answered
    /// `UNAVAILABLE` (`POLICY_STALE`, retryable), not `PERMISSION_DENIED`.
    /// Default: three periods plus one timeout.
    #[serde(default)]
    pub stale_after_ms: Option<u64>,
}

impl RefreshConfig {
    pub fn stale_after_ms(&self) -> u64 {
        self.stale_after_ms.unwrap_or_else(|| {
            self.period_ms
                .saturating_mul(3)
                .saturating_add(self.timeout_ms)
        })
    }
}

fn default_period_ms() -> u64 {
    5_000
}
fn default_timeout_ms() -> u64 {
    2_000
}
fn default_filter_version() -> u64 {
    1
}
fn default_max_waiters_per_key() -> u32 {
    latchkey_policies::DEFAULT_MAX_WAITERS_PER_KEY
}
fn default_max_waiters_per_identity() -> u32 {
    256
}
fn default_max_message_bytes() -> usize {
    16 * 1024
}
fn default_key_slots() -> u32 {
    16_384
}
fn default_identity_slots() -> u32 {
    4_096
}
/// Far below the arbiter cluster's circuit breaker (envoy/edge.yaml), so one
/// identity cannot overflow it for everyone (a test checks the ratio).
pub const DEFAULT_MAX_STREAMS_PER_IDENTITY: u32 = 256;
fn default_max_streams_per_identity() -> u32 {
    DEFAULT_MAX_STREAMS_PER_IDENTITY
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FilterConfig {
    pub trust_domain: String,
    /// Reported as the `filter_version` gauge: which rollout is serving.
    #[serde(default = "default_filter_version")]
    pub filter_version: u64,
    /// The grant table served until the first refresh (and kept if none
    /// succeeds). With a `refresh`, the last good table an earlier VM of this
    /// `vm_id` received from the arbiter (kept in shared data) is preferred:
    /// it is what the arbiter said last (see `grant_table`).
    #[serde(default)]
    pub grants: Vec<GrantConfig>,
    #[serde(default)]
    pub classes: Vec<ClassConfig>,
    /// Waiter bound for a class not in `classes`.
    #[serde(default = "default_max_waiters_per_key")]
    pub default_max_waiters_per_key: u32,
    #[serde(default = "default_max_waiters_per_identity")]
    pub max_waiters_per_identity: u32,
    /// The largest request message the edge decodes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Distinct keys that can have waiters at once (across all workers);
    /// also, in a table of their own, distinct (identity, key) pairs (each
    /// identity's share of a key, `admission::identity_share`).
    #[serde(default = "default_key_slots")]
    pub key_slots: u32,
    /// Distinct identities that can have waiters (and, separately, open
    /// streams) at once.
    #[serde(default = "default_identity_slots")]
    pub identity_slots: u32,
    /// Concurrent streams (every method, KeepAlive included) one identity may
    /// have open through the edge, across all workers.
    #[serde(default = "default_max_streams_per_identity")]
    pub max_streams_per_identity: u32,
    /// 32 hex digits (16 random bytes) keying where keys and identities land
    /// in the admission tables; generate one per deployment (`openssl rand
    /// -hex 16`) and give every Envoy of it the same one. Without it the
    /// filter derives one from the clock at its first start (shared by all
    /// workers, logged as a warning): guessable to within a few dozen bits,
    /// which does not matter for correctness (a crowded window never refuses
    /// another key) but lets a patient tenant aim collisions.
    #[serde(default)]
    pub admission_secret: Option<AdmissionSecret>,
    #[serde(default)]
    pub refresh: Option<RefreshConfig>,
}

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("plugin configuration is not valid JSON for this filter: {0}")]
    Json(#[from] serde_json::Error),
    #[error(
        "{old:?} and {new:?} are one field; keep only {new:?} (the snake_case names are deprecated)"
    )]
    BothSpellings { old: String, new: String },
    #[error("trustDomain {0:?} is not a SPIFFE trust domain")]
    TrustDomain(String),
    #[error("{field} must be between {min} and {max}")]
    Range {
        field: &'static str,
        min: u64,
        max: u64,
    },
    #[error(transparent)]
    Policy(#[from] PolicyBuildError),
}

impl FilterConfig {
    /// Parses and validates; also compiles the initial grant table.
    pub fn parse(json: &[u8]) -> Result<(FilterConfig, EdgePolicy), ConfigError> {
        Self::parse_reporting_deprecated(json).map(|(config, policy, _)| (config, policy))
    }

    /// [`FilterConfig::parse`], also returning the deprecated snake_case
    /// field names the JSON used (as written, e.g. `refresh.period_ms`), for
    /// the caller to log.
    pub fn parse_reporting_deprecated(
        json: &[u8],
    ) -> Result<(FilterConfig, EdgePolicy, Vec<String>), ConfigError> {
        let mut value: serde_json::Value = serde_json::from_slice(json)?;
        let mut deprecated = Vec::new();
        camel_case_keys(&mut value, "", &mut deprecated)?;
        let config: FilterConfig = serde_json::from_value(value)?;
        if !valid_trust_domain(&config.trust_domain) {
            return Err(ConfigError::TrustDomain(config.trust_domain));
        }
        let range = |field, v: u64, min, max| {
            if (min..=max).contains(&v) {
                Ok(())
            } else {
                Err(ConfigError::Range { field, min, max })
            }
        };
        range(
            "default_max_waiters_per_key",
            config.default_max_waiters_per_key.into(),
            1,
            latchkey_policies::MAX_WAITERS_PER_KEY_LIMIT.into(),
        )?;
        range(
            "maxWaitersPerIdentity",
            config.max_waiters_per_identity.into(),
            1,
            1 << 20,
        )?;
        range(
            "maxMessageBytes",
            config.max_message_bytes as u64,
            64,
            4 << 20,
        )?;
        range("keySlots", config.key_slots.into(), 1, MAX_SLOTS.into())?;
        range(
            "identitySlots",
            config.identity_slots.into(),
            1,
            MAX_SLOTS.into(),
        )?;
        range(
            "maxStreamsPerIdentity",
            config.max_streams_per_identity.into(),
            1,
            1 << 20,
        )?;
        if let Some(r) = &config.refresh {
            range("refresh.periodMs", r.period_ms, 100, 3_600_000)?;
            range("refresh.timeoutMs", r.timeout_ms, 10, 60_000)?;
            if let Some(stale) = r.stale_after_ms {
                range("refresh.staleAfterMs", stale, r.period_ms, 86_400_000)?;
            }
            if r.cluster.is_empty() {
                return Err(ConfigError::Range {
                    field: "refresh.cluster (length)",
                    min: 1,
                    max: 255,
                });
            }
        }
        let policy = EdgePolicy::from_config(&config)?;
        Ok((config, policy, deprecated))
    }
}

/// Renames the snake_case keys of the config's objects (the top level,
/// `refresh`, and the items of `grants` and `classes`) to camelCase,
/// recording each as `path.name`. Values are left alone.
fn camel_case_keys(
    value: &mut serde_json::Value,
    path: &str,
    deprecated: &mut Vec<String>,
) -> Result<(), ConfigError> {
    use serde_json::Value;
    let Value::Object(map) = value else {
        return Ok(());
    };
    let old_keys: Vec<String> = map.keys().filter(|k| k.contains('_')).cloned().collect();
    for old in old_keys {
        let new = snake_to_camel(&old);
        let shown = if path.is_empty() {
            old.clone()
        } else {
            format!("{path}.{old}")
        };
        if map.contains_key(&new) {
            return Err(ConfigError::BothSpellings { old: shown, new });
        }
        if let Some(v) = map.remove(&old) {
            map.insert(new, v);
            deprecated.push(shown);
        }
    }
    if path.is_empty() {
        if let Some(refresh) = map.get_mut("refresh") {
            camel_case_keys(refresh, "refresh", deprecated)?;
        }
        for list in ["grants", "classes"] {
            if let Some(Value::Array(items)) = map.get_mut(list) {
                for item in items {
                    camel_case_keys(item, list, deprecated)?;
                }
            }
        }
    }
    Ok(())
}

/// `max_waiters_per_key` → `maxWaitersPerKey`.
fn snake_to_camel(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_takes_defaults() {
        let (c, p) = FilterConfig::parse(br#"{"trust_domain":"dev.latchkey"}"#).unwrap();
        assert_eq!(c.filter_version, 1);
        assert_eq!(c.max_message_bytes, 16 * 1024);
        assert_eq!(c.max_streams_per_identity, DEFAULT_MAX_STREAMS_PER_IDENTITY);
        assert_eq!(c.admission_secret, None);
        assert!(p.grants().is_empty());
    }

    #[test]
    fn full_config_parses() {
        let json = br#"{
            "trust_domain": "dev.latchkey",
            "filter_version": 7,
            "grants": [{"identity": "spiffe://dev.latchkey/workload/a", "prefixes": ["a/b", "c"]}],
            "classes": [{"name": "demo", "max_waiters_per_key": 2}],
            "default_max_waiters_per_key": 4,
            "max_waiters_per_identity": 3,
            "max_message_bytes": 1024,
            "key_slots": 64,
            "identity_slots": 16,
            "max_streams_per_identity": 9,
            "admission_secret": "00112233445566778899aabbccddeeff",
            "refresh": {"cluster": "arbiter", "period_ms": 1000}
        }"#;
        let (c, p) = FilterConfig::parse(json).unwrap();
        assert_eq!(c.filter_version, 7);
        assert_eq!(p.grants().len(), 2);
        assert_eq!(p.max_waiters_per_key("demo"), 2);
        assert_eq!(p.max_waiters_per_key("other"), 4);
        let refresh = c.refresh.unwrap();
        assert_eq!(refresh.timeout_ms, 2000);
        assert_eq!(refresh.stale_after_ms(), 3 * 1000 + 2000);
        assert_eq!(c.max_streams_per_identity, 9);
        assert_eq!(
            c.admission_secret,
            AdmissionSecret::from_hex("00112233445566778899aabbccddeeff").ok()
        );
    }

    #[test]
    fn a_bad_secret_is_refused_without_echoing_it() {
        let e = FilterConfig::parse(
            br#"{"trust_domain":"dev.latchkey","admission_secret":"s3cr3t-value"}"#,
        )
        .unwrap_err();
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
        assert!(e.to_string().contains("32 hex digits"), "{e}");
    }

    /// One identity at its stream bound must stay far from the arbiter
    /// cluster's circuit breaker in the shipped bootstrap, or it could make
    /// Envoy answer everyone UNAVAILABLE "overflow" (issue 10).
    #[test]
    fn the_stream_bound_is_far_below_the_arbiter_circuit_breaker() {
        let yaml = include_str!("../../../envoy/edge.yaml");
        let cluster = yaml
            .split("  - name: ")
            .find(|c| c.starts_with("arbiter\n"))
            .expect("the arbiter cluster");
        let threshold = |name: &str| -> u32 {
            cluster
                .lines()
                .find_map(|l| l.trim().strip_prefix(&format!("{name}: ")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("{name} in the arbiter cluster"))
        };
        let bound = DEFAULT_MAX_STREAMS_PER_IDENTITY;
        assert!(threshold("max_requests") >= 16 * bound);
        assert!(threshold("max_pending_requests") >= 8 * bound);
        // The grant-table refresh has a cluster (and breaker) of its own.
        assert!(yaml.contains("  - name: arbiter_policy\n"));
    }

    #[test]
    fn unknown_fields_and_bad_values_are_refused() {
        for bad in [
            &br#"{"trust_domain":"dev.latchkey","max_waiter_per_key":3}"#[..],
            br#"{"trust_domain":"dev.latchkey","refresh":{"cluster":"a","perod_ms":1}}"#,
            br#"{"trust_domain":"dev.latchkey","refresh":{"cluster":"a","period_ms":1000,"stale_after_ms":999}}"#,
            br#"{"trust_domain":"Not A Domain"}"#,
            br#"{"trust_domain":"dev.latchkey","key_slots":0}"#,
            br#"{"trust_domain":"dev.latchkey","max_streams_per_identity":0}"#,
            br#"{"trust_domain":"dev.latchkey","admission_secret":"00"}"#,
            br#"{"trust_domain":"dev.latchkey","grants":[{"identity":"nope","prefixes":["a"]}]}"#,
            br#"{"trust_domain":"dev.latchkey","grants":[{"identity":"spiffe://dev.latchkey/a","prefixes":["a//b"]}]}"#,
            br#"{"trust_domain":"dev.latchkey","classes":[{"name":"x","max_waiters_per_key":0}]}"#,
            br#"not json"#,
        ] {
            assert!(FilterConfig::parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    /// Issue 17: camelCase like every other file a user writes; the old
    /// snake_case names still work, reported for a deprecation message.
    #[test]
    fn camel_case_names_and_the_deprecated_snake_case_ones_parse_alike() {
        let camel = br#"{
            "trustDomain": "dev.latchkey",
            "filterVersion": 7,
            "grants": [{"identity": "spiffe://dev.latchkey/workload/a", "prefixes": ["a/b"]}],
            "classes": [{"name": "demo", "maxWaitersPerKey": 2}],
            "defaultMaxWaitersPerKey": 4,
            "maxWaitersPerIdentity": 3,
            "maxMessageBytes": 1024,
            "keySlots": 64,
            "identitySlots": 16,
            "maxStreamsPerIdentity": 9,
            "admissionSecret": "00112233445566778899aabbccddeeff",
            "refresh": {"cluster": "arbiter", "periodMs": 1000, "timeoutMs": 500, "staleAfterMs": 4000}
        }"#;
        let snake = br#"{
            "trust_domain": "dev.latchkey",
            "filter_version": 7,
            "grants": [{"identity": "spiffe://dev.latchkey/workload/a", "prefixes": ["a/b"]}],
            "classes": [{"name": "demo", "max_waiters_per_key": 2}],
            "default_max_waiters_per_key": 4,
            "max_waiters_per_identity": 3,
            "max_message_bytes": 1024,
            "key_slots": 64,
            "identity_slots": 16,
            "max_streams_per_identity": 9,
            "admission_secret": "00112233445566778899aabbccddeeff",
            "refresh": {"cluster": "arbiter", "period_ms": 1000, "timeout_ms": 500, "stale_after_ms": 4000}
        }"#;
        let (from_camel, _, none) = FilterConfig::parse_reporting_deprecated(camel).unwrap();
        assert!(none.is_empty(), "{none:?}");
        let (from_snake, _, old) = FilterConfig::parse_reporting_deprecated(snake).unwrap();
        assert_eq!(from_camel, from_snake);
        assert_eq!(old.len(), 13, "{old:?}");
        for name in [
            "trust_domain",
            "classes.max_waiters_per_key",
            "refresh.stale_after_ms",
        ] {
            assert!(old.iter().any(|o| o == name), "{name} in {old:?}");
        }
        // Mixed is fine too; one field twice is not.
        let mixed = br#"{"trustDomain":"dev.latchkey","key_slots":8}"#;
        let (c, _, old) = FilterConfig::parse_reporting_deprecated(mixed).unwrap();
        assert_eq!((c.key_slots, old), (8, vec!["key_slots".to_string()]));
        let both = br#"{"trustDomain":"dev.latchkey","refresh":{"cluster":"a","periodMs":1000,"period_ms":1000}}"#;
        let e = FilterConfig::parse(both).unwrap_err();
        assert!(
            e.to_string()
                .contains("\"refresh.period_ms\" and \"periodMs\""),
            "{e}"
        );
        // A misspelling is still refused in either style.
        assert!(FilterConfig::parse(br#"{"trustDomain":"dev.latchkey","keySlot":8}"#).is_err());
    }
}
