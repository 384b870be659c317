//! The scripted host: what Envoy would be to the filter, as plain data the
//! test sets up and then reads back, and the proxy-wasm 0.2.1 imports that
//! serve the module from it.
//!
//! Only the imports the filter calls are served; every other import the
//! module declares (the Rust SDK declares all of them) traps with its name,
//! so a filter that starts using a new host call fails here until the host
//! scripts it. Values that come back to the module (buffers, header maps,
//! properties, shared data) are copied into memory the module allocates
//! through its `malloc` export, as Envoy does.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use wasmtime::{Error, Result};

use crate::wire::proto_fields;

mod imports;
mod memory;

pub use imports::{SERVED, link};

/// proxy-wasm `WasmResult` codes.
const OK: i32 = 0;
const NOT_FOUND: i32 = 1;
const BAD_ARGUMENT: i32 = 2;
const CAS_MISMATCH: i32 = 8;

/// Host shared data: one map per `vm_id`, shared by every VM (worker) of it
/// and kept across VM swaps. Envoy's semantics: a compare-and-swap token
/// changes on every set, the CAS is checked only on an existing entry (a
/// missing one is created whatever the token), and 0 means no check.
#[derive(Debug, Default)]
pub struct SharedData {
    entries: BTreeMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl SharedData {
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.entries.get(key).map(|(v, _)| v.as_slice())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn set(&mut self, key: &str, value: &[u8], cas: u32) -> i32 {
        if let Some((_, current)) = self.entries.get(key)
            && cas != 0
            && cas != *current
        {
            return CAS_MISMATCH;
        }
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        self.entries
            .insert(key.to_owned(), (value.to_vec(), self.next_cas));
        OK
    }
}

/// Shared data several VMs of one test use (`FilterVm::with_shared_data`).
pub type SharedDataHandle = Rc<RefCell<SharedData>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// A stat the module defined, and what it did to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metric {
    pub name: String,
    pub kind: MetricKind,
    /// A counter's or gauge's value.
    pub value: i64,
    /// A histogram's recorded values.
    pub samples: Vec<u64>,
}

/// A `proxy_send_local_response`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub http_status: u32,
    /// -1 for a plain HTTP reply.
    pub grpc_status: i32,
    /// For a gRPC reply, the `grpc-message`.
    pub body: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl LocalReply {
    pub fn message(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// `ErrorInfo.reason` from `grpc-status-details-bin` (a base64
    /// `google.rpc.Status` whose `details` hold one `Any` of an `ErrorInfo`).
    pub fn error_reason(&self) -> Option<String> {
        let status = crate::wire::base64_decode(self.header("grpc-status-details-bin")?)?;
        let any = proto_fields(&status)?
            .into_iter()
            .find(|(f, _)| *f == 3)
            .map(|(_, v)| v)?;
        let info = proto_fields(&any)?
            .into_iter()
            .find(|(f, _)| *f == 2)
            .map(|(_, v)| v)?;
        crate::wire::proto_string(&info, 1)
    }
}

/// A `proxy_grpc_call` the module dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcCall {
    pub token: u32,
    pub cluster: String,
    pub service: String,
    pub method: String,
    pub message: Vec<u8>,
    pub timeout_ms: u32,
}

/// One HTTP stream as the host sees it.
#[derive(Debug, Clone, Default)]
pub struct StreamData {
    /// Properties by path, the segments joined with `.`
    /// (`connection.uri_san_peer_certificate`).
    pub properties: BTreeMap<String, Vec<u8>>,
    /// The request headers as they are now (the module's changes applied):
    /// what the router would forward.
    pub request_headers: Vec<(String, Vec<u8>)>,
    pub request_trailers: Vec<(String, Vec<u8>)>,
    /// The request body buffered so far.
    pub request_body: Vec<u8>,
    pub local_reply: Option<LocalReply>,
    /// `set_envoy_filter_state` calls: `(key, value)`.
    pub filter_state: Vec<(String, String)>,
    /// The module reset the request (`proxy_close_stream`).
    pub reset: bool,
}

impl StreamData {
    pub fn request_header(&self, name: &str) -> Option<String> {
        self.request_headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    pub fn request_header_count(&self, name: &str) -> usize {
        self.request_headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .count()
    }
}

/// Everything the host knows, and everything the module did to it.
#[derive(Debug)]
pub struct HostState {
    /// The host clock, since the Unix epoch.
    pub now: Duration,
    pub plugin_configuration: Vec<u8>,
    pub shared: SharedDataHandle,
    /// Stats by id (the id is the index).
    pub metrics: Vec<Metric>,
    pub logs: Vec<(LogLevel, String)>,
    pub tick_period_ms: Option<u32>,
    pub grpc_calls: Vec<GrpcCall>,
    /// What `proxy_get_buffer_bytes(GrpcReceiveBuffer)` returns.
    pub grpc_receive_buffer: Vec<u8>,
    /// What `proxy_get_status` returns.
    pub grpc_status: (u32, Option<String>),
    pub streams: BTreeMap<u32, StreamData>,
    /// The context whose callback runs (as Envoy tracks it).
    pub current: u32,
    /// Whether to keep [`HostState::calls`] (off by default: configuring
    /// alone makes ~80,000 shared-data calls, creating the admission slots).
    pub tracing: bool,
    /// With `tracing`, every host call the module made, in order, with its
    /// arguments and answer (compare two builds' traces to see a behaviour
    /// change).
    pub calls: Vec<String>,
    next_token: u32,
}

impl HostState {
    pub fn new(shared: SharedDataHandle) -> Self {
        Self {
            // 2026-01-01T00:00:00Z
            now: Duration::from_secs(1_767_225_600),
            plugin_configuration: Vec::new(),
            shared,
            metrics: Vec::new(),
            logs: Vec::new(),
            tick_period_ms: None,
            grpc_calls: Vec::new(),
            grpc_receive_buffer: Vec::new(),
            grpc_status: (0, None),
            streams: BTreeMap::new(),
            current: 0,
            tracing: std::env::var_os("LATCHKEY_ABI_TRACE_DIR").is_some(),
            calls: Vec::new(),
            next_token: 0,
        }
    }

    pub fn metric(&self, name: &str) -> Option<&Metric> {
        self.metrics.iter().find(|m| m.name == name)
    }

    fn stream(&mut self) -> Result<&mut StreamData> {
        let current = self.current;
        self.streams
            .get_mut(&current)
            .ok_or_else(|| Error::msg(format!("context {current} is not an HTTP stream")))
    }
}

/// proxy-wasm log levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
    Critical,
}

impl LogLevel {
    fn of(level: i32) -> LogLevel {
        match level {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            _ => LogLevel::Critical,
        }
    }
}
