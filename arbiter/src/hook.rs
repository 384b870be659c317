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
use std::sync::OnceLock;
use std::time::Instant;

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
    /// [`monotonic_ns`] when the request was checked.
    pub now_monotonic_ns: u64,
    /// The class's hook table in the policy set this request was checked
    /// against; `None` for a class without a hook.
    pub hook: Option<&'a ClassHook>,
    /// The key's holder, read from etcd only when the hook asks for it.
    pub holder: Option<HolderSummary>,
    /// Locks the identity holds in the class (every arbiter's), read from
    /// etcd only when the hook asks for it.
    pub hold_count: Option<u32>,
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
/// good for intervals on one arbiter, meaningless across arbiters.
pub fn monotonic_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
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

pub trait ClassHooks: Send + Sync {
    fn before_grant(&self, input: &HookInput<'_>) -> HookDecision;
    /// Bookkeeping after a release. The release call does not name the class;
    /// a hook that needs it keeps its own record from `before_grant`.
    fn after_release(&self, _identity: &str, _key: &str) {}
}

/// Every class allowed, nothing annotated.
#[derive(Debug, Default)]
pub struct NoHooks;

impl ClassHooks for NoHooks {
    fn before_grant(&self, _input: &HookInput<'_>) -> HookDecision {
        HookDecision::allow()
    }
}
