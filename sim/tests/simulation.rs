//! The deterministic simulation in CI (issue 11): a fixed list of seeds
//! over the presets, over 10,000 checked operations in all, each run a
//! pure function of its seed. The list is long enough that each bug the
//! release gate found, put back, fails some of its runs (see [`CI_RUNS`]).
//!
//! A failing run prints its seed, the checker's violations (or the
//! liveness failure), the commands that replay it exactly, and writes its
//! history where `latchkey-gate --check` can read it.
//!
//! `LATCHKEY_SIM_SEED=<seed>[:<preset>]` (and optionally
//! `LATCHKEY_SIM_OPS=<n>`) runs one more seed: `seed_from_env`.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::time::Instant;

use latchkey_arbiter::table::durable::DurableStats;
use latchkey_sim::BatchCounts;
use latchkey_sim::simulation::{
    CoordRestores, ElectionReport, FenceReport, ForcedEnds, MemoryReport, PRESETS, ShardReport,
    SimConfig, SimRun, run,
};

/// (seed, preset, operations): seeds 1 to 80 over the presets without a
/// witness in turn, then 81 to 98 over the witnessed ones, 99 to 106 over
/// the durable ones, 107 to 110 over the fenced ones, 111 to 114 over
/// the forced ones, 115 to 118 and 121 over the quorum-loss ones, 122
/// and 123 over the renewal outages, 137 and 138 over the shards
/// (with a move), and 139 and 140 over the split tiers, 5,000 operations
/// each, ~700,000 in
/// all (CI promises at least
/// [`MIN_CI_OPS`]); the state-loss runs without a witness have no
/// restores (issue 15: see
/// [`without_a_witness_state_loss_and_restore_regress_tokens`]). The
/// seeds are not picked to pass. Re-introduced one at a time, each bug the
/// release gate found fails some of these runs (measured when the list was
/// set; the seeds of the failing runs):
///
/// - the orphan release deleting a grant that a new call of the same
///   session took as "already yours" (a double grant): 16 runs, seeds 9,
///   22, 32, 35, 40, 45, 47, 48, 51, 57, 68, 69, 71, 77, 79, 80;
/// - the advance re-using an epoch after a second restore of one snapshot
///   (stuck: the arbiters refuse the re-used epoch): 36 runs, seeds 1, 2,
///   3, 5, 6, 7, 9, ...;
/// - an arbiter that noticed a restore only after the advance sealing the
///   new epoch (stuck: no grant for 60 s): 23 runs, seeds 1, 2, 5, 6, 9,
///   13, 14, ... (runs with two or three arbiters);
///
/// and so does the hand-over whose answer was lost releasing plainly
/// (found by the simulation itself): 9 runs, seeds 6, 14, 27, 41, 51, 59,
/// 61, 62, 73; and a forced end that, finding the hold changed, retries on
/// the hold as it is now (`LockTable::force_end`, issue 32): all 4 forced
/// runs, seeds 111 to 114 (4 to 7 violations each).
///
/// The quorum-loss runs (issue 32: the whole arbiter through its handlers,
/// KeepAlive included, judged by the memory-grant ledger as well) were
/// measured over seeds 115 to 122 with each of these put back:
///
/// - a grant from memory that ignores the log (the hold count and the
///   grants in flight): all eight, 4 to 54 violations each;
/// - a live memory grant that does not keep its key from the log's grants
///   on its arbiter (no key gate, no wait before the log grant): 117, 119
///   and 120, one violation each;
/// - a memory grant made after the probe heard quorum again, beside a
///   grant of the key on its way to the log, and before the hold count saw
///   this arbiter's own last grant (the three checks removed together):
///   none of 115 to 130 since the clients renew through KeepAlive (121 and
///   128 before; the seeds do not reach that race now).
///
/// And the `renewal-outages` runs (122 and 123, measured over 122 to 125)
/// with a KeepAlive that answers a renewal the store refused (as renewed,
/// 30 s left): all four, 48 to 150 writes before the fence deadline on a
/// lease that was gone.
///
/// None of these seeds was picked.
const CI_RUNS: &[(u64, &str, usize)] = &[
    (1, "default", 5000),
    (2, "three-arbiters", 5000),
    (3, "one-arbiter", 5000),
    (4, "state-loss", 5000),
    (5, "default", 5000),
    (6, "three-arbiters", 5000),
    (7, "one-arbiter", 5000),
    (8, "state-loss", 5000),
    (9, "default", 5000),
    (10, "three-arbiters", 5000),
    (11, "one-arbiter", 5000),
    (12, "state-loss", 5000),
    (13, "default", 5000),
    (14, "three-arbiters", 5000),
    (15, "one-arbiter", 5000),
    (16, "state-loss", 5000),
    (17, "default", 5000),
    (18, "three-arbiters", 5000),
    (19, "one-arbiter", 5000),
    (20, "state-loss", 5000),
    (21, "default", 5000),
    (22, "three-arbiters", 5000),
    (23, "one-arbiter", 5000),
    (24, "state-loss", 5000),
    (25, "default", 5000),
    (26, "three-arbiters", 5000),
    (27, "one-arbiter", 5000),
    (28, "state-loss", 5000),
    (29, "default", 5000),
    (30, "three-arbiters", 5000),
    (31, "one-arbiter", 5000),
    (32, "state-loss", 5000),
    (33, "default", 5000),
    (34, "three-arbiters", 5000),
    (35, "one-arbiter", 5000),
    (36, "state-loss", 5000),
    (37, "default", 5000),
    (38, "three-arbiters", 5000),
    (39, "one-arbiter", 5000),
    (40, "state-loss", 5000),
    (41, "default", 5000),
    (42, "three-arbiters", 5000),
    (43, "one-arbiter", 5000),
    (44, "state-loss", 5000),
    (45, "default", 5000),
    (46, "three-arbiters", 5000),
    (47, "one-arbiter", 5000),
    (48, "state-loss", 5000),
    (49, "default", 5000),
    (50, "three-arbiters", 5000),
    (51, "one-arbiter", 5000),
    (52, "state-loss", 5000),
    (53, "default", 5000),
    (54, "three-arbiters", 5000),
    (55, "one-arbiter", 5000),
    (56, "state-loss", 5000),
    (57, "default", 5000),
    (58, "three-arbiters", 5000),
    (59, "one-arbiter", 5000),
    (60, "state-loss", 5000),
    (61, "default", 5000),
    (62, "three-arbiters", 5000),
    (63, "one-arbiter", 5000),
    (64, "state-loss", 5000),
    (65, "default", 5000),
    (66, "three-arbiters", 5000),
    (67, "one-arbiter", 5000),
    (68, "state-loss", 5000),
    (69, "default", 5000),
    (70, "three-arbiters", 5000),
    (71, "one-arbiter", 5000),
    (72, "state-loss", 5000),
    (73, "default", 5000),
    (74, "three-arbiters", 5000),
    (75, "one-arbiter", 5000),
    (76, "state-loss", 5000),
    (77, "default", 5000),
    (78, "three-arbiters", 5000),
    (79, "one-arbiter", 5000),
    (80, "state-loss", 5000),
    // With the coord cluster's witness (issue 15): state dirs lost at
    // restarts and right after restores, an arbiter idle before a restore
    // serving right after it; none of it may re-issue a token.
    (81, "witnessed", 5000),
    (82, "witnessed-three-arbiters", 5000),
    (83, "witnessed-state-loss", 5000),
    (84, "witnessed", 5000),
    (85, "witnessed-three-arbiters", 5000),
    (86, "witnessed-state-loss", 5000),
    (87, "witnessed", 5000),
    (88, "witnessed-three-arbiters", 5000),
    (89, "witnessed-state-loss", 5000),
    (90, "witnessed", 5000),
    (91, "witnessed-three-arbiters", 5000),
    (92, "witnessed-state-loss", 5000),
    (93, "witnessed", 5000),
    (94, "witnessed-three-arbiters", 5000),
    (95, "witnessed-state-loss", 5000),
    (96, "witnessed", 5000),
    (97, "witnessed-three-arbiters", 5000),
    (98, "witnessed-state-loss", 5000),
    // Half the keys of a durable class (ADR-14): waiters queued in the log,
    // served by create revision, through every fault above.
    (99, "durable", 5000),
    (100, "durable-three-arbiters", 5000),
    (101, "durable", 5000),
    (102, "durable-three-arbiters", 5000),
    (103, "durable", 5000),
    (104, "durable-three-arbiters", 5000),
    (105, "durable", 5000),
    (106, "durable-three-arbiters", 5000),
    // Shard-map fences (ADR-09 moves) raised above the map some arbiters
    // route by: none of their grants may commit past the raise.
    (107, "fenced", 5000),
    (108, "fenced-three-arbiters", 5000),
    (109, "fenced", 5000),
    (110, "fenced-three-arbiters", 5000),
    // Two-person force-releases of the clients' holds, read a moment
    // before they are ended: a hold released, handed over or granted again
    // since must never be ended.
    (111, "forced", 5000),
    (112, "forced-three-arbiters", 5000),
    (113, "forced", 5000),
    (114, "forced-three-arbiters", 5000),
    // The whole arbiter (issue 32): clients ask the keys' owner, admitted by
    // hold counts that follow the log, and the log loses its majority now
    // and then: open keys are granted from memory meanwhile, and judged.
    (115, "quorum-loss", 5000),
    (116, "quorum-loss-three-arbiters", 5000),
    (117, "quorum-loss", 5000),
    (118, "quorum-loss-three-arbiters", 5000),
    (121, "quorum-loss", 5000),
    // The whole arbiter again, renewing through KeepAlive while every
    // lease renewal fails for longer than a TTL now and then: no client may
    // write before its fence deadline on a lease that is gone.
    (122, "renewal-outages", 5000),
    (123, "renewal-outages", 5000),
    // Electors beside the clients (issue 33): campaigns, proclamations,
    // resignations, transfers, crashed and frozen leaders through the
    // whole arbiter, every fault of the quorum-loss runs; one leader per
    // term, terms rising with tokens, never two leaders acting at once.
    (124, "elections", 5000),
    (125, "elections-three-arbiters", 5000),
    (126, "elections", 5000),
    (127, "elections-three-arbiters", 5000),
    // Every client bounded as one grant subject with a quota of 3 (issue
    // 34), force-releases and every fault: the log, counted at every
    // commit, never holds more than 3 keys of the class for the subject.
    // With a release that hands a quota class's key over (a hand-over
    // takes no place) put back: both runs fail (258 and 192 commits over
    // the quota; seeds 124 to 127 of `quota` fail likewise).
    (128, "quota", 5000),
    (129, "quota-three-arbiters", 5000),
    // Every key a semaphore of 3 permits (issue 34), force-releases and
    // every fault: each slot judged as a lock, and the log, counted at
    // every commit, never holds more than 3 slots of a semaphore. With a
    // grant that may take slot 3 (an off-by-one in the free slots) both
    // runs fail (6512 and 6668 commits over the permits).
    (130, "semaphores", 5000),
    (131, "semaphores-three-arbiters", 5000),
    // 60 % of acquires shared (issue 34), force-releases and every fault:
    // each shared hold judged as a lock of its own key, and the log, read
    // at every commit of every run, never holds a key exclusively beside
    // anything under its name. With an exclusive grant that compares only
    // the slots under its name (not the shared holds) both runs fail from
    // revision 15 and 17 on. These presets do not yet replay byte for byte
    // (a driver's wake-ups differ between runs; the verdict has held).
    (132, "shared", 5000),
    (133, "shared-three-arbiters", 5000),
    // 30 % of their exclusive holds downgraded as the clients do it, naming
    // the hold's token (issue 34). Put back the bug the named downgrade
    // fixed — a downgrade of a hold that had already ended (force-released,
    // expired, an epoch advance) answered with a fresh shared grant — and
    // each of these three fails (the downgrade, recorded as the exclusive
    // hold's release, releases a hold nobody held), as do 39 of 96 runs of
    // the three presets over seeds 132, 133 and 1000 to 1029; 132 and 133
    // alone did not catch it.
    (134, "shared-durable", 5000),
    (135, "shared", 5000),
    (136, "shared-three-arbiters", 5000),
    // Found by a sweep: a second restore of one snapshot brought back, with
    // the epoch record, a hold the first advance had ended, and a release
    // of it was answered OK (the checker: a release of a hold nobody
    // held). A release naming an epoch the arbiter has served past now
    // answers as an ended hold. Fails without that rule.
    (47, "durable-three-arbiters", 5000),
    // Issue 32: the whole arbiter over entity shards, a shard added and
    // ranges moved to it by the admin handlers. A shard added by
    // publishing the next map at once (no fence, no drain, no epoch raised)
    // fails both (and every one of seeds 1-8 of `shards`).
    (137, "shards", 5000),
    (138, "shards-three-arbiters", 5000),
    // Issue 32: the whole arbiter with the coord tier split off, keys
    // routed between the tiers by the namespace bindings (their entity
    // copy restored with the lock cluster). sim/tests/tiers.rs runs a
    // policy rollout and shows unshared bindings are found.
    (139, "tiers", 5000),
    (140, "tiers-three-arbiters", 5000),
];

const MIN_CI_OPS: usize = 10_000;

/// Where a failing run's history goes.
fn history_path(seed: u64, preset: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("sim-{preset}-seed-{seed}.jsonl"))
}

/// Runs one seed; on failure, everything needed to replay it.
fn run_one(seed: u64, preset: &str, ops: usize) -> (SimRun, Option<String>) {
    let mut cfg = SimConfig::preset(preset, seed)
        .unwrap_or_else(|| panic!("no preset {preset:?}; presets: {PRESETS:?}"));
    cfg.min_ops = ops;
    let began = Instant::now();
    let result = run(&cfg);
    let wall = began.elapsed().as_secs_f64();
    println!(
        "{} [{preset}] wall {wall:.2} s ({:.0} ops/s)",
        result.summary(),
        result.ops as f64 / wall.max(1e-3)
    );
    if result.ok() {
        return (result, None);
    }
    let path = history_path(seed, preset);
    let saved = match std::fs::write(&path, result.history.to_jsonl_string()) {
        Ok(()) => format!("history: {}", path.display()),
        Err(e) => format!("could not write the history to {}: {e}", path.display()),
    };
    let report = format!(
        "seed {seed} (preset {preset}, {ops} ops) FAILED\n{}\n{saved}\n\
         replay: LATCHKEY_SIM_SEED={seed}:{preset} LATCHKEY_SIM_OPS={ops} cargo test -p latchkey-sim --test simulation seed_from_env -- --nocapture\n\
         replay: cargo run -p latchkey-sim --bin latchkey-sim -- --seed {seed} --preset {preset} --ops {ops} --history history.jsonl\n\
         re-check: cargo run -p latchkey-gate --bin latchkey-gate -- --check {}\n",
        result.failure(),
        path.display()
    );
    (result, Some(report))
}

#[test]
fn ci_seeds_check_out() {
    let began = Instant::now();
    let mut total = 0;
    let mut failures = Vec::new();
    let mut coord = CoordRestores::default();
    let mut coord_seeds = Vec::new();
    let (mut shared, mut largest) = (0, 0);
    let mut log_batches = BatchCounts::default();
    let mut durable = DurableStats::default();
    let mut fences = FenceReport::default();
    let mut forced = ForcedEnds::default();
    let mut memory = MemoryReport::default();
    let mut elections = ElectionReport::default();
    let mut shards = ShardReport::default();
    for &(seed, preset, ops) in CI_RUNS {
        let (result, failure) = run_one(seed, preset, ops);
        shards.grants += result.shards.grants;
        shards.elsewhere += result.shards.elsewhere;
        shards.moves += result.shards.moves;
        elections.leaderships += result.elections.leaderships;
        elections.handed_over += result.elections.handed_over;
        memory.losses += result.memory.losses;
        memory.granted += result.memory.granted;
        memory.kept_from_log += result.memory.kept_from_log;
        forced.ended += result.forced.ended;
        forced.changed += result.forced.changed;
        total += result.ops;
        durable.queued += result.durable.queued;
        durable.served += result.durable.served;
        fences.raised += result.fences.raised;
        fences.refused += result.fences.refused;
        fences.granted_again += result.fences.granted_again;
        shared += result.batches.shared;
        largest = largest.max(result.batches.largest);
        let b = result.log_batches;
        log_batches.batches += b.batches;
        log_batches.some_failed += b.some_failed;
        log_batches.mixed += b.mixed;
        log_batches.lost += b.lost;
        log_batches.failed_before += b.failed_before;
        log_batches.restored_under += b.restored_under;
        let c = result.coord_restores();
        coord.alone += c.alone;
        coord.with_the_log += c.with_the_log;
        coord.sealed_on_coord += c.sealed_on_coord;
        if c.sealed_on_coord > 0 {
            coord_seeds.push(seed);
        }
        if let Some(f) = failure {
            failures.push(f);
        }
    }
    println!(
        "simulation: {total} operations checked over {} seeds in {:.2} s of wall time",
        CI_RUNS.len(),
        began.elapsed().as_secs_f64()
    );
    println!(
        "coord cluster restored {} times alone, {} times with the lock log; {} of them sealed on it (seeds {coord_seeds:?})",
        coord.alone, coord.with_the_log, coord.sealed_on_coord
    );
    println!(
        "batches of more than one member: {shared} (largest {largest}); in the log {log_batches:?}"
    );
    for f in &failures {
        println!("{f}");
    }
    assert!(
        failures.is_empty(),
        "{} of {} seeds failed: see the reports above",
        failures.len(),
        CI_RUNS.len()
    );
    assert!(
        total >= MIN_CI_OPS,
        "only {total} operations checked; CI promises at least {MIN_CI_OPS}"
    );
    // The control for the coord cluster's restores: they happened, and the
    // arbiters noticed them as restores of the coord cluster (the seal
    // reason names it), so the witnessed seeds above did meet them.
    assert!(
        coord.alone > 0 && coord.with_the_log > 0,
        "the CI seeds restored the coord cluster {} times alone and {} times with the lock log: the simulation no longer reaches those restores",
        coord.alone,
        coord.with_the_log
    );
    assert!(
        coord.sealed_on_coord > 0,
        "no restore of the coord cluster in the CI seeds sealed an arbiter for the coord cluster's sake ({coord:?})"
    );
    // The control for group commit: the tables did send grants and releases
    // together, and the log met such batches with compares failing beside
    // members that wrote, with their answers lost, and with a restore while
    // one was on its way.
    assert!(
        shared > 0 && log_batches.batches > 0,
        "no batch of more than one member in the CI seeds: the simulation no longer batches"
    );
    assert!(
        log_batches.mixed > 0 && log_batches.lost > 0 && log_batches.restored_under > 0,
        "the CI seeds' batches never met a mixed outcome, a lost answer or a restore: {log_batches:?}"
    );
    // The control for durable waiters: waiters did queue in the log and
    // were granted at their turn.
    println!("durable waiters: {durable:?}");
    assert!(
        durable.queued > 0 && durable.served > 0,
        "no durable waiter queued and was served in the CI seeds: {durable:?}"
    );
    // The control for shard-map fences: they were raised, arbiters behind
    // them were refused, and granted again once caught up.
    println!("shard-map fences: {fences:?}");
    assert!(
        fences.raised > 0 && fences.refused > 0 && fences.granted_again > 0,
        "the CI seeds' fences were not raised, refused nothing, or the arbiters behind them never granted again: {fences:?}"
    );
    // The control for force-releases: they ended holds, and some found the
    // hold changed since it was read (the race their compares decide).
    println!("force-releases: {forced:?}");
    assert!(
        forced.ended > 0 && forced.changed > 0,
        "the CI seeds' force-releases never ended a hold or never met one changed: {forced:?}"
    );
    // The control for quorum losses: the log lost its majority, open keys
    // were granted from memory, and a live memory grant kept its key from
    // a grant in the log on its arbiter.
    println!("quorum losses: {memory:?}");
    assert!(
        memory.losses > 0 && memory.granted > 0 && memory.kept_from_log > 0,
        "the CI seeds' quorum losses granted nothing from memory, or no memory grant kept its key from the log: {memory:?}"
    );
    // The shards' control: keys were granted on shards other than the lock
    // cluster (on the sessions' shadows), and an added shard's move
    // finished, so the judge saw holds before and after it.
    println!("shards: {shards:?}");
    assert!(
        shards.elsewhere > 0 && shards.elsewhere < shards.grants && shards.moves > 0,
        "the CI seeds granted no key on another shard, only on other shards, or finished no move: {shards:?}"
    );
    // The electors' control: leaderships started over vacancies and by
    // hand-overs, so the election ledger judged both.
    assert!(
        elections.leaderships > elections.handed_over && elections.handed_over > 0,
        "the CI seeds' electors led {} times, {} by a hand-over: the simulation no longer exercises elections",
        elections.leaderships,
        elections.handed_over
    );
}

/// `LATCHKEY_SIM_SEED=<seed>[:<preset>]`: one more seed (a replay, or a
/// new one to explore). Passes at once when the variable is not set.
#[test]
fn seed_from_env() {
    let Ok(spec) = std::env::var("LATCHKEY_SIM_SEED") else {
        return;
    };
    let (seed, preset) = match spec.split_once(':') {
        Some((seed, preset)) => (seed, preset),
        None => (spec.as_str(), "default"),
    };
    let seed: u64 = seed
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("LATCHKEY_SIM_SEED={spec}: {e}"));
    let ops = std::env::var("LATCHKEY_SIM_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let (_, failure) = run_one(seed, preset, ops);
    if let Some(f) = failure {
        println!("{f}");
        panic!("seed {seed} (preset {preset}) failed: see the report above");
    }
}

/// A seed is a run: the same seed twice gives the same history, byte for
/// byte (and so the same verdict). Both runs are in this process, but each
/// draws its own session ids and hash-map seeds, as a run in a fresh
/// process does. `shared` (reader keys spell the arbiter's random session
/// ids) and the whole arbiter (`quorum-loss`: the hold and session counts
/// follow the log through prefix watches) each had a source
/// of their own; `shared` runs long enough that its first divergence,
/// within milliseconds of the start, would show whatever its seed.
#[test]
fn the_same_seed_gives_the_same_history() {
    for (preset, ops) in [
        ("default", 1500),
        ("state-loss", 1500),
        ("witnessed", 1500),
        ("fenced", 1500),
        ("shared", 3000),
        ("quorum-loss", 1500),
    ] {
        let mut cfg = SimConfig::preset(preset, 0x5EED).expect("preset");
        cfg.min_ops = ops;
        let first = run(&cfg);
        let second = run(&cfg);
        assert!(first.ops >= ops, "{}", first.summary());
        assert_eq!(
            (first.ops, first.simulated),
            (second.ops, second.simulated),
            "preset {preset}: two runs of seed {} differ in length:\n  {}\n  {}",
            cfg.seed,
            first.summary(),
            second.summary()
        );
        let (a, b) = (
            first.history.to_jsonl_string(),
            second.history.to_jsonl_string(),
        );
        if a != b {
            let line = a
                .lines()
                .zip(b.lines())
                .position(|(x, y)| x != y)
                .map_or(a.lines().count().min(b.lines().count()), |i| i + 1);
            panic!(
                "preset {preset}: two runs of seed {} differ from line {line}:\n  {}\n  {}",
                cfg.seed,
                a.lines().nth(line - 1).unwrap_or(""),
                b.lines().nth(line - 1).unwrap_or("")
            );
        }
        assert_eq!(first.report.ok(), second.report.ok());
    }
}

/// With nothing going wrong, every run is safe and live, and the faults
/// that should show do not.
#[test]
fn a_run_without_faults_checks_out() {
    let mut cfg = SimConfig::preset("default", 99).expect("preset");
    cfg.faults = latchkey_sim::simulation::FaultKnobs::none();
    cfg.min_ops = 2000;
    let result = run(&cfg);
    assert!(result.ok(), "{}\n{}", result.summary(), result.failure());
    assert_eq!(result.log_faults.failed_before_commit, 0);
    assert_eq!(result.log_faults.lost_responses, 0);
    let unknown = result
        .history
        .ops()
        .iter()
        .filter(|o| o.outcome() == Some(latchkey_checker::Outcome::Unknown))
        .count();
    assert_eq!(unknown, 0, "no faults, yet unknown outcomes");
}

/// The single-cluster limit (issue 15), shown: without a witness, restarts
/// that lose the state dir together with restores (the
/// `unwitnessed-state-loss` preset: `witnessed-state-loss` without the
/// witness) re-issue tokens. At least one seed of a small fixed set must
/// FAIL with a token regression, a duplicate token, a double grant or a
/// stale write accepted; the same seed with the witness must pass. If this
/// test fails, either the simulation stopped reaching the scenario (the
/// witnessed presets then prove nothing) or a single cluster became safe
/// without a witness (then say so in the docs and retire this test).
#[test]
fn without_a_witness_state_loss_and_restore_regress_tokens() {
    use latchkey_checker::ViolationKind;
    const SEEDS: &[u64] = &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
    const OPS: usize = 5000;
    let began = Instant::now();
    let unsafe_kinds = [
        ViolationKind::TokenRegression,
        ViolationKind::DuplicateToken,
        ViolationKind::DoubleGrant,
        ViolationKind::StaleWriteAccepted,
    ];
    let mut found = None;
    for &seed in SEEDS {
        let mut cfg = SimConfig::preset("unwitnessed-state-loss", seed).expect("preset");
        cfg.min_ops = OPS;
        assert!(!cfg.witness);
        let result = run(&cfg);
        println!("{} [unwitnessed-state-loss]", result.summary());
        let kinds: Vec<ViolationKind> = unsafe_kinds
            .iter()
            .copied()
            .filter(|k| result.report.violations_of(*k).next().is_some())
            .collect();
        if !kinds.is_empty() {
            let first = result
                .report
                .violations
                .iter()
                .find(|v| kinds.contains(&v.kind))
                .map(ToString::to_string)
                .unwrap_or_default();
            println!("seed {seed} without a witness: {kinds:?}; the first:\n{first}");
            found = Some(seed);
            break;
        }
    }
    let Some(seed) = found else {
        panic!(
            "no seed of {SEEDS:?} re-issued a token without a witness: the simulation no longer reaches issue 15's scenario"
        );
    };
    let (result, failure) = run_one(seed, "witnessed-state-loss", OPS);
    assert!(
        result.witness.is_some(),
        "the witnessed preset ran without a witness"
    );
    if let Some(f) = failure {
        panic!("seed {seed} fails WITH the witness too:\n{f}");
    }
    println!(
        "issue 15 shown in {:.2} s of wall time: seed {seed} re-issues tokens without a witness, passes with one",
        began.elapsed().as_secs_f64()
    );
}

/// The limit of restoring both clusters (the coord cluster's witness of
/// the lock log, and the lock log's of the coord cluster), shown: from two
/// backups that both predate the serving epoch, every state dir wiped,
/// nothing knows that epoch any more; the restore is noticed but the
/// operator's advance re-uses it and re-issues its tokens. The presets
/// never draw such a restore
/// ([`FaultKnobs::coord_restore_before_serving_epoch`]); with it drawn, one
/// of these seeds must FAIL with a token regression or a duplicate token,
/// and the same seed without it must pass. If this test fails, either the
/// simulation stopped reaching that restore (seeds found with the draw as
/// it was when this was written) or the arbiter learned to remember the
/// epoch elsewhere (then retire this test and the knob).
///
/// [`FaultKnobs::coord_restore_before_serving_epoch`]: latchkey_sim::simulation::FaultKnobs::coord_restore_before_serving_epoch
#[test]
fn restoring_both_from_before_the_serving_epoch_reissues_tokens() {
    use latchkey_checker::ViolationKind;
    const SEEDS: &[u64] = &[1010, 1030];
    const PRESET: &str = "witnessed-state-loss";
    const OPS: usize = 5000;
    let unsafe_kinds = [
        ViolationKind::TokenRegression,
        ViolationKind::DuplicateToken,
        ViolationKind::DoubleGrant,
        ViolationKind::StaleWriteAccepted,
    ];
    let mut found = None;
    for &seed in SEEDS {
        let mut cfg = SimConfig::preset(PRESET, seed).expect("preset");
        cfg.min_ops = OPS;
        cfg.faults.coord_restore_before_serving_epoch = true;
        let result = run(&cfg);
        println!(
            "{} [{PRESET}, both restored from before the serving epoch]",
            result.summary()
        );
        if unsafe_kinds
            .iter()
            .any(|k| result.report.violations_of(*k).next().is_some())
        {
            found = Some(seed);
            break;
        }
    }
    let Some(seed) = found else {
        panic!(
            "no seed of {SEEDS:?} re-issued a token with both clusters restored from before the serving epoch"
        );
    };
    let (_, failure) = run_one(seed, PRESET, OPS);
    if let Some(f) = failure {
        panic!("seed {seed} fails without that restore too:\n{f}");
    }
}

/// The shard-map fence's judge has teeth: with the arbiters picked to stay
/// behind a fence loading its map at once anyway
/// ([`FaultKnobs::map_fences_unenforced`]), their grants inside the windows
/// must show as violations, and the same seed as the preset runs it must
/// pass. If this fails, either the judge stopped seeing grants through the
/// arbiters behind a fence or the fenced presets no longer route calls to
/// them while it is up (the CI seeds then prove nothing about fences).
///
/// [`FaultKnobs::map_fences_unenforced`]: latchkey_sim::simulation::FaultKnobs::map_fences_unenforced
#[test]
fn grants_past_a_fence_the_arbiters_ignore_are_found() {
    const SEED: u64 = 107;
    const PRESET: &str = "fenced";
    const OPS: usize = 3000;
    let mut cfg = SimConfig::preset(PRESET, SEED).expect("preset");
    cfg.min_ops = OPS;
    cfg.faults.map_fences_unenforced = true;
    let result = run(&cfg);
    println!("{} [{PRESET}, fences not enforced]", result.summary());
    assert!(
        !result.fences.violations.is_empty() && !result.ok(),
        "no grant past a fence its arbiters ignored was found: {:?}",
        result.fences
    );
    println!("the first: {}", result.fences.violations[0]);
    let (_, failure) = run_one(SEED, PRESET, OPS);
    if let Some(f) = failure {
        panic!("seed {SEED} fails with the fences enforced too:\n{f}");
    }
}

/// The simulation's force-releases have teeth: with
/// [`FaultKnobs::force_releases_reread`] the forced end names whatever
/// holds the key right before it (the approval read another hold: the bug a
/// request's lease and revision guard against), so a hold handed over or
/// granted again in between is deleted under its holder, and the checker
/// finds the key granted to two clients at once. The same seed with the
/// forced ends as built passes.
///
/// [`FaultKnobs::force_releases_reread`]: latchkey_sim::simulation::FaultKnobs::force_releases_reread
#[test]
fn a_forced_end_of_a_hold_granted_since_is_found() {
    const SEED: u64 = 111;
    const PRESET: &str = "forced";
    const OPS: usize = 5000;
    let mut cfg = SimConfig::preset(PRESET, SEED).expect("preset");
    cfg.min_ops = OPS;
    cfg.faults.force_releases_reread = true;
    let result = run(&cfg);
    println!("{} [{PRESET}, forced ends re-read]", result.summary());
    assert!(
        !result.report.ok(),
        "no violation found with forced ends of the hold as it is now ({:?})",
        result.forced
    );
    let (_, failure) = run_one(SEED, PRESET, OPS);
    if let Some(f) = failure {
        panic!("seed {SEED} fails with the forced ends as built too:\n{f}");
    }
}

/// The simulation's session revocations have teeth: with
/// [`FaultKnobs::force_revokes_reread`] the approval revokes the session
/// that holds the key right after the forced end (often the next waiter's,
/// just handed the key), not the one it approved, so a hold nobody was told
/// of ends under its client and the checker finds the key granted to two
/// clients at once. The same seed with the revocation as built passes.
///
/// [`FaultKnobs::force_revokes_reread`]: latchkey_sim::simulation::FaultKnobs::force_revokes_reread
#[test]
fn a_revocation_of_a_session_not_approved_is_found() {
    const SEED: u64 = 112;
    const PRESET: &str = "forced";
    const OPS: usize = 5000;
    let mut cfg = SimConfig::preset(PRESET, SEED).expect("preset");
    cfg.min_ops = OPS;
    cfg.faults.force_revokes_reread = true;
    let result = run(&cfg);
    println!("{} [{PRESET}, revocations re-read]", result.summary());
    assert!(
        !result.ok(),
        "no violation found with revocations of the session holding the key now ({:?})",
        result.forced
    );
    let (_, failure) = run_one(SEED, PRESET, OPS);
    if let Some(f) = failure {
        panic!("seed {SEED} fails with the revocations as built too:\n{f}");
    }
}

/// The quorum-loss judge has teeth: with
/// [`FaultKnobs::blind_hold_follower`] the arbiters' hold counts see no hold
/// in the log, so a grant from memory during a quorum loss takes keys the
/// log holds for other sessions, and the judge finds it. The same seed with
/// the hold counts as built passes.
///
/// [`FaultKnobs::blind_hold_follower`]: latchkey_sim::simulation::FaultKnobs::blind_hold_follower
#[test]
fn a_memory_grant_of_a_key_held_in_the_log_is_found() {
    const SEED: u64 = 115;
    const PRESET: &str = "quorum-loss";
    const OPS: usize = 5000;
    let mut cfg = SimConfig::preset(PRESET, SEED).expect("preset");
    cfg.min_ops = OPS;
    cfg.faults.blind_hold_follower = true;
    let result = run(&cfg);
    println!("{} [{PRESET}, blind hold counts]", result.summary());
    assert!(
        !result.memory.violations.is_empty(),
        "no memory grant of a key held in the log found with blind hold counts ({:?})",
        result.memory
    );
    let (_, failure) = run_one(SEED, PRESET, OPS);
    if let Some(f) = failure {
        panic!("seed {SEED} fails with the hold counts as built too:\n{f}");
    }
}

/// The shard moves' judge has teeth: with
/// [`FaultKnobs::shard_moves_unfenced`] the operator adds the shard by
/// publishing the next map at once (no fence on the old shards, no drain
/// of the moving ranges, no epoch raised on the new shard), so a moved key
/// is granted on its new shard while its old one still holds it, with a
/// smaller token, and the checker finds it. The same seed with the move as built passes.
///
/// [`FaultKnobs::shard_moves_unfenced`]: latchkey_sim::simulation::FaultKnobs::shard_moves_unfenced
#[test]
fn an_unfenced_shard_move_is_found() {
    const SEED: u64 = 137;
    const PRESET: &str = "shards";
    const OPS: usize = 5000;
    let mut cfg = SimConfig::preset(PRESET, SEED).expect("preset");
    cfg.min_ops = OPS;
    cfg.faults.shard_moves_unfenced = true;
    let result = run(&cfg);
    println!("{} [{PRESET}, unfenced shard moves]", result.summary());
    assert!(
        !result.ok(),
        "no violation found with a shard move published at once ({:?})",
        result.shards
    );
    let (_, failure) = run_one(SEED, PRESET, OPS);
    if let Some(f) = failure {
        panic!("seed {SEED} fails with the move as built too:\n{f}");
    }
}
