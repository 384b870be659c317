//! The grant transactions of a table: one grant attempt, a session's
//! existing grant claimed for its new call, ownership of a hold, hand-over
//! and release. Each is one log request whose answer the seal checks first.

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::Instrument as _;

use super::batch::{GrantMember, Member};
use super::quota::Taking;
use super::{Asker, Attempt, Claim, Grant, GrantRequest, LockTable, Next, Released};
use crate::epoch::EpochState;
use crate::error::ArbiterError;
use crate::lock_log::{
    BatchOutcome, Claimed, Granted, HandOverFrom, HandOverTxn, HeldAt, QueueTurn, ReleaseTxn,
    ReleasedIf,
};
use crate::records::{HolderRecord, NotOwned, SessionRecord, check_owner, decode, encode};

impl LockTable {
    /// One grant attempt, retried a few times when a refusal came from a
    /// change under it (epoch advanced, shard-map fence raised, key freed
    /// between compare and read),
    /// never answered with a guess.
    pub(super) async fn attempt(
        self: &Arc<Self>,
        req: &GrantRequest,
        asker: Asker,
    ) -> Result<Attempt, ArbiterError> {
        match (req.permits, req.shared) {
            (Some(permits), _) => self.attempt_permit(req, permits, asker).await,
            (None, true) => self.attempt_shared(req, asker).await,
            (None, false) => self.attempt_in(req, QueueTurn::Empty, asker).await,
        }
    }

    /// [`Self::attempt`] at a place in the key's durable queue.
    pub(super) async fn attempt_in(
        self: &Arc<Self>,
        req: &GrantRequest,
        turn: QueueTurn,
        asker: Asker,
    ) -> Result<Attempt, ArbiterError> {
        for _ in 0..4 {
            if let Some(attempt) = self.grant_once(req, turn, asker).await? {
                return Ok(attempt);
            }
        }
        Err(ArbiterError::store(
            "the lock log kept changing under the grant transaction",
        ))
    }

    pub(super) async fn grant_once(
        self: &Arc<Self>,
        req: &GrantRequest,
        turn: QueueTurn,
        asker: Asker,
    ) -> Result<Option<Attempt>, ArbiterError> {
        // Registered before the gate is looked at (see `writing`). A slot's
        // or a shared hold's grant is also a write of its name, which a
        // memory grant of the name as a lock must wait for, and the gate
        // is asked about the name too (a writer is never beside a reader).
        let _writing = self.write_on(&req.key);
        let named = crate::records::named_key(&req.key);
        let _writing_name = (named != req.key).then(|| self.write_on(named));
        let (member, state) = match self.prepare_grant(req, turn).await? {
            Ok(ready) => ready,
            Err(answered) => return Ok(Some(answered)),
        };
        let answer = self.commit(member).await?;
        self.granted_or_why(req, turn, &state, answer, asker).await
    }

    /// A grant's transaction for `req`, with the epoch state it was made
    /// against; or the attempt's answer when nothing is to be sent (gated,
    /// or the session's own place of a quota already held).
    pub(super) async fn prepare_grant(
        self: &Arc<Self>,
        req: &GrantRequest,
        turn: QueueTurn,
    ) -> Result<Result<(Member, EpochState), Attempt>, ArbiterError> {
        let named = crate::records::named_key(&req.key);
        if self.gated(req)
            || (named != req.key
                && self.gated(&GrantRequest {
                    key: named.to_string(),
                    ..req.clone()
                }))
        {
            return Ok(Err(Attempt::Gated));
        }
        let state = self.seal.serving_epoch().await?;
        routed_in_time(&state, req)?;
        let quota = match req.quota {
            None => None,
            Some(max) => match self.quota_take(req, max).await? {
                Taking::Take(take) => Some(take),
                Taking::Held(grant) => return Ok(Err(Attempt::Reused(grant))),
            },
        };
        let member = Member::Grant(GrantMember {
            key: req.key.clone(),
            session: req.session,
            holder_record: req.holder_bytes(quota.as_ref().map(|take| take.index)),
            epoch_bytes: state.bytes.clone(),
            epoch: state.epoch(),
            fence_at: state.fence_at,
            session_record: req.session_bytes(),
            queue: turn,
            quota,
        });
        Ok(Ok((member, state)))
    }

    /// What a grant's transaction answered, as an attempt: `None` when the
    /// refusal came from a change under it and another attempt decides.
    pub(super) async fn granted_or_why(
        self: &Arc<Self>,
        req: &GrantRequest,
        turn: QueueTurn,
        state: &EpochState,
        answer: (BatchOutcome, crate::lock_log::Header),
        asker: Asker,
    ) -> Result<Option<Attempt>, ArbiterError> {
        let (granted, header) = match answer {
            (BatchOutcome::Grant(granted), header) => (granted, header),
            (BatchOutcome::Release(_), _) => {
                return Err(ArbiterError::internal(
                    "the lock log answered a grant as a release",
                ));
            }
        };
        let (
            holder,
            epoch_now,
            sealed,
            session,
            queue_head,
            fence_at,
            other_kind,
            other_mode,
            intent,
        ) = match granted {
            Granted::Yes => {
                self.granted_at(header.revision);
                let grant = Grant {
                    key: req.key.clone(),
                    session: req.session,
                    epoch: state.epoch(),
                    revision: header.revision,
                };
                if let Err(e) = self.seal.make_durable(state, header.revision).await {
                    // Committed, but its token may not be handed out:
                    // the grant goes as an orphan rather than stay a
                    // hold its session never heard of (the second
                    // hostile review of this stop).
                    self.release_orphan(grant);
                    return Err(e);
                }
                return Ok(Some(Attempt::Granted(grant)));
            }
            Granted::No {
                holder,
                epoch,
                sealed,
                session,
                queue_head,
                fence_at,
                other_kind,
                other_mode,
                intent,
            } => (
                holder, epoch, sealed, session, queue_head, fence_at, other_kind, other_mode,
                intent,
            ),
        };
        if sealed
            || epoch_now.as_deref() != Some(state.bytes.as_slice())
            || fence_at != state.fence_at
        {
            // The epoch moved, the log was sealed or a shard move raised the
            // fence under us: re-read, and let the caller try again against
            // the new state.
            self.seal.load_epoch().await?;
            self.seal.serving()?;
            return Ok(None);
        }
        match session.and_then(|bytes| decode::<SessionRecord>(&bytes)) {
            Some(s) if s.identity == req.identity && s.ttl_seconds != req.ttl_seconds => {
                return Err(ArbiterError::SessionClassMismatch {
                    session: req.session,
                    session_ttl: s.ttl_seconds,
                    class: req.class.clone(),
                    class_ttl: req.ttl_seconds,
                });
            }
            Some(s) if s.identity == req.identity => {}
            _ => {
                return Err(ArbiterError::SessionExpired {
                    session: req.session,
                });
            }
        }
        if other_kind && holder.is_none() {
            let (name, held_as, asked_as) = match crate::records::hold_kind(&req.key) {
                (crate::records::HoldKind::Slot, name) => (name, "lock", "semaphore"),
                (_, name) => (name, "semaphore", "lock"),
            };
            return Err(ArbiterError::KindInUse {
                key: name.to_string(),
                held_as,
                asked_as,
            });
        }
        if let (QueueTurn::Mine { created }, None, Some(head)) = (turn, &holder, &queue_head)
            && head.create_revision < created
        {
            // A durable waiter not yet first: whatever else is in the way
            // (the other mode's holds, an intent), it reads the queue's
            // head until its turn instead of sending a grant on every hint
            // (the second hostile review).
            self.note_head(crate::records::named_key(&req.key), req.session, head)
                .await;
            return Ok(Some(Attempt::Behind {
                watch_from: header.revision + 1,
            }));
        }
        if let (None, Some(other)) = (&holder, other_mode) {
            // Held in the other mode: a shared hold's grant found the lock
            // held exclusively, or an exclusive grant found it shared.
            return self
                .other_mode(req, state, other, header.revision + 1, asker)
                .await
                .map(Some);
        }
        if let (None, Some(intent)) = (&holder, intent) {
            // A shared grant kept out by a writer waiting (on any arbiter)
            // for the lock's shared holds to end: wait for its intent to go.
            let name = crate::records::named_key(&req.key);
            self.note_intent(name, req.session, &intent).await;
            return Ok(Some(Attempt::Intent {
                watch_from: header.revision + 1,
            }));
        }
        let Some(holder) = holder else {
            // Free: the durable queue refused it, or (everything matching
            // by the time it was read) the key was freed in between and
            // another attempt decides.
            return Ok(match (turn, queue_head) {
                (QueueTurn::Empty, Some(head)) => {
                    self.note_head(crate::records::named_key(&req.key), req.session, &head)
                        .await;
                    Some(Attempt::Behind {
                        watch_from: header.revision + 1,
                    })
                }
                (QueueTurn::Mine { created }, Some(head)) if head.create_revision < created => {
                    self.note_head(crate::records::named_key(&req.key), req.session, &head)
                        .await;
                    Some(Attempt::Behind {
                        watch_from: header.revision + 1,
                    })
                }
                (QueueTurn::Mine { created }, ref head)
                    if head.as_ref().is_none_or(|h| h.create_revision > created) =>
                {
                    Some(Attempt::Unqueued)
                }
                _ => None,
            });
        };
        match decode::<HolderRecord>(&holder.value) {
            Some(h) if h.session == req.session => {
                // Idempotent retry: the same grant, same token.
                Ok(Some(Attempt::Reused(Grant {
                    key: req.key.clone(),
                    session: req.session,
                    epoch: state.epoch(),
                    revision: holder.mod_revision,
                })))
            }
            Some(h) if super::is_leak(&h.identity, &h.instance, h.session, req) => {
                Err(ArbiterError::Leak {
                    key: req.key.clone(),
                    holder_session: h.session,
                    session: req.session,
                    instance: req.instance.clone(),
                })
            }
            _ => Ok(Some(Attempt::Held {
                watch_from: header.revision + 1,
            })),
        }
    }

    /// With waiters queued, a caller that already holds the key (a retry) or
    /// holds it under another session (a leak) is answered without queueing.
    pub(super) async fn already_held(
        &self,
        req: &GrantRequest,
    ) -> Result<Option<Grant>, ArbiterError> {
        let state = self.seal.serving_epoch().await?;
        let Some(holder) = self.holder(&req.key).await? else {
            return Ok(None);
        };
        if holder.lease == req.session && holder.record.identity == req.identity {
            return Ok(Some(Grant {
                key: req.key.clone(),
                session: req.session,
                epoch: state.epoch(),
                revision: holder.revision,
            }));
        }
        if super::is_leak(
            &holder.record.identity,
            &holder.record.instance,
            holder.record.session,
            req,
        ) {
            return Err(ArbiterError::Leak {
                key: req.key.clone(),
                holder_session: holder.record.session,
                session: req.session,
                instance: req.instance.clone(),
            });
        }
        Ok(None)
    }

    pub(super) async fn next_after(&self, attempt: Attempt) -> Result<Next, ArbiterError> {
        Ok(match attempt {
            Attempt::Granted(grant) => Next::Deliver(grant),
            Attempt::Reused(grant) => self.reuse(grant).await?,
            Attempt::Held { watch_from }
            | Attempt::Readers { watch_from }
            | Attempt::Intent { watch_from }
            | Attempt::Behind { watch_from, .. } => Next::Queue(Some(watch_from)),
            Attempt::Gated => Next::Queue(None),
            Attempt::Unqueued => {
                return Err(ArbiterError::internal(
                    "a grant outside the durable queue was answered as a durable waiter's",
                ));
            }
        })
    }

    /// A session's existing grant goes to this call only once claimed and
    /// re-read; otherwise the call queues, watching from after it.
    pub(super) async fn reuse(&self, grant: Grant) -> Result<Next, ArbiterError> {
        Ok(match self.claim_verified(&grant).await? {
            Claim::Claimed => Next::Deliver(grant),
            // gone (perhaps released as an orphan first): queue behind the
            // others and watch for what comes next
            Claim::Gone => Next::Queue(Some(grant.revision + 1)),
        })
    }

    /// Claims a session's existing grant (read from the log a moment ago)
    /// for a new call of that session: one transaction that finds the hold
    /// still there and records the claim, after which no orphan release
    /// deletes it. `Gone` if it went in between.
    pub(super) async fn claim_verified(&self, grant: &Grant) -> Result<Claim, ArbiterError> {
        // A write whose answer reaches a caller (the grant, as "already
        // yours"): checked against the witness like a grant, so a hold a
        // restore brought back is never handed out again.
        let (claimed, _) = self
            .seal
            .checked_write(
                self.log.claim(&grant.key, grant.session, grant.revision),
                |claimed| *claimed == Claimed::Now,
            )
            .await?;
        Ok(match claimed {
            Claimed::Now | Claimed::Already => Claim::Claimed,
            Claimed::Gone => Claim::Gone,
        })
    }

    /// The hold on `key` if it is `identity`'s through `session` at
    /// `revision`; otherwise `NotHeld` — the same answer for another
    /// identity's hold as for no hold, so session ids and tokens read from
    /// somewhere are no oracle — or `TokenMismatch` for the caller's own hold
    /// at another revision.
    pub(super) async fn owned_hold(
        &self,
        key: &str,
        identity: &str,
        session: i64,
        revision: i64,
    ) -> Result<HeldAt, ArbiterError> {
        let (kv, _) = self.seal.checked(self.log.holder(key)).await?;
        let record = kv.as_ref().and_then(|kv| decode::<HolderRecord>(&kv.value));
        let checked = match &kv {
            Some(kv) => check_owner(
                record.as_ref(),
                kv.lease,
                kv.mod_revision,
                identity,
                session,
                revision,
            ),
            None => Err(NotOwned::NotHeld),
        };
        match (checked, kv) {
            (Ok(()), Some(kv)) => Ok(HeldAt {
                key: key.to_string(),
                session,
                revision,
                value: kv.value,
            }),
            (Err(NotOwned::TokenMismatch), _) => Err(ArbiterError::TokenMismatch {
                key: key.to_string(),
            }),
            _ => Err(ArbiterError::NotHeld {
                key: key.to_string(),
                session,
            }),
        }
    }

    /// Releases the caller's hold in one transaction whose compares are
    /// [`Self::owned_hold`]'s checks: on the session's lease, at the token's
    /// revision, its record naming the identity and the session (its first
    /// bytes, [`owner_prefix`]). A refusal answers exactly as
    /// [`Self::owned_hold`] would for the hold the failure branch read.
    /// `None`: a record that names the caller in bytes other than the ones
    /// this arbiter writes; the read-then-compare path decides then.
    pub(super) async fn release_checked(
        self: &Arc<Self>,
        identity: &str,
        key: &str,
        session: i64,
        revision: i64,
    ) -> Result<Option<Released>, ArbiterError> {
        let Some(owner) = owner_prefix(identity, session) else {
            return Ok(None);
        };
        let member = Member::Release(ReleaseTxn {
            key: key.to_string(),
            session,
            revision,
            owner,
        });
        let holder = match self.commit(member).await? {
            (BatchOutcome::Release(ReleasedIf::Yes(bytes)), _) => {
                return Ok(Some(Released {
                    handed_over: false,
                    previous: decode(&bytes),
                }));
            }
            (BatchOutcome::Release(ReleasedIf::No { holder }), _) => holder,
            (BatchOutcome::Grant(_), _) => {
                return Err(ArbiterError::internal(
                    "the lock log answered a release as a grant",
                ));
            }
        };
        let checked = match &holder {
            Some(kv) => check_owner(
                decode::<HolderRecord>(&kv.value).as_ref(),
                kv.lease,
                kv.mod_revision,
                identity,
                session,
                revision,
            ),
            None => Err(NotOwned::NotHeld),
        };
        match checked {
            Ok(()) => Ok(None),
            Err(NotOwned::TokenMismatch) => Err(ArbiterError::TokenMismatch {
                key: key.to_string(),
            }),
            Err(NotOwned::NotHeld) => Err(ArbiterError::NotHeld {
                key: key.to_string(),
                session,
            }),
        }
    }

    /// Hands `held` straight to `next` in one transaction. `None` if any
    /// compare failed (the caller then does a plain release, which answers
    /// why).
    #[tracing::instrument(
        name = "lock.hand_over",
        target = "latchkey_otel",
        level = "trace",
        skip_all
    )]
    pub(super) async fn hand_over(
        &self,
        from: HandOverFrom<'_>,
        next: &GrantRequest,
    ) -> Result<Option<(Grant, Option<HolderRecord>)>, ArbiterError> {
        // Registered before the gate is looked at (see `writing`); kept from
        // the next waiter now, the plain release follows.
        let _writing = self.write_on(&next.key);
        if self.gated(next) {
            return Ok(None);
        }
        let state = self.seal.serving_epoch().await?;
        // A waiter routed by an older map than the cluster's fence gets
        // nothing here: the plain release follows, and its own attempt
        // answers it why.
        if routed_in_time(&state, next).is_err() {
            return Ok(None);
        }
        let next_session = next.session_bytes();
        let (done, header) = self
            .seal
            .checked_write(
                self.log.hand_over(HandOverTxn {
                    from,
                    next_session: next.session,
                    holder_record: next.holder_bytes(None),
                    epoch: &state.bytes,
                    fence_at: state.fence_at,
                    next_session_record: &next_session,
                }),
                Option::is_some,
            )
            .instrument(tracing::trace_span!(
                target: crate::telemetry::TARGET,
                "etcd.txn",
                txn = "hand_over"
            ))
            .await?;
        let Some(previous) = done else {
            return Ok(None);
        };
        self.granted_at(header.revision);
        self.seal.make_durable(&state, header.revision).await?;
        Ok(Some((
            Grant {
                key: from.key().to_string(),
                session: next.session,
                epoch: state.epoch(),
                revision: header.revision,
            },
            previous.and_then(|bytes| decode(&bytes)),
        )))
    }

    /// Deletes the caller's hold; returns its record (for the metrics).
    /// `NotHeld` if it changed since it was found (expired, or released by
    /// another call of the same caller).
    pub(super) async fn release_owned(
        &self,
        held: &HeldAt,
    ) -> Result<Option<HolderRecord>, ArbiterError> {
        // Checked against the witness like a grant: a release that deletes
        // a hold a restore brought back must not answer "released" (the
        // hold had ended in the timeline the caller lived in).
        let (deleted, _) = self
            .seal
            .checked_write(self.log.release(held), Option::is_some)
            .instrument(tracing::trace_span!(
                target: crate::telemetry::TARGET,
                "etcd.txn",
                txn = "release"
            ))
            .await?;
        match deleted {
            Some(bytes) => Ok(decode(&bytes)),
            None => Err(ArbiterError::NotHeld {
                key: held.key.clone(),
                session: held.session,
            }),
        }
    }
}

/// The first bytes of every holder record of `identity`'s hold through
/// `session`, as this arbiter encodes records (a fixed field order, identity
/// then session): `{"identity":"…","session":…,`. The trailing comma ends
/// the session's digits, the closing quote the identity, so no other
/// identity or session shares them. `None` if the encoding ever stops
/// looking like that (the release then reads and checks first).
/// Refuses a request routed by an older shard map than the one the
/// cluster is fenced at (as last read; the grant compares the fence again).
pub(super) fn routed_in_time(state: &EpochState, req: &GrantRequest) -> Result<(), ArbiterError> {
    match req.routed_by {
        Some(routed) if state.fence_version > routed => Err(ArbiterError::ShardMapAhead {
            cluster: state.fence_version,
            arbiter: routed,
        }),
        _ => Ok(()),
    }
}

pub(super) fn owner_prefix(identity: &str, session: i64) -> Option<Vec<u8>> {
    const REST: &[u8] = br#""class":"","acquiredAtUnixMs":0,"annotations":{}}"#;
    let record = encode(&HolderRecord {
        identity: identity.to_string(),
        session,
        class: String::new(),
        acquired_at_unix_ms: 0,
        annotations: BTreeMap::new(),
        instance: String::new(),
        bound: String::new(),
        quota_place: None,
        downgraded_from: None,
    });
    let owner = record.strip_suffix(REST)?;
    owner.ends_with(b",").then(|| owner.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(identity: &str, session: i64, class: &str) -> Vec<u8> {
        let mut annotations = BTreeMap::new();
        annotations.insert("ticket".to_string(), "CHG-1".to_string());
        encode(&HolderRecord {
            identity: identity.to_string(),
            session,
            class: class.to_string(),
            acquired_at_unix_ms: 1_700_000_000_000,
            annotations,
            instance: "pod-7:12".into(),
            bound: "spiffe://td/ns/a/*".into(),
            quota_place: None,
            downgraded_from: None,
        })
    }

    #[test]
    fn the_owner_prefix_begins_exactly_the_owners_records() {
        let owner = owner_prefix("spiffe://td/alice", 12).unwrap_or_default();
        assert!(!owner.is_empty());
        assert!(record("spiffe://td/alice", 12, "demo").starts_with(&owner));
        assert!(record("spiffe://td/alice", 12, "").starts_with(&owner));
        for (identity, session) in [
            ("spiffe://td/alice2", 12),
            ("spiffe://td/alic", 12),
            ("spiffe://td/bob", 12),
            ("spiffe://td/alice", 1),
            ("spiffe://td/alice", 123),
            ("spiffe://td/alice", -12),
        ] {
            assert!(
                !record(identity, session, "demo").starts_with(&owner),
                "{identity} {session}"
            );
        }
    }

    #[test]
    fn identities_that_need_escaping_keep_their_prefix_apart() {
        // A quote in an identity is escaped, so it cannot close the string
        // early and make one identity's records begin with another's prefix.
        let sly = r#"a","session":12,"#;
        let owner = owner_prefix("a", 12).unwrap_or_default();
        assert!(!record(sly, 99, "demo").starts_with(&owner));
        let own = owner_prefix(sly, 99).unwrap_or_default();
        assert!(record(sly, 99, "demo").starts_with(&own));
    }
}
