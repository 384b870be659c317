//! Two-person force-release (ADR-20): an operator requests, a different
//! operator approves, and one etcd transaction ends the hold.
//!
//! A request flows: the admin handler checks the channel identity (an
//! operator SVID) → [`ForceRelease`] verifies the caller's OIDC ID token
//! ([`crate::oidc`]) → the hold is read and a request record is written
//! under `{prefix}/sys/force-req/<id>` on a lease of its own (default 15
//! min: an unapproved request expires with it), only if the hold is still
//! the one read. An approval verifies its own token, refuses the requester's
//! `sub`, then asks the key's owner ([`KeyOwner::force_end`], the lock log's
//! `force_end`) for ONE transaction: compare the holder record's lease and
//! mod revision with the request's and the request's own revision; delete
//! the hold and its claims, put the force record under
//! `{prefix}/sys/force/<id>` on a 24 h lease, delete the request. The owner
//! wakes the key's waiters on this arbiter. The holder's KeepAlive stream hears that its hold ended from the
//! holds' watch (`hold_counts`), like any other end of a hold.
//!
//! That transaction runs through its own etcd client, logged in as a user
//! whose role may touch only the keys it needs (docs/security.md); revoking
//! the holder's session (asked for with the request) needs write access to
//! every key on the session's lease, so it uses the arbiter's own client,
//! after the transaction: one transaction deletes the session's record (no
//! grant on it from then on) and writes a `sys/revoked/<lease>` marker,
//! then `LeaseRevoke` ends its holds, which the audit tailer records as
//! `force-revoked` ([`RevokeRecord`]). Nothing is written on any refusal, and no token
//! (fencing or ID) ever reaches a record, a log line or an error.
//!
//! A request may name an election instead of a key (issue 33): then it is
//! the election's current leadership that ends. The request reads the
//! leader record and the term record and shows the leader (identity,
//! session), the term, the class and its enforcement — never the token:
//! the term record's mod revision, which with the epoch is the leader's
//! token, is kept in the stored request for the approval's compare only.
//! The approval asks the election's owner ([`Elections::force_end`], the
//! lock log's `force_end_term`) for ONE transaction: compare the leader
//! record's lease and the term record's mod revision with the request's
//! and the request's own revision; delete the leader record and the
//! leadership's entry, mark the term record ended by the operators (every
//! observer hears a `FORCED` vacancy of that term, the leader's own
//! client included), put the force record, delete the request. A request
//! for a key never ends a leadership and one for an election never ends
//! a hold: each reads and compares only its own records (`l/<key>` or
//! `e/<name>//`), and its pending place is its kind's.

pub mod etcd;

use std::sync::Arc;
use std::time::Duration;

use latchkey_policies::Enforcement;
use latchkey_proto::ERROR_DOMAIN;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::config::EtcdUser;
use crate::election::{Elections, ForcedTerm};
use crate::error::ArbiterError;
use crate::lock_log::StoreError;
use crate::oidc::{OidcConfig, OidcError, OidcVerifier, SignedIn};
use crate::owner::{
    ForceEndTxn, ForceEnded, ForceRecords, KeyOwner, RevokeSessionTxn, SessionRevoked,
};
use crate::records::encode;
use latchkey_records::force as force_names;

/// How long a request waits for its approver by default.
pub const DEFAULT_REQUEST_TTL: Duration = Duration::from_secs(15 * 60);
/// How long a force record stays in etcd (the audit tailer copies it first).
pub const FORCE_RECORD_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// What an approver of an advisory class's force-release is told.
pub const ADVISORY_WARNING: &str = "this class is ADVISORY: nothing fences its resource, so the current holder may still be writing when the next holder starts. Two writers may follow this release. Stop the holder first if you can.";

/// Force-release settings (none of it: force-release refused).
#[derive(Debug, Clone)]
pub struct ForceReleaseConfig {
    /// The provider operators sign in with; `None`: force-release is off.
    pub oidc: Option<OidcConfig>,
    /// The restricted etcd user the transaction runs as; `None`: the
    /// arbiter's own credentials (logged as a warning at start).
    pub etcd_user: Option<EtcdUser>,
    /// How long a request waits for its approval.
    pub request_ttl: Duration,
}

impl Default for ForceReleaseConfig {
    fn default() -> Self {
        Self {
            oidc: None,
            etcd_user: None,
            request_ttl: DEFAULT_REQUEST_TTL,
        }
    }
}

/// The stored records: a pending request, a force record and a revoked
/// session's marker (`latchkey_records::force`, shared with the audit
/// tailer, with their keys).
pub use latchkey_records::force::{ForceRecord, RequestRecord, RevokeRecord};

/// Pending (unapproved, unexpired) force-release requests one operator may
/// have at once.
pub const MAX_PENDING_PER_OPERATOR: usize = 16;

/// Why a force-release call is refused. Messages say what to do next.
#[derive(Debug, thiserror::Error)]
pub enum ForceError {
    #[error(
        "force-release is off on this arbiter: start it with --oidc-issuer and --oidc-audience (operators sign in with OIDC), and preferably --force-etcd-user/--force-etcd-password-file (docs/security.md)"
    )]
    Disabled,
    // Its message, and its causes (the provider's error) as its own.
    #[error(transparent)]
    Token(OidcError),
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "key {key:?} is not held as named: there is nothing to release (a shared hold is named by its holder's session, a semaphore's by its slot: `latchctl inspect` lists them)"
    )]
    NotHeld { key: String },
    #[error(
        "election {election:?} has no leader: there is nothing to release (a lock key of that name is released without --election)"
    )]
    NoLeader { election: String },
    #[error(
        "no pending force-release request {id:?}: it never existed, was approved already, or expired unapproved (requests last {ttl_minutes} min); request again"
    )]
    UnknownRequest { id: String, ttl_minutes: u64 },
    #[error(
        "{subject:?} requested this force-release and cannot approve it too: a different operator must approve (two-person rule)"
    )]
    SameApprover { subject: String },
    #[error(
        "the hold on {key:?} changed since the request ({now}): nothing was released. Look again (latchctl inspect) and request again if it is still stuck"
    )]
    HoldChanged { key: String, now: String },
    #[error(
        "the leadership of election {election:?} changed since the request ({now}): nothing was released. Look again (latchctl leader) and request again if it is still stuck"
    )]
    TermChanged { election: String, now: String },
    #[error(
        "{what} already has a pending force-release request {id:?}: approve that one (latchctl admin force-release list) instead of requesting again"
    )]
    AlreadyRequested {
        /// "the hold on \"k\"", or "the leadership of election \"e\"".
        what: String,
        id: String,
    },
    #[error(
        "{subject:?} has {limit} force-release requests pending: wait for approvals, or for requests to expire, before requesting more"
    )]
    TooManyPending { subject: String, limit: usize },
    #[error("the lock log (etcd) is unavailable: {detail}; retry")]
    Store {
        detail: String,
        /// What failed underneath (the store's error), for logs.
        #[source]
        source: Option<crate::error::StoreCause>,
    },
    #[error(
        "etcd refused the force-release transaction ({0}): the force-release user's role lacks a permission docs/security.md lists"
    )]
    StorePermission(String),
}

impl ForceError {
    /// The store is unavailable, with nothing underneath to keep.
    pub fn store(detail: impl Into<String>) -> Self {
        Self::Store {
            detail: detail.into(),
            source: None,
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Self::Disabled
            | Self::NotHeld { .. }
            | Self::HoldChanged { .. }
            | Self::NoLeader { .. }
            | Self::TermChanged { .. } => Code::FailedPrecondition,
            Self::Token(e) if e.is_permission() => Code::PermissionDenied,
            Self::Token(OidcError::Provider(_)) => Code::Unavailable,
            Self::Token(_) => Code::Unauthenticated,
            Self::BadRequest(_) => Code::InvalidArgument,
            Self::UnknownRequest { .. } => Code::NotFound,
            Self::SameApprover { .. } => Code::PermissionDenied,
            Self::AlreadyRequested { .. } => Code::AlreadyExists,
            Self::TooManyPending { .. } => Code::ResourceExhausted,
            Self::Store { .. } => Code::Unavailable,
            Self::StorePermission(_) => Code::Internal,
        }
    }

    /// `google.rpc.ErrorInfo.reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Disabled => "FORCE_RELEASE_DISABLED",
            Self::Token(e) if e.is_permission() => "OPERATOR_ROLE_MISSING",
            Self::Token(OidcError::Provider(_)) => "OIDC_PROVIDER_UNAVAILABLE",
            Self::Token(_) => "ID_TOKEN_INVALID",
            Self::BadRequest(_) => "BAD_REQUEST",
            Self::NotHeld { .. } => "NOT_HELD",
            Self::UnknownRequest { .. } => "FORCE_REQUEST_NOT_FOUND",
            Self::SameApprover { .. } => "SAME_APPROVER",
            Self::HoldChanged { .. } => "HOLD_CHANGED",
            Self::NoLeader { .. } => "NO_LEADER",
            Self::TermChanged { .. } => "TERM_CHANGED",
            Self::AlreadyRequested { .. } => "FORCE_REQUEST_PENDING",
            Self::TooManyPending { .. } => "TOO_MANY_FORCE_REQUESTS",
            Self::Store { .. } => "STORE_UNAVAILABLE",
            Self::StorePermission(_) => "STORE_PERMISSION",
        }
    }
}

impl From<ForceError> for Status {
    fn from(err: ForceError) -> Status {
        let mut details = ErrorDetails::new();
        details.set_error_info(
            err.reason(),
            ERROR_DOMAIN,
            std::collections::HashMap::<String, String>::new(),
        );
        Status::with_error_details(err.code(), err.to_string(), details)
    }
}

/// What an approval did.
#[derive(Debug, Clone)]
pub struct Approved {
    pub request: RequestRecord,
    pub record: ForceRecord,
    pub revision: i64,
    /// The revocation marker, when the request also revokes the holder's
    /// session: [`revoke_session`] with it, on the session's home cluster.
    pub revoke: Option<RevokeRecord>,
}

/// Revokes the session an approved force-release names, through `owner`,
/// the key owner of the cluster the session lives on (its home: the
/// entity or coord cluster, never a shard that holds only its shadow),
/// with the marker the approval made. `counted_as`: the grant subject the
/// session is counted against.
pub async fn revoke_session(
    owner: &KeyOwner,
    counted_as: &str,
    marker: &RevokeRecord,
) -> Result<SessionRevoked, StoreError> {
    owner
        .revoke_session(RevokeSessionTxn {
            session: marker.session,
            counted_as,
            marker: &encode(marker),
            marker_ttl_seconds: u32::try_from(FORCE_RECORD_TTL.as_secs()).unwrap_or(u32::MAX),
        })
        .await
}

/// A revocation's outcome as the admin API says it: `Ok` revoked now,
/// `Err` why not.
pub fn revocation_said(revoked: &Result<SessionRevoked, StoreError>) -> Result<(), String> {
    match revoked {
        Ok(SessionRevoked::Revoked) => Ok(()),
        Ok(SessionRevoked::RecordGone) => Err(
            "the session's record was already gone (closed or expiring); its lease is revoked"
                .to_string(),
        ),
        Ok(SessionRevoked::Ended) => Err("the session had already ended".to_string()),
        Err(e) => Err(e.detail()),
    }
}

/// The force-release path: token checks, then the store.
pub struct ForceRelease {
    verifier: OidcVerifier,
    store: etcd::ForceStore,
    request_ttl: Duration,
}

impl std::fmt::Debug for ForceRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForceRelease")
            .field("verifier", &self.verifier)
            .field("request_ttl", &self.request_ttl)
            .finish_non_exhaustive()
    }
}

/// `fenced`, `advisory`, or `unknown` for a class no longer in the policies.
pub fn enforcement_name(enforcement: Option<Enforcement>) -> &'static str {
    match enforcement {
        Some(Enforcement::Fenced) => "fenced",
        Some(Enforcement::Advisory) => "advisory",
        None => "unknown",
    }
}

/// What a force-release ends: the hold on a key, or an election's current
/// leadership (its term). Each kind reads and compares only its own
/// records, so one never ends the other of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Hold,
    Leadership,
}

/// What a request read of its target, for the request record.
struct Read {
    holder_identity: String,
    holder_session: i64,
    lease: i64,
    revision: i64,
    class: String,
    term: u64,
}

/// The plain warning an approver must see, if any.
pub fn warning_for(enforcement: &str) -> &'static str {
    match enforcement {
        "fenced" => "",
        "advisory" => ADVISORY_WARNING,
        _ => {
            "this hold's class is no longer in the policies, so nothing says its resource is fenced: treat it as advisory. Two writers may follow this release."
        }
    }
}

impl ForceRelease {
    pub fn new(
        verifier: OidcVerifier,
        store: etcd::ForceStore,
        request_ttl: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            verifier,
            store,
            request_ttl,
        })
    }

    /// The signed-in operator behind `id_token`.
    pub async fn sign_in(&self, id_token: &str) -> Result<SignedIn, ForceError> {
        self.verifier
            .verify(id_token)
            .await
            .map_err(ForceError::Token)
    }

    /// Writes a request for the hold `key` has now, or (`Target::Leadership`)
    /// for election `key`'s current leadership. `enforcement` names the
    /// class's enforcement (looked up by the caller in the policies in force).
    #[allow(clippy::too_many_arguments)]
    pub async fn request(
        &self,
        requester: &SignedIn,
        requester_identity: &str,
        target: Target,
        key: &str,
        reason: &str,
        revoke_session: bool,
        enforcement: impl Fn(&str) -> Option<Enforcement>,
    ) -> Result<RequestRecord, ForceError> {
        // Shown to the approver and kept in the audit trail: one line of
        // printable text (latchkey_proto::text says why).
        let reason = latchkey_proto::text::checked(reason, "a force-release reason", 512)
            .map_err(ForceError::BadRequest)?;
        let read = match target {
            Target::Hold => {
                let hold = self
                    .store
                    .hold(key)
                    .await?
                    .ok_or_else(|| ForceError::NotHeld {
                        key: crate::records::named_key(key).into(),
                    })?;
                Read {
                    holder_identity: hold.record.identity,
                    holder_session: hold.record.session,
                    lease: hold.lease,
                    revision: hold.mod_revision,
                    class: hold.record.class,
                    term: 0,
                }
            }
            Target::Leadership => {
                let led =
                    self.store
                        .leadership(key)
                        .await?
                        .ok_or_else(|| ForceError::NoLeader {
                            election: key.into(),
                        })?;
                Read {
                    holder_identity: led.record.identity.clone(),
                    holder_session: led.record.session,
                    lease: led.lease,
                    revision: led.term_revision,
                    term: led.record.term(),
                    class: led.record.class,
                }
            }
        };
        let now = crate::records::now_unix_ms();
        // Bounded: one pending request per hold, and a few per operator.
        // Both bounds are places in etcd that the request's own put takes
        // in the same transaction (ForceStore::put_request), so requests
        // racing on any number of arbiters cannot pass them; this read
        // only picks which free place to try first.
        let taken = self.store.taken_places(&requester.subject).await?;
        let Some(place) = (0..MAX_PENDING_PER_OPERATOR as u32).find(|p| !taken.contains(p)) else {
            return Err(ForceError::TooManyPending {
                subject: requester.subject.clone(),
                limit: MAX_PENDING_PER_OPERATOR,
            });
        };
        let ttl_ms = i64::try_from(self.request_ttl.as_millis()).unwrap_or(i64::MAX);
        let record = RequestRecord {
            id: new_id()?,
            key: key.to_string(),
            enforcement: enforcement_name(enforcement(&read.class)).into(),
            holder_identity: read.holder_identity,
            holder_session: read.holder_session,
            hold_lease: read.lease,
            hold_revision: read.revision,
            class: read.class,
            reason: reason.to_string(),
            revoke_session,
            requester_subject: requester.subject.clone(),
            requester_identity: requester_identity.to_string(),
            requested_at_unix_ms: now,
            expires_at_unix_ms: now.saturating_add(ttl_ms),
            place: Some(place),
            election: target == Target::Leadership,
            term: read.term,
        };
        self.store.put_request(record, self.request_ttl).await
    }

    /// Approves request `id` as `approver` and has the owner on its
    /// cluster end what it names: the hold (`owner`, the keys'), or the
    /// leadership (`elections`).
    pub async fn approve(
        &self,
        owner: &KeyOwner,
        elections: &Elections,
        approver: &SignedIn,
        approver_identity: &str,
        id: &str,
    ) -> Result<Approved, ForceError> {
        let unknown = || ForceError::UnknownRequest {
            id: crate::service::truncate(id, 64),
            ttl_minutes: self.request_ttl.as_secs() / 60,
        };
        if !valid_id(id) {
            return Err(unknown());
        }
        let (request, request_revision) = self.store.request(id).await?.ok_or_else(unknown)?;
        if request.requester_subject == approver.subject {
            return Err(ForceError::SameApprover {
                subject: approver.subject.clone(),
            });
        }
        let record = ForceRecord {
            key: request.key.clone(),
            // A term's revision is its leader's token's: never recorded.
            hold_revision: match request.election {
                true => 0,
                false => request.hold_revision,
            },
            request_id: request.id.clone(),
            requested_by: request.requester_subject.clone(),
            approved_by: approver.subject.clone(),
            reason: request.reason.clone(),
            enforcement: request.enforcement.clone(),
            holder_identity: request.holder_identity.clone(),
            holder_session: request.holder_session,
            class: request.class.clone(),
            revoke_session: request.revoke_session,
            requested_at_unix_ms: request.requested_at_unix_ms,
            approved_at_unix_ms: crate::records::now_unix_ms(),
            revoked_session: request.revoke_session,
            issuer: approver.issuer.clone(),
            requester_identity: request.requester_identity.clone(),
            approver_identity: approver_identity.to_string(),
            election: request.election,
            term: request.term,
        };
        let records = ForceRecords {
            unchanged: vec![(force_names::request_name(&request.id), request_revision)],
            put: vec![(force_names::record_name(&request.id), encode(&record))],
            ttl_seconds: u32::try_from(FORCE_RECORD_TTL.as_secs()).unwrap_or(u32::MAX),
            delete: std::iter::once(force_names::request_name(&request.id))
                .chain(request.place_names())
                .collect(),
        };
        let ended = match request.election {
            false => {
                owner
                    .force_end(ForceEndTxn {
                        key: &request.key,
                        lease: request.hold_lease,
                        revision: request.hold_revision,
                        records: &records,
                    })
                    .await
            }
            true => {
                elections
                    .force_end(ForcedTerm {
                        election: &request.key,
                        session: request.hold_lease,
                        term_at: request.hold_revision,
                        records: &records,
                    })
                    .await
            }
        };
        let (ended, revision) = ended.map_err(force_error)?;
        match ended {
            ForceEnded::Ended => {}
            ForceEnded::RecordsChanged => return Err(unknown()),
            ForceEnded::HoldChanged { now } if request.election => {
                return Err(ForceError::TermChanged {
                    election: request.key.clone(),
                    now: etcd::describe_leader_now(now.as_ref(), request.term),
                });
            }
            ForceEnded::HoldChanged { now } => {
                return Err(ForceError::HoldChanged {
                    key: request.key.clone(),
                    now: etcd::describe_now(now.as_ref()),
                });
            }
        }
        // The session is revoked on its own cluster (its home, where its
        // record and lease are), which need not be the key's: the caller
        // does it (`revoke_session`), with the marker made here.
        let revoke = request.revoke_session.then(|| RevokeRecord {
            session: request.holder_session,
            key: request.key.clone(),
            request_id: request.id.clone(),
            requested_by: request.requester_subject.clone(),
            approved_by: approver.subject.clone(),
            reason: request.reason.clone(),
            holder_identity: request.holder_identity.clone(),
            revoked_at_unix_ms: crate::records::now_unix_ms(),
        });
        Ok(Approved {
            request,
            record,
            revision,
            revoke,
        })
    }

    /// Pending requests and the force records still in etcd.
    pub async fn list(&self) -> Result<(Vec<RequestRecord>, Vec<ForceRecord>), ForceError> {
        self.store.list().await
    }
}

/// The owner's error as the force-release path says it: etcd refusing the
/// force-release user a permission is its own reason (the role is
/// incomplete); anything else is the store being unavailable.
fn force_error(e: ArbiterError) -> ForceError {
    match e {
        ArbiterError::StoreUnavailable { detail, source } => {
            // The cause as it was stored (an `Arc`'s own place in a source
            // chain hides its type from a downcast: look inside it).
            let mut cause = source
                .as_deref()
                .map(|c| c as &(dyn std::error::Error + 'static));
            while let Some(c) = cause {
                if let Some(StoreError::Denied { context, .. }) = c.downcast_ref::<StoreError>() {
                    return ForceError::StorePermission(context.clone());
                }
                cause = c.source();
            }
            ForceError::Store { detail, source }
        }
        other => ForceError::store(other.to_string()),
    }
}

/// 128 random bits, hex: request ids are not guessable (the token checks
/// stand anyway; this keeps ids from being an oracle of activity).
fn new_id() -> Result<String, ForceError> {
    let mut bytes = [0u8; 16];
    getrandom::getrandom(&mut bytes)
        // getrandom's error (no_std) is not a std error: its text is all.
        .map_err(|e| ForceError::store(format!("no randomness for a request id: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn valid_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A permission etcd refused the force-release user is its own reason,
    /// through the conversions on its way up (review of issue 32); an
    /// outage stays one.
    #[test]
    fn a_denied_forced_end_is_a_permission_refusal() {
        let denied = StoreError::Denied {
            context: "cannot run the force-release transaction: permission denied".into(),
            source: None,
        };
        let e = force_error(ArbiterError::from(denied));
        assert_eq!(e.reason(), "STORE_PERMISSION", "{e}");
        assert!(e.to_string().contains("permission denied"), "{e}");
        let down = StoreError::unavailable("cannot run the force-release transaction");
        let e = force_error(ArbiterError::from(down));
        assert_eq!(e.reason(), "STORE_UNAVAILABLE", "{e}");
        // The store's error stays underneath, for the logs.
        assert!(std::error::Error::source(&e).is_some(), "{e:?}");
    }

    #[test]
    fn ids_are_random_hex_and_checked() {
        let (a, b) = (new_id().unwrap(), new_id().unwrap());
        assert_ne!(a, b);
        assert!(valid_id(&a) && valid_id(&b));
        assert!(!valid_id("../l/x"));
        assert!(!valid_id(""));
    }

    #[test]
    fn advisory_and_unknown_classes_warn_of_two_writers() {
        assert_eq!(warning_for("fenced"), "");
        assert!(warning_for("advisory").contains("Two writers may follow"));
        assert!(warning_for("unknown").contains("Two writers may follow"));
    }

    #[test]
    fn refusals_have_the_right_codes() {
        let codes = [
            (ForceError::Disabled, Code::FailedPrecondition),
            (ForceError::Token(OidcError::Expired), Code::Unauthenticated),
            (
                ForceError::Token(OidcError::NoRole {
                    claim: "roles".into(),
                    role: "r".into(),
                }),
                Code::PermissionDenied,
            ),
            (ForceError::Token(OidcError::NoMfa), Code::PermissionDenied),
            (
                ForceError::SameApprover {
                    subject: "a".into(),
                },
                Code::PermissionDenied,
            ),
            (
                ForceError::UnknownRequest {
                    id: "x".into(),
                    ttl_minutes: 15,
                },
                Code::NotFound,
            ),
            (
                ForceError::HoldChanged {
                    key: "k".into(),
                    now: "not held".into(),
                },
                Code::FailedPrecondition,
            ),
        ];
        for (err, code) in codes {
            assert_eq!(Status::from(err).code(), code);
        }
        let msg = ForceError::Disabled.to_string();
        assert!(msg.contains("--oidc-issuer"), "{msg}");
    }

    /// An election's refusals: their own reasons, FAILED_PRECONDITION; the
    /// leader now is named by identity, session and term, never by the
    /// revision the request compared (the token's).
    #[test]
    fn an_election_s_refusals_say_what_leads_now_and_no_token() {
        for (err, reason) in [
            (
                ForceError::NoLeader {
                    election: "jobs/s".into(),
                },
                "NO_LEADER",
            ),
            (
                ForceError::TermChanged {
                    election: "jobs/s".into(),
                    now: "it is vacant now".into(),
                },
                "TERM_CHANGED",
            ),
        ] {
            assert_eq!(err.reason(), reason);
            assert_eq!(Status::from(err).code(), Code::FailedPrecondition);
        }
        let lead = crate::records::LeadRecord {
            identity: "spiffe://d/w".into(),
            session: 0x77,
            class: "e".into(),
            epoch: 1,
            count: 3,
            value: String::new(),
            priority: 0,
            since_unix_ms: 1,
            instance: String::new(),
            bound: String::new(),
            yields: false,
        };
        let kv = crate::lock_log::Kv {
            value: encode(&lead),
            create_revision: 987_654,
            mod_revision: 987_655,
            lease: 0x77,
        };
        let now = etcd::describe_leader_now(Some(&kv), (1 << 32) + 2);
        assert!(
            now.contains("spiffe://d/w") && now.contains("0x77"),
            "{now}"
        );
        assert!(now.contains(&format!("term {}", (1u64 << 32) + 3)), "{now}");
        assert!(!now.contains("98765"), "a revision in {now}");
        assert_eq!(
            etcd::describe_leader_now(None, 5),
            "it is vacant now".to_string()
        );
    }

    /// A request stored before elections reads as a hold's; a hold's
    /// request and record are stored without the election fields.
    #[test]
    fn the_election_fields_are_additive() {
        let old = br#"{"id":"r","key":"k","holderIdentity":"i","holderSession":1,"holdLease":1,"holdRevision":2,"class":"c","enforcement":"fenced","reason":"x","revokeSession":false,"requesterSubject":"a","requesterIdentity":"o","requestedAtUnixMs":1,"expiresAtUnixMs":2}"#;
        let r: RequestRecord = crate::records::decode(old).unwrap();
        assert!(!r.election && r.term == 0);
        let json = String::from_utf8(encode(&r)).unwrap();
        assert!(
            !json.contains("election") && !json.contains("term"),
            "{json}"
        );
        let elected = RequestRecord {
            election: true,
            term: 7,
            ..r
        };
        let json = String::from_utf8(encode(&elected)).unwrap();
        assert!(json.contains(r#""election":true"#) && json.contains(r#""term":7"#));
    }

    #[test]
    fn the_force_record_carries_what_the_audit_tailer_reads() {
        let record = ForceRecord {
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
        };
        let json: serde_json::Value =
            serde_json::from_slice(&crate::records::encode(&record)).unwrap();
        for field in [
            "key",
            "holdRevision",
            "requestId",
            "requestedBy",
            "approvedBy",
            "reason",
            "enforcement",
            "holderIdentity",
            "holderSession",
            "class",
            "requestedAtUnixMs",
            "approvedAtUnixMs",
            "revokedSession",
        ] {
            assert!(json.get(field).is_some(), "{field} missing: {json}");
        }
    }
}
