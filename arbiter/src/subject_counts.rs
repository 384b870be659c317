//! Entries of the log counted per grant subject, for a per-identity bound
//! that holds over every arbiter without reading etcd per call: the holds
//! ([`crate::hold_counts`]) and the open sessions
//! ([`crate::session_counts`]).
//!
//! The count comes from the log itself, read once and then followed by a
//! watch ([`crate::follow`]), so it counts what every
//! arbiter wrote and everything that ended, expiries included. Beside it
//! are this arbiter's own writes the watch has not shown yet: an entry
//! admitted here counts from its admission until the watch shows it (by its
//! key, or by reaching the revision it was written at), and an entry ended
//! here stops counting from the end's answer on. So the count never misses
//! what this arbiter wrote itself; it can only miss what other arbiters
//! wrote and this watch has not reached yet (milliseconds): the bound is
//! passed by no more than what they admit in that time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use tokio::time::Instant;

use crate::error::{ArbiterError, IdentityBound};

pub struct SubjectCounts {
    max: u32,
    bound: IdentityBound,
    /// What a refusal before the count is in says is being counted.
    counting: &'static str,
    state: Mutex<State>,
    /// Wakes calls that wait for a count to be in.
    counted: tokio::sync::Notify,
}

/// One change of one counted entry: whose it was before and after (a new
/// entry has no `before`, an ended one no `after`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub key: String,
    pub before: Option<String>,
    pub after: Option<String>,
}

#[derive(Default)]
struct State {
    /// Entries in the log per subject; `None` until a count is in (and,
    /// for a count that waits for its watch, while the watch is lost).
    /// Subjects with no entry leave the map.
    in_log: Option<HashMap<String, u32>>,
    /// The log revision `in_log` reflects.
    revision: i64,
    /// This arbiter's writes that `in_log` may not have yet, per subject.
    pending: HashMap<String, Vec<Pending>>,
    /// Ids for [`Pending`] entries.
    next_id: u64,
}

/// One write of this arbiter's, counted beside `in_log` until the watch
/// shows it.
struct Pending {
    id: u64,
    /// The entry's key as the watch names it; empty until known.
    key: String,
    /// An entry ended here (counts -1) rather than admitted (+1).
    ends: bool,
    /// 0 while in flight; then the write's revision, until the watch
    /// reaches it.
    revision: i64,
    /// The watch showed this write while its call was in flight: it is in
    /// `in_log` now and no longer counts beside it (or it would count twice).
    seen: bool,
    /// A write whose outcome is unknown (its answer was lost) counts until
    /// the watch shows it or until then, when the entry is gone anyway.
    until: Option<Instant>,
}

impl Pending {
    fn counts(&self, now: Instant) -> bool {
        !self.seen && self.until.is_none_or(|t| now < t)
    }
}

impl State {
    fn held(&self, subject: &str, now: Instant) -> Option<u32> {
        let in_log = self.in_log.as_ref()?.get(subject).copied().unwrap_or(0);
        Some(self.beside(in_log, subject, now))
    }

    /// `in_log` with this arbiter's writes not yet in it.
    fn beside(&self, in_log: u32, subject: &str, now: Instant) -> u32 {
        let (mut added, mut ended) = (0u32, 0u32);
        for p in self.pending.get(subject).into_iter().flatten() {
            if p.counts(now) {
                match p.ends {
                    true => ended = ended.saturating_add(1),
                    false => added = added.saturating_add(1),
                }
            }
        }
        in_log.saturating_add(added).saturating_sub(ended)
    }

    fn add(&mut self, subject: &str, delta: i32) {
        let Some(in_log) = self.in_log.as_mut() else {
            return;
        };
        let n = in_log.entry(subject.to_string()).or_insert(0);
        *n = n.saturating_add_signed(delta);
        if *n == 0 {
            in_log.remove(subject);
        }
    }

    /// The watch shows `key` of `subject` written (`ends`: deleted): a
    /// write of this arbiter's in flight with that key is the one it shows
    /// (matched by key, so another arbiter's write never cancels an
    /// unrelated one here).
    fn seen(&mut self, subject: &str, key: &str, ends: bool) {
        if let Some(p) = self.pending.get_mut(subject).and_then(|p| {
            p.iter_mut()
                .find(|p| p.ends == ends && !p.seen && p.key == key && (ends || p.revision == 0))
        }) {
            p.seen = true;
        }
    }

    /// The log is now known up to `revision`: writes at or below it are in
    /// `in_log`, so they stop counting beside it; so do writes of unknown
    /// outcome whose time is up.
    fn reached(&mut self, revision: i64, now: Instant) {
        self.revision = self.revision.max(revision);
        let seen = self.revision;
        self.pending.retain(|_, p| {
            p.retain(|p| (p.revision == 0 || p.revision > seen) && p.until.is_none_or(|t| now < t));
            !p.is_empty()
        });
    }

    fn push(&mut self, subject: &str, pending: impl FnOnce(u64) -> Pending) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.pending
            .entry(subject.to_string())
            .or_default()
            .push(pending(id));
        id
    }
}

/// One admitted write. Dropped without [`Admitted::written`], it stops
/// counting at once (unless [`Admitted::unknown_until`]); written, it
/// counts until the watch shows it.
pub struct Admitted {
    counts: Arc<SubjectCounts>,
    subject: String,
    id: u64,
    revision: i64,
    until: Option<Instant>,
}

impl Admitted {
    /// The entry's key is now known (before the write is sent: the watch
    /// can show the write before its answer arrives).
    pub fn writing(&self, key: &str) {
        let mut state = self.counts.lock();
        if let Some(p) = state
            .pending
            .get_mut(&self.subject)
            .and_then(|p| p.iter_mut().find(|p| p.id == self.id))
        {
            p.key = key.to_string();
        }
    }

    /// The entry was written at `revision` (one the watch may have shown
    /// already).
    pub fn written(mut self, revision: i64) {
        self.revision = revision;
    }

    /// The write was sent ([`Self::writing`]) and its answer lost: it may
    /// be in the log. It counts until the watch shows it, or until `until`,
    /// when an entry written then has ended anyway (a session's TTL). One
    /// never sent stops counting at once.
    pub fn unknown_until(mut self, until: Instant) {
        self.until = Some(until);
    }

    /// [`Self::unknown_until`] without ending the admission: what a drop
    /// before [`Self::written`] comes to (a call cancelled mid-write).
    pub fn until_unless_written(&mut self, until: Instant) {
        self.until = Some(until);
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut state = self.counts.lock();
        let seen = state.revision;
        let Some(pending) = state.pending.get_mut(&self.subject) else {
            return;
        };
        if let Some(i) = pending.iter().position(|p| p.id == self.id) {
            let p = &mut pending[i];
            if p.seen {
                pending.swap_remove(i);
            } else if self.revision > seen {
                p.revision = self.revision;
            } else if self.revision == 0 && self.until.is_some() && !p.key.is_empty() {
                p.until = self.until;
            } else {
                pending.swap_remove(i);
            }
        }
        if pending.is_empty() {
            state.pending.remove(&self.subject);
        }
    }
}

impl SubjectCounts {
    /// Counts bounded at `max` per subject; `counting` names what is
    /// counted in the refusal given before a count is in.
    pub fn new(max: u32, bound: IdentityBound, counting: &'static str) -> Arc<Self> {
        Arc::new(Self {
            max,
            bound,
            counting,
            state: Mutex::new(State::default()),
            counted: tokio::sync::Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Plain counts, consistent after every statement: a panic elsewhere
        // while holding the lock leaves nothing half-done.
        self.state.lock()
    }

    /// Waits, at most `wait`, for a count to be in; `StoreUnavailable`,
    /// saying why, if none is.
    pub async fn counted_within(&self, wait: Duration) -> Result<(), ArbiterError> {
        let deadline = Instant::now() + wait;
        loop {
            // Registered before the check, so a count installed in between
            // still wakes this call.
            let counted = self.counted.notified();
            if self.lock().in_log.is_some() {
                return Ok(());
            }
            // Waiting is not new work: the call's admission place goes back.
            crate::overload::parked();
            if tokio::time::timeout_at(deadline, counted).await.is_err() {
                return Err(self.not_counted());
            }
        }
    }

    fn not_counted(&self) -> ArbiterError {
        ArbiterError::store(format!(
            "this arbiter is counting the {} in etcd (it just started, or its watch on them broke and is being set up again) and cannot bound this call until it has; retry in a few seconds (another arbiter may answer at once)",
            self.counting
        ))
    }

    /// Admits one write for `subject` (`key`: the entry's key if known,
    /// else empty and [`Admitted::writing`] later), counting `beside` more
    /// entries of its counted elsewhere (the other tier's cluster), or
    /// refuses it: `IdentityLimit` at the bound, `StoreUnavailable` while
    /// there is no count.
    pub fn admit_beside(
        self: &Arc<Self>,
        subject: &str,
        key: &str,
        beside: u32,
    ) -> Result<Admitted, ArbiterError> {
        let mut state = self.lock();
        let Some(held) = state.held(subject, Instant::now()) else {
            return Err(self.not_counted());
        };
        if held.saturating_add(beside) >= self.max {
            return Err(ArbiterError::IdentityLimit {
                bound: self.bound,
                limit: self.max,
            });
        }
        let id = state.push(subject, |id| Pending {
            id,
            key: key.to_string(),
            ends: false,
            revision: 0,
            seen: false,
            until: None,
        });
        Ok(Admitted {
            counts: Arc::clone(self),
            subject: subject.to_string(),
            id,
            revision: 0,
            until: None,
        })
    }

    /// This arbiter ended `subject`'s entry `key` at `revision` (a delete
    /// it made itself): it stops counting now, not when the watch shows it.
    /// Only for an entry the count has (seen by the watch, or admitted
    /// here): one it does not have would be taken off twice.
    pub fn ended_here(&self, subject: &str, key: &str, revision: i64) {
        let mut state = self.lock();
        if revision <= state.revision {
            return;
        }
        state.push(subject, |id| Pending {
            id,
            key: key.to_string(),
            ends: true,
            revision,
            seen: false,
            until: None,
        });
    }

    /// `subject`'s entries as counted (log plus this arbiter's writes not
    /// yet in it); `None` while there is no count.
    pub fn held(&self, subject: &str) -> Option<u32> {
        self.lock().held(subject, Instant::now())
    }

    /// [`Self::held`], or while there is no count, only this arbiter's
    /// writes in flight.
    pub fn held_or_in_flight(&self, subject: &str) -> u32 {
        let state = self.lock();
        let now = Instant::now();
        state
            .held(subject, now)
            .unwrap_or_else(|| state.beside(0, subject, now))
    }

    /// The subject an admitted write with `key` is counted against.
    pub fn admitted_as(&self, key: &str) -> Option<String> {
        self.lock()
            .pending
            .iter()
            .find(|(_, p)| p.iter().any(|p| !p.ends && p.key == key))
            .map(|(subject, _)| subject.clone())
    }

    /// Replaces the count with a fresh one read at `revision`.
    pub fn install(&self, in_log: HashMap<String, u32>, revision: i64) {
        {
            let mut state = self.lock();
            state.in_log = Some(in_log);
            state.revision = 0;
            state.reached(revision, Instant::now());
        }
        self.counted.notify_waiters();
    }

    /// Every subject's entries in the log as counted (this arbiter's writes
    /// not yet seen aside); `None` while there is no count.
    pub fn total(&self) -> Option<u64> {
        let state = self.lock();
        Some(state.in_log.as_ref()?.values().map(|n| u64::from(*n)).sum())
    }

    /// The log revision the count reflects; `None` before the first count.
    pub fn revision(&self) -> Option<i64> {
        let state = self.lock();
        state.in_log.as_ref().map(|_| state.revision)
    }

    /// Whether a count is in.
    pub fn is_counted(&self) -> bool {
        self.lock().in_log.is_some()
    }

    /// The count is no longer followed: calls wait for the next one.
    pub fn lost(&self) {
        self.lock().in_log = None;
    }

    /// Applies one watch response's changes, all at or below `revision`.
    pub fn apply(&self, changes: &[Change], revision: i64) {
        let mut state = self.lock();
        for change in changes {
            if let Some(before) = &change.before {
                state.add(before, -1);
                if change.after.is_none() {
                    state.seen(before, &change.key, true);
                }
            }
            if let Some(after) = &change.after {
                state.add(after, 1);
                if change.before.as_ref() != Some(after) {
                    state.seen(after, &change.key, false);
                }
            }
        }
        state.reached(revision, Instant::now());
    }

    #[cfg(test)]
    pub(crate) fn pending_subjects(&self) -> usize {
        self.lock().pending.len()
    }

    #[cfg(test)]
    pub(crate) fn subjects_in_log(&self) -> Option<usize> {
        self.lock().in_log.as_ref().map(HashMap::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(pairs: &[(&str, u32)], revision: i64) -> Arc<SubjectCounts> {
        let c = SubjectCounts::new(3, IdentityBound::Sessions, "sessions");
        c.install(
            pairs.iter().map(|(s, n)| ((*s).to_string(), *n)).collect(),
            revision,
        );
        c
    }

    fn change(key: &str, before: Option<&str>, after: Option<&str>) -> Change {
        Change {
            key: key.into(),
            before: before.map(str::to_string),
            after: after.map(str::to_string),
        }
    }

    #[test]
    fn an_entry_ended_here_stops_counting_at_once_and_once() {
        let c = counted(&[("a", 3)], 10);
        assert!(c.admit_beside("a", "", 0).is_err(), "at the bound");
        c.ended_here("a", "k1", 12);
        assert_eq!(c.held("a"), Some(2));
        assert!(c.admit_beside("a", "", 0).is_ok(), "the place is free");
        // the watch shows the delete: still once
        c.apply(&[change("k1", Some("a"), None)], 12);
        assert_eq!(c.held("a"), Some(2));
        // an end the watch has already shown is not taken off again
        c.ended_here("a", "k2", 11);
        assert_eq!(c.held("a"), Some(2));
        // another arbiter's delete of another key is its own change
        c.ended_here("a", "k3", 20);
        c.apply(&[change("k9", Some("a"), None)], 13);
        assert_eq!(c.held("a"), Some(0));
        c.apply(&[change("k3", Some("a"), None)], 20);
        assert_eq!(c.held("a"), Some(0));
        assert_eq!(c.pending_subjects(), 0, "nothing left pending");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_of_unknown_outcome_counts_until_seen_or_its_time() {
        let c = counted(&[], 10);
        let a = c.admit_beside("a", "", 0).map_err(|e| e.to_string());
        let b = c.admit_beside("a", "", 0).map_err(|e| e.to_string());
        a.map(|a| {
            a.writing("k1");
            a.unknown_until(Instant::now() + Duration::from_secs(5));
        })
        .ok();
        b.map(|b| {
            b.writing("k2");
            b.unknown_until(Instant::now() + Duration::from_secs(5));
        })
        .ok();
        assert_eq!(c.held("a"), Some(2), "both may be in the log");
        // k1 was written after all: the watch shows it, once
        c.apply(&[change("k1", None, Some("a"))], 11);
        assert_eq!(c.held("a"), Some(2));
        // k2 never shows; its time runs out
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(c.held("a"), Some(1));
        c.apply(&[], 12);
        assert_eq!(c.pending_subjects(), 0);
    }

    #[test]
    fn a_lost_count_admits_nothing_until_the_next_one() {
        let c = counted(&[("a", 1)], 10);
        let admitted = c.admit_beside("a", "", 0).map_err(|e| e.to_string());
        admitted.map(|a| a.written(12)).ok();
        c.lost();
        assert!(matches!(
            c.admit_beside("a", "", 0),
            Err(ArbiterError::StoreUnavailable { .. })
        ));
        assert_eq!(c.held("a"), None);
        assert_eq!(c.held_or_in_flight("a"), 1, "the write of this arbiter's");
        // a recount at 11 lacks the write at 12: it still counts beside it
        c.install(HashMap::from([("a".to_string(), 1)]), 11);
        assert_eq!(c.held("a"), Some(2));
        // one at 12 has it
        c.install(HashMap::from([("a".to_string(), 2)]), 12);
        assert_eq!(c.held("a"), Some(2));
    }
}
