//! Semaphores (`kind = "semaphore"`, `permits = N`): a key of a semaphore
//! class carries up to N holds, each on a slot's own lock key
//! ([`crate::records::slot_key`], `<name>//s/<slot>`). A slot is an
//! exclusive lock in every other respect: one grant transaction compares it
//! absent and puts its holder record on the session's lease, its token is
//! above every earlier grant of the slot, its expiry, release, orphan
//! release and force-release are a lock's. So no more than N slots are ever
//! held (there are N keys), whichever arbiters grant them.
//!
//! What is the semaphore's own: which slot a grant tries (a free one below
//! the usable bound, picked at random so a burst spreads), that its
//! waiters queue on the semaphore's name (FIFO on the arbiter they called)
//! and its driver watches every slot, and that a release is never handed
//! over (a freed slot kicks the driver, whose grant takes the slot).
//!
//! A key is one kind at a time: a lock's grant compares its slots' range
//! empty and a slot's grant compares its semaphore's name not held as a
//! lock (both logs), so a token of one is never mistaken for the other's.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::quota::usable_below;
use super::{Asker, Attempt, Grant, GrantRequest, HolderView, LockTable, holder_view};
use crate::error::ArbiterError;
use crate::records::{HolderRecord, decode, slot_key, slots_of, split_slot};

/// Grant attempts on one read of the slots, before the caller queues.
const SLOT_TRIES: usize = 4;

impl LockTable {
    /// The held slots of semaphore `name`, in slot order (empty for a lock).
    pub async fn slot_holders(&self, name: &str) -> Result<Vec<(u32, HolderView)>, ArbiterError> {
        let (holds, _) = self
            .seal
            .checked(self.log.holders_under(&slots_of(name)))
            .await?;
        let mut held: Vec<(u32, HolderView)> = holds
            .into_iter()
            .filter_map(|(key, kv)| {
                let (of, slot) = split_slot(&key)?;
                (of == name).then_some(())?;
                Some((slot, holder_view(kv)?))
            })
            .collect();
        held.sort_by_key(|(slot, _)| *slot);
        Ok(held)
    }

    /// One grant attempt of a permit of semaphore `req.key` (its name):
    /// the session's own slot if it holds one (a retry, or a re-entrant
    /// call: its existing grant), else a grant of a free slot below the
    /// usable bound. `Held` when every usable slot is held, or when the
    /// slots tried were taken in between (the caller queues; the driver
    /// tries again on the next change of any slot).
    pub(super) async fn attempt_permit(
        self: &Arc<Self>,
        req: &GrantRequest,
        queued_with: u32,
        asker: Asker,
    ) -> Result<Attempt, ArbiterError> {
        // A waiter queued before a policy reload is granted by the permits
        // the policies give now (found by the hostile review: a lowered
        // number let old waiters take slots above it).
        let permits = self.permits_now(&req.class).unwrap_or(queued_with);
        let mut watch_from = None;
        for _ in 0..SLOT_TRIES {
            let (holds, header) = self
                .seal
                .checked(self.log.holders_under(&slots_of(&req.key)))
                .await?;
            watch_from.get_or_insert(header.revision + 1);
            // The session's own slot first: a retry or a re-entrant call is
            // answered with it whatever else is held (the second hostile
            // review: the class check below refused a holder's own retry).
            for (key, kv) in &holds {
                if split_slot(key).is_none_or(|(name, _)| name != req.key) {
                    continue;
                }
                if let Some(record) = decode::<HolderRecord>(&kv.value)
                    && record.session == req.session
                    && record.identity == req.identity
                {
                    let state = self.seal.serving_epoch().await?;
                    return Ok(Attempt::Reused(Grant {
                        key: key.clone(),
                        session: req.session,
                        epoch: state.epoch(),
                        revision: kv.mod_revision,
                    }));
                }
            }
            let mut live = Vec::new();
            for (key, kv) in &holds {
                let Some((name, slot)) = split_slot(key) else {
                    continue;
                };
                if name != req.key {
                    continue;
                }
                let record = decode::<HolderRecord>(&kv.value);
                // One class per semaphore: its permits are the class's, so
                // a caller cannot pick a class of more permits to exceed
                // them (the hostile review). Checked on the slots read; two
                // first grants of two classes racing can both pass, so the
                // bound is then the larger class's (policies/README).
                if let Some(record) = &record
                    && record.class != req.class
                {
                    return Err(ArbiterError::ClassInUse {
                        key: req.key.clone(),
                        held_class: record.class.clone(),
                        class: req.class.clone(),
                    });
                }
                live.push((slot, true));
            }
            // After permits were lowered, slots at or above them may still
            // be held: only slots below `usable` are taken, so the held
            // slots never exceed `permits` (as for quota places).
            let usable = usable_below(permits, &live);
            let taken: BTreeSet<u32> = live.iter().map(|(slot, _)| *slot).collect();
            let free: Vec<u32> = (0..usable).filter(|s| !taken.contains(s)).collect();
            let Some(&slot) = self.any_of(&free) else {
                break;
            };
            let slot_req = GrantRequest {
                key: slot_key(&req.key, slot),
                ..req.clone()
            };
            match self
                .attempt_in(&slot_req, crate::lock_log::QueueTurn::Empty, asker)
                .await
            {
                // taken in between, or by this process under another
                // session (no leak on a semaphore: a process may hold
                // several permits): read the slots again
                Ok(Attempt::Held { .. }) | Err(ArbiterError::Leak { .. }) => continue,
                other => return other,
            }
        }
        Ok(Attempt::Held {
            watch_from: watch_from.unwrap_or(0),
        })
    }

    /// The key of `identity`'s slot of semaphore `name` on `session` whose
    /// grant is `token`'s (what a release naming no slot means), if any.
    pub async fn own_slot(
        &self,
        name: &str,
        identity: &str,
        session: i64,
        token: u64,
    ) -> Result<Option<String>, ArbiterError> {
        let (_, revision) = crate::token::unpack(token);
        Ok(self
            .slot_holders(name)
            .await?
            .into_iter()
            .find(|(_, h)| {
                h.lease == session && h.revision == revision && h.record.identity == identity
            })
            .map(|(slot, _)| slot_key(name, slot)))
    }

    /// With waiters queued on semaphore `req.key`, the session's own slot,
    /// if it holds one (answered without queueing, as a lock's retry is).
    pub(super) async fn permit_held(
        &self,
        req: &GrantRequest,
    ) -> Result<Option<Grant>, ArbiterError> {
        let state = self.seal.serving_epoch().await?;
        Ok(self
            .slot_holders(&req.key)
            .await?
            .into_iter()
            .find(|(_, h)| h.lease == req.session && h.record.identity == req.identity)
            .map(|(slot, h)| Grant {
                key: slot_key(&req.key, slot),
                session: req.session,
                epoch: state.epoch(),
                revision: h.revision,
            }))
    }
}
