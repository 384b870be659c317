//! Leader elections (`latchkey.election.v1`): the [`Leadership`] guard, the
//! [`Client::lead`] loop, and what observers see.
//!
//! A campaign runs on a session of the election's class, like a hold: one
//! lease per TTL per client, renewed by the session's keepalive task. Only
//! the session's end and an observed change of the election can end a
//! leadership without this process asking, so each leadership has both
//! watching it: the session's fence (its deadline, its expiry, its close)
//! and an Observe stream of the election that reports a later term or a
//! vacancy. Whichever comes first cancels the leadership's token, once.

mod campaign;
mod events;
mod lead;
mod watch;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use latchkey_proto::electionv1::{
    CandidatesRequest, LeaderRequest, ProclaimRequest, ResignRequest, TransferRequest,
    transfer_request,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use events::{Candidate, ElectionEvent, ElectionEvents, Leader, VacancyReason};

use crate::client::Client;
use crate::error::Error;
use crate::session::{FenceReason, Lead, Session, SessionInner, Stepdown};
use crate::token::FencingToken;

/// How a campaign stands; see [`Client::campaign`].
///
/// ```
/// use std::time::Duration;
///
/// use latchkey_client::CampaignOptions;
///
/// let options = CampaignOptions {
///     priority: 10, // leads before priority 0 on a vacancy
///     wait: Some(Duration::from_secs(30)),
///     ..CampaignOptions::default()
/// };
/// # let _ = options;
/// ```
#[derive(Debug, Clone, Default)]
pub struct CampaignOptions {
    /// Higher leads first on a vacancy; first come first served within a
    /// priority. 0 by default.
    pub priority: u32,
    /// How long the call waits to lead (its gRPC deadline). `None`: as long
    /// as the arbiter lets a call wait (its maximum wait, 5 minutes by
    /// default), then `DEADLINE_EXCEEDED: WAIT_TIMEOUT`.
    pub wait: Option<Duration>,
    /// Campaign on this session rather than on the client's session for
    /// the class's TTL.
    pub session: Option<Session>,
}

/// Whom [`Leadership::transfer`] hands the leadership to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferTo {
    /// A standing candidate, by its [`Candidate::id`].
    Candidate(u64),
    /// The candidate that would lead next: the highest priority, then the
    /// first to stand.
    Preferred,
    /// The preferred candidate, only if its priority is above this
    /// leadership's (`NO_CANDIDATE` otherwise): what
    /// [`Leadership::yield_if_requested`] asks for.
    HigherPriority,
}

/// Why a leadership ended without this process resigning it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeadershipLost {
    /// The session it runs on died: its fence deadline passed without a
    /// successful keepalive, the arbiter expired it, or it was closed.
    Fenced(FenceReason),
    /// An Observe of the election reported a later term: someone else leads.
    Replaced {
        /// The term that started.
        term: u64,
    },
    /// An Observe of the election reported it vacant after this term
    /// started (the session ended at the arbiter, operators forced it out,
    /// an epoch advance).
    Vacated(VacancyReason),
    /// The arbiter refused a call on it with `NOT_LEADER`.
    NotLeader,
    /// This process handed it over with [`Leadership::transfer`].
    Transferred,
    /// This process resigned it ([`Leadership::resign`] or dropping the
    /// last guard).
    Resigned,
}

impl fmt::Display for LeadershipLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeadershipLost::Fenced(reason) => write!(f, "its session was lost: {reason}"),
            LeadershipLost::Replaced { term } => {
                write!(f, "term {term} started: another candidate leads")
            }
            LeadershipLost::Vacated(reason) => write!(f, "the election became vacant: {reason}"),
            LeadershipLost::NotLeader => {
                f.write_str("the arbiter answered that it is not the current leadership")
            }
            LeadershipLost::Transferred => f.write_str("it was transferred"),
            LeadershipLost::Resigned => f.write_str("it was resigned"),
        }
    }
}

/// Leading an election: what [`Client::campaign`] returns. Dropping the
/// last guard of a leadership resigns it (from a task, if a Tokio runtime
/// is running), as dropping a [`LockGuard`](crate::LockGuard) releases.
///
/// The leadership can end without this process asking: its session dies
/// (the fence deadline, ADR-12: the last successful keepalive's send time
/// plus the TTL minus one second), or an Observe of the election shows a
/// later term or a vacancy. Then [`Leadership::lost`] resolves and every
/// [`Leadership::cancellation_token`] is cancelled, once; stop acting as
/// the leader. Hand [`Leadership::token`] to the resources the leader
/// writes to, so that a leader that learns of its loss late is refused
/// there.
///
/// Campaigning again for an election this client's session leads returns
/// another guard of the same leadership (no call to the arbiter); the last
/// guard resigns.
///
/// ```no_run
/// use latchkey_client::CampaignOptions;
///
/// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
/// let leadership = client
///     .campaign("jobs/scheduler", "election", "pod-a:8080", CampaignOptions::default())
///     .await?;
/// let stop = leadership.cancellation_token();
/// tokio::select! {
///     () = stop.cancelled() => eprintln!("lost: {:?}", leadership.lost_reason()),
///     () = async { /* lead, writing with leadership.token().get() */ } => {}
/// }
/// leadership.resign().await.ok();
/// # Ok(())
/// # }
/// ```
#[must_use = "dropping the guard resigns the leadership"]
pub struct Leadership {
    lead: Arc<Lead>,
    session: Arc<SessionInner>,
    armed: bool,
}

impl Leadership {
    pub(crate) fn new(lead: Arc<Lead>, session: Arc<SessionInner>) -> Self {
        Self {
            lead,
            session,
            armed: true,
        }
    }

    /// The election led.
    pub fn election(&self) -> &str {
        &self.lead.election
    }

    /// The term: one above the election's last leadership, and higher
    /// after an epoch advance (`epoch * 2^32 + count`). Observers see it
    /// too; it says nothing of the token.
    pub fn term(&self) -> u64 {
        self.lead.term
    }

    /// The fencing token to present at the resources the leader writes to:
    /// larger than every token granted on the election's cluster before.
    pub fn token(&self) -> FencingToken {
        self.lead.token
    }

    /// The value observers see: the campaign's, or the last proclaimed.
    pub fn value(&self) -> String {
        self.lead.value()
    }

    /// The session the leadership runs on.
    pub fn session_id(&self) -> i64 {
        self.lead.session_id
    }

    /// How many guards share this leadership.
    pub fn guard_count(&self) -> u32 {
        self.lead.count()
    }

    /// Whether to start a new unit of work as the leader: the leadership is
    /// not lost and the session's last keepalive succeeded (ADR-12 stage one).
    pub fn can_start(&self) -> bool {
        self.lead.lost_reason().is_none() && self.session.core.can_start()
    }

    /// When the leadership is lost unless a keepalive succeeds first: the
    /// session's fence deadline. Moves forward with every renewal.
    pub fn fence_deadline(&self) -> Instant {
        self.session.core.deadline()
    }

    /// Time left before the fence deadline.
    pub fn remaining_ttl(&self) -> Duration {
        match self.lead.lost_reason() {
            Some(_) => Duration::ZERO,
            None => self.session.core.remaining_ttl(),
        }
    }

    /// Whether the leadership ended.
    pub fn is_lost(&self) -> bool {
        self.lead.lost_reason().is_some()
    }

    /// Why the leadership ended, `None` while it lasts.
    pub fn lost_reason(&self) -> Option<LeadershipLost> {
        self.lead.lost_reason()
    }

    /// Resolves when the leadership ends, with why. Owns what it needs, so
    /// it can be moved into a task or a `select!` beside the guard.
    pub fn lost(&self) -> impl Future<Output = LeadershipLost> + Send + 'static {
        let lead = Arc::clone(&self.lead);
        async move {
            lead.cancel_token().cancelled().await;
            lead.lost_reason().unwrap_or(LeadershipLost::Resigned)
        }
    }

    /// A token cancelled when the leadership ends (at the latest at the
    /// session's fence deadline): hand it to the tasks that act as the
    /// leader. Cancelling it yourself ends nothing.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.lead.cancel_token().child_token()
    }

    fn lost_error(&self, reason: LeadershipLost) -> Error {
        Error::LeadershipLost {
            election: self.lead.election.clone(),
            reason,
        }
    }

    /// Whether the election's class asked this leadership to yield: a
    /// candidate of a higher priority stands (`yieldToHigherPriority`;
    /// learned from the leadership's Observe stream).
    pub fn transfer_requested(&self) -> bool {
        self.lead.transfer_requested()
    }

    /// Resolves once [`Leadership::transfer_requested`] is true (at once if
    /// it is), e.g. to `select!` against a unit of work.
    pub async fn transfer_request(&self) {
        self.lead.transfer_requested_wait().await;
    }

    /// The safe point of a leadership whose class asks it to yield: when a
    /// transfer was requested, hands the leadership to the preferred
    /// candidate (the highest priority) and returns the new leader (this
    /// guard is then lost, [`LeadershipLost::Transferred`]); otherwise does
    /// nothing and returns `Ok(None)`. Call it between units of work.
    ///
    /// ```no_run
    /// # async fn run(leadership: latchkey_client::Leadership) -> Result<(), latchkey_client::Error> {
    /// loop {
    ///     // ... one unit of work, fenced by leadership.token() ...
    ///     if leadership.yield_if_requested().await?.is_some() {
    ///         break; // a higher-priority replica leads now
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn yield_if_requested(&self) -> Result<Option<Leader>, Error> {
        if !self.transfer_requested() {
            return Ok(None);
        }
        match self.transfer(TransferTo::HigherPriority).await {
            Ok(next) => Ok(Some(next)),
            // The candidate that asked left, and none above this
            // leadership's priority stands: it leads on.
            Err(e) if e.reason() == crate::Reason::NoCandidate => {
                self.lead.clear_transfer();
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Replaces the value observers see. Refused (`NOT_LEADER`) once the
    /// leadership ended; the guard then counts as lost.
    pub async fn proclaim(&self, value: impl Into<String>) -> Result<(), Error> {
        if let Some(reason) = self.lead.lost_reason() {
            return Err(self.lost_error(reason));
        }
        let value = value.into();
        let rpc = &self.session.rpc;
        let sent = rpc
            .election()
            .proclaim(rpc.unary(ProclaimRequest {
                election: self.lead.election.clone(),
                session_id: self.lead.session_id,
                token: self.lead.token.get(),
                value: value.clone(),
            }))
            .await;
        match sent {
            Ok(_) => {
                self.lead.set_value(value);
                Ok(())
            }
            Err(status) => Err(self.refused(status)),
        }
    }

    /// A refusal of a call on this leadership; `NOT_LEADER` ends it here too.
    fn refused(&self, status: tonic::Status) -> Error {
        let err = Error::from(status);
        if err.reason() == crate::Reason::NotLeader {
            self.lead.lose(LeadershipLost::NotLeader);
            self.session.core.leadership_ended(&self.lead);
        }
        err
    }

    /// Ends the leadership: the next candidate leads in the same
    /// transaction, or the election is vacant. The next leader, if any.
    ///
    /// With other guards of the same leadership alive this only counts
    /// this one down (`Ok(None)`, nothing sent). Fails with
    /// [`Error::LeadershipLost`] if the leadership had already ended.
    /// The cancellation tokens fire before Resign is sent.
    pub async fn resign(mut self) -> Result<Option<Leader>, Error> {
        self.armed = false;
        let core = &self.session.core;
        match core.step_down(&self.lead) {
            Stepdown::Remaining(_) => Ok(None),
            Stepdown::NotCurrent => match self.lead.lost_reason() {
                Some(reason) => Err(self.lost_error(reason)),
                None => Ok(None),
            },
            Stepdown::Last => {
                let _settle = SettleResign {
                    session: &self.session,
                    election: &self.lead.election,
                };
                self.lead.lose(LeadershipLost::Resigned);
                send_resign(&self.session, &self.lead).await
            }
        }
    }

    /// Hands the leadership to a standing candidate in one transaction and
    /// returns the new leader. Every guard of the leadership is then lost
    /// ([`LeadershipLost::Transferred`], or [`LeadershipLost::Replaced`]
    /// when its observer saw the next term before the answer came).
    /// Refused with `NO_CANDIDATE` when no such candidate stands; the
    /// leadership then goes on.
    pub async fn transfer(&self, to: TransferTo) -> Result<Leader, Error> {
        if let Some(reason) = self.lead.lost_reason() {
            return Err(self.lost_error(reason));
        }
        let rpc = &self.session.rpc;
        let sent = rpc
            .election()
            .transfer(rpc.unary(TransferRequest {
                election: self.lead.election.clone(),
                session_id: self.lead.session_id,
                token: self.lead.token.get(),
                to: Some(match to {
                    TransferTo::Candidate(id) => transfer_request::To::CandidateId(id),
                    TransferTo::Preferred => transfer_request::To::Preferred(true),
                    TransferTo::HigherPriority => transfer_request::To::HigherPriority(true),
                }),
            }))
            .await;
        let next = match sent {
            Ok(reply) => reply.into_inner().next,
            Err(status) => return Err(self.refused(status)),
        };
        self.lead.lose(LeadershipLost::Transferred);
        self.session.core.leadership_ended(&self.lead);
        tracing::debug!(election = %self.lead.election, term = self.lead.term, "transferred");
        next.map(Leader::from).ok_or(Error::Protocol {
            rpc: "Transfer",
            problem: "OK without the next leader",
        })
    }
}

async fn send_resign(session: &SessionInner, lead: &Lead) -> Result<Option<Leader>, Error> {
    let rpc = &session.rpc;
    let next = rpc
        .election()
        .resign(rpc.unary(ResignRequest {
            election: lead.election.clone(),
            session_id: lead.session_id,
            token: lead.token.get(),
        }))
        .await?
        .into_inner()
        .next;
    tracing::debug!(election = %lead.election, term = lead.term, "resigned");
    Ok(next.map(Leader::from))
}

/// Settles a final resignation in the table even if its future is dropped.
struct SettleResign<'a> {
    session: &'a SessionInner,
    election: &'a str,
}

impl Drop for SettleResign<'_> {
    fn drop(&mut self) {
        self.session.core.resigned(self.election);
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let core = &self.session.core;
        if core.step_down(&self.lead) != Stepdown::Last {
            return;
        }
        self.lead.lose(LeadershipLost::Resigned);
        let runtime = tokio::runtime::Handle::try_current();
        match (core.fenced(), runtime) {
            (None, Ok(runtime)) => {
                let session = Arc::clone(&self.session);
                let lead = Arc::clone(&self.lead);
                runtime.spawn(async move {
                    let _settle = SettleResign {
                        session: &session,
                        election: &lead.election,
                    };
                    if let Err(err) = send_resign(&session, &lead).await {
                        tracing::warn!(
                            election = %lead.election,
                            term = lead.term,
                            error = %err,
                            "resign on drop failed; the leadership ends with the session"
                        );
                    }
                });
            }
            // Fenced: nothing to resign. No runtime: the keepalive cannot
            // run either, so the leadership ends with the session's TTL.
            _ => core.resigned(&self.lead.election),
        }
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("election", &self.lead.election)
            .field("term", &self.lead.term)
            .field("token", &self.lead.token)
            .field("session_id", &self.lead.session_id)
            .field("value", &self.lead.value())
            .field("lost", &self.lead.lost_reason())
            .finish()
    }
}

impl fmt::Display for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "leadership of {} (term {}, token {})",
            latchkey_proto::text::Shown(&self.lead.election),
            self.lead.term,
            self.lead.token
        )
    }
}

impl Client {
    /// Stands for `election` under the election class `class` (which sets
    /// the session's TTL and who may stand) with `value` for observers, and
    /// waits to lead (see [`CampaignOptions::wait`]). A session of this
    /// client that leads the election already gets another guard of its
    /// leadership. A call that ends without leading leaves the candidates:
    /// the arbiter withdraws it, also when the future is dropped before its
    /// answer (the cancelled call's candidacy is withdrawn by the arbiter).
    /// A call dropped in the instant its leadership committed leaves the
    /// session leading without a guard: campaigning again on the session
    /// returns that leadership (as [`Client::lead`] does).
    ///
    /// Errors: `DEADLINE_EXCEEDED: WAIT_TIMEOUT` when the wait ran out,
    /// `INVALID_ARGUMENT: WRONG_KIND` for a lock class,
    /// `PERMISSION_DENIED: NOT_AUTHORISED` without a grant on the name.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// use latchkey_client::{CampaignOptions, Reason};
    ///
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let options = CampaignOptions { wait: Some(Duration::from_secs(10)), ..Default::default() };
    /// match client.campaign("jobs/scheduler", "election", "pod-a", options).await {
    ///     Ok(leadership) => println!("leading term {}", leadership.term()),
    ///     Err(err) if err.reason() == Reason::WaitTimeout => println!("someone else leads"),
    ///     Err(err) => return Err(err),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn campaign(
        &self,
        election: impl Into<String>,
        class: impl Into<String>,
        value: impl Into<String>,
        options: CampaignOptions,
    ) -> Result<Leadership, Error> {
        campaign::campaign(
            self,
            &election.into(),
            &class.into(),
            &value.into(),
            &options,
        )
        .await
    }

    /// Leads `election` for as long as the returned future is polled: it
    /// campaigns, runs `body` with the [`Leadership`] while this process
    /// leads, and when the leadership is lost (the session's fence
    /// deadline, its expiry, another term or a vacancy seen by an Observe)
    /// it drops `body`'s future at once and campaigns again, by itself,
    /// with the same value and options. That is the library's guarantee
    /// after losing: the process goes back to standing, never to acting.
    ///
    /// It returns `body`'s output when `body` finishes (the guard it was
    /// given resigns when dropped, unless `body` moved it elsewhere), or
    /// the first error a campaign cannot recover from by retrying
    /// (`NOT_AUTHORISED`, `WRONG_KIND`, a bad value; a dead
    /// [`CampaignOptions::session`]). A wait that runs out is campaigned
    /// again at once; temporary failures (the network, the store, a
    /// session that died) are retried with backoff. To stop, drop the
    /// future (e.g. `select!` against a shutdown signal): `body` is
    /// dropped, and so its guard, which resigns.
    ///
    /// ```no_run
    /// use latchkey_client::CampaignOptions;
    ///
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let shutdown = tokio::signal::ctrl_c();
    /// tokio::select! {
    ///     led = client.lead("jobs/scheduler", "election", "pod-a", CampaignOptions::default(),
    ///         |leadership| async move {
    ///             loop {
    ///                 // ... one round of scheduling, fenced by leadership.token() ...
    ///                 tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    /// #               let _ = &leadership;
    ///             }
    ///         }) => led?,
    ///     _ = shutdown => {} // the body is dropped and its leadership resigned
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lead<F, Fut, T>(
        &self,
        election: impl Into<String>,
        class: impl Into<String>,
        value: impl Into<String>,
        options: CampaignOptions,
        body: F,
    ) -> Result<T, Error>
    where
        F: FnMut(Leadership) -> Fut,
        Fut: Future<Output = T>,
    {
        lead::lead(
            self,
            election.into(),
            class.into(),
            value.into(),
            options,
            body,
        )
        .await
    }

    /// Every term start, proclamation and vacancy of `election`, in order:
    /// from the current state on (`from_term` 0: the first event describes
    /// it), or from `from_term`'s start as far as the arbiter can replay it
    /// (what it cannot is one [`ElectionEvent::Gap`] first). Needs a grant
    /// on the name, not a campaign. Never shows a token or a session.
    ///
    /// ```no_run
    /// use latchkey_client::ElectionEvent;
    ///
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let mut events = client.observe("jobs/scheduler", 0).await?;
    /// while let Some(event) = events.next_event().await {
    ///     match event? {
    ///         ElectionEvent::TermStarted { leader } => println!("{} leads", leader.identity),
    ///         other => println!("{other:?}"),
    ///     }
    /// }
    /// // The arbiter ended the stream: observe again from events.last_term().
    /// # Ok(())
    /// # }
    /// ```
    pub async fn observe(&self, election: &str, from_term: u64) -> Result<ElectionEvents, Error> {
        let rpc = self.rpc();
        let stream = rpc
            .election()
            .observe(rpc.stream(latchkey_proto::electionv1::ObserveRequest {
                election: election.to_owned(),
                from_term,
                transfer_requests: true,
            }))
            .await?
            .into_inner();
        Ok(ElectionEvents::new(election.to_owned(), stream, from_term))
    }

    /// The current leader of `election`, `None` while it is vacant.
    ///
    /// ```no_run
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// match client.leader("jobs/scheduler").await? {
    ///     Some(leader) => println!("{} leads term {}: {}", leader.identity, leader.term, leader.value),
    ///     None => println!("vacant"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        let rpc = self.rpc();
        Ok(rpc
            .election()
            .leader(rpc.unary(LeaderRequest {
                election: election.to_owned(),
            }))
            .await?
            .into_inner()
            .leader
            .map(Leader::from))
    }

    /// The candidates of `election` in the order they would lead: priority
    /// (highest first), then first come.
    pub async fn candidates(&self, election: &str) -> Result<Vec<Candidate>, Error> {
        let rpc = self.rpc();
        Ok(rpc
            .election()
            .candidates(rpc.unary(CandidatesRequest {
                election: election.to_owned(),
            }))
            .await?
            .into_inner()
            .candidates
            .into_iter()
            .map(Candidate::from)
            .collect())
    }
}
