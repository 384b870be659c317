//! `latchkey-sim`: one deterministic simulation run from the command line,
//! to replay a seed the CI test printed or to explore new ones.
//!
//! ```text
//! latchkey-sim --seed 42 [--preset default|three-arbiters|one-arbiter|state-loss|
//!                        witnessed|witnessed-three-arbiters|witnessed-state-loss|
//!                        unwitnessed-state-loss|durable|durable-three-arbiters|
//!                        fenced|fenced-three-arbiters|forced|forced-three-arbiters|
//!                        quorum-loss|quorum-loss-three-arbiters|renewal-outages|elections|
//!                        elections-three-arbiters|quota|quota-three-arbiters|semaphores|
//!                        semaphores-three-arbiters|shared|shared-three-arbiters|
//!                        shared-durable|shards|shards-three-arbiters]
//!              [--ops 10000] [--arbiters 2] [--clients 10] [--keys 8]
//!              [--long-holds 3] [--bug shadow-marks-trusted|...] [--coord-rollout on]
//!              [--faults all|state-loss|witnessed|witnessed-state-loss|fenced|forced|
//!                        quorum-loss|none]
//!              [--witness on|off] [--history out.jsonl]
//! ```
//!
//! Prints the run's summary, the simulated work per second of wall time,
//! the checker's verdict (and every violation); writes the history as JSON
//! lines when asked (`latchkey-gate --check out.jsonl` re-checks it).
//! Exit code 0 when the run is safe and live, 1 when it is not, 2 on bad
//! arguments. `LATCHKEY_SIM_TRACE=trace.txt` also writes every lock-log
//! call (simulated time, revision, call) for debugging a seed;
//! `LATCHKEY_SIM_LOG=<filter>` (e.g. `off,latchkey_arbiter::table=debug`)
//! prints the arbiters' own log lines to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use latchkey_sim::simulation::{FaultKnobs, PRESETS, SimConfig, run};

const USAGE: &str = "usage: latchkey-sim --seed N [--preset P] [--ops M] [--arbiters A] [--clients C] [--keys K] [--long-holds PERCENT] [--bug map-fences-unenforced|force-releases-reread|force-revokes-reread|shard-moves-unfenced|shadow-marks-trusted|blind-hold-follower|tier-bindings-unshared] [--coord-rollout on|off] [--faults all|state-loss|witnessed|witnessed-state-loss|fenced|forced|quorum-loss|none] [--witness on|off] [--history out.jsonl]\n(presets: `--preset list`, or the error for an unknown one)";

struct Args {
    cfg: SimConfig,
    history: Option<PathBuf>,
    /// The flags that give this run again.
    replay: String,
}

fn parse() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    // The preset first, whatever its place: the other flags adjust it.
    let preset = argv
        .iter()
        .position(|a| a == "--preset")
        .and_then(|i| argv.get(i + 1))
        .map_or("default", String::as_str);
    let mut cfg = SimConfig::preset(preset, 0).ok_or_else(|| {
        format!(
            "--preset {preset}: not a preset (one of {})\n{USAGE}",
            PRESETS.join(", ")
        )
    })?;
    let mut seed: Option<u64> = None;
    let mut history = None;
    let mut replay = Vec::new();
    let mut args = argv.iter().cloned();
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.to_string());
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}\n{USAGE}"))
        };
        let count = || number().and_then(|n| usize::try_from(n).map_err(|e| e.to_string()));
        if flag != "--history" {
            replay.push(format!("{flag} {value}"));
        }
        match flag.as_str() {
            "--preset" => {}
            "--seed" => seed = Some(number()?),
            "--ops" => cfg.min_ops = count()?,
            "--arbiters" => cfg.arbiters = count()?.max(1),
            "--clients" => cfg.clients = count()?.max(1),
            "--keys" => cfg.keys = count()?.max(1),
            "--long-holds" => {
                cfg.long_hold_percent = u32::try_from(number()?.min(100)).unwrap_or(100);
            }
            "--faults" => {
                cfg.faults = match value.as_str() {
                    "all" => FaultKnobs::all(),
                    "state-loss" => FaultKnobs::state_loss(),
                    "witnessed" => FaultKnobs::witnessed(),
                    "witnessed-state-loss" => FaultKnobs::witnessed_state_loss(),
                    "fenced" => FaultKnobs::fenced(),
                    "forced" => FaultKnobs::forced(),
                    "quorum-loss" => FaultKnobs::quorum_loss(),
                    "none" => FaultKnobs::none(),
                    other => return Err(format!("--faults {other}: not a fault set\n{USAGE}")),
                }
            }
            "--witness" => {
                cfg.witness = match value.as_str() {
                    "on" => true,
                    "off" => false,
                    other => return Err(format!("--witness {other}: on or off\n{USAGE}")),
                }
            }
            "--history" => history = Some(PathBuf::from(value)),
            "--coord-rollout" => {
                cfg.coord_rollout = match value.as_str() {
                    "on" => true,
                    "off" => false,
                    other => return Err(format!("--coord-rollout {other}: on or off\n{USAGE}")),
                }
            }
            // The bugs the knob tests put in, to look for seeds that show them.
            "--bug" => match value.as_str() {
                "map-fences-unenforced" => cfg.faults.map_fences_unenforced = true,
                "force-releases-reread" => cfg.faults.force_releases_reread = true,
                "force-revokes-reread" => cfg.faults.force_revokes_reread = true,
                "shard-moves-unfenced" => cfg.faults.shard_moves_unfenced = true,
                "shadow-marks-trusted" => cfg.faults.shadow_marks_trusted = true,
                "blind-hold-follower" => cfg.faults.blind_hold_follower = true,
                "tier-bindings-unshared" => cfg.faults.tier_bindings_unshared = true,
                other => return Err(format!("--bug {other}: not a bug knob\n{USAGE}")),
            },
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    cfg.seed = seed.ok_or_else(|| format!("--seed is required\n{USAGE}"))?;
    Ok(Args {
        cfg,
        history,
        replay: replay.join(" "),
    })
}

/// Prints a line; a closed stdout (`| head`) is not worth a panic.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Ok(filter) = std::env::var("LATCHKEY_SIM_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .without_time()
            .with_target(false)
            .init();
    }
    let began = Instant::now();
    let result = run(&args.cfg);
    let wall = began.elapsed().as_secs_f64();
    say!("{}", result.summary());
    say!(
        "throughput: {} ops in {:.2} s of wall time ({:.0} ops/s; {:.0} x real time)",
        result.ops,
        wall,
        result.ops as f64 / wall.max(1e-3),
        result.simulated.as_secs_f64() / wall.max(1e-3)
    );
    for note in &result.notes {
        say!("note: {note}");
    }
    if let Some(path) = &args.history {
        match std::fs::write(path, result.history.to_jsonl_string()) {
            Ok(()) => say!("history: {}", path.display()),
            Err(e) => eprintln!("could not write the history to {}: {e}", path.display()),
        }
    }
    if result.ok() {
        say!("{}", result.report);
        ExitCode::SUCCESS
    } else {
        say!("{}", result.failure());
        say!(
            "replay: cargo run -p latchkey-sim --bin latchkey-sim -- {} --history history.jsonl",
            args.replay
        );
        ExitCode::from(1)
    }
}
