//! Lock-loss push (issue 13): a holder hears at once when its hold ends by
//! anything but its own release — the hold removed from the log (what an
//! operator's force-release does), its session's lease revoked, an epoch
//! advance — and fences that hold without waiting for its deadline. The
//! class is `batch-report` (TTL 60 s), so a fence well inside the polls'
//! deadlines below can only have come from the arbiter's notice.

use std::sync::Arc;
use std::time::Duration;

use latchkey_client::{Error, FenceReason};
use latchkey_tests::eventually;
use tokio::time::timeout;

use crate::client::{Fired, connect, recorder, snapshot};
use crate::latchctl::latchctl_hold;
use crate::support::{layout, stack};

const CLASS: &str = "batch-report";
/// Far below the class's fence deadline (TTL 60 s less a second).
const PUSHED: Duration = Duration::from_secs(10);

fn fired_with(fired: &Fired, reason: FenceReason) -> anyhow::Result<()> {
    let got = snapshot(fired);
    anyhow::ensure!(
        got.iter().any(|(_, r)| *r == reason),
        "on_fence({reason:?}) not fired yet: {got:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hold_removed_from_the_log_is_fenced_at_once_and_the_session_lives_on()
-> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let (fired_a, fired_b): (Fired, Fired) = (Arc::default(), Arc::default());
    let a = alice
        .lock("demo/ll-a", CLASS)
        .acquire(recorder(&fired_a))
        .await?;
    // a nested guard of the same hold hears it too
    let a2 = alice
        .lock("demo/ll-a", CLASS)
        .acquire(recorder(&fired_a))
        .await?;
    let b = alice
        .lock("demo/ll-b", CLASS)
        .acquire(recorder(&fired_b))
        .await?;
    assert_eq!(a.session_id(), b.session_id());

    // what a force-release does to the hold: its record leaves the log
    s.etcd
        .client()
        .await?
        .delete(layout().holder("demo/ll-a"), None)
        .await?;
    eventually("alice to hear that her hold ended", PUSHED, || async {
        fired_with(&fired_a, FenceReason::HoldEnded)
    })
    .await?;
    assert_eq!(snapshot(&fired_a).len(), 2, "once per guard");
    assert!(a.is_fenced() && a2.is_fenced());
    assert!(snapshot(&fired_b).is_empty(), "only that hold is fenced");
    assert!(!b.is_fenced() && b.can_start(), "the session lives on");

    // releasing a lost hold says so, and sends nothing
    match a.release().await {
        Err(Error::Fenced { reason, .. }) => assert_eq!(reason, FenceReason::HoldEnded),
        other => anyhow::bail!("release of a lost hold: {other:?}"),
    }
    drop(a2);
    // the key can be taken again, on the same session
    let again = alice.lock("demo/ll-a", CLASS).acquire(|_| {}).await?;
    assert_eq!(again.session_id(), b.session_id());
    assert!(again.revision() > b.revision());
    // her own release tells her nothing
    let fired_before = snapshot(&fired_b).len();
    again.release().await?;
    b.release().await?;
    assert_eq!(snapshot(&fired_b).len(), fired_before);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_revoked_session_fences_its_holds_as_soon_as_the_arbiter_sees_it() -> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let fired: Fired = Arc::default();
    let a = alice
        .lock("demo/ll-r1", CLASS)
        .acquire(recorder(&fired))
        .await?;
    let b = alice
        .lock("demo/ll-r2", CLASS)
        .acquire(recorder(&fired))
        .await?;
    s.etcd
        .client()
        .await?
        .lease_client()
        .revoke(a.session_id())
        .await?;
    eventually("both holds to be fenced", PUSHED, || async {
        let got = snapshot(&fired);
        anyhow::ensure!(got.len() == 2, "fired so far: {got:?}");
        Ok(())
    })
    .await?;
    assert!(a.is_fenced() && b.is_fenced());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_epoch_advance_fences_every_holder_at_once() -> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let bob = connect(s.arbiter.addr(), "workload/bob").await?;
    let operator = connect(s.arbiter.addr(), "latchkey/operator").await?;
    let (fired_a, fired_b): (Fired, Fired) = (Arc::default(), Arc::default());
    let a = alice
        .lock("demo/ll-e1", CLASS)
        .acquire(recorder(&fired_a))
        .await?;
    let b = bob
        .lock("demo/ll-e2", CLASS)
        .acquire(recorder(&fired_b))
        .await?;
    operator
        .advance_epoch(a.epoch(), "lock-loss push e2e")
        .await?;
    eventually("both holders to hear of the advance", PUSHED, || async {
        fired_with(&fired_a, FenceReason::HoldEnded)?;
        fired_with(&fired_b, FenceReason::HoldEnded)
    })
    .await?;
    assert!(a.is_fenced() && b.is_fenced());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_hold_stops_its_command_when_its_hold_is_removed() -> anyhow::Result<()> {
    const KEY: &str = "demo/ll-cli";
    let s = stack().await?;
    let held = latchctl_hold(s.arbiter.addr(), "workload/alice", KEY, CLASS, 120).await?;
    let (mut child, pid) = (held.child, held.pid);
    let stderr = || std::fs::read_to_string(&held.stderr_path).unwrap_or_default();
    s.etcd
        .client()
        .await?
        .delete(layout().holder(KEY), None)
        .await?;
    let status = match timeout(PUSHED, child.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            let _ = child.start_kill();
            anyhow::bail!(
                "latchctl kept its command running after its hold was removed; stderr:\n{}",
                stderr()
            );
        }
    };
    let stderr = stderr();
    assert_eq!(status.code(), Some(7), "LOST exits 7: {stderr}");
    assert!(stderr.contains(&format!("lock on {KEY} lost")), "{stderr}");
    assert_eq!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH),
        "the command must be stopped, not orphaned"
    );
    Ok(())
}
