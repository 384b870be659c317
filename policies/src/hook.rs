//! A class's hook: the Wasm module the arbiter runs before every grant of
//! the class, the inputs it needs beyond the defaults, its limits and its
//! configuration (policies/HOOKS.md). Limits have safe defaults and platform
//! ceilings, so a class file can loosen them only so far.

use serde::{Deserialize, Serialize};

use crate::class::ClassError;

pub const DEFAULT_HOOK_DEADLINE_MS: u32 = 10;
pub const MAX_HOOK_DEADLINE_MS: u32 = 50;
pub const DEFAULT_HOOK_MEMORY_MIB: u32 = 16;
pub const MAX_HOOK_MEMORY_MIB: u32 = 64;
pub const DEFAULT_HOOK_TABLE_ELEMENTS: u32 = 10_000;
pub const MAX_HOOK_TABLE_ELEMENTS: u32 = 100_000;
pub const DEFAULT_HOOK_MAX_OUTPUT_BYTES: u32 = 16 * 1024;
pub const MAX_HOOK_MAX_OUTPUT_BYTES: u32 = 64 * 1024;

/// `[class.hook]` in a class file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassHook {
    /// Path of the `.wasm` file; relative paths are resolved against the
    /// policy directory.
    pub module: String,
    /// Optional inputs, sent only when listed here: the ones that cost an
    /// etcd read, and the ones a hook built before they existed could not
    /// read (ABI v1 refuses unknown fields).
    #[serde(default)]
    pub inputs: Vec<HookInputKind>,
    /// Execution deadline per call.
    #[serde(default = "default_deadline_ms")]
    pub deadline_ms: u32,
    /// Linear memory cap.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// Cap on table elements (function references).
    #[serde(default = "default_table_elements")]
    pub table_elements: u32,
    /// Cap on the size of the hook's answer.
    #[serde(default = "default_max_output_bytes")]
    pub max_output_bytes: u32,
    /// Passed to the hook with every call, as JSON.
    #[serde(default)]
    pub config: toml::Table,
}

/// Optional inputs: `holder` and `holdCount` are each an etcd read on the
/// request path; `mode` costs nothing but is sent only to a hook that asks,
/// since a hook built before it existed refuses unknown fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum HookInputKind {
    /// The key's current holder.
    Holder,
    /// How many locks of the class the caller's identity holds now.
    HoldCount,
    /// The Acquire's mode (exclusive or shared) and, for a semaphore class,
    /// its permits.
    Mode,
}

fn default_deadline_ms() -> u32 {
    DEFAULT_HOOK_DEADLINE_MS
}
fn default_memory_mib() -> u32 {
    DEFAULT_HOOK_MEMORY_MIB
}
fn default_table_elements() -> u32 {
    DEFAULT_HOOK_TABLE_ELEMENTS
}
fn default_max_output_bytes() -> u32 {
    DEFAULT_HOOK_MAX_OUTPUT_BYTES
}

impl ClassHook {
    pub fn needs(&self, input: HookInputKind) -> bool {
        self.inputs.contains(&input)
    }

    pub(crate) fn check(&self) -> Result<(), ClassError> {
        if self.module.trim().is_empty() || self.module.chars().any(char::is_control) {
            return Err(ClassError::HookModule);
        }
        let ranges = [
            ("deadlineMs", self.deadline_ms, MAX_HOOK_DEADLINE_MS),
            ("memoryMib", self.memory_mib, MAX_HOOK_MEMORY_MIB),
            (
                "tableElements",
                self.table_elements,
                MAX_HOOK_TABLE_ELEMENTS,
            ),
            (
                "maxOutputBytes",
                self.max_output_bytes,
                MAX_HOOK_MAX_OUTPUT_BYTES,
            ),
        ];
        for (field, value, max) in ranges {
            if !(1..=max).contains(&value) {
                return Err(ClassError::HookLimit { field, value, max });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_safe_ones() {
        let h: ClassHook = toml::from_str("module = \"x.wasm\"").unwrap();
        assert_eq!(h.deadline_ms, 10);
        assert_eq!(h.memory_mib, 16);
        assert_eq!(h.max_output_bytes, 16384);
        assert!(h.inputs.is_empty());
        h.check().unwrap();
    }

    #[test]
    fn limits_have_ceilings_and_unknown_fields_are_refused() {
        let h: ClassHook = toml::from_str("module = \"x.wasm\"\nmemoryMib = 65").unwrap();
        assert_eq!(
            h.check(),
            Err(ClassError::HookLimit {
                field: "memoryMib",
                value: 65,
                max: 64
            })
        );
        let err = toml::from_str::<ClassHook>("module = \"x\"\ndeadline = 3")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `deadline`"), "{err}");
        let h: ClassHook =
            toml::from_str("module = \"q.wasm\"\ninputs = [\"holdCount\"]\n[config]\nmaxHolds = 2")
                .unwrap();
        assert!(h.needs(HookInputKind::HoldCount));
        assert!(!h.needs(HookInputKind::Holder));
        assert!(!h.needs(HookInputKind::Mode));
        assert_eq!(
            h.config.get("maxHolds").and_then(|v| v.as_integer()),
            Some(2)
        );
        let m: ClassHook = toml::from_str("module = \"m.wasm\"\ninputs = [\"mode\"]").unwrap();
        assert!(m.needs(HookInputKind::Mode));
    }
}
