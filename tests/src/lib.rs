//! Harnesses for Latchkey's end-to-end tests, benchmarks and release gate
//! (crate `latchkey-gate`, which depends on this one).
//!
//! Scenarios (the `e2e` test binary) start real parts through these harnesses: an
//! [`etcd::EtcdServer`] on free loopback ports with a temp data dir, an arbiter
//! (in-process or as a process) and Envoy pointed at it, PostgreSQL, ClickHouse and
//! an OIDC provider. Every harness owns its processes and kills them on
//! drop, and every wait is a poll with a deadline ([`eventually`]), never a fixed sleep.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Once, OnceLock};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use latchkey_policies::{
    Date, Enforcement, PauseTestEvidence, PauseTestOutcome, PauseTestResult, PolicyFile, PolicySet,
    WriteOutcome,
};
use tempfile::TempDir;
use tokio::time::Instant;

pub mod arbiter;
pub mod browser;
pub mod buf;
pub mod clickhouse;
pub mod cluster;
pub mod deploy;
pub mod disk;
pub mod docs_tables;
pub mod envoy;
pub mod etcd;
pub mod etcd_lease;
pub mod faulty_log;
pub mod fence_contract;
pub mod hooks;
pub mod latency;
pub mod lock_calls;
pub mod log_contract;
pub mod manifests;
pub mod mariadb;
pub mod oidc;
pub mod postgres;
pub mod procstat;
pub mod proxy;
pub mod raw_grpc;
pub mod redis;
pub mod s3;
pub mod workspace_bins;

/// How often [`eventually`] re-checks its condition.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Polls `f` every 20 ms until it returns `Ok`, or fails after `timeout` with `what` and
/// the last error. The `assert_eventually!` of these tests: use it instead of sleeping.
///
/// `f` is always tried at least once, even with a zero timeout.
pub async fn eventually<F, Fut, T>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let deadline = Instant::now() + timeout;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let last = match f().await {
            Ok(value) => return Ok(value),
            Err(err) => err,
        };
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} ({attempts} attempts) waiting for {what}: {last:#}");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// The repository root (where the workspace `Cargo.toml`, `policies/` and `envoy/` live).
pub fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest_dir)
}

/// The `kit` of every fixture result: a test's stand-in for the pause-test kit's
/// output, never evidence that a resource is fenced (ADR-17).
pub const PAUSE_TEST_FIXTURE_KIT: &str = "test fixture (not evidence)";

/// A passing pause-test result for `class` against `resource`, finished just now,
/// as the kit would write it, for test policy directories only.
pub fn pause_test_fixture(class: &str, resource: &str) -> PauseTestResult {
    let finished = SystemTime::now();
    PauseTestResult {
        version: latchkey_policies::PAUSE_TEST_RESULT_VERSION,
        class: class.into(),
        resource: resource.into(),
        resource_schema_version: None,
        started_at: finished - Duration::from_secs(21),
        finished_at: finished,
        outcome: PauseTestOutcome::Pass,
        kit: PAUSE_TEST_FIXTURE_KIT.into(),
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
    }
}

/// Writes a [`pause_test_fixture`] for every fenced class in `policy_dir/classes/*.toml`
/// that names a pause test, where its `[class.pauseTest] result` says, so a test copy of
/// a policy directory loads (the real results come from the kit against a real
/// resource). Files that do not load are skipped: the arbiter reports them. Refuses to
/// write under the repository's `policies/`.
pub fn write_pause_test_fixtures(policy_dir: &Path) -> anyhow::Result<()> {
    let repo_policies = workspace_root().join("policies");
    let canonical = policy_dir.canonicalize()?;
    if repo_policies
        .canonicalize()
        .is_ok_and(|p| canonical.starts_with(p))
    {
        bail!(
            "refusing to write pause-test fixtures into {}: fixtures are for test copies only",
            policy_dir.display()
        );
    }
    for entry in std::fs::read_dir(policy_dir.join("classes"))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        let file = PolicyFile {
            path: &path,
            text: &text,
        };
        let Ok(set) = PolicySet::from_files(&[file], &[], Date::today_utc()) else {
            continue;
        };
        for class in set.classes().values() {
            let Some(spec) = &class.pause_test else {
                continue;
            };
            if class.enforcement != Enforcement::Fenced {
                continue;
            }
            let fixture = PauseTestResult {
                resource_schema_version: spec.schema_version.clone(),
                ..pause_test_fixture(&class.name, &spec.resource)
            };
            let out = policy_dir.join(&spec.result);
            if let Some(parent) = out.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&out, fixture.to_json_pretty()?)
                .with_context(|| format!("writing {}", out.display()))?;
        }
    }
    Ok(())
}

/// Copies `policies/dev` (its `classes/` and `grants/`) into `to`, with hook module
/// paths made absolute and fixture pause-test results, so the copy loads as the
/// original will once its real results are in.
pub fn copy_dev_policies(to: &Path) -> anyhow::Result<()> {
    let src = workspace_root().join("policies/dev");
    let wasm = workspace_root().join("target/wasm");
    for sub in ["classes", "grants"] {
        std::fs::create_dir_all(to.join(sub))?;
        for entry in std::fs::read_dir(src.join(sub))? {
            let entry = entry?;
            let text = std::fs::read_to_string(entry.path())?;
            let text = text.replace("../../target/wasm", &wasm.display().to_string());
            std::fs::write(to.join(sub).join(entry.file_name()), text)?;
        }
    }
    write_pause_test_fixtures(to)
}

/// A copy of the dev policies that also grants `prefix` to each of `names`
/// (the benches' own identities, `workload/bench-<i>`: an identity with no
/// grant cannot open a session).
pub fn dev_policies_granting(names: &[String], prefix: &str) -> anyhow::Result<TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("latchkey-bench-policies-")
        .tempdir()?;
    copy_dev_policies(dir.path())?;
    let grants: String = names
        .iter()
        .map(|name| {
            format!(
                "[[grant]]\nidentity = \"{}\"\nprefixes = [\"{prefix}\"]\n\n",
                arbiter::spiffe(name)
            )
        })
        .collect();
    std::fs::write(dir.path().join("grants/zz-bench.toml"), grants)?;
    Ok(dir)
}

/// A copy of the dev policies with one more election class, `class`, of
/// `ttl_seconds` (5 is the platform's shortest): fenced, with the harness's
/// fixture pause-test result, since an advisory class may not go below 30 s.
/// For the election tests and `election-bench` only.
pub fn dev_policies_with_election_class(class: &str, ttl_seconds: u32) -> anyhow::Result<TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("latchkey-elections-")
        .tempdir()?;
    copy_dev_policies(dir.path())?;
    std::fs::write(
        dir.path().join(format!("classes/zz-{class}.toml")),
        format!(
            r#"
[[class]]
name = "{class}"
kind = "election"
tier = "coord"
enforcement = "fenced"
ttlSeconds = {ttl_seconds}
[class.pauseTest]
resource = "postgresql:dev.latchkey_fenced_rows"
result = "pause-tests/{class}.json"
"#
        ),
    )?;
    write_pause_test_fixtures(dir.path())?;
    Ok(dir)
}

/// One read-only [`copy_dev_policies`] for this test process: the default policy
/// directory of the harnesses. Tests that change policies make their own copy.
pub fn dev_policies() -> anyhow::Result<&'static Path> {
    static DIR: OnceLock<Result<TempDir, String>> = OnceLock::new();
    let made = DIR.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-dev-policies-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        copy_dev_policies(dir.path()).map_err(|e| format!("{e:#}"))?;
        Ok(dir)
    });
    match made {
        Ok(dir) => Ok(dir.path()),
        Err(e) => bail!("a copy of policies/dev: {e}"),
    }
}

/// Installs a `tracing` subscriber that writes through the test harness's capture, with
/// the filter from `RUST_LOG` (default `info`). Safe to call from every test.
pub fn init_tracing() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        // Another subscriber may already be installed (e.g. by a benchmark binary).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn eventually_returns_first_success() {
        let mut calls = 0;
        let value = eventually("third call", Duration::from_secs(5), || {
            calls += 1;
            let n = calls;
            async move {
                if n < 3 {
                    bail!("call {n}");
                }
                Ok(n)
            }
        })
        .await
        .unwrap();
        assert_eq!(value, 3);
    }

    #[tokio::test]
    async fn eventually_reports_what_and_last_error() {
        let err = eventually("the impossible", Duration::from_millis(50), || async {
            Err::<(), _>(anyhow::anyhow!("still no"))
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("the impossible"), "{err}");
        assert!(err.contains("still no"), "{err}");
    }

    #[test]
    fn workspace_root_has_the_workspace_manifest() {
        assert!(workspace_root().join("Cargo.toml").is_file());
        assert!(workspace_root().join("tests").is_dir());
    }

    #[test]
    fn the_dev_policies_copy_loads_and_policies_dev_is_left_alone() {
        let dir = dev_policies().unwrap();
        let set = PolicySet::load_dir(dir, Date::today_utc()).unwrap();
        for class in set.classes().values() {
            if class.enforcement == Enforcement::Fenced {
                let spec = class.pause_test.as_ref().unwrap();
                let text = std::fs::read_to_string(dir.join(&spec.result)).unwrap();
                let result = PauseTestResult::from_json(&text).unwrap();
                assert_eq!(result.kit, PAUSE_TEST_FIXTURE_KIT);
            }
        }
        let err = write_pause_test_fixtures(&workspace_root().join("policies/dev")).unwrap_err();
        assert!(err.to_string().contains("test copies only"), "{err}");
    }

    #[test]
    fn init_tracing_is_idempotent() {
        init_tracing();
        init_tracing();
    }
}
