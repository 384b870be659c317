//! The one owner of every key's fate on one lock cluster (issue 32).
//!
//! Whether an Acquire is let in, whether it is granted through the lock log
//! or from memory while the cluster has no quorum (ADR-04), when a grant
//! from memory keeps a key from the log, and how a Release ends a hold (a
//! memory grant, or the log's hold with its hand-over to the next waiter),
//! and when a two-person force-release ends a hold whoever holds it: all
//! of it is decided here, by one [`KeyOwner`] per cluster, over the
//! cluster's [`LockTable`] (the log's grant protocol), its [`HoldCounts`]
//! (the per-subject bound on holds) and its [`QuorumLoss`] (the verdict,
//! the memory grants and their spool).
//!
//! The handlers in `service/` do identity, policy, hooks and metrics, and
//! ask the owner; none of them names quorum loss. `docs/grant-protocol.md`
//! ("The owner") says what it decides and in which order.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tracing::debug;

use crate::error::ArbiterError;
use crate::hold_counts::HoldCounts;
pub use crate::lock_log::{
    ForceEndTxn, ForceEnded, ForceRecords, RevokeSessionTxn, SessionRevoked, StoreError,
};
pub use crate::quorum_loss::MemoryGrant;
use crate::quorum_loss::QuorumLoss;
use crate::subject_counts::Admitted;
use crate::table::{Grant, GrantRequest, HolderView, LockTable, Released};

/// The owner of the keys of one lock cluster.
pub struct KeyOwner {
    table: Arc<LockTable>,
    holds: Arc<HoldCounts>,
    quorum: Arc<QuorumLoss>,
}

/// What a key's class asks of its grants.
#[derive(Debug, Clone, Copy)]
pub struct Terms<'a> {
    /// The class's name, for refusals.
    pub class: &'a str,
    /// `on_quorum_loss: open`: granted from memory, unprotected (token 0),
    /// while the cluster has no quorum. A closed class is refused then.
    pub open_on_loss: bool,
    /// `fairness: durable`: waiters queue in the log, not in memory.
    pub durable: bool,
    /// Waiters one key may have.
    pub max_waiters_per_key: u32,
    /// A shared hold is asked: never granted from memory (one arbiter's
    /// memory cannot keep a writer on another from the readers), so an
    /// open class refuses it during a loss as a closed one does.
    pub shared: bool,
    /// The class's `maxHoldSeconds`: a hold in the log ends that long
    /// after its grant (one timer per hold, from the grant's own time).
    pub max_hold: Option<Duration>,
}

/// An Acquire the owner let in, not yet granted. Dropped, it gives back
/// its place in the subject's hold count.
pub struct Admission {
    /// `None`: the cluster had no quorum when it was let in, and the grant
    /// comes from memory (no hold is written to the log).
    holds: Option<Admitted>,
}

/// How an Acquire was granted.
#[derive(Debug)]
pub enum Granted {
    /// Through the lock log: a fencing token.
    Log {
        grant: Grant,
        /// It queued before it was granted.
        waited: bool,
    },
    /// From memory during quorum loss: unprotected, token 0 (ADR-04).
    Memory(MemoryGrant),
}

/// How a Release ended a hold.
#[derive(Debug)]
pub struct Ended {
    pub released: Released,
    /// It was a grant from memory during quorum loss (nothing in the log).
    pub from_memory: bool,
}

impl KeyOwner {
    /// The owner of `table`'s keys. It installs the quorum-loss posture as
    /// the table's key gate, so a live memory grant keeps its key from the
    /// table's grants and hand-overs: one place wires it.
    pub fn new(table: Arc<LockTable>, holds: Arc<HoldCounts>, quorum: Arc<QuorumLoss>) -> Self {
        table.set_gate(quorum.clone());
        Self {
            table,
            holds,
            quorum,
        }
    }

    /// Lets an Acquire of `key` by `subject` in, or refuses it, before
    /// anything else is spent on it (a hook, a queue place). Without quorum:
    /// a closed class is refused (nothing sent to etcd), an open one is let
    /// in to a memory grant (bounded by the spool, not the log's counts).
    /// With quorum: the subject's bound on holds, counting `beside` more
    /// holds counted on other clusters, waiting up to `count_wait` for the
    /// first count.
    pub async fn admit(
        &self,
        subject: &str,
        key: &str,
        beside: u32,
        count_wait: Duration,
        terms: &Terms<'_>,
    ) -> Result<Admission, ArbiterError> {
        if self.quorum.is_lost() {
            if !terms.open_on_loss {
                return Err(self.quorum.closed_refusal(terms.class));
            }
            if terms.shared {
                return Err(self.quorum.shared_refusal(terms.class));
            }
            return Ok(Admission { holds: None });
        }
        let holds = self
            .holds
            .admit_within_beside(subject, key, beside, count_wait)
            .await?;
        Ok(Admission { holds: Some(holds) })
    }

    /// Grants `req`, let in by `admission`: at once, or after waiting up to
    /// `wait` in the key's queue. Through the log, `before_log` runs first
    /// (the session's shadow on the key's shard: written only once every
    /// check has passed); a live memory grant of the key by another session
    /// keeps it until it ends. If the cluster loses its quorum while the
    /// call is at etcd, an open class is granted from memory and a closed
    /// one refused.
    pub async fn acquire(
        &self,
        admission: Admission,
        req: GrantRequest,
        wait: Option<Duration>,
        terms: &Terms<'_>,
        before_log: impl Future<Output = Result<(), ArbiterError>>,
    ) -> Result<Granted, ArbiterError> {
        let Some(admitted) = admission.holds else {
            return self
                .grant_from_memory(&req, wait)
                .await
                .map(Granted::Memory);
        };
        before_log.await?;
        // A memory grant from the loss keeps its key until it ends.
        self.quorum.before_log_grant(&req, wait).await?;
        let fallback = (terms.open_on_loss && !terms.shared).then(|| req.clone());
        let acquired = if terms.durable {
            self.table
                .acquire_durable(req, wait, terms.max_waiters_per_key)
                .await
        } else {
            self.table
                .acquire(req, wait, terms.max_waiters_per_key)
                .await
        };
        let acquired = match acquired {
            Ok(acquired) => acquired,
            Err(e @ ArbiterError::StoreUnavailable { .. }) if self.quorum.is_lost() => {
                // The loss was noticed while this call was at etcd, whose
                // outcome is not known: a refusal from memory is no
                // answer that nothing was written.
                return match fallback {
                    Some(req) => self
                        .grant_from_memory(&req, wait)
                        .await
                        .map(Granted::Memory)
                        .map_err(|refused| {
                            let detail = match &e {
                                ArbiterError::StoreUnavailable { detail, .. } => detail.as_str(),
                                _ => "no answer",
                            };
                            let detail = format!(
                                "{detail}; then, with the quorum lost, not granted from memory either: {refused}"
                            );
                            // The store's failure stays the source (the
                            // refusal from memory is said in the detail).
                            ArbiterError::store_caused(detail, e)
                        }),
                    None => {
                        debug!(error = %e, "refused: quorum lost");
                        // The call was at etcd: its outcome is not known,
                        // so not the refusal of a call that sent nothing.
                        let detail = match self.quorum.closed_refusal(terms.class) {
                            ArbiterError::ClosedOnQuorumLoss { detail } => detail,
                            other => other.to_string(),
                        };
                        Err(ArbiterError::store(detail))
                    }
                };
            }
            Err(e) => return Err(e),
        };
        admitted.written(acquired.grant.revision);
        // The session now holds the key in the log: its memory grant (if
        // any) ends.
        self.quorum.granted_in_log(
            crate::records::named_key(&acquired.grant.key),
            acquired.grant.session,
        );
        self.bound(&acquired.grant, terms);
        Ok(Granted::Log {
            grant: acquired.grant,
            waited: acquired.waited,
        })
    }

    /// What a downgrade naming `token` finds before its hooks: `Some`, a
    /// repeat of one that landed (answered with the hold it made);
    /// `None`, the session's exclusive hold at that token, to convert;
    /// neither is [`ArbiterError::DowngradeNotHeld`], with nothing written
    /// (a client's clean-up asks again after its hold ended; no hook
    /// decides that).
    pub async fn downgrade_asked(
        &self,
        identity: &str,
        key: &str,
        session: i64,
        token: u64,
        terms: &Terms<'_>,
    ) -> Result<Option<Grant>, ArbiterError> {
        let repeated = self
            .downgraded_already(identity, key, session, token, terms)
            .await?;
        if repeated.is_none()
            && !self
                .holds_exclusively_at(identity, key, session, token)
                .await?
        {
            return Err(ArbiterError::DowngradeNotHeld {
                key: key.to_string(),
            });
        }
        Ok(repeated)
    }

    /// A repeat of a downgrade that landed, its answer lost
    /// ([`LockTable::downgraded_already`]): asked before the downgrade's
    /// hooks, so it is answered with the session's hold whatever they would
    /// say now.
    pub async fn downgraded_already(
        &self,
        identity: &str,
        key: &str,
        session: i64,
        token: u64,
        terms: &Terms<'_>,
    ) -> Result<Option<Grant>, ArbiterError> {
        if self.quorum.is_lost() {
            return Ok(None);
        }
        let grant = self
            .table
            .downgraded_already(identity, key, session, token, terms.class)
            .await?;
        if let Some(grant) = &grant {
            // as the downgrade that made it (perhaps on another arbiter)
            self.bound(grant, terms);
        }
        Ok(grant)
    }

    /// Whether `session` (of `identity`) holds lock `key` exclusively at
    /// exactly `token` ([`LockTable::holds_exclusively_at`]): what a
    /// downgrade naming it converts. Read only.
    pub async fn holds_exclusively_at(
        &self,
        identity: &str,
        key: &str,
        session: i64,
        token: u64,
    ) -> Result<bool, ArbiterError> {
        if self.quorum.is_lost() {
            // Answered by the downgrade itself (refused without quorum).
            return Ok(true);
        }
        self.table
            .holds_exclusively_at(identity, key, session, token)
            .await
    }

    /// A downgrade named by its exclusive hold's token
    /// (`AcquireRequest.downgrade_from`, [`LockTable::downgrade_from`]):
    /// made in the lock log only, never waits, never a fresh grant.
    ///
    /// No admission: it turns a hold the session has into another, so the
    /// hold count does not grow (a subject at its bound still downgrades).
    /// No shadow either: a key homed on another shard that the session
    /// holds there has its shadow already; one it does not hold is refused
    /// NOT_HELD, and a refusal writes nothing.
    pub async fn downgrade(
        &self,
        req: GrantRequest,
        token: u64,
        terms: &Terms<'_>,
    ) -> Result<Granted, ArbiterError> {
        if self.quorum.is_lost() {
            // Shared holds are never granted from memory (a writer on
            // another arbiter would not see them).
            return Err(self.quorum.shared_refusal(terms.class));
        }
        self.quorum.before_log_grant(&req, None).await?;
        let grant = self.table.downgrade_from(&req, token).await?;
        self.quorum
            .granted_in_log(crate::records::named_key(&grant.key), grant.session);
        self.bound(&grant, terms);
        Ok(Granted::Log {
            grant,
            waited: false,
        })
    }

    /// The class's `maxHoldSeconds` for a hold in the log: it ends that
    /// long after its grant.
    fn bound(&self, grant: &Grant, terms: &Terms<'_>) {
        if let Some(max) = terms.max_hold {
            self.table
                .end_after(&grant.key, grant.session, grant.revision, max);
        }
    }

    /// A grant from memory (the cluster has no quorum, the class is open):
    /// never of a key the log shows held by another session.
    async fn grant_from_memory(
        &self,
        req: &GrantRequest,
        wait: Option<Duration>,
    ) -> Result<MemoryGrant, ArbiterError> {
        // A memory grant costs etcd nothing (and may wait): no place.
        crate::overload::parked();
        self.quorum
            .acquire(req, wait, &|key, session| {
                self.holds
                    .held_by_other(key, session, self.quorum.log_answered())
                    || self.table.writing(key)
                    // The hold count has not seen this arbiter's own last
                    // grant yet.
                    || self
                        .holds
                        .seen_through()
                        .is_none_or(|seen| seen < self.table.granted_through())
            })
            .await
    }

    /// Ends the caller's hold of `key`: its grant from memory during a
    /// quorum loss (token 0), else its hold in the log (handed over to the
    /// key's next waiter in the same transaction).
    pub async fn release(
        &self,
        identity: &str,
        key: &str,
        session: i64,
        token: u64,
    ) -> Result<Ended, ArbiterError> {
        if let Some(released) = self.quorum.release(identity, key, session, token).await {
            released?;
            return Ok(Ended {
                released: Released {
                    handed_over: false,
                    previous: None,
                },
                from_memory: true,
            });
        }
        let released = self.table.release(identity, key, session, token).await?;
        Ok(Ended {
            released,
            from_memory: false,
        })
    }

    /// Ends the hold a two-person force-release names, whoever holds it, if
    /// it is still exactly that hold (the request's lease and revision) and
    /// the approval's records are as read ([`ForceEndTxn`]): one
    /// transaction of the log, with the force-release path's credentials.
    /// A hold granted since, even a hand-over to the next waiter a moment
    /// ago, is left alone (`HoldChanged`). The outcome, with the revision
    /// it was decided at. A grant from memory during a quorum loss is not in
    /// the log and cannot be forced: it ends when its session does, or when
    /// the loss does.
    pub async fn force_end(&self, txn: ForceEndTxn<'_>) -> Result<(ForceEnded, i64), ArbiterError> {
        self.table.force_end(txn).await
    }

    /// The caller's CloseSession ([`LockTable::close_session`]): the
    /// session's record goes first, if it is still `identity`'s, then its
    /// lease and every hold on it, in one entry. The revision of the
    /// record's delete. A memory grant of the session (no quorum) is not in
    /// the log: the close cannot reach the log either, so it ends with its
    /// TTL or the loss.
    pub async fn close_session(
        &self,
        identity: &str,
        counted_as: &str,
        session: i64,
    ) -> Result<i64, ArbiterError> {
        self.table
            .close_session(identity, counted_as, session)
            .await
    }

    /// Ends `session`'s shadow in this cluster (ADR-09: a shard holding
    /// only the shadow of a session homed elsewhere, whose home session
    /// has ended): its lease, and every hold on it.
    pub async fn end_shadow(&self, session: i64) -> Result<(), StoreError> {
        self.table.log().revoke(session).await
    }

    /// An operator's revocation of the session whose hold (or leadership)
    /// a force-release ended, in this cluster's log
    /// ([`crate::lock_log::SessionLog::revoke_session`]): its record goes
    /// first, so it grants nothing more, then its lease and every hold on
    /// it.
    pub async fn revoke_session(
        &self,
        txn: RevokeSessionTxn<'_>,
    ) -> Result<SessionRevoked, StoreError> {
        self.table.log().revoke_session(txn).await
    }

    /// Calls waiting for `key` here (a hook's input).
    pub fn waiting(&self, key: &str) -> usize {
        self.table.waiting(key)
    }

    /// The key's holder in the log (a hook's input; an etcd read).
    pub async fn holder(&self, key: &str) -> Result<Option<HolderView>, ArbiterError> {
        self.table.holder(key).await
    }

    /// Holds of `subject` in `class` under `prefixes` (a hook's input; etcd
    /// reads).
    pub async fn count_holds_of(
        &self,
        subject: &str,
        class: &str,
        prefixes: &[&str],
    ) -> Result<u32, ArbiterError> {
        self.table.count_holds_of(subject, class, prefixes).await
    }
}
