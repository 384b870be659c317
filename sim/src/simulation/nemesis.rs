//! The seeded nemesis: one fault at a time, each recorded as a `fault`
//! operation (and the operator's epoch advance after a restore as an
//! `advance`, the way the gate's nemesis records it).

use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::high_water::Mark;
use latchkey_arbiter::witness::Witnessed;
use latchkey_checker::{Function, Outcome};
use latchkey_records::{CoordSeenRecord, EpochRecord, decode};
use tokio::time::Instant;

use super::fences::Window;
use super::world::{World, lock};
use crate::memlog::{ClusterId, FaultRates, LAYOUT, Snapshot};
use crate::rng::Rng;
use crate::witness::{MemWitness, WitnessSnapshot};

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

/// One of the operator's backups: the lock log's snapshot and, when there
/// is a coord cluster, the coord cluster's, taken at one instant (a pair).
#[derive(Debug, Clone)]
struct Backup {
    /// Counted in the order taken (`#n` in the fault descriptions).
    n: u64,
    log: Snapshot,
    coord: Option<WitnessSnapshot>,
}

/// The backups kept to restore from, the oldest first.
#[derive(Default)]
struct Backups {
    kept: Vec<Backup>,
    taken: u64,
}

impl Backups {
    /// Backs up the lock log and the coord cluster as they are now.
    fn take(&mut self, world: &World) {
        let (log, coord) = back_up_now(world);
        self.keep(log, coord);
    }

    fn keep(&mut self, log: Snapshot, coord: Option<WitnessSnapshot>) {
        if self.kept.len() >= SNAPSHOTS_KEPT {
            self.kept.remove(0);
        }
        self.taken += 1;
        self.kept.push(Backup {
            n: self.taken,
            log,
            coord,
        });
    }
}

/// The lock log and the coord cluster as they are now: both read in one
/// step (no await between), so the pair is of one moment.
fn back_up_now(world: &World) -> (Snapshot, Option<WitnessSnapshot>) {
    let log = world.memlog.snapshot();
    let coord = world.memwitness.as_ref().map(MemWitness::snapshot);
    (log, coord)
}

/// What a restore puts back.
#[derive(Debug, Clone)]
enum What {
    /// The lock log from a backup, with the same or a new cluster id; the
    /// coord cluster untouched.
    Log { log: Backup, cluster: ClusterId },
    /// The coord cluster from a backup; the lock log untouched.
    Coord { coord: Backup },
    /// The lock log from one backup and the coord cluster from another,
    /// taken at a different time ([`detectable`]).
    Both {
        log: Backup,
        cluster: ClusterId,
        coord: Backup,
    },
}

impl What {
    /// The fault's description (a restore of the lock log alone reads as it
    /// always did).
    fn describe(&self) -> String {
        let cluster = |c: &ClusterId| match c {
            ClusterId::Same => "same cluster id",
            ClusterId::New => "new cluster id",
        };
        match self {
            What::Log { log, cluster: c } => {
                format!(
                    "restore snapshot at r{} ({})",
                    log.log.revision(),
                    cluster(c)
                )
            }
            What::Coord { coord } => format!(
                "restore {COORD_RESTORE} #{} ({}), {COORD_ALONE}",
                coord.n,
                show_witnessed(coord.coord.map(|c| c.witnessed).unwrap_or_default())
            ),
            What::Both {
                log,
                cluster: c,
                coord,
            } => format!(
                "restore snapshot #{} at r{} ({}) and {COORD_RESTORE} #{} ({}), taken {}",
                log.n,
                log.log.revision(),
                cluster(c),
                coord.n,
                show_witnessed(coord.coord.map(|c| c.witnessed).unwrap_or_default()),
                if coord.n < log.n { "before" } else { "after" },
            ),
        }
    }
}

/// Names a restore of the coord cluster in a fault's description.
pub const COORD_RESTORE: &str = "coord cluster from snapshot";

/// Ends the description of a restore of the coord cluster alone.
pub(crate) const COORD_ALONE: &str = "the lock log untouched";

fn show_witnessed(w: Witnessed) -> String {
    format!(
        "mark {}, epoch {}",
        w.mark.map_or_else(
            || "none".into(),
            |m| format!("e{}:r{}", m.epoch, m.revision)
        ),
        w.epoch
    )
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    LogFaults,
    SlowLog,
    Restart,
    Compact,
    Snapshot,
    Restore,
    MapFence,
    QuorumLoss,
    RenewalOutage,
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
    if knobs.map_fences {
        kinds.push((Kind::MapFence, 15));
    }
    if knobs.quorum_losses {
        kinds.push((Kind::QuorumLoss, 40));
    }
    if knobs.renewal_outages {
        kinds.push((Kind::RenewalOutage, 10));
    }
    if kinds.is_empty() {
        return;
    }
    let total: u64 = kinds.iter().map(|(_, w)| w).sum();
    let mut backups = Backups::default();
    // Warm up before the first snapshot, so a restore goes back over grants.
    if !pause(&world, Duration::from_secs(2)).await {
        return;
    }
    if knobs.restores {
        backups.take(&world);
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
            Kind::Snapshot => backups.take(&world),
            Kind::MapFence => map_fence(&world, &mut rng).await,
            Kind::QuorumLoss => super::operators::quorum_loss(&world, &mut rng).await,
            Kind::RenewalOutage => super::operators::renewal_outage(&world, &mut rng).await,
            Kind::Restore => {
                if !lock(&world.liveness).serving(Instant::now(), SERVING_WITHIN) {
                    continue;
                }
                let revision = world.memlog.revision();
                // Drawn only with a coord cluster and the knob on: the runs
                // without them draw what they always drew.
                let coord = knobs.coord_restore_percent > 0
                    && world.memwitness.is_some()
                    && rng.chance(knobs.coord_restore_percent);
                let what = if coord {
                    coord_restore(&world, &mut rng, &backups.kept, revision)
                } else {
                    None
                };
                let what = match what {
                    Some(what) => what,
                    None => {
                        let usable: Vec<&Backup> = backups
                            .kept
                            .iter()
                            .filter(|b| b.log.revision() < revision)
                            .collect();
                        // Half the time the newest backup, else any kept
                        // one: often one from before an earlier restore and
                        // advance (a second restore of one snapshot must not
                        // re-use an epoch either).
                        let Some(log) = newest_or_any(&mut rng, &usable).cloned() else {
                            backups.take(&world);
                            continue;
                        };
                        What::Log {
                            log,
                            cluster: draw_cluster(&mut rng),
                        }
                    }
                };
                if let Some((log, coord)) = restore(&world, &mut rng, &what).await {
                    backups.keep(log, coord);
                }
            }
        }
    }
}

/// Half the time the newest of `usable`, else any.
fn newest_or_any<'a>(rng: &mut Rng, usable: &[&'a Backup]) -> Option<&'a Backup> {
    let pick = match usable.len() {
        0 => None,
        n if rng.chance(50) => usable.get(n - 1),
        n => usable.get(usize::try_from(rng.below(n as u64)).unwrap_or(0)),
    };
    pick.copied()
}

fn draw_cluster(rng: &mut Rng) -> ClusterId {
    if rng.chance(50) {
        ClusterId::Same
    } else {
        ClusterId::New
    }
}

/// A restore of the coord cluster
/// ([`FaultKnobs::coord_restore_percent`](super::FaultKnobs::coord_restore_percent)):
/// half the time the coord cluster alone from a kept backup, else the lock
/// log from one backup and the coord cluster from another. Only a backup of
/// the coord cluster that shows less than it does now (restoring one that
/// shows as much changes nothing). `None` when no kept backup fits: then the
/// lock log alone is restored.
///
/// Never both from one backup: the lock log and its witness restored to
/// the same moment are a consistent past, and nothing in either shows what
/// came after it; only the arbiters' state dirs (and memory) remember, so
/// with every state dir wiped that restore is undetectable by design and
/// re-issues tokens. It is therefore not drawn. Nor two backups that both
/// predate the serving epoch ([`remembers`]).
fn coord_restore(world: &World, rng: &mut Rng, backups: &[Backup], revision: i64) -> Option<What> {
    let now = world.memwitness.as_ref()?.witnessed();
    let loses = |b: &Backup| b.coord.is_some_and(|c| !c.witnessed.covers(&now));
    if rng.chance(50) {
        let usable: Vec<&Backup> = backups.iter().filter(|b| loses(b)).collect();
        let coord = newest_or_any(rng, &usable)?.clone();
        return Some(What::Coord { coord });
    }
    let serving = epoch_of(&world.memlog.snapshot())
        .unwrap_or(0)
        .max(now.epoch);
    let unguarded = world.cfg.faults.coord_restore_before_serving_epoch;
    let pairs: Vec<(&Backup, &Backup)> = backups
        .iter()
        .filter(|log| log.log.revision() < revision)
        .flat_map(|log| {
            backups
                .iter()
                .filter(move |coord| {
                    coord.n != log.n
                        && loses(coord)
                        && detectable(log, coord)
                        && (unguarded || remembers(log, coord, serving))
                })
                .map(move |coord| (log, coord))
        })
        .collect();
    if pairs.is_empty() {
        return None;
    }
    let (log, coord) = pairs[usize::try_from(rng.below(pairs.len() as u64)).unwrap_or(0)];
    Some(What::Both {
        log: log.clone(),
        cluster: draw_cluster(rng),
        coord: coord.clone(),
    })
}

/// Whether restoring the lock log from `log` and the coord cluster from
/// `coord`'s snapshot (taken at different times) is bound to be noticed,
/// judged from the two backups' contents alone (every arbiter may lose its
/// state dir with it, so nothing else may be relied on). The design
/// guarantees it only when the two are apart by at least one vouched grant,
/// and, when the coord cluster's snapshot is the older, only when the lock
/// log's coord-seen record already covers more than it shows:
///
/// - the coord cluster's snapshot is the newer: its mark covers a grant the
///   lock log's snapshot does not hold (a later epoch, or a higher revision
///   in the log's epoch), so the restored log's first answer (or grant)
///   lies at or below the witnessed mark;
/// - it is the older: its mark is below the mark of `log`'s own coord
///   snapshot (a grant vouched for in between), and the lock log's
///   `sys/coord-seen` record of its epoch shows more than it (the record
///   is written at most every second, so a snapshot taken within a second
///   of the other may show no more).
fn detectable(log: &Backup, coord: &Backup) -> bool {
    let Some(witness) = coord.coord.map(|c| c.witnessed) else {
        return false;
    };
    let Some(epoch) = epoch_of(&log.log) else {
        return false;
    };
    let newer = witness
        .mark
        .is_some_and(|m| m.epoch > epoch || (m.epoch == epoch && m.revision > log.log.revision()));
    let grant_between = match (log.coord.and_then(|c| c.witnessed.mark), witness.mark) {
        (Some(then), Some(now)) => !now.covers(&then),
        (Some(_), None) => true,
        (None, _) => false,
    };
    let recorded = log
        .log
        .value(&LAYOUT.coord_seen())
        .and_then(decode::<CoordSeenRecord>)
        .filter(|r| r.lock_epoch == epoch)
        .map(|r| witnessed_of(&r));
    let older = grant_between && recorded.is_some_and(|r| !witness.covers(&r));
    newer || older
}

/// Whether the lock log's backup or the coord cluster's still knows the
/// `serving` epoch (the highest handed out in so far): the operator's
/// advance then goes above it. Two backups that both predate it leave
/// nothing that knows it once every state dir is wiped (the lock log's
/// epoch record, its coord-seen record and the coord cluster's allocation
/// all from before it): the restore is noticed, but the advance re-uses
/// the serving epoch and re-issues its tokens (seeds 1010 and 1030 of
/// `witnessed-state-loss` did, before this check). Undetectable in effect
/// by design, as restoring both from one moment is; not drawn.
fn remembers(log: &Backup, coord: &Backup, serving: u32) -> bool {
    let recorded = log
        .log
        .value(&LAYOUT.coord_seen())
        .and_then(decode::<CoordSeenRecord>)
        .map(|r| witnessed_of(&r));
    let known = [
        epoch_of(&log.log),
        recorded.map(|r| r.epoch),
        recorded.and_then(|r| r.mark).map(|m| m.epoch),
        coord.coord.map(|c| c.witnessed.epoch),
        coord.coord.and_then(|c| c.witnessed.mark).map(|m| m.epoch),
    ];
    known
        .into_iter()
        .flatten()
        .max()
        .is_some_and(|e| e >= serving)
}

/// The epoch in a lock log snapshot's epoch record.
pub(super) fn epoch_of(log: &Snapshot) -> Option<u32> {
    log.value(&LAYOUT.epoch())
        .and_then(decode::<EpochRecord>)
        .map(|r| r.epoch)
}

/// What a coord-seen record says the coord cluster showed (as the arbiter
/// reads it).
fn witnessed_of(record: &CoordSeenRecord) -> Witnessed {
    Witnessed {
        mark: (record.mark_revision > 0).then(|| Mark {
            epoch: record.mark_epoch,
            cluster_id: record.mark_cluster_id.parse().unwrap_or(0),
            revision: record.mark_revision,
        }),
        epoch: record.epoch,
    }
}

/// Sleeps unless the run stops first; whether to go on.
pub(super) async fn pause(world: &World, d: Duration) -> bool {
    tokio::select! {
        biased;
        () = world.stop.cancelled() => false,
        () = tokio::time::sleep(d) => true,
    }
}

pub(super) fn fault(world: &World, detail: String) -> super::world::OpId {
    world.invoke(
        "nemesis",
        Function::Fault,
        None,
        None,
        Some(detail),
        Instant::now(),
    )
}

pub(super) fn done(world: &World, op: super::world::OpId) {
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

/// A shard move's fence (ADR-09): some arbiters stay on the old shard map
/// (at least one, and never all of two or more), the others load the new
/// version, the lock log's fence is raised to it, and after one to four
/// seconds the ones behind load it too. From the raise's commit until then
/// no grant through them may commit (judged at the end,
/// [`super::fences`]); the others go on granting. With
/// [`FaultKnobs::map_fences_unenforced`] the ones behind load the map at
/// once, as a control: the judge must then find their grants.
///
/// [`FaultKnobs::map_fences_unenforced`]: super::FaultKnobs::map_fences_unenforced
async fn map_fence(world: &World, rng: &mut Rng) {
    let n = world.arbiters.len();
    let mut behind: Vec<usize> = (0..n).filter(|_| rng.chance(50)).collect();
    if behind.is_empty() {
        behind.push(usize::try_from(rng.below(n as u64)).unwrap_or(0));
    } else if n >= 2 && behind.len() == n {
        behind.remove(usize::try_from(rng.below(n as u64)).unwrap_or(0));
    }
    let length = Duration::from_millis(1000 + rng.below(3000));
    let version = {
        let mut fences = lock(&world.fences);
        fences.version += 1;
        fences.version
    };
    let names: Vec<String> = behind.iter().map(|i| format!("arbiter-{i}")).collect();
    let op = fault(
        world,
        format!(
            "shard-map fence raised to version {version}, {} still on version {} for {} ms",
            names.join(" and "),
            version - 1,
            length.as_millis()
        ),
    );
    let unenforced = world.cfg.faults.map_fences_unenforced;
    for i in 0..n {
        if unenforced || !behind.contains(&i) {
            world.set_map_version(i, version);
        }
    }
    // The mover's raise, retried until it has landed (an answer lost after
    // the commit is retried too, and then writes nothing).
    while world.log.raise_map_fence(version).await.is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let raised = world
        .memlog
        .stored(&LAYOUT.map_fence())
        .map(|kv| kv.mod_revision);
    let epoch = world
        .memlog
        .stored(&LAYOUT.epoch())
        .and_then(|kv| decode::<EpochRecord>(&kv.value))
        .map(|r| r.epoch);
    let (Some(raised), Some(epoch)) = (raised, epoch) else {
        world.note(format!(
            "the fence raised to version {version} or the epoch record is not in the log"
        ));
        done(world, op);
        return;
    };
    lock(&world.fences).windows.push(Window {
        version,
        epoch,
        raised,
        behind: behind.clone(),
        caught_up: None,
    });
    tokio::time::sleep(length).await;
    // The revision before the ones behind load the map: every grant they
    // make from here on commits above it.
    let caught_up = world.memlog.revision();
    for &i in &behind {
        world.set_map_version(i, version);
    }
    if let Some(w) = lock(&world.fences).windows.last_mut() {
        w.caught_up = Some(caught_up);
    }
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

/// Restores the lock log, the coord cluster, or both ([`What`]), waits
/// for an arbiter to seal, then advances the epoch as an operator through
/// one arbiter, retrying until it is done (a restore of the coord cluster
/// that lost nothing the arbiters had seen or the lock log had recorded of
/// it may not seal: the operator advances anyway after 20 s, and a note
/// says so). The fault completes with the seal reasons the operator saw.
/// Now and then ([`FaultKnobs::isolate_percent`]) one arbiter is cut off
/// from every caller first, until it is quiet, and reconnected only after
/// the advance: it notices the restore late, in the advanced epoch, and
/// must not seal that. Otherwise, now and then
/// ([`FaultKnobs::idle_percent`]) one arbiter is cut off the same way but
/// reconnected right after the restore, and the operator looks only a
/// little later: the clients reach it before any arbiter sealed. And now
/// and then ([`FaultKnobs::wipe_on_restore_percent`]) every arbiter
/// restarts with its state dir lost right after the restore. Half the
/// time the operator backs the restored log (and coord cluster) up before
/// advancing; that backup is returned.
///
/// [`FaultKnobs::isolate_percent`]: super::FaultKnobs::isolate_percent
/// [`FaultKnobs::idle_percent`]: super::FaultKnobs::idle_percent
/// [`FaultKnobs::wipe_on_restore_percent`]: super::FaultKnobs::wipe_on_restore_percent
async fn restore(
    world: &World,
    rng: &mut Rng,
    what: &What,
) -> Option<(Snapshot, Option<WitnessSnapshot>)> {
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
            "{} + advance-epoch{}{}{}",
            what.describe(),
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
    // Half the time the restore waits (a little) for a batch of several
    // grants and releases on its way to the log, and lands under it: the
    // batch then commits in the restored log, or its answer is lost.
    if rng.chance(50) {
        let by = Instant::now() + Duration::from_millis(300);
        while Instant::now() < by && world.memlog.batches_in_flight() == 0 {
            tokio::time::sleep(Duration::from_micros(250)).await;
        }
    }
    lock(&world.liveness).last_restore = Some(Instant::now());
    match what {
        What::Log { log, cluster } => world.memlog.restore(&log.log, *cluster),
        What::Coord { coord } => restore_coord(world, coord),
        What::Both {
            log,
            cluster,
            coord,
        } => {
            world.memlog.restore(&log.log, *cluster);
            restore_coord(world, coord);
        }
    }
    let taken = back_up.then(|| back_up_now(world));
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
    let sealed = loop {
        let reasons: Vec<String> = world
            .up()
            .iter()
            .filter_map(|a| {
                let reason = a.table.seal().guard().seal_reason()?;
                Some(format!("arbiter-{}: {reason}", a.index))
            })
            .collect();
        if !reasons.is_empty() {
            break format!("sealed: {}", reasons.join("; "));
        }
        if Instant::now() >= noticed_by {
            world.note(format!(
                "no arbiter sealed within 20 s of the restore at {:.1} ms; advancing anyway",
                world.ms(Instant::now())
            ));
            break "no arbiter sealed within 20 s".to_string();
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
    };

    // The lock cluster's advance: with shards, it ends the holds of the
    // keys homed there only (one advance per key, scoped to it).
    // A key that moved to another shard while the advance ran is judged
    // as if it had not ended its holds (a failed advance frees nothing):
    // strict, so no double grant on its new shard is excused.
    let now = Instant::now();
    let advances: Vec<_> = world
        .advance_scopes()
        .into_iter()
        .map(|scope| {
            let op = world.invoke(
                "nemesis",
                Function::Advance,
                scope.as_deref(),
                None,
                None,
                now,
            );
            (op, scope)
        })
        .collect();
    let detail = advance(world, rng).await;
    let still = world.advance_scopes();
    for (adv, scope) in advances {
        let outcome = match still.contains(&scope) {
            true => Outcome::Ok,
            false => Outcome::Fail,
        };
        world.complete(adv, outcome, None, None, Some(detail.clone()));
    }
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
    world.complete(op, Outcome::Ok, None, None, Some(sealed));
    taken
}

/// Restores the coord cluster from `coord`'s snapshot.
fn restore_coord(world: &World, coord: &Backup) {
    if let (Some(witness), Some(snapshot)) = (&world.memwitness, &coord.coord) {
        witness.restore(snapshot);
    }
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
