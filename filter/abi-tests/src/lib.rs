//! The built edge filter, run against scripted host calls: the tier between
//! `latchkey-filter-core`'s unit tests (the decisions, natively, against a
//! fake host) and the e2e tests (a real Envoy). It takes the `.wasm`
//! `scripts/build-wasm latchkey-filter` wrote, the artifact Envoy loads, and
//! runs it in wasmtime as Envoy would run it in V8: `_initialize`, a root
//! context (`proxy_on_context_create`, `proxy_on_vm_start`,
//! `proxy_on_configure`), then one HTTP context per stream
//! (`proxy_on_request_headers`, `proxy_on_request_body`,
//! `proxy_on_request_trailers`, `proxy_on_response_headers`, and
//! `proxy_on_done`, `proxy_on_log`, `proxy_on_delete` at its end), with ticks
//! and the grant-table refresh's gRPC answers in between.
//!
//! What the host knows (the peer certificate's URI SAN, request headers,
//! bodies, shared data, the clock) is plain data in [`HostState`]; what the
//! module did (local replies, headers set or removed, filter state, stats,
//! logs, gRPC calls dispatched, ticks asked for) is recorded there for the
//! test to read. A trap — a panic in the filter, a host call the host does not
//! serve, a runaway loop (fuel) — fails the call that caused it.
//!
//! One compile per process (about a second), a fresh instance per
//! [`FilterVm`]: a scenario takes milliseconds.

pub mod host;
pub mod wire;

use std::path::PathBuf;
use std::rc::Rc;
use std::sync::OnceLock;
use std::time::Duration;

use wasmtime::{Config, Engine, Error, Instance, Linker, Module, OptLevel, Result, Store};

pub use host::{
    GrpcCall, HostState, LocalReply, LogLevel, Metric, MetricKind, SharedData, SharedDataHandle,
    StreamData,
};

/// Instructions one callback may run before it traps (a runaway loop fails
/// the test instead of hanging it); a request takes well under a million.
const FUEL_PER_CALL: u64 = 2_000_000_000;

/// The filter as `scripts/build-wasm latchkey-filter` writes it (the path the
/// e2e tests use, `tests/src/envoy.rs`), or the module named by
/// `$LATCHKEY_FILTER_WASM` (to run these scenarios against another build).
pub fn filter_wasm() -> Result<PathBuf> {
    let path = std::env::var_os("LATCHKEY_FILTER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/wasm/latchkey_filter.wasm"));
    if !path.is_file() {
        return Err(Error::msg(format!(
            "{} is missing: run `scripts/build-wasm latchkey-filter` (scripts/test does) before these tests",
            path.display()
        )));
    }
    Ok(path)
}

fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(|filter| filter.parent())
        .map(PathBuf::from)
        .unwrap_or(manifest)
}

/// The engine and the compiled filter, once per process.
fn compiled() -> Result<&'static (Engine, Module)> {
    static COMPILED: OnceLock<std::result::Result<(Engine, Module), String>> = OnceLock::new();
    COMPILED
        .get_or_init(|| {
            let path = filter_wasm().map_err(|e| e.to_string())?;
            let mut config = Config::new();
            // The module is compiled once per test process: compile fast.
            config
                .consume_fuel(true)
                .cranelift_opt_level(OptLevel::None);
            let engine = Engine::new(&config).map_err(|e| format!("{e:?}"))?;
            let module = Module::from_file(&engine, &path)
                .map_err(|e| format!("{}: {e:?}", path.display()))?;
            Ok((engine, module))
        })
        .as_ref()
        .map_err(|e| Error::msg(e.clone()))
}

/// The built module's imports, as `module::name`.
pub fn module_imports() -> Result<Vec<String>> {
    let (_, module) = compiled()?;
    Ok(module
        .imports()
        .map(|i| format!("{}::{}", i.module(), i.name()))
        .collect())
}

/// The built module's exports.
pub fn module_exports() -> Result<Vec<String>> {
    let (_, module) = compiled()?;
    Ok(module.exports().map(|e| e.name().to_owned()).collect())
}

/// What a callback returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// `StopIteration` (headers, trailers) or `StopIterationAndBuffer` (body).
    Pause,
    Other(i32),
}

impl Action {
    fn of(v: i32) -> Action {
        match v {
            0 => Action::Continue,
            1 => Action::Pause,
            other => Action::Other(other),
        }
    }
}

/// One instance of the filter (one VM: an Envoy worker's), with its root
/// context.
pub struct FilterVm {
    store: Store<HostState>,
    instance: Instance,
    root: u32,
    next_context: u32,
    /// Streams whose last body callback returned Continue: Envoy passed that
    /// data on, so the next callback sees only what came after it.
    body_passed: std::collections::BTreeSet<u32>,
}

impl FilterVm {
    /// A VM with shared data of its own.
    pub fn new() -> Result<Self> {
        Self::with_shared_data(Rc::default())
    }

    /// A VM that shares `shared` with others (the workers of one Envoy, or a
    /// VM an ECDS update swaps in: same `vm_id`, same shared data).
    pub fn with_shared_data(shared: SharedDataHandle) -> Result<Self> {
        let (engine, module) = compiled()?;
        let mut linker = Linker::new(engine);
        host::link(&mut linker, module)?;
        let mut store = Store::new(engine, HostState::new(shared));
        store.set_fuel(FUEL_PER_CALL)?;
        let instance = linker.instantiate(&mut store, module)?;
        let mut vm = Self {
            store,
            instance,
            root: 1,
            next_context: 2,
            body_passed: Default::default(),
        };
        vm.call::<(), ()>(0, "_initialize", ())?;
        Ok(vm)
    }

    /// Creates the root context, starts the VM and configures it with
    /// `plugin_configuration`; the configure's answer.
    pub fn start(&mut self, plugin_configuration: &[u8]) -> Result<bool> {
        let root = self.root;
        self.call::<(i32, i32), ()>(root, "proxy_on_context_create", (ctx(root), 0))?;
        if self.call::<(i32, i32), i32>(root, "proxy_on_vm_start", (ctx(root), 0))? == 0 {
            return Err(Error::msg("proxy_on_vm_start returned false"));
        }
        self.configure(plugin_configuration)
    }

    /// `proxy_on_configure` with a new plugin configuration.
    pub fn configure(&mut self, plugin_configuration: &[u8]) -> Result<bool> {
        let root = self.root;
        self.store.data_mut().plugin_configuration = plugin_configuration.to_vec();
        let size = len(plugin_configuration.len())?;
        Ok(self.call::<(i32, i32), i32>(root, "proxy_on_configure", (ctx(root), size))? != 0)
    }

    /// The timer fires.
    pub fn tick(&mut self) -> Result<()> {
        let root = self.root;
        self.call::<i32, ()>(root, "proxy_on_tick", ctx(root))
    }

    /// A dispatched gRPC call answers `message` (status OK).
    pub fn grpc_receive(&mut self, token: u32, message: &[u8]) -> Result<()> {
        let root = self.root;
        self.store.data_mut().grpc_receive_buffer = message.to_vec();
        let size = len(message.len())?;
        self.call::<(i32, i32, i32), ()>(
            root,
            "proxy_on_grpc_receive",
            (ctx(root), ctx(token), size),
        )
    }

    /// A dispatched gRPC call fails with `status`.
    pub fn grpc_close(&mut self, token: u32, status: u32, message: Option<&str>) -> Result<()> {
        let root = self.root;
        self.store.data_mut().grpc_status = (status, message.map(str::to_owned));
        self.call::<(i32, i32, i32), ()>(
            root,
            "proxy_on_grpc_close",
            (ctx(root), ctx(token), ctx(status)),
        )
    }

    /// A new stream from a peer whose certificate has URI SAN `peer_san`
    /// (`None`: no client certificate), with `headers`; its context id.
    pub fn open(&mut self, peer_san: Option<&str>, headers: &[(&str, &[u8])]) -> Result<u32> {
        let id = self.next_context;
        self.next_context += 1;
        let mut stream = StreamData::default();
        if let Some(san) = peer_san {
            stream.properties.insert(
                "connection.uri_san_peer_certificate".into(),
                san.as_bytes().to_vec(),
            );
        }
        stream.request_headers = headers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
            .collect();
        self.store.data_mut().streams.insert(id, stream);
        let root = self.root;
        self.call::<(i32, i32), ()>(id, "proxy_on_context_create", (ctx(id), ctx(root)))?;
        Ok(id)
    }

    pub fn request_headers(&mut self, id: u32, end_of_stream: bool) -> Result<Action> {
        let count = len(self.stream(id)?.request_headers.len())?;
        let action = self.call::<(i32, i32, i32), i32>(
            id,
            "proxy_on_request_headers",
            (ctx(id), count, i32::from(end_of_stream)),
        )?;
        Ok(Action::of(action))
    }

    /// A body chunk arrives; the callback sees everything buffered so far.
    pub fn request_body(&mut self, id: u32, chunk: &[u8], end_of_stream: bool) -> Result<Action> {
        let passed = self.body_passed.remove(&id);
        let stream = self.stream_mut(id)?;
        if passed {
            stream.request_body.clear();
        }
        stream.request_body.extend_from_slice(chunk);
        let size = len(stream.request_body.len())?;
        let action = Action::of(self.call::<(i32, i32, i32), i32>(
            id,
            "proxy_on_request_body",
            (ctx(id), size, i32::from(end_of_stream)),
        )?);
        if action == Action::Continue {
            self.body_passed.insert(id);
        }
        Ok(action)
    }

    pub fn request_trailers(&mut self, id: u32, trailers: &[(&str, &[u8])]) -> Result<Action> {
        self.stream_mut(id)?.request_trailers = trailers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
            .collect();
        let count = len(trailers.len())?;
        let action =
            self.call::<(i32, i32), i32>(id, "proxy_on_request_trailers", (ctx(id), count))?;
        Ok(Action::of(action))
    }

    /// The upstream's response headers arrive.
    pub fn response_headers(&mut self, id: u32) -> Result<Action> {
        let action =
            self.call::<(i32, i32, i32), i32>(id, "proxy_on_response_headers", (ctx(id), 0, 0))?;
        Ok(Action::of(action))
    }

    /// The stream ends (answered, reset or timed out): `proxy_on_done`,
    /// `proxy_on_log`, `proxy_on_delete`. What the host recorded for it stays
    /// readable.
    pub fn end(&mut self, id: u32) -> Result<()> {
        self.call::<i32, i32>(id, "proxy_on_done", ctx(id))?;
        self.call::<i32, ()>(id, "proxy_on_log", ctx(id))?;
        self.call::<i32, ()>(id, "proxy_on_delete", ctx(id))
    }

    /// Moves the host clock on.
    pub fn advance(&mut self, by: Duration) {
        self.store.data_mut().now += by;
    }

    pub fn host(&self) -> &HostState {
        self.store.data()
    }

    pub fn host_mut(&mut self) -> &mut HostState {
        self.store.data_mut()
    }

    pub fn stream(&self, id: u32) -> Result<&StreamData> {
        self.host()
            .streams
            .get(&id)
            .ok_or_else(|| Error::msg(format!("no stream {id}")))
    }

    fn stream_mut(&mut self, id: u32) -> Result<&mut StreamData> {
        self.host_mut()
            .streams
            .get_mut(&id)
            .ok_or_else(|| Error::msg(format!("no stream {id}")))
    }

    /// A counter's or gauge's value; `None` if the module never defined it.
    pub fn stat(&self, name: &str) -> Option<i64> {
        self.host().metric(name).map(|m| m.value)
    }

    /// Log lines at `level` or above.
    pub fn logs_at_least(&self, level: LogLevel) -> Vec<&str> {
        self.host()
            .logs
            .iter()
            .filter(|(l, _)| *l >= level)
            .map(|(_, m)| m.as_str())
            .collect()
    }

    fn call<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &mut self,
        context: u32,
        export: &str,
        params: P,
    ) -> Result<R> {
        self.store.data_mut().current = context;
        self.store.set_fuel(FUEL_PER_CALL)?;
        let func = self
            .instance
            .get_typed_func::<P, R>(&mut self.store, export)?;
        func.call(&mut self.store, params).map_err(|e| {
            // A panic logs at Critical (the SDK's panic hook) before it traps.
            let said = self.logs_at_least(LogLevel::Critical).join("; ");
            Error::msg(format!(
                "{export} on context {context} trapped: {e:?} {said}"
            ))
        })
    }
}

/// With `$LATCHKEY_ABI_TRACE_DIR` set, every VM writes its host calls
/// ([`HostState::calls`]) to `<dir>/<test name>.<n>.trace` when dropped: run
/// the tier against two builds and diff the directories to see whether a
/// change to the filter changed anything it asks of the host.
impl Drop for FilterVm {
    fn drop(&mut self) {
        static VMS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let Some(dir) = std::env::var_os("LATCHKEY_ABI_TRACE_DIR") else {
            return;
        };
        let n = VMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let test = std::thread::current()
            .name()
            .unwrap_or("vm")
            .replace("::", ".");
        let path = PathBuf::from(dir).join(format!("{test}.{n}.trace"));
        let mut calls = self.host().calls.join("\n");
        calls.push('\n');
        // A test helper: a trace that cannot be written is only a lost trace.
        let _ = std::fs::write(path, calls);
    }
}

/// A context id, token or size as the ABI's i32.
fn ctx(v: u32) -> i32 {
    v as i32
}

fn len(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::msg("size does not fit in wasm32"))
}
