//! Sessions (ADR-10): one arbiter lease per TTL per client, renewed by one
//! keepalive stream, with every hold of that TTL attached to it. The
//! session is also where ADR-12's two stages live: `can_start()` turns false
//! at the first failed keepalive, and at the send-time deadline every hold's
//! `on_fence` fires, once.

mod holds;
mod keepalive;
mod leaderships;
mod liveness;

use std::collections::HashMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use latchkey_proto::lockv1::CloseSessionRequest;
use parking_lot::{Mutex, MutexGuard};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use holds::Holds;
pub(crate) use holds::{Begin, Decrement, Hold, NoDowngrade};
use leaderships::Leaderships;
pub(crate) use leaderships::{BeginCampaign, Lead, Stepdown};
use liveness::Liveness;

use crate::error::Error;
use crate::rpc::Rpc;

/// Why the holds of a session were lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceReason {
    /// No keepalive succeeded before the local deadline (last successful
    /// send + TTL − 1 s). The arbiter may not have expired the lease yet,
    /// but it will before anything this holder could still do is safe.
    DeadlineExceeded,
    /// The arbiter answered that the session no longer exists.
    Expired,
    /// [`Session::close`] was called while holds were attached.
    Closed,
    /// The arbiter told us this hold ended (an operator's force-release,
    /// the session's expiry or revocation, an epoch advance) before its
    /// deadline: only this hold is fenced, the session goes on.
    HoldEnded,
}

impl fmt::Display for FenceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FenceReason::DeadlineExceeded => "no keepalive succeeded before the fence deadline",
            FenceReason::Expired => "the arbiter expired the session",
            FenceReason::Closed => "the session was closed",
            FenceReason::HoldEnded => {
                "the arbiter reported that the hold ended (force-released, expired or an epoch advance)"
            }
        })
    }
}

pub(crate) type FenceCallback = Arc<dyn Fn(FenceReason) + Send + Sync + 'static>;

/// The state the keepalive task and the guards share.
pub(crate) struct SessionCore {
    pub(crate) id: i64,
    pub(crate) ttl: Duration,
    pub(crate) keepalive_interval: Duration,
    state: Mutex<CoreState>,
}

struct CoreState {
    liveness: Liveness,
    holds: Holds,
    leaderships: Leaderships,
    /// Per guard: the key it holds (`None` for a leadership, which only
    /// the session's end fences) and its callback.
    on_fence: HashMap<u64, (Option<String>, FenceCallback)>,
    next_guard: u64,
}

impl SessionCore {
    fn new(id: i64, ttl: Duration, keepalive_interval: Duration, opened_at: Instant) -> Self {
        Self {
            id,
            ttl,
            keepalive_interval,
            state: Mutex::new(CoreState {
                liveness: Liveness::new(opened_at, ttl),
                holds: Holds::default(),
                leaderships: Leaderships::default(),
                on_fence: HashMap::new(),
                next_guard: 0,
            }),
        }
    }

    /// Callbacks run outside this lock (parking_lot: no poisoning).
    fn state(&self) -> MutexGuard<'_, CoreState> {
        self.state.lock()
    }

    pub(crate) fn can_start(&self) -> bool {
        self.state().liveness.can_start(Instant::now())
    }

    pub(crate) fn remaining_ttl(&self) -> Duration {
        self.state().liveness.remaining(Instant::now())
    }

    pub(crate) fn fenced(&self) -> Option<FenceReason> {
        self.state().liveness.dead()
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.state().liveness.deadline()
    }

    pub(crate) fn renewed(&self, sent_at: Instant, remaining: Duration) {
        self.state().liveness.renewed(sent_at, remaining);
    }

    pub(crate) fn keepalive_failed(&self) {
        let mut state = self.state();
        if state.liveness.dead().is_none() {
            state.liveness.failed();
            tracing::debug!(
                session_id = self.id,
                "keepalive failed; not starting new work"
            );
        }
    }

    /// Marks the session dead and calls every registered `on_fence` once.
    pub(crate) fn fence(&self, reason: FenceReason) {
        let callbacks = {
            let mut state = self.state();
            if !state.liveness.fence(reason) {
                return;
            }
            std::mem::take(&mut state.on_fence)
                .into_values()
                .map(|(_, callback)| callback)
                .collect::<Vec<_>>()
        };
        tracing::warn!(
            session_id = self.id,
            holds = callbacks.len(),
            %reason,
            "session fenced"
        );
        for callback in callbacks {
            // One panicking callback must not keep the others from firing.
            if catch_unwind(AssertUnwindSafe(|| callback(reason))).is_err() {
                tracing::error!(session_id = self.id, "an on_fence callback panicked");
            }
        }
    }

    /// The arbiter says the hold of `key` granted at `revision` ended. If
    /// that is the hold we have (not one we are releasing, nor a later one
    /// of the key), it is fenced: its guards' `on_fence` fire, once, and it
    /// leaves the table so the key can be acquired again.
    pub(crate) fn hold_ended(&self, key: &str, revision: i64) {
        let callbacks = {
            let mut state = self.state();
            if !state.holds.ended(key, revision) {
                return;
            }
            state.take_callbacks(key)
        };
        self.fire_hold_ended(key, callbacks);
    }

    /// Starts a downgrade of `hold` (its only guard's): see
    /// [`holds::Holds::begin_downgrade`].
    pub(crate) fn begin_downgrade(&self, hold: &Arc<Hold>) -> Result<(), Error> {
        let mut state = self.state();
        if let Some(reason) = state.liveness.dead() {
            return Err(self.dead_error(reason));
        }
        state.holds.begin_downgrade(hold).map_err(|why| match why {
            NoDowngrade::NotHeld => self.dead_error(FenceReason::HoldEnded),
            NoDowngrade::Nested(guards) => Error::Refused {
                code: tonic::Code::FailedPrecondition,
                reason: latchkey_proto::lockv1::Reason::BadRequest,
                message: format!(
                    "{:?} has {guards} guards on this session (nested acquires, each expecting the exclusive hold): downgrade only with the last one",
                    hold.key
                ),
                wire_reason: String::new(),
                source: None,
            },
        })
    }

    /// The arbiter granted the downgrade: `shared` replaces the exclusive
    /// hold under the same guard. Fails (with the hold replaced all the
    /// same) if the session was fenced meanwhile, or the arbiter said
    /// already that the shared hold ended (its guard fenced now).
    pub(crate) fn downgraded(&self, shared: Arc<Hold>) -> Result<(), Error> {
        let key = shared.key.clone();
        let (dead, ended) = {
            let mut state = self.state();
            let ended = state
                .holds
                .downgraded(shared)
                .then(|| state.take_callbacks(&key));
            (state.liveness.dead(), ended)
        };
        if let Some(callbacks) = ended {
            self.fire_hold_ended(&key, callbacks);
            return Err(self.dead_error(FenceReason::HoldEnded));
        }
        match dead {
            Some(reason) => Err(self.dead_error(reason)),
            None => Ok(()),
        }
    }

    /// The downgrade of `key` was refused with nothing written: the
    /// exclusive hold stays, unless the arbiter said meanwhile that it
    /// ended; then it is fenced now, as [`SessionCore::hold_ended`] would
    /// have done.
    pub(crate) fn downgrade_failed(&self, key: &str) {
        let callbacks = {
            let mut state = self.state();
            if !state.holds.downgrade_failed(key) {
                return;
            }
            state.take_callbacks(key)
        };
        self.fire_hold_ended(key, callbacks);
    }

    /// The downgrade of `key` ended without a hold for its guard (NOT_HELD:
    /// the exclusive hold was gone), or with an outcome that stays unknown
    /// (`cleaning`): the guard is fenced now. While `cleaning`, the key
    /// stays in flight (other acquirers of it on this session wait) until
    /// [`SessionCore::downgrade_cleaned`].
    pub(crate) fn downgrade_lost(&self, key: &str, cleaning: bool) {
        let callbacks = {
            let mut state = self.state();
            if !state.holds.downgrade_lost(key, cleaning) {
                return;
            }
            state.take_callbacks(key)
        };
        self.fire_hold_ended(key, callbacks);
    }

    /// The clean-up of a downgrade of unknown outcome is over: the key is
    /// free for this session's acquirers again.
    pub(crate) fn downgrade_cleaned(&self, key: &str) {
        self.state().holds.downgrade_cleaned(key);
    }

    fn fire_hold_ended(&self, key: &str, callbacks: Vec<FenceCallback>) {
        tracing::warn!(
            session_id = self.id,
            %key,
            guards = callbacks.len(),
            "hold ended at the arbiter; fenced"
        );
        for callback in callbacks {
            if catch_unwind(AssertUnwindSafe(|| callback(FenceReason::HoldEnded))).is_err() {
                tracing::error!(session_id = self.id, "an on_fence callback panicked");
            }
        }
    }

    pub(crate) fn dead_error(&self, reason: FenceReason) -> Error {
        Error::Fenced {
            session_id: self.id,
            reason,
        }
    }

    /// Starts an acquire of `key`; a nested one registers its callback here.
    pub(crate) fn begin_acquire(
        &self,
        key: &str,
        on_fence: &FenceCallback,
    ) -> Result<(Begin, Option<u64>), Error> {
        let mut state = self.state();
        if let Some(reason) = state.liveness.dead() {
            return Err(self.dead_error(reason));
        }
        let begin = state.holds.begin(key);
        let guard_id = match begin {
            Begin::Reentered(_) => Some(state.register(key, on_fence)),
            Begin::Wait(_) | Begin::Outermost => None,
        };
        Ok((begin, guard_id))
    }

    /// The arbiter granted the outermost acquire.
    pub(crate) fn granted(&self, hold: Arc<Hold>, on_fence: &FenceCallback) -> Result<u64, Error> {
        let mut state = self.state();
        if let Some(reason) = state.liveness.dead() {
            state.holds.failed(&hold.key);
            return Err(self.dead_error(reason));
        }
        let key = hold.key.clone();
        state.holds.granted(hold);
        Ok(state.register(&key, on_fence))
    }

    pub(crate) fn acquire_failed(&self, key: &str) {
        self.state().holds.failed(key);
    }

    /// A guard is done: drop its callback and count it down.
    pub(crate) fn release_one(&self, hold: &Arc<Hold>, guard_id: u64) -> Decrement {
        let mut state = self.state();
        state.on_fence.remove(&guard_id);
        state.holds.decrement(hold)
    }

    pub(crate) fn released(&self, key: &str) {
        self.state().holds.released(key);
    }

    /// Starts a campaign of `election` on this session.
    pub(crate) fn begin_campaign(&self, election: &str) -> Result<BeginCampaign, Error> {
        let mut state = self.state();
        if let Some(reason) = state.liveness.dead() {
            return Err(self.dead_error(reason));
        }
        Ok(state.leaderships.begin(election))
    }

    /// The arbiter answered the outermost campaign with a leadership: it
    /// joins the table, and the session's end fences it through
    /// `on_fence`.
    pub(crate) fn led(&self, lead: Arc<Lead>, on_fence: &FenceCallback) -> Result<(), Error> {
        let mut state = self.state();
        if let Some(reason) = state.liveness.dead() {
            state.leaderships.failed(&lead.election);
            return Err(self.dead_error(reason));
        }
        let id = state.next_guard;
        state.next_guard += 1;
        state.on_fence.insert(id, (None, Arc::clone(on_fence)));
        lead.set_fence_id(id);
        state.leaderships.led(lead);
        Ok(())
    }

    pub(crate) fn campaign_failed(&self, election: &str) {
        self.state().leaderships.failed(election);
    }

    /// A guard of `lead` is done; the last one also stops the session's
    /// fence from calling it.
    pub(crate) fn step_down(&self, lead: &Arc<Lead>) -> Stepdown {
        let mut state = self.state();
        let step = state.leaderships.step_down(lead);
        if !matches!(step, Stepdown::Remaining(_))
            && let Some(id) = lead.take_fence_id()
        {
            state.on_fence.remove(&id);
        }
        step
    }

    /// `lead` ended other than by its last guard (a transfer, a loss seen
    /// by its observer): it leaves the table and the fence list.
    pub(crate) fn leadership_ended(&self, lead: &Arc<Lead>) {
        let mut state = self.state();
        state.leaderships.ended(lead);
        if let Some(id) = lead.take_fence_id() {
            state.on_fence.remove(&id);
        }
    }

    pub(crate) fn resigned(&self, election: &str) {
        self.state().leaderships.resigned(election);
    }
}

impl CoreState {
    fn register(&mut self, key: &str, on_fence: &FenceCallback) -> u64 {
        let id = self.next_guard;
        self.next_guard += 1;
        self.on_fence
            .insert(id, (Some(key.to_owned()), Arc::clone(on_fence)));
        id
    }

    /// The callbacks of `key`'s guards, taken out so that they fire once.
    fn take_callbacks(&mut self, key: &str) -> Vec<FenceCallback> {
        let guards: Vec<u64> = self
            .on_fence
            .iter()
            .filter(|(_, (k, _))| k.as_deref() == Some(key))
            .map(|(id, _)| *id)
            .collect();
        guards
            .into_iter()
            .filter_map(|id| self.on_fence.remove(&id))
            .map(|(_, callback)| callback)
            .collect()
    }
}

/// Owns the keepalive task: when the last handle (client map, `Session`,
/// guard) goes, renewal stops and the lease runs out at the arbiter.
pub(crate) struct SessionInner {
    pub(crate) core: Arc<SessionCore>,
    pub(crate) rpc: Rpc,
    keepalive: AbortHandle,
}

impl SessionInner {
    /// Spawns the keepalive task; needs a Tokio runtime.
    pub(crate) fn start(
        rpc: Rpc,
        id: i64,
        ttl: Duration,
        keepalive_interval: Duration,
        opened_at: Instant,
    ) -> Arc<Self> {
        let core = Arc::new(SessionCore::new(id, ttl, keepalive_interval, opened_at));
        let task = tokio::spawn(keepalive::run(Arc::clone(&core), rpc.clone()));
        Arc::new(Self {
            core,
            rpc,
            keepalive: task.abort_handle(),
        })
    }
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        self.keepalive.abort();
    }
}

/// A handle on one session: an arbiter lease with one TTL, renewed by this
/// client while it is open, that holds are attached to. Cheap to clone;
/// every clone is the same lease. See [`Client::open_session`](crate::Client::open_session).
#[derive(Clone)]
pub struct Session {
    pub(crate) inner: Arc<SessionInner>,
    reused: bool,
}

impl Session {
    pub(crate) fn new(inner: Arc<SessionInner>, reused: bool) -> Self {
        Self { inner, reused }
    }

    /// The arbiter's lease id.
    pub fn id(&self) -> i64 {
        self.inner.core.id
    }

    /// The lease's TTL (the class's).
    pub fn ttl(&self) -> Duration {
        self.inner.core.ttl
    }

    /// How often the keepalive task renews the lease.
    pub fn keepalive_interval(&self) -> Duration {
        self.inner.core.keepalive_interval
    }

    /// Whether the arbiter returned a session this client already had.
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// False from the first failed keepalive until the next successful one,
    /// and for good once the session is fenced. Check before each unit of work.
    pub fn can_start(&self) -> bool {
        self.inner.core.can_start()
    }

    /// Time until the fence deadline (zero once fenced).
    pub fn remaining_ttl(&self) -> Duration {
        self.inner.core.remaining_ttl()
    }

    /// When the session's holds are fenced unless a keepalive succeeds
    /// first: last successful send + TTL − 1 s (ADR-12).
    pub fn fence_deadline(&self) -> Instant {
        self.inner.core.deadline()
    }

    /// Whether the session is dead: every hold on it is lost.
    pub fn is_fenced(&self) -> bool {
        self.inner.core.fenced().is_some()
    }

    /// Why the session is dead, `None` while it lives.
    pub fn fence_reason(&self) -> Option<FenceReason> {
        self.inner.core.fenced()
    }

    /// Ends the session at the arbiter, which releases every hold on it.
    /// Holds still attached get `on_fence(Closed)`; renewal stops even if
    /// the call fails, so the lease then runs out with its TTL.
    pub async fn close(self) -> Result<(), Error> {
        let core = &self.inner.core;
        if let Some(reason) = core.fenced() {
            return match reason {
                FenceReason::Closed => Ok(()),
                other => Err(core.dead_error(other)),
            };
        }
        core.fence(FenceReason::Closed);
        self.inner.keepalive.abort();
        let rpc = &self.inner.rpc;
        rpc.lock()
            .close_session(rpc.unary(CloseSessionRequest {
                session_id: core.id,
            }))
            .await?;
        Ok(())
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id())
            .field("ttl", &self.ttl())
            .field("reused", &self.reused)
            .field("fenced", &self.fence_reason())
            .finish()
    }
}
