//! Latchkey's Envoy edge filter: the thin proxy-wasm 0.2.5 glue over
//! `latchkey-filter-core`. Everything that decides lives in the core crate;
//! this crate only moves bytes between Envoy and it.
//!
//! Per request: `on_http_request_headers` authenticates the TLS peer, replaces
//! any client-sent `x-latchkey-identity` with the verified SPIFFE ID and, for
//! Acquire/Release/Inspect, lets the headers on to Envoy's buffer filter (next
//! in the chain, which holds them from the router until the body has passed
//! here); `on_http_request_body` buffers the (bounded) body, decides, sets
//! `x-lock-key` to the authorised key for Envoy's ring hash, takes an admission
//! place for a waiting Acquire, and continues or answers with a gRPC refusal; `on_log` (every way a stream ends:
//! response, reset, timeout) gives the place back. The root context parses the
//! plugin configuration and refreshes the grant table from the arbiter on a
//! timer, keeping the last good table on failure.
//!
//! Host calls go through `proxy_wasm::hostcalls` (which return `Result`) rather
//! than the trait helpers (which unwrap), and clippy denies unwrap/expect/panic:
//! a panic would take the VM down.

#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::unreachable,
    clippy::todo,
    clippy::unimplemented,
    clippy::indexing_slicing
)]

mod glue;

pub use glue::HostStore;
