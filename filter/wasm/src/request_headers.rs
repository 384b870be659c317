//! `on_http_request_headers`: who the caller is, reserved headers, the call,
//! the identity header and the identity's stream place.

use std::borrow::Cow;

use latchkey_filter_core::decision::{self, KEY_HEADER};
use latchkey_filter_core::headers::check_request_headers;
use latchkey_filter_core::identity::IDENTITY_HEADER;
use latchkey_filter_core::metrics;
use latchkey_filter_core::request::Call;
use latchkey_filter_core::status::{DenyReason, Refusal};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{Action, MapType};

use crate::host_store::HostStore;
use crate::profile::Section;
use crate::stream::EdgeStream;
use crate::vm::now_ms;

impl EdgeStream {
    pub(crate) fn request_headers(&mut self, end_of_stream: bool) -> Action {
        self.started = hostcalls::get_current_time().ok();
        self.prof.start();
        let Some(active) = self.active.clone() else {
            return self.refuse(Refusal::of(DenyReason::PolicyNotReady));
        };
        // The peer certificate's URI SAN alone: Envoy has it only when the
        // client presented a certificate, which the listener verified against
        // the trust bundle (see `identity_from_san`). One property read per
        // request; the SPIFFE parse is cached per SAN.
        let san = hostcalls::get_property(vec!["connection", "uri_san_peer_certificate"])
            .ok()
            .flatten()
            .unwrap_or_default();
        let identity = self
            .state
            .borrow_mut()
            .identity(&san, &active.config.trust_domain);
        self.identity = match identity {
            Some(id) => id,
            None => return self.refuse(Refusal::of(DenyReason::Unauthenticated)),
        };
        self.bound = active
            .table
            .view(now_ms())
            .bound_subject(&self.identity)
            .into();
        self.prof.lap(Section::Identity);
        // Request headers are readable only in this phase: refuse any
        // x-latchkey-* the client sent (the edge names the caller, nobody
        // else), and keep what the body decision needs.
        // Bytes, not `get_map`: that unwraps UTF-8, and a header value need
        // not be UTF-8 (a panic would take the VM down).
        // Values are borrowed, and copied (lossily) only if not UTF-8.
        let raw = hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
        let headers: Vec<(&str, Cow<'_, str>)> = raw
            .iter()
            .map(|(k, v)| (k.as_str(), String::from_utf8_lossy(v)))
            .collect();
        let checked = match check_request_headers(headers.iter().map(|(k, v)| (*k, v.as_ref()))) {
            Ok(checked) => checked,
            Err(refusal) => return self.refuse(refusal),
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
            Call::EdgePolicy => return self.refuse(Refusal::of(DenyReason::EdgePolicyForbidden)),
            Call::Unknown => return self.refuse(Refusal::of(DenyReason::UnknownMethod)),
        };
        // The client's x-lock-key is never forwarded, on any call: routing
        // uses the key the filter authorised from the body (filter state),
        // and a keyed call's header must equal that key (checked on the
        // body, before anything is forwarded: the buffer filter holds the
        // headers until then).
        if checked.key_repeated {
            return self.refuse(Refusal::of(DenyReason::KeyMismatch));
        }
        self.prof.lap(Section::HeaderMap);
        if checked.key.is_some()
            && hostcalls::set_map_value(MapType::HttpRequestHeaders, KEY_HEADER, None).is_err()
        {
            return self.refuse(Refusal::of(DenyReason::NoRouteKey));
        }
        self.key_header = checked.key;
        // Every forwarded call names its verified caller, admin calls included.
        let identity = self.identity.clone();
        self.set_header(IDENTITY_HEADER, &identity);
        self.prof.lap(Section::HeaderSet);
        // Every stream counts against its identity's bound until it ends:
        // exactly, in shared data (a place kept back by one worker would
        // refuse the identity below its bound on another).
        match active.admission.open_stream(
            &HostStore,
            &self.bound,
            active.config.max_streams_per_identity,
        ) {
            Ok(place) => {
                self.stream = Some(place);
                self.prof.lap(Section::StreamPlace);
                self.state
                    .borrow_mut()
                    .metrics
                    .gauge_add(metrics::STREAMS_OPEN, 1);
            }
            Err(rejection) => return self.refuse(decision::admission_refusal(rejection)),
        }
        if !self.method.is_keyed() {
            self.state
                .borrow_mut()
                .metrics
                .add(&metrics::allowed(self.method.label(), "ns._.class._"), 1);
            self.decided = true;
            self.prof.lap(Section::HeaderStats);
            return Action::Continue;
        }
        self.prof.lap(Section::HeaderStats);
        if end_of_stream {
            return self.refuse(Refusal::of(DenyReason::BadRequest));
        }
        // Not Pause: the host turns a paused header phase into "stop all", and
        // the body would never reach this filter. The headers go on to Envoy's
        // buffer filter, which holds them (and so the router, its host choice
        // and the arbiter) until this filter lets the body through.
        Action::Continue
    }
}
