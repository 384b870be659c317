//! The adapter between the arbiter's hook point ([`crate::hook`]) and the
//! Wasm host (`latchkey-hook-host`): a class with a `[class.hook]` is asked
//! through its module; every class then goes through the configured
//! [`ClassHooks`] too (`NoHooks` unless a test or an embedder sets one).
//!
//! Loading happens elsewhere, off the request path: [`crate::build`] syncs
//! the host with the first policy set and [`crate::policy::Policies`] syncs
//! it before each new set is swapped in and on every poll (for rebuilt
//! module files).
//!
//! A Wasm call runs for up to the class's deadline, so it never holds an
//! async worker for long: the Acquire awaits its before-grant call on its own
//! worker, and the call gives the thread back at every epoch tick it runs
//! past; a Release does not wait for its after-release call, which runs on
//! the blocking pool in the background, a bounded number at a time.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use async_trait::async_trait;
use futures::FutureExt;
use latchkey_hook_abi::{ABI_VERSION, DenyCode, HookMode, HookRequest};
use latchkey_hook_host::{HookHost, HookOutcome};
use tokio::sync::Semaphore;
use tokio::task::JoinError;
use tonic::Code;
use tracing::{info, warn};

use crate::hook::{ClassHooks, HookDecision, HookInput, monotonic_ns};
use crate::records::now_unix_ms;

/// After-release calls pending or running at once. They share the host's
/// instance pool (32 slots by default) with before-grant calls, which
/// decide requests; a burst of releases must not take the slots those need
/// (a before-grant call without a slot is denied). Each call ends within its
/// class's deadline, so a few slots drain thousands of calls a second.
const MAX_PENDING_RELEASE_CALLS: usize = 8;

pub struct WasmHooks {
    host: Arc<HookHost>,
    then: Arc<dyn ClassHooks>,
    /// Room for after-release calls (see [`MAX_PENDING_RELEASE_CALLS`]).
    release_slots: Arc<Semaphore>,
    /// A dropped after-release call is logged once; the metrics count them all.
    drop_logged: AtomicBool,
}

impl WasmHooks {
    pub fn new(host: Arc<HookHost>, then: Arc<dyn ClassHooks>) -> Self {
        Self {
            host,
            then,
            release_slots: Arc::new(Semaphore::new(MAX_PENDING_RELEASE_CALLS)),
            drop_logged: AtomicBool::new(false),
        }
    }

    /// The class's before-grant call, awaited right here on the Acquire's
    /// worker: the host runs the guest on a fiber that gives the thread back
    /// at every epoch tick it runs past (policies/HOOKS.md), so a slow hook
    /// delays this worker's other tasks by at most a tick at a time, while a
    /// fast one (microseconds) is done before any other task could have run.
    /// No thread hand-off: a `spawn_blocking` round trip cost 15-70 us p50 on
    /// a 2-core machine, several times the call itself, and `block_in_place`
    /// 2-6 us more than awaiting in place (hook-bench --dispatch).
    /// If the call panics there is no outcome: deny, as for a module that
    /// trapped (fail closed).
    async fn run_before_grant(&self, request: HookRequest) -> HookOutcome {
        let started = Instant::now();
        let class = request.class.clone();
        match AssertUnwindSafe(self.host.before_grant_async(request))
            .catch_unwind()
            .await
        {
            Ok(outcome) => outcome,
            Err(_) => self
                .host
                .internal_failure(&class, started, "the hook call panicked"),
        }
    }

    /// Hands the release's after-release call (if its class's module wants
    /// one) to the blocking pool without waiting for it; drops it, counted,
    /// when [`MAX_PENDING_RELEASE_CALLS`] are already pending.
    fn spawn_after_release(&self, identity: &str, key: &str) {
        let Some(call) = self
            .host
            .release_call(identity, key, now_unix_ms(), monotonic_ns())
        else {
            return;
        };
        let Ok(permit) = self.release_slots.clone().try_acquire_owned() else {
            if !self.drop_logged.swap(true, Ordering::Relaxed) {
                warn!(
                    class = call.class(),
                    pending = MAX_PENDING_RELEASE_CALLS,
                    "after-release hook calls are being dropped: too many pending (logged once; counted per class as after_release_dropped)"
                );
            }
            self.host.release_call_dropped(call);
            return;
        };
        let host = self.host.clone();
        let class = call.class().to_string();
        tokio::spawn(async move {
            let done = tokio::task::spawn_blocking(move || host.run_release_call(call)).await;
            drop(permit);
            if let Err(e) = done {
                warn!(class, reason = %did_not_finish(&e), "after-release hook call lost");
            }
        });
    }

    /// Logs every class's hook metrics once a minute: the counters are on
    /// `/metrics` too, the latency percentiles only here.
    pub fn log_metrics(host: &HookHost) {
        for (class, m) in host.metrics().snapshot() {
            info!(
                class,
                invocations = m.invocations,
                allowed = m.allowed,
                denials = ?m.denials,
                failures = ?m.failures.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(),
                after_release_dropped = m.after_release_dropped,
                p50_us = m.latency(0.5).as_micros() as u64,
                p99_us = m.latency(0.99).as_micros() as u64,
                "hook metrics"
            );
        }
    }
}

fn did_not_finish(e: &JoinError) -> String {
    if e.is_panic() {
        "the host thread running the hook call panicked".into()
    } else {
        "the hook call was cancelled before it finished (the arbiter is shutting down)".into()
    }
}

fn code(c: DenyCode) -> Code {
    match c {
        DenyCode::PermissionDenied => Code::PermissionDenied,
        DenyCode::FailedPrecondition => Code::FailedPrecondition,
    }
}

fn request(input: &HookInput<'_>) -> HookRequest {
    HookRequest {
        version: ABI_VERSION,
        class: input.class.to_string(),
        identity: input.identity.to_string(),
        key: input.key.to_string(),
        session: input.session,
        metadata: input.metadata.clone(),
        holder: input
            .holder
            .as_ref()
            .map(|h| latchkey_hook_abi::HolderSummary {
                identity: h.identity.clone(),
                session: h.session,
                class: h.class.clone(),
                acquired_at_unix_ms: h.acquired_at_unix_ms,
            }),
        waiters: u32::try_from(input.waiters).unwrap_or(u32::MAX),
        now_unix_ms: input.now_unix_ms,
        now_monotonic_ns: input.now_monotonic_ns,
        hold_count: input.hold_count,
        // The host leaves both out for a hook that did not list "mode" in
        // its inputs (one built before they existed refuses them).
        mode: Some(if input.shared {
            HookMode::Shared
        } else {
            HookMode::Exclusive
        }),
        permits: input.permits,
        // The host fills in the config of the module it runs.
        config: serde_json::Value::Null,
    }
}

#[async_trait]
impl ClassHooks for WasmHooks {
    async fn before_grant(&self, input: &HookInput<'_>) -> HookDecision {
        let mut annotations = match input.hook {
            None => Default::default(),
            Some(_) => match self.run_before_grant(request(input)).await {
                HookOutcome::Allow { annotations } => annotations,
                HookOutcome::Deny {
                    code: c,
                    reason,
                    message,
                    failure: _,
                } => {
                    return HookDecision::Deny {
                        code: code(c),
                        reason,
                        message,
                    };
                }
            },
        };
        match self.then.before_grant(input).await {
            HookDecision::Allow { annotations: more } => {
                annotations.extend(more);
                HookDecision::Allow { annotations }
            }
            deny => deny,
        }
    }

    async fn after_release(&self, identity: &str, key: &str) {
        self.spawn_after_release(identity, key);
        self.then.after_release(identity, key).await;
    }
}
