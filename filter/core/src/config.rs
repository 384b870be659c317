//! The plugin configuration (JSON, in the ECDS resource) and its validation.
//!
//! Unknown fields are refused, so a typo in a limit name fails `on_configure`
//! (Envoy then keeps the previous filter) instead of silently using a default.

use serde::Deserialize;
use thiserror::Error;

use crate::identity::valid_trust_domain;
use crate::keyed_hash::AdmissionSecret;
use crate::policy::{EdgePolicy, PolicyBuildError};

/// Upper bound on admission slot tables (each slot is one shared-data entry,
/// which Envoy never deletes).
pub const MAX_SLOTS: u32 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantConfig {
    pub identity: String,
    pub prefixes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    pub name: String,
    pub max_waiters_per_key: u32,
}

/// Where and how often to refresh the grant table from the arbiter.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
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
    /// Distinct keys that can have waiters at once (across all workers).
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
    #[error("trust_domain {0:?} is not a SPIFFE trust domain")]
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
        let config: FilterConfig = serde_json::from_slice(json)?;
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
            "max_waiters_per_identity",
            config.max_waiters_per_identity.into(),
            1,
            1 << 20,
        )?;
        range(
            "max_message_bytes",
            config.max_message_bytes as u64,
            64,
            4 << 20,
        )?;
        range("key_slots", config.key_slots.into(), 1, MAX_SLOTS.into())?;
        range(
            "identity_slots",
            config.identity_slots.into(),
            1,
            MAX_SLOTS.into(),
        )?;
        range(
            "max_streams_per_identity",
            config.max_streams_per_identity.into(),
            1,
            1 << 20,
        )?;
        if let Some(r) = &config.refresh {
            range("refresh.period_ms", r.period_ms, 100, 3_600_000)?;
            range("refresh.timeout_ms", r.timeout_ms, 10, 60_000)?;
            if let Some(stale) = r.stale_after_ms {
                range("refresh.stale_after_ms", stale, r.period_ms, 86_400_000)?;
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
        Ok((config, policy))
    }
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
}
