//! The shard-move fault (ADR-09): the gate's keys (`bench/gate/...`, one
//! range) move to a second entity shard under load and back again. Each
//! move drains the range (new grants refused with RANGE_MOVING while its
//! holds end), raises the destination's epoch above the source's and flips
//! the map; the checker then judges every key's tokens across both moves.

use std::time::Duration;

use anyhow::{Context, bail};
use latchkey_client::Client;
use latchkey_proto::adminv1::change_shards_request::Change;
use latchkey_proto::adminv1::{AddShard, ChangeShardsRequest, PinNamespace, ShardStatus};
use tokio::time::Instant;

/// The second shard's name in the map.
pub const SHARD_B: &str = "shard-b";
/// The lock cluster's name (the arbiters' default `--lock-cluster-name`).
const HOME: &str = "default";
/// How long one move may take: its holds end within a TTL, and the
/// arbiters adopt each map version within milliseconds.
const MOVE_WITHIN: Duration = Duration::from_secs(60);

/// Moves `bench/` to shard B (adding B on the first call) and back home,
/// with `dwell` of load on B in between. Returns what it did.
pub async fn there_and_back(
    operator: &Client,
    shard_b: String,
    dwell: Duration,
) -> anyhow::Result<String> {
    let status = retried(|| operator.shards()).await?;
    if !status.shards.iter().any(|s| s.name == SHARD_B) {
        run(
            operator,
            ChangeShardsRequest {
                change: Some(Change::Add(AddShard {
                    name: SHARD_B.into(),
                    endpoints: vec![shard_b],
                    weight: 1,
                })),
                reason: "release gate: a second entity shard".into(),
            },
            false,
        )
        .await
        .context("adding the second shard")?;
    }
    // Each way raises the destination's epoch above the source's when it is
    // not already (restores advance the lock cluster's meanwhile), which
    // ends every hold on the destination: it holds none of the gate's then
    // (they all live on the source, and nothing else lives on either), so
    // the gate allows it, as an operator who checked would.
    let there = pin(operator, SHARD_B, true)
        .await
        .context("moving bench/ to shard B")?;
    tokio::time::sleep(dwell).await;
    let back = pin(operator, HOME, true)
        .await
        .context("moving bench/ home")?;
    Ok(format!(
        "bench/ to {SHARD_B} (map v{there}) and back (map v{back})"
    ))
}

async fn pin(operator: &Client, shard: &str, allow_ending_holds: bool) -> anyhow::Result<u64> {
    let done = run(
        operator,
        ChangeShardsRequest {
            change: Some(Change::Pin(PinNamespace {
                namespace: "bench".into(),
                shard: shard.into(),
            })),
            reason: format!("release gate: bench/ to {shard} under load"),
        },
        allow_ending_holds,
    )
    .await?;
    Ok(done.version)
}

/// Starts a change and steps it until it finishes.
async fn run(
    operator: &Client,
    change: ChangeShardsRequest,
    allow_ending_holds: bool,
) -> anyhow::Result<ShardStatus> {
    let until = Instant::now() + MOVE_WITHIN;
    // A retry of a change whose publish landed (and whose first step then
    // failed) finds the move under way: step it.
    let mut status = match retried(|| operator.change_shards(change.clone())).await {
        Ok(status) => status,
        Err(e) if e.to_string().contains("already under way") => {
            retried(|| operator.step_shard_move(allow_ending_holds)).await?
        }
        Err(e) => return Err(e),
    };
    while let Some(m) = &status.r#move {
        if Instant::now() >= until {
            bail!(
                "the move did not finish within {MOVE_WITHIN:?}: {}",
                m.detail
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        status = retried(|| operator.step_shard_move(allow_ending_holds)).await?;
    }
    Ok(status)
}

/// Retries a call refused as unavailable (an arbiter adopting the map,
/// etcd electing), as an operator would.
async fn retried<T, F, Fut>(mut call: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, latchkey_client::Error>>,
{
    let mut tries = 0;
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) if tries < 20 && e.is_transient() => {
                tries += 1;
                tracing::info!(error = %e, "shard call refused for now; again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}
