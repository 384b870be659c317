//! The contract's followed key spaces (the hold and session counts): every
//! key read at one revision, then each later change once, in order, with
//! the value a delete removed.

use anyhow::{Context, bail, ensure};
use latchkey_arbiter::lock_log::{Counted, FollowSignal, Kv, LockLog, PrefixWatch};

use super::{WATCH_WAIT, epoch, lease, open, revision, take};

async fn next(watch: &mut Box<dyn PrefixWatch>, what: &str) -> anyhow::Result<FollowSignal> {
    tokio::time::timeout(WATCH_WAIT, watch.next())
        .await
        .with_context(|| format!("no change reported within {WATCH_WAIT:?}: {what}"))
}

/// A follow of the holds reads every hold at the revision it answers with;
/// a grant, a release and a lease's end then come as one response each,
/// at their revision, a delete with the value it removed.
pub async fn a_follow_reads_then_reports_every_change(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/follow", lease(74, 0));
    open(log, id, identity).await?;
    let (a, b) = ("contract/follow/a", "contract/follow/b");
    let held_a = take(log, a, id, identity, &epoch).await?;
    let before = revision(log).await?;
    let mut read: Vec<(String, Kv)> = Vec::new();
    let (at, watch) = log
        .follow(Counted::Holds, true, &mut |key, kv| {
            read.push((key.to_string(), kv.clone()));
        })
        .await?;
    let mut watch = watch?;
    ensure!(at == before, "read at {at}, the log was at {before}");
    let mine: Vec<_> = read
        .iter()
        .filter(|(k, _)| k.starts_with("contract/follow/"))
        .collect();
    ensure!(
        mine.len() == 1 && mine[0].0 == a && mine[0].1.mod_revision == held_a.revision,
        "the read found {mine:?}"
    );

    let held_b = take(log, b, id, identity, &epoch).await?;
    match next(&mut watch, "a grant").await? {
        FollowSignal::Events { events, through } => {
            ensure!(through == held_b.revision, "through {through}");
            ensure!(events.len() == 1, "{events:?}");
            let e = &events[0];
            ensure!(e.key == b && e.prev.is_none(), "{e:?}");
            let put = e.put.as_ref().context("a grant without its value")?;
            ensure!(
                put.lease == id && put.mod_revision == held_b.revision,
                "{put:?}"
            );
        }
        FollowSignal::Lost => bail!("the watch was lost after a grant"),
    }

    let released = log.release(&held_a).await?;
    ensure!(released.value.is_some(), "the release did not happen");
    match next(&mut watch, "a release").await? {
        FollowSignal::Events { events, through } => {
            ensure!(through == released.header.revision, "through {through}");
            ensure!(events.len() == 1, "{events:?}");
            let e = &events[0];
            ensure!(e.key == a && e.put.is_none(), "{e:?}");
            let prev = e
                .prev
                .as_ref()
                .context("a delete without the value it removed")?;
            ensure!(prev.value == held_a.value && prev.lease == id, "{prev:?}");
        }
        FollowSignal::Lost => bail!("the watch was lost after a release"),
    }

    // The session's end takes its last hold with it.
    log.revoke(id).await?;
    let mut seen_b = false;
    while !seen_b {
        match next(&mut watch, "a lease's end").await? {
            FollowSignal::Events { events, .. } => {
                for e in &events {
                    if e.key == b {
                        ensure!(e.put.is_none(), "{e:?}");
                        ensure!(e.prev.as_ref().is_some_and(|p| p.lease == id), "{e:?}");
                        seen_b = true;
                    }
                }
            }
            FollowSignal::Lost => bail!("the watch was lost after a revoke"),
        }
    }
    Ok(())
}
