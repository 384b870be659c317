//! OpenTelemetry traces (ADR-22) from the real arbiter binary, exported over
//! OTLP/gRPC (`--otlp-endpoint`) to a real OTLP receiver in this test (a
//! tonic `TraceService` from `opentelemetry-proto`): the acquire, release,
//! hand-over, hook and etcd transaction spans arrive as children of the
//! caller's W3C `traceparent`, carry namespace and class, and never a token,
//! a key or the caller's SPIFFE ID.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use latchkey_proto::lockv1::{AcquireRequest, ReleaseRequest, WaitMode};
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, spiffe};
use latchkey_tests::envoy::{Envoy, EnvoyOptions};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::eventually;
use opentelemetry::trace::{
    FutureExt as _, SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use parking_lot::Mutex;
use serde_json::json;
use tokio_stream::wrappers::TcpListenerStream;

use crate::support::*;

/// Every export request the receiver got.
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.got.lock().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    fn spans(&self) -> Vec<Span> {
        self.got
            .lock()
            .iter()
            .flat_map(|r| &r.resource_spans)
            .flat_map(|r| &r.scope_spans)
            .flat_map(|s| s.spans.clone())
            .collect()
    }

    /// Every string and integer anywhere in what was exported: resource
    /// and scope attributes, span names, span attributes, events, links.
    fn all_values(&self) -> (Vec<String>, Vec<i64>) {
        let mut strings = Vec::new();
        let mut ints = Vec::new();
        let got = self.got.lock();
        let mut attrs = |kvs: &[KeyValue]| {
            for kv in kvs {
                strings.push(kv.key.clone());
                if let Some(v) = &kv.value {
                    walk(v, &mut strings, &mut ints);
                }
            }
        };
        for r in got.iter().flat_map(|r| &r.resource_spans) {
            if let Some(res) = &r.resource {
                attrs(&res.attributes);
            }
            for s in &r.scope_spans {
                if let Some(scope) = &s.scope {
                    attrs(&scope.attributes);
                }
                for span in &s.spans {
                    attrs(&span.attributes);
                    for e in &span.events {
                        attrs(&e.attributes);
                    }
                    for l in &span.links {
                        attrs(&l.attributes);
                    }
                }
            }
        }
        for span in got
            .iter()
            .flat_map(|r| &r.resource_spans)
            .flat_map(|r| &r.scope_spans)
            .flat_map(|s| &s.spans)
        {
            strings.push(span.name.clone());
            strings.push(span.trace_state.clone());
            for e in &span.events {
                strings.push(e.name.clone());
            }
            if let Some(st) = &span.status {
                strings.push(st.message.clone());
            }
        }
        (strings, ints)
    }
}

impl Receiver {
    /// ADR-22: no key, token, session or identity (as a SPIFFE ID or its
    /// path) anywhere in what was exported, as text or as an integer.
    fn assert_no_secrets(&self, keys: &[&str], tokens: &[u64], sessions: &[i64], names: &[&str]) {
        let (strings, ints) = self.all_values();
        let mut forbidden: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        forbidden.extend(tokens.iter().map(u64::to_string));
        forbidden.extend(names.iter().map(|n| spiffe(n)));
        forbidden.extend(names.iter().map(|n| n.to_string()));
        for s in &strings {
            for f in &forbidden {
                assert!(!s.contains(f.as_str()), "exported {s:?} contains {f:?}");
            }
        }
        for &token in tokens {
            assert!(
                !ints.iter().any(|&i| i64::try_from(token).ok() == Some(i)),
                "a token was exported as an integer attribute"
            );
        }
        for session in sessions {
            assert!(
                !ints.contains(session),
                "a session id was exported as an integer attribute"
            );
        }
    }
}

fn walk(v: &AnyValue, strings: &mut Vec<String>, ints: &mut Vec<i64>) {
    match &v.value {
        Some(any_value::Value::StringValue(s)) => strings.push(s.clone()),
        Some(any_value::Value::IntValue(i)) => ints.push(*i),
        Some(any_value::Value::DoubleValue(d)) => strings.push(d.to_string()),
        Some(any_value::Value::BytesValue(b)) => {
            strings.push(String::from_utf8_lossy(b).into_owned())
        }
        Some(any_value::Value::ArrayValue(a)) => {
            for v in &a.values {
                walk(v, strings, ints);
            }
        }
        Some(any_value::Value::KvlistValue(l)) => {
            for kv in &l.values {
                strings.push(kv.key.clone());
                if let Some(v) = &kv.value {
                    walk(v, strings, ints);
                }
            }
        }
        Some(any_value::Value::BoolValue(_)) | None => {}
    }
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a any_value::Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn string_attr<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    match attr(span, key) {
        Some(any_value::Value::StringValue(s)) => Some(s),
        _ => None,
    }
}

/// A W3C trace context the "caller" started: (trace id, parent span id).
struct Caller {
    trace_id: [u8; 16],
    span_id: [u8; 8],
}

impl Caller {
    fn new(n: u8) -> Self {
        let mut trace_id = [0u8; 16];
        trace_id[0] = 0x4b;
        trace_id[15] = n;
        let mut span_id = [0u8; 8];
        span_id[0] = 0x5c;
        span_id[7] = n;
        Self { trace_id, span_id }
    }

    fn traceparent(&self) -> String {
        format!("00-{}-{}-01", hex(&self.trace_id), hex(&self.span_id))
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        req.metadata_mut().insert(
            "traceparent",
            self.traceparent()
                .parse()
                .unwrap_or_else(|_| unreachable!("a traceparent is ASCII")),
        );
        req
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn otlp_spans_follow_the_callers_trace_and_never_name_a_key_token_or_identity()
-> anyhow::Result<()> {
    let traced = Traced::start(ArbiterOptions::default()).await?;
    let receiver = traced.receiver.clone();
    let addr = traced.arbiter.addr();
    let lock = |name: &'static str| async move {
        latchkey_tests::arbiter::channel(addr, name)
            .await
            .map(latchkey_proto::lockv1::lock_client::LockClient::new)
    };
    let (mut alice, mut bob) = (lock("workload/alice").await?, lock("workload/bob").await?);
    let key = "demo/otel-ledger-9c41";
    let sa = open(&mut alice, "demo").await?;
    let sb = open(&mut bob, "demo").await?;

    // alice acquires (trace 1); bob queues (trace 2); alice's release hands
    // the key to bob (trace 3); bob releases with nobody waiting (trace 4).
    let (t1, t2, t3, t4) = (
        Caller::new(1),
        Caller::new(2),
        Caller::new(3),
        Caller::new(4),
    );
    let first = alice
        .acquire(t1.request(AcquireRequest {
            key: key.into(),
            class: "demo".into(),
            session_id: sa,
            wait: WaitMode::WaitNone.into(),
            metadata: Default::default(),
            instance: String::new(),
            mode: 0,
            downgrade_from: None,
        }))
        .await?
        .into_inner()
        .grant
        .context("no grant")?;
    let mut bob_waits = bob.clone();
    let mut wait = t2.request(AcquireRequest {
        key: key.into(),
        class: "demo".into(),
        session_id: sb,
        wait: WaitMode::WaitUntilDeadline.into(),
        metadata: Default::default(),
        instance: String::new(),
        mode: 0,
        downgrade_from: None,
    });
    wait.set_timeout(Duration::from_secs(20));
    let waiting = tokio::spawn(async move { bob_waits.acquire(wait).await });
    eventually("bob queued", Duration::from_secs(10), || {
        let mut alice = alice.clone();
        async move {
            let view = alice
                .inspect(latchkey_proto::lockv1::InspectRequest { key: key.into() })
                .await?
                .into_inner();
            anyhow::ensure!(view.waiters > 0, "no waiter yet");
            Ok(())
        }
    })
    .await?;
    alice
        .release(t3.request(ReleaseRequest {
            key: key.into(),
            session_id: sa,
            token: first.token,
            slot: None,
            mode: 0,
        }))
        .await?;
    let second = waiting
        .await??
        .into_inner()
        .grant
        .context("no grant for bob")?;
    assert!(second.token > first.token);
    bob.release(t4.request(ReleaseRequest {
        key: key.into(),
        session_id: sb,
        token: second.token,
        slot: None,
        mode: 0,
    }))
    .await?;

    let in_trace = |spans: &[Span], caller: &Caller, name: &str| -> usize {
        spans
            .iter()
            .filter(|s| s.name == name && s.trace_id == caller.trace_id)
            .count()
    };
    let spans = eventually("the spans at the receiver", Duration::from_secs(30), || {
        let receiver = receiver.clone();
        let (t1, t3, t4) = (&t1, &t3, &t4);
        async move {
            let spans = receiver.spans();
            for (caller, name) in [
                (t1, "lock.acquire"),
                (t1, "hook.before_grant"),
                (t1, "etcd.txn"),
                (t3, "lock.release"),
                (t3, "lock.hand_over"),
                (t3, "etcd.txn"),
                (t4, "lock.release"),
                (t4, "etcd.txn"),
            ] {
                anyhow::ensure!(
                    in_trace(&spans, caller, name) > 0,
                    "no {name} span in trace {} yet; got {:?}",
                    hex(&caller.trace_id),
                    spans.iter().map(|s| &s.name).collect::<Vec<_>>()
                );
            }
            Ok(spans)
        }
    })
    .await?;

    // The caller's span is the parent of the call's root span.
    for (caller, name) in [(&t1, "lock.acquire"), (&t3, "lock.release")] {
        let span = spans
            .iter()
            .find(|s| s.name == name && s.trace_id == caller.trace_id)
            .context("checked above")?;
        assert_eq!(span.parent_span_id, caller.span_id, "{name}'s parent");
        assert_eq!(string_attr(span, "namespace"), Some("demo"), "{name}");
        assert_eq!(string_attr(span, "class"), Some("demo"), "{name}");
    }
    // The acquire's etcd transaction is a grant, under the acquire span.
    let acquire = spans
        .iter()
        .find(|s| s.name == "lock.acquire" && s.trace_id == t1.trace_id)
        .context("checked above")?;
    let grant_txn = spans
        .iter()
        .find(|s| {
            s.name == "etcd.txn"
                && s.trace_id == t1.trace_id
                && string_attr(s, "txn") == Some("grant")
        })
        .context("no grant transaction span in the acquire's trace")?;
    assert_ne!(grant_txn.span_id, acquire.span_id);
    // The hand-over's transaction, under the release that handed over.
    let release = spans
        .iter()
        .find(|s| s.name == "lock.release" && s.trace_id == t3.trace_id)
        .context("checked above")?;
    assert_eq!(
        attr(release, "handed_over"),
        Some(&any_value::Value::BoolValue(true))
    );
    let hand_over = spans
        .iter()
        .find(|s| s.name == "lock.hand_over" && s.trace_id == t3.trace_id)
        .context("checked above")?;
    assert!(
        spans.iter().any(|s| s.name == "etcd.txn"
            && s.parent_span_id == hand_over.span_id
            && string_attr(s, "txn") == Some("hand_over")),
        "no hand_over transaction under the hand-over span"
    );
    // bob's queued acquire (trace 2) is answered by the hand-over; its own
    // acquire span still ends in its trace.
    eventually("bob's acquire span", Duration::from_secs(30), || {
        let receiver = receiver.clone();
        let t2 = &t2;
        async move {
            anyhow::ensure!(
                in_trace(&receiver.spans(), t2, "lock.acquire") > 0,
                "not yet"
            );
            Ok(())
        }
    })
    .await?;

    // The client library (feature `otel`) sends the caller's current span
    // context as traceparent: its acquire and release join trace 5.
    let t5 = Caller::new(5);
    let cx = opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
        TraceId::from_bytes(t5.trace_id),
        SpanId::from_bytes(t5.span_id),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    ));
    let library = crate::client::connect(addr, "workload/alice").await?;
    let held = library
        .lock(key, "demo")
        .acquire(|_| {})
        .with_context(cx.clone())
        .await?;
    let library_token = held.token().get();
    held.release().with_context(cx).await?;
    let spans = eventually("the library's spans", Duration::from_secs(30), || {
        let receiver = receiver.clone();
        let t5 = &t5;
        async move {
            let spans = receiver.spans();
            for name in ["lock.acquire", "lock.release"] {
                anyhow::ensure!(
                    spans.iter().any(|s| s.name == name
                        && s.trace_id == t5.trace_id
                        && s.parent_span_id == t5.span_id),
                    "no {name} span under the library caller's span yet"
                );
            }
            Ok(spans)
        }
    })
    .await?;
    assert!(spans.len() > 10);

    // ADR-22: no token, key or identity anywhere in what was exported.
    receiver.assert_no_secrets(
        &[key],
        &[first.token, second.token, library_token],
        &[sa, sb],
        &["workload/alice", "workload/bob"],
    );
    traced.stop();
    Ok(())
}

/// Through Envoy and the filter: the edge forwards the client's
/// `traceparent` untouched (it strips only `x-lock-key` and refuses
/// `x-latchkey-*`), so the arbiter's spans join the client's trace.
#[tokio::test(flavor = "multi_thread")]
async fn otlp_spans_through_envoy_keep_the_callers_trace() -> anyhow::Result<()> {
    let traced = Traced::start(ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..ArbiterOptions::default()
    })
    .await?;
    let envoy = Envoy::start(EnvoyOptions::with_filter(traced.arbiter.addr(), json!({}))?).await?;
    let mut alice = latchkey_proto::lockv1::lock_client::LockClient::new(
        latchkey_tests::arbiter::channel(envoy.addr(), "workload/alice").await?,
    );
    let key = "demo/otel-edge-31d7";
    let session = open(&mut alice, "demo").await?;
    let (t6, t7) = (Caller::new(6), Caller::new(7));
    let mut acquire = t6.request(AcquireRequest {
        key: key.into(),
        class: "demo".into(),
        session_id: session,
        wait: WaitMode::WaitNone.into(),
        metadata: Default::default(),
        instance: String::new(),
        mode: 0,
        downgrade_from: None,
    });
    acquire.metadata_mut().insert("x-lock-key", key.parse()?);
    let grant = alice
        .acquire(acquire)
        .await?
        .into_inner()
        .grant
        .context("no grant")?;
    let mut release = t7.request(ReleaseRequest {
        key: key.into(),
        session_id: session,
        token: grant.token,
        slot: None,
        mode: 0,
    });
    release.metadata_mut().insert("x-lock-key", key.parse()?);
    alice.release(release).await?;

    let receiver = traced.receiver.clone();
    eventually("the spans at the receiver", Duration::from_secs(30), || {
        let receiver = receiver.clone();
        let (t6, t7) = (&t6, &t7);
        async move {
            let spans = receiver.spans();
            for (caller, name) in [
                (t6, "lock.acquire"),
                (t6, "etcd.txn"),
                (t7, "lock.release"),
                (t7, "etcd.txn"),
            ] {
                anyhow::ensure!(
                    spans
                        .iter()
                        .any(|s| s.name == name && s.trace_id == caller.trace_id),
                    "no {name} span in trace {} yet",
                    hex(&caller.trace_id)
                );
            }
            for (caller, name) in [(t6, "lock.acquire"), (t7, "lock.release")] {
                anyhow::ensure!(
                    spans.iter().any(|s| s.name == name
                        && s.trace_id == caller.trace_id
                        && s.parent_span_id == caller.span_id),
                    "{name} is not a child of the caller's span"
                );
            }
            Ok(())
        }
    })
    .await?;
    receiver.assert_no_secrets(
        &[key],
        &[grant.token],
        &[session],
        &["workload/alice", "latchkey/edge"],
    );
    drop(envoy);
    traced.stop();
    Ok(())
}

/// A real OTLP/gRPC receiver in this process and the arbiter binary
/// exporting to it.
struct Traced {
    receiver: Receiver,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    arbiter: ArbiterProcess,
    _etcd: EtcdServer,
}

impl Traced {
    async fn start(opts: ArbiterOptions) -> anyhow::Result<Self> {
        latchkey_tests::init_tracing();
        let receiver = Receiver::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let otlp = listener.local_addr()?;
        let serving = receiver.clone();
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(serving))
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await
        });
        let etcd = EtcdServer::start().await?;
        let binary = PathBuf::from(env!("CARGO_BIN_EXE_arbiter-under-test"));
        let arbiter = ArbiterProcess::start_with_env(
            &binary,
            &[etcd.endpoint()],
            None,
            opts,
            "info",
            &["--otlp-endpoint".into(), format!("http://{otlp}")],
            // Export batches often, so the test does not wait the default 5 s.
            &[("OTEL_BSP_SCHEDULE_DELAY", "100".into())],
        )
        .await?;
        Ok(Self {
            receiver,
            server,
            arbiter,
            _etcd: etcd,
        })
    }

    fn stop(self) {
        drop(self.arbiter);
        self.server.abort();
    }
}
