//! Where a request's time goes inside the filter's logic, natively (no Envoy,
//! no V8): each section the glue runs per request, timed in a loop. Not a
//! test of speed (no timed assertion): run it to print the table,
//!
//! `cargo test --release -p latchkey-filter-core --test profile -- --ignored --nocapture`
//!
//! The figures in Envoy are larger (V8 runs the same code, and each host call
//! crosses into Envoy and copies), see docs/edge-filter-profile.md.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::time::Instant;

use latchkey_filter_core::admission::{Admission, MemoryStore};
use latchkey_filter_core::config::FilterConfig;
use latchkey_filter_core::decision::check_keyed;
use latchkey_filter_core::grant_table::Table;
use latchkey_filter_core::headers::check_request_headers;
use latchkey_filter_core::identity::{identity_from_san, peer_identity};
use latchkey_filter_core::keyed_hash::AdmissionSecret;
use latchkey_filter_core::metrics;
use latchkey_filter_core::policy::EdgePolicy;
use latchkey_filter_core::request::{Call, Method};
use latchkey_filter_core::wire::Writer;

const ALICE: &str = "spiffe://dev.latchkey/workload/bench";

fn config(prefixes: usize) -> (FilterConfig, EdgePolicy) {
    let mut grants = vec![serde_json::json!({"identity": ALICE, "prefixes": ["bench", "demo"]})];
    let per_identity = 100;
    let extra = prefixes.saturating_sub(2);
    for chunk in 0..extra.div_ceil(per_identity) {
        let p: Vec<String> = (0..per_identity.min(extra - chunk * per_identity))
            .map(|i| format!("tenant-{chunk}/svc-{i}/locks"))
            .collect();
        grants.push(serde_json::json!({
            "identity": format!("spiffe://dev.latchkey/synthetic/tenant-{chunk}"),
            "prefixes": p,
        }));
    }
    let json = serde_json::json!({
        "trust_domain": "dev.latchkey",
        "admission_secret": "000102030405060708090a0b0c0d0e0f",
        "grants": grants,
        "classes": [{"name": "demo", "max_waiters_per_key": 16}],
    });
    FilterConfig::parse(json.to_string().as_bytes()).unwrap()
}

fn body(key: &str) -> Vec<u8> {
    let mut w = Writer::new();
    w.string(1, key)
        .string(2, "demo")
        .varint(3, 12345678)
        .varint(4, 0);
    let m = w.finish();
    let mut b = vec![0];
    b.extend_from_slice(&(m.len() as u32).to_be_bytes());
    b.extend(m);
    b
}

/// Mean ns per call of `f` over enough iterations.
fn time<R>(mut f: impl FnMut(u64) -> R) -> f64 {
    for i in 0..1_000 {
        black_box(f(i));
    }
    let n = 200_000u64;
    let start = Instant::now();
    for i in 0..n {
        black_box(f(i));
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

#[test]
#[ignore = "prints a profile; run with --ignored --nocapture"]
fn profile_the_request_path() {
    let headers: Vec<(String, String)> = [
        (":method", "POST"),
        (":scheme", "https"),
        (":path", "/latchkey.lock.v1.Lock/Acquire"),
        (":authority", "127.0.0.1:1234"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("user-agent", "tonic/0.14"),
        ("x-lock-key", "bench/l0-3/0/12345"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let store = MemoryStore::default();
    let secret = AdmissionSecret::from_hex("000102030405060708090a0b0c0d0e0f").unwrap();
    let admission = Admission::new(16_384, 4_096, secret);
    admission.create_slots(&store).unwrap();
    println!("\nsection                                   ns/call");
    let row = |name: &str, ns: f64| println!("{name:<40} {ns:>8.0}");
    row(
        "peer_identity (SPIFFE parse)",
        time(|_| peer_identity(Some(&[1]), Some(ALICE.as_bytes()), "dev.latchkey")),
    );
    row(
        "identity_from_san (SPIFFE parse)",
        time(|_| identity_from_san(Some(ALICE.as_bytes()), "dev.latchkey")),
    );
    row(
        "check_request_headers",
        time(|_| check_request_headers(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())))),
    );
    row(
        "Call::of",
        time(|_| Call::of("POST", "/latchkey.lock.v1.Lock/Acquire")),
    );
    row(
        "open_stream + close_stream (memory)",
        time(|_| {
            let p = admission.open_stream(&store, ALICE, 256).unwrap();
            admission.close_stream(&store, &p);
        }),
    );
    row(
        "admit + release (memory)",
        time(|i| {
            let key = format!("bench/x/{}", i % 64);
            let t = admission.admit(&store, &key, 16, ALICE, 256).unwrap();
            admission.release(&store, &t);
        }),
    );
    for prefixes in [10usize, 100_000] {
        let (c, policy) = config(prefixes);
        let b = body("bench/l0-3/0/12345");
        row(
            &format!("check_keyed, {prefixes} prefixes"),
            time(|_| {
                check_keyed(
                    Table::Fresh(&policy),
                    ALICE,
                    Method::Acquire,
                    &b,
                    Some("bench/l0-3/0/12345"),
                    c.max_message_bytes,
                )
                .unwrap()
            }),
        );
        let key = latchkey_policies::LockKey::parse("bench/l0-3/0/12345").unwrap();
        row(
            &format!("  authorise only, {prefixes} prefixes"),
            time(|_| policy.authorise(ALICE, &key).map(str::len)),
        );
    }
    row(
        "stat names (allowed + scope)",
        time(|_| metrics::allowed("acquire", &metrics::scope("bench", "demo"))),
    );
}
