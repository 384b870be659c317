//! A test fixture, not an example to copy: a hook that misbehaves on
//! request (`behavior` in its config), so the host's limits are tested
//! against a real guest built by the project's Wasm build step.
//!
//! - `"allow"`: allows, after logging one line through the host;
//! - `"loop"`: never returns (the deadline must cut it off);
//! - `"bomb"`: allocates until memory runs out (the memory cap must stop it);
//! - `"panic"`: panics (a trap, with `panic = "abort"`).

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing too.
#![deny(clippy::indexing_slicing)]

use latchkey_hook_sdk::{DenyCode, HookRequest, HookResponse, log};

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
        other => HookResponse::deny(
            DenyCode::FailedPrecondition,
            "UNKNOWN_BEHAVIOR",
            format!("unknown behavior {other:?}"),
        ),
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
}
