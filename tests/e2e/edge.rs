//! The edge, end to end: real Envoy + the real Wasm filter (ECDS) + the real
//! arbiter (trusting the edge's identity header only from the edge SVID) + real
//! etcd. Callers connect to Envoy with their dev SVIDs.
//!
//! Needs `target/wasm/latchkey_filter.wasm` (`scripts/build-wasm
//! latchkey-filter`, which scripts/test runs first).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{AcquireRequest, Grant, InspectRequest, ReleaseRequest, WaitMode};
use latchkey_tests::arbiter::{ArbiterOptions, anonymous_channel, channel, spiffe};
use latchkey_tests::envoy::{Envoy, EnvoyOptions, filter_wasm};
use latchkey_tests::eventually;
use serde_json::{Value, json};
use tonic::Code;
use tonic::codegen::Service;
use tonic::transport::Channel;

use crate::support::*;

pub(crate) struct Edge {
    pub(crate) _stack: Stack,
    pub(crate) envoy: Envoy,
}

pub(crate) async fn edge(overrides: Value) -> anyhow::Result<Edge> {
    edge_with(ArbiterOptions::default(), overrides).await
}

pub(crate) async fn edge_with(mut opts: ArbiterOptions, overrides: Value) -> anyhow::Result<Edge> {
    opts.edge_identity = Some(spiffe("latchkey/edge"));
    let stack = stack_with(opts).await?;
    let envoy = Envoy::start(EnvoyOptions::with_filter(stack.arbiter.addr(), overrides)?).await?;
    Ok(Edge {
        _stack: stack,
        envoy,
    })
}

impl Edge {
    /// A lock.v1 client through Envoy carrying `name`'s SVID.
    pub(crate) async fn client(&self, name: &str) -> anyhow::Result<Client> {
        Ok(LockClient::new(channel(self.envoy.addr(), name).await?))
    }

    pub(crate) async fn denied(&self, reason: &str) -> anyhow::Result<u64> {
        self.envoy
            .counter(&format!("wasmcustom.latchkey_edge.denied.reason.{reason}"))
            .await
    }
}

/// A request carrying `x-lock-key` (the edge requires it on keyed calls).
pub(crate) fn keyed<T>(message: T, key: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    if let Ok(v) = key.parse() {
        req.metadata_mut().insert("x-lock-key", v);
    }
    req
}

pub(crate) async fn lock(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
) -> Result<Grant, tonic::Status> {
    c.acquire(keyed(
        acquire_request(key, class, session, WaitMode::WaitNone),
        key,
    ))
    .await?
    .into_inner()
    .grant
    .ok_or_else(|| tonic::Status::internal("no grant in an OK response"))
}

pub(crate) async fn lock_wait(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
    timeout: Duration,
) -> Result<Grant, tonic::Status> {
    let mut req = keyed(
        acquire_request(key, class, session, WaitMode::WaitUntilDeadline),
        key,
    );
    req.set_timeout(timeout);
    c.acquire(req)
        .await?
        .into_inner()
        .grant
        .ok_or_else(|| tonic::Status::internal("no grant in an OK response"))
}

pub(crate) async fn unlock(c: &mut Client, g: &Grant) -> Result<(), tonic::Status> {
    let req = ReleaseRequest {
        key: g.key.clone(),
        session_id: g.session_id,
        token: g.token,
        slot: None,
        mode: 0,
    };
    c.release(keyed(req, &g.key)).await?;
    Ok(())
}

pub(crate) fn acquire_request(
    key: &str,
    class: &str,
    session: i64,
    wait: WaitMode,
) -> AcquireRequest {
    AcquireRequest {
        key: key.into(),
        class: class.into(),
        session_id: session,
        wait: wait.into(),
        metadata: Default::default(),
        instance: crate::support::TEST_INSTANCE.into(),
        mode: 0,
        downgrade_from: None,
    }
}

/// A raw gRPC call: any body, any headers. Returns (grpc-status, grpc-message).
pub(crate) async fn raw_call(
    channel: Channel,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> anyhow::Result<(i32, String)> {
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(tonic::body::Body::new(Full::new(Bytes::from(body))))?;
    let mut channel = channel;
    std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
    let resp = channel.call(req).await?;
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await?;
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let pick = |name: &str| {
        trailers
            .get(name)
            .or_else(|| parts.headers.get(name))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let status = pick("grpc-status")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no grpc-status (http {})", parts.status))?;
    Ok((status, pick("grpc-message").unwrap_or_default()))
}

pub(crate) fn frame(message: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8];
    b.extend_from_slice(&(message.len() as u32).to_be_bytes());
    b.extend_from_slice(message);
    b
}

pub(crate) fn encode<M: prost::Message>(m: &M) -> Vec<u8> {
    frame(&m.encode_to_vec())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_authorised_acquire_and_release_through_envoy_return_a_token() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let mut demo = e.client("workload/demo").await?;
    let session = open(&mut demo, "demo").await?;
    let g = tokio::time::timeout(
        Duration::from_secs(10),
        lock(&mut demo, "demo/edge/report", "demo", session),
    )
    .await??;
    assert!(g.token > 0);
    assert_eq!(g.key, "demo/edge/report");
    // The arbiter saw the verified caller, not the edge.
    let seen = demo
        .inspect(keyed(
            InspectRequest {
                key: "demo/edge/report".into(),
            },
            "demo/edge/report",
        ))
        .await?
        .into_inner();
    assert_eq!(
        seen.holder.map(|h| h.identity),
        Some(spiffe("workload/demo"))
    );
    unlock(&mut demo, &g).await?;
    let allowed = e
        .envoy
        .sum("wasmcustom.latchkey_edge.allowed.method.acquire")
        .await?;
    assert!(allowed >= 1, "allowed counter moved: {allowed}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workload_without_a_grant_is_denied_at_the_edge_with_one_message() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let mut mallory = e.client("workload/mallory").await?;
    let session = open(&mut mallory, "demo").await?;
    let mut demo = e.client("workload/demo").await?;
    let sd = open(&mut demo, "demo").await?;
    let held = lock(&mut demo, "demo/exists", "demo", sd).await?;
    let upstream = e.envoy.upstream_requests().await?;
    let a = expect_refusal(
        lock(&mut mallory, "demo/exists", "demo", session).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    let b = expect_refusal(
        lock(&mut mallory, "demo/never-was", "demo", session).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    assert_eq!(
        a.message(),
        b.message(),
        "same denial whether or not the key exists"
    );
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "denials never reach the arbiter"
    );
    assert!(e.denied("not_authorised").await? >= 2);
    unlock(&mut demo, &held).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_client_certificate_the_tls_handshake_fails() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let upstream = e.envoy.upstream_requests().await?;
    let outcome = match anonymous_channel(e.envoy.addr()).await {
        Err(_) => None,
        Ok(ch) => Some(
            LockClient::new(ch)
                .inspect(InspectRequest {
                    key: "demo/x".into(),
                })
                .await,
        ),
    };
    if let Some(r) = outcome {
        let s = r
            .err()
            .ok_or_else(|| anyhow::anyhow!("served without a client certificate"))?;
        assert!(
            matches!(
                s.code(),
                Code::Unavailable | Code::Unknown | Code::Cancelled
            ),
            "{s:?}"
        );
    }
    // Envoy counts the failed handshake as it tears the connection down,
    // which can be a moment after the client has seen it fail (a CI run
    // read the stats first: none counted yet). The count must come.
    eventually(
        "Envoy to count the missing client certificate",
        Duration::from_secs(5),
        || async {
            let stats = e.envoy.stats().await?;
            let no_cert: u64 = stats
                .iter()
                .filter(|(k, _)| {
                    k.starts_with("listener.")
                        && (k.ends_with("ssl.fail_verify_no_cert")
                            || k.ends_with("ssl.connection_error"))
                })
                .map(|(_, v)| *v)
                .sum();
            anyhow::ensure!(
                no_cert >= 1,
                "Envoy counted the missing certificate: {:?}",
                stats
                    .iter()
                    .filter(|(k, v)| k.contains("ssl") && **v > 0)
                    .collect::<Vec<_>>()
            );
            Ok(())
        },
    )
    .await?;
    assert_eq!(e.envoy.upstream_requests().await?, upstream);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_identity_header_is_refused() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let mut mallory = e.client("workload/mallory").await?;
    let session = open(&mut mallory, "demo").await?;
    let forged = spiffe("workload/demo");
    let upstream = e.envoy.upstream_requests().await?;
    // Claiming to be demo is refused outright, on demo's keys and on
    // mallory's own: only the edge names the caller.
    for key in ["demo/forged", "mallory/own"] {
        let mut req = keyed(
            acquire_request(key, "demo", session, WaitMode::WaitNone),
            key,
        );
        req.metadata_mut()
            .insert("x-latchkey-identity", forged.parse()?);
        expect_refusal(
            mallory.acquire(req).await,
            Code::InvalidArgument,
            "RESERVED_HEADER",
        )?;
    }
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "never forwarded"
    );
    assert!(e.denied("reserved_header").await? >= 2);
    // Without it, the arbiter records mallory, the verified caller.
    let g = lock(&mut mallory, "mallory/own", "demo", session).await?;
    let seen = mallory
        .inspect(keyed(
            InspectRequest {
                key: "mallory/own".into(),
            },
            "mallory/own",
        ))
        .await?
        .into_inner();
    assert_eq!(
        seen.holder.map(|h| h.identity),
        Some(spiffe("workload/mallory"))
    );
    unlock(&mut mallory, &g).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_header_that_differs_from_the_body_is_rejected() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let mut demo = e.client("workload/demo").await?;
    let session = open(&mut demo, "demo").await?;
    let upstream = e.envoy.upstream_requests().await?;
    let mut req = tonic::Request::new(acquire_request(
        "demo/a",
        "demo",
        session,
        WaitMode::WaitNone,
    ));
    req.metadata_mut().insert("x-lock-key", "demo/b".parse()?);
    let s = demo
        .acquire(req)
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("accepted a mismatch"))?;
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert_eq!(e.envoy.upstream_requests().await?, upstream);
    // A matching header is fine.
    let mut req = tonic::Request::new(acquire_request(
        "demo/a",
        "demo",
        session,
        WaitMode::WaitNone,
    ));
    req.metadata_mut().insert("x-lock-key", "demo/a".parse()?);
    let g = demo
        .acquire(req)
        .await?
        .into_inner()
        .grant
        .ok_or_else(|| anyhow::anyhow!("no grant"))?;
    unlock(&mut demo, &g).await?;
    // Without the header the call is fine: the filter routes by the body's key.
    let req = tonic::Request::new(acquire_request(
        "demo/b",
        "demo",
        session,
        WaitMode::WaitNone,
    ));
    let g = demo
        .acquire(req)
        .await?
        .into_inner()
        .grant
        .ok_or_else(|| anyhow::anyhow!("no grant"))?;
    unlock(&mut demo, &g).await?;
    assert!(e.denied("key_mismatch").await? >= 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grant_on_a_b_does_not_open_a_bc() -> anyhow::Result<()> {
    // The edge's table gives alice `shared/team` only; the arbiter's gives her
    // all of `shared`. So what stops `shared/teamx` here is the filter.
    let e = edge(json!({
        "refresh": null,
        "grants": [{"identity": spiffe("workload/alice"), "prefixes": ["demo", "shared/team"]}],
    }))
    .await?;
    let mut alice = e.client("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let g = lock(&mut alice, "shared/team/x", "demo", session).await?;
    unlock(&mut alice, &g).await?;
    let g = lock(&mut alice, "shared/team", "demo", session).await?;
    unlock(&mut alice, &g).await?;
    let upstream = e.envoy.upstream_requests().await?;
    expect_refusal(
        lock(&mut alice, "shared/teamx", "demo", session).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    expect_refusal(
        lock(&mut alice, "shared/tea", "demo", session).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    assert_eq!(e.envoy.upstream_requests().await?, upstream);
    Ok(())
}

/// The edge's waiter bounds: a key's (the class's `maxWaitersPerKey`, 3
/// here), one identity's share of a key (half of it, rounded up: 2) and an
/// identity's in all (3); refused at the edge, never forwarded, and every
/// place comes back when its stream is reset.
#[tokio::test(flavor = "multi_thread")]
async fn waiter_bounds_per_key_and_per_identity_hold_and_slots_come_back_after_resets()
-> anyhow::Result<()> {
    let e = edge(json!({
        "refresh": null,
        "classes": [{"name": "demo", "max_waiters_per_key": 3}],
        "max_waiters_per_identity": 3,
    }))
    .await?;
    let mut demo = e.client("workload/demo").await?;
    let sd = open(&mut demo, "demo").await?;
    let held_q = lock(&mut demo, "demo/q", "demo", sd).await?;
    let held_r = lock(&mut demo, "demo/r", "demo", sd).await?;
    let alice = e.client("workload/alice").await?;
    let bob = e.client("workload/bob").await?;
    let mut waiters = Vec::new();
    let wait_on = |c: &Client, key: &'static str| {
        let mut c = c.clone();
        async move {
            let s = open(&mut c, "demo").await?;
            let r = lock_wait(&mut c, key, "demo", s, Duration::from_secs(50)).await;
            anyhow::Ok(r)
        }
    };
    let waiting = "wasmcustom.latchkey_edge.waiters.ns.demo.class.demo";
    let waiting_are = |n: u64| {
        let e = &e;
        move || async move {
            let got = e.envoy.counter(waiting).await?;
            anyhow::ensure!(got == n, "{got} of {n}");
            Ok(())
        }
    };
    // Two of alice's waiters on demo/q: her share of the key.
    for _ in 0..2 {
        waiters.push(tokio::spawn(wait_on(&alice, "demo/q")));
    }
    eventually("two waiters", Duration::from_secs(10), waiting_are(2)).await?;
    let mut a = alice.clone();
    let sa = open(&mut a, "demo").await?;
    let upstream = e.envoy.upstream_requests().await?;
    let started = std::time::Instant::now();
    let s = expect_refusal(
        lock_wait(&mut a, "demo/q", "demo", sa, Duration::from_secs(30)).await,
        Code::ResourceExhausted,
        "QUEUE_FULL",
    )?;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused at once"
    );
    assert!(s.message().contains("share"), "{}", s.message());
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "never forwarded"
    );
    // Bob takes the key's third place; his second finds the key full.
    waiters.push(tokio::spawn(wait_on(&bob, "demo/q")));
    eventually("three waiters", Duration::from_secs(10), waiting_are(3)).await?;
    let mut b = bob.clone();
    let sb = open(&mut b, "demo").await?;
    let upstream = e.envoy.upstream_requests().await?;
    let s = expect_refusal(
        lock_wait(&mut b, "demo/q", "demo", sb, Duration::from_secs(30)).await,
        Code::ResourceExhausted,
        "QUEUE_FULL",
    )?;
    assert!(s.message().contains("key"), "{}", s.message());
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "never forwarded"
    );
    // A third waiter of alice's on another key: her identity bound (3).
    waiters.push(tokio::spawn(wait_on(&alice, "demo/r")));
    eventually("four waiters", Duration::from_secs(10), waiting_are(4)).await?;
    let s = expect_refusal(
        lock_wait(&mut a, "demo/s", "demo", sa, Duration::from_secs(30)).await,
        Code::ResourceExhausted,
        "QUEUE_FULL",
    )?;
    assert!(s.message().contains("caller"), "{}", s.message());
    // A try-lock is not a waiter: not bounded.
    expect_refusal(
        lock(&mut a, "demo/q", "demo", sa).await,
        Code::Aborted,
        "HELD",
    )?;
    // Reset every waiting stream: the places come back.
    for w in &waiters {
        w.abort();
    }
    eventually(
        "the waiters gauge back to 0",
        Duration::from_secs(10),
        waiting_are(0),
    )
    .await?;
    // And a new waiter is admitted and granted once demo lets go.
    let next = tokio::spawn(wait_on(&alice, "demo/q"));
    eventually("one waiter", Duration::from_secs(10), waiting_are(1)).await?;
    unlock(&mut demo, &held_q).await?;
    let g = next.await???;
    assert_eq!(g.key, "demo/q");
    unlock(&mut demo, &held_r).await?;
    for reason in [
        "queue_full_key",
        "queue_full_key_share",
        "queue_full_identity",
    ] {
        assert!(e.denied(reason).await? >= 1, "{reason}");
    }
    let rejected = e
        .envoy
        .sum("wasmcustom.latchkey_edge.admission_rejected")
        .await?;
    assert!(rejected >= 3);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_move_and_carry_namespace_and_class_only() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let mut demo = e.client("workload/demo").await?;
    let session = open(&mut demo, "demo").await?;
    let before = e.envoy.stats().await?;
    for i in 0..3 {
        let g = lock(&mut demo, &format!("payments/inv-{i}"), "demo", session).await?;
        unlock(&mut demo, &g).await?;
    }
    let _ = lock(&mut demo, "secret-ns/hidden-key", "demo", session).await;
    let after = e.envoy.stats().await?;
    let delta =
        |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    assert_eq!(
        delta("wasmcustom.latchkey_edge.allowed.method.acquire.ns.payments.class.demo"),
        3
    );
    assert_eq!(
        delta("wasmcustom.latchkey_edge.allowed.method.release.ns.payments.class._none"),
        3
    );
    assert_eq!(
        delta("wasmcustom.latchkey_edge.denied.reason.not_authorised"),
        1
    );
    assert_eq!(
        after.get("wasmcustom.latchkey_edge.filter_version"),
        Some(&1)
    );
    assert!(
        after
            .get("wasmcustom.latchkey_edge.grant_table_size")
            .copied()
            .unwrap_or(0)
            >= 5
    );
    assert!(
        after
            .get("wasmcustom.latchkey_edge.grant_table_version")
            .copied()
            .unwrap_or(0)
            > 0
    );
    let prom = e.envoy.prometheus().await?;
    assert!(
        prom.lines().any(|l| l.starts_with("latchkey_edge_allowed{")
            && l.contains("namespace=\"payments\"")
            && l.contains("class=\"demo\"")),
        "labelled allowed counter in:\n{}",
        prom.lines()
            .filter(|l| l.contains("latchkey_edge"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        prom.contains("latchkey_edge_decision_us_bucket"),
        "decision-time histogram"
    );
    for secret in [
        "inv-0",
        "hidden-key",
        "secret-ns",
        "workload/demo",
        "workload_demo",
    ] {
        let leaked: Vec<_> = prom
            .lines()
            .filter(|l| l.contains("latchkey_edge") && l.contains(secret))
            .collect();
        assert!(leaked.is_empty(), "{secret} in stats: {leaked:?}");
    }
    Ok(())
}

/// The same module bytes plus a custom section: a distinct, valid build.
fn rebuilt(wasm: &[u8], label: &str) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }
    let name = b"latchkey.release";
    let mut payload = Vec::new();
    leb(name.len(), &mut payload);
    payload.extend_from_slice(name);
    payload.extend_from_slice(label.as_bytes());
    let mut out = wasm.to_vec();
    out.push(0);
    leb(payload.len(), &mut out);
    out.extend(payload);
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_filter_is_swapped_under_load_with_zero_failed_requests() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let dir = tempfile::tempdir()?;
    let v2 = dir.path().join("latchkey_filter-v2.wasm");
    std::fs::write(&v2, rebuilt(&std::fs::read(filter_wasm()?)?, "v2"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for w in 0..4 {
        let mut c = e.client("workload/demo").await?;
        let (stop, ok) = (stop.clone(), ok.clone());
        workers.push(tokio::spawn(async move {
            let s = open(&mut c, "demo").await?;
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("demo/swap/{w}/{i}");
                let g = lock(&mut c, &key, "demo", s).await.map_err(|st| {
                    anyhow::anyhow!("acquire {key} failed during the swap: {st:?}")
                })?;
                unlock(&mut c, &g).await.map_err(|st| {
                    anyhow::anyhow!("release {key} failed during the swap: {st:?}")
                })?;
                ok.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            anyhow::Ok(())
        }));
    }
    eventually("load running", Duration::from_secs(10), || async {
        anyhow::ensure!(ok.load(Ordering::Relaxed) > 50);
        Ok(())
    })
    .await?;
    let config = latchkey_tests::envoy::dev_filter_config(json!({"filter_version": 2}))?;
    e.envoy.swap_filter(&v2, &config).await?;
    let at_swap = ok.load(Ordering::Relaxed);
    eventually("load after the swap", Duration::from_secs(10), || async {
        anyhow::ensure!(ok.load(Ordering::Relaxed) > at_swap + 200);
        Ok(())
    })
    .await?;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await??;
    }
    assert_eq!(
        e.envoy
            .counter("wasmcustom.latchkey_edge.filter_version")
            .await?,
        2
    );
    Ok(())
}

/// An edge whose grant table comes only from the arbiter (as dev-up ships
/// it), ready once every worker's first refresh has answered.
async fn arbiter_only_edge(overrides: Value) -> anyhow::Result<Edge> {
    let opts = ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..ArbiterOptions::default()
    };
    let stack = stack_with(opts).await?;
    let envoy = Envoy::start(EnvoyOptions::with_arbiter_only_filter(
        stack.arbiter.addr(),
        overrides,
    )?)
    .await?;
    Ok(Edge {
        _stack: stack,
        envoy,
    })
}

async fn wait_for_grant_table(e: &Edge) -> anyhow::Result<()> {
    // As dev-up waits: one refresh has answered (the other workers take
    // that table from shared data on their next tick).
    eventually(
        "the first grant table from the arbiter",
        Duration::from_secs(20),
        || async {
            let n = e
                .envoy
                .counter("wasmcustom.latchkey_edge.policy_refresh.result.updated")
                .await?;
            anyhow::ensure!(n >= 1, "{n} refreshes");
            Ok(())
        },
    )
    .await
}

/// What a hot update changes.
#[derive(Debug, Clone, Copy)]
enum Update {
    /// The same module, a new configuration (`filter_version` + 1).
    ConfigOnly,
    /// New module bytes (a custom section added) and `filter_version` + 1.
    NewModule,
}

/// Calls and failures during one phase of the swap test (phase 0 is before
/// the first swap, phase n after swap n).
#[derive(Debug, Default, Clone)]
struct Phase {
    calls: u64,
    failed: u64,
    permission_denied: u64,
    /// `code/REASON` of the first few failures.
    seen: Vec<String>,
}

/// Issue 19: four callers with grants loop Acquire + Release through the
/// edge while the filter is swapped six times by ECDS; the grant table comes
/// only from the arbiter. Nobody may be refused (least of all told
/// PERMISSION_DENIED) and every swap must show its `filter_version`.
async fn swaps_under_load_deny_nobody(update: Update) -> anyhow::Result<()> {
    const SWAPS: u64 = 6;
    let e = arbiter_only_edge(json!({})).await?;
    wait_for_grant_table(&e).await?;
    let wasm = std::fs::read(filter_wasm()?)?;
    let dir = tempfile::tempdir()?;
    let phase = Arc::new(AtomicU64::new(0));
    let phases = Arc::new(parking_lot::Mutex::new(vec![
        Phase::default();
        SWAPS as usize + 1
    ]));
    let ok = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let mut c = e.client("workload/alice").await?;
        let (stop, ok, phase, phases) = (stop.clone(), ok.clone(), phase.clone(), phases.clone());
        workers.push(tokio::spawn(async move {
            // A fresh session every few seconds: the run may outlast the demo
            // class's 15 s TTL on a busy machine.
            let mut session = (open(&mut c, "demo").await?, std::time::Instant::now());
            // On the very first start a worker decides nothing until its
            // table arrives (POLICY_NOT_READY): wait for this connection's.
            eventually(
                "a grant table on this caller's worker",
                Duration::from_secs(10),
                || {
                    let (mut c, s) = (c.clone(), session.0);
                    async move {
                        let g = lock(&mut c, &format!("demo/swap/{w}/ready"), "demo", s).await?;
                        unlock(&mut c, &g).await?;
                        Ok(())
                    }
                },
            )
            .await?;
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if session.1.elapsed() > Duration::from_secs(4) {
                    session = (open(&mut c, "demo").await?, std::time::Instant::now());
                }
                let key = format!("demo/swap/{w}/{i}");
                i += 1;
                let outcome = match lock(&mut c, &key, "demo", session.0).await {
                    Ok(g) => unlock(&mut c, &g).await.map(|_| 2),
                    Err(s) => Err(s),
                };
                let at = phase.load(Ordering::Relaxed) as usize;
                let mut p = phases.lock();
                let Some(p) = p.get_mut(at) else { continue };
                match outcome {
                    Ok(n) => {
                        p.calls += n;
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(s) => {
                        p.calls += 1;
                        p.failed += 1;
                        if s.code() == Code::PermissionDenied {
                            p.permission_denied += 1;
                        }
                        if p.seen.len() < 3 {
                            let (code, reason) = refusal(&s);
                            p.seen.push(format!("{code:?}/{reason}: {}", s.message()));
                        }
                    }
                }
            }
            anyhow::Ok(())
        }));
    }
    eventually("load running", Duration::from_secs(10), || async {
        anyhow::ensure!(ok.load(Ordering::Relaxed) > 50);
        Ok(())
    })
    .await?;
    for n in 1..=SWAPS {
        let version = n + 1;
        let module = match update {
            Update::ConfigOnly => filter_wasm()?,
            Update::NewModule => {
                let path = dir.path().join(format!("latchkey_filter-swap-{n}.wasm"));
                std::fs::write(&path, rebuilt(&wasm, &format!("swap-{n}")))?;
                path
            }
        };
        let config =
            latchkey_tests::envoy::arbiter_only_filter_config(json!({"filter_version": version}))?;
        phase.store(n, Ordering::Relaxed);
        e.envoy.swap_filter(&module, &config).await?;
        eventually(
            "filter_version of the swap in stats",
            Duration::from_secs(10),
            || async {
                let v = e
                    .envoy
                    .counter("wasmcustom.latchkey_edge.filter_version")
                    .await?;
                anyhow::ensure!(v == version, "filter_version {v}, want {version}");
                Ok(())
            },
        )
        .await?;
        // Traffic on the new filter: at least a second and 200 more calls.
        let (at, since) = (ok.load(Ordering::Relaxed), std::time::Instant::now());
        eventually("load after the swap", Duration::from_secs(20), || async {
            anyhow::ensure!(
                ok.load(Ordering::Relaxed) > at + 100 && since.elapsed() > Duration::from_secs(1)
            );
            Ok(())
        })
        .await?;
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await??;
    }
    let phases = phases.lock().clone();
    let report: Vec<String> = phases
        .iter()
        .enumerate()
        .map(|(n, p)| {
            format!(
                "{update:?} phase {n}: {} calls, {} failed, {} PERMISSION_DENIED {:?}",
                p.calls, p.failed, p.permission_denied, p.seen
            )
        })
        .collect();
    eprintln!("{}", report.join("\n"));
    let failed: u64 = phases.iter().map(|p| p.failed).sum();
    let denied: u64 = phases.iter().map(|p| p.permission_denied).sum();
    anyhow::ensure!(
        failed == 0 && denied == 0,
        "{failed} failed calls ({denied} PERMISSION_DENIED) over {SWAPS} swaps:\n{}",
        report.join("\n")
    );
    assert_eq!(e.denied("not_authorised").await?, 0);
    // Every swapped-in VM started from the table kept in shared data.
    let carried = e
        .envoy
        .counter("wasmcustom.latchkey_edge.grant_table_start.result.carried")
        .await?;
    assert!(
        carried >= SWAPS,
        "{carried} VMs started from the kept table"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn configuration_only_swaps_under_load_deny_nobody() -> anyhow::Result<()> {
    swaps_under_load_deny_nobody(Update::ConfigOnly).await
}

#[tokio::test(flavor = "multi_thread")]
async fn new_module_swaps_under_load_deny_nobody() -> anyhow::Result<()> {
    swaps_under_load_deny_nobody(Update::NewModule).await
}

/// A refresh that can never answer: Envoy refuses a gRPC call to a cluster it
/// does not have, so the filter's refresh fails at dispatch.
fn unreachable_refresh() -> Value {
    json!({"cluster": "no_such_cluster", "period_ms": 300, "timeout_ms": 200, "stale_after_ms": 1000})
}

/// Issue 19: on the very first start, before any refresh answered, the edge
/// has no table: a caller with a grant is told to retry (UNAVAILABLE,
/// POLICY_NOT_READY, and latchctl says so), never PERMISSION_DENIED; the first
/// refresh ends it.
#[tokio::test(flavor = "multi_thread")]
async fn before_its_first_grant_table_the_edge_says_retry_never_permission_denied()
-> anyhow::Result<()> {
    let e = arbiter_only_edge(json!({"refresh": unreachable_refresh()})).await?;
    let mut alice = e.client("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let upstream = e.envoy.upstream_requests().await?;
    let s = expect_refusal(
        lock(&mut alice, "demo/not-ready", "demo", session).await,
        Code::Unavailable,
        "POLICY_NOT_READY",
    )?;
    let err = latchkey_client::Error::from(s);
    assert!(err.is_transient() && err.retry_hint().is_some(), "{err}");
    // The same answer for a caller without a grant: nothing is decided.
    let mut mallory = e.client("workload/mallory").await?;
    expect_refusal(
        lock(&mut mallory, "demo/not-ready", "demo", session).await,
        Code::Unavailable,
        "POLICY_NOT_READY",
    )?;
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "not forwarded"
    );
    // latchctl prints the reason and says to retry.
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"))
            .env_clear()
            .arg("--endpoint")
            .arg(format!("https://{}", e.envoy.addr()))
            .args(latchkey_tests::arbiter::svid_flags("workload/alice")?)
            .args(["acquire", "demo/not-ready", "--class", "demo", "--detach"])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "temporary exits 6: {stderr}");
    assert!(
        stderr.contains("UNAVAILABLE: POLICY_NOT_READY") && stderr.contains("retry"),
        "{stderr}"
    );
    assert!(e.denied("policy_not_ready").await? >= 3);
    assert_eq!(e.denied("not_authorised").await?, 0);
    assert!(
        e.envoy
            .counter("wasmcustom.latchkey_edge.grant_table_start.result.none")
            .await?
            >= 1
    );
    // The first table that arrives ends it (a configuration-only update here).
    let config = latchkey_tests::envoy::arbiter_only_filter_config(json!({"filter_version": 2}))?;
    e.envoy.swap_filter(&filter_wasm()?, &config).await?;
    let g = eventually(
        "served once the table arrived",
        Duration::from_secs(20),
        || {
            let mut alice = alice.clone();
            async move { Ok(lock(&mut alice, "demo/not-ready", "demo", session).await?) }
        },
    )
    .await?;
    unlock(&mut alice, &g).await?;
    Ok(())
}

/// Issue 19: a table the arbiter has not confirmed for `stale_after_ms` still
/// lets through what it covers (the arbiter authorises again) and answers the
/// rest UNAVAILABLE POLICY_STALE; a refresh makes it final again. The swapped-in
/// VM that cannot refresh starts from the table the earlier one kept.
#[tokio::test(flavor = "multi_thread")]
async fn a_stale_table_lets_covered_keys_through_and_tells_the_rest_to_retry() -> anyhow::Result<()>
{
    let fresh_refresh = json!({"cluster": "arbiter_policy", "period_ms": 300, "timeout_ms": 200, "stale_after_ms": 1000});
    let e = arbiter_only_edge(json!({"refresh": fresh_refresh})).await?;
    wait_for_grant_table(&e).await?;
    let mut alice = e.client("workload/alice").await?;
    let mut mallory = e.client("workload/mallory").await?;
    let (sa, sm) = (
        open(&mut alice, "demo").await?,
        open(&mut mallory, "demo").await?,
    );
    // Every worker has the first table once another worker's is in shared data.
    let g = eventually(
        "served with the first table",
        Duration::from_secs(10),
        || {
            let mut alice = alice.clone();
            async move { Ok(lock(&mut alice, "demo/stale/a", "demo", sa).await?) }
        },
    )
    .await?;
    unlock(&mut alice, &g).await?;
    let config = latchkey_tests::envoy::arbiter_only_filter_config(
        json!({"filter_version": 2, "refresh": unreachable_refresh()}),
    )?;
    e.envoy.swap_filter(&filter_wasm()?, &config).await?;
    eventually(
        "mallory told to retry by a stale table",
        Duration::from_secs(20),
        || {
            let mut mallory = mallory.clone();
            async move {
                expect_refusal(
                    lock(&mut mallory, "demo/stale/m", "demo", sm).await,
                    Code::Unavailable,
                    "POLICY_STALE",
                )?;
                Ok(())
            }
        },
    )
    .await?;
    // Covered keys go through the stale table; the arbiter still decides.
    for i in 0..5 {
        let g = lock(&mut alice, &format!("demo/stale/a{i}"), "demo", sa).await?;
        unlock(&mut alice, &g).await?;
    }
    expect_refusal(
        lock(&mut alice, "payments/not-hers", "demo", sa).await,
        Code::Unavailable,
        "POLICY_STALE",
    )?;
    assert!(e.denied("policy_stale").await? >= 2);
    assert!(
        e.envoy
            .counter("wasmcustom.latchkey_edge.grant_table_start.result.carried")
            .await?
            >= 1
    );
    // A working refresh again: the denial is final again.
    let config = latchkey_tests::envoy::arbiter_only_filter_config(
        json!({"filter_version": 3, "refresh": fresh_refresh}),
    )?;
    e.envoy.swap_filter(&filter_wasm()?, &config).await?;
    eventually(
        "mallory denied by a fresh table",
        Duration::from_secs(20),
        || {
            let mut mallory = mallory.clone();
            async move {
                expect_refusal(
                    lock(&mut mallory, "demo/stale/m", "demo", sm).await,
                    Code::PermissionDenied,
                    "NOT_AUTHORISED",
                )?;
                Ok(())
            }
        },
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_filter_update_is_refused_and_the_old_filter_keeps_serving() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    // A config the filter refuses in on_configure (unknown field).
    let config =
        latchkey_tests::envoy::dev_filter_config(json!({"filter_version": 3, "max_waiter": 1}))?;
    let before = e
        .envoy
        .counter("extension_config_discovery.http_filter.latchkey.edge.update_rejected")
        .await?;
    e.envoy.offer_filter(&filter_wasm()?, &config)?;
    eventually(
        "Envoy to reject the update",
        Duration::from_secs(20),
        || async {
            let n = e
                .envoy
                .counter("extension_config_discovery.http_filter.latchkey.edge.update_rejected")
                .await?;
            anyhow::ensure!(n > before, "{n}");
            Ok(())
        },
    )
    .await?;
    assert_eq!(
        e.envoy
            .counter("wasmcustom.latchkey_edge.filter_version")
            .await?,
        1
    );
    assert!(
        e.envoy
            .counter("wasmcustom.latchkey_edge.config_errors")
            .await?
            >= 1
    );
    let mut demo = e.client("workload/demo").await?;
    let session = open(&mut demo, "demo").await?;
    let g = lock(&mut demo, "demo/still-served", "demo", session).await?;
    unlock(&mut demo, &g).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_and_oversized_bodies_get_clean_errors_and_never_reach_the_arbiter()
-> anyhow::Result<()> {
    let e = edge(json!({"max_message_bytes": 4096})).await?;
    let ch = channel(e.envoy.addr(), "workload/demo").await?;
    let acquire = "/latchkey.lock.v1.Lock/Acquire";
    let good = encode(&acquire_request("demo/raw", "demo", 1, WaitMode::WaitNone));
    let upstream = e.envoy.upstream_requests().await?;
    let mut short_frame = good.clone();
    short_frame.truncate(good.len() - 2);
    let mut compressed = good.clone();
    compressed[0] = 1;
    let mut two_frames = good.clone();
    two_frames.extend_from_slice(&good);
    let cases: Vec<(&str, Vec<u8>, i32)> = vec![
        ("empty body", vec![], 3),
        ("half a frame header", vec![0, 0, 0], 3),
        ("frame longer than the body", short_frame, 3),
        ("two frames", two_frames, 3),
        ("compressed", compressed, 3),
        ("not protobuf", frame(&[0xff, 0xff, 0xff, 0xff]), 3),
        ("key with a varint", frame(&[0x08, 0x01]), 3),
        (
            "bad key",
            encode(&acquire_request("demo//x", "demo", 1, WaitMode::WaitNone)),
            3,
        ),
        ("oversized", frame(&vec![0x42; 100_000]), 8),
        ("oversized declared", vec![0, 0x10, 0, 0, 0, 1, 2, 3], 8),
    ];
    for (what, body, code) in cases {
        let (status, message) =
            raw_call(ch.clone(), acquire, body, &[("x-lock-key", "demo/raw")]).await?;
        assert_eq!(status, code, "{what}: {message}");
        assert!(!message.is_empty(), "{what}: a message says why");
    }
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "none reached the arbiter"
    );
    // The same raw path with a good body does reach it (the check above is meaningful).
    let (status, _) = raw_call(ch.clone(), acquire, good, &[("x-lock-key", "demo/raw")]).await?;
    assert_ne!(status, 3);
    assert!(e.envoy.upstream_requests().await? > upstream);
    assert!(e.denied("oversized").await? >= 2);
    assert!(e.denied("bad_request").await? >= 5);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grant_change_reaches_the_edge_without_a_reload() -> anyhow::Result<()> {
    let policies = tempfile::tempdir()?;
    let dev = latchkey_tests::workspace_root().join("policies/dev");
    for sub in ["classes", "grants"] {
        std::fs::create_dir_all(policies.path().join(sub))?;
        for f in std::fs::read_dir(dev.join(sub))? {
            let f = f?;
            std::fs::copy(f.path(), policies.path().join(sub).join(f.file_name()))?;
        }
    }
    latchkey_tests::write_pause_test_fixtures(policies.path())?;
    let opts = ArbiterOptions {
        policies_dir: policies.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let e = edge_with(
        opts,
        json!({"refresh": {"cluster": "arbiter", "period_ms": 300}}),
    )
    .await?;
    let mut alice = e.client("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    expect_refusal(
        lock(&mut alice, "newteam/x", "demo", session).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    let version = e
        .envoy
        .counter("wasmcustom.latchkey_edge.grant_table_version")
        .await?;
    std::fs::write(
        policies.path().join("grants/newteam.toml"),
        format!(
            "[[grant]]\nidentity = \"{}\"\nprefixes = [\"newteam\"]\n",
            spiffe("workload/alice")
        ),
    )?;
    let g = eventually("the new grant at the edge", Duration::from_secs(20), || {
        let mut alice = alice.clone();
        async move { Ok(lock(&mut alice, "newteam/x", "demo", session).await?) }
    })
    .await?;
    unlock(&mut alice, &g).await?;
    assert_ne!(
        e.envoy
            .counter("wasmcustom.latchkey_edge.grant_table_version")
            .await?,
        version
    );
    assert!(
        e.envoy
            .counter("wasmcustom.latchkey_edge.policy_refresh.result.updated")
            .await?
            >= 1
    );
    Ok(())
}

/// A minimal proxy-wasm module (ABI 0.2.1) that loads and configures fine and
/// traps on the first request's headers: a stand-in for a filter that crashes.
fn trapping_module() -> Vec<u8> {
    fn section(id: u8, content: &[u8], out: &mut Vec<u8>) {
        out.push(id);
        out.push(u8::try_from(content.len()).unwrap_or(0));
        out.extend_from_slice(content);
    }
    fn name(n: &str, out: &mut Vec<u8>) {
        out.push(u8::try_from(n.len()).unwrap_or(0));
        out.extend_from_slice(n.as_bytes());
    }
    let mut m = vec![0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00];
    // Types: () -> (); (i32) -> i32; (i32, i32, i32) -> i32; (i32, i32) -> ().
    section(
        1,
        &[
            4, 0x60, 0, 0, 0x60, 1, 0x7f, 1, 0x7f, 0x60, 3, 0x7f, 0x7f, 0x7f, 1, 0x7f, 0x60, 2,
            0x7f, 0x7f, 0,
        ],
        &mut m,
    );
    section(3, &[4, 0, 1, 2, 3], &mut m);
    section(5, &[1, 0, 1], &mut m);
    let mut exports = vec![5];
    for (n, kind, index) in [
        ("memory", 2u8, 0u8),
        ("proxy_abi_version_0_2_1", 0, 0),
        ("proxy_on_memory_allocate", 0, 1),
        ("proxy_on_request_headers", 0, 2),
        ("proxy_on_context_create", 0, 3),
    ] {
        name(n, &mut exports);
        exports.push(kind);
        exports.push(index);
    }
    section(7, &exports, &mut m);
    section(
        10,
        &[
            4, // bodies
            2, 0, 0x0b, // abi marker: end
            5, 0, 0x41, 0x80, 0x08, 0x0b, // allocate: i32.const 1024
            3, 0, 0x00, 0x0b, // request headers: unreachable
            2, 0, 0x0b, // context create: end
        ],
        &mut m,
    );
    m
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crashing_filter_fails_closed_and_a_good_update_recovers() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let dir = tempfile::tempdir()?;
    let crasher = dir.path().join("crasher.wasm");
    std::fs::write(&crasher, trapping_module())?;
    let config = latchkey_tests::envoy::dev_filter_config(json!({"filter_version": 66}))?;
    e.envoy.swap_filter(&crasher, &config).await?;
    let mut demo = e.client("workload/demo").await?;
    let upstream = e.envoy.upstream_requests().await?;
    for i in 0..3 {
        let key = format!("demo/crash/{i}");
        let r = demo
            .inspect(keyed(InspectRequest { key: key.clone() }, &key))
            .await;
        let s = r
            .err()
            .ok_or_else(|| anyhow::anyhow!("a crashed filter let a request through"))?;
        assert_eq!(s.code(), Code::Unavailable, "{s:?}");
    }
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "nothing reached the arbiter"
    );
    let stats = e.envoy.stats().await?;
    let reloads: u64 = stats
        .iter()
        .filter(|(k, _)| k.starts_with("wasm.latchkey_edge.vm_reload"))
        .map(|(_, v)| *v)
        .sum();
    assert!(reloads >= 1, "FAIL_RELOAD reloaded the VM");
    // Shipping the good filter again restores service, without a restart.
    let good = latchkey_tests::envoy::dev_filter_config(json!({"filter_version": 4}))?;
    e.envoy.swap_filter(&filter_wasm()?, &good).await?;
    let session = open(&mut demo, "demo").await?;
    let g = lock(&mut demo, "demo/after-crash", "demo", session).await?;
    unlock(&mut demo, &g).await?;
    assert_eq!(
        e.envoy
            .counter("wasmcustom.latchkey_edge.filter_version")
            .await?,
        4
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn each_identity_has_its_own_request_rate_limit() -> anyhow::Result<()> {
    let opts = ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..ArbiterOptions::default()
    };
    let stack = stack_with(opts).await?;
    let mut envoy_opts = EnvoyOptions::with_filter(stack.arbiter.addr(), json!({}))?;
    envoy_opts.rate_per_second = 5;
    envoy_opts.rate_burst = 5;
    let envoy = Envoy::start(envoy_opts).await?;
    let e = Edge {
        _stack: stack,
        envoy,
    };
    let mut alice = e.client("workload/alice").await?;
    let mut limited = 0;
    for i in 0..20 {
        let key = format!("demo/rate/{i}");
        if let Err(s) = alice
            .inspect(keyed(InspectRequest { key: key.clone() }, &key))
            .await
        {
            assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
            limited += 1;
        }
    }
    assert!(limited >= 10, "alice was limited ({limited} of 20)");
    // Bob's bucket is his own.
    let mut bob = e.client("workload/bob").await?;
    bob.inspect(keyed(
        InspectRequest {
            key: "demo/rate/bob".into(),
        },
        "demo/rate/bob",
    ))
    .await?;
    assert!(
        e.envoy
            .counter("latchkey_identity_rate.http_local_rate_limit.rate_limited")
            .await?
            >= 10
    );
    Ok(())
}

/// Ring-hash affinity follows the authorised key: with two arbiters behind
/// Envoy, every call for one key (acquire, both waiters, inspect) reaches the
/// same arbiter — the one whose in-memory FIFO queues that key — and the keys
/// spread over both.
#[tokio::test(flavor = "multi_thread")]
async fn every_call_for_a_key_reaches_the_same_arbiter() -> anyhow::Result<()> {
    use latchkey_tests::arbiter::Arbiter;
    let opts = ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..Default::default()
    };
    let stack = stack_with(opts.clone()).await?;
    let second = Arbiter::start(&stack.etcd, opts).await?;
    let mut envoy_opts = EnvoyOptions::with_filter(stack.arbiter.addr(), json!({}))?;
    envoy_opts.second_arbiter = Some(second.addr());
    let envoy = Envoy::start(envoy_opts).await?;
    let direct = [
        LockClient::new(channel(stack.arbiter.addr(), "workload/alice").await?),
        LockClient::new(channel(second.addr(), "workload/alice").await?),
    ];
    let edge = Edge {
        _stack: stack,
        envoy,
    };
    let mut alice = edge.client("workload/alice").await?;
    let mut bob = edge.client("workload/bob").await?;
    let mut demo = edge.client("workload/demo").await?;
    let mut served = [0u32; 2];
    for i in 0..12 {
        // fresh sessions each round: the loop may outlast a 15 s TTL on a busy machine
        let (sa, sb, sd) = (
            open(&mut alice, "demo").await?,
            open(&mut bob, "demo").await?,
            open(&mut demo, "demo").await?,
        );
        let key = format!("demo/affinity-{i}");
        let held = lock(&mut alice, &key, "demo", sa).await?;
        let (mut b, k) = (bob.clone(), key.clone());
        let bob_wait = tokio::spawn(async move {
            lock_wait(&mut b, &k, "demo", sb, Duration::from_secs(20)).await
        });
        eventually("bob queued first", Duration::from_secs(10), || {
            let (mut via_edge, key) = (alice.clone(), key.clone());
            async move {
                let r = via_edge
                    .inspect(keyed(InspectRequest { key: key.clone() }, &key))
                    .await?;
                anyhow::ensure!(r.into_inner().waiters == 1, "bob not queued yet");
                Ok(())
            }
        })
        .await?;
        let (mut d, k) = (demo.clone(), key.clone());
        let demo_wait = tokio::spawn(async move {
            lock_wait(&mut d, &k, "demo", sd, Duration::from_secs(20)).await
        });
        // both waiters queued on ONE arbiter, and an inspect through Envoy lands there too
        let on = eventually(
            "both waiters on one arbiter",
            Duration::from_secs(10),
            || {
                let (mut via_edge, direct, key) = (alice.clone(), direct.clone(), key.clone());
                async move {
                    let seen = via_edge
                        .inspect(keyed(InspectRequest { key: key.clone() }, &key))
                        .await?
                        .into_inner()
                        .waiters;
                    anyhow::ensure!(seen == 2, "Envoy's inspect saw {seen} waiters");
                    let mut per = [0u32; 2];
                    for (n, mut c) in direct.into_iter().enumerate() {
                        per[n] = c
                            .inspect(InspectRequest { key: key.clone() })
                            .await?
                            .into_inner()
                            .waiters;
                    }
                    match per {
                        [2, 0] => Ok(0),
                        [0, 2] => Ok(1),
                        other => anyhow::bail!("waiters split across arbiters: {other:?}"),
                    }
                }
            },
        )
        .await?;
        served[on] += 1;
        unlock(&mut alice, &held).await?;
        let second_holder = bob_wait.await??;
        assert!(second_holder.token > held.token);
        unlock(&mut bob, &second_holder).await?;
        let third = demo_wait.await??;
        assert!(third.token > second_holder.token, "FIFO: bob, then demo");
        unlock(&mut demo, &third).await?;
    }
    assert!(
        served[0] > 0 && served[1] > 0,
        "keys spread over both arbiters: {served:?}"
    );
    drop(second);
    Ok(())
}
