//! Harnesses for Latchkey's end-to-end tests and benchmarks.
//!
//! Scenarios (the `e2e` test binary) start real parts through these harnesses: an
//! [`etcd::EtcdServer`] on free loopback ports with a temp data dir, then (later) an
//! arbiter and Envoy pointed at it. Every harness owns its processes and kills them on
//! drop, and every wait is a poll with a deadline ([`eventually`]), never a fixed sleep.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Once;
use std::time::Duration;

use anyhow::bail;
use tokio::time::Instant;

pub mod arbiter;
pub mod cluster;
pub mod envoy;
pub mod etcd;
pub mod gate;
pub mod hooks;
pub mod postgres;

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
    fn init_tracing_is_idempotent() {
        init_tracing();
        init_tracing();
    }
}
