//! The deterministic simulation (issue 11): the arbiter's real grant
//! protocol ([`LockTable`](latchkey_arbiter::table::LockTable)) over the
//! in-memory log, driven by seeded clients and a seeded nemesis under
//! tokio's paused clock, its history judged by `latchkey-checker`.
//!
//! **World.** One [`MemLog`] (the "etcd"), [`SimConfig::arbiters`] lock
//! tables sharing it, [`SimConfig::clients`] workers. Each worker is a
//! process in the checker's sense, with incarnations `w3.1`, `w3.2`, ...:
//! an incarnation opens a session (TTL 5 s) through any arbiter, renews it
//! from a task of its own, and loops: acquire a random key through the
//! key's home arbiter (a stable hash, as the edge's ring hash routes;
//! sometimes another), try-lock or waiting with a budget, sometimes
//! cancelled (the acquire future dropped), some with a short budget that
//! runs out about when the key is handed over; after a `WAIT_TIMEOUT` the
//! client usually asks for the same key again on the same session, at once
//! or a few milliseconds later, as a client's retry loop does (so a grant
//! that committed for the call that timed out meets that session's next
//! call); hold it for a unit of work,
//! write through a fenced resource (accepts only a strictly higher token
//! per key), release. Outcomes follow the gate exactly (`ok`, `fail` for the
//! arbiter's definite refusals, `unknown` for everything else); after an
//! unknown acquire or a release that did not succeed, the incarnation
//! records an `expire` at its session's fence deadline and ends. Crashed
//! holders (renewals stop, the hold expires) and frozen holders (no
//! renewals for longer than the TTL, then a write with a stale token) are
//! knobs of [`FaultKnobs`].
//!
//! **Nemesis.** One fault at a time, every 0.5–1.5 × [`FaultKnobs::fault_gap_ms`]:
//! windows of log faults (calls failing before they commit, answers lost
//! after a commit, delayed commits), windows of a slow log (most calls
//! delayed, none failing), arbiter restarts (calls in flight cut off, the
//! table shut down, a new table on the same log after a moment, keeping
//! its high-water mark), compaction and broken watch streams, and restore +
//! advance: one of the last few snapshots (often one taken before an
//! earlier restore and advance, or right after a restore) is restored with
//! the same or a new cluster id, and as soon as one arbiter has sealed the
//! operator advances the epoch through one arbiter, retrying until it is
//! done (recorded as the gate records it: a `fault` op around an `advance`
//! op). Now and then one arbiter is cut off from every caller before the
//! restore, once it is quiet, and reconnected only after the advance: it
//! notices the restore late, in the advanced epoch. A restore comes only
//! while the service serves (an acquire succeeded within the last second,
//! after the last advance).
//!
//! **Witness (issue 15).** With one cluster the arbiters' state dirs are
//! the only memory of the tokens handed out: a restore with the same
//! cluster id after EVERY arbiter has lost its state dir can re-issue
//! tokens, nothing that remembers the higher revisions being left. So
//! without a witness, restarts keep the state dir by default and losing
//! it ([`FaultKnobs::lose_state_percent`]) is only combined with restores
//! to show that limit (the `unwitnessed-state-loss` preset fails).
//! With [`SimConfig::witness`] every table is built with one shared
//! [`MemWitness`] (the coord cluster): the
//! mark is read before every grant and raised before every token is
//! handed out, and epochs are allocated from it, so the `witnessed`
//! presets lose state dirs at restarts, wipe every arbiter's state right
//! after a restore ([`FaultKnobs::wipe_on_restore_percent`]), and bring
//! an arbiter that was idle before the restore back right after it
//! ([`FaultKnobs::idle_percent`]), and must stay safe. The log-fault and
//! slow-log windows hit the witness too ([`FaultKnobs::witness_faults`]).
//!
//! **Restores of the coord cluster.** The lock log witnesses the coord
//! cluster in turn (its `sys/coord-seen` record), so the witnessed presets
//! restore the witness too ([`FaultKnobs::coord_restore_percent`]). Every
//! backup the nemesis keeps is a pair: the lock log's snapshot and the
//! witness's, taken at one instant. A restore of the coord cluster is
//! either the witness alone, from a kept pair (the lock log untouched), or
//! both, the lock log from one pair and the witness from another, taken at
//! a different time; either with the isolated, idle and wiped arbiters a
//! restore of the lock log has, and the same wait for a seal and advance
//! (a restore of the witness that lost nothing the arbiters or the lock log
//! knew of need not seal: the operator advances anyway after 20 s). The
//! witness is only restored to a backup that shows less than it does now.
//! Both are drawn only where the design guarantees the restore is noticed
//! and the advance goes above every epoch used, judged from the two
//! backups' contents: the witness's backup vouched for a grant the lock
//! log's does not hold, or it is older by a vouched grant and below what
//! the lock log's coord-seen record shows; and one of the two still knows
//! the serving epoch. Both from one moment (a consistent past: only state
//! dirs remember what came after) are undetectable by design and never
//! drawn. Each restore's fault completes with the seal reasons the operator
//! saw ([`SimRun::coord_restores`] counts those naming the coord cluster).
//!
//! **Shard-map fences (ADR-09).** With [`FaultKnobs::map_fences`] the
//! nemesis also plays a shard move's fence: it picks some arbiters to stay
//! on the old shard map, moves the others to a new version, raises the lock
//! log's fence (`sys/shardmap`) to it, and after one to four seconds lets
//! the ones behind load the map too. No grant through an arbiter behind the
//! fence may commit after the raise did ([`SimRun::fences`], judged here:
//! the checker knows nothing of maps); the others go on granting, and the
//! ones behind grant again once caught up.
//!
//! **Force-releases (issue 32).** With [`FaultKnobs::force_releases`]
//! "operators" beside the nemesis read a key's hold every 0.1–0.5 s and end
//! it a moment later through an arbiter's table (`force_end`, naming the
//! lease and revision read), recorded as an `expire` of that grant for the
//! process it was granted to ([`SimRun::forced`]). A hold released, handed
//! over or granted again in between must be left alone, or its holder and
//! the next client hold the key together and the checker says so. Some
//! approvals also revoke the holder's session through the key's owner
//! ([`FaultKnobs::force_revokes_percent`]), every hold still on it recorded
//! as an `expire` first.
//!
//! **Batches.** Every log call takes a round trip of 1–2 ms
//! ([`SimConfig::log_latency`]), so grants and releases that arrive while
//! a batch is in flight go together as the next one (group commit,
//! `latchkey_arbiter::table`): the log-fault windows lose whole batches'
//! answers, a try-lock on a held key shares a batch with grants that
//! commit, and half the restores wait a moment for a batch of several
//! members on its way to the log and land under it. [`SimRun::batches`]
//! and [`SimRun::log_batches`] count them; the CI test checks that its
//! seeds meet each.
//!
//! **Liveness.** Grants must not stop: if clients keep trying and no
//! acquire succeeds within [`LIVENESS_WINDOW`] of simulated time after the
//! last grant or the last advance, whichever is later (no restore waiting
//! for its advance), or no advance completes within two minutes of a
//! restore, the run is [`SimRun::stuck`]. So an advance whose epoch never
//! serves, and a seal written after an advance (an arbiter that noticed
//! the restore late), both fail the run: no restore comes until the
//! service serves again, and a run that has its operations goes on until
//! an acquire succeeded within the last five seconds.
//!
//! **Determinism.** Everything runs on one current-thread runtime with
//! paused time: no real time, no threads, every random choice from the
//! seed (the tables' poll jitter included), every `select!` biased, no
//! hash-map order in a decision, and the arbiter's randomly drawn session
//! ids mapped to counted ones before they reach the store
//! (`idlog`), and the log's watch wake-ups put in a fixed order
//! (`ordered`). The same seed gives the same history, byte for byte.
//! `LATCHKEY_SIM_TRACE=<file>` writes every log call of a run (simulated
//! time, revision, call) for debugging a seed.

mod clusters;
mod config;
pub(crate) mod elections;
mod fences;
mod idlog;
mod memory;
mod nemesis;
mod operators;
mod ordered;
mod policies;
mod shards;
mod tiers;
mod worker;
mod world;

use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::table::BatchStats;
use latchkey_arbiter::table::durable::DurableStats;
use latchkey_arbiter::witness::{Witness, Witnessed};
use latchkey_checker::{CheckOptions, History, Operation, Report};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::memlog::{BatchCounts, FaultCounts, FaultRates, MemLog, MemLogConfig};
use crate::rng::Rng;
use crate::witness::{MemWitness, WitnessCalls};
pub use config::{FaultKnobs, PRESETS, QUOTA_SUBJECT, SimConfig};
pub use elections::ElectionReport;
pub use fences::FenceReport;
pub use memory::MemoryReport;
pub use nemesis::{COORD_RESTORE, LIVENESS_WINDOW};
use world::{World, lock};

/// What a run produced.
#[derive(Debug)]
pub struct SimRun {
    pub seed: u64,
    pub history: History,
    /// Operations in the history.
    pub ops: usize,
    pub report: Report,
    /// A liveness failure: grants did not resume after an advance, an
    /// advance never completed, or the run never reached its operations.
    pub stuck: Option<String>,
    /// The history breaks a rule the checker relies on (read back from its
    /// JSON lines, as `latchkey-gate --check` would).
    pub invalid_history: Option<String>,
    /// Simulated time the run took.
    pub simulated: Duration,
    pub log_faults: FaultCounts,
    /// What the witness was asked, when the run had one.
    pub witness: Option<WitnessReport>,
    /// The tables' batches, added up over every arbiter incarnation.
    pub batches: BatchStats,
    /// What befell the batches of more than one member in the log.
    pub log_batches: BatchCounts,
    /// The durable waiters, added up over every arbiter incarnation.
    pub durable: DurableStats,
    /// The shard-map fences raised and what they stopped.
    pub fences: FenceReport,
    /// The forced ends of holds and how they ended.
    pub forced: ForcedEnds,
    /// The grants from memory during quorum losses, and what they broke.
    pub memory: MemoryReport,
    /// The leaderships of the electors, and what they broke.
    pub elections: ElectionReport,
    /// The entity shards: grants on them, and the moves finished.
    pub shards: ShardReport,
    /// Commits after which a grant subject held more keys of the quota
    /// class than [`SimConfig::quota`] (the log's state, counted at every
    /// commit).
    pub quota_violations: Vec<String>,
    pub notes: Vec<String>,
}

/// The entity shards of a run ([`SimConfig::shards`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShardReport {
    /// Grants answered (through the log).
    pub grants: usize,
    /// Of them, grants of keys homed on another shard than the lock
    /// cluster (by the map when each was answered): held on the session's
    /// shadow there.
    pub elsewhere: usize,
    /// Moves of ranges to an added shard that finished.
    pub moves: usize,
}

/// Two-person force-releases in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ForcedEnds {
    /// Ended the hold they named.
    pub ended: u64,
    /// Found the hold changed since it was read (released, handed over,
    /// granted again): nothing ended.
    pub changed: u64,
    /// Forced ends whose approval also revoked the holder's session, and
    /// it ended then ([`FaultKnobs::force_revokes_percent`]).
    pub revoked: u64,
}

/// The restores of the coord cluster in a run (faults whose description
/// names [`COORD_RESTORE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CoordRestores {
    /// The coord cluster alone, the lock log untouched.
    pub alone: usize,
    /// Both, from backups taken at different times.
    pub with_the_log: usize,
    /// Of all of them, those an arbiter sealed on for the coord cluster's
    /// sake (a seal reason naming the coord cluster: it showed less than
    /// it did), as the operator saw it before advancing.
    pub sealed_on_coord: usize,
}

/// The witness at the end of a run.
#[derive(Debug, Clone, Copy)]
pub struct WitnessReport {
    pub witnessed: Witnessed,
    pub calls: WitnessCalls,
    pub faults: FaultCounts,
}

impl SimRun {
    /// Safe, live, a history the checker accepts, and no grant past a
    /// shard-map fence.
    pub fn ok(&self) -> bool {
        self.report.ok()
            && self.stuck.is_none()
            && self.invalid_history.is_none()
            && self.fences.violations.is_empty()
            && self.memory.violations.is_empty()
            && self.elections.violations.is_empty()
            && self.quota_violations.is_empty()
    }

    /// What went wrong, for people: the violations (the checker's report),
    /// the liveness failure, an invalid history.
    pub fn failure(&self) -> String {
        let mut out = String::new();
        if let Some(e) = &self.invalid_history {
            out.push_str(&format!("invalid history: {e}\n"));
        }
        if let Some(s) = &self.stuck {
            out.push_str(&format!("stuck: {s}\n"));
        }
        if !self.report.ok() {
            out.push_str(&self.report.to_string());
        }
        for v in &self.fences.violations {
            out.push_str(&format!("past the shard-map fence: {v}\n"));
        }
        for v in &self.memory.violations {
            out.push_str(&format!("whole arbiter: {v}\n"));
        }
        for v in &self.elections.violations {
            out.push_str(&format!("elections: {v}\n"));
        }
        for v in &self.quota_violations {
            out.push_str(&format!("bound: {v}\n"));
        }
        out
    }

    /// The restores of the coord cluster, read from the history's faults
    /// (each completes with the seal reasons the operator saw).
    pub fn coord_restores(&self) -> CoordRestores {
        let mut out = CoordRestores::default();
        for o in self.history.ops() {
            let Some(detail) = o.detail.as_deref() else {
                continue;
            };
            if o.f != latchkey_checker::Function::Fault || !detail.contains(COORD_RESTORE) {
                continue;
            }
            if detail.contains(nemesis::COORD_ALONE) {
                out.alone += 1;
            } else {
                out.with_the_log += 1;
            }
            let sealed = o.completion.as_ref().and_then(|c| c.detail.as_deref());
            if sealed.is_some_and(|s| s.starts_with("sealed:") && s.contains("coord cluster")) {
                out.sealed_on_coord += 1;
            }
        }
        out
    }

    /// The workers' downgrades ([`SimConfig::downgrade_percent`]): made,
    /// refused (the exclusive hold had ended: NOT_HELD), outcome unknown.
    pub fn downgrades(&self) -> [usize; 3] {
        let mut counts = [0; 3];
        for o in self.history.ops() {
            if o.f == latchkey_checker::Function::Release
                && o.detail.as_deref() == Some("downgrade")
            {
                let at = match o.outcome() {
                    Some(latchkey_checker::Outcome::Ok) => 0,
                    Some(latchkey_checker::Outcome::Fail) => 1,
                    _ => 2,
                };
                counts[at] += 1;
            }
        }
        counts
    }

    /// One line: seed, operations, simulated time, faults.
    pub fn summary(&self) -> String {
        let faults = self
            .history
            .ops()
            .iter()
            .filter(|o| o.f == latchkey_checker::Function::Fault)
            .count();
        let witness = self.witness.map_or_else(String::new, |w| {
            let restores = self.coord_restores();
            format!(
                " (witness: {} reads, {} raises, {} epochs allocated; {} failed before commit, {} answers lost; restored {} times alone, {} with the log, {} sealed on it)",
                w.calls.reads,
                w.calls.raises,
                w.calls.allocations,
                w.faults.failed_before_commit,
                w.faults.lost_responses,
                restores.alone,
                restores.with_the_log,
                restores.sealed_on_coord
            )
        });
        let (b, lb) = (self.batches, self.log_batches);
        let downgrades = self.downgrades();
        format!(
            "seed {}: {} ops in {:.1} s simulated, {} faults ({} log calls: {} failed before commit, {} answers lost, {} delayed){witness}; {} batches of {} members, {} shared (largest {}, {} split; in the log {} with failed compares, {} mixed, {} answers lost, {} restores under one){}{}{}{}{}{}{}, {}",
            self.seed,
            self.ops,
            self.simulated.as_secs_f64(),
            faults,
            self.log_faults.calls,
            self.log_faults.failed_before_commit,
            self.log_faults.lost_responses,
            self.log_faults.delayed,
            b.batches,
            b.members,
            b.shared,
            b.largest,
            b.split,
            lb.some_failed,
            lb.mixed,
            lb.lost,
            lb.restored_under,
            if downgrades.iter().sum::<usize>() > 0 {
                format!(
                    "; downgrades: {} made, {} refused, {} of unknown outcome",
                    downgrades[0], downgrades[1], downgrades[2]
                )
            } else {
                String::new()
            },
            if self.durable.queued > 0 {
                format!(
                    "; durable waiters: {} queued, {} served at their turn, {} queued again, {} stale removed",
                    self.durable.queued,
                    self.durable.served,
                    self.durable.requeued,
                    self.durable.stale_removed
                )
            } else {
                String::new()
            },
            if self.fences.raised > 0 {
                format!(
                    "; shard-map fences: {} raised, {} acquires refused behind them, {} followed by grants of the arbiters caught up",
                    self.fences.raised, self.fences.refused, self.fences.granted_again
                )
            } else {
                String::new()
            },
            if self.shards.grants > 0 {
                format!(
                    "; shards: {} of {} grants on a shard other than the lock cluster (on the session's shadow), {} moves finished",
                    self.shards.elsewhere, self.shards.grants, self.shards.moves
                )
            } else {
                String::new()
            },
            if self.forced.ended + self.forced.changed > 0 {
                format!(
                    "; force-releases: {} ended their hold ({} revoked its session), {} found it changed",
                    self.forced.ended, self.forced.revoked, self.forced.changed
                )
            } else {
                String::new()
            },
            if self.memory.losses > 0 {
                format!(
                    "; quorum lost {} times: {} grants from memory, {} grants in the log kept waiting by one",
                    self.memory.losses, self.memory.granted, self.memory.kept_from_log
                )
            } else {
                String::new()
            },
            if self.elections.leaderships > 0 {
                format!(
                    "; {} leaderships ({} waited for a term, {} handed over)",
                    self.elections.leaderships, self.elections.waited, self.elections.handed_over
                )
            } else {
                String::new()
            },
            if self.ok() { "PASS" } else { "FAIL" }
        )
    }
}

/// Runs one simulation: a pure function of `cfg` (its seed included).
pub fn run(cfg: &SimConfig) -> SimRun {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build();
    let (ops, stuck, simulated, log_faults, witness, notes, batches, (fences, shards)) =
        match runtime {
            Ok(rt) => {
                let out = rt.block_on(simulate(cfg.clone()));
                drop(rt);
                out
            }
            Err(e) => (
                Vec::new(),
                Some(format!("could not build the runtime: {e}")),
                Duration::ZERO,
                FaultCounts::default(),
                None,
                Vec::new(),
                (
                    BatchStats::default(),
                    BatchCounts::default(),
                    DurableStats::default(),
                    ForcedEnds::default(),
                    MemoryReport::default(),
                    ElectionReport::default(),
                    Vec::new(),
                ),
                (FenceReport::default(), ShardReport::default()),
            ),
        };
    let built = History::from_ops(ops);
    // Judge what a file of it would say: read back, the discipline checked.
    let (history, invalid_history) = match History::from_jsonl(built.to_jsonl_string().as_bytes()) {
        Ok(h) => (h, None),
        Err(e) => (built, Some(e.to_string())),
    };
    let report = latchkey_checker::check(&history, &CheckOptions::default());
    SimRun {
        seed: cfg.seed,
        ops: history.ops().len(),
        history,
        report,
        stuck,
        invalid_history,
        simulated,
        log_faults,
        witness,
        notes,
        batches: batches.0,
        log_batches: batches.1,
        durable: batches.2,
        forced: batches.3,
        memory: batches.4,
        elections: batches.5,
        quota_violations: batches.6,
        fences,
        shards,
    }
}

type Outcome = (
    Vec<Operation>,
    Option<String>,
    Duration,
    FaultCounts,
    Option<WitnessReport>,
    Vec<String>,
    (
        BatchStats,
        BatchCounts,
        DurableStats,
        ForcedEnds,
        MemoryReport,
        ElectionReport,
        Vec<String>,
    ),
    (FenceReport, ShardReport),
);

async fn simulate(cfg: SimConfig) -> Outcome {
    let mut rng = Rng::new(cfg.seed);
    let memlog = MemLog::with_config(MemLogConfig {
        seed: rng.next_u64(),
        cluster_id: None,
        faults: FaultRates::NONE,
        history_revisions: Some(10_000),
        min_ttl_seconds: 2,
        latency: cfg.log_latency,
    });
    if let Some(max) = cfg.quota {
        memlog.watch_quota(policies::CLASS, max);
    }
    if let Some(permits) = cfg.permits {
        memlog.watch_permits(permits);
    }
    let watches = Arc::new(ordered::Dispatch::default());
    tokio::spawn(watches.clone().run());
    let trace = std::env::var_os("LATCHKEY_SIM_TRACE");
    let idlog = Arc::new(
        idlog::IdLog::new(memlog.clone(), watches, trace.is_some())
            .with_marks_trusted(cfg.faults.shadow_marks_trusted),
    );
    // The coord cluster, when there is one: seeded from the run's seed, not
    // from `rng`, so a run without it draws what it always drew.
    let memwitness = cfg
        .witness
        .then(|| MemWitness::new(cfg.seed ^ 0xC00D_0000_0000_0015));
    let witness: Option<Arc<dyn Witness>> = memwitness.clone().map(|w| {
        let traced: Arc<dyn Witness> = Arc::new(idlog::TracedWitness::new(w, idlog.clone()));
        traced
    });
    let shard_logs = shards::logs(&cfg, &idlog);
    let coord_log = tiers::coord_log(&cfg, &idlog);
    let world = Arc::new(World::new(
        cfg.clone(),
        memlog,
        idlog.clone(),
        memwitness,
        witness,
        shard_logs,
        coord_log,
    ));
    for i in 0..world.arbiters.len() {
        world.start_arbiter(i, false, rng.next_u64()).await;
    }
    let workers: Vec<JoinHandle<()>> = (0..cfg.clients.max(1))
        .map(|i| {
            let seed = rng.next_u64();
            tokio::spawn(worker::run(world.clone(), i, Rng::new(seed)))
        })
        .collect();
    // Drawn only with electors: the runs without them draw what they always drew.
    let electors: Vec<JoinHandle<()>> = (0..cfg.electors)
        .map(|i| {
            let seed = rng.next_u64();
            tokio::spawn(worker::elector::run(world.clone(), i, Rng::new(seed)))
        })
        .collect();
    let nemesis = tokio::spawn(nemesis::run(world.clone(), Rng::new(rng.next_u64())));
    // Drawn only when on: the runs without them draw what they always drew.
    let operators = cfg.faults.force_releases.then(|| {
        tokio::spawn(operators::operators(
            world.clone(),
            Rng::new(rng.next_u64()),
        ))
    });
    // Drawn only with shard moves: the runs without them draw what they always drew.
    let mover = (cfg.faults.shard_moves && world.shard_maps.is_some())
        .then(|| tokio::spawn(shards::mover(world.clone(), Rng::new(rng.next_u64()))));

    let mut stuck = None;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Enough operations, and the service serving now: a run does not
        // end in an outage the watchdog has yet to judge.
        if world.ops_recorded() >= cfg.min_ops
            && lock(&world.liveness).serving(Instant::now(), SETTLED)
        {
            break;
        }
        if let Some(why) = liveness(&world) {
            stuck = Some(why);
            break;
        }
        let elapsed = Instant::now() - world.start;
        if elapsed >= cfg.max_sim_time {
            stuck = Some(format!(
                "only {} of {} operations after {:.0} s of simulated time",
                world.ops_recorded(),
                cfg.min_ops,
                elapsed.as_secs_f64()
            ));
            break;
        }
    }
    world.stop.cancel();

    // Workers finish their cycle, the nemesis its fault; whoever is still
    // busy a minute later is cut off (its operation stays pending).
    let drain_until = Instant::now() + Duration::from_secs(60);
    for h in workers.into_iter().chain(electors) {
        finish(h, drain_until).await;
    }
    if !finish(nemesis, drain_until).await && stuck.is_none() {
        stuck = Some(
            "the nemesis did not finish its last fault within 60 s of the end (an advance that never succeeds?)"
                .into(),
        );
    }
    if let Some(operators) = operators {
        finish(operators, drain_until).await;
    }
    if let Some(mover) = mover {
        finish(mover, drain_until).await;
    }
    let simulated = Instant::now() - world.start;
    world.stop_arbiters().await;
    if let Some(path) = trace {
        // The lock cluster's calls, then each shard's (`[name]` before
        // each), then the coord tier's (`[coord]`).
        let mut lines = idlog.take_trace();
        for shard in &world.shards {
            let name = &shard.name;
            lines.extend(
                shard
                    .idlog
                    .take_trace()
                    .into_iter()
                    .map(|l| format!("[{name}] {l}")),
            );
        }
        if let Some(coord) = &world.coord {
            lines.extend(
                coord
                    .idlog
                    .take_trace()
                    .into_iter()
                    .map(|l| format!("[coord] {l}")),
            );
        }
        if let Err(e) = std::fs::write(&path, lines.join("\n")) {
            world.note(format!(
                "could not write the trace to {}: {e}",
                path.to_string_lossy()
            ));
        }
    }
    let (grants, elsewhere) = *lock(&world.shard_grants);
    let shards = ShardReport {
        grants,
        elsewhere,
        moves: *lock(&world.shard_moves),
    };
    // The state dirs (quorum-loss spools) go with the run.
    let _ = std::fs::remove_dir_all(&world.scratch);
    let notes = std::mem::take(&mut *lock(&world.notes));
    let witness = world.memwitness.as_ref().map(|w| WitnessReport {
        witnessed: w.witnessed(),
        calls: w.calls(),
        faults: w.fault_counts(),
    });
    (
        world.take_ops(),
        stuck,
        simulated,
        world.memlog.fault_counts(),
        witness,
        notes,
        (
            *lock(&world.batches),
            world.memlog.batch_counts(),
            *lock(&world.durable),
            *lock(&world.forced),
            lock(&world.memory).report(),
            lock(&world.elections).report(),
            world.memlog.quota_violations(),
        ),
        (lock(&world.fences).report(), shards),
    )
}

/// Waits for a task until `until`, then aborts it; whether it finished.
async fn finish(mut h: JoinHandle<()>, until: Instant) -> bool {
    tokio::select! {
        biased;
        _ = &mut h => true,
        () = tokio::time::sleep_until(until) => {
            h.abort();
            let _ = h.await;
            false
        }
    }
}

/// A run ends once it has its operations and an acquire succeeded this
/// recently (after the last advance, none pending).
const SETTLED: Duration = Duration::from_secs(5);

/// Whether the advance after a restore never came, or grants stopped: no
/// acquire succeeded for [`LIVENESS_WINDOW`] after the last grant or the
/// last advance, whichever is later, while clients kept trying and no
/// restore was waiting for its advance. (After an advance this is the
/// window grants must resume in; at any other time nothing in the
/// simulation stops every grant for that long: faults come one at a time,
/// a restart takes at most two seconds.)
fn liveness(world: &World) -> Option<String> {
    let now = Instant::now();
    let live = lock(&world.liveness);
    if let Some(restored) = live.last_restore
        && live.last_advance.is_none_or(|a| a < restored)
    {
        if now >= restored + Duration::from_secs(120) {
            return Some(format!(
                "no epoch advance completed within 120 s of simulated time after the restore at {:.1} ms; {}",
                world.ms(restored),
                seals(world)
            ));
        }
        return None;
    }
    let since = live
        .last_grant
        .max(live.last_advance)
        .unwrap_or(world.start);
    if !live.tried_since || now < since + LIVENESS_WINDOW {
        return None;
    }
    let after = match live.last_advance {
        Some(at) if live.last_grant.is_none_or(|g| g < at) => {
            format!("the epoch advance at {:.1} ms", world.ms(at))
        }
        _ => match live.last_grant {
            Some(g) => format!("the last grant at {:.1} ms", world.ms(g)),
            None => "the start".to_string(),
        },
    };
    Some(format!(
        "no acquire succeeded within {} s of simulated time after {after}, while clients kept trying; {}",
        LIVENESS_WINDOW.as_secs(),
        seals(world)
    ))
}

/// Each arbiter's state, for a liveness report.
fn seals(world: &World) -> String {
    (0..world.arbiters.len())
        .map(|i| match world.table(i) {
            None => format!("arbiter-{i}: down"),
            Some((table, isolated)) => {
                let epoch = table.seal().guard().state().map(|s| s.epoch());
                let cut = if isolated { " (isolated)" } else { "" };
                match table.seal().guard().seal_reason() {
                    Some(reason) => format!("arbiter-{i}{cut}: epoch {epoch:?}, sealed: {reason}"),
                    None => format!("arbiter-{i}{cut}: epoch {epoch:?}, serving"),
                }
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}
