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

use wasmtime::{Caller, Error, Extern, Linker, Memory, Module, Result, Val};

use crate::wire::{deserialize_map, proto_fields, serialize_map};

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

/// proxy-wasm buffer types the filter reads.
const BUFFER_HTTP_REQUEST_BODY: i32 = 0;
const BUFFER_GRPC_RECEIVE: i32 = 5;
const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;
/// proxy-wasm map types the filter reads or changes.
const MAP_HTTP_REQUEST_HEADERS: i32 = 0;
const MAP_HTTP_REQUEST_TRAILERS: i32 = 1;
/// proxy-wasm stream types.
const STREAM_HTTP_REQUEST: i32 = 0;

type C<'a> = Caller<'a, HostState>;

/// Records a host call in [`HostState::calls`], and passes its answer on.
fn noted(c: &mut C<'_>, call: String, status: i32) -> Result<i32> {
    if c.data().tracing {
        let context = c.data().current;
        c.data_mut()
            .calls
            .push(format!("[{context}] {call} -> {status}"));
    }
    Ok(status)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).escape_debug().to_string()
}

fn memory(caller: &mut C<'_>) -> Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => Err(Error::msg("the module exports no memory")),
    }
}

fn addr(v: i32) -> usize {
    // wasm32 pointers and sizes are u32.
    v as u32 as usize
}

fn read(caller: &mut C<'_>, ptr: i32, len: i32) -> Result<Vec<u8>> {
    let mem = memory(caller)?;
    let (start, len) = (addr(ptr), addr(len));
    let end = start
        .checked_add(len)
        .ok_or_else(|| Error::msg("pointer overflow"))?;
    mem.data(&*caller)
        .get(start..end)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| Error::msg(format!("out-of-bounds read of {len} bytes at {start}")))
}

fn read_str(caller: &mut C<'_>, ptr: i32, len: i32) -> Result<String> {
    String::from_utf8(read(caller, ptr, len)?).map_err(|_| Error::msg("not UTF-8"))
}

fn write(caller: &mut C<'_>, ptr: i32, bytes: &[u8]) -> Result<()> {
    let mem = memory(caller)?;
    mem.write(&mut *caller, addr(ptr), bytes)
        .map_err(|e| Error::msg(format!("out-of-bounds write at {}: {e}", addr(ptr))))
}

/// Copies `bytes` into memory the module allocates and writes the pointer and
/// size to `ptr_out` and `size_out`.
fn give(caller: &mut C<'_>, bytes: &[u8], ptr_out: i32, size_out: i32) -> Result<()> {
    let malloc = match caller.get_export("malloc") {
        Some(Extern::Func(f)) => f.typed::<i32, i32>(&*caller)?,
        _ => return Err(Error::msg("the module exports no malloc")),
    };
    let len = i32::try_from(bytes.len()).map_err(|_| Error::msg("value too large"))?;
    let ptr = malloc.call(&mut *caller, len)?;
    write(caller, ptr, bytes)?;
    write(caller, ptr_out, &ptr.to_le_bytes())?;
    write(caller, size_out, &len.to_le_bytes())
}

/// The imports this host serves. `Linker::func_wrap` checks each signature
/// against the module's import when it is instantiated.
pub const SERVED: &[&str] = &[
    "proxy_log",
    "proxy_get_current_time_nanoseconds",
    "proxy_set_tick_period_milliseconds",
    "proxy_get_buffer_bytes",
    "proxy_get_header_map_pairs",
    "proxy_get_header_map_value",
    "proxy_replace_header_map_value",
    "proxy_remove_header_map_value",
    "proxy_get_property",
    "proxy_get_shared_data",
    "proxy_set_shared_data",
    "proxy_send_local_response",
    "proxy_close_stream",
    "proxy_continue_stream",
    "proxy_grpc_call",
    "proxy_get_status",
    "proxy_call_foreign_function",
    "proxy_define_metric",
    "proxy_increment_metric",
    "proxy_record_metric",
    "proxy_set_effective_context",
    "proxy_done",
];

/// Serves [`SERVED`] and makes every other import of `module` trap.
pub fn link(linker: &mut Linker<HostState>, module: &Module) -> Result<()> {
    const ENV: &str = "env";
    linker.func_wrap(
        ENV,
        "proxy_log",
        |mut c: C<'_>, level: i32, ptr: i32, len: i32| -> Result<i32> {
            let message = String::from_utf8_lossy(&read(&mut c, ptr, len)?).into_owned();
            c.data_mut()
                .logs
                .push((LogLevel::of(level), message.clone()));
            noted(&mut c, format!("log({level}, {message:?})"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_current_time_nanoseconds",
        |mut c: C<'_>, out: i32| -> Result<i32> {
            let ns = u64::try_from(c.data().now.as_nanos()).unwrap_or(u64::MAX);
            write(&mut c, out, &ns.to_le_bytes())?;
            noted(&mut c, format!("get_current_time() = {ns}"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_tick_period_milliseconds",
        |mut c: C<'_>, ms: i32| -> Result<i32> {
            c.data_mut().tick_period_ms = Some(ms as u32);
            noted(&mut c, format!("set_tick_period({ms})"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_buffer_bytes",
        |mut c: C<'_>,
         kind: i32,
         start: i32,
         max: i32,
         ptr_out: i32,
         size_out: i32|
         -> Result<i32> {
            let whole = match kind {
                BUFFER_HTTP_REQUEST_BODY => c.data_mut().stream()?.request_body.clone(),
                BUFFER_GRPC_RECEIVE => c.data().grpc_receive_buffer.clone(),
                BUFFER_PLUGIN_CONFIGURATION => c.data().plugin_configuration.clone(),
                _ => return noted(&mut c, format!("get_buffer({kind})"), NOT_FOUND),
            };
            let call = format!("get_buffer({kind}, {start}, {max})");
            let start = addr(start);
            if start > whole.len() {
                return noted(&mut c, call, BAD_ARGUMENT);
            }
            let end = start.saturating_add(addr(max)).min(whole.len());
            let part = whole.get(start..end).unwrap_or_default().to_vec();
            if !part.is_empty() {
                give(&mut c, &part, ptr_out, size_out)?;
            }
            noted(&mut c, format!("{call} = {}", text(&part)), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_pairs",
        |mut c: C<'_>, map: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            let pairs = match map {
                MAP_HTTP_REQUEST_HEADERS => c.data_mut().stream()?.request_headers.clone(),
                MAP_HTTP_REQUEST_TRAILERS => c.data_mut().stream()?.request_trailers.clone(),
                other => return Err(Error::msg(format!("header map {other} is not scripted"))),
            };
            give(&mut c, &serialize_map(&pairs), ptr_out, size_out)?;
            noted(
                &mut c,
                format!("get_header_map_pairs({map}) = {} pairs", pairs.len()),
                OK,
            )
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_value",
        |mut c: C<'_>, map: i32, kp: i32, kl: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            let name = read_str(&mut c, kp, kl)?;
            let value = match map {
                MAP_HTTP_REQUEST_HEADERS => c.data_mut().stream()?.request_header(&name),
                other => return Err(Error::msg(format!("header map {other} is not scripted"))),
            };
            let call = format!("get_header_map_value({map}, {name:?})");
            match value {
                Some(v) => {
                    give(&mut c, v.as_bytes(), ptr_out, size_out)?;
                    noted(&mut c, format!("{call} = {v:?}"), OK)
                }
                None => noted(&mut c, call, NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_replace_header_map_value",
        |mut c: C<'_>, map: i32, kp: i32, kl: i32, vp: i32, vl: i32| -> Result<i32> {
            if map != MAP_HTTP_REQUEST_HEADERS {
                return Err(Error::msg(format!("header map {map} is not scripted")));
            }
            let name = read_str(&mut c, kp, kl)?;
            let value = read(&mut c, vp, vl)?;
            let call = format!(
                "replace_header_map_value({map}, {name:?}, {})",
                text(&value)
            );
            let headers = &mut c.data_mut().stream()?.request_headers;
            headers.retain(|(n, _)| !n.eq_ignore_ascii_case(&name));
            headers.push((name, value));
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_remove_header_map_value",
        |mut c: C<'_>, map: i32, kp: i32, kl: i32| -> Result<i32> {
            if map != MAP_HTTP_REQUEST_HEADERS {
                return Err(Error::msg(format!("header map {map} is not scripted")));
            }
            let name = read_str(&mut c, kp, kl)?;
            let call = format!("remove_header_map_value({map}, {name:?})");
            let headers = &mut c.data_mut().stream()?.request_headers;
            headers.retain(|(n, _)| !n.eq_ignore_ascii_case(&name));
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_property",
        |mut c: C<'_>, pp: i32, pl: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            let path = read(&mut c, pp, pl)?;
            let path: Vec<String> = path
                .split(|b| *b == 0)
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect();
            let path = path.join(".");
            let value = c.data_mut().stream()?.properties.get(&path).cloned();
            let call = format!("get_property({path:?})");
            match value {
                Some(v) => {
                    give(&mut c, &v, ptr_out, size_out)?;
                    noted(&mut c, format!("{call} = {}", text(&v)), OK)
                }
                None => noted(&mut c, call, NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_shared_data",
        |mut c: C<'_>,
         kp: i32,
         kl: i32,
         ptr_out: i32,
         size_out: i32,
         cas_out: i32|
         -> Result<i32> {
            let key = read_str(&mut c, kp, kl)?;
            let entry = c.data().shared.borrow().entries.get(&key).cloned();
            let Some((value, cas)) = entry else {
                return noted(&mut c, format!("get_shared_data({key:?})"), NOT_FOUND);
            };
            if !value.is_empty() {
                give(&mut c, &value, ptr_out, size_out)?;
            }
            write(&mut c, cas_out, &cas.to_le_bytes())?;
            let call = format!(
                "get_shared_data({key:?}) = {} bytes, cas {cas}",
                value.len()
            );
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_shared_data",
        |mut c: C<'_>, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| -> Result<i32> {
            let key = read_str(&mut c, kp, kl)?;
            let value = if vl == 0 {
                Vec::new()
            } else {
                read(&mut c, vp, vl)?
            };
            let status = c.data().shared.borrow_mut().set(&key, &value, cas as u32);
            let call = format!("set_shared_data({key:?}, {} bytes, cas {cas})", value.len());
            noted(&mut c, call, status)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_send_local_response",
        |mut c: C<'_>,
         status: i32,
         _dp: i32,
         _dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         grpc_status: i32|
         -> Result<i32> {
            let body = read(&mut c, bp, bl)?;
            let headers = deserialize_map(&read(&mut c, hp, hl)?)
                .ok_or_else(|| Error::msg("malformed local reply headers"))?;
            let stream = c.data_mut().stream()?;
            if stream.local_reply.is_some() {
                return Err(Error::msg("a second local reply on one stream"));
            }
            let call = format!(
                "send_local_response({status}, grpc {grpc_status}, {}, {headers:?})",
                text(&body)
            );
            stream.local_reply = Some(LocalReply {
                http_status: status as u32,
                grpc_status,
                body,
                headers,
            });
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_close_stream",
        |mut c: C<'_>, kind: i32| -> Result<i32> {
            if kind != STREAM_HTTP_REQUEST {
                return Err(Error::msg(format!("close of stream type {kind}")));
            }
            c.data_mut().stream()?.reset = true;
            noted(&mut c, format!("close_stream({kind})"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_continue_stream",
        |_c: C<'_>, kind: i32| -> Result<i32> {
            Err(Error::msg(format!(
                "continue of stream type {kind}: the filter never pauses a phase it resumes"
            )))
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_grpc_call",
        |mut c: C<'_>,
         up: i32,
         ul: i32,
         sp: i32,
         sl: i32,
         mp: i32,
         ml: i32,
         _metadata_p: i32,
         _metadata_l: i32,
         msgp: i32,
         msgl: i32,
         timeout_ms: i32,
         token_out: i32|
         -> Result<i32> {
            let cluster = read_str(&mut c, up, ul)?;
            let service = read_str(&mut c, sp, sl)?;
            let method = read_str(&mut c, mp, ml)?;
            let message = read(&mut c, msgp, msgl)?;
            let state = c.data_mut();
            state.next_token += 1;
            let token = state.next_token;
            state.grpc_calls.push(GrpcCall {
                token,
                cluster,
                service,
                method,
                message,
                timeout_ms: timeout_ms as u32,
            });
            write(&mut c, token_out, &token.to_le_bytes())?;
            let call = grpc_call_line(&c, token);
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_status",
        |mut c: C<'_>, code_out: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            let (code, message) = c.data().grpc_status.clone();
            write(&mut c, code_out, &code.to_le_bytes())?;
            if let Some(m) = &message {
                give(&mut c, m.as_bytes(), ptr_out, size_out)?;
            }
            noted(&mut c, format!("get_status() = {code}, {message:?}"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_call_foreign_function",
        |mut c: C<'_>,
         np: i32,
         nl: i32,
         ap: i32,
         al: i32,
         _ptr_out: i32,
         _size_out: i32|
         -> Result<i32> {
            let name = read_str(&mut c, np, nl)?;
            let args = read(&mut c, ap, al)?;
            let call = format!("call_foreign_function({name:?}, {})", text(&args));
            if name != "set_envoy_filter_state" {
                return noted(&mut c, call, NOT_FOUND);
            }
            // SetEnvoyFilterStateArguments{path = 1, value = 2, span = 3}
            let key = crate::wire::proto_string(&args, 1).unwrap_or_default();
            let value = crate::wire::proto_string(&args, 2).unwrap_or_default();
            c.data_mut().stream()?.filter_state.push((key, value));
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_define_metric",
        |mut c: C<'_>, kind: i32, np: i32, nl: i32, id_out: i32| -> Result<i32> {
            let name = read_str(&mut c, np, nl)?;
            let kind = match kind {
                0 => MetricKind::Counter,
                1 => MetricKind::Gauge,
                2 => MetricKind::Histogram,
                _ => return Ok(BAD_ARGUMENT),
            };
            let metrics = &mut c.data_mut().metrics;
            let id = match metrics.iter().position(|m| m.name == name) {
                Some(i) if metrics.get(i).is_some_and(|m| m.kind != kind) => {
                    return Err(Error::msg(format!("{name} defined as two kinds")));
                }
                Some(i) => i,
                None => {
                    metrics.push(Metric {
                        name: name.clone(),
                        kind,
                        value: 0,
                        samples: Vec::new(),
                    });
                    metrics.len() - 1
                }
            };
            let id = u32::try_from(id).map_err(|_| Error::msg("too many metrics"))?;
            write(&mut c, id_out, &id.to_le_bytes())?;
            noted(
                &mut c,
                format!("define_metric({kind:?}, {name:?}) = {id}"),
                OK,
            )
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_increment_metric",
        |mut c: C<'_>, id: i32, delta: i64| -> Result<i32> {
            let call = format!("increment_metric({id}, {delta})");
            let Some(m) = c.data_mut().metrics.get_mut(addr(id)) else {
                return noted(&mut c, call, NOT_FOUND);
            };
            if m.kind == MetricKind::Histogram {
                return noted(&mut c, call, BAD_ARGUMENT);
            }
            m.value += delta;
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_record_metric",
        |mut c: C<'_>, id: i32, value: i64| -> Result<i32> {
            let call = format!("record_metric({id}, {value})");
            let Some(m) = c.data_mut().metrics.get_mut(addr(id)) else {
                return noted(&mut c, call, NOT_FOUND);
            };
            match m.kind {
                MetricKind::Histogram => m.samples.push(value as u64),
                _ => m.value = value,
            }
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_effective_context",
        |mut c: C<'_>, id: i32| -> Result<i32> {
            c.data_mut().current = id as u32;
            noted(&mut c, format!("set_effective_context({id})"), OK)
        },
    )?;
    linker.func_wrap(ENV, "proxy_done", |mut c: C<'_>| -> Result<i32> {
        noted(&mut c, "done()".into(), OK)
    })?;

    for import in module.imports() {
        if import.module() == ENV && SERVED.contains(&import.name()) {
            continue;
        }
        let name = format!("{}::{}", import.module(), import.name());
        let wasmtime::ExternType::Func(ty) = import.ty() else {
            return Err(Error::msg(format!("import {name} is not a function")));
        };
        linker.func_new(
            import.module(),
            import.name(),
            ty,
            move |_c: C<'_>, _params: &[Val], _results: &mut [Val]| {
                Err(Error::msg(format!(
                    "the filter called {name}, which the scripted host does not serve"
                )))
            },
        )?;
    }
    Ok(())
}

fn grpc_call_line(c: &C<'_>, token: u32) -> String {
    match c.data().grpc_calls.iter().find(|g| g.token == token) {
        Some(g) => format!(
            "grpc_call({:?}, {:?}, {:?}, {} bytes, {} ms) = {token}",
            g.cluster,
            g.service,
            g.method,
            g.message.len(),
            g.timeout_ms
        ),
        None => format!("grpc_call() = {token}"),
    }
}
