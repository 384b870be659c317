//! RETIRED as a quota: use the class's `maxHoldsPerSubject`, enforced in
//! the grant transaction (policies/HOOKS.md, "Retired: the quota hook").
//! Kept as the example of the `holdCount` input and as a fixture of the
//! hook benchmark; no shipped class uses it.
//!
//! Per-identity hold-count hook: an identity may hold at most `maxHolds`
//! locks of the class at once, as far as a count read before the grant says. Needs `inputs = ["holdCount", "holder"]`: the count is
//! read from etcd by the arbiter (every arbiter's holds), and the holder lets
//! a retry of a key the caller already holds through.
//!
//! The count is read before the grant transaction, not inside it: two
//! Acquires of one identity racing on different arbiters can both see
//! `maxHolds - 1` and both be granted. The quota is exact for one caller
//! acquiring one key at a time, and can be overshot by concurrent Acquires.
//!
//! ```toml
//! [class.hook]
//! inputs = ["holdCount", "holder"]
//! [class.hook.config]
//! maxHolds = 2
//! ```

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing too.
#![deny(clippy::indexing_slicing)]

use latchkey_hook_sdk::{DenyCode, HookRequest, HookResponse};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Config {
    max_holds: u32,
}

pub fn before_grant(req: &HookRequest) -> HookResponse {
    let config: Config = match req.config() {
        Ok(c) => c,
        Err(e) => {
            return HookResponse::deny(
                DenyCode::FailedPrecondition,
                "HOOK_MISCONFIGURED",
                format!("the class's hook config is invalid: {e}"),
            );
        }
    };
    let Some(held) = req.hold_count else {
        return HookResponse::deny(
            DenyCode::FailedPrecondition,
            "HOOK_MISCONFIGURED",
            "the quota hook needs inputs = [\"holdCount\"] in the class's hook table",
        );
    };
    // A retry for a key this session already holds is not a new hold.
    if let Some(holder) = &req.holder
        && holder.identity == req.identity
        && holder.session == req.session
    {
        return HookResponse::allow().annotate("quota", format!("{held}/{}", config.max_holds));
    }
    if held >= config.max_holds {
        return HookResponse::deny(
            DenyCode::FailedPrecondition,
            "QUOTA_EXCEEDED",
            format!(
                "{} already holds {held} lock(s) of class {:?}, the most it may hold at once is {}: release one first",
                req.identity, req.class, config.max_holds
            ),
        );
    }
    HookResponse::allow().annotate("quota", format!("{}/{}", held + 1, config.max_holds))
}

latchkey_hook_sdk::hook!(before_grant);

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_hook_sdk::{ABI_VERSION, HolderSummary};

    fn req(held: Option<u32>) -> HookRequest {
        HookRequest {
            version: ABI_VERSION,
            class: "quota".into(),
            identity: "spiffe://td/w".into(),
            key: "demo/a".into(),
            session: 9,
            metadata: Default::default(),
            holder: None,
            waiters: 0,
            now_unix_ms: 0,
            now_monotonic_ns: 0,
            hold_count: held,
            mode: None,
            permits: None,
            config: serde_json::json!({"maxHolds": 2}),
        }
    }

    #[test]
    fn under_the_quota_is_allowed() {
        assert_eq!(
            before_grant(&req(Some(0))),
            HookResponse::allow().annotate("quota", "1/2")
        );
        assert_eq!(
            before_grant(&req(Some(1))),
            HookResponse::allow().annotate("quota", "2/2")
        );
    }

    #[test]
    fn at_the_quota_is_denied() {
        let r = before_grant(&req(Some(2)));
        assert_eq!(r.reason.as_deref(), Some("QUOTA_EXCEEDED"));
        assert_eq!(r.code, Some(DenyCode::FailedPrecondition));
    }

    #[test]
    fn a_retry_of_a_held_key_is_allowed() {
        let mut r = req(Some(2));
        r.holder = Some(HolderSummary {
            identity: r.identity.clone(),
            session: 9,
            class: "quota".into(),
            acquired_at_unix_ms: 0,
        });
        assert_eq!(
            before_grant(&r).decision,
            latchkey_hook_sdk::HookResponse::allow().decision
        );
    }

    #[test]
    fn without_the_count_it_fails_closed() {
        assert_eq!(
            before_grant(&req(None)).reason.as_deref(),
            Some("HOOK_MISCONFIGURED")
        );
    }
}
