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
//!
//! Callers send `x-lock-key` (what Envoy without the filter hashes on; the
//! filter checks it against the body's key, removes it and routes by filter
//! state either way); with `--omit-key-header` they do not (the baseline then
//! picks its one arbiter unhashed).
//! `--ops inspect` or `--ops pair` measures one table only. Where the filter's
//! time goes: docs/edge-filter-profile.md.
//!
//! The Acquire+Release table also runs etcd's own `Lock` + `Unlock` against the
//! same etcd, interleaved in the same rounds, and prints each path's
//! throughput at N callers as a ratio of it: what a team that switches from
//! etcd's lock to Latchkey through its sidecar gets.
//!
//! Besides latency, each Envoy's CPU time per call (all its threads, from
//! `/proc/<pid>/task/*/schedstat`, over the measured loop) is printed: on a
//! shared 2-core machine it is a steadier measure of what the filter costs
//! than a difference of two latency medians.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_etcd::Connection;
use latchkey_etcd::lock::LockOptions;
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
    /// Callers send no `x-lock-key` header.
    #[arg(long)]
    omit_key_header: bool,
    /// Which tables: `both`, `pair` (Acquire+Release) or `inspect`.
    #[arg(long, default_value = "both")]
    ops: String,
    /// Grant-table sizes to run the filter with.
    #[arg(long, value_delimiter = ',', default_values_t = [10usize, 100_000])]
    prefixes: Vec<usize>,
    /// Another filter build to measure in the same run (repeatable), e.g. the
    /// previous version: one more Envoy per build and table size, named after
    /// the file.
    #[arg(long)]
    also_wasm: Vec<std::path::PathBuf>,
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
    /// Envoy CPU (all threads) per call, when Envoy's process was found.
    cpu_us: Option<f64>,
}

/// The pid of the Envoy whose admin socket is `admin`: the process whose
/// command line names the config file in the same run directory.
fn envoy_pid(admin: &Path) -> Option<u32> {
    let config = admin.parent()?.join("envoy.yaml");
    let config = config.to_str()?;
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let e = e.ok()?;
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        cmdline
            .split(|b| *b == 0)
            .any(|arg| arg == config.as_bytes())
            .then_some(pid)
    })
}

/// CPU time of every thread of `pid` so far, in ns (`schedstat`'s first field).
fn cpu_ns(pid: Option<u32>) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{}/task", pid?)).ok()?;
    let mut total = 0u64;
    for t in tasks.flatten() {
        let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

fn keyed<T>(message: T, key: &str, header: bool) -> anyhow::Result<tonic::Request<T>> {
    let mut req = tonic::Request::new(message);
    if header {
        req.metadata_mut().insert("x-lock-key", key.parse()?);
    }
    Ok(req)
}

async fn measure(
    addr: SocketAddr,
    op: Op,
    callers: usize,
    seconds: u64,
    tag: &str,
    header: bool,
    pid: Option<u32>,
) -> anyhow::Result<Sample> {
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let calls = Arc::new(AtomicU64::new(0));
    // Connections and sessions first, then the clock (and the CPU count) starts.
    let ready = Arc::new(tokio::sync::Barrier::new(callers + 1));
    let mut tasks = Vec::new();
    for w in 0..callers {
        let (hist, calls, ready) = (hist.clone(), calls.clone(), ready.clone());
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
            ready.wait().await;
            let deadline = Instant::now() + Duration::from_secs(seconds);
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
                    c.inspect(keyed(InspectRequest { key: key.clone() }, &key, header)?)
                        .await?;
                } else {
                    let acquire = AcquireRequest {
                        key: key.clone(),
                        class: "demo".into(),
                        session_id: session,
                        wait: WaitMode::WaitNone.into(),
                        metadata: Default::default(),
                        instance: String::new(),
                        mode: 0,
                        downgrade_from: None,
                    };
                    let grant = c
                        .acquire(keyed(acquire, &key, header)?)
                        .await?
                        .into_inner()
                        .grant
                        .context("no grant")?;
                    let release = ReleaseRequest {
                        key: key.clone(),
                        session_id: session,
                        token: grant.token,
                        slot: None,
                        mode: 0,
                    };
                    c.release(keyed(release, &key, header)?).await?;
                }
                if now >= warm_until {
                    local.record(start.elapsed().as_micros() as u64)?;
                }
            }
            let per_iteration = if op == Op::Pair { 2 } else { 1 };
            calls.fetch_add(i * per_iteration, Ordering::Relaxed);
            hist.lock().await.add(&local)?;
            anyhow::Ok(())
        }));
    }
    ready.wait().await;
    let cpu_before = cpu_ns(pid);
    for t in tasks {
        t.await??;
    }
    let cpu = cpu_before
        .zip(cpu_ns(pid))
        .map(|(a, b)| b.saturating_sub(a));
    let h = hist.lock().await.clone();
    Ok(Sample {
        hist: h,
        seconds: seconds as f64 - 0.3,
        calls: calls.load(Ordering::Relaxed),
        cpu_ns: cpu,
    })
}

/// etcd's own Lock + Unlock, each caller with its own client, lease and lock
/// name: the baseline a Latchkey pair through the edge is compared with.
async fn measure_etcd_lock(
    endpoint: &str,
    callers: usize,
    seconds: u64,
    tag: &str,
) -> anyhow::Result<Sample> {
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let calls = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(tokio::sync::Barrier::new(callers + 1));
    let mut tasks = Vec::new();
    for w in 0..callers {
        let (hist, calls, ready) = (hist.clone(), calls.clone(), ready.clone());
        let (endpoint, name) = (endpoint.to_owned(), format!("edge-bench/etcd/{tag}/{w}"));
        tasks.push(tokio::spawn(async move {
            let mut client = latchkey_etcd::connect(&Connection::new([endpoint])).await?;
            let lease = client.lease_grant(60, None).await?.id();
            ready.wait().await;
            let deadline = Instant::now() + Duration::from_secs(seconds);
            let warm_until = Instant::now() + Duration::from_millis(300);
            let mut local = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            let mut i = 0u64;
            loop {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                i += 1;
                let start = Instant::now();
                let locked = client
                    .lock(name.as_str(), Some(LockOptions::new().with_lease(lease)))
                    .await
                    .context("etcd lock")?;
                client
                    .unlock(locked.key().to_vec())
                    .await
                    .context("etcd unlock")?;
                if now >= warm_until {
                    local.record(start.elapsed().as_micros() as u64)?;
                }
            }
            client.lease_revoke(lease).await?;
            calls.fetch_add(i * 2, Ordering::Relaxed);
            hist.lock().await.add(&local)?;
            anyhow::Ok(())
        }));
    }
    ready.wait().await;
    for t in tasks {
        t.await??;
    }
    let h = hist.lock().await.clone();
    Ok(Sample {
        hist: h,
        seconds: seconds as f64 - 0.3,
        calls: calls.load(Ordering::Relaxed),
        cpu_ns: None,
    })
}

/// Measurements of one (path, callers) cell, merged over the rounds.
#[derive(Clone)]
struct Sample {
    hist: Histogram<u64>,
    seconds: f64,
    /// Every call made in the measured loop (warm-up included), counting
    /// Acquire and Release as two.
    calls: u64,
    /// Envoy's CPU over the same loop.
    cpu_ns: Option<u64>,
}

impl Sample {
    fn merge(&mut self, other: &Sample) -> anyhow::Result<()> {
        self.hist.add(&other.hist)?;
        self.seconds += other.seconds;
        self.calls += other.calls;
        self.cpu_ns = self.cpu_ns.zip(other.cpu_ns).map(|(a, b)| a + b);
        Ok(())
    }

    fn run(&self) -> Run {
        Run {
            p50_us: self.hist.value_at_quantile(0.5),
            p99_us: self.hist.value_at_quantile(0.99),
            ops: self.hist.len() as f64 / self.seconds.max(0.001),
            cpu_us: self
                .cpu_ns
                .map(|ns| ns as f64 / 1000.0 / self.calls.max(1) as f64),
        }
    }
}

fn report(results: &[(String, Run, Run)], callers: usize) {
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
    let cpu = |filter: Option<f64>, plain: Option<f64>| match filter.zip(plain) {
        Some((f, p)) => format!("{:+.1}", f - p),
        None => "?".into(),
    };
    for (name, one, many) in &results[2..] {
        println!(
            "  filter cost, {name}: p50 {:+} us (x{:.2}), p99 x{:.2}, throughput x{:.2}; \
             Envoy CPU per call {} us (1 caller), {} us ({} callers) vs Envoy without the filter",
            one.p50_us as i64 - plain.1.p50_us as i64,
            one.p50_us as f64 / plain.1.p50_us.max(1) as f64,
            one.p99_us as f64 / plain.1.p99_us.max(1) as f64,
            many.ops / plain.2.ops.max(1.0),
            cpu(one.cpu_us, plain.1.cpu_us),
            cpu(many.cpu_us, plain.2.cpu_us),
            callers,
        );
    }
}

fn cpu_column(run: &Run) -> String {
    run.cpu_us
        .map(|us| format!("{us:.1}"))
        .unwrap_or_else(|| "-".into())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let etcd = EtcdServer::start().await?;
    let endpoint = etcd.endpoint();
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
    // (Envoy's own CPU is read from /proc; the direct path has none.)
    let plain = Envoy::start(EnvoyOptions::without_filter(arbiter.addr())).await?;
    paths.push(("Envoy, no filter".into(), plain.addr(), Some(plain)));
    let builds = std::iter::once(("filter".to_string(), wasm.clone())).chain(
        args.also_wasm.iter().map(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            (name.unwrap_or_else(|| p.display().to_string()), p.clone())
        }),
    );
    for ((build, wasm), prefixes) in
        builds.flat_map(|b| args.prefixes.iter().map(move |n| (b.clone(), *n)))
    {
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
            "{build} with {size} prefixes ready in {:.1}s",
            started.elapsed().as_secs_f64()
        );
        paths.push((
            format!("Envoy + {build}, {prefixes} prefixes"),
            envoy.addr(),
            Some(envoy),
        ));
    }
    let header = !args.omit_key_header;
    let pids: Vec<Option<u32>> = paths
        .iter()
        .map(|(_, _, envoy)| envoy.as_ref().and_then(|e| envoy_pid(e.admin_socket())))
        .collect();
    for (op, what) in [
        (Op::Pair, "Acquire+Release pairs"),
        (Op::Inspect, "Inspect calls"),
    ] {
        let wanted = match args.ops.as_str() {
            "pair" => op == Op::Pair,
            "inspect" => op == Op::Inspect,
            _ => true,
        };
        if !wanted {
            continue;
        }
        println!(
            "\nedge-bench: {what}; {} rounds x {}s per cell, paths interleaved in each round;\n\
             latency at 1 caller, throughput at {} callers; x-lock-key {}",
            args.rounds,
            args.seconds,
            args.concurrency,
            if header { "sent" } else { "omitted" }
        );
        println!(
            "{:<34} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9} {:>11} {:>9}",
            "path",
            "p50 us",
            "p99 us",
            "ops/s (1)",
            "cpu/call",
            "p50 us",
            "p99 us",
            "ops/s (N)",
            "cpu/call"
        );
        let mut cells: Vec<Option<(Sample, Sample)>> = vec![None; paths.len()];
        let mut etcd_lock: Option<(Sample, Sample)> = None;
        for round in 0..args.rounds {
            if op == Op::Pair {
                let one =
                    measure_etcd_lock(&endpoint, 1, args.seconds, &format!("l{round}")).await?;
                let many = measure_etcd_lock(
                    &endpoint,
                    args.concurrency,
                    args.seconds,
                    &format!("t{round}"),
                )
                .await?;
                match &mut etcd_lock {
                    Some((a, b)) => {
                        a.merge(&one)?;
                        b.merge(&many)?;
                    }
                    slot @ None => *slot = Some((one, many)),
                }
            }
            for (i, (_, addr, _)) in paths.iter().enumerate() {
                let pid = pids.get(i).copied().flatten();
                let one = measure(
                    *addr,
                    op,
                    1,
                    args.seconds,
                    &format!("l{round}-{i}"),
                    header,
                    pid,
                )
                .await?;
                let many = measure(
                    *addr,
                    op,
                    args.concurrency,
                    args.seconds,
                    &format!("t{round}-{i}"),
                    header,
                    pid,
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
                "{:<34} {:>9} {:>9} {:>11.0} {:>9} {:>9} {:>9} {:>11.0} {:>9}",
                name,
                one.p50_us,
                one.p99_us,
                one.ops,
                cpu_column(&one),
                many.p50_us,
                many.p99_us,
                many.ops,
                cpu_column(&many)
            );
            results.push((name.clone(), one, many));
        }
        if let Some((one, many)) = etcd_lock {
            let (one, many) = (one.run(), many.run());
            println!(
                "{:<34} {:>9} {:>9} {:>11.0} {:>9} {:>9} {:>9} {:>11.0} {:>9}",
                "etcd Lock + Unlock (baseline)",
                one.p50_us,
                one.p99_us,
                one.ops,
                "-",
                many.p50_us,
                many.p99_us,
                many.ops,
                "-"
            );
            for (name, _, path_many) in &results {
                println!(
                    "  {name}: throughput x{:.2}, p50 x{:.2} vs etcd Lock + Unlock at {} callers",
                    path_many.ops / many.ops.max(1.0),
                    path_many.p50_us as f64 / many.p50_us.max(1) as f64,
                    args.concurrency,
                );
            }
        }
        report(&results, args.concurrency);
    }
    for (name, _, envoy) in &paths {
        if let Some(envoy) = envoy {
            print_profile(name, envoy).await?;
        }
    }
    drop(paths);
    arbiter.stop().await?;
    Ok(())
}

/// A build with the filter's `profile` feature records each section of the
/// request path (filter/core/src/edge/profile.rs): prints the mean per stream
/// over the whole run, and the sum of the filter's own sections (all but
/// the wait for the body and the clock's own cost).
async fn print_profile(name: &str, envoy: &Envoy) -> anyhow::Result<()> {
    const PREFIX: &str = "wasmcustom.latchkey_edge.profile.";
    let stats = envoy.stats().await?;
    let mut own = 0.0;
    let mut row = Vec::new();
    for (key, sum) in &stats {
        let Some(section) = key
            .strip_prefix(PREFIX)
            .and_then(|k| k.strip_suffix("_sum_ns"))
        else {
            continue;
        };
        let calls = stats
            .get(&format!("{PREFIX}{section}_calls"))
            .copied()
            .unwrap_or(0);
        if calls == 0 {
            continue;
        }
        let mean_us = *sum as f64 / calls as f64 / 1000.0;
        if section != "wait_body" && section != "clock" {
            own += mean_us;
        }
        row.push(format!("{section} {mean_us:.1} ({calls})"));
    }
    if !row.is_empty() {
        println!(
            "\nprofile, {name}: the filter's own code {own:.1} us per stream (mean; sections, us (streams)): {}",
            row.join(", ")
        );
    }
    Ok(())
}
