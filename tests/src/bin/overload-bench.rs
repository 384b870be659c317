//! `overload-bench`: does a flood of new work cost established sessions their
//! renewals? (issue 31). Two phases, each on a fresh etcd and a fresh arbiter
//! process, the same load:
//!
//! - `--sessions` established sessions (class `--class`, TTL 5 s in the dev
//!   policies) renewed at the interval OpenSession names, over one KeepAlive
//!   stream per identity (1,000 sessions each), and
//! - `--flooders` workers that OpenSession, Acquire, Release and
//!   CloseSession as fast as they are answered, more than this machine can
//!   serve. A worker refused `OVERLOADED` backs off as a well-behaved client
//!   does (the pushback it is told or twice its last wait, with jitter),
//!   any other refusal 50 ms.
//!
//! The established sessions' client runs on a runtime and an OS thread of its
//! own, as if it were another process: the flood's tasks cannot delay it.
//!
//! The first phase runs with `--no-overload-protection` (the baseline), the
//! second with the protection as shipped. Printed per phase: renewals asked
//! and answered alive, late ones (answered after the target of 1 s), the
//! renewal round latency, established sessions lost (answered with no TTL
//! left, or not answered by the end), the flood's opens and grants per
//! second and its refusals, and the arbiter's RSS before, at the peak and
//! after the flood (its sessions closed, 10 s later). Then the protected
//! run beside the baseline as ratios. Nothing here is asserted on time.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{
    AcquireRequest, CloseSessionRequest, KeepAliveRequest, OpenSessionRequest, ReleaseRequest,
    WaitMode,
};
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, channel};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::procstat::usage;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic_types::StatusExt;

#[derive(Parser, Debug)]
#[command(
    about = "Renewals of established sessions under a flood of new work, protection off vs on"
)]
struct Args {
    /// Established sessions renewed throughout.
    #[arg(long, default_value_t = 5000)]
    sessions: usize,
    /// Their class (the dev policies' `short` has a TTL of 5 s).
    #[arg(long, default_value = "short")]
    class: String,
    /// Flood workers (each one call at a time).
    #[arg(long, default_value_t = 1500)]
    flooders: usize,
    /// Seconds the flood lasts.
    #[arg(long, default_value_t = 30)]
    secs: u64,
    /// Renewals answered later than this are late (the arbiter's default
    /// renewal latency target).
    #[arg(long, default_value_t = 1000)]
    late_ms: u64,
}

const PER_IDENTITY: usize = 1000;
/// Flood workers per HTTP/2 connection (the arbiter bounds streams per
/// connection).
const FLOODERS_PER_CHANNEL: usize = 50;

#[derive(Default)]
struct Renewals {
    /// Sessions whose renewal is asked and not answered yet, since when.
    sent: Arc<Mutex<HashMap<i64, Instant>>>,
    asked: AtomicU64,
    alive: AtomicU64,
    /// KeepAlive streams the arbiter ended (opened again by the renewer).
    stream_ends: AtomicU64,
    late: AtomicU64,
    /// Sessions answered with no TTL left (each counted once).
    lost: Mutex<std::collections::HashSet<i64>>,
    latency: Mutex<Option<Histogram<u64>>>,
}

impl Renewals {
    /// Of `ids`, those with an ask outstanding for over 2 s.
    fn unanswered(&self, ids: &[i64]) -> usize {
        let sent = self.sent.lock();
        ids.iter()
            .filter(|id| {
                sent.get(id)
                    .is_some_and(|at| at.elapsed() > Duration::from_secs(2))
            })
            .count()
    }
}

#[derive(Default)]
struct Flood {
    opens: AtomicU64,
    grants: AtomicU64,
    overloaded: AtomicU64,
    other_refusals: AtomicU64,
    other_reasons: Mutex<std::collections::BTreeMap<String, u64>>,
}

struct Phase {
    name: &'static str,
    secs: f64,
    asked: u64,
    alive: u64,
    late: u64,
    p99_ms: f64,
    max_ms: f64,
    lost: usize,
    /// Asks unanswered for over 2 s, 5 s past the flood.
    unanswered: usize,
    stream_ends: u64,
    opens: u64,
    grants: u64,
    overloaded: u64,
    other_refusals: u64,
    other_reasons: std::collections::BTreeMap<String, u64>,
    rss_before: u64,
    rss_peak: u64,
    rss_after: u64,
}

impl Phase {
    fn print(&self) {
        println!(
            "{:<10} renewals needed {:>7}  answered alive {:>7} ({:>5.1} %)  late {:>6}  latency p99 {:>7.0} ms  max {:>7.0} ms  sessions lost {:>5}  unanswered {:>5}  streams ended {}",
            self.name,
            self.asked,
            self.alive,
            self.alive as f64 * 100.0 / self.asked.max(1) as f64,
            self.late,
            self.p99_ms,
            self.max_ms,
            self.lost,
            self.unanswered,
            self.stream_ends
        );
        println!(
            "{:<10} flood: opens/s {:>6.0}  grants/s {:>6.0}  refused OVERLOADED {:>7}  other refusals {:>6} {:?}  arbiter RSS {} -> peak {} -> after {} MiB",
            "",
            self.opens as f64 / self.secs,
            self.grants as f64 / self.secs,
            self.overloaded,
            self.other_refusals,
            self.other_reasons,
            self.rss_before / 1024,
            self.rss_peak / 1024,
            self.rss_after / 1024
        );
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
    println!(
        "overload-bench: {} established sessions (class {}), {} flood workers for {} s, late past {} ms, {} cores",
        args.sessions,
        args.class,
        args.flooders,
        args.secs,
        args.late_ms,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let off = phase(&args, policies.path(), false).await?;
    off.print();
    let on = phase(&args, policies.path(), true).await?;
    on.print();
    let share = |p: &Phase| p.alive as f64 / p.asked.max(1) as f64;
    println!(
        "protected / unprotected: renewals answered alive {:.3}x ({:.1} % vs {:.1} %); late renewals {:.3}x; sessions lost {} vs {}; flood grants/s {:.2}x; refused OVERLOADED {} vs {}",
        share(&on) / share(&off).max(f64::MIN_POSITIVE),
        share(&on) * 100.0,
        share(&off) * 100.0,
        on.late as f64 / off.late.max(1) as f64,
        on.lost,
        off.lost,
        (on.grants as f64 / on.secs) / (off.grants as f64 / off.secs).max(f64::MIN_POSITIVE),
        on.overloaded,
        off.overloaded
    );
    Ok(())
}

async fn phase(args: &Args, policies: &std::path::Path, protected: bool) -> anyhow::Result<Phase> {
    let name = if protected { "protected" } else { "off" };
    let etcd = EtcdServer::start().await?;
    let exe = std::env::current_exe()?;
    let binary = exe.parent().context("exe dir")?.join("arbiter-under-test");
    let options = ArbiterOptions {
        policies_dir: policies.to_path_buf(),
        max_sessions_per_identity: Some(1_000_000),
        max_holds_per_identity: Some(1_000_000),
        overload: Some(latchkey_arbiter::overload::OverloadConfig {
            enabled: protected,
            ..Default::default()
        }),
        ..ArbiterOptions::default()
    };
    let arbiter = ArbiterProcess::start(&binary, &etcd, options, "warn").await?;
    let pid = arbiter.pid().context("arbiter pid")?;

    // The established sessions, each identity renewing its own as soon as
    // they are open: on a runtime (and an OS thread) of their own, as if in
    // other processes, so the flood's tasks in this one cannot delay them.
    let renewals = Arc::new(Renewals {
        latency: Mutex::new(Some(Histogram::new_with_bounds(1, 600_000_000, 3)?)),
        ..Default::default()
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let renewer_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let late = Duration::from_millis(args.late_ms);
    let established: Vec<i64> = {
        let (addr, sessions, class) = (arbiter.addr(), args.sessions, args.class.clone());
        let (renewals, stop_rx) = (renewals.clone(), stop_rx.clone());
        renewer_rt
            .spawn(async move {
                let mut established = Vec::new();
                for i in 0..sessions.div_ceil(PER_IDENTITY) {
                    let ch = channel(addr, &format!("workload/bench-{i}")).await?;
                    let mut c = LockClient::new(ch);
                    let count = PER_IDENTITY.min(sessions - i * PER_IDENTITY);
                    let mut ids = Vec::with_capacity(count);
                    let mut interval = Duration::from_secs(1);
                    for _ in 0..count {
                        let r = c
                            .open_session(OpenSessionRequest {
                                class: class.clone(),
                                reuse_session_ids: vec![],
                            })
                            .await?
                            .into_inner();
                        interval = Duration::from_millis(u64::from(r.keepalive_interval_ms));
                        ids.push(r.session_id);
                    }
                    established.extend(ids.iter().copied());
                    tokio::spawn(renew(
                        c,
                        ids,
                        interval,
                        late,
                        renewals.clone(),
                        stop_rx.clone(),
                    ));
                }
                anyhow::Ok(established)
            })
            .await??
    };
    // Let the renewals settle, then count from a clean slate.
    tokio::time::sleep(Duration::from_secs(3)).await;
    renewals.asked.store(0, Ordering::Relaxed);
    renewals.alive.store(0, Ordering::Relaxed);
    renewals.late.store(0, Ordering::Relaxed);
    if let Some(h) = renewals.latency.lock().as_mut() {
        h.reset();
    }
    let rss_before = usage(pid).rss_kib;

    // The flood.
    let flood = Arc::new(Flood::default());
    let began = Instant::now();
    let until = began + Duration::from_secs(args.secs);
    let mut flooders = tokio::task::JoinSet::new();
    let mut ch: Option<Channel> = None;
    for w in 0..args.flooders {
        if w % FLOODERS_PER_CHANNEL == 0 {
            ch = Some(channel(arbiter.addr(), "workload/bench").await?);
        }
        let c = LockClient::new(ch.clone().context("a channel")?);
        flooders.spawn(flood_worker(c, w, args.class.clone(), until, flood.clone()));
    }
    let mut rss_peak = rss_before;
    while Instant::now() < until {
        rss_peak = rss_peak.max(usage(pid).rss_kib);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    while flooders.join_next().await.is_some() {}
    let secs = began.elapsed().as_secs_f64();
    // The renewals a few seconds past the flood still count (a session lost
    // to it may only be answered so after it).
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Lost: answered with no TTL left, or gone from etcd now (while its
    // renewals still run).
    let mut lost = renewals.lost.lock().clone();
    let store = etcd.client().await?;
    for id in &established {
        let left = store.lease_client().time_to_live(*id, None).await?.ttl();
        if left <= 0 {
            lost.insert(*id);
        }
    }
    let unanswered = renewals.unanswered(&established);
    let stream_ends = renewals.stream_ends.load(Ordering::Relaxed);
    let _ = stop_tx.send(true);
    renewer_rt.shutdown_background();
    // What the arbiter gives back once the flood's sessions are closed.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let rss_after = usage(pid).rss_kib;
    let (p99_ms, max_ms) = renewals.latency.lock().as_ref().map_or((0.0, 0.0), |h| {
        (
            h.value_at_quantile(0.99) as f64 / 1000.0,
            h.max() as f64 / 1000.0,
        )
    });
    let measured = Phase {
        name,
        secs,
        asked: renewals.asked.load(Ordering::Relaxed),
        alive: renewals.alive.load(Ordering::Relaxed),
        late: renewals.late.load(Ordering::Relaxed),
        p99_ms,
        max_ms,
        lost: lost.len(),
        unanswered,
        stream_ends,
        opens: flood.opens.load(Ordering::Relaxed),
        grants: flood.grants.load(Ordering::Relaxed),
        overloaded: flood.overloaded.load(Ordering::Relaxed),
        other_refusals: flood.other_refusals.load(Ordering::Relaxed),
        other_reasons: flood.other_reasons.lock().clone(),
        rss_before,
        rss_peak,
        rss_after,
    };
    drop(arbiter);
    drop(etcd);
    Ok(measured)
}

/// Renews `ids` every `interval` over one KeepAlive stream, in messages of
/// 250 ids, and matches answers to asks by session id. A stream that ends
/// (the arbiter ends one on a store failure) is opened again at once, as
/// the client library does; its unanswered asks are dropped (counted in
/// `stream_ends`) and asked again on the new stream.
async fn renew(
    mut c: LockClient<Channel>,
    ids: Vec<i64>,
    interval: Duration,
    late: Duration,
    renewals: Arc<Renewals>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let sent = renewals.sent.clone();
    let (mut tx, mut reader) = renewal_stream(&mut c, late, &renewals).await?;
    let mut next = tokio::time::Instant::now();
    loop {
        if reader.is_finished() {
            renewals.stream_ends.fetch_add(1, Ordering::Relaxed);
            {
                let mut s = sent.lock();
                for id in &ids {
                    s.remove(id);
                }
            }
            match renewal_stream(&mut c, late, &renewals).await {
                Ok(stream) => (tx, reader) = stream,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        {
            // A renewal is needed each interval; one still unanswered from
            // the last round is not asked again (its answer counts once,
            // late if it is).
            let mut s = sent.lock();
            let now = Instant::now();
            for id in &ids {
                if let std::collections::hash_map::Entry::Vacant(e) = s.entry(*id) {
                    e.insert(now);
                    renewals.asked.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        for chunk in ids.chunks(250) {
            let msg = KeepAliveRequest {
                session_id: 0,
                session_ids: chunk.to_vec(),
            };
            if tx.send(msg).await.is_err() {
                break; // the stream ended: opened again above
            }
        }
        next += interval;
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            _ = stop.changed() => break,
        }
    }
    drop(tx);
    reader.abort();
    Ok(())
}

type RenewalStream = (mpsc::Sender<KeepAliveRequest>, tokio::task::JoinHandle<()>);

async fn renewal_stream(
    c: &mut LockClient<Channel>,
    late: Duration,
    renewals: &Arc<Renewals>,
) -> anyhow::Result<RenewalStream> {
    let (tx, rx) = mpsc::channel(64);
    let mut replies = c.keep_alive(ReceiverStream::new(rx)).await?.into_inner();
    let reader = {
        let renewals = renewals.clone();
        tokio::spawn(async move {
            while let Ok(Some(r)) = replies.message().await {
                if r.remaining_ttl_seconds == -1 {
                    continue; // a notice, not an answer
                }
                let Some(at) = renewals.sent.lock().remove(&r.session_id) else {
                    continue;
                };
                let took = at.elapsed();
                if r.remaining_ttl_seconds > 0 {
                    renewals.alive.fetch_add(1, Ordering::Relaxed);
                } else {
                    renewals.lost.lock().insert(r.session_id);
                }
                if took > late {
                    renewals.late.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(h) = renewals.latency.lock().as_mut() {
                    let _ = h.record(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
                }
            }
        })
    };
    Ok((tx, reader))
}

/// Open, acquire, release, close, as fast as answered, until `until`.
async fn flood_worker(
    mut c: LockClient<Channel>,
    w: usize,
    class: String,
    until: Instant,
    flood: Arc<Flood>,
) {
    let mut n = 0u64;
    let mut backoff = Duration::ZERO;
    while Instant::now() < until {
        n += 1;
        let opened = c
            .open_session(OpenSessionRequest {
                class: class.clone(),
                reuse_session_ids: vec![],
            })
            .await;
        let session = match opened {
            Ok(r) => {
                flood.opens.fetch_add(1, Ordering::Relaxed);
                r.into_inner().session_id
            }
            Err(s) => {
                refused(&s, &flood, &mut backoff).await;
                continue;
            }
        };
        let key = format!("bench/flood-{w}-{}", n % 4);
        let acquired = c
            .acquire(AcquireRequest {
                key: key.clone(),
                class: class.clone(),
                session_id: session,
                wait: WaitMode::WaitNone.into(),
                metadata: Default::default(),
                instance: format!("flood-{w}"),
                mode: 0,
                downgrade_from: None,
            })
            .await;
        match acquired {
            Ok(r) => {
                backoff = Duration::ZERO;
                flood.grants.fetch_add(1, Ordering::Relaxed);
                if let Some(g) = r.into_inner().grant {
                    let _ = c
                        .release(ReleaseRequest {
                            key,
                            session_id: session,
                            token: g.token,
                            slot: None,
                            mode: 0,
                        })
                        .await;
                }
            }
            Err(s) => refused(&s, &flood, &mut backoff).await,
        }
        let _ = c
            .close_session(CloseSessionRequest {
                session_id: session,
            })
            .await;
    }
}

/// Counts a refusal and waits as a well-behaved client does: after an
/// OVERLOADED refusal, the pushback it names or twice its last wait,
/// whichever is longer (capped at 8 s), with full jitter; 50 ms after any
/// other refusal.
async fn refused(s: &tonic::Status, flood: &Flood, backoff: &mut Duration) {
    let reason = s
        .get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
        .unwrap_or_else(|| format!("{:?}", s.code()));
    let pause = if reason == "OVERLOADED" {
        flood.overloaded.fetch_add(1, Ordering::Relaxed);
        let told = s
            .get_error_details()
            .retry_info()
            .and_then(|r| r.retry_delay)
            .unwrap_or(Duration::from_millis(250));
        *backoff = told.max(*backoff * 2).min(Duration::from_secs(8));
        backoff.mul_f64(0.5 + fastrand::f64())
    } else {
        flood.other_refusals.fetch_add(1, Ordering::Relaxed);
        *flood.other_reasons.lock().entry(reason).or_insert(0) += 1;
        Duration::from_millis(50)
    };
    tokio::time::sleep(pause).await;
}
