//! The session bound counted from memory (issue 31, "Overload"): each
//! arbiter reads the session index once and follows it with a watch, so an
//! open reads nothing from etcd however many sessions its identity has;
//! other arbiters' opens count once the watch has them, expiries and closes
//! free places, and a close deletes the entry its open wrote.

use std::time::Duration;

use anyhow::Context;
use latchkey_etcd::kv::count_prefix;
use latchkey_etcd::watch::{EventType, WatchOptions, watch_from};
use latchkey_proto::lockv1::CloseSessionRequest;
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, spiffe};
use latchkey_tests::eventually;
use tonic::Code;

use crate::support::*;

const MALLORY: &str = "workload/mallory";

/// mallory's sessions in etcd: her entries in the session index.
async fn entries_in_etcd(s: &Stack, subject: &str) -> anyhow::Result<i64> {
    let layout = latchkey_records::Layout::new("/latchkey");
    let etcd = s.etcd.client().await?;
    Ok(count_prefix(&etcd, layout.identity_sessions(subject))
        .await?
        .value)
}

/// The open sessions `arbiter` counts (its `open_sessions` gauge), once its
/// count is ready.
async fn counted_by(arbiter: &Arbiter) -> anyhow::Result<u64> {
    let addr = arbiter.metrics_addr().context("no metrics listener")?;
    let samples = scrape(addr).await?;
    anyhow::ensure!(
        total(&samples, &["latchkey_arbiter_session_count_ready"]) == 1,
        "the session count is not ready"
    );
    Ok(total(&samples, &["latchkey_arbiter_open_sessions"]))
}

fn at_the_bound(r: Result<i64, tonic::Status>) -> anyhow::Result<()> {
    expect_refusal(r, Code::ResourceExhausted, "IDENTITY_LIMIT").map(|_| ())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_arbiters_sessions_count_against_the_bound_once_the_watch_has_them()
-> anyhow::Result<()> {
    const BOUND: u32 = 4;
    let s = stack_with(ArbiterOptions {
        max_sessions_per_identity: Some(BOUND),
        metrics: true,
        ..Default::default()
    })
    .await?;
    let second = Arbiter::start(
        &s.etcd,
        ArbiterOptions {
            max_sessions_per_identity: Some(BOUND),
            ..Default::default()
        },
    )
    .await?;
    let mut here = s.arbiter.lock(MALLORY).await?;
    let mut there = second.lock(MALLORY).await?;
    let mut opened_there = Vec::new();
    for _ in 0..3 {
        opened_there.push(open(&mut there, "demo").await?);
    }
    eventually(
        "the first arbiter to count them",
        Duration::from_secs(10),
        || async {
            let n = counted_by(&s.arbiter).await?;
            anyhow::ensure!(n >= 3, "{n} counted");
            Ok(())
        },
    )
    .await?;
    // one place left, on whichever arbiter
    open(&mut here, "demo").await?;
    at_the_bound(open_class(&mut here, "demo").await)?;
    assert_eq!(
        entries_in_etcd(&s, &spiffe(MALLORY)).await?,
        i64::from(BOUND)
    );

    // a close on the second arbiter frees a place on the first once its
    // watch shows it (a refusal until then changes nothing)
    there
        .close_session(CloseSessionRequest {
            session_id: opened_there[0],
        })
        .await?;
    eventually(
        "a place freed by the other arbiter's close",
        Duration::from_secs(10),
        || {
            let mut here = here.clone();
            async move { Ok(open_class(&mut here, "demo").await?) }
        },
    )
    .await?;
    at_the_bound(open_class(&mut here, "demo").await)?;
    assert_eq!(
        entries_in_etcd(&s, &spiffe(MALLORY)).await?,
        i64::from(BOUND)
    );
    second.stop().await
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_left_to_expire_free_the_bound() -> anyhow::Result<()> {
    const BOUND: u32 = 3;
    let s = stack_with(ArbiterOptions {
        max_sessions_per_identity: Some(BOUND),
        ..Default::default()
    })
    .await?;
    let mut mallory = s.arbiter.lock(MALLORY).await?;
    // class `short`: a TTL of 5 s, and nobody renews them
    for _ in 0..BOUND {
        open(&mut mallory, "short").await?;
    }
    at_the_bound(open_class(&mut mallory, "short").await)?;
    let expired = eventually("the sessions to expire", Duration::from_secs(30), || {
        let mut mallory = mallory.clone();
        async move { Ok(open_class(&mut mallory, "short").await?) }
    })
    .await?;
    assert!(expired > 0);
    assert!(entries_in_etcd(&s, &spiffe(MALLORY)).await? <= i64::from(BOUND));
    Ok(())
}

/// Issue 31: every open counted its identity's entries in etcd, a range
/// read whose cost grew with them (150 opens/s at 860 sessions each). Now
/// an open reads nothing: etcd serves as few Range calls during 50 opens by
/// an identity with 500 sessions as with 10 (none per open; the count
/// before this change was one per open).
#[tokio::test(flavor = "multi_thread")]
async fn an_open_reads_nothing_from_etcd_however_many_sessions_its_identity_has()
-> anyhow::Result<()> {
    const OPENS: usize = 50;
    let s = stack_with(ArbiterOptions {
        max_sessions_per_identity: Some(1_000),
        ..Default::default()
    })
    .await?;
    let mallory = s.arbiter.lock(MALLORY).await?;
    let open_many = |n: usize| {
        let mallory = mallory.clone();
        async move {
            let calls: Vec<_> = (0..n)
                .map(|_| {
                    let mut c = mallory.clone();
                    tokio::spawn(async move { open(&mut c, "demo").await })
                })
                .collect();
            for call in calls {
                call.await??;
            }
            anyhow::Ok(())
        }
    };
    let mut reads = Vec::new();
    for sessions in [10, 500] {
        let have = entries_in_etcd(&s, &spiffe(MALLORY)).await?;
        open_many(sessions - usize::try_from(have)?).await?;
        let before = etcd_ranges(&s).await?;
        open_many(OPENS).await?;
        let ranges = etcd_ranges(&s).await? - before;
        eprintln!("{OPENS} opens with {sessions} sessions open: {ranges} etcd Range calls");
        reads.push((sessions, ranges));
    }
    for (sessions, ranges) in &reads {
        // the scrape itself and any background read, far below one per open
        assert!(
            *ranges < (OPENS / 10) as u64,
            "{ranges} Range calls during {OPENS} opens with {sessions} sessions open"
        );
    }
    assert_eq!(
        entries_in_etcd(&s, &spiffe(MALLORY)).await?,
        (500 + OPENS) as i64
    );
    Ok(())
}

/// A close deletes the session's entry under the subject it was opened as:
/// for a per-pod identity that is its pattern, not the pod's own ID (the
/// close deleted the pod's, which was never written, and the entry went
/// only with the revoke after). And a close counts off at once: a pod of
/// the same pattern opens in the place it freed without waiting.
#[tokio::test(flavor = "multi_thread")]
async fn a_close_deletes_the_entry_its_open_wrote_and_frees_its_place_at_once() -> anyhow::Result<()>
{
    let pattern = spiffe("ns/payments/sa/ledger/*");
    let s = stack_with(ArbiterOptions {
        max_sessions_per_identity: Some(1),
        ..Default::default()
    })
    .await?;
    let mut a = s
        .arbiter
        .lock("ns/payments/sa/ledger/ledger-7d9f-a")
        .await?;
    let mut b = s
        .arbiter
        .lock("ns/payments/sa/ledger/ledger-7d9f-b")
        .await?;
    let session = open(&mut a, "demo").await?;
    at_the_bound(open_class(&mut b, "demo").await)?;
    assert_eq!(entries_in_etcd(&s, &pattern).await?, 1);

    let layout = latchkey_records::Layout::new("/latchkey");
    let record = layout.session(session);
    let entry = layout.identity_session(&pattern, session);
    let etcd = s.etcd.client().await?;
    let from = s.etcd.revision().await? + 1;
    let mut events =
        watch_from(&etcd, "/latchkey/", from, WatchOptions::new().with_prefix()).await?;
    a.close_session(CloseSessionRequest {
        session_id: session,
    })
    .await?;
    // at once: no wait for the watch
    let again = open(&mut b, "demo").await?;

    let (mut record_gone, mut entry_gone) = (None, None);
    while record_gone.is_none() || entry_gone.is_none() {
        let resp = tokio::time::timeout(Duration::from_secs(10), events.message())
            .await
            .context("the deletes never came")??
            .context("the watch ended")?;
        for e in resp.events() {
            let Some(kv) = e.kv() else { continue };
            if e.event_type() != EventType::Delete {
                continue;
            }
            if kv.key_str()? == record {
                record_gone = Some(kv.mod_revision());
            } else if kv.key_str()? == entry {
                entry_gone = Some(kv.mod_revision());
            }
        }
    }
    assert_eq!(
        entry_gone, record_gone,
        "the entry went in the close's own transaction, not with the revoke after"
    );
    assert_eq!(entries_in_etcd(&s, &pattern).await?, 1, "b's session");
    assert!(again > 0);
    Ok(())
}
