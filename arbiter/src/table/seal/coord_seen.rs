//! The lock log's memory of its witness (`sys/coord-seen`): what the coord
//! cluster showed for this lock log, written back into the lock log so that
//! a restore of the coord cluster is seen by an arbiter with no memory.

use tracing::warn;

use super::Seal;
use crate::high_water::Mark;
use crate::records::{CoordSeenRecord, decode, encode, now_unix_ms};
use crate::witness::Witnessed;

/// How often, at most, an arbiter writes what it read from the coord
/// cluster into the lock log's coord-seen record while the witness moves.
/// A restore of the coord cluster that loses less than this much is not
/// seen by an arbiter started after it (one running across it still sees
/// it); nothing it lost is then below the lock log's own grants, so only a
/// restore of the lock log as well, before the next grant, could use it.
pub const COORD_SEEN_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The lock log's record of its witness, as last read from the log.
#[derive(Debug, Default)]
pub(super) struct CoordSeen {
    /// The record's mod revision (`None`: absent), for a conditional write.
    pub(super) at: Option<i64>,
    pub(super) record: Option<CoordSeenRecord>,
    /// When this arbiter last wrote it, and whether a write is under way.
    written: Option<tokio::time::Instant>,
    writing: bool,
}

impl CoordSeen {
    /// What the record says the coord cluster showed in `lock_epoch`.
    pub(super) fn in_epoch(&self, lock_epoch: Option<u32>) -> Option<Witnessed> {
        let record = self.record.as_ref()?;
        if Some(record.lock_epoch) != lock_epoch {
            return None;
        }
        Some(witnessed_of(record))
    }
}

pub(super) fn witnessed_of(record: &CoordSeenRecord) -> Witnessed {
    Witnessed {
        mark: (record.mark_revision > 0).then(|| Mark {
            epoch: record.mark_epoch,
            cluster_id: record.mark_cluster_id.parse().unwrap_or(0),
            revision: record.mark_revision,
        }),
        epoch: record.epoch,
    }
}

impl Seal {
    /// Writes `read` (checked, from the coord cluster) into the lock log's
    /// coord-seen record when the record lags behind: at once when there is
    /// none for this epoch or the witness's epoch moved, else (the mark
    /// moved) at most every [`COORD_SEEN_EVERY`]. One
    /// write at a time; a failed write is tried again on a later read.
    pub(super) async fn record_coord_seen(&self, lock_epoch: u32, read: Witnessed) {
        {
            let mut seen = self.coord_seen.lock();
            let due = match seen.in_epoch(Some(lock_epoch)) {
                None => true,
                Some(recorded) if recorded.covers(&read) => false,
                // A new epoch on the witness is rare: record it at once.
                Some(recorded) if recorded.epoch < read.epoch => true,
                Some(_) => seen
                    .written
                    .is_none_or(|at| at.elapsed() >= COORD_SEEN_EVERY),
            };
            if !due || seen.writing {
                return;
            }
            seen.writing = true;
        }
        let outcome = self.write_coord_seen(lock_epoch, read).await;
        {
            let mut seen = self.coord_seen.lock();
            seen.writing = false;
            seen.written = Some(tokio::time::Instant::now());
            if let Some((at, record)) = outcome {
                seen.at = Some(at);
                seen.record = Some(record);
            }
        }
    }

    /// The conditional write itself: the record becomes the higher of what
    /// it held in this epoch and `read`. The record and its mod revision
    /// when it was written or already covered `read`.
    async fn write_coord_seen(
        &self,
        lock_epoch: u32,
        read: Witnessed,
    ) -> Option<(i64, CoordSeenRecord)> {
        for _ in 0..3 {
            let answer = match self.log.records().await {
                Ok(answer) => answer,
                Err(e) => {
                    warn!(error = %e.detail(), "could not read the coord-seen record");
                    return None;
                }
            };
            let kv = answer.value.coord_seen;
            let existing = kv
                .as_ref()
                .and_then(|kv| decode::<CoordSeenRecord>(&kv.value))
                .filter(|r| r.lock_epoch == lock_epoch);
            let merged = existing
                .as_ref()
                .map_or(read, |r| witnessed_of(r).max(read));
            if let (Some(kv), Some(r)) = (&kv, &existing)
                && witnessed_of(r).covers(&read)
            {
                return Some((kv.mod_revision, r.clone()));
            }
            let record = CoordSeenRecord {
                lock_epoch,
                mark_epoch: merged.mark.map_or(0, |m| m.epoch),
                mark_revision: merged.mark.map_or(0, |m| m.revision),
                mark_cluster_id: merged.mark.map_or(0, |m| m.cluster_id).to_string(),
                epoch: merged.epoch,
                seen_at_unix_ms: now_unix_ms(),
            };
            match self
                .log
                .put_coord_seen(encode(&record), kv.as_ref().map(|kv| kv.mod_revision))
                .await
            {
                Ok(answer) if answer.value => return Some((answer.header.revision, record)),
                Ok(_) => continue,
                Err(e) => {
                    warn!(error = %e.detail(), "could not write the coord-seen record");
                    return None;
                }
            }
        }
        None
    }
}
