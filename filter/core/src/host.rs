//! What the filter asks of its host, as one trait: the `latchkey-filter` crate
//! implements it over `proxy_wasm::hostcalls` (one method, one host call), and
//! the unit tests over a scripted fake. Nothing in this crate names
//! `proxy_wasm`; everything that decides (the [`crate::edge`] callbacks) talks
//! to Envoy only through [`Host`].
//!
//! Shared data (one map per `vm_id`, across workers) is [`SharedStore`], a
//! supertrait: the admission tables and the last good grant table already
//! take it.
//!
//! Methods answer what the filter needs, not the host's status codes: a read
//! the filter treats as "nothing there" when it fails returns `Option` (or an
//! empty value), a call whose failure changes the decision returns
//! `Result<_, HostError>`, and a call whose failure the filter ignores (a
//! stat, a log line, the tick period) returns nothing.

use std::time::Duration;

use thiserror::Error;

use crate::admission::SharedStore;
use crate::status::GrpcCode;

/// A host call that failed, named by the host's status (e.g. `BadArgument`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{status}")]
pub struct HostError {
    pub status: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Warn,
    Error,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// The host buffers the filter reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    /// The request body buffered so far.
    RequestBody,
    /// The plugin configuration (the ECDS resource's).
    PluginConfiguration,
    /// The answer to a dispatched gRPC call.
    GrpcReceive,
}

/// The header maps the filter reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderMap {
    RequestHeaders,
    RequestTrailers,
}

/// What a callback tells the host to do with the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Hold the stream here: buffer (body), or wait for the local reply to
    /// end it.
    Pause,
}

/// Envoy, as the filter's callbacks see it (proxy-wasm ABI 0.2.1).
pub trait Host: SharedStore {
    // Every context.

    /// The host clock, since the Unix epoch; `None` if unreadable.
    fn now(&self) -> Option<Duration>;
    fn log(&self, level: LogLevel, message: &str);
    /// Defines (or finds) a stat; `None` if the host refused.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32>;
    /// Adds `delta` to a counter or gauge.
    fn increment_metric(&self, id: u32, delta: i64);
    /// Sets a gauge, or records a histogram value.
    fn record_metric(&self, id: u32, value: u64);
    /// Up to `max` bytes of a buffer from `start`; `None` when there is none
    /// or it cannot be read.
    fn buffer(&self, buffer: Buffer, start: usize, max: usize) -> Option<Vec<u8>>;

    // The root context.

    fn set_tick_period(&self, period: Duration);
    /// Starts a unary gRPC call; its token (the answer comes to the root
    /// context's `on_grpc_call_response` with it).
    fn dispatch_grpc_call(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError>;
    /// The status of the gRPC call being answered: code and message.
    fn grpc_status(&self) -> Option<(u32, Option<String>)>;

    // A stream's context.

    /// A property of the stream (`["connection", "uri_san_peer_certificate"]`);
    /// `None` when absent or unreadable.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Every pair of a header map, values as bytes (they need not be UTF-8);
    /// empty if unreadable.
    fn header_map(&self, map: HeaderMap) -> Vec<(String, Vec<u8>)>;
    /// Sets a request header (replacing any value the request had).
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError>;
    fn remove_request_header(&self, name: &str) -> Result<(), HostError>;
    /// Answers the stream with a gRPC status (HTTP 200, `grpc-status`,
    /// `grpc-message`, and `grpc-status-details-bin` = `details_bin`).
    fn send_grpc_reply(
        &self,
        code: GrpcCode,
        message: &str,
        details_bin: &str,
    ) -> Result<(), HostError>;
    /// Resets the request (when a local reply could not be sent).
    fn reset_request(&self);
    /// Calls one of Envoy's foreign functions (`set_envoy_filter_state`).
    fn call_foreign_function(&self, name: &str, arguments: &[u8]) -> Result<(), HostError>;
}

/// The host clock in milliseconds since the Unix epoch (0 if unreadable).
pub fn now_ms(host: &impl Host) -> u64 {
    host.now().map(as_ms).unwrap_or(0)
}

pub(crate) fn as_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
