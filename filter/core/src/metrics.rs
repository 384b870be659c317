//! Stat names. Labels are namespace, class, reason and scope only (ADR-22):
//! never a key, an identity or a token. Label values come from bounded sets —
//! the namespace is the first segment of the *granted prefix* (so it ranges
//! over the grant table, not over what callers send), the class is a known
//! class name or `_unknown` — and are sanitised to `[A-Za-z0-9_-]`.
//!
//! Names are dotted (`latchkey_edge.<stat>.ns.<ns>.class.<class>`); the Envoy
//! bootstrap's `stats_tags` turn `ns`, `class`, `reason` and `scope` into
//! Prometheus labels.

use crate::status::DenyReason;

pub const PREFIX: &str = "latchkey_edge";

/// Counters, gauges and the histogram without labels.
pub const FILTER_VERSION: &str = "latchkey_edge.filter_version";
pub const GRANT_TABLE_VERSION: &str = "latchkey_edge.grant_table_version";
pub const GRANT_TABLE_SIZE: &str = "latchkey_edge.grant_table_size";
pub const CONFIG_ERRORS: &str = "latchkey_edge.config_errors";
pub const DECISION_US: &str = "latchkey_edge.decision_us";
pub const REFRESH_OK: &str = "latchkey_edge.policy_refresh.result.updated";
pub const REFRESH_UNCHANGED: &str = "latchkey_edge.policy_refresh.result.unchanged";
pub const REFRESH_FAILED: &str = "latchkey_edge.policy_refresh.result.failed";
/// When the arbiter last confirmed the grant table this VM decides with
/// (Unix seconds; alert on its age).
pub const GRANT_TABLE_CONFIRMED_AT_S: &str = "latchkey_edge.grant_table_confirmed_at_s";
/// A table taken from shared data on a tick (another worker's refresh).
pub const GRANT_TABLE_ADOPTED: &str = "latchkey_edge.grant_table_adopted";

/// Where a newly configured VM's table came from
/// (`configured`, `carried`, `none`: see `grant_table::Origin`).
pub fn grant_table_start(origin: crate::grant_table::Origin) -> String {
    format!("{PREFIX}.grant_table_start.result.{}", origin.label())
}

/// Writing the last good table to shared data: `written`, `newer_kept`, `failed`.
pub fn grant_table_store(result: &str) -> String {
    format!("{PREFIX}.grant_table_store.result.{}", label(result))
}

/// Waiting Acquires admitted without a key place (the key's probe window was
/// full of other keys' waiters; the arbiter's per-key bound still holds).
pub const ADMISSION_OVERFLOW: &str = "latchkey_edge.admission_overflow";
/// 1 when `admission_secret` is configured, 0 when derived from the clock.
pub const ADMISSION_SECRET_CONFIGURED: &str = "latchkey_edge.admission_secret_configured";
/// Streams open through the edge (all identities; a per-identity count would
/// put identities in stat names).
pub const STREAMS_OPEN: &str = "latchkey_edge.streams_open";

/// A label value: `[A-Za-z0-9_-]`, at most 48 characters, never empty (shared
/// with the arbiter's metrics).
pub use latchkey_policies::metric_label as label;

/// `ns.<namespace>.class.<class>` for an authorised request.
pub fn scope(granted_prefix: &str, class: &str) -> String {
    format!(
        "ns.{}.class.{}",
        latchkey_policies::metric_namespace(granted_prefix),
        label(class)
    )
}

pub fn allowed(method: &str, scope: &str) -> String {
    format!("{PREFIX}.allowed.method.{method}.{scope}")
}

pub fn denied(reason: DenyReason) -> String {
    format!("{PREFIX}.denied.reason.{}", reason.label())
}

pub fn admission_rejected(which: &str, scope: &str) -> String {
    format!("{PREFIX}.admission_rejected.scope.{which}.{scope}")
}

pub fn waiters(scope: &str) -> String {
    format!("{PREFIX}.waiters.{scope}")
}

#[cfg(test)]
mod tests {
    use super::*;

    // `label` itself is tested where it lives (latchkey_policies::telemetry).
    #[test]
    fn scope_uses_the_granted_prefix_namespace() {
        assert_eq!(scope("payments/eu", "demo"), "ns.payments.class.demo");
        assert_eq!(scope("a.b c/x", "de mo"), "ns.a_b_c.class.de_mo");
        assert_eq!(
            allowed("acquire", &scope("demo", "demo")),
            "latchkey_edge.allowed.method.acquire.ns.demo.class.demo"
        );
        assert_eq!(
            denied(DenyReason::NotAuthorised),
            "latchkey_edge.denied.reason.not_authorised"
        );
        assert_eq!(
            denied(DenyReason::PolicyNotReady),
            "latchkey_edge.denied.reason.policy_not_ready"
        );
        assert_eq!(
            denied(DenyReason::PolicyStale),
            "latchkey_edge.denied.reason.policy_stale"
        );
        assert_eq!(
            grant_table_start(crate::grant_table::Origin::Carried),
            "latchkey_edge.grant_table_start.result.carried"
        );
    }
}
