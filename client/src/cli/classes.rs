//! `latchctl classes check`: validates a policy directory and prints each
//! class's review line (ADR-11: the cost of the TTL next to the TTL).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use latchkey_policies::{Date, PolicySet, review};
use serde_json::json;

use super::{Failure, Output};

#[derive(Debug, Subcommand)]
pub enum ClassesCommand {
    /// Load and validate a policy directory (classes/ and grants/).
    Check(CheckArgs),
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    pub dir: PathBuf,
    /// Expected concurrent sessions, for the keepalive load estimate.
    #[arg(long, default_value_t = 1000)]
    pub sessions: u64,
}

pub fn run(command: ClassesCommand, out: Output) -> Result<ExitCode, Failure> {
    let ClassesCommand::Check(args) = command;
    let set = match PolicySet::load_dir(&args.dir, Date::today_utc()) {
        Ok(set) => set,
        Err(err) => {
            if out.json {
                out.line(json!({ "ok": false, "error": err.to_string() }));
                return Ok(ExitCode::FAILURE);
            }
            // The policy error already names the file and the problem.
            return Err(Failure::Plain(err.to_string()));
        }
    };
    let reports: Vec<_> = set
        .classes()
        .values()
        .map(|class| review(class, args.sessions))
        .collect();
    if out.json {
        out.line(json!({
            "ok": true,
            "classes": reports.iter().map(|r| json!({
                "class": r.class,
                "tier": r.tier.to_string(),
                "enforcement": r.enforcement.to_string(),
                "on_quorum_loss": r.on_quorum_loss.to_string(),
                "ttl_seconds": r.ttl_seconds,
                "expected_sessions": r.expected_sessions,
                "keepalive_interval_ms": r.keepalive_interval_ms,
                "keepalives_per_second": r.keepalives_per_second,
                "liveness_bound_seconds": r.liveness_bound_seconds,
                "fence_deadline_ms": r.fence_deadline_ms,
                "review": r.to_string(),
            })).collect::<Vec<_>>(),
        }));
    } else {
        for report in &reports {
            println!("{report}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
