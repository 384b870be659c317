//! `hook-bench`: what a per-class Wasm hook costs, next to the same class
//! without a hook, in the same run, for each shipped hook (change-ticket,
//! quota, maintenance-window; every request is allowed, so every call runs
//! the whole hook).
//!
//! Two measurements, each against its own baseline taken in the same run:
//!
//! 1. **In the host** (no etcd, no network): the arbiter's hook stage
//!    (`WasmHooks::before_grant`, as an Acquire awaits it: the blocking-pool
//!    hop, the fresh store, the call, the answer) for a hooked class and for
//!    the same request with no hook, alternating call by call on one caller.
//!    Printed: p50/p99 of each, the difference and the hook call alone (the
//!    host's own latency metric). This is the issue's "a hooked Acquire costs
//!    ≤ 10 µs p50 more than an unhooked one in the host".
//! 2. **End to end**: one real etcd and one in-process arbiter (mTLS);
//!    `--concurrency` workers, each on its own key and session, loop
//!    `Acquire` (try-lock) + `Release` per class, the classes alternating in
//!    rounds so drift hits all alike. Printed: p50/p99 and ops/s per class,
//!    the difference and ratio to the class without a hook, and the hook
//!    call's p50/p99 from the arbiter's host metrics. quota's difference also
//!    holds its two etcd reads (`inputs = ["holdCount", "holder"]`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, anyhow};
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_arbiter::hook::{ClassHooks, HookDecision, HookInput, NoHooks, monotonic_ns};
use latchkey_arbiter::wasm_hooks::WasmHooks;
use latchkey_hook_host::{HookHost, HostSettings};
use latchkey_policies::PolicySet;
use latchkey_proto::lockv1::{AcquireRequest, OpenSessionRequest, ReleaseRequest, WaitMode};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::hooks::{HookedArbiter, dev_policies_copy, hook_wasm};

#[derive(Parser, Debug)]
#[command(about = "Acquire with and without each shipped per-class Wasm hook, as differences")]
struct Args {
    /// Timed Acquire+Release cycles per class (end to end).
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
    /// Hook stage calls per class in the host (each hooked and unhooked).
    #[arg(long, default_value_t = 20000)]
    host_calls: u32,
    /// Concurrent callers in the host (each its own task and key).
    #[arg(long, default_value_t = 1)]
    host_callers: u32,
    /// Also time the same host call dispatched three ways (awaited in place,
    /// as the arbiter does; in `block_in_place`; on the blocking pool).
    #[arg(long)]
    dispatch: bool,
    /// Only the in-host measurement (no etcd, no arbiter).
    #[arg(long)]
    host_only: bool,
    /// The hooked classes' deadlineMs. The deadline is wall-clock: with
    /// etcd, the arbiter and the clients on two cores a call is sometimes
    /// preempted past a short one, and a timeout denial would end the run.
    /// Failures are printed either way.
    #[arg(long, default_value_t = 10)]
    deadline_ms: u32,
}

struct Hooked {
    class: &'static str,
    label: &'static str,
    package: &'static str,
    /// Lines after `module` / `deadlineMs` in the class's hook table.
    table: &'static str,
}

const HOOKED: &[Hooked] = &[
    Hooked {
        class: "bench-ticket",
        label: "change-ticket",
        package: "latchkey-hook-change-ticket",
        table: "[class.hook.config]\npattern = \"^CHG-[0-9]{4,10}$\"\n",
    },
    Hooked {
        class: "bench-ticket-regex",
        label: "change-ticket, regex-lite",
        package: "latchkey-hook-change-ticket",
        // The same tickets through the hook's regex-lite fallback (a group
        // is outside its own matcher's forms): what compiling the pattern
        // in every call's fresh instance costs.
        table: "[class.hook.config]\npattern = \"^(?:CHG)-[0-9]{4,10}$\"\n",
    },
    Hooked {
        class: "bench-quota",
        label: "quota",
        package: "latchkey-hook-quota",
        table: "inputs = [\"holdCount\", \"holder\"]\n[class.hook.config]\nmaxHolds = 1000\n",
    },
    Hooked {
        class: "bench-window",
        label: "maintenance-window",
        package: "latchkey-hook-maintenance-window",
        // Two windows that cover the whole day, every day.
        table: "[[class.hook.config.windows]]\nstart = \"00:00\"\nend = \"12:00\"\n\
                [[class.hook.config.windows]]\nstart = \"12:00\"\nend = \"00:00\"\n",
    },
];

const PLAIN: &str = "bench-plain";

fn bench_classes(deadline_ms: u32) -> anyhow::Result<String> {
    let mut text = format!(
        "[[class]]\nname = \"{PLAIN}\"\ntier = \"entity\"\nenforcement = \"fenced\"\n\
         [class.pauseTest]\nresource = \"bench:plain\"\nresult = \"pause-tests/{PLAIN}.json\"\n\n"
    );
    for h in HOOKED {
        let module = hook_wasm(h.package)?;
        text.push_str(&format!(
            "[[class]]\nname = \"{}\"\ntier = \"entity\"\nenforcement = \"fenced\"\n\
             [class.pauseTest]\nresource = \"bench:{}\"\nresult = \"pause-tests/{}.json\"\n\
             [class.hook]\nmodule = \"{}\"\ndeadlineMs = {deadline_ms}\n{}\n",
            h.class,
            h.label,
            h.class,
            module.display(),
            h.table
        ));
    }
    Ok(text)
}

fn histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?)
}

/// Microseconds at quantile `q` of a histogram of nanoseconds.
fn us_ns(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// Microseconds at quantile `q` of a histogram of microseconds.
fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64
}

/// The arbiter's hook stage for each hooked class and for the same request
/// without a hook, alternating, on this (multi-thread) runtime.
/// One caller's hook stages for `class`, hooked and unhooked alternating:
/// (unhooked, hooked) latencies in ns, after 1000 untimed pairs, and the
/// denials (failures: every request is allowed).
async fn stage(
    hooks: &WasmHooks,
    spec: &latchkey_policies::ClassHook,
    class: &str,
    caller: u32,
    calls: u32,
) -> anyhow::Result<(Histogram<u64>, Histogram<u64>, Vec<String>)> {
    let mut failed = Vec::new();
    let metadata: BTreeMap<String, String> =
        [("ticket".to_string(), "CHG-424242".to_string())].into();
    let key = format!("bench/host/{caller}");
    let (mut none, mut hooked) = (histogram()?, histogram()?);
    for i in 0..calls + 1000 {
        for with_hook in [false, true] {
            let input = HookInput {
                identity: "spiffe://dev.latchkey/workload/bench",
                key: &key,
                class,
                session: 7_587_883_651_466_297_346,
                metadata: &metadata,
                waiters: 0,
                now_unix_ms: 1_767_409_200_000,
                now_monotonic_ns: monotonic_ns(),
                hook: with_hook.then_some(spec),
                holder: None,
                hold_count: Some(0),
                shared: false,
                permits: None,
            };
            let t = Instant::now();
            let decision = hooks.before_grant(&input).await;
            let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            if !matches!(decision, HookDecision::Allow { .. }) {
                // A denial here is a failure (every request is allowed):
                // counted and printed, the run goes on.
                failed.push(format!("{decision:?}"));
            }
            if i >= 1000 {
                if with_hook { &mut hooked } else { &mut none }.saturating_record(ns);
            }
            // An Acquire awaits the network before and after its hook stage;
            // a loop that never yields would hold its thread for the whole
            // run, which no request does.
            tokio::task::yield_now().await;
        }
    }
    Ok((none, hooked, failed))
}

async fn in_host(dir: &std::path::Path, calls: u32, callers: u32) -> anyhow::Result<()> {
    let set = PolicySet::load_dir_at(dir, SystemTime::now())?;
    let cache = tempfile::TempDir::new()?;
    let host = Arc::new(HookHost::new(HostSettings {
        cache_dir: Some(cache.path().to_path_buf()),
        ..Default::default()
    }));
    let refused = host.sync(&set, dir);
    anyhow::ensure!(refused.is_empty(), "hooks refused: {refused:?}");
    let hooks = Arc::new(WasmHooks::new(host.clone(), Arc::new(NoHooks)));

    println!(
        "in the host: the arbiter's hook stage (WasmHooks::before_grant in a task on a runtime worker, as an Acquire runs it), {calls} calls per class, {callers} concurrent caller(s), hooked and unhooked alternating"
    );
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6}",
        "hook (us)",
        "none p50",
        "none p99",
        "hook p50",
        "hook p99",
        "diff p50",
        "diff p99",
        "call p50",
        "call p99",
        "hook max",
        "failed"
    );
    for h in HOOKED {
        let spec = set
            .classes()
            .get(h.class)
            .and_then(|c| c.hook.clone())
            .ok_or_else(|| anyhow!("{} has no hook", h.class))?;
        // On worker threads, like the arbiter's request handlers (the
        // runtime's block_on thread is not one).
        let mut tasks = Vec::new();
        for c in 0..callers.max(1) {
            let (hooks, spec) = (hooks.clone(), spec.clone());
            let per_caller = calls.div_ceil(callers.max(1));
            tasks.push(tokio::spawn(async move {
                stage(&hooks, &spec, h.class, c, per_caller).await
            }));
        }
        let (mut none, mut hooked, mut failed) = (histogram()?, histogram()?, Vec::new());
        for t in tasks {
            let (n, k, f) = t.await??;
            none.add(&n)?;
            hooked.add(&k)?;
            failed.extend(f);
        }
        let m = host
            .metrics()
            .class(h.class)
            .ok_or_else(|| anyhow!("no hook metrics for {}", h.class))?;
        println!(
            "{:<20} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>+9.1} {:>+9.1} {:>9.1} {:>9.1} {:>9.0} {:>6}",
            h.label,
            us_ns(&none, 0.5),
            us_ns(&none, 0.99),
            us_ns(&hooked, 0.5),
            us_ns(&hooked, 0.99),
            us_ns(&hooked, 0.5) - us_ns(&none, 0.5),
            us_ns(&hooked, 0.99) - us_ns(&none, 0.99),
            m.latency(0.5).as_secs_f64() * 1e6,
            m.latency(0.99).as_secs_f64() * 1e6,
            us_ns(&hooked, 1.0),
            failed.len(),
        );
        if let Some(first) = failed.first() {
            println!("  first failure: {first}");
        }
    }
    println!(
        "(diff = hook - none at the same quantile; call = the host's own per-call latency metric: encode, store, run, answer, reset; failed = denials, which are failures here)"
    );
    Ok(())
}

/// The same host call for each hooked class, dispatched three ways in turn,
/// on a worker: what the hand-off to another thread costs.
async fn dispatch(dir: &std::path::Path, calls: u32) -> anyhow::Result<()> {
    use latchkey_hook_host::HookOutcome;
    use latchkey_hook_host::abi::{ABI_VERSION, HookRequest};
    let set = PolicySet::load_dir_at(dir, SystemTime::now())?;
    let cache = tempfile::TempDir::new()?;
    let host = Arc::new(HookHost::new(HostSettings {
        cache_dir: Some(cache.path().to_path_buf()),
        ..Default::default()
    }));
    let refused = host.sync(&set, dir);
    anyhow::ensure!(refused.is_empty(), "hooks refused: {refused:?}");
    println!(
        "dispatch: the same host call, {calls} per way per class, one caller on a worker, the ways alternating"
    );
    println!(
        "{:<20} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "hook (us)",
        "in place p50",
        "in place p99",
        "bip p50",
        "bip p99",
        "spawn_b p50",
        "spawn_b p99"
    );
    for h in HOOKED {
        let host = host.clone();
        let hs = tokio::spawn(async move {
            let request = || HookRequest {
                version: ABI_VERSION,
                class: h.class.into(),
                identity: "spiffe://dev.latchkey/workload/bench".into(),
                key: "bench/host/0".into(),
                session: 7_587_883_651_466_297_346,
                metadata: [("ticket".to_string(), "CHG-424242".to_string())].into(),
                holder: None,
                waiters: 0,
                now_unix_ms: 1_767_409_200_000,
                now_monotonic_ns: monotonic_ns(),
                hold_count: Some(0),
                mode: None,
                permits: None,
                config: serde_json::Value::Null,
            };
            let mut hs = [histogram()?, histogram()?, histogram()?];
            for i in 0..calls + 1000 {
                for (way, h) in hs.iter_mut().enumerate() {
                    let t = Instant::now();
                    let outcome = match way {
                        0 => host.before_grant_async(request()).await,
                        1 => tokio::task::block_in_place(|| host.before_grant(request())),
                        _ => {
                            let (host, req) = (host.clone(), request());
                            tokio::task::spawn_blocking(move || host.before_grant(req)).await?
                        }
                    };
                    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    anyhow::ensure!(matches!(outcome, HookOutcome::Allow { .. }), "{outcome:?}");
                    if i >= 1000 {
                        h.saturating_record(ns);
                    }
                    tokio::task::yield_now().await;
                }
            }
            anyhow::Ok(hs)
        })
        .await??;
        println!(
            "{:<20} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>12.1}",
            h.label,
            us_ns(&hs[0], 0.5),
            us_ns(&hs[0], 0.99),
            us_ns(&hs[1], 0.5),
            us_ns(&hs[1], 0.99),
            us_ns(&hs[2], 0.5),
            us_ns(&hs[2], 0.99),
        );
    }
    Ok(())
}

struct Run {
    latency: Histogram<u64>,
    elapsed: Duration,
    ops: u64,
}

async fn run_class(
    arbiter: &HookedArbiter,
    class: &str,
    concurrency: u32,
    ops: u32,
) -> anyhow::Result<Run> {
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
                        instance: String::new(),
                        mode: 0,
                        downgrade_from: None,
                    })
                    .await?
                    .into_inner()
                    .grant
                    .ok_or_else(|| anyhow!("no grant"))?;
                c.release(ReleaseRequest {
                    key: g.key,
                    session_id: g.session_id,
                    token: g.token,
                    slot: None,
                    mode: 0,
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
    Ok(Run {
        ops: latency.len(),
        latency,
        elapsed,
    })
}

fn merge(runs: Vec<Run>) -> anyhow::Result<Run> {
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut elapsed, mut ops) = (Duration::ZERO, 0);
    for r in runs {
        latency.add(&r.latency)?;
        elapsed += r.elapsed;
        ops += r.ops;
    }
    Ok(Run {
        latency,
        elapsed,
        ops,
    })
}

async fn end_to_end(args: &Args, dir: &std::path::Path) -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await.context("start etcd")?;
    let arbiter = HookedArbiter::start(&etcd, dir).await?;
    let classes: Vec<&str> = std::iter::once(PLAIN)
        .chain(HOOKED.iter().map(|h| h.class))
        .collect();

    for class in &classes {
        run_class(&arbiter, class, args.concurrency, args.warmup).await?;
    }
    let warm: Vec<u64> = HOOKED
        .iter()
        .map(|h| {
            arbiter
                .hooks()
                .metrics()
                .class(h.class)
                .map_or(0, |m| m.invocations)
        })
        .collect();
    let mut runs: Vec<Vec<Run>> = classes.iter().map(|_| Vec::new()).collect();
    let per_round = args.ops.div_ceil(args.rounds.max(1));
    for _ in 0..args.rounds.max(1) {
        for (i, class) in classes.iter().enumerate() {
            runs[i].push(run_class(&arbiter, class, args.concurrency, per_round).await?);
        }
    }
    let mut merged = Vec::new();
    for r in runs {
        merged.push(merge(r)?);
    }
    let plain = &merged[0];
    let ops_s = |r: &Run| r.ops as f64 / r.elapsed.as_secs_f64();

    println!(
        "end to end: {} Acquire+Release per class, {} workers, {} alternating rounds; etcd and arbiter on this machine",
        plain.ops, args.concurrency, args.rounds
    );
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9}",
        "class (us)",
        "p50",
        "p99",
        "ops/s",
        "diff p50",
        "diff p99",
        "ratio",
        "call p50",
        "call p99"
    );
    println!(
        "{:<20} {:>9.0} {:>9.0} {:>9.0}",
        "no hook",
        us(&plain.latency, 0.5),
        us(&plain.latency, 0.99),
        ops_s(plain)
    );
    for (i, h) in HOOKED.iter().enumerate() {
        let r = &merged[i + 1];
        let m = arbiter
            .hooks()
            .metrics()
            .class(h.class)
            .ok_or_else(|| anyhow!("no hook metrics for {}", h.class))?;
        println!(
            "{:<20} {:>9.0} {:>9.0} {:>9.0} {:>+9.0} {:>+9.0} {:>8.3} {:>9.1} {:>9.1}",
            h.label,
            us(&r.latency, 0.5),
            us(&r.latency, 0.99),
            ops_s(r),
            us(&r.latency, 0.5) - us(&plain.latency, 0.5),
            us(&r.latency, 0.99) - us(&plain.latency, 0.99),
            us(&r.latency, 0.5) / us(&plain.latency, 0.5),
            m.latency(0.5).as_secs_f64() * 1e6,
            m.latency(0.99).as_secs_f64() * 1e6,
        );
        if m.failures_total() > 0 {
            println!(
                "  {}: hook call max {:?}, p99.9 {:?}; failures {:?}",
                h.label,
                m.latency(1.0),
                m.latency(0.999),
                m.failures
            );
        }
        anyhow::ensure!(m.failures_total() == 0, "hook failures: {:?}", m.failures);
        anyhow::ensure!(m.denials_total() == 0, "hook denials: {:?}", m.denials);
        anyhow::ensure!(
            m.invocations - warm[i] >= r.ops,
            "the {} hook ran {} times for {} Acquires",
            h.label,
            m.invocations - warm[i],
            r.ops
        );
    }
    println!(
        "(diff and ratio against \"no hook\" at the same quantile; call = the hook call alone, from the arbiter's host metrics; quota's diff includes its two etcd reads)"
    );
    drop(arbiter);
    drop(etcd);
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = dev_policies_copy()?;
    std::fs::write(
        dir.path().join("classes/bench.toml"),
        bench_classes(args.deadline_ms)?,
    )?;
    latchkey_tests::write_pause_test_fixtures(dir.path())?;
    in_host(dir.path(), args.host_calls, args.host_callers).await?;
    if args.dispatch {
        println!();
        dispatch(dir.path(), args.host_calls).await?;
    }
    if !args.host_only {
        println!();
        end_to_end(&args, dir.path()).await?;
    }
    Ok(())
}
