//! Hostile workloads against the edge (issue 10): real Envoy + the real Wasm
//! filter + the real arbiter and etcd, attacked with valid SVIDs of their own.
//!
//! Each scenario is the regression test of one finding: identity smuggled in
//! request trailers, admin calls and unknown paths through the edge, admission
//! slots aimed at another tenant's key, admission places kept by a stalled
//! reader, a flood of idle KeepAlive streams, and a client-sent `x-lock-key`.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::adminv1::{AdvanceEpochRequest, GetEdgePolicyRequest, GetStatusRequest};
use latchkey_proto::lockv1::{
    CloseSessionRequest, InspectRequest, KeepAliveRequest, OpenSessionRequest, ReleaseRequest,
    WaitMode,
};
use latchkey_tests::arbiter::{ArbiterOptions, certs, channel, spiffe};
use latchkey_tests::eventually;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::codegen::Service;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::edge::{acquire_request, edge, edge_with, encode, lock, lock_wait, unlock};
use crate::support::*;

const LOCK: &str = "/latchkey.lock.v1.Lock/";
const ADMIN: &str = "/latchkey.admin.v1.Admin/";

/// How a raw call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// `grpc-status` and `grpc-message`.
    Status(i32, String),
    /// No status: the stream or the connection was reset.
    Reset(String),
}

/// One gRPC call with any body, headers and request *trailers* (an HTTP/2
/// HEADERS frame after the body), through hyper's h2 client.
async fn call_with_trailers(
    channel: Channel,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
    trailers: &[(&str, &str)],
) -> anyhow::Result<Outcome> {
    let mut map = http::HeaderMap::new();
    for (k, v) in trailers {
        map.append(
            http::HeaderName::from_bytes(k.as_bytes())?,
            http::HeaderValue::from_str(v)?,
        );
    }
    let body = Full::new(Bytes::from(body)).with_trailers(async move { Some(Ok(map)) });
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(tonic::body::Body::new(body))?;
    let call = async move {
        let mut channel = channel;
        std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
        let resp = match channel.call(req).await {
            Ok(r) => r,
            Err(e) => return anyhow::Ok(Outcome::Reset(format!("{e:#}"))),
        };
        let (parts, body) = resp.into_parts();
        let collected = match body.collect().await {
            Ok(c) => c,
            Err(e) => return Ok(Outcome::Reset(format!("{e:#}"))),
        };
        let trailers = collected.trailers().cloned().unwrap_or_default();
        let pick = |name: &str| {
            trailers
                .get(name)
                .or_else(|| parts.headers.get(name))
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Ok(match pick("grpc-status").and_then(|s| s.parse().ok()) {
            Some(status) => Outcome::Status(status, pick("grpc-message").unwrap_or_default()),
            None => Outcome::Reset(format!("no grpc-status (http {})", parts.status)),
        })
    };
    tokio::time::timeout(Duration::from_secs(20), call).await?
}

async fn call(channel: Channel, path: &str, body: Vec<u8>) -> anyhow::Result<Outcome> {
    call_with_trailers(channel, path, body, &[], &[]).await
}

/// Percent-decoding is enough for the messages the edge sends.
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

/// Finding 1: a reserved header in the request trailers is refused at the
/// edge for every method, including those the edge passes on at header time,
/// and the upstream call never completes (mallory cannot close alice's
/// session, read the status as an operator or advance the epoch).
#[tokio::test(flavor = "multi_thread")]
async fn reserved_headers_in_request_trailers_are_refused_for_every_method() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let mut alice = e.client("workload/alice").await?;
    let alice_session = open(&mut alice, "demo").await?;
    let mut mallory = e.client("workload/mallory").await?;
    let ms = open(&mut mallory, "demo").await?;
    let held = lock(&mut mallory, "mallory/trailers", "demo", ms).await?;
    let ch = channel(e.envoy.addr(), "workload/mallory").await?;
    let operator = spiffe("latchkey/operator");
    let alice_id = spiffe("workload/alice");
    let key = "mallory/trailers";
    let calls: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "OpenSession",
            encode(&OpenSessionRequest {
                class: "demo".into(),
                reuse_session_ids: vec![],
            }),
            &alice_id,
        ),
        (
            "KeepAlive",
            encode(&KeepAliveRequest {
                session_id: alice_session,
                ..Default::default()
            }),
            &alice_id,
        ),
        (
            "CloseSession",
            encode(&CloseSessionRequest {
                session_id: alice_session,
            }),
            &alice_id,
        ),
        (
            "Acquire",
            encode(&acquire_request(key, "demo", ms, WaitMode::WaitNone)),
            &alice_id,
        ),
        (
            "Release",
            encode(&ReleaseRequest {
                key: key.into(),
                session_id: held.session_id,
                token: held.token,
                slot: None,
                mode: 0,
            }),
            &alice_id,
        ),
        (
            "Inspect",
            encode(&InspectRequest { key: key.into() }),
            &alice_id,
        ),
        ("GetStatus", encode(&GetStatusRequest::default()), &operator),
        (
            "AdvanceEpoch",
            encode(&AdvanceEpochRequest {
                expected_epoch: 999_999,
                reason: "mallory".into(),
                ..Default::default()
            }),
            &operator,
        ),
    ];
    let before = e.denied("reserved_trailer").await?;
    let mut wrong = Vec::new();
    let mut refused = 0;
    for (method, body, claimed) in &calls {
        let service = if matches!(*method, "GetStatus" | "AdvanceEpoch") {
            ADMIN
        } else {
            LOCK
        };
        let path = format!("{service}{method}");
        let keyed_headers: &[(&str, &str)] = if matches!(*method, "Acquire" | "Release" | "Inspect")
        {
            &[("x-lock-key", key)]
        } else {
            &[]
        };
        for trailer in [
            ("x-latchkey-identity", *claimed),
            ("x-lock-key", "demo/report"),
            ("x-latchkey-anything", "1"),
        ] {
            let outcome =
                call_with_trailers(ch.clone(), &path, body.clone(), keyed_headers, &[trailer])
                    .await?;
            let ok = match &outcome {
                Outcome::Status(3, message) => decoded(message).contains("trailer"),
                // KeepAlive's response headers may already be downstream: Envoy
                // can then only reset the stream.
                Outcome::Reset(_) => *method == "KeepAlive",
                _ => false,
            };
            if ok {
                refused += 1;
            } else {
                wrong.push(format!("{method} with trailer {}: {outcome:?}", trailer.0));
            }
        }
    }
    anyhow::ensure!(
        wrong.is_empty(),
        "reserved trailers not refused at the edge:\n{}",
        wrong.join("\n")
    );
    let counted = e.denied("reserved_trailer").await? - before;
    assert!(counted >= refused, "counted {counted} of {refused}");
    // Nothing reached the arbiter's handlers: alice's session is alive and
    // hers, and mallory still holds her key.
    let g = lock(&mut alice, "demo/after-trailers", "demo", alice_session).await?;
    unlock(&mut alice, &g).await?;
    unlock(&mut mallory, &held).await?;
    Ok(())
}

/// Issue 33's surfaces at the edge: every election method, and a
/// force-release request naming an election, refuse a client-sent
/// `x-latchkey-*` header (initial or trailer) before anything is
/// forwarded, as lock.v1's methods do: identity comes from the mTLS peer
/// only, whichever service the call is for.
#[tokio::test(flavor = "multi_thread")]
async fn election_calls_refuse_reserved_headers_and_trailers() -> anyhow::Result<()> {
    use latchkey_proto::adminv1::RequestForceReleaseRequest;
    use latchkey_proto::electionv1::{
        CampaignRequest, CandidatesRequest, LeaderRequest, ObserveRequest, ProclaimRequest,
        ResignRequest, TransferRequest, transfer_request,
    };
    const ELECTION: &str = "/latchkey.election.v1.ElectionService/";
    let e = edge(json!({})).await?;
    let ch = channel(e.envoy.addr(), "workload/mallory").await?;
    let election = "mallory/elect/hostile";
    let (session_id, token) = (7_587_862_381_i64, 281_474_976_710_699_u64);
    let calls: Vec<(String, Vec<u8>)> = vec![
        (
            format!("{ELECTION}Campaign"),
            encode(&CampaignRequest {
                election: election.into(),
                class: "election".into(),
                session_id,
                value: "mallory".into(),
                ..Default::default()
            }),
        ),
        (
            format!("{ELECTION}Proclaim"),
            encode(&ProclaimRequest {
                election: election.into(),
                session_id,
                token,
                value: "mine".into(),
            }),
        ),
        (
            format!("{ELECTION}Leader"),
            encode(&LeaderRequest {
                election: election.into(),
            }),
        ),
        (
            format!("{ELECTION}Observe"),
            encode(&ObserveRequest {
                election: election.into(),
                from_term: 0,
                transfer_requests: false,
            }),
        ),
        (
            format!("{ELECTION}Resign"),
            encode(&ResignRequest {
                election: election.into(),
                session_id,
                token,
            }),
        ),
        (
            format!("{ELECTION}Transfer"),
            encode(&TransferRequest {
                election: election.into(),
                session_id,
                token,
                to: Some(transfer_request::To::Preferred(true)),
            }),
        ),
        (
            format!("{ELECTION}Candidates"),
            encode(&CandidatesRequest {
                election: election.into(),
            }),
        ),
        (
            format!("{ADMIN}RequestForceRelease"),
            encode(&RequestForceReleaseRequest {
                key: election.into(),
                reason: "mallory".into(),
                election: true,
                ..Default::default()
            }),
        ),
    ];
    let upstream = e.envoy.upstream_requests().await?;
    let operator = spiffe("latchkey/operator");
    let mut wrong = Vec::new();
    for (path, body) in &calls {
        for (name, value) in [
            ("x-latchkey-identity", operator.as_str()),
            ("x-latchkey-dev-identity", operator.as_str()),
            ("x-latchkey-whatever", "1"),
        ] {
            let header =
                call_with_trailers(ch.clone(), path, body.clone(), &[(name, value)], &[]).await?;
            match &header {
                Outcome::Status(3, m) if decoded(m).contains("reserved") => {}
                other => wrong.push(format!("{path} with header {name}: {other:?}")),
            }
        }
    }
    anyhow::ensure!(
        wrong.is_empty(),
        "headers not refused:\n{}",
        wrong.join("\n")
    );
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "nothing with a reserved header was forwarded"
    );
    let before = e.denied("reserved_trailer").await?;
    let mut refused = 0;
    for (path, body) in &calls {
        for trailer in [
            ("x-latchkey-identity", operator.as_str()),
            ("x-lock-key", "demo/report"),
        ] {
            let outcome =
                call_with_trailers(ch.clone(), path, body.clone(), &[], &[trailer]).await?;
            match &outcome {
                Outcome::Status(3, m) if decoded(m).contains("trailer") => refused += 1,
                // A server stream's response may be under way: a reset.
                Outcome::Reset(_) if path.ends_with("Observe") => refused += 1,
                other => wrong.push(format!("{path} with trailer {}: {other:?}", trailer.0)),
            }
        }
    }
    anyhow::ensure!(
        wrong.is_empty(),
        "trailers not refused:\n{}",
        wrong.join("\n")
    );
    assert!(e.denied("reserved_trailer").await? - before >= refused - 2);
    Ok(())
}

/// Finding 1 (initial headers): a client-sent `x-latchkey-*` header is refused,
/// not silently replaced, on every method.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_sent_reserved_header_is_refused_on_every_method() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let ch = channel(e.envoy.addr(), "workload/mallory").await?;
    let upstream = e.envoy.upstream_requests().await?;
    let mut wrong = Vec::new();
    for (path, body) in [
        (
            format!("{LOCK}OpenSession"),
            encode(&OpenSessionRequest {
                class: "demo".into(),
                reuse_session_ids: vec![],
            }),
        ),
        (
            format!("{LOCK}Inspect"),
            encode(&InspectRequest {
                key: "mallory/x".into(),
            }),
        ),
        (
            format!("{ADMIN}GetStatus"),
            encode(&GetStatusRequest::default()),
        ),
    ] {
        for header in [
            ("x-latchkey-identity", spiffe("latchkey/operator")),
            ("x-latchkey-dev-identity", spiffe("latchkey/operator")),
            ("x-latchkey-whatever", "1".to_string()),
        ] {
            let outcome = call_with_trailers(
                ch.clone(),
                &path,
                body.clone(),
                &[(header.0, &header.1)],
                &[],
            )
            .await?;
            match &outcome {
                Outcome::Status(3, m) if decoded(m).contains("reserved") => {}
                other => wrong.push(format!("{path} with {}: {other:?}", header.0)),
            }
        }
    }
    anyhow::ensure!(wrong.is_empty(), "not refused:\n{}", wrong.join("\n"));
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "none forwarded"
    );
    assert!(e.denied("reserved_header").await? >= 9);
    Ok(())
}

/// Finding 2: the edge forwards only known methods. GetEdgePolicy through the
/// edge is answered by the edge (PERMISSION_DENIED), unknown paths with
/// UNIMPLEMENTED; none reaches the arbiter. Admin calls the edge does forward
/// are judged as the verified caller.
#[tokio::test(flavor = "multi_thread")]
async fn only_known_methods_are_forwarded_and_the_grant_table_stays_at_the_edge()
-> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let mallory = channel(e.envoy.addr(), "workload/mallory").await?;
    let operator = channel(e.envoy.addr(), "latchkey/operator").await?;
    let upstream = e.envoy.upstream_requests().await?;
    for ch in [mallory.clone(), operator.clone()] {
        match call(
            ch,
            &format!("{ADMIN}GetEdgePolicy"),
            encode(&GetEdgePolicyRequest {}),
        )
        .await?
        {
            Outcome::Status(7, m) => assert!(
                decoded(&m).contains("served only to the edge itself"),
                "{m}"
            ),
            other => anyhow::bail!("GetEdgePolicy through the edge: {other:?}"),
        }
    }
    for path in [
        "/latchkey.lock.v1.Lock/Steal",
        "/latchkey.lock.v1.Lock/Acquire2",
        "/latchkey.lock.v1.Lock/acquire",
        "/latchkey.admin.v1.Admin/Shutdown",
        "/latchkey.admin.v1.Admin/GetEdgePolicy/",
        "/latchkey.admin.v1.Admin/GetEdge%50olicy",
        "/latchkey.lock.v1.Lock/Inspect?x=1",
        "/latchkey.lock.v2.Lock/Acquire",
        "/grpc.health.v1.Health/Check",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/",
    ] {
        match call(mallory.clone(), path, encode(&GetStatusRequest::default())).await? {
            Outcome::Status(12, _) => {}
            other => anyhow::bail!("{path}: {other:?}"),
        }
    }
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "nothing reached the arbiter"
    );
    assert!(e.denied("edge_policy_forbidden").await? >= 2);
    assert!(e.denied("unknown_method").await? >= 11);
    // Admin calls the edge forwards name the verified caller.
    let status = AdminClient::new(operator)
        .get_status(GetStatusRequest::default())
        .await;
    assert!(status.is_ok(), "the operator through the edge: {status:?}");
    let s = AdminClient::new(mallory)
        .get_status(GetStatusRequest::default())
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("mallory read the status through the edge"))?;
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    Ok(())
}

/// FNV-1a mod `slots`: the old, public slot placement.
fn fnv_slot(key: &str, slots: u64) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(key.as_bytes());
    h.finish() % slots
}

/// Finding 3: mallory parks waiters on keys chosen to cover the admission
/// probe window of `demo/report` as computed with the public FNV placement
/// (in `arena/`, which she shares with demo, who holds them so that her calls
/// really wait); alice's waiter on `demo/report` is still admitted.
#[tokio::test(flavor = "multi_thread")]
async fn waiters_aimed_at_another_keys_slots_do_not_refuse_it() -> anyhow::Result<()> {
    const SLOTS: u64 = 16_384;
    const WINDOW: u64 = 8;
    let policies = tempfile::tempdir()?;
    latchkey_tests::copy_dev_policies(policies.path())?;
    std::fs::write(
        policies.path().join("grants/arena.toml"),
        format!(
            "[[grant]]\nidentity = \"{}\"\nprefixes = [\"arena\"]\n\n\
             [[grant]]\nidentity = \"{}\"\nprefixes = [\"arena\"]\n",
            spiffe("workload/mallory"),
            spiffe("workload/demo")
        ),
    )?;
    let opts = ArbiterOptions {
        policies_dir: policies.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let e = edge_with(opts, json!({})).await?;
    let target = "demo/report";
    let home = fnv_slot(target, SLOTS);
    let aimed: Vec<String> = (0..WINDOW)
        .map(|i| {
            let want = (home + i) % SLOTS;
            (0u64..)
                .map(|n| format!("arena/aim/{n}"))
                .find(|k| fnv_slot(k, SLOTS) == want)
                .unwrap_or_default()
        })
        .collect();
    let mut demo = e.client("workload/demo").await?;
    let ds = open(&mut demo, "demo").await?;
    // The edge learns the arena grant from its first refresh.
    let first = aimed.first().cloned().unwrap_or_default();
    let mut holds = vec![
        eventually(
            "the arena grant at the edge",
            Duration::from_secs(20),
            || {
                let (mut demo, key) = (demo.clone(), first.clone());
                async move { Ok(lock(&mut demo, &key, "demo", ds).await?) }
            },
        )
        .await?,
    ];
    for key in aimed.iter().skip(1) {
        holds.push(lock(&mut demo, key, "demo", ds).await?);
    }
    let mallory = e.client("workload/mallory").await?;
    let mut parked = Vec::new();
    for key in &aimed {
        let mut c = mallory.clone();
        let key = key.clone();
        parked.push(tokio::spawn(async move {
            let s = open(&mut c, "demo").await?;
            anyhow::Ok(lock_wait(&mut c, &key, "demo", s, Duration::from_secs(50)).await)
        }));
    }
    let gauge = "wasmcustom.latchkey_edge.waiters.ns.arena.class.demo";
    let waiting = eventually(
        "mallory's aimed waiters",
        Duration::from_secs(20),
        || async {
            let n = e.envoy.counter(gauge).await?;
            anyhow::ensure!(n == WINDOW, "{n} waiting");
            Ok(())
        },
    )
    .await;
    if let Err(e) = waiting {
        let mut ended = Vec::new();
        for p in parked.iter_mut().filter(|p| p.is_finished()) {
            ended.push(format!("{:?}", p.await));
        }
        anyhow::bail!("{e:#}; ended: {ended:?}");
    }
    let held = lock(&mut demo, target, "demo", ds).await?;
    let mut alice = e.client("workload/alice").await?;
    let sa = open(&mut alice, "demo").await?;
    let started = Instant::now();
    let r = lock_wait(&mut alice, target, "demo", sa, Duration::from_secs(3)).await;
    match &r {
        Err(s) if s.code() == Code::ResourceExhausted => anyhow::bail!(
            "alice's waiter on {target} refused after {:?} by mallory's aimed waiters: {s:?}",
            started.elapsed()
        ),
        Ok(g) => anyhow::bail!("granted a held key: {g:?}"),
        Err(_) => {}
    }
    unlock(&mut demo, &held).await?;
    for p in parked {
        p.abort();
    }
    for g in &holds {
        unlock(&mut demo, g).await?;
    }
    Ok(())
}

/// A channel whose streams advertise a receive window of 0: the peer can
/// send response headers but no response data.
async fn zero_window_channel(addr: std::net::SocketAddr, name: &str) -> anyhow::Result<Channel> {
    let certs = certs()?;
    let svid = certs.svid(name);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(certs.ca())?))
        .identity(Identity::from_pem(
            std::fs::read(&svid.cert)?,
            std::fs::read(&svid.key)?,
        ))
        .domain_name("localhost");
    Ok(Channel::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .initial_stream_window_size(0)
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?)
}

/// Finding 4: a waiter whose reader stalls (receive window 0) gives its
/// admission place back as soon as the arbiter answers, not when the stream
/// finally ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_reader_gives_its_admission_place_back_when_the_arbiter_answers()
-> anyhow::Result<()> {
    let e = edge(json!({
        "refresh": null,
        "classes": [{"name": "demo", "max_waiters_per_key": 1}],
    }))
    .await?;
    let key = "shared/stall";
    let mut bob = e.client("workload/bob").await?;
    let sb = open(&mut bob, "demo").await?;
    let held = lock(&mut bob, key, "demo", sb).await?;
    let mut alice = e.client("workload/alice").await?;
    let sa = open(&mut alice, "demo").await?;
    let stalled = zero_window_channel(e.envoy.addr(), "workload/alice").await?;
    let body = encode(&acquire_request(
        key,
        "demo",
        sa,
        WaitMode::WaitUntilDeadline,
    ));
    let (answered_tx, answered_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stalled_call = tokio::spawn(async move {
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("https://localhost{LOCK}Acquire"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("grpc-timeout", "40S")
            .header("x-lock-key", key)
            .body(tonic::body::Body::new(Full::new(Bytes::from(body))))?;
        let mut ch = stalled;
        std::future::poll_fn(|cx| ch.poll_ready(cx)).await?;
        // Headers only: the body (the grant) is never read.
        let resp = ch.call(req).await?;
        let _ = answered_tx.send(resp.status());
        let _ = stop_rx.await;
        drop(resp);
        anyhow::Ok(())
    });
    let gauge = "wasmcustom.latchkey_edge.waiters.ns.shared.class.demo";
    eventually("alice waiting", Duration::from_secs(10), || async {
        let n = e.envoy.counter(gauge).await?;
        anyhow::ensure!(n == 1, "{n}");
        Ok(())
    })
    .await?;
    unlock(&mut bob, &held).await?;
    let status = tokio::time::timeout(Duration::from_secs(10), answered_rx).await??;
    assert_eq!(status, http::StatusCode::OK);
    // The arbiter has answered alice (she holds the key now); her reader is
    // stalled. Bob may queue behind her: the key's one place is free again.
    let started = Instant::now();
    let r = lock_wait(&mut bob, key, "demo", sb, Duration::from_secs(3)).await;
    if let Err(s) = &r
        && s.code() == Code::ResourceExhausted
    {
        anyhow::bail!(
            "bob refused after {:?} while alice's stalled stream keeps the place: {s:?}",
            started.elapsed()
        );
    }
    assert!(r.is_err(), "bob granted a key alice holds: {r:?}");
    eventually(
        "the waiters gauge back to 0",
        Duration::from_secs(10),
        || async {
            let n = e.envoy.counter(gauge).await?;
            anyhow::ensure!(n == 0, "{n}");
            Ok(())
        },
    )
    .await?;
    let _ = stop_tx.send(());
    stalled_call.await??;
    Ok(())
}

/// The edge's default bound on one identity's concurrent streams
/// (`max_streams_per_identity`).
const DEFAULT_MAX_STREAMS_PER_IDENTITY: usize = 256;

/// Idle streams held open by the test (response halves; the request bodies
/// never end).
type Held = tokio::sync::Mutex<Vec<http::Response<tonic::body::Body>>>;

/// Opens a KeepAlive stream that sends nothing and does not end until `stop`.
/// Returns the refusal if the edge answered at once, else keeps the stream in
/// `held`.
async fn idle_keepalive(
    ch: Channel,
    held: &Held,
    stop: CancellationToken,
) -> anyhow::Result<Option<(i32, String)>> {
    // No message; the request ends (without trailers) only when stopped.
    let body = Full::new(Bytes::new()).with_trailers(async move {
        stop.cancelled().await;
        None::<Result<http::HeaderMap, Infallible>>
    });
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{LOCK}KeepAlive"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(body))?;
    let mut ch = ch;
    std::future::poll_fn(|cx| ch.poll_ready(cx)).await?;
    let resp = tokio::time::timeout(Duration::from_secs(20), ch.call(req)).await??;
    let status = resp
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok());
    let message = resp
        .headers()
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(decoded)
        .unwrap_or_default();
    match status {
        Some(code) => Ok(Some((code, message))),
        None => {
            held.lock().await.push(resp);
            Ok(None)
        }
    }
}

/// Finding 5: one identity opening more idle KeepAlive streams than its
/// bound is refused (RESOURCE_EXHAUSTED) beyond it; another identity's calls
/// and the edge's grant-table refresh keep working meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_idle_keepalive_streams_is_bounded_per_identity() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let flood = DEFAULT_MAX_STREAMS_PER_IDENTITY + 44;
    // One connection for the flood: closing it ends every stream on it.
    let ch = channel(e.envoy.addr(), "workload/mallory").await?;
    let held: std::sync::Arc<Held> = Default::default();
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..flood {
        let (ch, held, stop) = (ch.clone(), held.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            idle_keepalive(ch, &held, stop).await
        }));
    }
    let mut refusals = Vec::new();
    for t in tasks {
        if let Some(r) = t.await?? {
            refusals.push(r);
        }
    }
    let accepted = held.lock().await.len();
    let exhausted = refusals
        .iter()
        .filter(|(code, m)| *code == 8 && m.contains("streams"))
        .count();
    anyhow::ensure!(
        accepted <= DEFAULT_MAX_STREAMS_PER_IDENTITY && exhausted >= flood - accepted,
        "mallory holds {accepted} of {flood} idle KeepAlive streams; the edge refused {exhausted} \
         (refusals: {:?})",
        refusals.iter().take(3).collect::<Vec<_>>()
    );
    assert!(e.denied("too_many_streams").await? >= exhausted as u64);
    // Others are served meanwhile, and the grant table still refreshes.
    let refreshed = |stats: &std::collections::BTreeMap<String, u64>| {
        [
            "wasmcustom.latchkey_edge.policy_refresh.result.updated",
            "wasmcustom.latchkey_edge.policy_refresh.result.unchanged",
        ]
        .iter()
        .map(|k| stats.get(*k).copied().unwrap_or(0))
        .sum::<u64>()
    };
    let before = refreshed(&e.envoy.stats().await?);
    let mut bob = e.client("workload/bob").await?;
    let sb = open(&mut bob, "demo").await?;
    let g = lock(&mut bob, "demo/during-flood", "demo", sb).await?;
    unlock(&mut bob, &g).await?;
    let mut bob_ka = bob.clone();
    let stream = bob_ka
        .keep_alive(futures::stream::iter([KeepAliveRequest {
            session_id: sb,
            ..Default::default()
        }]))
        .await?;
    drop(stream);
    eventually(
        "a grant-table refresh during the flood",
        Duration::from_secs(15),
        || async {
            let now = refreshed(&e.envoy.stats().await?);
            anyhow::ensure!(now > before, "{now} refreshes");
            Ok(())
        },
    )
    .await?;
    // When the flood's streams end, mallory's places come back.
    stop.cancel();
    held.lock().await.clear();
    drop(ch);
    let mut mallory = e.client("workload/mallory").await?;
    eventually("mallory served again", Duration::from_secs(15), || async {
        let mut m = mallory.clone();
        let s = open_class(&mut m, "demo").await?;
        anyhow::Ok(s)
    })
    .await?;
    let s = open(&mut mallory, "demo").await?;
    let g = lock(&mut mallory, "mallory/after-flood", "demo", s).await?;
    unlock(&mut mallory, &g).await?;
    Ok(())
}

/// Issue 12: a client's `x-lock-key` decides nothing. The edge removes it from
/// every call, keyed or not, and routes by the key it authorised from the body
/// (filter state); a keyed call whose header names another key is refused
/// before anything is forwarded. Mallory names alice's key `demo/x` (no grant
/// of hers) in the header: beside her own key in the body it is a mismatch;
/// beside `demo/x` in the body the call is judged by the body's key and
/// refused; neither reaches the arbiter. Her own key in both is served (routed
/// by the body's key), and so is a call without a key that carries the header.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_lock_key_header_never_authorises_or_routes() -> anyhow::Result<()> {
    let e = edge(json!({})).await?;
    let ch = channel(e.envoy.addr(), "workload/mallory").await?;
    let inspect = format!("{LOCK}Inspect");
    let body = |key: &str| encode(&InspectRequest { key: key.into() });
    let upstream = e.envoy.upstream_requests().await?;
    let header = [("x-lock-key", "demo/x")];
    match call_with_trailers(ch.clone(), &inspect, body("mallory/x"), &header, &[]).await? {
        Outcome::Status(3, m) if decoded(&m).contains("x-lock-key") => {}
        other => anyhow::bail!("her key in the body, alice's in the header: {other:?}"),
    }
    match call_with_trailers(ch.clone(), &inspect, body("demo/x"), &header, &[]).await? {
        Outcome::Status(7, _) => {}
        other => anyhow::bail!("alice's key in body and header: {other:?}"),
    }
    assert_eq!(
        e.envoy.upstream_requests().await?,
        upstream,
        "none forwarded"
    );
    assert!(e.denied("key_mismatch").await? >= 1);
    assert!(e.denied("not_authorised").await? >= 1);
    let own = [("x-lock-key", "mallory/x")];
    match call_with_trailers(ch.clone(), &inspect, body("mallory/x"), &own, &[]).await? {
        Outcome::Status(0, _) => {}
        other => anyhow::bail!("her own key in body and header: {other:?}"),
    }
    let open = encode(&OpenSessionRequest {
        class: "demo".into(),
        reuse_session_ids: vec![],
    });
    match call_with_trailers(ch, &format!("{LOCK}OpenSession"), open, &header, &[]).await? {
        Outcome::Status(0, _) => {}
        other => anyhow::bail!("a call without a key, with the header: {other:?}"),
    }
    Ok(())
}

/// Issue 30: per-pod identities under one pattern grant are one grant
/// subject at the edge too: their idle streams share one
/// `max_streams_per_identity`, so more pods do not buy more streams.
#[tokio::test(flavor = "multi_thread")]
async fn pods_under_one_pattern_share_one_stream_bound() -> anyhow::Result<()> {
    const BOUND: usize = 6;
    let e = edge(json!({"max_streams_per_identity": BOUND})).await?;
    let held: std::sync::Arc<Held> = Default::default();
    let stop = CancellationToken::new();
    let mut refusals = Vec::new();
    // Three pods, four streams each: twelve asked, six fit.
    for pod in [
        "ns/payments/sa/ledger/ledger-7d9f-a",
        "ns/payments/sa/ledger/ledger-7d9f-b",
        "ns/payments/sa/ledger/ledger-7d9f-c",
    ] {
        let ch = channel(e.envoy.addr(), pod).await?;
        for _ in 0..4 {
            if let Some(r) = idle_keepalive(ch.clone(), &held, stop.clone()).await? {
                refusals.push(r);
            }
        }
    }
    let accepted = held.lock().await.len();
    anyhow::ensure!(
        accepted == BOUND
            && refusals.len() == 12 - BOUND
            && refusals
                .iter()
                .all(|(code, m)| *code == 8 && m.contains("streams")),
        "the pods hold {accepted} streams (bound {BOUND} for their pattern): {refusals:?}"
    );
    // Another identity is unaffected.
    let ch = channel(e.envoy.addr(), "workload/alice").await?;
    anyhow::ensure!(
        idle_keepalive(ch, &held, stop.clone()).await?.is_none(),
        "alice was refused a stream"
    );
    stop.cancel();
    Ok(())
}
