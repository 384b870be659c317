//! The committed CRD YAML under deploy/crds/ is what the Rust types generate.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

#[test]
fn committed_crds_match_the_rust_types() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
    for (name, expected) in latchkey_crds::crd_files() {
        let path = dir.join(name);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == expected,
            "{} is out of date with crds/src/resources.rs: run \
             `cargo run -p latchkey-crds --bin latchkey-crd-gen` to regenerate it, and commit it",
            path.display()
        );
    }
}
