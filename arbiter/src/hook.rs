//! The hook point before every grant transaction (and after every release).
//!
//! A lock class may attach rules a prefix grant cannot express (a change
//! ticket, a quota, a maintenance window). The arbiter asks the class's hook
//! once per Acquire, before the caller is queued or the grant transaction
//! runs; a denial writes nothing. The sandboxed Wasm host (per-class modules
//! run by wasmtime) plugs in here; without one, every request is allowed.

use std::collections::BTreeMap;

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
