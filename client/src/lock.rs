//! Acquiring a key (ADR-13): the builder, and the guard that is the hold.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use latchkey_proto::lockv1::{AcquireRequest, Mode, Reason, ReleaseRequest, WaitMode};
use tokio::time::Instant;

use crate::client::Client;
use crate::error::Error;
use crate::session::{Begin, Decrement, FenceCallback, FenceReason, Hold, Session, SessionInner};
use crate::token::FencingToken;

/// A lock request, built by [`Client::lock`]; [`LockBuilder::acquire`]
/// sends it.
///
/// ```no_run
/// use std::time::Duration;
///
/// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
/// let guard = client
///     .lock("deploy/payments", "ticketed")
///     .metadata("ticket", "CHG-12345") // read by the class's hooks
///     .wait(Duration::from_secs(60))
///     .acquire(|reason| eprintln!("lost deploy/payments: {reason}"))
///     .await?;
/// # let _ = guard;
/// # Ok(())
/// # }
/// ```
#[must_use = "a lock is only requested by .acquire(on_fence)"]
pub struct LockBuilder {
    client: Client,
    key: String,
    class: String,
    wait: Option<Duration>,
    metadata: HashMap<String, String>,
    session: Option<Session>,
    shared: bool,
}

impl LockBuilder {
    pub(crate) fn new(client: Client, key: String, class: String) -> Self {
        Self {
            client,
            key,
            class,
            wait: None,
            metadata: HashMap::new(),
            session: None,
            shared: false,
        }
    }

    /// Queue for up to `wait` instead of failing at once with HELD. The wait
    /// is the call's gRPC deadline.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Asks for a shared hold: many sessions hold the key shared at once,
    /// never beside an exclusive holder. A waiting exclusive request keeps
    /// later shared ones behind it. The token is above every earlier
    /// exclusive grant of the key: fence reads with "no writer since my
    /// token" (docs/fencing.md). A session holding the key in the other
    /// mode is refused (`UPGRADE_REFUSED` for an exclusive request of a key
    /// held shared); to turn a held exclusive lock shared, use
    /// [`LockGuard::downgrade`].
    pub fn shared(mut self) -> Self {
        self.shared = true;
        self
    }

    /// Metadata for the class's hooks (a change ticket, say).
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Attach the hold to this session rather than to the client's session
    /// for the class's TTL.
    pub fn session(mut self, session: &Session) -> Self {
        self.session = Some(session.clone());
        self
    }

    /// Acquires the key. `on_fence` is called once if the hold is lost while
    /// this guard exists (the session's deadline passed or it expired); by
    /// then other holders may already have the key, so stop touching the
    /// resource. It runs on the keepalive task: keep it short.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicBool, Ordering};
    ///
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let lost = Arc::new(AtomicBool::new(false));
    /// let flag = Arc::clone(&lost);
    /// let guard = client
    ///     .lock("jobs/nightly", "jobs")
    ///     .acquire(move |_| flag.store(true, Ordering::SeqCst))
    ///     .await?;
    /// while !lost.load(Ordering::SeqCst) && guard.can_start() {
    ///     // ... one unit of work ...
    /// #   break;
    /// }
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn acquire<F>(self, on_fence: F) -> Result<LockGuard, Error>
    where
        F: Fn(FenceReason) + Send + Sync + 'static,
    {
        let on_fence: FenceCallback = Arc::new(on_fence);
        let explicit = self.session.is_some();
        let mut session = match &self.session {
            Some(session) => Arc::clone(&session.inner),
            None => self.client.session_for_class(&self.class).await?.inner,
        };
        let mut retried = false;
        loop {
            match self.acquire_on(&session, &on_fence).await {
                Err(err) if !explicit && !retried && stale_session(&err) => {
                    // The class's session went away or its TTL changed since
                    // we cached it: open (or be handed) the right one once.
                    if err.reason() == Reason::SessionExpired {
                        session.core.fence(FenceReason::Expired);
                    }
                    self.client.forget_class(&self.class, session.core.id);
                    session = self.client.session_for_class(&self.class).await?.inner;
                    retried = true;
                }
                result => return result,
            }
        }
    }

    async fn acquire_on(
        &self,
        session: &Arc<SessionInner>,
        on_fence: &FenceCallback,
    ) -> Result<LockGuard, Error> {
        let core = &session.core;
        loop {
            match core.begin_acquire(&self.key, on_fence)? {
                (Begin::Reentered(hold), Some(guard_id)) => {
                    let guard = LockGuard::new(hold, Arc::clone(session), guard_id);
                    if guard.hold.shared != self.shared {
                        // Held in the other mode by this session: one hold
                        // per key and session, so no re-entry in another.
                        let held = if guard.hold.shared {
                            "shared"
                        } else {
                            "exclusively"
                        };
                        drop(guard);
                        return Err(Error::Refused {
                            code: tonic::Code::FailedPrecondition,
                            reason: if self.shared {
                                Reason::BadRequest
                            } else {
                                Reason::UpgradeRefused
                            },
                            message: format!(
                                "this session holds {:?} {held} already: release it before acquiring it in the other mode{}",
                                self.key,
                                if self.shared {
                                    " (or downgrade its guard: LockGuard::downgrade)"
                                } else {
                                    ""
                                }
                            ),
                            wire_reason: String::new(),
                            source: None,
                        });
                    }
                    return Ok(guard);
                }
                (Begin::Wait(settled), _) => settled.await,
                (Begin::Outermost, _) => break,
                (Begin::Reentered(_), None) => {
                    return Err(Error::Protocol {
                        rpc: "Acquire",
                        problem: "nested acquire without a guard id",
                    });
                }
            }
        }

        // From here the key is Acquiring in the table; whatever happens to
        // this future, the entry must be settled.
        let mut pending = PendingAcquire {
            session,
            key: &self.key,
            settled: false,
        };
        let rpc = &session.rpc;
        let message = AcquireRequest {
            key: self.key.clone(),
            class: self.class.clone(),
            session_id: core.id,
            wait: match self.wait {
                Some(_) => WaitMode::WaitUntilDeadline,
                None => WaitMode::WaitNone,
            } as i32,
            metadata: self.metadata.clone(),
            instance: rpc.instance.clone(),
            mode: if self.shared {
                Mode::Shared
            } else {
                Mode::Exclusive
            } as i32,
            downgrade_from: None,
        };
        // One ask waits at most `wait_ask` (below the edge's route timeout
        // and the arbiter's maximum wait); a longer wait asks again on the
        // same session until its deadline. A grant that landed as an ask
        // ended is answered to the next ask, never as a second hold.
        // A wait too long to add to now (`Duration::MAX`) has no end.
        let deadline = self.wait.map(|w| Instant::now().checked_add(w));
        let grant = loop {
            let started = Instant::now();
            let mut request = rpc.unary(message.clone());
            if let Some(deadline) = deadline {
                let left = deadline.map_or(rpc.wait_ask, |d| d.saturating_duration_since(started));
                request.set_timeout(left.min(rpc.wait_ask).max(Duration::from_millis(1)));
            }
            match rpc.lock().acquire(request).await {
                Ok(reply) => break reply.into_inner().grant,
                Err(status) => {
                    // A wait that ended (the arbiter's WAIT_TIMEOUT, the edge's
                    // route timeout, or tonic's own deadline, which it says as
                    // CANCELLED) with more than a moment left asks again.
                    let ended = matches!(
                        status.code(),
                        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
                    );
                    let left = match deadline {
                        None => Duration::ZERO,
                        Some(None) => Duration::MAX,
                        Some(Some(d)) => d.saturating_duration_since(Instant::now()),
                    };
                    if !ended || left <= ASK_AGAIN_ABOVE {
                        return Err(status.into());
                    }
                    tracing::debug!(key = %self.key, "no grant within one ask; asking again");
                    // At most one ask a second, however soon an ask ends.
                    let pause = ASK_AT_MOST_EVERY
                        .saturating_sub(started.elapsed())
                        .min(left - ASK_AGAIN_ABOVE);
                    tokio::time::sleep(pause).await;
                }
            }
        };
        let hold = Arc::new(granted_hold(
            grant,
            core.id,
            &self.key,
            &self.class,
            &self.metadata,
        )?);
        pending.settled = true;
        let guard_id = core.granted(Arc::clone(&hold), on_fence)?;
        tracing::debug!(key = %self.key, session_id = core.id, epoch = hold.epoch, "acquired");
        Ok(LockGuard::new(hold, Arc::clone(session), guard_id))
    }
}

/// A wait that ended with no more than this left is over.
const ASK_AGAIN_ABOVE: Duration = Duration::from_millis(100);
/// Asks of one wait start at least this far apart.
const ASK_AT_MOST_EVERY: Duration = Duration::from_secs(1);

pub(crate) fn stale_session(err: &Error) -> bool {
    matches!(
        err.reason(),
        Reason::SessionExpired | Reason::SessionClassMismatch
    )
}

struct PendingAcquire<'a> {
    session: &'a SessionInner,
    key: &'a str,
    settled: bool,
}

impl Drop for PendingAcquire<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.session.core.acquire_failed(self.key);
        }
    }
}

/// A hold on a key. Nested acquires of the same key on the same session
/// return more guards of the same hold; the arbiter hears only of the first
/// acquire and the last release.
///
/// Dropping a guard counts it down like [`LockGuard::release`]; the final
/// Release is then sent from a task if a Tokio runtime is running.
///
/// ```no_run
/// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
/// let outer = client.lock("jobs/a", "jobs").acquire(|_| {}).await?;
/// // Re-entrant: the same hold, no second Acquire at the arbiter.
/// let inner = client.lock("jobs/a", "jobs").acquire(|_| {}).await?;
/// assert_eq!(inner.token(), outer.token());
/// assert_eq!(outer.hold_count(), 2);
/// inner.release().await?; // counts down
/// outer.release().await?; // sends Release
/// # Ok(())
/// # }
/// ```
#[must_use = "dropping the guard releases the lock"]
pub struct LockGuard {
    hold: Arc<Hold>,
    session: Arc<SessionInner>,
    guard_id: u64,
    armed: bool,
}

impl LockGuard {
    fn new(hold: Arc<Hold>, session: Arc<SessionInner>, guard_id: u64) -> Self {
        Self {
            hold,
            session,
            guard_id,
            armed: true,
        }
    }

    /// The fencing token to present at the resource.
    ///
    /// ```no_run
    /// # async fn run(guard: latchkey_client::LockGuard) {
    /// // e.g. `UPDATE ... WHERE $token >= high_water` at the resource.
    /// let token: u64 = guard.token().get();
    /// # let _ = token;
    /// # }
    /// ```
    pub fn token(&self) -> FencingToken {
        self.hold.token
    }

    /// The arbiter's epoch at the grant (the token's high 16 bits).
    pub fn epoch(&self) -> u32 {
        self.hold.epoch
    }

    /// The store revision of the grant.
    pub fn revision(&self) -> i64 {
        self.hold.revision
    }

    /// The key held.
    pub fn key(&self) -> &str {
        &self.hold.key
    }

    /// The slot held, for a semaphore class's grant (`0..permits`; the
    /// token is that slot's, so fence a resource partitioned by slot per
    /// slot); `None` for a lock.
    pub fn slot(&self) -> Option<u32> {
        self.hold.slot
    }

    /// A semaphore's permits (its class's `permits`: slots are
    /// `0..permits`), as the grant said; `None` for a lock, or from an
    /// arbiter too old to say.
    pub fn permits(&self) -> Option<u32> {
        self.hold.permits
    }

    /// Whether the hold is shared ([`LockBuilder::shared`], or after
    /// [`LockGuard::downgrade`]).
    pub fn is_shared(&self) -> bool {
        self.hold.shared
    }

    /// The session the hold is attached to.
    pub fn session_id(&self) -> i64 {
        self.hold.session_id
    }

    /// How many guards share this hold.
    pub fn hold_count(&self) -> u32 {
        self.hold.count()
    }

    /// Whether to start a new unit of work under this lock (ADR-12 stage one).
    pub fn can_start(&self) -> bool {
        self.session.core.can_start()
    }

    /// Time left before the hold is fenced unless a keepalive succeeds.
    pub fn remaining_ttl(&self) -> Duration {
        self.session.core.remaining_ttl()
    }

    /// When `on_fence` fires unless a keepalive succeeds first: the send
    /// time of the last successful renewal plus the TTL minus one second
    /// (ADR-12). Moves forward with every renewal.
    pub fn fence_deadline(&self) -> Instant {
        self.session.core.deadline()
    }

    /// Whether this hold is lost: its session was fenced, or the arbiter
    /// said the hold ended ([`FenceReason::HoldEnded`]).
    pub fn is_fenced(&self) -> bool {
        self.hold.has_ended() || self.session.core.fenced().is_some()
    }

    /// Turns this exclusive hold into a shared one, atomically at the
    /// arbiter: one transaction ends the exclusive hold and grants the
    /// shared one, so no writer comes between (docs/fencing.md). Readers
    /// queued behind the writer are let in at once; a writer still waits
    /// until this shared hold ends. The guard then holds the key shared:
    /// [`LockGuard::token`] is the shared grant's, a new token above the
    /// exclusive one, and [`LockGuard::is_shared`] is true. Release it as
    /// any guard; `on_fence` stays the same. The class's `maxHoldSeconds`
    /// still counts from the exclusive grant.
    ///
    /// It is an Acquire of the key in mode SHARED on the same session that
    /// names the exclusive hold's token (`downgrade_from`), with the class
    /// and metadata of the acquire that was granted, so the class's hooks
    /// are asked again (as a shared request). It never waits, and the
    /// arbiter never answers it with a fresh shared hold: unless the
    /// session still holds the key exclusively at that token, it is
    /// refused `NOT_HELD`.
    ///
    /// Refused, with the guard left as it was:
    /// - [`Error::Fenced`]: the hold is already lost (its session fenced,
    ///   or the arbiter said it ended);
    /// - `FAILED_PRECONDITION` / `BAD_REQUEST`, without a call: the hold is
    ///   shared already, a semaphore's slot, a grant from memory (token 0),
    ///   or has other guards (nested acquires, each expecting the exclusive
    ///   hold);
    /// - by the arbiter, before it writes anything: a class with a quota
    ///   (`maxHoldsPerSubject`) takes no downgrade (`BAD_REQUEST`), a hook
    ///   may deny the shared request, a policy refusal. Any other error is
    ///   taken as an unknown outcome (below).
    ///
    /// Refused `NOT_HELD` (`FAILED_PRECONDITION`): the exclusive hold had
    /// ended at the arbiter (expiry, `maxHoldSeconds`, force-release, an
    /// epoch advance) before its notice reached this client. A writer may
    /// have held the key since: the guard is fenced (`on_fence` fires with
    /// [`FenceReason::HoldEnded`]) and holds nothing.
    ///
    /// When the answer is lost (an error of unknown outcome,
    /// [`Error::is_transient`]), the downgrade may have landed: it is sent
    /// again, a few times, and a repeat is answered with the shared hold
    /// that downgrade made (or `NOT_HELD`). If no attempt settles it, or
    /// this future is dropped while a call is out, the guard is fenced
    /// ([`FenceReason::HoldEnded`]) and the error returned, and a task
    /// cleans up while the session lives: it releases the exclusive hold,
    /// or — if that is gone — asks the downgrade again and releases the
    /// shared hold it is answered with. Either way the guard never holds a
    /// hold this client has not heard of, and nothing is left held.
    ///
    /// ```no_run
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let mut guard = client.lock("config/app", "demo").acquire(|_| {}).await?;
    /// let writer: u64 = guard.token().get();
    /// // ... write the new config, fenced with `writer` ...
    /// guard.downgrade().await?;
    /// assert!(guard.is_shared() && guard.token().get() > writer);
    /// // ... read it back beside other readers, no writer in between ...
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn downgrade(&mut self) -> Result<(), Error> {
        let core = &self.session.core;
        let refuse = |why: &str| Error::Refused {
            code: tonic::Code::FailedPrecondition,
            reason: Reason::BadRequest,
            message: format!("{:?} cannot be downgraded: {why}", self.hold.key),
            wire_reason: String::new(),
            source: None,
        };
        if let Some(reason) = core.fenced() {
            return Err(core.dead_error(reason));
        }
        if self.hold.has_ended() {
            return Err(core.dead_error(FenceReason::HoldEnded));
        }
        if self.hold.shared {
            return Err(refuse(
                "it is held shared already (a downgrade turns an exclusive hold into a shared one)",
            ));
        }
        if self.hold.slot.is_some() {
            return Err(refuse("it is a semaphore's slot, which has no shared mode"));
        }
        if self.hold.token.get() == 0 {
            return Err(refuse(
                "it was granted from memory during a quorum loss (unprotected, token 0), and shared holds are made in the lock log only",
            ));
        }
        core.begin_downgrade(&self.hold)?;
        // From here the key is Downgrading in the table; whatever happens
        // to this future, the entry must be settled.
        let mut pending = PendingDowngrade {
            session: &self.session,
            hold: &self.hold,
            state: Outcome::Unknown,
        };
        let mut last = None;
        for attempt in 0..DOWNGRADE_TRIES {
            if attempt > 0 {
                tokio::time::sleep(DOWNGRADE_RETRY * attempt).await;
            }
            match send_downgrade(&self.session, &self.hold).await {
                Ok(shared) => {
                    pending.state = Outcome::Settled;
                    drop(pending);
                    let replaced = core.downgraded(Arc::clone(&shared));
                    self.hold = shared;
                    tracing::debug!(key = %self.hold.key, session_id = core.id, epoch = self.hold.epoch, "downgraded");
                    return replaced;
                }
                // The exclusive hold is gone at the arbiter and no shared
                // hold of this downgrade exists: a writer may have come
                // between. Fenced, never restored.
                Err(e) if e.reason() == Reason::NotHeld => {
                    pending.state = Outcome::Ended;
                    return Err(e);
                }
                // Refused before anything was written — as long as no
                // earlier attempt may have landed (then only a grant or
                // NOT_HELD settles it).
                Err(e) if last.is_none() && refused_before_writing(&e) => {
                    pending.state = Outcome::Refused;
                    return Err(e);
                }
                Err(e) if e.is_transient() => last = Some(e),
                // Anything else may follow a commit (an answer this client
                // cannot read, an error after the write): unknown.
                Err(e) => {
                    last = Some(e);
                    break;
                }
            }
        }
        // Still unknown: `pending` fences the guard and cleans up.
        Err(last.unwrap_or(Error::Protocol {
            rpc: "Acquire",
            problem: "a downgrade with no attempt",
        }))
    }

    /// Counts this guard down; the last one sends Release. Fails with
    /// [`Error::Fenced`] if the hold was already lost.
    pub async fn release(mut self) -> Result<(), Error> {
        self.armed = false;
        let core = &self.session.core;
        match core.release_one(&self.hold, self.guard_id) {
            // The arbiter said the hold ended: nothing to release, and the
            // caller hears that it was lost, as from a fenced session.
            Decrement::NotHeld if self.hold.has_ended() => Err(Error::Fenced {
                session_id: core.id,
                reason: FenceReason::HoldEnded,
            }),
            Decrement::Remaining(_) | Decrement::NotHeld => Ok(()),
            Decrement::Last => {
                let _settle = SettleRelease {
                    session: &self.session,
                    key: &self.hold.key,
                };
                if let Some(reason) = core.fenced() {
                    return Err(Error::Fenced {
                        session_id: core.id,
                        reason,
                    });
                }
                send_release(&self.session, &self.hold).await
            }
        }
    }

    /// Forgets this guard without sending Release: the hold stays until
    /// the session ends (its TTL, once this process stops renewing).
    ///
    /// ```no_run
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let guard = client.lock("jobs/a", "jobs").acquire(|_| {}).await?;
    /// // Another process releases it later with Client::release_grant.
    /// println!("session {} token {}", guard.session_id(), guard.token().get());
    /// guard.detach();
    /// # Ok(())
    /// # }
    /// ```
    pub fn detach(mut self) {
        self.armed = false;
        if self.session.core.release_one(&self.hold, self.guard_id) == Decrement::Last {
            self.session.core.released(&self.hold.key);
        }
    }
}

async fn send_release(session: &SessionInner, hold: &Hold) -> Result<(), Error> {
    let rpc = &session.rpc;
    rpc.lock()
        .release(rpc.unary(ReleaseRequest {
            key: hold.key.clone(),
            session_id: hold.session_id,
            token: hold.token.get(),
            slot: hold.slot,
            mode: if hold.shared {
                Mode::Shared
            } else {
                Mode::Exclusive
            } as i32,
        }))
        .await?;
    tracing::debug!(key = %hold.key, session_id = hold.session_id, "released");
    Ok(())
}

/// How often a downgrade is sent while its outcome is unknown, and the
/// pause before each repeat (times the attempt).
const DOWNGRADE_TRIES: u32 = 4;
const DOWNGRADE_RETRY: Duration = Duration::from_millis(200);
/// The background clean-up of a downgrade left unknown: the pause after a
/// failed try, doubling up to the longest.
const CLEANUP_FIRST_PAUSE: Duration = Duration::from_millis(500);
const CLEANUP_LONGEST_PAUSE: Duration = Duration::from_secs(10);

/// A refusal the arbiter (or the edge in front of it) makes before it
/// writes anything: a downgrade so refused did not happen, and the
/// exclusive hold stays. Any other error may follow a commit.
fn refused_before_writing(e: &Error) -> bool {
    !e.is_transient()
        && matches!(
            e.reason(),
            Reason::BadRequest
                | Reason::BadKey
                | Reason::UnknownClass
                | Reason::NotAuthorised
                | Reason::Unauthenticated
                | Reason::SessionClassMismatch
                | Reason::HookDenied
                | Reason::IdentityLimit
                | Reason::Held
                | Reason::PolicyNotReady
                | Reason::PolicyStale
                | Reason::WrongTier
                | Reason::WrongKind
                | Reason::QuotaExceeded
                | Reason::KindInUse
                | Reason::UpgradeRefused
        )
}

/// Sends the downgrade of `hold` (exclusive) and checks the answer: the
/// shared hold that replaces it.
async fn send_downgrade(session: &SessionInner, hold: &Hold) -> Result<Arc<Hold>, Error> {
    let rpc = &session.rpc;
    let grant = rpc
        .lock()
        .acquire(rpc.unary(AcquireRequest {
            key: hold.key.clone(),
            class: hold.class.clone(),
            session_id: session.core.id,
            wait: WaitMode::WaitNone as i32,
            metadata: hold.metadata.clone(),
            instance: rpc.instance.clone(),
            mode: Mode::Shared as i32,
            downgrade_from: Some(hold.token.get()),
        }))
        .await?
        .into_inner()
        .grant;
    let shared = granted_hold(
        grant,
        session.core.id,
        &hold.key,
        &hold.class,
        &hold.metadata,
    )?;
    if !shared.shared || shared.slot.is_some() {
        return Err(Error::Protocol {
            rpc: "Acquire",
            problem: "a downgrade granted other than shared",
        });
    }
    Ok(Arc::new(shared))
}

/// The hold an Acquire's answer grants, checked: a grant, for `session_id`
/// and `key`; with the class and metadata asked (a downgrade asks them
/// again).
fn granted_hold(
    grant: Option<latchkey_proto::lockv1::Grant>,
    session_id: i64,
    key: &str,
    class: &str,
    metadata: &HashMap<String, String>,
) -> Result<Hold, Error> {
    let grant = grant.ok_or(Error::Protocol {
        rpc: "Acquire",
        problem: "OK without a grant",
    })?;
    if grant.session_id != session_id || grant.key != key {
        return Err(Error::Protocol {
            rpc: "Acquire",
            problem: "grant for another session or key",
        });
    }
    let mut hold = Hold::new(
        grant.key,
        grant.session_id,
        FencingToken::new(grant.token),
        grant.epoch,
        grant.revision,
    );
    hold.slot = grant.slot;
    hold.permits = grant.permits.filter(|_| grant.slot.is_some());
    hold.shared = grant.mode == Mode::Shared as i32;
    hold.class = class.to_string();
    hold.metadata = metadata.clone();
    Ok(hold)
}

/// What is known of a downgrade as its future ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Granted: the table has the shared hold already.
    Settled,
    /// Refused with nothing written: the exclusive hold stays.
    Refused,
    /// The exclusive hold is gone (NOT_HELD): fenced.
    Ended,
    /// It may have landed (answers lost, or the future dropped mid-call).
    Unknown,
}

/// Settles a downgrade in the table however its future ends: refused, the
/// exclusive hold is the key's again; ended, it is fenced; unknown, it is
/// fenced too and the downgrade is asked again in the background until it
/// is answered, a shared hold it made released (so the session never keeps
/// a hold its client has not heard of).
struct PendingDowngrade<'a> {
    session: &'a Arc<SessionInner>,
    hold: &'a Arc<Hold>,
    state: Outcome,
}

impl Drop for PendingDowngrade<'_> {
    fn drop(&mut self) {
        let core = &self.session.core;
        match self.state {
            Outcome::Settled => {}
            Outcome::Refused => core.downgrade_failed(&self.hold.key),
            Outcome::Ended => core.downgrade_lost(&self.hold.key, false),
            Outcome::Unknown => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    core.downgrade_lost(&self.hold.key, true);
                    // Weak: a clean-up keeps no session alive (dropped with
                    // its client, the session's lease ends, and its holds).
                    let session = Arc::downgrade(self.session);
                    let hold = Arc::clone(self.hold);
                    runtime.spawn(async move {
                        clean_up_downgrade(&session, &hold).await;
                        if let Some(session) = session.upgrade() {
                            session.core.downgrade_cleaned(&hold.key);
                        }
                    });
                }
                // No runtime: no keepalive either; the session ends with
                // its TTL, and any hold with it.
                Err(_) => core.downgrade_lost(&self.hold.key, false),
            },
        }
    }
}

/// Ends whatever a downgrade of unknown outcome left, while the session
/// lives (its guard is fenced): first a release of the exclusive hold —
/// answered, the downgrade never landed and the hold is gone; refused
/// NOT_HELD (or TOKEN_MISMATCH), the exclusive hold is gone, so the
/// downgrade is asked again, which answers the shared hold it made (then
/// released) or NOT_HELD (nothing left; the arbiter says so before any
/// hook). An error of unknown outcome is tried again, backing off; any
/// other refusal ends the clean-up (a hold it could not end ends with the
/// session). It holds the session weakly: a dropped client's session is
/// not kept alive by it.
async fn clean_up_downgrade(session: &std::sync::Weak<SessionInner>, hold: &Hold) {
    let mut pause = CLEANUP_FIRST_PAUSE;
    let mut exclusive_gone = false;
    loop {
        let Some(session) = session.upgrade() else {
            return;
        };
        if session.core.fenced().is_some() || Instant::now() >= session.core.deadline() {
            // The session is over (or going): its holds end with its lease.
            return;
        }
        let step = if exclusive_gone {
            match send_downgrade(&session, hold).await {
                Ok(shared) => send_release(&session, &shared).await.map(|()| true),
                Err(e) if e.reason() == Reason::NotHeld => Ok(true),
                Err(e) => Err(e),
            }
        } else {
            match send_release(&session, hold).await {
                Ok(()) => Ok(true),
                Err(e) if matches!(e.reason(), Reason::NotHeld | Reason::TokenMismatch) => {
                    exclusive_gone = true;
                    Ok(false)
                }
                Err(e) => Err(e),
            }
        };
        drop(session);
        match step {
            Ok(true) => return,
            Ok(false) => continue,
            Err(err) if !err.is_transient() => {
                tracing::warn!(key = %hold.key, session_id = hold.session_id, error = %err, "a downgrade of unknown outcome could not be cleaned up; what it left ends with the session");
                return;
            }
            Err(err) => {
                tracing::debug!(key = %hold.key, session_id = hold.session_id, error = %err, "cleaning up a downgrade of unknown outcome; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(CLEANUP_LONGEST_PAUSE);
            }
        }
    }
}

/// Settles a final release in the table even if its future is dropped.
struct SettleRelease<'a> {
    session: &'a SessionInner,
    key: &'a str,
}

impl Drop for SettleRelease<'_> {
    fn drop(&mut self) {
        self.session.core.released(self.key);
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let core = &self.session.core;
        if core.release_one(&self.hold, self.guard_id) != Decrement::Last {
            return;
        }
        let runtime = tokio::runtime::Handle::try_current();
        match (core.fenced(), runtime) {
            (None, Ok(runtime)) => {
                let session = Arc::clone(&self.session);
                let hold = Arc::clone(&self.hold);
                runtime.spawn(async move {
                    let _settle = SettleRelease {
                        session: &session,
                        key: &hold.key,
                    };
                    if let Err(err) = send_release(&session, &hold).await {
                        tracing::warn!(
                            key = %hold.key,
                            session_id = hold.session_id,
                            error = %err,
                            "release on drop failed; the hold ends with the session"
                        );
                    }
                });
            }
            // Fenced: nothing to release. No runtime: the session's
            // keepalive cannot run either, so the hold ends with its TTL.
            _ => core.released(&self.hold.key),
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.hold.key)
            .field("token", &self.hold.token)
            .field("epoch", &self.hold.epoch)
            // Not the revision: with the epoch it spells the token.
            .field("session_id", &self.hold.session_id)
            .field("hold_count", &self.hold.count())
            .finish()
    }
}
