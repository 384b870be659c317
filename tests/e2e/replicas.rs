//! Issue 30: replicas of one workload share one SPIFFE ID (SPIRE's usual
//! `ns/<ns>/sa/<sa>` template gives every pod of a Deployment the same), so
//! they must contend like any two callers: a waiting Acquire waits its turn
//! (FIFO), a try-lock answers HELD, tokens rise. LEAK is only for the same
//! client instance under another session. Through the real edge: etcd, the
//! arbiter trusting the edge's identity, Envoy with the real filter, mTLS
//! with one SVID shared by three separate processes (two `latchctl hold
//! --wait`, one Python client).
//!
//! Needs `target/wasm/latchkey_filter.wasm` (scripts/build-wasm) and Python
//! with grpcio (scripts/setup).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_tests::arbiter::{ArbiterOptions, certs, spiffe};
use latchkey_tests::envoy::{Envoy, EnvoyOptions};
use latchkey_tests::workspace_root;
use serde_json::json;
use tokio::process::{Child, Command};

use crate::latchctl::latchctl;
use crate::support::stack_with;

const KEY: &str = "demo/replica-test";
/// How long each replica keeps the key: long enough that the later ones
/// are surely queued behind it.
const HOLD_SECS: f64 = 3.0;

/// `latchctl hold KEY --wait 30s` as `name` through `edge`: the command
/// appends "<token> <who>" to `log`, then keeps the key for HOLD_SECS.
fn latchctl_replica(
    edge: std::net::SocketAddr,
    name: &str,
    who: &str,
    log: &Path,
    out: &Path,
) -> anyhow::Result<Child> {
    Ok(latchctl(edge, name)?
        .args([
            "hold", KEY, "--class", "demo", "--wait", "30s", "--", "sh", "-c",
        ])
        .arg(format!(
            "echo \"$LATCHKEY_TOKEN {who}\" >> {}; sleep {HOLD_SECS}",
            log.display()
        ))
        .stdout(std::fs::File::create(out.with_extension("out"))?)
        .stderr(std::fs::File::create(out.with_extension("err"))?)
        .spawn()?)
}

/// The same as one Python process with the Python client.
fn python_replica(
    edge: std::net::SocketAddr,
    name: &str,
    who: &str,
    log: &Path,
    out: &Path,
) -> anyhow::Result<Child> {
    let certs = certs()?;
    let svid = certs.svid(name);
    let client_dir = workspace_root().join("clients/python");
    let script = r#"
import os, sys, time
import latchkey
client = latchkey.Client(
    os.environ["EDGE"], ca=os.environ["CA"], cert=os.environ["CERT"], key=os.environ["KEY"],
    connect_timeout=10.0,
)
with client.lock(os.environ["LOCK_KEY"], "demo", timeout=30.0) as guard:
    with open(os.environ["LOG"], "a") as log:
        log.write("%d %s\n" % (guard.token.value, os.environ["WHO"]))
    time.sleep(float(os.environ["HOLD"]))
client.close()
"#;
    Ok(Command::new("python3")
        .args(["-c", script])
        .env("PYTHONPATH", client_dir.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("EDGE", edge.to_string())
        .env("CA", certs.ca())
        .env("CERT", &svid.cert)
        .env("KEY", &svid.key)
        .env("LOCK_KEY", KEY)
        .env("LOG", log)
        .env("WHO", who)
        .env("HOLD", HOLD_SECS.to_string())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(out.with_extension("out"))?)
        .stderr(std::fs::File::create(out.with_extension("err"))?)
        .kill_on_drop(true)
        .spawn()?)
}

#[tokio::test(flavor = "multi_thread")]
async fn three_replicas_with_one_svid_take_one_key_in_turn_through_the_edge() -> anyhow::Result<()>
{
    let stack = stack_with(ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..ArbiterOptions::default()
    })
    .await?;
    let envoy = Envoy::start(EnvoyOptions::with_filter(stack.arbiter.addr(), json!({}))?).await?;
    let edge = envoy.addr();
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("grants.log");

    // One SVID (workload/alice) in three processes, started in this order
    // and a little apart, so the FIFO order of their waits is known.
    let first = latchctl_replica(edge, "workload/alice", "a", &log, &dir.path().join("a"))?;
    let wait_for_line = |n: usize| {
        let log = log.clone();
        async move {
            latchkey_tests::eventually("a replica's grant", Duration::from_secs(20), || {
                let log = log.clone();
                async move {
                    let lines = std::fs::read_to_string(&log).unwrap_or_default();
                    ensure!(
                        lines.lines().count() >= n,
                        "{} grants so far",
                        lines.lines().count()
                    );
                    Ok(())
                }
            })
            .await
        }
    };
    wait_for_line(1).await?;
    // An observer (another SVID) sees each replica queue before the next
    // starts: Python takes longer to start than latchctl.
    let observer = crate::client::connect(edge, "workload/bob").await?;
    let queued = |n: u32| {
        let observer = observer.clone();
        async move {
            latchkey_tests::eventually("a replica waiting", Duration::from_secs(20), || {
                let observer = observer.clone();
                async move {
                    let waiters = observer.inspect(KEY).await?.waiters;
                    ensure!(waiters >= n, "{waiters} waiting");
                    Ok(())
                }
            })
            .await
        }
    };
    let second = python_replica(edge, "workload/alice", "b", &log, &dir.path().join("b"))?;
    queued(1).await?;
    let third = latchctl_replica(edge, "workload/alice", "c", &log, &dir.path().join("c"))?;
    queued(2).await?;

    // While they queue, a try-lock by a fourth process with the same SVID
    // is told HELD, not LEAK.
    let try_lock = latchctl(edge, "workload/alice")?
        .args(["hold", KEY, "--class", "demo", "--", "true"])
        .output()
        .await?;
    let try_err = String::from_utf8_lossy(&try_lock.stderr);
    ensure!(
        !try_lock.status.success(),
        "a try-lock of a held key succeeded"
    );
    ensure!(
        try_err.contains("HELD") && !try_err.contains("LEAK"),
        "a replica's try-lock: {try_err}"
    );

    for (who, child) in [("a", first), ("b", second), ("c", third)] {
        let out = tokio::time::timeout(Duration::from_secs(40), child.wait_with_output())
            .await
            .with_context(|| format!("replica {who} did not finish"))??;
        let err =
            std::fs::read_to_string(dir.path().join(who).with_extension("err")).unwrap_or_default();
        ensure!(out.status.success(), "replica {who} failed: {err}");
        ensure!(!err.contains("LEAK"), "replica {who}: {err}");
    }
    let lines = std::fs::read_to_string(&log)?;
    let grants: Vec<(u64, &str)> = lines
        .lines()
        .map(|l| {
            let (token, who) = l.split_once(' ').context("a grant line")?;
            Ok((token.parse::<u64>().context("a token")?, who))
        })
        .collect::<anyhow::Result<_>>()?;
    let order: Vec<&str> = grants.iter().map(|g| g.1).collect();
    assert_eq!(order, ["a", "b", "c"], "FIFO: {lines}");
    assert!(
        grants.windows(2).all(|w| w[0].0 < w[1].0),
        "tokens strictly increase: {lines}"
    );
    Ok(())
}

/// Issue 30, per-pod identities: a Deployment whose ClusterSPIFFEID names
/// each pod is granted by one pattern over the path
/// (`spiffe://dev.latchkey/ns/payments/sa/ledger/*`, policies/dev), at the
/// edge and at the arbiter alike, and its pods share one set of bounds:
/// scaling to more pods does not multiply the tenant's sessions or holds.
#[tokio::test(flavor = "multi_thread")]
async fn per_pod_identities_are_granted_by_a_pattern_and_share_its_bounds() -> anyhow::Result<()> {
    use latchkey_tests::arbiter::ArbiterOptions;
    use tonic::Code;

    use crate::support::{expect_refusal, open_class, release, try_lock};

    let pods = [
        "ns/payments/sa/ledger/ledger-7d9f-a",
        "ns/payments/sa/ledger/ledger-7d9f-b",
        "ns/payments/sa/ledger/ledger-7d9f-c",
    ];
    let stack = stack_with(ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        allow_direct_workloads: true,
        max_sessions_per_identity: Some(4),
        max_holds_per_identity: Some(3),
        ..ArbiterOptions::default()
    })
    .await?;
    let mut a = stack.arbiter.lock(pods[0]).await?;
    let mut b = stack.arbiter.lock(pods[1]).await?;
    let mut c = stack.arbiter.lock(pods[2]).await?;

    // Granted by the pattern: its prefix, nothing else.
    let sa = open_class(&mut a, "demo").await?;
    let sb = open_class(&mut b, "demo").await?;
    let sc = open_class(&mut c, "demo").await?;
    let ga = try_lock(&mut a, "ledger/a1", "demo", sa).await?;
    expect_refusal(
        try_lock(&mut a, "demo/x", "demo", sa).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;

    // Sessions: 3 open across the pods, one more fits, then the subject is
    // at its bound whichever pod asks.
    open_class(&mut a, "demo").await?;
    for pod in [&mut a, &mut b, &mut c] {
        expect_refusal(
            open_class(pod, "demo").await,
            Code::ResourceExhausted,
            "IDENTITY_LIMIT",
        )?;
    }
    // Holds: 3 in all, over the pods.
    try_lock(&mut a, "ledger/a2", "demo", sa).await?;
    let gb = try_lock(&mut b, "ledger/b1", "demo", sb).await?;
    let over = expect_refusal(
        try_lock(&mut c, "ledger/c1", "demo", sc).await,
        Code::ResourceExhausted,
        "IDENTITY_LIMIT",
    )?;
    assert!(over.message().contains("hold"), "{}", over.message());
    // Another tenant is untouched.
    let mut alice = stack.arbiter.lock("workload/alice").await?;
    let s_alice = open_class(&mut alice, "demo").await?;
    try_lock(&mut alice, "demo/ledger-neighbour", "demo", s_alice).await?;
    // A release frees a place for any pod.
    release(&mut b, &gb).await?;
    latchkey_tests::eventually("the released hold counted", Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let g = try_lock(&mut c, "ledger/c1", "demo", sc).await?;
            Ok(g)
        }
    })
    .await?;
    release(&mut a, &ga).await?;

    Ok(())
}

/// Issue 30: the edge matches a pattern grant as the arbiter does (both use
/// the policies crate's [`latchkey_policies`] grant table): a per-pod
/// identity locks under its pattern's prefix through Envoy, and is refused
/// outside it.
#[tokio::test(flavor = "multi_thread")]
async fn the_edge_grants_per_pod_identities_by_the_same_pattern() -> anyhow::Result<()> {
    let pod = "ns/payments/sa/ledger/ledger-7d9f-c";
    let stack = stack_with(ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..ArbiterOptions::default()
    })
    .await?;
    // The edge matches the pattern the same way: pod c locks under
    // `ledger/` through Envoy, and not outside it.
    let envoy = Envoy::start(EnvoyOptions::with_filter(stack.arbiter.addr(), json!({}))?).await?;
    let inside = latchctl(envoy.addr(), pod)?
        .args([
            "hold",
            "ledger/through-edge",
            "--class",
            "demo",
            "--",
            "true",
        ])
        .output()
        .await?;
    ensure!(
        inside.status.success(),
        "a per-pod identity through the edge: {}",
        String::from_utf8_lossy(&inside.stderr)
    );
    let outside = latchctl(envoy.addr(), pod)?
        .args(["hold", "demo/through-edge", "--class", "demo", "--", "true"])
        .output()
        .await?;
    let err = String::from_utf8_lossy(&outside.stderr);
    ensure!(
        !outside.status.success() && err.contains("NOT_AUTHORISED"),
        "a per-pod identity outside its grant through the edge: {err}"
    );
    Ok(())
}
