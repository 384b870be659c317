//! The arbiter's Prometheus metrics (ADR-22), scraped over HTTP from the real
//! binary's `--metrics-listen`: calls counted by namespace, class and outcome,
//! queue and seal gauges, hook counters — and never a key, an identity, a
//! session or a token in the exposition.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use latchkey_proto::lockv1::AcquireRequest;
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess};
use latchkey_tests::envoy::admin_get;
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::eventually;
use tonic::Code;

use crate::support::*;

/// The unlabelled and labelled samples of one scrape: `name{labels}` -> value.
async fn scrape(addr: SocketAddr) -> anyhow::Result<(String, BTreeMap<String, f64>)> {
    let text = admin_get(addr, "/metrics").await?;
    let samples = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect();
    Ok((text, samples))
}

fn sample(samples: &BTreeMap<String, f64>, name: &str) -> f64 {
    samples.get(name).copied().unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_calls_by_namespace_and_class_and_never_name_a_key_or_token()
-> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_arbiter-under-test"));
    let arbiter = ArbiterProcess::start(
        &binary,
        &etcd,
        ArbiterOptions {
            metrics: true,
            ..ArbiterOptions::default()
        },
        "info",
    )
    .await?;
    let metrics = arbiter
        .metrics_addr()
        .context("the arbiter serves no metrics")?;
    let addr = arbiter.addr();
    let lock = |name: &'static str| async move {
        latchkey_tests::arbiter::channel(addr, name)
            .await
            .map(latchkey_proto::lockv1::lock_client::LockClient::new)
    };
    let (mut alice, mut bob, mut mallory) = (
        lock("workload/alice").await?,
        lock("workload/bob").await?,
        lock("workload/mallory").await?,
    );
    let key = "demo/metrics-report-7f3a";
    let sa = open(&mut alice, "demo").await?;
    let sb = open(&mut bob, "demo").await?;

    // alice holds; bob's try-lock is refused HELD, then bob queues.
    let first = try_lock(&mut alice, key, "demo", sa).await?;
    expect_refusal(
        try_lock(&mut bob, key, "demo", sb).await,
        Code::Aborted,
        "HELD",
    )?;
    let mut bob_waits = bob.clone();
    let waiting = tokio::spawn(async move {
        wait_lock(&mut bob_waits, key, "demo", sb, Duration::from_secs(20)).await
    });
    eventually(
        "bob's wait on the gauges",
        Duration::from_secs(10),
        || async {
            let (_, s) = scrape(metrics).await?;
            anyhow::ensure!(
                sample(&s, "latchkey_arbiter_waiters") == 1.0,
                "no waiter yet"
            );
            anyhow::ensure!(sample(&s, "latchkey_arbiter_contended_keys") == 1.0);
            Ok(())
        },
    )
    .await?;

    // alice's release hands the key to bob in the same transaction.
    release(&mut alice, &first).await?;
    let second = waiting.await??;
    assert!(second.token > first.token);
    release(&mut bob, &second).await?;

    // Refusals: mallory has no grant on demo/; a hook denies a ticketed
    // acquire without its change ticket.
    expect_refusal(
        try_lock(&mut mallory, key, "demo", 1).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    let st = open(&mut alice, "ticketed").await?;
    let denied = alice
        .acquire(AcquireRequest {
            key: "demo/metrics-change".into(),
            class: "ticketed".into(),
            session_id: st,
            wait: latchkey_proto::lockv1::WaitMode::WaitNone.into(),
            metadata: Default::default(),
            instance: String::new(),
            mode: 0,
            downgrade_from: None,
        })
        .await;
    let denied = denied.map(|r| r.into_inner());
    expect_refusal(denied, Code::PermissionDenied, "HOOK_DENIED")?;

    let (text, s) = scrape(metrics).await?;
    for (name, want) in [
        (
            r#"latchkey_arbiter_acquires_total{namespace="demo",class="demo",outcome="granted"}"#,
            1.0,
        ),
        (
            r#"latchkey_arbiter_acquires_total{namespace="demo",class="demo",outcome="held"}"#,
            1.0,
        ),
        (
            r#"latchkey_arbiter_acquires_total{namespace="demo",class="demo",outcome="granted_after_wait"}"#,
            1.0,
        ),
        (
            r#"latchkey_arbiter_acquires_total{namespace="_",class="_",outcome="not_authorised"}"#,
            1.0,
        ),
        (
            r#"latchkey_arbiter_acquires_total{namespace="demo",class="ticketed",outcome="hook_denied"}"#,
            1.0,
        ),
        (
            r#"latchkey_arbiter_releases_total{namespace="demo",class="demo",outcome="handed_over"}"#,
            1.0,
        ),
        (
            r#"latchkey_arbiter_releases_total{namespace="demo",class="demo",outcome="released"}"#,
            1.0,
        ),
        (
            r#"latchkey_arbiter_grant_wait_seconds_count{namespace="demo",class="demo"}"#,
            2.0,
        ),
        (
            r#"latchkey_arbiter_hold_seconds_count{namespace="demo",class="demo"}"#,
            2.0,
        ),
        (
            r#"latchkey_arbiter_hook_invocations_total{class="ticketed"}"#,
            1.0,
        ),
        (
            r#"latchkey_arbiter_hook_denials_total{class="ticketed"}"#,
            1.0,
        ),
        ("latchkey_arbiter_waiters", 0.0),
        ("latchkey_arbiter_sealed", 0.0),
        ("latchkey_arbiter_epoch", 1.0),
    ] {
        assert_eq!(sample(&s, name), want, "{name} in:\n{text}");
    }
    // bob waited at least until alice's release.
    let waited = sample(
        &s,
        r#"latchkey_arbiter_grant_wait_seconds_sum{namespace="demo",class="demo"}"#,
    );
    assert!(waited > 0.0, "{text}");

    // ADR-22: nothing per key, per caller or per grant.
    for secret in [
        key.to_string(),
        "metrics-change".to_string(),
        "spiffe://".to_string(),
        "alice".to_string(),
        "mallory".to_string(),
        first.token.to_string(),
        second.token.to_string(),
        sa.to_string(),
        sb.to_string(),
    ] {
        assert!(
            !text.contains(&secret),
            "{secret:?} in the metrics:\n{text}"
        );
    }
    Ok(())
}
