//! `fence-bench`: what the fence costs on each store (issue 35). For
//! PostgreSQL, MariaDB, Redis and etcd, each a private server on this
//! machine (the test harnesses), the adapter's guarded write against its
//! plain write (`FencedStore::plain_write`, what a naive writer does) on the
//! same records, in the same run, printed as latency and throughput ratios.
//!
//! Each store runs `--rounds` rounds; a round is `--ops` plain writes and
//! then `--ops` guarded writes by each of `--workers` concurrent writers
//! (plain first in odd rounds, guarded first in even ones), so drift in the
//! machine's load falls on both. Every writer owns its records
//! (`bench/w<i>/r<j>`) and raises its token on every write, so each guarded
//! write is the accepted case (a fenced-out one is counted and fails the run).
//!
//! The servers are the test harnesses': durability is off (PostgreSQL
//! fsync=off, MariaDB without a binary log or per-commit log flush, Redis
//! without persistence, etcd on the temp dir's disk). The absolute numbers
//! are this machine's and that configuration's; the ratio is the fence's.
//!
//! `cargo build --release -p latchkey-tests --bins && target/release/fence-bench`

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_fence::FencedStore;
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::mariadb::MariaDbServer;
use latchkey_tests::postgres::PostgresServer;
use latchkey_tests::redis::RedisServer;

#[derive(Parser, Debug)]
#[command(about = "Guarded vs plain writes on PostgreSQL, MariaDB, Redis and etcd, as ratios")]
struct Args {
    /// Stores to run: postgresql, mysql, redis, etcd.
    #[arg(long, value_delimiter = ',', default_values_t = ["postgresql".to_owned(), "mysql".to_owned(), "redis".to_owned(), "etcd".to_owned()])]
    stores: Vec<String>,
    /// Concurrent writers, each with its own records.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Writes per writer per round and kind.
    #[arg(long, default_value_t = 1000)]
    ops: usize,
    /// Rounds (each: plain and guarded, alternating which goes first).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Records per writer.
    #[arg(long, default_value_t = 16)]
    records: usize,
    /// Payload bytes.
    #[arg(long, default_value_t = 256)]
    payload: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Plain,
    Guarded,
}

/// One kind's measurements over all rounds.
struct Side {
    latency: Histogram<u64>,
    writes: u64,
    secs: f64,
}

impl Side {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            latency: Histogram::new_with_bounds(1, 60_000_000, 3)?,
            writes: 0,
            secs: 0.0,
        })
    }

    fn per_sec(&self) -> f64 {
        self.writes as f64 / self.secs.max(1e-9)
    }
}

struct Measured {
    store: &'static str,
    plain: Side,
    guarded: Side,
}

/// A server this run started (a harness handle: dropping it stops the
/// server); all are kept until the end, so none starts or stops while
/// another store is measured.
type Server = Box<dyn std::any::Any>;

async fn open(name: &str) -> anyhow::Result<(Server, Arc<dyn FencedStore>)> {
    Ok(match name {
        "postgresql" => {
            let server = PostgresServer::start().await?;
            let store = latchkey_fence_postgres::PostgresStore::connect(&server.url()).await?;
            (
                Box::new(server) as Server,
                Arc::new(store) as Arc<dyn FencedStore>,
            )
        }
        "mysql" => {
            let server = MariaDbServer::start().await?;
            let store = latchkey_fence_mysql::MysqlStore::connect(&server.url()).await?;
            (
                Box::new(server) as Server,
                Arc::new(store) as Arc<dyn FencedStore>,
            )
        }
        "redis" => {
            let server = RedisServer::start().await?;
            let store = latchkey_fence_redis::RedisStore::connect(&server.url()).await?;
            (
                Box::new(server) as Server,
                Arc::new(store) as Arc<dyn FencedStore>,
            )
        }
        "etcd" => {
            let server = EtcdServer::start().await?;
            let url = format!("etcd://127.0.0.1:{}/bench", server.client_port());
            let store = latchkey_fence_etcd::EtcdStore::connect(&url).await?;
            (
                Box::new(server) as Server,
                Arc::new(store) as Arc<dyn FencedStore>,
            )
        }
        other => bail!("unknown store {other:?} (postgresql, mysql, redis, etcd)"),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(
        args.workers >= 1 && args.ops >= 1 && args.rounds >= 1 && args.records >= 1,
        "--workers, --ops, --rounds and --records must be at least 1"
    );
    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "fence-bench: nproc {nproc}; {} writer(s), {} plain + {} guarded writes each per round, {} rounds, \
         {} records per writer, {}-byte payloads; test servers (durability off)",
        args.workers, args.ops, args.ops, args.rounds, args.records, args.payload
    );
    let mut results = Vec::new();
    let mut servers = Vec::new();
    for name in &args.stores {
        eprintln!("running: {name}");
        let (server, store) = open(name)
            .await
            .with_context(|| format!("starting {name}"))?;
        results.push(measure(&args, store).await?);
        servers.push(server);
    }
    print(&results);
    drop(servers);
    Ok(())
}

async fn measure(args: &Args, store: Arc<dyn FencedStore>) -> anyhow::Result<Measured> {
    let mut plain = Side::new()?;
    let mut guarded = Side::new()?;
    // Tokens only grow: every round's guarded writes start above the last.
    let mut next_token: u64 = 1 << 48;
    // Warm-up: connections, prepared statements, the script cache.
    run_round(
        args,
        &store,
        Kind::Guarded,
        next_token,
        1,
        &mut Side::new()?,
    )
    .await?;
    next_token += 1;
    run_round(args, &store, Kind::Plain, 0, 1, &mut Side::new()?).await?;
    for round in 0..args.rounds {
        let order = if round % 2 == 0 {
            [Kind::Plain, Kind::Guarded]
        } else {
            [Kind::Guarded, Kind::Plain]
        };
        for kind in order {
            match kind {
                Kind::Plain => run_round(args, &store, kind, 0, args.ops, &mut plain).await?,
                Kind::Guarded => {
                    run_round(args, &store, kind, next_token, args.ops, &mut guarded).await?;
                    next_token += args.ops as u64;
                }
            }
        }
    }
    Ok(Measured {
        store: store.kind(),
        plain,
        guarded,
    })
}

/// `ops` writes of `kind` by each writer; guarded writes use tokens from
/// `first_token` up, one per write.
async fn run_round(
    args: &Args,
    store: &Arc<dyn FencedStore>,
    kind: Kind,
    first_token: u64,
    ops: usize,
    side: &mut Side,
) -> anyhow::Result<()> {
    let payload: Arc<Vec<u8>> =
        Arc::new((0..args.payload).map(|i| b'a' + (i % 26) as u8).collect());
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(args.workers);
    for worker in 0..args.workers {
        let store = store.clone();
        let payload = payload.clone();
        let records = args.records;
        tasks.push(tokio::spawn(async move {
            let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            for i in 0..ops {
                let record = format!("bench/w{worker}/r{}", i % records);
                let t = Instant::now();
                match kind {
                    Kind::Plain => store.plain_write(&record, &payload).await?,
                    Kind::Guarded => {
                        let answer = store
                            .guarded_write(&record, first_token + i as u64, &payload)
                            .await?;
                        ensure!(answer.is_applied(), "a guarded write was {answer}");
                    }
                }
                latency.record(
                    u64::try_from(t.elapsed().as_micros())
                        .unwrap_or(u64::MAX)
                        .max(1),
                )?;
            }
            anyhow::Ok(latency)
        }));
    }
    for task in tasks {
        side.latency.add(task.await??)?;
    }
    side.secs += started.elapsed().as_secs_f64();
    side.writes += (ops * args.workers) as u64;
    Ok(())
}

fn print(results: &[Measured]) {
    println!();
    println!(
        "{:<11} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "store",
        "plain/s",
        "guard/s",
        "plain p50",
        "guard p50",
        "plain p99",
        "guard p99",
        "thr ratio",
        "p50 ratio"
    );
    for m in results {
        let (p, g) = (&m.plain, &m.guarded);
        println!(
            "{:<11} {:>10.0} {:>10.0} {:>8}µs {:>8}µs {:>8}µs {:>8}µs {:>9.2} {:>9.2}",
            m.store,
            p.per_sec(),
            g.per_sec(),
            p.latency.value_at_quantile(0.5),
            g.latency.value_at_quantile(0.5),
            p.latency.value_at_quantile(0.99),
            g.latency.value_at_quantile(0.99),
            g.per_sec() / p.per_sec().max(1e-9),
            g.latency.value_at_quantile(0.5) as f64
                / p.latency.value_at_quantile(0.5).max(1) as f64,
        );
    }
    println!();
    println!(
        "thr ratio: guarded writes/s over plain writes/s (1.00 = the fence is free); \
         p50 ratio: guarded median latency over plain"
    );
}
