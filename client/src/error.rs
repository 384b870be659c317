//! The one error type of the client, and the mapping from `tonic::Status`.

use std::path::PathBuf;

use latchkey_proto::lockv1::Reason;
use tonic::Code;
use tonic_types::StatusExt;

use crate::election::LeadershipLost;
use crate::session::FenceReason;

/// Everything a Latchkey call can fail with.
///
/// No variant carries a fencing token: tokens are capabilities and errors end
/// up in logs.
///
/// ```no_run
/// use std::time::Duration;
///
/// use latchkey_client::{Client, Error, Reason};
///
/// # async fn run(client: Client) -> Result<(), Error> {
/// loop {
///     match client.lock("jobs/a", "jobs").acquire(|_| {}).await {
///         Ok(guard) => break guard.release().await,
///         Err(err) if err.reason() == Reason::Held => break Ok(()), // someone else has it
///         Err(err) if err.is_transient() => {
///             eprintln!("{err}; {}", err.retry_hint().unwrap_or("retrying"));
///             tokio::time::sleep(Duration::from_secs(2)).await;
///         }
///         Err(err) => break Err(err), // e.g. PERMISSION_DENIED: NOT_AUTHORISED
///     }
/// }
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The arbiter (or Envoy in front of it) answered with a non-OK status.
    /// `reason` comes from the `google.rpc.ErrorInfo` detail in the
    /// `latchkey.dev` domain, `Unspecified` when there is none.
    #[error("{}: {}: {message}", code_name(*code), shown_reason(*reason, wire_reason))]
    Refused {
        /// The gRPC status code.
        code: Code,
        /// Why, when the refusal says (see [`Error::reason`]).
        reason: Reason,
        /// The status message: what to do about it.
        message: String,
        /// The `ErrorInfo` reason as sent (empty without one). The edge
        /// filter has reasons of its own that `Reason` does not name, e.g.
        /// `POLICY_NOT_READY` and `POLICY_STALE` (both retryable).
        wire_reason: String,
        /// What failed underneath, when the status was made on this side
        /// of the network (tonic's own transport or decoding errors, e.g.
        /// a refused connection or a TLS certificate it does not trust);
        /// `None` for an answer from the arbiter or the edge.
        #[source]
        source: Option<StatusSource>,
    },
    /// The channel to `endpoint` could not be set up or connected.
    #[error("connecting to {endpoint}")]
    Transport {
        /// [`ClientConfig::endpoint`](crate::ClientConfig::endpoint).
        endpoint: String,
        /// What tonic reported.
        #[source]
        source: tonic::transport::Error,
    },
    /// The client configuration cannot work.
    #[error("invalid configuration: {field}: {problem}")]
    Config {
        /// The [`ClientConfig`](crate::ClientConfig) field at fault.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A TLS file could not be read.
    #[error("reading {what} {}", path.display())]
    ReadFile {
        /// Which file: "CA bundle", "SVID certificate" or "SVID key".
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// Why it could not be read.
        #[source]
        source: std::io::Error,
    },
    /// The session is dead (deadline passed, expired at the arbiter, or
    /// closed), so every hold on it is lost.
    #[error("session {session_id} is fenced: {reason}")]
    Fenced {
        /// The dead session.
        session_id: i64,
        /// Why it died.
        reason: FenceReason,
    },
    /// The leadership a call named has ended (see [`LeadershipLost`]), so
    /// nothing was sent.
    #[error("the leadership of {election} is lost: {reason}")]
    LeadershipLost {
        /// The election.
        election: String,
        /// How it ended.
        reason: LeadershipLost,
    },
    /// The arbiter answered OK with a reply this client cannot use.
    #[error("malformed reply to {rpc}: {problem}")]
    Protocol {
        /// The call whose reply was malformed.
        rpc: &'static str,
        /// What was wrong with it.
        problem: &'static str,
    },
}

impl Error {
    /// Worth retrying as is: the network or the store, not the request.
    /// A TLS setup this side cannot complete ([`Self::tls_problem`]: a CA
    /// that does not sign the server's certificate, a server name the
    /// certificate does not name, a key that is not the certificate's, a
    /// certificate the server refuses) is not: it fails the same way
    /// every time.
    pub fn is_transient(&self) -> bool {
        if self.tls_problem().is_some() {
            return false;
        }
        match self {
            Error::Refused { code, reason, .. } => {
                matches!(reason, Reason::StoreUnavailable)
                    || matches!(code, Code::Unavailable | Code::Unknown | Code::Cancelled)
                    || (*code == Code::DeadlineExceeded && *reason != Reason::WaitTimeout)
            }
            Error::Transport { .. } => true,
            Error::Config { .. }
            | Error::ReadFile { .. }
            | Error::Fenced { .. }
            | Error::LeadershipLost { .. }
            | Error::Protocol { .. } => false,
        }
    }

    /// What is wrong with the TLS setup, when the connection failed in
    /// its handshake for a reason of configuration rather than the network:
    /// the line of the cause chain that says so (e.g. `invalid peer
    /// certificate: UnknownIssuer`). `None` for every other error, answers
    /// from the arbiter or the edge included.
    pub fn tls_problem(&self) -> Option<String> {
        let local: &(dyn std::error::Error + 'static) = match self {
            Error::Transport { source, .. } => source,
            Error::Refused {
                source: Some(source),
                ..
            } => source,
            _ => return None,
        };
        let mut next = Some(local);
        while let Some(err) = next {
            let line = match err
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
            {
                // An I/O error's own source skips the error it wraps.
                Some(inner) => inner.to_string(),
                None => err.to_string(),
            };
            if TLS_CONFIG_MARKERS.iter().any(|m| line.contains(m)) {
                return Some(line);
            }
            next = err.source();
        }
        None
    }

    /// The refusal reason, `Unspecified` for errors that are not refusals.
    pub fn reason(&self) -> Reason {
        match self {
            Error::Refused { reason, .. } => *reason,
            _ => Reason::Unspecified,
        }
    }

    /// What a person should do about a temporary refusal, `None` when
    /// retrying as is would not help.
    pub fn retry_hint(&self) -> Option<&'static str> {
        if let Error::Refused { wire_reason, .. } = self {
            match wire_reason.as_str() {
                EDGE_POLICY_NOT_READY => {
                    return Some(
                        "the edge has not loaded its grant table yet (it just started); retry in a few seconds",
                    );
                }
                EDGE_POLICY_STALE => {
                    return Some(
                        "the edge cannot refresh its grant table from the arbiter; retry in a few seconds, and tell the platform team if it persists",
                    );
                }
                _ => {}
            }
        }
        if self.reason() == Reason::Overloaded {
            return Some(
                "the arbiter is overloaded and serves established sessions' renewals first; retry with backoff (your held locks are not affected)",
            );
        }
        self.is_transient()
            .then_some("temporary: retry in a few seconds")
    }

    /// The gRPC code, if the error came from a status.
    pub fn code(&self) -> Option<Code> {
        match self {
            Error::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Self {
        Error::Refused {
            code: status.code(),
            reason: reason_of(&status),
            message: status.message().to_owned(),
            wire_reason: wire_reason_of(&status),
            source: StatusSource::of(status),
        }
    }
}

/// How rustls and tonic say a handshake failed for a reason of
/// configuration (the CA, the server name, the client's key or
/// certificate), as their errors print. A network failure says none.
const TLS_CONFIG_MARKERS: &[&str] = &[
    "invalid peer certificate",
    "peer sent no certificates",
    "received fatal alert: BadCertificate",
    "received fatal alert: UnknownCA",
    "received fatal alert: CertificateRequired",
    "received fatal alert: CertificateUnknown",
    "received fatal alert: DecryptError",
    "received fatal alert: AccessDenied",
    "InconsistentKeys",
    "keys may not be consistent",
    "KeyMismatch",
    "private key",
    "invalid certificate",
];

/// The error under a status tonic made itself (see [`Error::Refused`]).
///
/// Shows only that error and its chain: the status's message is already
/// the refusal's, and its metadata is not for logs.
pub struct StatusSource(Box<tonic::Status>);

impl StatusSource {
    /// tonic lends a status's source and never hands it over, so the
    /// status is kept, and only when it has one.
    fn of(status: tonic::Status) -> Option<Self> {
        std::error::Error::source(&status)?;
        Some(Self(Box::new(status)))
    }

    fn inner(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)
    }
}

impl std::fmt::Display for StatusSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.inner() {
            Some(e) => std::fmt::Display::fmt(e, f),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for StatusSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.inner() {
            Some(e) => std::fmt::Debug::fmt(e, f),
            None => f.write_str("None"),
        }
    }
}

impl std::error::Error for StatusSource {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner()?.source()
    }
}

/// The `Reason` in the status's `ErrorInfo`, if it is ours.
pub(crate) fn reason_of(status: &tonic::Status) -> Reason {
    let details = status.get_error_details();
    details
        .error_info()
        .filter(|info| info.domain == latchkey_proto::ERROR_DOMAIN)
        .and_then(|info| Reason::from_str_name(&format!("REASON_{}", info.reason)))
        .unwrap_or(Reason::Unspecified)
}

/// The edge's refusal when it has no grant table yet (`UNAVAILABLE`).
pub const EDGE_POLICY_NOT_READY: &str = "POLICY_NOT_READY";
/// The edge's refusal of a key its out-of-date grant table does not cover
/// (`UNAVAILABLE`).
pub const EDGE_POLICY_STALE: &str = "POLICY_STALE";

/// The `ErrorInfo` reason string as sent, if it is ours.
fn wire_reason_of(status: &tonic::Status) -> String {
    status
        .get_error_details()
        .error_info()
        .filter(|info| info.domain == latchkey_proto::ERROR_DOMAIN)
        .map(|info| info.reason.clone())
        .unwrap_or_default()
}

/// `reason`'s name, or the reason as sent when `Reason` does not name it.
fn shown_reason(reason: Reason, wire_reason: &str) -> &str {
    if reason == Reason::Unspecified && !wire_reason.is_empty() {
        wire_reason
    } else {
        reason_name(reason)
    }
}

/// The reason as it appears on the wire: `HELD`, not `REASON_HELD`.
pub(crate) fn reason_name(reason: Reason) -> &'static str {
    let name = reason.as_str_name();
    name.strip_prefix("REASON_").unwrap_or(name)
}

/// The canonical gRPC name of a code (`FAILED_PRECONDITION`), as the proto
/// comments and `docs/errors.md` spell it.
pub(crate) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_types::ErrorDetails;

    fn refusal(code: Code, reason: &str, domain: &str) -> tonic::Status {
        tonic::Status::with_error_details(
            code,
            "key is held",
            ErrorDetails::with_error_info(reason, domain, std::collections::HashMap::new()),
        )
    }

    #[test]
    fn reason_comes_from_error_info() {
        let err = Error::from(refusal(Code::Aborted, "HELD", "latchkey.dev"));
        assert_eq!(err.reason(), Reason::Held);
        assert_eq!(err.to_string(), "ABORTED: HELD: key is held");
        assert!(!err.is_transient());
    }

    #[test]
    fn foreign_or_missing_detail_is_unspecified() {
        let err = Error::from(refusal(Code::Aborted, "HELD", "example.com"));
        assert_eq!(err.reason(), Reason::Unspecified);
        let err = Error::from(tonic::Status::unavailable("no route"));
        assert_eq!(err.reason(), Reason::Unspecified);
        assert_eq!(err.to_string(), "UNAVAILABLE: UNSPECIFIED: no route");
        assert!(err.is_transient());
    }

    /// Issue 19: the edge's "no table yet" and "table out of date" refusals
    /// print their own reason and tell a person to retry.
    #[test]
    fn edge_policy_refusals_print_their_reason_and_say_retry() {
        for (reason, hint, typed) in [
            (
                EDGE_POLICY_NOT_READY,
                "not loaded its grant table yet",
                Reason::PolicyNotReady,
            ),
            (
                EDGE_POLICY_STALE,
                "cannot refresh its grant table",
                Reason::PolicyStale,
            ),
        ] {
            let err = Error::from(refusal(Code::Unavailable, reason, "latchkey.dev"));
            // lock.v1 names the edge's reasons, so programs can branch on them
            assert_eq!(err.reason(), typed);
            assert_eq!(
                err.to_string(),
                format!("UNAVAILABLE: {reason}: key is held")
            );
            assert!(err.is_transient());
            assert!(
                err.retry_hint().is_some_and(|h| h.contains(hint)),
                "{reason}"
            );
        }
        // A reason `Reason` names is shown by that name; a final one has no hint.
        let denied = Error::from(refusal(
            Code::PermissionDenied,
            "NOT_AUTHORISED",
            "latchkey.dev",
        ));
        assert_eq!(
            denied.to_string(),
            "PERMISSION_DENIED: NOT_AUTHORISED: key is held"
        );
        assert_eq!(denied.retry_hint(), None);
        // Another domain's reason is not ours to show.
        let foreign = Error::from(refusal(Code::Unavailable, "POLICY_STALE", "example.com"));
        assert_eq!(foreign.to_string(), "UNAVAILABLE: UNSPECIFIED: key is held");
        assert_eq!(
            foreign.retry_hint(),
            Some("temporary: retry in a few seconds")
        );
    }

    /// Issue 32: a status tonic made from an error of its own keeps that
    /// error as the source; an answer from the server has none. The
    /// message is the status's either way.
    #[test]
    fn a_local_status_keeps_its_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = Error::from(tonic::Status::from_error(Box::new(io)));
        assert_eq!(err.to_string(), "UNKNOWN: UNSPECIFIED: refused");
        let mut chain = Vec::new();
        let mut next = std::error::Error::source(&err);
        while let Some(e) = next {
            chain.push(e.to_string());
            next = e.source();
        }
        assert_eq!(chain, ["refused"]);

        let answered = Error::from(refusal(Code::Aborted, "HELD", "latchkey.dev"));
        assert!(std::error::Error::source(&answered).is_none());
    }

    #[test]
    fn wait_timeout_is_not_transient_but_store_unavailable_is() {
        let wait = Error::from(refusal(
            Code::DeadlineExceeded,
            "WAIT_TIMEOUT",
            "latchkey.dev",
        ));
        assert!(!wait.is_transient());
        let store = Error::from(refusal(
            Code::Unavailable,
            "STORE_UNAVAILABLE",
            "latchkey.dev",
        ));
        assert!(store.is_transient());
    }
}
