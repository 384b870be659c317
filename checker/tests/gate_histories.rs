//! Real histories recorded by the release gate, kept as regression inputs.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use latchkey_checker::{CheckOptions, History, ViolationKind, check};

fn load(name: &str) -> History {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/histories")
        .join(name);
    let file = File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    History::from_jsonl(BufReader::new(file)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Key `bench/gate/k0` of the short gate run (seed 7972183335971811910) that
/// found the arbiter handing a session's grant both to its next call and to
/// the orphan release: `w2.7#38` was granted while `w0.9#16` held the key.
#[test]
fn the_orphan_release_double_grant_is_reported_with_both_grants() {
    let report = check(
        &load("gate-orphan-double-grant.jsonl"),
        &CheckOptions::default(),
    );
    assert!(!report.ok(), "{report}");
    let named = report
        .violations_of(ViolationKind::DoubleGrant)
        .any(|v| v.message.contains("w2.7#38") && v.message.contains("w0.9#16"));
    assert!(named, "{report}");
}
