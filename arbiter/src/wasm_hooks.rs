//! The adapter between the arbiter's hook point ([`crate::hook`]) and the
//! Wasm host (`latchkey-hook-host`): a class with a `[class.hook]` is asked
//! through its module; every class then goes through the configured
//! [`ClassHooks`] too (`NoHooks` unless a test or an embedder sets one).
//!
//! Loading happens elsewhere, off the request path: [`crate::build`] syncs
//! the host with the first policy set and [`crate::policy::Policies`] syncs
//! it before each new set is swapped in and on every poll (for rebuilt
//! module files).

use std::sync::Arc;

use latchkey_hook_abi::{ABI_VERSION, DenyCode, HookRequest};
use latchkey_hook_host::{HookHost, HookOutcome};
use tonic::Code;
use tracing::info;

use crate::hook::{ClassHooks, HookDecision, HookInput};
use crate::records::now_unix_ms;

pub struct WasmHooks {
    host: Arc<HookHost>,
    then: Arc<dyn ClassHooks>,
}

impl WasmHooks {
    pub fn new(host: Arc<HookHost>, then: Arc<dyn ClassHooks>) -> Self {
        Self { host, then }
    }

    /// Logs every class's hook metrics (there is no metrics endpoint yet).
    pub fn log_metrics(host: &HookHost) {
        for (class, m) in host.metrics().snapshot() {
            info!(
                class,
                invocations = m.invocations,
                allowed = m.allowed,
                denials = ?m.denials,
                failures = ?m.failures.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(),
                p50_us = m.latency(0.5).as_micros() as u64,
                p99_us = m.latency(0.99).as_micros() as u64,
                "hook metrics"
            );
        }
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
        // The host fills in the config of the module it runs.
        config: serde_json::Value::Null,
    }
}

impl ClassHooks for WasmHooks {
    fn before_grant(&self, input: &HookInput<'_>) -> HookDecision {
        let mut annotations = match input.hook {
            None => Default::default(),
            Some(_) => match self.host.before_grant(request(input)) {
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
        match self.then.before_grant(input) {
            HookDecision::Allow { annotations: more } => {
                annotations.extend(more);
                HookDecision::Allow { annotations }
            }
            deny => deny,
        }
    }

    fn after_release(&self, identity: &str, key: &str) {
        self.host.after_release(identity, key, now_unix_ms());
        self.then.after_release(identity, key);
    }
}
