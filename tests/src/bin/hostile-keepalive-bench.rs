//! `hostile-keepalive-bench`: what one identity's KeepAlive flood costs other
//! tenants (issue 31, finding 3), next to the same run without the flood.
//!
//! Every phase runs the same victims for `--secs`: `workload/bob` Acquires +
//! Releases `demo/bench-k` in a loop (latency per pair), and `workload/alice`
//! keeps `--victim-sessions` sessions alive (class `short`, TTL 5 s) in
//! messages of up to 1,024 ids every second, counting sessions answered gone.
//!
//! 1. **baseline** — nobody floods.
//! 2. **unknown ids** — `workload/mallory` sends messages of 1,024 random
//!    unknown session ids as fast as `--streams` KeepAlive streams take them.
//! 3. **own session** — mallory renews her own session in one-id messages,
//!    as fast as the streams take them.
//!
//! Printed per phase: acquire+release p50/p99/max and pairs/s, alice's
//! slowest renewal round and sessions lost, etcd Range calls (each ownership
//! lookup is one), mallory's answers and refused streams (a stream naming
//! more unknown ids than an identity may have is refused; she opens another),
//! and the CPU of etcd and the arbiter;
//! then each flood's latency as a ratio to the baseline. Nothing here is
//! asserted on time.
//!
//! `cargo build -p latchkey-tests --bin hostile-keepalive-bench --bin arbiter-under-test`,
//! then `target/debug/hostile-keepalive-bench`.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use futures::{StreamExt as _, TryStreamExt as _};
use hdrhistogram::Histogram;
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{
    AcquireRequest, KeepAliveRequest, OpenSessionRequest, ReleaseRequest, WaitMode,
};
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, channel};
use latchkey_tests::envoy::admin_get;
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::procstat::usage;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

#[derive(Parser, Debug)]
#[command(about = "Other tenants' latency and sessions while one identity floods KeepAlive")]
struct Args {
    /// Seconds per phase.
    #[arg(long, default_value_t = 20)]
    secs: u64,
    /// Sessions alice keeps alive (at most the identity bound, 1000).
    #[arg(long, default_value_t = 500)]
    victim_sessions: usize,
    /// Mallory's KeepAlive streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flood {
    None,
    UnknownIds,
    OwnSession,
}

struct Phase {
    name: &'static str,
    pairs: Histogram<u64>,
    secs: f64,
    slowest_round: Duration,
    lost: u64,
    ranges: u64,
    mallory_answers: u64,
    /// Mallory's streams refused (for naming too many unknown ids).
    mallory_refused: u64,
    etcd_cpu: f64,
    arbiter_cpu: f64,
}

impl Phase {
    fn q(&self, q: f64) -> f64 {
        self.pairs.value_at_quantile(q) as f64 / 1000.0
    }

    fn print(&self) {
        println!(
            "{:<12} acquire+release p50 {:>7.2} ms  p99 {:>8.2} ms  max {:>8.2} ms  {:>6.0} pairs/s | alice: slowest round {:>5.0?}, {} lost | etcd Range calls {:>7} | mallory answered {:>8}, {} streams refused | CPU s: etcd {:.1}, arbiter {:.1}",
            self.name,
            self.q(0.5),
            self.q(0.99),
            self.pairs.max() as f64 / 1000.0,
            self.pairs.len() as f64 / self.secs,
            self.slowest_round,
            self.lost,
            self.ranges,
            self.mallory_answers,
            self.mallory_refused,
            self.etcd_cpu,
            self.arbiter_cpu,
        );
    }
}

type Client = LockClient<Channel>;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let exe = std::env::current_exe()?;
    let binary = exe.parent().context("exe dir")?.join("arbiter-under-test");
    let arbiter = ArbiterProcess::start(&binary, &etcd, ArbiterOptions::default(), "warn").await?;
    let addr = arbiter.addr();
    let pids = (
        etcd.pid().context("etcd pid")?,
        arbiter.pid().context("arbiter pid")?,
    );
    let etcd_metrics: SocketAddr = format!("127.0.0.1:{}", etcd.client_port()).parse()?;
    println!(
        "hostile-keepalive-bench: {} s per phase, alice keeps {} sessions (TTL 5 s), mallory floods on {} streams, 2 cores, debug build",
        args.secs, args.victim_sessions, args.streams
    );

    let alice = Client::new(channel(addr, "workload/alice").await?);
    // opened 16 at a time: the first must not expire (TTL 5 s) before the
    // last is open
    let sessions: Vec<i64> = futures::stream::iter(0..args.victim_sessions)
        .map(|_| {
            let mut alice = alice.clone();
            async move { open(&mut alice, "short").await }
        })
        .buffer_unordered(16)
        .try_collect()
        .await?;
    let mut bob = Client::new(channel(addr, "workload/bob").await?);
    let bob_session = open(&mut bob, "demo").await?;
    let mut mallory = Client::new(channel(addr, "workload/mallory").await?);

    let mut phases = Vec::new();
    for (name, flood) in [
        ("baseline", Flood::None),
        ("unknown ids", Flood::UnknownIds),
        ("own session", Flood::OwnSession),
    ] {
        // her own session, fresh (TTL 5 s: not renewed in the phases before)
        let mallory_session = open(&mut mallory, "short").await?;
        let ranges_before = etcd_ranges(etcd_metrics).await?;
        let cpu_before = (usage(pids.0), usage(pids.1));
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flood = CancellationToken::new();
        let answered = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        // Mallory floods from a thread and runtime of her own (one core at
        // most, as a client elsewhere would): the victims' calls share no
        // task queue with her writers.
        let attacker = match flood {
            Flood::None => None,
            _ => {
                let (streams, stop, answered, refused) = (
                    args.streams,
                    stop_flood.clone(),
                    answered.clone(),
                    refused.clone(),
                );
                Some(std::thread::spawn(move || -> anyhow::Result<()> {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?
                        .block_on(async move {
                            let mallory = Client::new(channel(addr, "workload/mallory").await?);
                            let floods: Vec<_> = (0..streams)
                                .map(|_| {
                                    tokio::spawn(flood_stream(
                                        mallory.clone(),
                                        flood,
                                        mallory_session,
                                        stop.clone(),
                                        answered.clone(),
                                        refused.clone(),
                                    ))
                                })
                                .collect();
                            for f in floods {
                                let _ = f.await;
                            }
                            anyhow::Ok(())
                        })
                }))
            }
        };
        let started = Instant::now();
        let keeper = tokio::spawn(keep_alive(alice.clone(), sessions.clone(), stop.clone()));
        let bobs = tokio::spawn(keep_alive(bob.clone(), vec![bob_session], stop.clone()));
        let mut pairs = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
        while started.elapsed() < Duration::from_secs(args.secs) {
            let t = Instant::now();
            acquire_release(&mut bob, bob_session).await?;
            pairs.record(u64::try_from(t.elapsed().as_micros())?.max(1))?;
        }
        let secs = started.elapsed().as_secs_f64();
        stop.store(true, Ordering::SeqCst);
        stop_flood.cancel();
        if let Some(attacker) = attacker {
            attacker
                .join()
                .map_err(|_| anyhow::anyhow!("the attacker thread panicked"))??;
        }
        let (slowest_round, lost) = keeper.await??;
        let (_, bob_lost) = bobs.await??;
        anyhow::ensure!(bob_lost == 0, "bob's session was lost");
        let cpu_after = (usage(pids.0), usage(pids.1));
        let phase = Phase {
            name,
            pairs,
            secs,
            slowest_round,
            lost,
            ranges: etcd_ranges(etcd_metrics).await? - ranges_before,
            mallory_answers: answered.load(Ordering::SeqCst),
            mallory_refused: refused.load(Ordering::SeqCst),
            etcd_cpu: cpu_after.0.cpu_secs_since(&cpu_before.0),
            arbiter_cpu: cpu_after.1.cpu_secs_since(&cpu_before.1),
        };
        phase.print();
        phases.push(phase);
        if lost > 0 {
            // alice's sessions are gone: the next phase would measure nothing
            break;
        }
    }
    if let Some(base) = phases.first() {
        for p in &phases[1..] {
            println!(
                "ratio {}/baseline: acquire+release p50 {:.2}x, p99 {:.2}x",
                p.name,
                p.q(0.5) / base.q(0.5).max(f64::MIN_POSITIVE),
                p.q(0.99) / base.q(0.99).max(f64::MIN_POSITIVE),
            );
        }
    }
    Ok(())
}

async fn open(c: &mut Client, class: &str) -> anyhow::Result<i64> {
    Ok(c.open_session(OpenSessionRequest {
        class: class.into(),
        reuse_session_ids: vec![],
    })
    .await?
    .into_inner()
    .session_id)
}

async fn acquire_release(bob: &mut Client, session: i64) -> anyhow::Result<()> {
    let grant = bob
        .acquire(AcquireRequest {
            key: "demo/bench-k".into(),
            class: "demo".into(),
            session_id: session,
            wait: WaitMode::WaitNone.into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .grant
        .context("no grant")?;
    bob.release(ReleaseRequest {
        key: grant.key,
        session_id: grant.session_id,
        token: grant.token,
        slot: None,
        mode: 0,
    })
    .await?;
    Ok(())
}

/// Renews every session once a second (in messages of up to 1,024) on a
/// stream of their own until `stop`: (the slowest round, sessions answered
/// gone).
async fn keep_alive(
    mut alice: Client,
    sessions: Vec<i64>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<(Duration, u64)> {
    let (tx, rx) = mpsc::channel(16);
    let mut replies = alice
        .keep_alive(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let (mut slowest, mut lost) = (Duration::ZERO, 0);
    while !stop.load(Ordering::SeqCst) {
        let sent = Instant::now();
        for chunk in sessions.chunks(1024) {
            tx.send(KeepAliveRequest {
                session_id: 0,
                session_ids: chunk.to_vec(),
            })
            .await?;
        }
        let mut left: HashSet<i64> = sessions.iter().copied().collect();
        while !left.is_empty() {
            let reply = replies.message().await?.context("the stream ended")?;
            if !reply.ended_holds.is_empty() {
                // a notice: one of the session's holds ended
                continue;
            }
            if left.remove(&reply.session_id) && reply.remaining_ttl_seconds <= 0 {
                lost += 1;
            }
        }
        slowest = slowest.max(sent.elapsed());
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(sent.elapsed())).await;
    }
    Ok((slowest, lost))
}

/// One of mallory's floods: a stream taking messages as fast as it will,
/// and a new one whenever the arbiter refuses it (a stream naming more
/// unknown ids than an identity may have is refused), until `stop`.
async fn flood_stream(
    mallory: Client,
    flood: Flood,
    own: i64,
    stop: CancellationToken,
    answered: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    while !stop.is_cancelled() {
        match one_stream(mallory.clone(), flood, own, stop.clone(), &answered).await {
            Ok(()) => return Ok(()),
            Err(status) if status.code() == tonic::Code::InvalidArgument => {
                refused.fetch_add(1, Ordering::Relaxed);
            }
            Err(status) => {
                eprintln!("mallory's stream ended: {status}");
                return Err(status.into());
            }
        }
    }
    Ok(())
}

async fn one_stream(
    mut mallory: Client,
    flood: Flood,
    own: i64,
    stop: CancellationToken,
    answered: &AtomicU64,
) -> Result<(), tonic::Status> {
    let (tx, rx) = mpsc::channel(1);
    let writer_stop = stop.clone();
    tokio::spawn(async move {
        loop {
            let message = match flood {
                Flood::UnknownIds => KeepAliveRequest {
                    session_id: 0,
                    session_ids: (0..1024).map(|_| fastrand::i64(1..1 << 53)).collect(),
                },
                _ => KeepAliveRequest {
                    session_id: own,
                    session_ids: Vec::new(),
                },
            };
            // a writer held back by flow control still stops: the request
            // ends, so the arbiter's side of the stream ends too
            tokio::select! {
                sent = tx.send(message) => if sent.is_err() { return },
                () = writer_stop.cancelled() => return,
            }
        }
    });
    let mut replies = mallory
        .keep_alive(ReceiverStream::new(rx))
        .await?
        .into_inner();
    loop {
        tokio::select! {
            reply = replies.message() => match reply? {
                Some(_) => answered.fetch_add(1, Ordering::Relaxed),
                None => return Err(tonic::Status::unknown("mallory's stream ended")),
            },
            () = stop.cancelled() => return Ok(()),
        };
    }
}

/// Range calls etcd has served, every code.
async fn etcd_ranges(addr: SocketAddr) -> anyhow::Result<u64> {
    let text = admin_get(addr, "/metrics").await?;
    let sum: f64 = text
        .lines()
        .filter(|l| l.starts_with("grpc_server_handled_total{") && l.contains("\"Range\""))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    Ok(sum as u64)
}
