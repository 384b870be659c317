//! What a request is: its method (from the `:path`) and, for the keyed calls
//! (lock.v1 Acquire, Release and Inspect, and every election.v1 call), the
//! key — an election's name is a lock key, in field 1 like a lock.v1 key —
//! and, where the call has them, the class and whether it waits, decoded
//! from the gRPC message itself.
//!
//! The decoder mirrors what the arbiter's prost decoder will see: for a repeated
//! scalar field the last occurrence wins (so a body carrying two keys cannot show
//! one key to the edge and another to the arbiter), unknown fields are skipped,
//! a known field with the wrong wire type is an error. A unary body must be
//! exactly one uncompressed gRPC frame.

use thiserror::Error;

use crate::wire::{Reader, Value, WireError};

/// The lock.v1 service path prefix.
pub const LOCK_SERVICE: &str = "/latchkey.lock.v1.Lock/";
/// The election.v1 service path prefix.
pub const ELECTION_SERVICE: &str = "/latchkey.election.v1.ElectionService/";
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
    /// election.v1 Campaign: treated as a waiting Acquire of the election's
    /// name (its class in field 2; it waits until it leads or its deadline,
    /// so it takes the waiter places until the arbiter answers).
    Campaign,
    /// election.v1 Proclaim, Resign and Transfer act on a leadership: like
    /// a Release (the name checked, no waiter place).
    Proclaim,
    /// See [`Method::Proclaim`].
    Resign,
    /// See [`Method::Proclaim`].
    Transfer,
    /// election.v1 Leader and Candidates read the election: like Inspect.
    Leader,
    /// See [`Method::Leader`].
    Candidates,
    /// election.v1 Observe: keyed like Inspect (its request is one message),
    /// and its answer is a long-lived stream: it keeps its place under the
    /// identity's stream bound until it ends, like a KeepAlive stream.
    Observe,
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
        if let Some(name) = path.strip_prefix(ELECTION_SERVICE) {
            return match name {
                "Campaign" => Call::Forward(Method::Campaign),
                "Proclaim" => Call::Forward(Method::Proclaim),
                "Leader" => Call::Forward(Method::Leader),
                "Observe" => Call::Forward(Method::Observe),
                "Resign" => Call::Forward(Method::Resign),
                "Transfer" => Call::Forward(Method::Transfer),
                "Candidates" => Call::Forward(Method::Candidates),
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
        !matches!(self, Method::Session | Method::Admin)
    }

    /// Whether the request names a class (field 2): Acquire and Campaign.
    pub fn has_class(self) -> bool {
        matches!(self, Method::Acquire | Method::Campaign)
    }

    pub fn label(self) -> &'static str {
        match self {
            Method::Acquire => "acquire",
            Method::Release => "release",
            Method::Inspect => "inspect",
            Method::Session => "session",
            Method::Admin => "admin",
            Method::Campaign => "campaign",
            Method::Proclaim => "proclaim",
            Method::Resign => "resign",
            Method::Transfer => "transfer",
            Method::Leader => "leader",
            Method::Candidates => "candidates",
            Method::Observe => "observe",
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
    /// Raw; validated as a `LockKey` by the caller. A lock key, or an
    /// election's name.
    pub key: &'a str,
    /// Acquire and Campaign only.
    pub class: Option<&'a str>,
    /// Acquire with any wait mode other than WAIT_NONE; every Campaign.
    pub waits: bool,
}

/// A field the edge does not read, checked for the wire type prost needs
/// (a varint, a fixed64, or length-delimited UTF-8): a body prost would
/// refuse is refused here too, not half-read.
fn check_varint(value: Value<'_>, field: u32) -> Result<(), WireError> {
    value.varint(field).map(|_| ())
}

fn check_fixed64(value: Value<'_>, field: u32) -> Result<(), WireError> {
    match value {
        Value::Fixed64(_) => Ok(()),
        _ => Err(WireError::FieldType { field }),
    }
}

fn check_string(value: Value<'_>, field: u32) -> Result<(), WireError> {
    value.string(field).map(|_| ())
}

/// Decodes the key (field 1 of every keyed request: a lock.v1 key, an
/// election.v1 election name), for Acquire and Campaign the class (2), and
/// for Acquire the wait mode (4). Other fields are checked for wire type only
/// where the arbiter would reject them, and otherwise skipped.
pub fn decode(method: Method, message: &[u8]) -> Result<KeyedRequest<'_>, RequestError> {
    let mut out = KeyedRequest::default();
    let mut reader = Reader::new(message);
    while let Some((field, value)) = reader.next_field()? {
        match (method, field) {
            (m, 1) if m.is_keyed() => out.key = value.string(field)?,
            (Method::Acquire | Method::Campaign, 2) => out.class = Some(value.string(field)?),
            (Method::Acquire, 3) => check_varint(value, field)?,
            (Method::Acquire, 4) => out.waits = value.varint(field)? != 0,
            (Method::Acquire, 5) => {
                value.bytes(field)?;
            }
            (Method::Release, 2) => check_varint(value, field)?,
            (Method::Release, 3) => check_fixed64(value, field)?,
            // The mode (an enum: a varint, its value the arbiter's to judge).
            (Method::Acquire, 7) => check_varint(value, field)?,
            // A downgrade's exclusive token (`downgrade_from`, a fixed64):
            // the arbiter's to judge, passed on as the client sent it.
            (Method::Acquire, 8) => check_fixed64(value, field)?,
            // A semaphore grant's slot (a uint32: prost truncates the
            // varint), and the mode.
            (Method::Release, 4 | 5) => check_varint(value, field)?,
            // CampaignRequest: session_id 3, value 4, priority 5 (prost
            // truncates a uint32's varint, so no range check), instance 6.
            (Method::Campaign, 3 | 5) => check_varint(value, field)?,
            (Method::Campaign, 4 | 6) => check_string(value, field)?,
            // Proclaim, Resign, Transfer: session_id 3, token 4 (fixed64);
            // Proclaim's value 5; Transfer's `to`: candidate_id 5, preferred 6.
            (Method::Proclaim | Method::Resign | Method::Transfer, 3) => {
                check_varint(value, field)?
            }
            (Method::Proclaim | Method::Resign | Method::Transfer, 4) => {
                check_fixed64(value, field)?
            }
            (Method::Proclaim, 5) => check_string(value, field)?,
            (Method::Transfer, 5 | 6) => check_varint(value, field)?,
            // ObserveRequest: from_term 2.
            (Method::Observe, 2) => check_varint(value, field)?,
            _ => {}
        }
    }
    if method.has_class() && out.class.is_none() {
        out.class = Some("");
    }
    // A campaign waits until it leads or its deadline, whatever it says.
    if method == Method::Campaign {
        out.waits = true;
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

    /// What prost decoded: the election's name, and a Campaign's class.
    type ProstSaw = (String, Option<String>);

    /// The election.v1 methods, each with its path.
    const ELECTION: [(&str, Method); 7] = [
        ("Campaign", Method::Campaign),
        ("Proclaim", Method::Proclaim),
        ("Leader", Method::Leader),
        ("Observe", Method::Observe),
        ("Resign", Method::Resign),
        ("Transfer", Method::Transfer),
        ("Candidates", Method::Candidates),
    ];

    /// Every keyed method, lock.v1's and election.v1's.
    const KEYED: [Method; 10] = [
        Method::Acquire,
        Method::Release,
        Method::Inspect,
        Method::Campaign,
        Method::Proclaim,
        Method::Leader,
        Method::Observe,
        Method::Resign,
        Method::Transfer,
        Method::Candidates,
    ];

    /// One well-formed request of `method` naming `name`, as prost encodes it.
    fn election_request(method: Method, name: &str) -> Vec<u8> {
        use latchkey_proto::electionv1 as e;
        use prost::Message;
        let name = name.to_owned();
        match method {
            Method::Campaign => e::CampaignRequest {
                election: name,
                class: "leaders".into(),
                session_id: -7,
                value: "10.0.0.1:80".into(),
                priority: u32::MAX,
                instance: "pod-1".into(),
            }
            .encode_to_vec(),
            Method::Proclaim => e::ProclaimRequest {
                election: name,
                session_id: 3,
                token: u64::MAX,
                value: "v".into(),
            }
            .encode_to_vec(),
            Method::Leader => e::LeaderRequest { election: name }.encode_to_vec(),
            Method::Observe => e::ObserveRequest {
                election: name,
                from_term: 1 << 40,
                transfer_requests: true,
            }
            .encode_to_vec(),
            Method::Resign => e::ResignRequest {
                election: name,
                session_id: 3,
                token: 9,
            }
            .encode_to_vec(),
            Method::Transfer => e::TransferRequest {
                election: name,
                session_id: 3,
                token: 9,
                to: Some(e::transfer_request::To::CandidateId(12)),
            }
            .encode_to_vec(),
            Method::Candidates => e::CandidatesRequest { election: name }.encode_to_vec(),
            _ => Vec::new(),
        }
    }

    #[test]
    fn election_methods_are_forwarded_by_exact_path_only() {
        for (name, method) in ELECTION {
            assert_eq!(
                Call::of(
                    "POST",
                    &format!("/latchkey.election.v1.ElectionService/{name}")
                ),
                Call::Forward(method),
                "{name}"
            );
            assert!(method.is_keyed(), "{name}");
            assert_eq!(method.has_class(), method == Method::Campaign, "{name}");
            assert_eq!(
                Call::of(
                    "GET",
                    &format!("/latchkey.election.v1.ElectionService/{name}")
                ),
                Call::Unknown
            );
        }
        for unknown in [
            "/latchkey.election.v1.ElectionService/Campaign/",
            "/latchkey.election.v1.ElectionService/campaign",
            "/latchkey.election.v1.ElectionService/CAMPAIGN",
            "/latchkey.election.v1.ElectionService/Campaignx",
            "/latchkey.election.v1.ElectionService/Camp%61ign",
            "/latchkey.election.v1.ElectionService/Campaign?x=1",
            "/latchkey.election.v1.ElectionService/Observe/",
            "/latchkey.election.v1.ElectionService/Elect",
            "/latchkey.election.v1.ElectionService/",
            "/latchkey.election.v1.ElectionService",
            "/latchkey.election.v1.electionservice/Campaign",
            "/latchkey.election.v1.Election/Campaign",
            "/latchkey.election.v2.ElectionService/Campaign",
            "//latchkey.election.v1.ElectionService/Campaign",
            "/latchkey.lock.v1.Lock/Campaign",
            "/latchkey.election.v1.ElectionService/Acquire",
        ] {
            assert_eq!(Call::of("POST", unknown), Call::Unknown, "{unknown}");
        }
    }

    #[test]
    fn every_method_has_its_own_label() {
        let mut labels: Vec<&str> = KEYED.iter().map(|m| m.label()).collect();
        labels.extend([Method::Session.label(), Method::Admin.label()]);
        let n = labels.len();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), n, "{labels:?}");
        for l in labels {
            assert_eq!(crate::metrics::label(l), l);
        }
        assert!(!Method::Session.is_keyed() && !Method::Admin.is_keyed());
    }

    #[test]
    fn decodes_each_election_request() {
        for (name, method) in ELECTION {
            let body = frame(&election_request(method, "jobs/scheduler"));
            let req = decode(method, unframe(&body, 4096).unwrap()).unwrap();
            assert_eq!(req.key, "jobs/scheduler", "{name}");
            if method == Method::Campaign {
                assert_eq!(req.class, Some("leaders"));
                assert!(req.waits);
            } else {
                assert_eq!(req.class, None, "{name}");
                assert!(!req.waits, "{name}");
            }
        }
        // The other arm of Transfer's `to`, and a Campaign without a class
        // (the arbiter refuses it; the edge reads the class as empty).
        use latchkey_proto::electionv1 as e;
        use prost::Message;
        let preferred = e::TransferRequest {
            election: "jobs/scheduler".into(),
            session_id: 3,
            token: 9,
            to: Some(e::transfer_request::To::Preferred(true)),
        }
        .encode_to_vec();
        assert_eq!(
            decode(Method::Transfer, &preferred).unwrap().key,
            "jobs/scheduler"
        );
        let mut w = Writer::new();
        w.string(1, "jobs/scheduler");
        let message = w.finish();
        let req = decode(Method::Campaign, &message).unwrap();
        assert_eq!((req.class, req.waits), (Some(""), true));
    }

    /// Two names in one body: the edge sees the one the arbiter will (prost:
    /// the last), whatever sits between them.
    #[test]
    fn the_last_election_name_wins_like_prost() {
        use latchkey_proto::electionv1 as e;
        use prost::Message;
        for (name, method) in ELECTION {
            let mut body = Writer::new();
            body.string(1, "mine/x");
            let mut message = body.finish();
            message.extend(election_request(method, "theirs/y"));
            assert_eq!(decode(method, &message).unwrap().key, "theirs/y", "{name}");
            let mut w = Writer::new();
            w.string(1, "theirs/y").varint(99, 1).string(1, "mine/x");
            assert_eq!(decode(method, &w.finish()).unwrap().key, "mine/x", "{name}");
        }
        // What prost makes of the first body above.
        let mut w = Writer::new();
        w.string(1, "mine/x");
        let mut message = w.finish();
        message.extend(election_request(Method::Campaign, "theirs/y"));
        let theirs = e::CampaignRequest::decode(message.as_slice()).unwrap();
        assert_eq!(theirs.election, "theirs/y");
    }

    #[test]
    fn an_election_field_with_the_wrong_wire_type_is_refused() {
        // The name as a varint, on every method.
        for (name, method) in ELECTION {
            let mut w = Writer::new();
            w.varint(1, 7);
            assert!(
                matches!(
                    decode(method, &w.finish()),
                    Err(RequestError::Wire(WireError::FieldType { field: 1 }))
                ),
                "{name}"
            );
            // Not UTF-8.
            let mut w = Writer::new();
            w.bytes(1, &[0xff, 0xfe]);
            assert!(decode(method, &w.finish()).is_err(), "{name}");
        }
        let fixed64 = |field: u32| {
            let mut m = Vec::new();
            m.push(((field << 3) | 1) as u8);
            m.extend_from_slice(&9u64.to_le_bytes());
            m
        };
        let with = |tail: Vec<u8>| {
            let mut w = Writer::new();
            w.string(1, "jobs/x");
            let mut m = w.finish();
            m.extend(tail);
            m
        };
        let varint = |field: u32| {
            let mut w = Writer::new();
            w.varint(field, 1);
            w.finish()
        };
        let string = |field: u32| {
            let mut w = Writer::new();
            w.string(field, "s");
            w.finish()
        };
        for (method, tail) in [
            (Method::Acquire, string(7)),   // mode
            (Method::Acquire, varint(8)),   // downgrade_from (fixed64)
            (Method::Release, string(5)),   // mode
            (Method::Campaign, varint(2)),  // class
            (Method::Campaign, fixed64(3)), // session_id
            (Method::Campaign, varint(4)),  // value
            (Method::Campaign, string(5)),  // priority
            (Method::Campaign, varint(6)),  // instance
            (Method::Proclaim, fixed64(3)), // session_id
            (Method::Proclaim, varint(4)),  // token (fixed64)
            (Method::Proclaim, varint(5)),  // value
            (Method::Resign, string(3)),    // session_id
            (Method::Resign, varint(4)),    // token
            (Method::Transfer, varint(4)),  // token
            (Method::Transfer, fixed64(5)), // candidate_id
            (Method::Transfer, string(6)),  // preferred
            (Method::Observe, string(2)),   // from_term
        ] {
            let message = with(tail);
            assert!(decode(method, &message).is_err(), "{method:?} {message:?}");
        }
        // Unknown fields of any wire type are skipped, as prost does.
        for method in [Method::Leader, Method::Candidates, Method::Proclaim] {
            let mut m = with(varint(2));
            m.extend(fixed64(7));
            m.extend(string(8));
            assert_eq!(decode(method, &m).unwrap().key, "jobs/x", "{method:?}");
        }
    }

    #[test]
    fn an_oversized_or_compressed_election_body_is_refused_before_decoding() {
        let body = frame(&election_request(Method::Observe, "jobs/scheduler"));
        let len = body.len() - 5;
        assert!(unframe(&body, len).is_ok());
        assert_eq!(
            unframe(&body, len - 1),
            Err(RequestError::Oversized { len, max: len - 1 })
        );
        let mut compressed = body.clone();
        compressed[0] = 1;
        assert_eq!(unframe(&compressed, 4096), Err(RequestError::Compressed));
        let mut two = body.clone();
        two.extend(frame(&election_request(Method::Observe, "jobs/other")));
        assert!(matches!(
            unframe(&two, 4096),
            Err(RequestError::Length { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

        // The decoder is total: any bytes end in Ok or Err, never a panic.
        #[test]
        fn decoder_never_panics(body in proptest::collection::vec(any::<u8>(), 0..600), max in 0usize..700) {
            for m in KEYED {
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
                mode: 1,
                downgrade_from: Some(session as u64),
            };
            let message = req.encode_to_vec();
            let ours = decode(Method::Acquire, &message).unwrap();
            prop_assert_eq!(ours.key, key);
            prop_assert_eq!(ours.class, Some(class.as_str()));
            prop_assert_eq!(ours.waits, wait != 0);
        }

        // Differential, for every election.v1 request: wherever prost and this
        // decoder both accept a body, they see the same election name (and,
        // for a Campaign, the same class).
        #[test]
        fn election_requests_agree_with_prost_on_what_both_accept(
            body in proptest::collection::vec(any::<u8>(), 0..80),
        ) {
            use latchkey_proto::electionv1 as e;
            use prost::Message;
            let theirs: [(Method, Option<ProstSaw>); 7] = [
                (Method::Campaign, e::CampaignRequest::decode(body.as_slice()).ok().map(|r| (r.election, Some(r.class)))),
                (Method::Proclaim, e::ProclaimRequest::decode(body.as_slice()).ok().map(|r| (r.election, None))),
                (Method::Leader, e::LeaderRequest::decode(body.as_slice()).ok().map(|r| (r.election, None))),
                (Method::Observe, e::ObserveRequest::decode(body.as_slice()).ok().map(|r| (r.election, None))),
                (Method::Resign, e::ResignRequest::decode(body.as_slice()).ok().map(|r| (r.election, None))),
                (Method::Transfer, e::TransferRequest::decode(body.as_slice()).ok().map(|r| (r.election, None))),
                (Method::Candidates, e::CandidatesRequest::decode(body.as_slice()).ok().map(|r| (r.election, None))),
            ];
            for (method, theirs) in theirs {
                if let (Ok(ours), Some((election, class))) = (decode(method, &body), theirs) {
                    prop_assert_eq!(ours.key, election.as_str());
                    prop_assert_eq!(ours.class.map(str::to_owned), class);
                }
            }
        }

        // Every request prost encodes, the edge decodes to the same name:
        // no well-formed election call is refused by the decoder.
        #[test]
        fn election_requests_prost_encodes_are_decoded(
            name in "\\PC{0,40}",
            class in "\\PC{0,12}",
            value in "\\PC{0,20}",
            session in any::<i64>(),
            token in any::<u64>(),
            number in any::<u64>(),
            priority in any::<u32>(),
            preferred in any::<bool>(),
        ) {
            use latchkey_proto::electionv1 as e;
            use prost::Message;
            let to = if preferred {
                e::transfer_request::To::Preferred(number % 2 == 0)
            } else {
                e::transfer_request::To::CandidateId(number)
            };
            let requests = [
                (Method::Campaign, e::CampaignRequest {
                    election: name.clone(), class: class.clone(), session_id: session,
                    value: value.clone(), priority, instance: value.clone(),
                }.encode_to_vec()),
                (Method::Proclaim, e::ProclaimRequest {
                    election: name.clone(), session_id: session, token, value: value.clone(),
                }.encode_to_vec()),
                (Method::Leader, e::LeaderRequest { election: name.clone() }.encode_to_vec()),
                (Method::Observe, e::ObserveRequest { election: name.clone(), from_term: number, transfer_requests: number % 2 == 0 }.encode_to_vec()),
                (Method::Resign, e::ResignRequest { election: name.clone(), session_id: session, token }.encode_to_vec()),
                (Method::Transfer, e::TransferRequest {
                    election: name.clone(), session_id: session, token, to: Some(to),
                }.encode_to_vec()),
                (Method::Candidates, e::CandidatesRequest { election: name.clone() }.encode_to_vec()),
            ];
            for (method, message) in requests {
                let ours = decode(method, &message).unwrap();
                prop_assert_eq!(ours.key, name.as_str());
                if method == Method::Campaign {
                    prop_assert_eq!(ours.class, Some(class.as_str()));
                    prop_assert!(ours.waits);
                } else {
                    prop_assert_eq!(ours.class, None);
                    prop_assert!(!ours.waits);
                }
            }
        }
    }
}
