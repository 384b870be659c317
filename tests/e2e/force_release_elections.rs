//! Two-person force-release of an election's leadership (issue 33), against
//! a real etcd, the in-process arbiter and a real OIDC provider, as
//! `force_release.rs` does for holds: operator A requests with the
//! election's name, operator B approves, and exactly that term ends — the
//! observers (the leader's own client included) hear a `FORCED` vacancy of
//! it, the next candidate leads in a higher term with a higher token, and
//! the old leader's Proclaim is refused `NOT_LEADER` while its session
//! lives on. A term that changed since the request is refused and nothing
//! is written; a request for an election never touches a hold on a lock key
//! of the same name, nor the other way round.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use latchkey_client::{
    CampaignOptions, Client, ElectionEvent, ElectionEvents, LeadershipLost, VacancyReason,
};
use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::adminv1::{
    ApproveForceReleaseRequest, ApproveForceReleaseResponse, ForceReleaseRequest,
    ListForceReleasesRequest, RequestForceReleaseRequest,
};
use latchkey_proto::electionv1::ProclaimRequest;
use latchkey_tests::arbiter::{ArbiterOptions, spiffe};
use latchkey_tests::eventually;
use latchkey_tests::oidc::OidcProvider;
use tempfile::TempDir;
use tokio::time::timeout;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::client::connect;
use crate::elections::{CLASS, policies};
use crate::force_release::{config, provider};
use crate::support::{Stack, expect_refusal, stack_with};

const AUDIENCE: &str = "latchctl";
const OPERATOR: &str = "latchkey/operator";
/// The fenced lock class (TTL 15 s) of a same-named hold.
const LOCK_CLASS: &str = "demo";

struct World {
    s: Stack,
    oidc: OidcProvider,
    _policies: TempDir,
}

async fn world() -> anyhow::Result<World> {
    let oidc = provider(None).await?;
    let dir = policies()?;
    let s = stack_with(ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        force_release: config(&oidc, false),
        ..ArbiterOptions::default()
    })
    .await?;
    Ok(World {
        s,
        oidc,
        _policies: dir,
    })
}

impl World {
    async fn admin(&self) -> anyhow::Result<AdminClient<Channel>> {
        self.s.arbiter.admin(OPERATOR).await
    }

    async fn token(&self, sub: &str) -> anyhow::Result<String> {
        self.oidc.id_token(sub, AUDIENCE).await
    }

    async fn request(
        &self,
        key: &str,
        election: bool,
        token: &str,
    ) -> Result<ForceReleaseRequest, Status> {
        let mut admin = self
            .admin()
            .await
            .map_err(|e| Status::unknown(e.to_string()))?;
        Ok(admin
            .request_force_release(RequestForceReleaseRequest {
                key: key.into(),
                reason: "the scheduler leader is wedged".into(),
                revoke_session: false,
                id_token: token.into(),
                election,
                slot: None,
                shared_session: None,
            })
            .await?
            .into_inner())
    }

    async fn approve(&self, id: &str, token: &str) -> Result<ApproveForceReleaseResponse, Status> {
        let mut admin = self
            .admin()
            .await
            .map_err(|e| Status::unknown(e.to_string()))?;
        Ok(admin
            .approve_force_release(ApproveForceReleaseRequest {
                request_id: id.into(),
                id_token: token.into(),
            })
            .await?
            .into_inner())
    }

    async fn revision(&self) -> anyhow::Result<i64> {
        self.s.etcd.revision().await
    }

    async fn held(&self, key: &str) -> anyhow::Result<bool> {
        let got = self
            .s
            .etcd
            .client()
            .await?
            .get(format!("/latchkey/l/{key}"), None)
            .await?;
        Ok(!got.kvs().is_empty())
    }

    /// The leadership entries (`e//i/<subject, hex>/<election>`), by subject.
    async fn leadership_entries(&self, election: &str) -> anyhow::Result<Vec<String>> {
        let got = self
            .s
            .etcd
            .client()
            .await?
            .get(
                "/latchkey/e//i/",
                Some(latchkey_etcd::kv::GetOptions::new().with_prefix()),
            )
            .await?;
        Ok(got
            .kvs()
            .iter()
            .filter_map(|kv| kv.key_str().ok())
            .filter(|k| k.ends_with(&format!("/{election}")))
            .map(str::to_string)
            .collect())
    }
}

fn waiting(wait: Duration) -> CampaignOptions {
    CampaignOptions {
        wait: Some(wait),
        ..CampaignOptions::default()
    }
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

async fn next_event(events: &mut ElectionEvents) -> anyhow::Result<ElectionEvent> {
    timeout(Duration::from_secs(15), events.next_event())
        .await
        .context("no event within 15 s")?
        .context("the observation ended")?
        .context("the observation failed")
}

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

/// No token of `tokens` (decimal, or its revision half) in `text`.
fn no_token_in(text: &str, tokens: &[u64]) -> anyhow::Result<()> {
    for t in tokens {
        let (_, revision) = latchkey_records::token::unpack(*t);
        for needle in [t.to_string(), revision.to_string()] {
            let whole_word = text
                .split(|c: char| !c.is_ascii_alphanumeric())
                .any(|w| w == needle);
            ensure!(!whole_word, "a token ({needle}) in {text:?}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn two_operators_force_release_a_leadership_and_the_next_candidate_leads()
-> anyhow::Result<()> {
    let w = world().await?;
    let election = "demo/elect/fr-lead";
    let addr = w.s.arbiter.addr();
    let alice = connect(addr, "workload/alice").await?;
    let bob = connect(addr, "workload/bob").await?;
    let carol = connect(addr, "workload/bob").await?;
    let mut events = carol.observe(election, 0).await?;
    ensure!(matches!(
        next_event(&mut events).await?,
        ElectionEvent::Vacant { .. }
    ));

    let la = alice
        .campaign(election, CLASS, "a", waiting(Duration::from_secs(5)))
        .await?;
    let t = la.term();
    match next_event(&mut events).await? {
        ElectionEvent::TermStarted { leader } if leader.term == t => {}
        other => bail!("expected term {t} to start: {other:?}"),
    }
    // bob stands behind alice.
    let bob_campaign = bob.clone();
    let bob_waits = tokio::spawn(async move {
        bob_campaign
            .campaign(election, CLASS, "b", waiting(Duration::from_secs(60)))
            .await
    });
    until_standing(&alice, election, 1).await?;
    ensure!(
        w.leadership_entries(election).await?
            == [format!(
                "/latchkey/e//i/{}/{election}",
                hex(&spiffe("workload/alice"))
            )],
        "alice's leadership entry"
    );

    // The request shows the leader, its session and term, never its token.
    let (a, b) = (w.token("alice-op").await?, w.token("bob-op").await?);
    let req = w.request(election, true, &a).await?;
    ensure!(req.election && req.key == election, "{req:?}");
    ensure!(req.term == t, "the request names term {} not {t}", req.term);
    ensure!(req.holder_identity == spiffe("workload/alice"), "{req:?}");
    ensure!(req.holder_session == la.session_id(), "{req:?}");
    ensure!(req.hold_revision == 0, "a term's revision shown: {req:?}");
    ensure!(
        (req.class.as_str(), req.enforcement.as_str()) == (CLASS, "fenced"),
        "{req:?}"
    );
    ensure!(req.warning.is_empty());
    no_token_in(&format!("{req:?}"), &[la.token().get()])?;
    let listed = w
        .admin()
        .await?
        .list_force_releases(ListForceReleasesRequest {
            id_token: b.clone(),
        })
        .await?
        .into_inner();
    let shown = listed
        .pending
        .iter()
        .find(|p| p.request_id == req.request_id)
        .context("the request is not listed")?;
    ensure!(shown.election && shown.term == t && shown.hold_revision == 0);
    ensure!(!la.is_lost(), "a request alone ends nothing");

    // B approves: the term ends, FORCED.
    let done = w.approve(&req.request_id, &b).await?;
    ensure!(done.approver == "bob-op");
    ensure!(
        done.request
            .as_ref()
            .is_some_and(|r| r.election && r.term == t)
    );
    ensure!(
        next_event(&mut events).await?
            == ElectionEvent::Vacant {
                term: t,
                reason: VacancyReason::Forced
            },
        "the observer did not hear a forced vacancy of term {t}"
    );
    // The leader's own client hears it from its Observe, its session alive.
    let reason = timeout(Duration::from_secs(5), la.lost())
        .await
        .context("the forced-out leader never heard of it")?;
    ensure!(
        reason == LeadershipLost::Vacated(VacancyReason::Forced),
        "{reason:?}"
    );
    ensure!(
        alice.session(la.session_id()).is_some(),
        "the session lives on"
    );

    // bob leads next, in a higher term with a higher token.
    let lb = timeout(Duration::from_secs(30), bob_waits)
        .await
        .context("bob did not lead after the forced vacancy")???;
    ensure!(lb.term() > t, "term {} after {t}", lb.term());
    ensure!(lb.token() > la.token(), "bob's token is not above alice's");
    match next_event(&mut events).await? {
        ElectionEvent::TermStarted { leader } if leader.term == lb.term() => {}
        other => bail!("expected bob's term to start: {other:?}"),
    }
    // Only bob's leadership is counted now.
    ensure!(
        w.leadership_entries(election).await?
            == [format!(
                "/latchkey/e//i/{}/{election}",
                hex(&spiffe("workload/bob"))
            )],
        "the leadership entries after the forced end"
    );

    // The old leader's Proclaim, straight to the arbiter: NOT_LEADER.
    let mut elect = w.s.arbiter.election("workload/alice").await?;
    let r = elect
        .proclaim(ProclaimRequest {
            election: election.into(),
            session_id: la.session_id(),
            token: la.token().get(),
            value: "still me".into(),
        })
        .await;
    expect_refusal(r, Code::FailedPrecondition, "NOT_LEADER")?;

    // The force record says it was an election and its term; no token.
    let mut etcd = w.s.etcd.client().await?;
    let got = etcd
        .get(crate::support::layout().force_record(&req.request_id), None)
        .await?;
    let kv = got.kvs().first().context("no force record")?;
    let record: serde_json::Value = serde_json::from_slice(kv.value())?;
    ensure!(record["key"] == election, "{record}");
    ensure!(record["election"] == true, "{record}");
    ensure!(record["term"] == t, "{record}");
    ensure!(record["holdRevision"] == 0, "{record}");
    ensure!(record["holderSession"] == la.session_id(), "{record}");
    ensure!(kv.mod_revision() == done.revision, "one transaction");
    let text = String::from_utf8_lossy(kv.value()).into_owned();
    no_token_in(&text, &[la.token().get()])?;
    ensure!(!text.contains(&a) && !text.contains(&b), "an ID token");
    let pending = etcd
        .get(
            crate::support::layout().force_request(&req.request_id),
            Some(latchkey_etcd::kv::GetOptions::new().with_prefix()),
        )
        .await?;
    ensure!(
        pending.kvs().is_empty(),
        "the request is gone with the term"
    );
    expect_refusal(
        w.approve(&req.request_id, &b).await,
        Code::NotFound,
        "FORCE_REQUEST_NOT_FOUND",
    )?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_term_that_changed_is_not_released_and_keys_and_elections_never_cross()
-> anyhow::Result<()> {
    let w = world().await?;
    let name = "demo/elect/fr-same";
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let (a, b) = (w.token("alice-op").await?, w.token("bob-op").await?);

    // Nothing led, nothing held: each kind says so, and writes nothing.
    let before = w.revision().await?;
    expect_refusal(
        w.request(name, true, &a).await,
        Code::FailedPrecondition,
        "NO_LEADER",
    )?;
    expect_refusal(
        w.request(name, false, &a).await,
        Code::FailedPrecondition,
        "NOT_HELD",
    )?;
    // A hold alone is no leadership, a leadership alone no hold.
    let hold = alice.lock(name, LOCK_CLASS).acquire(|_| {}).await?;
    let before_req = w.revision().await?;
    expect_refusal(
        w.request(name, true, &a).await,
        Code::FailedPrecondition,
        "NO_LEADER",
    )?;
    ensure!(w.revision().await? == before_req, "a refusal wrote");
    hold.release().await?;
    let la = alice
        .campaign(name, CLASS, "a", waiting(Duration::from_secs(5)))
        .await?;
    let before_req = w.revision().await?;
    expect_refusal(
        w.request(name, false, &a).await,
        Code::FailedPrecondition,
        "NOT_HELD",
    )?;
    ensure!(w.revision().await? == before_req, "a refusal wrote");
    ensure!(before < before_req);

    // Both at once under one name: a request of each kind, each its own.
    let hold = alice.lock(name, LOCK_CLASS).acquire(|_| {}).await?;
    let for_term = w.request(name, true, &a).await?;
    let for_hold = w.request(name, false, &a).await?;
    ensure!(for_term.election && for_term.term == la.term() && for_term.hold_revision == 0);
    ensure!(!for_hold.election && for_hold.hold_revision == hold.revision());

    // The term changes: alice resigns and leads again on the same session.
    let (t1, s1, token1) = (la.term(), la.session_id(), la.token().get());
    la.resign().await?;
    let la2 = alice
        .campaign(name, CLASS, "a2", waiting(Duration::from_secs(5)))
        .await?;
    ensure!(la2.session_id() == s1 && la2.term() > t1);
    let before = w.revision().await?;
    let s = expect_refusal(
        w.approve(&for_term.request_id, &b).await,
        Code::FailedPrecondition,
        "TERM_CHANGED",
    )?;
    ensure!(
        s.message().contains("changed since the request"),
        "{}",
        s.message()
    );
    ensure!(
        s.message().contains(&format!("term {}", la2.term())),
        "{}",
        s.message()
    );
    no_token_in(s.message(), &[token1, la2.token().get()])?;
    ensure!(w.revision().await? == before, "the refusal wrote");
    ensure!(!la2.is_lost(), "the new term was ended");

    // The key's request ends the hold, never the leadership.
    w.approve(&for_hold.request_id, &b).await?;
    ensure!(!w.held(name).await?, "the hold is still there");
    let leader = alice
        .leader(name)
        .await?
        .context("the election is vacant")?;
    ensure!(leader.term == la2.term(), "{leader:?}");
    ensure!(
        !la2.is_lost(),
        "the leadership was ended by the key's request"
    );

    // And the election's ends the leadership, never the hold.
    let hold2 = alice.lock(name, LOCK_CLASS).acquire(|_| {}).await?;
    let again = w.request(name, true, &a).await?;
    ensure!(again.term == la2.term());
    w.approve(&again.request_id, &b).await?;
    ensure!(w.held(name).await?, "the election's request ended the hold");
    ensure!(!hold2.is_fenced(), "the same-named hold was fenced");
    ensure!(alice.leader(name).await?.is_none(), "still led");
    let reason = timeout(Duration::from_secs(5), la2.lost())
        .await
        .context("the forced-out leader never heard of it")?;
    ensure!(reason == LeadershipLost::Vacated(VacancyReason::Forced));
    Ok(())
}
