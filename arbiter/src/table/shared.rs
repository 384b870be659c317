//! Shared holds (`mode = SHARED`, issue 34): a lock key carries many shared
//! holds, one per session, or one exclusive hold. A session's shared hold of
//! `K` is a lock key of its own ([`crate::records::reader_key`],
//! `K//r/<session>`), granted by one transaction that compares `K` not held
//! exclusively; an exclusive grant of `K` compares everything under `K//`
//! absent. So a writer is never beside a reader, whichever arbiters grant
//! them, and a shared hold is an exclusive lock in every other respect: its
//! token is above every earlier grant (the revision of its own grant, so
//! above the last exclusive hold's), its expiry, release, orphan release and
//! claims are a lock's.
//!
//! What is the mode's own:
//! - Waiters of both modes queue on the lock's name, FIFO on the arbiter
//!   they called: a waiting writer keeps later readers behind it, and
//!   readers at the head of the queue are granted together, in one batch
//!   (one transaction) — phase-fair ([`LockTable::grant_readers`]).
//! - A release is never handed over to a reader: the reader's own grant
//!   takes its key, with the readers behind it.
//! - A session's shared request of a lock it holds exclusively downgrades
//!   it in one transaction ([`crate::lock_log::DowngradeTxn`]) — only while
//!   that call runs: a queue's attempt for a waiting reader that finds its
//!   session's exclusive hold (taken since, by another call) waits for it
//!   to end instead, since the waiter's caller may be gone; an exclusive
//!   request of a lock it holds shared is refused (`UPGRADE_REFUSED`): two
//!   readers upgrading would each wait for the other forever.

use std::sync::Arc;

use super::grants::routed_in_time;
use super::queues::Head;
use super::{Asker, Attempt, Claim, Grant, GrantRequest, HolderView, LockTable, holder_view};
use crate::epoch::EpochState;
use crate::error::ArbiterError;
use crate::lock_log::{DowngradeTxn, HeldAt, Kv};
use crate::records::{HolderRecord, decode, reader_key, readers_of, split_reader};

impl LockTable {
    /// One grant attempt of a shared hold of lock `req.key`: a grant of the
    /// session's own reader key.
    pub(super) async fn attempt_shared(
        self: &Arc<Self>,
        req: &GrantRequest,
        asker: Asker,
    ) -> Result<Attempt, ArbiterError> {
        self.attempt_in(
            &reader_request(req),
            crate::lock_log::QueueTurn::Empty,
            asker,
        )
        .await
    }

    /// A grant refused because its lock is held in the other mode (`other`,
    /// read in the same transaction). A shared request finding its own
    /// session's exclusive hold downgrades it; finding another's, it waits
    /// for the key. An exclusive request finding shared holds waits for them
    /// to end — unless one is its own session's (`UPGRADE_REFUSED`).
    pub(super) async fn other_mode(
        self: &Arc<Self>,
        req: &GrantRequest,
        state: &EpochState,
        other: Kv,
        watch_from: i64,
        asker: Asker,
    ) -> Result<Attempt, ArbiterError> {
        if let Some((name, _)) = split_reader(&req.key) {
            let record = decode::<HolderRecord>(&other.value);
            let own = other.lease == req.session
                && record
                    .as_ref()
                    .is_some_and(|r| r.session == req.session && r.identity == req.identity);
            if !own {
                // The same process under another session: a leak, as for
                // an exclusive request (issue 30).
                if let Some(r) = &record
                    && super::is_leak(&r.identity, &r.instance, r.session, req)
                {
                    return Err(ArbiterError::Leak {
                        key: name.to_string(),
                        holder_session: r.session,
                        session: req.session,
                        instance: req.instance.clone(),
                    });
                }
                return Ok(Attempt::Held { watch_from });
            }
            if let Some(r) = &record
                && r.class != req.class
            {
                // A downgrade keeps the hold's class: its hooks, quota and
                // bounds were the ones it was granted under (the hostile
                // review: a shared request naming another class changed it).
                return Err(ArbiterError::BadRequest(format!(
                    "key {name:?} is held by this session under class {:?}: downgrade it in that class",
                    r.class
                )));
            }
            if asker == Asker::Queue {
                // A waiter's caller may be gone, and this exclusive hold
                // may be another call's of the same session, taken since
                // (the simulation caught a timed-out shared wait whose
                // attempt, still on its way, downgraded the exclusive hold
                // its session's next call had just been granted; that
                // shared hold was then released as an orphan, and the
                // exclusive holder was left holding nothing). Wait for it
                // to end like any reader.
                return Ok(Attempt::Held { watch_from });
            }
            let acquired_at = record.as_ref().map(|r| r.acquired_at_unix_ms);
            let held = HeldAt {
                key: name.to_string(),
                session: req.session,
                revision: other.mod_revision,
                value: other.value,
            };
            return self
                .downgrade(req, state, &held, acquired_at, watch_from)
                .await;
        }
        if self.holds_shared(req).await? {
            return Err(ArbiterError::UpgradeRefused {
                key: req.key.clone(),
            });
        }
        Ok(Attempt::Readers { watch_from })
    }

    /// The caller's exclusive hold `held` becomes its shared hold `req.key`
    /// (a reader key) in one transaction. A class with a quota refuses it:
    /// the shared hold would take no place (release, then acquire shared).
    /// The shared record keeps the exclusive one's grant time
    /// (`acquired_at`), so a class's `maxHoldSeconds` counts from the
    /// first grant: a downgrade does not restart it (the hostile review).
    async fn downgrade(
        self: &Arc<Self>,
        req: &GrantRequest,
        state: &EpochState,
        held: &HeldAt,
        acquired_at: Option<i64>,
        watch_from: i64,
    ) -> Result<Attempt, ArbiterError> {
        if req.quota.is_some() {
            return Err(ArbiterError::BadRequest(format!(
                "class {:?} has a quota (maxHoldsPerSubject), which a downgrade would leave: release {:?}, then acquire it shared",
                req.class, held.key
            )));
        }
        routed_in_time(state, req)?;
        let session_record = req.session_bytes();
        let (done, header) = self
            .seal
            .checked_write(
                self.log.downgrade(DowngradeTxn {
                    held,
                    reader_key: &req.key,
                    holder_record: req.downgraded_bytes(acquired_at, held.revision),
                    epoch: &state.bytes,
                    fence_at: state.fence_at,
                    session_record: &session_record,
                }),
                |done| *done,
            )
            .await
            .map_err(|e| match e {
                // A seal found with (or after) the write may follow its
                // commit: the outcome is unknown, never "refused" (a client
                // takes a refusal for "the exclusive hold stays").
                e @ ArbiterError::Sealed { .. } => ArbiterError::store_caused(
                    format!(
                        "the lock log was found sealed as the downgrade was written ({e}); its outcome is unknown: ask again once the epoch is advanced"
                    ),
                    e,
                ),
                e => e,
            })?;
        if !done {
            // The exclusive hold changed since it was read (released,
            // expired): wait for the key as any reader.
            return Ok(Attempt::Held { watch_from });
        }
        self.granted_at(header.revision);
        let grant = Grant {
            key: req.key.clone(),
            session: req.session,
            epoch: state.epoch(),
            revision: header.revision,
        };
        if let Err(e) = self.seal.make_durable(state, header.revision).await {
            // Committed, but its token may not be handed out: the shared
            // hold goes as an orphan (as a grant's does), and the caller
            // hears an outcome it cannot know — never a refusal, after
            // which a client would take the exclusive hold for its own
            // (the third hostile review).
            self.release_orphan(grant);
            self.kick(&held.key);
            return Err(match e {
                e @ ArbiterError::StoreUnavailable { .. } => e,
                other => ArbiterError::store_caused(
                    format!(
                        "the downgrade committed but could not be made durable ({other}); its outcome is unknown: ask again"
                    ),
                    other,
                ),
            });
        }
        // Readers queued behind the exclusive hold may join now.
        self.kick(&held.key);
        Ok(Attempt::Granted(grant))
    }

    /// A downgrade named by its exclusive hold's token
    /// (`AcquireRequest.downgrade_from`): only the downgrade path, never a
    /// fresh shared grant and never a wait. The session must hold lock
    /// `req.key` exclusively at exactly `token` (this epoch, that revision,
    /// its lease and identity): then one transaction turns that hold into
    /// the session's shared hold (`downgrade`). Otherwise the
    /// answer is the shared hold that this very downgrade made, if the
    /// session still holds it (its record names the exclusive hold's
    /// revision: a repeat after a lost answer), else `DowngradeNotHeld`
    /// (NOT_HELD) with nothing written — the exclusive hold ended some
    /// other way (expiry, `maxHoldSeconds`, force-release, epoch advance),
    /// and a writer may have held the key since (the hostile review: a
    /// shared Acquire then granted a fresh hold the client took for its
    /// downgrade).
    pub async fn downgrade_from(
        self: &Arc<Self>,
        req: &GrantRequest,
        token: u64,
    ) -> Result<Grant, ArbiterError> {
        let not_held = || ArbiterError::DowngradeNotHeld {
            key: req.key.clone(),
        };
        if !req.shared || req.permits.is_some() || split_reader(&req.key).is_some() {
            return Err(ArbiterError::internal(
                "a downgrade is a shared request of a lock",
            ));
        }
        let (epoch, revision) = crate::token::unpack(token);
        let reader = reader_request(req);
        // Registered as a grant's are (see `writing`): a memory grant of
        // the name waits for it.
        let _writing = self.write_on(&req.key);
        let _writing_reader = self.write_on(&reader.key);
        for _ in 0..4 {
            let state = self.seal.serving_epoch().await?;
            if state.epoch() != epoch || revision <= 0 {
                // A hold of another epoch ended with it (or none had it).
                return Err(not_held());
            }
            routed_in_time(&state, req)?;
            let (kv, _) = self.seal.checked(self.log.holder(&req.key)).await?;
            if let Some(kv) = kv.filter(|kv| kv.lease == req.session && kv.mod_revision == revision)
            {
                let record = decode::<HolderRecord>(&kv.value);
                if let Some(r) = &record
                    && r.session == req.session
                    && r.identity == req.identity
                {
                    if r.class != req.class {
                        return Err(ArbiterError::BadRequest(format!(
                            "key {:?} is held by this session under class {:?}: downgrade it in that class",
                            req.key, r.class
                        )));
                    }
                    let held = HeldAt {
                        key: req.key.clone(),
                        session: req.session,
                        revision,
                        value: kv.value,
                    };
                    let acquired_at = Some(r.acquired_at_unix_ms);
                    match self
                        .downgrade(&reader, &state, &held, acquired_at, 0)
                        .await?
                    {
                        Attempt::Granted(grant) => return Ok(grant),
                        // Changed under it (released, expired, the epoch or
                        // fence moved): read again.
                        _ => continue,
                    }
                }
            }
            // Not held exclusively at that token: a repeat of this very
            // downgrade, which landed (its answer lost)?
            return match self
                .downgraded_already(&req.identity, &req.key, req.session, token, &req.class)
                .await?
            {
                Some(grant) => Ok(grant),
                None => Err(not_held()),
            };
        }
        Err(ArbiterError::store(
            "the lock log kept changing under the downgrade",
        ))
    }

    /// Whether `session` (of `identity`) holds lock `key` exclusively at
    /// exactly `token` (this epoch, that revision, its lease): what a
    /// downgrade naming the token converts. Read only; the downgrade's
    /// transaction compares the hold again.
    pub async fn holds_exclusively_at(
        &self,
        identity: &str,
        key: &str,
        session: i64,
        token: u64,
    ) -> Result<bool, ArbiterError> {
        let (epoch, revision) = crate::token::unpack(token);
        let state = self.seal.serving_epoch().await?;
        if state.epoch() != epoch || revision <= 0 || split_reader(key).is_some() {
            return Ok(false);
        }
        let (kv, _) = self.seal.checked(self.log.holder(key)).await?;
        Ok(kv.is_some_and(|kv| {
            kv.lease == session
                && kv.mod_revision == revision
                && decode::<HolderRecord>(&kv.value)
                    .is_some_and(|r| r.session == session && r.identity == identity)
        }))
    }

    /// A repeat of the downgrade of lock `key`'s exclusive hold at `token`
    /// by `session` (of `identity`) that landed, its answer lost: the
    /// shared hold it made (its record names the exclusive hold's
    /// revision), made durable and claimed for this call, while the session
    /// holds it. `None` — with nothing written — if there is none: not a
    /// repeat, or that shared hold ended. The Acquire handler asks this
    /// before a downgrade's admission and hooks, so a repeat is answered
    /// whatever they would say now (the hold is the session's already).
    pub async fn downgraded_already(
        self: &Arc<Self>,
        identity: &str,
        key: &str,
        session: i64,
        token: u64,
        class: &str,
    ) -> Result<Option<Grant>, ArbiterError> {
        let (epoch, revision) = crate::token::unpack(token);
        let state = self.seal.serving_epoch().await?;
        if state.epoch() != epoch || revision <= 0 || split_reader(key).is_some() {
            return Ok(None);
        }
        let reader = crate::records::reader_key(key, session);
        let Some(h) = self.holder(&reader).await? else {
            return Ok(None);
        };
        if h.lease != session
            || h.record.session != session
            || h.record.identity != identity
            || h.record.class != class
            || h.record.downgraded_from != Some(revision)
        {
            return Ok(None);
        }
        let grant = Grant {
            key: reader,
            session,
            epoch: state.epoch(),
            revision: h.revision,
        };
        // Its token is handed out now: durable first, as a grant's.
        self.seal.make_durable(&state, h.revision).await?;
        // Claimed for this call as any existing grant answered again.
        Ok(match self.claim_verified(&grant).await? {
            Claim::Claimed => Some(grant),
            Claim::Gone => None,
        })
    }

    /// With waiters queued on lock `req.key`, a shared request is answered
    /// without queueing when its session holds the lock already: shared
    /// (its existing grant) or exclusively (`Some(None)`: downgrade it now,
    /// or it would wait behind waiters who wait for it).
    pub(super) async fn shared_held(
        &self,
        req: &GrantRequest,
    ) -> Result<Option<Option<Grant>>, ArbiterError> {
        let state = self.seal.serving_epoch().await?;
        let key = reader_key(&req.key, req.session);
        if let Some(h) = self.holder(&key).await?
            && h.lease == req.session
            && h.record.identity == req.identity
        {
            return Ok(Some(Some(Grant {
                key,
                session: req.session,
                epoch: state.epoch(),
                revision: h.revision,
            })));
        }
        Ok(self
            .holder(&req.key)
            .await?
            .filter(|h| h.lease == req.session && h.record.identity == req.identity)
            .map(|_| None))
    }

    /// Whether `req`'s session holds its key shared.
    pub(super) async fn holds_shared(&self, req: &GrantRequest) -> Result<bool, ArbiterError> {
        Ok(self
            .holder(&reader_key(&req.key, req.session))
            .await?
            .is_some_and(|h| h.lease == req.session && h.record.identity == req.identity))
    }

    /// The shared holds of lock `name`, in session order (empty for a key
    /// held exclusively or not at all).
    pub async fn reader_holders(&self, name: &str) -> Result<Vec<HolderView>, ArbiterError> {
        let (holds, _) = self
            .seal
            .checked(self.log.holders_under(&readers_of(name)))
            .await?;
        Ok(holds
            .into_iter()
            .filter(|(key, _)| split_reader(key).is_some_and(|(of, _)| of == name))
            .filter_map(|(_, kv)| holder_view(kv))
            .collect())
    }

    /// Grants the readers at the head of a queue together: every one's
    /// grant goes to the log in one batch (one transaction, up to the
    /// batch limit), so a writer's end lets all the readers queued behind
    /// it in at once. Each delivered grant leaves the queue; a reader whose
    /// grant did not commit stays at the head for the driver's next attempt.
    /// Whether any was delivered.
    pub(super) async fn grant_readers(self: &Arc<Self>, heads: Vec<Head>) -> bool {
        let reqs: Vec<GrantRequest> = heads.iter().map(|h| reader_request(&h.req)).collect();
        // Registered before the gate is looked at (see `writing`), as in
        // every grant: each reader's key, and the lock's name.
        let mut _writing: Vec<_> = reqs.iter().map(|r| self.write_on(&r.key)).collect();
        if let Some(first) = heads.first() {
            _writing.push(self.write_on(&first.req.key));
        }
        let mut ready = Vec::new();
        for (head, req) in heads.iter().zip(&reqs) {
            if let Ok(Ok((member, state))) = self
                .prepare_grant(req, crate::lock_log::QueueTurn::Empty)
                .await
            {
                ready.push((head, req, member, state));
            }
        }
        if ready.is_empty() {
            return false;
        }
        let members = ready.iter().map(|(_, _, m, _)| m.clone()).collect();
        // Each on its way until its reader is answered; one dropped
        // unfinished (an error, or this future dropped) leaves its outcome
        // unknown.
        let sending: Vec<_> = ready.iter().map(|(head, ..)| head.sending()).collect();
        let answers = self.commit_together(members).await;
        let mut delivered = false;
        for (((head, req, _, state), answer), sending) in
            ready.into_iter().zip(answers).zip(sending)
        {
            // Committed or not, unknown: a wait that ends now is not a
            // plain timeout (`sending` drops unfinished).
            let Ok(answer) = answer else { continue };
            // Anything but a grant (held again, reused, refused): the
            // driver's own attempt for this head answers it.
            if let Ok(Some(Attempt::Granted(grant))) = self
                .granted_or_why(
                    req,
                    crate::lock_log::QueueTurn::Empty,
                    &state,
                    answer,
                    Asker::Queue,
                )
                .await
            {
                self.deliver(head, grant);
                delivered = true;
            }
            sending.done();
        }
        delivered
    }
}

/// The grant request of `req`'s shared hold: the same request for the
/// session's own reader key.
pub(super) fn reader_request(req: &GrantRequest) -> GrantRequest {
    GrantRequest {
        key: reader_key(&req.key, req.session),
        ..req.clone()
    }
}
