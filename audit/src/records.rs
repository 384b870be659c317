//! The arbiter's records, as far as the audit reads them (the writer's
//! types are `latchkey_records`, whose key layout and `decode` the tailer
//! uses as they are; these types read the same JSON, and
//! tolerate fields they do not know, so an arbiter that adds a field does
//! not stop the tailer). The e2e tests run the real arbiter against them.
//!
//! These three stay the audit's own (issue 32): they read more than the
//! writer's types do (a record missing its class, its cluster id or its
//! seal time still makes an event), and widening the writer's types would
//! change the arbiter's own reading of such a record, where "does not
//! decode" means "no arbiter wrote it" (a hold it must not touch, an epoch
//! it must not trust). The tests below decode the writer's bytes with them.
//! The force-release records and the quorum-loss spool's lines are the
//! writer's types ([`crate::force`], [`crate::spool`]).

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

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_records::encode;

    /// What the arbiter writes today, and what older arbiters wrote,
    /// decodes into the audit's readers with the same values.
    #[test]
    fn the_writer_s_records_decode() {
        let hold = latchkey_records::HolderRecord {
            identity: "spiffe://td/w".into(),
            session: 7,
            class: "ledger".into(),
            acquired_at_unix_ms: 5,
            annotations: [("a".to_string(), "b".to_string())].into(),
            instance: "pod-1".into(),
            bound: "spiffe://td/*".into(),
            quota_place: Some(1),
            downgraded_from: Some(3),
        };
        let read: HolderRecord = decode(&encode(&hold)).unwrap();
        assert_eq!(
            read,
            HolderRecord {
                identity: hold.identity.clone(),
                session: 7,
                class: hold.class.clone(),
                acquired_at_unix_ms: 5,
            }
        );
        let old =
            br#"{"identity":"spiffe://td/w","session":7,"class":"ledger","acquiredAtUnixMs":5}"#;
        assert_eq!(decode::<HolderRecord>(old), Some(read));

        let epoch = latchkey_records::EpochRecord {
            epoch: 3,
            cluster_id: "18446744073709551615".into(),
            advanced_at_unix_ms: 9,
            reason: "restore".into(),
        };
        let read: EpochRecord = decode(&encode(&epoch)).unwrap();
        assert_eq!(
            (read.epoch, read.cluster_id.as_str(), read.reason.as_str()),
            (3, "18446744073709551615", "restore")
        );
        let old = br#"{"epoch":1,"clusterId":"42","advancedAtUnixMs":1}"#;
        assert_eq!(decode::<EpochRecord>(old).map(|r| r.epoch), Some(1));

        let seal = latchkey_records::SealRecord {
            reason: "restore seen".into(),
            sealed_at_unix_ms: 4,
            next_epoch_at_least: 6,
        };
        let read: SealRecord = decode(&encode(&seal)).unwrap();
        assert_eq!(
            (read.reason.as_str(), read.next_epoch_at_least),
            ("restore seen", 6)
        );
        let old = br#"{"reason":"restore seen","sealedAtUnixMs":4}"#;
        assert_eq!(
            decode::<SealRecord>(old).map(|r| r.next_epoch_at_least),
            Some(0)
        );
    }
}
