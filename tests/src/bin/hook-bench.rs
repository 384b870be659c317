//! `hook-bench`: what a per-class Wasm hook costs, next to the same class
//! without a hook, in the same run.
//!
//! One real etcd and one in-process arbiter (mTLS) on this machine. Two
//! classes that differ only in their hook: `bench-plain` (none) and
//! `bench-ticket` (the change-ticket example, every request carrying a valid
//! ticket, so every call runs the hook and is allowed). `--concurrency`
//! workers, each on its own key and session, loop `Acquire` (try-lock) +
//! `Release`; the classes alternate in rounds so drift hits both alike.
//! Printed side by side: Acquire+Release p50/p99 and ops/s per class with
//! the hook/plain ratio, and the hook's own per-call p50/p99 from the host's
//! metrics (instantiate, copy in, run, check the answer).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_proto::lockv1::{AcquireRequest, OpenSessionRequest, ReleaseRequest, WaitMode};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::hooks::{HookedArbiter, dev_policies_copy, hook_wasm};

#[derive(Parser, Debug)]
#[command(about = "Acquire+Release with and without a per-class Wasm hook, as a ratio")]
struct Args {
    /// Timed Acquire+Release cycles per class.
    #[arg(long, default_value_t = 4000)]
    ops: u32,
    /// Concurrent workers (each its own key and session).
    #[arg(long, default_value_t = 4)]
    concurrency: u32,
    /// Untimed cycles per class first.
    #[arg(long, default_value_t = 200)]
    warmup: u32,
    /// Alternating rounds (each runs ops/rounds cycles per class).
    #[arg(long, default_value_t = 4)]
    rounds: u32,
    /// The hooked class's deadlineMs. The platform default is 1, but the
    /// deadline is wall-clock: with etcd, the arbiter and the clients on two
    /// cores a call is sometimes preempted past 1 ms, and a timeout denial
    /// would end the run. Failures are printed either way.
    #[arg(long, default_value_t = 10)]
    deadline_ms: u32,
}

struct Result_ {
    latency: Histogram<u64>,
    elapsed: Duration,
    ops: u64,
}

async fn run_class(
    arbiter: &HookedArbiter,
    class: &str,
    concurrency: u32,
    ops: u32,
) -> anyhow::Result<Result_> {
    let per_worker = ops.div_ceil(concurrency);
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let mut c = arbiter.lock("workload/bench").await?;
        let session = c
            .open_session(OpenSessionRequest {
                class: class.into(),
                reuse_session_ids: vec![],
            })
            .await?
            .into_inner()
            .session_id;
        let key = format!("bench/{class}/{w}");
        let metadata: HashMap<String, String> =
            [("ticket".to_string(), "CHG-424242".to_string())].into();
        let class = class.to_string();
        workers.push(async move {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            for _ in 0..per_worker {
                let t = Instant::now();
                let g = c
                    .acquire(AcquireRequest {
                        key: key.clone(),
                        class: class.clone(),
                        session_id: session,
                        wait: WaitMode::WaitNone.into(),
                        metadata: metadata.clone(),
                    })
                    .await?
                    .into_inner()
                    .grant
                    .ok_or_else(|| anyhow!("no grant"))?;
                c.release(ReleaseRequest {
                    key: g.key,
                    session_id: g.session_id,
                    token: g.token,
                })
                .await?;
                h.saturating_record(u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX));
            }
            anyhow::Ok(h)
        });
    }
    let started = Instant::now();
    let results = futures::future::join_all(workers).await;
    let elapsed = started.elapsed();
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for r in results {
        latency.add(r?)?;
    }
    Ok(Result_ {
        ops: latency.len(),
        latency,
        elapsed,
    })
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let module = hook_wasm("latchkey-hook-change-ticket")?;
    let dir = dev_policies_copy()?;
    std::fs::write(
        dir.path().join("classes/bench.toml"),
        format!(
            "[[class]]\nname = \"bench-plain\"\ntier = \"entity\"\nenforcement = \"fenced\"\n\
             [class.pauseTest]\nresource = \"bench:plain\"\nresult = \"pause-tests/bench-plain.json\"\n\n\
             [[class]]\nname = \"bench-ticket\"\ntier = \"entity\"\nenforcement = \"fenced\"\n\
             [class.pauseTest]\nresource = \"bench:ticket\"\nresult = \"pause-tests/bench-ticket.json\"\n\
             [class.hook]\nmodule = \"{}\"\ndeadlineMs = {}\n[class.hook.config]\npattern = \"^CHG-[0-9]{{4,10}}$\"\n",
            module.display(),
            args.deadline_ms
        ),
    )?;
    latchkey_tests::write_pause_test_fixtures(dir.path())?;
    let etcd = EtcdServer::start().await.context("start etcd")?;
    let arbiter = HookedArbiter::start(&etcd, dir.path()).await?;

    for class in ["bench-plain", "bench-ticket"] {
        run_class(&arbiter, class, args.concurrency, args.warmup).await?;
    }
    let warm = arbiter
        .hooks()
        .metrics()
        .class("bench-ticket")
        .map_or(0, |m| m.invocations);
    let mut plain = Vec::new();
    let mut hooked = Vec::new();
    let per_round = args.ops.div_ceil(args.rounds.max(1));
    for _ in 0..args.rounds.max(1) {
        plain.push(run_class(&arbiter, "bench-plain", args.concurrency, per_round).await?);
        hooked.push(run_class(&arbiter, "bench-ticket", args.concurrency, per_round).await?);
    }
    let merge = |rs: Vec<Result_>| -> anyhow::Result<Result_> {
        let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        let (mut elapsed, mut ops) = (Duration::ZERO, 0);
        for r in rs {
            latency.add(&r.latency)?;
            elapsed += r.elapsed;
            ops += r.ops;
        }
        Ok(Result_ {
            latency,
            elapsed,
            ops,
        })
    };
    let (plain, hooked) = (merge(plain)?, merge(hooked)?);
    let m = arbiter
        .hooks()
        .metrics()
        .class("bench-ticket")
        .ok_or_else(|| anyhow!("no hook metrics"))?;
    println!(
        "hook call max {:?}, p99.9 {:?}; failures {:?}",
        m.latency(1.0),
        m.latency(0.999),
        m.failures
    );
    anyhow::ensure!(m.failures_total() == 0, "hook failures: {:?}", m.failures);
    anyhow::ensure!(m.denials_total() == 0, "hook denials: {:?}", m.denials);
    anyhow::ensure!(
        m.invocations - warm >= hooked.ops,
        "the hook ran {} times for {} Acquires",
        m.invocations - warm,
        hooked.ops
    );

    let ops_s = |r: &Result_| r.ops as f64 / r.elapsed.as_secs_f64();
    println!(
        "hook-bench: {} Acquire+Release per class, {} workers, {} alternating rounds; etcd and arbiter on this machine",
        plain.ops, args.concurrency, args.rounds
    );
    println!(
        "{:<34} {:>14} {:>16} {:>8}",
        "", "no hook", "change-ticket", "ratio"
    );
    for (label, q) in [
        ("Acquire+Release p50 (us)", 0.5),
        ("Acquire+Release p99 (us)", 0.99),
    ] {
        let (a, b) = (us(&plain.latency, q), us(&hooked.latency, q));
        println!("{label:<34} {a:>14.0} {b:>16.0} {:>8.3}", b / a);
    }
    let (a, b) = (ops_s(&plain), ops_s(&hooked));
    println!("{:<34} {a:>14.0} {b:>16.0} {:>8.3}", "ops/s", b / a);
    let p50 = m.latency(0.5).as_secs_f64() * 1e6;
    let p99 = m.latency(0.99).as_secs_f64() * 1e6;
    println!(
        "{:<34} {:>14} {:>16.1} {:>8.3}",
        "hook call p50 (us)",
        "-",
        p50,
        p50 / us(&plain.latency, 0.5)
    );
    println!(
        "{:<34} {:>14} {:>16.1} {:>8.3}",
        "hook call p99 (us)",
        "-",
        p99,
        p99 / us(&plain.latency, 0.99)
    );
    println!("(hook-call ratios are against the no-hook Acquire+Release at the same quantile)");
    drop(arbiter);
    drop(etcd);
    Ok(())
}
