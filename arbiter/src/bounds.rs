//! Per-identity bounds that hold for every caller, through the edge or
//! direct: open sessions (counted in etcd, see [`crate::table::LockTable::open_session`];
//! here the turn-taking and the opens in flight that keep one arbiter from
//! overshooting), and
//! the etcd work renewals cost (a memo of recent renewals, per session).
//! Waiting Acquires are bounded in [`crate::waiters`]. What one identity's
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
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub mod renewal_budget;

pub use renewal_budget::RenewalBudgets;

/// The default `--max-sessions-per-identity`.
pub const DEFAULT_MAX_SESSIONS_PER_IDENTITY: u32 = 1000;

/// Sessions remembered as recently renewed; past this, renewals of other
/// sessions go to etcd (the memo only saves work, it never decides).
const MAX_REMEMBERED_RENEWALS: usize = 1 << 18;
/// OpenSession turns: one identity's opens are counted one at a time (count,
/// then reserve); the creates then run side by side. Different identities
/// rarely share a stripe.
const OPEN_STRIPES: usize = 64;

/// One open in flight: the cluster it goes to (an index into the counts
/// of [`Bounds::reserve_open_over`]), the revision its count entry was
/// written at (0: not yet, or unknown), and whether it has finished (kept
/// only while a count that may have missed it is in progress).
struct OpenSlot {
    cluster: usize,
    written: Arc<AtomicI64>,
    done: bool,
}

/// One identity's opens in flight.
#[derive(Default)]
struct Opening {
    slots: Vec<OpenSlot>,
    /// A count of the identity's sessions is in progress ([`CountWindow`]).
    /// Its read may have been served before an open that finishes now wrote
    /// its entry, so such an open stays (done) and counts as in flight for
    /// that count unless the count's revision shows it; it leaves when the
    /// count is over. (Dropping it at once let a burst pass the bound by
    /// one: issue 31, finding 9.)
    counting: bool,
}

impl Opening {
    fn idle(&self) -> bool {
        self.slots.is_empty() && !self.counting
    }
}

pub struct Bounds {
    pub max_sessions: u32,
    /// KeepAlive streams' ownership lookups and renewals, per identity.
    pub renewal_budgets: RenewalBudgets,
    renewals: Mutex<RenewalMemo>,
    open_turns: [tokio::sync::Mutex<()>; OPEN_STRIPES],
    /// Opens reserved and not yet finished, per identity: the revision each
    /// one's count entry was written at (0: not yet). An identity leaves
    /// when its last open finishes, so the map holds only identities
    /// opening right now.
    opening: Mutex<HashMap<String, Opening>>,
    /// Wakes an open that waits for opens in flight to finish.
    open_progress: tokio::sync::Notify,
    /// Keyed with a per-process secret: nobody can aim at another's stripe.
    stripe_hasher: RandomState,
}

impl Bounds {
    pub fn new(max_sessions: u32) -> Self {
        Self {
            max_sessions,
            renewal_budgets: RenewalBudgets::new(max_sessions),
            renewals: Mutex::new(RenewalMemo::default()),
            open_turns: std::array::from_fn(|_| tokio::sync::Mutex::new(())),
            opening: Mutex::new(HashMap::new()),
            open_progress: tokio::sync::Notify::new(),
            stripe_hasher: RandomState::new(),
        }
    }

    /// Waits for `identity`'s turn to open a session (count, then create).
    pub async fn open_turn(&self, identity: &str) -> tokio::sync::MutexGuard<'_, ()> {
        let hash = self.stripe_hasher.hash_one(identity);
        // the remainder is below OPEN_STRIPES, so the index is in range
        let stripe = usize::try_from(hash % OPEN_STRIPES as u64).unwrap_or(0);
        self.open_turns[stripe].lock().await
    }

    /// Opens the window of one count of `identity`'s sessions: call it with
    /// the identity's turn held, before the count's read is sent, and keep
    /// it until [`Self::reserve_open_over`] has answered. Opens that finish
    /// while it is open stay counted (unless the count's revision covers
    /// their write); opens that finished before it are in the count.
    pub fn counting(&self, identity: &str) -> CountWindow<'_> {
        let mut opening = self.opening.lock();
        let entry = opening.entry(identity.to_string()).or_default();
        entry.slots.retain(|s| !s.done);
        entry.counting = true;
        CountWindow {
            bounds: self,
            identity: identity.to_string(),
        }
    }

    /// Reserves one open for `identity`, which has `open` sessions in the
    /// log as of revision `at`, unless those and its opens in flight reach
    /// `max`. Call with the identity's turn held, after counting. An open in
    /// flight counts until its count entry is known written at a revision
    /// the count covers (then the count has it), so the bound holds; an open
    /// whose entry is written but not yet known so may count twice, so a
    /// `None` while `open < max` means "wait for [`Self::open_progress`] and
    /// count again", never a refusal.
    pub fn reserve_open(
        &self,
        identity: &str,
        open: u32,
        at: i64,
        max: u32,
    ) -> Option<OpenReservation<'_>> {
        self.reserve_open_over(identity, 0, &[(open, at)], max)
    }

    /// [`Self::reserve_open`] over several clusters (the tiers): `counts[i]`
    /// is the identity's sessions on cluster `i` as of that cluster's
    /// revision, and the open goes to cluster `on`. An open in flight is
    /// compared with its own cluster's revision only (revisions of two
    /// clusters say nothing of each other); a cluster that could not be
    /// counted passes `(0, 0)`, so its opens in flight all count.
    pub fn reserve_open_over(
        &self,
        identity: &str,
        on: usize,
        counts: &[(u32, i64)],
        max: u32,
    ) -> Option<OpenReservation<'_>> {
        let mut opening = self.opening.lock();
        let entry = opening.entry(identity.to_string()).or_default();
        let in_flight = entry
            .slots
            .iter()
            .filter(|s| {
                let written = s.written.load(Ordering::SeqCst);
                let at = counts.get(s.cluster).map_or(0, |c| c.1);
                written == 0 || written > at
            })
            .count();
        let open: u64 = counts.iter().map(|c| u64::from(c.0)).sum();
        if open + in_flight as u64 >= u64::from(max) {
            if entry.idle() {
                opening.remove(identity);
            }
            return None;
        }
        let slot = Arc::new(AtomicI64::new(0));
        entry.slots.push(OpenSlot {
            cluster: on,
            written: slot.clone(),
            done: false,
        });
        Some(OpenReservation {
            bounds: self,
            identity: identity.to_string(),
            slot,
        })
    }

    /// Resolves when an open in flight finishes or learns its revision.
    /// Create it before counting, so no progress in between is missed.
    pub fn open_progress(&self) -> tokio::sync::futures::Notified<'_> {
        self.open_progress.notified()
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

    /// Forgets `session` (closed): its next renewal goes to etcd.
    pub fn forget_renewal(&self, session: i64) {
        self.renewals.lock().entries.remove(&session);
    }
}

/// One open in flight, counted against its identity's bound until dropped.
pub struct OpenReservation<'a> {
    bounds: &'a Bounds,
    identity: String,
    slot: Arc<AtomicI64>,
}

impl OpenReservation<'_> {
    /// The open's count entry is in the log as of `revision`.
    pub fn written_at(&self, revision: i64) {
        self.slot.store(revision.max(1), Ordering::SeqCst);
        self.bounds.open_progress.notify_waiters();
    }
}

impl Drop for OpenReservation<'_> {
    fn drop(&mut self) {
        let mut opening = self.bounds.opening.lock();
        if let Some(entry) = opening.get_mut(&self.identity) {
            if entry.counting {
                // A count in progress may have been read before this open
                // wrote: it stays counted for that count ([`Opening`]).
                for s in &mut entry.slots {
                    if Arc::ptr_eq(&s.written, &self.slot) {
                        s.done = true;
                    }
                }
            } else {
                entry.slots.retain(|s| !Arc::ptr_eq(&s.written, &self.slot));
            }
            if entry.idle() {
                opening.remove(&self.identity);
            }
        }
        drop(opening);
        self.bounds.open_progress.notify_waiters();
    }
}

/// One count of an identity's sessions in progress ([`Bounds::counting`]).
pub struct CountWindow<'a> {
    bounds: &'a Bounds,
    identity: String,
}

impl Drop for CountWindow<'_> {
    fn drop(&mut self) {
        let mut opening = self.bounds.opening.lock();
        if let Some(entry) = opening.get_mut(&self.identity) {
            entry.counting = false;
            entry.slots.retain(|s| !s.done);
            if entry.idle() {
                opening.remove(&self.identity);
            }
        }
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
                sent: r.at,
            })
    }

    fn note(&self, lease: i64, renewed: crate::lock_log::etcd::Renewed) {
        self.renewed(lease, renewed.sent, renewed.ttl_seconds);
    }
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

    #[tokio::test]
    async fn one_identity_counts_one_open_at_a_time() {
        let bounds = Bounds::new(1);
        let turn = bounds.open_turn("spiffe://td/a").await;
        let again =
            tokio::time::timeout(Duration::from_millis(50), bounds.open_turn("spiffe://td/a"))
                .await;
        assert!(again.is_err(), "a second open waits for the first");
        drop(turn);
        let _turn = bounds.open_turn("spiffe://td/a").await;
    }

    #[test]
    fn opens_in_flight_count_against_the_bound_once() {
        let bounds = Bounds::new(3);
        let a = "spiffe://td/a";
        let first = bounds
            .reserve_open(a, 1, 10, 3)
            .expect("1 open + 0 in flight < 3");
        assert!(
            bounds.reserve_open(a, 2, 10, 3).is_none(),
            "2 open + 1 in flight"
        );
        let second = bounds
            .reserve_open(a, 1, 10, 3)
            .expect("1 open + 1 in flight < 3");
        assert!(
            bounds.reserve_open(a, 1, 10, 3).is_none(),
            "1 open + 2 in flight"
        );
        assert!(
            bounds.reserve_open("spiffe://td/b", 0, 10, 3).is_some(),
            "another identity has its own"
        );
        // the first is written at revision 12: a count of revision 11 does
        // not have it (still in flight), one of revision 12 does (not twice)
        first.written_at(12);
        assert!(
            bounds.reserve_open(a, 1, 11, 3).is_none(),
            "1 + 2 in flight at r11"
        );
        assert!(
            bounds.reserve_open(a, 2, 12, 3).is_none(),
            "2 counted (the first among them) + 1 in flight"
        );
        drop(second);
        let _fourth = bounds
            .reserve_open(a, 2, 12, 3)
            .expect("2 counted + 0 in flight");
        drop(first);
        drop(_fourth);
        assert!(bounds.opening.lock().is_empty(), "entries leave at zero");
    }

    #[test]
    fn an_open_that_finishes_during_a_count_stays_counted_for_it() {
        // Bound 2, one session open. A reserves and writes at r100 while
        // B's count is in flight; B's read was served at r99, before A's
        // write. A finishes (dropped) before B reserves: without the window
        // B saw 1 open + 0 in flight and passed the bound by one.
        let bounds = Bounds::new(2);
        let a = "spiffe://td/a";
        let first = bounds.reserve_open(a, 1, 98, 2).expect("1 open");
        let window = bounds.counting(a);
        first.written_at(100);
        drop(first);
        assert!(
            bounds.reserve_open(a, 1, 99, 2).is_none(),
            "A is not in a count of r99: still in flight for it"
        );
        drop(window);
        // A count that starts after A finished has it.
        let window = bounds.counting(a);
        assert!(bounds.reserve_open(a, 2, 101, 2).is_none(), "2 open");
        drop(window);
        // A count whose revision covers A's write does not count it twice.
        let first = bounds.reserve_open(a, 0, 90, 2).expect("0 open");
        let window = bounds.counting(a);
        first.written_at(100);
        drop(first);
        let third = bounds.reserve_open(a, 1, 100, 2).expect("A in the count");
        drop(third);
        drop(window);
        assert!(bounds.opening.lock().is_empty(), "entries leave at zero");
    }

    #[test]
    fn an_open_in_flight_is_compared_with_its_own_clusters_revision() {
        // Two tiers, bound 2. An open on cluster 1 written at its revision
        // 50 is not in cluster 0's count, however high cluster 0's revision:
        // it stays in flight until cluster 1's count (at 20 here) has it.
        let bounds = Bounds::new(2);
        let a = "spiffe://td/a";
        let coord = bounds
            .reserve_open_over(a, 1, &[(0, 10), (0, 10)], 2)
            .expect("nothing open");
        coord.written_at(50);
        let _entity = bounds
            .reserve_open_over(a, 0, &[(0, 5000), (0, 20)], 2)
            .expect("one in flight on cluster 1");
        assert!(
            bounds
                .reserve_open_over(a, 0, &[(0, 5000), (0, 20)], 2)
                .is_none(),
            "two in flight: cluster 1's is not in its count at r20"
        );
        // Counted on cluster 1 (at r50): one open, one in flight.
        assert!(
            bounds
                .reserve_open_over(a, 0, &[(0, 5000), (1, 50)], 2)
                .is_none()
        );
        // A cluster that could not be counted: its opens all count.
        assert!(
            bounds
                .reserve_open_over(a, 0, &[(0, 5000), (0, 0)], 2)
                .is_none()
        );
    }
}
