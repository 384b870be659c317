//! A stream's context: one per HTTP stream. Its callbacks are in
//! `request_headers`, `request_body` (body and trailers: the keyed call's
//! decision) and `stream_end` (the response and the end of the stream: the
//! places it held given back).

use std::rc::Rc;
use std::time::Duration;

use crate::admission::{Place, Ticket};
use crate::edge::profile::Profile;
use crate::edge::vm::{Active, SharedVm};
use crate::host::{Action, Host};
use crate::metrics;
use crate::request::Method;
use crate::status::Refusal;

pub struct Stream {
    pub(crate) vm: SharedVm,
    /// The configuration and grant table this stream started with.
    pub(crate) active: Option<Rc<Active>>,
    pub(crate) method: Method,
    pub(crate) identity: Rc<str>,
    /// The grant subject the identity's streams and waiters count against:
    /// itself, or the pattern its per-pod identity falls under (issue 30),
    /// as the arbiter counts them.
    pub(crate) bound: Rc<str>,
    /// The client's `x-lock-key`, if it sent one (must equal the body's key).
    pub(crate) key_header: Option<String>,
    pub(crate) decided: bool,
    /// A waiter's admission places and the stat scope of its waiters gauge:
    /// given back when the arbiter answers or the stream ends.
    pub(crate) held: Option<(Ticket, Rc<str>)>,
    /// The identity's open-stream place: given back when the stream ends.
    pub(crate) stream: Option<Place>,
    /// When the header phase started (the host clock, since the Unix epoch).
    pub(crate) started: Option<Duration>,
    /// Section times (empty unless built with the `profile` feature).
    pub(crate) prof: Profile,
}

impl Stream {
    pub(crate) fn new(vm: SharedVm, active: Option<Rc<Active>>) -> Stream {
        Stream {
            vm,
            active,
            method: Method::Session,
            identity: Rc::from(""),
            bound: Rc::from(""),
            key_header: None,
            decided: false,
            held: None,
            stream: None,
            started: None,
            prof: Profile::default(),
        }
    }

    /// Answers the stream with `refusal` (or resets it if the answer cannot
    /// be sent) and counts the denial; nothing is forwarded.
    pub(crate) fn refuse(&mut self, host: &impl Host, refusal: Refusal) -> Action {
        self.decided = true;
        self.vm
            .borrow_mut()
            .metrics
            .add(host, &metrics::denied(refusal.why), 1);
        let details = refusal.status_details_bin();
        if host
            .send_grpc_reply(refusal.code, refusal.message, &details)
            .is_err()
        {
            host.reset_request();
        }
        Action::Pause
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::edge::fake::{ALICE, configured};
    use crate::host::Action;
    use crate::metrics;
    use crate::status::{DenyReason, Refusal};

    #[test]
    fn a_refusal_answers_once_counts_and_holds_the_stream() {
        let (host, root) = configured(json!({}));
        let mut stream = root.new_stream();
        let refusal = Refusal::of(DenyReason::NotAuthorised);
        assert_eq!(stream.refuse(&host, refusal.clone()), Action::Pause);
        assert!(stream.decided);
        let reply = host.last_reply().unwrap();
        assert_eq!(reply.code, refusal.code);
        assert_eq!(reply.details_bin, refusal.status_details_bin());
        assert_eq!(
            host.stat(&metrics::denied(DenyReason::NotAuthorised)),
            Some(1)
        );
        assert_eq!(host.resets.get(), 0);
    }

    #[test]
    fn a_refusal_that_cannot_be_sent_resets_the_request() {
        let (host, root) = configured(json!({}));
        host.fail_reply.set(true);
        host.request(Some(ALICE), "/nope", &[], &[]);
        let mut stream = root.new_stream();
        assert_eq!(stream.on_request_headers(&host, false), Action::Pause);
        assert!(host.replies.borrow().is_empty());
        assert_eq!(host.resets.get(), 1);
    }
}
