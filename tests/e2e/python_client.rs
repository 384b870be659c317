//! The Python client (`clients/python`, importable as `latchkey`) against the
//! real stack: etcd, the arbiter (trusting the edge's identity header only from
//! the edge SVID), Envoy with the real Wasm filter, and mTLS with dev SVIDs for
//! two workloads. The arbiter sits behind a TCP proxy so the path to it can go
//! dark on request. pytest runs `clients/python/tests` (the pure tests, the
//! stub drift check and the stack tests) and asks this harness to act through
//! request files in a control directory: `revision` (etcd's revision),
//! `remove-hold <key>` (what a force-release does to the log),
//! `remove-leader <election>` (the leader record leaves the log while its
//! session lives, as when an operator forces it out) and `block-arbiter`.
//!
//! Elections (latchkey.election.v1) go through Envoy like the lock calls. The
//! policies are the dev ones plus `elect-fast`, an election class with a 5 s
//! TTL, so a crashed leader's session expires within the suite.
//!
//! Needs `target/wasm/latchkey_filter.wasm` (scripts/build-wasm) and Python
//! with grpcio, protobuf, googleapis-common-protos and pytest (scripts/setup).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use latchkey_tests::arbiter::{ArbiterOptions, certs, spiffe};
use latchkey_tests::envoy::{Envoy, EnvoyOptions};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::workspace_root;
use serde_json::json;
use tempfile::TempDir;
use tokio::process::Command;
use tokio::time::{Instant, sleep};

use crate::support::{layout, stack_with};

/// The whole suite; it takes ~35 s, most of it TTLs running out (the fence
/// test's 5 s, a crashed leader's 5 s).
const SUITE_TIMEOUT: Duration = Duration::from_secs(150);

/// The test-only election class with the platform's shortest TTL (as in
/// elections.rs).
const FAST_ELECTION_CLASS: &str = "elect-fast";

/// `policies/dev` plus [`FAST_ELECTION_CLASS`].
fn policies() -> anyhow::Result<TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("latchkey-pytest-policies-")
        .tempdir()?;
    latchkey_tests::copy_dev_policies(dir.path())?;
    std::fs::write(
        dir.path().join("classes/zz-python-elections.toml"),
        format!(
            r#"
[[class]]
name = "{FAST_ELECTION_CLASS}"
kind = "election"
tier = "coord"
enforcement = "fenced"
ttlSeconds = 5
[class.pauseTest]
resource = "postgresql:dev.latchkey_fenced_rows"
result = "pause-tests/{FAST_ELECTION_CLASS}.json"
"#
        ),
    )?;
    latchkey_tests::write_pause_test_fixtures(dir.path())?;
    Ok(dir)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_python_client_passes_its_suite_against_envoy_the_filter_and_the_arbiter()
-> anyhow::Result<()> {
    let policies = policies()?;
    let opts = ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        policies_dir: policies.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let stack = stack_with(opts).await?;
    let path = Proxy::start(stack.arbiter.addr()).await?;
    let envoy = Envoy::start(EnvoyOptions::with_filter(path.addr(), json!({}))?).await?;

    let certs = certs()?;
    let (alice, bob) = (certs.svid("workload/alice"), certs.svid("workload/bob"));
    let control = tempfile::Builder::new()
        .prefix("latchkey-pytest-")
        .tempdir()?;
    let output = control.path().join("pytest.out");
    let requests = control.path().join("requests");
    std::fs::create_dir(&requests)?;

    let client_dir = workspace_root().join("clients/python");
    let mut pytest = Command::new("python3")
        .args([
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            // The fence adapters' store suite needs its own servers:
            // python_fence.rs runs it.
            "--ignore=tests/test_fence_stores.py",
            "tests",
        ])
        .current_dir(&client_dir)
        .env("PYTHONPATH", client_dir.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LATCHKEY_TEST_REQUIRE_STACK", "1")
        .env("LATCHKEY_TEST_ENDPOINT", envoy.addr().to_string())
        .env("LATCHKEY_TEST_CA", certs.ca())
        .env("LATCHKEY_TEST_ALICE_CERT", &alice.cert)
        .env("LATCHKEY_TEST_ALICE_KEY", &alice.key)
        .env("LATCHKEY_TEST_BOB_CERT", &bob.cert)
        .env("LATCHKEY_TEST_BOB_KEY", &bob.key)
        .env("LATCHKEY_TEST_CONTROL", &requests)
        .env("LATCHKEY_TEST_FAST_ELECTION_CLASS", FAST_ELECTION_CLASS)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&output)?)
        .stderr(std::fs::File::create(control.path().join("pytest.err"))?)
        .kill_on_drop(true)
        .spawn()
        .context("starting python3 -m pytest (scripts/setup installs what it needs)")?;

    let started = Instant::now();
    let status = loop {
        if let Some(status) = pytest.try_wait()? {
            break status;
        }
        if started.elapsed() > SUITE_TIMEOUT {
            let _ = pytest.start_kill();
            bail!(
                "pytest did not finish in {SUITE_TIMEOUT:?}; output so far:\n{}",
                std::fs::read_to_string(&output).unwrap_or_default()
            );
        }
        serve_requests(&requests, &stack.etcd, &path).await?;
        sleep(Duration::from_millis(20)).await;
    };
    let out = std::fs::read_to_string(&output)?;
    let err = std::fs::read_to_string(control.path().join("pytest.err"))?;
    println!("{out}");
    ensure!(
        status.success(),
        "pytest failed ({status}):\n{out}\n{err}\nenvoy log tail:\n{}",
        tail(&envoy.log(), 40)
    );
    let summary = out.lines().last().unwrap_or_default();
    ensure!(
        summary.contains(" passed") && !summary.contains("skipped") && !summary.contains("failed"),
        "every Python test must run and pass: {summary}"
    );
    Ok(())
}

/// Answers each `<n>.req` in `dir` with `<n>.done`: `ok <value>` or `error <why>`.
async fn serve_requests(dir: &Path, etcd: &EtcdServer, path: &Proxy) -> anyhow::Result<()> {
    let mut pending: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "req"))
        .collect();
    pending.sort();
    for request in pending {
        let command = std::fs::read_to_string(&request)?;
        let answer = match act(command.trim(), etcd, path).await {
            Ok(value) => format!("ok {value}"),
            Err(e) => format!("error {e:#}"),
        };
        let tmp = request.with_extension("answer");
        std::fs::write(&tmp, answer)?;
        std::fs::rename(&tmp, request.with_extension("done"))?;
        std::fs::remove_file(&request)?;
    }
    Ok(())
}

async fn act(command: &str, etcd: &EtcdServer, path: &Proxy) -> anyhow::Result<String> {
    match command.split_once(' ').unwrap_or((command, "")) {
        ("revision", "") => Ok(etcd.revision().await?.to_string()),
        ("remove-hold", key) if !key.is_empty() => {
            // What an operator's force-release does to the hold: its record
            // leaves the log (as in lock_loss.rs).
            let deleted = etcd
                .client()
                .await?
                .delete(layout().holder(key), None)
                .await?
                .deleted();
            ensure!(deleted == 1, "no hold of {key} in the log");
            Ok(String::new())
        }
        ("remove-leader", election) if !election.is_empty() => {
            // The leader record leaves the log while its session lives:
            // observers see the term fall vacant, as when operators force a
            // leadership out.
            let deleted = etcd
                .client()
                .await?
                .delete(layout().election_lead(election), None)
                .await?
                .deleted();
            ensure!(deleted == 1, "no leader of {election} in the log");
            Ok(String::new())
        }
        ("block-arbiter", "") => {
            path.block();
            Ok(String::new())
        }
        _ => bail!("unknown request {command:?}"),
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
