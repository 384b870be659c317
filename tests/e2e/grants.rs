//! Grants, tokens, try-lock, idempotent retry, leaks and bad input, against
//! a real etcd and the real arbiter over mTLS.

use std::time::Duration;

use latchkey_proto::lockv1::{
    AcquireRequest, InspectRequest, OpenSessionRequest, ReleaseRequest, WaitMode,
};
use tonic::Code;

use crate::support::*;

const EPOCH_SHIFT: u32 = 48;

#[tokio::test(flavor = "multi_thread")]
async fn a_grant_is_one_transaction_and_its_token_is_epoch_and_revision() -> anyhow::Result<()> {
    let s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let before = revision(&s.etcd).await?;
    let g = try_lock(&mut alice, "demo/report", "demo", session).await?;
    // exactly one commit: the grant transaction
    assert_eq!(g.revision, before + 1, "the grant is the next revision");
    assert_eq!(revision(&s.etcd).await?, before + 1);
    assert_eq!(g.epoch, 1);
    assert_eq!(
        g.token,
        (u64::from(g.epoch) << EPOCH_SHIFT) + u64::try_from(g.revision)?
    );
    // the holder record sits on the session lease, written by that transaction
    let mut etcd = s.etcd.client().await?;
    let kv = etcd.get(layout().holder("demo/report"), None).await?;
    let kv = kv
        .kvs()
        .first()
        .ok_or_else(|| anyhow::anyhow!("no holder key"))?;
    assert_eq!(kv.lease(), session);
    assert_eq!(kv.mod_revision(), g.revision);
    let holder: serde_json::Value = serde_json::from_slice(kv.value())?;
    assert_eq!(holder["identity"], "spiffe://dev.latchkey/workload/alice");
    assert_eq!(holder["class"], "demo");
    assert!(holder["acquiredAtUnixMs"].as_i64().unwrap_or(0) > 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn try_lock_refuses_a_held_key_and_tokens_only_grow() -> anyhow::Result<()> {
    let s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let mut bob = s.arbiter.lock("workload/bob").await?;
    let sa = open(&mut alice, "demo").await?;
    let sb = open(&mut bob, "demo").await?;
    let mut last = 0u64;
    for _ in 0..5 {
        let g = try_lock(&mut alice, "demo/k", "demo", sa).await?;
        let refused = try_lock(&mut bob, "demo/k", "demo", sb).await;
        let st = expect_refusal(refused, Code::Aborted, "HELD")?;
        assert!(
            !st.message().contains(&g.token.to_string()),
            "no token in errors"
        );
        assert!(g.token > last, "tokens strictly increase");
        last = g.token;
        release(&mut alice, &g).await?;
        let g = try_lock(&mut bob, "demo/k", "demo", sb).await?;
        assert!(g.token > last);
        last = g.token;
        release(&mut bob, &g).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn retry_from_the_same_session_gets_the_same_grant_and_another_session_is_a_leak()
-> anyhow::Result<()> {
    let s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let s1 = open(&mut alice, "demo").await?;
    let g1 = try_lock(&mut alice, "demo/r", "demo", s1).await?;
    let before = revision(&s.etcd).await?;
    let again = try_lock(&mut alice, "demo/r", "demo", s1).await?;
    assert_eq!(again, g1, "idempotent retry: same grant, same token");
    // The first retry records its claim on the grant (one write, so no
    // orphan release on any arbiter can delete the grant it was just
    // given: docs/grant-protocol.md); every further retry writes nothing.
    assert_eq!(
        revision(&s.etcd).await?,
        before + 1,
        "the first retry writes its claim and nothing else"
    );
    let third = try_lock(&mut alice, "demo/r", "demo", s1).await?;
    assert_eq!(third, g1, "same grant, same token again");
    assert_eq!(
        revision(&s.etcd).await?,
        before + 1,
        "a retry of a claimed grant writes nothing"
    );
    // the same identity AND the same client instance under a second session
    // (the process forgot its hold): LEAK, not HELD, naming both sessions
    let mut alice2 = s.arbiter.lock("workload/alice").await?;
    let s2 = open(&mut alice2, "demo").await?;
    assert_ne!(s1, s2);
    let leak = expect_refusal(
        try_lock(&mut alice2, "demo/r", "demo", s2).await,
        Code::FailedPrecondition,
        "LEAK",
    )?;
    assert!(
        leak.message().contains(&format!("{s1:#x}"))
            && leak.message().contains(&format!("{s2:#x}"))
            && leak.message().contains(TEST_INSTANCE),
        "{}",
        leak.message()
    );
    // a waiting acquire from the leaking session is refused at once too
    expect_refusal(
        wait_lock(&mut alice2, "demo/r", "demo", s2, Duration::from_secs(5)).await,
        Code::FailedPrecondition,
        "LEAK",
    )?;
    // issue 30: another instance of the same identity (a replica of the
    // same Deployment, same SVID) contends like anyone: HELD on a try-lock,
    // and a waiting acquire waits and is granted when the holder releases
    expect_refusal(
        acquire_as(&mut alice2, "demo/r", "demo", s2, "replica-2:1", None).await,
        Code::Aborted,
        "HELD",
    )?;
    let mut replica = alice2.clone();
    let waiting = tokio::spawn(async move {
        acquire_as(
            &mut replica,
            "demo/r",
            "demo",
            s2,
            "replica-2:1",
            Some(Duration::from_secs(10)),
        )
        .await
    });
    // Queued, not answered: the arbiter counts it as a waiter.
    latchkey_tests::eventually("the replica queued", Duration::from_secs(5), || {
        let mut alice = alice.clone();
        async move {
            let waiters = alice
                .inspect(InspectRequest {
                    key: "demo/r".into(),
                })
                .await?
                .into_inner()
                .waiters;
            anyhow::ensure!(waiters == 1, "{waiters} waiting");
            Ok(())
        }
    })
    .await?;
    assert!(!waiting.is_finished(), "the replica waits");
    release(&mut alice, &g1).await?;
    let g2 = waiting.await??;
    assert_eq!(g2.session_id, s2);
    assert!(g2.token > g1.token, "tokens rise across replicas");
    // and an unnamed instance (an older client) is never refused as a leak
    expect_refusal(
        acquire_as(&mut alice, "demo/r", "demo", s1, "", None).await,
        Code::Aborted,
        "HELD",
    )?;
    release(&mut alice2, &g2).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_are_one_lease_per_identity_and_ttl() -> anyhow::Result<()> {
    let s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let first = alice
        .open_session(OpenSessionRequest {
            class: "demo".into(),
            reuse_session_ids: vec![],
        })
        .await?
        .into_inner();
    assert_eq!(first.ttl_seconds, 15);
    assert_eq!(first.keepalive_interval_ms, 5000);
    assert!(!first.reused);
    // demo and payments-ledger differ in TTL; demo twice reuses
    let again = alice
        .open_session(OpenSessionRequest {
            class: "demo".into(),
            reuse_session_ids: vec![first.session_id],
        })
        .await?
        .into_inner();
    assert!(again.reused);
    assert_eq!(again.session_id, first.session_id);
    // someone else cannot adopt alice's session
    let mut bob = s.arbiter.lock("workload/bob").await?;
    let theirs = bob
        .open_session(OpenSessionRequest {
            class: "demo".into(),
            reuse_session_ids: vec![first.session_id],
        })
        .await?
        .into_inner();
    assert!(!theirs.reused);
    assert_ne!(theirs.session_id, first.session_id);
    // ...nor use it to lock
    expect_refusal(
        try_lock(&mut bob, "demo/x", "demo", first.session_id).await,
        Code::FailedPrecondition,
        "SESSION_EXPIRED",
    )?;
    // a session of another TTL cannot hold a key of this class
    let short = open(&mut alice, "short").await?;
    expect_refusal(
        try_lock(&mut alice, "demo/x", "demo", short).await,
        Code::InvalidArgument,
        "SESSION_CLASS_MISMATCH",
    )?;
    // the etcd lease count: one per (identity, TTL) opened above
    let etcd = s.etcd.client().await?;
    let leases = etcd.lease_client().leases().await?;
    assert_eq!(
        leases.leases().len(),
        3,
        "alice/demo, bob/demo, alice/short"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_a_clear_error_and_writes_nothing() -> anyhow::Result<()> {
    let s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let before = revision(&s.etcd).await?;
    let long = format!("demo/{}", "x".repeat(600));
    for key in [
        "",
        "demo//a",
        "demo/../etc",
        "demo/a\u{7}b",
        "/demo/a",
        "demo/a/",
        long.as_str(),
    ] {
        let st = expect_refusal(
            try_lock(&mut alice, key, "demo", session).await,
            Code::InvalidArgument,
            "BAD_KEY",
        )?;
        assert!(
            st.message().len() < 400,
            "the message stays short: {}",
            st.message()
        );
    }
    expect_refusal(
        try_lock(&mut alice, "demo/a", "no-such-class", session).await,
        Code::InvalidArgument,
        "UNKNOWN_CLASS",
    )?;
    expect_refusal(
        try_lock(&mut alice, "demo/a", "demo", 0x7777_7777).await,
        Code::FailedPrecondition,
        "SESSION_EXPIRED",
    )?;
    expect_refusal(
        try_lock(&mut alice, "demo/a", "demo", 0).await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    let mut req = AcquireRequest {
        key: "demo/a".into(),
        class: "demo".into(),
        session_id: session,
        wait: WaitMode::WaitNone.into(),
        metadata: Default::default(),
        instance: String::new(),
        mode: 0,
        downgrade_from: None,
    };
    req.metadata.insert("ticket".into(), "x".repeat(300));
    expect_refusal(
        alice.acquire(req).await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    assert_eq!(
        revision(&s.etcd).await?,
        before,
        "no refusal wrote anything"
    );

    // release with a wrong token or session: refused, the hold stays
    let g = try_lock(&mut alice, "demo/a", "demo", session).await?;
    let wrong = alice
        .release(ReleaseRequest {
            key: g.key.clone(),
            session_id: session,
            token: g.token + 1,
            slot: None,
            mode: 0,
        })
        .await;
    expect_refusal(wrong, Code::FailedPrecondition, "TOKEN_MISMATCH")?;
    let wrong = alice
        .release(ReleaseRequest {
            key: g.key.clone(),
            session_id: session + 1,
            token: g.token,
            slot: None,
            mode: 0,
        })
        .await;
    expect_refusal(wrong, Code::FailedPrecondition, "NOT_HELD")?;
    let inspect = alice
        .inspect(InspectRequest { key: g.key.clone() })
        .await?
        .into_inner();
    assert_eq!(inspect.holder.map(|h| h.session_id), Some(session));
    release(&mut alice, &g).await?;
    expect_refusal(
        release(&mut alice, &g).await,
        Code::FailedPrecondition,
        "NOT_HELD",
    )?;
    let etcd = s.etcd.client().await?;
    let held = latchkey_etcd::kv::count_prefix(&etcd, layout().holders()).await?;
    assert_eq!(held.value, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn prefix_grants_decide_and_a_denial_never_reveals_the_key() -> anyhow::Result<()> {
    let s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let mut mallory = s.arbiter.lock("workload/mallory").await?;
    let sa = open(&mut alice, "demo").await?;
    let sm = open(&mut mallory, "demo").await?;
    let _held = try_lock(&mut alice, "demo/secret", "demo", sa).await?;
    let held = expect_refusal(
        try_lock(&mut mallory, "demo/secret", "demo", sm).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    let free = expect_refusal(
        try_lock(&mut mallory, "demo/free", "demo", sm).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    assert_eq!(
        held.message(),
        free.message(),
        "same answer whether or not the key is held"
    );
    let inspected = mallory
        .inspect(InspectRequest {
            key: "demo/secret".into(),
        })
        .await;
    let i = expect_refusal(inspected, Code::PermissionDenied, "NOT_AUTHORISED")?;
    assert_eq!(i.message(), free.message());
    // "demo" grants demo/..., not demox/...
    expect_refusal(
        try_lock(&mut alice, "demox/1", "demo", sa).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    assert!(
        try_lock(&mut alice, "demo", "demo", sa).await.is_ok(),
        "the prefix itself is granted"
    );
    // mallory's own prefix works
    assert!(
        try_lock(&mut mallory, "mallory/x", "demo", sm)
            .await
            .is_ok()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn inspect_shows_the_holder_and_waiters() -> anyhow::Result<()> {
    let s = stack().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let mut bob = s.arbiter.lock("workload/bob").await?;
    let sa = open(&mut alice, "demo").await?;
    let sb = open(&mut bob, "demo").await?;
    let free = alice
        .inspect(InspectRequest {
            key: "demo/i".into(),
        })
        .await?
        .into_inner();
    assert!(free.holder.is_none());
    let g = try_lock(&mut alice, "demo/i", "demo", sa).await?;
    let waiter = tokio::spawn(async move {
        wait_lock(&mut bob, "demo/i", "demo", sb, Duration::from_secs(20)).await
    });
    latchkey_tests::eventually("one waiter", Duration::from_secs(10), || {
        let mut alice = alice.clone();
        async move {
            let r = alice
                .inspect(InspectRequest {
                    key: "demo/i".into(),
                })
                .await?
                .into_inner();
            anyhow::ensure!(r.waiters == 1, "waiters = {}", r.waiters);
            let h = r.holder.ok_or_else(|| anyhow::anyhow!("no holder"))?;
            anyhow::ensure!(h.identity == "spiffe://dev.latchkey/workload/alice");
            anyhow::ensure!(h.session_id == sa);
            anyhow::ensure!(h.acquired_at_unix_ms > 0);
            Ok(())
        }
    })
    .await?;
    release(&mut alice, &g).await?;
    let next = waiter.await??;
    assert!(next.token > g.token);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_keep_growing_across_arbiter_and_etcd_restarts() -> anyhow::Result<()> {
    use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
    let Stack { mut etcd, arbiter } = stack().await?;
    let state = arbiter.state_dir().to_path_buf();
    let mut last = 0;
    let mut arbiter = Some(arbiter);
    for round in 0..3 {
        let a = match arbiter.take() {
            Some(a) => a,
            None => {
                Arbiter::start(
                    &etcd,
                    ArbiterOptions {
                        state_dir: Some(state.clone()),
                        ..Default::default()
                    },
                )
                .await?
            }
        };
        let mut alice = a.lock("workload/alice").await?;
        let session = open(&mut alice, "demo").await?;
        for _ in 0..3 {
            let g = try_lock(&mut alice, "demo/restart", "demo", session).await?;
            assert!(g.token > last, "round {round}: token did not grow");
            last = g.token;
            release(&mut alice, &g).await?;
        }
        a.stop().await?;
        // the lock log restarts too (same data): revisions carry on
        etcd.kill()?;
        etcd.restart().await?;
    }
    Ok(())
}

/// Regression: responses to concurrent grants arrive out of order; a slow
/// response overtaken by a later grant's durable high-water mark must not be
/// taken for a restore (found by latchkey-bench, which sealed under load).
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_grants_never_seal_the_lock_log() -> anyhow::Result<()> {
    let s = stack().await?;
    let mut workers = Vec::new();
    for w in 0..8 {
        let mut c = s
            .arbiter
            .lock(if w % 2 == 0 {
                "workload/alice"
            } else {
                "workload/bob"
            })
            .await?;
        workers.push(tokio::spawn(async move {
            let session = open(&mut c, "demo").await?;
            for i in 0..40 {
                let g = try_lock(&mut c, &format!("demo/c{w}-{i}"), "demo", session).await?;
                release(&mut c, &g).await?;
            }
            anyhow::Ok(())
        }));
    }
    for w in workers {
        w.await??;
    }
    let mut op = s.arbiter.admin("latchkey/operator").await?;
    let status = op
        .get_status(latchkey_proto::adminv1::GetStatusRequest::default())
        .await?
        .into_inner();
    assert!(!status.sealed, "sealed under load: {}", status.seal_reason);
    Ok(())
}
