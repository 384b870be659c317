//! What the edge costs: Acquire+Release latency (p50/p99) and throughput,
//! measured in one run against one etcd and one arbiter, four ways:
//! direct to the arbiter; through Envoy without the filter (mTLS, routing,
//! native identity header); through Envoy with the filter and a 10-prefix grant
//! table; and with a 100,000-prefix table. Ratios are against the direct path
//! and against Envoy without the filter.
//!
//! A second table does the same with Inspect (one etcd read), where the edge's
//! own cost is less buried under etcd's fsyncs.
//!
//! `TMPDIR=/dev/shm cargo run --release -p latchkey-tests --bin edge-bench`
//! (needs `scripts/build-wasm latchkey-filter` first; a tmpfs TMPDIR puts etcd's
//! data dir in memory so its fsync does not dominate every figure).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{
    AcquireRequest, InspectRequest, OpenSessionRequest, ReleaseRequest, WaitMode,
};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, channel, spiffe};
use latchkey_tests::envoy::{
    Envoy, EnvoyOptions, config_with_extra_grants, dev_filter_config, filter_wasm,
};
use latchkey_tests::etcd::EtcdServer;
use serde_json::json;
use tokio::sync::Mutex;

#[derive(Parser, Debug)]
#[command(about = "Acquire+Release through the edge vs direct, in one run")]
struct Args {
    /// Seconds measured per (path, callers) cell in each round.
    #[arg(long, default_value_t = 2)]
    seconds: u64,
    /// Rounds; each round runs every path once, so slow drift in machine load
    /// spreads over all paths instead of landing on one.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Concurrent callers in the throughput phase (the latency phase uses 1).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
}

/// What one iteration does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    /// Acquire (try-lock) then Release: two etcd writes.
    Pair,
    /// Inspect: one etcd read; shows the edge's own cost with less store noise.
    Inspect,
}

struct Run {
    p50_us: u64,
    p99_us: u64,
    ops: f64,
}

fn keyed<T>(message: T, key: &str) -> anyhow::Result<tonic::Request<T>> {
    let mut req = tonic::Request::new(message);
    req.metadata_mut().insert("x-lock-key", key.parse()?);
    Ok(req)
}

async fn measure(
    addr: SocketAddr,
    op: Op,
    callers: usize,
    seconds: u64,
    tag: &str,
) -> anyhow::Result<Sample> {
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for w in 0..callers {
        let hist = hist.clone();
        let tag = tag.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut c = LockClient::new(channel(addr, "workload/bench").await?);
            let session = c
                .open_session(OpenSessionRequest {
                    class: "demo".into(),
                    reuse_session_ids: vec![],
                })
                .await?
                .into_inner()
                .session_id;
            let mut local = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            let mut i = 0u64;
            // Warm the connection and the path.
            let warm_until = Instant::now() + Duration::from_millis(300);
            loop {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                let key = format!("bench/{tag}/{w}/{i}");
                i += 1;
                let start = Instant::now();
                if op == Op::Inspect {
                    c.inspect(keyed(InspectRequest { key: key.clone() }, &key)?)
                        .await?;
                } else {
                    let acquire = AcquireRequest {
                        key: key.clone(),
                        class: "demo".into(),
                        session_id: session,
                        wait: WaitMode::WaitNone.into(),
                        metadata: Default::default(),
                    };
                    let grant = c
                        .acquire(keyed(acquire, &key)?)
                        .await?
                        .into_inner()
                        .grant
                        .context("no grant")?;
                    let release = ReleaseRequest {
                        key: key.clone(),
                        session_id: session,
                        token: grant.token,
                    };
                    c.release(keyed(release, &key)?).await?;
                }
                if now >= warm_until {
                    local.record(start.elapsed().as_micros() as u64)?;
                }
            }
            hist.lock().await.add(&local)?;
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let h = hist.lock().await.clone();
    Ok(Sample {
        hist: h,
        seconds: seconds as f64 - 0.3,
    })
}

/// Measurements of one (path, callers) cell, merged over the rounds.
#[derive(Clone)]
struct Sample {
    hist: Histogram<u64>,
    seconds: f64,
}

impl Sample {
    fn merge(&mut self, other: &Sample) -> anyhow::Result<()> {
        self.hist.add(&other.hist)?;
        self.seconds += other.seconds;
        Ok(())
    }

    fn run(&self) -> Run {
        Run {
            p50_us: self.hist.value_at_quantile(0.5),
            p99_us: self.hist.value_at_quantile(0.99),
            ops: self.hist.len() as f64 / self.seconds.max(0.001),
        }
    }
}

fn report(results: &[(String, Run, Run)]) {
    let [direct, plain, ..] = results else {
        return;
    };
    for (name, one, many) in &results[1..] {
        println!(
            "  {name}: p50 x{:.2}, p99 x{:.2}, throughput x{:.2} vs direct (p50 {:+} us at 1 caller)",
            one.p50_us as f64 / direct.1.p50_us.max(1) as f64,
            one.p99_us as f64 / direct.1.p99_us.max(1) as f64,
            many.ops / direct.2.ops.max(1.0),
            one.p50_us as i64 - direct.1.p50_us as i64,
        );
    }
    for (name, one, many) in &results[2..] {
        println!(
            "  filter cost, {name}: p50 {:+} us (x{:.2}), p99 x{:.2}, throughput x{:.2} vs Envoy without the filter",
            one.p50_us as i64 - plain.1.p50_us as i64,
            one.p50_us as f64 / plain.1.p50_us.max(1) as f64,
            one.p99_us as f64 / plain.1.p99_us.max(1) as f64,
            many.ops / plain.2.ops.max(1.0),
        );
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let etcd = EtcdServer::start().await?;
    let arbiter = Arbiter::start(
        &etcd,
        ArbiterOptions {
            edge_identity: Some(spiffe("latchkey/edge")),
            ..ArbiterOptions::default()
        },
    )
    .await?;
    let wasm = filter_wasm()?;
    let base = dev_filter_config(json!({"refresh": null}))?;
    let mut paths: Vec<(String, SocketAddr, Option<Envoy>)> =
        vec![("direct to the arbiter".into(), arbiter.addr(), None)];
    let plain = Envoy::start(EnvoyOptions::without_filter(arbiter.addr())).await?;
    paths.push(("Envoy, no filter".into(), plain.addr(), Some(plain)));
    for prefixes in [10usize, 100_000] {
        let config = config_with_extra_grants(base.clone(), prefixes);
        let mut opts = EnvoyOptions::with_filter(arbiter.addr(), json!({}))?;
        opts.filter = Some((wasm.clone(), config));
        opts.rate_per_second = 1_000_000;
        opts.rate_burst = 1_000_000;
        let started = Instant::now();
        let envoy = Envoy::start(opts).await?;
        let size = envoy
            .counter("wasmcustom.latchkey_edge.grant_table_size")
            .await?;
        eprintln!(
            "filter with {size} prefixes ready in {:.1}s",
            started.elapsed().as_secs_f64()
        );
        paths.push((
            format!("Envoy + filter, {prefixes} prefixes"),
            envoy.addr(),
            Some(envoy),
        ));
    }
    for (op, what) in [
        (Op::Pair, "Acquire+Release pairs"),
        (Op::Inspect, "Inspect calls"),
    ] {
        println!(
            "\nedge-bench: {what}; {} rounds x {}s per cell, paths interleaved in each round;\n\
             latency at 1 caller, throughput at {} callers",
            args.rounds, args.seconds, args.concurrency
        );
        println!(
            "{:<34} {:>9} {:>9} {:>11} {:>9} {:>9} {:>11}",
            "path", "p50 us", "p99 us", "ops/s (1)", "p50 us", "p99 us", "ops/s (N)"
        );
        let mut cells: Vec<Option<(Sample, Sample)>> = vec![None; paths.len()];
        for round in 0..args.rounds {
            for (i, (_, addr, _)) in paths.iter().enumerate() {
                let one = measure(*addr, op, 1, args.seconds, &format!("l{round}-{i}")).await?;
                let many = measure(
                    *addr,
                    op,
                    args.concurrency,
                    args.seconds,
                    &format!("t{round}-{i}"),
                )
                .await?;
                match &mut cells[i] {
                    Some((a, b)) => {
                        a.merge(&one)?;
                        b.merge(&many)?;
                    }
                    slot @ None => *slot = Some((one, many)),
                }
            }
        }
        let mut results = Vec::new();
        for ((name, _, _), cell) in paths.iter().zip(cells) {
            let (one, many) = cell.context("no samples")?;
            let (one, many) = (one.run(), many.run());
            println!(
                "{:<34} {:>9} {:>9} {:>11.0} {:>9} {:>9} {:>11.0}",
                name, one.p50_us, one.p99_us, one.ops, many.p50_us, many.p99_us, many.ops
            );
            results.push((name.clone(), one, many));
        }
        report(&results);
    }
    drop(paths);
    arbiter.stop().await?;
    Ok(())
}
