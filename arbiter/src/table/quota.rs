//! Per-subject quotas that hold under concurrency (`maxHoldsPerSubject`).
//!
//! A class with a quota of N gives each grant subject N places in the log
//! (`p/<class>/<hex(subject)>/<index>`). Every grant of the class takes one
//! in its own transaction — the place is compared (absent, or stale) and
//! put on the session's lease together with the holder record, at the same
//! revision — so N+k concurrent Acquires of one subject, on any arbiters,
//! commit at most N grants: the rest find every place taken and are refused
//! `QUOTA_EXCEEDED`. (A count read before the grant, as the retired quota
//! hook did, let a burst of 12 through a quota of 2.)
//!
//! A place lasts as long as the hold that took it: its session's lease ends
//! both; a release frees it at once ([`LockTable::free_quota_place`]); and a
//! place whose hold is gone or changed hands since (a release whose free
//! was lost, a force-release, an orphan release, a hand-over) is stale: the
//! hold on its key is no longer at the place's revision, which the taking
//! transaction compares. A hand-over takes no place, so a release never
//! hands a quota class's key over: the next waiter's driver grants it with
//! a place. Indices at or above N (a quota lowered since) are never taken
//! again; their holds count until they end.

use std::collections::BTreeSet;
use std::sync::Arc;

use tracing::debug;

use super::{Grant, GrantRequest, LockTable};
use crate::error::ArbiterError;
use crate::lock_log::{Kv, PlaceWas, QuotaTake};
use crate::records::{HolderRecord, QuotaPlaceRecord, decode, encode};

/// What a grant attempt does about its class's quota.
pub(super) enum Taking {
    /// Take this place in the grant transaction.
    Take(QuotaTake),
    /// The session holds the key already, on a live place of its own: its
    /// existing grant (claimed before it reaches the call).
    Held(Grant),
}

/// Holds read at once when a full quota's places are checked for a stale one.
const HOLD_READS_AT_ONCE: usize = 32;

impl LockTable {
    /// The place `req`'s grant takes out of its subject's `max`, or
    /// `QUOTA_EXCEEDED` when every one is live.
    pub(super) async fn quota_take(
        &self,
        req: &GrantRequest,
        max: u32,
        epoch: u32,
    ) -> Result<Taking, ArbiterError> {
        let subject = req.bounded_as();
        let (places, _) = self
            .seal
            .checked(self.log.quota_places(&req.class, subject))
            .await?;
        let record = encode(&QuotaPlaceRecord {
            key: req.key.clone(),
            session: req.session,
        });
        let take = |index: u32, was: PlaceWas| QuotaTake {
            class: req.class.clone(),
            subject: subject.to_string(),
            index,
            record: record.clone(),
            was,
        };
        let taken: BTreeSet<u32> = places.iter().map(|(index, _)| *index).collect();
        let free: Vec<u32> = (0..max).filter(|i| !taken.contains(i)).collect();
        if !free.is_empty() {
            // Any free place, so that a burst spreads over them instead of
            // every grant racing for the first.
            let pick = self.jitter.lock().usize(..free.len());
            if let Some(&index) = free.get(pick) {
                return Ok(Taking::Take(take(index, PlaceWas::Free)));
            }
        }
        // Every place is taken: one whose hold has ended is taken again.
        let candidates: Vec<(u32, Kv, Option<QuotaPlaceRecord>)> = places
            .into_iter()
            .filter(|(index, _)| *index < max)
            .map(|(index, kv)| {
                let record = decode(&kv.value);
                (index, kv, record)
            })
            .collect();
        for chunk in candidates.chunks(HOLD_READS_AT_ONCE) {
            let reads = chunk.iter().map(|(_, _, record)| async move {
                match record {
                    Some(r) => self
                        .seal
                        .checked(self.log.holder(&r.key))
                        .await
                        .map(|(kv, _)| kv),
                    None => Ok(None),
                }
            });
            let holds = futures::future::join_all(reads).await;
            for ((index, place, record), hold) in chunk.iter().zip(holds) {
                // A place no arbiter wrote counts as taken: when in doubt, refuse.
                let Some(record) = record else { continue };
                let live = hold?.is_some_and(|h| h.mod_revision == place.mod_revision);
                if !live {
                    return Ok(Taking::Take(take(
                        *index,
                        PlaceWas::Stale {
                            revision: place.mod_revision,
                            key: record.key.clone(),
                        },
                    )));
                }
                if record.key == req.key && record.session == req.session {
                    return Ok(Taking::Held(Grant {
                        key: req.key.clone(),
                        session: req.session,
                        epoch,
                        revision: place.mod_revision,
                    }));
                }
            }
        }
        Err(ArbiterError::QuotaExceeded {
            class: req.class.clone(),
            subject: subject.to_string(),
            max,
        })
    }

    /// Frees the quota place of a hold that just ended at `revision`, in
    /// the background (a place left behind is stale and taken again anyway).
    pub(super) fn free_quota_place(self: &Arc<Self>, ended: Option<&HolderRecord>, revision: i64) {
        let Some(record) = ended else { return };
        let Some(index) = record.quota_place else {
            return;
        };
        let (class, subject) = (record.class.clone(), record.bounded_as().to_string());
        let table = self.clone();
        self.tasks.spawn(async move {
            let freed = table
                .seal
                .checked(table.log.free_quota_place(&class, &subject, index, revision))
                .await;
            if let Err(e) = freed {
                debug!(class = %class, error = %e, "could not free a quota place; it is taken again as stale");
            }
        });
    }
}
