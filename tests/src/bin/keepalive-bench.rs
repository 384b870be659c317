//! `keepalive-bench`: what keeping N sessions alive costs through Latchkey, next to
//! etcd's own client keeping N leases alive on the same etcd in the same run (issue 18).
//!
//! 1. **baseline** — etcd-client grants N leases (the class's TTL) and renews each every
//!    TTL/3 over one LeaseKeepAlive stream, pipelined, as etcd's own client does.
//! 2. **Latchkey** — N sessions across ⌈N/1000⌉ identities (so the default
//!    `--max-sessions-per-identity` of 1000 holds), one KeepAlive stream per identity
//!    (like the grpcio client), each session renewed every TTL/3 while
//!    `--acquirers` workers of `workload/bench` Acquire + Release `bench/k<i>`.
//!
//! Printed per phase: renewals/s, round latency (send to answer), leases lost (answered
//! TTL 0, plus leases missing in etcd at the end), CPU and RSS of etcd, the arbiter (its
//! own process) and this client; then the CPU per renewal as a ratio to the baseline.
//! Nothing here is asserted on time.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use anyhow::{Context, anyhow};
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_proto::lockv1::{
    AcquireRequest, KeepAliveRequest, OpenSessionRequest, ReleaseRequest, WaitMode,
};
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, channel};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::procstat::{Usage, ticks_to_secs, usage};
use tokio::sync::{Semaphore, mpsc};

#[derive(Parser, Debug)]
#[command(about = "Latchkey keepalive at N sessions vs etcd's own client at N leases")]
struct Args {
    /// Sessions (and baseline leases).
    #[arg(long, default_value_t = 2000)]
    sessions: usize,
    /// Lock class of every session (TTL 60 s in the dev policies).
    #[arg(long, default_value = "batch-report")]
    class: String,
    /// Seconds each phase renews (after opening).
    #[arg(long, default_value_t = 90)]
    secs: u64,
    /// Acquire + Release workers during the Latchkey phase (0: a
    /// renewals-only phase, like for like with the baseline).
    #[arg(long, default_value_t = 4)]
    acquirers: usize,
    /// Sessions renewed by one KeepAlive message (1..=1024).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    per_message: u16,
    /// Holds taken (by `workload/bench`, 1,000 per session, each session
    /// renewed like the others) before the measured phase and kept through
    /// it: issue 12's "40,000 sessions and 250,000 holds" is
    /// `--sessions 40000 --holds 250000`.
    #[arg(long, default_value_t = 0)]
    holds: usize,
}

/// Holds per session in `--holds` (well under any per-session limit).
const HOLDS_PER_SESSION: usize = 1000;

const PER_IDENTITY: usize = 1000;

/// Renewal statistics of one phase.
struct Rounds {
    latency: Mutex<Histogram<u64>>,
    renewals: AtomicU64,
    lost: AtomicU64,
}

impl Rounds {
    fn new() -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            latency: Mutex::new(Histogram::new_with_bounds(1, 600_000_000, 3)?),
            renewals: AtomicU64::new(0),
            lost: AtomicU64::new(0),
        }))
    }
    /// Counts from now on only (what came before was the opening).
    fn start_counting(&self) {
        self.latency.lock().reset();
        self.renewals.store(0, Ordering::Relaxed);
    }
    fn answered(&self, sent: Instant, ttl: i64) {
        self.renewals.fetch_add(1, Ordering::Relaxed);
        if ttl <= 0 {
            self.lost.fetch_add(1, Ordering::Relaxed);
        }
        let _ = self
            .latency
            .lock()
            .record(u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX));
    }
}

struct Measured {
    name: &'static str,
    secs: f64,
    renewals: u64,
    lost: u64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    cpu: Vec<(&'static str, f64, u64)>,
    grants: u64,
}

impl Measured {
    fn print(&self) {
        println!(
            "{:<9} renewals/s {:>8.0}  round p50 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms  leases lost {}  grants/s {:.0}",
            self.name,
            self.renewals as f64 / self.secs,
            self.p50_ms,
            self.p99_ms,
            self.max_ms,
            self.lost,
            self.grants as f64 / self.secs
        );
        for (who, cpu_s, rss) in &self.cpu {
            println!(
                "          {who:<8} CPU {:>6.1} %  ({:.3} ms per renewal)  RSS {:>6} MiB",
                cpu_s / self.secs * 100.0,
                cpu_s * 1000.0 / (self.renewals.max(1) as f64),
                rss / 1024
            );
        }
    }
    fn cpu_total(&self) -> f64 {
        self.cpu.iter().map(|(_, c, _)| c).sum()
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    latchkey_tests::init_tracing();
    let names: Vec<String> = (0..args.sessions.div_ceil(PER_IDENTITY))
        .map(|i| format!("workload/bench-{i}"))
        .collect();
    // Declared before the arbiters that poll it.
    let policies = latchkey_tests::dev_policies_granting(&names, "bench")?;
    let certs = latchkey_tests::arbiter::certs()?;
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    latchctl::dev_certs::generate(
        certs.dir.as_path(),
        latchkey_tests::arbiter::TRUST_DOMAIN,
        &refs,
    )
    .context("issuing SVIDs for the bench identities")?;
    let etcd = EtcdServer::start().await?;
    let etcd_pid = etcd.pid().context("etcd pid")?;
    let exe = std::env::current_exe()?;
    let binary = exe.parent().context("exe dir")?.join("arbiter-under-test");
    let options = ArbiterOptions {
        // `workload/bench` takes every hold of --holds, plus the acquirers'.
        max_holds_per_identity: Some(u32::try_from(args.holds + 10_000)?),
        policies_dir: policies.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let arbiter = ArbiterProcess::start(&binary, &etcd, options, "warn").await?;
    let arbiter_pid = arbiter.pid().context("arbiter pid")?;
    let me = std::process::id();
    let ttl = 60i64;
    println!(
        "keepalive-bench: {} sessions, TTL {ttl} s, renewals every {} s, {} s per phase, 2 cores",
        args.sessions,
        ttl / 3,
        args.secs
    );

    // 1. baseline: etcd's own client
    let base = baseline(
        &etcd,
        args.sessions,
        ttl,
        args.secs,
        &[("etcd", etcd_pid), ("client", me)],
    )
    .await?;
    base.print();

    // 2. Latchkey
    let lk = latchkey(
        &args,
        &arbiter,
        &etcd,
        &[("etcd", etcd_pid), ("arbiter", arbiter_pid), ("client", me)],
    )
    .await?;
    lk.print();
    let per = |m: &Measured, who: &str| {
        m.cpu
            .iter()
            .find(|(w, _, _)| *w == who)
            .map_or(0.0, |(_, c, _)| *c / m.renewals.max(1) as f64)
    };
    println!(
        "ratio Latchkey/baseline: etcd CPU per renewal {:.2}x; all processes' CPU per renewal {:.2}x (Latchkey's includes {} acquirers' grants; {} sessions per KeepAlive message)",
        per(&lk, "etcd") / per(&base, "etcd").max(f64::MIN_POSITIVE),
        (lk.cpu_total() / lk.renewals.max(1) as f64)
            / (base.cpu_total() / base.renewals.max(1) as f64).max(f64::MIN_POSITIVE),
        args.acquirers,
        args.per_message
    );
    let after = usage(arbiter_pid);
    println!(
        "arbiter RSS after every session closed: {} MiB",
        after.rss_kib / 1024
    );
    Ok(())
}

async fn baseline(
    etcd: &EtcdServer,
    n: usize,
    ttl: i64,
    secs: u64,
    pids: &[(&'static str, u32)],
) -> anyhow::Result<Measured> {
    let client = etcd.client().await?;
    let mut ids = Vec::with_capacity(n);
    let sem = Arc::new(Semaphore::new(64));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let permit = sem.clone().acquire_owned().await?;
        let mut c = client.lease_client();
        tasks.spawn(async move {
            let _p = permit;
            c.grant(ttl, None).await.map(|r| r.id())
        });
    }
    while let Some(r) = tasks.join_next().await {
        ids.push(r??);
    }
    let rounds = Rounds::new()?;
    let (mut keeper, mut stream) = client.lease_client().keep_alive(ids[0]).await?;
    let sent: Arc<Mutex<HashMap<i64, Instant>>> = Arc::default();
    let reader = {
        let (rounds, sent) = (rounds.clone(), sent.clone());
        tokio::spawn(async move {
            while let Ok(Some(r)) = stream.message().await {
                let at = sent.lock().remove(&r.id());
                if let Some(at) = at {
                    rounds.answered(at, r.ttl());
                }
            }
        })
    };
    let start: Vec<Usage> = pids.iter().map(|(_, p)| usage(*p)).collect();
    let began = Instant::now();
    let period = Duration::from_secs(u64::try_from(ttl / 3)?);
    let gap = period / u32::try_from(n.max(1))?;
    let mut next = tokio::time::Instant::now();
    'outer: loop {
        for id in &ids {
            if began.elapsed() >= Duration::from_secs(secs) {
                break 'outer;
            }
            next += gap;
            tokio::time::sleep_until(next).await;
            sent.lock().insert(*id, Instant::now());
            keeper.id = *id;
            keeper.keep_alive().await?;
        }
    }
    let took = began.elapsed().as_secs_f64();
    let cpu = cpu_since(pids, &start);
    reader.abort();
    let alive = count_leases(etcd).await?;
    let m = finish("baseline", took, &rounds, cpu, 0, n.saturating_sub(alive))?;
    for id in ids {
        let _ = client.lease_client().revoke(id).await;
    }
    Ok(m)
}

fn cpu_since(pids: &[(&'static str, u32)], start: &[Usage]) -> Vec<(&'static str, f64, u64)> {
    pids.iter()
        .zip(start)
        .map(|((who, pid), s)| {
            let now = usage(*pid);
            (
                *who,
                ticks_to_secs(now.cpu_ticks.saturating_sub(s.cpu_ticks)),
                now.rss_kib,
            )
        })
        .collect()
}

fn finish(
    name: &'static str,
    secs: f64,
    rounds: &Rounds,
    cpu: Vec<(&'static str, f64, u64)>,
    grants: u64,
    missing: usize,
) -> anyhow::Result<Measured> {
    let h = rounds.latency.lock();
    Ok(Measured {
        name,
        secs,
        renewals: rounds.renewals.load(Ordering::Relaxed),
        lost: rounds.lost.load(Ordering::Relaxed) + missing as u64,
        p50_ms: h.value_at_quantile(0.5) as f64 / 1000.0,
        p99_ms: h.value_at_quantile(0.99) as f64 / 1000.0,
        max_ms: h.max() as f64 / 1000.0,
        cpu,
        grants,
    })
}

async fn count_leases(etcd: &EtcdServer) -> anyhow::Result<usize> {
    Ok(etcd
        .client()
        .await?
        .lease_client()
        .leases()
        .await?
        .leases()
        .len())
}

async fn latchkey(
    args: &Args,
    arbiter: &ArbiterProcess,
    etcd: &EtcdServer,
    pids: &[(&'static str, u32)],
) -> anyhow::Result<Measured> {
    let n = args.sessions;
    let identities = n.div_ceil(PER_IDENTITY);
    let rounds = Rounds::new()?;
    let opening = Instant::now();
    let period = Duration::from_secs(20);
    let per_message = usize::from(args.per_message);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Open every identity's sessions, one identity after another; each
    // identity starts renewing its sessions as soon as they are open (as a
    // real client does), so a slow opening never delays a first renewal.
    let mut renewers = tokio::task::JoinSet::new();
    let mut all_ids = Vec::new();
    for i in 0..identities {
        let ch = channel(arbiter.addr(), &format!("workload/bench-{i}")).await?;
        let client = latchkey_proto::lockv1::lock_client::LockClient::new(ch);
        let count = PER_IDENTITY.min(n - i * PER_IDENTITY);
        let sem = Arc::new(Semaphore::new(32));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..count {
            let permit = sem.clone().acquire_owned().await?;
            let mut c = client.clone();
            let class = args.class.clone();
            tasks.spawn(async move {
                let _p = permit;
                c.open_session(OpenSessionRequest {
                    class,
                    reuse_session_ids: vec![],
                })
                .await
                .map(|r| r.into_inner().session_id)
            });
        }
        let mut ids = Vec::new();
        while let Some(r) = tasks.join_next().await {
            ids.push(r??);
        }
        all_ids.extend(ids.iter().copied());
        renewers.spawn(renew_identity(
            client,
            ids,
            rounds.clone(),
            period,
            per_message,
            stop_rx.clone(),
        ));
    }
    println!(
        "opened {n} sessions in {:.1} s ({:.0}/s); renewals counted from here",
        opening.elapsed().as_secs_f64(),
        n as f64 / opening.elapsed().as_secs_f64()
    );
    let hold_sessions = if args.holds > 0 {
        let (held, sessions) = take_holds(args, arbiter, &rounds, period, &stop_rx).await?;
        renewers.spawn(renew_identity(
            held,
            sessions.clone(),
            rounds.clone(),
            period,
            per_message,
            stop_rx.clone(),
        ));
        sessions.len()
    } else {
        0
    };
    rounds.start_counting();
    let start: Vec<Usage> = pids.iter().map(|(_, p)| usage(*p)).collect();
    let began = Instant::now();
    let until = began + Duration::from_secs(args.secs);
    let stopper = tokio::spawn(async move {
        tokio::time::sleep_until(until.into()).await;
        let _ = stop_tx.send(true);
    });
    // acquirers
    let grants = Arc::new(AtomicU64::new(0));
    let mut acquirers = tokio::task::JoinSet::new();
    for w in 0..args.acquirers {
        let ch = channel(arbiter.addr(), "workload/bench").await?;
        let mut c = latchkey_proto::lockv1::lock_client::LockClient::new(ch);
        let class = args.class.clone();
        let grants = grants.clone();
        acquirers.spawn(async move {
            let session = c
                .open_session(OpenSessionRequest {
                    class: class.clone(),
                    reuse_session_ids: vec![],
                })
                .await?
                .into_inner()
                .session_id;
            // The acquirer's own session lives as long as the phase: renew it
            // every 20 s (TTL/3) on its own stream.
            let (renew_tx, renew_rx) = mpsc::channel(4);
            let mut renewals = c
                .keep_alive(tokio_stream::wrappers::ReceiverStream::new(renew_rx))
                .await?
                .into_inner();
            let keeper = tokio::spawn(async move {
                loop {
                    let request = KeepAliveRequest {
                        session_id: session,
                        ..Default::default()
                    };
                    if renew_tx.send(request).await.is_err() {
                        return;
                    }
                    // Notices of ended holds (each release is one) answer
                    // no renewal: wait for the renewal's answer.
                    loop {
                        match renewals.message().await {
                            Ok(Some(r)) if !r.ended_holds.is_empty() => {}
                            Ok(Some(r)) if r.remaining_ttl_seconds > 0 => break,
                            _ => return,
                        }
                    }
                    tokio::time::sleep(Duration::from_secs(20)).await;
                }
            });
            let mut i = 0u64;
            while Instant::now() < until {
                i += 1;
                let g = c
                    .acquire(AcquireRequest {
                        key: format!("bench/k{w}-{}", i % 64),
                        class: class.clone(),
                        session_id: session,
                        wait: WaitMode::WaitNone.into(),
                        metadata: Default::default(),
                        instance: String::new(),
                        mode: 0,
                        downgrade_from: None,
                    })
                    .await?
                    .into_inner()
                    .grant
                    .ok_or_else(|| anyhow!("no grant"))?;
                grants.fetch_add(1, Ordering::Relaxed);
                c.release(ReleaseRequest {
                    key: g.key.clone(),
                    session_id: session,
                    token: g.token,
                    slot: None,
                    mode: 0,
                })
                .await?;
            }
            keeper.abort();
            anyhow::Ok(())
        });
    }
    while let Some(r) = acquirers.join_next().await {
        if let Err(e) = r? {
            println!("acquirer failed: {e:#}");
        }
    }
    while let Some(r) = renewers.join_next().await {
        r??;
    }
    stopper.abort();
    let took = began.elapsed().as_secs_f64();
    let cpu = cpu_since(pids, &start);
    let leases = count_leases(etcd).await?;
    let sessions = n + hold_sessions + args.acquirers;
    println!(
        "scale: {sessions} sessions ({n} renewing only, {hold_sessions} with {} holds kept, {} acquirers'), etcd leases {leases}, keepalive traffic expected {:.0}/s (sessions / {} s)",
        args.holds,
        args.acquirers,
        sessions as f64 / period.as_secs_f64(),
        period.as_secs()
    );
    // sessions whose record is gone from etcd were lost
    let records = latchkey_etcd::kv::count_prefix(
        &etcd.client().await?,
        latchkey_records::Layout::new("/latchkey").sessions(),
    )
    .await?
    .value;
    let missing = n.saturating_sub(usize::try_from(records)?);
    let m = finish(
        "Latchkey",
        took,
        &rounds,
        cpu,
        grants.load(Ordering::Relaxed),
        missing,
    )?;
    // close every session (memory should come back)
    for (i, chunk) in all_ids.chunks(PER_IDENTITY).enumerate() {
        let ch = channel(arbiter.addr(), &format!("workload/bench-{i}")).await?;
        let mut c = latchkey_proto::lockv1::lock_client::LockClient::new(ch);
        for id in chunk {
            let _ = c
                .close_session(latchkey_proto::lockv1::CloseSessionRequest { session_id: *id })
                .await;
        }
    }
    Ok(m)
}

/// Renews one identity's sessions over one KeepAlive stream: every session
/// once a `period`, `per_message` sessions per message, spread evenly, the
/// first round starting at once; until `stop` turns true.
async fn renew_identity(
    mut client: latchkey_proto::lockv1::lock_client::LockClient<tonic::transport::Channel>,
    ids: Vec<i64>,
    rounds: Arc<Rounds>,
    period: Duration,
    per_message: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel(4096);
    let mut replies = client
        .keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let sent: Arc<Mutex<HashMap<i64, Instant>>> = Arc::default();
    let reader = {
        let (rounds, sent) = (rounds.clone(), sent.clone());
        tokio::spawn(async move {
            while let Ok(Some(r)) = replies.message().await {
                if !r.ended_holds.is_empty() {
                    continue; // a notice, not a renewal's answer
                }
                let at = sent.lock().remove(&r.session_id);
                if let Some(at) = at {
                    rounds.answered(at, r.remaining_ttl_seconds);
                }
            }
        })
    };
    let batches: Vec<Vec<i64>> = ids.chunks(per_message).map(<[i64]>::to_vec).collect();
    let gap = period / u32::try_from(batches.len().max(1))?;
    let mut next = tokio::time::Instant::now();
    'outer: loop {
        for batch in &batches {
            next += gap;
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                _ = stop.wait_for(|s| *s) => break 'outer,
            }
            {
                let mut s = sent.lock();
                let now = Instant::now();
                for id in batch {
                    s.insert(*id, now);
                }
            }
            tx.send(KeepAliveRequest {
                session_id: 0,
                session_ids: batch.clone(),
            })
            .await?;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    reader.abort();
    Ok(())
}

/// `--holds`: `workload/bench` opens one session per 1,000 holds and takes
/// them all (64 Acquires in flight), printing how fast; the sessions are
/// then renewed like every other (the caller spawns that).
async fn take_holds(
    args: &Args,
    arbiter: &ArbiterProcess,
    rounds: &Arc<Rounds>,
    period: Duration,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<(
    latchkey_proto::lockv1::lock_client::LockClient<tonic::transport::Channel>,
    Vec<i64>,
)> {
    let ch = channel(arbiter.addr(), "workload/bench").await?;
    let client = latchkey_proto::lockv1::lock_client::LockClient::new(ch);
    let mut sessions = Vec::new();
    for _ in 0..args.holds.div_ceil(HOLDS_PER_SESSION) {
        sessions.push(
            client
                .clone()
                .open_session(OpenSessionRequest {
                    class: args.class.clone(),
                    reuse_session_ids: vec![],
                })
                .await?
                .into_inner()
                .session_id,
        );
    }
    // Renewed while the holds are taken (that can take longer than a TTL).
    let (stop_early_tx, stop_early) = tokio::sync::watch::channel(false);
    let early = tokio::spawn(renew_identity(
        client.clone(),
        sessions.clone(),
        rounds.clone(),
        period,
        1,
        stop_early,
    ));
    let started = Instant::now();
    let sem = Arc::new(Semaphore::new(64));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..args.holds {
        let permit = sem.clone().acquire_owned().await?;
        let mut c = client.clone();
        let class = args.class.clone();
        let session = sessions[i / HOLDS_PER_SESSION];
        tasks.spawn(async move {
            let _p = permit;
            c.acquire(AcquireRequest {
                key: format!(
                    "bench/hold/{}/{}",
                    i / HOLDS_PER_SESSION,
                    i % HOLDS_PER_SESSION
                ),
                class,
                session_id: session,
                wait: WaitMode::WaitNone.into(),
                metadata: Default::default(),
                instance: String::new(),
                mode: 0,
                downgrade_from: None,
            })
            .await
            .map(|_| ())
        });
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
        if *stop.borrow() {
            anyhow::bail!("stopped while taking holds");
        }
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let took = started.elapsed().as_secs_f64();
    println!(
        "took {} holds on {} sessions in {took:.1} s ({:.0}/s)",
        args.holds,
        sessions.len(),
        args.holds as f64 / took
    );
    let _ = stop_early_tx.send(true);
    early.await??;
    Ok((client, sessions))
}
