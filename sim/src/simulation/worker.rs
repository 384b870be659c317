//! One simulated client: the gate worker's loop (gate/src/worker.rs)
//! against the arbiters' tables instead of the client library.
//!
//! A worker is a process in the checker's terms; each incarnation (`w3.2`)
//! has one session, renewed by a task of its own. Any outcome the worker
//! cannot know (an unknown acquire, a release that did not succeed) ends
//! the incarnation after an `expire` marker at the session's fence
//! deadline, and the next incarnation opens a new session: the checker's
//! search relies on a process doing nothing after an unknown outcome.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use latchkey_arbiter::error::ArbiterError;
use latchkey_arbiter::table::GrantRequest;
use latchkey_checker::{Function, Outcome};
use latchkey_proto::lockv1::{CloseSessionRequest, OpenSessionRequest, ReleaseRequest};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::world::{Arbiter, World, lock};

pub(crate) mod calls;
pub(crate) mod elector;
mod renewals;
use crate::rng::Rng;
use calls::{Got, acquire, downgrade, request};
use renewals::{keep_alive, renew};

/// Sessions an identity may have open; dead incarnations' sessions linger
/// until their TTL, so this is generous.
const MAX_SESSIONS: u32 = 10_000;
const MAX_WAITERS_PER_KEY: u32 = 16;
use super::SimConfig;
use super::policies::{CLASS, COORD_CLASS, DURABLE_CLASS, OPEN_CLASS};

/// The reasons the arbiter gives before writing anything: the gate's list
/// (`is_definite_refusal` in gate/src/worker.rs), and a shard-map
/// fence ahead of the arbiter's map (refused by the serving check, as a
/// seal is). Everything else may hide a grant or a release.
fn is_definite_refusal(e: &ArbiterError) -> bool {
    matches!(
        e,
        ArbiterError::Held { .. }
            | ArbiterError::Leak { .. }
            | ArbiterError::WaitTimeout { .. }
            | ArbiterError::Sealed { .. }
            | ArbiterError::ShardMapAhead { .. }
            // A moving range is refused by its route, before anything is
            // written.
            | ArbiterError::RangeMoving(_)
            | ArbiterError::QueueFull { .. }
            | ArbiterError::TooManyWaiters { .. }
            | ArbiterError::NotHeld { .. }
            | ArbiterError::DowngradeNotHeld { .. }
            | ArbiterError::TokenMismatch { .. }
            | ArbiterError::SessionExpired { .. }
            | ArbiterError::ClosedOnQuorumLoss { .. }
            | ArbiterError::QuotaExceeded { .. }
            // The tiers' routing refuses before any hold is written.
            | ArbiterError::WrongTier(_)
            | ArbiterError::TierBound(_)
            | ArbiterError::TierMoving(_)
            | ArbiterError::SessionWrongTier(_)
    )
}

/// An error for the history's `detail`, without the session ids the
/// arbiter draws at random (a seed must give the same bytes every run).
fn describe(e: &ArbiterError) -> String {
    match e {
        ArbiterError::SessionExpired { .. } => "SESSION_EXPIRED".into(),
        ArbiterError::NotHeld { key, .. } => format!("NOT_HELD {key}"),
        ArbiterError::Leak { key, .. } => format!("LEAK {key}"),
        ArbiterError::SessionClassMismatch { .. } => "SESSION_CLASS_MISMATCH".into(),
        ArbiterError::SessionWrongTier(_) => "SESSION_WRONG_TIER".into(),
        other => other.to_string(),
    }
}

/// How a call through an arbiter ended.
enum Call<T> {
    Answered(Result<T, ArbiterError>),
    /// The arbiter died with the call in flight.
    Killed,
    /// The client gave up on it (the acquire future was dropped).
    Cancelled,
}

/// The session of one incarnation, shared with its renewal task.
struct Session {
    id: i64,
    /// When the last successful renewal (or the lease grant) was sent: the
    /// lease cannot end before this + TTL.
    renewed: Instant,
    /// The TTL the last renewal counted from `renewed` (the session's TTL,
    /// or what a KeepAlive answer said was left).
    granted: Duration,
    /// The log said the lease is gone.
    gone: bool,
    ttl: Duration,
    /// When it was opened (asked for).
    opened: Instant,
}

impl Session {
    /// The fence deadline: the earliest moment the lease, and every hold on
    /// it, may end. Exact under paused time (the gate's client subtracts a
    /// second of margin for real clocks).
    fn deadline(&self) -> Instant {
        self.renewed + self.granted
    }
}

/// One worker: incarnations until the run stops.
pub(crate) async fn run(world: Arc<World>, index: usize, mut rng: Rng) {
    let identity = match world.cfg.whole_arbiter {
        true => super::policies::identity(index),
        false => format!("w{index}"),
    };
    let mut incarnation = 0u32;
    while !world.stopping() {
        incarnation += 1;
        let process = format!("w{index}.{incarnation}");
        let renew_seed = rng.next_u64();
        // Drawn only with coord keys: other runs draw what they always drew.
        let coord = world.cfg.coord_keys > 0 && rng.chance(50);
        Incarnation {
            world: world.clone(),
            identity: identity.clone(),
            process,
            rng: &mut rng,
            retry: None,
            coord,
        }
        .run(renew_seed)
        .await;
    }
}

struct Incarnation<'a> {
    world: Arc<World>,
    identity: String,
    process: String,
    rng: &'a mut Rng,
    /// The key to ask for again, on the same session, in the next cycle:
    /// the last acquire ran out of its wait budget (or, retrying, found it
    /// held).
    retry: Option<String>,
    /// Its session is the coord tier's, and it asks for coord keys only
    /// (`SimConfig::coord_keys`).
    coord: bool,
}

/// Stops the renewal task when the incarnation ends, however it ends.
struct Renewer(JoinHandle<()>);

impl Drop for Renewer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Incarnation<'_> {
    async fn run(mut self, renew_seed: u64) {
        let Some(session) = self.open_session().await else {
            return;
        };
        let session = Arc::new(Mutex::new(session));
        let renewal = match self.world.cfg.whole_arbiter {
            true => tokio::spawn(keep_alive(
                self.world.clone(),
                self.identity.clone(),
                session.clone(),
                Rng::new(renew_seed),
            )),
            false => tokio::spawn(renew(
                self.world.clone(),
                session.clone(),
                Rng::new(renew_seed),
            )),
        };
        let mut renewer = Some(Renewer(renewal));
        let id = lock(&session).id;
        loop {
            if self.world.stopping() {
                return;
            }
            {
                let s = lock(&session);
                if s.gone || Instant::now() >= s.deadline() {
                    // Fenced: nothing was asked on it since; a new
                    // incarnation opens a new session.
                    return;
                }
            }
            if self.rng.chance(self.world.cfg.faults.close_session_percent) {
                self.close(id).await;
                return;
            }
            match self.cycle(id, &session, &mut renewer).await {
                Next::Continue => {}
                Next::End => return,
            }
        }
    }

    async fn open_session(&mut self) -> Option<Session> {
        loop {
            if self.world.stopping() {
                return None;
            }
            let Some(arbiter) = self.world.any(self.rng) else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let sent = Instant::now();
            let table = arbiter.table.clone();
            let identity = self.identity.clone();
            let ttl_seconds = self.world.cfg.ttl_seconds;
            let call = async {
                match &arbiter.service {
                    // The OpenSession handler, for the class's TTL.
                    Some(service) => service
                        .open_session(request(
                            &identity,
                            None,
                            OpenSessionRequest {
                                class: match self.coord {
                                    true => COORD_CLASS,
                                    false => CLASS,
                                }
                                .into(),
                                reuse_session_ids: Vec::new(),
                            },
                        ))
                        .await
                        .map(|r| r.session_id),
                    None => {
                        table
                            .open_session(&identity, ttl_seconds, MAX_SESSIONS)
                            .await
                    }
                }
            };
            let opened = tokio::select! {
                biased;
                () = arbiter.killed.cancelled() => None,
                r = call => r.ok(),
            };
            match opened {
                Some(id) => {
                    return Some(Session {
                        id,
                        renewed: sent,
                        granted: Duration::from_secs(u64::from(ttl_seconds)),
                        opened: sent,
                        gone: false,
                        ttl: Duration::from_secs(u64::from(ttl_seconds)),
                    });
                }
                // Nothing was asked on a session yet: nothing to record. A
                // lease that was granted anyway expires on its own.
                None => {
                    let pause = 50 + self.rng.below(200);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
            }
        }
    }

    async fn close(&mut self, id: i64) {
        let Some(arbiter) = self.world.any(self.rng) else {
            return;
        };
        let table = arbiter.table.clone();
        let call = async {
            match &arbiter.service {
                Some(service) => {
                    let _ = service
                        .close_session(request(
                            &self.identity,
                            None,
                            CloseSessionRequest { session_id: id },
                        ))
                        .await;
                }
                None => {
                    let _ = table
                        .close_session(&self.identity, &self.identity, id)
                        .await;
                }
            }
        };
        tokio::select! {
            biased;
            () = arbiter.killed.cancelled() => {}
            () = call => {}
        }
    }

    /// A key of the incarnation's tier: any key without coord keys.
    fn draw_key(&mut self, cfg: &SimConfig) -> String {
        let keys = cfg.keys.max(1) as u64;
        let coord = cfg.coord_keys.min(cfg.keys) as u64;
        if coord == 0 {
            return cfg.key(self.rng.below(keys));
        }
        match self.coord {
            true => cfg.key(keys - coord + self.rng.below(coord)),
            false => cfg.key(self.rng.below((keys - coord).max(1))),
        }
    }

    fn stray(&mut self) -> bool {
        self.rng.chance(self.world.cfg.faults.stray_percent)
    }

    /// One acquire, unit of work, write and release.
    async fn cycle(
        &mut self,
        id: i64,
        session: &Arc<Mutex<Session>>,
        renewer: &mut Option<Renewer>,
    ) -> Next {
        let cfg = self.world.cfg.clone();
        let (mut key, retrying) = match self.retry.take() {
            Some(key) => (key, true),
            None => (self.draw_key(&cfg), false),
        };
        let stray = self.stray();
        let Some(arbiter) = self.world.route(&key, stray, self.rng) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            return Next::Continue;
        };
        // A short budget runs out about when the key is handed over.
        let short = |rng: &mut Rng| {
            Some(Duration::from_millis(
                10 + rng.below(cfg.unit_ms.max(1) * 2),
            ))
        };
        let wait = if retrying {
            // A retry: a try-lock half the time, else a short wait.
            if self.rng.chance(50) {
                None
            } else {
                short(self.rng)
            }
        } else if self.rng.chance(cfg.try_lock_percent) {
            None
        } else if self.rng.chance(cfg.short_wait_percent) {
            short(self.rng)
        } else {
            let ms = cfg.wait_ms.max(10);
            Some(Duration::from_millis(
                ms / 10 + self.rng.below(ms - ms / 10 + 1),
            ))
        };
        let cancel_after = self.rng.chance(cfg.faults.cancel_percent).then(|| {
            let budget = wait.map_or(20, |w| u64::try_from(w.as_millis()).unwrap_or(20));
            Duration::from_millis(self.rng.below(budget.max(1) + 1))
        });

        let invoked = Instant::now();
        let op = self.world.invoke(
            &self.process,
            Function::Acquire,
            Some(&key),
            None,
            None,
            invoked,
        );
        let number = cfg.key_number(&key);
        let durable = number.is_some_and(|n| n < cfg.durable_keys);
        let open = number.is_some_and(|n| n + cfg.open_keys >= cfg.keys);
        let coord = number.is_some_and(|n| cfg.is_coord_key(n as u64));
        let req = GrantRequest {
            key: key.clone(),
            identity: self.identity.clone(),
            session: id,
            class: match (coord, open, durable) {
                (true, _, _) => COORD_CLASS,
                (false, true, _) => OPEN_CLASS,
                (false, false, true) => DURABLE_CLASS,
                (false, false, false) => CLASS,
            }
            .into(),
            ttl_seconds: cfg.ttl_seconds,
            annotations: BTreeMap::new(),
            routed_by: None,
            quota: cfg.quota,
            permits: cfg.permits,
            // no draw at 0 %: every other preset's seeds replay as before
            shared: cfg.shared_percent > 0
                && cfg.permits.is_none()
                && self.rng.chance(cfg.shared_percent),
            instance: String::new(),
            bound: match cfg.quota {
                Some(_) => super::config::QUOTA_SUBJECT.into(),
                None => String::new(),
            },
        };
        // Kept for a downgrade of the hold, which asks it again in mode SHARED.
        let asked = req.clone();
        let answer = acquire(&arbiter, req, wait, cancel_after, durable).await;
        let token = match answer {
            Call::Answered(Ok(Got::Log(grant))) => match grant.token() {
                Some(token) => {
                    if cfg.permits.is_some() || grant.key != key {
                        // A semaphore's grant holds a slot, a shared one
                        // the session's reader key: from here on the
                        // history, the writes and the release name it, and
                        // the checker judges each as a lock.
                        key = grant.key.clone();
                        self.world.rekey(op, &key);
                    }
                    lock(&self.world.fences).granted(arbiter.index, &grant);
                    if self.world.cfg.faults.force_releases {
                        lock(&self.world.granted_to)
                            .insert((key.clone(), token), (self.process.clone(), grant.session));
                    }
                    if arbiter.owner.is_some() {
                        let ms = self.world.ms(Instant::now());
                        lock(&self.world.memory).log_granted(
                            arbiter.index,
                            &key,
                            id,
                            &self.process,
                            invoked,
                            ms,
                        );
                    }
                    self.world
                        .complete(op, Outcome::Ok, Some(token), None, None);
                    token
                }
                None => {
                    let detail = format!("granted at an unpackable token {grant:?}");
                    return self.unknown_acquire(op, &key, detail, session, renewer);
                }
            },
            Call::Answered(Ok(Got::Memory)) => {
                // Unprotected: no fenced grant, so the checker sees a
                // refusal; the memory ledger judges it.
                self.world.complete(
                    op,
                    Outcome::Fail,
                    None,
                    None,
                    Some("UNPROTECTED memory grant (token 0)".into()),
                );
                self.hold_from_memory(&arbiter, &key, id, invoked).await;
                return Next::Continue;
            }
            Call::Answered(Err(e)) if is_definite_refusal(&e) => {
                if arbiter.owner.is_some()
                    && matches!(
                        e,
                        ArbiterError::Held { .. } | ArbiterError::WaitTimeout { .. }
                    )
                    && !self.world.memlog.quorum_lost()
                {
                    lock(&self.world.memory).log_refused(arbiter.index, &key, id);
                }
                self.world
                    .complete(op, Outcome::Fail, None, None, Some(describe(&e)));
                if matches!(e, ArbiterError::ShardMapAhead { .. }) {
                    lock(&self.world.fences).refused += 1;
                }
                if matches!(e, ArbiterError::SessionExpired { .. }) {
                    return Next::End;
                }
                let timed_out = matches!(e, ArbiterError::WaitTimeout { .. });
                let held = matches!(e, ArbiterError::Held { .. });
                if (timed_out || (held && retrying)) && self.rng.chance(cfg.retry_percent) {
                    // Ask again for the same key on the same session: at
                    // once, or after a few milliseconds.
                    self.retry = Some(key);
                    if self.rng.chance(50) {
                        let pause = self.rng.below(20);
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                    return Next::Continue;
                }
                if !matches!(
                    e,
                    ArbiterError::Held { .. } | ArbiterError::WaitTimeout { .. }
                ) {
                    // Sealed, behind the shard map, or the session is gone:
                    // do not spin.
                    let pause = 50 + self.rng.below(200);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                } else if wait.is_none() {
                    // A try-lock that found the key held backs off a little.
                    let pause = self.rng.below(cfg.unit_ms.max(1));
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
                return Next::Continue;
            }
            Call::Answered(Err(e)) => {
                return self.unknown_acquire(op, &key, describe(&e), session, renewer);
            }
            Call::Killed => {
                let detail = format!("arbiter-{} died with the call in flight", arbiter.index);
                return self.unknown_acquire(op, &key, detail, session, renewer);
            }
            Call::Cancelled => {
                let detail = "cancelled by the client".to_string();
                return self.unknown_acquire(op, &key, detail, session, renewer);
            }
        };

        // Held. A crash here: renewals stop, the hold ends with the lease.
        if self.rng.chance(cfg.faults.crash_percent) {
            *renewer = None;
            let deadline = lock(session).deadline();
            self.world.invoke(
                &self.process,
                Function::Expire,
                Some(&key),
                Some(token),
                Some("crashed holding the key".into()),
                deadline,
            );
            return Next::End;
        }

        let can_start = Instant::now() < lock(session).deadline();
        let mut paused = false;
        if can_start {
            let longest = if self.rng.below(16) == 0 {
                cfg.unit_ms * 10
            } else {
                cfg.unit_ms
            };
            tokio::time::sleep(Duration::from_millis(self.rng.below(longest + 1))).await;
            if self.rng.chance(cfg.faults.pause_percent) {
                // Frozen inside the unit of work past its lease (the gate's
                // SIGSTOP): no renewals, then a write with a stale token.
                *renewer = None;
                paused = true;
                let pause = lock(session).ttl + Duration::from_millis(500 + self.rng.below(2500));
                tokio::time::sleep(pause).await;
            }
            let believed = (!paused && Instant::now() < lock(session).deadline())
                .then(|| (id, lock(session).opened));
            self.write(&key, token, believed).await;
            if !paused && self.rng.chance(cfg.long_hold_percent) {
                // A long hold, renewed all along (a leader's term): a write
                // every 1–3 s for one and a half TTLs, stopping at the fence
                // deadline as the client library's guard does.
                let until = Instant::now() + lock(session).ttl * 3 / 2;
                while Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(1000 + self.rng.below(2000))).await;
                    if Instant::now() >= lock(session).deadline() {
                        break;
                    }
                    let opened = lock(session).opened;
                    self.write(&key, token, Some((id, opened))).await;
                }
            }
        }
        // A downgrade of the exclusive hold (the shared presets): the hold
        // turns shared, named by its token, and is then read under and
        // released as a reader's.
        let mut token = token;
        if !paused
            && cfg.downgrade_percent > 0
            && !asked.shared
            && cfg.permits.is_none()
            && self.rng.chance(cfg.downgrade_percent)
        {
            match self.downgrade(asked, token, session).await {
                Some((reader, shared)) => {
                    (key, token) = (reader, shared);
                    let unit = self.rng.below(cfg.unit_ms + 1);
                    tokio::time::sleep(Duration::from_millis(unit)).await;
                }
                None => {
                    *renewer = None;
                    return Next::End;
                }
            }
        }
        let think = self.rng.below(cfg.unit_ms / 3 + 1);
        tokio::time::sleep(Duration::from_millis(think)).await;

        let ended = self.release(&key, id, token, session).await;
        if ended || paused {
            *renewer = None;
            return Next::End;
        }
        let think = self.rng.below(cfg.unit_ms / 3 + 1);
        tokio::time::sleep(Duration::from_millis(think)).await;
        Next::Continue
    }

    /// Holds a grant from memory for a unit of work (no fenced write: token
    /// 0 fences nothing), then releases it through the arbiter that granted
    /// it (the edge routes a key to its arbiter), or any, if that one died.
    async fn hold_from_memory(&mut self, granter: &Arbiter, key: &str, id: i64, invoked: Instant) {
        let held = {
            let in_log = self.world.held_in_log(key);
            let ms = self.world.ms(Instant::now());
            lock(&self.world.memory).granted(
                granter.index,
                key,
                id,
                &self.process,
                invoked,
                Duration::from_secs(u64::from(self.world.cfg.ttl_seconds)),
                in_log,
                ms,
            )
        };
        let unit = self.rng.below(self.world.cfg.unit_ms + 1);
        tokio::time::sleep(Duration::from_millis(unit)).await;
        let arbiter = match self.world.arbiter(granter.index) {
            Some(a) => a,
            None => match self.world.route(key, true, self.rng) {
                Some(a) => a,
                None => return,
            },
        };
        lock(&self.world.memory).releasing(held, Instant::now());
        let Some(service) = arbiter.service.clone() else {
            return;
        };
        let released = service.release(request(
            &self.identity,
            None,
            ReleaseRequest {
                key: key.to_string(),
                session_id: id,
                token: 0,
                slot: None,
                mode: 0,
            },
        ));
        tokio::select! {
            biased;
            () = arbiter.killed.cancelled() => {}
            _ = released => {}
        }
    }

    /// Records an unknown acquire and the expire that bounds whatever it may
    /// have granted: at the session's fence deadline, read after the
    /// renewals stopped, so nothing moves it afterwards.
    fn unknown_acquire(
        &mut self,
        op: super::world::OpId,
        key: &str,
        detail: String,
        session: &Arc<Mutex<Session>>,
        renewer: &mut Option<Renewer>,
    ) -> Next {
        self.world
            .complete(op, Outcome::Unknown, None, None, Some(detail));
        *renewer = None;
        let deadline = lock(session).deadline();
        self.world.invoke(
            &self.process,
            Function::Expire,
            Some(key),
            None,
            None,
            deadline,
        );
        Next::End
    }

    /// A write through the fenced resource, taking a little time each way.
    /// With the whole arbiter, a write before the fence deadline (every
    /// write the worker makes) is judged against the log's leases: the
    /// session's must still be there, and its shadow's on the key's shard.
    async fn write(&mut self, key: &str, token: u64, believed: Option<(i64, Instant)>) {
        // `believed`: the session and when it was opened, if the worker
        // writes believing it alive. A restore since then may have taken a
        // lease that was there (the store's leases go back with it).
        let restored_since = |opened: Instant| {
            lock(&self.world.liveness)
                .last_restore
                .is_some_and(|r| r >= opened)
        };
        // A key on another shard is held on the session's shadow there,
        // whose lease no restore of the lock cluster takes back: judged
        // unless the session itself went with a restore (its shadows are
        // then ended as the session's are).
        let log = self
            .world
            .idlog_of_hold(key, token, believed.map(|(id, _)| id));
        let coord = self
            .world
            .coord
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(log, &c.idlog));
        let on_shadow = !Arc::ptr_eq(log, &self.world.idlog) && !coord;
        // A coord session's hold is on its lease in the coord tier's log,
        // which no restore of the lock cluster touches: always judged.
        let judged = |id: i64, opened: Instant| match (coord, on_shadow) {
            (true, _) => true,
            (false, true) => !restored_since(opened) || self.world.idlog.lease_alive(id),
            (false, false) => !restored_since(opened),
        };
        if self.world.cfg.whole_arbiter
            && let Some((id, opened)) = believed
            && judged(id, opened)
            && !log.lease_alive(id)
        {
            let ms = self.world.ms(Instant::now());
            lock(&self.world.memory).deadline_outlived_lease(&self.process, id, key, ms);
        }
        let op = self.world.invoke(
            &self.process,
            Function::Write,
            Some(key),
            Some(token),
            None,
            Instant::now(),
        );
        tokio::time::sleep(Duration::from_micros(self.rng.below(3000))).await;
        let seq = lock(&self.world.resource).write(key, token);
        tokio::time::sleep(Duration::from_micros(self.rng.below(3000))).await;
        match seq {
            Some(seq) => self.world.complete(op, Outcome::Ok, None, Some(seq), None),
            None => self.world.complete(op, Outcome::Fail, None, None, None),
        }
    }

    /// Downgrades the exclusive hold `asked` was granted (token `token`) as
    /// the clients do, naming the hold by its token. The history records it
    /// as the exclusive hold's release and the reader key's grant (each
    /// judged as a lock of its own; the log itself is checked after every
    /// commit never to hold the key exclusively beside a reader). The
    /// reader key and its token, or `None` when the incarnation ends: the
    /// downgrade was refused (NOT_HELD: the hold had ended) or its outcome
    /// is unknown, and an `expire` was recorded.
    async fn downgrade(
        &mut self,
        asked: GrantRequest,
        token: u64,
        session: &Arc<Mutex<Session>>,
    ) -> Option<(String, u64)> {
        let key = asked.key.clone();
        let deadline = lock(session).deadline();
        let stray = self.stray();
        let arbiter = loop {
            if let Some(a) = self.world.route(&key, stray, self.rng) {
                break a;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let op = self.world.invoke(
            &self.process,
            Function::Release,
            Some(&key),
            Some(token),
            Some("downgrade".into()),
            Instant::now(),
        );
        let (outcome, detail) = match downgrade(&arbiter, asked, token).await {
            Call::Answered(Ok(grant)) => match grant.token() {
                Some(shared) if grant.key != key => {
                    self.world.complete(op, Outcome::Ok, None, None, None);
                    let got = self.world.invoke(
                        &self.process,
                        Function::Acquire,
                        Some(&grant.key),
                        None,
                        Some("downgrade".into()),
                        Instant::now(),
                    );
                    lock(&self.world.fences).granted(arbiter.index, &grant);
                    self.world
                        .complete(got, Outcome::Ok, Some(shared), None, None);
                    return Some((grant.key, shared));
                }
                _ => (
                    Outcome::Unknown,
                    format!("a downgrade granted other than a reader key: {grant:?}"),
                ),
            },
            Call::Answered(Err(e)) if is_definite_refusal(&e) => (Outcome::Fail, describe(&e)),
            Call::Answered(Err(e)) => (Outcome::Unknown, describe(&e)),
            Call::Killed | Call::Cancelled => (
                Outcome::Unknown,
                format!("arbiter-{} died with the call in flight", arbiter.index),
            ),
        };
        self.world.complete(op, outcome, None, None, Some(detail));
        // As a release that did not succeed: the exclusive hold may linger
        // until its lease ends (a shared hold the downgrade made, unknown
        // to the history, ends with it too, and the reader key is this
        // session's alone).
        let from = deadline.min(Instant::now());
        self.world.invoke(
            &self.process,
            Function::Expire,
            Some(&key),
            Some(token),
            None,
            from,
        );
        None
    }

    /// Releases the hold; whether the incarnation must end (the release did
    /// not succeed, and an `expire` was recorded).
    async fn release(
        &mut self,
        key: &str,
        id: i64,
        token: u64,
        session: &Arc<Mutex<Session>>,
    ) -> bool {
        // The deadline as it stands before the call (the gate's worker reads
        // `guard.fence_deadline()` there too).
        let deadline = lock(session).deadline();
        let stray = self.stray();
        let arbiter = loop {
            if let Some(a) = self.world.route(key, stray, self.rng) {
                break a;
            }
            // No arbiter up: a client retries the connection before it sends.
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let op = self.world.invoke(
            &self.process,
            Function::Release,
            Some(key),
            Some(token),
            None,
            Instant::now(),
        );
        let table = arbiter.table.clone();
        let service = arbiter.service.clone();
        let call = async {
            match service {
                // The Release handler.
                Some(service) => service
                    .release(request(
                        &self.identity,
                        None,
                        // A shared hold: the lock's name, in mode SHARED.
                        ReleaseRequest {
                            key: latchkey_arbiter::records::named_key(key).to_string(),
                            session_id: id,
                            token,
                            slot: None,
                            mode: i32::from(latchkey_arbiter::records::split_reader(key).is_some()),
                        },
                    ))
                    .await
                    .map(|_| ()),
                None => table
                    .release(&self.identity, key, id, token)
                    .await
                    .map(|_| ()),
            }
        };
        let answer = tokio::select! {
            biased;
            () = arbiter.killed.cancelled() => Call::Killed,
            r = call => Call::Answered(r),
        };
        let (outcome, detail) = match answer {
            Call::Answered(Ok(_)) => {
                self.world.complete(op, Outcome::Ok, None, None, None);
                return false;
            }
            Call::Answered(Err(e)) if is_definite_refusal(&e) => (Outcome::Fail, describe(&e)),
            Call::Answered(Err(e)) => (Outcome::Unknown, describe(&e)),
            Call::Killed | Call::Cancelled => (
                Outcome::Unknown,
                format!("arbiter-{} died with the call in flight", arbiter.index),
            ),
        };
        self.world.complete(op, outcome, None, None, Some(detail));
        // The hold may linger until the lease ends, no earlier than the
        // fence deadline; a refused release says it is gone already.
        let from = deadline.min(Instant::now());
        self.world.invoke(
            &self.process,
            Function::Expire,
            Some(key),
            Some(token),
            None,
            from,
        );
        true
    }
}

enum Next {
    Continue,
    End,
}
