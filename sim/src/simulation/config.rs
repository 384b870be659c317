//! The shape of a run: [`SimConfig`] (seed, arbiters, clients, keys,
//! operations), the faults it may meet ([`FaultKnobs`]) and the named
//! presets the CI seeds run.

mod keys;

use std::time::Duration;

/// What the nemesis and the clients may do wrong.
#[derive(Debug, Clone)]
pub struct FaultKnobs {
    /// Mean milliseconds between two faults (each gap is 0.5–1.5 × this).
    pub fault_gap_ms: u64,
    /// Windows of log faults.
    pub log_faults: bool,
    /// Windows of a slow log: many calls delayed, none failing.
    pub slow_log: bool,
    /// Highest percentage of calls failing before commit, and of answers
    /// lost after commit, in a window (delays up to three times this).
    pub log_fault_peak: u32,
    /// Kill and restart arbiters.
    pub arbiter_restarts: bool,
    /// Percent of restarts that lose the state dir (the high-water mark).
    /// With [`Self::restores`] only safe with a witness: see the module
    /// docs (issue 15).
    pub lose_state_percent: u32,
    /// Compact the log's history and break watch streams.
    pub compaction: bool,
    /// Restore snapshots (same or new cluster id) and advance the epoch.
    pub restores: bool,
    /// Percent of restores during which one arbiter is cut off from every
    /// caller (quiet before the restore, reconnected after the advance).
    pub isolate_percent: u32,
    /// Percent of the other restores during which one arbiter is idle (no
    /// caller reaches it for a while before the restore) and is reconnected
    /// right after the restore, before any arbiter sealed or the operator
    /// advanced: the clients reach it first. Without a witness its memory
    /// stops at what it saw before it went idle.
    pub idle_percent: u32,
    /// Percent of restores after which every arbiter restarts with its
    /// state dir lost (issue 15's fault: "restore + every arbiter loses
    /// its state"). Only safe with a witness.
    pub wipe_on_restore_percent: u32,
    /// Percent of restores that restore the coord cluster (the witness),
    /// when there is one: half of them the coord cluster alone (the lock
    /// log untouched), half both, the lock log from one kept backup and
    /// the coord cluster from another taken at a different time, drawn
    /// only where the design guarantees the restore is noticed (see the
    /// module docs). The isolated, idle and wiped arbiters come with them
    /// as with any restore.
    pub coord_restore_percent: u32,
    /// Also draw restores of both whose two backups both predate the
    /// serving epoch: with every state dir wiped nothing then knows that
    /// epoch, and the advance re-uses it (unsafe by design: only to show
    /// that limit; off in every preset).
    pub coord_restore_before_serving_epoch: bool,
    /// The log-fault and slow-log windows hit the witness too (when there
    /// is one), with the same rates.
    pub witness_faults: bool,
    /// Percent of grants whose holder crashes (stops renewing, never
    /// releases).
    pub crash_percent: u32,
    /// Percent of units of work in which the holder freezes past its TTL
    /// and then writes with its (stale) token.
    pub pause_percent: u32,
    /// Percent of acquires the client cancels after a random time.
    pub cancel_percent: u32,
    /// Percent of calls routed to a random arbiter instead of the key's home.
    pub stray_percent: u32,
    /// Percent of cycles after which an incarnation closes its session and
    /// ends.
    pub close_session_percent: u32,
    /// Raise the lock log's shard-map fence above the map some arbiters
    /// route by, for a while (see the module docs).
    pub map_fences: bool,
    /// The arbiters picked to stay behind a fence load its map at once
    /// anyway, while the run is judged as if they had not: their grants
    /// must show as violations (only to show the fence's check has teeth;
    /// off in every preset).
    pub map_fences_unenforced: bool,
    /// Two-person force-releases of holds the clients have (see the module
    /// docs).
    pub force_releases: bool,
    /// The forced end names the hold as it is right before the end, not
    /// the one approved: the bug a request's lease and revision guard
    /// against. Its runs must show violations (only to show that the
    /// simulation notices; off in every preset).
    pub force_releases_reread: bool,
    /// Of the force-releases that ended their hold, the share (percent)
    /// whose approval also revokes the holder's session
    /// (`KeyOwner::revoke_session`): every hold still on it is recorded as
    /// an `expire` first, as the forced end is.
    pub force_revokes_percent: u32,
    /// The revocation names the session that holds the key right after the
    /// forced end (often the next waiter's, handed the key), not the one
    /// approved: its runs must show violations (only to show that the
    /// simulation notices; off in every preset).
    pub force_revokes_reread: bool,
    /// With shards ([`SimConfig::shards`]): the last shard is not in the
    /// first map, and an operator adds it and moves ranges to it through
    /// the admin handlers (`ChangeShards`, then `StepShardMove` until the
    /// move finishes: fence, drain, epoch raise, new homes), or cancels the
    /// move if it has not finished in a minute.
    pub shard_moves: bool,
    /// The operator adds the shard by publishing the next map with it at
    /// once: no move, so no fence, no drain and no epoch raised; the ranges
    /// it homes are granted there while their old shard still holds them,
    /// with smaller tokens. Its runs must show violations (only to show
    /// that the simulation notices; off in every preset).
    pub shard_moves_unfenced: bool,
    /// Renewals trust a session's shadow marks after a restore of the lock
    /// cluster (the marks' read never shows the epoch advance), so a mark
    /// the restore took back is never made again: the shadow it named
    /// expires while KeepAlive answers the session alive. Its runs must
    /// show violations with long holds (only to show that the simulation
    /// notices; off in every preset).
    pub shadow_marks_trusted: bool,
    /// Each arbiter keeps the namespace bindings in a store of its own
    /// (none shared), so each routes a namespace by the policies it read:
    /// with [`SimConfig::coord_rollout`], one arbiter grants a coord key
    /// on the coord tier while another grants it on the entity cluster.
    /// Its runs must show violations (only to show that the simulation
    /// notices; off in every preset).
    pub tier_bindings_unshared: bool,
    /// Windows in which the lock log loses its majority (every call fails,
    /// no lease expires; on return every lease gets its whole TTL), now and
    /// then with the watch streams broken right before or an arbiter
    /// restarted in it. Open keys are granted from memory meanwhile
    /// ([`SimConfig::open_keys`]; needs [`SimConfig::whole_arbiter`]).
    pub quorum_losses: bool,
    /// The hold counts see no hold in the log, so a grant from memory takes
    /// keys the log holds for other sessions: the bug the count guards
    /// against. Its runs must show violations (only to show that the
    /// simulation notices; off in every preset).
    pub blind_hold_follower: bool,
    /// Windows in which every lease renewal fails for longer than a TTL
    /// while the rest of the log answers: sessions expire under clients
    /// that must have fenced by then.
    pub renewal_outages: bool,
}

impl FaultKnobs {
    /// Every fault, state kept across restarts.
    pub fn all() -> Self {
        Self {
            fault_gap_ms: 2000,
            log_faults: true,
            slow_log: true,
            log_fault_peak: 10,
            arbiter_restarts: true,
            lose_state_percent: 0,
            compaction: true,
            restores: true,
            isolate_percent: 40,
            idle_percent: 0,
            wipe_on_restore_percent: 0,
            coord_restore_percent: 0,
            coord_restore_before_serving_epoch: false,
            witness_faults: false,
            crash_percent: 2,
            pause_percent: 2,
            cancel_percent: 4,
            stray_percent: 15,
            close_session_percent: 1,
            map_fences: false,
            map_fences_unenforced: false,
            force_releases: false,
            force_releases_reread: false,
            force_revokes_percent: 0,
            force_revokes_reread: false,
            shard_moves: false,
            shard_moves_unfenced: false,
            shadow_marks_trusted: false,
            tier_bindings_unshared: false,
            quorum_losses: false,
            blind_hold_follower: false,
            renewal_outages: false,
        }
    }

    /// Every fault, and shard-map fences raised above some arbiters' map.
    pub fn fenced() -> Self {
        Self {
            map_fences: true,
            ..Self::all()
        }
    }

    /// Every fault, and two-person force-releases of the clients' holds.
    pub fn forced() -> Self {
        Self {
            force_releases: true,
            force_revokes_percent: 30,
            ..Self::all()
        }
    }

    /// Every fault, shard-map fences, force-releases, and quorum losses
    /// (the whole arbiter).
    pub fn quorum_loss() -> Self {
        Self {
            quorum_losses: true,
            force_releases: true,
            force_revokes_percent: 30,
            ..Self::all()
        }
    }

    /// Every fault, force-releases, and windows in which every lease
    /// renewal fails for longer than a TTL (the whole arbiter, renewing
    /// through KeepAlive).
    pub fn renewal_outages() -> Self {
        Self {
            renewal_outages: true,
            force_releases: true,
            force_revokes_percent: 30,
            ..Self::all()
        }
    }

    /// Every fault, force-releases revoking sessions, and more sessions
    /// closed (for the tiers: the coord tier's sessions too).
    pub fn forced_revoking() -> Self {
        Self {
            force_releases: true,
            force_revokes_percent: 40,
            close_session_percent: 4,
            ..Self::all()
        }
    }

    /// Every fault, force-releases revoking sessions, and more sessions
    /// closed (their shadows end with them) for a sharded run.
    pub fn sharded() -> Self {
        Self {
            force_releases: true,
            force_revokes_percent: 40,
            close_session_percent: 4,
            shard_moves: true,
            ..Self::all()
        }
    }

    /// Every fault but restores, and half the restarts lose their state dir.
    pub fn state_loss() -> Self {
        Self {
            restores: false,
            lose_state_percent: 50,
            ..Self::all()
        }
    }

    /// Every fault, and state dirs lost together with restores: half the
    /// restarts lose their state dir, a third of the restores wipe every
    /// arbiter's state right after them, a third bring back an arbiter
    /// idle before them at once; the witness faults with the log, and half
    /// the restores restore the coord cluster (alone, or with the lock log
    /// from another moment). Safe only with a witness (issue 15).
    pub fn witnessed() -> Self {
        Self {
            lose_state_percent: 50,
            idle_percent: 35,
            wipe_on_restore_percent: 35,
            coord_restore_percent: 50,
            witness_faults: true,
            ..Self::all()
        }
    }

    /// [`Self::witnessed`] with every restart losing its state dir, and
    /// half the restores wiping every arbiter's state.
    pub fn witnessed_state_loss() -> Self {
        Self {
            lose_state_percent: 100,
            wipe_on_restore_percent: 50,
            ..Self::witnessed()
        }
    }

    /// Nothing goes wrong.
    pub fn none() -> Self {
        Self {
            fault_gap_ms: 2500,
            log_faults: false,
            slow_log: false,
            log_fault_peak: 0,
            arbiter_restarts: false,
            lose_state_percent: 0,
            compaction: false,
            restores: false,
            isolate_percent: 0,
            idle_percent: 0,
            wipe_on_restore_percent: 0,
            coord_restore_percent: 0,
            coord_restore_before_serving_epoch: false,
            witness_faults: false,
            crash_percent: 0,
            pause_percent: 0,
            cancel_percent: 0,
            stray_percent: 0,
            close_session_percent: 0,
            map_fences: false,
            map_fences_unenforced: false,
            force_releases: false,
            force_releases_reread: false,
            force_revokes_percent: 0,
            force_revokes_reread: false,
            shard_moves: false,
            shard_moves_unfenced: false,
            shadow_marks_trusted: false,
            tier_bindings_unshared: false,
            quorum_losses: false,
            blind_hold_follower: false,
            renewal_outages: false,
        }
    }
}

/// One simulation run: a seed and the shape of the world.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub seed: u64,
    /// Stop once the history holds this many operations (workers finish
    /// their cycle, the nemesis its fault).
    pub min_ops: usize,
    pub keys: usize,
    pub clients: usize,
    pub arbiters: usize,
    /// Longest unit of work inside a hold, in milliseconds (one in 16 is
    /// ten times longer).
    pub unit_ms: u64,
    /// Longest wait budget of a waiting acquire, in milliseconds (from a
    /// tenth of it).
    pub wait_ms: u64,
    /// Percent of waiting acquires with a short budget (up to twice
    /// `unit_ms`): they often run out as the key is handed to them.
    pub short_wait_percent: u32,
    /// Percent of acquires that are try-locks.
    pub try_lock_percent: u32,
    /// Percent of `WAIT_TIMEOUT`s (and of `HELD`s of such a retry) after
    /// which the client asks for the same key again on the same session,
    /// at once or after a few milliseconds (a client's retry loop).
    pub retry_percent: u32,
    /// The tables' poll period (waiters whose watch is lost).
    pub poll: Duration,
    /// Build every table with one shared [`MemWitness`] (the coord
    /// cluster, issue 15); without it the state dirs are the only witness.
    ///
    /// [`MemWitness`]: crate::witness::MemWitness
    pub witness: bool,
    /// Give up (stuck) if `min_ops` is not reached by then, simulated.
    pub max_sim_time: Duration,
    /// Each log call takes half of this to all of it: the round trip in
    /// which later grants and releases queue for the next batch.
    pub log_latency: Duration,
    /// The tables' batch limit (1: no batching).
    pub batch_limit: usize,
    /// Keys `sim/k0` up to this one (exclusive) are of a durable class
    /// (ADR-14): their waiters queue in the log, not in a table.
    pub durable_keys: usize,
    /// The last this many keys are of a class open on quorum loss (ADR-04):
    /// granted from this arbiter's memory, token 0, while the log has no
    /// majority. Only with [`Self::whole_arbiter`].
    pub open_keys: usize,
    /// Run the whole arbiter around each table, as `start.rs` builds it:
    /// clients ask the key's owner (`latchkey_arbiter::owner::KeyOwner`),
    /// which admits by the hold count (following the log) and grants
    /// through the log or, during a quorum loss, from memory (the
    /// quorum-loss posture with its probe and spool). Off: the table alone.
    pub whole_arbiter: bool,
    /// The sessions' TTL (the classes' `ttlSeconds` with the whole arbiter).
    pub ttl_seconds: u32,
    /// Percent of holds kept for one and a half TTLs, renewed, with a write
    /// every 1–3 s until the fence deadline (what a renewal answered for a
    /// lease that was not renewed would let write too late).
    pub long_hold_percent: u32,
    /// Simulated replicas campaigning in [`Self::elections`] elections
    /// through the whole arbiter (latchkey.election.v1), judged by the
    /// election ledger. Only with [`Self::whole_arbiter`].
    pub electors: usize,
    /// Elections `sim/e0` up to this one (exclusive).
    pub elections: usize,
    /// Every worker is bounded as one grant subject ([`QUOTA_SUBJECT`])
    /// and the lock class has this `maxHoldsPerSubject` (issue 34): the
    /// log is checked after every commit to hold no more (table only).
    pub quota: Option<u32>,
    /// Every key is a semaphore of this many permits (issue 34): a grant
    /// holds a slot, which the history then names (each slot judged as a
    /// lock), and the log is checked after every commit to hold no more
    /// slots of a semaphore than its permits (table only).
    pub permits: Option<u32>,
    /// Percent of acquires asking for a shared hold (issue 34): a shared
    /// grant holds the session's own reader key, which the history then
    /// names (each judged as a lock); the log is checked after every commit
    /// of every run never to hold a key exclusively beside anything under
    /// its name (table only).
    pub shared_percent: u32,
    /// Percent of exclusive holds downgraded (issue 34) as the clients do
    /// it, naming the hold's token: the hold turns shared, or the
    /// downgrade is refused NOT_HELD when the hold had ended (force-release,
    /// expiry, an epoch advance), never a fresh reader.
    pub downgrade_percent: u32,
    /// Entity shards beside the lock cluster (ADR-09; only with
    /// [`Self::whole_arbiter`]): the lock cluster is shard `home`, these
    /// are `s1`, `s2`, … with logs of their own (no faults: the nemesis
    /// acts on the lock cluster), all in the first shard map, which the
    /// arbiters follow. Keys then have three segments (`sim/k3/x`), so
    /// that each is a range of its own and the ranges spread over the
    /// shards; a session's holds on another shard are held on its shadow
    /// there, renewed with it, ended with it.
    pub shards: usize,
    /// The last this many keys are coord keys (ADR-07; only with
    /// [`Self::whole_arbiter`]): in namespace `simc`, which a coord-tier
    /// class names, served by the coord tier on a cluster of its own, with
    /// the namespace bindings routing every key. Half the workers'
    /// incarnations open their session for the coord class and use coord
    /// keys only; the others use the entity keys.
    pub coord_keys: usize,
    /// With coord keys: a policy change half rolled out. The odd-numbered
    /// arbiters read files in which no coord-tier class names the coord
    /// keys' namespace any more (their `sim-coord` is an entity-tier
    /// class), the even ones the files before the change. The namespace's
    /// binding, written by whichever serves it first, decides for all;
    /// the others refuse its keys (`TIER_BOUND`, `SESSION_WRONG_TIER`).
    pub coord_rollout: bool,
    pub faults: FaultKnobs,
}

/// The grant subject every worker is bounded as in a quota run.
pub const QUOTA_SUBJECT: &str = "spiffe://sim/workers/*";

impl SimConfig {
    /// The CI shape: 8 keys, 10 clients, 2 arbiters, every fault.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            min_ops: 2500,
            keys: 8,
            clients: 10,
            arbiters: 2,
            unit_ms: 200,
            wait_ms: 1500,
            short_wait_percent: 30,
            try_lock_percent: 25,
            retry_percent: 70,
            poll: Duration::from_millis(500),
            witness: false,
            max_sim_time: Duration::from_secs(3600),
            log_latency: Duration::from_millis(2),
            batch_limit: latchkey_arbiter::table::DEFAULT_BATCH_LIMIT,
            durable_keys: 0,
            open_keys: 0,
            whole_arbiter: false,
            ttl_seconds: 5,
            long_hold_percent: 0,
            electors: 0,
            elections: 0,
            quota: None,
            permits: None,
            shared_percent: 0,
            downgrade_percent: 0,
            shards: 0,
            coord_keys: 0,
            coord_rollout: false,
            faults: FaultKnobs::all(),
        }
    }
}

impl SimConfig {
    /// The whole arbiter ([`Self::whole_arbiter`]) in the shape its
    /// presets share: 12 keys, two of them durable, the TTL an advisory
    /// class needs.
    fn whole(base: Self) -> Self {
        Self {
            whole_arbiter: true,
            ttl_seconds: OPEN_TTL_SECONDS,
            keys: 12,
            durable_keys: 2,
            ..base
        }
    }
}

/// The TTL of the whole-arbiter presets: an open class is advisory, and an
/// advisory class's TTL is at least 30 s (a session serves one TTL).
const OPEN_TTL_SECONDS: u32 = 30;

/// The named shapes the CI test runs and `latchkey-sim --preset` takes.
pub const PRESETS: &[&str] = &[
    "default",
    "three-arbiters",
    "one-arbiter",
    "state-loss",
    "witnessed",
    "witnessed-three-arbiters",
    "witnessed-state-loss",
    "unwitnessed-state-loss",
    "durable",
    "durable-three-arbiters",
    "fenced",
    "fenced-three-arbiters",
    "forced",
    "forced-three-arbiters",
    "quorum-loss",
    "quorum-loss-three-arbiters",
    "renewal-outages",
    "elections",
    "elections-three-arbiters",
    "quota",
    "quota-three-arbiters",
    "semaphores",
    "semaphores-three-arbiters",
    "shared",
    "shared-three-arbiters",
    "shared-durable",
    "shards",
    "shards-three-arbiters",
    "tiers",
    "tiers-three-arbiters",
];

impl SimConfig {
    /// A named shape ([`PRESETS`]) with `seed`:
    ///
    /// - `default`: [`SimConfig::new`] (2 arbiters, every fault);
    /// - `three-arbiters`, `one-arbiter`: the same with 3 arbiters (more
    ///   routing and more arbiters to notice a restore), or 1 (every
    ///   restart takes the whole service down);
    /// - `state-loss`: restarts lose their state dir half the time, and
    ///   so no restores ([`FaultKnobs::state_loss`], issue 15).
    /// - `witnessed`: `default` with a witness ([`SimConfig::witness`]),
    ///   state dirs lost at restarts and right after restores, an arbiter
    ///   idle before a restore serving right after it, half the restores
    ///   restoring the coord cluster, alone or with the lock log from
    ///   another moment ([`FaultKnobs::witnessed`]);
    ///   `witnessed-three-arbiters` the same with 3 arbiters;
    /// - `witnessed-state-loss`: every restart loses its state dir, half
    ///   the restores wipe every arbiter's, half restore the coord cluster
    ///   ([`FaultKnobs::witnessed_state_loss`]);
    /// - `unwitnessed-state-loss`: `witnessed-state-loss` without the
    ///   witness (and so no restore of one): the single-cluster limit of
    ///   issue 15, which re-issues tokens (it is expected to fail).
    /// - `durable`, `durable-three-arbiters`: `default` (and with 3
    ///   arbiters) with half the keys of a durable class
    ///   ([`SimConfig::durable_keys`]).
    /// - `fenced`, `fenced-three-arbiters`: `default` (and with 3
    ///   arbiters) with shard-map fences ([`FaultKnobs::fenced`]).
    /// - `forced`, `forced-three-arbiters`: `default` (and with 3
    ///   arbiters) with two-person force-releases ([`FaultKnobs::forced`]).
    /// - `quorum-loss`, `quorum-loss-three-arbiters`: the whole arbiter
    ///   ([`SimConfig::whole_arbiter`]), half the keys open on quorum loss,
    ///   two durable, every fault, shard-map fences, force-releases and
    ///   quorum losses ([`FaultKnobs::quorum_loss`]).
    /// - `elections`, `elections-three-arbiters`: the whole arbiter with
    ///   every fault of `quorum-loss`, and electors ([`SimConfig::electors`])
    ///   campaigning, proclaiming, resigning, transferring, crashing and
    ///   freezing in 2 (3) elections beside the workers.
    /// - `quota`, `quota-three-arbiters`: `forced` (and with 3 arbiters)
    ///   over 12 keys, every worker bounded as one grant subject with a
    ///   quota of 3 ([`SimConfig::quota`]): force-releases and orphan
    ///   releases leave stale places to take again.
    /// - `semaphores`, `semaphores-three-arbiters`: `forced` (and with 3
    ///   arbiters) where every one of 3 keys is a semaphore of 3 permits
    ///   ([`SimConfig::permits`]), so a dozen clients contend for 9 slots.
    /// - `shared`, `shared-three-arbiters`: `forced` (and with 3 arbiters)
    ///   over 3 keys, 60 % of acquires shared ([`SimConfig::shared_percent`]):
    ///   readers, writers, phase-fair queues and readers granted in one
    ///   batch; 30 % of exclusive holds downgraded
    ///   ([`SimConfig::downgrade_percent`]).
    /// - `shared-durable`: `shared-three-arbiters` where 2 of the 3 keys are
    ///   of a durable class: readers and writers queued in the log.
    /// - `renewal-outages`: the whole arbiter, every fault, force-releases,
    ///   windows in which no lease renewal succeeds for longer than a TTL
    ///   ([`FaultKnobs::renewal_outages`]), and 3% long holds writing until
    ///   their fence deadline ([`SimConfig::long_hold_percent`]).
    /// - `shards`, `shards-three-arbiters`: the whole arbiter over entity
    ///   shards ([`SimConfig::shards`]): the lock cluster and `s1` in the
    ///   first map, `s2` added by an operator who moves ranges to it
    ///   ([`FaultKnobs::shard_moves`]); every shard witnessed on the coord
    ///   cluster, as a sharded arbiter is; every fault on the lock cluster,
    ///   force-releases of holds on any shard revoking the holder's session
    ///   on its home (its shadows ended), closed sessions.
    /// - `tiers`, `tiers-three-arbiters`: the whole arbiter with the coord
    ///   tier split off ([`SimConfig::coord_keys`]): 5 of the 12 keys in a
    ///   coord-tier namespace, on the coord tier's own cluster, routed by
    ///   the namespace bindings (their entity copy in the lock cluster, so
    ///   restores take it back); every fault on the lock cluster,
    ///   force-releases on either tier revoking the holder's session.
    pub fn preset(name: &str, seed: u64) -> Option<Self> {
        let base = Self::new(seed);
        Some(match name {
            "default" => base,
            "three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                ..base
            },
            "durable" => Self {
                durable_keys: base.keys / 2,
                ..base
            },
            "durable-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                durable_keys: base.keys / 2,
                ..base
            },
            "fenced" => Self {
                faults: FaultKnobs::fenced(),
                ..base
            },
            "fenced-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                faults: FaultKnobs::fenced(),
                ..base
            },
            "forced" => Self {
                faults: FaultKnobs::forced(),
                ..base
            },
            "quorum-loss" => Self {
                open_keys: 8,
                faults: FaultKnobs::quorum_loss(),
                ..Self::whole(base)
            },
            "quorum-loss-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                open_keys: 8,
                faults: FaultKnobs::quorum_loss(),
                ..Self::whole(base)
            },
            "elections" => Self {
                electors: 8,
                elections: 3,
                faults: FaultKnobs::quorum_loss(),
                ..Self::whole(base)
            },
            "elections-three-arbiters" => Self {
                arbiters: 3,
                electors: 8,
                elections: 3,
                faults: FaultKnobs::quorum_loss(),
                ..Self::whole(base)
            },
            "renewal-outages" => Self {
                long_hold_percent: 3,
                faults: FaultKnobs::renewal_outages(),
                ..Self::whole(base)
            },
            "shards" => Self {
                shards: 2,
                witness: true,
                faults: FaultKnobs::sharded(),
                ..Self::whole(base)
            },
            "tiers" => Self {
                coord_keys: 5,
                witness: true,
                faults: FaultKnobs::forced_revoking(),
                ..Self::whole(base)
            },
            "tiers-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                coord_keys: 5,
                witness: true,
                faults: FaultKnobs::forced_revoking(),
                ..Self::whole(base)
            },
            "shards-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                shards: 2,
                witness: true,
                faults: FaultKnobs::sharded(),
                ..Self::whole(base)
            },
            "quota" => Self {
                keys: 12,
                quota: Some(3),
                faults: FaultKnobs::forced(),
                ..base
            },
            "semaphores" => Self {
                keys: 3,
                permits: Some(3),
                faults: FaultKnobs::forced(),
                ..base
            },
            "shared" => Self {
                keys: 3,
                shared_percent: 60,
                downgrade_percent: 30,
                faults: FaultKnobs::forced(),
                ..base
            },
            "shared-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                keys: 3,
                shared_percent: 60,
                downgrade_percent: 30,
                faults: FaultKnobs::forced(),
                ..base
            },
            "shared-durable" => Self {
                arbiters: 3,
                clients: 12,
                keys: 3,
                durable_keys: 2,
                shared_percent: 60,
                downgrade_percent: 30,
                faults: FaultKnobs::forced(),
                ..base
            },
            "semaphores-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                keys: 3,
                permits: Some(3),
                faults: FaultKnobs::forced(),
                ..base
            },
            "quota-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                keys: 12,
                quota: Some(3),
                faults: FaultKnobs::forced(),
                ..base
            },
            "forced-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                faults: FaultKnobs::forced(),
                ..base
            },
            "one-arbiter" => Self {
                arbiters: 1,
                clients: 8,
                keys: 6,
                ..base
            },
            "state-loss" => Self {
                faults: FaultKnobs::state_loss(),
                ..base
            },
            "witnessed" => Self {
                witness: true,
                faults: FaultKnobs::witnessed(),
                ..base
            },
            "witnessed-three-arbiters" => Self {
                arbiters: 3,
                clients: 12,
                witness: true,
                faults: FaultKnobs::witnessed(),
                ..base
            },
            "witnessed-state-loss" => Self {
                witness: true,
                faults: FaultKnobs::witnessed_state_loss(),
                ..base
            },
            "unwitnessed-state-loss" => Self {
                witness: false,
                faults: FaultKnobs::witnessed_state_loss(),
                ..base
            },
            _ => return None,
        })
    }
}
