//! The release gate from the command line: a short run like CI's, or a long
//! soak with a seed and a duration.
//!
//! ```text
//! cargo build -p latchkey-gate -p latchkey-tests --bins
//! target/debug/latchkey-gate --duration 30m --seed 42
//! ```
//! Exit code 0 when the history checks out and every key was granted again
//! after the last fault, 1 when the checker found a violation (history and
//! report saved under --out) or the service did not recover, 2 when the run
//! could not be carried out. `--check history.jsonl` re-checks a saved history.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use latchkey_gate::{self as gate, Binaries, Fault, GateConfig};
use latchkey_tests::faulty_log::TestFault;

#[derive(Parser)]
#[command(
    about = "Latchkey release gate: faults on a 3-member etcd cluster, a checked lock history"
)]
struct Args {
    /// Seed for the nemesis and the workloads (random when omitted; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// How long the nemesis runs, e.g. 100s, 30m, 2h.
    #[arg(long, default_value = "100s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Workload processes (each its own SPIFFE identity); default as CI's gate.
    #[arg(long)]
    workers: Option<usize>,
    /// Electors beside the workers: processes of one identity campaigning
    /// for two elections on the coord tier (default 3; 0 for none).
    #[arg(long)]
    electors: Option<usize>,
    /// Lock keys the workers contend on; default as CI's gate.
    #[arg(long)]
    keys: Option<usize>,
    /// Arbiter processes; workers are spread over them.
    #[arg(long)]
    arbiters: Option<usize>,
    /// Longest unit of work inside a hold, e.g. 20ms (one in 16 is ten
    /// times longer); default as CI's gate.
    #[arg(long, value_parser = humantime::parse_duration)]
    unit_of_work: Option<Duration>,
    /// Fault kinds, comma-separated (default: all): kill-member,
    /// pause-leader, partition, kill-arbiter, pause-holder, restore,
    /// restore-forget, clock-step, clock-step-arbiter, slow-disk-member,
    /// slow-disk-arbiter, quorum-loss, shard-move.
    /// `none` for no nemesis.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Where a failing run keeps its history and report.
    #[arg(long, default_value = "target/gate")]
    out: PathBuf,
    /// Run the arbiters with a deliberate bug (`grant-on-watch`,
    /// `forget-hidden`): the checker must then fail the run
    /// (`lose-grant-answers` is forget-hidden's control, not a bug). The gate's arbiter-under-test has the
    /// tests' faults; a shipped latchkey-arbiter has none.
    #[arg(long, value_parser = TestFault::parse, default_value = "none")]
    arbiter_test_fault: TestFault,
    /// Keep the history, report and logs under --out even when the run passes.
    #[arg(long)]
    keep: bool,
    /// Every fenced write to the PostgreSQL reference fence, instead of a
    /// rotation through every fence adapter (MariaDB, Redis, etcd, S3).
    #[arg(long)]
    postgres_only: bool,
    /// Run nothing: check a saved history (JSON lines) and print the report.
    #[arg(long, value_name = "HISTORY")]
    check: Option<PathBuf>,
}

/// `--check`: the checker alone, on a history a run saved.
fn check_saved(path: &std::path::Path) -> ExitCode {
    let history = std::fs::File::open(path)
        .map_err(anyhow::Error::from)
        .and_then(|f| {
            Ok(latchkey_checker::History::from_jsonl(
                std::io::BufReader::new(f),
            )?)
        });
    match history {
        Ok(history) => {
            let started = std::time::Instant::now();
            let report =
                latchkey_checker::check(&history, &latchkey_checker::CheckOptions::default());
            let took = started.elapsed().as_secs_f64();
            print!("{report}");
            println!(
                "checker: {:.2} s ({:.0} ops/s)",
                took,
                report.ops_checked as f64 / took.max(1e-3)
            );
            if report.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("latchkey-gate: {}: {e:#}", path.display());
            ExitCode::from(2)
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    if let Some(path) = &args.check {
        return check_saved(path);
    }
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    println!("gate: seed {seed} (re-run with --seed {seed})");
    let faults = if args.faults.is_empty() {
        Fault::ALL.to_vec()
    } else if args.faults == ["none"] {
        Vec::new()
    } else {
        match args.faults.iter().map(|f| Fault::parse(f)).collect() {
            Ok(f) => f,
            Err(e) => {
                eprintln!("latchkey-gate: {e}");
                return ExitCode::from(2);
            }
        }
    };
    let binaries = match Binaries::beside_current_exe() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("latchkey-gate: {e:#}");
            return ExitCode::from(2);
        }
    };
    let short = GateConfig::short(seed, binaries, args.out);
    let config = GateConfig {
        duration: args.duration,
        workers: args.workers.unwrap_or(short.workers),
        electors: args.electors.unwrap_or(short.electors),
        keys: args.keys.unwrap_or(short.keys),
        arbiters: args.arbiters.unwrap_or(short.arbiters),
        unit_of_work: args.unit_of_work.unwrap_or(short.unit_of_work),
        faults,
        arbiter_test_fault: args.arbiter_test_fault,
        keep: args.keep,
        fence_rotation: !args.postgres_only,
        ..short
    };
    match gate::run(config).await {
        Ok(outcome) => {
            print!("{outcome}");
            if outcome.report.ok() && outcome.recovered_after.is_some() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("latchkey-gate: the run could not be carried out: {e:#}");
            ExitCode::from(2)
        }
    }
}
