//! Reserved headers: the names only the edge may set on a forwarded call.
//!
//! The edge names the verified caller in `x-latchkey-identity`; the arbiter
//! trusts it from the edge's SVID only. Anything a client sends under the
//! `x-latchkey-` prefix is therefore refused — in the initial headers and in
//! the request trailers alike (tonic merges a unary request's trailers into
//! its metadata, so a trailer is as good as a header to the arbiter). The
//! routing header `x-lock-key` is the client's to send in the initial headers
//! (checked against the body's key, then stripped), never in trailers.

use crate::decision::KEY_HEADER;
use crate::status::{DenyReason, Refusal};

/// Every header under this prefix is the edge's to set.
pub const RESERVED_PREFIX: &str = "x-latchkey-";

fn is_edge_header(name: &str) -> bool {
    name.get(..RESERVED_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(RESERVED_PREFIX))
}

/// Whether `name` may not appear in request trailers.
pub fn reserved_in_trailers(name: &str) -> bool {
    is_edge_header(name) || name.eq_ignore_ascii_case(KEY_HEADER)
}

/// What the edge keeps from the initial request headers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestHeaders {
    /// The client's `x-lock-key`, when sent once.
    pub key: Option<String>,
    /// `x-lock-key` was sent more than once (a mismatch whatever the body says).
    pub key_repeated: bool,
}

/// Checks the initial request headers: refuses any `x-latchkey-*`.
pub fn check_request_headers<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<RequestHeaders, Refusal> {
    let mut out = RequestHeaders::default();
    for (name, value) in headers {
        if is_edge_header(name) {
            return Err(Refusal::of(DenyReason::ReservedHeader));
        }
        if name.eq_ignore_ascii_case(KEY_HEADER) {
            out.key_repeated |= out.key.is_some();
            out.key = Some(value.to_owned());
        }
    }
    Ok(out)
}

/// Checks the request trailers: refuses any reserved name.
pub fn check_trailers<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), Refusal> {
    for name in names {
        if reserved_in_trailers(name) {
            return Err(Refusal::of(DenyReason::ReservedTrailer));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::GrpcCode;

    #[test]
    fn any_edge_header_in_the_initial_headers_is_refused() {
        for name in [
            "x-latchkey-identity",
            "X-Latchkey-Identity",
            "x-latchkey-dev-identity",
            "x-latchkey-",
            "x-latchkey-anything-new",
        ] {
            let r = check_request_headers([(":path", "/x"), (name, "v")]).unwrap_err();
            assert_eq!(r.why, DenyReason::ReservedHeader, "{name}");
            assert_eq!(r.code, GrpcCode::InvalidArgument);
        }
        for fine in ["x-latchkey", "x-latchke-identity", "xx-latchkey-identity"] {
            assert!(check_request_headers([(fine, "v")]).is_ok(), "{fine}");
        }
    }

    #[test]
    fn the_key_header_is_kept_and_a_repeat_noticed() {
        let h = check_request_headers([("x-lock-key", "a/b")]).unwrap();
        assert_eq!(h.key.as_deref(), Some("a/b"));
        assert!(!h.key_repeated);
        let h = check_request_headers([("x-lock-key", "a/b"), ("X-Lock-Key", "a/b")]).unwrap();
        assert!(h.key_repeated);
        assert_eq!(
            check_request_headers([]).unwrap(),
            RequestHeaders::default()
        );
    }

    #[test]
    fn reserved_trailers_are_refused_including_the_routing_key() {
        for name in [
            "x-latchkey-identity",
            "X-LATCHKEY-IDENTITY",
            "x-lock-key",
            "X-Lock-Key",
        ] {
            let r = check_trailers(["grpc-foo", name]).unwrap_err();
            assert_eq!(r.why, DenyReason::ReservedTrailer, "{name}");
            assert!(r.message.contains("trailer"));
        }
        assert!(check_trailers(["grpc-status-details-bin", "x-custom"]).is_ok());
        assert!(check_trailers([]).is_ok());
    }
}
