use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use tokio::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt as _};
use latchkey_proto::lockv1::{EndedHold, KeepAliveRequest, KeepAliveResponse};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Status};
use tracing::debug;

use super::{Arbiter, KeepAliveStream, session_id};
use crate::error::ArbiterError;

/// Renewals of one client stream in flight at once. Past it the stream is not
/// read until one is answered, so a client that sends faster is slowed by
/// HTTP/2 flow control, never refused.
const MAX_IN_FLIGHT_PER_STREAM: usize = 1024;
/// Answers waiting for the client to read them.
const REPLY_QUEUE: usize = 256;
/// Sessions one KeepAlive message may renew (`session_id` and
/// `session_ids` together).
pub const MAX_SESSIONS_PER_MESSAGE: usize = 1024;
/// Sessions whose ownership one stream remembers having checked, at most
/// (the per-identity session bound is usually far lower).
const MAX_CHECKED_PER_STREAM: usize = 1 << 16;
/// Ended-hold notices waiting to be pushed on one stream; past it they are
/// dropped (the client's fence deadline still holds).
const NOTICE_QUEUE: usize = 64;

/// Stops a stream's hold notices when the stream ends, however it ends.
struct Watched<'a> {
    arbiter: &'a Arbiter,
    stream: u64,
    sessions: HashSet<i64>,
}

impl Watched<'_> {
    fn add(&mut self, session: i64, notices: &crate::hold_counts::Notices) {
        if self.sessions.insert(session) {
            // Every cluster's: a session from before the tiers were split
            // may carry the coord bit and hold on the entity cluster.
            for cluster in self.arbiter.tiers.all() {
                cluster.holds.watch_session(session, self.stream, notices);
            }
        }
    }

    fn remove(&mut self, session: i64) {
        if self.sessions.remove(&session) {
            for cluster in self.arbiter.tiers.all() {
                cluster.holds.unwatch_session(session, self.stream);
            }
        }
    }
}

impl Drop for Watched<'_> {
    fn drop(&mut self) {
        for session in self.sessions.drain() {
            for cluster in self.arbiter.tiers.all() {
                cluster.holds.unwatch_session(session, self.stream);
            }
        }
    }
}

/// What one renewal came to.
enum Renewal {
    /// Renewed (or answered from the memo) with this many seconds left; the
    /// session lives where `Home` says.
    Alive(i64, Home),
    /// Gone, or not the caller's: the same answer either way.
    Gone,
}

/// Where a session the caller owns lives, as far as its renewals care:
/// learnt by its ownership lookup and remembered by the stream, so a
/// renewal of a checked session reads nothing from etcd.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Home {
    /// The entity (home) cluster: renewals there check the shard-map fence
    /// and renew the session's shadows.
    Entity,
    /// The coord cluster (`--split-tiers`).
    Coord,
}

impl Arbiter {
    /// Renews sessions on request; one message may name up to
    /// `MAX_SESSIONS_PER_MESSAGE` of them, each answered on its own.
    /// Renewals on one stream are pipelined:
    /// each is answered when its own renewal is, in any order (answers carry
    /// the session id), over the store's shared etcd keep-alive streams.
    /// Each session's ownership is checked once per stream (someone else's
    /// session is answered as one that is gone). A session that is gone is
    /// answered with `remaining_ttl_seconds = 0` and the stream goes on for
    /// the others; a renewal that fails at the store is not answered (the
    /// client's next one retries); only a malformed request ends it.
    /// A session renewed in etcd within the last quarter of its TTL is
    /// answered from the arbiter's memo of renewals ([`crate::bounds`]):
    /// renewing faster costs etcd nothing, and no renewal is ever refused
    /// for its rate.
    ///
    /// What a stream makes the arbiter do is paced per identity (all of its
    /// streams on this arbiter together, [`crate::bounds::renewal_budget`]):
    /// the ownership lookups (an etcd read each, whatever the id names) and
    /// the renewals answered. Past either budget the stream is simply not
    /// read until the budget is back (the sessions of the message read wait
    /// for their lookups meanwhile); nothing is refused for its rate, and
    /// another identity's streams never wait for it (issue 31).
    ///
    /// A stream also hears, unasked, when a hold of a session it renews
    /// ends (a notice: `ended_holds`, `remaining_ttl_seconds = -1`), so the
    /// holder can fence that hold at once (issue 13).
    ///
    /// Generic over the inbound stream: tonic's `Streaming`, or any stream
    /// of messages (the simulation's clients).
    pub fn keep_alive<S>(
        self: Arc<Self>,
        request: Request<S>,
    ) -> Result<KeepAliveStream, ArbiterError>
    where
        S: futures::Stream<Item = Result<KeepAliveRequest, Status>> + Send + Unpin + 'static,
    {
        let caller = self.caller(&request)?;
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<KeepAliveResponse, Status>>(REPLY_QUEUE);
        tokio::spawn(async move {
            let identity = caller.identity.as_str();
            // Shared by the grant subject's streams (issue 30): per-pod
            // identities under one pattern have one budget.
            let subject = self
                .policies
                .current()
                .grants()
                .subject(identity)
                .unwrap_or(identity)
                .to_string();
            let budget = self.bounds.renewal_budgets.for_stream(&subject);
            let checked_cap = MAX_CHECKED_PER_STREAM.min(
                usize::try_from(self.bounds.max_sessions)
                    .unwrap_or(usize::MAX)
                    .saturating_mul(2)
                    .max(1024),
            );
            // The caller's sessions checked on this stream, and where each
            // lives; a session that turns out gone leaves, and the map goes
            // with the stream.
            let mut checked: HashMap<i64, Home> = HashMap::new();
            // Sessions named but not checked yet, waiting for the identity's
            // lookup budget (at most one message's: the stream is not read
            // while any wait).
            let mut unchecked: VecDeque<i64> = VecDeque::new();
            // Not before this: the next lookup (the budget is spent) ...
            let mut lookups_after: Option<Instant> = None;
            // ... and reading the next message (renewals' pace).
            let mut read_after: Option<Instant> = None;
            let mut in_flight = FuturesUnordered::new();
            let mut reading = true;
            let (notices, mut noticed) = tokio::sync::mpsc::channel(NOTICE_QUEUE);
            let mut watched = Watched {
                arbiter: &self,
                // One counter for every stream, whichever cluster its
                // sessions are on.
                stream: self.tiers.entity().holds.stream_id(),
                sessions: HashSet::new(),
            };
            loop {
                // The lookups the identity's budget lets in now.
                let was_waiting = lookups_after.take().is_some();
                while let Some(&session) = unchecked.front() {
                    if in_flight.len() >= MAX_IN_FLIGHT_PER_STREAM {
                        break;
                    }
                    match budget.take_lookup(self.lookup_reads(session), Instant::now()) {
                        Ok(()) => {
                            unchecked.pop_front();
                            in_flight.push(self.renewal(identity, session, None));
                        }
                        Err(at) => {
                            if !was_waiting {
                                self.metrics.keepalive_paced("ownership_lookups");
                            }
                            lookups_after = Some(at);
                            break;
                        }
                    }
                }
                let now = Instant::now();
                read_after = read_after.filter(|at| *at > now);
                let room = reading
                    && unchecked.is_empty()
                    && read_after.is_none()
                    && in_flight.len() < MAX_IN_FLIGHT_PER_STREAM;
                let wake = match (lookups_after, read_after) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let event = tokio::select! {
                    req = inbound.next(), if room => Event::Request(req),
                    Some(done) = in_flight.next() => Event::Done(done),
                    Some(notice) = noticed.recv() => Event::Notice(notice),
                    () = tokio::time::sleep_until(wake.unwrap_or(now)), if wake.is_some() => Event::Budget,
                    // The client went away: no lookups for it any more.
                    () = tx.closed() => return,
                    else => Event::Idle,
                };
                match event {
                    Event::Notice((session, hold)) => {
                        if tx.send(Ok(notice(session, hold))).await.is_err() {
                            return;
                        }
                    }
                    Event::Request(Some(Ok(req))) => match sessions_named(&req) {
                        Ok(sessions) => {
                            read_after = budget.charge_renewals(sessions.len(), Instant::now());
                            if read_after.is_some() {
                                self.metrics.keepalive_paced("renewals");
                            }
                            for session in sessions {
                                match checked.get(&session) {
                                    Some(&home) => {
                                        in_flight.push(self.renewal(identity, session, Some(home)))
                                    }
                                    // A malformed id ends the stream; it
                                    // costs no lookup.
                                    None if session <= 0 => {
                                        in_flight.push(self.renewal(identity, session, None))
                                    }
                                    None => unchecked.push_back(session),
                                }
                            }
                        }
                        Err(e) => {
                            self.metrics.renewal_refused(&e);
                            let _ = tx.send(Err(Status::from(e))).await;
                            return;
                        }
                    },
                    Event::Request(_) => reading = false,
                    Event::Budget => {}
                    Event::Idle => return,
                    Event::Done((session, outcome)) => {
                        let reply = match outcome {
                            Ok(Renewal::Alive(ttl, home)) => {
                                if checked.len() < checked_cap || checked.contains_key(&session) {
                                    checked.insert(session, home);
                                    watched.add(session, &notices);
                                }
                                Some(Ok(KeepAliveResponse {
                                    session_id: session,
                                    remaining_ttl_seconds: ttl,
                                    ended_holds: Vec::new(),
                                }))
                            }
                            Ok(Renewal::Gone) => {
                                checked.remove(&session);
                                watched.remove(session);
                                self.metrics
                                    .renewal_refused(&ArbiterError::SessionExpired { session });
                                Some(Ok(KeepAliveResponse {
                                    session_id: session,
                                    remaining_ttl_seconds: 0,
                                    ended_holds: Vec::new(),
                                }))
                            }
                            // A renewal that failed at the store is not
                            // answered: the client's next one retries, and
                            // its fence deadline runs from the last answer.
                            // Ending the stream would cost every other
                            // session on it a reconnection and an ownership
                            // lookup, just when the store is struggling
                            // (issue 31, overload). Only the store's
                            // struggling is waited out this way: a renewal
                            // this arbiter cannot serve at all (a shard map
                            // it does not follow) ends the stream, so the
                            // client goes to one that can.
                            Err(
                                e @ (ArbiterError::StoreUnavailable { .. }
                                | ArbiterError::Overloaded { .. }),
                            ) => {
                                debug!(identity, error = %e, "renewal failed at the store; not answered");
                                self.metrics.renewal_refused(&e);
                                // (and on to the end-of-stream check below:
                                // a half-closed stream whose last renewal
                                // failed ends now, not at an idle timeout)
                                None
                            }
                            Err(e) => {
                                debug!(identity, error = %e, "keepalive stream ended");
                                self.metrics.renewal_refused(&e);
                                Some(Err(Status::from(e)))
                            }
                        };
                        if let Some(reply) = reply {
                            let end = reply.is_err();
                            if tx.send(reply).await.is_err() || end {
                                return;
                            }
                        }
                    }
                }
                if !reading && in_flight.is_empty() && unchecked.is_empty() {
                    return;
                }
            }
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    /// One renewal of `raw` for `identity`; `checked`: its ownership was
    /// already checked on this stream, and it lives there.
    async fn renewal(
        &self,
        identity: &str,
        raw: i64,
        checked: Option<Home>,
    ) -> (i64, Result<Renewal, ArbiterError>) {
        (raw, self.renew_session(identity, raw, checked).await)
    }

    /// The etcd reads one ownership lookup of `session` may take: two for
    /// an id with the coord bit under `--split-tiers` (a session from before
    /// the split lives on the entity cluster), one otherwise.
    fn lookup_reads(&self, session: i64) -> u32 {
        match Arc::ptr_eq(self.tiers.for_session(session), self.tiers.entity()) {
            true => 1,
            false => 2,
        }
    }

    /// Where the caller's `session` lives; `None` when it is gone or
    /// someone else's (the same answer). One etcd read; for an id with the
    /// coord bit under `--split-tiers`, the coord cluster's record, or when
    /// it has none the entity cluster's (a session from before the split):
    /// where [`super::Arbiter::owned_session`] finds it, without reading a
    /// record found on the coord cluster twice.
    async fn owner_home(&self, identity: &str, session: i64) -> Result<Option<Home>, ArbiterError> {
        // Counted as sent: a lookup dropped with its stream still read etcd.
        self.metrics.ownership_lookup();
        let entity = self.tiers.entity();
        let tagged = self.tiers.for_session(session);
        let home = if Arc::ptr_eq(tagged, entity) {
            match self.owned_session(identity, session).await {
                Ok(_) => Some(Home::Entity),
                Err(ArbiterError::SessionExpired { .. }) => None,
                Err(e) => return Err(e),
            }
        } else {
            let (home, record) = match tagged.table.session(session).await? {
                Some(record) => (Home::Coord, Some(record)),
                None => (Home::Entity, entity.table.session(session).await?),
            };
            record.filter(|r| r.identity == identity).map(|_| home)
        };
        Ok(home)
    }

    async fn renew_session(
        &self,
        identity: &str,
        raw: i64,
        checked: Option<Home>,
    ) -> Result<Renewal, ArbiterError> {
        let session = session_id(raw)?;
        let home = match checked {
            Some(home) => home,
            None => match self.owner_home(identity, session).await? {
                Some(home) => home,
                None => return Ok(Renewal::Gone),
            },
        };
        // With other shards, every renewal renews the session's shadows
        // too, and the memo (the home cluster's renewals only) cannot answer.
        // An arbiter behind the lock cluster's map fence may not know the
        // shards a session has shadows on: it does not answer.
        if home == Home::Entity {
            self.renewal_fenced()?;
            if self.has_shadows() {
                return self.renew_with_shadows(session).await;
            }
        }
        // Ownership is settled above; only then may the memo answer.
        if let Some(ttl) = self.bounds.recent_renewal(session) {
            self.metrics.renewal("coalesced");
            return Ok(Renewal::Alive(ttl, home));
        }
        // At most twice: a renewal already in flight (or just answered) when
        // this one was asked answers for it too, counted from when it was
        // sent; if that leaves under a second, renew afresh.
        for _ in 0..2 {
            let asked = Instant::now();
            // The store notes etcd's answer in the memo.
            let mut renewed = self.tiers.for_session(session).table.renew(session).await?;
            if renewed.ttl_seconds <= 0
                && self.tiers.for_session(session).tier != self.tiers.entity().tier
            {
                // A session from before the split whose id carries the
                // coord bit lives on the entity cluster.
                renewed = self.tiers.entity().table.renew(session).await?;
            }
            if renewed.ttl_seconds <= 0 {
                return Ok(Renewal::Gone);
            }
            self.metrics.renewal(if renewed.sent_to_store {
                "renewed"
            } else {
                "coalesced"
            });
            if Instant::from_std(renewed.sent) >= asked {
                return Ok(Renewal::Alive(renewed.ttl_seconds, home));
            }
            if let Some(ttl) = self.bounds.recent_renewal(session) {
                return Ok(Renewal::Alive(ttl, home));
            }
        }
        Err(ArbiterError::store("the lease renewal answered too late"))
    }

    /// Renews an entity session and its shadows on the other shards: alive
    /// for the shortest time left among them, each counted from its own
    /// renewal's send (the home lane's memo may answer for the home lease;
    /// the other shards' lanes have none); gone when the session is.
    async fn renew_with_shadows(&self, session: i64) -> Result<Renewal, ArbiterError> {
        let home = &self.tiers.entity().table;
        for _ in 0..2 {
            let renewed = home.renew(session).await?;
            if renewed.ttl_seconds <= 0 {
                // Its shadows are left to expire, not revoked: the holder
                // was told its session lives until the shortest of them
                // ends, and a lease the lock cluster lost to a restore
                // (restored to before the session opened) ended before
                // that. A session that expired had them renewed with it.
                return Ok(Renewal::Gone);
            }
            let mut left = super::shadow::time_left(&renewed);
            if let Some(shadows) = self.renew_shadows(session).await? {
                left = left.min(shadows);
            }
            self.metrics.renewal(if renewed.sent_to_store {
                "renewed"
            } else {
                "coalesced"
            });
            if left >= 1 {
                return Ok(Renewal::Alive(left, Home::Entity));
            }
        }
        Err(ArbiterError::store("the lease renewal answered too late"))
    }
}

/// The distinct sessions one message names, in the order named: a
/// message naming none, or more than [`MAX_SESSIONS_PER_MESSAGE`], is
/// refused (and ends the stream: the client is broken, not unlucky).
fn sessions_named(req: &KeepAliveRequest) -> Result<Vec<i64>, ArbiterError> {
    let named = usize::from(req.session_id != 0) + req.session_ids.len();
    if named > MAX_SESSIONS_PER_MESSAGE {
        return Err(ArbiterError::BadRequest(format!(
            "a KeepAlive message renews at most {MAX_SESSIONS_PER_MESSAGE} sessions; this one named {named}: split it over several messages"
        )));
    }
    if named == 0 {
        // As before: session 0 is answered as an invalid session id.
        return Ok(vec![0]);
    }
    if named == 1 {
        return Ok(vec![
            req.session_ids.first().copied().unwrap_or(req.session_id),
        ]);
    }
    let mut seen = HashSet::with_capacity(named);
    Ok(std::iter::once(req.session_id)
        .filter(|&id| id != 0)
        .chain(req.session_ids.iter().copied())
        .filter(|id| seen.insert(*id))
        .collect())
}

enum Event<R, D> {
    Request(Option<R>),
    Done(D),
    Notice((i64, EndedHold)),
    /// The identity's budget may let more in.
    Budget,
    Idle,
}

/// A pushed notice: `hold` of `session` ended.
fn notice(session: i64, hold: EndedHold) -> KeepAliveResponse {
    KeepAliveResponse {
        session_id: session,
        remaining_ttl_seconds: -1,
        ended_holds: vec![hold],
    }
}
