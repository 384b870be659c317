//! The body phase: `on_http_request_body` buffers the keyed call's body and
//! `on_http_request_trailers` refuses reserved trailer names; either decides
//! the call on its whole body (`decide`): authorisation, the routing key and
//! a waiting Acquire's admission.

use latchkey_filter_core::decision;
use latchkey_filter_core::headers::check_trailers;
use latchkey_filter_core::metrics;
use latchkey_filter_core::status::{DenyReason, Refusal};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{Action, BufferType, LogLevel, MapType, Status};

use crate::host_store::HostStore;
use crate::profile::Section;
use crate::stream::EdgeStream;
use crate::vm::{log, now_ms};

/// The filter state key the route's ring hash reads (`hash_policy.filter_state`):
/// Envoy's well-known hashable string object.
const ROUTE_KEY_STATE: &str = "envoy.hashable_string";

/// Sets `envoy.hashable_string` in the request's filter state through Envoy's
/// `set_envoy_filter_state` foreign function (argument: the
/// `SetEnvoyFilterStateArguments` message, `{path = 1, value = 2, span = 3}`).
fn set_route_key(key: &str) -> Result<(), Status> {
    let mut args = latchkey_filter_core::wire::Writer::new();
    args.string(1, ROUTE_KEY_STATE).string(2, key);
    hostcalls::call_foreign_function("set_envoy_filter_state", Some(&args.finish())).map(|_| ())
}

impl EdgeStream {
    pub(crate) fn request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided {
            return Action::Continue;
        }
        let max = self
            .active
            .as_ref()
            .map(|a| a.config.max_message_bytes)
            .unwrap_or(0);
        if decision::body_too_large(body_size, max) {
            return self.refuse(Refusal::of(DenyReason::Oversized));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.decide(body_size)
    }

    pub(crate) fn request_trailers(&mut self) -> Action {
        // Reserved names are refused here too, whatever the method: tonic
        // merges a unary request's trailers into its metadata. Pausing keeps
        // the trailers from the router, and the local reply ends the stream,
        // which resets the upstream request (for a call passed on at header
        // time) before the arbiter has seen its end: it never completes.
        let trailers = hostcalls::get_map_bytes(MapType::HttpRequestTrailers).unwrap_or_default();
        if let Err(refusal) = check_trailers(trailers.iter().map(|(k, _)| k.as_str())) {
            return self.refuse(refusal);
        }
        if self.decided {
            return Action::Continue;
        }
        let size = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, usize::MAX)
            .ok()
            .flatten()
            .map(|b| b.len())
            .unwrap_or(0);
        self.decide(size)
    }

    /// Decides a keyed call on its whole body.
    fn decide(&mut self, body_size: usize) -> Action {
        self.decided = true;
        self.prof.lap(Section::WaitBody);
        let Some(active) = self.active.clone() else {
            return self.refuse(Refusal::of(DenyReason::PolicyNotReady));
        };
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.prof.lap(Section::BodyGet);
        let now = self
            .started
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or_else(now_ms);
        let authorised = match decision::check_keyed(
            active.table.view(now),
            &self.identity,
            self.method,
            &body,
            self.key_header.as_deref(),
            active.config.max_message_bytes,
        ) {
            Ok(a) => a,
            Err(refusal) => return self.refuse(refusal),
        };
        self.prof.lap(Section::Check);
        // Routing affinity follows the authorised key, from the body: the
        // ring hash reads filter state, set here (request headers can no
        // longer be changed in the body phase). The client's x-lock-key was
        // removed in the header phase, whatever it said.
        if let Err(e) = set_route_key(authorised.key.as_str()) {
            log(
                LogLevel::Error,
                &format!("latchkey edge: cannot set the routing key: {e:?}"),
            );
            return self.refuse(Refusal::of(DenyReason::NoRouteKey));
        }
        self.prof.lap(Section::RouteKey);
        let (scope, allowed) = self.state.borrow_mut().scope(self.method, &authorised);
        if authorised.waits {
            match active.admission.admit(
                &HostStore,
                authorised.key.as_str(),
                authorised.max_waiters_per_key,
                &self.bound,
                active.config.max_waiters_per_identity,
            ) {
                Ok(ticket) => {
                    let mut st = self.state.borrow_mut();
                    st.metrics.gauge_add(&metrics::waiters(&scope), 1);
                    if ticket.overflowed() {
                        st.metrics.add(metrics::ADMISSION_OVERFLOW, 1);
                    }
                    drop(st);
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
                    self.state
                        .borrow_mut()
                        .metrics
                        .add(&metrics::admission_rejected(which, &scope), 1);
                    return self.refuse(refusal);
                }
            }
            self.prof.lap(Section::Admit);
        }
        if let Some(id) = allowed {
            let _ = hostcalls::increment_metric(id, 1);
        }
        if let (Some(start), Ok(now)) = (self.started, hostcalls::get_current_time())
            && let Ok(spent) = now.duration_since(start)
        {
            self.state
                .borrow_mut()
                .metrics
                .histogram(metrics::DECISION_US, spent.as_micros() as u64);
        }
        self.prof.lap(Section::BodyStats);
        Action::Continue
    }
}
