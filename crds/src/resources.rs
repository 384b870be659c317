//! The LockClass and LockGrant custom resources (ADR-24): the same fields as
//! a `[[class]]` table and a `[[grant]]`/`[[operator]]` table in the policy
//! files, with an OpenAPI schema and CEL rules (`x-kubernetes-validations`)
//! that mirror the loader's rules, so the API server refuses at `kubectl
//! apply` / Argo CD sync time most of what `PolicySet::load_dir` would refuse.
//!
//! What CEL cannot see is left to the loader (and `latchctl classes check`):
//! whether the named pause-test result exists and passed, whether a waiver
//! has expired (CEL has no clock here), and whether two namespaces define the
//! same class name. Those are the rules where the two can differ; every other
//! rule is tested to agree on the same cases (tests/cel_agrees.rs).

use std::collections::BTreeMap;

use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// API group of both kinds.
pub const GROUP: &str = "latchkey.dev";
/// The only version served and stored.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of both kinds.
pub const API_VERSION: &str = "latchkey.dev/v1alpha1";

/// A lock class; `metadata.name` is the class name.
///
/// Field names and meanings are those of `[[class]]` in policies/README.md.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[kube(
    group = "latchkey.dev",
    version = "v1alpha1",
    kind = "LockClass",
    derive = "PartialEq",
    namespaced,
    shortname = "lc",
    category = "latchkey",
    doc = "A Latchkey lock class (ADR-24): enforcement, TTL, tier and posture, reviewed by the resource owner.",
    printcolumn = r#"{"name":"Tier","type":"string","jsonPath":".spec.tier"}"#,
    printcolumn = r#"{"name":"Enforcement","type":"string","jsonPath":".spec.enforcement"}"#,
    printcolumn = r#"{"name":"TTL","type":"integer","jsonPath":".spec.ttlSeconds"}"#,
    printcolumn = r#"{"name":"Risk owner","type":"string","jsonPath":".spec.riskOwner"}"#,
    printcolumn = r#"{"name":"Waiver expires","type":"string","jsonPath":".spec.waiverExpires"}"#,
    validation = Rule::new("self.metadata.name.size() <= 63")
        .message("class names are at most 63 bytes: metadata.name is the class name"),
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.enforcement != 'advisory' || self.ttlSeconds >= 30").message(
        "ttlSeconds is below the advisory floor of 30: a false expiry on an unfenced resource \
         can cause a duplicate write; raise ttlSeconds or fence the resource"
    ),
    validation = Rule::new(
        "self.enforcement != 'advisory' || (has(self.riskOwner) && has(self.waiverExpires))"
    )
    .message(
        "advisory classes need riskOwner (who accepts the risk of an unfenced lock, e.g. \
         \"team-reporting@example.com\") and waiverExpires (\"YYYY-MM-DD\")"
    ),
    validation = Rule::new(
        "self.enforcement != 'fenced' || (!has(self.riskOwner) && !has(self.waiverExpires))"
    )
    .message(
        "fenced classes take no riskOwner or waiverExpires: a waiver is only for advisory \
         classes; remove them or set enforcement: advisory"
    ),
    validation = Rule::new("self.enforcement != 'fenced' || has(self.pauseTest)").message(
        "enforcement: fenced needs a passing pause test: run `latchctl pause-test` against the \
         real resource and add pauseTest with its resource and result, or declare the class \
         advisory with riskOwner and waiverExpires"
    ),
    validation = Rule::new("self.enforcement != 'fenced' || self.onQuorumLoss != 'open'").message(
        "onQuorumLoss: open is not allowed for a fenced class: fenced classes claim mutual \
         exclusion, which an ungoverned grant breaks; use onQuorumLoss: closed"
    ),
    validation = Rule::new("!has(self.kind) || self.kind != 'election' || self.tier == 'coord'")
        .message(
            "an election class takes no tier: entity: elections run on the coord tier, whose \
             keys never move between shards; set tier: coord"
        ),
    validation = Rule::new(
        "!has(self.kind) || self.kind != 'election' || !has(self.onQuorumLoss) || self.onQuorumLoss != 'open'"
    )
    .message(
        "an election class takes no onQuorumLoss: open: a leadership is only ever granted by \
         the lock log, never from an arbiter's memory"
    ),
    validation = Rule::new(
        "!has(self.kind) || self.kind != 'election' || !has(self.fairness) || self.fairness == 'memory'"
    )
    .message(
        "an election class takes no fairness: candidates always wait in the lock log, \
         ordered by priority and then arrival"
    ),
    validation = Rule::new(
        "!has(self.kind) || self.kind != 'election' || !has(self.maxWaitersPerKey) || self.maxWaitersPerKey <= 1024"
    )
    .message(
        "an election class takes at most maxWaitersPerKey: 1024: an election's candidates are \
         read in one answer of at most 1024"
    ),
    validation = Rule::new(
        "!has(self.yieldToHigherPriority) || !self.yieldToHigherPriority || (has(self.kind) && self.kind == 'election')"
    )
    .message(
        "yieldToHigherPriority is for election classes (kind: election): a lock has no \
         priority to yield to; remove it or set kind: election"
    ),
    validation = Rule::new(
        "!has(self.kind) || self.kind != 'election' || !has(self.maxHoldsPerSubject)"
    )
    .message(
        "an election class takes no maxHoldsPerSubject: a subject's leaderships are bounded \
         by the arbiter's per-subject bounds, not by a class quota"
    ),
    validation = Rule::new(
        "!has(self.maxHoldsPerSubject) || !has(self.onQuorumLoss) || self.onQuorumLoss != 'open'"
    )
    .message(
        "maxHoldsPerSubject is not allowed with onQuorumLoss: open: a memory grant made \
         without the lock log cannot take a quota place in it, so the quota would not hold"
    ),
    validation = Rule::new(
        "!has(self.maxHoldSeconds) || self.maxHoldSeconds >= self.ttlSeconds"
    )
    .message(
        "maxHoldSeconds is below ttlSeconds: a hold cannot be ended sooner than its session \
         could expire"
    ),
    validation = Rule::new(
        "!has(self.maxHoldSeconds) || !has(self.onQuorumLoss) || self.onQuorumLoss != 'open'"
    )
    .message(
        "maxHoldSeconds is not allowed with onQuorumLoss: open: a memory grant made without \
         the lock log cannot be ended by it"
    ),
    validation = Rule::new(
        "!has(self.kind) || self.kind != 'election' || !has(self.maxHoldSeconds)"
    )
    .message(
        "an election class takes no maxHoldSeconds: a leadership ends by resigning, a \
         transfer, a force-release or its session"
    ),
    validation = Rule::new("!has(self.kind) || self.kind != 'semaphore' || has(self.permits)")
        .message(
            "a semaphore class (kind: semaphore) needs permits, the number of holds a key \
             carries at once, e.g. permits: 8"
        ),
    validation = Rule::new("!has(self.permits) || (has(self.kind) && self.kind == 'semaphore')")
        .message("permits is for semaphore classes: set kind: semaphore or remove permits"),
    validation = Rule::new(
        "!has(self.kind) || self.kind != 'semaphore' || !has(self.onQuorumLoss) || self.onQuorumLoss != 'open'"
    )
    .message(
        "a semaphore class takes no onQuorumLoss: open: a slot is only ever granted by the \
         lock log, which counts the permits"
    ),
    validation = Rule::new(
        "!has(self.kind) || self.kind != 'semaphore' || !has(self.fairness) || self.fairness == 'memory'"
    )
    .message(
        "a semaphore class takes no fairness: durable: a semaphore's waiters queue on the \
         arbiter they called (FIFO per arbiter)"
    ),
    validation = Rule::new(
        "!has(self.kind) || self.kind != 'semaphore' || !has(self.maxHoldsPerSubject)"
    )
    .message(
        "a semaphore class takes no maxHoldsPerSubject (yet): a quota place and a slot are \
         not yet taken in one transaction"
    ),
    validation = Rule::new("!has(self.kind) || self.kind != 'semaphore' || !has(self.hook)")
        .message(
            "a semaphore class takes no hook (yet): a hook's holder input is a lock's holder, \
             and a semaphore's slot holders are not shown to hooks"
        ),
    validation = Rule::new("!has(self.kind) || self.kind != 'election' || !has(self.hook)").message(
        "an election class takes no hook: class hooks run before lock grants only, not before \
         a leadership"
    ),
    validation = Rule::new(
        "self.tier == 'coord' || !has(self.namespaces) || size(self.namespaces) == 0"
    )
    .message(
        "namespaces is only for coord-tier classes: an entity-tier class serves every \
         namespace no coord-tier class names; remove namespaces or set tier: coord"
    ),
)]
pub struct LockClassSpec {
    /// What the class's keys are: `lock` (Acquire, the default) or
    /// `election` (latchkey.election.v1: Campaign and the rest; coord tier
    /// only, docs/elections.md).
    #[serde(default, skip_serializing_if = "ClassKind::is_lock")]
    pub kind: ClassKind,
    pub tier: Tier,
    /// Coord tier only: the key namespaces (first key segments) the coord
    /// tier serves (ADR-07). Keys in them are coord-tier keys, every other
    /// key an entity-tier key. Each is listed once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 512)))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    #[x_kube(validation = Rule::new(
        "self.all(n, n.size() <= 512 && n.matches('^[^/]+$') && n != '.' && n != '..' && \
         !n.matches('[\\\\p{Cc}\\\\p{Cf}\\\\p{Zl}\\\\p{Zp}]'))"
    ).message(
        "a namespace is not one key segment: a namespace is the first segment of a key, \
         printable, without '/', not '.' or '..', at most 512 bytes, e.g. \"leader\" for \
         \"leader/scheduler\""
    ))]
    pub namespaces: Vec<String>,
    pub enforcement: Enforcement,
    #[serde(default = "default_ttl_seconds")]
    #[schemars(range(min = 5, max = 300))]
    #[x_kube(validation = Rule::new("self >= 5 && self <= 300").message(
        "ttlSeconds is outside the platform range 5..=300: choose a value in range (the default is 15)"
    ))]
    pub ttl_seconds: u32,
    #[serde(default)]
    pub on_quorum_loss: OnQuorumLoss,
    #[serde(default)]
    pub fairness: Fairness,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    #[x_kube(validation = Rule::new(PRINTABLE_NOT_BLANK).message(
        "riskOwner must name a person or team in printable text, e.g. \"team-reporting@example.com\""
    ))]
    pub risk_owner: Option<String>,
    /// The last day (UTC) the waiver holds, `YYYY-MM-DD`. Whether it has
    /// passed is checked by the loader: CEL has no clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"), length(max = 10))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$')"
    ).message("waiverExpires must be a date, \"YYYY-MM-DD\""))]
    pub waiver_expires: Option<String>,
    #[serde(default = "default_max_waiters_per_key")]
    #[schemars(range(min = 1, max = 10_000))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 10000")
        .message("maxWaitersPerKey is outside 1..=10000"))]
    pub max_waiters_per_key: u32,
    /// The most keys of the class one grant subject holds at once,
    /// enforced inside every grant transaction (lock classes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 256")
        .message("maxHoldsPerSubject is outside 1..=256"))]
    pub max_holds_per_subject: Option<u32>,
    /// Semaphore classes only (and required there): how many holds a key of
    /// the class carries at once, each in its own slot `0..permits`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 256")
        .message("permits is outside 1..=256"))]
    pub permits: Option<u32>,
    /// The longest one hold of the class lasts from its grant, however it
    /// renews: it then ends as an expiry does (ttlSeconds..=604800).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 5, max = 604_800))]
    #[x_kube(validation = Rule::new("self >= 5 && self <= 604800")
        .message("maxHoldSeconds is outside ttlSeconds..=604800 (a week)"))]
    pub max_hold_seconds: Option<u32>,
    /// Election classes only: a leader is asked (Observe's
    /// TransferRequested) to yield when a higher-priority candidate stands.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub yield_to_higher_priority: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub description: Option<String>,
    /// A Wasm hook run before every grant of the class (policies/HOOKS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hook: Option<HookSpec>,
    /// Where the class's pause-test result is (ADR-17): required for a
    /// fenced class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_test: Option<PauseTestSpec>,
}

/// CEL: at least one visible character, and no control, format (invisible)
/// or line/paragraph separator characters, as the loader's printable rule.
const PRINTABLE_NOT_BLANK: &str = "self.matches('[^\\\\p{Z}\\\\p{Cc}]') && !self.matches('[\\\\p{Cc}\\\\p{Cf}\\\\p{Zl}\\\\p{Zp}]')";

/// `hook` of a LockClass: `[class.hook]` of a class file.
#[derive(KubeSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HookSpec {
    /// Path of the `.wasm` file, relative to the policy directory.
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("self.matches('[^\\\\p{Z}\\\\p{Cc}]') && !self.matches('\\\\p{Cc}')")
        .message("hook.module must name a .wasm file (a path relative to the policy directory)"))]
    pub module: String,
    #[serde(default)]
    pub inputs: Vec<HookInput>,
    #[serde(default = "default_hook_deadline_ms")]
    #[schemars(range(min = 1, max = 50))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 50")
        .message("hook.deadlineMs is outside the platform range 1..=50"))]
    pub deadline_ms: u32,
    #[serde(default = "default_hook_memory_mib")]
    #[schemars(range(min = 1, max = 64))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 64")
        .message("hook.memoryMib is outside the platform range 1..=64"))]
    pub memory_mib: u32,
    #[serde(default = "default_hook_table_elements")]
    #[schemars(range(min = 1, max = 100_000))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100000")
        .message("hook.tableElements is outside the platform range 1..=100000"))]
    pub table_elements: u32,
    #[serde(default = "default_hook_max_output_bytes")]
    #[schemars(range(min = 1, max = 65_536))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65536")
        .message("hook.maxOutputBytes is outside the platform range 1..=65536"))]
    pub max_output_bytes: u32,
    /// Passed to the hook with every call, as JSON; any object.
    #[serde(default)]
    #[schemars(schema_with = "any_object")]
    pub config: BTreeMap<String, serde_json::Value>,
}

/// `pauseTest` of a LockClass: `[class.pauseTest]` of a class file.
#[derive(KubeSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PauseTestSpec {
    /// The guarded resource, e.g. `postgresql:ledger.postings`.
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new(PRINTABLE_NOT_BLANK).message(
        "pauseTest.resource must name the guarded resource in printable text, e.g. \
         \"postgresql:ledger.postings\""
    ))]
    pub resource: String,
    /// Path of the result JSON, relative to the policy directory.
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new(
        "self.endsWith('.json') && !self.startsWith('/') && !self.matches('(^|/)\\\\.\\\\.(/|$)') && \
         self.matches('[^\\\\p{Z}\\\\p{Cc}]') && !self.matches('[\\\\p{Cc}\\\\p{Cf}\\\\p{Zl}\\\\p{Zp}]')"
    ).message(
        "pauseTest.result must be a .json path inside the policy directory, relative to it, e.g. \
         \"pause-tests/payments-ledger.json\""
    ))]
    pub result: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub schema_version: Option<String>,
}

/// A grant of key prefixes to one SPIFFE identity, and/or the operator role.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[kube(
    group = "latchkey.dev",
    version = "v1alpha1",
    kind = "LockGrant",
    derive = "PartialEq",
    namespaced,
    shortname = "lg",
    category = "latchkey",
    doc = "A Latchkey prefix grant (ADR-19, ADR-24): which key prefixes one SPIFFE identity may lock, and whether it has the operator role.",
    printcolumn = r#"{"name":"Identity","type":"string","jsonPath":".spec.identity"}"#,
    printcolumn = r#"{"name":"Operator","type":"boolean","jsonPath":".spec.operator"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("self.operator || self.prefixes.size() > 0").message(
    "a grant lists no prefixes: give at least one, e.g. prefixes: [payments], or set operator: true"
))]
#[x_kube(validation = Rule::new("!(self.operator && self.identity.endsWith('/*'))").message(
    "the operator role goes to one identity, never to a pattern: name the operator's SPIFFE ID"
))]
pub struct LockGrantSpec {
    /// A SPIFFE ID, e.g. `spiffe://example.org/workload/payments`, or a
    /// pattern over the path, e.g. `spiffe://example.org/ns/payments/sa/ledger/*`
    /// (every ID with at least one more segment below it: per-pod IDs).
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[Ss][Pp][Ii][Ff][Ff][Ee]://[A-Za-z0-9._-]+((/[A-Za-z0-9._-]+)*|(/[A-Za-z0-9._-]+)+/\\\\*)$') && !self.matches('/\\\\.\\\\.?(/|$)')"
    ).message(
        "identity is not a SPIFFE ID or a pattern: identities look like \"spiffe://trust-domain/workload/name\", patterns like \"spiffe://trust-domain/ns/payments/sa/ledger/*\""
    ))]
    pub identity: String,
    /// Key prefixes, matched on whole segments: `payments` grants
    /// `payments/invoice/42`, not `paymentsx`. One trailing `/` is allowed.
    #[serde(default)]
    #[schemars(length(max = 256), inner(length(max = 513)))]
    #[x_kube(validation = Rule::new(
        "self.all(p, p.size() <= 513 && p.matches('^[^/]+(/[^/]+)*/?$') && \
         !p.matches('(^|/)\\\\.\\\\.?(/|$)') && !p.matches('[\\\\p{Cc}\\\\p{Cf}\\\\p{Zl}\\\\p{Zp}]'))"
    ).message(
        "a prefix is not a lock key: keys are '/'-separated printable names like \
         \"payments/invoice\", without empty, '.' or '..' segments, at most 512 bytes"
    ))]
    pub prefixes: Vec<String>,
    /// The classes the prefixes are granted for; absent: any class. At
    /// least one when present, each a LockClass of the policy (checked by
    /// the loader: CEL sees one object at a time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64), inner(length(max = 63)))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    #[x_kube(validation = Rule::new("self.all(c, c.size() <= 63)").message(
        "a class name is at most 63 bytes: list the names of LockClass objects"
    ))]
    pub classes: Option<Vec<String>>,
    /// The operator role for the admin API (force-release and the like).
    #[serde(default)]
    pub operator: bool,
}

/// Which etcd cluster tier serves the class (ADR-07).
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Coord,
    Entity,
}

/// Whether the guarded resource checks the fencing token (ADR-01).
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Enforcement {
    Fenced,
    Advisory,
}

/// What a class's keys are.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ClassKind {
    #[default]
    Lock,
    Election,
    Semaphore,
}

impl ClassKind {
    pub fn is_lock(&self) -> bool {
        *self == ClassKind::Lock
    }
}

/// What the arbiter does without an etcd quorum (ADR-04).
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnQuorumLoss {
    #[default]
    Closed,
    Open,
}

/// How waiters are queued (ADR-14): `memory` (FIFO in one arbiter's
/// memory) or `durable` (waiter records in etcd, FIFO across arbiters and
/// restarts, two more consensus writes per waiting call).
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Fairness {
    #[default]
    Memory,
    Durable,
}

/// Optional hook inputs: `holder` and `holdCount` are each an etcd read on
/// the request path; `mode` (the Acquire's mode, and a semaphore's permits)
/// costs nothing.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum HookInput {
    Holder,
    HoldCount,
    Mode,
}

fn default_ttl_seconds() -> u32 {
    latchkey_policies::DEFAULT_TTL_SECONDS
}
fn default_max_waiters_per_key() -> u32 {
    latchkey_policies::DEFAULT_MAX_WAITERS_PER_KEY
}
fn default_hook_deadline_ms() -> u32 {
    latchkey_policies::DEFAULT_HOOK_DEADLINE_MS
}
fn default_hook_memory_mib() -> u32 {
    latchkey_policies::DEFAULT_HOOK_MEMORY_MIB
}
fn default_hook_table_elements() -> u32 {
    latchkey_policies::DEFAULT_HOOK_TABLE_ELEMENTS
}
fn default_hook_max_output_bytes() -> u32 {
    latchkey_policies::DEFAULT_HOOK_MAX_OUTPUT_BYTES
}

/// A structural-schema object that keeps whatever it is given.
fn any_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// The committed CRD files, by file name under deploy/crds/, as YAML.
pub fn crd_files() -> Vec<(&'static str, String)> {
    let header = "# Generated by `cargo run -p latchkey-crds --bin latchkey-crd-gen`; do not edit.\n\
                  # Source: crds/src/resources.rs. Docs: deploy/crds/README.md.\n";
    let render = |crd| {
        let mut value = serde_json::to_value(crd).unwrap_or_default();
        tidy(&mut value);
        // Rendering plain JSON data as YAML cannot fail.
        format!(
            "{header}{}",
            serde_norway::to_string(&value).unwrap_or_default()
        )
    };
    vec![
        ("lockclass.yaml", render(LockClass::crd())),
        ("lockgrant.yaml", render(LockGrant::crd())),
    ]
}

/// Drops what the API server would not use: `nullable` (an absent optional
/// field and a null one then mean the same, both pruned before CEL runs),
/// schemars' Rust integer formats, and the Rust type name as `title`.
fn tidy(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.remove("nullable");
            map.remove("title");
            if map
                .get("format")
                .and_then(|f| f.as_str())
                .is_some_and(|f| f.starts_with("uint") || f.starts_with("int"))
            {
                map.remove("format");
            }
            map.values_mut().for_each(tidy);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(tidy),
        _ => {}
    }
}
