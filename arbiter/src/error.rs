//! Domain errors of the arbiter and their one mapping to `tonic::Status`.
//!
//! Every refusal carries a `google.rpc.ErrorInfo` whose `reason` is the name of
//! a `latchkey.lock.v1.Reason` value (without the `REASON_` prefix). Messages
//! say what a person can do; none of them ever contains a fencing token.

use latchkey_proto::ERROR_DOMAIN;
use latchkey_proto::lockv1::Reason;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The cause under a [`ArbiterError::StoreUnavailable`] or an
/// [`ArbiterError::Internal`], shared: one failed batch answers every member
/// with it.
pub type StoreCause = std::sync::Arc<dyn std::error::Error + Send + Sync>;

/// The one message for every authorisation refusal, whether or not the key
/// exists or is held (ADR-19: no existence leak through errors).
pub const NOT_AUTHORISED_MESSAGE: &str = "this identity has no prefix grant covering the key; ask the key's owners to add one in policies/";

#[derive(Debug, thiserror::Error)]
pub enum ArbiterError {
    #[error("no verified SPIFFE identity on this call: {detail}")]
    Unauthenticated { detail: String },
    #[error("{}", NOT_AUTHORISED_MESSAGE)]
    NotAuthorised,
    #[error("this call needs the operator role; operators are listed in the policies/ grant files")]
    NotOperator,
    #[error(
        "this arbiter serves workloads only through the edge (Envoy with the Latchkey filter); call your sidecar, not the arbiter (operators may call directly)"
    )]
    DirectCallRefused,
    #[error("{0}")]
    BadKey(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("unknown lock class {class:?}; the classes are defined in the policies/ files")]
    UnknownClass { class: String },
    #[error(
        "session {session:#x} is unknown, expired or not yours; open a new session and acquire again"
    )]
    SessionExpired { session: i64 },
    #[error(
        "session {session:#x} has a TTL of {session_ttl}s but class {class:?} needs {class_ttl}s; open a session for this class"
    )]
    SessionClassMismatch {
        session: i64,
        session_ttl: u32,
        class: String,
        class_ttl: u32,
    },
    /// With the tiers split: the class is of the other tier than the key.
    #[error("{0}")]
    WrongTier(String),
    /// The namespace is bound to the other tier than the policies say, or
    /// the coord tier is not ready for it (an operator must act).
    #[error("{0}")]
    TierBound(String),
    /// The namespace cannot be served on its tier just now; retry.
    #[error("{0}")]
    TierMoving(String),
    /// The key's range is moving between entity shards (ADR-09); retry.
    #[error("{0}")]
    RangeMoving(String),
    /// With the tiers split: the session lives on the other tier's cluster
    /// (answered like a session of another TTL: open one for this class).
    #[error("{0}")]
    SessionWrongTier(String),
    #[error("key {key:?} is held by another session")]
    Held { key: String },
    #[error(
        "key {key:?} is already held by this client instance ({instance:?}) under session {holder_session:#x}, and this call asks under session {session:#x}: a leaked lock, not contention; release it from that session or let it expire (replicas that share an identity must name different instances, which the client libraries do by default)"
    )]
    Leak {
        key: String,
        holder_session: i64,
        session: i64,
        instance: String,
    },
    #[error("timed out waiting for key {key:?}: still held when the call's deadline came")]
    WaitTimeout { key: String },
    #[error("too many waiters queued for key {key:?} (limit {limit} for its class); retry later")]
    QueueFull { key: String, limit: u32 },
    #[error(
        "this identity already has {share} Acquire calls waiting for key {key:?} at this arbiter: its share of the key's {limit} waiter places (half its class's maxWaitersPerKey, rounded up; the rest are kept for other callers); retry later, or try-lock with WAIT_NONE"
    )]
    QueueShareFull { key: String, share: u32, limit: u32 },
    #[error(
        "this identity already has {limit} Acquire calls waiting at this arbiter (its --max-waiters-per-identity); let some finish or cancel them, or try-lock with WAIT_NONE"
    )]
    TooManyWaiters { limit: u32 },
    #[error("{}", bound.message(*limit))]
    IdentityLimit { bound: IdentityBound, limit: u32 },
    #[error("key {key:?} is not held by session {session:#x} (released, expired or never granted)")]
    NotHeld { key: String, session: i64 },
    #[error(
        "nothing downgraded: key {key:?} is not held exclusively by this session at the token downgrade_from names (the hold ended: released, expired, maxHoldSeconds, force-released, epoch advanced), nor shared by that downgrade; a writer may have held it since, so acquire it again and read afresh"
    )]
    DowngradeNotHeld { key: String },
    #[error(
        "the grant that covers this key is for class(es) {allowed:?} only, not {class:?}: acquire it with one of them"
    )]
    ClassNotGranted { class: String, allowed: Vec<String> },
    #[error(
        "{subject} already holds {max} lock(s) of class {class:?}, the most its maxHoldsPerSubject allows at once: release one first"
    )]
    QuotaExceeded {
        class: String,
        subject: String,
        max: u32,
    },
    #[error(
        "key {key:?} is held as a {held_as} now, and this call asks for it as a {asked_as}: a key is one kind at a time; use one class kind per key"
    )]
    KindInUse {
        key: String,
        held_as: &'static str,
        asked_as: &'static str,
    },
    #[error("{0}")]
    BadSlot(String),
    #[error(
        "this session holds {key:?} shared, and a shared hold is never upgraded (two readers upgrading would wait for each other forever): release it, then acquire {key:?} exclusively"
    )]
    UpgradeRefused { key: String },
    #[error(
        "semaphore {key:?} is held under class {held_class:?}, and a semaphore's permits are its class's: acquire it with class {held_class:?}, not {class:?}"
    )]
    ClassInUse {
        key: String,
        held_class: String,
        class: String,
    },
    #[error(
        "the token does not match the current grant of key {key:?}; release with the token the grant returned"
    )]
    TokenMismatch { key: String },
    #[error(
        "session {session:#x} does not lead election {election:?} with this token (the leadership resigned, expired, was forced out or handed over); campaign again"
    )]
    NotLeader { election: String, session: i64 },
    #[error(
        "class {class:?} is a {kind} class; {call} takes a {wanted} class (kind = \"{wanted}\" in the policies)"
    )]
    WrongKind {
        class: String,
        kind: &'static str,
        wanted: &'static str,
        call: &'static str,
    },
    #[error("{0}")]
    NoCandidate(String),
    #[error(
        "{reason}; no grants until an operator runs `latchctl admin advance-epoch --expected {epoch} --reason ...`"
    )]
    Sealed { reason: String, epoch: u32 },
    #[error("{message}")]
    HookDenied {
        code: Code,
        reason_code: String,
        message: String,
    },
    /// The lock cluster was fenced (ADR-09: a key range moved) at a shard
    /// map newer than the one this arbiter routes by: it grants nothing
    /// there until it has loaded that map.
    #[error(
        "this lock cluster is fenced at shard map version {cluster}, and this arbiter routes by version {arbiter}: it is reloading the map; retry (an arbiter that does not follow the shard map cannot serve a sharded lock cluster)"
    )]
    ShardMapAhead { cluster: u64, arbiter: u64 },
    #[error("the lock log (etcd) is unavailable: {detail}; retry with backoff")]
    StoreUnavailable {
        detail: String,
        /// What failed underneath, when it was an error of its own (the
        /// store's answer, a spool write): kept for the logs up to where the
        /// error becomes a status. `detail` already says it in words.
        #[source]
        source: Option<StoreCause>,
    },
    /// A closed class refused while the lock cluster has no quorum
    /// (ADR-04), before anything was sent to etcd: nothing was written.
    /// The same status and reason as [`Self::StoreUnavailable`].
    #[error("the lock log (etcd) is unavailable: {detail}; retry with backoff")]
    ClosedOnQuorumLoss { detail: String },
    /// New work refused so that established sessions keep renewing
    /// ([`crate::overload`]).
    #[error(
        "this arbiter is overloaded{}: new {work} calls are refused so that established sessions keep renewing; retry with backoff (at least {} ms)",
        if *renewals_late { " (renewals are running late)" } else { "" },
        retry_after.as_millis()
    )]
    Overloaded {
        work: &'static str,
        retry_after: std::time::Duration,
        renewals_late: bool,
    },
    #[error("internal error: {detail}")]
    Internal {
        detail: String,
        /// What failed underneath, when it was an error of its own (a state
        /// directory write, a record that does not parse): kept for the logs
        /// up to where the error becomes a status. `detail` already says it
        /// in words.
        #[source]
        source: Option<StoreCause>,
    },
}

impl ArbiterError {
    pub fn reason(&self) -> Reason {
        match self {
            Self::Unauthenticated { .. } => Reason::Unauthenticated,
            Self::NotAuthorised
            | Self::NotOperator
            | Self::DirectCallRefused
            | Self::ClassNotGranted { .. } => Reason::NotAuthorised,
            Self::BadKey(_) => Reason::BadKey,
            Self::BadRequest(_) | Self::Internal { .. } => Reason::BadRequest,
            Self::UnknownClass { .. } => Reason::UnknownClass,
            Self::SessionExpired { .. } => Reason::SessionExpired,
            Self::SessionClassMismatch { .. } | Self::SessionWrongTier(_) => {
                Reason::SessionClassMismatch
            }
            Self::WrongTier(_) | Self::TierBound(_) => Reason::WrongTier,
            Self::TierMoving(_) => Reason::TierMoving,
            Self::RangeMoving(_) => Reason::RangeMoving,
            Self::Held { .. } => Reason::Held,
            Self::Leak { .. } => Reason::Leak,
            Self::WaitTimeout { .. } => Reason::WaitTimeout,
            Self::QueueFull { .. } | Self::QueueShareFull { .. } | Self::TooManyWaiters { .. } => {
                Reason::QueueFull
            }
            Self::IdentityLimit { .. } => Reason::IdentityLimit,
            Self::NotHeld { .. } | Self::DowngradeNotHeld { .. } => Reason::NotHeld,
            Self::QuotaExceeded { .. } => Reason::QuotaExceeded,
            Self::KindInUse { .. } | Self::ClassInUse { .. } => Reason::KindInUse,
            Self::BadSlot(_) => Reason::BadSlot,
            Self::UpgradeRefused { .. } => Reason::UpgradeRefused,
            Self::TokenMismatch { .. } => Reason::TokenMismatch,
            Self::NotLeader { .. } => Reason::NotLeader,
            Self::WrongKind { .. } => Reason::WrongKind,
            Self::NoCandidate(_) => Reason::NoCandidate,
            Self::Sealed { .. } => Reason::Sealed,
            Self::HookDenied { .. } => Reason::HookDenied,
            Self::ShardMapAhead { .. } => Reason::ShardMapChanged,
            Self::StoreUnavailable { .. } | Self::ClosedOnQuorumLoss { .. } => {
                Reason::StoreUnavailable
            }
            Self::Overloaded { .. } => Reason::Overloaded,
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Self::Unauthenticated { .. } => Code::Unauthenticated,
            Self::NotAuthorised
            | Self::NotOperator
            | Self::DirectCallRefused
            | Self::ClassNotGranted { .. } => Code::PermissionDenied,
            Self::BadKey(_)
            | Self::BadRequest(_)
            | Self::UnknownClass { .. }
            | Self::SessionClassMismatch { .. }
            | Self::SessionWrongTier(_)
            | Self::WrongKind { .. }
            | Self::BadSlot(_)
            | Self::WrongTier(_) => Code::InvalidArgument,
            Self::Held { .. } => Code::Aborted,
            Self::WaitTimeout { .. } => Code::DeadlineExceeded,
            Self::QueueFull { .. }
            | Self::QueueShareFull { .. }
            | Self::TooManyWaiters { .. }
            | Self::IdentityLimit { .. } => Code::ResourceExhausted,
            Self::Leak { .. }
            | Self::SessionExpired { .. }
            | Self::NotHeld { .. }
            | Self::DowngradeNotHeld { .. }
            | Self::QuotaExceeded { .. }
            | Self::KindInUse { .. }
            | Self::ClassInUse { .. }
            | Self::UpgradeRefused { .. }
            | Self::TokenMismatch { .. }
            | Self::NotLeader { .. }
            | Self::NoCandidate(_)
            | Self::Sealed { .. }
            | Self::TierBound(_) => Code::FailedPrecondition,
            Self::TierMoving(_) | Self::RangeMoving(_) | Self::ShardMapAhead { .. } => {
                Code::Unavailable
            }
            Self::HookDenied { code, .. } => *code,
            Self::StoreUnavailable { .. }
            | Self::ClosedOnQuorumLoss { .. }
            | Self::Overloaded { .. } => Code::Unavailable,
            Self::Internal { .. } => Code::Internal,
        }
    }

    /// Worth retrying the same request later without any change.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::StoreUnavailable { .. }
                | Self::ClosedOnQuorumLoss { .. }
                | Self::Overloaded { .. }
                | Self::Held { .. }
                | Self::TierMoving(_)
                | Self::RangeMoving(_)
                | Self::ShardMapAhead { .. }
        )
    }

    pub fn store(detail: impl std::fmt::Display) -> Self {
        Self::StoreUnavailable {
            detail: detail.to_string(),
            source: None,
        }
    }

    /// [`Self::store`] caused by `source`, which stays its error source.
    pub fn store_caused(
        detail: impl std::fmt::Display,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::StoreUnavailable {
            detail: detail.to_string(),
            source: Some(std::sync::Arc::new(source)),
        }
    }

    /// A failure of the arbiter itself, with nothing underneath to keep.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        Self::Internal {
            detail: detail.to_string(),
            source: None,
        }
    }

    /// [`Self::internal`] caused by `source`, which stays its error source.
    pub fn internal_caused(
        detail: impl std::fmt::Display,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Internal {
            detail: detail.to_string(),
            source: Some(std::sync::Arc::new(source)),
        }
    }
}

/// A per-identity bound of the arbiter, other than waiting calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityBound {
    /// Open sessions (`--max-sessions-per-identity`).
    Sessions,
    /// Keys held (`--max-holds-per-identity`).
    Holds,
    /// Elections led (`--max-holds-per-identity`: a leadership is a hold).
    Leaderships,
    /// Observe streams open at this arbiter.
    Observers,
    /// Campaign calls waiting at this arbiter.
    Campaigns,
    /// Elections whose term records the subject made.
    Elections,
    /// Bytes of the quorum-loss spool (a share of
    /// `--quorum-loss-spool-bytes`), so one identity cannot fill it for all.
    Spool,
}

impl IdentityBound {
    fn message(self, limit: u32) -> String {
        match self {
            Self::Sessions => format!(
                "this identity has {limit} open sessions (the arbiter's --max-sessions-per-identity); reuse one session per lock class (OpenSession's reuse_session_ids) and close sessions you no longer need"
            ),
            Self::Leaderships => format!(
                "this identity leads {limit} elections (the arbiter's --max-holds-per-identity, which counts leaderships too); resign the leaderships you no longer need"
            ),
            Self::Observers => format!(
                "this identity has {limit} Observe streams open at this arbiter; observe each election once and share the stream"
            ),
            Self::Elections => format!(
                "this identity has started {limit} elections (each keeps its term record until an epoch advance, so that terms never go back); campaign in the elections it has, under fewer names"
            ),
            Self::Campaigns => format!(
                "this identity has {limit} Campaign calls waiting at this arbiter; one campaign per election and session is enough"
            ),
            Self::Holds => format!(
                "this identity holds {limit} keys (the arbiter's --max-holds-per-identity); release the keys you no longer need before taking more"
            ),
            Self::Spool => format!(
                "this identity has used its share ({limit} bytes) of the quorum-loss spool that records unprotected grants while the lock cluster has no quorum; no more unprotected grants for it until quorum returns"
            ),
        }
    }

    /// The metric label.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Sessions => "sessions",
            Self::Holds => "holds",
            Self::Spool => "spool",
            Self::Leaderships => "leaderships",
            Self::Observers => "observers",
            Self::Campaigns => "campaigns",
            Self::Elections => "elections",
        }
    }
}

/// The reason's wire name: `REASON_HELD` -> `HELD`.
pub fn reason_name(reason: Reason) -> &'static str {
    let name = reason.as_str_name();
    name.strip_prefix("REASON_").unwrap_or(name)
}

/// The causes under `err`, each in its own words, outermost first, joined
/// by ": " (empty: nothing underneath). For the logs: a status says only the
/// error's own message.
pub fn source_chain(err: &dyn std::error::Error) -> String {
    let mut chain = String::new();
    let mut next = err.source();
    while let Some(cause) = next {
        if !chain.is_empty() {
            chain.push_str(": ");
        }
        chain.push_str(&cause.to_string());
        next = cause.source();
    }
    chain
}

impl From<ArbiterError> for Status {
    fn from(err: ArbiterError) -> Status {
        // Where the cause is kept for: logged once, here, as the error
        // becomes a status (which says only the error's own message). No
        // error of these kinds carries a token.
        match &err {
            ArbiterError::Internal { .. } => tracing::warn!(
                error = %err,
                source_chain = %source_chain(&err),
                "internal error answered"
            ),
            // Per call, as the store's other refusals (an outage answers
            // every call with one).
            ArbiterError::StoreUnavailable { .. } => tracing::debug!(
                error = %err,
                source_chain = %source_chain(&err),
                "lock log unavailable answered"
            ),
            _ => {}
        }
        let mut details = ErrorDetails::new();
        let mut metadata = std::collections::HashMap::new();
        if let ArbiterError::HookDenied { reason_code, .. } = &err {
            metadata.insert("hookReason".to_string(), reason_code.clone());
        }
        if let ArbiterError::Overloaded { retry_after, .. } = &err {
            // google.rpc.RetryInfo, and gRPC's own pushback header, which
            // clients with a retry policy honour.
            details.set_retry_info(Some(*retry_after));
        }
        details.set_error_info(reason_name(err.reason()), ERROR_DOMAIN, metadata);
        let mut status = Status::with_error_details(err.code(), err.to_string(), details);
        if let ArbiterError::Overloaded { retry_after, .. } = &err
            && let Ok(ms) = retry_after.as_millis().to_string().parse()
        {
            status.metadata_mut().insert("grpc-retry-pushback-ms", ms);
        }
        status
    }
}

/// A lock log's error where it becomes the arbiter's: a lease gone is the
/// session's end; anything else is the store failing, its cause kept as the
/// source (a malformed answer included: the caller may retry, and the
/// detail says what was wrong).
impl From<crate::lock_log::StoreError> for ArbiterError {
    fn from(e: crate::lock_log::StoreError) -> Self {
        match e {
            crate::lock_log::StoreError::LeaseGone { lease } => {
                ArbiterError::SessionExpired { session: lease }
            }
            other => ArbiterError::store_caused(other.detail(), other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_carries_reason_and_code() {
        let status: Status = ArbiterError::Held { key: "a/b".into() }.into();
        assert_eq!(status.code(), Code::Aborted);
        let details = status.get_error_details();
        let info = details.error_info();
        assert_eq!(info.map(|i| i.reason.as_str()), Some("HELD"));
        assert_eq!(info.map(|i| i.domain.as_str()), Some(ERROR_DOMAIN));
    }

    #[test]
    fn a_shard_map_ahead_is_unavailable_and_retried() {
        let err = ArbiterError::ShardMapAhead {
            cluster: 3,
            arbiter: 2,
        };
        assert!(err.is_transient());
        let status: Status = err.into();
        assert_eq!(status.code(), Code::Unavailable);
        let details = status.get_error_details();
        let info = details.error_info();
        assert_eq!(info.map(|i| i.reason.as_str()), Some("SHARD_MAP_CHANGED"));
        assert!(
            status
                .message()
                .starts_with("this lock cluster is fenced at shard map version 3, and this arbiter routes by version 2"),
            "{}",
            status.message()
        );
    }

    /// Issue 32: a cause kept as the source changes nothing a client sees,
    /// and the chain under it is there for the log.
    #[test]
    fn a_kept_cause_leaves_the_status_as_it_was() {
        let io = || std::io::Error::other("disk full");
        for (bare, caused) in [
            (
                ArbiterError::internal("cannot write: disk full"),
                ArbiterError::internal_caused("cannot write: disk full", io()),
            ),
            (
                ArbiterError::store("cannot write: disk full"),
                ArbiterError::store_caused("cannot write: disk full", io()),
            ),
        ] {
            assert_eq!(source_chain(&bare), "");
            assert_eq!(source_chain(&caused), "disk full");
            let (bare, caused): (Status, Status) = (bare.into(), caused.into());
            assert_eq!(bare.code(), caused.code());
            assert_eq!(bare.message(), caused.message());
            assert_eq!(bare.details(), caused.details());
        }
    }

    #[test]
    fn denial_message_is_fixed() {
        let status: Status = ArbiterError::NotAuthorised.into();
        assert_eq!(status.code(), Code::PermissionDenied);
        assert_eq!(status.message(), NOT_AUTHORISED_MESSAGE);
    }
}
