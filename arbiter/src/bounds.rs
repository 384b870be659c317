//! Per-identity bounds that hold for every caller, through the edge or
//! direct: open sessions (counted from etcd by a watch, see
//! [`crate::session_counts`]; here only the lock that admits one open at a
//! time over both tiers), and the etcd work renewals cost (a memo of recent
//! renewals, per session).
//! Waiting Acquires are bounded in [`crate::table`]. What one identity's
//! KeepAlive streams may make the arbiter do (ownership lookups, renewals
//! answered) is paced in [`renewal_budget`].
//!
//! Renewals are bounded by coalescing, never by refusal: a refused renewal
//! would cost a client that renews on time its session and every hold on it.
//! A session renewed in etcd less than a quarter of its TTL ago is answered
//! from memory (the TTL left since that renewal, which is never more than
//! etcd's own), so however fast an identity renews, etcd sees at most four
//! renewals per session per TTL, and the sessions are bounded per identity.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use parking_lot::Mutex;

pub mod renewal_budget;

pub use renewal_budget::RenewalBudgets;

/// The default `--max-sessions-per-identity`.
pub const DEFAULT_MAX_SESSIONS_PER_IDENTITY: u32 = 1000;

/// Sessions remembered as recently renewed; past this, renewals of other
/// sessions go to etcd (the memo only saves work, it never decides).
const MAX_REMEMBERED_RENEWALS: usize = 1 << 18;

pub struct Bounds {
    pub max_sessions: u32,
    /// KeepAlive streams' ownership lookups and renewals, per identity.
    pub renewal_budgets: RenewalBudgets,
    renewals: Mutex<RenewalMemo>,
    /// Held while one open is admitted ([`Self::admitting_open`]).
    open_admission: Mutex<()>,
    /// Told how long each renewal took at the lanes (the overload signal).
    admission: std::sync::OnceLock<std::sync::Arc<crate::overload::Admission>>,
}

impl Bounds {
    pub fn new(max_sessions: u32) -> Self {
        Self {
            max_sessions,
            renewal_budgets: RenewalBudgets::new(max_sessions),
            renewals: Mutex::new(RenewalMemo::default()),
            open_admission: Mutex::new(()),
            admission: std::sync::OnceLock::new(),
        }
    }

    /// Tells `admission` how long renewals take at the lanes from now on.
    pub fn report_renewals_to(&self, admission: std::sync::Arc<crate::overload::Admission>) {
        let _ = self.admission.set(admission);
    }

    /// One open's admission at a time: the session bound is over both
    /// tiers, each tier's count behind its own lock, so reading the other
    /// tier's count and admitting on this one must not interleave with
    /// another open doing the same the other way round. Held for a few
    /// lookups in memory, never across an await.
    pub fn admitting_open(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.open_admission.lock()
    }

    /// The TTL left (whole seconds, at least 1) when `session` was renewed in
    /// etcd within the last quarter of its TTL; `None`: renew it in etcd.
    pub fn recent_renewal(&self, session: i64) -> Option<i64> {
        self.renewals.lock().recent(session, Instant::now())
    }

    /// Notes an etcd renewal of `session` sent at `sent` that answered `ttl_seconds`.
    pub fn renewed(&self, session: i64, sent: Instant, ttl_seconds: i64) {
        self.renewals
            .lock()
            .note(session, sent, ttl_seconds, Instant::now());
    }

    /// When this arbiter last renewed `session` in etcd and the TTL it had
    /// left from then (what the console shows), while the memo still has
    /// it (it keeps renewals for a quarter TTL, pruned every 10 s: the
    /// console adds nothing to the renewal path); `None`: not known here.
    pub fn last_renewal(&self, session: i64) -> Option<LastRenewal> {
        let memo = self.renewals.lock();
        let r = memo.entries.get(&session)?;
        let ago = r.at.elapsed();
        (ago < r.ttl).then(|| LastRenewal {
            ago,
            ttl_left: r.ttl - ago,
        })
    }

    /// Forgets `session` (closed): its next renewal goes to etcd.
    pub fn forget_renewal(&self, session: i64) {
        self.renewals.lock().entries.remove(&session);
    }
}

/// How often the memo drops what can no longer answer (closed and expired
/// sessions, and those not renewed lately), so its memory comes back.
const PRUNE_EVERY: Duration = Duration::from_secs(10);

impl crate::lock_log::etcd::RenewalMemo for Bounds {
    fn recent(&self, lease: i64) -> Option<crate::lock_log::etcd::Renewed> {
        let memo = self.renewals.lock();
        let r = memo.entries.get(&lease)?;
        r.fresh(Instant::now())
            .then(|| crate::lock_log::etcd::Renewed {
                ttl_seconds: i64::try_from(r.ttl.as_secs()).unwrap_or(i64::MAX),
                sent: r.at.into_std(),
            })
    }

    fn note(&self, lease: i64, renewed: crate::lock_log::etcd::Renewed) {
        self.renewed(lease, Instant::from_std(renewed.sent), renewed.ttl_seconds);
    }

    fn round_trip(&self, took: Duration) {
        if let Some(admission) = self.admission.get() {
            admission.renewal_served(took);
        }
    }
}

/// A session's last renewal in etcd by this arbiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LastRenewal {
    pub ago: Duration,
    /// At least this much of the lease's TTL is left.
    pub ttl_left: Duration,
}

#[derive(Default)]
struct RenewalMemo {
    entries: HashMap<i64, Renewed>,
    next_prune: Option<Instant>,
}

#[derive(Clone, Copy)]
struct Renewed {
    /// When the renewal was sent: the lease had `ttl` left from then at least.
    at: Instant,
    ttl: Duration,
}

impl Renewed {
    fn fresh(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) < self.ttl / 4
    }
}

impl RenewalMemo {
    fn recent(&self, session: i64, now: Instant) -> Option<i64> {
        let r = self.entries.get(&session)?;
        if !r.fresh(now) {
            return None;
        }
        let left = r.ttl.saturating_sub(now.saturating_duration_since(r.at));
        i64::try_from(left.as_secs()).ok().filter(|s| *s >= 1)
    }

    /// Drops entries past their quarter TTL (they answer nothing) and hands
    /// the table's spare room back.
    fn prune(&mut self, now: Instant) {
        self.entries.retain(|_, r| r.fresh(now));
        if self.entries.capacity() > 64 && self.entries.len() < self.entries.capacity() / 4 {
            self.entries.shrink_to_fit();
        }
        self.next_prune = Some(now + PRUNE_EVERY);
    }

    fn note(&mut self, session: i64, sent: Instant, ttl_seconds: i64, now: Instant) {
        if self.next_prune.is_none_or(|t| now >= t) {
            self.prune(now);
        }
        let Ok(secs @ 1..) = u64::try_from(ttl_seconds) else {
            self.entries.remove(&session);
            return;
        };
        if self.entries.len() >= MAX_REMEMBERED_RENEWALS && !self.entries.contains_key(&session) {
            self.prune(now);
            if self.entries.len() >= MAX_REMEMBERED_RENEWALS {
                return;
            }
        }
        self.entries.insert(
            session,
            Renewed {
                at: sent,
                ttl: Duration::from_secs(secs),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_renewal_inside_a_quarter_ttl_is_answered_from_the_memo() {
        let mut m = RenewalMemo::default();
        let t0 = Instant::now();
        assert_eq!(m.recent(7, t0), None, "never renewed: go to etcd");
        m.note(7, t0, 20, t0);
        assert_eq!(m.recent(7, t0), Some(20));
        // 2 s later: 18 s left, still inside the first quarter (5 s)
        assert_eq!(m.recent(7, t0 + Duration::from_secs(2)), Some(18));
        // at a quarter of the TTL: back to etcd
        assert_eq!(m.recent(7, t0 + Duration::from_secs(5)), None);
        // another session is not covered
        assert_eq!(m.recent(8, t0), None);
        // a lease etcd says is gone is forgotten
        m.note(7, t0, -1, t0);
        assert_eq!(m.recent(7, t0), None);
    }

    #[test]
    fn the_memo_never_claims_more_than_etcd_answered() {
        let mut m = RenewalMemo::default();
        let t0 = Instant::now();
        // a TTL of 1 s: nothing is ever answered from memory (under 1 s left)
        m.note(1, t0, 1, t0);
        assert_eq!(m.recent(1, t0 + Duration::from_millis(100)), None);
        // the answer counts from when the renewal was sent, not answered
        m.note(2, t0, 8, t0 + Duration::from_millis(1500));
        assert_eq!(m.recent(2, t0 + Duration::from_millis(1500)), Some(6));
    }

    #[test]
    fn the_memo_is_bounded() {
        let mut m = RenewalMemo::default();
        let t0 = Instant::now();
        for s in 0..(MAX_REMEMBERED_RENEWALS as i64 + 10) {
            m.note(s, t0, 60, t0);
        }
        assert!(m.entries.len() <= MAX_REMEMBERED_RENEWALS);
        // once stale, old entries make room
        let later = t0 + Duration::from_secs(16);
        m.note(-5, later, 60, later);
        assert_eq!(m.entries.len(), 1);
    }

    #[test]
    fn stale_entries_leave_and_their_memory_comes_back() {
        let mut m = RenewalMemo::default();
        let t0 = Instant::now();
        for s in 0..10_000 {
            m.note(s, t0, 60, t0);
        }
        let peak = m.entries.capacity();
        // past a quarter TTL and the prune interval, the next note prunes
        let later = t0 + Duration::from_secs(16).max(PRUNE_EVERY);
        m.note(-1, later, 60, later);
        assert_eq!(m.entries.len(), 1);
        assert!(m.entries.capacity() < peak / 4, "{}", m.entries.capacity());
    }
}
