//! Refusals the filter answers itself, as gRPC statuses.
//!
//! Each refusal carries a gRPC code, a reason from docs/errors.md (or an
//! edge-only one) and a fixed message. The message never names the key, the
//! identity or a token; a denial reads the same whether or not the key exists.

use crate::wire::Writer;

/// The gRPC codes the filter answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcCode {
    InvalidArgument = 3,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    Unauthenticated = 16,
}

/// Why a request was refused at the edge: a bounded set, used as a stat label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DenyReason {
    Unauthenticated,
    NotAuthorised,
    BadKey,
    KeyMismatch,
    BadRequest,
    Oversized,
    Compressed,
    QueueFullKey,
    QueueFullKeyShare,
    QueueFullIdentity,
    AdmissionTableFull,
    PolicyNotReady,
    PolicyStale,
    NoRouteKey,
    ReservedHeader,
    ReservedTrailer,
    UnknownMethod,
    EdgePolicyForbidden,
    TooManyStreams,
    StreamTableFull,
    AdmissionUnavailable,
}

impl DenyReason {
    /// The stat label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Unauthenticated => "unauthenticated",
            Self::NotAuthorised => "not_authorised",
            Self::BadKey => "bad_key",
            Self::KeyMismatch => "key_mismatch",
            Self::BadRequest => "bad_request",
            Self::Oversized => "oversized",
            Self::Compressed => "compressed",
            Self::QueueFullKey => "queue_full_key",
            Self::QueueFullKeyShare => "queue_full_key_share",
            Self::QueueFullIdentity => "queue_full_identity",
            Self::AdmissionTableFull => "admission_table_full",
            Self::PolicyNotReady => "policy_not_ready",
            Self::PolicyStale => "policy_stale",
            Self::NoRouteKey => "no_route_key",
            Self::ReservedHeader => "reserved_header",
            Self::ReservedTrailer => "reserved_trailer",
            Self::UnknownMethod => "unknown_method",
            Self::EdgePolicyForbidden => "edge_policy_forbidden",
            Self::TooManyStreams => "too_many_streams",
            Self::StreamTableFull => "stream_table_full",
            Self::AdmissionUnavailable => "admission_unavailable",
        }
    }

    pub const ALL: [DenyReason; 21] = [
        Self::Unauthenticated,
        Self::NotAuthorised,
        Self::BadKey,
        Self::KeyMismatch,
        Self::BadRequest,
        Self::Oversized,
        Self::Compressed,
        Self::QueueFullKey,
        Self::QueueFullKeyShare,
        Self::QueueFullIdentity,
        Self::AdmissionTableFull,
        Self::PolicyNotReady,
        Self::PolicyStale,
        Self::NoRouteKey,
        Self::ReservedHeader,
        Self::ReservedTrailer,
        Self::UnknownMethod,
        Self::EdgePolicyForbidden,
        Self::TooManyStreams,
        Self::StreamTableFull,
        Self::AdmissionUnavailable,
    ];
}

/// A local gRPC answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: GrpcCode,
    /// `ErrorInfo.reason` (docs/errors.md).
    pub reason: &'static str,
    pub message: &'static str,
    /// The stat label.
    pub why: DenyReason,
}

/// The one message for every authorisation denial (ADR-19: no existence leak).
pub const NOT_AUTHORISED_MESSAGE: &str =
    "not authorised for this key: no prefix grant for the caller covers it";

impl Refusal {
    pub fn of(why: DenyReason) -> Refusal {
        use GrpcCode::*;
        let (code, reason, message) = match why {
            DenyReason::Unauthenticated => (
                Unauthenticated,
                "UNAUTHENTICATED",
                "no verified SPIFFE ID: present an X.509 SVID from this trust domain",
            ),
            DenyReason::NotAuthorised => {
                (PermissionDenied, "NOT_AUTHORISED", NOT_AUTHORISED_MESSAGE)
            }
            DenyReason::BadKey => (
                InvalidArgument,
                "BAD_KEY",
                "malformed key: '/'-separated non-empty segments, printable UTF-8, at most 512 bytes",
            ),
            DenyReason::KeyMismatch => (
                InvalidArgument,
                "BAD_REQUEST",
                "the x-lock-key header, when sent, must appear once and equal the request's key",
            ),
            DenyReason::BadRequest => (
                InvalidArgument,
                "BAD_REQUEST",
                "malformed request: not one gRPC message of the method's type",
            ),
            DenyReason::Oversized => (
                ResourceExhausted,
                "BAD_REQUEST",
                "request message larger than the edge accepts",
            ),
            DenyReason::Compressed => (
                InvalidArgument,
                "BAD_REQUEST",
                "compressed request messages are not accepted at the edge",
            ),
            DenyReason::QueueFullKey => (
                ResourceExhausted,
                "QUEUE_FULL",
                "too many callers are already waiting for this key; retry later",
            ),
            DenyReason::QueueFullKeyShare => (
                ResourceExhausted,
                "QUEUE_FULL",
                "this caller already has its share of this key's waiting places (half the class's maxWaitersPerKey, rounded up; the rest are kept for other callers); retry later",
            ),
            DenyReason::QueueFullIdentity => (
                ResourceExhausted,
                "QUEUE_FULL",
                "this caller already has too many waiting acquires; retry later",
            ),
            DenyReason::AdmissionTableFull => (
                ResourceExhausted,
                "QUEUE_FULL",
                "the edge is tracking too many waiting callers; retry later",
            ),
            DenyReason::AdmissionUnavailable => (
                Unavailable,
                "EDGE_BUSY",
                "the edge could not count this call against its bounds (shared state contended); retry with backoff",
            ),
            DenyReason::ReservedHeader => (
                InvalidArgument,
                "RESERVED_HEADER",
                "x-latchkey-* headers are reserved for the edge; remove them from the request (the edge names the caller from its SVID)",
            ),
            DenyReason::ReservedTrailer => (
                InvalidArgument,
                "RESERVED_HEADER",
                "request trailers may not carry x-latchkey-* or x-lock-key; send x-lock-key in the initial headers only and no x-latchkey-* at all",
            ),
            DenyReason::UnknownMethod => (
                Unimplemented,
                "UNIMPLEMENTED",
                "the edge forwards only the lock.v1, election.v1 and admin.v1 methods it knows (POST, exact path); check the method name and the client's proto version",
            ),
            DenyReason::EdgePolicyForbidden => (
                PermissionDenied,
                "NOT_AUTHORISED",
                "GetEdgePolicy is not served through the edge: the grant table is served only to the edge itself (operators: call the arbiter directly)",
            ),
            DenyReason::TooManyStreams => (
                ResourceExhausted,
                "TOO_MANY_STREAMS",
                "this caller has too many open streams at the edge; close idle streams (one KeepAlive per session) or retry later",
            ),
            DenyReason::StreamTableFull => (
                ResourceExhausted,
                "TOO_MANY_STREAMS",
                "the edge is tracking too many callers with open streams; retry later",
            ),
            DenyReason::NoRouteKey => (
                Internal,
                "INTERNAL",
                "the edge could not route this call by its key; retry",
            ),
            // Not PERMISSION_DENIED: the caller may well have a grant, and
            // clients treat PERMISSION_DENIED as final (issue 19).
            DenyReason::PolicyNotReady => (
                Unavailable,
                "POLICY_NOT_READY",
                "the edge has not received its grant table from the arbiter yet; retry with backoff",
            ),
            DenyReason::PolicyStale => (
                Unavailable,
                "POLICY_STALE",
                "the edge's grant table is out of date (its refresh from the arbiter is failing) and does not cover this key; retry with backoff",
            ),
        };
        Refusal {
            code,
            reason,
            message,
            why,
        }
    }

    /// The `grpc-status-details-bin` value: base64 of a `google.rpc.Status`
    /// carrying one `google.rpc.ErrorInfo` (domain `latchkey.dev`).
    pub fn status_details_bin(&self) -> String {
        let mut info = Writer::new();
        info.string(1, self.reason).string(2, "latchkey.dev");
        let mut any = Writer::new();
        any.string(1, "type.googleapis.com/google.rpc.ErrorInfo")
            .bytes(2, &info.finish());
        let mut status = Writer::new();
        status
            .varint(1, self.code as u64)
            .string(2, self.message)
            .bytes(3, &any.finish());
        base64(&status.finish())
    }
}

/// Standard base64 without padding (what gRPC senders should emit for -bin headers).
fn base64(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let sym = |i: u32| char::from(ALPHABET.get((i & 63) as usize).copied().unwrap_or(b'A'));
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (b(0) << 16) | (b(1) << 8) | b(2);
        out.push(sym(n >> 18));
        out.push(sym(n >> 12));
        if chunk.len() > 1 {
            out.push(sym(n >> 6));
        }
        if chunk.len() > 2 {
            out.push(sym(n));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_known_vectors() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg");
        assert_eq!(base64(b"fo"), "Zm8");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foob"), "Zm9vYg");
        assert_eq!(base64(&[0xfb, 0xff]), "+/8");
    }

    #[test]
    fn a_missing_or_stale_table_is_retryable_never_permission_denied() {
        for why in [DenyReason::PolicyNotReady, DenyReason::PolicyStale] {
            let r = Refusal::of(why);
            assert_eq!(r.code, GrpcCode::Unavailable, "{why:?}");
            assert_ne!(r.reason, "NOT_AUTHORISED");
            assert_ne!(r.message, NOT_AUTHORISED_MESSAGE);
            assert!(r.message.contains("retry"), "{}", r.message);
        }
        assert_eq!(
            Refusal::of(DenyReason::PolicyNotReady).reason,
            "POLICY_NOT_READY"
        );
        assert_eq!(Refusal::of(DenyReason::PolicyStale).reason, "POLICY_STALE");
    }

    #[test]
    fn every_reason_has_a_distinct_label_and_no_message_names_a_key() {
        let labels: std::collections::HashSet<_> =
            DenyReason::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), DenyReason::ALL.len());
        for r in DenyReason::ALL {
            let refusal = Refusal::of(r);
            assert!(!refusal.message.is_empty());
            assert!(!refusal.status_details_bin().is_empty());
        }
    }
}
