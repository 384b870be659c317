//! [`MemWitness`]: an in-memory [`Witness`], the coord cluster of the
//! simulation (issue 15).
//!
//! It keeps what a restore of the lock log cannot roll back: the highest
//! grant any arbiter vouched for (the mark, raised, never lowered) and the
//! highest epoch allocated to the lock log. Every call is linearizable (one
//! mutex, applied at one instant), as a read or a transaction on the coord
//! etcd cluster is.
//!
//! Faults as [`MemLog`](crate::MemLog)'s: each call draws its fate from the
//! seed ([`FaultRates`]): failing before it reaches the store
//! ([`StoreError::Unavailable`], nothing applied), its answer lost after it
//! was applied (`Unavailable` for a raise or an allocation that happened),
//! or a delay on tokio's clock before it applies. And the operator's side:
//! [`MemWitness::snapshot`] and [`MemWitness::restore`], to simulate a
//! restore of the coord cluster itself.
//!
//! Nothing here reads the wall clock, spawns a task or iterates a hash map.

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use async_trait::async_trait;
use latchkey_arbiter::high_water::Mark;
use latchkey_arbiter::lock_log::StoreError;
use latchkey_arbiter::witness::{Witness, Witnessed};
use tokio::time::Duration;

use crate::memlog::{FaultCounts, FaultRates};
use crate::rng::Rng;

/// What the witness holds at one moment, to [`MemWitness::restore`] later
/// (a snapshot of the coord cluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WitnessSnapshot {
    pub witnessed: Witnessed,
}

/// How often each call kind reached the store (faults aside).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WitnessCalls {
    pub reads: u64,
    pub raises: u64,
    /// Raises that moved the mark.
    pub raised: u64,
    pub allocations: u64,
}

struct Inner {
    witnessed: Witnessed,
    faults: FaultRates,
    rng: Rng,
    counts: FaultCounts,
    calls: WitnessCalls,
}

/// One call's fate, drawn when it starts.
struct Fate {
    fail_before: bool,
    lose_response: bool,
    delay: Option<Duration>,
}

/// The in-memory witness. A cheap handle: clones share one store.
#[derive(Clone)]
pub struct MemWitness {
    inner: Arc<Mutex<Inner>>,
    name: Arc<str>,
}

impl std::fmt::Debug for MemWitness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("MemWitness")
            .field("name", &self.name)
            .field("witnessed", &inner.witnessed)
            .field("faults", &inner.faults)
            .finish_non_exhaustive()
    }
}

impl MemWitness {
    /// An empty witness (no mark, no epoch allocated) with no faults;
    /// `seed` draws the faults once they are set.
    pub fn new(seed: u64) -> Self {
        Self::with_faults(seed, FaultRates::NONE)
    }

    pub fn with_faults(seed: u64, faults: FaultRates) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                witnessed: Witnessed::default(),
                faults,
                rng: Rng::new(seed ^ 0x5EED_3117_0000_0015),
                counts: FaultCounts::default(),
                calls: WitnessCalls::default(),
            })),
            name: Arc::from("simulated coord cluster (MemWitness)"),
        }
    }

    /// A state; a panic elsewhere while it was held leaves it usable.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    // --- fault knobs ---

    pub fn set_faults(&self, faults: FaultRates) {
        self.lock().faults = faults;
    }

    pub fn faults(&self) -> FaultRates {
        self.lock().faults
    }

    pub fn fault_counts(&self) -> FaultCounts {
        self.lock().counts
    }

    pub fn calls(&self) -> WitnessCalls {
        self.lock().calls
    }

    // --- the operator's side ---

    /// What is witnessed now (no fault, no delay).
    pub fn witnessed(&self) -> Witnessed {
        self.lock().witnessed
    }

    /// The witness as it is now.
    pub fn snapshot(&self) -> WitnessSnapshot {
        WitnessSnapshot {
            witnessed: self.witnessed(),
        }
    }

    /// Goes back to `snapshot` (a restore of the coord cluster): the mark
    /// and the allocated epoch may go down.
    pub fn restore(&self, snapshot: &WitnessSnapshot) {
        self.lock().witnessed = snapshot.witnessed;
    }

    // --- calls ---

    /// Draws this call's fate: always three draws, whatever the rates (as
    /// [`MemLog`](crate::MemLog) does).
    fn fate(&self) -> Fate {
        let mut inner = self.lock();
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
        inner.counts.calls += 1;
        inner.counts.failed_before_commit += u64::from(fail_before);
        inner.counts.lost_responses += u64::from(lose_response);
        inner.counts.delayed += u64::from(delay.is_some());
        Fate {
            fail_before,
            lose_response,
            delay,
        }
    }

    /// One call: its fate, its delay, then `f` on the state, then maybe a
    /// lost answer.
    async fn call<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Inner) -> T + Send,
    ) -> Result<T, StoreError> {
        let fate = self.fate();
        if let Some(delay) = fate.delay {
            tokio::time::sleep(delay).await;
        }
        if fate.fail_before {
            return Err(StoreError::unavailable(format!(
                "witness {what}: the coord cluster did not answer (injected before commit)"
            )));
        }
        let out = f(&mut self.lock());
        if fate.lose_response {
            return Err(StoreError::unavailable(format!(
                "witness {what}: the answer was lost (injected after commit)"
            )));
        }
        Ok(out)
    }
}

#[async_trait]
impl Witness for MemWitness {
    async fn read(&self) -> Result<Witnessed, StoreError> {
        self.call("read", |inner| {
            inner.calls.reads += 1;
            inner.witnessed
        })
        .await
    }

    async fn raise(&self, mark: Mark) -> Result<(), StoreError> {
        self.call("raise", |inner| {
            inner.calls.raises += 1;
            if inner.witnessed.mark.is_none_or(|m| !m.covers(&mark)) {
                inner.witnessed.mark = Some(mark);
                inner.calls.raised += 1;
            }
        })
        .await
    }

    async fn allocate_epoch(&self, at_least: u32) -> Result<u32, StoreError> {
        self.call("allocate_epoch", |inner| {
            inner.calls.allocations += 1;
            let next = at_least.max(inner.witnessed.epoch.saturating_add(1));
            inner.witnessed.epoch = next;
            next
        })
        .await
    }

    async fn note_epoch(&self, epoch: u32) -> Result<(), StoreError> {
        self.call("note_epoch", |inner| {
            inner.calls.allocations += 1;
            inner.witnessed.epoch = inner.witnessed.epoch.max(epoch);
        })
        .await
    }

    fn describe(&self) -> String {
        self.name.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(epoch: u32, revision: i64) -> Mark {
        Mark {
            epoch,
            cluster_id: 7,
            revision,
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn the_mark_only_goes_up() {
        block_on(async {
            let w = MemWitness::new(1);
            assert_eq!(w.read().await.expect("read"), Witnessed::default());
            w.raise(mark(1, 40)).await.expect("raise");
            w.raise(mark(1, 30)).await.expect("raise");
            assert_eq!(w.read().await.expect("read").mark, Some(mark(1, 40)));
            // a later epoch covers any revision of an earlier one
            w.raise(mark(2, 5)).await.expect("raise");
            w.raise(mark(1, 90)).await.expect("raise");
            assert_eq!(w.read().await.expect("read").mark, Some(mark(2, 5)));
            assert_eq!(w.calls().raised, 2);
        });
    }

    #[test]
    fn epochs_are_allocated_above_every_earlier_one() {
        block_on(async {
            let w = MemWitness::new(1);
            assert_eq!(w.allocate_epoch(2).await.expect("allocate"), 2);
            assert_eq!(w.allocate_epoch(2).await.expect("allocate"), 3);
            assert_eq!(w.allocate_epoch(7).await.expect("allocate"), 7);
            assert_eq!(w.allocate_epoch(1).await.expect("allocate"), 8);
            assert_eq!(w.read().await.expect("read").epoch, 8);
        });
    }

    #[test]
    fn a_restore_goes_back_to_the_snapshot() {
        block_on(async {
            let w = MemWitness::new(1);
            w.raise(mark(1, 10)).await.expect("raise");
            let snap = w.snapshot();
            w.raise(mark(1, 20)).await.expect("raise");
            w.allocate_epoch(2).await.expect("allocate");
            let other = w.clone();
            other.restore(&snap);
            let now = w.read().await.expect("read");
            assert_eq!(now.mark, Some(mark(1, 10)));
            assert_eq!(now.epoch, 0);
        });
    }

    #[test]
    fn faults_fail_before_or_lose_the_answer_after_applying() {
        block_on(async {
            let w = MemWitness::with_faults(
                3,
                FaultRates {
                    fail_before_commit: 0,
                    lose_response: 100,
                    delay: 100,
                    max_delay: Duration::from_millis(50),
                },
            );
            let before = tokio::time::Instant::now();
            assert!(w.raise(mark(1, 10)).await.is_err());
            // applied, answer lost
            assert_eq!(w.witnessed().mark, Some(mark(1, 10)));
            assert!(tokio::time::Instant::now() - before <= Duration::from_millis(50));
            w.set_faults(FaultRates {
                fail_before_commit: 100,
                ..FaultRates::NONE
            });
            assert!(w.raise(mark(1, 20)).await.is_err());
            assert!(w.allocate_epoch(5).await.is_err());
            // nothing applied
            assert_eq!(w.witnessed().mark, Some(mark(1, 10)));
            assert_eq!(w.witnessed().epoch, 0);
            let counts = w.fault_counts();
            assert_eq!(counts.calls, 3);
            assert_eq!(counts.lost_responses, 1);
            assert_eq!(counts.failed_before_commit, 2);
            w.set_faults(FaultRates::NONE);
            assert!(w.read().await.is_ok());
        });
    }

    #[test]
    fn a_seed_gives_the_same_faults() {
        let faults = FaultRates {
            fail_before_commit: 30,
            lose_response: 30,
            delay: 0,
            max_delay: Duration::ZERO,
        };
        let outcomes = |seed| {
            block_on(async move {
                let w = MemWitness::with_faults(seed, faults);
                let mut out = Vec::new();
                for i in 0..32 {
                    out.push(w.raise(mark(1, i)).await.is_ok());
                }
                out
            })
        };
        assert_eq!(outcomes(9), outcomes(9));
    }
}
