//! A test fixture, not an example to copy: a hook that misbehaves on
//! request (`behavior` in its config), so the host's limits are tested
//! against a real guest built by the project's Wasm build step.
//!
//! - `"allow"`: allows, after logging one line through the host;
//! - `"loop"`: never returns (the deadline must cut it off);
//! - `"bomb"`: allocates until memory runs out (the memory cap must stop it);
//! - `"panic"`: panics (a trap, with `panic = "abort"`);
//! - `"show-mode"`: allows, annotating the `mode` it was sent (`exclusive`,
//!   `shared`, or `absent` when the class's `inputs` lack `"mode"`) and the
//!   `permits`, if any;
//! - `"exclusive-only"`: refuses shared Acquires (`SHARED_REFUSED`), allows
//!   the rest as `"show-mode"` does; without the `"mode"` input it cannot
//!   tell them apart and says so (`HOOK_MISCONFIGURED`, refused at load).

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing too.
#![deny(clippy::indexing_slicing)]

use latchkey_hook_sdk::{DenyCode, HookMode, HookRequest, HookResponse, log};

pub fn before_grant(req: &HookRequest) -> HookResponse {
    let behavior = req
        .config
        .get("behavior")
        .and_then(|b| b.as_str())
        .unwrap_or("allow");
    match behavior {
        "allow" => {
            log::info(&format!("allowing {}", req.key));
            HookResponse::allow().annotate("behavior", "allow")
        }
        "loop" => {
            let mut n: u64 = 0;
            loop {
                n = std::hint::black_box(n.wrapping_add(1));
            }
        }
        "bomb" => {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                // Reserve without touching: memory grows fast, so the cap
                // (not the deadline) is what stops it.
                let mut chunk = Vec::<u8>::with_capacity(1 << 20);
                chunk.push(1);
                hoard.push(std::hint::black_box(chunk));
            }
        }
        #[allow(clippy::panic)]
        "panic" => panic!("asked to panic"),
        "show-mode" => show_mode(req),
        "exclusive-only" => match req.mode {
            Some(HookMode::Shared) => HookResponse::deny(
                DenyCode::PermissionDenied,
                "SHARED_REFUSED",
                format!(
                    "class {:?} takes exclusive acquires only: acquire without shared",
                    req.class
                ),
            ),
            Some(HookMode::Exclusive) => show_mode(req),
            None => HookResponse::deny(
                DenyCode::FailedPrecondition,
                "HOOK_MISCONFIGURED",
                "exclusive-only needs the Acquire's mode: list \"mode\" in the class's hook inputs",
            ),
        },
        other => HookResponse::deny(
            DenyCode::FailedPrecondition,
            "UNKNOWN_BEHAVIOR",
            format!("unknown behavior {other:?}"),
        ),
    }
}

/// Allows, annotating the mode and permits the hook was sent.
fn show_mode(req: &HookRequest) -> HookResponse {
    let mode = match req.mode {
        Some(HookMode::Exclusive) => "exclusive",
        Some(HookMode::Shared) => "shared",
        None => "absent",
    };
    let allow = HookResponse::allow().annotate("mode", mode);
    match req.permits {
        Some(permits) => allow.annotate("permits", permits.to_string()),
        None => allow,
    }
}

latchkey_hook_sdk::hook!(before_grant);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_allows() {
        let req: HookRequest = serde_json::from_value(serde_json::json!({
            "version": 1, "class": "c", "identity": "i", "key": "k", "session": 1,
            "waiters": 0, "nowUnixMs": 0, "nowMonotonicNs": 0, "config": {"behavior": "allow"}
        }))
        .unwrap();
        assert_eq!(
            before_grant(&req)
                .annotations
                .get("behavior")
                .map(String::as_str),
            Some("allow")
        );
    }

    fn asking(mode: Option<&str>, permits: Option<u32>) -> HookRequest {
        let mut req = serde_json::json!({
            "version": 1, "class": "c", "identity": "i", "key": "k", "session": 1,
            "waiters": 0, "nowUnixMs": 0, "nowMonotonicNs": 0,
            "config": {"behavior": "exclusive-only"}
        });
        if let Some(mode) = mode {
            req["mode"] = mode.into();
        }
        if let Some(permits) = permits {
            req["permits"] = permits.into();
        }
        serde_json::from_value(req).unwrap()
    }

    #[test]
    fn exclusive_only_refuses_shared_acquires_only() {
        let denied = before_grant(&asking(Some("shared"), None));
        assert_eq!(denied.reason.as_deref(), Some("SHARED_REFUSED"));
        assert_eq!(denied.code, Some(DenyCode::PermissionDenied));
        let allowed = before_grant(&asking(Some("exclusive"), Some(8)));
        assert_eq!(allowed.reason, None);
        assert_eq!(
            allowed.annotations.get("mode").map(String::as_str),
            Some("exclusive")
        );
        assert_eq!(
            allowed.annotations.get("permits").map(String::as_str),
            Some("8")
        );
        let blind = before_grant(&asking(None, None));
        assert_eq!(blind.reason.as_deref(), Some("HOOK_MISCONFIGURED"));
    }
}
