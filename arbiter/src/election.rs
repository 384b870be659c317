//! Leader elections (latchkey.election.v1) on one lock cluster: who leads,
//! who stands, and how a term starts or ends. The owner of every election
//! of its cluster, beside the [`crate::owner::KeyOwner`] of its keys; the
//! handlers (`service/election.rs`) do identity, policy and bounds, then ask
//! it.
//!
//! The records (`latchkey_records::Layout::election`):
//! - the **leader record** `e/<name>//lead` on the leader's session lease:
//!   who leads, the epoch and count of its term, the value (a proclamation
//!   rewrites it);
//! - the **term record** `e/<name>//term`, on no lease: the election's
//!   leaderships in this epoch, and how the last term ended when a write
//!   ended it. Every transaction that starts or ends a term writes it and
//!   compares its mod revision, nothing else writes it, and only an epoch
//!   advance deletes it, so such a transaction sees every term start since
//!   its read, and while a leader leads, the record's mod revision is the
//!   leadership's (its token's revision);
//! - **candidate records** `e/<name>//c/<rank>/<lease>` on the candidates'
//!   session leases, in the order they lead: priority, then arrival.
//!
//! Safety is the leadership transaction's ([`LeadTxn`]) alone: one leader
//! record, started only over a vacancy or over the exact leadership it
//! ends, at a term record that has not moved. A term is therefore led by
//! one session, and a term's count is one above the last (the term is
//! `epoch * 2^32 + count`); the token (the commit's revision, in the epoch
//! the transaction compared) is above every earlier grant of the cluster.
//! A restore is caught by the table's seal like any grant, and an epoch
//! advance deletes every election's records, so terms go on from the new
//! epoch's range. Candidates only order who is tried next: a candidate's
//! own campaign call leads it, over a vacancy, when it is the first
//! candidate; a resignation or transfer hands over to a candidate in the
//! same transaction, and that candidate's call finds itself leading.

mod observe;
mod read;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use latchkey_records::token::pack;
use latchkey_records::{
    CandidateRecord, LeadRecord, SessionRecord, TermEnd, TermRecord, encode, now_unix_ms,
};
use parking_lot::Mutex;
use tokio::time::Instant;
use tracing::debug;

use crate::epoch::EpochState;
use crate::error::ArbiterError;
use crate::lock_log::{
    ForceEnded, ForceRecords, ForceTermTxn, LeadFrom, LeadTo, LeadTxn, ProclaimTxn, Queued,
};
use crate::table::LockTable;
use read::{Read, Standing};

pub use observe::{Observation, Observer, Vacancy};

/// How many candidate records one read returns: an election's candidates
/// are bounded by its class's `maxWaitersPerKey` (at most this).
pub const MAX_CANDIDATES: usize = latchkey_policies::MAX_ELECTION_CANDIDATES as usize;

/// How long a waiting candidate sleeps between reads when its watch says
/// nothing (a watch is only a hint).
const POLL: Duration = Duration::from_secs(2);

/// How long beyond its call's wait a candidate record first in line may stay
/// unchanged over a vacancy before a waiting candidate behind it removes it
/// (its call's arbiter died), as durable waiters do.
pub const STALE_AFTER: Duration = Duration::from_secs(5);

/// A leadership as the handlers answer it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leadership {
    pub election: String,
    pub term: u64,
    pub token: u64,
    pub session: i64,
    pub value: String,
}

/// The leader as observers see it: never a token or a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderView {
    pub identity: String,
    pub value: String,
    pub term: u64,
    pub since_unix_ms: i64,
    pub priority: u32,
}

impl LeaderView {
    fn of(record: &LeadRecord) -> Self {
        Self {
            identity: record.identity.clone(),
            value: record.value.clone(),
            term: record.term(),
            since_unix_ms: record.since_unix_ms,
            priority: record.priority,
        }
    }
}

/// A candidate as `Candidates` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateView {
    /// The record's create revision: names the candidacy in a transfer.
    pub id: u64,
    pub identity: String,
    pub value: String,
    pub priority: u32,
    pub since_unix_ms: i64,
}

/// A campaign, checked by the handler.
#[derive(Debug, Clone)]
pub struct Campaign {
    pub election: String,
    pub identity: String,
    pub session: i64,
    pub class: String,
    pub ttl_seconds: u32,
    pub value: String,
    pub priority: u32,
    pub instance: String,
    /// The grant subject when not the identity ([`LeadRecord::bound`]).
    pub bound: String,
    /// How long the call waits to lead.
    pub wait: Duration,
    /// How many leaderships the grant subject may have.
    pub max_leaderships: u32,
    /// How many elections' term records the grant subject may have made.
    pub max_elections: u32,
    /// How many candidates the election may have (its class's).
    pub max_candidates: u32,
    /// The class asks its leaders to yield to a higher-priority candidate.
    pub yields: bool,
}

impl Campaign {
    /// The grant subject the leadership counts against.
    fn subject(&self) -> &str {
        if self.bound.is_empty() {
            &self.identity
        } else {
            &self.bound
        }
    }
}

/// Names a leadership in Proclaim, Resign and Transfer: the caller's
/// identity and session and the token its Campaign returned.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub election: &'a str,
    pub identity: &'a str,
    pub session: i64,
    pub token: u64,
}

/// The leadership an approved force-release ends: the leader record's
/// lease and the term record's mod revision as the request read them.
#[derive(Debug, Clone, Copy)]
pub struct ForcedTerm<'a> {
    pub election: &'a str,
    pub session: i64,
    pub term_at: i64,
    /// The approval's records, written in the same transaction.
    pub records: &'a ForceRecords,
}

/// Whom a transfer hands the leadership to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferTo {
    /// The candidacy with this id ([`CandidateView::id`]).
    Candidate(u64),
    /// The first candidate in order.
    Preferred,
    /// The first candidate in order, only if its priority is above the
    /// leader's (yielding to a higher priority).
    HigherPriority,
}

/// A standing candidacy: withdrawn when its call ends without leading,
/// however it ends (a call the client cancelled is dropped mid-wait, so
/// the withdrawal runs on a task of its own).
///
/// A resignation or a transfer may hand the leadership to this candidate
/// in the moment its call ends: the withdrawal then finds its record gone.
/// An answered call reads again and answers the leadership; a cancelled
/// call, whose caller will never learn of it, resigns it, so the election
/// is not held by a leader nobody knows of until its session ends.
struct Candidacy {
    elections: Arc<Elections>,
    election: String,
    identity: String,
    session: i64,
    priority: u32,
    /// The record's last write as last read.
    modified: i64,
    /// The call answered (led, or withdrew the record itself).
    led: bool,
}

impl Drop for Candidacy {
    fn drop(&mut self) {
        if self.led {
            return;
        }
        let elections = self.elections.clone();
        let (election, identity, session, priority, modified) = (
            std::mem::take(&mut self.election),
            std::mem::take(&mut self.identity),
            self.session,
            self.priority,
            self.modified,
        );
        let running = elections.cleanups.clone();
        if running.fetch_add(1, std::sync::atomic::Ordering::AcqRel) >= MAX_CLEANUPS {
            running.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _running = CleanupSlot(running);
                // Best effort: a record left behind ends with its session,
                // or as a stale head.
                let log = elections.table.log().clone();
                if let Ok((false, _)) = elections
                    .table
                    .seal()
                    .checked(log.withdraw(&election, session, priority, modified))
                    .await
                {
                    elections
                        .resign_unknown(&election, &identity, session)
                        .await;
                }
            });
        }
    }
}

/// One of [`MAX_CLEANUPS`], given back when the clean-up ends.
struct CleanupSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for CleanupSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// The elections of one lock cluster.
pub struct Elections {
    table: Arc<LockTable>,
    /// Candidate records seen first in line over a vacancy: (election,
    /// session) → (last write, first seen), for [`STALE_AFTER`].
    heads: Mutex<HashMap<(String, i64), (i64, Instant)>>,
    /// Leaderships this arbiter answered lately: (election, session, term
    /// record revision) → when. A cancelled campaign's clean-up resigns a
    /// leadership handed to it only if no call was answered it meanwhile
    /// (a retry on the same session gets the leadership back).
    delivered: Mutex<HashMap<(String, i64, i64), Instant>>,
    /// Clean-ups of cancelled campaigns running now, at most
    /// [`MAX_CLEANUPS`].
    cleanups: Arc<std::sync::atomic::AtomicUsize>,
    observers: observe::Hubs,
}

/// How long [`Elections`] remembers answering a leadership.
const DELIVERED_FOR: Duration = Duration::from_secs(120);
/// Cancelled campaigns' clean-ups running at once, per cluster; beyond it a
/// record is left to end with its session, or as a stale head.
const MAX_CLEANUPS: usize = 1024;

impl Elections {
    pub fn new(table: Arc<LockTable>) -> Self {
        Self {
            observers: observe::Hubs::new(table.clone()),
            table,
            heads: Mutex::new(HashMap::new()),
            delivered: Mutex::new(HashMap::new()),
            cleanups: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        }
    }

    fn note_delivered(&self, election: &str, session: i64, revision: i64) {
        let now = Instant::now();
        let mut delivered = self.delivered.lock();
        // Pruned when it has doubled since the last pruning (amortised
        // O(1) per answer, never a scan on every one).
        if delivered.len() >= 1024 && delivered.len().is_power_of_two() {
            delivered.retain(|_, at| now.duration_since(*at) < DELIVERED_FOR);
        }
        delivered.insert((election.to_string(), session, revision), now);
    }

    fn was_delivered(&self, election: &str, session: i64, revision: i64) -> bool {
        self.delivered
            .lock()
            .get(&(election.to_string(), session, revision))
            .is_some_and(|at| at.elapsed() < DELIVERED_FOR)
    }

    async fn read(&self, election: &str) -> Result<Read, ArbiterError> {
        let (read, header) = self
            .table
            .seal()
            .checked(self.table.log().election(election, MAX_CANDIDATES))
            .await?;
        Read::of(read, header.revision)
    }

    /// The leadership `record` names, at `revision` (the term record's),
    /// made durable (the high-water mark and the witness) before its token
    /// leaves. The token and the term are in the epoch the leadership's
    /// transaction compared (the record's): an arbiter that has not seen an
    /// advance yet reads the epoch again rather than answer another.
    async fn deliver(
        &self,
        election: &str,
        record: &LeadRecord,
        revision: i64,
    ) -> Result<Leadership, ArbiterError> {
        let mut state = self.table.seal().serving_epoch().await?;
        if state.epoch() != record.epoch {
            self.table.seal().load_epoch().await?;
            state = self.table.seal().serving()?;
            if state.epoch() != record.epoch {
                return Err(ArbiterError::store(
                    "the election's leadership is of another epoch than this arbiter serves; retry",
                ));
            }
        }
        self.table.seal().make_durable(&state, revision).await?;
        let token = pack(record.epoch, revision).ok_or_else(|| {
            ArbiterError::internal("the epoch or revision is outside the token range")
        })?;
        self.note_delivered(election, record.session, revision);
        Ok(Leadership {
            election: election.to_string(),
            term: record.term(),
            token,
            session: record.session,
            value: record.value.clone(),
        })
    }

    /// Stands for the election and waits to lead, at most `c.wait`. A
    /// session that leads already gets its leadership back. The candidacy
    /// ends with the call, led or not, however the call ends (a cancelled
    /// call's record is removed by a task of its own).
    pub async fn campaign(self: &Arc<Self>, c: &Campaign) -> Result<Leadership, ArbiterError> {
        let until = Instant::now() + c.wait;
        self.table.seal().serving_epoch().await?;
        let read = self.read(&c.election).await?;
        if let Some(record) = read.led_by(&c.identity, c.session) {
            let revision = read.term_at().0;
            let record = record.clone();
            return self.deliver(&c.election, &record, revision).await;
        }
        self.admit(c, &read).await?;
        let stood = self.stand(c).await?;
        // From here the call waits for its turn: it is no longer new work.
        crate::overload::parked();
        let mut candidacy = Candidacy {
            elections: Arc::clone(self),
            election: c.election.clone(),
            identity: c.identity.clone(),
            session: c.session,
            priority: c.priority,
            modified: stood.modified,
            led: false,
        };
        let mut outcome = self.wait_to_lead(c, &mut candidacy, until).await;
        if let Err(e) = &outcome {
            // Answered without leading: gone before the answer is. A record
            // that moved since the last read may have been handed the
            // leadership in the meantime (a resignation picks the first
            // candidate, whose call may be ending): then the answer is the
            // leadership, not the error.
            let log = self.table.log();
            let withdrawn = self
                .table
                .seal()
                .checked(log.withdraw(&c.election, c.session, c.priority, candidacy.modified))
                .await;
            // Until the answer is settled the candidacy stays armed: if
            // anything below fails, or the call is dropped meanwhile, its
            // drop withdraws again and resigns a leadership handed to it.
            match withdrawn {
                Ok((true, _)) => candidacy.led = true,
                Ok((false, _)) => {
                    if let Ok(read) = self.read(&c.election).await {
                        match read.led_by(&c.identity, c.session) {
                            Some(record) => {
                                debug!(election = %c.election, error = %e, "handed the leadership as its call ended");
                                let revision = read.term_at().0;
                                let record = record.clone();
                                outcome = self.deliver(&c.election, &record, revision).await;
                                candidacy.led = outcome.is_ok();
                            }
                            None => candidacy.led = true,
                        }
                    }
                }
                Err(_) => {}
            }
            return outcome;
        }
        candidacy.led = true;
        outcome
    }

    /// Resigns `session`'s leadership of `election`, if it leads: a
    /// leadership handed to a candidate whose call was cancelled (its
    /// caller never learns of it).
    async fn resign_unknown(&self, election: &str, identity: &str, session: i64) {
        let Ok(read) = self.read(election).await else {
            return;
        };
        let Some(record) = read.led_by(identity, session) else {
            return;
        };
        let revision = read.term_at().0;
        if self.was_delivered(election, session, revision) {
            // A later call on the session was answered this leadership.
            return;
        }
        let Some(token) = pack(record.epoch, revision) else {
            return;
        };
        let claim = Claim {
            election,
            identity,
            session,
            token,
        };
        if let Err(e) = self.resign(&claim).await {
            debug!(election, error = %e, "could not resign a leadership its cancelled campaign was handed");
        }
    }

    /// The bounds a campaign passes before it stands: the election's
    /// candidates (its class's `maxWaitersPerKey`), the subject's
    /// leaderships, and, for an election never led in this epoch, the term
    /// records the subject made.
    async fn admit(&self, c: &Campaign, read: &Read) -> Result<(), ArbiterError> {
        let standing = read
            .candidates
            .iter()
            .filter(|s| s.record.session != c.session)
            .count();
        if standing >= c.max_candidates as usize {
            return Err(ArbiterError::QueueFull {
                key: c.election.clone(),
                limit: c.max_candidates,
            });
        }
        let log = self.table.log();
        let (led, _) = self
            .table
            .seal()
            .checked(log.count_leaderships(c.subject()))
            .await?;
        if led >= i64::from(c.max_leaderships) {
            return Err(ArbiterError::IdentityLimit {
                bound: crate::error::IdentityBound::Leaderships,
                limit: c.max_leaderships,
            });
        }
        if read.term.is_none() {
            let (made, _) = self
                .table
                .seal()
                .checked(log.count_elections(c.subject()))
                .await?;
            if made >= i64::from(c.max_elections) {
                return Err(ArbiterError::IdentityLimit {
                    bound: crate::error::IdentityBound::Elections,
                    limit: c.max_elections,
                });
            }
        }
        Ok(())
    }

    async fn stand(&self, c: &Campaign) -> Result<Queued, ArbiterError> {
        let record = CandidateRecord {
            identity: c.identity.clone(),
            session: c.session,
            class: c.class.clone(),
            value: c.value.clone(),
            priority: c.priority,
            since_unix_ms: now_unix_ms(),
            wait_ms: u64::try_from(c.wait.as_millis()).unwrap_or(u64::MAX),
            instance: c.instance.clone(),
            bound: c.bound.clone(),
            yields: c.yields,
        };
        let session_record = encode(&SessionRecord {
            identity: c.identity.clone(),
            ttl_seconds: c.ttl_seconds,
        });
        let (stood, _) = self
            .table
            .seal()
            .checked(self.table.log().stand(
                &c.election,
                c.session,
                c.priority,
                &session_record,
                encode(&record),
            ))
            .await?;
        match stood {
            Some(q) => Ok(q),
            None => Err(self.why_not_session(c).await),
        }
    }

    /// Why a session record did not match: a session of the caller with
    /// another TTL, or none of the caller's.
    async fn why_not_session(&self, c: &Campaign) -> ArbiterError {
        match self.table.session(c.session).await {
            Ok(Some(s)) if s.identity == c.identity && s.ttl_seconds != c.ttl_seconds => {
                ArbiterError::SessionClassMismatch {
                    session: c.session,
                    session_ttl: s.ttl_seconds,
                    class: c.class.clone(),
                    class_ttl: c.ttl_seconds,
                }
            }
            Ok(_) => ArbiterError::SessionExpired { session: c.session },
            Err(e) => e,
        }
    }

    async fn wait_to_lead(
        &self,
        c: &Campaign,
        candidacy: &mut Candidacy,
        until: Instant,
    ) -> Result<Leadership, ArbiterError> {
        let log = self.table.log();
        let mut watch = None;
        loop {
            let state = self.table.seal().serving_epoch().await?;
            let read = self.read(&c.election).await?;
            if let Some(record) = read.led_by(&c.identity, c.session) {
                // Led over a vacancy by this call's last attempt, or handed
                // over by a resignation or a transfer.
                let record = record.clone();
                let revision = read.term_at().0;
                return self.deliver(&c.election, &record, revision).await;
            }
            let timed_out = || ArbiterError::WaitTimeout {
                key: c.election.clone(),
            };
            match read.standing(c.session, c.priority) {
                Some(s) => candidacy.modified = s.modified,
                None => {
                    // Removed (an epoch advance, or taken for stale): stand
                    // again, at the back, unless the call's time is up.
                    if Instant::now() >= until {
                        return Err(timed_out());
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    candidacy.modified = self.stand(c).await?.modified;
                    continue;
                }
            }
            if read.lead.is_some() {
                self.forget_heads(&c.election);
            } else if let Some(first) = read.candidates.first() {
                if first.record.session == c.session && first.record.priority == c.priority {
                    if !self.lead_vacancy(c, &state, &read, first).await? {
                        // Moved under us, or this arbiter's epoch or fence
                        // is behind: read them again before the next try,
                        // after a pause (never a hot loop against etcd).
                        self.table.seal().load_epoch().await?;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    continue;
                }
                self.remove_if_stale(&c.election, first).await;
            }
            if Instant::now() >= until {
                return Err(timed_out());
            }
            if watch.is_none() {
                watch = log
                    .watch_election(&c.election, read.revision + 1)
                    .await
                    .ok();
            }
            let hint = async {
                match watch.as_mut() {
                    Some(w) => !matches!(w.next().await, crate::lock_log::FollowSignal::Lost),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                kept = hint => if !kept { watch = None; },
                () = tokio::time::sleep(POLL) => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }

    /// Leads over a vacancy: whether the transaction committed (the next
    /// read then finds the leadership).
    async fn lead_vacancy(
        &self,
        c: &Campaign,
        state: &EpochState,
        read: &Read,
        me: &Standing,
    ) -> Result<bool, ArbiterError> {
        let term_at = read.term_at().0;
        let count = read.next_count()?;
        let lead = LeadRecord {
            identity: c.identity.clone(),
            session: c.session,
            class: c.class.clone(),
            epoch: state.epoch(),
            count,
            value: me.record.value.clone(),
            priority: me.record.priority,
            since_unix_ms: now_unix_ms(),
            instance: c.instance.clone(),
            bound: c.bound.clone(),
            yields: c.yields,
        };
        let session_record = encode(&SessionRecord {
            identity: c.identity.clone(),
            ttl_seconds: c.ttl_seconds,
        });
        let subject = read.term_subject().unwrap_or(c.subject()).to_string();
        let txn = LeadTxn {
            election: &c.election,
            epoch: &state.bytes,
            fence_at: state.fence_at,
            term_at,
            term_record: encode(&TermRecord {
                count,
                ended: None,
                subject: subject.clone(),
            }),
            creates_for: (term_at == 0).then_some(subject.as_str()),
            from: LeadFrom::Vacant,
            to: Some(LeadTo {
                session: c.session,
                priority: c.priority,
                created: me.created,
                lead_record: encode(&lead),
                session_record: Some(&session_record),
                subject: c.subject(),
            }),
        };
        let (led, _) = self
            .table
            .seal()
            .checked_write(self.table.log().lead(txn), |led| *led)
            .await?;
        Ok(led)
    }

    /// Forgets the heads seen in `election` (it has a leader: the next
    /// vacancy's first candidate is timed afresh).
    fn forget_heads(&self, election: &str) {
        self.heads.lock().retain(|(e, _), _| e != election);
    }

    /// Removes `head`'s record when it has stood first over a vacancy,
    /// unchanged, for longer than its call waits and [`STALE_AFTER`]: its
    /// call is gone (its arbiter died) while its session lives.
    async fn remove_if_stale(&self, election: &str, head: &Standing) {
        let key = (election.to_string(), head.record.session);
        let now = Instant::now();
        let seen = {
            let mut heads = self.heads.lock();
            // Only the first candidate of each vacancy is timed.
            heads.retain(|(e, s), _| e != election || *s == head.record.session);
            heads.retain(|_, (_, at)| now.duration_since(*at) < Duration::from_secs(3_600));
            let entry = heads.entry(key.clone()).or_insert((head.modified, now));
            if entry.0 != head.modified {
                *entry = (head.modified, now);
            }
            entry.1
        };
        let grace = Duration::from_millis(head.record.wait_ms).saturating_add(STALE_AFTER);
        if now.duration_since(seen) < grace {
            return;
        }
        let removed = self
            .table
            .seal()
            .checked(self.table.log().withdraw(
                election,
                head.record.session,
                head.record.priority,
                head.modified,
            ))
            .await;
        if matches!(removed, Ok((true, _))) {
            debug!(election, "removed a stale candidate record");
        }
        self.heads.lock().remove(&key);
    }

    /// The caller's current leadership, read and checked: `NotLeader`
    /// unless the leader record names the caller's identity and session on
    /// its lease, in the token's epoch, and the term record is at the
    /// token's revision.
    async fn current(&self, claim: &Claim<'_>) -> Result<(EpochState, Read), ArbiterError> {
        let state = self.table.seal().serving_epoch().await?;
        let read = self.read(claim.election).await?;
        let (epoch, revision) = latchkey_records::token::unpack(claim.token);
        match read.led_by(claim.identity, claim.session) {
            Some(lead) if lead.epoch == epoch && read.term_at().0 == revision => Ok((state, read)),
            _ => Err(ArbiterError::NotLeader {
                election: claim.election.to_string(),
                session: claim.session,
            }),
        }
    }

    /// Replaces the leader's value, if the claimed leadership is current.
    pub async fn proclaim(&self, claim: &Claim<'_>, value: &str) -> Result<(), ArbiterError> {
        for _ in 0..2 {
            let (state, read) = self.current(claim).await?;
            let Some((lead, _)) = &read.lead else {
                return Err(ArbiterError::internal(
                    "a current leadership without its record",
                ));
            };
            let record = LeadRecord {
                value: value.to_string(),
                ..lead.clone()
            };
            let txn = ProclaimTxn {
                election: claim.election,
                session: claim.session,
                term_at: read.term_at().0,
                epoch: &state.bytes,
                lead_record: encode(&record),
            };
            let (done, _) = self
                .table
                .seal()
                .checked_write(self.table.log().proclaim(txn), |done| *done)
                .await?;
            if done {
                return Ok(());
            }
            // The leadership moved, or this arbiter's epoch is behind.
            self.table.seal().load_epoch().await?;
        }
        Err(ArbiterError::NotLeader {
            election: claim.election.to_string(),
            session: claim.session,
        })
    }

    /// Ends the claimed leadership: the first candidate leads in the same
    /// transaction, or the election is vacant. The next leader, if any.
    pub async fn resign(&self, claim: &Claim<'_>) -> Result<Option<LeaderView>, ArbiterError> {
        self.hand_over(claim, None).await
    }

    /// Hands the claimed leadership to a candidate in one transaction.
    pub async fn transfer(
        &self,
        claim: &Claim<'_>,
        to: TransferTo,
    ) -> Result<LeaderView, ArbiterError> {
        match self.hand_over(claim, Some(to)).await? {
            Some(next) => Ok(next),
            None => Err(ArbiterError::internal("a transfer that left no leader")),
        }
    }

    /// Resign (`to` = None: the first candidate, or a vacancy) or transfer,
    /// in one transaction. Read again and retried while the candidates move
    /// under it.
    async fn hand_over(
        &self,
        claim: &Claim<'_>,
        to: Option<TransferTo>,
    ) -> Result<Option<LeaderView>, ArbiterError> {
        for _ in 0..5 {
            let (state, read) = self.current(claim).await?;
            let Some((current, _)) = &read.lead else {
                return Err(ArbiterError::internal(
                    "a current leadership without its record",
                ));
            };
            // Never back to the resigning session (a record it left at
            // another priority).
            let mut others = read
                .candidates
                .iter()
                .filter(|c| c.record.session != claim.session);
            let next = match to {
                None | Some(TransferTo::Preferred) => others.next(),
                Some(TransferTo::HigherPriority) => others
                    .next()
                    .filter(|c| c.record.priority > current.priority),
                Some(TransferTo::Candidate(id)) => {
                    others.find(|c| u64::try_from(c.created).ok() == Some(id))
                }
            };
            if to.is_some() && next.is_none() {
                return Err(ArbiterError::NoCandidate(match to {
                    Some(TransferTo::Candidate(id)) => format!(
                        "candidate {id} is not standing in election {:?} (its campaign ended, or it leads); list them with Candidates",
                        claim.election
                    ),
                    Some(TransferTo::HigherPriority) => format!(
                        "election {:?} has no candidate above the leader's priority {} (the one that asked may have left)",
                        claim.election, current.priority
                    ),
                    _ => format!(
                        "election {:?} has no candidate to transfer to",
                        claim.election
                    ),
                }));
            }
            let (term_at, count) = read.term_at();
            let subject = read
                .term_subject()
                .unwrap_or(current.bounded_as())
                .to_string();
            let (term_record, lead) = match next {
                Some(n) => {
                    let count = read.next_count()?;
                    let lead = LeadRecord {
                        identity: n.record.identity.clone(),
                        session: n.record.session,
                        class: n.record.class.clone(),
                        epoch: state.epoch(),
                        count,
                        value: n.record.value.clone(),
                        priority: n.record.priority,
                        since_unix_ms: now_unix_ms(),
                        instance: n.record.instance.clone(),
                        bound: n.record.bound.clone(),
                        yields: n.record.yields,
                    };
                    let term = TermRecord {
                        count,
                        ended: None,
                        subject,
                    };
                    (term, Some((n, lead)))
                }
                None => (
                    TermRecord {
                        count,
                        ended: Some(TermEnd::Resigned),
                        subject,
                    },
                    None,
                ),
            };
            let txn = LeadTxn {
                election: claim.election,
                epoch: &state.bytes,
                fence_at: state.fence_at,
                term_at,
                term_record: encode(&term_record),
                creates_for: None,
                from: LeadFrom::Leader {
                    session: claim.session,
                    subject: current.bounded_as(),
                },
                to: lead.as_ref().map(|(n, record)| LeadTo {
                    session: n.record.session,
                    priority: n.record.priority,
                    created: n.created,
                    lead_record: encode(record),
                    session_record: None,
                    subject: n.record.bounded_as(),
                }),
            };
            match self
                .table
                .seal()
                .checked_write(self.table.log().lead(txn), |led| *led)
                .await
            {
                Ok((true, header)) => {
                    if lead.is_some() {
                        // The next leader's token is this revision.
                        self.table
                            .seal()
                            .make_durable(&state, header.revision)
                            .await?;
                    }
                    return Ok(lead.map(|(_, record)| LeaderView::of(&record)));
                }
                // Moved under us, this arbiter's epoch or fence is behind,
                // or the next candidate's session ended under us: read
                // again.
                Ok((false, _)) | Err(ArbiterError::SessionExpired { .. }) => {
                    self.table.seal().load_epoch().await?;
                }
                Err(e) => return Err(e),
            }
        }
        Err(ArbiterError::store(
            "the election's candidates kept changing during the hand-over; retry",
        ))
    }

    /// Ends the leadership an approved force-release names (operators, not
    /// its leader: no claim, no token), if it is still that one: the leader
    /// record on `forced.session`'s lease and the term record at
    /// `forced.term_at`. ONE transaction ([`ForceTermTxn`]) deletes the
    /// leader record and the leadership's entry, marks the term record
    /// ended by the operators (observers hear `FORCED` for that term) and
    /// writes the approval's records. Nothing is handed to a candidate: a
    /// waiting campaign sees the vacancy and leads in a term of its own.
    /// The leader's session is left alone. The header is judged, but a
    /// sealed log still answers: ending a term hands nothing out.
    /// Returns the outcome with the revision it was read or written at.
    pub async fn force_end(
        &self,
        forced: ForcedTerm<'_>,
    ) -> Result<(ForceEnded, i64), ArbiterError> {
        // Judged, not checked: a sealed log still answers (as the write).
        let (read, header) = self
            .table
            .seal()
            .judged(self.table.log().election(forced.election, 0))
            .await?;
        let read = Read::of(read, header.revision)?;
        let (term_at, count) = read.term_at();
        let leader = match &read.lead {
            Some((record, kv)) if kv.lease == forced.session && term_at == forced.term_at => record,
            // Moved since the request: the transaction would fail its
            // compares, so it is not sent.
            _ => {
                return Ok((
                    ForceEnded::HoldChanged {
                        now: read.lead.map(|(_, kv)| kv),
                    },
                    read.revision,
                ));
            }
        };
        let subject = read
            .term_subject()
            .unwrap_or(leader.bounded_as())
            .to_string();
        let txn = ForceTermTxn {
            election: forced.election,
            session: forced.session,
            subject: leader.bounded_as(),
            term_at: forced.term_at,
            term_record: encode(&TermRecord {
                count,
                ended: Some(TermEnd::Forced),
                subject,
            }),
            records: forced.records,
        };
        let (ended, header) = self
            .table
            .seal()
            .judged(self.table.log().force_end_term(txn))
            .await?;
        Ok((ended, header.revision))
    }

    /// The current leader, or `None` while vacant.
    pub async fn leader(&self, election: &str) -> Result<Option<LeaderView>, ArbiterError> {
        let read = self.read(election).await?;
        Ok(read.lead.as_ref().map(|(r, _)| LeaderView::of(r)))
    }

    /// The candidates in the order they lead.
    pub async fn candidates(&self, election: &str) -> Result<Vec<CandidateView>, ArbiterError> {
        let read = self.read(election).await?;
        Ok(read
            .candidates
            .iter()
            .map(|c| CandidateView {
                id: u64::try_from(c.created).unwrap_or(0),
                identity: c.record.identity.clone(),
                value: c.record.value.clone(),
                priority: c.record.priority,
                since_unix_ms: c.record.since_unix_ms,
            })
            .collect())
    }

    /// Observes the election: its state now, then every change.
    pub async fn observe(&self, election: &str, from_term: u64) -> Result<Observer, ArbiterError> {
        self.observers.subscribe(election, from_term).await
    }
}
