//! The arbiter's records, as far as the audit reads them (the writer's
//! types are `latchkey_records`, whose key layout and `decode` the tailer
//! uses as they are; these types read the same JSON, and
//! tolerate fields they do not know, so an arbiter that adds a field does
//! not stop the tailer). The e2e tests run the real arbiter against them.

use serde::Deserialize;

/// `{prefix}/l/{key}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HolderRecord {
    pub identity: String,
    pub session: i64,
    #[serde(default)]
    pub class: String,
    /// The granting arbiter's wall clock.
    #[serde(default)]
    pub acquired_at_unix_ms: i64,
}

/// `{prefix}/sys/epoch`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EpochRecord {
    pub epoch: u32,
    #[serde(default)]
    pub cluster_id: String,
    #[serde(default)]
    pub reason: String,
}

/// `{prefix}/sys/seal`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SealRecord {
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub next_epoch_at_least: u32,
}

pub use latchkey_records::decode;
