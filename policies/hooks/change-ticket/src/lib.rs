//! Change-ticket hook: an Acquire of the class must carry a change ticket in
//! its request metadata (`ticket` by default) that matches the configured
//! pattern; the ticket is stored on the holder record, so Inspect shows which
//! change a holder works under.
//!
//! ```toml
//! [class.hook.config]
//! pattern = "^CHG-[0-9]{4,10}$"   # required; a regex (regex-lite syntax)
//! metadataKey = "ticket"          # optional
//! ```
//!
//! Patterns of the shape tickets use are matched without compiling a regex
//! ([`pattern`]): the hook runs in a fresh instance on every call, so it
//! would compile the regex on every Acquire.

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing too.
#![deny(clippy::indexing_slicing)]

use latchkey_hook_sdk::{DenyCode, HookRequest, HookResponse};
use serde::Deserialize;

pub mod pattern;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Config {
    pattern: String,
    #[serde(default = "default_key")]
    metadata_key: String,
}

fn default_key() -> String {
    "ticket".into()
}

pub fn before_grant(req: &HookRequest) -> HookResponse {
    let config: Config = match req.config() {
        Ok(c) => c,
        Err(e) => return misconfigured(format!("the class's hook config is invalid: {e}")),
    };
    let pattern = match pattern::Pattern::new(&config.pattern) {
        Ok(p) => p,
        Err(e) => {
            return misconfigured(format!("pattern {:?} is not a regex: {e}", config.pattern));
        }
    };
    match req.metadata.get(&config.metadata_key) {
        None => HookResponse::deny(
            DenyCode::PermissionDenied,
            "TICKET_MISSING",
            format!(
                "class {:?} needs a change ticket: send request metadata {}=<ticket> matching {}",
                req.class, config.metadata_key, config.pattern
            ),
        ),
        Some(ticket) if !pattern.is_match(ticket) => HookResponse::deny(
            DenyCode::PermissionDenied,
            "TICKET_MALFORMED",
            format!(
                "class {:?}: metadata {}={:?} does not match {}",
                req.class,
                config.metadata_key,
                ticket.chars().take(64).collect::<String>(),
                config.pattern
            ),
        ),
        Some(ticket) => HookResponse::allow().annotate("ticket", ticket.clone()),
    }
}

fn misconfigured(message: String) -> HookResponse {
    HookResponse::deny(DenyCode::FailedPrecondition, "HOOK_MISCONFIGURED", message)
}

latchkey_hook_sdk::hook!(before_grant);

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_hook_sdk::ABI_VERSION;
    use std::collections::BTreeMap;

    fn req(ticket: Option<&str>) -> HookRequest {
        HookRequest {
            version: ABI_VERSION,
            class: "ticketed".into(),
            identity: "spiffe://td/w".into(),
            key: "demo/a".into(),
            session: 1,
            metadata: ticket
                .map(|t| BTreeMap::from([("ticket".to_string(), t.to_string())]))
                .unwrap_or_default(),
            holder: None,
            waiters: 0,
            now_unix_ms: 0,
            now_monotonic_ns: 0,
            hold_count: None,
            mode: None,
            permits: None,
            config: serde_json::json!({"pattern": "^CHG-[0-9]{4,10}$"}),
        }
    }

    #[test]
    fn a_matching_ticket_is_allowed_and_annotated() {
        let r = before_grant(&req(Some("CHG-12345")));
        assert_eq!(r, HookResponse::allow().annotate("ticket", "CHG-12345"));
    }

    #[test]
    fn a_missing_ticket_says_what_is_missing() {
        let r = before_grant(&req(None));
        assert_eq!(r.reason.as_deref(), Some("TICKET_MISSING"));
        assert_eq!(r.code, Some(DenyCode::PermissionDenied));
        assert!(r.message.unwrap().contains("ticket=<ticket>"));
    }

    #[test]
    fn a_malformed_ticket_is_denied() {
        let r = before_grant(&req(Some("CHG-12")));
        assert_eq!(r.reason.as_deref(), Some("TICKET_MALFORMED"));
    }

    #[test]
    fn a_bad_config_fails_closed() {
        let mut r = req(Some("CHG-12345"));
        r.config = serde_json::json!({"pattern": "("});
        assert_eq!(
            before_grant(&r).reason.as_deref(),
            Some("HOOK_MISCONFIGURED")
        );
        r.config = serde_json::json!({"patern": "x"});
        assert_eq!(
            before_grant(&r).reason.as_deref(),
            Some("HOOK_MISCONFIGURED")
        );
    }
}
