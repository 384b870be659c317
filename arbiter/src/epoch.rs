//! The epoch record and the seal (ADR-03).
//!
//! The arbiter serves only while the lock log is the one its epoch was minted
//! for. It seals — refuses every grant — when any etcd response shows
//! a cluster id other than the epoch record's, when the log's revision is below
//! the high-water mark this arbiter made durable for the same epoch, when the
//! epoch went backwards, or when another arbiter wrote the seal record. A seal
//! is sticky: only an epoch advance (a larger epoch, bound to the current
//! cluster id) lifts it. Nothing else does, not even revisions that later grow
//! past the mark again.

use parking_lot::RwLock;

use crate::error::ArbiterError;
use crate::high_water::Mark;
use crate::records::{EpochRecord, SealRecord};

#[derive(Debug, Clone)]
pub struct EpochState {
    pub record: EpochRecord,
    /// The exact bytes of the record in etcd: every grant compares them.
    pub bytes: Vec<u8>,
    pub cluster_id: u64,
    /// The shard-map fence's mod revision, read with the record (0: no
    /// fence): every grant and hand-over compares it, so a fence raised
    /// since fails them and the records are read again.
    pub fence_at: i64,
    /// The shard map version the cluster is fenced at (0: no fence). An
    /// arbiter routing by an older map does not grant here.
    pub fence_version: u64,
}

impl EpochState {
    pub fn epoch(&self) -> u32 {
        self.record.epoch
    }
}

#[derive(Debug, Clone)]
struct Seal {
    reason: String,
    epoch: u32,
}

#[derive(Default)]
struct Inner {
    state: Option<EpochState>,
    seal: Option<Seal>,
}

#[derive(Default)]
pub struct EpochGuard {
    inner: RwLock<Inner>,
}

/// What a response header and the stored records say about the log, as a
/// seal reason, or `None` if the log is the one the epoch was minted for.
pub fn evaluate(
    state: &EpochState,
    header_cluster_id: u64,
    header_revision: Option<i64>,
    mark: Option<Mark>,
    seal_record: Option<&SealRecord>,
) -> Option<String> {
    if let Some(seal) = seal_record {
        return Some(format!("the lock log is sealed: {}", seal.reason));
    }
    if header_cluster_id != state.cluster_id {
        return Some(format!(
            "etcd cluster id {header_cluster_id} is not the cluster id {} that epoch {} was minted for: the lock log was restored or replaced",
            state.cluster_id,
            state.epoch()
        ));
    }
    let mark = mark?;
    if mark.epoch > state.epoch() {
        return Some(format!(
            "the epoch record says {} but a grant in epoch {} was already handed out (as this arbiter's state directory or the coord witness records): the lock log was restored from before an epoch advance",
            state.epoch(),
            mark.epoch
        ));
    }
    if mark.epoch == state.epoch() {
        if mark.cluster_id != state.cluster_id {
            return Some(format!(
                "epoch {} is bound to cluster {} here, but a grant in it was handed out on cluster {}: the lock log was replaced",
                state.epoch(),
                state.cluster_id,
                mark.cluster_id
            ));
        }
        if let Some(rev) = header_revision
            && rev < mark.revision
        {
            return Some(format!(
                "etcd revision {rev} is below the revision of a grant already handed out (or seen) in epoch {}: the lock log was restored from an earlier snapshot",
                state.epoch()
            ));
        }
    }
    None
}

impl EpochGuard {
    /// The epoch to grant in, or SEALED.
    pub fn serving(&self) -> Result<EpochState, ArbiterError> {
        let inner = self.inner.read();
        match (&inner.seal, &inner.state) {
            (Some(seal), _) => Err(ArbiterError::Sealed {
                reason: seal.reason.clone(),
                epoch: seal.epoch,
            }),
            (None, Some(state)) => Ok(state.clone()),
            (None, None) => Err(ArbiterError::store(
                "the epoch record has not been read yet",
            )),
        }
    }

    pub fn state(&self) -> Option<EpochState> {
        self.inner.read().state.clone()
    }

    pub fn seal_reason(&self) -> Option<String> {
        self.inner.read().seal.as_ref().map(|s| s.reason.clone())
    }

    /// Installs a freshly read epoch record. A seal is lifted only by a larger
    /// epoch that evaluates clean. Returns the new seal reason if this sealed.
    pub fn install(
        &self,
        state: EpochState,
        header_cluster_id: u64,
        header_revision: Option<i64>,
        mark: Option<Mark>,
        seal_record: Option<&SealRecord>,
    ) -> Option<String> {
        let verdict = evaluate(
            &state,
            header_cluster_id,
            header_revision,
            mark,
            seal_record,
        );
        let mut inner = self.inner.write();
        let epoch = state.epoch();
        inner.state = Some(state);
        match (verdict, inner.seal.clone()) {
            (Some(reason), None) => {
                inner.seal = Some(Seal {
                    reason: reason.clone(),
                    epoch,
                });
                Some(reason)
            }
            (Some(_), Some(_)) => None,
            (None, Some(old)) if epoch > old.epoch => {
                inner.seal = None;
                None
            }
            (None, _) => None,
        }
    }

    /// Seals for `reason` (found outside a header check); whether this call
    /// sealed (false if sealed already or no epoch is installed).
    pub fn seal_now(&self, reason: &str) -> bool {
        let mut inner = self.inner.write();
        let Some(epoch) = inner.state.as_ref().map(EpochState::epoch) else {
            return false;
        };
        if inner.seal.is_some() {
            return false;
        }
        inner.seal = Some(Seal {
            reason: reason.to_string(),
            epoch,
        });
        true
    }

    /// Checks a response header against the installed epoch; seals on a
    /// mismatch and returns the reason when this call sealed.
    pub fn observe(
        &self,
        header_cluster_id: u64,
        header_revision: Option<i64>,
        mark: Option<Mark>,
    ) -> Option<String> {
        let state = self.state()?;
        let reason = evaluate(&state, header_cluster_id, header_revision, mark, None)?;
        let mut inner = self.inner.write();
        if inner.seal.is_some() {
            return None;
        }
        inner.seal = Some(Seal {
            reason: reason.clone(),
            epoch: state.epoch(),
        });
        Some(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(epoch: u32, cluster_id: u64) -> EpochState {
        EpochState {
            record: EpochRecord {
                epoch,
                cluster_id: cluster_id.to_string(),
                advanced_at_unix_ms: 0,
                reason: String::new(),
            },
            bytes: vec![],
            cluster_id,
            fence_at: 0,
            fence_version: 0,
        }
    }

    fn mark(epoch: u32, cluster_id: u64, revision: i64) -> Option<Mark> {
        Some(Mark {
            epoch,
            cluster_id,
            revision,
        })
    }

    #[test]
    fn clean_log_serves() {
        assert_eq!(
            evaluate(&state(1, 9), 9, Some(50), mark(1, 9, 40), None),
            None
        );
        assert_eq!(
            evaluate(&state(2, 9), 9, Some(5), mark(1, 9, 40), None),
            None
        );
    }

    #[test]
    fn every_restore_shape_seals() {
        // cluster id changed (restore with other flags)
        assert!(evaluate(&state(1, 9), 8, Some(50), None, None).is_some());
        // same cluster id, revision went back (restore with same flags)
        assert!(evaluate(&state(1, 9), 9, Some(30), mark(1, 9, 40), None).is_some());
        // epoch record went back
        assert!(evaluate(&state(1, 9), 9, Some(99), mark(2, 9, 4), None).is_some());
        // a fresh cluster minted the same epoch again
        assert!(evaluate(&state(1, 7), 7, Some(99), mark(1, 9, 4), None).is_some());
        // another arbiter sealed
        let seal = SealRecord {
            reason: "x".into(),
            sealed_at_unix_ms: 0,
            next_epoch_at_least: 2,
        };
        assert!(evaluate(&state(1, 9), 9, Some(50), None, Some(&seal)).is_some());
    }

    #[test]
    fn seal_is_sticky_until_the_epoch_advances() {
        let guard = EpochGuard::default();
        assert!(
            guard
                .install(state(1, 9), 9, Some(30), mark(1, 9, 40), None)
                .is_some()
        );
        assert!(guard.serving().is_err());
        // revisions grow past the mark again: still sealed
        assert!(
            guard
                .install(state(1, 9), 9, Some(41), mark(1, 9, 40), None)
                .is_none()
        );
        assert!(guard.serving().is_err());
        // the advance lifts it
        guard.install(state(2, 9), 9, Some(42), mark(1, 9, 40), None);
        assert_eq!(guard.serving().map(|s| s.epoch()).ok(), Some(2));
    }
}
