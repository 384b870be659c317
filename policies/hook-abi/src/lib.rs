//! Hook ABI v1: what the arbiter sends a lock class's Wasm hook and what it
//! accepts back. Shared by the host (`latchkey-hook-host`) and the guests
//! (through `latchkey-hook-sdk`), so both sides agree on one set of types.
//!
//! A call flows: the host serialises a [`HookRequest`] as JSON, copies it
//! into a buffer the guest allocated with [`EXPORT_ALLOC`], calls
//! [`EXPORT_BEFORE_GRANT`], reads the JSON [`HookResponse`] the guest points
//! at, and checks it with [`HookResponse::verdict`] against [`OutputLimits`].
//! Every struct rejects unknown fields and carries a `version`, so a guest
//! built for another ABI version is refused instead of misread. The full
//! contract, with memory ownership, is in `policies/HOOKS.md`.

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing too.
#![deny(clippy::indexing_slicing)]

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// The ABI version this crate describes. Bumped on any incompatible change.
pub const ABI_VERSION: u32 = 1;

/// `() -> i32`: returns [`ABI_VERSION`]. Checked when the module is loaded.
pub const EXPORT_ABI_VERSION: &str = "latchkey_abi_version";
/// `(len: i32) -> i32`: a guest-owned buffer of `len` bytes; 0 on failure.
pub const EXPORT_ALLOC: &str = "latchkey_alloc";
/// `(ptr: i32, len: i32)`: gives back a buffer from `latchkey_alloc` or an output.
pub const EXPORT_FREE: &str = "latchkey_free";
/// `(ptr: i32, len: i32) -> i64`: takes ownership of the input buffer and
/// returns `(out_ptr << 32) | out_len` of a guest-owned JSON [`HookResponse`].
pub const EXPORT_BEFORE_GRANT: &str = "latchkey_before_grant";
/// Optional, `(ptr: i32, len: i32)`: a [`ReleaseNotice`]; no answer.
pub const EXPORT_AFTER_RELEASE: &str = "latchkey_after_release";
/// The linear memory, exported under its usual name.
pub const EXPORT_MEMORY: &str = "memory";

/// The only import module a hook may use.
pub const IMPORT_MODULE: &str = "latchkey";
/// `(level: i32, ptr: i32, len: i32)`: one UTF-8 log line (level 0 = error,
/// 1 = warn, 2 = info, 3 = debug). Bounded per call by the host.
pub const IMPORT_LOG: &str = "log";

/// What the hook is asked about: one Acquire, before it is queued or granted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HookRequest {
    pub version: u32,
    /// The lock class whose hook this is.
    pub class: String,
    /// The caller's SPIFFE ID.
    pub identity: String,
    pub key: String,
    pub session: i64,
    /// The request metadata the client sent (at most 16 small entries).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The key's current holder; present only when the class's hook lists
    /// `"holder"` in `inputs` (it costs an etcd read).
    #[serde(default)]
    pub holder: Option<HolderSummary>,
    /// Callers queued on this key at this arbiter.
    pub waiters: u32,
    /// Wall clock, Unix milliseconds (the arbiter's clock; hooks have none).
    pub now_unix_ms: i64,
    /// The arbiter's monotonic clock in nanoseconds since it started: only
    /// for intervals measured on one arbiter.
    pub now_monotonic_ns: u64,
    /// Locks this identity's grant subject holds in this class now, across
    /// every arbiter (for per-pod identities under a pattern grant, every
    /// pod's); present only when the hook lists `"holdCount"` in `inputs`.
    #[serde(default)]
    pub hold_count: Option<u32>,
    /// The mode the Acquire asks for; present only when the class's hook
    /// lists `"mode"` in `inputs` (so a hook built before the field existed,
    /// which refuses unknown fields, never sees it). Absent: the hook did
    /// not ask, not "exclusive".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<HookMode>,
    /// The class's permits when it is a semaphore (`kind = "semaphore"`):
    /// the Acquire asks for one of its slots, `0..permits` (the slot is
    /// chosen by the grant transaction, after the hook). Absent for a lock
    /// class, and whenever `mode` is absent (`inputs` lacks `"mode"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
    /// The class's `[class.hook.config]` table, as JSON. Keep it the last
    /// field: the host splices its encoding in at the end.
    #[serde(default)]
    pub config: serde_json::Value,
}

/// The mode of an Acquire (`latchkey.lock.v1.Mode`), in [`HookRequest::mode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HookMode {
    /// One holder (`MODE_EXCLUSIVE`): a lock's writer, or one slot of a
    /// semaphore (a semaphore takes exclusive requests only).
    Exclusive,
    /// One of many readers (`MODE_SHARED`), never beside an exclusive
    /// holder. A session's shared request of a lock it holds exclusively
    /// is a downgrade and comes through the hook like any Acquire.
    Shared,
}

/// Who holds the key now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HolderSummary {
    pub identity: String,
    pub session: i64,
    pub class: String,
    pub acquired_at_unix_ms: i64,
}

/// Sent to the optional after-release export: bookkeeping only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleaseNotice {
    pub version: u32,
    pub class: String,
    pub identity: String,
    pub key: String,
    pub now_unix_ms: i64,
    pub now_monotonic_ns: u64,
    #[serde(default)]
    pub config: serde_json::Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    Allow,
    Deny,
}

/// The status code a denial maps to on the caller's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DenyCode {
    /// The caller may never do this (no ticket, over quota).
    PermissionDenied,
    /// Not now: the state of the world must change first (outside a window).
    FailedPrecondition,
}

/// The hook's answer as it crosses the boundary. Use [`HookResponse::allow`]
/// and [`HookResponse::deny`] to build one and [`HookResponse::verdict`] to
/// check one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HookResponse {
    pub version: u32,
    pub decision: Decision,
    /// Allow only: stored on the holder record, shown by Inspect.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Deny only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<DenyCode>,
    /// Deny only: a machine-readable reason, `[A-Z0-9_]{1,64}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Deny only: shown to the caller; say what is missing and how to fix it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A checked answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow {
        annotations: BTreeMap<String, String>,
    },
    Deny {
        code: DenyCode,
        reason: String,
        message: String,
    },
}

/// Bounds on what a hook may answer; the host refuses anything larger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputLimits {
    pub max_annotations: usize,
    pub max_annotation_key_bytes: usize,
    pub max_annotation_value_bytes: usize,
    pub max_reason_bytes: usize,
    pub max_message_bytes: usize,
}

impl Default for OutputLimits {
    fn default() -> Self {
        Self {
            max_annotations: 8,
            max_annotation_key_bytes: 64,
            max_annotation_value_bytes: 256,
            max_reason_bytes: 64,
            max_message_bytes: 512,
        }
    }
}

/// Why an answer was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputError {
    Version { got: u32 },
    Field(&'static str, String),
}

impl fmt::Display for OutputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OutputError::Version { got } => write!(
                f,
                "the hook answered with ABI version {got}; this arbiter speaks version {ABI_VERSION}"
            ),
            OutputError::Field(field, why) => write!(f, "{field}: {why}"),
        }
    }
}

impl std::error::Error for OutputError {}

impl HookResponse {
    pub fn allow() -> Self {
        Self {
            version: ABI_VERSION,
            decision: Decision::Allow,
            annotations: BTreeMap::new(),
            code: None,
            reason: None,
            message: None,
        }
    }

    /// Allow and store `key = value` on the holder record.
    pub fn annotate(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    pub fn deny(code: DenyCode, reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            version: ABI_VERSION,
            decision: Decision::Deny,
            annotations: BTreeMap::new(),
            code: Some(code),
            reason: Some(reason.into()),
            message: Some(message.into()),
        }
    }

    /// Checks the answer's shape and bounds and turns it into a [`Verdict`].
    pub fn verdict(self, limits: &OutputLimits) -> Result<Verdict, OutputError> {
        if self.version != ABI_VERSION {
            return Err(OutputError::Version { got: self.version });
        }
        match self.decision {
            Decision::Allow => {
                if self.code.is_some() || self.reason.is_some() || self.message.is_some() {
                    return Err(OutputError::Field(
                        "decision",
                        "an allow carries no code, reason or message".into(),
                    ));
                }
                if self.annotations.len() > limits.max_annotations {
                    return Err(OutputError::Field(
                        "annotations",
                        format!("at most {} entries", limits.max_annotations),
                    ));
                }
                for (k, v) in &self.annotations {
                    if k.is_empty() || k.len() > limits.max_annotation_key_bytes || !printable(k) {
                        return Err(OutputError::Field(
                            "annotations",
                            format!(
                                "keys are 1..={} bytes of printable text",
                                limits.max_annotation_key_bytes
                            ),
                        ));
                    }
                    if v.len() > limits.max_annotation_value_bytes || !printable(v) {
                        return Err(OutputError::Field(
                            "annotations",
                            format!(
                                "values are at most {} bytes of printable text",
                                limits.max_annotation_value_bytes
                            ),
                        ));
                    }
                }
                Ok(Verdict::Allow {
                    annotations: self.annotations,
                })
            }
            Decision::Deny => {
                if !self.annotations.is_empty() {
                    return Err(OutputError::Field(
                        "annotations",
                        "a deny carries no annotations".into(),
                    ));
                }
                let code = self
                    .code
                    .ok_or_else(|| OutputError::Field("code", "a deny needs a code".into()))?;
                let reason = self.reason.unwrap_or_default();
                if reason.is_empty()
                    || reason.len() > limits.max_reason_bytes
                    || !reason
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
                {
                    return Err(OutputError::Field(
                        "reason",
                        format!("must match [A-Z0-9_]{{1,{}}}", limits.max_reason_bytes),
                    ));
                }
                let message = self.message.unwrap_or_default();
                if message.is_empty() || message.len() > limits.max_message_bytes {
                    return Err(OutputError::Field(
                        "message",
                        format!("must be 1..={} bytes", limits.max_message_bytes),
                    ));
                }
                if !printable(&message) {
                    return Err(OutputError::Field(
                        "message",
                        "must be printable text".into(),
                    ));
                }
                Ok(Verdict::Deny {
                    code,
                    reason,
                    message,
                })
            }
        }
    }
}

fn printable(s: &str) -> bool {
    !s.chars().any(char::is_control)
}

/// Packs an output pointer and length the way [`EXPORT_BEFORE_GRANT`] returns them.
pub fn pack(ptr: u32, len: u32) -> u64 {
    (u64::from(ptr) << 32) | u64::from(len)
}

/// The inverse of [`pack`].
pub fn unpack(packed: u64) -> (u32, u32) {
    ((packed >> 32) as u32, (packed & 0xffff_ffff) as u32)
}

impl HookRequest {
    /// The class's hook config as the hook author's own type.
    pub fn config<T: for<'de> Deserialize<'de>>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> HookRequest {
        HookRequest {
            version: ABI_VERSION,
            class: "ticketed".into(),
            identity: "spiffe://td/w".into(),
            key: "demo/a".into(),
            session: 7,
            metadata: BTreeMap::from([("ticket".into(), "CHG-1".into())]),
            holder: None,
            waiters: 0,
            now_unix_ms: 1,
            now_monotonic_ns: 2,
            hold_count: Some(3),
            mode: None,
            permits: None,
            config: serde_json::json!({"pattern": "CHG-"}),
        }
    }

    /// `HookRequest` as ABI v1 first shipped it, unknown fields refused: a
    /// hook built then must still read every request whose class does not
    /// list `"mode"` in `inputs`.
    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[allow(dead_code)]
    struct FirstHookRequest {
        version: u32,
        class: String,
        identity: String,
        key: String,
        session: i64,
        #[serde(default)]
        metadata: BTreeMap<String, String>,
        #[serde(default)]
        holder: Option<HolderSummary>,
        waiters: u32,
        now_unix_ms: i64,
        now_monotonic_ns: u64,
        #[serde(default)]
        hold_count: Option<u32>,
        #[serde(default)]
        config: serde_json::Value,
    }

    #[test]
    fn mode_and_permits_are_sent_only_when_set_so_older_hooks_still_read_the_rest() {
        let text = serde_json::to_string(&request()).unwrap();
        assert!(
            !text.contains("mode") && !text.contains("permits"),
            "{text}"
        );
        serde_json::from_str::<FirstHookRequest>(&text).unwrap();

        let mut asked = request();
        asked.mode = Some(HookMode::Shared);
        let text = serde_json::to_string(&asked).unwrap();
        assert!(text.contains("\"mode\":\"shared\""), "{text}");
        assert!(
            text.ends_with(r#""config":{"pattern":"CHG-"}}"#),
            "config stays last: {text}"
        );
        assert_eq!(serde_json::from_str::<HookRequest>(&text).unwrap(), asked);

        let mut slot = request();
        slot.mode = Some(HookMode::Exclusive);
        slot.permits = Some(8);
        let text = serde_json::to_string(&slot).unwrap();
        assert!(text.contains(r#""mode":"exclusive","permits":8"#), "{text}");
        assert_eq!(serde_json::from_str::<HookRequest>(&text).unwrap(), slot);
        // Written by hand, as a test or another host might: absent is None.
        let bare: HookRequest = serde_json::from_value(serde_json::json!({
            "version": 1, "class": "c", "identity": "i", "key": "k", "session": 1,
            "waiters": 0, "nowUnixMs": 0, "nowMonotonicNs": 0
        }))
        .unwrap();
        assert_eq!((bare.mode, bare.permits), (None, None));
    }

    #[test]
    fn request_round_trips_and_rejects_unknown_fields() {
        let r = request();
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"nowUnixMs\":1"), "{text}");
        assert_eq!(serde_json::from_str::<HookRequest>(&text).unwrap(), r);
        let extra = text.replacen('{', "{\"surprise\":1,", 1);
        let err = serde_json::from_str::<HookRequest>(&extra).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `surprise`"),
            "{err}"
        );
    }

    #[test]
    fn responses_are_checked() {
        let limits = OutputLimits::default();
        assert_eq!(
            HookResponse::allow()
                .annotate("ticket", "CHG-1")
                .verdict(&limits),
            Ok(Verdict::Allow {
                annotations: BTreeMap::from([("ticket".into(), "CHG-1".into())])
            })
        );
        let deny = HookResponse::deny(DenyCode::PermissionDenied, "NO_TICKET", "say which");
        assert!(matches!(deny.verdict(&limits), Ok(Verdict::Deny { .. })));
        let bad = HookResponse::deny(DenyCode::PermissionDenied, "no ticket", "x");
        assert!(bad.verdict(&limits).is_err());
        let mut wrong = HookResponse::allow();
        wrong.version = 2;
        assert_eq!(wrong.verdict(&limits), Err(OutputError::Version { got: 2 }));
        let mut many = HookResponse::allow();
        for i in 0..9 {
            many = many.annotate(format!("k{i}"), "v");
        }
        assert!(many.verdict(&limits).is_err());
        let text = r#"{"version":1,"decision":"allow","extra":true}"#;
        assert!(serde_json::from_str::<HookResponse>(text).is_err());
    }

    #[test]
    fn pack_round_trips() {
        assert_eq!(unpack(pack(0x1234, 0xffff_ffff)), (0x1234, 0xffff_ffff));
    }

    #[test]
    fn config_is_typed_by_the_author() {
        #[derive(Deserialize)]
        struct C {
            pattern: String,
        }
        assert_eq!(request().config::<C>().unwrap().pattern, "CHG-");
    }
}
