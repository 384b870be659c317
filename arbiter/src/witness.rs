//! Witnesses: what a restore of the lock log cannot roll back (ADR-03, ADR-07).
//!
//! An arbiter's state directory remembers the grants *it* made; an arbiter
//! run as a stateless Deployment remembers nothing, and no arbiter remembers
//! another's grants it never saw. A restored lock log then looks clean to
//! every arbiter that lacks the memory, and it would issue again tokens that
//! were already handed out (issue 15). A witness keeps that memory outside
//! the lock log, in the coord cluster:
//!
//! - the **mark**: the highest grant (epoch, cluster id, revision) any arbiter
//!   has vouched for. Every token is covered by it before it is handed out,
//!   and every grant transaction is sent only after the mark has been read, so
//!   a grant that comes back below it (or at it) comes from a restored log;
//! - the **epochs** allocated to the lock log: an advance takes its new epoch
//!   from the witness, above every epoch allocated before, whatever the lock
//!   log's own epoch record says after a restore.
//!
//! One cluster for everything (laptops, tests) has no witness: there the
//! arbiter's state directory is the only one.

pub mod etcd;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use tokio::sync::Mutex as AsyncMutex;

use crate::high_water::Mark;
use crate::lock_log::StoreError;

/// What a witness knows about one lock log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Witnessed {
    /// The highest grant any arbiter has vouched for.
    pub mark: Option<Mark>,
    /// The highest epoch allocated to the lock log (0: none yet).
    pub epoch: u32,
}

impl Witnessed {
    /// Whether this shows at least what `earlier` showed. A witness only
    /// ever goes up; one that shows less than it did was restored.
    pub fn covers(&self, earlier: &Witnessed) -> bool {
        let marks = match (self.mark, earlier.mark) {
            (_, None) => true,
            (None, Some(_)) => false,
            (Some(now), Some(then)) => now.covers(&then),
        };
        marks && self.epoch >= earlier.epoch
    }

    /// The higher of each part.
    pub fn max(self, other: Witnessed) -> Witnessed {
        let mark = match (self.mark, other.mark) {
            (Some(a), Some(b)) => Some(if a.covers(&b) { a } else { b }),
            (a, b) => a.or(b),
        };
        Witnessed {
            mark,
            epoch: self.epoch.max(other.epoch),
        }
    }
}

/// A fresh read, and whether it went below the read before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreshRead {
    pub now: Witnessed,
    /// The earlier read (since [`SharedWitness::start_over`]) that this one
    /// shows less than: the witness was restored between the two.
    pub went_back_from: Option<Witnessed>,
}

/// A store the lock log's restores cannot roll back.
#[async_trait]
pub trait Witness: Send + Sync + 'static {
    /// What is witnessed now (a linearizable read).
    async fn read(&self) -> Result<Witnessed, StoreError>;
    /// Raises the mark to cover `mark`; never lowers it.
    async fn raise(&self, mark: Mark) -> Result<(), StoreError>;
    /// Allocates an epoch: at least `at_least`, above every epoch allocated
    /// before, and records it.
    async fn allocate_epoch(&self, at_least: u32) -> Result<u32, StoreError>;
    /// Records that `epoch` is in use (an epoch the lock log had before the
    /// witness came, or that an earlier allocation lost): the allocated epoch
    /// becomes at least `epoch`; never lowers it.
    async fn note_epoch(&self, epoch: u32) -> Result<(), StoreError>;
    /// Where the witness lives, for logs and `admin status`.
    fn describe(&self) -> String;
}

/// Shares witness reads and raises between concurrent grants.
///
/// A read counts for a grant only if it was sent after the grant arrived
/// (so it covers every token handed out before); one read serves every grant
/// that arrived before it was sent. A raise covers every mark wanted before
/// it was sent, so concurrent grants wait on one write.
pub struct SharedWitness {
    witness: Arc<dyn Witness>,
    arrivals: AtomicU64,
    /// (arrivals covered by the last completed read, what it read).
    reads: AsyncMutex<(u64, FreshRead)>,
    /// Reads sent so far (each is numbered when it is sent).
    sent: AtomicU64,
    /// (the first read number that counts, the highest read since then):
    /// every later read, sent after it completed, must cover it. Reads sent
    /// before [`Self::start_over`] neither count nor are checked.
    baseline: parking_lot::Mutex<(u64, Option<Witnessed>)>,
    /// (highest mark wanted, highest mark known raised).
    wanted: parking_lot::Mutex<Option<Mark>>,
    raised: AsyncMutex<Option<Mark>>,
}

impl SharedWitness {
    pub fn new(witness: Arc<dyn Witness>) -> Self {
        Self {
            witness,
            arrivals: AtomicU64::new(0),
            reads: AsyncMutex::new((
                0,
                FreshRead {
                    now: Witnessed::default(),
                    went_back_from: None,
                },
            )),
            sent: AtomicU64::new(0),
            baseline: parking_lot::Mutex::new((1, None)),
            wanted: parking_lot::Mutex::new(None),
            raised: AsyncMutex::new(None),
        }
    }

    pub fn witness(&self) -> &Arc<dyn Witness> {
        &self.witness
    }

    /// What the witness knew at some moment after this call began, checked
    /// against every read before it. Reads are sent one after another (the
    /// lock is held across each), so each read is sent after the one before
    /// completed and must show at least as much.
    pub async fn read_fresh(&self) -> Result<FreshRead, StoreError> {
        let me = self.arrivals.fetch_add(1, Ordering::SeqCst) + 1;
        let mut reads = self.reads.lock().await;
        if reads.0 >= me {
            return Ok(reads.1);
        }
        // Everyone who arrived so far arrived before this read is sent.
        let covers = self.arrivals.load(Ordering::SeqCst);
        let number = self.sent.fetch_add(1, Ordering::SeqCst) + 1;
        let now = self.witness.read().await?;
        let went_back_from = {
            let mut baseline = self.baseline.lock();
            match baseline.1 {
                _ if number < baseline.0 => None,
                Some(before) if !now.covers(&before) => Some(before),
                _ => {
                    baseline.1 = Some(baseline.1.map_or(now, |b| b.max(now)));
                    None
                }
            }
        };
        let read = FreshRead {
            now,
            went_back_from,
        };
        *reads = (covers, read);
        Ok(read)
    }

    /// Forgets earlier reads: after an epoch advance (which may follow a
    /// restore of the witness itself), the witness as it is now is the new
    /// baseline.
    pub fn start_over(&self) {
        // Reads sent from now on.
        *self.baseline.lock() = (self.sent.load(Ordering::SeqCst) + 1, None);
    }

    /// Returns once the witness covers `mark`.
    pub async fn raise(&self, mark: Mark) -> Result<(), StoreError> {
        {
            let mut wanted = self.wanted.lock();
            if wanted.is_none_or(|w| !w.covers(&mark)) {
                *wanted = Some(mark);
            }
        }
        let mut raised = self.raised.lock().await;
        if raised.is_some_and(|r| r.covers(&mark)) {
            return Ok(());
        }
        let target = (*self.wanted.lock())
            .filter(|w| w.covers(&mark))
            .unwrap_or(mark);
        self.witness.raise(target).await?;
        *raised = Some(target);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A witness whose records the test sets by hand (a restore is a set
    /// to less).
    #[derive(Default)]
    struct Fixed(parking_lot::Mutex<Witnessed>);

    #[async_trait]
    impl Witness for Fixed {
        async fn read(&self) -> Result<Witnessed, StoreError> {
            Ok(*self.0.lock())
        }
        async fn raise(&self, _: Mark) -> Result<(), StoreError> {
            Ok(())
        }
        async fn allocate_epoch(&self, at_least: u32) -> Result<u32, StoreError> {
            Ok(at_least)
        }
        async fn note_epoch(&self, _: u32) -> Result<(), StoreError> {
            Ok(())
        }
        fn describe(&self) -> String {
            "fixed".into()
        }
    }

    fn w(epoch: u32, revision: i64) -> Witnessed {
        Witnessed {
            mark: Some(Mark {
                epoch,
                cluster_id: 9,
                revision,
            }),
            epoch,
        }
    }

    #[test]
    fn covers_needs_both_the_mark_and_the_epoch() {
        assert!(w(1, 10).covers(&w(1, 10)));
        assert!(w(1, 11).covers(&w(1, 10)));
        assert!(w(2, 1).covers(&w(1, 10)));
        assert!(!w(1, 9).covers(&w(1, 10)));
        assert!(!Witnessed::default().covers(&w(1, 1)));
        assert!(w(1, 1).covers(&Witnessed::default()));
        let epoch_only = Witnessed {
            mark: Some(Mark {
                epoch: 1,
                cluster_id: 9,
                revision: 50,
            }),
            epoch: 3,
        };
        assert!(!w(2, 60).covers(&epoch_only), "epoch 2 < 3");
        assert_eq!(
            w(1, 60).max(epoch_only),
            Witnessed {
                epoch: 3,
                ..w(1, 60)
            }
        );
    }

    #[tokio::test]
    async fn a_read_below_an_earlier_one_went_back_until_started_over() {
        let fixed = Arc::new(Fixed::default());
        let shared = SharedWitness::new(fixed.clone());
        *fixed.0.lock() = w(1, 40);
        assert_eq!(shared.read_fresh().await.unwrap().went_back_from, None);
        *fixed.0.lock() = w(1, 50);
        assert_eq!(shared.read_fresh().await.unwrap().went_back_from, None);
        // restored to an earlier snapshot
        *fixed.0.lock() = w(1, 45);
        let read = shared.read_fresh().await.unwrap();
        assert_eq!(read.went_back_from, Some(w(1, 50)));
        assert_eq!(read.now, w(1, 45));
        // it stays behind what was seen: every read says so
        assert_eq!(
            shared.read_fresh().await.unwrap().went_back_from,
            Some(w(1, 50))
        );
        // the operator's advance: the witness as it is now is the baseline
        shared.start_over();
        *fixed.0.lock() = w(2, 46);
        assert_eq!(shared.read_fresh().await.unwrap().went_back_from, None);
        *fixed.0.lock() = w(2, 45);
        assert_eq!(
            shared.read_fresh().await.unwrap().went_back_from,
            Some(w(2, 46))
        );
    }
}
