//! Latchkey's Envoy edge filter: the thin proxy-wasm 0.2.5 glue over
//! `latchkey-filter-core`. Everything that decides lives in the core crate
//! (`latchkey_filter_core::edge`, which talks to Envoy only through its
//! `Host` trait); this crate implements that trait over
//! `proxy_wasm::hostcalls` ([`HostCalls`]) and forwards each proxy-wasm
//! callback of the root context (`root`) and of a stream (`stream`) to the
//! core's method of the same name.
//!
//! Per request (the core's `edge` module has the detail): `on_http_request_headers` authenticates the TLS peer (its
//! certificate's URI SAN; the SPIFFE parse is cached per SAN), refuses
//! any client-sent `x-latchkey-*` header, answers GetEdgePolicy and unknown
//! methods itself, sets `x-latchkey-identity` to the verified SPIFFE ID, takes
//! a place under the identity's stream bound, removes any client
//! `x-lock-key` and, for Acquire/Release/Inspect, lets the headers on to
//! Envoy's buffer filter (next in the chain, which holds them from the router
//! until the body has passed here); `on_http_request_body` buffers the
//! (bounded) body, decides, sets the routing key for Envoy's ring hash
//! (filter state, from the body's key), takes an admission place for a
//! waiting Acquire, and continues or answers with a gRPC refusal;
//! `on_http_request_trailers`
//! refuses reserved names in trailers (for every method: the local reply
//! resets a call already passed on); `on_http_response_headers` gives the
//! waiter's place back (the wait is over once the arbiter answers); `on_log`
//! (every way a stream ends: response, reset, timeout) gives every place back.
//! The root context parses the plugin configuration, starts from the last
//! good grant table kept in shared data (so a VM swapped in by ECDS decides
//! with the table the previous one had, not an empty one), and refreshes the
//! table from the arbiter on a timer, writing each good answer back to shared
//! data and keeping the last good table on failure.
//!
//! Every host call costs microseconds in Envoy's V8, and the request path
//! makes as few as it can: docs/edge-filter-profile.md has the profile (the
//! `profile` feature times each section inside Envoy).
//!
//! Host calls go through `proxy_wasm::hostcalls` (which return `Result`) rather
//! than the trait helpers (which unwrap), and clippy denies unwrap/expect/panic:
//! a panic would take the VM down. Header maps are read as bytes for the same
//! reason (`get_map` unwraps UTF-8).

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing and
// `unreachable!` too.
#![deny(clippy::indexing_slicing, clippy::unreachable)]

mod host;
mod root;
mod stream;

pub use host::HostCalls;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::EdgeRoot::default())
    });
}}
