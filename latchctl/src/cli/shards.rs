//! `latchctl admin shards`: the entity shards and their moves (ADR-09).

use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use latchkey_client::Client;
use latchkey_proto::adminv1::change_shards_request::Change;
use latchkey_proto::adminv1::{
    AddShard, CancelMove, ChangeShardsRequest, PinNamespace, ShardInfo, ShardStatus,
};
use serde_json::json;

use super::{Failure, Output, duration};

#[derive(Debug, Subcommand)]
pub enum ShardsCommand {
    /// The shard map: each shard's epoch, map fence and holds, and the move
    /// under way.
    Status,
    /// Add an etcd cluster to the entity tier. About 1/N of the ranges move
    /// to it; they take no new grants until their holds on their old shards
    /// end (at most the longest class TTL).
    Add(AddArgs),
    /// Pin every range of NAMESPACE to a shard (a tenant with its own
    /// cluster); its ranges on other shards move there.
    Move(MoveArgs),
    /// Step the move under way as far as it can go now.
    Step(StepArgs),
    /// Cancel the move under way: every range stays where it is (safe
    /// until the move finishes).
    Cancel(CancelArgs),
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    #[arg(long)]
    pub reason: String,
}

#[derive(Debug, Args)]
pub struct AddArgs {
    /// The shard's name: 1 to 63 of a-z, 0-9 and '-' (it is hashed: never rename it).
    pub name: String,
    /// Its etcd client URLs, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub endpoints: Vec<String>,
    /// Relative capacity, 1 to 100.
    #[arg(long, default_value_t = 1)]
    pub weight: u32,
    /// Why: kept in the map while the move runs, and logged.
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub wait: WaitArgs,
}

#[derive(Debug, Args)]
pub struct MoveArgs {
    /// The namespace (a lock key's first segment).
    pub namespace: String,
    /// The shard to pin it to.
    #[arg(long)]
    pub to: String,
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub wait: WaitArgs,
}

#[derive(Debug, Args)]
pub struct StepArgs {
    /// A destination shard whose epoch must be raised ends every hold on it;
    /// allow that (a new shard holds nothing and never needs this).
    #[arg(long)]
    pub allow_ending_holds: bool,
    #[command(flatten)]
    pub wait: WaitArgs,
}

#[derive(Debug, Args)]
pub struct WaitArgs {
    /// How long to keep stepping the move until it finishes (0s: one step).
    #[arg(long, default_value = "10m", value_parser = duration::parse)]
    pub wait: Duration,
}

pub async fn run(client: Client, command: ShardsCommand, out: &Output) -> Result<(), Failure> {
    let status = match command {
        ShardsCommand::Status => client.shards().await?,
        ShardsCommand::Add(args) => {
            let change = ChangeShardsRequest {
                change: Some(Change::Add(AddShard {
                    name: args.name,
                    endpoints: args.endpoints,
                    weight: args.weight,
                })),
                reason: args.reason,
            };
            let started = client.change_shards(change).await?;
            finish(&client, started, false, args.wait.wait, out).await?
        }
        ShardsCommand::Move(args) => {
            let change = ChangeShardsRequest {
                change: Some(Change::Pin(PinNamespace {
                    namespace: args.namespace,
                    shard: args.to,
                })),
                reason: args.reason,
            };
            let started = client.change_shards(change).await?;
            finish(&client, started, false, args.wait.wait, out).await?
        }
        ShardsCommand::Cancel(args) => {
            client
                .change_shards(ChangeShardsRequest {
                    change: Some(Change::Cancel(CancelMove {})),
                    reason: args.reason,
                })
                .await?
        }
        ShardsCommand::Step(args) => {
            let stepped = client.step_shard_move(args.allow_ending_holds).await?;
            finish(
                &client,
                stepped,
                args.allow_ending_holds,
                args.wait.wait,
                out,
            )
            .await?
        }
    };
    print_status(&status, out);
    match &status.r#move {
        Some(m) => Err(Failure::Plain(format!(
            "the move to shard map version {} has not finished: {}",
            status.version + 1,
            m.detail
        ))),
        None => Ok(()),
    }
}

/// Steps the move until it finishes or `wait` runs out.
async fn finish(
    client: &Client,
    mut status: ShardStatus,
    allow_ending_holds: bool,
    wait: Duration,
    out: &Output,
) -> Result<ShardStatus, Failure> {
    let until = Instant::now() + wait;
    let mut said = String::new();
    while let Some(m) = &status.r#move {
        if Instant::now() >= until {
            break;
        }
        if !out.json && m.detail != said {
            eprintln!("{}", m.detail);
            said = m.detail.clone();
        }
        tokio::time::sleep(Duration::from_secs(1).min(until - Instant::now())).await;
        status = client.step_shard_move(allow_ending_holds).await?;
    }
    Ok(status)
}

fn shard_json(s: &ShardInfo) -> serde_json::Value {
    json!({
        "name": s.name,
        "endpoints": s.endpoints,
        "weight": s.weight,
        "epoch": s.epoch,
        "fence_version": s.fence_version,
        "holds": s.holds,
        "moving_holds": s.moving_holds,
        "sealed": s.sealed,
        "error": s.error,
    })
}

fn print_status(s: &ShardStatus, out: &Output) {
    if out.json {
        out.line(json!({
            "version": s.version,
            "shards": s.shards.iter().map(shard_json).collect::<Vec<_>>(),
            "overrides": s.overrides,
            "move": s.r#move.as_ref().map(|m| json!({
                "next_shards": m.next_shards.iter().map(shard_json).collect::<Vec<_>>(),
                "next_overrides": m.next_overrides,
                "phase": m.phase,
                "detail": m.detail,
                "reason": m.reason,
                "started_at_unix_ms": m.started_at_unix_ms,
            })),
        }));
        return;
    }
    match s.version {
        0 => println!("shard map            none yet: every entity key on the lock cluster"),
        v => println!("shard map            version {v}"),
    }
    println!(
        "{:<20} {:>6} {:>6} {:>7} {:>7}  endpoints",
        "shard", "weight", "epoch", "fence", "holds"
    );
    for shard in &s.shards {
        print_shard(shard);
    }
    for (namespace, shard) in &s.overrides {
        println!("pinned               {namespace} -> {shard}");
    }
    if let Some(m) = &s.r#move {
        println!(
            "moving to version {} ({}): {}",
            s.version + 1,
            m.phase,
            m.reason
        );
        for shard in m
            .next_shards
            .iter()
            .filter(|n| !s.shards.iter().any(|c| c.name == n.name))
        {
            print!("  new ");
            print_shard(shard);
        }
        for (namespace, shard) in &m.next_overrides {
            if s.overrides.get(namespace) != Some(shard) {
                println!("  pin                {namespace} -> {shard}");
            }
        }
        let moving: i64 = s.shards.iter().map(|x| x.moving_holds).sum();
        println!("  holds left in moving ranges: {moving}");
        if !m.detail.is_empty() {
            println!("  {}", m.detail);
        }
    }
}

fn print_shard(s: &ShardInfo) {
    println!(
        "{:<20} {:>6} {:>6} {:>7} {:>7}  {}{}{}",
        s.name,
        s.weight,
        s.epoch,
        s.fence_version,
        s.holds,
        s.endpoints.join(","),
        if s.sealed { "  SEALED" } else { "" },
        if s.error.is_empty() {
            String::new()
        } else {
            format!("  ({})", s.error)
        },
    );
}
