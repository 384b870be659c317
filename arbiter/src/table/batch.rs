//! Group commit: grants and releases on distinct keys that arrive together
//! go to the log as one batch — one transaction, one revision, one
//! high-water write for all its grants.
//!
//! A member goes out at once while fewer than `batches_in_flight` batches
//! are in flight (two by default); members that arrive meanwhile wait and
//! go together as the next batch, at most the log's (and the table's) batch
//! limit, never two on one key, nor on a key in flight (the later waits for
//! a batch after). Each member keeps its own compares and
//! gets what its own transaction would have answered; the batch's header
//! goes through the seal's checks once, as a single transaction's does
//! (`checked_write`: a witness read sent after every member arrived, then
//! the header against the marks). A lost answer is every member's unknown
//! outcome; a batch the log refused before writing anything runs again one
//! member at a time, so each hears its own reason.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::oneshot;
use tracing::debug;

use super::{Grant, LockTable};
use crate::error::ArbiterError;
use crate::lock_log::{
    self, BatchOp, BatchOutcome, GrantTxn, Granted, Header, QueueTurn, ReleaseTxn, StoreError,
};

/// The default cap on a batch's members (the log may allow fewer).
pub const DEFAULT_BATCH_LIMIT: usize = 64;
/// The default number of batches one table keeps in flight at once (a
/// member waits only while two are: with one, every member waited for the
/// batch before it to land, measured 0.6x the throughput of two here).
pub const DEFAULT_BATCHES_IN_FLIGHT: usize = 2;
/// Members waiting for a batch, per batch in flight and member of a batch:
/// beyond this, a caller is refused rather than queued without bound.
const WAITING_PER_SLOT: usize = 16;

/// A grant transaction's parts, owned: the member outlives its caller's
/// borrow while it waits for a batch.
#[derive(Debug, Clone)]
pub(super) struct GrantMember {
    pub key: String,
    pub session: i64,
    pub holder_record: Vec<u8>,
    pub epoch_bytes: Vec<u8>,
    pub epoch: u32,
    /// The shard-map fence's mod revision the grant compares.
    pub fence_at: i64,
    pub session_record: Vec<u8>,
    pub queue: QueueTurn,
    /// The quota place the grant takes ([`lock_log::QuotaTake`]).
    pub quota: Option<lock_log::QuotaTake>,
}

#[derive(Debug, Clone)]
pub(super) enum Member {
    Grant(GrantMember),
    Release(ReleaseTxn),
}

impl Member {
    fn key(&self) -> &str {
        match self {
            Member::Grant(g) => &g.key,
            Member::Release(r) => &r.key,
        }
    }

    /// What no other member of its batch, or of a batch in flight, may
    /// write: its lock key and, for a grant that takes a quota place, the
    /// place (etcd refuses a transaction that puts one key twice, and two
    /// grants racing for one place are decided by separate transactions).
    /// A NUL begins a place's name: no lock key has one. A grant also
    /// names its kind of hold under the name its caller asked for
    /// ([`kind_name`]). An exclusive grant, a shared hold's and a slot's
    /// under one name compare each other's absence, which two members of
    /// one batch would both pass: each [`Self::conflicts`] with the
    /// others', while slots of one semaphore, or readers of one lock, go
    /// together.
    fn names(&self) -> impl Iterator<Item = String> + '_ {
        let (place, kind) = match self {
            Member::Grant(g) => (
                g.quota
                    .as_ref()
                    .map(|take| format!("\0{}\0{}\0{}", take.class, take.subject, take.index)),
                Some(kind_name(&g.key)),
            ),
            Member::Release(_) => (None, None),
        };
        std::iter::once(self.key().to_string())
            .chain(place)
            .chain(kind)
    }

    /// The names that keep this member out of a batch, or make it wait for
    /// a batch in flight: its key and quota place ([`Self::names`] but its
    /// kind's name, which slots of one semaphore share), and for a grant
    /// the other kind's name of its key.
    fn conflicts(&self) -> impl Iterator<Item = String> + '_ {
        let (own, others) = match self {
            Member::Grant(g) => (Some(kind_name(&g.key)), Some(other_kind_names(&g.key))),
            Member::Release(_) => (None, None),
        };
        self.names()
            .filter(move |n| Some(n) != own.as_ref())
            .chain(others.into_iter().flatten())
    }

    /// The transaction's kind, as a trace span names it (telemetry.rs).
    fn kind(&self) -> &'static str {
        match self {
            Member::Grant(_) => "grant",
            Member::Release(_) => "release",
        }
    }

    fn op(&self) -> BatchOp<'_> {
        match self {
            Member::Grant(g) => BatchOp::Grant(GrantTxn {
                key: &g.key,
                session: g.session,
                holder_record: g.holder_record.clone(),
                epoch: &g.epoch_bytes,
                fence_at: g.fence_at,
                session_record: &g.session_record,
                queue: g.queue,
                quota: g.quota.clone().map(Box::new),
            }),
            Member::Release(r) => BatchOp::Release(r),
        }
    }
}

/// The name a grant of `key` takes for its kind of hold under its name:
/// SOH for an exclusive hold, STX for a slot, ETX for a shared hold.
fn kind_name(key: &str) -> String {
    let (kind, name) = crate::records::hold_kind(key);
    format!("{}{name}", kind_tag(kind))
}

fn kind_tag(kind: crate::records::HoldKind) -> char {
    match kind {
        crate::records::HoldKind::Exclusive => '\u{1}',
        crate::records::HoldKind::Slot => '\u{2}',
        crate::records::HoldKind::Shared => '\u{3}',
    }
}

/// The names of the other kinds of hold under `key`'s name: a grant of
/// one never shares a batch, or batches in flight, with a grant of another.
fn other_kind_names(key: &str) -> impl Iterator<Item = String> {
    use crate::records::HoldKind;
    let (kind, name) = crate::records::hold_kind(key);
    let name = name.to_string();
    [HoldKind::Exclusive, HoldKind::Slot, HoldKind::Shared]
        .into_iter()
        .filter(move |k| *k != kind)
        .map(move |k| format!("{}{name}", kind_tag(k)))
}

/// What a member hears: its outcome and the batch's (checked) header.
pub(super) type MemberAnswer = Result<(BatchOutcome, Header), ArbiterError>;

struct Pending {
    member: Member,
    reply: oneshot::Sender<MemberAnswer>,
}

/// How the batches went so far (for tests and the simulation's report).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Batches sent (a refused batch counts once, its re-runs apart).
    pub batches: u64,
    pub members: u64,
    /// Batches of more than one member.
    pub shared: u64,
    pub largest: usize,
    /// Batches the log refused, whose members then ran one by one.
    pub split: u64,
}

#[derive(Default)]
pub(super) struct Batches {
    queue: parking_lot::Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Pending>,
    /// Keys of the members in flight: a later member on one of them waits.
    in_flight: BTreeMap<String, usize>,
    /// Committer tasks running, each sending one batch at a time.
    committers: usize,
    stats: BatchStats,
}

impl Batches {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Queue> {
        self.queue.lock()
    }

    pub(super) fn stats(&self) -> BatchStats {
        self.lock().stats
    }

    /// Queues `pending`; whether a committer must be started for it, or
    /// `None` (and the member dropped) if `bound` members wait already.
    fn push(&self, pending: Pending, in_flight: usize, bound: usize) -> Option<bool> {
        let mut q = self.lock();
        if q.waiting.len() >= bound {
            return None;
        }
        q.waiting.push_back(pending);
        let start = q.committers < in_flight;
        if start {
            q.committers += 1;
        }
        Some(start)
    }

    /// The next batch, in arrival order: members whose caller is still
    /// there, on keys neither in flight nor already in this batch. `None`
    /// (and the committer ends) when nothing can go.
    fn next(&self, limit: usize) -> Option<Vec<Pending>> {
        let mut q = self.lock();
        let mut batch: Vec<Pending> = Vec::new();
        let mut keys = BTreeSet::new();
        // Names of members left for a later batch: a later member that
        // conflicts with one waits behind it, so per name the order of
        // arrival holds (the second hostile review: slot grants of K kept
        // overtaking an earlier lock grant of K, which then starved).
        let mut skipped = BTreeSet::new();
        let mut rest = VecDeque::with_capacity(q.waiting.len());
        while let Some(p) = q.waiting.pop_front() {
            if p.reply.is_closed() {
                continue; // its caller went away before it was sent
            }
            if batch.len() < limit
                && p.member.conflicts().all(|n| {
                    !q.in_flight.contains_key(&n) && !keys.contains(&n) && !skipped.contains(&n)
                })
            {
                keys.extend(p.member.names());
                batch.push(p);
            } else {
                skipped.extend(p.member.names());
                rest.push_back(p);
            }
        }
        q.waiting = rest;
        if batch.is_empty() {
            q.committers = q.committers.saturating_sub(1);
            return None;
        }
        for p in &batch {
            for name in p.member.names() {
                *q.in_flight.entry(name).or_insert(0) += 1;
            }
        }
        let stats = &mut q.stats;
        stats.batches += 1;
        stats.members += batch.len() as u64;
        stats.shared += u64::from(batch.len() > 1);
        stats.largest = stats.largest.max(batch.len());
        Some(batch)
    }

    fn landed(&self, batch: &[Pending]) {
        let mut q = self.lock();
        for p in batch {
            for name in p.member.names() {
                if let Some(n) = q.in_flight.get_mut(&name) {
                    *n -= 1;
                    if *n == 0 {
                        q.in_flight.remove(&name);
                    }
                }
            }
        }
    }

    fn note_split(&self) {
        self.lock().stats.split += 1;
    }

    /// Every waiting member, taken out (the table is stopping).
    fn drain(&self) -> Vec<Pending> {
        self.lock().waiting.drain(..).collect()
    }
}

impl LockTable {
    /// How the batches went so far.
    pub fn batch_stats(&self) -> BatchStats {
        self.batches.stats()
    }

    /// Sends `member` with the next batch; its outcome once that batch's
    /// header passed the seal's checks. Dropping the future leaves the
    /// member to its batch: a grant made for it is then released as an
    /// orphan.
    #[tracing::instrument(
        name = "etcd.txn",
        target = "latchkey_otel",
        level = "trace",
        skip_all,
        fields(txn = member.kind())
    )]
    pub(super) async fn commit(self: &Arc<Self>, member: Member) -> MemberAnswer {
        if self.stop.is_cancelled() {
            return Err(ArbiterError::store("the arbiter is shutting down"));
        }
        let in_flight = self.options.batches_in_flight.max(1);
        let bound = in_flight * self.batch_limit() * WAITING_PER_SLOT;
        let (reply, rx) = oneshot::channel();
        match self
            .batches
            .push(Pending { member, reply }, in_flight, bound)
        {
            Some(true) => {
                self.tasks.spawn(self.clone().commit_batches());
            }
            Some(false) => {}
            None => {
                return Err(ArbiterError::store(
                    "too many grants and releases are waiting for the lock log",
                ));
            }
        }
        rx.await.unwrap_or_else(|_| {
            Err(ArbiterError::store(
                "the batch was dropped with the arbiter; its outcome is unknown",
            ))
        })
    }

    /// Sends `members` together: queued at once, so they go in one batch
    /// (as far as the batch limit allows) unless one waits behind an
    /// earlier member on its name. Each hears its own answer, in order.
    pub(super) async fn commit_together(
        self: &Arc<Self>,
        members: Vec<Member>,
    ) -> Vec<MemberAnswer> {
        if self.stop.is_cancelled() {
            return members
                .iter()
                .map(|_| Err(ArbiterError::store("the arbiter is shutting down")))
                .collect();
        }
        let in_flight = self.options.batches_in_flight.max(1);
        let bound = in_flight * self.batch_limit() * WAITING_PER_SLOT;
        let mut receivers = Vec::with_capacity(members.len());
        let mut starts = 0;
        {
            let mut q = self.batches.lock();
            for member in members {
                let (reply, rx) = oneshot::channel();
                if q.waiting.len() >= bound {
                    receivers.push(None);
                    continue;
                }
                q.waiting.push_back(Pending { member, reply });
                receivers.push(Some(rx));
                if q.committers < in_flight {
                    q.committers += 1;
                    starts += 1;
                }
            }
        }
        for _ in 0..starts {
            self.tasks.spawn(self.clone().commit_batches());
        }
        let mut answers = Vec::with_capacity(receivers.len());
        for rx in receivers {
            answers.push(match rx {
                Some(rx) => rx.await.unwrap_or_else(|_| {
                    Err(ArbiterError::store(
                        "the batch was dropped with the arbiter; its outcome is unknown",
                    ))
                }),
                None => Err(ArbiterError::store(
                    "too many grants and releases are waiting for the lock log",
                )),
            });
        }
        answers
    }

    pub(super) fn batch_limit(&self) -> usize {
        self.options.batch_limit.min(self.log.batch_limit()).max(1)
    }

    /// One committer: sends batches one after another while members wait.
    async fn commit_batches(self: Arc<Self>) {
        let limit = self.batch_limit();
        loop {
            if self.stop.is_cancelled() {
                for p in self.batches.drain() {
                    let _ = p
                        .reply
                        .send(Err(ArbiterError::store("the arbiter is shutting down")));
                }
            }
            let Some(batch) = self.batches.next(limit) else {
                return;
            };
            let answers = tokio::select! {
                biased;
                () = self.stop.cancelled() => batch
                    .iter()
                    .map(|_| Err(ArbiterError::store(
                        "the arbiter stopped with the batch in flight; its outcome is unknown",
                    )))
                    .collect(),
                answers = self.send(&batch) => answers,
            };
            self.batches.landed(&batch);
            self.answer_members(batch, answers);
        }
    }

    /// The batch's answers, one per member in order.
    async fn send(&self, batch: &[Pending]) -> Vec<MemberAnswer> {
        let members: Vec<&Member> = batch.iter().map(|p| &p.member).collect();
        match self.send_members(&members).await {
            Ok(answers) => answers,
            Err((_, true)) if members.len() > 1 => {
                // Nothing was written: each member alone, so each hears its
                // own answer (a session gone, say, refuses its whole batch).
                debug!(
                    members = members.len(),
                    "the log refused a batch; running its members one by one"
                );
                self.batches.note_split();
                let mut answers = Vec::with_capacity(members.len());
                for member in members {
                    answers.push(match self.send_members(&[member]).await {
                        Ok(mut one) => one.pop().unwrap_or_else(|| {
                            Err(ArbiterError::internal("a batch of one without an answer"))
                        }),
                        Err((e, _)) => Err(e),
                    });
                }
                answers
            }
            Err((e, _)) => members.iter().map(|_| Err(each_member(&e))).collect(),
        }
    }

    /// One request for `members`, checked as a write: answers in order, or
    /// the error every member gets and whether the log refused the batch
    /// before writing anything.
    #[tracing::instrument(
        name = "etcd.batch",
        target = "latchkey_otel",
        level = "trace",
        skip_all,
        fields(members = members.len())
    )]
    async fn send_members(
        &self,
        members: &[&Member],
    ) -> Result<Vec<MemberAnswer>, (ArbiterError, bool)> {
        let refused = AtomicBool::new(false);
        let ops: Vec<BatchOp<'_>> = members.iter().map(|m| m.op()).collect();
        let request = async {
            // A lone member is its own plain transaction, with its own
            // errors (a session gone is that session's, not a refusal).
            let answer = match <[BatchOp<'_>; 1]>::try_from(ops) {
                Ok([op]) => lock_log::alone(self.log.as_ref(), op)
                    .await
                    .map(|a| a.map(|outcome| vec![outcome])),
                Err(ops) => self.log.batch(ops).await,
            };
            if let Err(StoreError::Refused { context }) = &answer {
                debug!(context, "batch refused");
                refused.store(true, Ordering::Relaxed);
            }
            answer
        };
        let checked = self
            .seal
            .checked_write(request, |outcomes: &Vec<BatchOutcome>| {
                outcomes.iter().any(BatchOutcome::committed)
            })
            .await;
        let (outcomes, header) = checked.map_err(|e| (e, refused.load(Ordering::Relaxed)))?;
        if outcomes.len() != members.len() {
            let e = ArbiterError::store(format!(
                "the lock log answered {} of a batch's {} members",
                outcomes.len(),
                members.len()
            ));
            return Err((e, false));
        }
        Ok(outcomes.into_iter().map(|o| Ok((o, header))).collect())
    }

    /// Hands each member its answer. A grant made for a caller that went
    /// away meanwhile is released as an orphan, as a waiter's would be.
    fn answer_members(self: &Arc<Self>, batch: Vec<Pending>, answers: Vec<MemberAnswer>) {
        for (p, answer) in batch.into_iter().zip(answers) {
            let Err(Ok((BatchOutcome::Grant(Granted::Yes), header))) = p.reply.send(answer) else {
                continue;
            };
            if let Member::Grant(g) = p.member {
                self.release_orphan(Grant {
                    key: g.key,
                    session: g.session,
                    epoch: g.epoch,
                    revision: header.revision,
                });
            }
        }
    }
}

/// The batch's error as each member hears it: the same kind (an unknown
/// outcome stays unknown, a seal stays a seal).
fn each_member(e: &ArbiterError) -> ArbiterError {
    match e {
        ArbiterError::Sealed { reason, epoch } => ArbiterError::Sealed {
            reason: reason.clone(),
            epoch: *epoch,
        },
        ArbiterError::SessionExpired { session } => {
            ArbiterError::SessionExpired { session: *session }
        }
        ArbiterError::Internal { detail, source } => ArbiterError::Internal {
            detail: detail.clone(),
            source: source.clone(),
        },
        ArbiterError::StoreUnavailable { detail, source } => ArbiterError::StoreUnavailable {
            detail: detail.clone(),
            source: source.clone(),
        },
        other => ArbiterError::store(other.to_string()),
    }
}
