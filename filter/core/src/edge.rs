//! The filter's proxy-wasm callbacks, as plain Rust over a [`Host`]: every
//! decision the edge makes about a stream or its configuration is taken
//! here, and the `latchkey-filter` crate only forwards each proxy-wasm
//! callback to the method of the same name with its host.
//!
//! The root context ([`Root`], one per VM) takes the configuration
//! (`configure`: [`Root::on_configure`]) and keeps the grant table fresh on
//! a timer (`refresh`: [`Root::on_tick`], [`Root::on_grpc_call_response`]).
//! A stream ([`Stream`], from [`Root::new_stream`]) goes through
//! `request_headers` ([`Stream::on_request_headers`]: identity, reserved
//! headers, the call, the identity header, the stream bound), `request_body`
//! ([`Stream::on_request_body`], [`Stream::on_request_trailers`]: a keyed
//! call's decision) and `stream_end` ([`Stream::on_response_headers`],
//! [`Stream::on_log`]: places given back). What the root context shares with
//! its streams is the VM's state (`vm`).
//!
//! [`Host`]: crate::host::Host

mod configure;
#[cfg(test)]
pub(crate) mod fake;
mod metric_ids;
pub(crate) mod profile;
mod refresh;
mod request_body;
mod request_headers;
mod root;
mod stream;
mod stream_end;
mod vm;

pub use refresh::{FIRST_REFRESH_MS, NOT_READY_REFRESH_MS};
pub use request_body::{ROUTE_KEY_STATE, SET_FILTER_STATE, route_key_arguments};
pub use root::Root;
pub use stream::Stream;
