//! Per-identity bounds that hold for every caller, through the edge or
//! direct: open sessions (counted in etcd, see [`crate::store::Store::open_session`];
//! here only the turn-taking that keeps one arbiter from overshooting), and
//! session renewals per second (a token bucket per identity, in memory).
//! Waiting Acquires are bounded in [`crate::waiters`].
//!
//! Nothing here is keyed by anything but an authenticated identity, and the
//! bucket map is bounded: a full bucket is forgotten (it is the same as none).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::time::Instant;

use crate::error::{ArbiterError, IdentityBound};

/// The default `--max-sessions-per-identity`.
pub const DEFAULT_MAX_SESSIONS_PER_IDENTITY: u32 = 1000;
/// The default `--max-renewals-per-identity` (per second): 1000 sessions
/// renewed every 5 s (a 15 s TTL), with a burst of twice as many.
pub const DEFAULT_MAX_RENEWALS_PER_IDENTITY: u32 = 200;

/// Identities tracked by the renewal buckets before full ones are dropped.
const MAX_TRACKED_IDENTITIES: usize = 16_384;
/// OpenSession turns: one identity's opens run one at a time (count, then
/// create); different identities rarely share a stripe.
const OPEN_STRIPES: usize = 64;

pub struct Bounds {
    pub max_sessions: u32,
    renewals: Mutex<Renewals>,
    open_turns: [tokio::sync::Mutex<()>; OPEN_STRIPES],
    /// Keyed with a per-process secret: nobody can aim at another's stripe.
    stripe_hasher: RandomState,
}

impl Bounds {
    pub fn new(max_sessions: u32, renewals_per_second: u32) -> Self {
        Self {
            max_sessions,
            renewals: Mutex::new(Renewals::new(renewals_per_second)),
            open_turns: std::array::from_fn(|_| tokio::sync::Mutex::new(())),
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

    /// Takes one renewal from `identity`'s budget, or refuses it.
    pub fn renewal(&self, identity: &str) -> Result<(), ArbiterError> {
        let mut renewals = self
            .renewals
            .lock()
            .map_err(|_| ArbiterError::Internal("renewal budgets poisoned".into()))?;
        renewals.take(identity, Instant::now())
    }
}

/// Token buckets: `rate` renewals per second, up to `2 × rate` saved up.
struct Renewals {
    rate: f64,
    burst: f64,
    limit: u32,
    buckets: HashMap<String, Bucket>,
}

#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Renewals {
    fn new(per_second: u32) -> Self {
        let rate = f64::from(per_second.max(1));
        Self {
            rate,
            burst: rate * 2.0,
            limit: per_second.max(1),
            buckets: HashMap::new(),
        }
    }

    fn refilled(&self, b: Bucket, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        (b.tokens + elapsed * self.rate).min(self.burst)
    }

    fn take(&mut self, identity: &str, now: Instant) -> Result<(), ArbiterError> {
        let tokens = match self.buckets.get(identity) {
            Some(b) => self.refilled(*b, now),
            None => {
                if self.buckets.len() >= MAX_TRACKED_IDENTITIES {
                    self.forget_full(now);
                }
                self.burst
            }
        };
        if tokens < 1.0 {
            self.buckets
                .insert(identity.to_string(), Bucket { tokens, at: now });
            return Err(ArbiterError::IdentityLimit {
                bound: IdentityBound::Renewals,
                limit: self.limit,
            });
        }
        if self.buckets.len() < MAX_TRACKED_IDENTITIES || self.buckets.contains_key(identity) {
            self.buckets.insert(
                identity.to_string(),
                Bucket {
                    tokens: tokens - 1.0,
                    at: now,
                },
            );
        }
        Ok(())
    }

    /// Drops the buckets that have refilled: the same as having none.
    fn forget_full(&mut self, now: Instant) {
        let (rate, burst) = (self.rate, self.burst);
        self.buckets.retain(|_, b| {
            let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
            b.tokens + elapsed * rate < burst
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn renewals_are_refused_past_the_burst_and_allowed_again_at_the_rate() {
        let mut r = Renewals::new(10);
        let t0 = Instant::now();
        for _ in 0..20 {
            assert!(r.take("spiffe://td/mallory", t0).is_ok());
        }
        let refused = r.take("spiffe://td/mallory", t0);
        assert!(matches!(
            refused,
            Err(ArbiterError::IdentityLimit {
                bound: IdentityBound::Renewals,
                limit: 10
            })
        ));
        // another identity is unaffected
        assert!(r.take("spiffe://td/alice", t0).is_ok());
        // 100 ms later: one more renewal's worth
        let later = t0 + Duration::from_millis(100);
        assert!(r.take("spiffe://td/mallory", later).is_ok());
        assert!(r.take("spiffe://td/mallory", later).is_err());
        // a steady 10/s is always fine
        for i in 1..=50u64 {
            let t = later + Duration::from_millis(100 * i);
            assert!(r.take("spiffe://td/mallory", t).is_ok(), "renewal {i}");
        }
    }

    #[test]
    fn the_bucket_map_is_bounded() {
        let mut r = Renewals::new(10);
        let t0 = Instant::now();
        for i in 0..MAX_TRACKED_IDENTITIES + 100 {
            let _ = r.take(&format!("spiffe://td/w{i}"), t0);
        }
        assert!(r.buckets.len() <= MAX_TRACKED_IDENTITIES);
        // once refilled, the old buckets go to make room
        let later = t0 + Duration::from_secs(5);
        let _ = r.take("spiffe://td/newcomer", later);
        assert!(r.buckets.len() <= 1);
    }

    #[tokio::test]
    async fn one_identity_opens_one_session_at_a_time() {
        let bounds = Bounds::new(1, 1);
        let turn = bounds.open_turn("spiffe://td/a").await;
        let again =
            tokio::time::timeout(Duration::from_millis(50), bounds.open_turn("spiffe://td/a"))
                .await;
        assert!(again.is_err(), "a second open waits for the first");
        drop(turn);
        let _turn = bounds.open_turn("spiffe://td/a").await;
    }
}
