//! One call to the store: its fate (faults drawn from the seed), its
//! latency, then the store, then maybe a lost answer.

use latchkey_arbiter::lock_log::StoreError;
use tokio::time::{Duration, Instant};

use super::{Inner, MemLog};

/// One call's fate, drawn when it starts.
pub(super) struct Fate {
    fail_before: bool,
    lose_response: bool,
    delay: Option<Duration>,
    latency: Duration,
}

/// Keeps the count of multi-member batches on their way to the store
/// right, however the call ends (a caller may drop it mid-flight).
struct InFlight<'a>(&'a MemLog);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut inner = self.0.shared.lock();
        inner.batches_in_flight = inner.batches_in_flight.saturating_sub(1);
    }
}

impl MemLog {
    /// Draws this call's fate: always three draws, whatever the rates (and
    /// one more from the latency's own stream, when there is a latency).
    fn fate(&self) -> Fate {
        let mut inner = self.shared.lock();
        let roll = inner.rng.below(100);
        let delay_roll = inner.rng.below(100);
        let amount = inner.rng.next_u64();
        let f = inner.faults;
        let fail_before = roll < u64::from(f.fail_before_commit);
        let lose_response = !fail_before
            && roll < u64::from(f.fail_before_commit).saturating_add(u64::from(f.lose_response));
        let max = u64::try_from(f.max_delay.as_micros()).unwrap_or(u64::MAX);
        let delay = (delay_roll < u64::from(f.delay) && max > 0)
            .then(|| Duration::from_micros(amount % max.saturating_add(1)));
        let most = u64::try_from(inner.latency.as_micros()).unwrap_or(u64::MAX);
        let latency = match most {
            0 => Duration::ZERO,
            most => Duration::from_micros(most / 2 + inner.latency_rng.below(most / 2 + 1)),
        };
        inner.counts.calls += 1;
        inner.counts.failed_before_commit += u64::from(fail_before);
        inner.counts.lost_responses += u64::from(lose_response);
        inner.counts.delayed += u64::from(delay.is_some());
        Fate {
            fail_before,
            lose_response,
            delay,
            latency,
        }
    }

    /// One call: its fate, its delay, then `f` on the store (after the
    /// expiries due by then), then maybe a lost answer.
    pub(super) async fn call<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Inner, Instant) -> Result<T, StoreError> + Send,
    ) -> Result<T, StoreError> {
        self.fated(what, f).await.1
    }

    /// A batch of `members` as one call, counted when it has more than one
    /// member: its lost answers, its failures before the store, restores
    /// while it was on its way (`f` counts what its members did).
    pub(super) async fn batch_call<T>(
        &self,
        members: usize,
        f: impl FnOnce(&mut Inner, Instant) -> Result<T, StoreError> + Send,
    ) -> Result<T, StoreError> {
        if members < 2 {
            return self.call("batch", f).await;
        }
        let in_flight = {
            let mut inner = self.shared.lock();
            inner.batches.batches += 1;
            inner.batches_in_flight += 1;
            InFlight(self)
        };
        let (fate, out) = self.fated("batch", f).await;
        drop(in_flight);
        let mut inner = self.shared.lock();
        let counts = &mut inner.batches;
        counts.lost += u64::from(fate.lose_response);
        counts.failed_before += u64::from(fate.fail_before);
        out
    }

    async fn fated<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Inner, Instant) -> Result<T, StoreError> + Send,
    ) -> (Fate, Result<T, StoreError>) {
        let fate = self.fate();
        let wait = fate.delay.unwrap_or_default() + fate.latency;
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        if fate.fail_before {
            let e = StoreError::unavailable(format!(
                "{what}: the store did not answer (injected before commit)"
            ));
            return (fate, Err(e));
        }
        let out = self.shared.with(|inner, now| {
            if inner.store.quorum_lost() {
                return Err(StoreError::unavailable(format!(
                    "{what}: etcdserver: no leader (the members have no majority)"
                )));
            }
            if inner.renewals_fail && what == "renew" {
                return Err(StoreError::unavailable(format!(
                    "{what}: the renewal did not reach the lessor (injected)"
                )));
            }
            f(inner, now)
        });
        if fate.lose_response {
            let e = StoreError::unavailable(format!(
                "{what}: the answer was lost (injected after commit)"
            ));
            return (fate, Err(e));
        }
        (fate, out)
    }
}
