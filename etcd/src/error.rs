//! The one classification of etcd-client's errors. Callers ask
//! [`Error::kind`] what failed (etcd unreachable, a revision compacted, a
//! permission missing, a lease gone...) instead of matching gRPC codes and
//! message texts themselves; what a kind means to them (retry, a gap, a
//! refusal, an expired session) is still theirs to say.

/// What an etcd request's failure was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// etcd did not answer, or could not serve the request now (no
    /// connection, a timeout, no leader, too many requests): worth the same
    /// request again later. A write's outcome is unknown.
    Unavailable,
    /// The revision asked for has been compacted away (a read or a watch
    /// from it can never succeed).
    Compacted,
    /// The etcd user's role does not allow the request.
    PermissionDenied,
    /// The lease the request names is gone (a put or a transaction on it, a
    /// revoke of it, a keep-alive stream opened for it).
    LeaseNotFound,
    /// A LeaseGrant asked for an id that is taken.
    LeaseExists,
    /// etcd refused the request as it is (InvalidArgument: a transaction
    /// that puts one key twice, too many operations): nothing was applied.
    InvalidArgument,
    /// Another NotFound answer.
    NotFound,
    /// Anything else (a bad endpoint, malformed options, an internal error).
    Other,
}

/// An etcd-client error with its classification.
///
/// Its message is etcd-client's, unchanged. `etcd_client::Error` has no
/// `source()`, yet tonic keeps the interesting part of a failure (connection
/// refused, a TLS alert, an unknown issuer) in its transport error's or its
/// status's source chain: this error's `source()` is that cause, so a walk
/// of the chain (the arbiter's `StoreError::detail`, a log line) goes past
/// etcd-client's one line. The original is kept whole ([`Error::get_ref`]).
#[derive(Debug)]
pub struct Error(etcd_client::Error);

impl Error {
    /// What failed.
    pub fn kind(&self) -> ErrorKind {
        use etcd_client::Error as E;
        use tonic::Code;
        match &self.0 {
            E::GRpcStatus(s) => match s.code() {
                Code::OutOfRange if s.message().contains("compacted") => ErrorKind::Compacted,
                Code::PermissionDenied => ErrorKind::PermissionDenied,
                Code::NotFound if s.message().contains("lease not found") => {
                    ErrorKind::LeaseNotFound
                }
                Code::NotFound => ErrorKind::NotFound,
                Code::FailedPrecondition if s.message().contains("lease already exists") => {
                    ErrorKind::LeaseExists
                }
                Code::InvalidArgument => ErrorKind::InvalidArgument,
                Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::Aborted
                | Code::ResourceExhausted => ErrorKind::Unavailable,
                _ => ErrorKind::Other,
            },
            // etcd-client's own word for a keep-alive answered with TTL 0.
            E::LeaseKeepAliveError(m) if m.contains("lease not found") => ErrorKind::LeaseNotFound,
            E::TransportError(_) | E::IoError(_) => ErrorKind::Unavailable,
            _ => ErrorKind::Other,
        }
    }

    /// Worth the same request again later ([`ErrorKind::Unavailable`]).
    pub fn is_transient(&self) -> bool {
        self.kind() == ErrorKind::Unavailable
    }

    /// The message of etcd's gRPC status, when etcd answered with one
    /// (`etcdserver: permission denied`), without etcd-client's wording
    /// around it.
    pub fn grpc_message(&self) -> Option<&str> {
        match &self.0 {
            etcd_client::Error::GRpcStatus(s) => Some(s.message()),
            _ => None,
        }
    }

    /// The error as etcd-client returned it.
    pub fn get_ref(&self) -> &etcd_client::Error {
        &self.0
    }

    pub fn into_inner(self) -> etcd_client::Error {
        self.0
    }
}

impl From<etcd_client::Error> for Error {
    fn from(e: etcd_client::Error) -> Self {
        Self(e)
    }
}

/// etcd's answer as etcd-client would return it.
impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Self {
        Self(etcd_client::Error::GRpcStatus(status))
    }
}

/// A connection's failure as etcd-client would return it.
impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Self(etcd_client::Error::IoError(e))
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        use etcd_client::Error as E;
        match &self.0 {
            E::TransportError(e) => Some(e),
            E::GRpcStatus(e) => Some(e),
            E::IoError(e) => Some(e),
            E::InvalidUri(e) => Some(e),
            E::Utf8Error(e) => Some(e),
            E::InvalidMetadataValue(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn status(code: Code, message: &str) -> Error {
        etcd_client::Error::GRpcStatus(tonic::Status::new(code, message)).into()
    }

    #[test]
    fn classifies_etcds_answers() {
        let cases = [
            (
                status(
                    Code::OutOfRange,
                    "etcdserver: mvcc: required revision has been compacted",
                ),
                ErrorKind::Compacted,
            ),
            (
                status(
                    Code::OutOfRange,
                    "etcdserver: mvcc: required revision is a future revision",
                ),
                ErrorKind::Other,
            ),
            (
                status(Code::Unavailable, "compacted"),
                ErrorKind::Unavailable,
            ),
            (
                status(Code::PermissionDenied, "etcdserver: permission denied"),
                ErrorKind::PermissionDenied,
            ),
            (
                status(Code::NotFound, "etcdserver: requested lease not found"),
                ErrorKind::LeaseNotFound,
            ),
            (status(Code::NotFound, "key not found"), ErrorKind::NotFound),
            (
                status(Code::FailedPrecondition, "etcdserver: lease already exists"),
                ErrorKind::LeaseExists,
            ),
            (
                status(Code::FailedPrecondition, "etcdserver: something else"),
                ErrorKind::Other,
            ),
            (
                status(
                    Code::InvalidArgument,
                    "etcdserver: duplicate key given in txn request",
                ),
                ErrorKind::InvalidArgument,
            ),
            (
                status(Code::Unavailable, "etcdserver: leader changed"),
                ErrorKind::Unavailable,
            ),
            (
                etcd_client::Error::LeaseKeepAliveError("lease not found".into()).into(),
                ErrorKind::LeaseNotFound,
            ),
            (
                etcd_client::Error::LeaseKeepAliveError("channel closed".into()).into(),
                ErrorKind::Other,
            ),
            (
                etcd_client::Error::IoError(std::io::Error::from(
                    std::io::ErrorKind::ConnectionRefused,
                ))
                .into(),
                ErrorKind::Unavailable,
            ),
        ];
        for (error, kind) in cases {
            assert_eq!(error.kind(), kind, "{error}");
        }
    }

    #[test]
    fn the_message_is_etcd_clients_and_the_source_its_cause() {
        use std::error::Error as _;
        let cause = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = Error::from(etcd_client::Error::IoError(cause));
        assert_eq!(err.to_string(), "io error: refused");
        let io = err.source();
        assert!(io.is_some_and(|e| e.downcast_ref::<std::io::Error>().is_some()));
        assert!(err.grpc_message().is_none());
        let denied = status(Code::PermissionDenied, "etcdserver: permission denied");
        assert_eq!(denied.grpc_message(), Some("etcdserver: permission denied"));
    }
}
