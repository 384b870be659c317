//! The end of a stream, and its accounting: the arbiter's response headers
//! end a waiter's wait (its admission places are given back), and the end of
//! the stream (`on_log`, however it ended: answered, reset, timed out) gives
//! back every place the stream still holds. Each place is given back once.

use crate::edge::profile::Section;
use crate::edge::stream::Stream;
use crate::host::{Action, Host};
use crate::metrics;

impl Stream {
    pub fn on_response_headers(&mut self, host: &impl Host) -> Action {
        // The arbiter has answered: the wait is over, whether or not the
        // client ever reads the answer (a zero receive window must not keep
        // the place).
        self.prof.start(host);
        self.release_waiter(host);
        self.prof.lap(host, Section::ResponseHeaders);
        Action::Continue
    }

    /// The stream is over (`on_log`; also run when the context is dropped,
    /// for a host that skips `on_log`): gives every place back, once.
    pub fn on_log(&mut self, host: &impl Host) {
        let holding = self.held.is_some() || self.stream.is_some();
        self.prof.start(host);
        self.release_waiter(host);
        if let (Some(place), Some(active)) = (self.stream.take(), self.active.as_ref()) {
            active.admission.close_stream(host, &place);
            self.vm
                .borrow_mut()
                .metrics
                .gauge_add(host, metrics::STREAMS_OPEN, -1);
        }
        if holding {
            self.prof.lap(host, Section::Release);
        }
        let vm = &self.vm;
        self.prof.flush(
            host,
            |name, ns| vm.borrow_mut().metrics.histogram(host, name, ns),
            |name, delta| vm.borrow_mut().metrics.add(host, name, delta),
        );
    }

    /// Gives the waiter's places back (once): the wait is over.
    fn release_waiter(&mut self, host: &impl Host) {
        if let (Some((ticket, scope)), Some(active)) = (self.held.take(), self.active.as_ref()) {
            active.admission.release(host, &ticket);
            self.vm
                .borrow_mut()
                .metrics
                .gauge_add(host, &metrics::waiters(&scope), -1);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::edge::fake::{
        ACQUIRE, ALICE, BOB, FakeHost, INSPECT, OBSERVE, acquire, configured, election, inspect,
        keyed_call,
    };
    use crate::status::{DenyReason, GrpcCode};

    const WAITERS: &str = "latchkey_edge.waiters.ns.demo.class.demo";

    #[test]
    fn the_arbiters_answer_gives_a_waiters_places_back_once() {
        let (host, root) = configured(json!({}));
        let (mut stream, _, _) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/k", true));
        let admission = root.vm().borrow().active.as_ref().unwrap().admission;
        assert_eq!(admission.count(&host, "demo/k"), 1);
        assert_eq!(host.stat(WAITERS), Some(1));
        assert_eq!(stream.on_response_headers(&host), Action::Continue);
        assert_eq!(admission.count(&host, "demo/k"), 0);
        assert_eq!(host.stat(WAITERS), Some(0));
        // Again (trailers-only answers, a retried callback) and at the end:
        // nothing more is given back.
        stream.on_response_headers(&host);
        stream.on_log(&host);
        assert_eq!(host.stat(WAITERS), Some(0));
        assert_eq!(admission.streams(&host, ALICE), 0);
    }

    #[test]
    fn the_end_of_a_stream_gives_back_every_place_it_holds_once() {
        let (host, root) = configured(json!({}));
        // Reset before the arbiter answered: the waiter's place and the
        // stream's both come back at the end.
        let (mut stream, _, _) = keyed_call(&host, &root, ALICE, ACQUIRE, &acquire("demo/k", true));
        let admission = root.vm().borrow().active.as_ref().unwrap().admission;
        assert_eq!(host.stat(metrics::STREAMS_OPEN), Some(1));
        stream.on_log(&host);
        stream.on_log(&host);
        assert_eq!(host.stat(metrics::STREAMS_OPEN), Some(0));
        assert_eq!(host.stat(WAITERS), Some(0));
        assert_eq!(admission.count(&host, "demo/k"), 0);
        assert_eq!(admission.streams(&host, ALICE), 0);
    }

    #[test]
    fn a_refused_stream_gives_back_what_it_took() {
        let (host, root) = configured(json!({"maxStreamsPerIdentity": 1}));
        // Refused on its body, after it took its stream place.
        let (mut refused, _, at_body) = keyed_call(&host, &root, BOB, INSPECT, &inspect("demo/a"));
        assert_eq!(at_body, Some(Action::Pause));
        refused.on_log(&host);
        // Bob's one place is free again.
        let (_, at_headers, _) = keyed_call(&host, &root, BOB, INSPECT, &inspect("demo/a"));
        assert_eq!(at_headers, Action::Continue);
    }

    /// An Observe stream is answered at once and then stays open: the
    /// arbiter's response headers give back no stream place (only a waiter's),
    /// so it counts under the identity's stream bound, like a KeepAlive
    /// stream, until it ends.
    #[test]
    fn an_observe_stream_keeps_its_stream_place_until_it_ends() {
        let (host, root) = configured(json!({"maxStreamsPerIdentity": 2}));
        let admission = root.vm().borrow().active.as_ref().unwrap().admission;
        let observe = |host: &FakeHost| {
            let (stream, at_headers, at_body) =
                keyed_call(host, &root, ALICE, OBSERVE, &election("demo/leader"));
            (stream, at_headers, at_body)
        };
        let (mut first, _, a) = observe(&host);
        let (_second, _, b) = observe(&host);
        assert_eq!((a, b), (Some(Action::Continue), Some(Action::Continue)));
        // No waiter places: an observer does not wait to be granted anything.
        assert_eq!(host.stat(WAITERS), None);
        // The arbiter's answer starts the event stream; the places stay.
        assert_eq!(first.on_response_headers(&host), Action::Continue);
        assert_eq!(admission.streams(&host, ALICE), 2);
        assert_eq!(host.stat(metrics::STREAMS_OPEN), Some(2));
        // A third stream of any kind is refused at its headers.
        let (_, at_headers, at_body) = observe(&host);
        assert_eq!((at_headers, at_body), (Action::Pause, None));
        let reply = host.last_reply().unwrap();
        assert_eq!(reply.code, GrpcCode::ResourceExhausted);
        assert_eq!(
            host.stat(&metrics::denied(DenyReason::TooManyStreams)),
            Some(1)
        );
        // Bob's bound is his own.
        let (_, at_headers, _) = keyed_call(&host, &root, BOB, OBSERVE, &election("demo/leader"));
        assert_eq!(at_headers, Action::Continue);
        // The first observer goes away: its place comes back, once.
        first.on_log(&host);
        first.on_log(&host);
        assert_eq!(admission.streams(&host, ALICE), 1);
        let (_, _, again) = observe(&host);
        assert_eq!(again, Some(Action::Continue));
    }
}
