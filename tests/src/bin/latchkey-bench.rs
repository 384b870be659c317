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
//! 6. With `--durable`, the large hot-key scenario again with a durable class (ADR-14:
//!    waiters queued in etcd, `bench/hot-durable`): what the durable queue costs.
//!
//! Correctness is checked while measuring, and a failure exits non-zero: in the
//! uncontended run each worker's tokens must increase; in the contended runs no two
//! waiters may hold the key at once, and Latchkey's fencing tokens must strictly increase
//! in grant order (printed as `token order: ok (N grants)`).

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
    AcquireRequest, Grant, KeepAliveRequest, OpenSessionRequest, ReleaseRequest, WaitMode,
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
const LEASE_TTL_SECS: i64 = 15;
/// How long a contended waiter may queue before the run is declared stuck.
const WAIT_TIMEOUT: Duration = Duration::from_secs(30);
/// The identities with the `demo` prefix in the dev policies.
const DEMO_WAITERS: &[&str] = &["workload/alice", "workload/bob", "workload/demo"];

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
    let arbiter = Arbiter::start(
        &etcd,
        ArbiterOptions {
            policies_dir: policies.path().to_path_buf(),
            coord: coord.as_ref().map(latchkey_tests::arbiter::Coord::on),
            ..Default::default()
        },
    )
    .await?;
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
    for &c in &plan.counts {
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

    println!();
    table.print(args.json)?;
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
        })
    }

    async fn acquire_grant(&mut self, wait: WaitMode) -> anyhow::Result<Grant> {
        let mut request = tonic::Request::new(AcquireRequest {
            key: self.key.clone(),
            class: self.class.into(),
            session_id: self.session.id,
            wait: wait.into(),
            metadata: Default::default(),
            instance: String::new(),
            mode: 0,
        });
        if wait == WaitMode::WaitUntilDeadline {
            request.set_timeout(WAIT_TIMEOUT);
        }
        let response = self
            .client
            .acquire(request)
            .await
            .with_context(|| format!("acquire {}", self.key))?;
        response
            .into_inner()
            .grant
            .with_context(|| format!("acquire {}: OK without a grant", self.key))
    }

    async fn release_grant(&mut self, grant: &Grant) -> anyhow::Result<()> {
        self.client
            .release(ReleaseRequest {
                key: grant.key.clone(),
                session_id: grant.session_id,
                token: grant.token,
                slot: grant.slot,
                mode: 0,
            })
            .await
            .with_context(|| format!("release {}", grant.key))?;
        Ok(())
    }
}

impl Cycle for Latchkey {
    async fn cycle(&mut self) -> anyhow::Result<()> {
        let grant = self.acquire_grant(WaitMode::WaitNone).await?;
        // Alone on the key: every grant must carry a larger token than the last.
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
    versus: Option<Versus>,
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
        let ops_per_sec =
            |h: &Histogram<u64>, run: &Run| h.len() as f64 / run.elapsed.as_secs_f64().max(1e-9);
        let quantile = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q).max(1) as f64;
        let versus = baseline.map(|(label, base_run, base)| Versus {
            baseline: label.to_owned(),
            ops_per_sec: ops_per_sec(latency, run) / ops_per_sec(base, base_run).max(1e-9),
            p50: quantile(latency, 0.5) / quantile(base, 0.5),
            p99: quantile(latency, 0.99) / quantile(base, 0.99),
        });
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
            let ratio = match &r.versus {
                Some(v) => format!(
                    "x{:.2}, x{:.2}, x{:.2} vs {}",
                    v.ops_per_sec, v.p50, v.p99, v.baseline
                ),
                None => "(baseline)".to_owned(),
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
                    "baseline": r.versus.as_ref().map(|v| &v.baseline),
                    "ops_per_sec_ratio": r.versus.as_ref().map(|v| v.ops_per_sec),
                    "p50_ratio": r.versus.as_ref().map(|v| v.p50),
                    "p99_ratio": r.versus.as_ref().map(|v| v.p99),
                });
                println!("{}", serde_json::to_string(&line)?);
            }
        }
        Ok(())
    }
}
