//! Two-person force-release's records (ADR-20) and their keys: one
//! definition for the arbiter, which writes them, and the audit tailer,
//! which reads them.
//!
//! Below the prefix:
//!
//! - `sys/force-req/{id}` — [`RequestRecord`], a pending request, on a
//!   lease of its own (an unapproved request expires with it).
//! - `sys/force-req/place/hold/{hold revision}/{key}` — the one pending
//!   request a hold may have (the value is the request's id).
//! - `sys/force-req/place/term/{term}/{election}` — the one pending request
//!   a leadership may have.
//! - `sys/force-req/place/op/{hex(subject)}/{n}` — the places of one
//!   operator's pending requests.
//! - `sys/force/{id}` — [`ForceRecord`], an approval, on a 24 h lease,
//!   put in the transaction that ends the hold or the leadership.
//! - `sys/revoked/{lease:016x}` — [`RevokeRecord`], a session an approval
//!   revoked, on a 24 h lease.
//!
//! The request id is the arbiter's (32 hex digits), so a record's key names
//! its request, not the hold it ended: the record itself says which.
//!
//! The readers' fields after the first few have defaults, so a record
//! written before a field existed still decodes. The bytes written are the
//! same as before: the defaults only widen what decodes.

use serde::{Deserialize, Serialize};

use crate::{Layout, keys};

/// A pending request, as stored (JSON, camelCase, fixed field order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestRecord {
    pub id: String,
    pub key: String,
    pub holder_identity: String,
    pub holder_session: i64,
    /// The lease the holder record was on and its mod revision: the
    /// approval's transaction compares both.
    pub hold_lease: i64,
    pub hold_revision: i64,
    pub class: String,
    pub enforcement: String,
    pub reason: String,
    pub revoke_session: bool,
    pub requester_subject: String,
    pub requester_identity: String,
    pub requested_at_unix_ms: i64,
    pub expires_at_unix_ms: i64,
    /// Which of its requester's places the request takes
    /// ([`operator_place_name`]); `None` for a request written before
    /// places existed, whose approval then deletes no place (it could be
    /// another request's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub place: Option<u32>,
    /// The request names an election's leadership, not a hold: `key` is
    /// the election, the holder its leader, `hold_lease` the leader
    /// record's lease and `hold_revision` the term record's mod revision
    /// (with the epoch, the leader's token: compared by the approval and
    /// never shown, logged or put in the force record).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub election: bool,
    /// The term the request names (`epoch * 2^32 + count`); 0 for a hold.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub term: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl RequestRecord {
    /// The place of the target the request names: its hold's
    /// ([`hold_place_name`]) or its term's ([`term_place_name`]).
    pub fn target_place_name(&self) -> String {
        match self.election {
            true => term_place_name(&self.key, self.term),
            false => hold_place_name(&self.key, self.hold_revision),
        }
    }

    /// The places the request took, by name below the prefix (none for one
    /// written before places existed: deleting place 0 then could free
    /// another request's).
    pub fn place_names(&self) -> Vec<String> {
        match self.place {
            Some(place) => vec![
                self.target_place_name(),
                operator_place_name(&self.requester_subject, place),
            ],
            None => Vec::new(),
        }
    }
}

/// A force-release that happened, as stored under `sys/force/{id}` for the
/// audit tailer. The first seven fields are required; the rest default when
/// absent (records written before them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ForceRecord {
    /// The lock key whose hold was deleted (or the election's name).
    pub key: String,
    /// The deleted hold's grant revision (its token's revision); 0 for an
    /// election.
    pub hold_revision: i64,
    /// The request's id in the Admin API.
    pub request_id: String,
    /// OIDC subjects of the requester and the approver (ADR-20 requires
    /// two different ones).
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
    /// The request asked for the holder's session to be revoked too.
    #[serde(default)]
    pub revoke_session: bool,
    #[serde(default)]
    pub requested_at_unix_ms: i64,
    #[serde(default)]
    pub approved_at_unix_ms: i64,
    /// The approval goes on to revoke the holder's session (right after the
    /// transaction, with the arbiter's own credentials).
    #[serde(default)]
    pub revoked_session: bool,
    #[serde(default)]
    pub issuer: String,
    /// The operators' channel identities (SVIDs).
    #[serde(default)]
    pub requester_identity: String,
    #[serde(default)]
    pub approver_identity: String,
    /// An election's leadership was ended, not a hold: `key` is the
    /// election, `term` the term ended, the holder its leader, and
    /// `hold_revision` 0 (the term's revision is its token's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub election: bool,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub term: u64,
}

/// A session an operator's force-release revoked, as stored under
/// `sys/revoked/{lease:016x}` on a 24 h lease, written in the transaction
/// that deletes the session's record, before the lease is revoked: the
/// audit tailer reads the revoke's deletions against it as `force-revoked`
/// rather than an expiry. Every field defaults when absent: the marker's
/// presence is what matters to a reader.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RevokeRecord {
    pub session: i64,
    /// The key whose force-release asked for the revocation.
    pub key: String,
    pub request_id: String,
    pub requested_by: String,
    pub approved_by: String,
    pub reason: String,
    pub holder_identity: String,
    pub revoked_at_unix_ms: i64,
}

/// The places' directory below the requests' (`sys/force-req/place/`).
const PLACES: &str = "place/";

/// `sys/force-req/{id}` (below the prefix): a pending request.
pub fn request_name(id: &str) -> String {
    format!("{}{id}", keys::FORCE_REQUESTS)
}

/// `sys/force/{id}` (below the prefix): the record of an approval.
pub fn record_name(id: &str) -> String {
    format!("{}{id}", keys::FORCE)
}

/// The request id a force record's name (below the prefix) names, if it is
/// one: what [`record_name`] spells, with a non-empty id and no `/` in it.
pub fn parse_record_name(relative: &str) -> Option<&str> {
    let id = relative.strip_prefix(keys::FORCE)?;
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

/// `sys/revoked/{session:016x}` (below the prefix): a revoked session's
/// marker.
pub fn revoked_name(session: i64) -> String {
    format!("{}{session:016x}", keys::REVOKED)
}

/// The lease a revoked session's marker name (below the prefix) names: what
/// [`revoked_name`] spells, 16 hex digits.
pub fn parse_revoked_name(relative: &str) -> Option<i64> {
    let hex = relative.strip_prefix(keys::REVOKED)?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok().map(|l| l as i64)
}

/// `sys/force-req/place/hold/{hold revision}/{key}`: the one pending request
/// a hold may have. Its value is the request's id.
pub fn hold_place_name(key: &str, hold_revision: i64) -> String {
    format!("{}{PLACES}hold/{hold_revision}/{key}", keys::FORCE_REQUESTS)
}

/// `sys/force-req/place/term/{term}/{election}`: the one pending request a
/// leadership may have (a place of its own kind, so a key's and an
/// election's of one name never share one). Named by the term number, not
/// the term record's revision: that is the leader's token's, and key names
/// are listed by more readers than values.
pub fn term_place_name(election: &str, term: u64) -> String {
    format!("{}{PLACES}term/{term}/{election}", keys::FORCE_REQUESTS)
}

/// `sys/force-req/place/op/{hex(subject)}/`: the places of one operator's
/// pending requests (hex, so no subject's places are a prefix of
/// another's).
pub fn operator_places_name(subject: &str) -> String {
    let hex: String = subject.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{}{PLACES}op/{hex}/", keys::FORCE_REQUESTS)
}

/// Place `place` of `subject`'s pending requests.
pub fn operator_place_name(subject: &str, place: u32) -> String {
    format!("{}{place}", operator_places_name(subject))
}

/// The force-release keys under the prefix: the names above with it.
impl Layout {
    /// `{prefix}/sys/force-req/`: every pending request (and the places).
    pub fn force_requests(&self) -> String {
        self.under(keys::FORCE_REQUESTS)
    }
    /// Request `id`.
    pub fn force_request(&self, id: &str) -> String {
        self.under(&request_name(id))
    }
    /// `{prefix}/sys/force/`: every force record.
    pub fn force_records(&self) -> String {
        self.under(keys::FORCE)
    }
    /// The force record of request `id`.
    pub fn force_record(&self, id: &str) -> String {
        self.under(&record_name(id))
    }
    /// `{prefix}/sys/revoked/`: every revoked session's marker.
    pub fn revoked_sessions(&self) -> String {
        self.under(keys::REVOKED)
    }
    /// The marker of revoked session `session`.
    pub fn revoked_session(&self, session: i64) -> String {
        self.under(&revoked_name(session))
    }
    /// The place of the hold or term `request` names.
    pub fn force_target_place(&self, request: &RequestRecord) -> String {
        self.under(&request.target_place_name())
    }
    /// Every place of `subject`'s pending requests: a prefix to list.
    pub fn operator_places(&self, subject: &str) -> String {
        self.under(&operator_places_name(subject))
    }
    /// Place `place` of `subject`'s pending requests.
    pub fn operator_place(&self, subject: &str, place: u32) -> String {
        self.under(&operator_place_name(subject, place))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode, encode};

    fn request() -> RequestRecord {
        RequestRecord {
            id: "0123456789abcdef0123456789abcdef".into(),
            key: "ledger/inv-1".into(),
            holder_identity: "spiffe://td/w".into(),
            holder_session: 7,
            hold_lease: 7,
            hold_revision: 42,
            class: "ledger".into(),
            enforcement: "fenced".into(),
            reason: "stuck".into(),
            revoke_session: false,
            requester_subject: "alice".into(),
            requester_identity: "spiffe://td/op".into(),
            requested_at_unix_ms: 1,
            expires_at_unix_ms: 2,
            place: Some(3),
            election: false,
            term: 0,
        }
    }

    fn record() -> ForceRecord {
        ForceRecord {
            key: "ledger/inv-1".into(),
            hold_revision: 42,
            request_id: "r".into(),
            requested_by: "alice".into(),
            approved_by: "bob".into(),
            reason: "stuck".into(),
            enforcement: "fenced".into(),
            holder_identity: "spiffe://d/w".into(),
            holder_session: 7,
            class: "c".into(),
            revoke_session: false,
            requested_at_unix_ms: 1,
            approved_at_unix_ms: 2,
            revoked_session: false,
            issuer: "https://sso".into(),
            requester_identity: "spiffe://d/op".into(),
            approver_identity: "spiffe://d/op2".into(),
            election: false,
            term: 0,
        }
    }

    /// The bytes are the arbiter's as they were (field order, names, the
    /// election fields left out for a hold).
    #[test]
    fn the_bytes_are_as_before() {
        assert_eq!(
            String::from_utf8(encode(&request())).unwrap(),
            r#"{"id":"0123456789abcdef0123456789abcdef","key":"ledger/inv-1","holderIdentity":"spiffe://td/w","holderSession":7,"holdLease":7,"holdRevision":42,"class":"ledger","enforcement":"fenced","reason":"stuck","revokeSession":false,"requesterSubject":"alice","requesterIdentity":"spiffe://td/op","requestedAtUnixMs":1,"expiresAtUnixMs":2,"place":3}"#
        );
        assert_eq!(
            String::from_utf8(encode(&record())).unwrap(),
            r#"{"key":"ledger/inv-1","holdRevision":42,"requestId":"r","requestedBy":"alice","approvedBy":"bob","reason":"stuck","enforcement":"fenced","holderIdentity":"spiffe://d/w","holderSession":7,"class":"c","revokeSession":false,"requestedAtUnixMs":1,"approvedAtUnixMs":2,"revokedSession":false,"issuer":"https://sso","requesterIdentity":"spiffe://d/op","approverIdentity":"spiffe://d/op2"}"#
        );
        let elected = ForceRecord {
            election: true,
            term: 9,
            ..record()
        };
        let json = String::from_utf8(encode(&elected)).unwrap();
        assert!(json.ends_with(r#","election":true,"term":9}"#), "{json}");
        let marker = RevokeRecord {
            session: 7,
            key: "k".into(),
            request_id: "r".into(),
            requested_by: "a".into(),
            approved_by: "b".into(),
            reason: "x".into(),
            holder_identity: "i".into(),
            revoked_at_unix_ms: 3,
        };
        assert_eq!(
            String::from_utf8(encode(&marker)).unwrap(),
            r#"{"session":7,"key":"k","requestId":"r","requestedBy":"a","approvedBy":"b","reason":"x","holderIdentity":"i","revokedAtUnixMs":3}"#
        );
        assert_eq!(decode::<RevokeRecord>(&encode(&marker)), Some(marker));
    }

    /// A force record with only its first fields, as older writers left it,
    /// still decodes; one without them does not.
    #[test]
    fn a_force_record_s_later_fields_may_be_missing() {
        let text = br#"{"key":"a","holdRevision":3,"requestId":"r","requestedBy":"x","approvedBy":"y","reason":"z","enforcement":"advisory"}"#;
        let r: ForceRecord = decode(text).unwrap();
        assert_eq!(r.hold_revision, 3);
        assert!(!r.revoke_session && !r.election && r.issuer.is_empty());
        assert_eq!(decode::<ForceRecord>(br#"{"key":"a"}"#), None);
        assert_eq!(decode::<RevokeRecord>(b"{}"), Some(RevokeRecord::default()));
    }

    #[test]
    fn names_and_keys() {
        let l = Layout::new("/latchkey/");
        let r = request();
        assert_eq!(
            record_name(&r.id),
            "sys/force/0123456789abcdef0123456789abcdef"
        );
        assert_eq!(
            l.force_request(&r.id),
            "/latchkey/sys/force-req/0123456789abcdef0123456789abcdef"
        );
        assert_eq!(l.force_requests(), "/latchkey/sys/force-req/");
        assert_eq!(l.force_records(), "/latchkey/sys/force/");
        assert_eq!(l.force_record("x"), "/latchkey/sys/force/x");
        assert_eq!(
            l.revoked_session(255),
            "/latchkey/sys/revoked/00000000000000ff"
        );
        assert!(l.revoked_session(255).starts_with(&l.revoked_sessions()));
        assert_eq!(
            r.place_names(),
            [
                "sys/force-req/place/hold/42/ledger/inv-1",
                "sys/force-req/place/op/616c696365/3"
            ]
        );
        let elected = RequestRecord {
            election: true,
            term: (1 << 32) + 2,
            ..r.clone()
        };
        assert_eq!(
            l.force_target_place(&elected),
            "/latchkey/sys/force-req/place/term/4294967298/ledger/inv-1"
        );
        assert_eq!(
            l.operator_place("alice", 3),
            "/latchkey/sys/force-req/place/op/616c696365/3"
        );
        assert!(
            l.operator_place("alice", 3)
                .starts_with(&l.operator_places("alice"))
        );
        let old = RequestRecord { place: None, ..r };
        assert!(old.place_names().is_empty());
    }

    /// What the arbiter writes, the audit's parsers read back (issue 32:
    /// the audit once parsed `sys/force/{key}//{revision}`, a name no
    /// arbiter wrote).
    #[test]
    fn names_parse_back() {
        let id = "0123456789abcdef0123456789abcdef";
        assert_eq!(parse_record_name(&record_name(id)), Some(id));
        assert_eq!(parse_record_name("sys/force/"), None);
        assert_eq!(
            parse_record_name("sys/force/ledger/inv-1//000000000000002a"),
            None
        );
        assert_eq!(parse_record_name(&request_name(id)), None);
        assert_eq!(parse_record_name("sys/epoch"), None);
        for session in [1, 255, i64::MAX] {
            assert_eq!(parse_revoked_name(&revoked_name(session)), Some(session));
        }
        assert_eq!(parse_revoked_name("sys/revoked/ff"), None);
        assert_eq!(parse_revoked_name("sys/revoked/zz00000000000000"), None);
        assert_eq!(parse_revoked_name("sys/force/00000000000000ff"), None);
    }
}
