//! The deterministic simulation in CI (issue 11): a fixed list of seeds
//! over the presets, over 10,000 checked operations in all, each run a
//! pure function of its seed.
//!
//! A failing run prints its seed, the checker's violations (or the
//! liveness failure), the commands that replay it exactly, and writes its
//! history where `latchkey-gate --check` can read it.
//!
//! `LATCHKEY_SIM_SEED=<seed>[:<preset>]` (and optionally
//! `LATCHKEY_SIM_OPS=<n>`) runs one more seed: `seed_from_env`.

use std::path::PathBuf;
use std::time::Instant;

use latchkey_sim::simulation::{PRESETS, SimConfig, SimRun, run};

/// (seed, preset, operations): seeds 1 to 12 over the presets, ~42,000
/// operations in all (CI promises at least [`MIN_CI_OPS`]); the state-loss
/// runs have no restores (issue 15). The seeds are not picked to pass.
const CI_RUNS: &[(u64, &str, usize)] = &[
    (1, "default", 3500),
    (2, "three-arbiters", 3500),
    (3, "one-arbiter", 3500),
    (4, "state-loss", 3500),
    (5, "default", 3500),
    (6, "three-arbiters", 3500),
    (7, "one-arbiter", 3500),
    (8, "state-loss", 3500),
    (9, "default", 3500),
    (10, "three-arbiters", 3500),
    (11, "one-arbiter", 3500),
    (12, "state-loss", 3500),
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
         re-check: cargo run -p latchkey-tests --bin latchkey-gate -- --check {}\n",
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
    for &(seed, preset, ops) in CI_RUNS {
        let (result, failure) = run_one(seed, preset, ops);
        total += result.ops;
        if let Some(f) = failure {
            failures.push(f);
        }
    }
    println!(
        "simulation: {total} operations checked over {} seeds in {:.2} s of wall time",
        CI_RUNS.len(),
        began.elapsed().as_secs_f64()
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
/// byte (and so the same verdict).
#[test]
fn the_same_seed_gives_the_same_history() {
    for preset in ["default", "state-loss"] {
        let mut cfg = SimConfig::preset(preset, 0x5EED).expect("preset");
        cfg.min_ops = 1500;
        let first = run(&cfg);
        let second = run(&cfg);
        assert!(first.ops >= 1500, "{}", first.summary());
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
