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

/// The indices a grant may take out of a quota of `max`, given which
/// places are live: the largest `u ≤ max` with `u` + (live places at or
/// above `u`) ≤ `max`.
pub(super) fn usable_below(max: u32, live: &[(u32, bool)]) -> u32 {
    let mut u = max;
    loop {
        let above = live.iter().filter(|(i, l)| *l && *i >= u).count();
        let above = u32::try_from(above).unwrap_or(u32::MAX);
        if u.saturating_add(above) <= max {
            return u;
        }
        let lower = max.saturating_sub(above);
        if lower >= u {
            // Nothing lower to try (u is 0: more live above the quota
            // than it allows): nothing is usable until some end.
            return 0;
        }
        u = lower;
    }
}

/// A quota place as the log reads it: its index and its record.
type Place = (u32, Kv);

/// What a grant attempt does about its class's quota.
pub(super) enum Taking {
    /// Take this place in the grant transaction.
    Take(QuotaTake),
    /// The session holds the key already, on a live place of its own: its
    /// existing grant (claimed before it reaches the call).
    Held(Grant),
}

impl LockTable {
    /// The place `req`'s grant takes out of its subject's `max`: a free one,
    /// or a stale one (its hold ended), each picked at random so that a
    /// burst spreads over them. When every place is live, the caller's own
    /// hold of the key (a retry) is its existing grant; anything else is
    /// `QUOTA_EXCEEDED`.
    pub(super) async fn quota_take(
        &self,
        req: &GrantRequest,
        max: u32,
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
        // Only indices below `usable` are taken. With no place at or above
        // `max` that is `max`. After the quota was lowered, places at or
        // above it may still be live, and so may places between the new
        // `usable` and `max`: `usable` is lowered until the live places at
        // or above it leave room (`usable + live above ≤ max`), so the
        // subject's live holds never exceed `max`. A place seen ended never
        // lives again, so a later read only raises `usable`.
        let usable = match places.iter().any(|(index, _)| *index >= max) {
            false => max,
            true => {
                let all: Vec<&Place> = places.iter().collect();
                let live: Vec<(u32, bool)> = places
                    .iter()
                    .map(|(index, _)| *index)
                    .zip(self.live(&all).await?)
                    .collect();
                usable_below(max, &live)
            }
        };
        let taken: BTreeSet<u32> = places.iter().map(|(index, _)| *index).collect();
        let free: Vec<u32> = (0..usable).filter(|i| !taken.contains(i)).collect();
        if let Some(&index) = self.any_of(&free) {
            return Ok(Taking::Take(take(index, PlaceWas::Free)));
        }
        let low: Vec<&Place> = places.iter().filter(|(index, _)| *index < usable).collect();
        let live = self.live(&low).await?;
        let stale: Vec<(u32, i64, String)> = low
            .iter()
            .zip(live)
            .filter(|(_, live)| !live)
            .filter_map(|((index, place), _)| {
                decode::<QuotaPlaceRecord>(&place.value)
                    .map(|r| (*index, place.mod_revision, r.key))
            })
            .collect();
        if let Some((index, revision, key)) = self.any_of(&stale).cloned() {
            return Ok(Taking::Take(take(index, PlaceWas::Stale { revision, key })));
        }
        // Every place is live. A retry of a key the caller holds is its
        // existing grant (its session's and identity's, as `already_held`
        // checks: a place naming another session proves nothing).
        if let Some(grant) = self.already_held(req).await? {
            return Ok(Taking::Held(grant));
        }
        Err(ArbiterError::QuotaExceeded {
            class: req.class.clone(),
            subject: subject.to_string(),
            max,
        })
    }

    /// One of `items`, drawn from the table's seeded generator.
    pub(super) fn any_of<'a, T>(&self, items: &'a [T]) -> Option<&'a T> {
        match items.len() {
            0 => None,
            n => items.get(self.jitter.lock().usize(..n)),
        }
    }

    /// Whether each place's hold is still the one that took it (at the
    /// place's revision): one read of every hold the places name. A place
    /// no arbiter wrote counts as live: when in doubt, refuse.
    async fn live(&self, places: &[&Place]) -> Result<Vec<bool>, ArbiterError> {
        let keys: Vec<Option<String>> = places
            .iter()
            .map(|(_, place)| decode::<QuotaPlaceRecord>(&place.value).map(|r| r.key))
            .collect();
        let wanted: Vec<String> = keys.iter().flatten().cloned().collect();
        if wanted.is_empty() {
            return Ok(vec![true; places.len()]);
        }
        let (holds, _) = self.seal.checked(self.log.holders_of(&wanted)).await?;
        let mut holds = holds.into_iter();
        Ok(keys
            .iter()
            .zip(places)
            .map(|(key, (_, place))| match key {
                None => true,
                Some(_) => holds
                    .next()
                    .flatten()
                    .is_some_and(|h| h.mod_revision == place.mod_revision),
            })
            .collect())
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

#[cfg(test)]
mod tests {
    use super::usable_below;

    #[test]
    fn live_places_above_a_lowered_quota_keep_as_many_below_it_unused() {
        // no place above: the whole quota
        assert_eq!(usable_below(3, &[(0, true), (1, true)]), 3);
        // lowered from 4 to 3 with places 2 and 3 live: only index 0
        assert_eq!(usable_below(3, &[(2, true), (3, true)]), 1);
        // place 2 ended: indices 0 and 1
        assert_eq!(usable_below(3, &[(2, false), (3, true)]), 2);
        // lowered from 8 to 2 with 5 live above: nothing until they end
        let live: Vec<(u32, bool)> = (3..8).map(|i| (i, true)).collect();
        assert_eq!(usable_below(2, &live), 0);
        // every place ended: the whole quota again
        let ended: Vec<(u32, bool)> = (0..8).map(|i| (i, false)).collect();
        assert_eq!(usable_below(2, &ended), 2);
    }
}
