//! The seeded nemesis: one fault at a time, each recorded as a `fault`
//! operation (and the operator's epoch advance after a restore as an
//! `advance`, the way the gate's nemesis records it).

use std::sync::Arc;
use std::time::Duration;

use latchkey_checker::{Function, Outcome};
use tokio::time::Instant;

use super::world::{World, lock};
use crate::memlog::{ClusterId, FaultRates, Snapshot};
use crate::rng::Rng;

/// Grants must not stop for this long while clients try (no restore
/// waiting for its advance): the liveness watchdog's window.
pub const LIVENESS_WINDOW: Duration = Duration::from_secs(60);

/// A restore only while the service serves: an acquire succeeded after the
/// last advance and this recently. So a restore never lands in an outage
/// the watchdog has yet to judge (an advance whose epoch never serves, a
/// seal written after it), and never hides one.
const SERVING_WITHIN: Duration = Duration::from_secs(1);

/// Snapshots kept to restore from (the operator's backups): a restore may
/// go back to one taken before an earlier restore and advance.
const SNAPSHOTS_KEPT: usize = 6;

#[derive(Debug, Clone, Copy)]
enum Kind {
    LogFaults,
    SlowLog,
    Restart,
    Compact,
    Snapshot,
    Restore,
}

pub(crate) async fn run(world: Arc<World>, mut rng: Rng) {
    let knobs = world.cfg.faults.clone();
    let mut kinds: Vec<(Kind, u64)> = Vec::new();
    if knobs.log_faults {
        kinds.push((Kind::LogFaults, 30));
    }
    if knobs.slow_log {
        kinds.push((Kind::SlowLog, 25));
    }
    if knobs.arbiter_restarts {
        kinds.push((Kind::Restart, 20));
    }
    if knobs.compaction {
        kinds.push((Kind::Compact, 15));
    }
    if knobs.restores {
        kinds.push((Kind::Snapshot, 10));
        kinds.push((Kind::Restore, 12));
    }
    if kinds.is_empty() {
        return;
    }
    let total: u64 = kinds.iter().map(|(_, w)| w).sum();
    let mut snapshots: Vec<Snapshot> = Vec::new();
    let keep = |snapshots: &mut Vec<Snapshot>, snap: Snapshot| {
        if snapshots.len() >= SNAPSHOTS_KEPT {
            snapshots.remove(0);
        }
        snapshots.push(snap);
    };
    // Warm up before the first snapshot, so a restore goes back over grants.
    if !pause(&world, Duration::from_secs(2)).await {
        return;
    }
    if knobs.restores {
        keep(&mut snapshots, world.memlog.snapshot());
    }
    loop {
        let gap = Duration::from_millis(knobs.fault_gap_ms / 2 + rng.below(knobs.fault_gap_ms + 1));
        if !pause(&world, gap).await {
            return;
        }
        let mut draw = rng.below(total);
        let mut kind = Kind::LogFaults;
        for (k, w) in &kinds {
            if draw < *w {
                kind = *k;
                break;
            }
            draw -= w;
        }
        match kind {
            Kind::LogFaults => log_faults(&world, &mut rng).await,
            Kind::SlowLog => slow_log(&world, &mut rng).await,
            Kind::Restart => restart(&world, &mut rng).await,
            Kind::Compact => compact(&world, &mut rng),
            Kind::Snapshot => keep(&mut snapshots, world.memlog.snapshot()),
            Kind::Restore => {
                if !lock(&world.liveness).serving(Instant::now(), SERVING_WITHIN) {
                    continue;
                }
                let revision = world.memlog.revision();
                let usable: Vec<&Snapshot> = snapshots
                    .iter()
                    .filter(|s| s.revision() < revision)
                    .collect();
                // Half the time the newest backup, else any kept one: often
                // one from before an earlier restore and advance (a second
                // restore of one snapshot must not re-use an epoch either).
                let pick = match usable.len() {
                    0 => None,
                    n if rng.chance(50) => usable.get(n - 1),
                    n => usable.get(usize::try_from(rng.below(n as u64)).unwrap_or(0)),
                };
                let Some(snap) = pick.map(|s| (*s).clone()) else {
                    keep(&mut snapshots, world.memlog.snapshot());
                    continue;
                };
                let cluster = if rng.chance(50) {
                    ClusterId::Same
                } else {
                    ClusterId::New
                };
                if let Some(taken) = restore(&world, &mut rng, &snap, cluster).await {
                    keep(&mut snapshots, taken);
                }
            }
        }
    }
}

/// Sleeps unless the run stops first; whether to go on.
async fn pause(world: &World, d: Duration) -> bool {
    tokio::select! {
        biased;
        () = world.stop.cancelled() => false,
        () = tokio::time::sleep(d) => true,
    }
}

fn fault(world: &World, detail: String) -> super::world::OpId {
    world.invoke(
        "nemesis",
        Function::Fault,
        None,
        None,
        Some(detail),
        Instant::now(),
    )
}

fn done(world: &World, op: super::world::OpId) {
    world.complete(op, Outcome::Ok, None, None, None);
}

/// Sets the log's fault rates, and the witness's when it faults with the
/// log ([`FaultKnobs::witness_faults`](super::FaultKnobs::witness_faults)).
fn set_faults(world: &World, rates: FaultRates) {
    world.memlog.set_faults(rates);
    if world.cfg.faults.witness_faults
        && let Some(witness) = &world.memwitness
    {
        witness.set_faults(rates);
    }
}

/// A window of log faults: calls failing before they commit, answers lost
/// after, commits delayed so calls overtake each other.
async fn log_faults(world: &World, rng: &mut Rng) {
    let peak = world.cfg.faults.log_fault_peak.max(1);
    let rates = FaultRates {
        fail_before_commit: u32::try_from(rng.below(u64::from(peak) + 1)).unwrap_or(0),
        lose_response: u32::try_from(rng.below(u64::from(peak) + 1)).unwrap_or(0),
        delay: u32::try_from(rng.below(u64::from(peak) * 3 + 1)).unwrap_or(0),
        max_delay: Duration::from_millis(1 + rng.below(300)),
    };
    let length = Duration::from_millis(1000 + rng.below(4000));
    let op = fault(
        world,
        format!(
            "log faults for {} ms: {}% fail before commit, {}% answers lost after commit, {}% delayed up to {} ms",
            length.as_millis(),
            rates.fail_before_commit,
            rates.lose_response,
            rates.delay,
            rates.max_delay.as_millis()
        ),
    );
    set_faults(world, rates);
    tokio::time::sleep(length).await;
    set_faults(world, FaultRates::NONE);
    done(world, op);
}

/// A window of a slow log: many calls delayed (none failing, no answer
/// lost), so commits land late and calls overtake each other while the
/// clients' sessions live on.
async fn slow_log(world: &World, rng: &mut Rng) {
    let rates = FaultRates {
        fail_before_commit: 0,
        lose_response: 0,
        delay: u32::try_from(30 + rng.below(61)).unwrap_or(30),
        max_delay: Duration::from_millis(20 + rng.below(281)),
    };
    let length = Duration::from_millis(1000 + rng.below(4000));
    let op = fault(
        world,
        format!(
            "slow log for {} ms: {}% delayed up to {} ms",
            length.as_millis(),
            rates.delay,
            rates.max_delay.as_millis()
        ),
    );
    set_faults(world, rates);
    tokio::time::sleep(length).await;
    set_faults(world, FaultRates::NONE);
    done(world, op);
}

/// Kills an arbiter and starts it again on the same log after a moment,
/// keeping its state directory (its high-water mark) unless the run loses
/// state.
async fn restart(world: &World, rng: &mut Rng) {
    let n = world.arbiters.len() as u64;
    let i = usize::try_from(rng.below(n)).unwrap_or(0);
    let lose = rng.chance(world.cfg.faults.lose_state_percent);
    let down = Duration::from_millis(100 + rng.below(1900));
    let op = fault(
        world,
        format!(
            "restart arbiter-{i} after {} ms ({})",
            down.as_millis(),
            if lose {
                "state dir lost"
            } else {
                "state dir kept"
            }
        ),
    );
    world.kill_arbiter(i).await;
    tokio::time::sleep(down).await;
    world.start_arbiter(i, lose, rng.next_u64()).await;
    done(world, op);
}

/// Compacts the log's history (a watch from below it is lost), and now and
/// then breaks every watch stream.
fn compact(world: &World, rng: &mut Rng) {
    let revision = world.memlog.revision();
    let below = (revision - i64::try_from(rng.below(40)).unwrap_or(0)).max(1);
    let broken = rng.chance(40);
    let op = fault(
        world,
        format!(
            "compact below r{below}{}",
            if broken { ", break watch streams" } else { "" }
        ),
    );
    if let Err(e) = world.memlog.compact(below) {
        world.note(format!("compaction to r{below} refused: {e}"));
    }
    if broken {
        world.memlog.break_watches();
    }
    done(world, op);
}

/// Restores the log from `snapshot`, waits for an arbiter to seal, then
/// advances the epoch as an operator through one arbiter, retrying until
/// it is done. Now and then ([`FaultKnobs::isolate_percent`]) one arbiter
/// is cut off from every caller first, until it is quiet, and reconnected
/// only after the advance: it notices the restore late, in the advanced
/// epoch, and must not seal that. Otherwise, now and then
/// ([`FaultKnobs::idle_percent`]) one arbiter is cut off the same way but
/// reconnected right after the restore, and the operator looks only a
/// little later: the clients reach it before any arbiter sealed. And now
/// and then ([`FaultKnobs::wipe_on_restore_percent`]) every arbiter
/// restarts with its state dir lost right after the restore. Half the
/// time the operator backs the restored log up before advancing; that
/// snapshot is returned.
///
/// [`FaultKnobs::isolate_percent`]: super::FaultKnobs::isolate_percent
/// [`FaultKnobs::idle_percent`]: super::FaultKnobs::idle_percent
/// [`FaultKnobs::wipe_on_restore_percent`]: super::FaultKnobs::wipe_on_restore_percent
async fn restore(
    world: &World,
    rng: &mut Rng,
    snapshot: &Snapshot,
    cluster: ClusterId,
) -> Option<Snapshot> {
    let n = world.arbiters.len();
    let isolated = (n >= 2 && rng.chance(world.cfg.faults.isolate_percent))
        .then(|| usize::try_from(rng.below(n as u64)).unwrap_or(0));
    let back_up = rng.chance(50);
    // Drawn only when the knobs are on: the runs without them draw what
    // they always drew.
    let knobs = &world.cfg.faults;
    let idle =
        (knobs.idle_percent > 0 && n >= 2 && isolated.is_none() && rng.chance(knobs.idle_percent))
            .then(|| usize::try_from(rng.below(n as u64)).unwrap_or(0));
    let wipe = knobs.wipe_on_restore_percent > 0 && rng.chance(knobs.wipe_on_restore_percent);
    let op = fault(
        world,
        format!(
            "restore snapshot at r{} ({}) + advance-epoch{}{}{}",
            snapshot.revision(),
            match cluster {
                ClusterId::Same => "same cluster id",
                ClusterId::New => "new cluster id",
            },
            match isolated {
                Some(i) => format!(", arbiter-{i} isolated until after the advance"),
                None => String::new(),
            },
            match idle {
                Some(i) => format!(", arbiter-{i} idle before the restore, serving right after it"),
                None => String::new(),
            },
            if wipe {
                ", every arbiter restarted with its state dir lost right after the restore"
            } else {
                ""
            }
        ),
    );
    if let Some(i) = isolated.or(idle) {
        world.set_isolated(i, true);
        // Quiet: its waiters answered or timed out, its drivers retired.
        let quiet_by = Instant::now() + Duration::from_secs(5);
        while Instant::now() < quiet_by && world.table(i).is_some_and(|(t, _)| t.totals() != (0, 0))
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    lock(&world.liveness).last_restore = Some(Instant::now());
    world.memlog.restore(snapshot, cluster);
    let taken = back_up.then(|| world.memlog.snapshot());
    if let Some(i) = idle {
        // Back at once; the operator looks a little later, so the clients'
        // calls (the idle arbiter's among them) meet the restored log first.
        world.set_isolated(i, false);
        tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
    }
    if wipe {
        // Every arbiter down, then up again with an empty state dir: only
        // a witness remembers the tokens handed out before the restore.
        for i in 0..n {
            world.kill_arbiter(i).await;
        }
        tokio::time::sleep(Duration::from_millis(50 + rng.below(450))).await;
        for i in 0..n {
            world.start_arbiter(i, true, rng.next_u64()).await;
        }
    }

    // The arbiters notice on their next answer (the clients keep calling);
    // the operator polls the status as the gate's nemesis does.
    let noticed_by = Instant::now() + Duration::from_secs(20);
    loop {
        if world
            .up()
            .iter()
            .any(|a| a.table.seal().guard().seal_reason().is_some())
        {
            break;
        }
        if Instant::now() >= noticed_by {
            world.note(format!(
                "no arbiter sealed within 20 s of the restore at {:.1} ms; advancing anyway",
                world.ms(Instant::now())
            ));
            break;
        }
        if let Some(a) = world.any(rng) {
            let table = a.table.clone();
            tokio::select! {
                biased;
                () = a.killed.cancelled() => {}
                _ = table.seal().load_epoch() => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let adv = world.invoke(
        "nemesis",
        Function::Advance,
        None,
        None,
        None,
        Instant::now(),
    );
    let detail = advance(world, rng).await;
    world.complete(adv, Outcome::Ok, None, None, Some(detail));
    {
        let mut live = lock(&world.liveness);
        live.last_advance = Some(Instant::now());
        live.tried_since = false;
    }
    if let Some(i) = isolated {
        tokio::time::sleep(Duration::from_millis(rng.below(500))).await;
        world.set_isolated(i, false);
        // Long enough for its clients to reach it again.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    done(world, op);
    taken
}

const REASON: &str = "simulation: restore from snapshot";

/// The operator's advance: read the epoch (the status), advance from it;
/// on any error read again and retry. An attempt whose answer was lost and
/// that did commit shows as the epoch having moved past the one it
/// expected.
async fn advance(world: &World, rng: &mut Rng) -> String {
    let mut expected_first: Option<u32> = None;
    loop {
        let Some(a) = world.arbiter(0).or_else(|| world.any(rng)) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let table = a.table.clone();
        let status = tokio::select! {
            biased;
            () = a.killed.cancelled() => None,
            s = table.seal().load_epoch() => s.ok(),
        };
        let Some(status) = status else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let epoch = status.epoch();
        if let Some(first) = expected_first
            && epoch > first
        {
            return format!("epoch {first} -> {epoch} (by an attempt whose answer was lost)");
        }
        expected_first.get_or_insert(epoch);
        let answer = tokio::select! {
            biased;
            () = a.killed.cancelled() => None,
            r = table.seal().advance_epoch(epoch, REASON) => Some(r),
        };
        match answer {
            Some(Ok((record, deleted))) => {
                return format!(
                    "epoch {epoch} -> {} through arbiter-{}, {deleted} holds deleted",
                    record.epoch, a.index
                );
            }
            Some(Err(_)) | None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
