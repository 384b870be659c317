//! One engine for the process, one fresh store per call.
//!
//! The engine uses the pooling allocator (instantiation reuses pre-reserved
//! slots instead of mapping memory per call) and epoch interruption: a
//! ticker thread advances the epoch every `tick` while at least one store is
//! alive ([`Ticker`]), and a running call, at every tick, checks its own
//! wall-clock deadline and traps once it has passed, or else yields to its
//! async caller. Calls are async (wasmtime runs the guest on a fiber): the
//! arbiter awaits a call on its own worker, which a call that runs past a
//! tick gives back at every tick; [`block_on`] runs one to completion on the
//! current thread for callers off the request path. Memory and tables are
//! capped per call by [`CallLimiter`], which also remembers that a growth was
//! refused, so the trap that follows is reported as out-of-memory rather than
//! a bare trap.

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use latchkey_hook_abi::{
    EXPORT_ALLOC, EXPORT_MEMORY, HookResponse, IMPORT_LOG, IMPORT_MODULE, OutputLimits, Verdict,
    unpack,
};
use latchkey_policies::{MAX_HOOK_MEMORY_MIB, MAX_HOOK_TABLE_ELEMENTS};
use tracing::{debug, error, info, warn};
use wasmtime::{
    Caller, Config, Enabled, Engine, InstanceAllocationStrategy, InstancePre, Linker, Memory,
    ModuleExport, OptLevel, PoolingAllocationConfig, ResourceLimiter, Store, Trap, UpdateDeadline,
};

/// Why a call produced no usable answer. Every kind denies the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailureKind {
    /// The class has a hook but no module loaded (never loaded successfully).
    NotLoaded,
    /// The pool or the store refused to instantiate the module.
    Instantiate,
    /// The deadline passed.
    Timeout,
    /// A memory growth beyond the cap was refused.
    OutOfMemory,
    /// Any other trap (a guest panic, unreachable, bad memory access).
    Trap,
    /// The answer was too large, out of bounds, not JSON or broke the ABI.
    MalformedOutput,
    /// The host itself failed around the call (the thread running it
    /// panicked or was cancelled): the hook did not decide.
    Internal,
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::NotLoaded => "not_loaded",
            FailureKind::Instantiate => "instantiate",
            FailureKind::Timeout => "timeout",
            FailureKind::OutOfMemory => "out_of_memory",
            FailureKind::Trap => "trap",
            FailureKind::MalformedOutput => "malformed_output",
            FailureKind::Internal => "internal",
        }
    }

    /// The reason code the caller sees.
    pub fn reason(self) -> &'static str {
        match self {
            FailureKind::NotLoaded => "HOOK_NOT_LOADED",
            FailureKind::Instantiate => "HOOK_UNAVAILABLE",
            FailureKind::Timeout => "HOOK_TIMEOUT",
            FailureKind::OutOfMemory => "HOOK_OUT_OF_MEMORY",
            FailureKind::Trap => "HOOK_TRAPPED",
            FailureKind::MalformedOutput => "HOOK_BAD_OUTPUT",
            FailureKind::Internal => "HOOK_INTERNAL_ERROR",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookFailure {
    pub kind: FailureKind,
    pub detail: String,
}

impl HookFailure {
    fn new(kind: FailureKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
        }
    }
}

/// Per-call limits, resolved from the class's hook table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallLimits {
    pub deadline: Duration,
    pub memory_bytes: usize,
    pub table_elements: usize,
    pub max_output_bytes: usize,
}

/// Bytes a hook may log per call, and per line.
const LOG_BUDGET_BYTES: usize = 2048;
const LOG_LINE_BYTES: usize = 512;

pub(crate) struct CallState {
    limiter: CallLimiter,
    class: Arc<str>,
    log_budget: usize,
    /// When the store was made: the deadline counts from here, so it covers
    /// instantiation as well as the call.
    started: Instant,
    deadline: Duration,
    /// Keeps the ticker running for as long as this store lives (by its
    /// `Drop`; never read).
    _active: Active,
}

struct CallLimiter {
    memory_bytes: usize,
    table_elements: usize,
    memory_refused: bool,
}

impl ResourceLimiter for CallLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            self.memory_refused = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= self.table_elements)
    }

    fn instances(&self) -> usize {
        1
    }

    fn tables(&self) -> usize {
        2
    }

    fn memories(&self) -> usize {
        1
    }
}

/// The engine, the linker with the one import, and the epoch ticker.
pub(crate) struct Runtime {
    pub engine: Engine,
    pub linker: Linker<CallState>,
    ticker: Arc<Ticker>,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.ticker.stop.store(true, Ordering::SeqCst);
        self.ticker.wake();
    }
}

/// Coarsest tick: a bound on how late any deadline is enforced, whatever the
/// classes ask for.
pub(crate) const MAX_TICK: Duration = Duration::from_millis(100);

/// The epoch ticker's shared state.
///
/// A tick is only a moment at which running stores look at the clock, so it
/// need be no finer than the deadlines it enforces ([`Runtime::set_tick`]),
/// and it is not needed at all while no store is alive: the thread parks when
/// the last [`Active`] drops and the next one unparks it. A busy arbiter pays
/// one atomic increment per call; an idle one, nothing.
struct Ticker {
    /// Stores alive now (instantiating, running, or being read out).
    active: AtomicUsize,
    tick_ns: AtomicU64,
    stop: AtomicBool,
    thread: OnceLock<Thread>,
    /// Epoch increments so far: shows the ticker rests when nothing runs.
    ticks: AtomicU64,
}

impl Ticker {
    fn tick(&self) -> Duration {
        Duration::from_nanos(self.tick_ns.load(Ordering::Relaxed).max(1))
    }

    fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Registers a live store; the first one wakes the ticker.
    fn enter(self: &Arc<Self>) -> Active {
        // SeqCst pairs with the ticker's load before it parks: either it sees
        // this store, or this unpark comes after that load and wakes it.
        if self.active.fetch_add(1, Ordering::SeqCst) == 0 {
            self.wake();
        }
        Active(self.clone())
    }

    fn run(&self, engine: &wasmtime::EngineWeak) {
        while !self.stop.load(Ordering::SeqCst) {
            if self.active.load(Ordering::SeqCst) == 0 {
                // Spurious or stale wake-ups just go round the loop again.
                std::thread::park();
                continue;
            }
            std::thread::sleep(self.tick());
            match engine.upgrade() {
                Some(e) => e.increment_epoch(),
                None => return,
            }
            self.ticks.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One live store's hold on the ticker.
pub(crate) struct Active(Arc<Ticker>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

const MIB: usize = 1 << 20;

/// With `PAGEMAP_SCAN`, the most memory per pool slot that is reset by copy
/// and stays resident (written pages only); beyond it pages are given back
/// with `madvise`. A Rust hook writes a few dozen pages per call.
const KEEP_RESIDENT_PAGEMAP: usize = MIB;

impl Runtime {
    /// `tick` is the starting tick; [`Runtime::set_tick`] changes it.
    pub fn new(tick: Duration, pool_slots: u32) -> Result<Self, wasmtime::Error> {
        let mut pool = PoolingAllocationConfig::default();
        pool.total_core_instances(pool_slots)
            .total_memories(pool_slots)
            .total_tables(pool_slots)
            .total_stacks(pool_slots)
            .max_memories_per_module(1)
            .max_tables_per_module(2)
            .max_memory_size(MAX_HOOK_MEMORY_MIB as usize * MIB)
            .table_elements(MAX_HOOK_TABLE_ELEMENTS as usize);
        if PoolingAllocationConfig::is_pagemap_scan_available() {
            // Linux >= 6.7: when a store is dropped, the kernel reports
            // which pages of its memory the call wrote, and only those are
            // put back (copied from the module's initial image, or zeroed)
            // and stay mapped; untouched pages are left alone. The next call
            // in the slot then takes no page faults and no `madvise`
            // (measured: 8-13 us of a ~25 us Rust hook call). The memory's
            // contents after the reset are the module's initial ones either
            // way: nothing of one call is visible to the next.
            // A table of one page (a Rust hook's: a few dozen functions) is
            // cheaper to zero than to scan, and wasmtime zeroes a table that
            // small when it may keep no more than a page of it.
            pool.pagemap_scan(Enabled::Yes)
                .linear_memory_keep_resident(KEEP_RESIDENT_PAGEMAP)
                .table_keep_resident(4096);
        } else {
            // Reset small memories by memset rather than madvise: cheaper
            // per call for hooks that touch a few pages.
            pool.linear_memory_keep_resident(64 * 1024)
                .table_keep_resident(64 * 1024);
        }
        let mut config = Config::new();
        config
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
            .epoch_interruption(true)
            .cranelift_opt_level(OptLevel::Speed);
        let engine = Engine::new(&config)?;
        let mut linker = Linker::new(&engine);
        linker.func_wrap(IMPORT_MODULE, IMPORT_LOG, guest_log)?;

        let ticker = Arc::new(Ticker {
            active: AtomicUsize::new(0),
            tick_ns: AtomicU64::new(nanos(tick)),
            stop: AtomicBool::new(false),
            thread: OnceLock::new(),
            ticks: AtomicU64::new(0),
        });
        let weak = engine.weak();
        let shared = ticker.clone();
        let handle = std::thread::Builder::new()
            .name("hook-epoch".into())
            .spawn(move || shared.run(&weak))
            .map_err(|e| wasmtime::Error::msg(format!("cannot start the epoch ticker: {e}")))?;
        let _ = ticker.thread.set(handle.thread().clone());
        Ok(Self {
            engine,
            linker,
            ticker,
        })
    }

    /// Sets the tick: a running store looks at its deadline once per tick,
    /// so a call is stopped between its deadline and one tick later. Safe to
    /// change while calls run: each store measures its own deadline in
    /// wall-clock time, the tick only says how often it looks.
    pub fn set_tick(&self, tick: Duration) {
        self.ticker.tick_ns.store(nanos(tick), Ordering::Relaxed);
    }

    pub fn tick(&self) -> Duration {
        self.ticker.tick()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// The store's epoch deadline came (once per tick): stop the call if its
/// wall-clock deadline has passed, else yield to the caller's executor and
/// look again at the next tick. A call never holds its thread for more than
/// a tick at a time, so an async worker running it goes on serving its other
/// tasks around a slow hook.
fn on_epoch(state: &CallState) -> UpdateDeadline {
    if state.started.elapsed() >= state.deadline {
        return UpdateDeadline::Interrupt;
    }
    UpdateDeadline::Yield(1)
}

/// Runs `fut` to completion on this thread: for a hook call off the request
/// path (the load-time checks, after-release calls, synchronous callers).
/// A hook call only waits on its own yields, which wake it at once.
pub(crate) fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// The exports a loaded module is called through, looked up once.
pub(crate) struct Exports {
    pub memory: ModuleExport,
    pub alloc: ModuleExport,
    pub before_grant: ModuleExport,
    pub after_release: Option<ModuleExport>,
}

fn guest_log(mut caller: Caller<'_, CallState>, level: i32, ptr: u32, len: u32) {
    let Some(wasmtime::Extern::Memory(memory)) = caller.get_export(EXPORT_MEMORY) else {
        return;
    };
    let len = (len as usize)
        .min(LOG_LINE_BYTES)
        .min(caller.data().log_budget);
    if len == 0 {
        return;
    }
    let mut buf = vec![0u8; len];
    if memory.read(&caller, ptr as usize, &mut buf).is_err() {
        return;
    }
    caller.data_mut().log_budget -= len;
    let line = String::from_utf8_lossy(&buf);
    let class = &*caller.data().class;
    match level {
        0 => error!(class, hook_log = %line, "hook"),
        1 => warn!(class, hook_log = %line, "hook"),
        2 => info!(class, hook_log = %line, "hook"),
        _ => debug!(class, hook_log = %line, "hook"),
    }
}

pub(crate) fn trial_store(rt: &Runtime, class: &Arc<str>, limits: &CallLimits) -> Store<CallState> {
    let active = rt.ticker.enter();
    let mut store = Store::new(
        &rt.engine,
        CallState {
            limiter: CallLimiter {
                memory_bytes: limits.memory_bytes,
                table_elements: limits.table_elements,
                memory_refused: false,
            },
            class: class.clone(),
            log_budget: LOG_BUDGET_BYTES,
            started: Instant::now(),
            deadline: limits.deadline,
            _active: active,
        },
    );
    store.limiter(|s| &mut s.limiter);
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(|ctx| Ok(on_epoch(ctx.data())));
    store
}

fn classify(store: &Store<CallState>, e: &wasmtime::Error, limits: &CallLimits) -> HookFailure {
    if let Some(Trap::Interrupt) = e.downcast_ref::<Trap>() {
        return HookFailure::new(
            FailureKind::Timeout,
            format!(
                "the hook ran past its {:?} deadline and was stopped",
                limits.deadline
            ),
        );
    }
    if store.data().limiter.memory_refused {
        return HookFailure::new(
            FailureKind::OutOfMemory,
            format!(
                "the hook tried to grow its memory past its {} MiB cap",
                limits.memory_bytes / MIB
            ),
        );
    }
    match e.downcast_ref::<Trap>() {
        Some(trap) => HookFailure::new(FailureKind::Trap, format!("the hook trapped: {trap}")),
        None => HookFailure::new(FailureKind::Trap, format!("the hook failed: {e}")),
    }
}

fn memory_of(
    store: &mut Store<CallState>,
    instance: &wasmtime::Instance,
    exports: &Exports,
) -> Result<Memory, HookFailure> {
    match instance.get_module_export(&mut *store, &exports.memory) {
        Some(wasmtime::Extern::Memory(m)) => Ok(m),
        _ => Err(HookFailure::new(
            FailureKind::Instantiate,
            "the hook exports no memory",
        )),
    }
}

fn func<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
    store: &mut Store<CallState>,
    instance: &wasmtime::Instance,
    export: &ModuleExport,
    name: &str,
) -> Result<wasmtime::TypedFunc<P, R>, HookFailure> {
    match instance.get_module_export(&mut *store, export) {
        Some(wasmtime::Extern::Func(f)) => f
            .typed::<P, R>(&*store)
            .map_err(|e| HookFailure::new(FailureKind::Instantiate, format!("{name}: {e}"))),
        _ => Err(HookFailure::new(
            FailureKind::Instantiate,
            format!("{name} is missing"),
        )),
    }
}

/// What one call runs: a loaded module of a class, under its limits.
pub(crate) struct Callee<'a> {
    pub rt: &'a Runtime,
    pub pre: &'a InstancePre<CallState>,
    pub exports: &'a Exports,
    pub class: &'a Arc<str>,
    pub limits: &'a CallLimits,
}

/// Instantiates, copies `input` in, calls `export` and returns its packed
/// answer pointer (0 when the export returns nothing), with the store.
async fn invoke(
    callee: &Callee<'_>,
    export: &ModuleExport,
    input: &[u8],
    returns: bool,
) -> Result<(Store<CallState>, Memory, u64), HookFailure> {
    let Callee {
        rt,
        pre,
        exports,
        class,
        limits,
    } = *callee;
    let mut store = trial_store(rt, class, limits);
    let instance = match pre.instantiate_async(&mut store).await {
        Ok(i) => i,
        Err(e) if store.data().limiter.memory_refused => {
            return Err(HookFailure::new(
                FailureKind::OutOfMemory,
                format!("the hook needs more memory than its cap at start: {e}"),
            ));
        }
        Err(e) => {
            return Err(HookFailure::new(
                FailureKind::Instantiate,
                format!("cannot instantiate the hook: {e}"),
            ));
        }
    };
    let memory = memory_of(&mut store, &instance, exports)?;
    let alloc = func::<u32, u32>(&mut store, &instance, &exports.alloc, EXPORT_ALLOC)?;
    let len = u32::try_from(input.len())
        .map_err(|_| HookFailure::new(FailureKind::Instantiate, "input too large"))?;
    let ptr = alloc
        .call_async(&mut store, len)
        .await
        .map_err(|e| classify(&store, &e, limits))?;
    if ptr == 0 {
        return Err(HookFailure::new(
            FailureKind::OutOfMemory,
            "the hook could not allocate its input buffer",
        ));
    }
    memory.write(&mut store, ptr as usize, input).map_err(|_| {
        HookFailure::new(
            FailureKind::MalformedOutput,
            "latchkey_alloc returned a buffer outside the hook's memory",
        )
    })?;
    let packed = if returns {
        let f = func::<(u32, u32), u64>(&mut store, &instance, export, "export")?;
        f.call_async(&mut store, (ptr, len))
            .await
            .map_err(|e| classify(&store, &e, limits))?
    } else {
        let f = func::<(u32, u32), ()>(&mut store, &instance, export, "export")?;
        f.call_async(&mut store, (ptr, len))
            .await
            .map_err(|e| classify(&store, &e, limits))?;
        0
    };
    Ok((store, memory, packed))
}

/// One before-grant call: a fresh store, the request in, the answer checked.
pub(crate) async fn before_grant(
    callee: &Callee<'_>,
    input: &[u8],
) -> Result<Verdict, HookFailure> {
    let limits = callee.limits;
    let (store, memory, packed) = invoke(callee, &callee.exports.before_grant, input, true).await?;
    let (out_ptr, out_len) = unpack(packed);
    let out_len = out_len as usize;
    if out_len > limits.max_output_bytes {
        return Err(HookFailure::new(
            FailureKind::MalformedOutput,
            format!(
                "the answer is {out_len} bytes, more than the class's cap of {}",
                limits.max_output_bytes
            ),
        ));
    }
    let out = memory
        .data(&store)
        .get(out_ptr as usize..(out_ptr as usize).saturating_add(out_len))
        .ok_or_else(|| {
            HookFailure::new(
                FailureKind::MalformedOutput,
                "the answer points outside the hook's memory",
            )
        })?;
    let response: HookResponse = serde_json::from_slice(out).map_err(|e| {
        HookFailure::new(
            FailureKind::MalformedOutput,
            format!("the answer is not an ABI v1 response: {e}"),
        )
    })?;
    response.verdict(&OutputLimits::default()).map_err(|e| {
        HookFailure::new(
            FailureKind::MalformedOutput,
            format!("the answer is refused: {e}"),
        )
    })
}

/// One after-release call; its result only feeds the metrics.
pub(crate) async fn after_release(
    callee: &Callee<'_>,
    export: &ModuleExport,
    input: &[u8],
) -> Result<(), HookFailure> {
    invoke(callee, export, input, false).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(deadline: Duration) -> CallLimits {
        CallLimits {
            deadline,
            memory_bytes: MIB,
            table_elements: 16,
            max_output_bytes: 1024,
        }
    }

    #[test]
    fn the_ticker_runs_only_while_a_store_is_alive() {
        let rt = Runtime::new(Duration::from_millis(1), 2).unwrap();
        let ticks = || rt.ticker.ticks.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(ticks(), 0, "ticked with nothing running");

        let class: Arc<str> = Arc::from("c");
        let store = trial_store(&rt, &class, &limits(Duration::from_millis(10)));
        assert_eq!(rt.ticker.active.load(Ordering::SeqCst), 1);
        std::thread::sleep(Duration::from_millis(30));
        let while_alive = ticks();
        assert!(while_alive >= 5, "{while_alive} ticks in 30 ms at 1 ms");

        drop(store);
        assert_eq!(rt.ticker.active.load(Ordering::SeqCst), 0);
        // One tick may still be under way when the store drops.
        std::thread::sleep(Duration::from_millis(5));
        let parked = ticks();
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            ticks() <= parked + 1,
            "{} ticks after the last store",
            ticks() - parked
        );
    }

    #[test]
    fn the_deadline_is_wall_clock_whatever_the_tick() {
        let rt = Runtime::new(Duration::from_millis(2), 2).unwrap();
        let class: Arc<str> = Arc::from("c");
        let store = trial_store(&rt, &class, &limits(Duration::from_millis(50)));
        // Early: give the thread back and look again at the next tick,
        // however fine or coarse the tick is.
        assert!(matches!(on_epoch(store.data()), UpdateDeadline::Yield(1)));
        rt.set_tick(Duration::from_micros(200));
        assert!(matches!(on_epoch(store.data()), UpdateDeadline::Yield(1)));
        let late = trial_store(&rt, &class, &limits(Duration::ZERO));
        assert!(matches!(on_epoch(late.data()), UpdateDeadline::Interrupt));
    }

    #[test]
    fn block_on_runs_a_future_that_yields() {
        struct YieldTwice(u8);
        impl Future for YieldTwice {
            type Output = u8;
            fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u8> {
                if self.0 == 2 {
                    return Poll::Ready(self.0);
                }
                self.0 += 1;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
        assert_eq!(block_on(YieldTwice(0)), 2);
    }
}
