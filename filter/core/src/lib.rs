//! The logic of Latchkey's Envoy edge filter, kept free of `proxy_wasm` so it is
//! tested natively (the `latchkey-filter` crate is the thin glue). The
//! proxy-wasm callbacks themselves are [`edge`] (root context: configuration
//! and the grant-table refresh; a stream: headers, body and trailers, its
//! end), which talk to Envoy only through the [`host::Host`] trait: the glue
//! implements it over the host calls, the unit tests over a scripted fake.
//!
//! A request flows through it like this: the caller's SPIFFE ID comes from the
//! TLS peer ([`identity::peer_identity`]); any client-sent `x-latchkey-*`
//! header is refused ([`headers`]) and the edge names the caller itself; the
//! `:method` and `:path` must be a known call ([`request::Call`]: GetEdgePolicy
//! and anything unknown are answered by the edge); every stream takes a place
//! under its identity's stream bound ([`admission::Admission::open_stream`])
//! until it ends (so a KeepAlive or an election Observe stream holds its
//! place for as long as it is open); for a keyed call — Acquire, Release and
//! Inspect, and every election.v1 call, whose election name is a lock key —
//! the body is one gRPC frame whose message gives the key and class
//! ([`decision::check_keyed`], which also
//! matches the `x-lock-key` header and asks the grant table,
//! [`policy::EdgePolicy`], for the longest granted prefix — as seen through
//! [`grant_table::Table`]: without a table, or for a key a stale table does
//! not cover, the answer is a retryable `UNAVAILABLE`, never
//! `PERMISSION_DENIED`); a waiting Acquire or a Campaign
//! then takes a place under the per-identity, per-identity-on-the-key (its
//! share of the key) and per-key bounds in host shared data, placed by a
//! keyed hash ([`keyed_hash`]) and given back when the arbiter answers or the
//! stream ends. Request trailers carrying a reserved
//! name are refused on every method. Refusals are [`status::Refusal`]s; stat
//! names are in [`metrics`]. The configuration is [`config::FilterConfig`].
//! The table a VM starts with — the last good one an earlier VM kept in shared
//! data, so a filter swap never decides with an empty table — and its
//! freshness are [`grant_table`].

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing and
// `unreachable!` too.
#![deny(clippy::indexing_slicing, clippy::unreachable)]

pub mod admission;
pub mod config;
pub mod decision;
pub mod edge;
pub mod grant_table;
pub mod headers;
pub mod host;
pub mod identity;
pub mod keyed_hash;
pub mod metrics;
pub mod policy;
pub mod request;
pub mod status;
pub mod wire;
