//! Issue 33: leader elections (latchkey.election.v1) on a real etcd and a
//! real arbiter, over mTLS with SPIFFE identities. Replicas that share one
//! identity (alice, twice) campaign against each other on their own
//! sessions; every leadership gets a term one above the one it took over
//! from and a token above every earlier one; Proclaim, Resign and Transfer
//! act only on the current leadership; Observe reports every term,
//! proclamation and vacancy in order.

use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_proto::electionv1::election_service_client::ElectionServiceClient;
use latchkey_proto::electionv1::{
    CampaignRequest, CandidatesRequest, LeaderRequest, Leadership, ObserveRequest, ObserveResponse,
    ProclaimRequest, ResignRequest, TransferRequest, VacancyReason, observe_response::Event,
    transfer_request,
};
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{CloseSessionRequest, KeepAliveRequest};
use latchkey_tests::arbiter::ArbiterOptions;
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

use crate::support::{Stack, expect_refusal, stack_with};

/// A fenced election class with the platform's shortest TTL, for the
/// tests only (its pause-test result is the harness's fixture). The client
/// and latchctl scenarios (`client_elections.rs`, `latchctl_elections.rs`)
/// use it too.
pub(crate) const CLASS: &str = "elect-fast";
pub(crate) const TTL: Duration = Duration::from_secs(5);

type Elect = ElectionServiceClient<Channel>;
type Lock = LockClient<Channel>;

pub(crate) fn policies() -> anyhow::Result<TempDir> {
    let ttl = u32::try_from(TTL.as_secs())?;
    latchkey_tests::dev_policies_with_election_class(CLASS, ttl)
}

pub(crate) async fn stack(dir: &TempDir) -> anyhow::Result<Stack> {
    stack_with(ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..ArbiterOptions::default()
    })
    .await
}

/// A replica: its own session (kept alive until `stop`), its own clients.
/// The audit scenario (`audit.rs`) campaigns with it too.
pub(crate) struct Replica {
    pub(crate) lock: Lock,
    pub(crate) elect: Elect,
    pub(crate) session: i64,
    renewals: JoinHandle<()>,
}

impl Replica {
    pub(crate) async fn start(stack: &Stack, name: &str) -> anyhow::Result<Self> {
        let mut lock = stack.arbiter.lock(name).await?;
        let session = latchkey_tests::lock_calls::open(&mut lock, CLASS).await?;
        let renewals = keep_alive(lock.clone(), session);
        Ok(Self {
            elect: stack.arbiter.election(name).await?,
            lock,
            session,
            renewals,
        })
    }

    fn campaign_request(&self, election: &str, value: &str, priority: u32) -> CampaignRequest {
        CampaignRequest {
            election: election.into(),
            class: CLASS.into(),
            session_id: self.session,
            value: value.into(),
            priority,
            instance: String::new(),
        }
    }

    pub(crate) async fn campaign(
        &mut self,
        election: &str,
        value: &str,
        wait: Duration,
    ) -> Result<Leadership, tonic::Status> {
        let mut request = tonic::Request::new(self.campaign_request(election, value, 0));
        request.set_timeout(wait);
        Ok(self
            .elect
            .campaign(request)
            .await?
            .into_inner()
            .leadership
            .unwrap_or_default())
    }

    /// A campaign left waiting in the background.
    pub(crate) fn campaign_later(
        &self,
        election: &str,
        value: &str,
        priority: u32,
        wait: Duration,
    ) -> JoinHandle<Result<Leadership, tonic::Status>> {
        let mut elect = self.elect.clone();
        let mut request = tonic::Request::new(self.campaign_request(election, value, priority));
        request.set_timeout(wait);
        tokio::spawn(async move {
            Ok(elect
                .campaign(request)
                .await?
                .into_inner()
                .leadership
                .unwrap_or_default())
        })
    }

    /// Stops renewing: the session ends a TTL later, as a crashed replica's.
    fn crash(&self) {
        self.renewals.abort();
    }
}

fn keep_alive(mut lock: Lock, session: i64) -> JoinHandle<()> {
    tokio::spawn(async move {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let requests = tokio_stream::wrappers::ReceiverStream::new(rx);
        let Ok(answers) = lock.keep_alive(requests).await else {
            return;
        };
        let mut answers = answers.into_inner();
        tokio::spawn(async move { while let Ok(Some(_)) = answers.message().await {} });
        loop {
            let renew = KeepAliveRequest {
                session_id: session,
                session_ids: vec![],
            };
            if tx.send(renew).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

async fn candidates(elect: &mut Elect, election: &str) -> anyhow::Result<Vec<(String, u32, u64)>> {
    Ok(elect
        .candidates(CandidatesRequest {
            election: election.into(),
        })
        .await?
        .into_inner()
        .candidates
        .into_iter()
        .map(|c| (c.value, c.priority, c.candidate_id))
        .collect())
}

/// Waits until `n` candidates stand.
pub(crate) async fn until_standing(
    elect: &mut Elect,
    election: &str,
    n: usize,
) -> anyhow::Result<()> {
    latchkey_tests::eventually("candidates to stand", Duration::from_secs(5), || {
        let mut elect = elect.clone();
        async move {
            let standing = candidates(&mut elect, election).await?.len();
            ensure!(
                standing >= n,
                "{standing} of {n} candidates stand in {election}"
            );
            Ok(())
        }
    })
    .await
}

#[tokio::test]
async fn replicas_sharing_an_identity_take_over_from_each_other_with_rising_terms_and_tokens()
-> anyhow::Result<()> {
    let dir = policies()?;
    let stack = stack(&dir).await?;
    let election = "demo/elect/replicas";
    let mut a = Replica::start(&stack, "workload/alice").await?;
    let mut b = Replica::start(&stack, "workload/alice").await?;
    let first = a
        .campaign(election, "pod-a", Duration::from_secs(5))
        .await?;
    ensure!(first.session_id == a.session && first.value == "pod-a");
    ensure!(first.token > 0 && first.term > 0);
    // The same session campaigning again gets its leadership back.
    let again = a
        .campaign(election, "pod-a", Duration::from_secs(5))
        .await?;
    ensure!(again == first, "{again:?} != {first:?}");

    let waiting = b.campaign_later(election, "pod-b", 0, Duration::from_secs(20));
    until_standing(&mut a.elect, election, 1).await?;
    // Resign: b leads in the same transaction.
    let next = a
        .elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: a.session,
            token: first.token,
        })
        .await?
        .into_inner()
        .next
        .context("a resignation with a candidate names the next leader")?;
    ensure!(next.value == "pod-b" && next.term == first.term + 1);
    let second = waiting.await??;
    ensure!(second.session_id == b.session);
    ensure!(second.term == first.term + 1, "{second:?} after {first:?}");
    ensure!(second.token > first.token);

    // a stands again; b crashes: a leads after b's session expires.
    let waiting = a.campaign_later(election, "pod-a", 0, Duration::from_secs(30));
    until_standing(&mut b.elect, election, 1).await?;
    b.crash();
    let started = std::time::Instant::now();
    let third = waiting.await??;
    let failover = started.elapsed();
    ensure!(third.session_id == a.session);
    ensure!(third.term > second.term && third.token > second.token);
    // A crash is noticed when the lease expires (TTL) plus the campaign's
    // reaction: well inside TTL + a few seconds here.
    ensure!(
        failover <= TTL + Duration::from_secs(4),
        "failover took {failover:?}"
    );
    let leader = a
        .elect
        .leader(LeaderRequest {
            election: election.into(),
        })
        .await?
        .into_inner()
        .leader
        .context("a leader")?;
    ensure!(leader.value == "pod-a" && leader.term == third.term);
    Ok(())
}

#[tokio::test]
async fn only_the_current_leadership_proclaims_resigns_or_transfers() -> anyhow::Result<()> {
    let dir = policies()?;
    let stack = stack(&dir).await?;
    let election = "demo/elect/proclaim";
    let mut a = Replica::start(&stack, "workload/alice").await?;
    let mut b = Replica::start(&stack, "workload/bob").await?;
    let led = a.campaign(election, "v1", Duration::from_secs(5)).await?;
    a.elect
        .proclaim(ProclaimRequest {
            election: election.into(),
            session_id: a.session,
            token: led.token,
            value: "v2".into(),
        })
        .await?;
    // Another identity naming a's session and token is not the leader.
    expect_refusal(
        b.elect
            .proclaim(ProclaimRequest {
                election: election.into(),
                session_id: a.session,
                token: led.token,
                value: "mine".into(),
            })
            .await,
        Code::FailedPrecondition,
        "NOT_LEADER",
    )?;
    expect_refusal(
        b.elect
            .resign(ResignRequest {
                election: election.into(),
                session_id: b.session,
                token: led.token,
            })
            .await,
        Code::FailedPrecondition,
        "NOT_LEADER",
    )?;
    // A stale token of the right session is not the leadership either.
    expect_refusal(
        a.elect
            .proclaim(ProclaimRequest {
                election: election.into(),
                session_id: a.session,
                token: led.token - 1,
                value: "old".into(),
            })
            .await,
        Code::FailedPrecondition,
        "NOT_LEADER",
    )?;
    // Transfer with no candidate: NO_CANDIDATE; then to b by its id.
    expect_refusal(
        a.elect
            .transfer(TransferRequest {
                election: election.into(),
                session_id: a.session,
                token: led.token,
                to: Some(transfer_request::To::Preferred(true)),
            })
            .await,
        Code::FailedPrecondition,
        "NO_CANDIDATE",
    )?;
    let waiting = b.campaign_later(election, "bv", 0, Duration::from_secs(20));
    until_standing(&mut a.elect, election, 1).await?;
    let (_, _, id) = candidates(&mut a.elect, election).await?[0].clone();
    let next = a
        .elect
        .transfer(TransferRequest {
            election: election.into(),
            session_id: a.session,
            token: led.token,
            to: Some(transfer_request::To::CandidateId(id)),
        })
        .await?
        .into_inner()
        .next
        .context("the next leader")?;
    ensure!(next.identity.ends_with("/bob") && next.term == led.term + 1);
    let b_led = waiting.await??;
    ensure!(b_led.token > led.token);
    // a's leadership ended: its proclamation and resignation are refused.
    expect_refusal(
        a.elect
            .proclaim(ProclaimRequest {
                election: election.into(),
                session_id: a.session,
                token: led.token,
                value: "v3".into(),
            })
            .await,
        Code::FailedPrecondition,
        "NOT_LEADER",
    )?;
    let leader = b
        .elect
        .leader(LeaderRequest {
            election: election.into(),
        })
        .await?
        .into_inner()
        .leader
        .context("b leads")?;
    ensure!(leader.value == "bv");
    drop(a.lock);
    Ok(())
}

#[tokio::test]
async fn priority_then_arrival_decides_who_leads_next() -> anyhow::Result<()> {
    let dir = policies()?;
    let stack = stack(&dir).await?;
    let election = "demo/elect/priority";
    let mut a = Replica::start(&stack, "workload/alice").await?;
    let b = Replica::start(&stack, "workload/alice").await?;
    let c = Replica::start(&stack, "workload/alice").await?;
    let d = Replica::start(&stack, "workload/bob").await?;
    let led = a.campaign(election, "a", Duration::from_secs(5)).await?;
    let wait = Duration::from_secs(20);
    let b_waits = b.campaign_later(election, "b", 0, wait);
    until_standing(&mut a.elect, election, 1).await?;
    let c_waits = c.campaign_later(election, "c", 7, wait);
    until_standing(&mut a.elect, election, 2).await?;
    let d_waits = d.campaign_later(election, "d", 7, wait);
    until_standing(&mut a.elect, election, 3).await?;
    let order: Vec<String> = candidates(&mut a.elect, election)
        .await?
        .into_iter()
        .map(|(v, _, _)| v)
        .collect();
    ensure!(order == ["c", "d", "b"], "{order:?}");
    a.elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: a.session,
            token: led.token,
        })
        .await?;
    let c_led = c_waits.await??;
    ensure!(c_led.value == "c" && c_led.term == led.term + 1);
    let mut c_elect = c.elect.clone();
    c_elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: c.session,
            token: c_led.token,
        })
        .await?;
    let d_led = d_waits.await??;
    ensure!(d_led.value == "d" && d_led.term == c_led.term + 1);
    ensure!(!b_waits.is_finished());
    b_waits.abort();
    Ok(())
}

/// The events of an Observe stream, as short strings.
async fn next_event(stream: &mut Streaming<ObserveResponse>) -> anyhow::Result<String> {
    let event = tokio::time::timeout(Duration::from_secs(15), stream.message())
        .await
        .context("no event within 15 s")??
        .context("the stream ended")?;
    Ok(match event.event.context("an event")? {
        Event::TermStarted(t) => {
            let l = t.leader.unwrap_or_default();
            format!("start {} {}", l.term, l.value)
        }
        Event::Proclaimed(p) => format!("proclaim {} {}", p.term, p.value),
        Event::Vacant(v) => format!(
            "vacant {} {:?}",
            v.term,
            VacancyReason::try_from(v.reason).unwrap_or(VacancyReason::Unspecified)
        ),
        Event::Gap(g) => format!("gap {}-{}", g.from_term, g.to_term),
        Event::TransferRequested(t) => format!("yield {} {}", t.term, t.priority),
    })
}

/// A resignation hands the leadership to the first candidate, whose
/// Campaign call may be ending at that moment (its deadline passed, its
/// client gave up). Here the withdrawal of the ended call's record is held
/// back ([`TestFault::SlowWithdraw`]), so the resignation certainly hands
/// over to it: the arbiter must resign that leadership again, not leave
/// the election led by a session whose caller never learns it leads (it
/// renews its session for its locks, so that would last for good).
#[tokio::test]
async fn a_leadership_handed_to_a_campaign_that_gave_up_is_resigned_again() -> anyhow::Result<()> {
    let dir = policies()?;
    let stack = stack_with(ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        test_fault: latchkey_tests::faulty_log::TestFault::SlowWithdraw,
        ..ArbiterOptions::default()
    })
    .await?;
    let election = "demo/elect/gave-up";
    let mut a = Replica::start(&stack, "workload/alice").await?;
    let mut b = Replica::start(&stack, "workload/alice").await?;
    let led = a
        .campaign(election, "pod-a", Duration::from_secs(5))
        .await?;
    let gave_up = b
        .campaign(election, "pod-b", Duration::from_secs(1))
        .await
        .expect_err("a leads: b's campaign ends at its deadline");
    ensure!(
        matches!(gave_up.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{gave_up:?}"
    );
    // b's record stands until its slow withdrawal: the resignation picks it.
    let standing = candidates(&mut a.elect, election).await?;
    ensure!(
        standing.iter().any(|(value, ..)| value == "pod-b"),
        "b's record is withdrawn only {:?} after its call: {standing:?}",
        latchkey_tests::faulty_log::SLOW_WITHDRAW
    );
    let next = a
        .elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: a.session,
            token: led.token,
        })
        .await?
        .into_inner()
        .next
        .context("the resignation hands over to b's record")?;
    ensure!(next.value == "pod-b" && next.term == led.term + 1);
    // Nobody asked for b's leadership any more: it is resigned, and the
    // election is vacant (b's session lives on, renewed).
    latchkey_tests::eventually(
        "the handed-over leadership to be resigned",
        latchkey_tests::faulty_log::SLOW_WITHDRAW + Duration::from_secs(10),
        || {
            let mut elect = a.elect.clone();
            async move {
                let leader = elect
                    .leader(LeaderRequest {
                        election: election.into(),
                    })
                    .await?
                    .into_inner();
                ensure!(leader.leader.is_none(), "still led: {leader:?}");
                Ok(())
            }
        },
    )
    .await?;
    // The election works on: b campaigns again and leads a later term.
    let again = b
        .campaign(election, "pod-b", Duration::from_secs(5))
        .await?;
    ensure!(again.session_id == b.session && again.term > next.term);
    Ok(())
}

/// The same hand-over to a campaign that gave up, but its caller asks
/// again on the same session before the cancelled call's clean-up runs:
/// the retry is answered the leadership, and the clean-up must then leave
/// it alone (it resigns only a leadership nobody was answered).
#[tokio::test]
async fn a_retried_campaign_keeps_the_leadership_its_cancelled_call_was_handed()
-> anyhow::Result<()> {
    let dir = policies()?;
    let stack = stack_with(ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        test_fault: latchkey_tests::faulty_log::TestFault::SlowWithdraw,
        ..ArbiterOptions::default()
    })
    .await?;
    let election = "demo/elect/retried";
    let mut a = Replica::start(&stack, "workload/alice").await?;
    let mut b = Replica::start(&stack, "workload/alice").await?;
    let led = a
        .campaign(election, "pod-a", Duration::from_secs(5))
        .await?;
    b.campaign(election, "pod-b", Duration::from_secs(1))
        .await
        .expect_err("a leads: b's campaign ends at its deadline");
    let next = a
        .elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: a.session,
            token: led.token,
        })
        .await?
        .into_inner()
        .next
        .context("the resignation hands over to b's record")?;
    ensure!(next.value == "pod-b");
    // b asks again at once, on the same session: it leads already.
    let retried = b
        .campaign(election, "pod-b", Duration::from_secs(5))
        .await?;
    ensure!(retried.session_id == b.session && retried.term == next.term);
    // The cancelled call's clean-up has run by now; b still leads.
    tokio::time::sleep(latchkey_tests::faulty_log::SLOW_WITHDRAW + Duration::from_secs(2)).await;
    b.elect
        .proclaim(ProclaimRequest {
            election: election.into(),
            session_id: b.session,
            token: retried.token,
            value: "still-b".into(),
        })
        .await
        .context("b's answered leadership must outlive the clean-up")?;
    Ok(())
}

#[tokio::test]
async fn observe_reports_every_term_proclamation_and_vacancy_in_order() -> anyhow::Result<()> {
    let dir = policies()?;
    let stack = stack(&dir).await?;
    let election = "demo/elect/observed";
    // bob observes: a grant on the prefix is enough, no campaign.
    let mut observer = stack.arbiter.election("workload/bob").await?;
    let mut stream = observer
        .observe(ObserveRequest {
            election: election.into(),
            from_term: 0,
            transfer_requests: false,
        })
        .await?
        .into_inner();
    ensure!(next_event(&mut stream).await? == "vacant 0 Unspecified");
    let mut a = Replica::start(&stack, "workload/alice").await?;
    let mut b = Replica::start(&stack, "workload/alice").await?;
    let led = a.campaign(election, "a", Duration::from_secs(5)).await?;
    let t = led.term;
    ensure!(next_event(&mut stream).await? == format!("start {t} a"));
    a.elect
        .proclaim(ProclaimRequest {
            election: election.into(),
            session_id: a.session,
            token: led.token,
            value: "a2".into(),
        })
        .await?;
    ensure!(next_event(&mut stream).await? == format!("proclaim {t} a2"));
    let waiting = b.campaign_later(election, "b", 0, Duration::from_secs(20));
    until_standing(&mut a.elect, election, 1).await?;
    a.elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: a.session,
            token: led.token,
        })
        .await?;
    let b_led = waiting.await??;
    ensure!(next_event(&mut stream).await? == format!("start {} b", t + 1));
    b.elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: b.session,
            token: b_led.token,
        })
        .await?;
    ensure!(next_event(&mut stream).await? == format!("vacant {} Resigned", t + 1));
    let a_led = a.campaign(election, "a3", Duration::from_secs(5)).await?;
    let t3 = a_led.term;
    ensure!(
        t3 == t + 2,
        "a term over a vacancy is one above the last: {t3} after {}",
        t + 1
    );
    ensure!(next_event(&mut stream).await? == format!("start {t3} a3"));
    a.lock
        .close_session(CloseSessionRequest {
            session_id: a.session,
        })
        .await?;
    ensure!(next_event(&mut stream).await? == format!("vacant {t3} SessionEnded"));
    // A late observer asking from an old term is told of the gap first.
    let mut late = observer
        .observe(ObserveRequest {
            election: election.into(),
            from_term: t,
            transfer_requests: false,
        })
        .await?
        .into_inner();
    let first = next_event(&mut late).await?;
    ensure!(first == format!("gap {t}-{}", t3 - 1), "{first}");
    ensure!(next_event(&mut late).await?.starts_with("vacant"));
    Ok(())
}

#[tokio::test]
async fn elections_refuse_bad_input_and_other_identities() -> anyhow::Result<()> {
    let dir = policies()?;
    let stack = stack(&dir).await?;
    let mut a = Replica::start(&stack, "workload/alice").await?;
    // mallory has no grant on demo/: refused as for a key, nothing written.
    let mut mallory = stack.arbiter.election("workload/mallory").await?;
    expect_refusal(
        mallory
            .campaign(a.campaign_request("demo/elect/x", "m", 0))
            .await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    expect_refusal(
        mallory
            .observe(ObserveRequest {
                election: "demo/elect/x".into(),
                from_term: 0,
                transfer_requests: false,
            })
            .await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    expect_refusal(
        mallory
            .candidates(CandidatesRequest {
                election: "demo/elect/x".into(),
            })
            .await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    // A lock class on Campaign, an election class on Acquire.
    let mut lock_class = a.campaign_request("demo/elect/x", "v", 0);
    lock_class.class = "demo".into();
    expect_refusal(
        a.elect.campaign(lock_class).await,
        Code::InvalidArgument,
        "WRONG_KIND",
    )?;
    expect_refusal(
        latchkey_tests::lock_calls::try_lock(&mut a.lock, "demo/elect/x", CLASS, a.session).await,
        Code::InvalidArgument,
        "WRONG_KIND",
    )?;
    // A value that would rewrite an observer's terminal.
    let mut escape = a.campaign_request("demo/elect/x", "ok\u{1b}[2J", 0);
    escape.value = "ok\u{1b}[2J".into();
    expect_refusal(
        a.elect.campaign(escape).await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    let too_long = a.campaign_request("demo/elect/x", &"v".repeat(1_025), 0);
    expect_refusal(
        a.elect.campaign(too_long).await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    expect_refusal(
        a.elect
            .campaign(a.campaign_request("demo//x", "v", 0))
            .await,
        Code::InvalidArgument,
        "BAD_KEY",
    )?;
    // Another identity's session.
    let mut bob = stack.arbiter.election("workload/bob").await?;
    expect_refusal(
        bob.campaign(a.campaign_request("demo/elect/x", "v", 0))
            .await,
        Code::FailedPrecondition,
        "SESSION_EXPIRED",
    )?;
    // Nothing of the refused calls was written: no candidate, no leader.
    ensure!(candidates(&mut a.elect, "demo/elect/x").await?.is_empty());
    let leader = a
        .elect
        .leader(LeaderRequest {
            election: "demo/elect/x".into(),
        })
        .await?
        .into_inner();
    ensure!(leader.leader.is_none());
    // A campaign that times out leaves the candidates.
    let led = a
        .campaign("demo/elect/y", "a", Duration::from_secs(5))
        .await?;
    let mut other = Replica::start(&stack, "workload/alice").await?;
    expect_refusal(
        other
            .campaign("demo/elect/y", "o", Duration::from_millis(700))
            .await,
        Code::DeadlineExceeded,
        "WAIT_TIMEOUT",
    )?;
    ensure!(candidates(&mut a.elect, "demo/elect/y").await?.is_empty());
    // A campaign the client cancels leaves them too (its call is dropped
    // mid-wait; the arbiter withdraws the record on a task of its own).
    let cancelled = other.campaign_later("demo/elect/y", "c", 0, Duration::from_secs(30));
    until_standing(&mut a.elect, "demo/elect/y", 1).await?;
    cancelled.abort();
    latchkey_tests::eventually(
        "a cancelled campaign's record to go",
        Duration::from_secs(2),
        || {
            let mut elect = a.elect.clone();
            async move {
                let standing = candidates(&mut elect, "demo/elect/y").await?;
                ensure!(standing.is_empty(), "still standing: {standing:?}");
                Ok(())
            }
        },
    )
    .await?;
    ensure!(led.token > 0);
    Ok(())
}

/// Through the real edge (Envoy with the real filter, the arbiter trusting
/// only the edge's identity): two replicas with one SVID hand the
/// leadership over, an observer of another identity sees it, and an
/// identity with no grant is refused at the edge.
#[tokio::test(flavor = "multi_thread")]
async fn through_the_edge_replicas_hand_over_and_others_are_refused() -> anyhow::Result<()> {
    use latchkey_tests::arbiter::{channel, spiffe};
    use latchkey_tests::envoy::{Envoy, EnvoyOptions};
    let dir = policies()?;
    let stack = stack_with(ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        edge_identity: Some(spiffe("latchkey/edge")),
        ..ArbiterOptions::default()
    })
    .await?;
    let envoy = Envoy::start(EnvoyOptions::with_filter(
        stack.arbiter.addr(),
        serde_json::json!({}),
    )?)
    .await?;
    let edge = envoy.addr();
    let replica = |name: &'static str| async move {
        let ch = channel(edge, name).await?;
        let mut lock = Lock::new(ch.clone());
        let session = latchkey_tests::lock_calls::open(&mut lock, CLASS).await?;
        anyhow::Ok(Replica {
            renewals: keep_alive(lock.clone(), session),
            elect: Elect::new(ch),
            lock,
            session,
        })
    };
    let election = "demo/elect/edge";
    let mut a = replica("workload/alice").await?;
    let b = replica("workload/alice").await?;
    let mut observer = Elect::new(channel(edge, "workload/bob").await?);
    let mut stream = observer
        .observe(ObserveRequest {
            election: election.into(),
            from_term: 0,
            transfer_requests: false,
        })
        .await?
        .into_inner();
    ensure!(next_event(&mut stream).await? == "vacant 0 Unspecified");
    let led = a.campaign(election, "a", Duration::from_secs(5)).await?;
    ensure!(next_event(&mut stream).await? == format!("start {} a", led.term));
    let waiting = b.campaign_later(election, "b", 0, Duration::from_secs(20));
    until_standing(&mut a.elect, election, 1).await?;
    a.elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: a.session,
            token: led.token,
        })
        .await?;
    let b_led = waiting.await??;
    ensure!(b_led.term == led.term + 1 && b_led.token > led.token);
    ensure!(next_event(&mut stream).await? == format!("start {} b", b_led.term));
    // mallory has no grant on demo/: the edge refuses before the arbiter.
    let mut mallory = Elect::new(channel(edge, "workload/mallory").await?);
    expect_refusal(
        mallory
            .leader(LeaderRequest {
                election: election.into(),
            })
            .await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    drop(a.lock);
    Ok(())
}
