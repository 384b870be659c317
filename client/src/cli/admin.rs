//! `latchctl admin`: operator calls.

use std::process::ExitCode;

use crate::Client;
use clap::{Args, Subcommand};
use serde_json::json;

use super::{Failure, Output};

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// The arbiter's epoch, cluster ids, seal state and witness.
    Status,
    /// Unseal after a restore: epoch `expected` -> above every epoch known, deleting every hold.
    AdvanceEpoch(AdvanceArgs),
}

#[derive(Debug, Args)]
pub struct AdvanceArgs {
    /// The epoch the arbiter is at now (see `admin status`).
    #[arg(long)]
    pub expected: u32,
    /// Why; stored with the new epoch record.
    #[arg(long)]
    pub reason: String,
    /// The new epoch is at least this. Only needed after restoring BOTH the
    /// lock and the coord cluster from backups older than the serving epoch:
    /// pass one above the highest epoch in any token your fenced resources
    /// stored (token >> 48).
    #[arg(long, default_value_t = 0)]
    pub at_least: u32,
}

pub async fn run(client: Client, command: AdminCommand, out: Output) -> Result<ExitCode, Failure> {
    match command {
        AdminCommand::Status => {
            let s = client.admin_status().await?;
            if out.json {
                out.line(json!({
                    "epoch": s.epoch,
                    "epoch_cluster_id": s.epoch_cluster_id,
                    "current_cluster_id": s.current_cluster_id,
                    "sealed": s.sealed,
                    "seal_reason": s.seal_reason,
                    "revision_high_water_mark": s.revision_high_water_mark,
                    "witness": s.witness,
                    "witnessed_revision": s.witnessed_revision,
                    "witnessed_mark_epoch": s.witnessed_mark_epoch,
                    "witnessed_epoch": s.witnessed_epoch,
                    "coord_seen_revision": s.coord_seen_revision,
                    "coord_seen_mark_epoch": s.coord_seen_mark_epoch,
                    "coord_seen_epoch": s.coord_seen_epoch,
                }));
            } else {
                println!("epoch                {}", s.epoch);
                println!("epoch cluster id     {:#018x}", s.epoch_cluster_id);
                println!("current cluster id   {:#018x}", s.current_cluster_id);
                println!("revision high-water  {}", s.revision_high_water_mark);
                // An arbiter from before issue 15 sends no witness.
                let witness = if s.witness.is_empty() {
                    "unknown (the arbiter does not say)"
                } else {
                    s.witness.as_str()
                };
                println!("witness              {witness}");
                if s.witnessed_revision != 0 || s.witnessed_epoch != 0 {
                    println!(
                        "witnessed grant      e{}:r{}",
                        s.witnessed_mark_epoch, s.witnessed_revision
                    );
                    println!("witnessed epoch      {}", s.witnessed_epoch);
                }
                // The other direction: the lock cluster's record of the
                // coord cluster, which reveals a restore of the coord cluster.
                if s.coord_seen_revision != 0 || s.coord_seen_epoch != 0 {
                    println!(
                        "coord cluster, as the lock cluster recorded it: grant e{}:r{}, epoch {}",
                        s.coord_seen_mark_epoch, s.coord_seen_revision, s.coord_seen_epoch
                    );
                }
                if s.sealed {
                    println!("sealed               YES: {}", s.seal_reason);
                } else {
                    println!("sealed               no");
                }
            }
        }
        AdminCommand::AdvanceEpoch(args) => {
            let r = client
                .advance_epoch_at_least(args.expected, &args.reason, args.at_least)
                .await?;
            if out.json {
                out.line(json!({
                    "epoch": r.epoch,
                    "cluster_id": r.cluster_id,
                    "holds_deleted": r.holds_deleted,
                }));
            } else {
                println!(
                    "epoch advanced to {} (cluster {:#018x}); {} holds deleted",
                    r.epoch, r.cluster_id, r.holds_deleted
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
