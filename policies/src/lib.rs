//! The reviewed policy model of Latchkey: what a lock key may look like, which
//! lock classes exist and what they promise (enforcement, TTL, posture on
//! quorum loss), and which SPIFFE identities may lock which key prefixes.
//!
//! A request flows through it like this: the caller's key is parsed into a
//! [`LockKey`] (rejecting anything outside the public key syntax), the
//! caller's SPIFFE ID and key go to [`PrefixGrants::authorise`] (one radix
//! trie lookup, longest prefix on whole path segments), and the requested
//! class name is resolved with [`PolicySet::class`] to get its TTL, tier and
//! enforcement. Which tier serves the key is decided by the key, not the
//! class: [`PolicySet::tier_of_key`] (ADR-07). The [`PolicySet`] itself is built once per policy change by
//! [`PolicySet::load_dir`] from the Git-reviewed `classes/` and `grants/`
//! TOML files (ADR-24), and refused whole if any file breaks a rule, so the
//! caller keeps serving the last good set. A fenced class is refused unless
//! the [`PauseTestResult`] it names passed for it, against its resource,
//! within the last year (ADR-17).
//!
//! The crate is pure: no async, no I/O beyond reading the policy files, and
//! no panics outside tests, because it is also compiled to
//! `wasm32-unknown-unknown` for the Envoy filter, where a panic takes down the
//! VM. [`PolicySet::from_files`] serves callers that get the file texts some
//! other way.

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing and
// `unreachable!` too.
#![deny(clippy::indexing_slicing, clippy::unreachable)]

mod class;
mod date;
mod error;
mod fnv;
mod grants;
mod hook;
mod key;
mod pause_test;
mod policy_set;
mod telemetry;

pub use class::{
    ADVISORY_MIN_TTL_SECONDS, ClassError, ClassKind, DEFAULT_MAX_WAITERS_PER_KEY,
    DEFAULT_TTL_SECONDS, Enforcement, FENCE_MARGIN_MS, Fairness, LockClass, MAX_CLASS_NAME_BYTES,
    MAX_CLASS_NAMESPACES, MAX_ELECTION_CANDIDATES, MAX_PERMITS, MAX_TTL_SECONDS,
    MAX_WAITERS_PER_KEY_LIMIT, MIN_TTL_SECONDS, NameError, OnQuorumLoss, ReviewReport, Tier,
    review,
};
pub use date::{Date, DateError};
pub use error::PolicyError;
pub use grants::{PrefixGrants, PrefixGrantsBuilder};
pub use hook::{
    ClassHook, DEFAULT_HOOK_DEADLINE_MS, DEFAULT_HOOK_MAX_OUTPUT_BYTES, DEFAULT_HOOK_MEMORY_MIB,
    DEFAULT_HOOK_TABLE_ELEMENTS, HookInputKind, MAX_HOOK_DEADLINE_MS, MAX_HOOK_MAX_OUTPUT_BYTES,
    MAX_HOOK_MEMORY_MIB, MAX_HOOK_TABLE_ELEMENTS,
};
pub use key::{ECHO_CHARS, KeyError, LockKey, MAX_KEY_BYTES};
pub use pause_test::{
    ClassPauseTest, PAUSE_TEST_MAX_CLOCK_SKEW, PAUSE_TEST_RESULT_VERSION, PAUSE_TEST_VALID_DAYS,
    PauseTestError, PauseTestEvidence, PauseTestOutcome, PauseTestResult, PauseTestStore,
    WriteOutcome, rfc3339,
};
pub use policy_set::{CLASSES_DIR, GRANTS_DIR, PolicyFile, PolicySet, fingerprint};
pub use telemetry::{MAX_LABEL_CHARS, metric_label, metric_namespace};
