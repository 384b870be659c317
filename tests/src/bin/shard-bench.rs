//! `shard-bench`: entity-tier grants with 1, 2 and 4 shard clusters on this
//! machine (issue 16, ADR-09), printed as ratios of the one-shard run with
//! the CPU each process used, so a reader can see what more machines would
//! buy.
//!
//! For each shard count N: N etcd clusters (one member each, the
//! [`EtcdServer`] harness) and N arbiter processes, arbiter i on etcd i,
//! each its own lock log and revision space. A versioned [`ShardMap`] of N
//! shards homes every key by rendezvous hashing over its range (namespace
//! and first segment, `bench/r17`); `--workers` clients each cycle through
//! one key in each of `--ranges` ranges, sending Acquire(try) + Release
//! over mTLS to the key's home shard's arbiter. The clients route by the
//! map themselves: arbiters do not route by it yet (docs/tiers-and-shards.md),
//! so this measures the data plane a sharded entity tier would have.
//!
//! Every process shares the machine's cores, so past the point where they
//! are busy more shards cannot help here; the CPU table says where that
//! point is and which process uses it. Tokens must increase per key
//! (checked while measuring; a failure exits non-zero).
//!
//! `cargo build --release -p latchkey-tests --bins && target/release/shard-bench`

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_arbiter::shards::{Shard, ShardMap};
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{AcquireRequest, OpenSessionRequest, ReleaseRequest, WaitMode};
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, channel};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::procstat::{Usage, usage};
use parking_lot::Mutex;
use tonic::transport::Channel;

const IDENTITY: &str = "workload/bench";
const CLASS: &str = "demo";

#[derive(Parser, Debug)]
#[command(
    about = "Entity-tier grants with 1, 2 and 4 shard clusters, as ratios, with CPU per process"
)]
struct Args {
    /// Shard counts to run, each a fresh set of clusters; the first is the
    /// baseline of the ratios.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4])]
    shards: Vec<usize>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Ranges each client cycles through (one key in each).
    #[arg(long, default_value_t = 64)]
    ranges: usize,
    /// Measured seconds per shard count (sessions live 15 s: at most 10).
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
}

/// What one shard count measured.
struct Measured {
    shards: usize,
    cycles: u64,
    secs: f64,
    latency: Histogram<u64>,
    /// Keys homed on each shard.
    keys_per_shard: Vec<usize>,
    etcd_cpu: Vec<f64>,
    arbiter_cpu: Vec<f64>,
    clients_cpu: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(
        !args.shards.is_empty() && args.shards.iter().all(|&n| (1..=16).contains(&n)),
        "--shards takes counts from 1 to 16"
    );
    ensure!(
        args.secs > 0.0 && args.secs <= 10.0,
        "--secs must be in (0, 10]"
    );
    ensure!(
        args.workers >= 1 && args.ranges >= 1,
        "--workers and --ranges must be at least 1"
    );
    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "shard-bench: nproc {nproc}; {} clients, each cycling Acquire(try) + Release over one key in each of {} ranges; \
         one single-member etcd and one arbiter process per shard; clients route by the shard map",
        args.workers, args.ranges
    );
    let mut runs = Vec::new();
    for &n in &args.shards {
        eprintln!("running: {n} shard(s)");
        runs.push(run(&args, n).await?);
    }
    print(&runs, nproc);
    Ok(())
}

async fn run(args: &Args, n: usize) -> anyhow::Result<Measured> {
    let exe = std::env::current_exe()?;
    let binary = exe.parent().context("exe dir")?.join("arbiter-under-test");
    let mut etcds = Vec::with_capacity(n);
    let mut arbiters = Vec::with_capacity(n);
    for _ in 0..n {
        let etcd = EtcdServer::start().await?;
        let arbiter =
            ArbiterProcess::start(&binary, &etcd, ArbiterOptions::default(), "warn").await?;
        etcds.push(etcd);
        arbiters.push(arbiter);
    }
    let map = ShardMap {
        version: 1,
        shards: etcds
            .iter()
            .enumerate()
            .map(|(i, e)| Shard {
                name: format!("shard-{i}"),
                endpoints: vec![e.endpoint()],
                weight: 1,
            })
            .collect(),
        overrides: BTreeMap::new(),
        moving: None,
    };
    map.check().context("the bench's shard map")?;
    let shard_index: BTreeMap<String, usize> = map
        .shards
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.clone(), i))
        .collect();

    // Each worker: a channel and a session per shard, one key per range.
    let mut workers = Vec::with_capacity(args.workers);
    let mut keys_per_shard = vec![0usize; n];
    for w in 0..args.workers {
        let mut clients = Vec::with_capacity(n);
        for a in &arbiters {
            let mut client = LockClient::new(channel(a.addr(), IDENTITY).await?);
            let session = client
                .open_session(OpenSessionRequest {
                    class: CLASS.into(),
                    reuse_session_ids: vec![],
                })
                .await
                .context("open session")?
                .into_inner()
                .session_id;
            clients.push((client, session));
        }
        let keys: Vec<(String, usize)> = (0..args.ranges)
            .map(|r| {
                let key = format!("bench/r{r}/w{w}");
                let home = shard_index.get(&map.home(&key).name).copied().unwrap_or(0);
                keys_per_shard[home] += 1;
                (key, home)
            })
            .collect();
        let last = vec![0; keys.len()];
        workers.push(Worker {
            clients,
            keys,
            last,
            next: w % args.ranges,
        });
    }

    // Warm up (connections, caches), then measure.
    let stop = Arc::new(AtomicBool::new(false));
    for w in &mut workers {
        for _ in 0..args.ranges.min(8) {
            w.cycle(&mut histogram()?).await?;
        }
    }
    let pids = |ps: Vec<Option<u32>>| ps.into_iter().map(|p| p.unwrap_or(0)).collect::<Vec<_>>();
    let etcd_pids = pids(etcds.iter().map(EtcdServer::pid).collect());
    let arbiter_pids = pids(arbiters.iter().map(ArbiterProcess::pid).collect());
    let me = std::process::id();
    let before: Vec<Usage> = etcd_pids
        .iter()
        .chain(&arbiter_pids)
        .map(|&p| usage(p))
        .collect();
    let me_before = usage(me);
    let latency = Arc::new(Mutex::new(histogram()?));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut w in workers {
        let stop = Arc::clone(&stop);
        let latency = Arc::clone(&latency);
        tasks.push(tokio::spawn(async move {
            let mut own = histogram()?;
            let mut cycles = 0u64;
            while !stop.load(Ordering::Relaxed) {
                w.cycle(&mut own).await?;
                cycles += 1;
            }
            latency.lock().add(&own)?;
            Ok::<_, anyhow::Error>(cycles)
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(args.secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut cycles = 0;
    for t in tasks {
        cycles += t.await??;
    }
    let secs = started.elapsed().as_secs_f64();
    let after: Vec<Usage> = etcd_pids
        .iter()
        .chain(&arbiter_pids)
        .map(|&p| usage(p))
        .collect();
    let cpu: Vec<f64> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.cpu_secs_since(b))
        .collect();
    let clients_cpu = usage(me).cpu_secs_since(&me_before);
    let latency = Arc::try_unwrap(latency)
        .map_err(|_| anyhow::anyhow!("a worker kept the histogram"))?
        .into_inner();
    drop(arbiters);
    drop(etcds);
    Ok(Measured {
        shards: n,
        cycles,
        secs,
        latency,
        keys_per_shard,
        etcd_cpu: cpu[..n].to_vec(),
        arbiter_cpu: cpu[n..].to_vec(),
        clients_cpu,
    })
}

/// One client: a session on every shard's arbiter, its keys with their
/// homes, and the last token each key got (tokens must increase per key).
struct Worker {
    clients: Vec<(LockClient<Channel>, i64)>,
    keys: Vec<(String, usize)>,
    last: Vec<u64>,
    next: usize,
}

impl Worker {
    /// Acquire(try) + Release of the next key, at its home shard.
    async fn cycle(&mut self, latency: &mut Histogram<u64>) -> anyhow::Result<()> {
        let at = self.next;
        self.next = (self.next + 1) % self.keys.len();
        let (key, home) = &self.keys[at];
        let (client, session) = &mut self.clients[*home];
        let began = Instant::now();
        let grant = client
            .acquire(AcquireRequest {
                key: key.clone(),
                class: CLASS.into(),
                session_id: *session,
                wait: WaitMode::WaitNone.into(),
                metadata: Default::default(),
                instance: String::new(),
                mode: 0,
                downgrade_from: None,
            })
            .await
            .with_context(|| format!("acquire {key}"))?
            .into_inner()
            .grant
            .with_context(|| format!("acquire {key}: OK without a grant"))?;
        client
            .release(ReleaseRequest {
                key: key.clone(),
                session_id: *session,
                token: grant.token,
                slot: None,
                mode: 0,
            })
            .await
            .with_context(|| format!("release {key}"))?;
        latency.record(u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX))?;
        if grant.token <= self.last[at] {
            bail!("{key}: token {} after {}", grant.token, self.last[at]);
        }
        self.last[at] = grant.token;
        Ok(())
    }
}

fn histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 60_000_000, 3)?)
}

fn print(runs: &[Measured], nproc: usize) {
    let Some(base) = runs.first() else {
        return;
    };
    let rate = |m: &Measured| m.cycles as f64 / m.secs;
    println!();
    println!(
        "{:>6} | {:>9} | {:>8} | {:>8} | {:>8} | {:>14} | {:>21} | {:>21} | {:>9} | {:>6}",
        "shards",
        "cycles/s",
        "ratio",
        "p50",
        "p99",
        "keys per shard",
        "etcd CPU s (each)",
        "arbiter CPU s (each)",
        "clients",
        "busy"
    );
    for m in runs {
        let total: f64 =
            m.etcd_cpu.iter().sum::<f64>() + m.arbiter_cpu.iter().sum::<f64>() + m.clients_cpu;
        let each = |v: &[f64]| {
            v.iter()
                .map(|c| format!("{c:.1}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        println!(
            "{:>6} | {:>9.0} | {:>7.2}x | {:>6.2}ms | {:>6.2}ms | {:>14} | {:>21} | {:>21} | {:>8.1}s | {:>5.0}%",
            m.shards,
            rate(m),
            rate(m) / rate(base),
            m.latency.value_at_quantile(0.5) as f64 / 1000.0,
            m.latency.value_at_quantile(0.99) as f64 / 1000.0,
            m.keys_per_shard
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            each(&m.etcd_cpu),
            each(&m.arbiter_cpu),
            m.clients_cpu,
            100.0 * total / (m.secs * nproc as f64),
        );
    }
    println!(
        "ratio: cycles/s against {} shard(s) in the same run; busy: CPU of every process above over {nproc} cores",
        base.shards
    );
    for m in runs {
        let per = |cpu: f64| 1e6 * cpu / m.cycles.max(1) as f64;
        println!(
            "  {} shard(s): CPU per cycle: etcd {:.0} us, arbiter {:.0} us, clients {:.0} us",
            m.shards,
            per(m.etcd_cpu.iter().sum()),
            per(m.arbiter_cpu.iter().sum()),
            per(m.clients_cpu),
        );
    }
}
