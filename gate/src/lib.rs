//! The release gate (ADR-23): real processes under a seeded nemesis, every
//! client operation recorded, the history judged by `latchkey_checker`.
//!
//! A run starts a 3-member etcd cluster (each member in its own network
//! namespace, so partitions are real), a single etcd as the coord cluster
//! that witnesses it (`--coord-etcd`, issue 15), a private PostgreSQL holding
//! the reference fence, one or two arbiter processes and N worker processes
//! (`gate-worker`, the client library doing acquire → fenced write →
//! release). The nemesis injects every fault kind in [`Fault::ALL`] at least
//! once, then random ones until the duration is up. Afterwards the workers
//! stop, the per-process histories are merged, and the checker verifies
//! linearizability against a lock model per key, token order, and that the
//! fence never accepted a stale write.
//!
//! It runs on `latchkey_tests`' harnesses (the etcd cluster, arbiter
//! processes, PostgreSQL, the slow-disk mounts, the dev CA). `latchkey-gate`
//! (src/bin) runs it from the command line for long soaks; this crate's
//! tests (tests/gate.rs) run a short gate and the broken-arbiter self-tests.

pub mod clock;
pub mod elector;
pub mod nemesis;
pub mod quorum_loss;
pub mod record;
pub mod shards;
pub mod stores;
pub mod worker;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use latchkey_checker::{CheckOptions, History, Report};
use tokio::sync::Mutex;

use clock::SteppableClock;
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, Coord, certs, svid_flags};
use latchkey_tests::cluster::{ClusterOptions, EtcdCluster};
use latchkey_tests::disk::StallableDir;
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::faulty_log::TestFault;
use latchkey_tests::postgres::PostgresServer;

pub use nemesis::Fault;

/// The lock class every worker uses; TTL 5 s so lease expiry is quick.
pub const CLASS: &str = "gate";
/// The same class with durable waiters (ADR-14): some workers use it on
/// keys of their own, judged with the rest.
pub const DURABLE_CLASS: &str = "gate-durable";
/// A coord-tier class (ADR-07): the arbiters run with the tiers split, and
/// some workers lock keys of the namespace it names on the coord cluster,
/// judged with the rest, through every fault.
pub const COORD_CLASS: &str = "gate-leader";
/// The namespace the coord class serves.
pub const COORD_NAMESPACE: &str = "gateleader";
/// The election class (issue 33): electors campaign for elections of the
/// namespace it names, on the coord tier like every election class.
pub const ELECTION_CLASS: &str = "gate-election";
/// A semaphore class (issue 34): some workers take its slots on a key of
/// their own; each slot's record is fenced by the slot's token.
pub const SEMAPHORE_CLASS: &str = "gate-semaphore";
/// Its permits: fewer than the workers that contend for them.
pub const SEMAPHORE_PERMITS: u32 = 2;
/// One acquire in this many of the plain workers is shared (issue 34),
/// on the first few keys: readers meet readers and writers there.
pub const SHARED_EVERY: u64 = 3;
/// The namespace the election class serves.
pub const ELECTION_NAMESPACE: &str = "gateelect";
/// The electors' one identity: replicas of one Deployment.
const ELECTOR_IDENTITY: &str = "workload/gate-electors";
pub const TTL: Duration = Duration::from_secs(5);
/// The resource the gate's class is fenced by: the reference fence's table.
const GATE_RESOURCE: &str = "postgresql:gate.latchkey_fenced_rows";

/// Where the gate finds the binaries it runs as separate processes.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub arbiter: PathBuf,
    pub worker: PathBuf,
}

impl Binaries {
    /// Next to the running executable (what `latchkey-gate` uses).
    pub fn beside_current_exe() -> anyhow::Result<Self> {
        let exe = std::env::current_exe()?;
        let dir = exe.parent().context("executable without a directory")?;
        Ok(Self {
            arbiter: dir.join("arbiter-under-test"),
            worker: dir.join("gate-worker"),
        })
    }
}

#[derive(Debug, Clone)]
pub struct GateConfig {
    pub seed: u64,
    pub duration: Duration,
    pub workers: usize,
    /// Electors beside the workers ([`elector`]): processes of one
    /// identity campaigning for two elections, judged with the rest.
    pub electors: usize,
    pub keys: usize,
    pub arbiters: usize,
    /// Faults to schedule; each one at least once. Empty = no nemesis.
    pub faults: Vec<Fault>,
    /// Pause between faults (uniform in this range).
    pub fault_gap: (Duration, Duration),
    /// Longest unit of work a worker does inside a hold (one in 16 is ten
    /// times longer, for the holder pauses).
    pub unit_of_work: Duration,
    /// Longest time a worker waits for a held key.
    pub wait: Duration,
    /// A deliberate bug for the arbiters (the checker's self-test:
    /// [`TestFault::GrantOnWatch`]), passed as `--test-fault`: only
    /// `arbiter-under-test` has the faults (see [`latchkey_tests::faulty_log`]).
    pub arbiter_test_fault: TestFault,
    /// Where a failing run's history and report are kept.
    pub out_dir: PathBuf,
    /// Keep the history, report and logs even when the run passes.
    pub keep: bool,
    /// Rotate the fenced writes through every fence adapter (PostgreSQL,
    /// MariaDB, Redis, etcd, S3: [`stores`]), one store per key; off, they
    /// all go to the PostgreSQL reference fence.
    pub fence_rotation: bool,
    pub binaries: Binaries,
}

impl GateConfig {
    /// The short gate CI runs: every fault kind, enough keys and workers
    /// with short units of work for over 10,000 checked operations.
    pub fn short(seed: u64, binaries: Binaries, out_dir: PathBuf) -> Self {
        Self {
            seed,
            duration: Duration::from_secs(100),
            workers: 15,
            electors: 3,
            keys: 16,
            arbiters: 2,
            faults: Fault::ALL.to_vec(),
            fault_gap: (Duration::from_millis(1500), Duration::from_millis(4000)),
            unit_of_work: Duration::from_millis(20),
            wait: Duration::from_millis(1000),
            arbiter_test_fault: TestFault::None,
            out_dir,
            keep: false,
            fence_rotation: true,
            binaries,
        }
    }
}

/// What a run found.
pub struct GateOutcome {
    pub report: Report,
    pub faults: Vec<String>,
    /// History lines (invokes and completions).
    pub operations: usize,
    pub worker_restarts: usize,
    /// From the first worker start to the stop (the workload's wall time).
    pub workload_time: Duration,
    /// How long the checker took on the merged history.
    pub check_time: Duration,
    /// How long after the nemesis stopped every key was granted again;
    /// `None` when some key was not within [`RECOVERY_TIMEOUT`] (liveness
    /// lost: the history may still be safe).
    pub recovered_after: Option<Duration>,
    /// The longest stretch of the run in which no acquire succeeded.
    pub longest_without_grant: Duration,
    /// Where the history, report and logs were kept: always on a failure,
    /// on a pass only with [`GateConfig::keep`].
    pub saved: Option<PathBuf>,
    /// With the quorum-loss fault: the open class's unprotected grants
    /// (token 0) the workers were given, and those no spool has (ADR-04:
    /// must be none).
    pub unprotected_grants: usize,
    pub unspooled: Vec<String>,
    /// Issue 34's holds in the judged history: shared grants and the
    /// semaphore slots granted.
    pub modes: ModeCounts,
    /// Fenced writes per store kind (one entry, `postgresql`, without
    /// [`GateConfig::fence_rotation`]).
    pub stores: BTreeMap<String, stores::StoreWrites>,
}

/// How much of the judged history was shared holds and semaphore slots.
#[derive(Debug, Clone, Default)]
pub struct ModeCounts {
    pub shared_grants: usize,
    /// Shared grants whose token another shared grant of the key also got
    /// (readers granted together in one transaction).
    pub shared_together: usize,
    /// Pairs of shared holds of one key that were held at once for sure
    /// (each granted before the other's release was asked for).
    pub shared_overlaps: usize,
    pub semaphore_grants: usize,
    pub slots: std::collections::BTreeSet<u32>,
    /// Readers' guarded reads through the reference fence: accepted,
    /// refused by the fence (a newer writer had written), outcome unknown.
    pub reads_accepted: usize,
    pub reads_refused: usize,
    pub reads_unknown: usize,
}

/// Pairs of shared holds of one key held at the same time for sure: each
/// from its grant's answer to its process's next release of the key.
fn shared_overlaps(history: &History) -> usize {
    use latchkey_checker::{Function, Mode};
    let mut held: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    let ops = history.ops();
    for (i, o) in ops.iter().enumerate() {
        if o.f != Function::Acquire || !o.is_ok() || o.mode != Mode::Shared {
            continue;
        }
        let (Some(key), Some(from)) = (o.key.as_deref(), o.complete_time()) else {
            continue;
        };
        let until = ops[i + 1..]
            .iter()
            .find(|r| {
                r.f == Function::Release && r.process == o.process && r.key.as_deref() == Some(key)
            })
            .map(|r| r.invoke_time);
        if let Some(until) = until {
            held.entry(key).or_default().push((from, until));
        }
    }
    held.values()
        .map(|spans| {
            let mut n = 0;
            for (a, x) in spans.iter().enumerate() {
                n += spans[a + 1..]
                    .iter()
                    .filter(|y| x.0 < y.1 && y.0 < x.1)
                    .count();
            }
            n
        })
        .sum()
}

impl ModeCounts {
    fn of(history: &History) -> Self {
        let mut counts = ModeCounts::default();
        let mut shared_tokens: BTreeMap<(&str, u64), usize> = BTreeMap::new();
        for o in history.ops() {
            if o.f == latchkey_checker::Function::Read {
                match o.outcome() {
                    Some(latchkey_checker::Outcome::Ok) => counts.reads_accepted += 1,
                    Some(latchkey_checker::Outcome::Fail) => counts.reads_refused += 1,
                    _ => counts.reads_unknown += 1,
                }
                continue;
            }
            if o.f != latchkey_checker::Function::Acquire || !o.is_ok() {
                continue;
            }
            match o.mode {
                latchkey_checker::Mode::Shared => {
                    counts.shared_grants += 1;
                    if let (Some(k), Some(t)) = (o.key.as_deref(), o.subject_token()) {
                        *shared_tokens.entry((k, t)).or_default() += 1;
                    }
                }
                latchkey_checker::Mode::Semaphore => {
                    counts.semaphore_grants += 1;
                    counts.slots.extend(o.slot);
                }
                latchkey_checker::Mode::Exclusive => {}
            }
        }
        counts.shared_together = shared_tokens.values().filter(|&&n| n > 1).sum();
        counts.shared_overlaps = shared_overlaps(history);
        counts
    }
}

impl fmt::Display for GateOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "gate: {} history lines, {} faults injected, {} worker incarnations restarted",
            self.operations,
            self.faults.len(),
            self.worker_restarts
        )?;
        writeln!(
            f,
            "throughput: {} ops checked in {:.1} s of workload ({:.0} ops/s); checker {:.2} s ({:.0} ops/s)",
            self.report.ops_checked,
            self.workload_time.as_secs_f64(),
            self.ops_per_second(),
            self.check_time.as_secs_f64(),
            self.report.ops_checked as f64 / self.check_time.as_secs_f64().max(1e-3),
        )?;
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for fault in &self.faults {
            let kind = fault.split_whitespace().next().unwrap_or(fault);
            *counts.entry(kind).or_default() += 1;
        }
        for (kind, n) in counts {
            writeln!(f, "  fault {kind}: {n}")?;
        }
        match self.recovered_after {
            Some(d) => writeln!(
                f,
                "recovery: every key granted again {:.1} s after the last fault",
                d.as_secs_f64()
            )?,
            None => writeln!(
                f,
                "recovery: NOT RECOVERED: some key was not granted within {} s after the last fault",
                RECOVERY_TIMEOUT.as_secs()
            )?,
        }
        writeln!(
            f,
            "longest stretch without a grant: {:.1} s",
            self.longest_without_grant.as_secs_f64()
        )?;
        writeln!(
            f,
            "shared holds: {} grants ({} granted together with another reader, {} pairs held at once); semaphore: {} grants over slots {:?}",
            self.modes.shared_grants,
            self.modes.shared_together,
            self.modes.shared_overlaps,
            self.modes.semaphore_grants,
            self.modes.slots
        )?;
        writeln!(
            f,
            "readers' guarded reads (reference fence): {} accepted / {} refused / {} unknown",
            self.modes.reads_accepted, self.modes.reads_refused, self.modes.reads_unknown
        )?;
        let per_store: Vec<String> = self
            .stores
            .iter()
            .map(|(kind, w)| {
                format!(
                    "{kind} {} accepted / {} refused / {} unknown",
                    w.accepted, w.refused, w.unknown
                )
            })
            .collect();
        writeln!(f, "fenced writes by store: {}", per_store.join(", "))?;
        if self.unprotected_grants > 0 || !self.unspooled.is_empty() {
            writeln!(
                f,
                "quorum loss: {} unprotected grants (token 0) of the open class, {} not in a spool",
                self.unprotected_grants,
                self.unspooled.len()
            )?;
            for line in self.unspooled.iter().take(20) {
                writeln!(f, "  [unspooled] {line}")?;
            }
        }
        write!(f, "{}", self.report)?;
        if let Some(dir) = &self.saved {
            writeln!(f, "history and report saved in {}", dir.display())?;
        }
        Ok(())
    }
}

impl GateOutcome {
    /// Checked operations per second of workload.
    pub fn ops_per_second(&self) -> f64 {
        self.report.ops_checked as f64 / self.workload_time.as_secs_f64().max(1e-3)
    }
}

/// A worker process and its incarnation count.
struct Worker {
    index: usize,
    incarnation: usize,
    child: Option<Child>,
    seed: u64,
    arbiter: usize,
}

/// Everything the nemesis acts on.
pub(crate) struct Rig {
    pub cluster: Mutex<EtcdCluster>,
    pub arbiters: Mutex<Vec<Option<ArbiterProcess>>>,
    pub arbiter_addrs: Vec<std::net::SocketAddr>,
    pub arbiter_state: Vec<PathBuf>,
    pub arbiter_opts: ArbiterOptions,
    /// The coord cluster every arbiter is witnessed by (`arbiter_opts.coord`);
    /// only the coord faults (`kill-coord`, `restore-coord`, not in CI's
    /// main schedule) touch it; with the tiers split it also holds the coord
    /// tier's locks and the elections. Declared after `arbiters`: stopped
    /// after them.
    pub coord: tokio::sync::Mutex<CoordEtcd>,
    /// The coord tier's witness (`--coord-tier-witness-etcd`); no fault
    /// touches it either.
    pub _coord_tier_witness: EtcdServer,
    /// With the shard-move fault: the entity tier's second shard (a single
    /// etcd; no other fault touches it).
    pub _shard_b: Option<EtcdServer>,
    /// With the slow-disk-arbiter fault: arbiter i's state dir is inside
    /// `arbiter_disks[i]` (declared after `arbiters`: unmounted after they stop).
    pub arbiter_disks: Vec<StallableDir>,
    pub binaries: Binaries,
    workers: Mutex<Vec<Worker>>,
    /// With the clock-step fault: worker slot i's clock.
    pub clocks: Vec<SteppableClock>,
    /// With the clock-step-arbiter fault: arbiter i's clock (kept across
    /// its restarts, as a machine's clock would be).
    pub arbiter_clocks: Vec<SteppableClock>,
    pub dir: PathBuf,
}

impl Rig {
    pub(crate) async fn start_arbiter(&self, i: usize) -> anyhow::Result<ArbiterProcess> {
        let endpoints = self.cluster.lock().await.endpoints();
        let opts = ArbiterOptions {
            state_dir: Some(self.arbiter_state[i].clone()),
            ..self.arbiter_opts.clone()
        };
        let env = self.arbiter_clocks.get(i).map(SteppableClock::env);
        ArbiterProcess::start_with_env(
            &self.binaries.arbiter,
            &endpoints,
            Some(self.arbiter_addrs[i]),
            opts,
            "info,latchkey_arbiter=info",
            &[],
            env.as_deref().unwrap_or_default(),
        )
        .await
    }

    /// A worker that is inside a hold right now (its last history line is a
    /// successful acquire), as (name, pid, slot).
    pub(crate) async fn holding_worker(&self) -> Option<(String, u32, usize)> {
        let workers = self.workers.lock().await;
        // From a random worker on, so electors (last) are caught too.
        let from = fastrand::usize(..workers.len().max(1));
        let (head, tail) = workers.split_at(from.min(workers.len()));
        for w in tail.iter().chain(head) {
            let Some(child) = &w.child else { continue };
            let name = w.name();
            let path = self.dir.join(format!("{name}.jsonl"));
            if last_line_is_grant(&path) {
                return Some((name, child.id(), w.index));
            }
        }
        None
    }
}

impl Worker {
    fn name(&self) -> String {
        format!("w{}.{}", self.index, self.incarnation)
    }
}

fn last_line_is_grant(path: &Path) -> bool {
    let Some(text) = tail(path, 4096) else {
        return false;
    };
    let Some(last) = text.lines().last() else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(last) else {
        return false;
    };
    if v["type"] != "complete" || v["outcome"] != "ok" || v["token"].is_null() {
        return false;
    }
    // A completed acquire is the only completion carrying a token.
    true
}

/// The last `bytes` of a file (whole lines after the first newline when cut).
fn tail(path: &Path, bytes: u64) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let from = len.saturating_sub(bytes);
    file.seek(SeekFrom::Start(from)).ok()?;
    let mut buf = Vec::new();
    file.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    if from == 0 {
        Some(text)
    } else {
        text.split_once('\n').map(|(_, rest)| rest.to_owned())
    }
}

/// The coord cluster: one etcd, or (with the coord faults) three members
/// in network namespaces.
pub enum CoordEtcd {
    Single(EtcdServer),
    Cluster(EtcdCluster),
}

impl CoordEtcd {
    fn endpoints(&self) -> Vec<String> {
        match self {
            CoordEtcd::Single(s) => vec![s.endpoint()],
            CoordEtcd::Cluster(c) => c.endpoints(),
        }
    }

    pub(crate) async fn snapshot_save(&self, path: &Path) -> anyhow::Result<()> {
        match self {
            CoordEtcd::Single(s) => s.snapshot_save(path).await,
            CoordEtcd::Cluster(c) => c.snapshot_save(path).await,
        }
    }
}

/// Runs one gate and checks its history.
pub async fn run(config: GateConfig) -> anyhow::Result<GateOutcome> {
    if config.workers == 0 || config.keys == 0 || config.arbiters == 0 {
        bail!("the gate needs at least one worker, key and arbiter");
    }
    let dir = tempfile::Builder::new()
        .prefix("latchkey-gate-")
        .tempdir()?;
    let history_dir = dir.path().join("history");
    std::fs::create_dir_all(&history_dir)?;
    let stop_file = dir.path().join("stop");

    let cluster = if config.faults.contains(&Fault::SlowDiskMember) {
        EtcdCluster::start_with_stallable_disks(ClusterOptions::default()).await
    } else {
        EtcdCluster::start(ClusterOptions::default()).await
    }
    .context("starting the 3-member etcd cluster")?;
    // The witness outside the lock cluster: what lets an arbiter that lost
    // its state dir tell that the lock cluster was restored (restore-forget).
    // With the coord faults, three members in network namespaces of their
    // own, so a partition and a leader's pause are real there too.
    let coord = if config.faults.iter().any(|f| Fault::COORD.contains(f)) {
        CoordEtcd::Cluster(
            EtcdCluster::start(ClusterOptions::default())
                .await
                .context("starting the 3-member coord etcd cluster")?,
        )
    } else {
        CoordEtcd::Single(
            EtcdServer::start()
                .await
                .context("starting the coord etcd")?,
        )
    };
    let coord_tier_witness = EtcdServer::start()
        .await
        .context("starting the coord tier's witness etcd")?;
    let shard_b = match config.faults.contains(&Fault::ShardMove) {
        true => Some(
            EtcdServer::start()
                .await
                .context("starting the second shard's etcd")?,
        ),
        false => None,
    };
    let postgres = PostgresServer::start()
        .await
        .context("starting PostgreSQL")?;
    {
        let pg = postgres.client().await?;
        latchkey_fence_postgres::ensure_schema(&pg).await?;
    }
    let fence_stores = match config.fence_rotation {
        true => Some(stores::FenceStores::start(&postgres).await?),
        false => None,
    };
    let policies = dir.path().join("policies");
    write_policies(&policies, config.workers, config.electors)?;
    issue_worker_svids(config.workers, config.electors)?;

    let arbiter_opts = ArbiterOptions {
        policies_dir: policies.clone(),
        retry_poll: Duration::from_millis(500),
        test_fault: config.arbiter_test_fault,
        coord: Some(Coord {
            endpoints: coord.endpoints(),
            prefix: None,
            lock_cluster_name: None,
            split_tiers: true,
            coord_tier_witness: vec![coord_tier_witness.endpoint()],
        }),
        ..ArbiterOptions::default()
    };
    let mut addrs = Vec::new();
    let mut states = Vec::new();
    let mut arbiter_disks = Vec::new();
    for i in 0..config.arbiters {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        addrs.push(l.local_addr()?);
        if config.faults.contains(&Fault::SlowDiskArbiter) {
            let disk = StallableDir::mount(
                &dir.path().join(format!("arbiter-{i}.disk")),
                &dir.path().join(format!("arbiter-{i}")),
            )
            .with_context(|| format!("a stallable disk for arbiter-{i}"))?;
            states.push(disk.path().join("state"));
            arbiter_disks.push(disk);
        } else {
            states.push(dir.path().join(format!("arbiter-{i}")));
        }
    }
    let mut clocks = Vec::new();
    if config.faults.contains(&Fault::ClockStep) {
        std::fs::create_dir_all(dir.path().join("clocks"))?;
        for i in 0..config.workers + config.electors {
            clocks.push(SteppableClock::new(
                &dir.path().join(format!("clocks/w{i}")),
            )?);
        }
    }
    let mut arbiter_clocks = Vec::new();
    if config.faults.contains(&Fault::ClockStepArbiter) {
        std::fs::create_dir_all(dir.path().join("clocks"))?;
        for i in 0..config.arbiters {
            arbiter_clocks.push(SteppableClock::new(
                &dir.path().join(format!("clocks/arbiter-{i}")),
            )?);
        }
    }
    let rig = Arc::new(Rig {
        cluster: Mutex::new(cluster),
        arbiters: Mutex::new(Vec::new()),
        arbiter_addrs: addrs,
        arbiter_state: states,
        arbiter_opts,
        coord: tokio::sync::Mutex::new(coord),
        _coord_tier_witness: coord_tier_witness,
        _shard_b: shard_b,
        arbiter_disks,
        binaries: config.binaries.clone(),
        workers: Mutex::new(Vec::new()),
        clocks: clocks.clone(),
        arbiter_clocks,
        dir: history_dir.clone(),
    });
    for i in 0..config.arbiters {
        let a = rig.start_arbiter(i).await?;
        rig.arbiters.lock().await.push(Some(a));
    }

    let keys: Vec<String> = (0..config.keys)
        .map(|k| format!("bench/gate/k{k}"))
        .collect();
    // With the quorum-loss fault a quarter of the workers use the open
    // class on keys of their own, their histories apart (quorum_loss.rs).
    let open_from = match config.faults.contains(&Fault::QuorumLoss) && config.workers >= 2 {
        true => config.workers - (config.workers / 4).max(1),
        false => config.workers,
    };
    let open_keys: Vec<String> = (0..(config.keys / 4).max(2))
        .map(|k| format!("bench/gate/open/k{k}"))
        .collect();
    // A quarter of the others use the durable class on keys of their own,
    // in the same history: every fault meets durable waiters too.
    let durable_workers = match open_from {
        0..=2 => 0,
        n => (n / 4).max(1),
    };
    let durable_from = open_from - durable_workers;
    // A quarter of the rest lock coord-tier keys on the coord cluster.
    let coord_workers = match durable_from {
        0..=3 => 0,
        n => (n / 4).max(1),
    };
    let coord_from = durable_from - coord_workers;
    // Three of the rest contend for a semaphore's two permits.
    let semaphore_workers = match coord_from {
        0..=4 => 0,
        _ => 3,
    };
    let semaphore_from = coord_from - semaphore_workers;
    let semaphore_keys: Vec<String> = vec!["bench/gate/semaphore/s0".to_string()];
    let coord_keys: Vec<String> = (0..(config.keys / 4).max(2))
        .map(|k| format!("{COORD_NAMESPACE}/gate/k{k}"))
        .collect();
    let durable_keys: Vec<String> = (0..(config.keys / 4).max(2))
        .map(|k| format!("bench/gate/durable/k{k}"))
        .collect();
    let mut judged_keys: Vec<String> = keys.clone();
    if durable_workers > 0 {
        judged_keys.extend(durable_keys.iter().cloned());
    }
    if coord_workers > 0 {
        judged_keys.extend(coord_keys.iter().cloned());
    }
    if semaphore_workers > 0 {
        judged_keys.extend(semaphore_keys.iter().cloned());
    }
    let election_keys: Vec<String> = (0..2)
        .map(|e| format!("{ELECTION_NAMESPACE}/gate/e{e}"))
        .collect();
    if config.electors > 0 {
        judged_keys.extend(election_keys.iter().cloned());
    }
    let open_history_dir = history_dir.join("open");
    std::fs::create_dir_all(&open_history_dir)?;
    let mut rng = fastrand::Rng::with_seed(config.seed);
    {
        let mut workers = rig.workers.lock().await;
        for index in 0..config.workers + config.electors {
            workers.push(Worker {
                index,
                incarnation: 0,
                child: None,
                seed: rng.u64(..),
                arbiter: index % config.arbiters,
            });
        }
    }
    let spawn = WorkerSpawn {
        binary: config.binaries.worker.clone(),
        keys: keys.join(","),
        open_keys: open_keys.join(","),
        open_from,
        durable_keys: durable_keys.join(","),
        durable_from,
        coord_keys: coord_keys.join(","),
        semaphore_keys: semaphore_keys.join(","),
        semaphore_from,
        coord_from,
        election_keys: election_keys.join(","),
        elect_from: config.workers,
        open_history_dir: open_history_dir.clone(),
        postgres: postgres.url(),
        fence_stores: fence_stores
            .as_ref()
            .map(|f| (f.urls.join(" "), f.env.clone())),
        history_dir: history_dir.clone(),
        stop_file: stop_file.clone(),
        addrs: rig.arbiter_addrs.clone(),
        log_dir: dir.path().to_path_buf(),
        clocks,
        unit_ms: u64::try_from(config.unit_of_work.as_millis())?,
        wait_ms: u64::try_from(config.wait.as_millis())?,
    };
    let spool_collector = quorum_loss::spawn_collector(Arc::clone(&rig));
    let workload_started = tokio::time::Instant::now();
    let mut restarts = 0usize;
    {
        let mut workers = rig.workers.lock().await;
        for w in workers.iter_mut() {
            spawn.start(w)?;
        }
    }

    // Keep the workers going: a tainted or crashed incarnation is replaced.
    let supervisor = {
        let rig = Arc::clone(&rig);
        let spawn = spawn.clone();
        tokio::spawn(async move {
            let mut restarted = 0usize;
            let mut crashes = 0usize;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if spawn.stop_file.exists() {
                    return Ok::<_, anyhow::Error>(restarted);
                }
                let mut workers = rig.workers.lock().await;
                for w in workers.iter_mut() {
                    let Some(child) = w.child.as_mut() else {
                        continue;
                    };
                    if let Some(status) = child.try_wait()? {
                        match status.code() {
                            Some(worker::EXIT_TAINTED) => {}
                            _ => {
                                crashes += 1;
                                if crashes > 20 {
                                    bail!(
                                        "gate workers keep failing (last: {} exited {status}); see {}",
                                        w.name(),
                                        spawn.log_dir.display()
                                    );
                                }
                            }
                        }
                        w.child = None;
                        w.incarnation += 1;
                        w.seed = w.seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                        spawn.start(w)?;
                        restarted += 1;
                    }
                }
            }
        })
    };

    // The nemesis, then the stop.
    let faults = nemesis::run(&rig, &config, &mut rng, &history_dir).await;
    let recovered_after = if faults.is_ok() {
        wait_for_recovery(&history_dir, &judged_keys).await
    } else {
        None
    };
    std::fs::write(&stop_file, b"stop")?;
    match supervisor.await? {
        Ok(n) => restarts += n,
        Err(e) => return Err(e),
    }
    {
        let mut workers = rig.workers.lock().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        for w in workers.iter_mut() {
            if let Some(mut child) = w.child.take() {
                loop {
                    if child.try_wait()?.is_some() {
                        break;
                    }
                    if tokio::time::Instant::now() > deadline {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    let workload_time = workload_started.elapsed();
    let faults = faults?;

    // Merge and judge.
    let merged = dir.path().join("history.jsonl");
    let operations = merge_histories(&history_dir, &merged)?;
    let history = History::from_jsonl(std::io::BufReader::new(std::fs::File::open(&merged)?))
        .with_context(|| format!("parsing {}", merged.display()))?;
    let longest_without_grant = longest_without_grant(&history);
    let modes = ModeCounts::of(&history);
    let stores = stores::writes_by_store(&history);
    drop(spool_collector);
    quorum_loss::collect_all(&rig, false)?;
    let unprotected = quorum_loss::unprotected_grants(&open_history_dir, |process| {
        let index = process.strip_prefix('w')?.split('.').next()?.parse().ok()?;
        Some(latchkey_tests::arbiter::spiffe(&identity_of(
            index,
            config.workers,
        )))
    })?;
    let spooled = quorum_loss::spooled_grants(&history_dir, &rig.arbiter_state)?;
    let unspooled = quorum_loss::unspooled(&unprotected, &spooled);
    let checking = std::time::Instant::now();
    let report = latchkey_checker::check(&history, &CheckOptions::default());
    let check_time = checking.elapsed();
    let saved = if report.ok() && unspooled.is_empty() && recovered_after.is_some() && !config.keep
    {
        None
    } else {
        let keep = config
            .out_dir
            .join(format!("gate-seed-{}-{}", config.seed, std::process::id()));
        std::fs::create_dir_all(&keep)?;
        std::fs::copy(&merged, keep.join("history.jsonl"))?;
        std::fs::write(keep.join("report.txt"), report.to_string())?;
        std::fs::write(
            keep.join("report.json"),
            serde_json::to_vec_pretty(&report)?,
        )?;
        for entry in std::fs::read_dir(dir.path())? {
            let entry = entry?;
            let name = entry.file_name();
            if name.to_string_lossy().ends_with(".log") {
                let _ = std::fs::copy(entry.path(), keep.join(name));
            }
        }
        Some(keep)
    };
    drop(rig);
    drop(fence_stores);
    drop(postgres);
    Ok(GateOutcome {
        report,
        faults,
        operations,
        worker_restarts: restarts,
        workload_time,
        check_time,
        recovered_after,
        longest_without_grant,
        saved,
        unprotected_grants: unprotected.len(),
        unspooled,
        modes,
        stores,
    })
}

#[derive(Clone)]
struct WorkerSpawn {
    binary: PathBuf,
    keys: String,
    /// Workers from this index on use the open class (quorum-loss fault).
    open_keys: String,
    open_from: usize,
    /// Workers from this index up to `open_from` use the durable class.
    durable_keys: String,
    durable_from: usize,
    /// Workers from this index up to `durable_from` use the coord class.
    coord_keys: String,
    coord_from: usize,
    /// Workers from this index up to `coord_from` use the semaphore class.
    semaphore_keys: String,
    semaphore_from: usize,
    /// Workers from this index on are electors.
    election_keys: String,
    elect_from: usize,
    open_history_dir: PathBuf,
    postgres: String,
    /// The worker's `--fence-stores` (by environment) and the S3 adapter's
    /// credentials, when the writes rotate through every adapter.
    fence_stores: Option<(String, Vec<(String, String)>)>,
    history_dir: PathBuf,
    stop_file: PathBuf,
    addrs: Vec<std::net::SocketAddr>,
    log_dir: PathBuf,
    clocks: Vec<SteppableClock>,
    unit_ms: u64,
    wait_ms: u64,
}

impl WorkerSpawn {
    fn start(&self, w: &mut Worker) -> anyhow::Result<()> {
        let name = w.name();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join(format!("worker-{}.log", w.index)))?;
        let elect = w.index >= self.elect_from;
        let (keys, class, history) = if elect {
            (&self.election_keys, ELECTION_CLASS, &self.history_dir)
        } else if w.index >= self.open_from {
            (
                &self.open_keys,
                quorum_loss::OPEN_CLASS,
                &self.open_history_dir,
            )
        } else if w.index >= self.durable_from {
            (&self.durable_keys, DURABLE_CLASS, &self.history_dir)
        } else if w.index >= self.coord_from {
            (&self.coord_keys, COORD_CLASS, &self.history_dir)
        } else if w.index >= self.semaphore_from {
            (&self.semaphore_keys, SEMAPHORE_CLASS, &self.history_dir)
        } else {
            (&self.keys, CLASS, &self.history_dir)
        };
        let semaphore = !elect && class == SEMAPHORE_CLASS;
        let plain = !elect && class == CLASS;
        let mut command = Command::new(&self.binary);
        if let Some(clock) = self.clocks.get(w.index) {
            command.envs(clock.env());
        }
        if let Some((urls, env)) = &self.fence_stores {
            command
                .env("LATCHKEY_GATE_FENCE_STORES", urls)
                .envs(env.iter().map(|(k, v)| (k, v)));
        }
        let child = command
            .arg("--arbiter")
            .arg(format!("https://{}", self.addrs[w.arbiter]))
            .args(svid_flags(&identity_of(w.index, self.elect_from))?)
            .arg("--keys")
            .arg(keys)
            .arg("--class")
            .arg(class)
            .arg("--postgres")
            .arg(&self.postgres)
            .arg("--history")
            .arg(history.join(format!("{name}.jsonl")))
            .arg("--process")
            .arg(&name)
            .arg("--seed")
            .arg(w.seed.to_string())
            .arg("--stop-file")
            .arg(&self.stop_file)
            .arg("--unit-ms")
            .arg(self.unit_ms.to_string())
            .arg("--wait-ms")
            .arg(self.wait_ms.to_string())
            .args(elect.then_some("--elect"))
            .args(
                semaphore
                    .then(|| ["--permits".to_string(), SEMAPHORE_PERMITS.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .args(
                plain
                    .then(|| ["--shared-every".to_string(), SHARED_EVERY.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawn {}", self.binary.display()))?;
        w.child = Some(child);
        Ok(())
    }
}

/// How long the gate waits, once the nemesis stopped, for every key to be
/// granted again.
pub const RECOVERY_TIMEOUT: Duration = Duration::from_secs(60);

/// Waits until every key has a successful acquire that completed after now
/// (the nemesis has stopped and healed everything); how long that took.
async fn wait_for_recovery(history_dir: &Path, keys: &[String]) -> Option<Duration> {
    let since = record::mono_ns();
    let started = tokio::time::Instant::now();
    while started.elapsed() < RECOVERY_TIMEOUT {
        let granted = granted_keys_since(history_dir, since);
        if keys.iter().all(|k| granted.contains(k)) {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let granted = granted_keys_since(history_dir, since);
    let missing: Vec<&String> = keys.iter().filter(|k| !granted.contains(*k)).collect();
    tracing::warn!(?missing, "not granted again after the last fault");
    eprintln!(
        "gate: not granted again within {RECOVERY_TIMEOUT:?} after the last fault: {missing:?}"
    );
    None
}

/// Keys with an acquire that completed ok after `since`, from the tails of
/// the history files.
fn granted_keys_since(history_dir: &Path, since: u64) -> std::collections::BTreeSet<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut granted = std::collections::BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(history_dir) else {
        return granted;
    };
    for entry in entries.flatten() {
        let Ok(mut file) = std::fs::File::open(entry.path()) else {
            continue;
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(256 * 1024)));
        let mut text = String::new();
        if file.read_to_string(&mut text).is_err() {
            continue;
        }
        // The key is on the invoke line; the token on the completion.
        let mut keys_of_ops: BTreeMap<u64, String> = BTreeMap::new();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let op = v["op"].as_u64().unwrap_or(0);
            if v["type"] == "invoke" && v["f"] == "acquire" {
                if let Some(key) = v["key"].as_str() {
                    keys_of_ops.insert(op, key.to_owned());
                }
            } else if v["type"] == "complete"
                && v["outcome"] == "ok"
                && v["time"].as_u64().unwrap_or(0) > since
                && let Some(key) = keys_of_ops.get(&op)
            {
                granted.insert(key.clone());
            }
        }
    }
    granted
}

/// The longest gap between successive successful acquires, from the
/// history's first event to its last.
fn longest_without_grant(history: &History) -> Duration {
    let ops = history.ops();
    let first = history.start_time();
    let last = ops
        .iter()
        .map(|o| o.complete_time().unwrap_or(o.invoke_time))
        .max()
        .unwrap_or(first);
    let mut grants: Vec<u64> = ops
        .iter()
        .filter(|o| o.f == latchkey_checker::Function::Acquire && o.is_ok())
        .filter_map(|o| o.complete_time())
        .collect();
    grants.sort_unstable();
    let mut previous = first;
    let mut longest = 0;
    for t in grants.into_iter().chain([last]) {
        longest = longest.max(t.saturating_sub(previous));
        previous = t;
    }
    Duration::from_nanos(longest)
}

/// Concatenates every process's history, ordered by time, into `out`;
/// returns the number of lines.
fn merge_histories(dir: &Path, out: &Path) -> anyhow::Result<usize> {
    let mut lines: Vec<(u64, String)> = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "jsonl") {
            for line in std::fs::read_to_string(&path)?.lines() {
                if line.trim().is_empty() {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(line)
                    .with_context(|| format!("{}: not JSON: {line}", path.display()))?;
                lines.push((v["time"].as_u64().unwrap_or(0), line.to_owned()));
            }
        }
    }
    lines.sort_by_key(|(t, _)| *t);
    let mut text = String::new();
    for (_, line) in &lines {
        text.push_str(line);
        text.push('\n');
    }
    std::fs::write(out, text)?;
    Ok(lines.len())
}

/// Workers that run as replicas of one workload: the first
/// `REPLICA_GROUPS * REPLICAS` workers share an identity in groups of
/// `REPLICAS` (separate processes, one SVID, as the pods of one Deployment
/// do, issue 30); each names itself as its own client instance, so they
/// contend like any workers and the checker judges them alike.
const REPLICA_GROUPS: usize = 2;
const REPLICAS: usize = 3;

/// Worker `index`'s SPIFFE name: a replica group's shared one, or its own.
fn identity_of(index: usize, workers: usize) -> String {
    if index >= workers {
        ELECTOR_IDENTITY.to_string()
    } else if index < REPLICA_GROUPS * REPLICAS {
        format!("workload/gate-replicas-{}", index / REPLICAS)
    } else {
        format!("workload/gate-{index}")
    }
}

/// The distinct identities of `workers` workers, in worker order.
fn worker_identities(workers: usize, electors: usize) -> Vec<String> {
    let mut names: Vec<String> = (0..workers + electors)
        .map(|i| identity_of(i, workers))
        .collect();
    names.dedup();
    names
}

/// Issues the workers' SVIDs from the test trust domain's CA.
fn issue_worker_svids(workers: usize, electors: usize) -> anyhow::Result<()> {
    let names = worker_identities(workers, electors);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    latchctl::dev_certs::generate(&certs()?.dir, latchkey_tests::arbiter::TRUST_DOMAIN, &names)?;
    Ok(())
}

/// The gate's policy directory: one fenced class with a short TTL and a
/// grant on `bench/gate` for every worker.
fn write_policies(dir: &Path, workers: usize, electors: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("classes"))?;
    std::fs::create_dir_all(dir.join("grants"))?;
    std::fs::write(
        dir.join("classes/gate.toml"),
        format!(
            "[[class]]\nname = \"{CLASS}\"\ndescription = \"Release gate workload\"\ntier = \"entity\"\n\
             enforcement = \"fenced\"\nttlSeconds = {}\n\
             [class.pauseTest]\nresource = \"{GATE_RESOURCE}\"\nresult = \"pause-tests/{CLASS}.json\"\n",
            TTL.as_secs()
        ),
    )?;
    let mut grants = String::new();
    for name in worker_identities(workers, electors) {
        grants.push_str(&format!(
            "[[grant]]\nidentity = \"{}\"\nprefixes = [\"bench/gate\", \"{COORD_NAMESPACE}\", \"{ELECTION_NAMESPACE}\"]\n\n",
            latchkey_tests::arbiter::spiffe(&name)
        ));
    }
    grants.push_str(&format!(
        "[[operator]]\nidentity = \"{}\"\n",
        latchkey_tests::arbiter::spiffe("latchkey/operator")
    ));
    std::fs::write(dir.join("grants/gate.toml"), grants)?;
    std::fs::write(
        dir.join("classes/gate-open.toml"),
        quorum_loss::open_class_toml(),
    )?;
    std::fs::write(
        dir.join("classes/gate-durable.toml"),
        format!(
            "[[class]]\nname = \"{DURABLE_CLASS}\"\ndescription = \"Release gate workload, durable waiters\"\n\
             tier = \"entity\"\nenforcement = \"fenced\"\nttlSeconds = {}\nfairness = \"durable\"\n\
             [class.pauseTest]\nresource = \"{GATE_RESOURCE}\"\nresult = \"pause-tests/{DURABLE_CLASS}.json\"\n",
            TTL.as_secs()
        ),
    )?;
    std::fs::write(
        dir.join("classes/gate-leader.toml"),
        format!(
            "[[class]]\nname = \"{COORD_CLASS}\"\ndescription = \"Release gate workload on the coord tier\"\n\
             tier = \"coord\"\nnamespaces = [\"{COORD_NAMESPACE}\"]\nenforcement = \"fenced\"\nttlSeconds = {}\n\
             [class.pauseTest]\nresource = \"{GATE_RESOURCE}\"\nresult = \"pause-tests/{COORD_CLASS}.json\"\n",
            TTL.as_secs()
        ),
    )?;
    std::fs::write(
        dir.join("classes/gate-semaphore.toml"),
        format!(
            "[[class]]\nname = \"{SEMAPHORE_CLASS}\"\ndescription = \"Release gate semaphore\"\n\
             kind = \"semaphore\"\npermits = {SEMAPHORE_PERMITS}\ntier = \"entity\"\n\
             enforcement = \"fenced\"\nttlSeconds = {}\n\
             [class.pauseTest]\nresource = \"{GATE_RESOURCE}\"\nresult = \"pause-tests/{SEMAPHORE_CLASS}.json\"\n",
            TTL.as_secs()
        ),
    )?;
    std::fs::write(
        dir.join("classes/gate-election.toml"),
        format!(
            "[[class]]\nname = \"{ELECTION_CLASS}\"\ndescription = \"Release gate elections\"\n\
             kind = \"election\"\ntier = \"coord\"\nnamespaces = [\"{ELECTION_NAMESPACE}\"]\n\
             enforcement = \"fenced\"\nttlSeconds = {}\n\
             [class.pauseTest]\nresource = \"{GATE_RESOURCE}\"\nresult = \"pause-tests/{ELECTION_CLASS}.json\"\n",
            TTL.as_secs()
        ),
    )?;
    // The fixture only lets the arbiter load the class: the gate's own
    // fence check is the evidence here.
    latchkey_tests::write_pause_test_fixtures(dir)?;
    Ok(())
}
