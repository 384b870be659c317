//! The per-class registry: which module serves which class, how it is
//! (re)loaded off the request path, and how a call's result becomes the
//! arbiter's decision.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use std::time::{Duration, Instant, UNIX_EPOCH};

use latchkey_hook_abi::{
    ABI_VERSION, DenyCode, EXPORT_ABI_VERSION, EXPORT_AFTER_RELEASE, EXPORT_ALLOC,
    EXPORT_BEFORE_GRANT, EXPORT_FREE, EXPORT_MEMORY, HookMode, HookRequest, ReleaseNotice, Verdict,
};
use latchkey_policies::{ClassHook, PolicySet};
use tracing::{debug, info, warn};
use wasmtime::{ExternType, InstancePre, Module, Store, ValType};

use crate::cache::{self, Source};
use crate::call::{
    self, CallLimits, CallState, Callee, Exports, FailureKind, HookFailure, MAX_TICK, Runtime,
};
use crate::metrics::{Metrics, Recorded};

/// The deny reason by which a hook says its class's config is invalid
/// (policies/HOOKS.md); the host checks each new module and config with one
/// trial call and refuses a pair answered with it.
pub const MISCONFIGURED: &str = "HOOK_MISCONFIGURED";
/// Who and what the config check's trial call asks about.
pub const CONFIG_CHECK_IDENTITY: &str = "spiffe://latchkey.invalid/config-check";
pub const CONFIG_CHECK_KEY: &str = "latchkey-config-check";

const MIB: usize = 1 << 20;
/// The least time a module's load-time trial call (its ABI version) gets,
/// whatever the class's per-call deadline.
const TRIAL_DEADLINE: Duration = Duration::from_secs(1);

/// How the host runs.
#[derive(Debug, Clone)]
pub struct HostSettings {
    /// Compiled modules are cached here (by content hash). `None`: no cache.
    pub cache_dir: Option<PathBuf>,
    /// The finest epoch tick. The tick in force is a tenth of the smallest
    /// deadline among the hooked classes (so a call is stopped at most 10%
    /// late), never finer than this and never coarser than 100 ms; the
    /// ticker only runs while a call is in flight.
    pub min_epoch_tick: Duration,
    /// Instances that may run at once (pooling allocator slots).
    pub pool_slots: u32,
}

impl Default for HostSettings {
    fn default() -> Self {
        Self {
            cache_dir: None,
            // The fixed tick this host used to run at all the time: a 1 ms
            // deadline is then enforced to within 20%, and no class makes
            // the ticker busier than it used to be.
            min_epoch_tick: Duration::from_micros(200),
            pool_slots: 32,
        }
    }
}

/// What the arbiter does with a call's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookOutcome {
    Allow {
        annotations: BTreeMap<String, String>,
    },
    Deny {
        code: DenyCode,
        reason: String,
        message: String,
        /// Set when the hook did not decide: it failed and the host denied.
        failure: Option<FailureKind>,
    },
}

/// A module refused at load: the class keeps its previous module (if any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub class: String,
    pub module: PathBuf,
    pub reason: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "hook for class \"{}\" refused ({}): {}",
            self.class,
            self.module.display(),
            self.reason
        )
    }
}

/// One class's loaded hook.
struct Loaded {
    spec: ClassHook,
    path: PathBuf,
    digest: String,
    /// Size and mtime when last read, to skip hashing unchanged files.
    stamp: (u64, u128),
    pre: InstancePre<CallState>,
    exports: Exports,
    limits: CallLimits,
    config: serde_json::Value,
    /// `config` as JSON, encoded once at load and spliced into every request.
    config_json: Vec<u8>,
    class: Arc<str>,
}

impl Loaded {
    fn callee<'a>(&'a self, rt: &'a Runtime) -> Callee<'a> {
        Callee {
            rt,
            pre: &self.pre,
            exports: &self.exports,
            class: &self.class,
            limits: &self.limits,
        }
    }
}

/// A file and spec that failed to load, so it is not retried every poll.
#[derive(Clone, PartialEq)]
struct Attempt {
    spec: ClassHook,
    stamp: (u64, u128),
}

pub struct HookHost {
    settings: HostSettings,
    runtime: OnceLock<Result<Runtime, String>>,
    classes: RwLock<HashMap<String, Arc<Loaded>>>,
    refusals: RwLock<BTreeMap<String, Refusal>>,
    failed: Mutex<HashMap<String, Attempt>>,
    /// The last refusal logged per class, as (module file state, reason): a
    /// refusal is news once, and again only when the file or the reason changes.
    reported: Mutex<HashMap<String, ReportedRefusal>>,
    /// key -> class for holds whose class's module wants after-release calls.
    held: Mutex<HashMap<String, String>>,
    metrics: Metrics,
}

/// A refusal as logged: the module file's (size, mtime) if readable, and the reason.
type ReportedRefusal = (Option<(u64, u128)>, String);

/// Most keys tracked for after-release calls.
const MAX_TRACKED_HOLDS: usize = 65_536;

impl HookHost {
    pub fn new(settings: HostSettings) -> Self {
        Self {
            settings,
            runtime: OnceLock::new(),
            classes: RwLock::new(HashMap::new()),
            refusals: RwLock::new(BTreeMap::new()),
            failed: Mutex::new(HashMap::new()),
            reported: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            metrics: Metrics::default(),
        }
    }

    /// The engine is made on first use, so an arbiter without hooks pays nothing.
    fn runtime(&self) -> Result<&Runtime, String> {
        self.runtime
            .get_or_init(|| {
                Runtime::new(self.settings.min_epoch_tick, self.settings.pool_slots)
                    .map_err(|e| format!("cannot start the Wasm engine: {e}"))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Modules refused at their last load, by class.
    pub fn refusals(&self) -> BTreeMap<String, Refusal> {
        self.refusals.read().clone()
    }

    /// The content hash of the module serving `class`.
    pub fn loaded_digest(&self, class: &str) -> Option<String> {
        self.classes.read().get(class).map(|l| l.digest.clone())
    }

    /// The epoch tick the deadlines of `classes` need: a tenth of the
    /// smallest, within [`HostSettings::min_epoch_tick`] and 100 ms.
    fn tick_for<'a>(&self, classes: impl IntoIterator<Item = &'a ClassHook>) -> Duration {
        let floor = self.settings.min_epoch_tick.min(MAX_TICK);
        classes
            .into_iter()
            .map(|h| Duration::from_millis(u64::from(h.deadline_ms)) / 10)
            .min()
            .unwrap_or(MAX_TICK)
            .clamp(floor, MAX_TICK)
    }

    /// The epoch tick in force, once the engine has started.
    pub fn epoch_tick(&self) -> Option<Duration> {
        match self.runtime.get() {
            Some(Ok(rt)) => Some(rt.tick()),
            _ => None,
        }
    }

    /// Brings the loaded modules in line with `policies` (module paths
    /// relative to `base`): compiles what changed, keeps the previous module
    /// of a class whose new one is refused, drops classes that lost their
    /// hook. Blocking (Cranelift): call it off the request path. Returns the
    /// refusals made by this call.
    pub fn sync(&self, policies: &PolicySet, base: &Path) -> Vec<Refusal> {
        let mut refused = Vec::new();
        let wanted: Vec<(&String, &ClassHook)> = policies
            .classes()
            .iter()
            .filter_map(|(name, c)| c.hook.as_ref().map(|h| (name, h)))
            .collect();
        // Before loading: the trial calls run under the new deadlines too. A
        // refused class's deadline counts as well; it only makes the tick finer.
        if !wanted.is_empty()
            && let Ok(rt) = self.runtime()
        {
            rt.set_tick(self.tick_for(wanted.iter().map(|(_, h)| *h)));
        }
        for (class, spec) in &wanted {
            let path = resolve(base, &spec.module);
            match self.sync_class(class, spec, &path) {
                Ok(()) => {}
                Err(reason) => {
                    let r = Refusal {
                        class: (*class).clone(),
                        module: path,
                        reason,
                    };
                    let kept = self.loaded_digest(class).is_some();
                    self.metrics.record_refusal(class);
                    if self.is_news(class, &r.module, &r.reason) {
                        warn!(class = %r.class, module = %r.module.display(), reason = %r.reason, previous_kept = kept, "hook module refused (logged again only when the file or the reason changes)");
                    }
                    self.refusals.write().insert(r.class.clone(), r.clone());
                    refused.push(r);
                }
            }
        }
        // Classes that no longer have a hook (or no longer exist).
        // A class that loaded (or lost its hook) starts afresh: its next
        // refusal is news again.
        self.reported.lock().retain(|name, _| {
            refused.iter().any(|r| &r.class == name) || self.is_still_failed(name)
        });
        self.classes
            .write()
            .retain(|name, _| wanted.iter().any(|(c, _)| *c == name));
        self.refusals
            .write()
            .retain(|name, _| wanted.iter().any(|(c, _)| *c == name));
        refused
    }

    fn is_still_failed(&self, class: &str) -> bool {
        self.failed.lock().contains_key(class)
    }

    /// True when this refusal differs from the last one logged for `class`
    /// (another module file state or another reason); remembers it.
    fn is_news(&self, class: &str, path: &Path, reason: &str) -> bool {
        let state = (stamp(path).ok(), reason.to_string());
        let mut reported = self.reported.lock();
        if reported.get(class) == Some(&state) {
            return false;
        }
        reported.insert(class.to_string(), state);
        true
    }

    fn sync_class(&self, class: &str, spec: &ClassHook, path: &Path) -> Result<(), String> {
        let stamp = stamp(path).map_err(|e| format!("cannot read the module: {e}"))?;
        let current = self.classes.read().get(class).cloned();
        if let Some(cur) = &current
            && cur.spec == *spec
            && cur.path == path
            && cur.stamp == stamp
        {
            return Ok(());
        }
        let attempt = Attempt {
            spec: spec.clone(),
            stamp,
        };
        if self.failed.lock().get(class) == Some(&attempt) {
            // Already refused, unchanged since: keep the refusal, say nothing.
            return Ok(());
        }
        let result = self.load(class, spec, path, stamp, current.as_deref());
        match result {
            Ok(loaded) => {
                info!(class, module = %path.display(), digest = %loaded.digest, "hook loaded");
                self.classes
                    .write()
                    .insert(class.to_string(), Arc::new(loaded));
                self.refusals.write().remove(class);
                self.failed.lock().remove(class);
                Ok(())
            }
            Err(reason) => {
                self.failed.lock().insert(class.to_string(), attempt);
                Err(reason)
            }
        }
    }

    fn load(
        &self,
        class: &str,
        spec: &ClassHook,
        path: &Path,
        stamp: (u64, u128),
        current: Option<&Loaded>,
    ) -> Result<Loaded, String> {
        let rt = self.runtime()?;
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read the module: {e}"))?;
        let digest = cache::digest(&bytes);
        let limits = CallLimits {
            deadline: Duration::from_millis(u64::from(spec.deadline_ms)),
            memory_bytes: spec.memory_mib as usize * MIB,
            table_elements: spec.table_elements as usize,
            max_output_bytes: spec.max_output_bytes as usize,
        };
        let config = serde_json::to_value(&spec.config)
            .map_err(|e| format!("the hook config cannot be passed as JSON: {e}"))?;
        let config_json = serde_json::to_vec(&config)
            .map_err(|e| format!("the hook config cannot be passed as JSON: {e}"))?;
        // Same bytes, new limits or config: reuse the compiled module.
        let (module, source) = match current {
            Some(cur) if cur.digest == digest => (cur.pre.module().clone(), Source::Cache),
            _ => cache::load(
                &rt.engine,
                self.settings.cache_dir.as_deref(),
                &bytes,
                &digest,
            )
            .map_err(|e| format!("not a valid Wasm module: {e:#}"))?,
        };
        let exports = check_abi(&module, &limits)?;
        let pre = rt
            .linker
            .instantiate_pre(&module)
            .map_err(|e| format!("imports something other than latchkey.log: {e:#}"))?;
        let class: Arc<str> = Arc::from(class);
        // One trial call of the version export, under the class's memory
        // limits and at least a second: it checks what the module is, not
        // how fast it is, and a busy host that delays a trivial call past a
        // 5 ms deadline must not refuse the module (the refusal would stand
        // until the file changed, and the class would deny every Acquire).
        let trial = CallLimits {
            deadline: limits.deadline.max(TRIAL_DEADLINE),
            ..limits
        };
        let mut store: Store<CallState> = call_store(rt, &class, &trial);
        let instance = pre
            .instantiate(&mut store)
            .map_err(|e| format!("cannot be instantiated within its limits: {e:#}"))?;
        let version = call::block_on(async {
            instance
                .get_typed_func::<(), i32>(&mut store, EXPORT_ABI_VERSION)?
                .call_async(&mut store, ())
                .await
        })
        .map_err(|e| format!("{EXPORT_ABI_VERSION} failed: {e:#}"))?;
        if u32::try_from(version).ok() != Some(ABI_VERSION) {
            return Err(format!(
                "speaks hook ABI version {version}; this arbiter speaks version {ABI_VERSION}"
            ));
        }
        debug!(class = %class, ?source, "hook module ready");
        let loaded = Loaded {
            spec: spec.clone(),
            path: path.to_path_buf(),
            digest,
            stamp,
            pre,
            exports,
            limits,
            config,
            config_json,
            class,
        };
        self.check_config(rt, &loaded)?;
        Ok(loaded)
    }

    /// One trial `before_grant` with a made-up request: a module that
    /// answers [`MISCONFIGURED`] does not accept the class's config, so the
    /// pair is refused and the previous one stays in service. (A module
    /// rebuilt under an unchanged config, or written before its new class
    /// file, would otherwise fail every request until the config caught up.)
    /// Any other answer, trap or timeout says nothing about the config.
    fn check_config(&self, rt: &Runtime, loaded: &Loaded) -> Result<(), String> {
        let request = HookRequest {
            version: ABI_VERSION,
            class: loaded.class.to_string(),
            identity: CONFIG_CHECK_IDENTITY.to_string(),
            key: CONFIG_CHECK_KEY.to_string(),
            session: 0,
            metadata: BTreeMap::new(),
            holder: None,
            waiters: 0,
            now_unix_ms: now_unix_ms(),
            now_monotonic_ns: monotonic_ns(),
            hold_count: loaded
                .spec
                .needs(latchkey_policies::HookInputKind::HoldCount)
                .then_some(0),
            mode: loaded
                .spec
                .needs(latchkey_policies::HookInputKind::Mode)
                .then_some(HookMode::Exclusive),
            permits: None,
            config: loaded.config.clone(),
        };
        let Ok(input) = serde_json::to_vec(&request) else {
            return Ok(());
        };
        match call::block_on(call::before_grant(&loaded.callee(rt), &input)) {
            Ok(Verdict::Deny {
                reason, message, ..
            }) if reason == MISCONFIGURED => Err(format!(
                "does not accept the class's hook config (a trial call answered {MISCONFIGURED}: {message})"
            )),
            Ok(_) => Ok(()),
            Err(f) => {
                debug!(class = %loaded.class, kind = %f.kind, "the config check call failed; loading anyway");
                Ok(())
            }
        }
    }

    /// [`HookHost::before_grant_async`] run to completion on this thread,
    /// for callers that are not async (or must not give their thread back).
    pub fn before_grant(&self, request: HookRequest) -> HookOutcome {
        call::block_on(self.before_grant_async(request))
    }

    /// Runs the class's hook for one Acquire: the loaded module (and its
    /// config) is the last one that loaded for the class. Await it on an
    /// async worker: a call gives the thread back at every epoch tick it
    /// runs past (a tenth of the smallest hooked deadline, at least 200 us),
    /// so a slow hook delays the worker's other tasks by at most a tick at
    /// a time, and a fast one (microseconds) never leaves the worker.
    pub async fn before_grant_async(&self, mut request: HookRequest) -> HookOutcome {
        let started = Instant::now();
        let class = request.class.clone();
        let loaded = self.classes.read().get(&class).cloned();
        let Some(loaded) = loaded else {
            let why = self
                .refusals
                .read()
                .get(&class)
                .map(|r| r.reason.clone())
                .unwrap_or_else(|| "it has not been loaded yet".into());
            return self.failed(
                &class,
                started,
                HookFailure {
                    kind: FailureKind::NotLoaded,
                    detail: format!("no module is loaded: {why}"),
                },
            );
        };
        let rt = match self.runtime() {
            Ok(rt) => rt,
            Err(e) => {
                return self.failed(
                    &class,
                    started,
                    HookFailure {
                        kind: FailureKind::Instantiate,
                        detail: e,
                    },
                );
            }
        };
        if !loaded.spec.needs(latchkey_policies::HookInputKind::Mode) {
            // A hook that did not ask for the mode may be one built before
            // the field existed, which refuses unknown fields.
            request.mode = None;
            request.permits = None;
        }
        let input = match encode_request(&mut request, &loaded.config, &loaded.config_json) {
            Ok(i) => i,
            Err(e) => {
                return self.failed(
                    &class,
                    started,
                    HookFailure {
                        kind: FailureKind::Instantiate,
                        detail: format!("cannot encode the request: {e}"),
                    },
                );
            }
        };
        match call::before_grant(&loaded.callee(rt), &input).await {
            Ok(Verdict::Allow { annotations }) => {
                self.metrics
                    .record(&class, started.elapsed(), Recorded::Allowed);
                if loaded.exports.after_release.is_some() {
                    self.track(&request.key, &class);
                }
                HookOutcome::Allow { annotations }
            }
            Ok(Verdict::Deny {
                code,
                reason,
                message,
            }) => {
                self.metrics
                    .record(&class, started.elapsed(), Recorded::Denied(&reason));
                HookOutcome::Deny {
                    code,
                    reason,
                    message,
                    failure: None,
                }
            }
            Err(f) => self.failed(&class, started, f),
        }
    }

    /// The denial for a call that never produced an outcome because the
    /// host failed around it (the thread running [`HookHost::before_grant`]
    /// panicked or was cancelled): fail closed like any other hook failure,
    /// counted and logged the same way.
    pub fn internal_failure(
        &self,
        class: &str,
        started: Instant,
        detail: impl Into<String>,
    ) -> HookOutcome {
        self.failed(
            class,
            started,
            HookFailure {
                kind: FailureKind::Internal,
                detail: detail.into(),
            },
        )
    }

    fn failed(&self, class: &str, started: Instant, f: HookFailure) -> HookOutcome {
        self.metrics
            .record(class, started.elapsed(), Recorded::Failed(f.kind));
        warn!(class, kind = %f.kind, detail = %f.detail, "hook failed; request denied (fail closed)");
        HookOutcome::Deny {
            code: DenyCode::FailedPrecondition,
            reason: f.kind.reason().to_string(),
            message: format!(
                "the hook of class \"{class}\" failed, so the request is refused: {}",
                f.detail
            ),
            failure: Some(f.kind),
        }
    }

    fn track(&self, key: &str, class: &str) {
        let mut held = self.held.lock();
        if held.len() < MAX_TRACKED_HOLDS || held.contains_key(key) {
            held.insert(key.to_string(), class.to_string());
        }
    }

    /// Bookkeeping after a release: calls the class's after-release export
    /// if its module has one. Failures are logged, never surfaced. Blocking
    /// for up to the class's deadline: [`HookHost::release_call`] and
    /// [`HookHost::run_release_call`] split it for callers that must not block.
    pub fn after_release(
        &self,
        identity: &str,
        key: &str,
        now_unix_ms: i64,
        now_monotonic_ns: u64,
    ) {
        if let Some(call) = self.release_call(identity, key, now_unix_ms, now_monotonic_ns) {
            self.run_release_call(call);
        }
    }

    /// The after-release call a release needs, if any: the key was granted
    /// under a class whose module exports after-release. Cheap and
    /// non-blocking (a map lookup and a small JSON encoding), and it forgets
    /// the hold at once, in release order, whenever the call itself runs.
    /// `now_monotonic_ns` must be on the same clock as the before-grant
    /// requests' (the arbiter's, [`monotonic_ns`]).
    pub fn release_call(
        &self,
        identity: &str,
        key: &str,
        now_unix_ms: i64,
        now_monotonic_ns: u64,
    ) -> Option<ReleaseCall> {
        let class = self.held.lock().remove(key)?;
        let loaded = self.classes.read().get(&class).cloned()?;
        loaded.exports.after_release.as_ref()?;
        let notice = ReleaseNotice {
            version: ABI_VERSION,
            class,
            identity: identity.to_string(),
            key: key.to_string(),
            now_unix_ms,
            now_monotonic_ns,
            config: loaded.config.clone(),
        };
        let input = serde_json::to_vec(&notice).ok()?;
        Some(ReleaseCall { loaded, input })
    }

    /// Runs an after-release call: blocking, for up to the class's deadline.
    pub fn run_release_call(&self, call: ReleaseCall) {
        let ReleaseCall { loaded, input } = call;
        let (Some(export), Ok(rt)) = (&loaded.exports.after_release, self.runtime()) else {
            return;
        };
        if let Err(f) = call::block_on(call::after_release(&loaded.callee(rt), export, &input)) {
            warn!(class = %loaded.class, kind = %f.kind, detail = %f.detail, "after-release hook failed");
        }
    }

    /// Counts an after-release call its caller had no room to run.
    pub fn release_call_dropped(&self, call: ReleaseCall) {
        self.metrics.record_release_dropped(call.class());
    }
}

/// One pending after-release call (see [`HookHost::release_call`]).
pub struct ReleaseCall {
    loaded: Arc<Loaded>,
    input: Vec<u8>,
}

impl ReleaseCall {
    pub fn class(&self) -> &str {
        &self.loaded.class
    }
}

impl std::fmt::Debug for ReleaseCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReleaseCall")
            .field("class", &self.class())
            .finish_non_exhaustive()
    }
}

/// Nanoseconds on this process's monotonic clock since it was first read:
/// the one clock every hook request and release notice carries in
/// `nowMonotonicNs` (the arbiter reads it for both hook entry points too),
/// so an interval between a grant and its release is measured on one clock.
/// Meaningless across processes.
pub fn monotonic_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// `request` as JSON with `config` as the class's: the config's encoding,
/// made once at load, is spliced in rather than cloned and encoded again on
/// every call. serde writes a struct's fields in declaration order and
/// `config` is the last, so the request encoded with a null config ends in
/// `"config":null}`; if it ever does not, the config is encoded in place.
fn encode_request(
    request: &mut HookRequest,
    config: &serde_json::Value,
    config_json: &[u8],
) -> serde_json::Result<Vec<u8>> {
    const TAIL: &[u8] = b"\"config\":null}";
    request.config = serde_json::Value::Null;
    let mut out = Vec::with_capacity(384 + config_json.len());
    serde_json::to_writer(&mut out, &*request)?;
    if out.ends_with(TAIL) {
        out.truncate(out.len() - b"null}".len());
        out.extend_from_slice(config_json);
        out.push(b'}');
        return Ok(out);
    }
    request.config = config.clone();
    serde_json::to_vec(&*request)
}

fn call_store(rt: &Runtime, class: &Arc<str>, limits: &CallLimits) -> Store<CallState> {
    call::trial_store(rt, class, limits)
}

fn resolve(base: &Path, module: &str) -> PathBuf {
    let p = Path::new(module);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn stamp(path: &Path) -> std::io::Result<(u64, u128)> {
    let meta = std::fs::metadata(path)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok((meta.len(), mtime))
}

/// The ABI exports with the right types, and a memory the class's cap fits.
fn check_abi(module: &Module, limits: &CallLimits) -> Result<Exports, String> {
    use ValType::{I32, I64};
    let func = |name: &str, params: &[ValType], results: &[ValType]| -> Result<(), String> {
        match module.get_export(name) {
            Some(ExternType::Func(f)) => {
                let p: Vec<ValType> = f.params().collect();
                let r: Vec<ValType> = f.results().collect();
                let same = |a: &[ValType], b: &[ValType]| {
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| ValType::eq(x, y))
                };
                if same(&p, params) && same(&r, results) {
                    Ok(())
                } else {
                    Err(format!(
                        "export {name} has the wrong signature (see policies/HOOKS.md)"
                    ))
                }
            }
            _ => Err(format!(
                "lacks the hook ABI v1 export {name} (build it with latchkey-hook-sdk's hook! macro)"
            )),
        }
    };
    func(EXPORT_ABI_VERSION, &[], &[I32])?;
    func(EXPORT_ALLOC, &[I32], &[I32])?;
    func(EXPORT_FREE, &[I32, I32], &[])?;
    func(EXPORT_BEFORE_GRANT, &[I32, I32], &[I64])?;
    let after = match module.get_export(EXPORT_AFTER_RELEASE) {
        None => None,
        Some(_) => {
            func(EXPORT_AFTER_RELEASE, &[I32, I32], &[])?;
            module.get_export_index(EXPORT_AFTER_RELEASE)
        }
    };
    match module.get_export(EXPORT_MEMORY) {
        Some(ExternType::Memory(m)) => {
            let min = usize::try_from(m.minimum())
                .unwrap_or(usize::MAX)
                .saturating_mul(64 * 1024);
            if min > limits.memory_bytes {
                return Err(format!(
                    "its memory starts at {} KiB, above the class's cap of {} MiB",
                    min / 1024,
                    limits.memory_bytes / MIB
                ));
            }
        }
        _ => return Err(format!("lacks the hook ABI v1 export {EXPORT_MEMORY}")),
    }
    let index = |name: &str| {
        module
            .get_export_index(name)
            .ok_or_else(|| format!("lacks the hook ABI v1 export {name}"))
    };
    Ok(Exports {
        memory: index(EXPORT_MEMORY)?,
        alloc: index(EXPORT_ALLOC)?,
        before_grant: index(EXPORT_BEFORE_GRANT)?,
        after_release: after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spliced_request_is_the_request_with_the_config() {
        let config = serde_json::json!({"windows": [{"start": "02:00", "end": "04:00"}], "n": 1});
        let config_json = serde_json::to_vec(&config).unwrap();
        let mut request = HookRequest {
            version: ABI_VERSION,
            class: "c".into(),
            identity: "spiffe://td/w".into(),
            key: "k\"}".into(),
            session: -3,
            metadata: BTreeMap::from([("ticket".into(), "CHG-1}".into())]),
            holder: None,
            waiters: 2,
            now_unix_ms: 5,
            now_monotonic_ns: 6,
            hold_count: Some(1),
            mode: Some(latchkey_hook_abi::HookMode::Shared),
            permits: Some(4),
            config: serde_json::Value::Null,
        };
        let bytes = encode_request(&mut request, &config, &config_json).unwrap();
        let mut expected = request.clone();
        expected.config = config.clone();
        assert_eq!(bytes, serde_json::to_vec(&expected).unwrap());
        let back: HookRequest = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back, expected);
    }
}
