//! `latchkey-bench`: what a Latchkey grant costs, next to etcd doing the same work in the
//! same run.
//!
//! One real etcd (the [`EtcdServer`] harness) and one in-process arbiter over mTLS share
//! the machine with the clients, so every number is relative: each result is printed
//! beside a baseline measured minutes earlier on the same etcd, as a ratio.
//!
//! Uncontended (`--concurrency` workers, each on its own key, `--ops` timed cycles in all;
//! once per count of the list, 8 and 16 by default):
//! 1. **raw etcd** — a put-if-absent `Txn` (create_revision == 0, put with a lease) then a
//!    delete. Two raft writes: the physical floor of any grant + release on etcd. This
//!    is the baseline of the next two.
//! 2. **etcd Lock** — etcd's own `Lock(name, lease)` + `Unlock(key)`: what a team gets
//!    without Latchkey.
//! 3. **Latchkey** — `Acquire` (try-lock) + `Release` through the arbiter, each worker
//!    with its own mTLS connection and session (opened before the clock starts).
//!
//! Contended (one hot key, waiters with distinct identities, for `--hot-secs`):
//! 4. **Latchkey hot key** — each waiter loops `Acquire(wait)` + `Release`. Reported:
//!    the Acquire latency (queue wait included), grants/s, and the handoff gap: the
//!    releasing waiter stamps an `Instant` just before it sends `Release`, the next waiter
//!    to be granted measures from that stamp. Run with 3 waiters (alice, bob, demo on
//!    `demo/hot`, the dev policies as they are) and with `--waiters` dedicated identities
//!    `workload/bench-<i>` on `bench/hot` (granted by a private copy of the dev policies).
//! 5. **etcd Lock hot key** — the same loop with etcd's Lock API, one client and lease
//!    per waiter: the baseline of 4.
//! 3b. **Latchkey with a quota** — the same with a class that sets
//!    `maxHoldsPerSubject` (issue 34): each grant reads the subject's quota places and
//!    takes one in its transaction; the baseline is 3.
//! 3c. **Latchkey semaphore** — the same on one key of a semaphore class with as many
//!    permits as workers (issue 34): every worker holds a slot of one name at once, each
//!    grant reads the slots and takes a free one; the baseline is 3 (one key per worker).
//! 3d. **Latchkey shared, one key** — each worker loops `Acquire(shared, wait)` +
//!    `Release` on one key (issue 34): every worker holds it at once, each grant the
//!    session's own reader key. Beside it, in the same run, the same loop in the exclusive
//!    mode on one key (the workers queue: a hot key of `C` waiters, its baseline 3); the
//!    shared row's ratios are to both, exclusive on one key and 3 (exclusive, one key each).
//! 6. With `--durable`, the large hot-key scenario again with a durable class (ADR-14:
//!    waiters queued in etcd, `bench/hot-durable`): what the durable queue costs.
//! 7. **A writer under a stream of readers** (issue 34's goal: a writer is granted within
//!    2× the longest reader hold). Readers arrive at `--reader-rate` per second, each on a
//!    session of its own (a pool opened beforehand, one reader per session at a time, over
//!    the `--waiters` identities), each holding `--reader-hold-ms` (H) from its grant, so
//!    about rate × H hold at once; every second or so (jittered ±50 %) a writer asks
//!    exclusively with a wait, `--writers` times. Printed: the writers' wait (Acquire →
//!    grant) p50 and max, H, and max / H against the goal 2.0; the baseline, measured in
//!    the same run, is the writer's Acquire of the key with no reader. Readers and writer
//!    on one arbiter: the phase-fair case. With `--cross-arbiter`, also readers on a second
//!    arbiter B and the writer on A (each writer waiting at most 10×H, at least 5 s): FIFO
//!    is per arbiter, so what keeps B's readers behind A's writer is the writer's intent in
//!    etcd, which every shared grant compares absent. `--streams-only` runs only these.
//!
//! Correctness is checked while measuring, and a failure exits non-zero: in the
//! uncontended run each worker's tokens must increase; in the contended runs no two
//! waiters may hold the key at once, and Latchkey's fencing tokens must strictly increase
//! in grant order (printed as `token order: ok (N grants)`); under the stream of readers no
//! reader may hold beside a writer.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use clap::Parser;
use hdrhistogram::Histogram;
use latchctl::dev_certs;
use latchkey_etcd::kv::PutOptions;
use latchkey_etcd::lock::LockOptions;
use latchkey_etcd::txn::{Compare, CompareOp, Txn, TxnOp};
use latchkey_etcd::{Client as EtcdClient, Connection};
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{
    AcquireRequest, Grant, KeepAliveRequest, Mode, OpenSessionRequest, ReleaseRequest, WaitMode,
};
use latchkey_tests::arbiter::{self, Arbiter, ArbiterOptions};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::etcd_lease::EtcdLease;
use latchkey_tests::latency::{duration_text, histogram, micros};
use latchkey_tests::workspace_root;
use parking_lot::Mutex;
use tempfile::TempDir;
use tokio::sync::Barrier;
use tokio::task::{JoinHandle, JoinSet};
use tonic::transport::Channel;
use tonic::{Code, Status};

/// The dev lock class every Latchkey scenario uses (TTL 15 s); etcd leases get the same TTL.
const CLASS: &str = "demo";
/// The same with durable waiters (ADR-14), in the bench's copy of the policies.
const DURABLE_CLASS: &str = "bench-durable";
/// The demo class with a quota (`maxHoldsPerSubject`, issue 34) above any
/// worker count: every grant takes a quota place in its transaction.
const QUOTA_CLASS: &str = "bench-quota";
/// A semaphore class (issue 34) of 256 permits: the uncontended workers
/// share one name, a slot each.
const SEMAPHORE_CLASS: &str = "bench-semaphore";
/// The demo class with room for the readers that queue behind a writer
/// (`maxWaitersPerKey`): the class of the writer-under-readers scenario.
const SHARED_CLASS: &str = "bench-shared";
const LEASE_TTL_SECS: i64 = 15;
/// How long a contended waiter may queue before the run is declared stuck.
const WAIT_TIMEOUT: Duration = Duration::from_secs(30);
/// The identities with the `demo` prefix in the dev policies.
const DEMO_WAITERS: &[&str] = &["workload/alice", "workload/bob", "workload/demo"];
/// How often a writer asks under the stream of readers, on average (each
/// pause jittered ±50 %).
const WRITER_EVERY: Duration = Duration::from_secs(1);
#[derive(Parser, Debug)]
#[command(about = "Latchkey vs etcd: grant + release cost, uncontended and on a hot key")]
struct Args {
    /// Timed cycles per uncontended scenario, all workers together [default: 2000; 200 with --quick].
    #[arg(long)]
    ops: Option<usize>,
    /// Workers in the uncontended scenarios, each on its own key: a list
    /// runs each scenario once per count (`8,16`).
    #[arg(long, alias = "workers", value_delimiter = ',', default_values_t = [8, 16])]
    concurrency: Vec<usize>,
    /// Only the uncontended scenarios (no hot key).
    #[arg(long)]
    uncontended_only: bool,
    /// Waiters on the hot key in the large contended variant (each its own identity).
    #[arg(long, default_value_t = 8)]
    waiters: usize,
    /// Seconds each contended scenario runs [default: 5; 2 with --quick].
    #[arg(long)]
    hot_secs: Option<f64>,
    /// Small numbers, for a CI smoke run.
    #[arg(long)]
    quick: bool,
    /// Also print every result as a JSON line.
    #[arg(long)]
    json: bool,
    /// Run a coord etcd (a second etcd process) and witness the arbiter's
    /// grants there (`--coord-etcd`): what the witness costs.
    #[arg(long)]
    witness: bool,
    /// Also run the large hot-key scenario with a durable class (ADR-14:
    /// the queue in etcd, two more writes per waiting call).
    #[arg(long)]
    durable: bool,
    /// Readers arriving per second under which writers ask (each reader on
    /// its own session).
    #[arg(long, default_value_t = 100.0)]
    reader_rate: f64,
    /// How long each of those readers holds, from its grant to its Release (H).
    #[arg(long, default_value_t = 200)]
    reader_hold_ms: u64,
    /// Writers measured under the readers, one every second or so [default: 20; 5 with --quick].
    #[arg(long)]
    writers: Option<usize>,
    /// Also run the writer under readers across two arbiters (readers on B,
    /// the writer on A), where FIFO does not reach.
    #[arg(long)]
    cross_arbiter: bool,
    /// Only the writer-under-readers scenarios (7): no uncontended or hot-key run.
    #[arg(long)]
    streams_only: bool,
}

/// The resolved settings of one run.
#[derive(Clone)]
struct Plan {
    ops: usize,
    /// Workers of the uncontended scenario being run.
    concurrency: usize,
    /// Every worker count to run the uncontended scenarios with.
    counts: Vec<usize>,
    waiters: usize,
    hot: Duration,
    /// Untimed cycles per worker before the clock starts (connections, caches).
    warmup: usize,
    stream: StreamPlan,
}

impl Plan {
    fn from_args(args: &Args) -> anyhow::Result<Self> {
        let plan = Self {
            ops: args.ops.unwrap_or(if args.quick { 200 } else { 2000 }),
            concurrency: args.concurrency.iter().copied().max().unwrap_or(0),
            counts: args.concurrency.clone(),
            waiters: args.waiters,
            hot: Duration::try_from_secs_f64(args.hot_secs.unwrap_or(if args.quick {
                2.0
            } else {
                5.0
            }))
            .context("--hot-secs")?,
            warmup: if args.quick { 3 } else { 20 },
            stream: StreamPlan {
                rate: args.reader_rate,
                hold: Duration::from_millis(args.reader_hold_ms),
                writers: args.writers.unwrap_or(if args.quick { 5 } else { 20 }),
            },
        };
        ensure!(
            !plan.counts.is_empty() && plan.counts.iter().all(|&c| c >= 1),
            "--concurrency must be at least 1"
        );
        ensure!(
            plan.ops >= plan.concurrency,
            "--ops must be at least every --concurrency"
        );
        ensure!(plan.waiters >= 2, "--waiters must be at least 2 to contend");
        ensure!(!plan.hot.is_zero(), "--hot-secs must be positive");
        ensure!(
            plan.stream.rate.is_finite() && plan.stream.rate >= 0.1 && plan.stream.rate <= 1000.0,
            "--reader-rate must be between 0.1 and 1000 per second"
        );
        ensure!(
            !plan.stream.hold.is_zero(),
            "--reader-hold-ms must be positive"
        );
        ensure!(plan.stream.writers >= 1, "--writers must be at least 1");
        Ok(plan)
    }

    /// Timed cycles for worker `w`: `ops` split evenly, the remainder to the first workers.
    fn ops_for(&self, w: usize) -> usize {
        self.ops / self.concurrency + usize::from(w < self.ops % self.concurrency)
    }
}

/// What one scenario measured.
struct Run {
    elapsed: Duration,
    /// Per cycle (uncontended) or per Acquire including the queue wait (contended), µs.
    latency: Histogram<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let plan = Plan::from_args(&args)?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init()
        .map_err(|e| anyhow!("installing the tracing subscriber: {e}"))?;

    // Declared first so they outlive the arbiter that polls them.
    let bench_waiters: Vec<String> = (0..plan.waiters)
        .map(|i| format!("workload/bench-{i}"))
        .collect();
    let policies = policies_with_waiters(&bench_waiters)?;
    let certs = arbiter::certs()?;
    let names: Vec<&str> = bench_waiters.iter().map(String::as_str).collect();
    dev_certs::generate(certs.dir.as_path(), arbiter::TRUST_DOMAIN, &names)
        .context("issuing SVIDs for the bench waiters")?;

    let etcd = EtcdServer::start().await?;
    let etcd_version = etcd.client().await?.status().await?.version().to_owned();
    let coord = match args.witness {
        true => Some(EtcdServer::start().await?),
        false => None,
    };
    let arbiter_options = ArbiterOptions {
        policies_dir: policies.path().to_path_buf(),
        coord: coord.as_ref().map(latchkey_tests::arbiter::Coord::on),
        ..Default::default()
    };
    let arbiter = Arbiter::start(&etcd, arbiter_options.clone()).await?;
    let endpoint = etcd.endpoint();
    let addr = arbiter.addr();

    println!(
        "latchkey-bench {}: nproc {}, etcd {etcd_version} (one member, temp data dir), \
         in-process arbiter over mTLS{}; clients, etcd and arbiter share the machine",
        env!("CARGO_PKG_VERSION"),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if coord.is_some() {
            ", witnessed by a coord etcd (a second process)"
        } else {
            ""
        },
    );
    println!(
        "uncontended: {} cycles, {:?} workers on distinct keys; hot key: {:.1} s per run",
        plan.ops,
        plan.counts,
        plan.hot.as_secs_f64()
    );

    let mut table = Table::default();
    let counts = match args.streams_only {
        true => Vec::new(),
        false => plan.counts.clone(),
    };
    for &c in &counts {
        let plan = Plan {
            concurrency: c,
            counts: vec![c],
            ..plan.clone()
        };
        eprintln!("running: raw etcd txn + delete, C={c}");
        let raw = uncontended(&plan, |w| RawEtcd::connect(endpoint.clone(), w)).await?;
        eprintln!("running: etcd Lock + Unlock, C={c}");
        let etcd_lock = uncontended(&plan, |w| {
            EtcdLock::connect(endpoint.clone(), format!("bench-etcd/lock-{w}"))
        })
        .await?;
        eprintln!("running: latchkey Acquire + Release, C={c}");
        let latchkey = uncontended(&plan, |w| {
            Latchkey::connect(
                addr,
                "workload/bench".to_owned(),
                format!("bench/k-{w}"),
                CLASS,
            )
        })
        .await?;
        table.row(
            format!("raw etcd: txn put-if-absent + delete (C={c})"),
            &raw,
            &raw.latency,
            None,
        );
        let raw_label = format!("raw etcd C={c}");
        let vs_raw = Some((raw_label.as_str(), &raw, &raw.latency));
        table.row(
            format!("etcd Lock + Unlock (C={c})"),
            &etcd_lock,
            &etcd_lock.latency,
            vs_raw,
        );
        table.row(
            format!("latchkey Acquire(try) + Release (C={c})"),
            &latchkey,
            &latchkey.latency,
            vs_raw,
        );
        eprintln!("running: latchkey Acquire + Release with a quota, C={c}");
        let quota = uncontended(&plan, |w| {
            Latchkey::connect(
                addr,
                "workload/bench".to_owned(),
                format!("bench/q-{w}"),
                QUOTA_CLASS,
            )
        })
        .await?;
        let plain_label = format!("latchkey C={c}");
        table.row(
            format!("latchkey with maxHoldsPerSubject (C={c})"),
            &quota,
            &quota.latency,
            Some((plain_label.as_str(), &latchkey, &latchkey.latency)),
        );
        eprintln!("running: latchkey semaphore Acquire + Release, C={c} on one name");
        let semaphore = uncontended(&plan, |_| {
            Latchkey::connect(
                addr,
                "workload/bench".to_owned(),
                "bench/pool".to_owned(),
                SEMAPHORE_CLASS,
            )
        })
        .await?;
        table.row(
            format!("latchkey semaphore, C={c} slots of one name"),
            &semaphore,
            &semaphore.latency,
            Some((plain_label.as_str(), &latchkey, &latchkey.latency)),
        );
        eprintln!("running: latchkey exclusive Acquire(wait) + Release, C={c} on one key");
        let one_key = format!("bench/one-{c}");
        let exclusive_one = uncontended(&plan, |_| {
            let key = one_key.clone();
            async move {
                let lock = Latchkey::connect(addr, "workload/bench".to_owned(), key, CLASS).await?;
                Ok(lock.cycling(Mode::Exclusive, WaitMode::WaitUntilDeadline))
            }
        })
        .await?;
        eprintln!("running: latchkey shared Acquire(wait) + Release, C={c} on one key");
        let shared_key = format!("bench/shared-{c}");
        let shared_one = uncontended(&plan, |_| {
            let key = shared_key.clone();
            async move {
                let lock = Latchkey::connect(addr, "workload/bench".to_owned(), key, CLASS).await?;
                Ok(lock.cycling(Mode::Shared, WaitMode::WaitUntilDeadline))
            }
        })
        .await?;
        table.row(
            format!("latchkey exclusive, C={c} on one key (wait)"),
            &exclusive_one,
            &exclusive_one.latency,
            Some((plain_label.as_str(), &latchkey, &latchkey.latency)),
        );
        let exclusive_label = format!("exclusive one key C={c}");
        table.row_vs(
            format!("latchkey shared, C={c} readers of one key (wait)"),
            &shared_one,
            &shared_one.latency,
            &[
                (
                    exclusive_label.as_str(),
                    &exclusive_one,
                    &exclusive_one.latency,
                ),
                (plain_label.as_str(), &latchkey, &latchkey.latency),
            ],
        );
    }
    if args.uncontended_only {
        println!();
        table.print(args.json)?;
        arbiter.stop().await?;
        drop(etcd);
        return Ok(());
    }

    let demo_waiters: Vec<String> = DEMO_WAITERS.iter().map(|s| (*s).to_owned()).collect();
    let hot_keys = [
        (&demo_waiters, "demo/hot", CLASS, ""),
        (&bench_waiters, "bench/hot", CLASS, ""),
        (
            &bench_waiters,
            "bench/hot-durable",
            DURABLE_CLASS,
            " durable",
        ),
    ];
    for (waiters, key, class, durable) in hot_keys {
        if args.streams_only {
            continue;
        }
        let m = waiters.len();
        if !durable.is_empty() && !args.durable {
            continue;
        }
        eprintln!("running: hot key, etcd Lock, M={m}");
        let etcd_hot = contended(&plan, waiters, |_| {
            EtcdLock::connect(endpoint.clone(), format!("bench-etcd/hot-{m}"))
        })
        .await?;
        eprintln!("running: hot key, latchkey{durable}, M={m}");
        let hot = contended(&plan, waiters, |name| {
            Latchkey::connect(addr, name.to_owned(), key.to_owned(), class)
        })
        .await?;

        let (etcd_wait, etcd_gap) = (format!("etcd wait M={m}"), format!("etcd gap M={m}"));
        table.row(
            format!("hot key M={m}, etcd Lock: lock wait"),
            &etcd_hot.run,
            &etcd_hot.run.latency,
            None,
        );
        table.row(
            format!("hot key M={m}, etcd Lock: unlock→next grant"),
            &etcd_hot.run,
            &etcd_hot.gap,
            None,
        );
        table.row(
            format!("hot key M={m}, latchkey{durable}: acquire wait"),
            &hot.run,
            &hot.run.latency,
            Some((&etcd_wait, &etcd_hot.run, &etcd_hot.run.latency)),
        );
        table.row(
            format!("hot key M={m}, latchkey{durable}: release→next grant"),
            &hot.run,
            &hot.gap,
            Some((&etcd_gap, &etcd_hot.run, &etcd_hot.gap)),
        );
        table
            .checks
            .push(format!("M={m} {key}: {}", check_token_order(&hot.tokens)?));
    }

    let reader_identities = &bench_waiters;
    let mut streams = Vec::new();
    eprintln!(
        "running: a writer under readers at {}/s holding {:?}, one arbiter",
        plan.stream.rate, plan.stream.hold
    );
    let same = writer_under_readers(
        StreamSetup {
            readers_at: addr,
            writer_at: addr,
            reader_identities,
            key: "bench/rw-one-arbiter",
            writers: plan.stream.writers,
            budget: WAIT_TIMEOUT,
        },
        plan.stream,
    )
    .await?;
    streams.push(("one arbiter (phase-fair FIFO)".to_owned(), same));
    if args.cross_arbiter {
        let b = Arbiter::start(&etcd, arbiter_options.clone()).await?;
        eprintln!(
            "running: a writer under readers at {}/s holding {:?}, readers on arbiter B, writer on A",
            plan.stream.rate, plan.stream.hold
        );
        let cross = writer_under_readers(
            StreamSetup {
                readers_at: b.addr(),
                writer_at: addr,
                reader_identities,
                key: "bench/rw-two-arbiters",
                writers: plan.stream.writers,
                budget: plan.stream.cross_budget(),
            },
            plan.stream,
        )
        .await;
        b.stop().await?;
        streams.push((
            "two arbiters: readers on B, writer on A (its intent in etcd)".to_owned(),
            cross?,
        ));
    }

    println!();
    table.print(args.json)?;
    println!();
    print_streams(&plan.stream, &streams, args.json)?;
    arbiter.stop().await?;
    drop(etcd);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Uncontended: each worker cycles on its own key.

/// One client cycling a lock it alone uses.
trait Cycle: Send + 'static {
    /// Takes the lock and gives it back: the timed unit of the uncontended scenarios.
    fn cycle(&mut self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

async fn uncontended<L, F, Fut>(plan: &Plan, setup: F) -> anyhow::Result<Run>
where
    L: Cycle,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<L>> + Send + 'static,
{
    let start_line = Arc::new(Barrier::new(plan.concurrency + 1));
    let mut workers = JoinSet::new();
    for w in 0..plan.concurrency {
        let (ops, warmup) = (plan.ops_for(w), plan.warmup);
        let setup = setup(w);
        let start_line = start_line.clone();
        workers.spawn(async move {
            let ready = async {
                let mut lock = setup.await?;
                for _ in 0..warmup {
                    lock.cycle().await?;
                }
                anyhow::Ok(lock)
            }
            .await;
            // Reached even on a setup error, so the others are never left waiting.
            start_line.wait().await;
            let mut lock = ready?;
            let mut latency = histogram()?;
            for _ in 0..ops {
                let sent = Instant::now();
                lock.cycle().await?;
                latency.saturating_record(micros(sent.elapsed()));
            }
            anyhow::Ok(latency)
        });
    }
    start_line.wait().await;
    let start = Instant::now();
    let mut latency = histogram()?;
    while let Some(done) = workers.join_next().await {
        latency.add(done??)?;
    }
    Ok(Run {
        elapsed: start.elapsed(),
        latency,
    })
}

/// The floor: a put-if-absent txn with a lease, then a delete, on the worker's own key.
struct RawEtcd {
    client: EtcdClient,
    key: String,
    lease: EtcdLease,
}

impl RawEtcd {
    async fn connect(endpoint: String, worker: usize) -> anyhow::Result<Self> {
        let mut client = latchkey_etcd::connect(&Connection::new([endpoint])).await?;
        let lease = EtcdLease::grant(&mut client, LEASE_TTL_SECS).await?;
        Ok(Self {
            client,
            key: format!("bench-etcd/raw-{worker}"),
            lease,
        })
    }
}

impl Cycle for RawEtcd {
    async fn cycle(&mut self) -> anyhow::Result<()> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.key.as_str(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(
                self.key.as_str(),
                "held",
                Some(PutOptions::new().with_lease(self.lease.id)),
            )]);
        let put = self.client.txn(txn).await.context("put-if-absent txn")?;
        ensure!(put.succeeded(), "{} was not free", self.key);
        self.client
            .delete(self.key.as_str(), None)
            .await
            .context("delete")?;
        Ok(())
    }
}

/// etcd's Lock API with the client's own lease.
struct EtcdLock {
    client: EtcdClient,
    name: String,
    lease: EtcdLease,
    /// The ownership key of the lock held now (contended loop).
    held: Option<Vec<u8>>,
}

impl EtcdLock {
    async fn connect(endpoint: String, name: String) -> anyhow::Result<Self> {
        let mut client = latchkey_etcd::connect(&Connection::new([endpoint])).await?;
        let lease = EtcdLease::grant(&mut client, LEASE_TTL_SECS).await?;
        Ok(Self {
            client,
            name,
            lease,
            held: None,
        })
    }

    /// Blocks until granted; returns the lock's ownership key.
    async fn lock(&mut self) -> anyhow::Result<Vec<u8>> {
        let options = LockOptions::new().with_lease(self.lease.id);
        let locked = tokio::time::timeout(
            WAIT_TIMEOUT,
            self.client.lock(self.name.as_str(), Some(options)),
        )
        .await
        .with_context(|| {
            format!(
                "etcd lock {} not granted within {WAIT_TIMEOUT:?}",
                self.name
            )
        })?
        .context("etcd lock")?;
        Ok(locked.key().to_vec())
    }

    async fn unlock(&mut self, key: Vec<u8>) -> anyhow::Result<()> {
        self.client.unlock(key).await.context("etcd unlock")?;
        Ok(())
    }
}

impl Cycle for EtcdLock {
    async fn cycle(&mut self) -> anyhow::Result<()> {
        let key = self.lock().await?;
        self.unlock(key).await
    }
}

/// A Latchkey client: its own mTLS connection under one identity, and its own session.
struct Latchkey {
    client: LockClient<Channel>,
    key: String,
    class: &'static str,
    session: LatchkeySession,
    last_token: u64,
    /// The grant held now (contended loop).
    held: Option<Grant>,
    /// The mode the cycle asks for: exclusive unless [`Latchkey::cycling`].
    mode: Mode,
    /// Whether the cycle waits for a held key: a try-lock unless [`Latchkey::cycling`].
    cycle_wait: WaitMode,
}

impl Latchkey {
    async fn connect(
        addr: SocketAddr,
        identity: String,
        key: String,
        class: &'static str,
    ) -> anyhow::Result<Self> {
        let mut client = LockClient::new(arbiter::channel(addr, &identity).await?);
        let session = LatchkeySession::open(&mut client, class).await?;
        Ok(Self {
            client,
            key,
            class,
            session,
            last_token: 0,
            held: None,
            mode: Mode::Exclusive,
            cycle_wait: WaitMode::WaitNone,
        })
    }

    /// The same client, its cycle asking in `mode` and waiting as `wait` says.
    fn cycling(self, mode: Mode, wait: WaitMode) -> Self {
        Self {
            mode,
            cycle_wait: wait,
            ..self
        }
    }

    async fn acquire_grant(&mut self, wait: WaitMode) -> anyhow::Result<Grant> {
        let budget = (wait == WaitMode::WaitUntilDeadline).then_some(WAIT_TIMEOUT);
        acquire(
            &mut self.client,
            &self.key,
            self.class,
            self.session.id,
            self.mode,
            budget,
        )
        .await
        .with_context(|| format!("acquire {}", self.key))
    }

    async fn release_grant(&mut self, grant: &Grant) -> anyhow::Result<()> {
        release(&mut self.client, grant)
            .await
            .with_context(|| format!("release {}", grant.key))
    }
}

/// One Acquire of `key` in `mode`; `budget`: how long a held key is waited
/// for (`None`: a try-lock).
async fn acquire(
    client: &mut LockClient<Channel>,
    key: &str,
    class: &str,
    session: i64,
    mode: Mode,
    budget: Option<Duration>,
) -> Result<Grant, Status> {
    let mut request = tonic::Request::new(AcquireRequest {
        key: key.into(),
        class: class.into(),
        session_id: session,
        wait: match budget {
            Some(_) => WaitMode::WaitUntilDeadline.into(),
            None => WaitMode::WaitNone.into(),
        },
        metadata: Default::default(),
        instance: String::new(),
        mode: mode.into(),
        downgrade_from: None,
    });
    if let Some(budget) = budget {
        request.set_timeout(budget);
    }
    client
        .acquire(request)
        .await?
        .into_inner()
        .grant
        .ok_or_else(|| Status::internal("OK without a grant"))
}

/// Releases `grant` in the mode it was granted.
async fn release(client: &mut LockClient<Channel>, grant: &Grant) -> Result<(), Status> {
    client
        .release(ReleaseRequest {
            key: grant.key.clone(),
            session_id: grant.session_id,
            token: grant.token,
            slot: grant.slot,
            mode: grant.mode,
        })
        .await?;
    Ok(())
}

impl Cycle for Latchkey {
    async fn cycle(&mut self) -> anyhow::Result<()> {
        let grant = self.acquire_grant(self.cycle_wait).await?;
        ensure!(
            grant.mode == i32::from(self.mode),
            "{}: granted mode {} when {:?} was asked",
            self.key,
            grant.mode,
            self.mode
        );
        // Its own session's grants (alone on the key, or a reader's own key,
        // or queued with others): every one must carry a larger token than
        // the last.
        ensure!(
            grant.token > self.last_token,
            "{}: token {} after {}",
            self.key,
            grant.token,
            self.last_token
        );
        self.last_token = grant.token;
        self.release_grant(&grant).await
    }
}

// ---------------------------------------------------------------------------------------
// Contended: every waiter loops on one key.

/// One waiter on the hot key. `acquire` returns a fencing token where the lock has one.
trait HotLock: Send + 'static {
    fn acquire(&mut self) -> impl Future<Output = anyhow::Result<Option<u64>>> + Send;
    fn release(&mut self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

impl HotLock for EtcdLock {
    async fn acquire(&mut self) -> anyhow::Result<Option<u64>> {
        let key = self.lock().await?;
        self.held = Some(key);
        Ok(None)
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        let key = self.held.take().context("etcd unlock without a lock")?;
        self.unlock(key).await
    }
}

impl HotLock for Latchkey {
    async fn acquire(&mut self) -> anyhow::Result<Option<u64>> {
        let grant = self.acquire_grant(WaitMode::WaitUntilDeadline).await?;
        let token = grant.token;
        self.held = Some(grant);
        Ok(Some(token))
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        let grant = self.held.take().context("release without a grant")?;
        self.release_grant(&grant).await
    }
}

/// What the waiters share: who holds the key, when it was last released, and the
/// tokens in the order they were granted.
#[derive(Default)]
struct HotKey {
    held: AtomicBool,
    released_at: Mutex<Option<Instant>>,
    tokens: Mutex<Vec<u64>>,
}

struct HotRun {
    run: Run,
    /// Release sent → next grant received, µs.
    gap: Histogram<u64>,
    /// Fencing tokens in grant order (empty for etcd's Lock, which has none).
    tokens: Vec<u64>,
}

async fn contended<L, F, Fut>(plan: &Plan, waiters: &[String], setup: F) -> anyhow::Result<HotRun>
where
    L: HotLock,
    F: Fn(&str) -> Fut,
    Fut: Future<Output = anyhow::Result<L>> + Send + 'static,
{
    let hot = Arc::new(HotKey::default());
    let start_line = Arc::new(Barrier::new(waiters.len() + 1));
    let mut tasks = JoinSet::new();
    for name in waiters {
        let (setup, start_line, hot, run_for) =
            (setup(name), start_line.clone(), hot.clone(), plan.hot);
        tasks.spawn(async move {
            let ready = setup.await;
            start_line.wait().await;
            let mut lock = ready?;
            let deadline = Instant::now() + run_for;
            let (mut latency, mut gap) = (histogram()?, histogram()?);
            while Instant::now() < deadline {
                let sent = Instant::now();
                let token = lock.acquire().await?;
                let granted = Instant::now();
                ensure!(
                    !hot.held.swap(true, Ordering::SeqCst),
                    "two waiters hold the hot key at once"
                );
                latency.saturating_record(micros(granted - sent));
                if let Some(released) = hot.released_at.lock().take() {
                    gap.saturating_record(micros(granted.saturating_duration_since(released)));
                }
                if let Some(token) = token {
                    hot.tokens.lock().push(token);
                }
                // Cleared before Release is sent: the next grant can only follow it.
                hot.held.store(false, Ordering::SeqCst);
                *hot.released_at.lock() = Some(Instant::now());
                lock.release().await?;
            }
            anyhow::Ok((latency, gap))
        });
    }
    start_line.wait().await;
    let start = Instant::now();
    let (mut latency, mut gap) = (histogram()?, histogram()?);
    while let Some(done) = tasks.join_next().await {
        let (l, g) = done??;
        latency.add(l)?;
        gap.add(g)?;
    }
    let elapsed = start.elapsed();
    let tokens = std::mem::take(&mut *hot.tokens.lock());
    Ok(HotRun {
        run: Run { elapsed, latency },
        gap,
        tokens,
    })
}

/// Tokens of one key must strictly increase in grant order.
fn check_token_order(tokens: &[u64]) -> anyhow::Result<String> {
    ensure!(!tokens.is_empty(), "no grants recorded on the hot key");
    if let Some(i) = tokens.windows(2).position(|w| w[0] >= w[1]) {
        bail!(
            "token order violated: grant {} has token {} after {}",
            i + 1,
            tokens[i + 1],
            tokens[i]
        );
    }
    Ok(format!("token order: ok ({} grants)", tokens.len()))
}

// ---------------------------------------------------------------------------------------
// A writer under a stream of readers (issue 34).

/// The stream of readers a writer asks under.
#[derive(Clone, Copy)]
struct StreamPlan {
    /// Readers arriving per second, each on a session of its own.
    rate: f64,
    /// How long each reader holds, from its grant to its Release (H).
    hold: Duration,
    /// Writers measured on one arbiter, one after the other.
    writers: usize,
}

impl StreamPlan {
    /// How long a writer of the cross-arbiter variant waits before it counts
    /// as not granted: far above the goal (2×H), so a miss is no near one.
    fn cross_budget(&self) -> Duration {
        (self.hold * 10).max(Duration::from_secs(5))
    }

    /// Sessions for the readers: more than hold at once (rate × H) plus
    /// those queued behind a writer (rate × its wait, about H), with room.
    fn pool(&self) -> usize {
        (self.rate * self.hold.as_secs_f64() * 4.0).ceil() as usize + 32
    }
}

/// Where one variant's readers and writer call, and how long a writer waits.
struct StreamSetup<'a> {
    readers_at: SocketAddr,
    writer_at: SocketAddr,
    /// The readers' sessions are spread over these identities.
    reader_identities: &'a [String],
    key: &'a str,
    writers: usize,
    budget: Duration,
}

/// Who holds the key now, as the clients saw their grants.
#[derive(Default)]
struct RwKey {
    /// Readers holding (counted once granted, uncounted before the Release is sent).
    readers: AtomicUsize,
    /// The writer holds (set once granted, cleared before the Release is sent).
    writer: AtomicBool,
    /// The writers are done: no more readers arrive.
    stop: AtomicBool,
}

/// What one variant measured.
struct StreamRun {
    /// Readers that arrived, and their arrival rate as it was.
    readers: usize,
    arrivals_per_sec: f64,
    /// Reader Acquire → grant, µs.
    reader_wait: Histogram<u64>,
    /// Reader grant → Release answered, µs: the hold as the reader saw it.
    reader_hold: Histogram<u64>,
    /// Readers holding when each writer asked.
    overlap: Vec<usize>,
    /// Writers measured, and the waits of those granted (Acquire → grant).
    writers: usize,
    writer_waits: Vec<Duration>,
    /// How long a writer waited before it counted as not granted.
    budget: Duration,
    /// The writer's Acquire of the key with no reader, µs (same run, before the stream).
    alone: Histogram<u64>,
}

impl StreamRun {
    fn not_granted(&self) -> usize {
        self.writers - self.writer_waits.len()
    }
}

/// The readers' sessions, one reader on each at a time.
type SessionPool = Arc<Mutex<Vec<(LockClient<Channel>, LatchkeySession)>>>;

/// Readers arrive at `plan.rate` on `setup.readers_at`, each holding `plan.hold`; once
/// they overlap as they will, `setup.writers` writers ask on `setup.writer_at`, about one
/// a second, each exclusively with a wait of at most `setup.budget`.
async fn writer_under_readers(
    setup: StreamSetup<'_>,
    plan: StreamPlan,
) -> anyhow::Result<StreamRun> {
    let key = setup.key.to_owned();
    let pool: SessionPool = Arc::default();
    let mut clients = Vec::new();
    for identity in setup.reader_identities {
        clients.push(LockClient::new(
            arbiter::channel(setup.readers_at, identity).await?,
        ));
    }
    ensure!(!clients.is_empty(), "no identities for the readers");
    for i in 0..plan.pool() {
        let mut client = clients[i % clients.len()].clone();
        let session = LatchkeySession::open(&mut client, SHARED_CLASS).await?;
        pool.lock().push((client, session));
    }
    let mut writer = Latchkey::connect(
        setup.writer_at,
        "workload/bench".to_owned(),
        key.clone(),
        SHARED_CLASS,
    )
    .await?;

    // The baseline: the writer's Acquire with no reader about.
    let mut alone = histogram()?;
    for _ in 0..20 {
        let sent = Instant::now();
        let grant = writer.acquire_grant(WaitMode::WaitUntilDeadline).await?;
        alone.saturating_record(micros(sent.elapsed()));
        writer.release_grant(&grant).await?;
    }

    let rw = Arc::new(RwKey::default());
    let stream = tokio::spawn(reader_stream(pool, rw.clone(), key.clone(), plan));
    // Let the readers come to overlap as they will.
    tokio::time::sleep(plan.hold * 2).await;
    let (mut overlap, mut writer_waits) = (Vec::new(), Vec::new());
    for _ in 0..setup.writers {
        tokio::time::sleep(WRITER_EVERY.mul_f64(0.5 + fastrand::f64())).await;
        if stream.is_finished() {
            stream.await??;
            bail!("the readers stopped before the writers were done");
        }
        overlap.push(rw.readers.load(Ordering::SeqCst));
        let sent = Instant::now();
        let asked = acquire(
            &mut writer.client,
            &key,
            SHARED_CLASS,
            writer.session.id,
            Mode::Exclusive,
            Some(setup.budget),
        )
        .await;
        let waited = sent.elapsed();
        match asked {
            Ok(grant) => {
                let readers = rw.readers.load(Ordering::SeqCst);
                ensure!(
                    readers == 0,
                    "the writer was granted beside {readers} readers"
                );
                rw.writer.store(true, Ordering::SeqCst);
                writer_waits.push(waited);
                // Cleared before Release is sent: a reader's grant can only follow it.
                rw.writer.store(false, Ordering::SeqCst);
                release(&mut writer.client, &grant)
                    .await
                    .context("the writer's release")?;
            }
            // Not granted within its budget (WAIT_TIMEOUT, or the call's own deadline).
            Err(status) if status.code() == Code::DeadlineExceeded => {}
            Err(status) => return Err(anyhow!(status).context("the writer's acquire")),
        }
    }
    rw.stop.store(true, Ordering::SeqCst);
    let (readers, arrivals_per_sec, reader_wait, reader_hold) = stream.await??;
    Ok(StreamRun {
        readers,
        arrivals_per_sec,
        reader_wait,
        reader_hold,
        overlap,
        writers: setup.writers,
        writer_waits,
        budget: setup.budget,
        alone,
    })
}

/// Spawns a reader every 1/rate s until `rw.stop`, then waits for every one to end.
/// Returns (readers, arrivals per second, reader waits, reader holds).
async fn reader_stream(
    pool: SessionPool,
    rw: Arc<RwKey>,
    key: String,
    plan: StreamPlan,
) -> anyhow::Result<(usize, f64, Histogram<u64>, Histogram<u64>)> {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / plan.rate));
    let mut readers = JoinSet::new();
    let (mut waits, mut holds) = (histogram()?, histogram()?);
    let mut record =
        |done: Result<anyhow::Result<(Duration, Duration)>, tokio::task::JoinError>| {
            let (wait, hold) = done??;
            waits.saturating_record(micros(wait));
            holds.saturating_record(micros(hold));
            anyhow::Ok(())
        };
    let (start, mut arrived) = (Instant::now(), 0usize);
    while !rw.stop.load(Ordering::SeqCst) {
        tick.tick().await;
        arrived += 1;
        readers.spawn(reader(pool.clone(), rw.clone(), key.clone(), plan.hold));
        while let Some(done) = readers.try_join_next() {
            record(done)?;
        }
    }
    let rate = arrived as f64 / start.elapsed().as_secs_f64().max(1e-9);
    while let Some(done) = readers.join_next().await {
        record(done)?;
    }
    Ok((arrived, rate, waits, holds))
}

/// One reader: a session from the pool, `Acquire(shared, wait)`, `hold`, `Release`.
/// Returns (Acquire → grant, grant → Release answered).
async fn reader(
    pool: SessionPool,
    rw: Arc<RwKey>,
    key: String,
    hold: Duration,
) -> anyhow::Result<(Duration, Duration)> {
    let taken = pool.lock().pop();
    let (mut client, session) =
        taken.context("the readers' session pool ran dry: more readers at once than planned")?;
    let sent = Instant::now();
    let grant = acquire(
        &mut client,
        &key,
        SHARED_CLASS,
        session.id,
        Mode::Shared,
        Some(WAIT_TIMEOUT),
    )
    .await
    .context("a reader's acquire")?;
    let granted = Instant::now();
    ensure!(
        !rw.writer.load(Ordering::SeqCst),
        "a reader was granted beside the writer"
    );
    rw.readers.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(hold).await;
    rw.readers.fetch_sub(1, Ordering::SeqCst);
    release(&mut client, &grant)
        .await
        .context("a reader's release")?;
    let held = granted.elapsed();
    pool.lock().push((client, session));
    Ok((granted - sent, held))
}

/// The writer-under-readers variants, against the goal: the longest writer wait within
/// 2×H.
fn print_streams(
    plan: &StreamPlan,
    streams: &[(String, StreamRun)],
    json: bool,
) -> anyhow::Result<()> {
    const GOAL: f64 = 2.0;
    println!(
        "a writer under a stream of readers (issue 34 goal: every writer granted within {GOAL}×H, \
         H = {} each reader's hold; readers at {}/s)",
        duration_text(micros(plan.hold)),
        plan.rate
    );
    let width = streams
        .iter()
        .map(|(label, _)| label.chars().count())
        .max()
        .unwrap_or(8);
    println!(
        "{:<width$} | {:>7} | {:>9} | {:>9} | {:>9} | {:>9} | {:>9} | max wait / H (goal ≤ {GOAL:.1})",
        "variant", "granted", "alone p50", "wait p50", "wait max", "H", "hold max"
    );
    println!("{}", "-".repeat(width + 100));
    let mut lines = Vec::new();
    for (label, run) in streams {
        let mut waits = run.writer_waits.clone();
        waits.sort();
        let missed = run.not_granted();
        let hold_us = micros(plan.hold) as f64;
        // A writer not granted waited at least its budget.
        let (max_us, max_text) = match (missed, waits.last()) {
            (0, Some(max)) => (micros(*max), duration_text(micros(*max))),
            _ => (
                micros(run.budget),
                format!("> {}", duration_text(micros(run.budget))),
            ),
        };
        let p50 = match nearest_rank(&waits, 0.5) {
            Some(p50) if missed * 2 < run.writers => duration_text(micros(p50)),
            _ => format!("> {}", duration_text(micros(run.budget))),
        };
        let ratio = max_us as f64 / hold_us;
        let verdict = match (missed, ratio <= GOAL) {
            (0, true) => "met".to_owned(),
            (0, false) => "MISSED".to_owned(),
            _ => format!("MISSED: {missed} of {} not granted", run.writers),
        };
        let alone_p50 = run.alone.value_at_quantile(0.5);
        println!(
            "{:<width$} | {:>7} | {:>9} | {:>9} | {:>9} | {:>9} | {:>9} | {}{ratio:.2} {verdict}",
            label,
            format!("{}/{}", run.writer_waits.len(), run.writers),
            duration_text(alone_p50),
            p50,
            max_text,
            duration_text(micros(plan.hold)),
            duration_text(run.reader_hold.max()),
            if missed > 0 { "> " } else { "" },
        );
        let mut overlap = run.overlap.clone();
        overlap.sort_unstable();
        let writer_p50_vs_alone =
            nearest_rank(&waits, 0.5).map(|p50| micros(p50) as f64 / alone_p50.max(1) as f64);
        lines.push(format!(
            "  {label}: {} readers at {:.1}/s; readers holding when a writer asked: \
             min {}, p50 {}, max {}; reader acquire wait p50 {}, p99 {}, max {}{}",
            run.readers,
            run.arrivals_per_sec,
            overlap.first().copied().unwrap_or(0),
            overlap
                .get((overlap.len().max(1) - 1) / 2)
                .copied()
                .unwrap_or(0),
            overlap.last().copied().unwrap_or(0),
            duration_text(run.reader_wait.value_at_quantile(0.5)),
            duration_text(run.reader_wait.value_at_quantile(0.99)),
            duration_text(run.reader_wait.max()),
            match writer_p50_vs_alone {
                Some(x) => format!("; writer wait p50 x{x:.0} its alone p50"),
                None => String::new(),
            },
        ));
        lines.push(format!(
            "  {label}: max writer wait / longest reader hold (grant → Release answered) {}{:.2}",
            if missed > 0 { "> " } else { "" },
            max_us as f64 / run.reader_hold.max().max(1) as f64,
        ));
        if json {
            let line = serde_json::json!({
                "scenario": format!("writer under readers: {label}"),
                "reader_rate": plan.rate,
                "reader_hold_us": micros(plan.hold),
                "readers": run.readers,
                "writers": run.writers,
                "writers_granted": run.writer_waits.len(),
                "writer_wait_us": waits.iter().map(|w| micros(*w)).collect::<Vec<_>>(),
                "writer_budget_us": micros(run.budget),
                "writer_alone_p50_us": alone_p50,
                "max_wait_over_hold": ratio,
                "goal": GOAL,
                "reader_hold_max_us": run.reader_hold.max(),
                "reader_wait_p50_us": run.reader_wait.value_at_quantile(0.5),
                "reader_wait_p99_us": run.reader_wait.value_at_quantile(0.99),
            });
            lines.push(serde_json::to_string(&line)?);
        }
    }
    for line in lines {
        println!("{line}");
    }
    println!("no reader beside a writer: ok");
    Ok(())
}

/// The nearest-rank `q` quantile of `sorted`.
fn nearest_rank(sorted: &[Duration], q: f64) -> Option<Duration> {
    let rank = ((sorted.len() as f64 * q).ceil() as usize).max(1);
    sorted.get(rank - 1).copied()
}

// ---------------------------------------------------------------------------------------
// Sessions and leases, kept alive in the background for as long as the client lives.

/// A Latchkey session with a KeepAlive stream (aborted on drop; the session then expires).
struct LatchkeySession {
    id: i64,
    keepalive: JoinHandle<()>,
}

impl LatchkeySession {
    async fn open(client: &mut LockClient<Channel>, class: &str) -> anyhow::Result<Self> {
        let opened = client
            .open_session(OpenSessionRequest {
                class: class.into(),
                reuse_session_ids: vec![],
            })
            .await
            .context("open session")?
            .into_inner();
        let id = opened.session_id;
        let every = Duration::from_millis(u64::from(opened.keepalive_interval_ms.max(100)));
        let (renew, renewals) = futures::channel::mpsc::unbounded();
        let mut client = client.clone();
        let keepalive = tokio::spawn(async move {
            let mut replies = match client.keep_alive(renewals).await {
                Ok(replies) => replies.into_inner(),
                Err(status) => {
                    tracing::warn!(session = id, %status, "keepalive stream refused");
                    return;
                }
            };
            loop {
                tokio::time::sleep(every).await;
                let sent = renew.unbounded_send(KeepAliveRequest {
                    session_id: id,
                    ..Default::default()
                });
                if sent.is_err() || !matches!(replies.message().await, Ok(Some(_))) {
                    tracing::warn!(session = id, "session keepalive ended");
                    return;
                }
            }
        });
        Ok(Self { id, keepalive })
    }
}

impl Drop for LatchkeySession {
    fn drop(&mut self) {
        self.keepalive.abort();
    }
}

/// A copy of the dev policies plus a grant of prefix `bench` to each of `names`, so each
/// contended waiter can be its own identity.
fn policies_with_waiters(names: &[String]) -> anyhow::Result<TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("latchkey-bench-policies-")
        .tempdir()?;
    let dev = workspace_root().join("policies/dev");
    for sub in ["classes", "grants"] {
        copy_toml_files(&dev.join(sub), &dir.path().join(sub))?;
    }
    // The demo class with durable waiters (a fixture pause test, as the others).
    let durable = format!(
        "[[class]]\nname = \"{DURABLE_CLASS}\"\ndescription = \"latchkey-bench: demo with durable waiters\"\n\
         tier = \"coord\"\nenforcement = \"fenced\"\nttlSeconds = 15\nfairness = \"durable\"\n\
         [class.pauseTest]\nresource = \"postgresql:dev.latchkey_fenced_rows\"\nresult = \"pause-tests/bench-durable.json\"\n"
    );
    let path = dir.path().join("classes/zz-bench-durable.toml");
    std::fs::write(&path, durable).with_context(|| format!("writing {}", path.display()))?;
    let quota = format!(
        "[[class]]\nname = \"{QUOTA_CLASS}\"\ndescription = \"latchkey-bench: demo with a quota\"\n\
         tier = \"coord\"\nenforcement = \"fenced\"\nttlSeconds = 15\nmaxHoldsPerSubject = 256\n\
         [class.pauseTest]\nresource = \"postgresql:dev.latchkey_fenced_rows\"\nresult = \"pause-tests/bench-quota.json\"\n"
    );
    let path = dir.path().join("classes/zz-bench-quota.toml");
    std::fs::write(&path, quota).with_context(|| format!("writing {}", path.display()))?;
    let semaphore = format!(
        "[[class]]\nname = \"{SEMAPHORE_CLASS}\"\ndescription = \"latchkey-bench: a semaphore\"\n\
         kind = \"semaphore\"\npermits = 256\ntier = \"coord\"\nenforcement = \"fenced\"\nttlSeconds = 15\n\
         [class.pauseTest]\nresource = \"postgresql:dev.latchkey_fenced_rows\"\nresult = \"pause-tests/bench-semaphore.json\"\n"
    );
    let path = dir.path().join("classes/zz-bench-semaphore.toml");
    std::fs::write(&path, semaphore).with_context(|| format!("writing {}", path.display()))?;
    let shared = format!(
        "[[class]]\nname = \"{SHARED_CLASS}\"\ndescription = \"latchkey-bench: demo with room for queued readers\"\n\
         tier = \"coord\"\nenforcement = \"fenced\"\nttlSeconds = 15\nmaxWaitersPerKey = 1024\n\
         [class.pauseTest]\nresource = \"postgresql:dev.latchkey_fenced_rows\"\nresult = \"pause-tests/bench-shared.json\"\n"
    );
    let path = dir.path().join("classes/zz-bench-shared.toml");
    std::fs::write(&path, shared).with_context(|| format!("writing {}", path.display()))?;
    latchkey_tests::write_pause_test_fixtures(dir.path())?;
    let grants: String = names
        .iter()
        .map(|name| {
            format!(
                "[[grant]]\nidentity = \"{}\"\nprefixes = [\"bench\"]\n\n",
                arbiter::spiffe(name)
            )
        })
        .collect();
    let path = dir.path().join("grants/zz-bench-waiters.toml");
    std::fs::write(&path, grants).with_context(|| format!("writing {}", path.display()))?;
    Ok(dir)
}

fn copy_toml_files(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        if let Some(name) = path.file_name()
            && path.is_file()
        {
            std::fs::copy(&path, to.join(name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Reporting.

struct Row {
    scenario: String,
    ops: u64,
    ops_per_sec: f64,
    mean_us: f64,
    p50_us: u64,
    p99_us: u64,
    /// Ratios to each baseline, the first the row's own.
    versus: Vec<Versus>,
}

/// A row's ratios to its baseline: above 1 means more ops/s, or a longer latency.
struct Versus {
    baseline: String,
    ops_per_sec: f64,
    p50: f64,
    p99: f64,
}

#[derive(Default)]
struct Table {
    rows: Vec<Row>,
    checks: Vec<String>,
}

impl Table {
    /// Adds `latency` (recorded during `run`; its count over the run's wall time gives
    /// ops/s), with ratios to a baseline `(label, run, latency)` when given.
    fn row(
        &mut self,
        scenario: String,
        run: &Run,
        latency: &Histogram<u64>,
        baseline: Option<(&str, &Run, &Histogram<u64>)>,
    ) {
        let baselines: Vec<_> = baseline.into_iter().collect();
        self.row_vs(scenario, run, latency, &baselines);
    }

    /// [`Table::row`] with ratios to each of `baselines`.
    fn row_vs(
        &mut self,
        scenario: String,
        run: &Run,
        latency: &Histogram<u64>,
        baselines: &[(&str, &Run, &Histogram<u64>)],
    ) {
        let ops_per_sec =
            |h: &Histogram<u64>, run: &Run| h.len() as f64 / run.elapsed.as_secs_f64().max(1e-9);
        let quantile = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q).max(1) as f64;
        let versus = baselines
            .iter()
            .map(|(label, base_run, base)| Versus {
                baseline: (*label).to_owned(),
                ops_per_sec: ops_per_sec(latency, run) / ops_per_sec(base, base_run).max(1e-9),
                p50: quantile(latency, 0.5) / quantile(base, 0.5),
                p99: quantile(latency, 0.99) / quantile(base, 0.99),
            })
            .collect();
        self.rows.push(Row {
            scenario,
            ops: latency.len(),
            ops_per_sec: ops_per_sec(latency, run),
            mean_us: latency.mean(),
            p50_us: latency.value_at_quantile(0.5),
            p99_us: latency.value_at_quantile(0.99),
            versus,
        });
    }

    fn print(&self, json: bool) -> anyhow::Result<()> {
        let width = self
            .rows
            .iter()
            .map(|r| r.scenario.chars().count())
            .max()
            .unwrap_or(8);
        println!(
            "{:<width$} | {:>6} | {:>7} | {:>9} | {:>9} | {:>9} | ratio to baseline (ops/s, p50, p99)",
            "scenario", "ops", "ops/s", "mean", "p50", "p99"
        );
        println!("{}", "-".repeat(width + 100));
        for r in &self.rows {
            let ratio = match r.versus.as_slice() {
                [] => "(baseline)".to_owned(),
                versus => versus
                    .iter()
                    .map(|v| {
                        format!(
                            "x{:.2}, x{:.2}, x{:.2} vs {}",
                            v.ops_per_sec, v.p50, v.p99, v.baseline
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; "),
            };
            println!(
                "{:<width$} | {:>6} | {:>7.0} | {:>9} | {:>9} | {:>9} | {ratio}",
                r.scenario,
                r.ops,
                r.ops_per_sec,
                duration_text(r.mean_us.round() as u64),
                duration_text(r.p50_us),
                duration_text(r.p99_us),
            );
        }
        println!("mutual exclusion on the hot keys: ok");
        for check in &self.checks {
            println!("{check}");
        }
        if json {
            for r in &self.rows {
                let line = serde_json::json!({
                    "scenario": r.scenario,
                    "ops": r.ops,
                    "ops_per_sec": r.ops_per_sec,
                    "mean_us": r.mean_us,
                    "p50_us": r.p50_us,
                    "p99_us": r.p99_us,
                    "baseline": r.versus.first().map(|v| &v.baseline),
                    "ops_per_sec_ratio": r.versus.first().map(|v| v.ops_per_sec),
                    "p50_ratio": r.versus.first().map(|v| v.p50),
                    "p99_ratio": r.versus.first().map(|v| v.p99),
                    "also_versus": r.versus.iter().skip(1).map(|v| serde_json::json!({
                        "baseline": v.baseline,
                        "ops_per_sec_ratio": v.ops_per_sec,
                        "p50_ratio": v.p50,
                        "p99_ratio": v.p99,
                    })).collect::<Vec<_>>(),
                });
                println!("{}", serde_json::to_string(&line)?);
            }
        }
        Ok(())
    }
}
