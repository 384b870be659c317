//! Durable waiters (ADR-14, `fairness = "durable"`, issue 16) on a real
//! etcd with two arbiters: the queue lives in etcd, ordered by create
//! revision, so FIFO holds across arbiters and a waiter keeps its place
//! when its arbiter stops and it asks again on the same session. Every
//! other grant defers to a non-empty queue; a waiter whose call ended
//! leaves it; a record left by a call that ended long ago is removed by the
//! waiter behind it.

use std::time::Duration;

use anyhow::ensure;
use latchkey_etcd::kv::{GetOptions, PutOptions, SortOrder, SortTarget};
use latchkey_proto::lockv1::InspectRequest;
use latchkey_records::Layout;
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::{copy_dev_policies, eventually, init_tracing};
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tonic::{Code, Status};

use crate::support::{Client, expect_refusal, open, release, try_lock, wait_lock};

const CLASS: &str = "fair-queue";

/// An advisory class with durable waiters (advisory needs 30 s at least).
const DURABLE_CLASS: &str = r#"
[[class]]
name = "fair-queue"
description = "Turns that must survive an arbiter rollout."
tier = "entity"
enforcement = "advisory"
ttlSeconds = 30
fairness = "durable"
riskOwner = "team-platform@example.com"
waiverExpires = "2099-12-31"
"#;

const PREFIX: &str = "/latchkey";

struct Rig {
    etcd: EtcdServer,
    _policies: TempDir,
    opts: ArbiterOptions,
}

async fn rig() -> anyhow::Result<Rig> {
    init_tracing();
    let etcd = EtcdServer::start().await?;
    let policies = tempfile::tempdir()?;
    copy_dev_policies(policies.path())?;
    std::fs::write(policies.path().join("classes/durable.toml"), DURABLE_CLASS)?;
    let opts = ArbiterOptions {
        policies_dir: policies.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    ensure!(
        opts.prefix == PREFIX,
        "the harness's prefix is {}",
        opts.prefix
    );
    Ok(Rig {
        etcd,
        _policies: policies,
        opts,
    })
}

impl Rig {
    async fn arbiter(&self) -> anyhow::Result<Arbiter> {
        Arbiter::start(&self.etcd, self.opts.clone()).await
    }

    /// The waiter records of `key`, oldest first: their sessions.
    async fn queue(&self, key: &str) -> anyhow::Result<Vec<i64>> {
        let mut etcd = self.etcd.client().await?;
        let resp = etcd
            .get(
                Layout::new(PREFIX).queue_of(key),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend),
                ),
            )
            .await?;
        Ok(resp.kvs().iter().map(|kv| kv.lease()).collect())
    }

    async fn until_queue(&self, key: &str, sessions: &[i64]) -> anyhow::Result<()> {
        eventually(
            &format!("the durable queue of {key} to be {sessions:x?}"),
            Duration::from_secs(10),
            || async move {
                let queue = self.queue(key).await?;
                ensure!(queue == sessions, "{queue:x?}");
                Ok(())
            },
        )
        .await
    }
}

fn waiting(
    c: &Client,
    key: &'static str,
    session: i64,
    budget: Duration,
) -> JoinHandle<Result<latchkey_proto::lockv1::Grant, Status>> {
    let mut c = c.clone();
    tokio::spawn(async move { wait_lock(&mut c, key, CLASS, session, budget).await })
}

/// Served in queue order whichever arbiter each waiter asked: the release
/// goes through the arbiter of the second waiter, and still the first
/// (waiting at the other arbiter) is granted.
#[tokio::test(flavor = "multi_thread")]
async fn durable_waiters_are_served_in_order_across_arbiters() -> anyhow::Result<()> {
    let rig = rig().await?;
    let (one, two) = (rig.arbiter().await?, rig.arbiter().await?);
    let mut alice = one.lock("workload/alice").await?;
    let bob = two.lock("workload/bob").await?;
    let demo = one.lock("workload/demo").await?;
    let key = "demo/fair/order";
    let sa = open(&mut alice, CLASS).await?;
    let sb = open(&mut bob.clone(), CLASS).await?;
    let sd = open(&mut demo.clone(), CLASS).await?;
    let first = try_lock(&mut alice, key, CLASS, sa).await?;

    let bob_wait = waiting(&bob, key, sb, Duration::from_secs(30));
    rig.until_queue(key, &[sb]).await?;
    let demo_wait = waiting(&demo, key, sd, Duration::from_secs(30));
    rig.until_queue(key, &[sb, sd]).await?;
    // Inspect counts them from the log, the same through either arbiter.
    for c in [&alice, &bob] {
        let seen = c
            .clone()
            .inspect(InspectRequest { key: key.into() })
            .await?
            .into_inner();
        assert_eq!((seen.waiters, seen.durable_waiters), (0, 2), "{seen:?}");
    }

    release(&mut alice, &first).await?;
    let second = bob_wait.await??;
    assert_eq!(second.session_id, sb, "the oldest waiter is served first");
    assert!(second.token > first.token);
    rig.until_queue(key, &[sd]).await?;

    release(&mut bob.clone(), &second).await?;
    let third = demo_wait.await??;
    assert_eq!(third.session_id, sd);
    assert!(third.token > second.token);
    rig.until_queue(key, &[]).await?;
    release(&mut demo.clone(), &third).await?;
    Ok(())
}

/// A waiter whose arbiter stops keeps its place: the record stays on its
/// session's lease, a try-lock of a free key is refused while it is
/// there, and the waiter's retry through the other arbiter on the same
/// session is served before a waiter that queued after it.
#[tokio::test(flavor = "multi_thread")]
async fn a_durable_waiter_keeps_its_place_when_its_arbiter_stops() -> anyhow::Result<()> {
    let rig = rig().await?;
    let (one, two) = (rig.arbiter().await?, rig.arbiter().await?);
    let mut alice = one.lock("workload/alice").await?;
    let bob_on_two = two.lock("workload/bob").await?;
    let demo = one.lock("workload/demo").await?;
    let key = "demo/fair/restart";
    let sa = open(&mut alice, CLASS).await?;
    let sb = open(&mut bob_on_two.clone(), CLASS).await?;
    let sd = open(&mut demo.clone(), CLASS).await?;
    let first = try_lock(&mut alice, key, CLASS, sa).await?;

    let bob_wait = waiting(&bob_on_two, key, sb, Duration::from_secs(30));
    rig.until_queue(key, &[sb]).await?;
    let demo_wait = waiting(&demo, key, sd, Duration::from_secs(30));
    rig.until_queue(key, &[sb, sd]).await?;

    two.stop().await?;
    assert!(bob_wait.await?.is_err(), "bob's call ends with its arbiter");
    assert_eq!(rig.queue(key).await?, vec![sb, sd], "bob keeps his place");

    // Free key, bob first in the queue but not asking: nobody else gets it
    // (demo overtaking would hold the key, and bob's wait below would
    // time out).
    release(&mut alice, &first).await?;
    let sa2 = open(&mut alice, "demo").await?;
    expect_refusal(
        try_lock(&mut alice, key, "demo", sa2).await,
        Code::Aborted,
        "HELD",
    )?;

    // bob asks again through the first arbiter, on the same session.
    let mut bob_on_one = one.lock("workload/bob").await?;
    let second = wait_lock(&mut bob_on_one, key, CLASS, sb, Duration::from_secs(10)).await?;
    assert_eq!(second.session_id, sb);
    assert!(second.token > first.token);
    release(&mut bob_on_one, &second).await?;
    let third = demo_wait.await??;
    assert_eq!(third.session_id, sd);
    assert!(third.token > second.token);
    release(&mut demo.clone(), &third).await?;
    rig.until_queue(key, &[]).await?;
    Ok(())
}

/// A waiter that gives up (its deadline) leaves the queue at once; a
/// try-lock of the durable class is refused HELD on a held key and writes
/// no record.
#[tokio::test(flavor = "multi_thread")]
async fn a_durable_waiter_that_gives_up_leaves_the_queue() -> anyhow::Result<()> {
    let rig = rig().await?;
    let one = rig.arbiter().await?;
    let mut alice = one.lock("workload/alice").await?;
    let mut bob = one.lock("workload/bob").await?;
    let key = "demo/fair/timeout";
    let sa = open(&mut alice, CLASS).await?;
    let sb = open(&mut bob, CLASS).await?;
    let held = try_lock(&mut alice, key, CLASS, sa).await?;
    expect_refusal(
        try_lock(&mut bob, key, CLASS, sb).await,
        Code::Aborted,
        "HELD",
    )?;
    assert!(
        rig.queue(key).await?.is_empty(),
        "a try-lock queues nothing"
    );

    let timed_out = wait_lock(&mut bob, key, CLASS, sb, Duration::from_millis(1500)).await;
    expect_refusal(timed_out, Code::DeadlineExceeded, "WAIT_TIMEOUT")?;
    rig.until_queue(key, &[]).await?;
    release(&mut alice, &held).await?;
    // Free and no queue: bob's try-lock is granted at once.
    let got = try_lock(&mut bob, key, CLASS, sb).await?;
    assert!(got.token > held.token);
    Ok(())
}

/// A record left by a call that ended long ago (its arbiter died; its
/// session lives on) is removed once the arbiter has seen it unchanged for
/// longer than the record's budget and the grace period (its own clock,
/// across calls); a record whose budget has not run out is never removed.
#[tokio::test(flavor = "multi_thread")]
async fn a_stale_durable_waiter_record_is_removed_after_its_budget_and_the_grace()
-> anyhow::Result<()> {
    let rig = rig().await?;
    let one = rig.arbiter().await?;
    let mut demo = one.lock("workload/demo").await?;
    let key = "demo/fair/stale";
    let sd = open(&mut demo, CLASS).await?;

    let mut etcd = rig.etcd.client().await?;
    let lease = etcd.lease_grant(120, None).await?.id();
    let record = |wait_ms: u64| {
        serde_json::json!({
            "identity": "spiffe://dev.latchkey/workload/gone",
            "session": lease,
            "class": CLASS,
            "waitMs": wait_ms,
        })
        .to_string()
    };
    let leftover = Layout::new(PREFIX).waiter(key, lease);
    // Its call waits a minute: demo waits behind it and gives up.
    etcd.put(
        leftover.clone(),
        record(60_000),
        Some(PutOptions::new().with_lease(lease)),
    )
    .await?;
    let behind = wait_lock(&mut demo, key, CLASS, sd, Duration::from_millis(2500)).await;
    expect_refusal(behind, Code::DeadlineExceeded, "WAIT_TIMEOUT")?;
    // demo's own record goes as its call ends (removed by the waiting
    // task, just after the answer); the leftover stays.
    rig.until_queue(key, &[lease]).await?;

    // Its call waited 3 s. The arbiter's clock for it runs across calls:
    // try-locks, each refused while the record is there, until the
    // arbiter has seen it unchanged for 3 s + the grace period; then it is
    // removed and the next try-lock is granted. Never earlier: the clock
    // starts no sooner than the first try-lock below.
    etcd.put(
        leftover,
        record(3_000),
        Some(PutOptions::new().with_lease(lease)),
    )
    .await?;
    let grace = latchkey_arbiter::table::durable::STALE_AFTER;
    let started = std::time::Instant::now();
    let got = loop {
        match try_lock(&mut demo, key, CLASS, sd).await {
            Ok(grant) => break grant,
            Err(status) if status.code() == Code::Aborted => {}
            Err(status) => return Err(status.into()),
        }
        ensure!(
            started.elapsed() < Duration::from_secs(3) + grace + Duration::from_secs(20),
            "the stale record was never removed"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        started.elapsed() >= Duration::from_secs(3) + grace,
        "removed after {:?}, before its budget and the grace period",
        started.elapsed()
    );
    assert_eq!(got.session_id, sd);
    rig.until_queue(key, &[]).await?;
    Ok(())
}

/// Another identity's session cannot queue: refused, and no waiter record
/// is written on the session's lease (the enqueue compares the session's
/// record, as a grant does).
#[tokio::test(flavor = "multi_thread")]
async fn a_durable_waiter_cannot_queue_on_another_identitys_session() -> anyhow::Result<()> {
    let rig = rig().await?;
    let one = rig.arbiter().await?;
    let mut alice = one.lock("workload/alice").await?;
    let mut bob = one.lock("workload/bob").await?;
    let key = "demo/fair/foreign";
    let sa = open(&mut alice, CLASS).await?;
    let sb = open(&mut bob, CLASS).await?;
    let held = try_lock(&mut bob, key, CLASS, sb).await?;
    let before = rig.etcd.revision().await?;
    let refused = wait_lock(&mut bob, key, CLASS, sa, Duration::from_secs(3)).await;
    let status = refused.expect_err("bob queued on alice's session");
    assert_ne!(status.code(), Code::Ok);
    assert!(
        rig.queue(key).await?.is_empty(),
        "a record on alice's lease"
    );
    assert_eq!(rig.etcd.revision().await?, before, "the refusal wrote");
    release(&mut bob, &held).await?;
    Ok(())
}
