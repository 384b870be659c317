//! The gate's quorum-loss fault (ADR-04, issue 16): two of the three etcd
//! members down for a few seconds, with workers on a closed (fenced) class
//! and a few on an open (advisory) class.
//!
//! The closed class's keys are judged by the checker with everything else
//! (no double grant, no token regression). The open class's workers keep
//! their histories apart (`history/open/`): their grants during the loss
//! are token 0 from an arbiter's memory, which no linearizability claim
//! covers. What the gate checks for them is ADR-04's promise instead:
//! every unprotected grant a worker was given is in some arbiter's spool.
//! Like the audit tailer, the gate collects the spools the arbiters ship on
//! recovery (before another fault can wipe a state dir).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use super::Rig;

/// The open class: advisory, stays open on quorum loss.
pub const OPEN_CLASS: &str = "gate-open";

/// The open class's policy text (advisory classes need 30 s at least).
pub fn open_class_toml() -> String {
    format!(
        "[[class]]\nname = \"{OPEN_CLASS}\"\ndescription = \"Release gate: an efficiency class open on quorum loss\"\n\
         tier = \"entity\"\nenforcement = \"advisory\"\nttlSeconds = 30\nonQuorumLoss = \"open\"\n\
         riskOwner = \"team-platform@example.com\"\nwaiverExpires = \"2099-12-31\"\n"
    )
}

/// Where the gate keeps the spools it collected.
pub fn collected_dir(rig_dir: &Path) -> PathBuf {
    rig_dir.join("spools")
}

fn spool_root(state_dir: &Path) -> PathBuf {
    state_dir.join("quorum-loss")
}

/// Moves arbiter `i`'s ready spools into the collection; returns how many.
fn collect_ready(state_dir: &Path, into: &Path, i: usize) -> anyhow::Result<usize> {
    let ready = spool_root(state_dir).join("ready");
    let Ok(files) = latchkey_audit::spool::ready_files(&ready) else {
        return Ok(0);
    };
    std::fs::create_dir_all(into)?;
    for file in &files {
        let name = file.file_name().context("a ready file without a name")?;
        let to = into.join(format!("a{i}-{}", name.to_string_lossy()));
        std::fs::copy(file, &to)?;
        std::fs::remove_file(file)?;
    }
    Ok(files.len())
}

/// Collects every arbiter's ready spools; with `open_too` (the arbiters are
/// stopped and their state dirs about to go) also a copy of each open spool.
pub(crate) fn collect_all(rig: &Rig, open_too: bool) -> anyhow::Result<usize> {
    let into = collected_dir(&rig.dir);
    let mut n = 0;
    for (i, state) in rig.arbiter_state.iter().enumerate() {
        n += collect_ready(state, &into, i)?;
        let open = spool_root(state).join("spool.jsonl");
        if open_too && open.exists() {
            std::fs::create_dir_all(&into)?;
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            std::fs::copy(&open, into.join(format!("a{i}-open-{stamp}.jsonl")))?;
            n += 1;
        }
    }
    Ok(n)
}

/// Collects ready spools every 250 ms until dropped (the audit tailer's
/// `--quorum-loss-spool-dir` loop).
pub(crate) fn spawn_collector(rig: std::sync::Arc<Rig>) -> tokio_util::task::AbortOnDrop {
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if let Err(e) = collect_all(&rig, false) {
                tracing::warn!(error = %e, "collecting quorum-loss spools");
            }
        }
    });
    tokio_util::task::AbortOnDrop::new(task.abort_handle())
}

/// After the members are back: waits (bounded) until every arbiter has
/// shipped its open spool, then collects the ready files.
pub(crate) async fn collect_after_recovery(rig: &Rig) -> anyhow::Result<usize> {
    let into = collected_dir(&rig.dir);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let open = rig
            .arbiter_state
            .iter()
            .any(|s| spool_root(s).join("spool.jsonl").exists());
        if !open || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut n = 0;
    for (i, state) in rig.arbiter_state.iter().enumerate() {
        n += collect_ready(state, &into, i)?;
    }
    Ok(n)
}

/// Every spooled grant, as (key, identity): the collection, and whatever
/// is still in the arbiters' state dirs (open or ready).
pub(crate) fn spooled_grants(
    rig_dir: &Path,
    state_dirs: &[PathBuf],
) -> anyhow::Result<BTreeSet<(String, String)>> {
    let mut files = Vec::new();
    if let Ok(f) = latchkey_audit::spool::ready_files(&collected_dir(rig_dir)) {
        files.extend(f);
    }
    for state in state_dirs {
        let root = spool_root(state);
        if let Ok(f) = latchkey_audit::spool::ready_files(&root.join("ready")) {
            files.extend(f);
        }
        if root.join("spool.jsonl").exists() {
            files.push(root.join("spool.jsonl"));
        }
    }
    let mut grants = BTreeSet::new();
    for file in files {
        for line in latchkey_audit::spool::read(&file)
            .with_context(|| format!("reading the spool {}", file.display()))?
        {
            if line.kind == latchkey_audit::spool::SpoolKind::Grant
                && line.token == 0
                && line.unprotected
            {
                grants.insert((line.key, line.identity));
            }
        }
    }
    Ok(grants)
}

/// The unprotected grants (token 0) the open workers were given, as
/// (key, identity, "process#op").
pub(crate) fn unprotected_grants(
    open_history_dir: &Path,
    identity_of: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<Vec<(String, String, String)>> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(open_history_dir) else {
        return Ok(found);
    };
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "jsonl") {
            continue;
        }
        let mut keys: BTreeMap<(String, u64), String> = BTreeMap::new();
        for line in std::fs::read_to_string(&path)?.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let process = v["process"].as_str().unwrap_or_default().to_string();
            let op = v["op"].as_u64().unwrap_or(0);
            match (v["type"].as_str(), v["f"].as_str()) {
                (Some("invoke"), Some("acquire")) => {
                    if let Some(key) = v["key"].as_str() {
                        keys.insert((process, op), key.to_string());
                    }
                }
                (Some("complete"), _) if v["outcome"] == "ok" && v["token"].as_u64() == Some(0) => {
                    if let Some(key) = keys.get(&(process.clone(), op)) {
                        let identity = identity_of(&process).unwrap_or_default();
                        found.push((key.clone(), identity, format!("{process}#{op}")));
                    }
                }
                _ => {}
            }
        }
    }
    Ok(found)
}

/// The unprotected grants no spool has: each a line for the report.
pub fn unspooled(
    grants: &[(String, String, String)],
    spooled: &BTreeSet<(String, String)>,
) -> Vec<String> {
    grants
        .iter()
        .filter(|(key, identity, _)| !spooled.contains(&(key.clone(), identity.clone())))
        .map(|(key, identity, op)| {
            format!("{op}: unprotected grant of {key} to {identity} is in no spool")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unprotected_grant_must_be_in_a_spool() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let history = dir.path().join("w3.0.jsonl");
        std::fs::write(
            &history,
            concat!(
                r#"{"type":"invoke","process":"w3.0","op":1,"f":"acquire","time":1,"key":"bench/gate/open/k0"}"#,
                "\n",
                r#"{"type":"complete","process":"w3.0","op":1,"outcome":"ok","time":2,"token":0}"#,
                "\n",
                r#"{"type":"invoke","process":"w3.0","op":2,"f":"acquire","time":3,"key":"bench/gate/open/k1"}"#,
                "\n",
                r#"{"type":"complete","process":"w3.0","op":2,"outcome":"ok","time":4,"token":281474976710700}"#,
                "\n",
            ),
        )?;
        let grants = unprotected_grants(dir.path(), |_| Some("id-3".into()))?;
        assert_eq!(
            grants,
            vec![(
                "bench/gate/open/k0".to_string(),
                "id-3".to_string(),
                "w3.0#1".to_string()
            )]
        );
        let mut spooled = BTreeSet::new();
        assert_eq!(unspooled(&grants, &spooled).len(), 1);
        spooled.insert(("bench/gate/open/k0".to_string(), "id-3".to_string()));
        assert!(unspooled(&grants, &spooled).is_empty());
        Ok(())
    }
}
