//! `on_http_request_headers`: who the caller is (the peer certificate's
//! SPIFFE ID), reserved headers, which call it is, the identity header, and
//! the identity's place under its stream bound. Unkeyed calls are decided
//! here; keyed ones (Acquire, Release, Inspect, every election.v1 call) go
//! on to the body phase.

use std::borrow::Cow;

use crate::decision::{self, KEY_HEADER};
use crate::edge::profile::Section;
use crate::edge::stream::Stream;
use crate::headers::check_request_headers;
use crate::host::{Action, HeaderMap, Host, now_ms};
use crate::identity::IDENTITY_HEADER;
use crate::metrics;
use crate::request::Call;
use crate::status::{DenyReason, Refusal};

impl Stream {
    pub fn on_request_headers(&mut self, host: &impl Host, end_of_stream: bool) -> Action {
        self.started = host.now();
        self.prof.start(host);
        let Some(active) = self.active.clone() else {
            return self.refuse(host, Refusal::of(DenyReason::PolicyNotReady));
        };
        // The peer certificate's URI SAN alone: Envoy has it only when the
        // client presented a certificate, which the listener verified against
        // the trust bundle (see `identity_from_san`). One property read per
        // request; the SPIFFE parse is cached per SAN.
        let san = host
            .property(&["connection", "uri_san_peer_certificate"])
            .unwrap_or_default();
        let identity = self
            .vm
            .borrow_mut()
            .identity(&san, &active.config.trust_domain);
        self.identity = match identity {
            Some(id) => id,
            None => return self.refuse(host, Refusal::of(DenyReason::Unauthenticated)),
        };
        self.bound = active
            .table
            .view(now_ms(host))
            .bound_subject(&self.identity)
            .into();
        self.prof.lap(host, Section::Identity);
        // Request headers are readable only in this phase: refuse any
        // x-latchkey-* the client sent (the edge names the caller, nobody
        // else), and keep what the body decision needs. A header value need
        // not be UTF-8: values are borrowed, and copied (lossily) only if not.
        let raw = host.header_map(HeaderMap::RequestHeaders);
        let headers: Vec<(&str, Cow<'_, str>)> = raw
            .iter()
            .map(|(k, v)| (k.as_str(), String::from_utf8_lossy(v)))
            .collect();
        let checked = match check_request_headers(headers.iter().map(|(k, v)| (*k, v.as_ref()))) {
            Ok(checked) => checked,
            Err(refusal) => return self.refuse(host, refusal),
        };
        let pseudo = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.as_ref())
                .unwrap_or_default()
        };
        self.method = match Call::of(pseudo(":method"), pseudo(":path")) {
            Call::Forward(method) => method,
            Call::EdgePolicy => {
                return self.refuse(host, Refusal::of(DenyReason::EdgePolicyForbidden));
            }
            Call::Unknown => return self.refuse(host, Refusal::of(DenyReason::UnknownMethod)),
        };
        // The client's x-lock-key is never forwarded, on any call: routing
        // uses the key the filter authorised from the body (filter state),
        // and a keyed call's header must equal that key (checked on the
        // body, before anything is forwarded: the buffer filter holds the
        // headers until then).
        if checked.key_repeated {
            return self.refuse(host, Refusal::of(DenyReason::KeyMismatch));
        }
        self.prof.lap(host, Section::HeaderMap);
        if checked.key.is_some() && host.remove_request_header(KEY_HEADER).is_err() {
            return self.refuse(host, Refusal::of(DenyReason::NoRouteKey));
        }
        self.key_header = checked.key;
        // Every forwarded call names its verified caller, admin calls included.
        let _ = host.set_request_header(IDENTITY_HEADER, &self.identity);
        self.prof.lap(host, Section::HeaderSet);
        // Every stream counts against its identity's bound until it ends:
        // exactly, in shared data (a place kept back by one worker would
        // refuse the identity below its bound on another).
        match active.admission.open_stream(
            host,
            &self.bound,
            active.config.max_streams_per_identity,
        ) {
            Ok(place) => {
                self.stream = Some(place);
                self.prof.lap(host, Section::StreamPlace);
                self.vm
                    .borrow_mut()
                    .metrics
                    .gauge_add(host, metrics::STREAMS_OPEN, 1);
            }
            Err(rejection) => return self.refuse(host, decision::admission_refusal(rejection)),
        }
        if !self.method.is_keyed() {
            self.vm.borrow_mut().metrics.add(
                host,
                &metrics::allowed(self.method.label(), "ns._.class._"),
                1,
            );
            self.decided = true;
            self.prof.lap(host, Section::HeaderStats);
            return Action::Continue;
        }
        self.prof.lap(host, Section::HeaderStats);
        if end_of_stream {
            return self.refuse(host, Refusal::of(DenyReason::BadRequest));
        }
        // Not Pause: the host turns a paused header phase into "stop all", and
        // the body would never reach this filter. The headers go on to Envoy's
        // buffer filter, which holds them (and so the router, its host choice
        // and the arbiter) until this filter lets the body through.
        Action::Continue
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::edge::Root;
    use crate::edge::fake::{
        ACQUIRE, ALICE, BOB, FakeHost, INSPECT, OPEN_SESSION, configured, inspect,
    };
    use crate::status::GrpcCode;

    fn headers(host: &FakeHost, root: &Root, peer: Option<&str>, path: &str) -> (Stream, Action) {
        headers_with(host, root, peer, path, &[])
    }

    fn headers_with(
        host: &FakeHost,
        root: &Root,
        peer: Option<&str>,
        path: &str,
        extra: &[(&str, &str)],
    ) -> (Stream, Action) {
        host.request(peer, path, extra, &inspect("demo/a"));
        let mut stream = root.new_stream();
        let action = stream.on_request_headers(host, false);
        (stream, action)
    }

    fn refused(host: &FakeHost, why: DenyReason) {
        let reply = host.last_reply().expect("a reply");
        let expected = Refusal::of(why);
        assert_eq!(
            (reply.code, reply.message.as_str()),
            (expected.code, expected.message)
        );
        assert_eq!(reply.details_bin, expected.status_details_bin());
        assert!(
            host.stat(&metrics::denied(why)).unwrap_or(0) >= 1,
            "{why:?}"
        );
    }

    #[test]
    fn the_identity_header_names_the_verified_peer() {
        let (host, root) = configured(json!({}));
        let (stream, action) = headers(&host, &root, Some(BOB), INSPECT);
        assert_eq!(action, Action::Continue);
        assert!(host.replies.borrow().is_empty());
        assert_eq!(host.header(IDENTITY_HEADER).as_deref(), Some(BOB));
        assert_eq!(&*stream.identity, BOB);
        // Keyed: decided on the body.
        assert!(!stream.decided);
        assert_eq!(host.stat(metrics::STREAMS_OPEN), Some(1));
        // One property read per request, and the parse is cached by SAN.
        assert_eq!(host.property_reads.get(), 1);
        headers(&host, &root, Some(BOB), INSPECT);
        assert_eq!(host.property_reads.get(), 2);
        assert_eq!(root.vm().borrow().identities.len(), 1);
    }

    #[test]
    fn an_unkeyed_call_is_decided_at_the_headers() {
        let (host, root) = configured(json!({}));
        let (stream, action) = headers(&host, &root, Some(BOB), OPEN_SESSION);
        assert_eq!(action, Action::Continue);
        assert!(stream.decided);
        assert_eq!(
            host.stat("latchkey_edge.allowed.method.session.ns._.class._"),
            Some(1)
        );
        let (stream, action) = headers(
            &host,
            &root,
            Some(BOB),
            "/latchkey.admin.v1.Admin/GetStatus",
        );
        assert_eq!((action, stream.decided), (Action::Continue, true));
        assert_eq!(host.header(IDENTITY_HEADER).as_deref(), Some(BOB));
    }

    #[test]
    fn a_client_sent_identity_header_is_refused_and_never_replaced() {
        let (host, root) = configured(json!({}));
        for name in [
            "x-latchkey-identity",
            "X-LATCHKEY-IDENTITY",
            "x-latchkey-other",
        ] {
            let (_, action) = headers_with(&host, &root, Some(BOB), ACQUIRE, &[(name, ALICE)]);
            assert_eq!(action, Action::Pause, "{name}");
            refused(&host, DenyReason::ReservedHeader);
            // The filter set nothing: the request (never forwarded) still
            // carries only the client's value.
            assert_eq!(host.header(name).as_deref(), Some(ALICE));
        }
        // Refused before it took a stream place.
        assert_eq!(host.stat(metrics::STREAMS_OPEN), Some(0));
        assert_eq!(host.replies.borrow().len(), 3);
    }

    #[test]
    fn without_a_verified_spiffe_id_the_caller_is_unauthenticated() {
        let (host, root) = configured(json!({}));
        for peer in [
            None,
            Some(""),
            Some("spiffe://another.domain/workload/alice"),
            Some("https://dev.latchkey/workload/alice"),
        ] {
            let (_, action) = headers(&host, &root, peer, INSPECT);
            assert_eq!(action, Action::Pause, "{peer:?}");
            refused(&host, DenyReason::Unauthenticated);
            assert_eq!(host.last_reply().unwrap().code, GrpcCode::Unauthenticated);
            assert_eq!(host.header(IDENTITY_HEADER), None);
        }
    }

    #[test]
    fn unknown_calls_and_get_edge_policy_are_answered_by_the_edge() {
        let (host, root) = configured(json!({}));
        for path in [
            "/latchkey.lock.v1.Lock/Steal",
            "/latchkey.lock.v1.Lock/Acquire/",
            "/other.Service/Acquire",
            "/latchkey.election.v1.ElectionService/Elect",
            "/latchkey.election.v1.ElectionService/Campaign/",
            "/latchkey.election.v1.ElectionService/campaign",
            "/latchkey.election.v1.electionservice/Observe",
        ] {
            let (_, action) = headers(&host, &root, Some(ALICE), path);
            assert_eq!(action, Action::Pause, "{path}");
            refused(&host, DenyReason::UnknownMethod);
            assert_eq!(host.last_reply().unwrap().code, GrpcCode::Unimplemented);
            // Never forwarded: not even named.
            assert_eq!(host.header(IDENTITY_HEADER), None, "{path}");
        }
        assert_eq!(host.stat(metrics::STREAMS_OPEN).unwrap_or(0), 0);
        headers(
            &host,
            &root,
            Some(ALICE),
            "/latchkey.admin.v1.Admin/GetEdgePolicy",
        );
        refused(&host, DenyReason::EdgePolicyForbidden);
    }

    #[test]
    fn the_stream_bound_is_exact_and_a_stream_that_ends_gives_its_place_back() {
        let (host, root) = configured(json!({"maxStreamsPerIdentity": 2}));
        let (mut first, a) = headers(&host, &root, Some(ALICE), OPEN_SESSION);
        let (_second, b) = headers(&host, &root, Some(ALICE), OPEN_SESSION);
        assert_eq!((a, b), (Action::Continue, Action::Continue));
        let (_, c) = headers(&host, &root, Some(ALICE), OPEN_SESSION);
        assert_eq!(c, Action::Pause);
        refused(&host, DenyReason::TooManyStreams);
        // Bob has a bound of his own.
        assert_eq!(
            headers(&host, &root, Some(BOB), OPEN_SESSION).1,
            Action::Continue
        );
        first.on_log(&host);
        assert_eq!(
            headers(&host, &root, Some(ALICE), OPEN_SESSION).1,
            Action::Continue
        );
        let vm = root.vm().borrow();
        let admission = vm.active.as_ref().unwrap().admission;
        assert_eq!(admission.streams(&host, ALICE), 2);
    }

    #[test]
    fn the_key_header_is_removed_and_kept_for_the_body_check() {
        let (host, root) = configured(json!({}));
        let (stream, action) = headers_with(
            &host,
            &root,
            Some(ALICE),
            INSPECT,
            &[("x-lock-key", "demo/a")],
        );
        assert_eq!(action, Action::Continue);
        assert_eq!(host.header("x-lock-key"), None);
        assert_eq!(stream.key_header.as_deref(), Some("demo/a"));
        // Sent twice: a mismatch whatever the body says.
        let (_, action) = headers_with(
            &host,
            &root,
            Some(ALICE),
            INSPECT,
            &[("x-lock-key", "demo/a"), ("X-Lock-Key", "demo/a")],
        );
        assert_eq!(action, Action::Pause);
        refused(&host, DenyReason::KeyMismatch);
        // A header the host cannot remove is never forwarded: refused.
        host.fail_remove_header.set(true);
        let (_, action) = headers_with(
            &host,
            &root,
            Some(ALICE),
            INSPECT,
            &[("x-lock-key", "demo/a")],
        );
        assert_eq!(action, Action::Pause);
        refused(&host, DenyReason::NoRouteKey);
        assert_eq!(host.last_reply().unwrap().code, GrpcCode::Internal);
    }

    #[test]
    fn a_keyed_call_that_ends_at_its_headers_is_a_bad_request() {
        let (host, root) = configured(json!({}));
        host.request(Some(ALICE), INSPECT, &[], &[]);
        let mut stream = root.new_stream();
        assert_eq!(stream.on_request_headers(&host, true), Action::Pause);
        refused(&host, DenyReason::BadRequest);
    }

    #[test]
    fn an_unconfigured_vm_tells_every_caller_to_retry() {
        let host = FakeHost::default();
        let root = Root::default();
        let (_, action) = headers(&host, &root, Some(ALICE), OPEN_SESSION);
        assert_eq!(action, Action::Pause);
        refused(&host, DenyReason::PolicyNotReady);
        assert_eq!(host.last_reply().unwrap().code, GrpcCode::Unavailable);
    }

    #[test]
    fn a_non_utf8_header_value_is_read_lossily() {
        let (host, root) = configured(json!({}));
        host.request(Some(ALICE), INSPECT, &[], &inspect("demo/a"));
        host.request_headers
            .borrow_mut()
            .push(("x-custom".into(), vec![0xff, 0xfe]));
        let mut stream = root.new_stream();
        assert_eq!(stream.on_request_headers(&host, false), Action::Continue);
    }
}
