//! What a request is: its method (from the `:path`) and, for the keyed lock.v1
//! calls, the key, class and wait mode decoded from the gRPC message itself.
//!
//! The decoder mirrors what the arbiter's prost decoder will see: for a repeated
//! scalar field the last occurrence wins (so a body carrying two keys cannot show
//! one key to the edge and another to the arbiter), unknown fields are skipped,
//! a known field with the wrong wire type is an error. A unary body must be
//! exactly one uncompressed gRPC frame.

use thiserror::Error;

use crate::wire::{Reader, WireError};

/// The lock.v1 service path prefix.
pub const LOCK_SERVICE: &str = "/latchkey.lock.v1.Lock/";
/// The admin.v1 service path prefix.
pub const ADMIN_SERVICE: &str = "/latchkey.admin.v1.Admin/";

/// A call the edge forwards, and how it treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    Acquire,
    Release,
    Inspect,
    /// OpenSession, KeepAlive, CloseSession: authenticated and rate limited,
    /// not key-checked; never buffered (KeepAlive is a stream).
    Session,
    /// admin.v1 GetStatus, AdvanceEpoch and the force-release calls: passed
    /// on naming the verified caller; the arbiter checks the operator role
    /// (and a force-release's ID token) itself.
    Admin,
}

/// What the edge does with a request, from its `:method` and `:path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    Forward(Method),
    /// admin.v1 GetEdgePolicy: the grant table is served to the edge's own
    /// refresh only (which does not pass through the filter chain).
    EdgePolicy,
    /// Anything else: answered UNIMPLEMENTED by the edge, never forwarded.
    Unknown,
}

impl Call {
    /// Exact paths only (no query, no trailing slash, no percent-encoding):
    /// what the edge checks must be what the arbiter routes.
    pub fn of(http_method: &str, path: &str) -> Call {
        if http_method != "POST" {
            return Call::Unknown;
        }
        if let Some(name) = path.strip_prefix(LOCK_SERVICE) {
            return match name {
                "Acquire" => Call::Forward(Method::Acquire),
                "Release" => Call::Forward(Method::Release),
                "Inspect" => Call::Forward(Method::Inspect),
                "OpenSession" | "KeepAlive" | "CloseSession" => Call::Forward(Method::Session),
                _ => Call::Unknown,
            };
        }
        match path.strip_prefix(ADMIN_SERVICE) {
            // The arbiter judges every admin call (operator SVID; for a
            // force-release also the operator's OIDC ID token).
            Some(
                "GetStatus"
                | "AdvanceEpoch"
                | "RequestForceRelease"
                | "ApproveForceRelease"
                | "ListForceReleases",
            ) => Call::Forward(Method::Admin),
            Some("GetEdgePolicy") => Call::EdgePolicy,
            _ => Call::Unknown,
        }
    }
}

impl Method {
    /// Whether the edge needs the request body (the key lives in it).
    pub fn is_keyed(self) -> bool {
        matches!(self, Method::Acquire | Method::Release | Method::Inspect)
    }

    pub fn label(self) -> &'static str {
        match self {
            Method::Acquire => "acquire",
            Method::Release => "release",
            Method::Inspect => "inspect",
            Method::Session => "session",
            Method::Admin => "admin",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RequestError {
    #[error("body shorter than a gRPC frame header")]
    ShortFrame,
    #[error("compressed gRPC message")]
    Compressed,
    #[error("invalid gRPC frame flags {0:#x}")]
    Flags(u8),
    #[error("gRPC message of {len} bytes exceeds the edge limit of {max}")]
    Oversized { len: usize, max: usize },
    #[error("frame length {declared} does not match the {actual} bytes received")]
    Length { declared: usize, actual: usize },
    #[error("malformed message: {0}")]
    Wire(#[from] WireError),
}

/// The message inside a unary request body: exactly one uncompressed frame,
/// at most `max` bytes.
pub fn unframe(body: &[u8], max: usize) -> Result<&[u8], RequestError> {
    let (header, message) = body
        .split_first_chunk::<5>()
        .ok_or(RequestError::ShortFrame)?;
    let [flags, l0, l1, l2, l3] = *header;
    match flags {
        0 => {}
        1 => return Err(RequestError::Compressed),
        other => return Err(RequestError::Flags(other)),
    }
    let declared = u32::from_be_bytes([l0, l1, l2, l3]) as usize;
    if declared > max {
        return Err(RequestError::Oversized { len: declared, max });
    }
    if declared != message.len() {
        return Err(RequestError::Length {
            declared,
            actual: message.len(),
        });
    }
    Ok(message)
}

/// The fields of a keyed request the edge decides on, borrowed from the
/// message (no copy: the decision runs on every keyed call).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeyedRequest<'a> {
    /// Raw; validated as a `LockKey` by the caller.
    pub key: &'a str,
    /// Acquire only.
    pub class: Option<&'a str>,
    /// Acquire with any wait mode other than WAIT_NONE.
    pub waits: bool,
}

/// Decodes the key (field 1 of Acquire, Release and Inspect), and for Acquire
/// the class (2) and wait mode (4). Other fields are checked for wire type only
/// where the arbiter would reject them, and otherwise skipped.
pub fn decode(method: Method, message: &[u8]) -> Result<KeyedRequest<'_>, RequestError> {
    let mut out = KeyedRequest::default();
    let mut reader = Reader::new(message);
    while let Some((field, value)) = reader.next_field()? {
        match (method, field) {
            (Method::Acquire | Method::Release | Method::Inspect, 1) => {
                out.key = value.string(field)?;
            }
            (Method::Acquire, 2) => out.class = Some(value.string(field)?),
            (Method::Acquire, 3) => {
                value.varint(field)?;
            }
            (Method::Acquire, 4) => out.waits = value.varint(field)? != 0,
            (Method::Acquire, 5) => {
                value.bytes(field)?;
            }
            (Method::Release, 2) => {
                value.varint(field)?;
            }
            (Method::Release, 3) if !matches!(value, crate::wire::Value::Fixed64(_)) => {
                return Err(WireError::FieldType { field }.into());
            }
            _ => {}
        }
    }
    if method == Method::Acquire && out.class.is_none() {
        out.class = Some("");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Writer;
    use proptest::prelude::*;

    pub(crate) fn frame(message: &[u8]) -> Vec<u8> {
        let mut body = vec![0u8];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
        body
    }

    fn acquire(key: &str, class: &str, wait: u64) -> Vec<u8> {
        let mut w = Writer::new();
        w.string(1, key)
            .string(2, class)
            .varint(3, 42)
            .varint(4, wait);
        w.finish()
    }

    #[test]
    fn only_known_methods_are_forwarded() {
        let post = |p: &str| Call::of("POST", p);
        assert_eq!(
            post("/latchkey.lock.v1.Lock/Acquire"),
            Call::Forward(Method::Acquire)
        );
        for m in ["OpenSession", "KeepAlive", "CloseSession"] {
            assert_eq!(
                post(&format!("/latchkey.lock.v1.Lock/{m}")),
                Call::Forward(Method::Session)
            );
        }
        for m in [
            "GetStatus",
            "AdvanceEpoch",
            "RequestForceRelease",
            "ApproveForceRelease",
            "ListForceReleases",
        ] {
            assert_eq!(
                post(&format!("/latchkey.admin.v1.Admin/{m}")),
                Call::Forward(Method::Admin)
            );
        }
        assert_eq!(
            post("/latchkey.admin.v1.Admin/GetEdgePolicy"),
            Call::EdgePolicy
        );
        for unknown in [
            "/latchkey.lock.v1.Lock/Acquirex",
            "/latchkey.lock.v1.Lock/acquire",
            "/latchkey.lock.v1.Lock/Acquire/",
            "/latchkey.lock.v1.Lock/Acquire?x=1",
            "/latchkey.lock.v1.Lock/",
            "/latchkey.admin.v1.Admin/GetEdge%50olicy",
            "/latchkey.admin.v1.Admin/GetEdgePolicy/",
            "/latchkey.admin.v1.Admin/Shutdown",
            "/latchkey.lock.v2.Lock/Acquire",
            "/grpc.health.v1.Health/Check",
            "//latchkey.lock.v1.Lock/Acquire",
            "/",
            "",
        ] {
            assert_eq!(post(unknown), Call::Unknown, "{unknown}");
        }
        assert_eq!(
            Call::of("GET", "/latchkey.lock.v1.Lock/Acquire"),
            Call::Unknown
        );
    }

    #[test]
    fn decodes_an_acquire() {
        let body = frame(&acquire("a/b", "demo", 1));
        let msg = unframe(&body, 4096).unwrap();
        let req = decode(Method::Acquire, msg).unwrap();
        assert_eq!(req.key, "a/b");
        assert_eq!(req.class, Some("demo"));
        assert!(req.waits);
    }

    #[test]
    fn the_last_key_wins_like_prost() {
        let mut w = Writer::new();
        w.string(1, "mine/x").string(1, "theirs/y");
        let message = w.finish();
        let req = decode(Method::Release, &message).unwrap();
        assert_eq!(req.key, "theirs/y");
    }

    #[test]
    fn frames_are_checked() {
        assert_eq!(unframe(&[0, 0, 0], 10), Err(RequestError::ShortFrame));
        assert_eq!(unframe(&[1, 0, 0, 0, 0], 10), Err(RequestError::Compressed));
        assert_eq!(unframe(&[2, 0, 0, 0, 0], 10), Err(RequestError::Flags(2)));
        assert_eq!(
            unframe(&[0, 0, 0, 0, 11], 10),
            Err(RequestError::Oversized { len: 11, max: 10 })
        );
        assert_eq!(
            unframe(&[0, 0, 0, 0, 2, 1], 10),
            Err(RequestError::Length {
                declared: 2,
                actual: 1
            })
        );
        // Two frames in a unary body.
        let mut two = frame(&acquire("a", "b", 0));
        two.extend(frame(&acquire("c", "d", 0)));
        assert!(matches!(
            unframe(&two, 4096),
            Err(RequestError::Length { .. })
        ));
    }

    #[test]
    fn a_key_with_the_wrong_wire_type_is_refused() {
        let mut w = Writer::new();
        w.varint(1, 7);
        assert!(decode(Method::Inspect, &w.finish()).is_err());
        let mut w = Writer::new();
        w.string(1, "k").varint(3, 1);
        assert!(decode(Method::Release, &w.finish()).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

        // The decoder is total: any bytes end in Ok or Err, never a panic.
        #[test]
        fn decoder_never_panics(body in proptest::collection::vec(any::<u8>(), 0..600), max in 0usize..700) {
            for m in [Method::Acquire, Method::Release, Method::Inspect] {
                if let Ok(msg) = unframe(&body, max) {
                    let _ = decode(m, msg);
                }
                let _ = decode(m, &body);
            }
        }

        // Mutations of a valid request: still total, and what decodes is what prost would see.
        #[test]
        fn mutated_requests_never_panic(
            key in "[a-z/]{0,40}",
            class in "[a-z-]{0,12}",
            wait in 0u64..3,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
            cut in any::<usize>(),
        ) {
            let mut body = frame(&acquire(&key, &class, wait));
            for (at, byte) in flips {
                let n = body.len();
                if let Some(b) = body.get_mut(at % n) { *b = byte; }
            }
            body.truncate(cut % (body.len() + 1));
            if let Ok(msg) = unframe(&body, 4096) {
                let _ = decode(Method::Acquire, msg);
            }
        }

        #[test]
        fn valid_acquires_round_trip(key in "[a-z0-9/._-]{1,64}", class in "[a-z-]{1,16}", wait in 0u64..2) {
            let body = frame(&acquire(&key, &class, wait));
            let req = decode(Method::Acquire, unframe(&body, 4096).unwrap()).unwrap();
            prop_assert_eq!(req.key, key);
            prop_assert_eq!(req.class, Some(class.as_str()));
            prop_assert_eq!(req.waits, wait != 0);
        }

        // Differential: wherever prost (the arbiter's decoder) and this decoder
        // both accept a body, they see the same key, class and wait mode.
        #[test]
        fn agrees_with_prost_on_what_both_accept(body in proptest::collection::vec(any::<u8>(), 0..80)) {
            use prost::Message;
            let ours = decode(Method::Acquire, &body);
            let theirs = latchkey_proto::lockv1::AcquireRequest::decode(body.as_slice());
            if let (Ok(ours), Ok(theirs)) = (ours, theirs) {
                prop_assert_eq!(ours.key, theirs.key);
                prop_assert_eq!(ours.class.unwrap_or_default(), theirs.class);
                prop_assert_eq!(ours.waits, theirs.wait != 0);
            }
        }

        #[test]
        fn agrees_with_prost_on_encoded_requests(
            key in "\\PC{0,40}",
            class in "[a-z-]{0,12}",
            wait in 0i32..3,
            session in any::<i64>(),
            meta in proptest::collection::btree_map("[a-z]{1,5}", "[a-z]{0,5}", 0..3),
        ) {
            use prost::Message;
            let req = latchkey_proto::lockv1::AcquireRequest {
                key: key.clone(),
                class: class.clone(),
                session_id: session,
                wait,
                metadata: meta.into_iter().collect(),
                instance: String::new(),
            };
            let message = req.encode_to_vec();
            let ours = decode(Method::Acquire, &message).unwrap();
            prop_assert_eq!(ours.key, key);
            prop_assert_eq!(ours.class, Some(class.as_str()));
            prop_assert_eq!(ours.waits, wait != 0);
        }
    }
}
