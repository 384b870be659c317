//! The quorum-loss spool (ADR-04): every grant an open class gets from the
//! arbiter's memory while etcd has no quorum, appended as one JSON line and
//! `fdatasync`ed before the caller hears of it, so no unprotected grant is
//! ever handed out that the audit trail cannot list afterwards.
//!
//! Layout under the state directory:
//!
//! ```text
//! quorum-loss/spool.jsonl           the open spool (appended during a loss)
//! quorum-loss/ready/<ms>-<n>.jsonl  closed spools, waiting for the audit tailer
//! ```
//!
//! On recovery the open spool is renamed into `ready/` (and the directories
//! synced); the audit tailer (`latchkey-audit --quorum-loss-spool-dir`)
//! copies each ready file into the audit store, marked unprotected, and
//! moves it out of `ready/`. The spool is bounded: the open spool and every
//! ready file together stay under `limit_bytes`, and a grant that would go
//! over is refused (the caller hears UNAVAILABLE), never answered unspooled.
//!
//! A crash can leave a torn last line; readers skip a last line without its
//! newline (it was never synced, so it was never answered).

use parking_lot::{Mutex, MutexGuard};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The open spool's file name.
pub const SPOOL_FILE: &str = "spool.jsonl";
/// Where closed spools wait for the audit tailer.
pub const READY_DIR: &str = "ready";

/// The spool's lines: one definition with the audit tailer, which reads
/// them (`latchkey_records::spool`).
pub use latchkey_records::spool::{SpoolKind, SpoolRecord};

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error(
        "the quorum-loss spool is full ({used} of {limit} bytes in {dir}): no more unprotected grants until quorum returns and the audit tailer collects it"
    )]
    Full { used: u64, limit: u64, dir: PathBuf },
    #[error("{identity} has used its share of the quorum-loss spool ({used} of {share} bytes)")]
    Share {
        identity: String,
        used: u64,
        share: u64,
    },
    #[error("cannot write the quorum-loss spool {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The spool of one arbiter. Its methods block (they write and sync files):
/// call them from `spawn_blocking`.
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    limit_bytes: u64,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Open lazily: an arbiter that never loses quorum writes nothing.
    file: Option<File>,
    /// Bytes in the open spool.
    open_bytes: u64,
    /// Bytes in `ready/` when last counted.
    ready_bytes: u64,
    /// Spools closed by this process (names them uniquely).
    closed: u64,
    /// Bytes each identity's grants took in the open spool (twice the grant
    /// line: room for its release is kept).
    per_identity: std::collections::HashMap<String, u64>,
    /// Room kept in the bound for the release lines of grants written.
    reserved: u64,
}

/// One identity may take at most this fraction of the spool's bound: one
/// workload cannot use up everyone's unprotected grants.
pub const SHARE_DIVISOR: u64 = 8;

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl Spool {
    /// Opens (creating) `state_dir/quorum-loss`, and returns the records of
    /// an open spool left by an earlier run (a loss that outlived it).
    pub fn open(
        state_dir: &Path,
        limit_bytes: u64,
    ) -> Result<(Self, Vec<SpoolRecord>), SpoolError> {
        let dir = state_dir.join("quorum-loss");
        let ready = dir.join(READY_DIR);
        fs::create_dir_all(&ready).map_err(io_err(&ready))?;
        let path = dir.join(SPOOL_FILE);
        let records = match read(&path) {
            Ok(records) => records,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(SpoolError::Io { path, source }),
        };
        let open_bytes = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let spool = Self {
            dir,
            limit_bytes,
            inner: Mutex::new(Inner {
                file: None,
                open_bytes,
                ready_bytes: 0,
                closed: 0,
                per_identity: std::collections::HashMap::new(),
                reserved: 0,
            }),
        };
        let ready_bytes = spool.count_ready();
        spool.lock().ready_bytes = ready_bytes;
        Ok((spool, records))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// The open spool's path.
    pub fn path(&self) -> PathBuf {
        self.dir.join(SPOOL_FILE)
    }

    /// Where closed spools wait for the audit tailer.
    pub fn ready_dir(&self) -> PathBuf {
        self.dir.join(READY_DIR)
    }

    fn count_ready(&self) -> u64 {
        fs::read_dir(self.ready_dir())
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Appends one record and syncs it to disk before returning: the
    /// caller answers only after this returns `Ok`. Refuses, writing
    /// nothing, when the record would take the spool over its bound.
    pub fn append(&self, record: &SpoolRecord) -> Result<(), SpoolError> {
        let mut line = serde_json::to_vec(record).map_err(|e| SpoolError::Io {
            path: self.path(),
            source: io::Error::other(e),
        })?;
        line.push(b'\n');
        let path = self.path();
        let mut inner = self.lock();
        // A grant keeps room for its release line, in the bound and in its
        // identity's share.
        let len = line.len() as u64;
        let need = match record.kind {
            SpoolKind::Grant => 2 * len,
            SpoolKind::Release => len,
        };
        if record.kind == SpoolKind::Grant {
            let share = self.share();
            let used = inner
                .per_identity
                .get(record.bounded_as())
                .copied()
                .unwrap_or(0);
            if used + need > share {
                return Err(SpoolError::Share {
                    identity: record.bounded_as().to_string(),
                    used,
                    share,
                });
            }
        }
        // A release takes the room its grant kept.
        let kept = match record.kind {
            SpoolKind::Release => inner.reserved.min(len),
            SpoolKind::Grant => 0,
        };
        let mut used = inner.open_bytes + inner.ready_bytes + inner.reserved - kept;
        if used + need > self.limit_bytes {
            // The tailer may have collected ready files since: count again.
            inner.ready_bytes = self.count_ready();
            used = inner.open_bytes + inner.ready_bytes + inner.reserved - kept;
            if used + need > self.limit_bytes {
                return Err(SpoolError::Full {
                    used,
                    limit: self.limit_bytes,
                    dir: self.dir.clone(),
                });
            }
        }
        if inner.file.is_none() {
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(io_err(&path))?;
            // A new file's directory entry must survive a crash too.
            sync_dir(&self.dir).map_err(io_err(&self.dir))?;
            inner.file = Some(file);
        }
        let Some(file) = inner.file.as_mut() else {
            return Err(SpoolError::Io {
                path,
                source: io::Error::other("spool file not open"),
            });
        };
        let written = file.write_all(&line).and_then(|()| file.sync_data());
        if let Err(source) = written {
            // Whatever reached the file is torn or unsynced: start a fresh
            // handle next time, and count the bytes as used.
            inner.file = None;
            inner.open_bytes = fs::metadata(&path).map(|m| m.len()).unwrap_or(u64::MAX / 2);
            return Err(SpoolError::Io { path, source });
        }
        inner.open_bytes += len;
        match record.kind {
            SpoolKind::Grant => {
                inner.reserved += len;
                *inner
                    .per_identity
                    .entry(record.bounded_as().to_string())
                    .or_insert(0) += need;
            }
            SpoolKind::Release => inner.reserved -= kept,
        }
        Ok(())
    }

    /// The bytes one identity's grants may take in the open spool.
    pub fn share(&self) -> u64 {
        self.limit_bytes / SHARE_DIVISOR
    }

    /// Closes the open spool into `ready/` for the audit tailer, if it has
    /// anything; returns the ready file's path.
    pub fn ship(&self) -> Result<Option<PathBuf>, SpoolError> {
        let path = self.path();
        let mut inner = self.lock();
        let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        if len == 0 {
            return Ok(None);
        }
        if let Some(file) = inner.file.take() {
            file.sync_all().map_err(io_err(&path))?;
        }
        inner.closed += 1;
        let name = format!(
            "{}-{}-{}.jsonl",
            crate::records::now_unix_ms(),
            std::process::id(),
            inner.closed
        );
        let target = self.ready_dir().join(name);
        fs::rename(&path, &target).map_err(io_err(&target))?;
        sync_dir(&self.ready_dir()).map_err(io_err(&self.ready_dir()))?;
        sync_dir(&self.dir).map_err(io_err(&self.dir))?;
        inner.open_bytes = 0;
        inner.per_identity.clear();
        inner.reserved = 0;
        inner.ready_bytes = self.count_ready();
        Ok(Some(target))
    }

    /// Bytes of the open spool and of the ready files as last counted.
    pub fn used_bytes(&self) -> u64 {
        let inner = self.lock();
        inner.open_bytes + inner.ready_bytes
    }

    /// Bytes the open spool holds.
    pub fn open_bytes(&self) -> u64 {
        self.lock().open_bytes
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Every whole record of a spool file, in order. A last line without its
/// newline is a torn write (never synced, never answered) and is skipped;
/// a malformed whole line is an error.
pub fn read(path: &Path) -> io::Result<Vec<SpoolRecord>> {
    let bytes = fs::read(path)?;
    let mut records = Vec::new();
    for line in bytes.split_inclusive(|&b| b == b'\n') {
        let Some(line) = line.strip_suffix(b"\n") else {
            // Torn tail.
            break;
        };
        if line.is_empty() {
            continue;
        }
        let record = serde_json::from_slice(line).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: a spool line is not a record: {e}", path.display()),
            )
        })?;
        records.push(record);
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: i64, key: &str) -> SpoolRecord {
        SpoolRecord {
            id,
            kind: SpoolKind::Grant,
            key: key.into(),
            identity: "spiffe://dev.latchkey/w/a".into(),
            bound: String::new(),
            instance: String::new(),
            session: 7,
            class: "batch".into(),
            ttl_seconds: 30,
            at_unix_ms: 1_700_000_000_000,
            token: 0,
            unprotected: true,
            arbiter: "a1".into(),
            cluster_id: 9,
        }
    }

    #[test]
    fn append_is_on_disk_before_it_returns_and_replays() {
        let dir = tempfile::tempdir().unwrap();
        let (spool, old) = Spool::open(dir.path(), 1 << 20).unwrap();
        assert!(old.is_empty());
        spool.append(&record(1, "a/b")).unwrap();
        spool.append(&record(2, "a/c")).unwrap();
        // What a fresh reader (another process after a crash) sees at once.
        let seen = read(&spool.path()).unwrap();
        assert_eq!(seen, vec![record(1, "a/b"), record(2, "a/c")]);
        drop(spool);
        // An arbiter restarting during the loss replays the open spool.
        let (spool, old) = Spool::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(old.len(), 2);
        spool.append(&record(3, "a/d")).unwrap();
        assert_eq!(read(&spool.path()).unwrap().len(), 3);
    }

    #[test]
    fn a_torn_last_line_is_skipped_a_bad_whole_line_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.jsonl");
        let mut good = serde_json::to_vec(&record(1, "a/b")).unwrap();
        good.push(b'\n');
        let mut bytes = good.clone();
        bytes.extend_from_slice(b"{\"id\":2,\"ki");
        fs::write(&path, &bytes).unwrap();
        assert_eq!(read(&path).unwrap(), vec![record(1, "a/b")]);
        bytes.extend_from_slice(b"\n");
        fs::write(&path, &bytes).unwrap();
        assert_eq!(read(&path).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn bounded_refuses_when_full_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        // Eight identities' grants, each with room kept for its release,
        // fill the bound exactly (and each identity's share).
        let of = |i: i64| SpoolRecord {
            identity: format!("spiffe://dev.latchkey/w/{i:02}"),
            ..record(1, "a/b")
        };
        let line = serde_json::to_vec(&of(1)).unwrap().len() as u64 + 1;
        let (spool, _) = Spool::open(dir.path(), line * 2 * SHARE_DIVISOR).unwrap();
        for i in 1..=8 {
            spool.append(&of(i)).unwrap();
        }
        let err = spool.append(&of(9)).unwrap_err();
        assert!(matches!(err, SpoolError::Full { .. }), "{err}");
        assert!(err.to_string().contains("spool is full"), "{err}");
        assert_eq!(read(&spool.path()).unwrap().len(), 8);
        // Shipping frees only the room kept for releases: the ready file
        // (8 lines) counts until the audit tailer collects it.
        let shipped = spool.ship().unwrap().unwrap();
        for i in 9..=12 {
            spool.append(&of(i)).unwrap();
        }
        assert!(spool.append(&of(13)).is_err());
        fs::remove_file(&shipped).unwrap();
        spool.append(&of(13)).unwrap();
    }

    #[test]
    fn one_identity_gets_its_share_and_its_releases_always_fit() {
        let dir = tempfile::tempdir().unwrap();
        let line = serde_json::to_vec(&record(1, "a/b")).unwrap().len() as u64 + 1;
        // A share of two grants (with their releases).
        let (spool, _) = Spool::open(dir.path(), line * 4 * SHARE_DIVISOR).unwrap();
        spool.append(&record(1, "a/b")).unwrap();
        spool.append(&record(2, "a/c")).unwrap();
        let err = spool.append(&record(3, "a/d")).unwrap_err();
        assert!(matches!(err, SpoolError::Share { .. }), "{err}");
        for id in [1, 2] {
            let release = SpoolRecord {
                kind: SpoolKind::Release,
                ..record(id, "a/b")
            };
            spool.append(&release).unwrap();
        }
        assert_eq!(read(&spool.path()).unwrap().len(), 4);
        // A new loss (after shipping) starts a new share.
        spool.ship().unwrap();
        spool.append(&record(3, "a/d")).unwrap();
    }

    #[test]
    fn ship_moves_the_open_spool_to_ready_once() {
        let dir = tempfile::tempdir().unwrap();
        let (spool, _) = Spool::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(spool.ship().unwrap(), None);
        spool.append(&record(1, "a/b")).unwrap();
        let shipped = spool.ship().unwrap().unwrap();
        assert!(shipped.starts_with(spool.ready_dir()));
        assert_eq!(read(&shipped).unwrap(), vec![record(1, "a/b")]);
        assert!(!spool.path().exists());
        assert_eq!(spool.ship().unwrap(), None);
        // The next loss starts a new spool.
        spool.append(&record(2, "a/c")).unwrap();
        assert_eq!(read(&spool.path()).unwrap(), vec![record(2, "a/c")]);
        let again = spool.ship().unwrap().unwrap();
        assert_ne!(again, shipped);
    }
}
