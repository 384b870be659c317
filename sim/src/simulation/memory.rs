//! The judge of grants from memory during quorum losses (issue 32, ADR-04).
//!
//! A grant from memory is unprotected (token 0) and exclusive per key on
//! its arbiter only, so the checker, which judges fenced grants over every
//! arbiter, does not see it: the worker records its acquire as refused
//! (`fail`, "UNPROTECTED") and this ledger judges what ADR-04 does promise:
//!
//! 1. no grant from memory of a key the log holds for another session, and
//!    held for it when the loss began (nothing commits while the log has
//!    no majority, so every arbiter's hold count could have seen it); when
//!    the watch streams broke shortly before the loss, held for it since
//!    before the break (a hold granted after the break is unseen until the
//!    count reads again, and the arbiter refuses every memory grant only if
//!    the log answered its probe after the break);
//! 2. no two live grants from memory of one key on one arbiter to two
//!    sessions;
//! 3. while a grant from memory is live, no grant of its key in the log
//!    through that arbiter to another session (the table's key gate).
//!
//! Each grant's interval is taken short, so only certain overlaps are
//! violations: from its answer (the hold began before) to the earliest
//! moment it may have ended, its release's invocation or its TTL from the
//! acquire's invocation (the hold's TTL runs from a later moment).

use std::time::Duration;

use tokio::time::Instant;

/// What the grants from memory of a run did, and what they broke.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Quorum losses the nemesis made.
    pub losses: u64,
    /// Grants answered from memory.
    pub granted: u64,
    /// Grants in the log a live memory grant of another session kept
    /// waiting or refused on its arbiter (the key gate at work).
    pub kept_from_log: u64,
    pub violations: Vec<String>,
}

/// Who held each key in the log as the last quorum loss began.
type Holders = std::collections::BTreeMap<String, i64>;

struct Held {
    arbiter: usize,
    key: String,
    session: i64,
    process: String,
    from: Instant,
    until: Instant,
}

/// The ledger of a run's grants from memory.
#[derive(Default)]
pub(crate) struct MemoryGrants {
    held: Vec<Held>,
    /// The log's holds as the last quorum loss began: what every arbiter's
    /// hold count had seen (nothing commits while the log has no majority).
    at_loss: Holders,
    /// Sessions an operator revoked: their leases end before their
    /// clients' fence deadlines, as a revocation must.
    revoked: std::collections::BTreeSet<i64>,
    report: MemoryReport,
}

/// Names one grant from memory in the ledger.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemoryId(usize);

impl MemoryGrants {
    /// The log lost its majority; `holders`: its holds then.
    pub(crate) fn lost_quorum(&mut self, holders: Holders) {
        self.report.losses += 1;
        self.at_loss = holders;
    }

    /// A grant from memory of `key` to `session` through `arbiter`, asked
    /// for at `invoked` and answered now; `in_log`: the session the log
    /// holds the key for now, if any.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn granted(
        &mut self,
        arbiter: usize,
        key: &str,
        session: i64,
        process: &str,
        invoked: Instant,
        ttl: Duration,
        in_log: Option<i64>,
        ms: f64,
    ) -> MemoryId {
        let now = Instant::now();
        self.report.granted += 1;
        // Held by another session since before the loss: every arbiter's
        // hold count had it. (A hold granted in the log after the quorum
        // came back, through an arbiter whose probe saw it first, may meet
        // a memory grant of an arbiter whose probe has not yet: ADR-04 keeps
        // memory grants exclusive on their arbiter only.)
        if in_log.is_some_and(|holder| holder != session && self.at_loss.get(key) == Some(&holder))
        {
            self.report.violations.push(format!(
                "at {ms:.0} ms arbiter-{arbiter} granted {key} from memory to {process} while the lock log holds it for another session"
            ));
        }
        if let Some(other) = self.live_other(arbiter, key, session, now, now) {
            self.report.violations.push(format!(
                "at {ms:.0} ms arbiter-{arbiter} granted {key} from memory to {process} while its memory grant to {other} was live"
            ));
        }
        self.held.push(Held {
            arbiter,
            key: key.to_string(),
            session,
            process: process.to_string(),
            from: now,
            until: invoked + ttl,
        });
        MemoryId(self.held.len() - 1)
    }

    /// The grant's release was asked for at `at`: it may end from then on.
    pub(crate) fn releasing(&mut self, id: MemoryId, at: Instant) {
        if let Some(h) = self.held.get_mut(id.0) {
            h.until = h.until.min(at);
        }
    }

    /// Arbiter `arbiter` lost its state dir (its spool) at `at`: its
    /// grants from memory end there.
    pub(crate) fn forget(&mut self, arbiter: usize, at: Instant) {
        for h in self.held.iter_mut().filter(|h| h.arbiter == arbiter) {
            h.until = h.until.min(at);
        }
    }

    /// A grant in the log of `key` to `session` through `arbiter`, asked
    /// for at `invoked` and answered now: rule 3.
    pub(crate) fn log_granted(
        &mut self,
        arbiter: usize,
        key: &str,
        session: i64,
        process: &str,
        invoked: Instant,
        ms: f64,
    ) {
        if let Some(other) = self.live_other(arbiter, key, session, invoked, Instant::now()) {
            self.report.violations.push(format!(
                "at {ms:.0} ms arbiter-{arbiter} granted {key} in the log to {process} while its memory grant to {other} was live"
            ));
        }
    }

    /// A grant in the log of `key` through `arbiter` was refused or timed
    /// out now while a memory grant of another session held it there.
    pub(crate) fn log_refused(&mut self, arbiter: usize, key: &str, session: i64) {
        let now = Instant::now();
        if self.live_other(arbiter, key, session, now, now).is_some() {
            self.report.kept_from_log += 1;
        }
    }

    /// The process of a grant from memory of `key` on `arbiter` to another
    /// session than `session` that was certainly live from `from` to `to`.
    fn live_other(
        &self,
        arbiter: usize,
        key: &str,
        session: i64,
        from: Instant,
        to: Instant,
    ) -> Option<&str> {
        self.held
            .iter()
            .find(|h| {
                h.arbiter == arbiter
                    && h.key == key
                    && h.session != session
                    && h.from <= from
                    && to < h.until
            })
            .map(|h| h.process.as_str())
    }

    /// A client about to write believes its session alive (before its
    /// fence deadline) while the log has no lease for it: a renewal was
    /// answered that the lease did not get. Not a grant from memory, but
    /// the same kind of promise the checker cannot see (a fenced write
    /// stays safe; a client that trusts its deadline does not).
    pub(crate) fn deadline_outlived_lease(
        &mut self,
        process: &str,
        session: i64,
        key: &str,
        ms: f64,
    ) {
        if self.revoked.contains(&session) {
            return;
        }
        self.report.violations.push(format!(
            "at {ms:.0} ms {process} was about to write {key} before its fence deadline, and its session's lease was gone: a renewal answered for a lease that was not renewed"
        ));
    }

    /// An operator is revoking `session` (its lease may go at any moment).
    pub(crate) fn revoking(&mut self, session: i64) {
        self.revoked.insert(session);
    }

    /// The revocation of `session` ended nothing (its lease had gone
    /// before, or is still there).
    pub(crate) fn not_revoked(&mut self, session: i64) {
        self.revoked.remove(&session);
    }

    pub(crate) fn report(&self) -> MemoryReport {
        self.report.clone()
    }
}
