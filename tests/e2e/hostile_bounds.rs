//! Hostile workloads against the per-identity bounds (issue 31, findings 5
//! and 6): real etcd + the real arbiter (+ real Envoy with the real filter
//! where the edge is involved), attacked with valid SVIDs of their own.
//!
//! - Finding 5: one identity parked waiting Acquires on a shared key until
//!   its queue was full for everyone else. Now an identity gets at most its
//!   share (half, rounded up) of a key's waiter places, at the edge and at
//!   the arbiter.
//! - Finding 6: health `Watch` and reflection streams were outside every
//!   bound (1,600 on one certificate, all accepted). Now the arbiter bounds
//!   them per identity and in total, and the edge forwards neither.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use latchkey_arbiter::grpc_health::ProbeStreamLimits;
use latchkey_proto::lockv1::InspectRequest;
use latchkey_tests::arbiter::{certs, channel};
use latchkey_tests::eventually;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::codegen::Service;
use tonic::transport::Channel;

use crate::edge::{edge, lock, lock_wait};
use crate::support::*;

const WATCH: &str = "/grpc.health.v1.Health/Watch";
const REFLECTION_V1: &str = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
const REFLECTION_V1ALPHA: &str = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

/// A bounded wait for anything that should answer at once (or hang, when
/// the bound under test is missing: then the test fails instead of hanging).
const PROMPTLY: Duration = Duration::from_secs(10);

/// A gRPC frame around `message`.
fn frame(message: &[u8]) -> Bytes {
    let mut b = vec![0u8];
    b.extend_from_slice(&(message.len() as u32).to_be_bytes());
    b.extend_from_slice(message);
    Bytes::from(b)
}

/// `HealthCheckRequest{service: ""}` (the server as a whole).
fn watch_request() -> Bytes {
    frame(&[])
}

/// `ServerReflectionRequest{list_services: "*"}` (field 7).
fn list_services_request() -> Bytes {
    frame(&[0x3a, 0x01, b'*'])
}

/// How opening a stream went.
enum Opened {
    /// The server's first message came; the stream stays open while this
    /// lives (its response body, and for reflection its request body).
    Open(#[allow(dead_code)] OpenStream),
    /// `grpc-status` and `grpc-message`, decoded.
    Refused(i32, String),
}

struct OpenStream {
    _body: tonic::body::Body,
    _sender: Option<mpsc::Sender<Result<Frame<Bytes>, Infallible>>>,
}

impl Opened {
    fn refusal(&self) -> Option<(i32, &str)> {
        match self {
            Opened::Refused(code, m) => Some((*code, m)),
            Opened::Open(_) => None,
        }
    }
}

/// Opens a health `Watch` or a reflection stream over `channel` and waits
/// for the server's first answer: a message (the stream is open) or a status.
/// A reflection stream's request side stays open too, as a client's would.
async fn open_stream(channel: &Channel, path: &str) -> anyhow::Result<Opened> {
    let (body, sender) = if path == WATCH {
        (tonic::body::Body::new(Full::new(watch_request())), None)
    } else {
        let (tx, rx) = mpsc::channel(1);
        tx.send(Ok(Frame::data(list_services_request()))).await?;
        (
            tonic::body::Body::new(StreamBody::new(ReceiverStream::new(rx))),
            Some(tx),
        )
    };
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)?;
    let mut channel = channel.clone();
    let opened = async move {
        std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
        let resp = channel.call(req).await?;
        let (parts, mut body) = resp.into_parts();
        let status = |map: &http::HeaderMap| {
            map.get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|s| s.parse::<i32>().ok())
        };
        let message = |map: &http::HeaderMap| {
            map.get("grpc-message")
                .and_then(|v| v.to_str().ok())
                .map(decoded)
                .unwrap_or_default()
        };
        if let Some(code) = status(&parts.headers) {
            return anyhow::Ok(Opened::Refused(code, message(&parts.headers)));
        }
        match body.frame().await {
            Some(Ok(f)) if f.is_data() => Ok(Opened::Open(OpenStream {
                _body: body,
                _sender: sender,
            })),
            Some(Ok(f)) => {
                let trailers = f.into_trailers().unwrap_or_default();
                match status(&trailers) {
                    Some(code) => Ok(Opened::Refused(code, message(&trailers))),
                    None => anyhow::bail!("{path}: trailers without a grpc-status"),
                }
            }
            Some(Err(e)) => anyhow::bail!("{path}: {e}"),
            None => anyhow::bail!("{path}: the stream ended without an answer"),
        }
    };
    tokio::time::timeout(PROMPTLY, opened)
        .await
        .map_err(|_| anyhow::anyhow!("{path}: no answer in {PROMPTLY:?}"))?
}

/// Percent-decoding is enough for the messages tonic and the edge send.
fn decoded(message: &str) -> String {
    let bytes = message.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = message.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Opens `n` streams on `path` and fails unless every one is open.
async fn open_all(channel: &Channel, path: &str, n: usize) -> anyhow::Result<Vec<Opened>> {
    let mut open = Vec::with_capacity(n);
    for i in 0..n {
        let s = open_stream(channel, path).await?;
        if let Some((code, m)) = s.refusal() {
            anyhow::bail!("{path} stream {i} of {n} refused: {code} {m}");
        }
        open.push(s);
    }
    Ok(open)
}

fn expect_too_many(opened: &Opened, flag: &str) -> anyhow::Result<()> {
    match opened.refusal() {
        Some((8, m)) => {
            anyhow::ensure!(m.contains(flag), "the message names {flag}: {m}");
            Ok(())
        }
        Some((code, m)) => anyhow::bail!("expected RESOURCE_EXHAUSTED, got {code}: {m}"),
        None => anyhow::bail!("the stream was accepted above the bound ({flag})"),
    }
}

/// Finding 6, at the arbiter with its default bounds: one workload
/// certificate opens health `Watch` streams straight to the arbiter until
/// the bound (16); the next Watch and a reflection stream are refused
/// RESOURCE_EXHAUSTED naming `--max-probe-streams-per-identity`; another
/// identity still opens one; a stream alice closes is hers to open again.
/// `Health/Check` is never refused (Envoy's health checks use it).
#[tokio::test(flavor = "multi_thread")]
async fn health_watch_and_reflection_streams_are_bounded_per_identity() -> anyhow::Result<()> {
    let s = stack().await?;
    let bound = ProbeStreamLimits::default().per_identity as usize;
    let alice = channel(s.arbiter.addr(), "workload/alice").await?;
    let mut alices = open_all(&alice, WATCH, bound / 2).await?;
    alices.extend(open_all(&alice, REFLECTION_V1, bound - bound / 2).await?);
    let flag = "--max-probe-streams-per-identity";
    for path in [WATCH, REFLECTION_V1, REFLECTION_V1ALPHA] {
        expect_too_many(&open_stream(&alice, path).await?, flag)?;
    }
    // Her Health/Check still answers.
    let check = crate::edge::raw_call(
        alice.clone(),
        "/grpc.health.v1.Health/Check",
        watch_request().to_vec(),
        &[],
    )
    .await?;
    anyhow::ensure!(check.0 == 0, "Check: {check:?}");
    // Another certificate is not affected.
    let bob = channel(s.arbiter.addr(), "workload/bob").await?;
    let bobs = open_all(&bob, WATCH, 1).await?;
    // A closed stream's place comes back (once the arbiter has seen the reset).
    alices.pop();
    let again = eventually("alice's closed stream's place", PROMPTLY, || {
        let alice = alice.clone();
        async move {
            let s = open_stream(&alice, WATCH).await?;
            match s.refusal() {
                None => Ok(s),
                Some((code, m)) => anyhow::bail!("still refused: {code} {m}"),
            }
        }
    })
    .await?;
    expect_too_many(&open_stream(&alice, WATCH).await?, flag)?;
    drop((alices, again, bobs));
    Ok(())
}

/// An arbiter on `etcd` with the given probe-stream bounds, in this process.
struct BoundedArbiter {
    addr: SocketAddr,
    _state: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for BoundedArbiter {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

async fn arbiter_with(
    etcd: &latchkey_tests::etcd::EtcdServer,
    probe_streams: ProbeStreamLimits,
) -> anyhow::Result<BoundedArbiter> {
    let certs = certs()?;
    let state = tempfile::TempDir::new()?;
    let svid = certs.svid("latchkey/arbiter");
    let mut config = latchkey_arbiter::Config::new(
        vec![etcd.endpoint()],
        latchkey_tests::dev_policies()?.to_path_buf(),
        state.path().to_path_buf(),
    );
    config.tls = Some(latchkey_arbiter::TlsFiles {
        cert: svid.cert,
        key: svid.key,
        client_ca: certs.ca(),
    });
    config.trust_domain = latchkey_tests::arbiter::TRUST_DOMAIN.into();
    config.trust_unwitnessed_log = true;
    config.probe_streams = probe_streams;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(latchkey_arbiter::run(listener, config, async {
        let _ = rx.await;
    }));
    let arbiter = BoundedArbiter {
        addr,
        _state: state,
        stop: Some(tx),
    };
    eventually("the arbiter to answer", Duration::from_secs(20), || async {
        let ch = channel(addr, "workload/demo").await?;
        let (code, m) = crate::edge::raw_call(
            ch,
            "/grpc.health.v1.Health/Check",
            watch_request().to_vec(),
            &[],
        )
        .await?;
        anyhow::ensure!(code == 0, "{code} {m}");
        Ok(())
    })
    .await?;
    Ok(arbiter)
}

/// Finding 6, the bound for all callers together: with 3 per identity and
/// 5 in all, alice takes 3 and bob 2; demo's first stream is refused naming
/// `--max-probe-streams`, and gets a place once bob closes one.
#[tokio::test(flavor = "multi_thread")]
async fn health_watch_and_reflection_streams_are_bounded_in_total() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let etcd = latchkey_tests::etcd::EtcdServer::start().await?;
    let a = arbiter_with(
        &etcd,
        ProbeStreamLimits {
            per_identity: 3,
            total: 5,
        },
    )
    .await?;
    let alice = channel(a.addr, "workload/alice").await?;
    let bob = channel(a.addr, "workload/bob").await?;
    let demo = channel(a.addr, "workload/demo").await?;
    let alices = open_all(&alice, WATCH, 3).await?;
    expect_too_many(
        &open_stream(&alice, REFLECTION_V1ALPHA).await?,
        "--max-probe-streams-per-identity",
    )?;
    let mut bobs = open_all(&bob, REFLECTION_V1, 1).await?;
    bobs.extend(open_all(&bob, WATCH, 1).await?);
    for path in [WATCH, REFLECTION_V1] {
        expect_too_many(&open_stream(&demo, path).await?, "--max-probe-streams")?;
    }
    bobs.pop();
    let demos = eventually("a place for demo", PROMPTLY, || {
        let demo = demo.clone();
        async move {
            let s = open_stream(&demo, WATCH).await?;
            match s.refusal() {
                None => Ok(s),
                Some((code, m)) => anyhow::bail!("still refused: {code} {m}"),
            }
        }
    })
    .await?;
    drop((alices, bobs, demos));
    Ok(())
}

/// Finding 6, at the edge: the filter forwards no health or reflection call
/// (UNIMPLEMENTED from the edge itself, nothing reaches the arbiter), so
/// the edge's own bounds need not cover them and a workload behind the edge
/// cannot reach the arbiter's probe services at all.
#[tokio::test(flavor = "multi_thread")]
async fn the_edge_forwards_no_health_watch_or_reflection_stream() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let mallory = channel(e.envoy.addr(), "workload/mallory").await?;
    let upstream = e.envoy.upstream_requests().await?;
    for _ in 0..3 {
        for path in [WATCH, REFLECTION_V1, REFLECTION_V1ALPHA] {
            match open_stream(&mallory, path).await?.refusal() {
                Some((12, _)) => {}
                Some((code, m)) => anyhow::bail!("{path} through the edge: {code} {m}"),
                None => anyhow::bail!("{path} through the edge was forwarded"),
            }
        }
    }
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "nothing reached the arbiter"
    );
    assert!(e.denied("unknown_method").await? >= 9);
    Ok(())
}

/// Finding 5, at the edge (real Envoy, the real filter): with `demo`'s
/// waiter bound at 4, bob parks his share (2) of waiting Acquires on a key
/// alice holds; his next one is refused at the edge (RESOURCE_EXHAUSTED
/// QUEUE_FULL naming his share, never forwarded); workload/demo still gets a
/// place on the key.
#[tokio::test(flavor = "multi_thread")]
async fn one_identity_cannot_fill_a_shared_keys_queue_at_the_edge() -> anyhow::Result<()> {
    let e = edge(json!({
        "refresh": null,
        "classes": [{"name": "demo", "maxWaitersPerKey": 4}],
    }))
    .await?;
    let key = "demo/shared-queue";
    let mut alice = e.client("workload/alice").await?;
    let sa = open(&mut alice, "demo").await?;
    let held = lock(&mut alice, key, "demo", sa).await?;
    let bob = e.client("workload/bob").await?;
    let sb = open(&mut bob.clone(), "demo").await?;
    let waiting = "wasmcustom.latchkey_edge.waiters.ns.demo.class.demo";
    let mut waits = Vec::new();
    for n in 1..=2u64 {
        let mut c = bob.clone();
        waits.push(tokio::spawn(async move {
            lock_wait(&mut c, key, "demo", sb, Duration::from_secs(60)).await
        }));
        eventually("bob's waiter at the edge", PROMPTLY, || async {
            let got = e.envoy.counter(waiting).await?;
            anyhow::ensure!(got == n, "{got} of {n}");
            Ok(())
        })
        .await?;
    }
    // Bob's third: beyond his share, refused by the edge at once (were it
    // admitted it would wait for its whole deadline, and fail the test).
    let upstream = e.envoy.upstream_requests().await?;
    let over = lock_wait(&mut bob.clone(), key, "demo", sb, Duration::from_secs(10)).await;
    let status = expect_refusal(over, Code::ResourceExhausted, "QUEUE_FULL")?;
    assert!(
        status.message().contains("share") && status.message().contains("maxWaitersPerKey"),
        "the message names the bound: {}",
        status.message()
    );
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "never forwarded"
    );
    assert!(e.denied("queue_full_key_share").await? >= 1);
    // demo still gets a place on the key (and so would a second demo waiter).
    let mut demo = e.client("workload/demo").await?;
    let sd = open(&mut demo, "demo").await?;
    let mut d = demo.clone();
    waits.push(tokio::spawn(async move {
        lock_wait(&mut d, key, "demo", sd, Duration::from_secs(60)).await
    }));
    eventually("demo's waiter at the edge", PROMPTLY, || async {
        let got = e.envoy.counter(waiting).await?;
        anyhow::ensure!(got == 3, "{got} of 3");
        Ok(())
    })
    .await?;
    // ... and at the arbiter: three waiters queued behind alice.
    eventually("three waiters at the arbiter", PROMPTLY, || {
        let mut alice = alice.clone();
        async move {
            let view = alice
                .inspect(crate::edge::keyed(InspectRequest { key: key.into() }, key))
                .await?
                .into_inner();
            anyhow::ensure!(view.waiters == 3, "{} queued", view.waiters);
            Ok(())
        }
    })
    .await?;
    for w in &waits {
        anyhow::ensure!(!w.is_finished(), "a waiter was answered: {w:?}");
        w.abort();
    }
    crate::edge::unlock(&mut alice, &held).await?;
    Ok(())
}

/// Finding 5, at the arbiter for a direct caller (the class's default bound,
/// 64): bob parks his share (32) of waiting Acquires on a key alice holds;
/// his next one is refused RESOURCE_EXHAUSTED QUEUE_FULL naming his share;
/// workload/demo still queues on the key.
#[tokio::test(flavor = "multi_thread")]
async fn one_identity_cannot_fill_a_shared_keys_queue_at_the_arbiter() -> anyhow::Result<()> {
    const SHARE: u32 = 32;
    let s = stack().await?;
    let key = "demo/shared-queue";
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let sa = open(&mut alice, "demo").await?;
    try_lock(&mut alice, key, "demo", sa).await?;
    let bob = s.arbiter.lock("workload/bob").await?;
    let sb = open(&mut bob.clone(), "demo").await?;
    let mut waits = Vec::new();
    for _ in 0..SHARE {
        let mut c = bob.clone();
        waits.push(tokio::spawn(async move {
            wait_lock(&mut c, key, "demo", sb, Duration::from_secs(60)).await
        }));
    }
    let queued = |n: u32| {
        let alice = alice.clone();
        move || {
            let mut alice = alice.clone();
            async move {
                let view = alice
                    .inspect(InspectRequest { key: key.into() })
                    .await?
                    .into_inner();
                anyhow::ensure!(view.waiters == n, "{} of {n} queued", view.waiters);
                Ok(())
            }
        }
    };
    eventually("bob's share queued", Duration::from_secs(20), queued(SHARE)).await?;
    // Bob's next: beyond his share, refused at once (were it queued it
    // would wait for its whole deadline, and fail the test).
    let over = wait_lock(&mut bob.clone(), key, "demo", sb, Duration::from_secs(10)).await;
    let status = expect_refusal(over, Code::ResourceExhausted, "QUEUE_FULL")?;
    assert!(
        status.message().contains("share") && status.message().contains(&SHARE.to_string()),
        "the message names the bound: {}",
        status.message()
    );
    // demo still queues on the key.
    let mut demo = s.arbiter.lock("workload/demo").await?;
    let sd = open(&mut demo, "demo").await?;
    waits.push(tokio::spawn(async move {
        wait_lock(&mut demo, key, "demo", sd, Duration::from_secs(60)).await
    }));
    eventually("demo queued", PROMPTLY, queued(SHARE + 1)).await?;
    for w in &waits {
        anyhow::ensure!(!w.is_finished(), "a waiter was answered: {w:?}");
        w.abort();
    }
    Ok(())
}
