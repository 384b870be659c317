//! The body phase of a keyed call: `on_http_request_body` buffers the body
//! (refusing it as soon as it is too large) and `on_http_request_trailers`
//! refuses reserved trailer names on every call; whichever sees the end of
//! the request decides the call on its whole body: authorisation, the
//! routing key, and a waiting Acquire's or a Campaign's admission places.

use crate::decision;
use crate::edge::profile::Section;
use crate::edge::stream::Stream;
use crate::headers::check_trailers;
use crate::host::{Action, Buffer, HeaderMap, Host, LogLevel, as_ms, now_ms};
use crate::metrics;
use crate::status::{DenyReason, Refusal};
use crate::wire::Writer;

/// The filter state key the route's ring hash reads (`hash_policy.filter_state`):
/// Envoy's well-known hashable string object.
pub const ROUTE_KEY_STATE: &str = "envoy.hashable_string";

/// The foreign function that sets filter state.
pub const SET_FILTER_STATE: &str = "set_envoy_filter_state";

/// The argument of [`SET_FILTER_STATE`] that sets the routing key: the
/// `SetEnvoyFilterStateArguments` message, `{path = 1, value = 2, span = 3}`.
pub fn route_key_arguments(key: &str) -> Vec<u8> {
    let mut args = Writer::new();
    args.string(1, ROUTE_KEY_STATE).string(2, key);
    args.finish()
}

impl Stream {
    pub fn on_request_body(
        &mut self,
        host: &impl Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.decided {
            return Action::Continue;
        }
        let max = self
            .active
            .as_ref()
            .map(|a| a.config.max_message_bytes)
            .unwrap_or(0);
        if decision::body_too_large(body_size, max) {
            return self.refuse(host, Refusal::of(DenyReason::Oversized));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.decide(host, body_size)
    }

    pub fn on_request_trailers(&mut self, host: &impl Host) -> Action {
        // Reserved names are refused here too, whatever the method: tonic
        // merges a unary request's trailers into its metadata. Pausing keeps
        // the trailers from the router, and the local reply ends the stream,
        // which resets the upstream request (for a call passed on at header
        // time) before the arbiter has seen its end: it never completes.
        let trailers = host.header_map(HeaderMap::RequestTrailers);
        if let Err(refusal) = check_trailers(trailers.iter().map(|(k, _)| k.as_str())) {
            return self.refuse(host, refusal);
        }
        if self.decided {
            return Action::Continue;
        }
        let size = host
            .buffer(Buffer::RequestBody, 0, usize::MAX)
            .map(|b| b.len())
            .unwrap_or(0);
        self.decide(host, size)
    }

    /// Decides a keyed call on its whole body.
    fn decide(&mut self, host: &impl Host, body_size: usize) -> Action {
        self.decided = true;
        self.prof.lap(host, Section::WaitBody);
        let Some(active) = self.active.clone() else {
            return self.refuse(host, Refusal::of(DenyReason::PolicyNotReady));
        };
        let body = host
            .buffer(Buffer::RequestBody, 0, body_size)
            .unwrap_or_default();
        self.prof.lap(host, Section::BodyGet);
        let now = self.started.map(as_ms).unwrap_or_else(|| now_ms(host));
        let authorised = match decision::check_keyed(
            active.table.view(now),
            &self.identity,
            self.method,
            &body,
            self.key_header.as_deref(),
            active.config.max_message_bytes,
        ) {
            Ok(a) => a,
            Err(refusal) => return self.refuse(host, refusal),
        };
        self.prof.lap(host, Section::Check);
        // Routing affinity follows the authorised key, from the body: the
        // ring hash reads filter state, set here (request headers can no
        // longer be changed in the body phase). The client's x-lock-key was
        // removed in the header phase, whatever it said.
        let route_key = route_key_arguments(authorised.key.as_str());
        if let Err(e) = host.call_foreign_function(SET_FILTER_STATE, &route_key) {
            host.log(
                LogLevel::Error,
                &format!("latchkey edge: cannot set the routing key: {e}"),
            );
            return self.refuse(host, Refusal::of(DenyReason::NoRouteKey));
        }
        self.prof.lap(host, Section::RouteKey);
        let (scope, allowed) = self.vm.borrow_mut().scope(host, self.method, &authorised);
        if authorised.waits {
            match active.admission.admit(
                host,
                authorised.key.as_str(),
                authorised.max_waiters_per_key,
                &self.bound,
                active.config.max_waiters_per_identity,
            ) {
                Ok(ticket) => {
                    let stats = &mut self.vm.borrow_mut().metrics;
                    stats.gauge_add(host, &metrics::waiters(&scope), 1);
                    if ticket.overflowed() {
                        stats.add(host, metrics::ADMISSION_OVERFLOW, 1);
                    }
                    self.held = Some((ticket, scope));
                }
                Err(rejection) => {
                    let refusal = decision::admission_refusal(rejection);
                    let which = match refusal.why {
                        DenyReason::QueueFullKey => "key",
                        DenyReason::QueueFullKeyShare => "key_share",
                        DenyReason::QueueFullIdentity => "identity",
                        DenyReason::AdmissionUnavailable => "store",
                        _ => "table",
                    };
                    self.vm.borrow_mut().metrics.add(
                        host,
                        &metrics::admission_rejected(which, &scope),
                        1,
                    );
                    return self.refuse(host, refusal);
                }
            }
            self.prof.lap(host, Section::Admit);
        }
        if let Some(id) = allowed {
            host.increment_metric(id, 1);
        }
        if let (Some(start), Some(now)) = (self.started, host.now())
            && let Some(spent) = now.checked_sub(start)
        {
            self.vm.borrow_mut().metrics.histogram(
                host,
                metrics::DECISION_US,
                spent.as_micros() as u64,
            );
        }
        self.prof.lap(host, Section::BodyStats);
        Action::Continue
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::admission::identity_share;
    use crate::edge::fake::{
        ACQUIRE, ALICE, BOB, CAMPAIGN, ELECTION_PATHS, FakeHost, INSPECT, OPEN_SESSION, PROCLAIM,
        acquire, campaign, configured, election, inspect, keyed_call,
    };
    use crate::identity::IDENTITY_HEADER;
    use crate::status::GrpcCode;

    fn refused(host: &FakeHost, why: DenyReason) {
        let reply = host.last_reply().expect("a reply");
        let expected = Refusal::of(why);
        assert_eq!(
            (reply.code, reply.message.as_str()),
            (expected.code, expected.message)
        );
        assert!(
            host.stat(&metrics::denied(why)).unwrap_or(0) >= 1,
            "{why:?}"
        );
    }

    #[test]
    fn an_authorised_call_routes_by_its_key_and_is_counted() {
        let (host, root) = configured(json!({}));
        let (stream, at_headers, at_body) =
            keyed_call(&host, &root, ALICE, INSPECT, &inspect("demo/report"));
        assert_eq!(at_headers, Action::Continue);
        assert_eq!(at_body, Some(Action::Continue));
        assert!(stream.decided);
        assert!(host.replies.borrow().is_empty());
        assert_eq!(
            *host.foreign_calls.borrow(),
            vec![(
                SET_FILTER_STATE.to_owned(),
                route_key_arguments("demo/report")
            )]
        );
        assert_eq!(
            host.stat("latchkey_edge.allowed.method.inspect.ns.demo.class._none"),
            Some(1)
        );
        assert_eq!(host.samples(metrics::DECISION_US).len(), 1);
        // Decided: later body frames pass untouched.
        let mut stream = stream;
        assert_eq!(stream.on_request_body(&host, 3, true), Action::Continue);
    }

    #[test]
    fn the_routing_key_argument_is_the_filter_state_message() {
        // SetEnvoyFilterStateArguments{path = 1, value = 2}
        let mut expected = vec![0x0a, ROUTE_KEY_STATE.len() as u8];
        expected.extend_from_slice(ROUTE_KEY_STATE.as_bytes());
        expected.extend_from_slice(&[0x12, 3]);
        expected.extend_from_slice(b"a/b");
        assert_eq!(route_key_arguments("a/b"), expected);
    }

    #[test]
    fn a_call_without_a_grant_is_refused_with_one_message() {
        let (host, root) = configured(json!({}));
        for (peer, key) in [(BOB, "demo/a"), (ALICE, "demox/a"), (ALICE, "elsewhere")] {
            let (_, _, at_body) = keyed_call(&host, &root, peer, ACQUIRE, &acquire(key, true));
            assert_eq!(at_body, Some(Action::Pause), "{peer} {key}");
            refused(&host, DenyReason::NotAuthorised);
        }
        assert_eq!(
            host.stat(&metrics::denied(DenyReason::NotAuthorised)),
            Some(3)
        );
        // Nothing was routed and no waiter place taken.
        assert!(host.foreign_calls.borrow().is_empty());
        assert_eq!(host.stat("latchkey_edge.waiters.ns.demo.class.demo"), None);
    }

    #[test]
    fn the_body_is_held_until_its_end_and_refused_as_soon_as_it_is_too_large() {
        let (host, root) = configured(json!({"maxMessageBytes": 64}));
        host.request(Some(ALICE), INSPECT, &[], &[]);
        let mut stream = root.new_stream();
        assert_eq!(stream.on_request_headers(&host, false), Action::Continue);
        assert_eq!(stream.on_request_body(&host, 40, false), Action::Pause);
        assert!(host.replies.borrow().is_empty());
        assert_eq!(stream.on_request_body(&host, 70, false), Action::Pause);
        refused(&host, DenyReason::Oversized);
        assert_eq!(host.last_reply().unwrap().code, GrpcCode::ResourceExhausted);
    }

    #[test]
    fn a_malformed_body_is_refused() {
        let (host, root) = configured(json!({}));
        let (_, _, at_body) = keyed_call(
            &host,
            &root,
            ALICE,
            INSPECT,
            &[0, 0, 0, 0, 3, 0xff, 0xff, 0xff],
        );
        assert_eq!(at_body, Some(Action::Pause));
        refused(&host, DenyReason::BadRequest);
        let (_, _, at_body) = keyed_call(&host, &root, ALICE, INSPECT, &inspect("demo//a"));
        assert_eq!(at_body, Some(Action::Pause));
        refused(&host, DenyReason::BadKey);
    }

    #[test]
    fn a_key_header_must_equal_the_bodys_key() {
        let (host, root) = configured(json!({}));
        let body = inspect("demo/a");
        host.request(Some(ALICE), INSPECT, &[("x-lock-key", "demo/b")], &body);
        let mut stream = root.new_stream();
        assert_eq!(stream.on_request_headers(&host, false), Action::Continue);
        assert_eq!(
            stream.on_request_body(&host, body.len(), true),
            Action::Pause
        );
        refused(&host, DenyReason::KeyMismatch);
    }

    #[test]
    fn a_routing_key_that_cannot_be_set_refuses_the_call() {
        let (host, root) = configured(json!({}));
        host.fail_foreign_call.set(true);
        let (_, _, at_body) = keyed_call(&host, &root, ALICE, INSPECT, &inspect("demo/a"));
        assert_eq!(at_body, Some(Action::Pause));
        refused(&host, DenyReason::NoRouteKey);
        assert!(host.logged(
            LogLevel::Error,
            "latchkey edge: cannot set the routing key: InternalFailure"
        ));
    }

    #[test]
    fn waiting_acquires_are_bounded_per_identity() {
        let (host, root) = configured(json!({"maxWaitersPerIdentity": 1}));
        let (mut first, _, a) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/1", true));
        assert_eq!(a, Some(Action::Continue));
        assert_eq!(
            host.stat("latchkey_edge.waiters.ns.demo.class.demo"),
            Some(1)
        );
        let (_, _, b) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/2", true));
        assert_eq!(b, Some(Action::Pause));
        refused(&host, DenyReason::QueueFullIdentity);
        assert_eq!(
            host.stat("latchkey_edge.admission_rejected.scope.identity.ns.demo.class.demo"),
            Some(1)
        );
        // A try-lock never waits, so it takes no waiter place.
        let (_, _, c) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/3", false));
        assert_eq!(c, Some(Action::Continue));
        // The first one's wait ends: its place comes back.
        first.on_response_headers(&host);
        let (_, _, d) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/2", true));
        assert_eq!(d, Some(Action::Continue));
    }

    #[test]
    fn one_identity_gets_its_share_of_a_key_and_the_key_its_bound() {
        // Class demo: 4 waiters per key, so 2 per identity.
        let (host, root) = configured(json!({}));
        let share = identity_share(4);
        let mut held = Vec::new();
        for _ in 0..share {
            let (s, _, a) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/k", true));
            assert_eq!(a, Some(Action::Continue));
            held.push(s);
        }
        let (_, _, over) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/k", true));
        assert_eq!(over, Some(Action::Pause));
        refused(&host, DenyReason::QueueFullKeyShare);
        assert_eq!(
            host.stat("latchkey_edge.admission_rejected.scope.key_share.ns.demo.class.demo"),
            Some(1)
        );
        let vm = root.vm().borrow();
        let admission = vm.active.as_ref().unwrap().admission;
        assert_eq!(admission.count(&host, "demo/k"), share);
    }

    #[test]
    fn trailers_with_reserved_names_are_refused_on_every_call() {
        let (host, root) = configured(json!({}));
        for name in ["x-latchkey-identity", "x-lock-key", "X-Latchkey-Anything"] {
            host.request(Some(ALICE), OPEN_SESSION, &[], &[]);
            let mut stream = root.new_stream();
            assert_eq!(stream.on_request_headers(&host, false), Action::Continue);
            *host.request_trailers.borrow_mut() = vec![(name.to_owned(), ALICE.into())];
            assert_eq!(stream.on_request_trailers(&host), Action::Pause, "{name}");
            refused(&host, DenyReason::ReservedTrailer);
        }
    }

    #[test]
    fn trailers_end_a_keyed_call_and_decide_it() {
        let (host, root) = configured(json!({}));
        let body = inspect("demo/a");
        host.request(Some(ALICE), INSPECT, &[], &body);
        let mut stream = root.new_stream();
        stream.on_request_headers(&host, false);
        assert_eq!(
            stream.on_request_body(&host, body.len(), false),
            Action::Pause
        );
        *host.request_trailers.borrow_mut() = vec![("grpc-timeout".into(), b"1S".to_vec())];
        assert_eq!(stream.on_request_trailers(&host), Action::Continue);
        assert!(stream.decided);
        assert_eq!(host.foreign_calls.borrow().len(), 1);
    }

    #[test]
    fn the_decision_time_is_measured_from_the_headers() {
        let (host, root) = configured(json!({}));
        let body = inspect("demo/a");
        host.request(Some(ALICE), INSPECT, &[], &body);
        let mut stream = root.new_stream();
        stream.on_request_headers(&host, false);
        host.now.set(host.now.get() + Duration::from_micros(250));
        stream.on_request_body(&host, body.len(), true);
        assert_eq!(host.samples(metrics::DECISION_US), vec![250]);
    }

    /// Every election.v1 call is a keyed call on its election's name: the
    /// caller named by the edge alone, routed by the authorised name, counted
    /// under its own method label.
    #[test]
    fn every_election_call_names_its_caller_and_routes_by_the_election() {
        let (host, root) = configured(json!({}));
        for path in ELECTION_PATHS {
            host.foreign_calls.borrow_mut().clear();
            let body = if path == CAMPAIGN {
                campaign("demo/leader")
            } else {
                election("demo/leader")
            };
            let (stream, at_headers, at_body) = keyed_call(&host, &root, ALICE, path, &body);
            assert_eq!(
                (at_headers, at_body),
                (Action::Continue, Some(Action::Continue)),
                "{path}"
            );
            assert!(host.replies.borrow().is_empty(), "{path}");
            assert_eq!(
                host.header(IDENTITY_HEADER).as_deref(),
                Some(ALICE),
                "{path}"
            );
            assert_eq!(
                *host.foreign_calls.borrow(),
                vec![(
                    SET_FILTER_STATE.to_owned(),
                    route_key_arguments("demo/leader")
                )],
                "{path}"
            );
            let label = stream.method.label();
            let class = if path == CAMPAIGN { "demo" } else { "_none" };
            assert_eq!(
                host.stat(&format!(
                    "latchkey_edge.allowed.method.{label}.ns.demo.class.{class}"
                )),
                Some(1),
                "{path}"
            );
        }
    }

    #[test]
    fn an_election_call_without_a_grant_is_refused_and_never_forwarded() {
        let (host, root) = configured(json!({}));
        for path in ELECTION_PATHS {
            for (peer, name) in [
                (BOB, "demo/leader"),
                (ALICE, "demox/leader"),
                (ALICE, "other"),
            ] {
                let body = if path == CAMPAIGN {
                    campaign(name)
                } else {
                    election(name)
                };
                let (_, _, at_body) = keyed_call(&host, &root, peer, path, &body);
                assert_eq!(at_body, Some(Action::Pause), "{path} {peer} {name}");
                refused(&host, DenyReason::NotAuthorised);
                assert_eq!(host.last_reply().unwrap().code, GrpcCode::PermissionDenied);
            }
        }
        assert_eq!(
            host.stat(&metrics::denied(DenyReason::NotAuthorised)),
            Some(3 * ELECTION_PATHS.len() as i64)
        );
        // Not routed, no waiter place taken, nothing counted as allowed.
        assert!(host.foreign_calls.borrow().is_empty());
        assert_eq!(host.stat("latchkey_edge.waiters.ns.demo.class.demo"), None);
        assert!(
            !host
                .stats
                .borrow()
                .iter()
                .any(|s| s.name.contains(".allowed.")),
            "{:?}",
            host.stats.borrow()
        );
    }

    #[test]
    fn an_election_call_is_refused_on_the_same_body_rules_as_a_lock_call() {
        let (host, root) = configured(json!({"maxMessageBytes": 64}));
        // Two names in one body: the edge decides on the last, as the
        // arbiter will read it.
        let mut two = crate::wire::Writer::new();
        two.string(1, "demo/mine").string(1, "other/theirs");
        let (_, _, at_body) = keyed_call(
            &host,
            &root,
            ALICE,
            PROCLAIM,
            &crate::edge::fake::frame(&two.finish()),
        );
        assert_eq!(at_body, Some(Action::Pause));
        refused(&host, DenyReason::NotAuthorised);
        let mut two = crate::wire::Writer::new();
        two.string(1, "other/theirs").string(1, "demo/mine");
        let (_, _, at_body) = keyed_call(
            &host,
            &root,
            ALICE,
            PROCLAIM,
            &crate::edge::fake::frame(&two.finish()),
        );
        assert_eq!(at_body, Some(Action::Continue));
        assert_eq!(
            host.foreign_calls.borrow().last().map(|(_, a)| a.clone()),
            Some(route_key_arguments("demo/mine"))
        );
        // The name with the wrong wire type.
        let mut bad = crate::wire::Writer::new();
        bad.varint(1, 7);
        let (_, _, at_body) = keyed_call(
            &host,
            &root,
            ALICE,
            PROCLAIM,
            &crate::edge::fake::frame(&bad.finish()),
        );
        assert_eq!(at_body, Some(Action::Pause));
        refused(&host, DenyReason::BadRequest);
        // Over the size limit, as soon as the buffered body says so.
        host.request(Some(ALICE), CAMPAIGN, &[], &[]);
        let mut stream = root.new_stream();
        assert_eq!(stream.on_request_headers(&host, false), Action::Continue);
        assert_eq!(stream.on_request_body(&host, 70, false), Action::Pause);
        refused(&host, DenyReason::Oversized);
        // A malformed name.
        let (_, _, at_body) = keyed_call(&host, &root, ALICE, CAMPAIGN, &campaign("demo//a"));
        assert_eq!(at_body, Some(Action::Pause));
        refused(&host, DenyReason::BadKey);
        // A routing header that is not the name.
        let body = election("demo/leader");
        host.request(
            Some(ALICE),
            PROCLAIM,
            &[("x-lock-key", "demo/other")],
            &body,
        );
        let mut stream = root.new_stream();
        assert_eq!(stream.on_request_headers(&host, false), Action::Continue);
        assert_eq!(host.header("x-lock-key"), None);
        assert_eq!(
            stream.on_request_body(&host, body.len(), true),
            Action::Pause
        );
        refused(&host, DenyReason::KeyMismatch);
    }

    /// Campaign waits like an Acquire: it takes the waiter places (the
    /// identity's bound, its share of the election, the class's per-key
    /// bound) until the arbiter answers.
    #[test]
    fn campaigns_take_waiter_places_like_waiting_acquires() {
        let (host, root) = configured(json!({"maxWaitersPerIdentity": 3}));
        let (mut first, _, a) = keyed_call(&host, &root, ALICE, CAMPAIGN, &campaign("demo/leader"));
        assert_eq!(a, Some(Action::Continue));
        assert_eq!(
            host.stat("latchkey_edge.waiters.ns.demo.class.demo"),
            Some(1)
        );
        // Class demo: 4 waiters per key, so 2 per identity on one election.
        let (_, _, b) = keyed_call(&host, &root, ALICE, CAMPAIGN, &campaign("demo/leader"));
        assert_eq!(b, Some(Action::Continue));
        let (_, _, c) = keyed_call(&host, &root, ALICE, CAMPAIGN, &campaign("demo/leader"));
        assert_eq!(c, Some(Action::Pause));
        refused(&host, DenyReason::QueueFullKeyShare);
        // Campaigns and waiting Acquires share the identity's bound.
        let (_, _, d) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/k", true));
        assert_eq!(d, Some(Action::Continue));
        let (_, _, e) = keyed_call(&host, &root, ALICE, CAMPAIGN, &campaign("demo/other"));
        assert_eq!(e, Some(Action::Pause));
        refused(&host, DenyReason::QueueFullIdentity);
        assert_eq!(
            host.stat("latchkey_edge.admission_rejected.scope.identity.ns.demo.class.demo"),
            Some(1)
        );
        // The arbiter answers the first campaign: its places come back.
        first.on_response_headers(&host);
        let (_, _, f) = keyed_call(&host, &root, ALICE, CAMPAIGN, &campaign("demo/other"));
        assert_eq!(f, Some(Action::Continue));
    }
}
