//! The HTTP context: one per stream. The callbacks are in
//! `request_headers`, `request_body` (body and trailers: the decision) and
//! `stream_end` (the response and the end of the stream: places given back).

use std::rc::Rc;
use std::time::SystemTime;

use latchkey_filter_core::admission::{Place, Ticket};
use latchkey_filter_core::metrics;
use latchkey_filter_core::request::Method;
use latchkey_filter_core::status::{GrpcCode, Refusal};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, GrpcStatusCode, MapType};

use crate::profile::Profile;
use crate::vm::{Active, SharedState};

pub(crate) struct EdgeStream {
    pub(crate) state: SharedState,
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
    pub(crate) started: Option<SystemTime>,
    /// Section times (empty unless built with the `profile` feature).
    pub(crate) prof: Profile,
}

fn grpc_code(code: GrpcCode) -> GrpcStatusCode {
    match code {
        GrpcCode::InvalidArgument => GrpcStatusCode::InvalidArgument,
        GrpcCode::PermissionDenied => GrpcStatusCode::PermissionDenied,
        GrpcCode::ResourceExhausted => GrpcStatusCode::ResourceExhausted,
        GrpcCode::Unimplemented => GrpcStatusCode::Unimplemented,
        GrpcCode::Internal => GrpcStatusCode::Internal,
        GrpcCode::Unavailable => GrpcStatusCode::Unavailable,
        GrpcCode::Unauthenticated => GrpcStatusCode::Unauthenticated,
    }
}

impl EdgeStream {
    pub(crate) fn refuse(&mut self, refusal: Refusal) -> Action {
        self.decided = true;
        self.state
            .borrow_mut()
            .metrics
            .add(&metrics::denied(refusal.why), 1);
        let details = refusal.status_details_bin();
        let sent = hostcalls::send_grpc_response(
            grpc_code(refusal.code),
            Some(refusal.message),
            vec![("grpc-status-details-bin", details.as_bytes())],
        );
        if sent.is_err() {
            let _ = hostcalls::reset_http_request();
        }
        Action::Pause
    }

    pub(crate) fn set_header(&self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
    }
}

impl Context for EdgeStream {}

impl HttpContext for EdgeStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.request_headers(end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.request_body(body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.request_trailers()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.response_headers()
    }

    fn on_log(&mut self) {
        self.release();
    }
}

impl Drop for EdgeStream {
    fn drop(&mut self) {
        // on_log runs on every stream end; this covers a host that skips it.
        self.release();
    }
}
