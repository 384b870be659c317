//! One list of good and bad classes and grants, three judges:
//!
//! 1. the loader, on a policy directory holding the case as TOML
//!    (`PolicySet::load_dir_at`, pause-test results included);
//! 2. the manifest check, on the same case as a LockClass/LockGrant manifest
//!    (`check_manifests`), which must give the loader's verdict *and*
//!    message;
//! 3. the committed CRDs' schema and CEL rules (deploy/crds/*.yaml),
//!    evaluated offline with the `cel` crate after applying the schema's
//!    defaults, as the API server does. They must give the loader's verdict,
//!    except where CEL cannot know (a waiver's expiry needs a clock; a
//!    pause-test result is a file): those cases are marked and pinned.
//!
//! No API server runs here, so the CEL engine is cel-rust rather than
//! cel-go; the rules use only core CEL (has, size, all, matches, startsWith,
//! endsWith) and RE2-compatible regexes, which both implement.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use latchkey_crds::{ManifestFile, check_manifests};
use latchkey_policies::{
    PauseTestEvidence, PauseTestOutcome, PauseTestResult, PolicySet, WriteOutcome,
};
use serde_json::{Value as J, json};

const RESOURCE: &str = "postgresql:test.rows";

/// Noon, 2026-01-15 UTC: a fixed clock for the waiver and pause-test rules.
fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_768_478_400)
}

/// How CEL's verdict relates to the loader's for a case.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Cel {
    /// Same verdict as the loader.
    Agrees,
    /// The loader refuses what CEL cannot see (no clock, no files): the API
    /// server accepts, the loader (and `latchctl classes check`) refuses.
    LoaderOnly,
}

struct Case {
    what: &'static str,
    name: &'static str,
    spec: J,
    cel: Cel,
}

fn fenced(extra: J) -> J {
    let mut spec = json!({
        "tier": "coord",
        "enforcement": "fenced",
        "pauseTest": {"resource": RESOURCE, "result": "pause-tests/c.json"}
    });
    merge(&mut spec, extra);
    spec
}

fn advisory(extra: J) -> J {
    let mut spec = json!({
        "tier": "entity",
        "enforcement": "advisory",
        "ttlSeconds": 60,
        "riskOwner": "team@example.com",
        "waiverExpires": "2027-06-30"
    });
    merge(&mut spec, extra);
    spec
}

/// Sets each key of `extra` on `spec`; a null removes the key.
fn merge(spec: &mut J, extra: J) {
    let (Some(spec), J::Object(extra)) = (spec.as_object_mut(), extra) else {
        panic!("objects only");
    };
    for (k, v) in extra {
        if v.is_null() {
            spec.remove(&k);
        } else {
            spec.insert(k, v);
        }
    }
}

fn class_cases() -> Vec<Case> {
    let ok = |what, spec| Case {
        what,
        name: "c",
        spec,
        cel: Cel::Agrees,
    };
    vec![
        ok("fenced with defaults", fenced(json!({}))),
        ok("advisory", advisory(json!({}))),
        ok(
            "ttl at the bottom of the range",
            fenced(json!({"ttlSeconds": 5})),
        ),
        ok(
            "ttl at the top of the range",
            fenced(json!({"ttlSeconds": 300})),
        ),
        ok("ttl below the range", fenced(json!({"ttlSeconds": 4}))),
        ok("ttl zero", fenced(json!({"ttlSeconds": 0}))),
        ok("ttl above the range", fenced(json!({"ttlSeconds": 301}))),
        ok("advisory at its floor", advisory(json!({"ttlSeconds": 30}))),
        ok(
            "advisory below its floor",
            advisory(json!({"ttlSeconds": 29})),
        ),
        ok(
            "advisory with the default ttl",
            advisory(json!({"ttlSeconds": null})),
        ),
        ok(
            "advisory without riskOwner",
            advisory(json!({"riskOwner": null})),
        ),
        ok(
            "advisory without waiverExpires",
            advisory(json!({"waiverExpires": null})),
        ),
        ok(
            "advisory without either",
            advisory(json!({"riskOwner": null, "waiverExpires": null})),
        ),
        ok(
            "advisory, blank riskOwner",
            advisory(json!({"riskOwner": "  "})),
        ),
        ok(
            "advisory, riskOwner with a tab",
            advisory(json!({"riskOwner": "a\tb"})),
        ),
        ok(
            "advisory, riskOwner with a zero-width space",
            advisory(json!({"riskOwner": "team\u{200b}@example.com"})),
        ),
        ok(
            "advisory, unicode riskOwner",
            advisory(json!({"riskOwner": "équipe zürich"})),
        ),
        ok(
            "advisory, bad waiver date",
            advisory(json!({"waiverExpires": "2027-13-01"})),
        ),
        Case {
            what: "advisory, expired waiver",
            name: "c",
            spec: advisory(json!({"waiverExpires": "2026-01-14"})),
            cel: Cel::LoaderOnly,
        },
        ok(
            "advisory, waiver ending today",
            advisory(json!({"waiverExpires": "2026-01-15"})),
        ),
        ok(
            "advisory open on quorum loss",
            advisory(json!({"onQuorumLoss": "open"})),
        ),
        ok(
            "advisory naming a pause test",
            advisory(
                json!({"pauseTest": {"resource": RESOURCE, "result": "pause-tests/none.json"}}),
            ),
        ),
        ok(
            "fenced with riskOwner",
            fenced(json!({"riskOwner": "x@example.com"})),
        ),
        ok(
            "fenced with waiverExpires",
            fenced(json!({"waiverExpires": "2027-01-01"})),
        ),
        ok(
            "fenced open on quorum loss",
            fenced(json!({"onQuorumLoss": "open"})),
        ),
        ok(
            "fenced closed on quorum loss",
            fenced(json!({"onQuorumLoss": "closed"})),
        ),
        ok(
            "fenced without a pause test",
            fenced(json!({"pauseTest": null})),
        ),
        Case {
            what: "fenced, pause-test result missing",
            name: "c",
            spec: fenced(
                json!({"pauseTest": {"resource": RESOURCE, "result": "pause-tests/none.json"}}),
            ),
            cel: Cel::LoaderOnly,
        },
        Case {
            what: "fenced, result for another resource",
            name: "c",
            spec: fenced(
                json!({"pauseTest": {"resource": "postgresql:other.rows", "result": "pause-tests/c.json"}}),
            ),
            cel: Cel::LoaderOnly,
        },
        ok(
            "pause test result outside the directory",
            fenced(json!({"pauseTest": {"resource": RESOURCE, "result": "../c.json"}})),
        ),
        ok(
            "pause test result absolute",
            fenced(json!({"pauseTest": {"resource": RESOURCE, "result": "/c.json"}})),
        ),
        ok(
            "pause test result not json",
            fenced(json!({"pauseTest": {"resource": RESOURCE, "result": "pause-tests/c.txt"}})),
        ),
        ok(
            "pause test blank resource",
            fenced(json!({"pauseTest": {"resource": " ", "result": "pause-tests/c.json"}})),
        ),
        ok("durable fairness", fenced(json!({"fairness": "durable"}))),
        ok("memory fairness", fenced(json!({"fairness": "memory"}))),
        ok("max waiters zero", fenced(json!({"maxWaitersPerKey": 0}))),
        ok(
            "a hold of at most 600 s",
            fenced(json!({"maxHoldSeconds": 600})),
        ),
        ok(
            "a hold of at most the ttl",
            fenced(json!({"maxHoldSeconds": 15})),
        ),
        ok(
            "a hold of at most a week",
            fenced(json!({"maxHoldSeconds": 604_800})),
        ),
        ok(
            "a max hold below the ttl",
            fenced(json!({"maxHoldSeconds": 14})),
        ),
        ok(
            "a max hold above a week",
            fenced(json!({"maxHoldSeconds": 604_801})),
        ),
        ok(
            "a max hold on a class open on quorum loss",
            advisory(json!({"maxHoldSeconds": 600, "onQuorumLoss": "open"})),
        ),
        ok(
            "a max hold on an election class",
            fenced(json!({"kind": "election", "maxHoldSeconds": 600})),
        ),
        ok("a quota of 2", fenced(json!({"maxHoldsPerSubject": 2}))),
        ok("a quota of 256", fenced(json!({"maxHoldsPerSubject": 256}))),
        ok("a quota of 0", fenced(json!({"maxHoldsPerSubject": 0}))),
        ok("a quota of 257", fenced(json!({"maxHoldsPerSubject": 257}))),
        ok(
            "a quota on a class open on quorum loss",
            advisory(json!({"maxHoldsPerSubject": 2, "onQuorumLoss": "open"})),
        ),
        ok(
            "a quota on an election class",
            fenced(json!({"kind": "election", "maxHoldsPerSubject": 2})),
        ),
        ok(
            "a semaphore of 8",
            fenced(json!({"kind": "semaphore", "permits": 8})),
        ),
        ok(
            "a semaphore of 256",
            fenced(json!({"kind": "semaphore", "permits": 256})),
        ),
        ok(
            "a semaphore of 0",
            fenced(json!({"kind": "semaphore", "permits": 0})),
        ),
        ok(
            "a semaphore of 257",
            fenced(json!({"kind": "semaphore", "permits": 257})),
        ),
        ok(
            "a semaphore without permits",
            fenced(json!({"kind": "semaphore"})),
        ),
        ok("permits on a lock", fenced(json!({"permits": 2}))),
        ok(
            "permits on an election",
            fenced(json!({"kind": "election", "permits": 2})),
        ),
        ok(
            "a semaphore open on quorum loss",
            advisory(json!({"kind": "semaphore", "permits": 2, "onQuorumLoss": "open"})),
        ),
        ok(
            "a durable semaphore",
            fenced(json!({"kind": "semaphore", "permits": 2, "fairness": "durable"})),
        ),
        ok(
            "a semaphore with a hook",
            fenced(json!({"kind": "semaphore", "permits": 2, "hook": {"module": "h.wasm"}})),
        ),
        ok(
            "a semaphore with a quota",
            fenced(json!({"kind": "semaphore", "permits": 2, "maxHoldsPerSubject": 1})),
        ),
        ok(
            "max waiters at the limit",
            fenced(json!({"maxWaitersPerKey": 10000})),
        ),
        ok(
            "max waiters over the limit",
            fenced(json!({"maxWaitersPerKey": 10001})),
        ),
        ok(
            "hook with defaults",
            fenced(json!({"hook": {"module": "h.wasm"}})),
        ),
        ok(
            "hook memory over the ceiling",
            fenced(json!({"hook": {"module": "h.wasm", "memoryMib": 65}})),
        ),
        ok(
            "hook deadline zero",
            fenced(json!({"hook": {"module": "h.wasm", "deadlineMs": 0}})),
        ),
        ok(
            "hook deadline at the ceiling",
            fenced(json!({"hook": {"module": "h.wasm", "deadlineMs": 50}})),
        ),
        ok(
            "hook output over the ceiling",
            fenced(json!({"hook": {"module": "h.wasm", "maxOutputBytes": 65537}})),
        ),
        ok(
            "hook tables over the ceiling",
            fenced(json!({"hook": {"module": "h.wasm", "tableElements": 100001}})),
        ),
        ok(
            "hook blank module",
            fenced(json!({"hook": {"module": " "}})),
        ),
        ok(
            "hook with config",
            fenced(
                json!({"hook": {"module": "h.wasm", "inputs": ["holdCount"], "config": {"maxHolds": 2, "w": [{"days": ["sat"]}]}}}),
            ),
        ),
        Case {
            what: "name at 63 bytes",
            name: "a123456789012345678901234567890123456789012345678901234567890bc",
            spec: fenced(json!({"pauseTest": null})),
            cel: Cel::Agrees,
        },
        Case {
            what: "name over 63 bytes",
            name: "a123456789012345678901234567890123456789012345678901234567890bcd",
            spec: fenced(json!({"pauseTest": null})),
            cel: Cel::Agrees,
        },
        // ADR-07: only a coord-tier class names the key namespaces it serves.
        ok(
            "coord class with namespaces",
            fenced(json!({"namespaces": ["leader", "sched"]})),
        ),
        ok(
            "coord class with an empty namespaces list",
            fenced(json!({"namespaces": []})),
        ),
        ok(
            "entity class with namespaces",
            advisory(json!({"namespaces": ["batch"]})),
        ),
        ok(
            "an election class on the entity tier",
            advisory(json!({"kind": "election"})),
        ),
        ok(
            "an election class on the coord tier",
            fenced(json!({"kind": "election"})),
        ),
        ok(
            "an election class that opens on quorum loss",
            advisory(json!({"kind": "election", "tier": "coord", "onQuorumLoss": "open"})),
        ),
        ok(
            "an election class with durable fairness",
            fenced(json!({"kind": "election", "fairness": "durable"})),
        ),
        ok(
            "an election class with 1024 candidates",
            fenced(json!({"kind": "election", "maxWaitersPerKey": 1024})),
        ),
        ok(
            "an election class with 1025 candidates",
            fenced(json!({"kind": "election", "maxWaitersPerKey": 1025})),
        ),
        ok(
            "an election class that yields to a higher priority",
            fenced(json!({"kind": "election", "yieldToHigherPriority": true})),
        ),
        ok(
            "a lock class that yields to a higher priority",
            fenced(json!({"yieldToHigherPriority": true})),
        ),
        ok(
            "an election class with a hook",
            fenced(json!({"kind": "election", "hook": {"module": "hooks/quota.wasm"}})),
        ),
        ok(
            "entity class with an empty namespaces list",
            advisory(json!({"namespaces": []})),
        ),
        ok(
            "coord class, a namespace with a '/'",
            fenced(json!({"namespaces": ["leader/x"]})),
        ),
        ok(
            "coord class, an empty namespace",
            fenced(json!({"namespaces": ["leader", ""]})),
        ),
        ok(
            "coord class, a '..' namespace",
            fenced(json!({"namespaces": [".."]})),
        ),
        ok(
            "coord class, a namespace with a zero-width space",
            fenced(json!({"namespaces": ["lead\u{200b}er"]})),
        ),
        ok(
            "coord class, a unicode namespace",
            fenced(json!({"namespaces": ["zürich", "a.b"]})),
        ),
        ok(
            "coord class, a namespace listed twice",
            fenced(json!({"namespaces": ["leader", "sched", "leader"]})),
        ),
        ok(
            "coord class, 64 namespaces",
            fenced(json!({"namespaces": (0..64).map(|i| format!("ns{i}")).collect::<Vec<_>>()})),
        ),
        ok(
            "coord class, 65 namespaces",
            fenced(json!({"namespaces": (0..65).map(|i| format!("ns{i}")).collect::<Vec<_>>()})),
        ),
        Case {
            what: "dotted name",
            name: "payments-ledger.v2",
            spec: advisory(json!({})),
            cel: Cel::Agrees,
        },
    ]
}

struct GrantCase {
    what: &'static str,
    identity: &'static str,
    prefixes: Vec<&'static str>,
}

fn grant_cases() -> Vec<GrantCase> {
    let g = |what, identity, prefixes| GrantCase {
        what,
        identity,
        prefixes,
    };
    vec![
        g(
            "plain",
            "spiffe://td/workload/a",
            vec!["payments", "shared/cron"],
        ),
        g(
            "trailing slash allowed",
            "spiffe://td/workload/a",
            vec!["payments/"],
        ),
        g("no prefixes", "spiffe://td/workload/a", vec![]),
        g("not spiffe", "https://td/workload/a", vec!["p"]),
        g("no trust domain", "spiffe:///workload/a", vec!["p"]),
        g("empty path segment", "spiffe://td//a", vec!["p"]),
        g("dot path segment", "spiffe://td/./a", vec!["p"]),
        g("dot-dot path segment", "spiffe://td/a/..", vec!["p"]),
        g("bad path char", "spiffe://td/a b", vec!["p"]),
        g("trailing slash identity", "spiffe://td/a/", vec!["p"]),
        g("trust domain only", "spiffe://td", vec!["p"]),
        g("uppercase path", "spiffe://td/Work_load/A-1.x", vec!["p"]),
        g("uppercase trust domain", "spiffe://TD.example/a", vec!["p"]),
        g("uppercase scheme", "SPIFFE://td/a", vec!["p"]),
        g("port in trust domain", "spiffe://td:443/a", vec!["p"]),
        g("query in path", "spiffe://td/a?x=1", vec!["p"]),
        g("leading slash prefix", "spiffe://td/a", vec!["/p"]),
        g("double slash prefix", "spiffe://td/a", vec!["p//q"]),
        g("two trailing slashes", "spiffe://td/a", vec!["p//"]),
        g("dot prefix segment", "spiffe://td/a", vec!["p/./q"]),
        g("dot-dot prefix", "spiffe://td/a", vec![".."]),
        g(
            "dotted names are fine",
            "spiffe://td/a",
            vec!["a.b/..c/.d."],
        ),
        g("control char prefix", "spiffe://td/a", vec!["p\u{7}q"]),
        g("bidi char prefix", "spiffe://td/a", vec!["p\u{202e}q"]),
        g("unicode prefix", "spiffe://td/a", vec!["zürich/ledger"]),
        g("empty prefix", "spiffe://td/a", vec![""]),
        g("just a slash", "spiffe://td/a", vec!["/"]),
        g(
            "per-pod pattern",
            "spiffe://td/ns/payments/sa/ledger/*",
            vec!["payments"],
        ),
        g("trust-domain pattern", "spiffe://td/*", vec!["p"]),
        g("star inside a segment", "spiffe://td/a*", vec!["p"]),
        g("star in the middle", "spiffe://td/a/*/b", vec!["p"]),
        g("double star", "spiffe://td/a/**", vec!["p"]),
        g(
            "pattern after an empty segment",
            "spiffe://td/a//*",
            vec!["p"],
        ),
        g("dot-dot pattern", "spiffe://td/a/../*", vec!["p"]),
    ]
}

// ---------------------------------------------------------------------------
// Judges 1 and 2

/// A policy directory with `classes/c.toml`, `grants/g.toml` and a passing
/// pause-test result for class `c` (and for every case's class name).
fn policy_dir(class_toml: &str, grant_toml: &str, class_name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for sub in ["classes", "grants", "pause-tests"] {
        std::fs::create_dir(dir.path().join(sub)).unwrap();
    }
    std::fs::write(dir.path().join("classes/c.toml"), class_toml).unwrap();
    std::fs::write(dir.path().join("grants/g.toml"), grant_toml).unwrap();
    let finished = now() - Duration::from_secs(86_400);
    let result = PauseTestResult {
        version: 1,
        class: class_name.into(),
        resource: RESOURCE.into(),
        resource_schema_version: None,
        started_at: finished - Duration::from_secs(21),
        finished_at: finished,
        outcome: PauseTestOutcome::Pass,
        kit: "unit test fixture (not evidence)".into(),
        evidence: PauseTestEvidence {
            ttl_seconds: 10,
            paused_for_ms: 12_400,
            first_write: WriteOutcome::Accepted,
            second_holder_write: WriteOutcome::Accepted,
            second_token_greater: true,
            stale_write_after_resume: WriteOutcome::Rejected,
            final_row_from: "second-holder".into(),
            stale_proclaim_after_resume: None,
        },
        failure: None,
        store: None,
    };
    std::fs::write(
        dir.path().join("pause-tests/c.json"),
        serde_json::to_string(&result).unwrap(),
    )
    .unwrap();
    dir
}

const GOOD_CLASS: &str = "[[class]]\nname = \"base\"\ntier = \"coord\"\nenforcement = \"advisory\"\n\
    ttlSeconds = 30\nriskOwner = \"t@example.com\"\nwaiverExpires = \"2027-01-01\"\n";

fn class_toml(name: &str, spec: &J) -> String {
    let mut table = spec.clone();
    table
        .as_object_mut()
        .unwrap()
        .insert("name".into(), json!(name));
    toml::to_string(&json!({ "class": [table] })).unwrap()
}

fn manifest(kind: &str, name: &str, spec: &J) -> J {
    json!({
        "apiVersion": "latchkey.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": spec,
    })
}

fn yaml(docs: &[J]) -> String {
    docs.iter()
        .map(|d| format!("---\n{}", serde_norway::to_string(d).unwrap()))
        .collect()
}

/// The loader's verdict, its message without the file path.
fn loader(dir: &Path, file: &str) -> Result<PolicySet, String> {
    PolicySet::load_dir_at(dir, now()).map_err(|e| {
        let msg = e.to_string();
        let prefix = format!("{}: ", dir.join(file).display());
        msg.strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("loader message without its file: {msg}"))
            .to_owned()
    })
}

/// The manifest check's verdict, its message without the location.
fn manifests(dir: &Path, text: &str) -> Result<PolicySet, String> {
    let path = dir.join("m.yaml");
    check_manifests(&[ManifestFile { path: &path, text }], Some(dir), now())
        .map_err(|e| e.to_string())
}

#[test]
fn manifests_get_the_loaders_verdict_and_message_for_every_class_case() {
    for case in class_cases() {
        let dir = policy_dir(&class_toml(case.name, &case.spec), "", case.name);
        let by_loader = loader(dir.path(), "classes/c.toml");
        let text = yaml(&[manifest("LockClass", case.name, &case.spec)]);
        let by_manifest = manifests(dir.path(), &text);
        match (&by_loader, &by_manifest) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{}", case.what),
            (Err(loader_msg), Err(manifest_msg)) => {
                let at = format!(
                    "{}, document 1 (LockClass team-a/{}): ",
                    dir.path().join("m.yaml").display(),
                    case.name
                );
                let manifest_msg = manifest_msg
                    .strip_prefix(&at)
                    .unwrap_or_else(|| panic!("{}: {manifest_msg} is not at {at}", case.what));
                if loader_msg.starts_with("TOML parse error") {
                    // A value of the wrong shape: the same reason, without
                    // the TOML line and column.
                    let reason = loader_msg.trim_end().lines().last().unwrap();
                    assert_eq!(
                        manifest_msg,
                        format!("LockClass spec: {reason}"),
                        "{}",
                        case.what
                    );
                } else {
                    assert_eq!(
                        manifest_msg, loader_msg,
                        "{}: the manifest message must be the loader's, at the object",
                        case.what
                    );
                }
            }
            _ => panic!(
                "{}: loader says {by_loader:?}, manifest check says {by_manifest:?}",
                case.what
            ),
        }
    }
}

#[test]
fn manifests_get_the_loaders_verdict_and_message_for_every_grant_case() {
    for case in grant_cases() {
        let grant_toml = toml::to_string(&json!({
            "grant": [{"identity": case.identity, "prefixes": case.prefixes}]
        }))
        .unwrap();
        let dir = policy_dir(GOOD_CLASS, &grant_toml, "base");
        let by_loader = loader(dir.path(), "grants/g.toml");
        let base = toml::from_str::<toml::Table>(GOOD_CLASS).unwrap();
        let mut base_spec = serde_json::to_value(&base["class"][0]).unwrap();
        base_spec.as_object_mut().unwrap().remove("name");
        let text = yaml(&[
            manifest("LockClass", "base", &base_spec),
            manifest(
                "LockGrant",
                "g",
                &json!({"identity": case.identity, "prefixes": case.prefixes}),
            ),
        ]);
        let by_manifest = manifests(dir.path(), &text);
        match (&by_loader, &by_manifest) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{}", case.what),
            (Err(loader_msg), Err(manifest_msg)) => {
                let at = format!(
                    "{}, document 2 (LockGrant team-a/g): ",
                    dir.path().join("m.yaml").display()
                );
                assert_eq!(
                    manifest_msg.strip_prefix(&at),
                    Some(loader_msg.as_str()),
                    "{}",
                    case.what
                );
            }
            _ => panic!(
                "{}: loader says {by_loader:?}, manifest check says {by_manifest:?}",
                case.what
            ),
        }
    }
}

// ---------------------------------------------------------------------------
// Judge 3: the committed CRDs, offline

fn crd_schema(file: &str) -> J {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/crds")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let crd: J = serde_norway::from_str(&text).unwrap();
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// What the API server does before CEL: fill in schema defaults.
fn apply_defaults(schema: &J, value: &mut J) {
    if let (Some(props), Some(obj)) = (schema.get("properties"), value.as_object_mut()) {
        for (key, prop) in props.as_object().unwrap() {
            if !obj.contains_key(key)
                && let Some(default) = prop.get("default")
            {
                obj.insert(key.clone(), default.clone());
            }
            if let Some(child) = obj.get_mut(key) {
                apply_defaults(prop, child);
            }
        }
    }
    if let (Some(items), Some(list)) = (schema.get("items"), value.as_array_mut()) {
        for item in list {
            apply_defaults(items, item);
        }
    }
}

fn to_cel(value: &J) -> cel::Value {
    match value {
        J::Null => cel::Value::Null,
        J::Bool(b) => cel::Value::Bool(*b),
        // Kubernetes' integer type is int64.
        J::Number(n) => match n.as_i64() {
            Some(i) => cel::Value::Int(i),
            None => cel::Value::Float(n.as_f64().unwrap()),
        },
        J::String(s) => cel::Value::String(Arc::new(s.clone())),
        J::Array(items) => cel::Value::List(Arc::new(items.iter().map(to_cel).collect())),
        J::Object(map) => {
            let map: HashMap<String, cel::Value> =
                map.iter().map(|(k, v)| (k.clone(), to_cel(v))).collect();
            map.into()
        }
    }
}

/// The schema's structural checks (required, enum, minimum, maximum,
/// maxLength, minItems, maxItems, `x-kubernetes-list-type: set`) and every CEL rule,
/// at every node; the messages of whatever fails.
fn schema_errors(schema: &J, value: &J, at: &str, errors: &mut Vec<String>) {
    if let Some(required) = schema.get("required").and_then(J::as_array) {
        for key in required {
            if value.get(key.as_str().unwrap()).is_none() {
                errors.push(format!("{at}.{}: required", key.as_str().unwrap()));
            }
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(J::as_array)
        && !allowed.contains(value)
    {
        errors.push(format!("{at}: not one of {allowed:?}"));
    }
    if let (Some(min), Some(n)) = (schema.get("minimum"), value.as_f64())
        && n < min.as_f64().unwrap()
    {
        errors.push(format!("{at}: below minimum"));
    }
    if let (Some(max), Some(n)) = (schema.get("maximum"), value.as_f64())
        && n > max.as_f64().unwrap()
    {
        errors.push(format!("{at}: above maximum"));
    }
    if let (Some(max), Some(s)) = (schema.get("maxLength"), value.as_str())
        && s.chars().count() as u64 > max.as_u64().unwrap()
    {
        errors.push(format!("{at}: too long"));
    }
    if let (Some(min), Some(list)) = (schema.get("minItems"), value.as_array())
        && (list.len() as u64) < min.as_u64().unwrap()
    {
        errors.push(format!("{at}: too few items"));
    }
    if let (Some(max), Some(list)) = (schema.get("maxItems"), value.as_array())
        && list.len() as u64 > max.as_u64().unwrap()
    {
        errors.push(format!("{at}: too many items"));
    }
    if schema.get("x-kubernetes-list-type").and_then(J::as_str) == Some("set")
        && let Some(list) = value.as_array()
        && list
            .iter()
            .enumerate()
            .any(|(i, item)| list[..i].contains(item))
    {
        errors.push(format!("{at}: duplicate items in a set"));
    }
    for rule in schema
        .get("x-kubernetes-validations")
        .and_then(J::as_array)
        .into_iter()
        .flatten()
    {
        let expr = rule["rule"].as_str().unwrap();
        let program = cel::Program::compile(expr)
            .unwrap_or_else(|e| panic!("CEL rule does not compile: {expr}: {e:?}"));
        let mut context = cel::Context::default();
        context.add_variable_from_value("self", to_cel(value));
        match program.execute(&context) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => {
                errors.push(format!("{at}: {}", rule["message"].as_str().unwrap()))
            }
            other => panic!("CEL rule {expr} on {value}: {other:?}"),
        }
    }
    if let (Some(props), Some(obj)) = (schema.get("properties"), value.as_object()) {
        for (key, prop) in props.as_object().unwrap() {
            if let Some(child) = obj.get(key) {
                schema_errors(prop, child, &format!("{at}.{key}"), errors);
            }
        }
    }
    if let (Some(items), Some(list)) = (schema.get("items"), value.as_array()) {
        for (i, item) in list.iter().enumerate() {
            schema_errors(items, item, &format!("{at}[{i}]"), errors);
        }
    }
}

fn api_server(schema: &J, object: &J) -> Vec<String> {
    let mut object = object.clone();
    apply_defaults(schema, &mut object);
    let mut errors = Vec::new();
    schema_errors(schema, &object, "", &mut errors);
    errors
}

/// Every CEL rule's message in `schema`, at any depth.
fn rule_messages(schema: &J, out: &mut Vec<String>) {
    match schema {
        J::Object(map) => {
            for (key, value) in map {
                if key == "x-kubernetes-validations" {
                    for rule in value.as_array().unwrap() {
                        out.push(rule["message"].as_str().unwrap().to_owned());
                    }
                } else {
                    rule_messages(value, out);
                }
            }
        }
        J::Array(items) => items.iter().for_each(|i| rule_messages(i, out)),
        _ => {}
    }
}

/// Each CEL rule refuses at least one case, so no rule is vacuous here.
fn assert_every_rule_fired(schema: &J, seen: &[String]) {
    let mut messages = Vec::new();
    rule_messages(schema, &mut messages);
    assert!(!messages.is_empty());
    for message in messages {
        assert!(
            seen.iter().any(|e| e.ends_with(&message)),
            "no case makes this CEL rule refuse: {message}"
        );
    }
}

#[test]
fn the_crd_rules_agree_with_the_loader_on_every_class_case() {
    let schema = crd_schema("lockclass.yaml");
    let mut seen = Vec::new();
    for case in class_cases() {
        let dir = policy_dir(&class_toml(case.name, &case.spec), "", case.name);
        let loader_ok = loader(dir.path(), "classes/c.toml").is_ok();
        let errors = api_server(&schema, &manifest("LockClass", case.name, &case.spec));
        match case.cel {
            Cel::Agrees => assert_eq!(
                errors.is_empty(),
                loader_ok,
                "{}: loader ok = {loader_ok}, CRD rules say {errors:?}",
                case.what
            ),
            Cel::LoaderOnly => {
                assert!(!loader_ok, "{}: the loader should refuse", case.what);
                assert!(errors.is_empty(), "{}: CRD says {errors:?}", case.what);
            }
        }
        seen.extend(errors);
    }
    assert_every_rule_fired(&schema, &seen);
}

#[test]
fn the_crd_rules_agree_with_the_loader_on_every_grant_case() {
    let schema = crd_schema("lockgrant.yaml");
    let mut seen = Vec::new();
    for case in grant_cases() {
        let grant_toml = toml::to_string(&json!({
            "grant": [{"identity": case.identity, "prefixes": case.prefixes}]
        }))
        .unwrap();
        let dir = policy_dir(GOOD_CLASS, &grant_toml, "base");
        let loader_ok = loader(dir.path(), "grants/g.toml").is_ok();
        let errors = api_server(
            &schema,
            &manifest(
                "LockGrant",
                "g",
                &json!({"identity": case.identity, "prefixes": case.prefixes}),
            ),
        );
        assert_eq!(
            errors.is_empty(),
            loader_ok,
            "{}: loader ok = {loader_ok}, CRD rules say {errors:?}",
            case.what
        );
        seen.extend(errors);
    }
    // Grants for some classes only (issue 34): a class of the policy, and a
    // name too long to be one (both refuse). A well-formed name no class
    // has is refused by the loader only: CEL sees one object at a time.
    let long = "c".repeat(64);
    for (what, classes, cel) in [
        ("for one class", vec!["base"], Cel::Agrees),
        (
            "for a name too long for a class",
            vec![long.as_str()],
            Cel::Agrees,
        ),
        (
            "for a class the policy lacks",
            vec!["nope"],
            Cel::LoaderOnly,
        ),
        ("for no class (an empty list)", vec![], Cel::Agrees),
    ] {
        let spec =
            json!({"identity": "spiffe://td/workload/a", "prefixes": ["p"], "classes": classes});
        let grant_toml = toml::to_string(&json!({"grant": [spec.clone()]})).unwrap();
        let dir = policy_dir(GOOD_CLASS, &grant_toml, "base");
        let loader_ok = loader(dir.path(), "grants/g.toml").is_ok();
        let errors = api_server(&schema, &manifest("LockGrant", "g", &spec));
        match cel {
            Cel::Agrees => assert_eq!(
                errors.is_empty(),
                loader_ok,
                "{what}: loader ok = {loader_ok}, CRD rules say {errors:?}"
            ),
            Cel::LoaderOnly => assert!(
                errors.is_empty() && !loader_ok,
                "{what}: the loader should refuse alone: loader ok = {loader_ok}, CRD {errors:?}"
            ),
        }
        seen.extend(errors);
    }
    // The operator role given to a pattern (refused by the loader too:
    // the_operator_role_is_refused_to_a_pattern_by_both).
    let spec = json!({"identity": "spiffe://td/latchkey/ops/*", "operator": true});
    seen.extend(api_server(&schema, &manifest("LockGrant", "ops", &spec)));
    assert_every_rule_fired(&schema, &seen);
}

#[test]
fn the_operator_role_is_refused_to_a_pattern_by_both() {
    let schema = crd_schema("lockgrant.yaml");
    let spec = json!({"identity": "spiffe://td/latchkey/ops/*", "operator": true});
    let errors = api_server(&schema, &manifest("LockGrant", "ops", &spec));
    assert!(
        errors.iter().any(|e| e.contains("never to a pattern")),
        "{errors:?}"
    );
    let dir = policy_dir(GOOD_CLASS, "", "base");
    let base = toml::from_str::<toml::Table>(GOOD_CLASS).unwrap();
    let mut base_spec = serde_json::to_value(&base["class"][0]).unwrap();
    base_spec.as_object_mut().unwrap().remove("name");
    let text = yaml(&[
        manifest("LockClass", "base", &base_spec),
        manifest("LockGrant", "ops", &spec),
    ]);
    assert!(
        manifests(dir.path(), &text).is_err(),
        "the loader refuses it too"
    );
}

#[test]
fn an_operator_only_grant_is_valid_in_both_forms() {
    let schema = crd_schema("lockgrant.yaml");
    let spec = json!({"identity": "spiffe://td/latchkey/operator", "operator": true});
    assert_eq!(
        api_server(&schema, &manifest("LockGrant", "op", &spec)),
        Vec::<String>::new()
    );
    let dir = policy_dir(GOOD_CLASS, "", "base");
    let base = toml::from_str::<toml::Table>(GOOD_CLASS).unwrap();
    let mut base_spec = serde_json::to_value(&base["class"][0]).unwrap();
    base_spec.as_object_mut().unwrap().remove("name");
    let text = yaml(&[
        manifest("LockClass", "base", &base_spec),
        manifest("LockGrant", "op", &spec),
    ]);
    let set = manifests(dir.path(), &text).unwrap();
    assert!(set.is_operator("spiffe://td/latchkey/operator"));
    assert!(set.grants().is_empty());
}
