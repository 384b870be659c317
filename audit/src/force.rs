//! The force-release record (ADR-20), as the tailer reads it.
//!
//! An approved force-release is one etcd transaction that deletes the hold
//! and puts this record, on a lease of its own with a 24-hour TTL:
//!
//! ```text
//! compare  {prefix}/l/{key}  mod_revision == hold_revision  (the hold the operators saw)
//! then     delete {prefix}/l/{key}
//!          delete {prefix}/c/{key}//                          (its claims, prefix)
//!          put    {prefix}/sys/force/{key}//{hold_revision:016x} = ForceRecord (JSON), lease 24 h
//! ```
//!
//! The key names the hold it ended (key and grant revision), so a retried
//! transaction cannot write a second record for one hold, and `//` cannot
//! occur in a lock key. The tailer pairs the record with the hold deleted
//! in the same revision and writes one force-release event, copying the
//! operators and the reason, before the record's lease ends.
//!
//! With "revoke the session too" the arbiter then, with its own credentials
//! (the force-release role may not touch sessions), runs one transaction
//! that deletes the session's record (`{prefix}/s/{lease}` and its count
//! entry), so nothing more is granted on it, and puts a [`RevokeRecord`]
//! under `{prefix}/sys/revoked/{lease:016x}` on a 24-hour lease; then it
//! revokes the lease. The tailer reads the revoke's deletions against the
//! marker: `force-revoked`, not `expired-or-revoked` (a lapse and a revoke
//! delete the same keys; only the marker tells them apart).

use serde::{Deserialize, Serialize};

/// Where force records live under the prefix.
pub const FORCE_DIR: &str = latchkey_records::keys::FORCE;

/// What the operators decided. Field order is fixed (the helper writing it
/// and tests compare bytes); unknown fields are kept out by nothing: the
/// tailer copies what it knows and ignores the rest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ForceRecord {
    /// The lock key whose hold was deleted.
    pub key: String,
    /// The deleted hold's grant revision (its token's revision).
    pub hold_revision: i64,
    /// The request's id in the Admin API.
    pub request_id: String,
    /// OIDC subjects of the requesting and the approving operator (ADR-20
    /// requires two different ones).
    pub requested_by: String,
    pub approved_by: String,
    pub reason: String,
    /// `fenced` or `advisory`: what the operators were shown before
    /// approving (on an advisory class two writers may follow).
    pub enforcement: String,
    /// The holder the operators were shown.
    #[serde(default)]
    pub holder_identity: String,
    #[serde(default)]
    pub holder_session: i64,
    #[serde(default)]
    pub class: String,
    /// The holder's whole session was revoked too.
    #[serde(default)]
    pub revoke_session: bool,
    #[serde(default)]
    pub requested_at_unix_ms: i64,
    #[serde(default)]
    pub approved_at_unix_ms: i64,
    /// The operators ended an election's term (`key` is the election's
    /// name), not a hold.
    #[serde(default)]
    pub election: bool,
    /// The term they ended (elections only).
    #[serde(default)]
    pub term: u64,
}

impl ForceRecord {
    /// The record's key under the prefix (without it), e.g.
    /// `sys/force/ledger/inv-1//000000000000002a`.
    pub fn relative_key(&self) -> String {
        format!("{FORCE_DIR}{}//{:016x}", self.key, self.hold_revision)
    }

    /// What the audit event keeps of it (everything but what the event's
    /// own columns carry).
    pub fn detail(&self) -> serde_json::Value {
        serde_json::json!({
            "requestId": self.request_id,
            "requestedBy": self.requested_by,
            "approvedBy": self.approved_by,
            "reason": self.reason,
            "enforcement": self.enforcement,
            "revokeSession": self.revoke_session,
            "requestedAtUnixMs": self.requested_at_unix_ms,
            "approvedAtUnixMs": self.approved_at_unix_ms,
            "election": self.election,
            "term": self.term,
        })
    }
}

/// Where the revoked-session markers live under the prefix.
pub const REVOKED_DIR: &str = latchkey_records::keys::REVOKED;

/// A session an operator's force-release revoked (the arbiter's
/// `force_release::RevokeRecord`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RevokeRecord {
    #[serde(default)]
    pub session: i64,
    #[serde(default)]
    pub key: String,
    #[serde(default)]
    pub request_id: String,
    #[serde(default)]
    pub requested_by: String,
    #[serde(default)]
    pub approved_by: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub revoked_at_unix_ms: i64,
}

impl RevokeRecord {
    /// What an event of a hold it ended keeps of it; an undecodable marker
    /// still says the session was revoked by an operator.
    pub fn detail(record: Option<&Self>) -> serde_json::Value {
        match record {
            Some(r) => serde_json::json!({
                "revokedWith": r.key,
                "requestId": r.request_id,
                "requestedBy": r.requested_by,
                "approvedBy": r.approved_by,
                "reason": r.reason,
                "revokedAtUnixMs": r.revoked_at_unix_ms,
            }),
            None => serde_json::json!({ "reason": "(undecodable revocation record)" }),
        }
    }
}

/// The lease a revoked-session marker's key (relative to the prefix) names.
pub fn parse_revoked_key(relative: &str) -> Option<i64> {
    let hex = relative.strip_prefix(REVOKED_DIR)?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok().map(|l| l as i64)
}

/// The lock key and hold revision a force record's key (relative to the
/// prefix) names, if it is one.
pub fn parse_key(relative: &str) -> Option<(&str, i64)> {
    let rest = relative.strip_prefix(FORCE_DIR)?;
    let (key, revision) = rest.rsplit_once("//")?;
    let revision = i64::from_str_radix(revision, 16).ok()?;
    (!key.is_empty()).then_some((key, revision))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ForceRecord {
        ForceRecord {
            key: "ledger/inv-1".into(),
            hold_revision: 42,
            request_id: "fr-1".into(),
            requested_by: "alice".into(),
            approved_by: "bob".into(),
            reason: "stuck after deploy".into(),
            enforcement: "fenced".into(),
            holder_identity: "spiffe://td/w".into(),
            holder_session: 7,
            class: "ledger".into(),
            revoke_session: false,
            requested_at_unix_ms: 1,
            approved_at_unix_ms: 2,
            election: false,
            term: 0,
        }
    }

    #[test]
    fn the_key_names_the_hold_and_parses_back() {
        let r = record();
        assert_eq!(r.relative_key(), "sys/force/ledger/inv-1//000000000000002a");
        assert_eq!(parse_key(&r.relative_key()), Some(("ledger/inv-1", 42)));
        assert_eq!(parse_key("sys/force/x"), None);
        assert_eq!(parse_key("sys/epoch"), None);
    }

    #[test]
    fn a_revoked_marker_names_its_lease() {
        assert_eq!(parse_revoked_key("sys/revoked/00000000000000ff"), Some(255));
        assert_eq!(parse_revoked_key("sys/revoked/ff"), None);
        assert_eq!(parse_revoked_key("sys/revoked/zz00000000000000"), None);
        assert_eq!(parse_revoked_key("sys/force/00000000000000ff"), None);
    }

    #[test]
    fn optional_fields_may_be_missing() {
        let text = r#"{"key":"a","holdRevision":3,"requestId":"r","requestedBy":"x","approvedBy":"y","reason":"z","enforcement":"advisory"}"#;
        let r: ForceRecord = serde_json::from_str(text).unwrap();
        assert_eq!(r.hold_revision, 3);
        assert!(!r.revoke_session);
    }
}
