//! The force-release records (ADR-20), as the tailer reads them.
//!
//! An approved force-release is one etcd transaction that deletes the hold
//! and puts a [`ForceRecord`], on a lease of its own with a 24-hour TTL:
//!
//! ```text
//! compare  {prefix}/l/{key}  lease and mod_revision as the request read them
//!          {prefix}/sys/force-req/{id}  mod_revision (still pending)
//! then     delete {prefix}/l/{key}
//!          delete {prefix}/c/{key}//                          (its claims, prefix)
//!          put    {prefix}/sys/force/{id} = ForceRecord (JSON), lease 24 h
//!          delete {prefix}/sys/force-req/{id} and its places
//! ```
//!
//! The record's key names the request (`latchkey_records::force`
//! spells it for the arbiter and parses it here); the record names the
//! hold it ended (key and grant revision). The tailer pairs the record
//! with the hold deleted in the same revision and writes one
//! force-release event, copying the operators and the reason, before the
//! record's lease ends.
//!
//! With "revoke the session too" the arbiter then, with its own credentials
//! (the force-release role may not touch sessions), runs one transaction
//! that deletes the session's record (`{prefix}/s/{lease}` and its count
//! entry), so nothing more is granted on it, and puts a [`RevokeRecord`]
//! under `{prefix}/sys/revoked/{lease:016x}` on a 24-hour lease; then it
//! revokes the lease. The tailer reads the revoke's deletions against the
//! marker: `force-revoked`, not `expired-or-revoked` (a lapse and a revoke
//! delete the same keys; only the marker tells them apart).
//!
//! The record types are the arbiter's own (`latchkey_records::force`):
//! their later fields default when absent, so an older record still reads.

pub use latchkey_records::force::{
    ForceRecord, RevokeRecord, parse_record_name, parse_revoked_name, record_name, revoked_name,
};

/// Where force records live under the prefix.
pub const FORCE_DIR: &str = latchkey_records::keys::FORCE;

/// Where the revoked-session markers live under the prefix.
pub const REVOKED_DIR: &str = latchkey_records::keys::REVOKED;

/// What the audit event of a force-release keeps of its record (everything
/// but what the event's own columns carry).
pub fn detail(record: &ForceRecord) -> serde_json::Value {
    serde_json::json!({
        "requestId": record.request_id,
        "requestedBy": record.requested_by,
        "approvedBy": record.approved_by,
        "reason": record.reason,
        "enforcement": record.enforcement,
        "revokeSession": record.revoke_session,
        "requestedAtUnixMs": record.requested_at_unix_ms,
        "approvedAtUnixMs": record.approved_at_unix_ms,
        "election": record.election,
        "term": record.term,
    })
}

/// What an event of a hold a revoked session's marker ended keeps of it; an
/// undecodable marker still says the session was revoked by an operator.
pub fn revoke_detail(record: Option<&RevokeRecord>) -> serde_json::Value {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ForceRecord {
        ForceRecord {
            key: "ledger/inv-1".into(),
            hold_revision: 42,
            request_id: "0123456789abcdef0123456789abcdef".into(),
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
            revoked_session: false,
            issuer: String::new(),
            requester_identity: String::new(),
            approver_identity: String::new(),
            election: false,
            term: 0,
        }
    }

    /// Issue 32: the name the arbiter puts a record under (its
    /// `ForceRecords::put`, `sys/force/{request id}`) is one the tailer
    /// parses, and names the record's request.
    #[test]
    fn the_arbiter_s_record_name_parses_back() {
        let r = record();
        let name = record_name(&r.request_id);
        assert_eq!(name, "sys/force/0123456789abcdef0123456789abcdef");
        assert!(name.starts_with(FORCE_DIR));
        assert_eq!(parse_record_name(&name), Some(r.request_id.as_str()));
        // the name the tailer once expected, and no arbiter wrote
        assert_eq!(
            parse_record_name("sys/force/ledger/inv-1//000000000000002a"),
            None
        );
        assert_eq!(parse_record_name("sys/force/"), None);
        assert_eq!(parse_record_name("sys/epoch"), None);
    }

    #[test]
    fn a_revoked_marker_names_its_lease() {
        assert_eq!(parse_revoked_name(&revoked_name(255)), Some(255));
        assert!(revoked_name(255).starts_with(REVOKED_DIR));
        assert_eq!(
            parse_revoked_name("sys/revoked/00000000000000ff"),
            Some(255)
        );
        assert_eq!(parse_revoked_name("sys/revoked/ff"), None);
        assert_eq!(parse_revoked_name("sys/revoked/zz00000000000000"), None);
        assert_eq!(parse_revoked_name("sys/force/00000000000000ff"), None);
    }

    #[test]
    fn optional_fields_may_be_missing() {
        let text = r#"{"key":"a","holdRevision":3,"requestId":"r","requestedBy":"x","approvedBy":"y","reason":"z","enforcement":"advisory"}"#;
        let r: ForceRecord = serde_json::from_str(text).unwrap();
        assert_eq!(r.hold_revision, 3);
        assert!(!r.revoke_session);
        let marker: RevokeRecord = serde_json::from_str(r#"{"session":7}"#).unwrap();
        assert_eq!(marker.session, 7);
    }

    /// The event's detail is what it was: the operators, the reason and
    /// the request, never the channel identities or the issuer.
    #[test]
    fn the_detail_keeps_what_it_kept() {
        let d = detail(&record());
        assert_eq!(d["requestId"], "0123456789abcdef0123456789abcdef");
        assert_eq!(d["requestedBy"], "alice");
        assert_eq!(d["election"], false);
        assert_eq!(d.as_object().map(|m| m.len()), Some(10));
        assert_eq!(
            revoke_detail(None)["reason"],
            "(undecodable revocation record)"
        );
    }
}
