//! The hook point before every grant transaction (and after every release).
//!
//! A lock class may attach rules a prefix grant cannot express (a change
//! ticket, a quota, a maintenance window). The arbiter asks the class's hook
//! once per Acquire, before the caller is queued or the grant transaction
//! runs; a denial writes nothing. The sandboxed Wasm host (per-class modules
//! run by wasmtime, [`crate::wasm_hooks`]) plugs in here; a class without a
//! `[class.hook]` is allowed.
//!
//! A hook can only refuse or annotate: an allow lets the request go on to
//! the grant transaction (or the queue) exactly as if there were no hook.

use std::collections::BTreeMap;

use async_trait::async_trait;
use latchkey_policies::ClassHook;
use tonic::Code;

/// What a hook sees. Time arrives in the input: hooks get no clock.
#[derive(Debug)]
pub struct HookInput<'a> {
    pub identity: &'a str,
    pub key: &'a str,
    pub class: &'a str,
    pub session: i64,
    pub metadata: &'a BTreeMap<String, String>,
    pub waiters: usize,
    pub now_unix_ms: i64,
    /// [`monotonic_ns`] when the request was checked: the same clock the
    /// after-release notice carries.
    pub now_monotonic_ns: u64,
    /// The class's hook table in the policy set this request was checked
    /// against; `None` for a class without a hook.
    pub hook: Option<&'a ClassHook>,
    /// The key's holder, read from etcd only when the hook asks for it.
    pub holder: Option<HolderSummary>,
    /// Locks the identity holds in the class (every arbiter's), read from
    /// etcd only when the hook asks for it.
    pub hold_count: Option<u32>,
    /// The Acquire asks for a shared hold (`MODE_SHARED`); `false`:
    /// exclusive. A Wasm hook sees it only when its class lists `"mode"` in
    /// `inputs` (the host leaves it out otherwise).
    pub shared: bool,
    /// The class's permits, for a semaphore class; `None` for a lock.
    pub permits: Option<u32>,
}

/// Who holds a key now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderSummary {
    pub identity: String,
    pub session: i64,
    pub class: String,
    pub acquired_at_unix_ms: i64,
}

/// Nanoseconds on this arbiter's monotonic clock since it first asked:
/// good for intervals on one arbiter, meaningless across arbiters. It is the
/// hook host's clock, so both hook entry points (and the host's own trial
/// calls) carry one clock whichever side reads it.
pub fn monotonic_ns() -> u64 {
    latchkey_hook_host::monotonic_ns()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookDecision {
    /// Go ahead; the annotations are stored on the holder record (Inspect shows them).
    Allow {
        annotations: BTreeMap<String, String>,
    },
    /// Refuse with a code (PERMISSION_DENIED or FAILED_PRECONDITION), a
    /// machine-readable reason and a message shown to the caller.
    Deny {
        code: Code,
        reason: String,
        message: String,
    },
}

impl HookDecision {
    pub fn allow() -> Self {
        Self::Allow {
            annotations: BTreeMap::new(),
        }
    }
}

/// The hook point. Async because a hook may block (a Wasm call runs for up
/// to its class's deadline): an implementation moves blocking work off the
/// tokio workers (`spawn_blocking`) or does its own I/O, and the request
/// awaits it. `async_trait` rather than a native async fn: the service holds
/// the hooks as `Arc<dyn ClassHooks>`.
#[async_trait]
pub trait ClassHooks: Send + Sync {
    async fn before_grant(&self, input: &HookInput<'_>) -> HookDecision;
    /// Bookkeeping after a release, awaited before Release answers: return
    /// promptly and hand anything slow to a bounded background task (as
    /// [`crate::wasm_hooks::WasmHooks`] does). Time, if a hook needs it, is
    /// [`monotonic_ns`] (the clock `before_grant` got) and the wall clock.
    /// The release call does not name the class; a hook that needs it keeps
    /// its own record from `before_grant`.
    async fn after_release(&self, _identity: &str, _key: &str) {}
}

/// Every class allowed, nothing annotated.
#[derive(Debug, Default)]
pub struct NoHooks;

#[async_trait]
impl ClassHooks for NoHooks {
    async fn before_grant(&self, _input: &HookInput<'_>) -> HookDecision {
        HookDecision::allow()
    }
}
