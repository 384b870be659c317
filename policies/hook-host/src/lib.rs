//! The sandboxed host that runs per-class hooks (ABI v1, policies/HOOKS.md)
//! inside the arbiter, with wasmtime.
//!
//! Loading, off the request path: [`HookHost::sync`] is given the policy set
//! in force; for every class with a `[class.hook]` whose module file or spec
//! changed, the module is compiled once (or read back from the on-disk cache
//! keyed by its SHA-256, [`cache`]), checked for the ABI exports and its
//! imports resolved into an `InstancePre`, then swapped in atomically. A
//! module that fails any step is refused with a message naming the class and
//! the reason, and the class keeps its previous module.
//!
//! A call, on the request path: [`HookHost::before_grant`] takes the class's
//! loaded module, makes a fresh `Store` (so no state survives between calls)
//! from the pooling allocator with the class's memory and table caps and an
//! epoch deadline, copies the JSON request into guest memory, calls the
//! export and checks the JSON answer. A trap, a timeout, running out of
//! memory or a malformed answer becomes a denial (fail closed) that is
//! counted in [`Metrics`]; nothing one class's hook does reaches another
//! class. [`HookHost::before_grant_async`] is awaited on an async worker: the
//! guest runs on a fiber and gives the thread back at every epoch tick it
//! runs past, so a slow hook holds a worker for at most a tick at a time;
//! [`HookHost::before_grant`] runs the same call to completion on the
//! calling thread. A hook can only refuse or annotate: the caller still has
//! to pass every other check and win the grant transaction.
//!
//! What a call costs, and why, is in policies/HOOKS.md ("What a call
//! costs"); `examples/call-profile.rs` takes one apart phase by phase.

pub mod cache;
mod call;
mod host;
mod metrics;

pub use call::{FailureKind, HookFailure};
pub use host::{HookHost, HookOutcome, HostSettings, Refusal, ReleaseCall, monotonic_ns};
/// The ABI types the host's API speaks ([`HookHost::before_grant`] takes a
/// [`abi::HookRequest`]).
pub use latchkey_hook_abi as abi;
pub use metrics::{ClassMetrics, Metrics};
