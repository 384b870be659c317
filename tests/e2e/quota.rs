//! Quotas that hold under concurrency (issue 34): the dev class `quota`
//! (`maxHoldsPerSubject = 2`) through two real arbiters on one real etcd.
//! The hostile burst that the retired quota hook let through 12 of 12 is
//! granted exactly 2; a place comes back when its hold ends (release,
//! session close, a hold deleted behind the arbiter's back); a waiter is
//! granted with a place, and refused when its subject filled its quota
//! while it waited.

use std::time::Duration;

use anyhow::ensure;
use latchkey_proto::lockv1::{CloseSessionRequest, Grant};
use latchkey_records::Layout;
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::{copy_dev_policies, eventually, init_tracing};
use tempfile::TempDir;
use tonic::{Code, Status};

use crate::support::{Client, acquire_as, expect_refusal, open, refusal, release};

const CLASS: &str = "quota";
const PREFIX: &str = "/latchkey";

struct Rig {
    etcd: EtcdServer,
    _policies: TempDir,
    a: Arbiter,
    b: Arbiter,
}

async fn rig() -> anyhow::Result<Rig> {
    init_tracing();
    let etcd = EtcdServer::start().await?;
    let policies = tempfile::tempdir()?;
    copy_dev_policies(policies.path())?;
    latchkey_tests::write_pause_test_fixtures(policies.path())?;
    let opts = ArbiterOptions {
        policies_dir: policies.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    ensure!(
        opts.prefix == PREFIX,
        "the harness's prefix is {}",
        opts.prefix
    );
    let a = Arbiter::start(&etcd, opts.clone()).await?;
    let b = Arbiter::start(&etcd, opts).await?;
    Ok(Rig {
        etcd,
        _policies: policies,
        a,
        b,
    })
}

impl Rig {
    /// The quota places of `identity` in etcd: (index, lease).
    async fn places(&self, identity: &str) -> anyhow::Result<Vec<(String, i64)>> {
        let mut etcd = self.etcd.client().await?;
        let resp = etcd
            .get(
                Layout::new(PREFIX).quota_places(CLASS, identity),
                Some(latchkey_etcd::kv::GetOptions::new().with_prefix()),
            )
            .await?;
        Ok(resp
            .kvs()
            .iter()
            .map(|kv| {
                let key = String::from_utf8_lossy(kv.key()).to_string();
                let index = key.rsplit('/').next().unwrap_or_default().to_string();
                (index, kv.lease())
            })
            .collect())
    }
}

async fn grab(c: &mut Client, key: &str, session: i64) -> Result<Grant, Status> {
    acquire_as(c, key, CLASS, session, &format!("pod-{session:x}"), None).await
}

fn spiffe(name: &str) -> String {
    latchkey_tests::arbiter::spiffe(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_twelve_acquires_is_granted_exactly_the_quota() -> anyhow::Result<()> {
    let rig = rig().await?;
    // Twelve sessions of one identity, half on each arbiter, each asking
    // for its own key at the same moment.
    let mut calls = Vec::new();
    for i in 0..12 {
        let arbiter = if i % 2 == 0 { &rig.a } else { &rig.b };
        let mut c = arbiter.lock("workload/alice").await?;
        let s = open(&mut c, CLASS).await?;
        calls.push((c, s, format!("demo/burst-{i}")));
    }
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(calls.len()));
    let tasks: Vec<_> = calls
        .into_iter()
        .map(|(mut c, s, key)| {
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                (grab(&mut c, &key, s).await, c)
            })
        })
        .collect();
    let mut granted = Vec::new();
    let mut refused = 0;
    for t in tasks {
        let (answer, c) = t.await?;
        match answer {
            Ok(g) => granted.push((g, c)),
            Err(s) => {
                let (code, reason) = refusal(&s);
                ensure!(
                    (code, reason.as_str()) == (Code::FailedPrecondition, "QUOTA_EXCEEDED"),
                    "a refusal other than the quota's: {code:?}/{reason}: {}",
                    s.message()
                );
                ensure!(
                    s.message().contains("maxHoldsPerSubject")
                        && s.message().contains("release one first"),
                    "{}",
                    s.message()
                );
                refused += 1;
            }
        }
    }
    ensure!(
        granted.len() == 2 && refused == 10,
        "{} granted, {refused} refused (the quota is 2)",
        granted.len()
    );
    ensure!(rig.places(&spiffe("workload/alice")).await?.len() == 2);

    // A retry of a held key is the same grant, not a new hold.
    let (g, c) = &mut granted[0];
    let again = grab(c, &g.key, g.session_id).await?;
    ensure!(again.token == g.token, "a retry got another grant");

    // Another identity has its own places.
    let mut bob = rig.b.lock("workload/bob").await?;
    let sb = open(&mut bob, CLASS).await?;
    let gb = grab(&mut bob, "demo/bob-1", sb).await?;

    // A release gives the place back at once, on either arbiter.
    let (g, mut c) = granted.remove(0);
    release(&mut c, &g).await?;
    let s2 = open(&mut c, CLASS).await?;
    let g3 = grab(&mut c, "demo/after-release", s2).await?;
    expect_refusal(
        grab(&mut c, "demo/one-more", s2).await,
        Code::FailedPrecondition,
        "QUOTA_EXCEEDED",
    )?;

    // Closing a session ends its holds and their places.
    c.close_session(CloseSessionRequest { session_id: s2 })
        .await?;
    let s3 = open(&mut c, CLASS).await?;
    let g4 = eventually(
        "the closed session's place to come back",
        Duration::from_secs(5),
        || {
            let mut c = c.clone();
            async move { Ok(grab(&mut c, "demo/after-close", s3).await?) }
        },
    )
    .await?;

    // A hold deleted behind the arbiter's back (as an operator's
    // force-release does) leaves its place stale: taken again.
    let mut etcd = rig.etcd.client().await?;
    etcd.delete(Layout::new(PREFIX).holder(&g4.key), None)
        .await?;
    ensure!(
        rig.places(&spiffe("workload/alice")).await?.len() == 2,
        "the place went with the hold"
    );
    let g5 = grab(&mut c, "demo/after-force", s3).await?;
    ensure!(rig.places(&spiffe("workload/alice")).await?.len() == 2);
    expect_refusal(
        grab(&mut c, "demo/one-more", s3).await,
        Code::FailedPrecondition,
        "QUOTA_EXCEEDED",
    )?;

    let (g, mut c1) = granted.remove(0);
    release(&mut c1, &g).await?;
    release(&mut c, &g5).await?;
    release(&mut bob, &gb).await?;
    let _ = g3;
    Ok(())
}

/// Starts a waiting Acquire of `key` on `session`, and returns once the
/// arbiter shows it queued.
async fn queue_behind(
    c: &Client,
    key: &'static str,
    session: i64,
) -> anyhow::Result<tokio::task::JoinHandle<Result<Grant, Status>>> {
    let waiter = {
        let mut c = c.clone();
        tokio::spawn(async move {
            acquire_as(
                &mut c,
                key,
                CLASS,
                session,
                "pod-a",
                Some(Duration::from_secs(20)),
            )
            .await
        })
    };
    eventually("the waiter to queue", Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let seen = c
                .inspect(latchkey_proto::lockv1::InspectRequest { key: key.into() })
                .await?
                .into_inner();
            ensure!(seen.waiters == 1, "{} waiters", seen.waiters);
            Ok(())
        }
    })
    .await?;
    Ok(waiter)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_is_granted_with_a_place_or_refused_when_its_quota_filled() -> anyhow::Result<()> {
    let rig = rig().await?;
    let mut bob = rig.a.lock("workload/bob").await?;
    let sb = open(&mut bob, CLASS).await?;
    let held = grab(&mut bob, "demo/contended", sb).await?;

    // alice waits on arbiter b for the key bob holds on arbiter a: bob's
    // release hands nothing over; alice's driver grants it with a place.
    let mut alice = rig.b.lock("workload/alice").await?;
    let sa = open(&mut alice, CLASS).await?;
    let waiter = queue_behind(&alice, "demo/contended", sa).await?;
    release(&mut bob, &held).await?;
    let got = waiter.await??;
    ensure!(got.session_id == sa);
    ensure!(rig.places(&spiffe("workload/alice")).await?.len() == 1);

    // bob holds the key again; alice waits, and fills her quota meanwhile:
    // when the key is free her waiter is refused, not granted a third hold.
    release(&mut alice, &got).await?;
    let held = eventually("bob to take the key again", Duration::from_secs(5), || {
        let mut bob = bob.clone();
        async move { Ok(grab(&mut bob, "demo/contended", sb).await?) }
    })
    .await?;
    let waiter = queue_behind(&alice, "demo/contended", sa).await?;
    let g1 = grab(&mut alice, "demo/filler-1", sa).await?;
    let g2 = grab(&mut alice, "demo/filler-2", sa).await?;
    release(&mut bob, &held).await?;
    expect_refusal(waiter.await?, Code::FailedPrecondition, "QUOTA_EXCEEDED")?;
    ensure!(rig.places(&spiffe("workload/alice")).await?.len() == 2);
    release(&mut alice, &g1).await?;
    release(&mut alice, &g2).await?;
    Ok(())
}

/// A grant may name the classes its prefixes are for (`classes = ["quota"]`
/// for workload/tenant's "tenant" in the dev grants): another class is
/// refused there, so the quota bounds the tenant's holds under the prefix,
/// not one class of them (the hostile review of issue 34).
#[tokio::test(flavor = "multi_thread")]
async fn a_grant_for_one_class_makes_its_quota_the_tenants_bound() -> anyhow::Result<()> {
    let rig = rig().await?;
    let mut tenant = rig.a.lock("workload/tenant").await?;
    let before = rig.etcd.revision().await?;
    // No session of a class none of its grants is for.
    let refused = latchkey_tests::lock_calls::open_class(&mut tenant, "demo").await;
    let status = expect_refusal(refused, Code::PermissionDenied, "NOT_AUTHORISED")?;
    ensure!(
        status.message().contains("\"quota\""),
        "{}",
        status.message()
    );
    let sq = open(&mut tenant, CLASS).await?;
    let before = before.max(rig.etcd.revision().await?);
    let refused = acquire_as(&mut tenant, "tenant/a", "demo", sq, "pod-t", None).await;
    let status = expect_refusal(refused, Code::PermissionDenied, "NOT_AUTHORISED")?;
    ensure!(
        status.message().contains("\"quota\"") && status.message().contains("\"demo\""),
        "{}",
        status.message()
    );
    ensure!(
        rig.etcd.revision().await? == before,
        "a refused class wrote"
    );
    let g1 = grab(&mut tenant, "tenant/a", sq).await?;
    let g2 = grab(&mut tenant, "tenant/b", sq).await?;
    expect_refusal(
        grab(&mut tenant, "tenant/c", sq).await,
        Code::FailedPrecondition,
        "QUOTA_EXCEEDED",
    )?;
    release(&mut tenant, &g1).await?;
    release(&mut tenant, &g2).await?;
    Ok(())
}
