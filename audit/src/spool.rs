//! Unprotected grants from the arbiters' quorum-loss spools (ADR-04).
//!
//! While the lock cluster has no quorum, an arbiter grants the classes
//! declared `onQuorumLoss = "open"` from its memory with token 0 and appends
//! each grant (and its release) to a fsynced spool file; no etcd revision
//! exists for them, so the tailer cannot see them in the log. On recovery
//! the arbiter closes the spool into `<state-dir>/quorum-loss/ready/`; this
//! module reads those files (`latchkey-audit --quorum-loss-spool-dir`),
//! writes their events to the audit store marked `"unprotected": true`, and
//! moves each file to `../shipped/` once its events are written.
//!
//! Event keys: an unprotected event has no revision, so it is stored at a
//! negative one, `SPOOL_REVISION_BASE + 2 * id` for the grant and one more
//! for its release (`id` is the arbiter's `unix_ms << 12 | seq`): never a
//! real revision, distinct per grant, in time order among themselves (and
//! before every etcd revision), and the same on every replay (the stores
//! ignore copies). The reconciliation list is every event with
//! `detail.unprotected = true` over the outage window.

use std::io;
use std::path::{Path, PathBuf};

use crate::event::{Ended, Event, Kind};

/// Where unprotected events' revisions start: far below zero, so that
/// `base + 2 * id` stays negative for every id (ids are below 2^55).
pub const SPOOL_REVISION_BASE: i64 = i64::MIN / 2;

/// One spool line: the arbiter's own type (`latchkey_records::spool`),
/// which reads lines from before `bound`, `instance` and `clusterId`.
pub use latchkey_records::spool::{SpoolKind, SpoolRecord as SpoolLine};

/// Every whole line of a spool file. A last line without its newline was
/// torn by a crash (never synced, so never answered) and is skipped, and
/// so is a line of a kind this tailer does not know (a newer arbiter's:
/// it has no event here).
pub fn read(path: &Path) -> io::Result<Vec<SpoolLine>> {
    let bytes = std::fs::read(path)?;
    let mut lines = Vec::new();
    for line in bytes.split_inclusive(|&b| b == b'\n') {
        let Some(line) = line.strip_suffix(b"\n") else {
            break;
        };
        if line.is_empty() {
            continue;
        }
        let bad = |source| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                NotASpoolLine {
                    path: path.to_path_buf(),
                    source,
                },
            )
        };
        let value: serde_json::Value = serde_json::from_slice(line).map_err(bad)?;
        let kind = value.get("kind").cloned().unwrap_or_default();
        if kind.is_string() && serde_json::from_value::<SpoolKind>(kind).is_err() {
            continue;
        }
        lines.push(serde_json::from_value(value).map_err(bad)?);
    }
    Ok(lines)
}

/// A spool line that does not decode; the decoder's error stays the source.
#[derive(Debug, thiserror::Error)]
#[error("{}: not a spool line: {source}", path.display())]
struct NotASpoolLine {
    path: PathBuf,
    source: serde_json::Error,
}

/// The audit events of a spool's lines: (cluster id, event) each.
pub fn events(lines: &[SpoolLine], file: &str) -> Vec<(u64, Event)> {
    lines
        .iter()
        .filter_map(|l| {
            let grant = SPOOL_REVISION_BASE.checked_add(l.id.checked_mul(2)?)?;
            let (kind, ended, revision) = match l.kind {
                SpoolKind::Grant => (Kind::Grant, Ended::No, grant),
                SpoolKind::Release => (Kind::Release, Ended::Released, grant.checked_add(1)?),
            };
            if revision >= 0 {
                return None;
            }
            let mut e = Event::new(revision, l.key.clone(), kind, 0);
            e.ended = ended;
            e.identity = l.identity.clone();
            e.session = l.session;
            e.class = l.class.clone();
            e.hold_revision = grant;
            e.detail = serde_json::json!({
                "unprotected": true,
                "token": 0,
                "cause": "quorum-loss",
                "arbiter": l.arbiter,
                "atUnixMs": l.at_unix_ms,
                "ttlSeconds": l.ttl_seconds,
                "spool": file,
            });
            Some((l.cluster_id, e))
        })
        .collect()
}

/// The ready spool files in `dir`, oldest name first.
pub fn ready_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl") && p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

/// Where a shipped file goes: `<dir>/../shipped/<name>`.
pub fn shipped_path(ready: &Path) -> Option<PathBuf> {
    let dir = ready.parent()?.parent()?.join("shipped");
    Some(dir.join(ready.file_name()?))
}

#[cfg(feature = "tailer")]
mod collect {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use tokio::sync::watch;
    use tracing::{info, warn};

    use super::{events, read, ready_files, shipped_path};
    use crate::event::Event;
    use crate::store::AuditStore;

    /// Writes every ready spool file in `dir` to `store`, then moves it to
    /// `shipped/`; returns the number of events written.
    pub async fn collect_once(dir: &Path, store: &dyn AuditStore) -> anyhow::Result<usize> {
        let mut written = 0;
        for file in ready_files(dir)? {
            let lines = read(&file)?;
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let mut by_cluster: BTreeMap<u64, Vec<Event>> = BTreeMap::new();
            for (cluster, event) in events(&lines, &name) {
                by_cluster.entry(cluster).or_default().push(event);
            }
            for (cluster, events) in &by_cluster {
                store.write(*cluster, events).await?;
                written += events.len();
            }
            let Some(to) = shipped_path(&file) else {
                anyhow::bail!("{}: no place to move it to", file.display());
            };
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::rename(&file, &to)?;
            info!(file = %name, events = lines.len(), "copied a quorum-loss spool (unprotected grants) into the audit store");
        }
        Ok(written)
    }

    /// Collects from `dirs` every `every` until `stop`.
    pub async fn run(
        dirs: Vec<PathBuf>,
        store: std::sync::Arc<dyn AuditStore>,
        every: Duration,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            for dir in &dirs {
                if let Err(e) = collect_once(dir, store.as_ref()).await {
                    warn!(dir = %dir.display(), error = %e, "cannot collect quorum-loss spools; will retry");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

#[cfg(feature = "tailer")]
pub use collect::{collect_once, run};

#[cfg(test)]
mod tests {
    use super::*;

    const GRANT: &str = r#"{"id":4096,"kind":"grant","key":"shared/a","identity":"spiffe://dev.latchkey/workload/alice","session":7,"class":"spare","ttlSeconds":30,"atUnixMs":1,"token":0,"unprotected":true,"arbiter":"a1","clusterId":9}"#;
    const RELEASE: &str = r#"{"id":4096,"kind":"release","key":"shared/a","identity":"spiffe://dev.latchkey/workload/alice","session":7,"class":"spare","ttlSeconds":30,"atUnixMs":2,"token":0,"unprotected":true,"arbiter":"a1","clusterId":9}"#;

    #[test]
    fn spool_lines_become_unprotected_events_at_negative_revisions() {
        let dir = std::env::temp_dir().join(format!("latchkey-spool-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("ready")).unwrap();
        let file = dir.join("ready").join("1-1-1.jsonl");
        std::fs::write(&file, format!("{GRANT}\n{RELEASE}\n{{\"id\":5,")).unwrap();
        let lines = read(&file).unwrap();
        assert_eq!(lines.len(), 2, "the torn tail is skipped");
        let events = events(&lines, "1-1-1.jsonl");
        assert_eq!(events.len(), 2);
        let (cluster, grant) = &events[0];
        assert_eq!(*cluster, 9);
        assert_eq!(
            (grant.kind, grant.revision),
            (Kind::Grant, SPOOL_REVISION_BASE + 8192)
        );
        assert!(grant.revision < 0);
        assert_eq!(grant.detail["unprotected"], true);
        assert_eq!(grant.detail["token"], 0);
        let (_, release) = &events[1];
        assert_eq!(
            (release.kind, release.revision),
            (Kind::Release, SPOOL_REVISION_BASE + 8193)
        );
        assert_eq!(release.hold_revision, grant.revision);
        assert_eq!(ready_files(&dir.join("ready")).unwrap(), vec![file.clone()]);
        assert_eq!(
            shipped_path(&file).unwrap(),
            dir.join("shipped").join("1-1-1.jsonl")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Lines as arbiters wrote them decode into the one type: without
    /// `clusterId` (older spools), with `bound` and `instance` (newer
    /// ones); a kind this tailer does not know is skipped, as before.
    #[test]
    fn old_and_new_arbiter_lines_are_read() {
        let dir = std::env::temp_dir().join(format!("latchkey-spool-old-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("1-1-1.jsonl");
        let older = GRANT.replace(r#","clusterId":9"#, "");
        let newer = RELEASE.replace(
            r#""session":7"#,
            r#""bound":"spiffe://dev.latchkey/workload/*","instance":"pod-1","session":7"#,
        );
        let unknown = GRANT.replace(r#""kind":"grant""#, r#""kind":"renew""#);
        std::fs::write(&file, format!("{older}\n{unknown}\n{newer}\n")).unwrap();
        let lines = read(&file).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!((lines[0].kind, lines[0].cluster_id), (SpoolKind::Grant, 0));
        assert_eq!(lines[1].kind, SpoolKind::Release);
        assert_eq!(lines[1].bound, "spiffe://dev.latchkey/workload/*");
        assert_eq!(lines[1].instance, "pod-1");
        let events = events(&lines, "1-1-1.jsonl");
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].0, 0);
        assert_eq!(events[1].1.kind, Kind::Release);
    }

    /// Issue 32: a line that does not decode keeps the decoder's error as
    /// the source, under the message that names the file.
    #[test]
    fn a_bad_line_keeps_the_decoders_error() {
        let dir = std::env::temp_dir().join(format!("latchkey-spool-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("1-1-1.jsonl");
        std::fs::write(&file, format!("{GRANT}\nnot json\n")).unwrap();
        let err = read(&file).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let source = std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<serde_json::Error>())
            .unwrap_or_else(|| panic!("no serde_json source: {err:?}"));
        assert_eq!(
            err.to_string(),
            format!("{}: not a spool line: {source}", file.display())
        );
    }
}
