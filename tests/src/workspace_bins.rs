//! Binaries of the workspace for tests in another package: cargo builds a
//! package's binaries before its integration tests run, and names them in
//! `CARGO_BIN_EXE_<name>`, only for that package. The release gate's tests
//! (crate `latchkey-gate`) run this crate's `arbiter-under-test` and
//! `fsync-delay-fs`, and its check of the shipped arbiter builds
//! `latchkey-arbiter`: each asks cargo, which builds what is missing or stale
//! (a fresh checkout, `cargo nextest run -p latchkey-gate`) and otherwise only
//! reports where the executables are.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::Context;

/// Builds `bins` as `cargo build --workspace` does: features unified over
/// every workspace member without their dev-dependencies, what a release
/// ships. In this process's profile; the executables in `bins` order.
pub fn build_as_shipped(bins: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    build(bins, None)
}

/// Builds `bins` as `cargo test --workspace` (and so `cargo nextest run
/// --workspace`) builds them: with every member's dev-dependencies, whose
/// features differ (regex-automata's, so everything above tracing-subscriber
/// would build twice). After such a run nothing is compiled again and the
/// files in `target/<profile>/` stay the ones that run built, which other
/// tests are running meanwhile. `test` names a test target of the workspace
/// (the caller's own): selecting one is what makes cargo resolve the
/// dev-dependencies; it is fresh when the caller was built by that run.
pub fn build_as_tested(test: &str, bins: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    build(bins, Some(test))
}

fn build(bins: &[&str], test: Option<&str>) -> anyhow::Result<Vec<PathBuf>> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    // Without what cargo set for this test process: build scripts that
    // watch these (ring's does) would otherwise rebuild for every build in
    // and out of this test.
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_by_cargo_for_a_crate) {
            cmd.env_remove(name);
        }
    }
    cmd.current_dir(crate::workspace_root())
        .args([
            "build",
            "--workspace",
            "--message-format=json-render-diagnostics",
        ])
        .stdin(Stdio::null());
    for bin in bins {
        cmd.args(["--bin", bin]);
    }
    if let Some(test) = test {
        cmd.args(["--test", test]);
    }
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let what = format!("cargo {:?}", cmd.get_args().collect::<Vec<_>>());
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let artifacts: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .collect();
    bins.iter()
        .map(|bin| {
            artifacts
                .iter()
                .filter(|m| m["target"]["name"] == *bin && m["profile"]["test"] == false)
                .find_map(|m| m["executable"].as_str().map(PathBuf::from))
                .with_context(|| format!("{what} reported no {bin} executable"))
        })
        .collect()
}

/// The variables cargo sets for a crate it runs (a test, a build script),
/// as opposed to ones that configure cargo (`CARGO_HOME`, `CARGO_TARGET_DIR`).
fn set_by_cargo_for_a_crate(name: &str) -> bool {
    const PREFIXES: [&str; 3] = ["CARGO_PKG_", "CARGO_BIN_", "CARGO_CFG_"];
    const NAMES: [&str; 8] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p)) || NAMES.contains(&name)
}
