//! The built filter (`target/wasm/latchkey_filter.wasm`) against scripted host
//! calls: identity, reserved headers, authorisation, bounds, configuration and
//! the grant-table refresh, as Envoy would drive them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use latchkey_filter_abi_tests::host::SERVED;
use latchkey_filter_abi_tests::{
    Action, FilterVm, LocalReply, LogLevel, SharedDataHandle, module_exports, module_imports,
};
use latchkey_proto::adminv1::{EdgeClass, EdgeGrant, EdgePolicy};
use latchkey_proto::electionv1::{CampaignRequest, ObserveRequest, ProclaimRequest};
use latchkey_proto::lockv1::{AcquireRequest, InspectRequest};
use prost::Message;
use serde_json::{Value, json};

const ALICE: &str = "spiffe://dev.latchkey/workload/alice";
const BOB: &str = "spiffe://dev.latchkey/workload/bob";
const ACQUIRE: &str = "/latchkey.lock.v1.Lock/Acquire";
const INSPECT: &str = "/latchkey.lock.v1.Lock/Inspect";
const OPEN_SESSION: &str = "/latchkey.lock.v1.Lock/OpenSession";
const CAMPAIGN: &str = "/latchkey.election.v1.ElectionService/Campaign";
const PROCLAIM: &str = "/latchkey.election.v1.ElectionService/Proclaim";
const OBSERVE: &str = "/latchkey.election.v1.ElectionService/Observe";
const IDENTITY_HEADER: &str = "x-latchkey-identity";

/// gRPC status codes the edge answers with.
const INVALID_ARGUMENT: i32 = 3;
const PERMISSION_DENIED: i32 = 7;
const RESOURCE_EXHAUSTED: i32 = 8;
const UNIMPLEMENTED: i32 = 12;
const UNAVAILABLE: i32 = 14;
const UNAUTHENTICATED: i32 = 16;

/// Alice may lock under `demo`; the class `demo` allows 4 waiters per key.
fn config(overrides: Value) -> Vec<u8> {
    let mut config = json!({
        "trustDomain": "dev.latchkey",
        "admissionSecret": "000102030405060708090a0b0c0d0e0f",
        "grants": [{"identity": ALICE, "prefixes": ["demo"]}],
        "classes": [{"name": "demo", "maxWaitersPerKey": 4}],
    });
    for (k, v) in overrides.as_object().unwrap() {
        config[k] = v.clone();
    }
    serde_json::to_vec(&config).unwrap()
}

fn started(overrides: Value) -> FilterVm {
    let mut vm = FilterVm::new().unwrap();
    assert!(
        vm.start(&config(overrides)).unwrap(),
        "{:?}",
        vm.host().logs
    );
    vm
}

fn headers<'a>(path: &'a str, extra: &[(&'a str, &'a [u8])]) -> Vec<(&'a str, &'a [u8])> {
    let mut h: Vec<(&str, &[u8])> = vec![
        (":method", b"POST"),
        (":path", path.as_bytes()),
        (":authority", b"edge.dev.latchkey"),
        ("content-type", b"application/grpc"),
        ("te", b"trailers"),
    ];
    h.extend_from_slice(extra);
    h
}

fn frame(message: &[u8]) -> Vec<u8> {
    let mut body = vec![0];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message);
    body
}

fn acquire(key: &str, wait: bool) -> Vec<u8> {
    frame(
        &AcquireRequest {
            key: key.into(),
            class: "demo".into(),
            session_id: 1,
            wait: i32::from(wait),
            ..Default::default()
        }
        .encode_to_vec(),
    )
}

fn inspect(key: &str) -> Vec<u8> {
    frame(&InspectRequest { key: key.into() }.encode_to_vec())
}

fn campaign(election: &str) -> Vec<u8> {
    frame(
        &CampaignRequest {
            election: election.into(),
            class: "demo".into(),
            session_id: 1,
            value: "10.0.0.1:8080".into(),
            priority: 1,
            instance: "pod-1".into(),
        }
        .encode_to_vec(),
    )
}

fn proclaim(election: &str) -> Vec<u8> {
    frame(
        &ProclaimRequest {
            election: election.into(),
            session_id: 1,
            token: 1 << 48,
            value: "10.0.0.2:8080".into(),
        }
        .encode_to_vec(),
    )
}

fn observe(election: &str) -> Vec<u8> {
    frame(
        &ObserveRequest {
            election: election.into(),
            from_term: 0,
            transfer_requests: false,
        }
        .encode_to_vec(),
    )
}

/// A keyed call from `peer` through the header and body phases: the stream,
/// and what each phase answered.
fn keyed_call(
    vm: &mut FilterVm,
    peer: &str,
    path: &str,
    body: &[u8],
    extra: &[(&str, &[u8])],
) -> (u32, Action, Option<Action>) {
    let id = vm.open(Some(peer), &headers(path, extra)).unwrap();
    let at_headers = vm.request_headers(id, false).unwrap();
    if vm.stream(id).unwrap().local_reply.is_some() {
        return (id, at_headers, None);
    }
    let at_body = vm.request_body(id, body, true).unwrap();
    (id, at_headers, Some(at_body))
}

fn reply(vm: &FilterVm, id: u32) -> LocalReply {
    vm.stream(id)
        .unwrap()
        .local_reply
        .clone()
        .expect("a local reply")
}

/// A gRPC refusal: HTTP 200, the code, and the reason in the status details.
fn assert_refused(vm: &FilterVm, id: u32, code: i32, reason: &str) {
    let r = reply(vm, id);
    assert_eq!(
        (r.http_status, r.grpc_status),
        (200, code),
        "{}",
        r.message()
    );
    assert_eq!(r.error_reason().as_deref(), Some(reason), "{}", r.message());
}

#[test]
fn a_granted_spiffe_peer_is_passed_on_with_its_identity() {
    let mut vm = started(json!({}));
    let (id, at_headers, at_body) =
        keyed_call(&mut vm, ALICE, ACQUIRE, &acquire("demo/report", true), &[]);
    assert_eq!(at_headers, Action::Continue);
    assert_eq!(at_body, Some(Action::Continue));
    let s = vm.stream(id).unwrap();
    assert!(s.local_reply.is_none());
    assert!(!s.reset);
    assert_eq!(s.request_header(IDENTITY_HEADER).as_deref(), Some(ALICE));
    assert_eq!(s.request_header_count(IDENTITY_HEADER), 1);
    // The ring hash routes by the key the filter authorised, from the body.
    assert_eq!(
        s.filter_state,
        vec![("envoy.hashable_string".into(), "demo/report".into())]
    );
    assert_eq!(
        vm.stat("latchkey_edge.allowed.method.acquire.ns.demo.class.demo"),
        Some(1)
    );
    // A waiting Acquire holds a waiter place until the arbiter answers, and
    // its stream a stream place until it ends.
    assert_eq!(vm.stat("latchkey_edge.waiters.ns.demo.class.demo"), Some(1));
    assert_eq!(vm.stat("latchkey_edge.streams_open"), Some(1));
    assert_eq!(vm.response_headers(id).unwrap(), Action::Continue);
    assert_eq!(vm.stat("latchkey_edge.waiters.ns.demo.class.demo"), Some(0));
    vm.end(id).unwrap();
    assert_eq!(vm.stat("latchkey_edge.streams_open"), Some(0));
    assert!(
        vm.logs_at_least(LogLevel::Warn).is_empty(),
        "{:?}",
        vm.host().logs
    );
}

#[test]
fn an_unkeyed_call_is_passed_on_at_the_headers_with_its_identity() {
    let mut vm = started(json!({}));
    let id = vm.open(Some(BOB), &headers(OPEN_SESSION, &[])).unwrap();
    assert_eq!(vm.request_headers(id, false).unwrap(), Action::Continue);
    let s = vm.stream(id).unwrap();
    assert!(s.local_reply.is_none());
    assert_eq!(s.request_header(IDENTITY_HEADER).as_deref(), Some(BOB));
    // Decided at the headers: the body passes untouched.
    assert_eq!(
        vm.request_body(id, b"anything", true).unwrap(),
        Action::Continue
    );
    assert_eq!(
        vm.stat("latchkey_edge.allowed.method.session.ns._.class._"),
        Some(1)
    );
}

#[test]
fn a_peer_without_a_grant_is_refused_permission_denied() {
    let mut vm = started(json!({}));
    for (peer, key) in [
        (BOB, "demo/report"),
        (ALICE, "other/report"),
        (ALICE, "demox/a"),
    ] {
        let (id, at_headers, at_body) = keyed_call(&mut vm, peer, INSPECT, &inspect(key), &[]);
        assert_eq!(at_headers, Action::Continue, "{peer} {key}");
        assert_eq!(at_body, Some(Action::Pause), "{peer} {key}");
        assert_refused(&vm, id, PERMISSION_DENIED, "NOT_AUTHORISED");
        // One message whether or not a grant exists nearby (ADR-19).
        assert_eq!(
            reply(&vm, id).message(),
            "not authorised for this key: no prefix grant for the caller covers it"
        );
        assert!(vm.stream(id).unwrap().filter_state.is_empty());
        vm.end(id).unwrap();
    }
    assert_eq!(
        vm.stat("latchkey_edge.denied.reason.not_authorised"),
        Some(3)
    );
    assert_eq!(vm.stat("latchkey_edge.streams_open"), Some(0));
}

#[test]
fn a_client_sent_identity_header_is_never_trusted() {
    let mut vm = started(json!({}));
    // Bob claims to be Alice: refused before anything is forwarded, whatever
    // the spelling, and any other reserved name too.
    for (name, value) in [
        ("x-latchkey-identity", ALICE),
        ("X-Latchkey-Identity", ALICE),
        ("x-latchkey-dev-identity", ALICE),
    ] {
        let (id, at_headers, at_body) = keyed_call(
            &mut vm,
            BOB,
            ACQUIRE,
            &acquire("demo/report", false),
            &[(name, value.as_bytes())],
        );
        assert_eq!((at_headers, at_body), (Action::Pause, None), "{name}");
        assert_refused(&vm, id, INVALID_ARGUMENT, "RESERVED_HEADER");
        // Nothing the filter set names anyone: the only identity header on the
        // (never forwarded) request is the client's own.
        assert_eq!(
            vm.stream(id).unwrap().request_header(name).as_deref(),
            Some(ALICE)
        );
        assert_eq!(vm.stream(id).unwrap().request_header_count(name), 1);
        vm.end(id).unwrap();
    }
    // In the trailers too (tonic merges a unary request's trailers into its
    // metadata), even on a call already passed on at the headers.
    let id = vm.open(Some(BOB), &headers(OPEN_SESSION, &[])).unwrap();
    assert_eq!(vm.request_headers(id, false).unwrap(), Action::Continue);
    assert_eq!(
        vm.request_trailers(id, &[(IDENTITY_HEADER, ALICE.as_bytes())])
            .unwrap(),
        Action::Pause
    );
    assert_refused(&vm, id, INVALID_ARGUMENT, "RESERVED_HEADER");
    assert_eq!(
        vm.stat("latchkey_edge.denied.reason.reserved_header"),
        Some(3)
    );
    assert_eq!(
        vm.stat("latchkey_edge.denied.reason.reserved_trailer"),
        Some(1)
    );
}

#[test]
fn without_a_verified_spiffe_id_the_caller_is_unauthenticated() {
    let mut vm = started(json!({}));
    for peer in [
        None,
        Some(""),
        Some("spiffe://other.domain/workload/alice"),
        Some("https://dev.latchkey/workload/alice"),
    ] {
        let id = vm.open(peer, &headers(ACQUIRE, &[])).unwrap();
        assert_eq!(vm.request_headers(id, false).unwrap(), Action::Pause);
        assert_refused(&vm, id, UNAUTHENTICATED, "UNAUTHENTICATED");
        assert_eq!(vm.stream(id).unwrap().request_header(IDENTITY_HEADER), None);
        vm.end(id).unwrap();
    }
}

#[test]
fn a_malformed_configuration_is_refused() {
    for bad in [
        b"not json".to_vec(),
        config(json!({"trustDomain": "not a trust domain!"})),
        config(json!({"maxStreamsPerIdentity": 0})),
        config(json!({"noSuchField": 1})),
        config(json!({"grants": [{"identity": ALICE, "prefixes": ["a//b"]}]})),
    ] {
        let mut vm = FilterVm::new().unwrap();
        assert!(
            !vm.start(&bad).unwrap(),
            "{}",
            String::from_utf8_lossy(&bad)
        );
        assert_eq!(vm.stat("latchkey_edge.config_errors"), Some(1));
        let errors = vm.logs_at_least(LogLevel::Error);
        assert!(
            errors
                .iter()
                .any(|l| l.contains("latchkey edge: configuration refused")),
            "{errors:?}"
        );
    }
    // A bad update of a configured VM is refused and the last good
    // configuration keeps deciding.
    let mut vm = started(json!({}));
    assert!(!vm.configure(b"{\"trustDomain\": 7}").unwrap());
    let (id, _, at_body) = keyed_call(&mut vm, ALICE, INSPECT, &inspect("demo/a"), &[]);
    assert_eq!(at_body, Some(Action::Continue));
    assert!(vm.stream(id).unwrap().local_reply.is_none());
}

#[test]
fn the_per_identity_stream_bound_refuses_the_next_stream() {
    let mut vm = started(json!({"maxStreamsPerIdentity": 2}));
    let open = |vm: &mut FilterVm, peer| {
        let id = vm.open(Some(peer), &headers(OPEN_SESSION, &[])).unwrap();
        (id, vm.request_headers(id, false).unwrap())
    };
    let (first, a) = open(&mut vm, ALICE);
    let (_second, b) = open(&mut vm, ALICE);
    assert_eq!((a, b), (Action::Continue, Action::Continue));
    let (third, c) = open(&mut vm, ALICE);
    assert_eq!(c, Action::Pause);
    assert_refused(&vm, third, RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS");
    vm.end(third).unwrap();
    // Another identity has a bound of its own.
    let (_, other) = open(&mut vm, BOB);
    assert_eq!(other, Action::Continue);
    // A stream that ends gives its place back.
    vm.end(first).unwrap();
    let (_, again) = open(&mut vm, ALICE);
    assert_eq!(again, Action::Continue);
    assert_eq!(
        vm.stat("latchkey_edge.denied.reason.too_many_streams"),
        Some(1)
    );
    assert_eq!(vm.stat("latchkey_edge.streams_open"), Some(3));
}

#[test]
fn the_per_identity_waiter_bound_refuses_the_next_waiting_acquire() {
    let mut vm = started(json!({"maxWaitersPerIdentity": 1}));
    let (first, _, a) = keyed_call(&mut vm, ALICE, ACQUIRE, &acquire("demo/one", true), &[]);
    assert_eq!(a, Some(Action::Continue));
    let (second, _, b) = keyed_call(&mut vm, ALICE, ACQUIRE, &acquire("demo/two", true), &[]);
    assert_eq!(b, Some(Action::Pause));
    let r = reply(&vm, second);
    assert_refused(&vm, second, RESOURCE_EXHAUSTED, "QUEUE_FULL");
    assert!(
        r.message().contains("too many waiting acquires"),
        "{}",
        r.message()
    );
    assert_eq!(
        vm.stat("latchkey_edge.denied.reason.queue_full_identity"),
        Some(1)
    );
    assert_eq!(
        vm.stat("latchkey_edge.admission_rejected.scope.identity.ns.demo.class.demo"),
        Some(1)
    );
    // A try-lock (no wait) is never counted as a waiter.
    let (_, _, no_wait) = keyed_call(&mut vm, ALICE, ACQUIRE, &acquire("demo/three", false), &[]);
    assert_eq!(no_wait, Some(Action::Continue));
    // The arbiter answered the first: its place comes back.
    vm.response_headers(first).unwrap();
    let (_, _, c) = keyed_call(&mut vm, ALICE, ACQUIRE, &acquire("demo/two", true), &[]);
    assert_eq!(c, Some(Action::Continue));
}

#[test]
fn the_routing_key_header_is_removed_and_must_match_the_body() {
    let mut vm = started(json!({}));
    let (id, _, at_body) = keyed_call(
        &mut vm,
        ALICE,
        INSPECT,
        &inspect("demo/a"),
        &[("x-lock-key", b"demo/a")],
    );
    assert_eq!(at_body, Some(Action::Continue));
    let s = vm.stream(id).unwrap();
    assert_eq!(s.request_header("x-lock-key"), None);
    assert_eq!(
        s.filter_state,
        vec![("envoy.hashable_string".into(), "demo/a".into())]
    );
    let (id, _, at_body) = keyed_call(
        &mut vm,
        ALICE,
        INSPECT,
        &inspect("demo/a"),
        &[("x-lock-key", b"demo/b")],
    );
    assert_eq!(at_body, Some(Action::Pause));
    assert_refused(&vm, id, INVALID_ARGUMENT, "BAD_REQUEST");
    assert_eq!(vm.stat("latchkey_edge.denied.reason.key_mismatch"), Some(1));
}

#[test]
fn unknown_methods_edge_policy_and_bad_bodies_are_answered_by_the_edge() {
    let mut vm = started(json!({"maxMessageBytes": 64}));
    let id = vm
        .open(Some(ALICE), &headers("/latchkey.lock.v1.Lock/Steal", &[]))
        .unwrap();
    assert_eq!(vm.request_headers(id, false).unwrap(), Action::Pause);
    assert_refused(&vm, id, UNIMPLEMENTED, "UNIMPLEMENTED");
    let id = vm
        .open(
            Some(ALICE),
            &headers("/latchkey.admin.v1.Admin/GetEdgePolicy", &[]),
        )
        .unwrap();
    assert_eq!(vm.request_headers(id, false).unwrap(), Action::Pause);
    assert_refused(&vm, id, PERMISSION_DENIED, "NOT_AUTHORISED");
    // Oversized: refused as soon as the buffered body is over the limit.
    let id = vm.open(Some(ALICE), &headers(INSPECT, &[])).unwrap();
    vm.request_headers(id, false).unwrap();
    assert_eq!(
        vm.request_body(id, &[0u8; 70], false).unwrap(),
        Action::Pause
    );
    assert_refused(&vm, id, RESOURCE_EXHAUSTED, "BAD_REQUEST");
    // Not a gRPC frame of the method's message.
    let (id, _, at_body) = keyed_call(
        &mut vm,
        ALICE,
        INSPECT,
        &[0, 0, 0, 0, 3, 0xff, 0xff, 0xff],
        &[],
    );
    assert_eq!(at_body, Some(Action::Pause));
    assert_refused(&vm, id, INVALID_ARGUMENT, "BAD_REQUEST");
    // A keyed call without a body cannot be decided.
    let id = vm.open(Some(ALICE), &headers(INSPECT, &[])).unwrap();
    assert_eq!(vm.request_headers(id, true).unwrap(), Action::Pause);
    assert_refused(&vm, id, INVALID_ARGUMENT, "BAD_REQUEST");
    // A header value that is not UTF-8 does not take the VM down.
    let (id, _, at_body) = keyed_call(
        &mut vm,
        ALICE,
        INSPECT,
        &inspect("demo/a"),
        &[("x-custom", &[0xff, 0xfe])],
    );
    assert_eq!(at_body, Some(Action::Continue));
    assert!(vm.stream(id).unwrap().local_reply.is_none());
}

#[test]
fn an_authorised_campaign_is_passed_on_like_a_waiting_acquire() {
    let mut vm = started(json!({}));
    let (id, at_headers, at_body) = keyed_call(
        &mut vm,
        ALICE,
        CAMPAIGN,
        &campaign("demo/scheduler"),
        &[("x-lock-key", b"demo/scheduler")],
    );
    assert_eq!(
        (at_headers, at_body),
        (Action::Continue, Some(Action::Continue))
    );
    let s = vm.stream(id).unwrap();
    assert!(s.local_reply.is_none());
    assert!(!s.reset);
    // Named by the edge, once; the client's routing header gone; routed by
    // the election the filter authorised.
    assert_eq!(s.request_header(IDENTITY_HEADER).as_deref(), Some(ALICE));
    assert_eq!(s.request_header_count(IDENTITY_HEADER), 1);
    assert_eq!(s.request_header("x-lock-key"), None);
    assert_eq!(
        s.filter_state,
        vec![("envoy.hashable_string".into(), "demo/scheduler".into())]
    );
    assert_eq!(
        vm.stat("latchkey_edge.allowed.method.campaign.ns.demo.class.demo"),
        Some(1)
    );
    // A waiter until the arbiter answers (it leads, or the deadline came).
    assert_eq!(vm.stat("latchkey_edge.waiters.ns.demo.class.demo"), Some(1));
    assert_eq!(vm.stat("latchkey_edge.streams_open"), Some(1));
    vm.response_headers(id).unwrap();
    assert_eq!(vm.stat("latchkey_edge.waiters.ns.demo.class.demo"), Some(0));
    vm.end(id).unwrap();
    assert_eq!(vm.stat("latchkey_edge.streams_open"), Some(0));
    assert!(
        vm.logs_at_least(LogLevel::Warn).is_empty(),
        "{:?}",
        vm.host().logs
    );
}

#[test]
fn a_campaign_without_a_grant_is_refused_and_never_forwarded() {
    let mut vm = started(json!({}));
    for (peer, election) in [
        (BOB, "demo/scheduler"),
        (ALICE, "other/scheduler"),
        (ALICE, "demox/scheduler"),
    ] {
        let (id, at_headers, at_body) =
            keyed_call(&mut vm, peer, CAMPAIGN, &campaign(election), &[]);
        assert_eq!(at_headers, Action::Continue, "{peer} {election}");
        assert_eq!(at_body, Some(Action::Pause), "{peer} {election}");
        assert_refused(&vm, id, PERMISSION_DENIED, "NOT_AUTHORISED");
        assert_eq!(
            reply(&vm, id).message(),
            "not authorised for this key: no prefix grant for the caller covers it"
        );
        assert!(vm.stream(id).unwrap().filter_state.is_empty());
        vm.end(id).unwrap();
    }
    assert_eq!(
        vm.stat("latchkey_edge.denied.reason.not_authorised"),
        Some(3)
    );
    // No waiter place was ever taken, nothing counted as allowed.
    assert_eq!(vm.stat("latchkey_edge.waiters.ns.demo.class.demo"), None);
    assert_eq!(
        vm.stat("latchkey_edge.allowed.method.campaign.ns.demo.class.demo"),
        None
    );
    assert_eq!(vm.stat("latchkey_edge.streams_open"), Some(0));
}

#[test]
fn campaigns_count_against_the_waiter_bounds() {
    let mut vm = started(json!({"maxWaitersPerIdentity": 1}));
    let (first, _, a) = keyed_call(&mut vm, ALICE, CAMPAIGN, &campaign("demo/one"), &[]);
    assert_eq!(a, Some(Action::Continue));
    // The identity's one waiting place is taken: by a campaign or an acquire.
    let (second, _, b) = keyed_call(&mut vm, ALICE, CAMPAIGN, &campaign("demo/two"), &[]);
    assert_eq!(b, Some(Action::Pause));
    assert_refused(&vm, second, RESOURCE_EXHAUSTED, "QUEUE_FULL");
    let (third, _, c) = keyed_call(&mut vm, ALICE, ACQUIRE, &acquire("demo/two", true), &[]);
    assert_eq!(c, Some(Action::Pause));
    assert_refused(&vm, third, RESOURCE_EXHAUSTED, "QUEUE_FULL");
    vm.response_headers(first).unwrap();
    let (_, _, d) = keyed_call(&mut vm, ALICE, CAMPAIGN, &campaign("demo/two"), &[]);
    assert_eq!(d, Some(Action::Continue));
}

#[test]
fn an_observe_stream_counts_against_the_stream_bound_until_it_ends() {
    let mut vm = started(json!({"maxStreamsPerIdentity": 2}));
    let (first, _, a) = keyed_call(&mut vm, ALICE, OBSERVE, &observe("demo/scheduler"), &[]);
    let (second, _, b) = keyed_call(&mut vm, ALICE, OBSERVE, &observe("demo/scheduler"), &[]);
    assert_eq!((a, b), (Some(Action::Continue), Some(Action::Continue)));
    for id in [first, second] {
        let s = vm.stream(id).unwrap();
        assert!(s.local_reply.is_none());
        assert_eq!(s.request_header(IDENTITY_HEADER).as_deref(), Some(ALICE));
        assert_eq!(
            s.filter_state,
            vec![("envoy.hashable_string".into(), "demo/scheduler".into())]
        );
    }
    assert_eq!(
        vm.stat("latchkey_edge.allowed.method.observe.ns.demo.class._none"),
        Some(2)
    );
    // The arbiter's answer opens the event stream; it is no waiter, and it
    // keeps its stream place for as long as it is open.
    vm.response_headers(first).unwrap();
    assert_eq!(vm.stat("latchkey_edge.waiters.ns.demo.class.demo"), None);
    assert_eq!(vm.stat("latchkey_edge.streams_open"), Some(2));
    // A third stream of the identity, Observe or any other, is refused.
    let (third, at_headers, at_body) =
        keyed_call(&mut vm, ALICE, OBSERVE, &observe("demo/scheduler"), &[]);
    assert_eq!((at_headers, at_body), (Action::Pause, None));
    assert_refused(&vm, third, RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS");
    vm.end(third).unwrap();
    let session = vm.open(Some(ALICE), &headers(OPEN_SESSION, &[])).unwrap();
    assert_eq!(vm.request_headers(session, false).unwrap(), Action::Pause);
    assert_refused(&vm, session, RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS");
    vm.end(session).unwrap();
    // Bob's bound is his own: his stream passes it (and is then refused on
    // his grants, which do not cover the election).
    let (bob, at_headers, _) = keyed_call(&mut vm, BOB, OBSERVE, &observe("demo/scheduler"), &[]);
    assert_eq!(at_headers, Action::Continue);
    assert_refused(&vm, bob, PERMISSION_DENIED, "NOT_AUTHORISED");
    vm.end(bob).unwrap();
    // An observer that goes away gives its place back.
    vm.end(first).unwrap();
    let (_, _, again) = keyed_call(&mut vm, ALICE, OBSERVE, &observe("demo/scheduler"), &[]);
    assert_eq!(again, Some(Action::Continue));
    assert_eq!(
        vm.stat("latchkey_edge.denied.reason.too_many_streams"),
        Some(2)
    );
}

#[test]
fn a_proclaim_is_decided_on_the_election_it_names() {
    let mut vm = started(json!({}));
    let (id, _, at_body) = keyed_call(&mut vm, ALICE, PROCLAIM, &proclaim("demo/scheduler"), &[]);
    assert_eq!(at_body, Some(Action::Continue));
    let s = vm.stream(id).unwrap();
    assert!(s.local_reply.is_none());
    assert_eq!(s.request_header(IDENTITY_HEADER).as_deref(), Some(ALICE));
    assert_eq!(
        s.filter_state,
        vec![("envoy.hashable_string".into(), "demo/scheduler".into())]
    );
    assert_eq!(
        vm.stat("latchkey_edge.allowed.method.proclaim.ns.demo.class._none"),
        Some(1)
    );
    // Never a waiter.
    assert_eq!(vm.stat("latchkey_edge.waiters.ns.demo.class.demo"), None);
    vm.end(id).unwrap();

    // Two names in one message: prost (the arbiter) reads the last, and so
    // does the edge.
    let two = |first: &str, last: &str| {
        let mut message = ProclaimRequest {
            election: first.into(),
            ..Default::default()
        }
        .encode_to_vec();
        message.extend(
            ProclaimRequest {
                election: last.into(),
                session_id: 1,
                token: 1 << 48,
                value: "v".into(),
            }
            .encode_to_vec(),
        );
        frame(&message)
    };
    let (id, _, at_body) = keyed_call(&mut vm, ALICE, PROCLAIM, &two("demo/a", "other/b"), &[]);
    assert_eq!(at_body, Some(Action::Pause));
    assert_refused(&vm, id, PERMISSION_DENIED, "NOT_AUTHORISED");
    let (id, _, at_body) = keyed_call(&mut vm, ALICE, PROCLAIM, &two("other/b", "demo/a"), &[]);
    assert_eq!(at_body, Some(Action::Continue));
    assert_eq!(
        vm.stream(id).unwrap().filter_state,
        vec![("envoy.hashable_string".into(), "demo/a".into())]
    );
    // The token (fixed64) sent as a varint: not a ProclaimRequest.
    let mut bad = ProclaimRequest {
        election: "demo/a".into(),
        ..Default::default()
    }
    .encode_to_vec();
    bad.extend([4 << 3, 1]);
    let (id, _, at_body) = keyed_call(&mut vm, ALICE, PROCLAIM, &frame(&bad), &[]);
    assert_eq!(at_body, Some(Action::Pause));
    assert_refused(&vm, id, INVALID_ARGUMENT, "BAD_REQUEST");
    // A routing header that is not the election.
    let (id, _, at_body) = keyed_call(
        &mut vm,
        ALICE,
        PROCLAIM,
        &proclaim("demo/a"),
        &[("x-lock-key", b"demo/b")],
    );
    assert_eq!(at_body, Some(Action::Pause));
    assert_refused(&vm, id, INVALID_ARGUMENT, "BAD_REQUEST");
}

#[test]
fn unknown_election_methods_are_answered_by_the_edge() {
    let mut vm = started(json!({}));
    for path in [
        "/latchkey.election.v1.ElectionService/Campaign/",
        "/latchkey.election.v1.ElectionService/campaign",
        "/latchkey.election.v1.ElectionService/Elect",
        "/latchkey.election.v1.electionservice/Observe",
    ] {
        let id = vm.open(Some(ALICE), &headers(path, &[])).unwrap();
        assert_eq!(
            vm.request_headers(id, false).unwrap(),
            Action::Pause,
            "{path}"
        );
        assert_refused(&vm, id, UNIMPLEMENTED, "UNIMPLEMENTED");
        assert_eq!(vm.stream(id).unwrap().request_header(IDENTITY_HEADER), None);
        vm.end(id).unwrap();
    }
    assert_eq!(
        vm.stat("latchkey_edge.denied.reason.unknown_method"),
        Some(4)
    );
}

fn edge_policy(version: u64, grants: &[(&str, &[&str])]) -> Vec<u8> {
    EdgePolicy {
        version,
        grants: grants
            .iter()
            .map(|(identity, prefixes)| EdgeGrant {
                identity: (*identity).into(),
                prefixes: prefixes.iter().map(|p| (*p).into()).collect(),
            })
            .collect(),
        classes: vec![EdgeClass {
            name: "demo".into(),
            max_waiters_per_key: 4,
        }],
    }
    .encode_to_vec()
}

fn arbiter_only() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "trustDomain": "dev.latchkey",
        "admissionSecret": "000102030405060708090a0b0c0d0e0f",
        "refresh": {"cluster": "arbiter_policy", "periodMs": 2000, "timeoutMs": 1000},
    }))
    .unwrap()
}

#[test]
fn the_grant_table_comes_from_the_arbiter_on_a_timer_and_is_kept_for_the_next_vm() {
    let shared = SharedDataHandle::default();
    let mut vm = FilterVm::with_shared_data(shared.clone()).unwrap();
    assert!(vm.start(&arbiter_only()).unwrap());
    assert_eq!(vm.host().tick_period_ms, Some(200));
    assert_eq!(
        vm.stat("latchkey_edge.grant_table_start.result.none"),
        Some(1)
    );
    // No table yet: retry, never PERMISSION_DENIED (issue 19).
    let (id, _, _) = keyed_call(&mut vm, ALICE, INSPECT, &inspect("demo/a"), &[]);
    assert_refused(&vm, id, UNAVAILABLE, "POLICY_NOT_READY");

    vm.tick().unwrap();
    // Not ready: the next refresh within a second, not a whole period.
    assert_eq!(vm.host().tick_period_ms, Some(1000));
    let call = vm.host().grpc_calls.last().cloned().unwrap();
    assert_eq!(
        (
            call.cluster.as_str(),
            call.service.as_str(),
            call.method.as_str()
        ),
        ("arbiter_policy", "latchkey.admin.v1.Admin", "GetEdgePolicy")
    );
    assert_eq!(call.timeout_ms, 1000);
    vm.grpc_receive(call.token, &edge_policy(7, &[(ALICE, &["demo"])]))
        .unwrap();
    assert_eq!(vm.stat("latchkey_edge.grant_table_version"), Some(7));
    assert_eq!(
        vm.stat("latchkey_edge.policy_refresh.result.updated"),
        Some(1)
    );
    assert_eq!(
        vm.stat("latchkey_edge.grant_table_store.result.written"),
        Some(1)
    );
    let (id, _, at_body) = keyed_call(&mut vm, ALICE, INSPECT, &inspect("demo/a"), &[]);
    assert_eq!(at_body, Some(Action::Continue));
    assert!(vm.stream(id).unwrap().local_reply.is_none());
    let (id, _, _) = keyed_call(&mut vm, BOB, INSPECT, &inspect("demo/a"), &[]);
    assert_refused(&vm, id, PERMISSION_DENIED, "NOT_AUTHORISED");

    // A failed refresh keeps the table and says so.
    vm.tick().unwrap();
    assert_eq!(vm.host().tick_period_ms, Some(2000));
    let token = vm.host().grpc_calls.last().unwrap().token;
    vm.grpc_close(token, 14, Some("upstream connect error"))
        .unwrap();
    assert_eq!(
        vm.stat("latchkey_edge.policy_refresh.result.failed"),
        Some(1)
    );
    assert!(
        vm.logs_at_least(LogLevel::Warn)
            .iter()
            .any(|l| l.contains("grant table refresh failed (grpc status 14")),
        "{:?}",
        vm.host().logs
    );
    let (_, _, at_body) = keyed_call(&mut vm, ALICE, INSPECT, &inspect("demo/a"), &[]);
    assert_eq!(at_body, Some(Action::Continue));

    // A VM swapped in (same vm_id: same shared data) starts from that table.
    let mut next = FilterVm::with_shared_data(shared).unwrap();
    assert!(next.start(&arbiter_only()).unwrap());
    assert_eq!(
        next.stat("latchkey_edge.grant_table_start.result.carried"),
        Some(1)
    );
    let (id, _, at_body) = keyed_call(&mut next, ALICE, INSPECT, &inspect("demo/a"), &[]);
    assert_eq!(at_body, Some(Action::Continue));
    assert!(next.stream(id).unwrap().local_reply.is_none());
}

#[test]
fn a_stale_table_tells_uncovered_keys_to_retry() {
    let mut vm = FilterVm::new().unwrap();
    assert!(vm.start(&arbiter_only()).unwrap());
    vm.tick().unwrap();
    let token = vm.host().grpc_calls.last().unwrap().token;
    vm.grpc_receive(token, &edge_policy(1, &[(ALICE, &["demo"])]))
        .unwrap();
    // Three periods and a timeout without a confirmation: stale.
    vm.advance(std::time::Duration::from_millis(7_001));
    let (id, _, _) = keyed_call(&mut vm, BOB, INSPECT, &inspect("demo/a"), &[]);
    assert_refused(&vm, id, UNAVAILABLE, "POLICY_STALE");
    let (_, _, covered) = keyed_call(&mut vm, ALICE, INSPECT, &inspect("demo/a"), &[]);
    assert_eq!(covered, Some(Action::Continue));
}

#[test]
fn the_module_is_a_proxy_wasm_0_2_1_filter() {
    let imports = module_imports().unwrap();
    // The Rust SDK declares every host call of the ABI; all come from `env`.
    assert!(
        imports.iter().all(|i| i.starts_with("env::proxy_")),
        "{imports:?}"
    );
    // What this host serves is what the module imports (the rest trap if
    // called: none is, in the scenarios above).
    for served in SERVED {
        assert!(imports.contains(&format!("env::{served}")), "{served}");
    }
    let exports = module_exports().unwrap();
    for needed in [
        "memory",
        "malloc",
        "_initialize",
        "proxy_abi_version_0_2_1",
        "proxy_on_context_create",
        "proxy_on_configure",
        "proxy_on_request_headers",
        "proxy_on_request_body",
        "proxy_on_request_trailers",
        "proxy_on_response_headers",
        "proxy_on_log",
        "proxy_on_tick",
        "proxy_on_grpc_receive",
        "proxy_on_grpc_close",
    ] {
        assert!(exports.iter().any(|e| e == needed), "{needed}: {exports:?}");
    }
    // Instantiating checks each served import's signature.
    let vm = FilterVm::new().unwrap();
    assert!(vm.host().logs.is_empty());
}
