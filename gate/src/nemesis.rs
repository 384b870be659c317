//! The seeded nemesis: every fault kind in the schedule at least once (in a
//! seeded order), then random kinds until the run's duration is up. Each
//! fault is recorded in the history as a `fault` operation (start and end),
//! and the epoch advance after a restore as an `advance` operation, which the
//! checker's model uses (it drops every hold).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use latchkey_client::{Client, ClientConfig, TlsFiles};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::time::Instant;

use super::record::{Fields, Outcome, Recorder};
use super::{CoordEtcd, GateConfig, Rig, TTL};
use latchkey_tests::arbiter::certs;
use latchkey_tests::eventually;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL an etcd member, restart it with the same flags and data.
    KillMember,
    /// SIGSTOP the etcd leader past an election, then SIGCONT.
    PauseLeader,
    /// Cut one etcd member (often the leader) off the network, then heal.
    Partition,
    /// SIGKILL an arbiter process, restart it with the same state dir.
    KillArbiter,
    /// SIGSTOP a worker inside a hold for longer than the TTL, then SIGCONT.
    PauseHolder,
    /// Restore the cluster from an earlier snapshot with the same member
    /// flags (same cluster id), then advance the epoch as an operator.
    Restore,
    /// The same restore, but every arbiter also loses its state dir: each
    /// is killed and its state dir deleted before the restore and started
    /// again with an empty one after it, before the operator's advance (an
    /// arbiter run as a stateless Deployment; issue 15). Only the coord
    /// cluster's witness can then tell that the lock log went back.
    RestoreForget,
    /// Step a holder's wall clock forward, then back behind the real time,
    /// then to the real time again (libfaketime; see [`super::clock`]).
    ClockStep,
    /// The same steps of an arbiter process's wall clock (it times leases
    /// and waits on the monotonic clock, which does not step).
    ClockStepArbiter,
    /// Slow the fsyncs of the disk under an etcd member's data dir (often
    /// the leader's) again and again for a few seconds; writes and reads go
    /// on (see [`latchkey_tests::disk`]).
    SlowDiskMember,
    /// Slow the fsyncs under an arbiter's durable state dir likewise.
    SlowDiskArbiter,
    /// Kill two of the three etcd members (no quorum) for 5-8 s, then
    /// restart both: closed classes refuse, the open class grants token 0
    /// from memory into the spool (ADR-04; see [`super::quorum_loss`]).
    QuorumLoss,
    /// Move the gate's keys to a second entity shard under load and back
    /// (ADR-09): each move drains the range, raises the destination's epoch
    /// and flips the shard map (see [`super::shards`]).
    ShardMove,
    /// SIGKILL a member of the coord cluster (three members in network
    /// namespaces when a coord fault is scheduled), restart it with the
    /// same data 0.5-2.5 s later.
    KillCoord,
    /// SIGSTOP the coord cluster's leader for 2-4 s, then SIGCONT.
    PauseCoordLeader,
    /// Cut a coord member (the leader half the time) off for 2-5 s.
    PartitionCoord,
    /// Restore the coord etcd from a snapshot taken 3 s into the run (same
    /// flags); the arbiters seal the coord tier (its own witness is above
    /// the restored log) and the operator advances the coord tier's epoch,
    /// which ends its locks and elections (`advance` operations scoped to
    /// the coord namespaces). The lock cluster's witness went back with
    /// it, so the arbiters seal the lock cluster too, and the operator
    /// advances that as well.
    RestoreCoord,
}

impl Fault {
    /// Faults of the coord cluster (issue 33): not in [`Fault::ALL`] (the
    /// CI gate's schedule), run by their own short gate and by soaks that
    /// name them.
    pub const COORD: [Fault; 4] = [
        Fault::KillCoord,
        Fault::PauseCoordLeader,
        Fault::PartitionCoord,
        Fault::RestoreCoord,
    ];

    pub const ALL: [Fault; 13] = [
        Fault::KillMember,
        Fault::PauseLeader,
        Fault::Partition,
        Fault::KillArbiter,
        Fault::PauseHolder,
        Fault::Restore,
        Fault::RestoreForget,
        Fault::ClockStep,
        Fault::ClockStepArbiter,
        Fault::SlowDiskMember,
        Fault::SlowDiskArbiter,
        Fault::QuorumLoss,
        Fault::ShardMove,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::KillMember => "kill-member",
            Fault::PauseLeader => "pause-leader",
            Fault::Partition => "partition",
            Fault::KillArbiter => "kill-arbiter",
            Fault::PauseHolder => "pause-holder",
            Fault::Restore => "restore",
            Fault::RestoreForget => "restore-forget",
            Fault::ClockStep => "clock-step",
            Fault::ClockStepArbiter => "clock-step-arbiter",
            Fault::SlowDiskMember => "slow-disk-member",
            Fault::SlowDiskArbiter => "slow-disk-arbiter",
            Fault::QuorumLoss => "quorum-loss",
            Fault::ShardMove => "shard-move",
            Fault::KillCoord => "kill-coord",
            Fault::PauseCoordLeader => "pause-coord-leader",
            Fault::PartitionCoord => "partition-coord",
            Fault::RestoreCoord => "restore-coord",
        }
    }

    pub fn parse(name: &str) -> Result<Fault, String> {
        Fault::ALL
            .into_iter()
            .chain(Fault::COORD)
            .find(|f| f.name() == name)
            .ok_or_else(|| {
                let names: Vec<_> = Fault::ALL
                    .iter()
                    .chain(&Fault::COORD)
                    .map(|f| f.name())
                    .collect();
                format!("unknown fault {name:?}; known: {}", names.join(", "))
            })
    }
}

/// Runs the schedule until `config.duration` has passed since the start;
/// returns the faults injected, by description.
pub(crate) async fn run(
    rig: &Rig,
    config: &GateConfig,
    rng: &mut fastrand::Rng,
    history_dir: &Path,
) -> anyhow::Result<Vec<String>> {
    let start = Instant::now();
    let end = start + config.duration;
    let mut rec = Recorder::create(&history_dir.join("nemesis.jsonl"), "nemesis")?;
    let mut injected = Vec::new();

    // Warm up, then keep a snapshot for the restore faults.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let snapshot = rig.dir.parent().unwrap_or(&rig.dir).join("snapshot.db");
    if config.faults.contains(&Fault::Restore) || config.faults.contains(&Fault::RestoreForget) {
        rig.cluster
            .lock()
            .await
            .snapshot_save(&snapshot)
            .await
            .context("snapshot for the restore fault")?;
    }
    let coord_snapshot = rig
        .dir
        .parent()
        .unwrap_or(&rig.dir)
        .join("coord-snapshot.db");
    if config.faults.contains(&Fault::RestoreCoord) {
        rig.coord
            .lock()
            .await
            .snapshot_save(&coord_snapshot)
            .await
            .context("snapshot for the coord restore fault")?;
    }

    // Scheduled by fault, not by the clock: every kind at least once, in a
    // seeded order, whatever the machine's speed (on a slow machine the
    // owed kinds run past the duration; random kinds fill only the time
    // left after them). A fault that found nothing to act on (no worker
    // inside a hold) goes to the back of the owed queue and is tried again
    // after the others, up to MAX_TRIES times in all before the run fails
    // saying so (then the workers, not the clock, are the problem).
    const MAX_TRIES: u32 = 12;
    let mut owed = config.faults.clone();
    rng.shuffle(&mut owed);
    let mut owed: VecDeque<Fault> = owed.into();
    let mut tries: BTreeMap<&'static str, u32> = BTreeMap::new();
    while !owed.is_empty() || (!config.faults.is_empty() && Instant::now() < end) {
        let gap = rng.u64(
            u64::try_from(config.fault_gap.0.as_millis())?
                ..=u64::try_from(config.fault_gap.1.as_millis())?,
        );
        tokio::time::sleep(Duration::from_millis(gap)).await;
        let (fault, was_owed) = match owed.pop_front() {
            Some(f) => (f, true),
            None => (config.faults[rng.usize(..config.faults.len())], false),
        };
        let snapshots = Snapshots {
            lock: &snapshot,
            coord: &coord_snapshot,
        };
        let injected_now = inject(rig, fault, rng, &mut rec, snapshots)
            .await
            .with_context(|| format!("injecting {}", fault.name()))?;
        match injected_now {
            Some(description) => {
                tracing::info!(fault = %description, "nemesis");
                injected.push(description);
            }
            None if was_owed => {
                let tried = tries.entry(fault.name()).or_insert(0);
                *tried += 1;
                anyhow::ensure!(
                    *tried < MAX_TRIES,
                    "fault {} found nothing to act on {MAX_TRIES} times (no worker inside a hold?)",
                    fault.name()
                );
                tracing::info!(fault = fault.name(), "nemesis: nothing to act on; later");
                owed.push_back(fault);
            }
            None => tracing::info!(fault = fault.name(), "nemesis: nothing to act on"),
        }
    }
    if config.faults.is_empty() {
        tokio::time::sleep_until(end).await;
    }
    // The gate then waits (polling) until every key is granted again.
    Ok(injected)
}

/// The snapshots the restore faults go back to.
#[derive(Clone, Copy)]
struct Snapshots<'a> {
    lock: &'a Path,
    coord: &'a Path,
}

/// Injects `fault`; `None` when there was nothing to act on.
async fn inject(
    rig: &Rig,
    fault: Fault,
    rng: &mut fastrand::Rng,
    rec: &mut Recorder,
    snapshots: Snapshots<'_>,
) -> anyhow::Result<Option<String>> {
    let snapshot = snapshots.lock;
    match fault {
        Fault::KillCoord => {
            let mut coord = rig.coord.lock().await;
            let what;
            match &mut *coord {
                CoordEtcd::Single(s) => {
                    what = "kill-coord".to_owned();
                    let op = begin(rec, &what)?;
                    s.kill()?;
                    tokio::time::sleep(Duration::from_millis(rng.u64(500..2500))).await;
                    s.restart().await?;
                    end(rec, op)?;
                }
                CoordEtcd::Cluster(c) => {
                    let i = if rng.bool() {
                        c.leader().await?
                    } else {
                        rng.usize(..c.members())
                    };
                    what = format!("kill-coord {}", c.name(i));
                    let op = begin(rec, &what)?;
                    c.kill(i)?;
                    tokio::time::sleep(Duration::from_millis(rng.u64(500..2500))).await;
                    c.restart(i).await?;
                    end(rec, op)?;
                }
            }
            Ok(Some(what))
        }
        Fault::PauseCoordLeader => {
            let coord = rig.coord.lock().await;
            let CoordEtcd::Cluster(c) = &*coord else {
                anyhow::bail!("pause-coord-leader needs the 3-member coord cluster");
            };
            let l = c.leader().await?;
            let what = format!("pause-coord-leader {}", c.name(l));
            let op = begin(rec, &what)?;
            c.pause(l)?;
            tokio::time::sleep(Duration::from_millis(rng.u64(2000..4000))).await;
            c.resume(l)?;
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::PartitionCoord => {
            let mut coord = rig.coord.lock().await;
            let CoordEtcd::Cluster(c) = &mut *coord else {
                anyhow::bail!("partition-coord needs the 3-member coord cluster");
            };
            let i = if rng.bool() {
                c.leader().await?
            } else {
                rng.usize(..c.members())
            };
            let what = format!("partition-coord {}", c.name(i));
            let op = begin(rec, &what)?;
            c.partition(i)?;
            tokio::time::sleep(Duration::from_millis(rng.u64(2000..5000))).await;
            c.heal(i)?;
            end(rec, op)?;
            c.wait_healthy(Duration::from_secs(30)).await?;
            Ok(Some(what))
        }
        Fault::RestoreCoord => {
            let what = "restore-coord from snapshot + advance the coord tier and the lock cluster"
                .to_owned();
            let op = begin(rec, &what)?;
            match &mut *rig.coord.lock().await {
                CoordEtcd::Single(s) => {
                    s.restore(snapshots.coord, latchkey_tests::etcd::RestoreFlags::Same)
                        .await?
                }
                CoordEtcd::Cluster(c) => c.restore(snapshots.coord).await?,
            }
            advance_coord(rig, rec).await?;
            // The coord cluster also witnesses the lock cluster: its
            // witness went back with it, so the arbiters seal the lock
            // cluster too (a restore of it could now go unnoticed) and the
            // operator advances it as well, as the seal's message says.
            seal_then_advance(rig, rec, Duration::from_secs(10), true).await?;
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::KillMember => {
            let mut cluster = rig.cluster.lock().await;
            let i = rng.usize(..cluster.members());
            let what = format!("kill-member {}", cluster.name(i));
            let op = begin(rec, &what)?;
            cluster.kill(i)?;
            tokio::time::sleep(Duration::from_millis(rng.u64(500..2500))).await;
            cluster.restart(i).await?;
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::QuorumLoss => {
            let mut cluster = rig.cluster.lock().await;
            let n = cluster.members();
            anyhow::ensure!(n >= 2, "quorum loss needs two members to kill");
            let a = rng.usize(..n);
            let b = (a + 1 + rng.usize(..n - 1)) % n;
            let what = format!("quorum-loss {} {}", cluster.name(a), cluster.name(b));
            let op = begin(rec, &what)?;
            cluster.kill(a)?;
            cluster.kill(b)?;
            tokio::time::sleep(Duration::from_millis(rng.u64(5000..8000))).await;
            cluster.restart(a).await?;
            cluster.restart(b).await?;
            drop(cluster);
            end(rec, op)?;
            // As the audit tailer would: take the spools the arbiters ship
            // on recovery before another fault can wipe a state dir.
            let collected = super::quorum_loss::collect_after_recovery(rig).await?;
            tracing::info!(collected, "quorum-loss spools collected");
            Ok(Some(what))
        }
        Fault::ShardMove => {
            let shard_b = rig
                ._shard_b
                .as_ref()
                .context("the gate started no second shard")?
                .endpoint();
            let op = begin(rec, "shard-move")?;
            let operator = operator_client(rig).await?;
            let dwell = Duration::from_millis(rng.u64(1000..3000));
            let what = super::shards::there_and_back(&operator, shard_b, dwell).await?;
            end(rec, op)?;
            Ok(Some(format!("shard-move {what}")))
        }
        Fault::PauseLeader => {
            let cluster = rig.cluster.lock().await;
            let l = cluster.leader().await?;
            let what = format!("pause-leader {}", cluster.name(l));
            let op = begin(rec, &what)?;
            cluster.pause(l)?;
            tokio::time::sleep(Duration::from_millis(rng.u64(2000..4000))).await;
            cluster.resume(l)?;
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::Partition => {
            let mut cluster = rig.cluster.lock().await;
            let i = if rng.bool() {
                cluster.leader().await?
            } else {
                rng.usize(..cluster.members())
            };
            let what = format!("partition {}", cluster.name(i));
            let op = begin(rec, &what)?;
            cluster.partition(i)?;
            tokio::time::sleep(Duration::from_millis(rng.u64(2000..5000))).await;
            cluster.heal(i)?;
            end(rec, op)?;
            cluster.wait_healthy(Duration::from_secs(30)).await?;
            Ok(Some(what))
        }
        Fault::KillArbiter => {
            let mut arbiters = rig.arbiters.lock().await;
            let i = rng.usize(..arbiters.len());
            let what = format!("kill-arbiter arbiter-{i}");
            let op = begin(rec, &what)?;
            if let Some(mut a) = arbiters[i].take() {
                a.kill();
            }
            tokio::time::sleep(Duration::from_millis(rng.u64(300..1500))).await;
            arbiters[i] = Some(rig.start_arbiter(i).await?);
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::PauseHolder => {
            // Catch a worker inside a hold (it checked can_start and is in its
            // unit of work); fall back to the next check after 5 s.
            let found = eventually("a worker inside a hold", Duration::from_secs(5), || async {
                rig.holding_worker().await.context("no worker holds a key")
            })
            .await
            .ok();
            let Some((name, pid, _)) = found else {
                return Ok(None);
            };
            let what = format!("pause-holder {name}");
            let op = begin(rec, &what)?;
            let pid = Pid::from_raw(i32::try_from(pid)?);
            kill(pid, Signal::SIGSTOP)?;
            tokio::time::sleep(TTL + Duration::from_millis(rng.u64(1500..3000))).await;
            kill(pid, Signal::SIGCONT)?;
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::ClockStep => {
            let found = eventually("a worker inside a hold", Duration::from_secs(5), || async {
                rig.holding_worker().await.context("no worker holds a key")
            })
            .await
            .ok();
            let Some((name, _, index)) = found else {
                return Ok(None);
            };
            let clock = rig
                .clocks
                .get(index)
                .context("the gate started the workers without steppable clocks")?;
            // From a minute to two hours: past the TTL and every keepalive
            // interval, short of the dev certificates' one-day margin.
            let step = i64::try_from(rng.u64(60..7200))?;
            let what = format!("clock-step {name} +{step}s then -{step}s");
            let op = begin(rec, &what)?;
            step_clock(clock, step, rng).await?;
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::ClockStepArbiter => {
            let i = rng.usize(..rig.arbiter_clocks.len().max(1));
            let clock = rig
                .arbiter_clocks
                .get(i)
                .context("the gate started the arbiters without steppable clocks")?;
            let step = i64::try_from(rng.u64(60..7200))?;
            let what = format!("clock-step-arbiter arbiter-{i} +{step}s then -{step}s");
            let op = begin(rec, &what)?;
            step_clock(clock, step, rng).await?;
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::SlowDiskMember => {
            let cluster = rig.cluster.lock().await;
            let i = if rng.bool() {
                cluster.leader().await?
            } else {
                rng.usize(..cluster.members())
            };
            let disk = cluster
                .disk(i)
                .context("the gate started etcd without stallable disks")?;
            let what = format!("slow-disk-member {}", cluster.name(i));
            stall_disk(rec, &what, disk, rng).await.map(Some)
        }
        Fault::SlowDiskArbiter => {
            let i = rng.usize(..rig.arbiter_disks.len().max(1));
            let disk = rig
                .arbiter_disks
                .get(i)
                .context("the gate started the arbiters without stallable disks")?;
            let what = format!("slow-disk-arbiter arbiter-{i}");
            stall_disk(rec, &what, disk, rng).await.map(Some)
        }
        Fault::Restore => {
            let what = "restore from snapshot + advance-epoch".to_owned();
            let op = begin(rec, &what)?;
            rig.cluster.lock().await.restore(snapshot).await?;
            // The arbiters notice the lower revision on their next etcd
            // response and seal; the operator then advances the epoch.
            seal_then_advance(rig, rec, Duration::from_secs(20), false).await?;
            end(rec, op)?;
            Ok(Some(what))
        }
        Fault::RestoreForget => {
            let mut what =
                "restore-forget from snapshot + every arbiter's state dir wiped + advance-epoch"
                    .to_owned();
            let op = begin(rec, &what)?;
            {
                // Stopped before the restore, so none of them can notice it
                // and leave a seal record in the restored log: after it,
                // nothing in the lock cluster or in any arbiter remembers
                // the tokens handed out since the snapshot.
                let mut arbiters = rig.arbiters.lock().await;
                for a in arbiters.iter_mut() {
                    if let Some(mut a) = a.take() {
                        a.kill();
                    }
                }
                // The spools are not part of the state this fault takes
                // away: the audit tailer has them (ADR-04).
                super::quorum_loss::collect_all(rig, true)?;
                for state in &rig.arbiter_state {
                    match std::fs::remove_dir_all(state) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => {
                            return Err(e).with_context(|| format!("deleting {}", state.display()));
                        }
                    }
                }
                rig.cluster.lock().await.restore(snapshot).await?;
                for (i, slot) in arbiters.iter_mut().enumerate() {
                    *slot = Some(rig.start_arbiter(i).await?);
                }
            }
            // With the coord cluster's witness a fresh arbiter starts sealed
            // (the witness's mark is above the restored log). The operator
            // advances after a restore whatever the arbiters say: if none
            // sealed, the advance comes anyway after the wait, and the
            // checker judges the grants made in between.
            if !seal_then_advance(rig, rec, Duration::from_secs(10), true).await? {
                what.push_str(" (no arbiter sealed within 10 s; advanced anyway)");
            }
            end(rec, op)?;
            Ok(Some(what))
        }
    }
}

/// Waits up to `wait` for an arbiter to report itself sealed, then advances
/// the epoch as an operator (an `advance` operation in the history) from the
/// epoch it reports. When none sealed: an error, or with `advance_unsealed`
/// the advance from the current epoch. Whether an arbiter was sealed.
async fn seal_then_advance(
    rig: &Rig,
    rec: &mut Recorder,
    wait: Duration,
    advance_unsealed: bool,
) -> anyhow::Result<bool> {
    let operator = operator_client(rig).await?;
    let status = eventually("an arbiter to seal", wait, || async {
        let s = operator.admin_status().await?;
        if s.sealed {
            Ok(s)
        } else {
            anyhow::bail!("not sealed yet (epoch {})", s.epoch)
        }
    })
    .await;
    let (sealed, epoch) = match status {
        Ok(s) => (true, s.epoch),
        Err(e) if !advance_unsealed => return Err(e),
        Err(_) => {
            let s = eventually("the arbiter's status", Duration::from_secs(20), || async {
                Ok(operator.admin_status().await?)
            })
            .await?;
            (false, s.epoch)
        }
    };
    // The lock (entity) cluster's advance: it ends the holds of the keys
    // on it (`bench/...`), not the coord tier's (ADR-07).
    let adv = rec.invoke(
        "advance",
        Fields {
            key: Some("bench/".into()),
            ..Fields::default()
        },
    )?;
    match advance(&operator, epoch).await {
        Ok(detail) => rec.complete(
            adv,
            Outcome::Ok,
            Fields {
                detail: Some(detail),
                ..Fields::default()
            },
        )?,
        Err(e) => {
            rec.complete(
                adv,
                Outcome::Unknown,
                Fields {
                    detail: Some(e.to_string()),
                    ..Fields::default()
                },
            )?;
            return Err(e).context("advancing the epoch after the restore");
        }
    }
    Ok(sealed)
}

/// After the coord cluster's restore: waits for the coord tier to seal (its
/// witness is above the restored log), then advances its epoch as an
/// operator, recorded as one `advance` per coord namespace (the lock
/// cluster's keys keep their holds).
async fn advance_coord(rig: &Rig, rec: &mut Recorder) -> anyhow::Result<()> {
    const REASON: &str = "release gate: coord cluster restored from snapshot";
    let operator = operator_client(rig).await?;
    let status = eventually(
        "the coord tier to seal",
        Duration::from_secs(30),
        || async {
            let s = operator.admin_status_of("coord").await?;
            if s.sealed {
                Ok(s)
            } else {
                anyhow::bail!("the coord tier is not sealed (epoch {})", s.epoch)
            }
        },
    )
    .await?;
    let advances = [super::COORD_NAMESPACE, super::ELECTION_NAMESPACE].map(|ns| {
        rec.invoke(
            "advance",
            Fields {
                key: Some(format!("{ns}/")),
                ..Fields::default()
            },
        )
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let outcome = loop {
        match operator
            .advance_epoch_in("coord", status.epoch, REASON, 0)
            .await
        {
            Ok(resp) => break Ok(format!("coord epoch {} -> {}", status.epoch, resp.epoch)),
            Err(e) if e.is_transient() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => {
                if let Ok(s) = operator.admin_status_of("coord").await
                    && s.epoch > status.epoch
                    && !s.sealed
                {
                    break Ok(format!(
                        "coord epoch {} -> {} (by an attempt whose answer was lost)",
                        status.epoch, s.epoch
                    ));
                }
                break Err(anyhow::Error::from(e));
            }
        }
    };
    for adv in advances {
        let adv = adv?;
        match &outcome {
            Ok(detail) => rec.complete(
                adv,
                Outcome::Ok,
                Fields {
                    detail: Some(detail.clone()),
                    ..Fields::default()
                },
            )?,
            Err(e) => rec.complete(
                adv,
                Outcome::Unknown,
                Fields {
                    detail: Some(e.to_string()),
                    ..Fields::default()
                },
            )?,
        }
    }
    outcome
        .map(|_| ())
        .context("advancing the coord tier's epoch after its restore")
}

/// The operator's epoch advance after a restore, retried while etcd is still
/// coming back (a member of the restored cluster may refuse connections for
/// a moment), as an operator would on UNAVAILABLE. An attempt whose outcome
/// was lost and that did commit shows as the epoch having moved on.
async fn advance(operator: &Client, expected: u32) -> anyhow::Result<String> {
    const REASON: &str = "release gate: restore from snapshot";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match operator.advance_epoch(expected, REASON).await {
            Ok(resp) => {
                return Ok(format!(
                    "epoch {expected} -> {}, {} holds deleted",
                    resp.epoch, resp.holds_deleted
                ));
            }
            Err(e) if e.is_transient() && tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "epoch advance not done yet; retrying");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => {
                // An earlier attempt may have committed before its answer was lost.
                if let Ok(s) = operator.admin_status().await
                    && s.epoch > expected
                    && !s.sealed
                {
                    return Ok(format!(
                        "epoch {expected} -> {} (by an attempt whose answer was lost)",
                        s.epoch
                    ));
                }
                return Err(e.into());
            }
        }
    }
}

async fn operator_client(rig: &Rig) -> anyhow::Result<Client> {
    let certs = certs()?;
    let svid = certs.svid("latchkey/operator");
    let config = ClientConfig::tls(
        format!("https://{}", rig.arbiter_addrs[0]),
        TlsFiles {
            ca: certs.ca(),
            cert: svid.cert,
            key: svid.key,
        },
    );
    eventually(
        "the operator client to connect",
        Duration::from_secs(20),
        || {
            let config = config.clone();
            async move { Ok(Client::connect(config).await?) }
        },
    )
    .await
}

/// Steps `clock` `step_s` seconds ahead of the real time, then as far
/// behind it, then back to it. libfaketime re-reads the control file at most
/// every second: each step is held for longer than that.
async fn step_clock(
    clock: &super::clock::SteppableClock,
    step_s: i64,
    rng: &mut fastrand::Rng,
) -> anyhow::Result<()> {
    clock.set(step_s)?;
    tokio::time::sleep(Duration::from_millis(rng.u64(1500..3000))).await;
    clock.set(-step_s)?;
    tokio::time::sleep(Duration::from_millis(rng.u64(1500..3000))).await;
    clock.set(0)?;
    Ok(())
}

/// Slows `disk`'s fsyncs again and again for 2–4 s (each delayed 100–800
/// ms; writes and reads are not), recorded as the fault `what`; its
/// description with the number of fsyncs delayed.
async fn stall_disk(
    rec: &mut Recorder,
    what: &str,
    disk: &latchkey_tests::disk::StallableDir,
    rng: &mut fastrand::Rng,
) -> anyhow::Result<String> {
    let op = begin(rec, what)?;
    let total = Duration::from_millis(rng.u64(2000..4000));
    let delayed = disk
        .slow_for(
            total,
            (Duration::from_millis(100), Duration::from_millis(800)),
            rng,
        )
        .await?;
    end(rec, op)?;
    Ok(format!("{what} ({delayed} fsyncs delayed 100-800 ms)"))
}

fn begin(rec: &mut Recorder, what: &str) -> anyhow::Result<u64> {
    rec.invoke(
        "fault",
        Fields {
            detail: Some(what.to_owned()),
            ..Fields::default()
        },
    )
}

fn end(rec: &mut Recorder, op: u64) -> anyhow::Result<()> {
    rec.complete(op, Outcome::Ok, Fields::default())
}
