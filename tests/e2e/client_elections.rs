//! The client library's elections (`Client::campaign`, `Leadership`,
//! `Client::lead`, `Client::observe`) against the real arbiter on real etcd,
//! over mTLS with the dev SVIDs, on the short-TTL `elect-fast` class of
//! `elections.rs`. Replicas are separate `Client`s of one identity (alice
//! twice), so separate sessions. A frozen leader is one whose network path
//! goes dark (a blocked proxy): its keepalives stop, and it must hear of
//! its loss at its fence deadline, before the arbiter lets anyone else lead.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use latchkey_client::{
    CampaignOptions, Client, ElectionEvent, ElectionEvents, Error, FenceReason, LeadershipLost,
    TransferTo, VacancyReason,
};
use latchkey_tests::arbiter::spiffe;
use latchkey_tests::eventually;
use latchkey_tests::proxy::Proxy;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

use crate::client::connect;
use crate::elections::{CLASS, TTL, policies, stack};
use crate::support::layout;

fn waiting(wait: Duration) -> CampaignOptions {
    CampaignOptions {
        wait: Some(wait),
        ..CampaignOptions::default()
    }
}

/// Until `n` candidates stand in `election`.
async fn until_standing(client: &Client, election: &str, n: usize) -> anyhow::Result<()> {
    eventually(
        &format!("{n} candidates in {election}"),
        Duration::from_secs(10),
        || async {
            let standing = client.candidates(election).await?.len();
            ensure!(standing >= n, "{standing} standing");
            Ok(())
        },
    )
    .await
}

async fn next_event(events: &mut ElectionEvents) -> anyhow::Result<ElectionEvent> {
    timeout(Duration::from_secs(15), events.next_event())
        .await
        .context("no event within 15 s")?
        .context("the observation ended")?
        .context("the observation failed")
}

fn started(event: &ElectionEvent) -> Option<(u64, &str, &str)> {
    match event {
        ElectionEvent::TermStarted { leader } => {
            Some((leader.term, leader.value.as_str(), leader.identity.as_str()))
        }
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn client_elections_replicas_of_one_identity_take_over_on_resign_and_from_a_frozen_leader()
-> anyhow::Result<()> {
    let dir = policies()?;
    let s = stack(&dir).await?;
    let election = "demo/elect/client-takeover";
    let proxy = Proxy::start(s.arbiter.addr()).await?;
    let a = connect(s.arbiter.addr(), "workload/alice").await?;
    // b's network path can go dark.
    let b = connect(proxy.addr(), "workload/alice").await?;

    let first = a
        .campaign(election, CLASS, "pod-a", waiting(Duration::from_secs(5)))
        .await?;
    ensure!(first.value() == "pod-a" && first.term() > 0 && first.token().get() > 0);
    // Campaigning again on the same client: another guard, nothing sent.
    let again = a
        .campaign(election, CLASS, "pod-a", waiting(Duration::from_secs(5)))
        .await?;
    ensure!(again.token() == first.token() && first.guard_count() == 2);
    drop(again);
    ensure!(first.guard_count() == 1 && !first.is_lost() && first.can_start());
    let shown = format!("{first:?} {first}");
    ensure!(
        !shown.contains(&first.token().get().to_string()),
        "the token shows: {shown}"
    );
    let leader = b.leader(election).await?.context("a leads")?;
    ensure!(leader.identity == spiffe("workload/alice") && leader.term == first.term());

    // b stands; a resigns: b leads in the same transaction.
    let b_campaign = b.clone();
    let b_waits = tokio::spawn(async move {
        b_campaign
            .campaign(election, CLASS, "pod-b", waiting(Duration::from_secs(20)))
            .await
    });
    until_standing(&a, election, 1).await?;
    let (first_term, first_token, first_session) =
        (first.term(), first.token(), first.session_id());
    let next = first.resign().await?.context("b is named next")?;
    ensure!(
        next.value == "pod-b" && next.term == first_term + 1,
        "{next:?}"
    );
    let second = b_waits.await??;
    ensure!(second.term() == first_term + 1 && second.token() > first_token);
    ensure!(second.session_id() != first_session, "a session of its own");

    // a stands again; b freezes (its path goes dark, so no keepalive gets
    // through): b hears it lost at its fence deadline, before a leads.
    let a_campaign = a.clone();
    let a_waits = tokio::spawn(async move {
        let led = a_campaign
            .campaign(election, CLASS, "pod-a", waiting(Duration::from_secs(30)))
            .await;
        (Instant::now(), led)
    });
    until_standing(&a, election, 1).await?;
    let b_lost = second.lost();
    let b_token = second.cancellation_token();
    proxy.block();
    let blocked_at = Instant::now();
    let reason = timeout(TTL + Duration::from_secs(2), b_lost)
        .await
        .context("the frozen leader never heard it lost")?;
    let b_lost_at = Instant::now();
    ensure!(
        reason == LeadershipLost::Fenced(FenceReason::DeadlineExceeded),
        "{reason:?}"
    );
    ensure!(
        b_lost_at - blocked_at <= TTL,
        "lost only {:?} after the block",
        b_lost_at - blocked_at
    );
    ensure!(b_token.is_cancelled() && !second.can_start() && second.is_lost());
    let (a_led_at, third) = timeout(Duration::from_secs(20), a_waits)
        .await
        .context("a never led")??;
    let third = third?;
    ensure!(
        b_lost_at < a_led_at,
        "a led {:?} before the frozen leader knew it had lost",
        b_lost_at - a_led_at
    );
    ensure!(third.term() > second.term() && third.token() > second.token());
    drop(second); // lost: nothing to resign
    ensure!(third.resign().await?.is_none(), "no one else stands");
    ensure!(a.leader(election).await?.is_none());
    Ok(())
}

enum Step {
    Started { term: u64, session_id: i64 },
    Stopped { term: u64 },
}

/// Tells the test when a body is dropped (cancelled or finished).
struct OnDrop(mpsc::UnboundedSender<Step>, u64);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Step::Stopped { term: self.1 });
    }
}

async fn step(rx: &mut mpsc::UnboundedReceiver<Step>) -> anyhow::Result<Step> {
    timeout(Duration::from_secs(15), rx.recv())
        .await
        .context("no step within 15 s")?
        .context("lead() ended")
}

#[tokio::test(flavor = "multi_thread")]
async fn client_elections_lead_campaigns_again_by_itself_after_its_session_is_closed_under_it()
-> anyhow::Result<()> {
    let dir = policies()?;
    let s = stack(&dir).await?;
    let election = "demo/elect/client-lead";
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let leader = alice.clone();
    let leading = tokio::spawn(async move {
        leader
            .lead(
                election,
                CLASS,
                "pod-a",
                CampaignOptions::default(),
                move |leadership| {
                    let tx = tx.clone();
                    async move {
                        let term = leadership.term();
                        let _stopped = OnDrop(tx.clone(), term);
                        let _ = tx.send(Step::Started {
                            term,
                            session_id: leadership.session_id(),
                        });
                        // Leads until lead() drops it.
                        std::future::pending::<()>().await;
                        drop(leadership);
                    }
                },
            )
            .await
    });

    let Step::Started {
        term: first,
        session_id,
    } = step(&mut rx).await?
    else {
        bail!("stopped before it started");
    };
    // The session is closed under it (its lease revoked, as an operator or
    // an expiry would end it).
    s.etcd
        .client()
        .await?
        .lease_client()
        .revoke(session_id)
        .await?;
    let revoked_at = Instant::now();
    let Step::Stopped { term } = step(&mut rx).await? else {
        bail!("started again before the body was stopped");
    };
    ensure!(term == first);
    ensure!(
        revoked_at.elapsed() < TTL,
        "the body ran on for {:?}",
        revoked_at.elapsed()
    );
    let Step::Started {
        term: second,
        session_id: second_session,
    } = step(&mut rx).await?
    else {
        bail!("no second term");
    };
    ensure!(second > first && second_session != session_id);
    let now = alice.leader(election).await?.context("leads again")?;
    ensure!(now.term == second && now.value == "pod-a");

    // Stopping lead() (dropping its future) drops the body and resigns.
    leading.abort();
    let Step::Stopped { term } = step(&mut rx).await? else {
        bail!("started after the abort");
    };
    ensure!(term == second);
    eventually(
        "the dropped leadership to resign",
        Duration::from_secs(10),
        || async {
            ensure!(alice.leader(election).await?.is_none());
            Ok(())
        },
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn client_elections_observe_sees_the_sequence_and_a_leader_forced_out_hears_it()
-> anyhow::Result<()> {
    let dir = policies()?;
    let s = stack(&dir).await?;
    let election = "demo/elect/client-observed";
    let a = connect(s.arbiter.addr(), "workload/alice").await?;
    let b = connect(s.arbiter.addr(), "workload/alice").await?;
    // bob observes: a grant on the prefix, no campaign.
    let bob = connect(s.arbiter.addr(), "workload/bob").await?;
    let mut events = bob.observe(election, 0).await?;
    ensure!(
        next_event(&mut events).await?
            == ElectionEvent::Vacant {
                term: 0,
                reason: VacancyReason::Unknown
            }
    );

    let la = a
        .campaign(election, CLASS, "a", waiting(Duration::from_secs(5)))
        .await?;
    let t = la.term();
    let event = next_event(&mut events).await?;
    ensure!(
        started(&event) == Some((t, "a", spiffe("workload/alice").as_str())),
        "{event:?}"
    );
    la.proclaim("a2").await?;
    ensure!(la.value() == "a2");
    ensure!(
        next_event(&mut events).await?
            == ElectionEvent::Proclaimed {
                term: t,
                value: "a2".into()
            }
    );

    // Transfer to the preferred candidate: b.
    let b_campaign = b.clone();
    let b_waits = tokio::spawn(async move {
        b_campaign
            .campaign(election, CLASS, "b", waiting(Duration::from_secs(20)))
            .await
    });
    until_standing(&a, election, 1).await?;
    let next = la.transfer(TransferTo::Preferred).await?;
    ensure!(next.value == "b" && next.term == t + 1);
    // Its own transfer, unless its observer saw the next term first.
    let reason = la.lost_reason();
    ensure!(
        reason == Some(LeadershipLost::Transferred)
            || reason == Some(LeadershipLost::Replaced { term: t + 1 }),
        "{reason:?}"
    );
    match la.proclaim("a3").await {
        Err(Error::LeadershipLost { reason: lost, .. }) => ensure!(Some(lost) == reason),
        other => bail!("proclaim after the transfer: {other:?}"),
    }
    let lb = b_waits.await??;
    ensure!(lb.term() == t + 1);
    let event = next_event(&mut events).await?;
    ensure!(started(&event).map(|s| s.0) == Some(t + 1), "{event:?}");
    ensure!(lb.resign().await?.is_none(), "vacant after b");
    ensure!(
        next_event(&mut events).await?
            == ElectionEvent::Vacant {
                term: t + 1,
                reason: VacancyReason::Resigned
            }
    );

    // a leads again and is forced out while its session lives (its leader
    // record leaves the log, what a force-release does): only its Observe
    // can tell it, well before any fence deadline.
    let l3 = a
        .campaign(election, CLASS, "a3", waiting(Duration::from_secs(5)))
        .await?;
    let t3 = l3.term();
    ensure!(t3 > t + 1);
    let event = next_event(&mut events).await?;
    ensure!(started(&event).map(|s| s.0) == Some(t3), "{event:?}");
    s.etcd
        .client()
        .await?
        .delete(layout().election_lead(election), None)
        .await?;
    let reason = timeout(Duration::from_secs(3), l3.lost())
        .await
        .context("the forced-out leader never heard of it")?;
    ensure!(
        reason == LeadershipLost::Vacated(VacancyReason::SessionEnded),
        "{reason:?}"
    );
    ensure!(a.session(l3.session_id()).is_some(), "the session lives on");
    ensure!(
        next_event(&mut events).await?
            == ElectionEvent::Vacant {
                term: t3,
                reason: VacancyReason::SessionEnded
            }
    );
    ensure!(events.last_term() == t3);
    match l3.resign().await {
        Err(Error::LeadershipLost { .. }) => {}
        other => bail!("resigning a lost leadership: {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn client_elections_a_dropped_campaign_does_not_stay_a_candidate() -> anyhow::Result<()> {
    let dir = policies()?;
    let s = stack(&dir).await?;
    let election = "demo/elect/client-dropped";
    let a = connect(s.arbiter.addr(), "workload/alice").await?;
    let b = connect(s.arbiter.addr(), "workload/alice").await?;
    let la = a
        .campaign(election, CLASS, "a", waiting(Duration::from_secs(5)))
        .await?;
    // b gives up on its (long) campaign by dropping the future.
    let dropped = timeout(
        Duration::from_secs(1),
        b.campaign(election, CLASS, "b", waiting(Duration::from_secs(30))),
    )
    .await;
    ensure!(dropped.is_err(), "b cannot lead while a does");
    eventually(
        "b's candidacy to be withdrawn",
        Duration::from_secs(10),
        || async {
            let standing = a.candidates(election).await?;
            ensure!(standing.is_empty(), "{standing:?}");
            Ok(())
        },
    )
    .await?;
    // So a's resignation hands the election to no one.
    ensure!(la.resign().await?.is_none());
    ensure!(a.leader(election).await?.is_none());
    // And b campaigns again as usual.
    let lb = b
        .campaign(election, CLASS, "b", waiting(Duration::from_secs(5)))
        .await?;
    lb.resign().await?;
    Ok(())
}

/// `yieldToHigherPriority` (issue 33): a leader is asked to yield when a
/// candidate above its priority stands, and hands over at its own safe
/// point (`yield_if_requested`), in one transaction, to the highest
/// priority; a candidate at or below its priority asks nothing.
#[tokio::test(flavor = "multi_thread")]
async fn client_elections_a_leader_yields_to_a_higher_priority_candidate_at_its_safe_point()
-> anyhow::Result<()> {
    const YIELDING: &str = "elect-yield";
    let dir = policies()?;
    std::fs::write(
        dir.path().join("classes/zz-elect-yield.toml"),
        format!(
            "[[class]]\nname = \"{YIELDING}\"\nkind = \"election\"\ntier = \"coord\"\n\
             enforcement = \"fenced\"\nttlSeconds = {}\nyieldToHigherPriority = true\n\
             [class.pauseTest]\nresource = \"postgresql:dev.latchkey_fenced_rows\"\n\
             result = \"pause-tests/{YIELDING}.json\"\n",
            TTL.as_secs()
        ),
    )?;
    latchkey_tests::write_pause_test_fixtures(dir.path())?;
    let s = stack(&dir).await?;
    let election = "demo/elect/yield";
    let a = connect(s.arbiter.addr(), "workload/alice").await?;
    let b = connect(s.arbiter.addr(), "workload/alice").await?;
    let c = connect(s.arbiter.addr(), "workload/alice").await?;
    let at = |priority: u32| CampaignOptions {
        priority,
        wait: Some(Duration::from_secs(30)),
        ..CampaignOptions::default()
    };
    let led = a.campaign(election, YIELDING, "pod-a", at(1)).await?;
    let mut events = a.observe(election, 0).await?;
    ensure!(started(&next_event(&mut events).await?).is_some());

    // A candidate at the leader's priority or below asks nothing.
    let low = tokio::spawn({
        let c = c.clone();
        async move { c.campaign(election, YIELDING, "pod-c", at(1)).await }
    });
    until_standing(&a, election, 1).await?;
    ensure!(
        timeout(Duration::from_secs(1), led.transfer_request())
            .await
            .is_err(),
        "a candidate of the leader's own priority asked it to yield"
    );
    ensure!(!led.transfer_requested());
    ensure!(
        led.yield_if_requested().await?.is_none(),
        "nothing to yield to"
    );

    // A higher one does: the leader hears of it and yields at its safe point.
    let high = tokio::spawn({
        let b = b.clone();
        async move { b.campaign(election, YIELDING, "pod-b", at(5)).await }
    });
    timeout(Duration::from_secs(10), led.transfer_request())
        .await
        .context("the leader was not asked to yield within 10 s")?;
    match next_event(&mut events).await? {
        ElectionEvent::TransferRequested { term, priority } => {
            ensure!(term == led.term() && priority == 5, "{term} {priority}");
        }
        other => bail!("expected the transfer request, got {other:?}"),
    }
    let next = led
        .yield_if_requested()
        .await?
        .context("a requested yield hands the leadership over")?;
    ensure!(next.value == "pod-b" && next.priority == 5, "{next:?}");
    let b_leads = high.await??;
    ensure!(b_leads.term() == led.term() + 1 && b_leads.token() > led.token());
    ensure!(led.is_lost(), "the yielded leadership is over");
    // The lower candidate still waits; b leads on.
    ensure!(!low.is_finished());
    low.abort();
    b_leads.resign().await?;
    Ok(())
}
