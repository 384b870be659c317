//! A stream's context: each proxy-wasm callback forwarded to
//! [`latchkey_filter_core::edge::Stream`] with the host.

use latchkey_filter_core::edge::Stream;
use latchkey_filter_core::host;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::host::HostCalls;

pub(crate) struct EdgeStream {
    core: Stream,
}

impl EdgeStream {
    pub(crate) fn new(core: Stream) -> Self {
        Self { core }
    }
}

fn action(a: host::Action) -> Action {
    match a {
        host::Action::Continue => Action::Continue,
        host::Action::Pause => Action::Pause,
    }
}

impl Context for EdgeStream {}

impl HttpContext for EdgeStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(self.core.on_request_headers(&HostCalls, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(
            self.core
                .on_request_body(&HostCalls, body_size, end_of_stream),
        )
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.core.on_request_trailers(&HostCalls))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        action(self.core.on_response_headers(&HostCalls))
    }

    fn on_log(&mut self) {
        self.core.on_log(&HostCalls);
    }
}

impl Drop for EdgeStream {
    fn drop(&mut self) {
        // on_log runs on every stream end; this covers a host that skips it.
        self.core.on_log(&HostCalls);
    }
}
