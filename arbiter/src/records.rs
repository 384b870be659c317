//! The values the arbiter stores in etcd, and the key layout under the
//! configured prefix:
//!
//! - `{prefix}/sys/epoch` — [`EpochRecord`]: the epoch and the cluster id it was minted for.
//! - `{prefix}/sys/seal`  — present while the log is sealed (a restore was seen).
//! - `{prefix}/s/{lease}` — [`SessionRecord`] on the session's lease.
//! - `{prefix}/l/{key}`   — [`HolderRecord`] on the holder's session lease.
//! - `{prefix}/q/`        — reserved for durable waiters (deleted by an epoch advance).
//!
//! Records are JSON with a fixed field order, so the bytes the arbiter writes
//! are the bytes it can compare in a transaction.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EpochRecord {
    pub epoch: u32,
    /// etcd cluster id, as a decimal string (JSON numbers lose u64 precision).
    pub cluster_id: String,
    pub advanced_at_unix_ms: i64,
    #[serde(default)]
    pub reason: String,
}

impl EpochRecord {
    pub fn cluster_id(&self) -> Option<u64> {
        self.cluster_id.parse().ok()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SealRecord {
    pub reason: String,
    pub sealed_at_unix_ms: i64,
    /// The lowest epoch the advance may move to: one above every epoch the
    /// sealing arbiters have granted in. After a restore to before an
    /// earlier advance, etcd's epoch record is older than epochs already
    /// used, and advancing it by one would re-use an epoch (and its tokens).
    #[serde(default)]
    pub next_epoch_at_least: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionRecord {
    pub identity: String,
    pub ttl_seconds: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HolderRecord {
    pub identity: String,
    pub session: i64,
    pub class: String,
    pub acquired_at_unix_ms: i64,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// Serialises a record; these types cannot fail to serialise.
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(record).unwrap_or_default()
}

pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Option<T> {
    serde_json::from_slice(bytes).ok()
}

#[derive(Debug, Clone)]
pub struct Layout {
    prefix: String,
}

impl Layout {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }
    pub fn epoch(&self) -> String {
        format!("{}/sys/epoch", self.prefix)
    }
    pub fn seal(&self) -> String {
        format!("{}/sys/seal", self.prefix)
    }
    pub fn session(&self, lease: i64) -> String {
        format!("{}/s/{lease:016x}", self.prefix)
    }
    pub fn holder(&self, key: &str) -> String {
        format!("{}/l/{key}", self.prefix)
    }
    pub fn holders(&self) -> String {
        format!("{}/l/", self.prefix)
    }
    pub fn durable_waiters(&self) -> String {
        format!("{}/q/", self.prefix)
    }
}

pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_bytes_are_stable() {
        let r = SessionRecord {
            identity: "spiffe://td/w".into(),
            ttl_seconds: 15,
        };
        assert_eq!(encode(&r), encode(&r.clone()));
        assert_eq!(
            String::from_utf8_lossy(&encode(&r)),
            r#"{"identity":"spiffe://td/w","ttlSeconds":15}"#
        );
    }

    #[test]
    fn layout() {
        let l = Layout::new("/latchkey/");
        assert_eq!(l.holder("a/b"), "/latchkey/l/a/b");
        assert_eq!(l.session(255), "/latchkey/s/00000000000000ff");
    }
}
