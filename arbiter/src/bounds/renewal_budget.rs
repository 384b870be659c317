//! What one identity's KeepAlive streams may make this arbiter do (issue 31):
//! ownership lookups (an etcd read each) and renewals answered (CPU), each
//! from a token bucket per identity that all of its streams on this arbiter
//! share.
//!
//! Neither bucket ever refuses anything: a refused renewal would cost a
//! client that renews on time its session and every hold on it. A stream
//! whose identity is out of budget is not read until the budget is back
//! (HTTP/2 flow control then slows its sender), so the one who pays for a
//! flood is the identity that sends it.
//!
//! - **Lookups.** A session named on a stream for the first time costs a read
//!   of its record (whose is it?). Unknown ids all cost one, so without a
//!   budget one stream of random ids drove etcd reads as fast as it could
//!   send. The burst is twice the identity's session bound, so a client
//!   reconnecting with every session it may have is checked at once (twice
//!   over, for a second reconnection right after); the burst comes back over
//!   [`LOOKUP_REFILL`].
//! - **Renewals.** A renewal answered from the memo costs etcd nothing but
//!   still costs CPU; renewals answered are paced at four per second per
//!   session the identity may have (at least [`MIN_RENEWALS_PER_SECOND`]). A
//!   client renewing every session every third of the shortest TTL (5 s)
//!   uses a sixth of that.
//!
//! An identity's entry is dropped once it has no stream on this arbiter and
//! both its buckets are full again (then it is the same as no entry), so the
//! map holds the identities streaming now and those that streamed within the
//! last refill time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use parking_lot::Mutex;

/// The lookup burst comes back in full over this (a session bound's worth
/// per half of it).
pub const LOOKUP_REFILL: Duration = Duration::from_secs(10);
/// The session bound the budgets are computed from, at least: a tiny
/// `--max-sessions-per-identity` still gets a useful burst.
const MIN_SESSIONS_BUDGETED: u32 = 32;
/// Renewals answered per second per session the identity may have.
const RENEWALS_PER_SESSION_PER_SECOND: f64 = 4.0;
/// Renewals answered per second per identity, at least: one full message
/// (`MAX_SESSIONS_PER_MESSAGE`) a second.
pub const MIN_RENEWALS_PER_SECOND: f64 = 1024.0;
/// How often idle identities are looked for.
const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// A token bucket's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    /// Tokens a full bucket holds.
    pub burst: f64,
    /// Tokens that come back per second.
    pub per_second: f64,
}

impl Rate {
    /// How long it takes to earn `tokens`, rounded up to a whole
    /// microsecond (so a wait never ends a rounding error short of them).
    fn time_for(&self, tokens: f64) -> Duration {
        let micros = (tokens.max(0.0) / self.per_second * 1e6).ceil();
        // saturating: a NaN or an overflow is "not in this process's life"
        Duration::from_micros(micros as u64)
    }
}

/// A token bucket (the rate is the owner's): `tokens` as of `at`; below
/// zero after a [`Bucket::charge`] past what it had.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: Rate, now: Instant) -> Self {
        Self {
            tokens: rate.burst,
            at: now,
        }
    }

    fn refill(&mut self, rate: Rate, now: Instant) {
        let earned = now.saturating_duration_since(self.at).as_secs_f64() * rate.per_second;
        self.tokens = (self.tokens + earned).min(rate.burst);
        self.at = self.at.max(now);
    }

    /// Takes `cost` tokens if the bucket has them; otherwise the instant it
    /// will (and takes nothing).
    fn take(&mut self, rate: Rate, cost: f64, now: Instant) -> Result<(), Instant> {
        self.refill(rate, now);
        if self.tokens >= cost {
            self.tokens -= cost;
            return Ok(());
        }
        Err(now + rate.time_for(cost - self.tokens))
    }

    /// Charges `cost` for work already let in (the bucket may go below
    /// zero); while it is below zero, the instant it is back at zero: let
    /// nothing more in before.
    fn charge(&mut self, rate: Rate, cost: f64, now: Instant) -> Option<Instant> {
        self.refill(rate, now);
        self.tokens -= cost;
        (self.tokens < 0.0).then(|| now + rate.time_for(-self.tokens))
    }

    fn is_full(&self, rate: Rate, now: Instant) -> bool {
        let mut b = *self;
        b.refill(rate, now);
        b.tokens >= rate.burst
    }
}

/// One identity's buckets.
#[derive(Debug)]
struct Buckets {
    lookups: Bucket,
    renewals: Bucket,
}

/// The budgets of every identity streaming KeepAlives to this arbiter.
#[derive(Debug)]
pub struct RenewalBudgets {
    lookups: Rate,
    renewals: Rate,
    identities: Mutex<Identities>,
}

#[derive(Debug, Default)]
struct Identities {
    by_name: HashMap<String, Arc<IdentityBudget>>,
    next_prune: Option<Instant>,
}

impl RenewalBudgets {
    /// The budgets for identities that may have `max_sessions` sessions.
    pub fn new(max_sessions: u32) -> Self {
        let sessions = f64::from(max_sessions.max(MIN_SESSIONS_BUDGETED));
        let lookup_burst = 2.0 * sessions;
        let renewals = (RENEWALS_PER_SESSION_PER_SECOND * sessions).max(MIN_RENEWALS_PER_SECOND);
        Self::with_rates(
            Rate {
                burst: lookup_burst,
                per_second: lookup_burst / LOOKUP_REFILL.as_secs_f64(),
            },
            Rate {
                burst: renewals,
                per_second: renewals,
            },
        )
    }

    /// Budgets of these shapes: `lookups` (ownership lookups, an etcd read
    /// each) and `renewals` (session renewals answered).
    pub fn with_rates(lookups: Rate, renewals: Rate) -> Self {
        Self {
            lookups,
            renewals,
            identities: Mutex::new(Identities::default()),
        }
    }

    /// The ownership lookups' bucket shape.
    pub fn lookups(&self) -> Rate {
        self.lookups
    }

    /// The renewals' bucket shape.
    pub fn renewals(&self) -> Rate {
        self.renewals
    }

    /// `identity`'s budget, for one of its streams: shared with its other
    /// streams on this arbiter for as long as the stream keeps it.
    pub fn for_stream(&self, identity: &str) -> Arc<IdentityBudget> {
        self.for_stream_at(identity, Instant::now())
    }

    fn for_stream_at(&self, identity: &str, now: Instant) -> Arc<IdentityBudget> {
        let mut identities = self.identities.lock();
        if identities.next_prune.is_none_or(|t| now >= t) {
            identities.prune(now);
            identities.next_prune = Some(now + PRUNE_EVERY);
        }
        if let Some(budget) = identities.by_name.get(identity) {
            return budget.clone();
        }
        let budget = Arc::new(IdentityBudget {
            lookups: self.lookups,
            renewals: self.renewals,
            buckets: Mutex::new(Buckets {
                lookups: Bucket::full(self.lookups, now),
                renewals: Bucket::full(self.renewals, now),
            }),
        });
        identities
            .by_name
            .insert(identity.to_string(), budget.clone());
        budget
    }

    /// Identities with a budget now (streaming, or not yet refilled).
    pub fn identities(&self) -> usize {
        self.identities.lock().by_name.len()
    }
}

impl Identities {
    /// Drops the identities no stream holds whose buckets are full again
    /// (the same as a fresh entry), and hands the map's spare room back.
    fn prune(&mut self, now: Instant) {
        self.by_name
            .retain(|_, b| Arc::strong_count(b) > 1 || !b.is_full(now));
        if self.by_name.capacity() > 64 && self.by_name.len() < self.by_name.capacity() / 4 {
            self.by_name.shrink_to_fit();
        }
    }
}

/// One identity's budget on this arbiter, shared by its streams.
#[derive(Debug)]
pub struct IdentityBudget {
    lookups: Rate,
    renewals: Rate,
    buckets: Mutex<Buckets>,
}

impl IdentityBudget {
    /// Takes the budget for one ownership lookup of `reads` etcd reads;
    /// `Err`: not before this instant (nothing taken: ask again then).
    pub fn take_lookup(&self, reads: u32, now: Instant) -> Result<(), Instant> {
        self.buckets
            .lock()
            .lookups
            .take(self.lookups, f64::from(reads), now)
    }

    /// Charges `sessions` renewals just let in (one message's); `Some`: read
    /// nothing more from the stream before this instant.
    pub fn charge_renewals(&self, sessions: usize, now: Instant) -> Option<Instant> {
        // at most MAX_SESSIONS_PER_MESSAGE: exact as an f64
        let cost = sessions as f64;
        self.buckets
            .lock()
            .renewals
            .charge(self.renewals, cost, now)
    }

    fn is_full(&self, now: Instant) -> bool {
        let b = self.buckets.lock();
        b.lookups.is_full(self.lookups, now) && b.renewals.is_full(self.renewals, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn budgets() -> RenewalBudgets {
        RenewalBudgets::with_rates(
            Rate {
                burst: 10.0,
                per_second: 2.0,
            },
            Rate {
                burst: 100.0,
                per_second: 100.0,
            },
        )
    }

    /// `at` is `want`, give or take a few microseconds (rounding).
    fn near(at: Option<Instant>, want: Instant) -> bool {
        at.is_some_and(|at| at.max(want) - at.min(want) <= Duration::from_micros(3))
    }

    /// Lookups taken from a full bucket, one read each, until it says wait.
    fn drain(b: &IdentityBudget, now: Instant) -> (usize, Instant) {
        let mut taken = 0;
        loop {
            match b.take_lookup(1, now) {
                Ok(()) => taken += 1,
                Err(at) => return (taken, at),
            }
        }
    }

    #[test]
    fn the_defaults_check_a_whole_reconnection_at_once_and_pace_the_rest() {
        let b = RenewalBudgets::new(1000);
        assert_eq!(b.lookups().burst, 2000.0, "every session, twice over");
        assert_eq!(b.lookups().per_second, 200.0);
        assert_eq!(b.renewals().per_second, 4000.0);
        // a client renewing 1,000 sessions of the shortest TTL (5 s) every
        // third of it stays far inside the renewals' pace
        assert!(1000.0 / (5.0 / 3.0) * 6.0 <= b.renewals().per_second);
        let tiny = RenewalBudgets::new(1);
        assert_eq!(tiny.lookups().burst, 64.0);
        assert_eq!(tiny.renewals().per_second, MIN_RENEWALS_PER_SECOND);
    }

    #[test]
    fn lookups_past_the_burst_wait_for_the_refill_and_are_never_refused() {
        let budgets = budgets();
        let t0 = Instant::now();
        let b = budgets.for_stream_at("spiffe://td/mallory", t0);
        let (taken, at) = drain(&b, t0);
        assert_eq!(taken, 10, "the burst");
        assert!(near(Some(at), t0 + SECOND / 2), "one more at 2 per second");
        assert!(near(
            b.take_lookup(1, at - Duration::from_millis(1)).err(),
            at
        ));
        assert_eq!(b.take_lookup(1, at), Ok(()));
        // a lookup of two reads waits for two tokens
        let t1 = at + SECOND / 2;
        assert!(near(b.take_lookup(2, t1).err(), t1 + SECOND / 2));
        // over a long flood: the burst plus the refill, however often asked
        let mut now = t0;
        let mut total = 0;
        let end = t0 + 60 * SECOND;
        let b = budgets.for_stream_at("spiffe://td/eve", t0);
        while now < end {
            match b.take_lookup(1, now) {
                Ok(()) => total += 1,
                Err(at) => now = at.min(end),
            }
        }
        assert!(total <= 10 + 2 * 60 + 1, "{total}");
        assert!(total >= 10 + 2 * 60 - 1, "{total}");
    }

    #[test]
    fn an_identitys_streams_share_its_budget_and_others_have_their_own() {
        let budgets = budgets();
        let t0 = Instant::now();
        let first = budgets.for_stream_at("spiffe://td/mallory", t0);
        let second = budgets.for_stream_at("spiffe://td/mallory", t0);
        assert_eq!(drain(&first, t0).0, 10);
        assert!(second.take_lookup(1, t0).is_err(), "the same bucket");
        let victim = budgets.for_stream_at("spiffe://td/alice", t0);
        assert_eq!(drain(&victim, t0).0, 10, "alice's own burst");
    }

    #[test]
    fn renewals_are_let_in_then_charged_and_reading_waits_off_the_debt() {
        let budgets = budgets();
        let t0 = Instant::now();
        let b = budgets.for_stream_at("spiffe://td/mallory", t0);
        assert_eq!(b.charge_renewals(60, t0), None);
        // the message that passes the budget is answered; reading waits
        assert!(near(b.charge_renewals(60, t0), t0 + SECOND / 5));
        // half way there, still behind
        let t1 = t0 + SECOND / 10;
        assert!(near(
            b.charge_renewals(1, t1),
            t1 + Duration::from_millis(110)
        ));
        // and the lookups are a budget of their own
        assert_eq!(b.take_lookup(1, t1), Ok(()));
        // a steady flood of one-session messages gets the rate
        let mut now = t0 + 10 * SECOND;
        let b = budgets.for_stream_at("spiffe://td/eve", t0);
        let end = now + 10 * SECOND;
        let mut let_in = 0;
        while now < end {
            let_in += 1;
            if let Some(at) = b.charge_renewals(1, now) {
                now = at;
            }
        }
        assert!(let_in <= 100 + 100 * 10 + 1, "{let_in}");
        assert!(let_in >= 100 + 100 * 10 - 1, "{let_in}");
    }

    #[test]
    fn idle_identities_leave_once_refilled() {
        let budgets = budgets();
        let t0 = Instant::now();
        let held = budgets.for_stream_at("spiffe://td/alice", t0);
        drop(budgets.for_stream_at("spiffe://td/bob", t0));
        // mallory empties her bucket 8 s in (it refills in 5 s)
        let spent = budgets.for_stream_at("spiffe://td/mallory", t0);
        assert_eq!(drain(&spent, t0 + 8 * SECOND).0, 10);
        drop(spent);
        assert_eq!(budgets.identities(), 3);
        // past the prune interval: bob (full) leaves; mallory is still
        // refilling and alice has a stream
        let t1 = t0 + PRUNE_EVERY;
        let carol = budgets.for_stream_at("spiffe://td/carol", t1);
        let mut left: Vec<String> = budgets.identities.lock().by_name.keys().cloned().collect();
        left.sort();
        assert_eq!(
            left,
            [
                "spiffe://td/alice",
                "spiffe://td/carol",
                "spiffe://td/mallory"
            ]
        );
        // reconnecting gets mallory her own half-empty bucket, not a fresh one
        let again = budgets.for_stream_at("spiffe://td/mallory", t1);
        assert_eq!(drain(&again, t1).0, 4);
        drop(again);
        drop(held);
        let t2 = t1 + PRUNE_EVERY;
        drop(budgets.for_stream_at("spiffe://td/dave", t2));
        assert_eq!(budgets.identities(), 2, "carol's stream, and dave");
        drop(carol);
    }

    #[test]
    fn the_map_of_identities_gives_its_memory_back() {
        let budgets = budgets();
        let t0 = Instant::now();
        for i in 0..10_000 {
            drop(budgets.for_stream_at(&format!("spiffe://td/w{i}"), t0));
        }
        let peak = budgets.identities.lock().by_name.capacity();
        let _ = budgets.for_stream_at("spiffe://td/last", t0 + PRUNE_EVERY);
        let identities = budgets.identities.lock();
        assert_eq!(identities.by_name.len(), 1);
        assert!(identities.by_name.capacity() < peak / 4);
    }
}
