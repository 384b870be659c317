//! `election-bench`: what a Latchkey leader election costs, next to etcd's own
//! election API (v3election: Campaign and Resign on a lease) in the same run, on the
//! same etcd.
//!
//! One real etcd (the [`EtcdServer`] harness) and one in-process arbiter over mTLS
//! share the machine with the candidates. Both sides run with the same TTL
//! (`--ttl-secs`, 5 s by default): Latchkey's sessions are opened for an election class
//! of that TTL (fenced, with the harness's fixture pause test, in a temporary copy of
//! the dev policies: advisory classes may not go below 30 s), etcd's candidates hold
//! leases of that TTL. Both renew every TTL/3. Every replica is `workload/bench`: the
//! replicas of one workload share its identity.
//!
//! 1. **Crash failover** (`--rounds`, 5 by default). `--candidates` processes stand for
//!    one election: this program in its hidden `candidate` mode, campaigning with
//!    latchkey-client, or with etcd-client on a lease it keeps alive (etcdctl elect
//!    cannot set its session's TTL, 60 s). The leader's process is SIGKILLed; measured
//!    from the kill to the moment the bench reads the line the next leader's process
//!    prints when its Campaign returns. A fresh candidate then stands, and the next
//!    round kills the new leader. Goal: every Latchkey failover within TTL + 1 s. A
//!    failover waits for the dead leader's session (lease) to expire: between 2/3 of a
//!    TTL and a TTL after the kill, by where the kill falls between its renewals (a
//!    random point, the same on both sides), plus how soon the store notices.
//! 2. **Graceful hand-off** (`--handoffs`, 200 by default). Two in-process replicas,
//!    each its own client with its own session (etcd: its own lease). The leader
//!    resigns and the other's waiting Campaign returns; measured from just before
//!    Resign is sent to that return. The old leader then stands again, and has stood
//!    for 200 ms when the next hand-off starts (untimed; see [`SETTLE`]).
//!    Goal: Latchkey's p99 within 20 ms.
//!
//! Correctness is checked while measuring, and a failure exits non-zero: Latchkey's
//! terms and fencing tokens must strictly rise across every failover and hand-off
//! (printed as `... terms and tokens rose: ok`). Tokens are read for that check only
//! and never printed.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, anyhow, bail, ensure};
use clap::{Parser, Subcommand, ValueEnum};
use hdrhistogram::Histogram;
use latchkey_client::{CampaignOptions, Client, ClientConfig, Leadership, Reason, TlsFiles};
use latchkey_etcd::election::{LeaderKey, ResignOptions};
use latchkey_etcd::{Client as EtcdClient, Connection};
use latchkey_tests::arbiter::{self, Arbiter, ArbiterOptions};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::etcd_lease::EtcdLease;
use latchkey_tests::eventually;
use latchkey_tests::latency::{duration_text, histogram, micros};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};

/// The election class of the bench's policies (its TTL is `--ttl-secs`).
const CLASS: &str = "bench-elect";
/// The identity every replica shares (granted `bench` by the dev policies).
const REPLICA: &str = "workload/bench";
const CRASH_ELECTION: &str = "bench/elect/crash";
const HANDOFF_ELECTION: &str = "bench/elect/handoff";
/// Untimed hand-offs before the clock starts (connections, caches).
const WARMUP: usize = 5;
const HANDOFF_GOAL: Duration = Duration::from_millis(20);
/// How long a hand-off's standby has stood before the leader resigns (untimed). A
/// standby usually waits long; and etcd's Campaign waits on its predecessor's key with
/// a watch from the revision it read, which etcd serves from its unsynced-watcher loop
/// (every 100 ms) until it has caught up: resigning at once would time that loop, not
/// the hand-off.
const SETTLE: Duration = Duration::from_millis(200);
/// How long a step outside a failover may take before the run is declared stuck.
const STUCK: Duration = Duration::from_secs(30);

#[derive(Parser, Debug)]
#[command(about = "Latchkey vs etcd elections: crash failover and graceful hand-off")]
struct Args {
    #[command(subcommand)]
    mode: Option<Mode>,
    /// Crash failover rounds per side (each kills the leader's process once).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Candidate processes standing in each crash round (the leader included).
    #[arg(long, default_value_t = 3)]
    candidates: usize,
    /// Timed graceful hand-offs per side.
    #[arg(long, default_value_t = 200)]
    handoffs: usize,
    /// The TTL of both sides: the election class's and the etcd leases'.
    #[arg(long, default_value_t = 5)]
    ttl_secs: u32,
    /// Only this scenario.
    #[arg(long, value_enum)]
    only: Option<Scenario>,
    /// Also print every result as a JSON line.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// One candidate of the crash scenario: campaigns, prints `leading TERM TOKEN`
    /// to stdout (for the bench's term and token check) when it leads, then leads
    /// until killed or until its stdin closes (the bench is gone).
    #[command(hide = true)]
    Candidate(CandidateArgs),
}

#[derive(clap::Args, Debug)]
struct CandidateArgs {
    #[arg(long, value_enum)]
    side: Side,
    /// The arbiter (`https://...`) or etcd (`http://...`).
    #[arg(long)]
    endpoint: String,
    #[arg(long)]
    election: String,
    #[arg(long)]
    value: String,
    /// etcd: the lease's TTL (Latchkey's comes from the class).
    #[arg(long)]
    ttl_secs: u32,
    /// Latchkey: the election class and the SVID.
    #[arg(long, default_value = CLASS)]
    class: String,
    #[arg(long)]
    ca: Option<PathBuf>,
    #[arg(long)]
    cert: Option<PathBuf>,
    #[arg(long)]
    key: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Side {
    Latchkey,
    Etcd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Crash,
    Handoff,
}

/// One leadership as the check sees it: (term, token). etcd's have term 0 and the
/// leader key's create revision.
type Led = (u64, u64);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // The dev classes' hook modules are not built for the bench.
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("warn,latchkey_hook_host=error")
                }),
        )
        .with_writer(std::io::stderr)
        .try_init()
        .map_err(|e| anyhow!("installing the tracing subscriber: {e}"))?;
    if let Some(Mode::Candidate(candidate_args)) = &args.mode {
        return candidate(candidate_args).await;
    }
    ensure!(args.candidates >= 2, "--candidates must be at least 2");
    ensure!(args.rounds >= 1, "--rounds must be at least 1");
    ensure!(args.handoffs >= 1, "--handoffs must be at least 1");
    let ttl = Duration::from_secs(u64::from(args.ttl_secs));

    let policies = latchkey_tests::dev_policies_with_election_class(CLASS, args.ttl_secs)?;
    let etcd = EtcdServer::start().await?;
    let etcd_version = etcd.client().await?.status().await?.version().to_owned();
    let arbiter = Arbiter::start(
        &etcd,
        ArbiterOptions {
            policies_dir: policies.path().to_path_buf(),
            ..Default::default()
        },
    )
    .await?;
    let endpoint = etcd.endpoint();
    let arbiter_endpoint = format!("https://{}", arbiter.addr());

    println!(
        "election-bench {} ({} build): nproc {}, etcd {etcd_version} (one member, temp data \
         dir), in-process arbiter over mTLS; candidates, etcd and arbiter share the machine",
        env!("CARGO_PKG_VERSION"),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    println!(
        "TTL {} s on both sides (class {CLASS}; etcd leases), renewed every TTL/3; crash: {} \
         rounds, {} candidate processes; hand-off: {} resignations after {WARMUP} untimed",
        args.ttl_secs, args.rounds, args.candidates, args.handoffs
    );

    let mut report = Report::default();
    if args.only != Some(Scenario::Handoff) {
        let processes = |side: Side| -> anyhow::Result<Vec<OsString>> {
            let mut flags: Vec<OsString> = vec![
                "--election".into(),
                CRASH_ELECTION.into(),
                "--ttl-secs".into(),
                args.ttl_secs.to_string().into(),
            ];
            match side {
                Side::Etcd => flags.extend([
                    "--side".into(),
                    "etcd".into(),
                    "--endpoint".into(),
                    endpoint.clone().into(),
                ]),
                Side::Latchkey => {
                    let certs = arbiter::certs()?;
                    let svid = certs.svid(REPLICA);
                    flags.extend([
                        "--side".into(),
                        "latchkey".into(),
                        "--endpoint".into(),
                        arbiter_endpoint.clone().into(),
                        "--ca".into(),
                        certs.ca().into(),
                        "--cert".into(),
                        svid.cert.into(),
                        "--key".into(),
                        svid.key.into(),
                    ]);
                }
            }
            Ok(flags)
        };
        let crash_plan = CrashPlan {
            rounds: args.rounds,
            candidates: args.candidates,
            ttl,
        };
        eprintln!("running: crash failover, etcd election");
        let tally = Tally::Etcd(Box::new(
            latchkey_etcd::connect(&Connection::new([endpoint.clone()])).await?,
        ));
        let etcd_crash = crash(&crash_plan, processes(Side::Etcd)?, &tally).await?;
        eprintln!("running: crash failover, latchkey election");
        let tally = Tally::Latchkey(connect(&arbiter_endpoint).await?);
        let latchkey_crash = crash(&crash_plan, processes(Side::Latchkey)?, &tally).await?;

        report.row(
            "crash failover: etcd (kill -9 → next Campaign returns)",
            &etcd_crash.failover,
            None,
            None,
        );
        let goal = ttl + Duration::from_secs(1);
        let max = Duration::from_micros(latchkey_crash.failover.max());
        report.row(
            "crash failover: latchkey (kill -9 → next Campaign returns)",
            &latchkey_crash.failover,
            Some(("etcd crash", &etcd_crash.failover)),
            Some(format!(
                "max ≤ TTL + 1 s = {}: {}",
                duration_text(micros(goal)),
                if max <= goal { "met" } else { "MISSED" }
            )),
        );
        report.checks.push(check_rising(
            "crash failover: latchkey terms and tokens rose",
            &latchkey_crash.leaderships,
        )?);
    }
    if args.only != Some(Scenario::Crash) {
        eprintln!("running: graceful hand-off, etcd Resign → Campaign");
        let etcd_handoff = handoff_etcd(&endpoint, args.ttl_secs, args.handoffs).await?;
        eprintln!("running: graceful hand-off, latchkey Resign → Campaign");
        let latchkey_handoff = handoff_latchkey(&arbiter_endpoint, args.handoffs).await?;
        report.row(
            "hand-off: etcd (Resign sent → next Campaign returns)",
            &etcd_handoff.latency,
            None,
            None,
        );
        let p99 = Duration::from_micros(latchkey_handoff.latency.value_at_quantile(0.99));
        report.row(
            "hand-off: latchkey (Resign sent → next Campaign returns)",
            &latchkey_handoff.latency,
            Some(("etcd hand-off", &etcd_handoff.latency)),
            Some(format!(
                "p99 ≤ {}: {}",
                duration_text(micros(HANDOFF_GOAL)),
                if p99 <= HANDOFF_GOAL { "met" } else { "MISSED" }
            )),
        );
        report.checks.push(check_rising(
            "hand-off: latchkey terms and tokens rose",
            &latchkey_handoff.leaderships,
        )?);
    }

    println!();
    report.print(args.json)?;
    arbiter.stop().await?;
    drop(etcd);
    Ok(())
}

/// A Latchkey client as [`REPLICA`], straight to the arbiter.
async fn connect(endpoint: &str) -> anyhow::Result<Client> {
    let certs = arbiter::certs()?;
    let svid = certs.svid(REPLICA);
    let tls = TlsFiles {
        ca: certs.ca(),
        cert: svid.cert,
        key: svid.key,
    };
    Client::connect(ClientConfig::tls(endpoint, tls))
        .await
        .with_context(|| format!("connecting to {endpoint} as {REPLICA}"))
}

// ---------------------------------------------------------------------------------------
// Crash failover: candidate processes, the leader's SIGKILLed.

struct CrashPlan {
    rounds: usize,
    candidates: usize,
    ttl: Duration,
}

struct CrashRun {
    /// Kill → the next leader's line read, µs.
    failover: Histogram<u64>,
    /// Every leadership in order: the first, then one per round.
    leaderships: Vec<Led>,
}

async fn crash(plan: &CrashPlan, flags: Vec<OsString>, tally: &Tally) -> anyhow::Result<CrashRun> {
    let mut candidates = CandidateProcesses::new(flags);
    let first = candidates.spawn()?;
    let mut leader = candidates.next_leader(STUCK).await?;
    ensure!(leader.candidate == first, "a later candidate led first");
    for waiting in 1..plan.candidates {
        candidates.spawn()?;
        tally.until_waiting(CRASH_ELECTION, waiting).await?;
    }
    let mut leaderships = vec![leader.led];
    let mut failover = histogram()?;
    // The dead leader's session (lease) expires within a TTL of its last
    // renewal; the rest is slack for a loaded machine.
    let within = plan.ttl * 3 + STUCK;
    // Each round's kill waits a random part of a renewal interval first, so that it
    // falls anywhere between two of the leader's renewals: without it every step here
    // follows the last expiry by about the same time, and so would every kill follow
    // a renewal. The same seed on both sides: the same points.
    let mut phase = fastrand::Rng::with_seed(33);
    let renewal = plan.ttl / 3;
    for round in 1..=plan.rounds {
        tokio::time::sleep(renewal.mul_f64(phase.f64())).await;
        let killed_at = candidates.kill(leader.candidate).await?;
        let next = candidates.next_leader(within).await?;
        let took = next.at.saturating_duration_since(killed_at);
        failover.saturating_record(micros(took));
        eprintln!(
            "  round {round}: candidate {} led {} after the kill",
            next.candidate,
            duration_text(micros(took))
        );
        leaderships.push(next.led);
        leader = next;
        if round < plan.rounds {
            candidates.spawn()?;
            tally
                .until_waiting(CRASH_ELECTION, plan.candidates - 1)
                .await?;
        }
    }
    candidates.stop().await;
    Ok(CrashRun {
        failover,
        leaderships,
    })
}

/// What a candidate process's stdout said.
enum Event {
    Leading(Leading),
    /// Its stdout closed: it exited (or was killed).
    Exited(usize),
    Garbled(usize, String),
}

struct Leading {
    candidate: usize,
    /// When the bench read the line.
    at: Instant,
    led: Led,
}

/// The candidate processes of one side: this program in `candidate` mode.
struct CandidateProcesses {
    flags: Vec<OsString>,
    /// By candidate number; `None` once killed.
    children: Vec<Option<Child>>,
    events_tx: mpsc::UnboundedSender<Event>,
    events: mpsc::UnboundedReceiver<Event>,
}

impl CandidateProcesses {
    fn new(flags: Vec<OsString>) -> Self {
        let (events_tx, events) = mpsc::unbounded_channel();
        Self {
            flags,
            children: Vec::new(),
            events_tx,
            events,
        }
    }

    /// Starts the next candidate; its lines are read (and timed) by a task of its own.
    fn spawn(&mut self) -> anyhow::Result<usize> {
        let n = self.children.len();
        let mut child = Command::new(std::env::current_exe()?)
            .arg("candidate")
            .args(&self.flags)
            .arg("--value")
            .arg(format!("replica-{n}"))
            // The candidate exits when its stdin closes: when the bench is gone.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting a candidate process")?;
        let stdout = child.stdout.take().context("the candidate's stdout")?;
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let at = Instant::now();
                let event = match parse_leading(&line) {
                    Some(led) => Event::Leading(Leading {
                        candidate: n,
                        at,
                        led,
                    }),
                    None => Event::Garbled(n, line),
                };
                if events.send(event).is_err() {
                    return;
                }
            }
            let _ = events.send(Event::Exited(n));
        });
        self.children.push(Some(child));
        Ok(n)
    }

    /// The next candidate to report that it leads.
    async fn next_leader(&mut self, within: Duration) -> anyhow::Result<Leading> {
        let deadline = Instant::now() + within;
        loop {
            let event = timeout(
                deadline.saturating_duration_since(Instant::now()),
                self.events.recv(),
            )
            .await
            .with_context(|| format!("no candidate led within {within:?}"))?
            .context("every candidate's output closed")?;
            match event {
                Event::Leading(leading) => return Ok(leading),
                // A killed candidate's output closes: expected.
                Event::Exited(n) if self.children.get(n).is_some_and(Option::is_none) => {}
                Event::Exited(n) => bail!("candidate {n} exited on its own (its stderr is above)"),
                Event::Garbled(n, line) => bail!("candidate {n} printed {line:?}"),
            }
        }
    }

    /// SIGKILLs candidate `n` and reaps it; when the signal was sent.
    async fn kill(&mut self, n: usize) -> anyhow::Result<Instant> {
        let mut child = self
            .children
            .get_mut(n)
            .and_then(Option::take)
            .with_context(|| format!("candidate {n} is not running"))?;
        let pid = child.id().context("the candidate already exited")?;
        let at = Instant::now();
        kill(Pid::from_raw(i32::try_from(pid)?), Signal::SIGKILL)?;
        child.wait().await?;
        Ok(at)
    }

    async fn stop(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}

/// `leading TERM TOKEN`.
fn parse_leading(line: &str) -> Option<Led> {
    let mut words = line.split_whitespace();
    if words.next()? != "leading" {
        return None;
    }
    let term = words.next()?.parse().ok()?;
    let token = words.next()?.parse().ok()?;
    words.next().is_none().then_some((term, token))
}

/// How many candidates wait behind the leader, as each side tells it.
enum Tally {
    Latchkey(Client),
    Etcd(Box<EtcdClient>),
}

impl Tally {
    async fn waiting(&self, election: &str) -> anyhow::Result<usize> {
        match self {
            Tally::Latchkey(client) => Ok(client.candidates(election).await?.len()),
            // v3election keys every candidate (the leader too) under `<name>/`.
            Tally::Etcd(client) => {
                let keys = latchkey_etcd::kv::count_prefix(client, format!("{election}/")).await?;
                Ok(usize::try_from(keys.value)?.saturating_sub(1))
            }
        }
    }

    async fn until_waiting(&self, election: &str, n: usize) -> anyhow::Result<()> {
        eventually(
            &format!("{n} candidates waiting in {election}"),
            STUCK,
            || async {
                let waiting = self.waiting(election).await?;
                ensure!(waiting >= n, "{waiting} waiting");
                Ok(())
            },
        )
        .await
    }
}

/// The `candidate` mode: stand, say so when leading, lead until killed.
async fn candidate(args: &CandidateArgs) -> anyhow::Result<()> {
    let stdin_closed = async {
        let mut sink = Vec::new();
        let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    };
    tokio::select! {
        led = stand(args) => led,
        () = stdin_closed => Ok(()),
    }
}

async fn stand(args: &CandidateArgs) -> anyhow::Result<()> {
    match args.side {
        Side::Latchkey => {
            let (Some(ca), Some(cert), Some(key)) =
                (args.ca.clone(), args.cert.clone(), args.key.clone())
            else {
                bail!("a latchkey candidate needs --ca, --cert and --key");
            };
            let client = Client::connect(ClientConfig::tls(
                args.endpoint.clone(),
                TlsFiles { ca, cert, key },
            ))
            .await?;
            let leadership = loop {
                match client
                    .campaign(
                        args.election.as_str(),
                        args.class.as_str(),
                        args.value.as_str(),
                        CampaignOptions::default(),
                    )
                    .await
                {
                    // The arbiter's longest wait ran out: stand again.
                    Err(err) if err.reason() == Reason::WaitTimeout => {}
                    led => break led?,
                }
            };
            announce((leadership.term(), leadership.token().get()))?;
            let lost = leadership.lost().await;
            bail!("{}: leadership lost: {lost}", args.value)
        }
        Side::Etcd => {
            let mut client =
                latchkey_etcd::connect(&Connection::new([args.endpoint.clone()])).await?;
            let lease = EtcdLease::grant(&mut client, i64::from(args.ttl_secs)).await?;
            let mut campaigned = client
                .campaign(args.election.as_str(), args.value.as_str(), lease.id)
                .await?;
            let key = campaigned
                .take_leader()
                .context("etcd's Campaign answered without a leader key")?;
            announce((0, u64::try_from(key.rev())?))?;
            // Leads until killed; the lease lives while the keepalive task runs.
            std::future::pending::<()>().await;
            Ok(())
        }
    }
}

/// The line the bench reads: a pipe to it, never a log.
fn announce((term, token): Led) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "leading {term} {token}")?;
    out.flush()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Graceful hand-off: two in-process replicas resign to each other.

struct HandoffRun {
    /// Resign sent → the other replica's Campaign returned, µs.
    latency: Histogram<u64>,
    leaderships: Vec<Led>,
}

/// Campaigns from a task of its own; when it returned, with what.
fn stand_latchkey(
    client: &Client,
    value: String,
) -> JoinHandle<(Instant, Result<Leadership, latchkey_client::Error>)> {
    let client = client.clone();
    tokio::spawn(async move {
        let options = CampaignOptions {
            wait: Some(STUCK),
            ..CampaignOptions::default()
        };
        let led = client
            .campaign(HANDOFF_ELECTION, CLASS, value, options)
            .await;
        (Instant::now(), led)
    })
}

async fn handoff_latchkey(endpoint: &str, handoffs: usize) -> anyhow::Result<HandoffRun> {
    let replicas = [connect(endpoint).await?, connect(endpoint).await?];
    let tally = Tally::Latchkey(connect(endpoint).await?);
    let (mut leader, mut standby) = (&replicas[0], &replicas[1]);
    let (_, first) = stand_latchkey(leader, "replica-0".into()).await?;
    let mut leadership = first.context("the first campaign")?;
    let mut leaderships = vec![(leadership.term(), leadership.token().get())];
    let mut latency = histogram()?;
    for i in 0..WARMUP + handoffs {
        let waiting = stand_latchkey(standby, format!("replica-{}", (i + 1) % 2));
        tally.until_waiting(HANDOFF_ELECTION, 1).await?;
        tokio::time::sleep(SETTLE).await;
        let sent = Instant::now();
        let next = leadership.resign().await.context("resign")?;
        ensure!(
            next.is_some(),
            "a resignation left the election vacant with a candidate waiting"
        );
        let (at, led) = timeout(STUCK, waiting)
            .await
            .context("the waiting campaign did not return")??;
        leadership = led.context("the waiting campaign")?;
        if i >= WARMUP {
            latency.saturating_record(micros(at.saturating_duration_since(sent)));
        }
        leaderships.push((leadership.term(), leadership.token().get()));
        std::mem::swap(&mut leader, &mut standby);
    }
    leadership.resign().await.context("the last resign")?;
    Ok(HandoffRun {
        latency,
        leaderships,
    })
}

/// An etcd replica: its own client and lease.
struct EtcdReplica {
    client: EtcdClient,
    lease: EtcdLease,
}

impl EtcdReplica {
    async fn start(endpoint: &str, ttl_secs: u32) -> anyhow::Result<Self> {
        let mut client = latchkey_etcd::connect(&Connection::new([endpoint.to_owned()])).await?;
        let lease = EtcdLease::grant(&mut client, i64::from(ttl_secs)).await?;
        Ok(Self { client, lease })
    }

    /// Campaigns from a task of its own; when it returned, with the leader key.
    fn stand(&self, value: String) -> JoinHandle<(Instant, anyhow::Result<LeaderKey>)> {
        let mut client = self.client.clone();
        let lease = self.lease.id;
        tokio::spawn(async move {
            let led = client.campaign(HANDOFF_ELECTION, value, lease).await;
            let at = Instant::now();
            let key = led.map_err(anyhow::Error::from).and_then(|mut r| {
                r.take_leader()
                    .context("etcd's Campaign answered without a leader key")
            });
            (at, key)
        })
    }
}

async fn handoff_etcd(
    endpoint: &str,
    ttl_secs: u32,
    handoffs: usize,
) -> anyhow::Result<HandoffRun> {
    let replicas = [
        EtcdReplica::start(endpoint, ttl_secs).await?,
        EtcdReplica::start(endpoint, ttl_secs).await?,
    ];
    let tally = Tally::Etcd(Box::new(replicas[0].client.clone()));
    let (mut leader, mut standby) = (&replicas[0], &replicas[1]);
    let (_, first) = leader.stand("replica-0".into()).await?;
    let mut key = first.context("the first campaign")?;
    let mut latency = histogram()?;
    for i in 0..WARMUP + handoffs {
        let waiting = standby.stand(format!("replica-{}", (i + 1) % 2));
        tally.until_waiting(HANDOFF_ELECTION, 1).await?;
        tokio::time::sleep(SETTLE).await;
        let sent = Instant::now();
        leader
            .client
            .clone()
            .resign(Some(ResignOptions::new().with_leader(key)))
            .await
            .context("resign")?;
        let (at, led) = timeout(STUCK, waiting)
            .await
            .context("the waiting campaign did not return")??;
        key = led.context("the waiting campaign")?;
        if i >= WARMUP {
            latency.saturating_record(micros(at.saturating_duration_since(sent)));
        }
        std::mem::swap(&mut leader, &mut standby);
    }
    leader
        .client
        .clone()
        .resign(Some(ResignOptions::new().with_leader(key)))
        .await
        .context("the last resign")?;
    Ok(HandoffRun {
        latency,
        leaderships: Vec::new(),
    })
}

/// Terms and tokens must strictly rise from each leadership to the next. A
/// failure names the terms and whether the token rose, never a token.
fn check_rising(what: &str, leaderships: &[Led]) -> anyhow::Result<String> {
    ensure!(leaderships.len() >= 2, "{what}: fewer than two leaderships");
    for (i, pair) in leaderships.windows(2).enumerate() {
        let [(term_a, token_a), (term_b, token_b)] = pair else {
            continue;
        };
        ensure!(
            term_b > term_a && token_b > token_a,
            "{what}: NO: leadership {} has term {term_b} after {term_a}, its token {} the last",
            i + 1,
            if token_b > token_a {
                "above"
            } else {
                "NOT above"
            }
        );
    }
    let by_one = leaderships
        .windows(2)
        .all(|w| matches!(w, [(a, _), (b, _)] if *b == a + 1));
    Ok(format!(
        "{what}: ok ({} leaderships{})",
        leaderships.len(),
        if by_one {
            ", each term one above the last"
        } else {
            ""
        }
    ))
}

// ---------------------------------------------------------------------------------------
// Reporting.

struct Row {
    scenario: String,
    samples: u64,
    p50_us: u64,
    p99_us: u64,
    max_us: u64,
    /// Ratios to the baseline (above 1: slower): p50, p99, max.
    versus: Option<(String, f64, f64, f64)>,
    goal: Option<String>,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    checks: Vec<String>,
}

impl Report {
    fn row(
        &mut self,
        scenario: &str,
        latency: &Histogram<u64>,
        baseline: Option<(&str, &Histogram<u64>)>,
        goal: Option<String>,
    ) {
        let ratio = |a: u64, b: u64| a.max(1) as f64 / b.max(1) as f64;
        let versus = baseline.map(|(label, base)| {
            (
                label.to_owned(),
                ratio(latency.value_at_quantile(0.5), base.value_at_quantile(0.5)),
                ratio(
                    latency.value_at_quantile(0.99),
                    base.value_at_quantile(0.99),
                ),
                ratio(latency.max(), base.max()),
            )
        });
        self.rows.push(Row {
            scenario: scenario.to_owned(),
            samples: latency.len(),
            p50_us: latency.value_at_quantile(0.5),
            p99_us: latency.value_at_quantile(0.99),
            max_us: latency.max(),
            versus,
            goal,
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
            "{:<width$} | {:>5} | {:>9} | {:>9} | {:>9} | ratio to baseline (p50, p99, max) | goal",
            "scenario", "n", "p50", "p99", "max"
        );
        println!("{}", "-".repeat(width + 100));
        for r in &self.rows {
            let ratio = match &r.versus {
                Some((label, p50, p99, max)) => {
                    format!("x{p50:.2}, x{p99:.2}, x{max:.2} vs {label}")
                }
                None => "(baseline)".to_owned(),
            };
            println!(
                "{:<width$} | {:>5} | {:>9} | {:>9} | {:>9} | {ratio:<34} | {}",
                r.scenario,
                r.samples,
                duration_text(r.p50_us),
                duration_text(r.p99_us),
                duration_text(r.max_us),
                r.goal.as_deref().unwrap_or(""),
            );
        }
        for check in &self.checks {
            println!("{check}");
        }
        if json {
            for r in &self.rows {
                let line = serde_json::json!({
                    "scenario": r.scenario,
                    "n": r.samples,
                    "p50_us": r.p50_us,
                    "p99_us": r.p99_us,
                    "max_us": r.max_us,
                    "baseline": r.versus.as_ref().map(|v| &v.0),
                    "p50_ratio": r.versus.as_ref().map(|v| v.1),
                    "p99_ratio": r.versus.as_ref().map(|v| v.2),
                    "max_ratio": r.versus.as_ref().map(|v| v.3),
                    "goal": r.goal,
                });
                println!("{}", serde_json::to_string(&line)?);
            }
        }
        Ok(())
    }
}
