//! The revision high-water mark, kept outside the lock log.
//!
//! etcd 3.4 keeps the SAME cluster id when a snapshot is restored with the
//! same member flags (measured on this project's machines), so ADR-03's
//! cluster-id binding alone misses such a restore. Before a grant's token is
//! returned, the arbiter makes the grant's revision durable in a small file in
//! its state directory. A lock log whose revisions are below that mark for the
//! same epoch has gone back in time, and the arbiter seals.
//!
//! Writes are group-committed: concurrent grants wait on one file write +
//! fsync that covers all of them (a batch's grants share one revision, so
//! a batch costs one write; [`HighWater::writes`] counts them).

mod slots;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mark {
    pub epoch: u32,
    #[serde(with = "as_string")]
    pub cluster_id: u64,
    pub revision: i64,
}

impl Mark {
    /// Whether `self` is past `other` (a later epoch, or a higher revision in it).
    pub fn covers(&self, other: &Mark) -> bool {
        (self.epoch, self.revision) >= (other.epoch, other.revision)
    }
}

mod as_string {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HighWaterError {
    #[error("cannot create the arbiter state directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the high-water mark {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the high-water mark {path} is corrupt ({detail}); refusing to start because a restored lock log could go unnoticed — restore the file or, if this arbiter never granted, delete it"
    )]
    Corrupt {
        path: PathBuf,
        detail: String,
        /// The decoder's error, when the file does not parse.
        #[source]
        source: Option<serde_json::Error>,
    },
    #[error("cannot write the high-water mark {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub struct HighWater {
    /// The slots file; `None`: kept in memory only (the deterministic
    /// simulation, where a "state directory" is whatever the simulation
    /// hands the next arbiter).
    path: Option<PathBuf>,
    /// Highest mark asked for so far (in memory).
    wanted: Mutex<Option<Mark>>,
    /// Highest mark known to be on disk, and the slots file. Its async lock
    /// is the writer's turn: whoever holds it is the only one writing the
    /// file, and a write runs in a task that owns the guard (see
    /// [`Self::record`]).
    durable: Arc<tokio::sync::Mutex<Disk>>,
    durable_view: Arc<Mutex<Option<Mark>>>,
    /// Marks written (to disk, or to memory for an in-memory mark).
    writes: Arc<AtomicU64>,
}

/// The writer's side: the mark on disk and the open slots file (opened at
/// the first write, reading where the slots stand; put back after each
/// write that succeeded).
struct Disk {
    mark: Option<Mark>,
    writer: Option<slots::Writer>,
}

impl HighWater {
    /// The single-record file earlier versions wrote (replaced on every
    /// write): still read at start, never written.
    pub const FILE: &'static str = "high-water-mark.json";
    /// The file the mark is written to.
    pub const SLOTS_FILE: &'static str = slots::FILE;

    pub fn open(state_dir: &Path) -> Result<Self, HighWaterError> {
        std::fs::create_dir_all(state_dir).map_err(|source| HighWaterError::CreateDir {
            path: state_dir.to_path_buf(),
            source,
        })?;
        let legacy = state_dir.join(Self::FILE);
        let legacy = match std::fs::read(&legacy) {
            Ok(bytes) => Some(serde_json::from_slice::<Mark>(&bytes).map_err(|e| {
                HighWaterError::Corrupt {
                    path: legacy.clone(),
                    detail: e.to_string(),
                    source: Some(e),
                }
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(HighWaterError::Read {
                    path: legacy,
                    source,
                });
            }
        };
        let path = state_dir.join(Self::SLOTS_FILE);
        let mark = match (legacy, slots::read(&path)?.mark) {
            (Some(a), Some(b)) if a.covers(&b) => Some(a),
            (a, b) => b.or(a),
        };
        Ok(Self::with(Some(path), mark))
    }

    /// A mark kept in memory, starting at `mark`: the simulation's state
    /// directory (it carries `current()` over to a restarted arbiter, or
    /// not, for an arbiter that lost its state).
    pub fn in_memory(mark: Option<Mark>) -> Self {
        Self::with(None, mark)
    }

    fn with(path: Option<PathBuf>, mark: Option<Mark>) -> Self {
        Self {
            path,
            wanted: Mutex::new(mark),
            durable: Arc::new(tokio::sync::Mutex::new(Disk { mark, writer: None })),
            durable_view: Arc::new(Mutex::new(mark)),
            writes: Arc::new(AtomicU64::new(0)),
        }
    }

    /// How many marks were written so far (each a slot write and its
    /// `fdatasync`, for a mark on disk).
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// The mark on disk.
    pub fn current(&self) -> Option<Mark> {
        *self.durable_view.lock()
    }

    /// Returns once a mark at least as high as `mark` is on disk.
    ///
    /// Cancel-safe: the write itself (the slot, its sync, and noting the
    /// new durable mark) runs in a task that owns the writer's turn, so a
    /// caller dropped mid-write (a client that went away) neither leaves
    /// the turn to a second writer of the same file nor loses the mark it
    /// wrote; the next caller waits for that write and finds its mark
    /// covered.
    pub async fn record(&self, mark: Mark) -> Result<(), HighWaterError> {
        {
            let mut wanted = self.wanted.lock();
            match *wanted {
                Some(w) if w.covers(&mark) => {}
                _ => *wanted = Some(mark),
            }
        }
        let mut durable = Arc::clone(&self.durable).lock_owned().await;
        if durable.mark.is_some_and(|d| d.covers(&mark)) {
            return Ok(());
        }
        let target = self.wanted.lock().unwrap_or(mark);
        let view = Arc::clone(&self.durable_view);
        self.writes.fetch_add(1, Ordering::Relaxed);
        let Some(path) = self.path.clone() else {
            durable.mark = Some(target);
            *view.lock() = Some(target);
            return Ok(());
        };
        let joined_path = path.clone();
        // Holds the turn until the slot is durable and noted, whether or
        // not anyone still awaits it.
        let write = tokio::spawn(async move {
            let writer = durable.writer.take();
            let blocking_path = path.clone();
            let written = tokio::task::spawn_blocking(move || {
                let mut writer = match writer {
                    Some(w) => w,
                    None => slots::Writer::open(&blocking_path)?,
                };
                writer.write(&blocking_path, target)?;
                Ok::<_, HighWaterError>(writer)
            })
            .await
            .map_err(|e| HighWaterError::Write {
                path,
                source: std::io::Error::other(e),
            })??;
            // A failed write drops the file: the next reads the slots and
            // opens it afresh, so a sequence number never goes back.
            durable.writer = Some(written);
            durable.mark = Some(target);
            *view.lock() = Some(target);
            Ok(())
        });
        write.await.map_err(|e| HighWaterError::Write {
            path: joined_path,
            source: std::io::Error::other(e),
        })?
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn survives_reopen_and_only_goes_up() -> Result<(), HighWaterError> {
        let dir = tempfile::tempdir().map_err(|source| HighWaterError::Read {
            path: PathBuf::new(),
            source,
        })?;
        let hw = HighWater::open(dir.path())?;
        assert_eq!(hw.current(), None);
        let m = |epoch, revision| Mark {
            epoch,
            cluster_id: 7,
            revision,
        };
        hw.record(m(1, 10)).await?;
        hw.record(m(1, 5)).await?;
        assert_eq!(hw.current(), Some(m(1, 10)));
        hw.record(m(2, 3)).await?;
        drop(hw);
        let hw = HighWater::open(dir.path())?;
        assert_eq!(hw.current(), Some(m(2, 3)));
        Ok(())
    }

    /// Issue 18: a grant cancelled while its mark was being written left that
    /// write running without the writer's turn; the next grant wrote the same
    /// temp file at the same time and one rename failed (ENOENT), refusing a
    /// committed grant. Real file writes, grants dropped at varied points.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grants_cancelled_mid_write_never_fail_the_next() -> Result<(), HighWaterError> {
        let dir = tempfile::tempdir().map_err(|source| HighWaterError::Read {
            path: PathBuf::new(),
            source,
        })?;
        let hw = Arc::new(HighWater::open(dir.path())?);
        let m = |revision| Mark {
            epoch: 1,
            cluster_id: 7,
            revision,
        };
        let mut revision = 0;
        for round in 0..300u64 {
            // Cancelled grants: dropped after 0..400 µs, mostly mid-write.
            let mut cancelled = Vec::new();
            for k in 0..3u64 {
                revision += 1;
                let hw = Arc::clone(&hw);
                let after = Duration::from_micros((round * 37 + k * 131) % 400);
                cancelled.push(tokio::spawn(async move {
                    let _ = tokio::time::timeout(after, hw.record(m(revision))).await;
                }));
            }
            // A grant that is not cancelled must always be made durable.
            revision += 1;
            hw.record(m(revision)).await?;
            assert!(hw.current().is_some_and(|c| c.covers(&m(revision))));
            for c in cancelled {
                let _ = c.await;
            }
        }
        let on_disk = HighWater::open(dir.path())?.current();
        assert!(
            on_disk.is_some_and(|c| c.covers(&m(revision))),
            "{on_disk:?}"
        );
        Ok(())
    }

    /// A state dir an earlier version wrote (one JSON record) keeps its
    /// mark as the floor; new marks go to the slots, and a reopen sees the
    /// higher of the two.
    #[tokio::test]
    async fn an_earlier_versions_mark_is_kept() -> Result<(), HighWaterError> {
        let dir = tempfile::tempdir().map_err(|source| HighWaterError::Read {
            path: PathBuf::new(),
            source,
        })?;
        let m = |revision| Mark {
            epoch: 1,
            cluster_id: 7,
            revision,
        };
        let legacy = serde_json::to_vec(&m(40)).unwrap_or_default();
        let _ = std::fs::write(dir.path().join(HighWater::FILE), legacy);
        let hw = HighWater::open(dir.path())?;
        assert_eq!(hw.current(), Some(m(40)));
        hw.record(m(30)).await?;
        assert_eq!(hw.writes(), 0, "covered by the old mark: nothing written");
        hw.record(m(50)).await?;
        drop(hw);
        assert_eq!(HighWater::open(dir.path())?.current(), Some(m(50)));
        Ok(())
    }

    #[test]
    fn corrupt_file_refuses_to_open() {
        let Ok(dir) = tempfile::tempdir() else { return };
        let _ = std::fs::write(dir.path().join(HighWater::FILE), b"{not json");
        let err = HighWater::open(dir.path()).err();
        assert!(
            matches!(err, Some(HighWaterError::Corrupt { .. })),
            "{err:?}"
        );
        // Issue 32: the decoder's error stays the source.
        let source = err
            .as_ref()
            .and_then(|e| std::error::Error::source(e))
            .and_then(|s| s.downcast_ref::<serde_json::Error>());
        assert!(source.is_some(), "{err:?}");
    }
}
