//! The guest side of hook ABI v1. A hook author writes one plain function
//! from [`HookRequest`] to [`HookResponse`] and names it in [`hook!`]:
//!
//! ```
//! use latchkey_hook_sdk::{DenyCode, HookRequest, HookResponse};
//!
//! fn before_grant(req: &HookRequest) -> HookResponse {
//!     match req.metadata.get("ticket") {
//!         Some(t) => HookResponse::allow().annotate("ticket", t.clone()),
//!         None => HookResponse::deny(
//!             DenyCode::PermissionDenied,
//!             "TICKET_MISSING",
//!             "send metadata ticket=CHG-<number>",
//!         ),
//!     }
//! }
//! latchkey_hook_sdk::hook!(before_grant);
//! # fn main() {}
//! ```
//!
//! Built with `scripts/build-wasm <package>` (crate-type `cdylib` and `rlib`),
//! the macro emits the exports the host looks for (`latchkey_abi_version`,
//! `latchkey_alloc`, `latchkey_free`, `latchkey_before_grant`, and
//! `latchkey_after_release` when given). On the host the exports are not
//! emitted, so the same function is unit-tested natively with plain
//! `cargo test`. A request that cannot be decoded is denied by the SDK
//! itself (`BAD_INPUT`), never handed to the author's function.

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing too.
#![deny(clippy::indexing_slicing)]

pub use latchkey_hook_abi::{
    ABI_VERSION, DenyCode, HolderSummary, HookMode, HookRequest, HookResponse, ReleaseNotice,
};

pub mod heap;
pub mod log;

#[doc(hidden)]
pub mod glue;

/// Decodes `input` and calls `f`; the shared core of the export glue, safe
/// and testable natively.
pub fn answer(input: &[u8], f: impl FnOnce(&HookRequest) -> HookResponse) -> Vec<u8> {
    let response = match serde_json::from_slice::<HookRequest>(input) {
        Ok(req) if req.version == ABI_VERSION => f(&req),
        Ok(req) => HookResponse::deny(
            DenyCode::FailedPrecondition,
            "ABI_VERSION",
            format!(
                "the hook speaks ABI version {ABI_VERSION}, the arbiter sent {}",
                req.version
            ),
        ),
        Err(e) => HookResponse::deny(
            DenyCode::FailedPrecondition,
            "BAD_INPUT",
            format!("the hook could not read its input: {e}"),
        ),
    };
    serde_json::to_vec(&response).unwrap_or_default()
}

/// Decodes `input` and calls `f` (after-release bookkeeping).
pub fn notice(input: &[u8], f: impl FnOnce(&ReleaseNotice)) {
    if let Ok(n) = serde_json::from_slice::<ReleaseNotice>(input)
        && n.version == ABI_VERSION
    {
        f(&n);
    }
}

/// Emits the ABI v1 exports for `before_grant` (and optionally an
/// after-release function) on `wasm32`; nothing elsewhere.
///
/// `hook!(my_fn)` or `hook!(before_grant = my_fn, after_release = my_notice_fn)`.
#[macro_export]
macro_rules! hook {
    ($before:path) => {
        $crate::hook!(before_grant = $before);
    };
    (before_grant = $before:path $(, after_release = $after:path)? $(,)?) => {
        #[cfg(target_arch = "wasm32")]
        #[allow(unsafe_code)]
        #[unsafe(no_mangle)]
        pub extern "C" fn latchkey_abi_version() -> i32 {
            $crate::glue::abi_version()
        }

        #[cfg(target_arch = "wasm32")]
        #[allow(unsafe_code)]
        #[unsafe(no_mangle)]
        pub extern "C" fn latchkey_alloc(len: u32) -> u32 {
            $crate::glue::alloc(len)
        }

        #[cfg(target_arch = "wasm32")]
        #[allow(unsafe_code)]
        #[unsafe(no_mangle)]
        pub extern "C" fn latchkey_free(ptr: u32, len: u32) {
            $crate::glue::free(ptr, len)
        }

        #[cfg(target_arch = "wasm32")]
        #[allow(unsafe_code)]
        #[unsafe(no_mangle)]
        pub extern "C" fn latchkey_before_grant(ptr: u32, len: u32) -> u64 {
            $crate::glue::before_grant(ptr, len, $before)
        }

        $(
            #[cfg(target_arch = "wasm32")]
            #[allow(unsafe_code)]
            #[unsafe(no_mangle)]
            pub extern "C" fn latchkey_after_release(ptr: u32, len: u32) {
                $crate::glue::after_release(ptr, len, $after)
            }
        )?
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req_json() -> String {
        serde_json::json!({
            "version": 1, "class": "c", "identity": "spiffe://td/w", "key": "k",
            "session": 1, "waiters": 0, "nowUnixMs": 0, "nowMonotonicNs": 0
        })
        .to_string()
    }

    #[test]
    fn answer_calls_the_function() {
        let out = answer(req_json().as_bytes(), |r| {
            HookResponse::allow().annotate("key", r.key.clone())
        });
        let resp: HookResponse = serde_json::from_slice(&out).unwrap();
        assert_eq!(resp.annotations.get("key").map(String::as_str), Some("k"));
    }

    #[test]
    fn bad_input_is_denied_without_calling() {
        let out = answer(b"{\"nope\":1}", |_| unreachable!());
        let resp: HookResponse = serde_json::from_slice(&out).unwrap();
        assert_eq!(resp.reason.as_deref(), Some("BAD_INPUT"));
        let v2 = req_json().replace("\"version\":1", "\"version\":2");
        let out = answer(v2.as_bytes(), |_| unreachable!());
        let resp: HookResponse = serde_json::from_slice(&out).unwrap();
        assert_eq!(resp.reason.as_deref(), Some("ABI_VERSION"));
    }
}
