//! The edge's decision for a keyed call (lock.v1 Acquire, Release, Inspect;
//! every election.v1 call, whose election name is checked as a lock key), as
//! one pure function: body -> gRPC frame -> message -> key -> header match ->
//! grant.
//! Admission (the waiter bounds) follows separately, because it touches shared
//! state and must be undone when the stream ends.

use latchkey_policies::LockKey;

use crate::admission::Rejection;
use crate::grant_table::Table;
use crate::metrics;
use crate::request::{Method, RequestError, decode, unframe};
use crate::status::{DenyReason, Refusal};

/// The routing-key header a client may send on a keyed call; if present it
/// must equal the request's key (an election call's: the election name).
pub const KEY_HEADER: &str = "x-lock-key";

/// A keyed call the edge lets through. Borrows from the request body and
/// the grant table (nothing is copied but the key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorised<'a> {
    pub key: LockKey,
    /// The class asked for (Acquire, Campaign), empty otherwise.
    pub class: &'a str,
    /// Acquire that will wait, or Campaign: subject to admission.
    pub waits: bool,
    /// The longest granted prefix that covers the key.
    pub granted: &'a str,
    /// The class as a stat label: the class if the table knows it,
    /// `_unknown` for an Acquire or Campaign of another class, `_none`
    /// otherwise.
    pub class_label: &'a str,
    /// The class's waiter bound, from the table that authorised the call.
    pub max_waiters_per_key: u32,
}

impl Authorised<'_> {
    /// `ns.<ns>.class.<class>` for stats (depends on `granted` and
    /// `class_label` only, so it may be cached by them).
    pub fn scope(&self) -> String {
        metrics::scope(self.granted, self.class_label)
    }
}

/// Whether a body of `body_size` bytes can already be refused as oversized
/// (before buffering all of it).
pub fn body_too_large(body_size: usize, max_message_bytes: usize) -> bool {
    body_size > max_message_bytes.saturating_add(5)
}

/// A key the table does not cover is `NOT_AUTHORISED` only when the table is
/// fresh: without a table (`POLICY_NOT_READY`) or with a stale one
/// (`POLICY_STALE`) the refusal is `UNAVAILABLE`, since the caller may hold a
/// grant the edge has not received (issue 19). Malformed requests are refused
/// the same way whatever the table.
pub fn check_keyed<'a>(
    table: Table<'a>,
    identity: &str,
    method: Method,
    body: &'a [u8],
    header_key: Option<&str>,
    max_message_bytes: usize,
) -> Result<Authorised<'a>, Refusal> {
    let refuse = |why| Refusal::of(why);
    let request = unframe(body, max_message_bytes)
        .and_then(|message| decode(method, message))
        .map_err(|e| match e {
            RequestError::Compressed => refuse(DenyReason::Compressed),
            RequestError::Oversized { .. } => refuse(DenyReason::Oversized),
            _ => refuse(DenyReason::BadRequest),
        })?;
    let key = LockKey::parse(request.key).map_err(|_| refuse(DenyReason::BadKey))?;
    // A client may send x-lock-key (Envoy without the filter hashes on it); if
    // it does, it must be exactly the key. Sent twice counts as a mismatch.
    if let Some(header) = header_key
        && header != key.as_str()
    {
        return Err(refuse(DenyReason::KeyMismatch));
    }
    let (policy, stale) = match table {
        Table::NotReady => return Err(refuse(DenyReason::PolicyNotReady)),
        Table::Fresh(policy) => (policy, false),
        Table::Stale(policy) => (policy, true),
    };
    let granted = policy.authorise(identity, &key).ok_or_else(|| {
        refuse(if stale {
            DenyReason::PolicyStale
        } else {
            DenyReason::NotAuthorised
        })
    })?;
    let class = request.class.unwrap_or_default();
    let class_label = if method.has_class() && policy.knows_class(class) {
        class
    } else if method.has_class() {
        "_unknown"
    } else {
        "_none"
    };
    Ok(Authorised {
        max_waiters_per_key: policy.max_waiters_per_key(class),
        key,
        class,
        waits: method.has_class() && request.waits,
        granted,
        class_label,
    })
}

pub fn admission_refusal(r: Rejection) -> Refusal {
    Refusal::of(match r {
        Rejection::KeyFull => DenyReason::QueueFullKey,
        Rejection::KeyShareFull => DenyReason::QueueFullKeyShare,
        Rejection::IdentityFull => DenyReason::QueueFullIdentity,
        Rejection::TableFull => DenyReason::AdmissionTableFull,
        Rejection::StreamsFull => DenyReason::TooManyStreams,
        Rejection::StreamTableFull => DenyReason::StreamTableFull,
        Rejection::Store => DenyReason::AdmissionUnavailable,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FilterConfig;
    use crate::policy::EdgePolicy;
    use crate::status::GrpcCode;
    use crate::wire::Writer;

    const ALICE: &str = "spiffe://dev.latchkey/workload/alice";

    fn policy() -> EdgePolicy {
        let json = format!(
            r#"{{"trust_domain":"dev.latchkey",
                "grants":[{{"identity":"{ALICE}","prefixes":["a/b","shared"]}}],
                "classes":[{{"name":"demo","max_waiters_per_key":2}}]}}"#
        );
        FilterConfig::parse(json.as_bytes()).unwrap().1
    }

    fn body(key: &str) -> Vec<u8> {
        let mut w = Writer::new();
        w.string(1, key).string(2, "demo").varint(3, 1).varint(4, 1);
        let m = w.finish();
        let mut b = vec![0];
        b.extend_from_slice(&(m.len() as u32).to_be_bytes());
        b.extend(m);
        b
    }

    #[test]
    fn an_authorised_acquire_passes_with_its_scope() {
        let (p, b) = (policy(), body("a/b/c"));
        let a = check_keyed(
            Table::Fresh(&p),
            ALICE,
            Method::Acquire,
            &b,
            Some("a/b/c"),
            4096,
        )
        .unwrap();
        assert_eq!(a.key.as_str(), "a/b/c");
        assert!(a.waits);
        assert_eq!(a.granted, "a/b");
        assert_eq!(a.class, "demo");
        assert_eq!(a.scope(), "ns.a.class.demo");
        // No header: fine (the filter sets the routing key itself).
        assert!(
            check_keyed(
                Table::Fresh(&policy()),
                ALICE,
                Method::Acquire,
                &body("a/b"),
                None,
                4096
            )
            .is_ok()
        );
    }

    #[test]
    fn refusals() {
        let p = policy();
        let code = |r: Result<Authorised, Refusal>| r.map(|_| ()).map_err(|r| (r.code, r.why));
        assert_eq!(
            code(check_keyed(
                Table::Fresh(&p),
                ALICE,
                Method::Acquire,
                &body("a/bc"),
                Some("a/bc"),
                4096
            )),
            Err((GrpcCode::PermissionDenied, DenyReason::NotAuthorised))
        );
        assert_eq!(
            code(check_keyed(
                Table::Fresh(&p),
                "spiffe://dev.latchkey/workload/bob",
                Method::Acquire,
                &body("a/b"),
                Some("a/b"),
                4096
            )),
            Err((GrpcCode::PermissionDenied, DenyReason::NotAuthorised))
        );
        assert_eq!(
            code(check_keyed(
                Table::Fresh(&p),
                ALICE,
                Method::Acquire,
                &body("a/b/x"),
                Some("a/b/y"),
                4096
            )),
            Err((GrpcCode::InvalidArgument, DenyReason::KeyMismatch))
        );
        assert_eq!(
            code(check_keyed(
                Table::Fresh(&p),
                ALICE,
                Method::Acquire,
                &body("a//b"),
                Some("a//b"),
                4096
            )),
            Err((GrpcCode::InvalidArgument, DenyReason::BadKey))
        );
        assert_eq!(
            code(check_keyed(
                Table::Fresh(&p),
                ALICE,
                Method::Acquire,
                &body("a/b"),
                Some("a/b"),
                8
            )),
            Err((GrpcCode::ResourceExhausted, DenyReason::Oversized))
        );
        assert_eq!(
            code(check_keyed(
                Table::Fresh(&p),
                ALICE,
                Method::Release,
                &[0, 0, 0, 0, 3, 0xff, 0xff, 0xff],
                None,
                4096
            )),
            Err((GrpcCode::InvalidArgument, DenyReason::BadRequest))
        );
    }

    #[test]
    fn the_denial_is_the_same_whether_or_not_a_grant_exists_nearby() {
        let p = policy();
        let a = check_keyed(
            Table::Fresh(&p),
            ALICE,
            Method::Inspect,
            &body("a/bc"),
            Some("a/bc"),
            4096,
        )
        .unwrap_err();
        let b = check_keyed(
            Table::Fresh(&p),
            ALICE,
            Method::Inspect,
            &body("zzz/none"),
            Some("zzz/none"),
            4096,
        )
        .unwrap_err();
        assert_eq!(a, b);
    }

    /// Issue 19: without a table, or with a stale one, a caller is never told
    /// PERMISSION_DENIED; a stale table still lets through what it covers.
    #[test]
    fn a_missing_or_stale_table_is_unavailable_not_permission_denied() {
        let p = policy();
        let code = |r: Result<Authorised, Refusal>| r.map(|_| ()).map_err(|r| (r.code, r.why));
        for key in ["a/b/c", "zzz/none"] {
            assert_eq!(
                code(check_keyed(
                    Table::NotReady,
                    ALICE,
                    Method::Acquire,
                    &body(key),
                    None,
                    4096
                )),
                Err((GrpcCode::Unavailable, DenyReason::PolicyNotReady))
            );
        }
        let b = body("a/b/c");
        let stale = check_keyed(Table::Stale(&p), ALICE, Method::Acquire, &b, None, 4096).unwrap();
        assert_eq!(stale.scope(), "ns.a.class.demo");
        assert_eq!(stale.max_waiters_per_key, 2);
        assert_eq!(
            code(check_keyed(
                Table::Stale(&p),
                ALICE,
                Method::Acquire,
                &body("a/bc"),
                None,
                4096
            )),
            Err((GrpcCode::Unavailable, DenyReason::PolicyStale))
        );
        // The same refusal whether or not a grant exists nearby, as when fresh.
        assert_eq!(
            check_keyed(
                Table::Stale(&p),
                ALICE,
                Method::Inspect,
                &body("a/bc"),
                None,
                4096
            ),
            check_keyed(
                Table::Stale(&p),
                ALICE,
                Method::Inspect,
                &body("zzz/none"),
                None,
                4096
            ),
        );
        // A malformed request is refused as such whatever the table.
        assert_eq!(
            code(check_keyed(
                Table::NotReady,
                ALICE,
                Method::Acquire,
                &body("a//b"),
                None,
                4096
            )),
            Err((GrpcCode::InvalidArgument, DenyReason::BadKey))
        );
    }

    /// Over its share of a key, a caller hears a retryable refusal that
    /// names the bound, distinct from the key being full.
    #[test]
    fn a_share_refusal_is_retryable_and_names_the_bound() {
        let share = admission_refusal(Rejection::KeyShareFull);
        assert_eq!(
            (share.code, share.reason),
            (GrpcCode::ResourceExhausted, "QUEUE_FULL")
        );
        for word in ["share", "maxWaitersPerKey", "retry"] {
            assert!(share.message.contains(word), "{word}: {}", share.message);
        }
        assert_ne!(share, admission_refusal(Rejection::KeyFull));
        assert_eq!(share.why.label(), "queue_full_key_share");
    }

    /// A body of an election.v1 `method` naming `name` (field 1), with the
    /// class `demo` for a Campaign.
    fn election_body(method: Method, name: &str) -> Vec<u8> {
        let mut w = Writer::new();
        w.string(1, name);
        if method == Method::Campaign {
            w.string(2, "demo").varint(3, 1);
        }
        let m = w.finish();
        let mut b = vec![0];
        b.extend_from_slice(&(m.len() as u32).to_be_bytes());
        b.extend(m);
        b
    }

    const ELECTION: [Method; 7] = [
        Method::Campaign,
        Method::Proclaim,
        Method::Leader,
        Method::Observe,
        Method::Resign,
        Method::Transfer,
        Method::Candidates,
    ];

    /// An election's name is checked exactly as a lock key: the same grants,
    /// key rules, header match, size limit and table states.
    #[test]
    fn an_election_name_is_authorised_as_a_lock_key() {
        let p = policy();
        let code = |r: Result<Authorised, Refusal>| r.map(|_| ()).map_err(|r| (r.code, r.why));
        for method in ELECTION {
            let b = election_body(method, "a/b/leader");
            let a = check_keyed(
                Table::Fresh(&p),
                ALICE,
                method,
                &b,
                Some("a/b/leader"),
                4096,
            )
            .unwrap();
            assert_eq!((a.key.as_str(), a.granted), ("a/b/leader", "a/b"));
            if method == Method::Campaign {
                // A waiting call of its class: admission applies.
                assert!(a.waits);
                assert_eq!((a.class, a.class_label), ("demo", "demo"));
                assert_eq!(a.max_waiters_per_key, 2);
                assert_eq!(a.scope(), "ns.a.class.demo");
            } else {
                assert!(!a.waits, "{method:?}");
                assert_eq!((a.class, a.class_label), ("", "_none"), "{method:?}");
                assert_eq!(a.scope(), "ns.a.class._none");
            }
            for (table, identity, name, header, max, want) in [
                (
                    Table::Fresh(&p),
                    ALICE,
                    "a/bc",
                    None,
                    4096,
                    DenyReason::NotAuthorised,
                ),
                (
                    Table::Fresh(&p),
                    "spiffe://dev.latchkey/workload/bob",
                    "a/b",
                    None,
                    4096,
                    DenyReason::NotAuthorised,
                ),
                (
                    Table::Fresh(&p),
                    ALICE,
                    "a//b",
                    None,
                    4096,
                    DenyReason::BadKey,
                ),
                (Table::Fresh(&p), ALICE, "", None, 4096, DenyReason::BadKey),
                (
                    Table::Fresh(&p),
                    ALICE,
                    "a/b/x",
                    Some("a/b/y"),
                    4096,
                    DenyReason::KeyMismatch,
                ),
                (
                    Table::Fresh(&p),
                    ALICE,
                    "a/b",
                    None,
                    4,
                    DenyReason::Oversized,
                ),
                (
                    Table::NotReady,
                    ALICE,
                    "a/b",
                    None,
                    4096,
                    DenyReason::PolicyNotReady,
                ),
                (
                    Table::Stale(&p),
                    ALICE,
                    "zzz/none",
                    None,
                    4096,
                    DenyReason::PolicyStale,
                ),
            ] {
                let got = code(check_keyed(
                    table,
                    identity,
                    method,
                    &election_body(method, name),
                    header,
                    max,
                ));
                assert_eq!(
                    got,
                    Err((Refusal::of(want).code, want)),
                    "{method:?} {name}"
                );
            }
            // A stale table still lets through what it covers.
            assert!(check_keyed(Table::Stale(&p), ALICE, method, &b, None, 4096).is_ok());
        }
    }

    /// A Campaign of a class the table does not know is counted as
    /// `_unknown`, like an Acquire (the arbiter refuses the class).
    #[test]
    fn a_campaign_of_an_unknown_class_is_labelled_unknown() {
        let p = policy();
        let mut w = Writer::new();
        w.string(1, "a/b/leader").string(2, "nope");
        let m = w.finish();
        let mut b = vec![0];
        b.extend_from_slice(&(m.len() as u32).to_be_bytes());
        b.extend(m);
        let a = check_keyed(Table::Fresh(&p), ALICE, Method::Campaign, &b, None, 4096).unwrap();
        assert_eq!((a.class_label, a.waits), ("_unknown", true));
    }

    #[test]
    fn early_size_check() {
        assert!(!body_too_large(4101, 4096));
        assert!(body_too_large(4102, 4096));
    }
}
