//! Two-person force-release (ADR-20) against a real etcd, the in-process
//! arbiter and a real OIDC provider (`oidc-provider-mock`): operator A
//! requests, operator B approves, the hold is gone, a force record lives on
//! a 24 h lease and the holder is fenced by the arbiter's push. Every
//! refusal (same approver, bad tokens, no role, no MFA, a hold that changed)
//! answers its own gRPC code and writes nothing. And with etcd's auth on,
//! the force-release user's role can do exactly its job and cannot write a
//! grant.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use latchkey_arbiter::force_release::ForceReleaseConfig;
use latchkey_arbiter::oidc::OidcConfig;
use latchkey_arbiter::{EtcdClientCert, EtcdCredentials, EtcdUser};
use latchkey_client::FenceReason;
use latchkey_etcd::kv::{GetOptions, PutOptions};
use latchkey_etcd::txn::{Compare, CompareOp, Txn, TxnOp};
use latchkey_etcd::{Connection, ErrorKind, Login, TlsPem};
use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::adminv1::{
    ApproveForceReleaseRequest, ApproveForceReleaseResponse, ForceReleaseRequest,
    ListForceReleasesRequest, RequestForceReleaseRequest,
};
use latchkey_tests::arbiter::ArbiterOptions;
use latchkey_tests::etcd::{EtcdOptions, EtcdServer, EtcdTls};
use latchkey_tests::eventually;
use latchkey_tests::oidc::OidcProvider;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::client::{Fired, connect, recorder, snapshot};
use crate::latchctl::latchctl;
use crate::support::{Stack, stack_with};

const AUDIENCE: &str = "latchctl";
const OPERATOR: &str = "latchkey/operator";
/// Fenced, TTL 15 s.
const FENCED: &str = "demo";
/// Advisory, TTL 60 s: a fence well inside the poll below can only come
/// from the arbiter's push.
const ADVISORY: &str = "batch-report";
const PUSHED: Duration = Duration::from_secs(10);

struct World {
    s: Stack,
    oidc: OidcProvider,
}

pub(crate) fn config(oidc: &OidcProvider, require_mfa: bool) -> ForceReleaseConfig {
    let mut c = OidcConfig::new(oidc.issuer().into(), AUDIENCE.into());
    c.require_mfa = require_mfa;
    // Expiry tests wait for exp itself, not exp plus skew.
    c.leeway = Duration::ZERO;
    ForceReleaseConfig {
        oidc: Some(c),
        ..ForceReleaseConfig::default()
    }
}

/// Operators alice-op and bob-op (role, MFA), carol (MFA, no role), dave-op
/// (role, password only).
pub(crate) async fn provider(token_max_age: Option<Duration>) -> anyhow::Result<OidcProvider> {
    let oidc = OidcProvider::start_with(token_max_age).await?;
    let op = serde_json::json!({"roles": ["lock-operator"], "amr": ["pwd", "otp"]});
    oidc.set_user("alice-op", op.clone()).await?;
    oidc.set_user("bob-op", op).await?;
    oidc.set_user(
        "carol",
        serde_json::json!({"roles": ["viewer"], "amr": ["pwd", "otp"]}),
    )
    .await?;
    oidc.set_user(
        "dave-op",
        serde_json::json!({"roles": ["lock-operator"], "amr": ["pwd"]}),
    )
    .await?;
    Ok(oidc)
}

async fn world(require_mfa: bool) -> anyhow::Result<World> {
    let oidc = provider(None).await?;
    let s = stack_with(ArbiterOptions {
        force_release: config(&oidc, require_mfa),
        ..ArbiterOptions::default()
    })
    .await?;
    Ok(World { s, oidc })
}

impl World {
    async fn admin(&self) -> anyhow::Result<AdminClient<Channel>> {
        self.s.arbiter.admin(OPERATOR).await
    }

    async fn token(&self, sub: &str) -> anyhow::Result<String> {
        self.oidc.id_token(sub, AUDIENCE).await
    }

    async fn request(&self, key: &str, token: &str) -> Result<ForceReleaseRequest, Status> {
        let mut admin = self
            .admin()
            .await
            .map_err(|e| Status::unknown(e.to_string()))?;
        Ok(admin
            .request_force_release(RequestForceReleaseRequest {
                key: key.into(),
                reason: "stuck since the 03:12 deploy".into(),
                revoke_session: false,
                id_token: token.into(),
                election: false,
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

    /// The etcd revision now: a refusal must not move it.
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
}

/// Waits until the holder's client has heard its hold ended (`HoldEnded`).
async fn hold_ended_reaches(fired: &Fired, what: &str) -> anyhow::Result<()> {
    eventually(what, PUSHED, || async {
        anyhow::ensure!(
            snapshot(fired)
                .iter()
                .any(|(_, r)| *r == FenceReason::HoldEnded),
            "not fenced yet"
        );
        Ok(())
    })
    .await
}

fn expect_code<T: std::fmt::Debug>(r: Result<T, Status>, code: Code) -> anyhow::Result<Status> {
    match r {
        Ok(v) => anyhow::bail!("expected {code:?}, got OK {v:?}"),
        Err(s) if s.code() == code => Ok(s),
        Err(s) => anyhow::bail!("expected {code:?}, got {:?}: {}", s.code(), s.message()),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_operators_force_release_a_hold_and_the_holder_is_fenced_at_once() -> anyhow::Result<()>
{
    let w = world(true).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let fired: Fired = Arc::default();
    let guard = alice
        .lock("demo/fr-1", FENCED)
        .acquire(recorder(&fired))
        .await?;

    let (a, b) = (w.token("alice-op").await?, w.token("bob-op").await?);
    let req = w.request("demo/fr-1", &a).await?;
    assert_eq!(
        req.holder_identity,
        latchkey_tests::arbiter::spiffe("workload/alice")
    );
    assert_eq!(req.holder_session, guard.session_id());
    assert_eq!(req.hold_revision, guard.revision());
    assert_eq!(
        (req.class.as_str(), req.enforcement.as_str()),
        (FENCED, "fenced")
    );
    assert!(req.warning.is_empty(), "no warning on a fenced class");
    assert_eq!(req.requester, "alice-op");
    assert!(
        w.held("demo/fr-1").await?,
        "a request alone releases nothing"
    );

    // the approver sees the request before approving
    let listed = w
        .admin()
        .await?
        .list_force_releases(ListForceReleasesRequest {
            id_token: b.clone(),
        })
        .await?
        .into_inner();
    assert!(
        listed
            .pending
            .iter()
            .any(|p| p.request_id == req.request_id)
    );

    let done = w.approve(&req.request_id, &b).await?;
    assert_eq!(done.approver, "bob-op");
    assert!(!w.held("demo/fr-1").await?, "the hold is gone");
    hold_ended_reaches(&fired, "alice to hear her hold was force-released").await?;
    assert!(guard.is_fenced());

    // the force record: JSON for the audit tailer, on a 24 h lease
    let mut etcd = w.s.etcd.client().await?;
    let got = etcd
        .get(crate::support::layout().force_record(&req.request_id), None)
        .await?;
    let kv = got.kvs().first().context("no force record")?;
    let record: serde_json::Value = serde_json::from_slice(kv.value())?;
    assert_eq!(record["key"], "demo/fr-1");
    assert_eq!(record["requestedBy"], "alice-op");
    assert_eq!(record["approvedBy"], "bob-op");
    assert_eq!(record["holdRevision"], guard.revision());
    assert_eq!(record["enforcement"], "fenced");
    assert_eq!(record["revokedSession"], false);
    assert_eq!(kv.mod_revision(), done.revision, "one transaction");
    let ttl = etcd
        .lease_client()
        .time_to_live(kv.lease(), None)
        .await?
        .ttl();
    assert!(
        (86_000..=86_400).contains(&ttl),
        "the record's lease TTL is {ttl} s"
    );
    let text = String::from_utf8_lossy(kv.value()).into_owned();
    assert!(
        !text.contains(&a) && !text.contains(&b),
        "no ID token in the record"
    );
    let pending = etcd
        .get(
            crate::support::layout().force_request(&req.request_id),
            None,
        )
        .await?;
    assert!(
        pending.kvs().is_empty(),
        "the request is gone with the hold"
    );

    // approving again: the request is gone
    expect_code(w.approve(&req.request_id, &b).await, Code::NotFound)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn revoke_session_ends_every_hold_of_the_holders_session() -> anyhow::Result<()> {
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let fired: Fired = Arc::default();
    let one = alice
        .lock("demo/fr-rv1", FENCED)
        .acquire(recorder(&fired))
        .await?;
    let two = alice
        .lock("demo/fr-rv2", FENCED)
        .acquire(recorder(&fired))
        .await?;
    assert_eq!(one.session_id(), two.session_id());
    let mut admin = w.admin().await?;
    let req = admin
        .request_force_release(RequestForceReleaseRequest {
            key: "demo/fr-rv1".into(),
            reason: "the whole worker is wedged".into(),
            revoke_session: true,
            id_token: w.token("alice-op").await?,
            election: false,
            slot: None,
            shared_session: None,
        })
        .await?
        .into_inner();
    assert!(req.revoke_session);
    let done = w
        .approve(&req.request_id, &w.token("bob-op").await?)
        .await?;
    assert!(done.session_revoked, "{}", done.session_revoke_error);
    assert!(!w.held("demo/fr-rv1").await? && !w.held("demo/fr-rv2").await?);
    eventually("both holds to be fenced", PUSHED, || async {
        anyhow::ensure!(snapshot(&fired).len() == 2, "fired: {:?}", snapshot(&fired));
        Ok(())
    })
    .await?;
    assert!(one.is_fenced() && two.is_fenced());
    let record =
        w.s.etcd
            .client()
            .await?
            .get(crate::support::layout().force_record(&req.request_id), None)
            .await?;
    let kv = record.kvs().first().context("no force record")?;
    let record: serde_json::Value = serde_json::from_slice(kv.value())?;
    assert_eq!(record["revokedSession"], true);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_requester_cannot_approve_and_bad_tokens_write_nothing() -> anyhow::Result<()> {
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let _guard = alice.lock("demo/fr-2", FENCED).acquire(|_| {}).await?;
    let a = w.token("alice-op").await?;
    let req = w.request("demo/fr-2", &a).await?;

    let before = w.revision().await?;
    let s = expect_code(w.approve(&req.request_id, &a).await, Code::PermissionDenied)?;
    assert!(
        s.message().contains("different operator"),
        "{}",
        s.message()
    );

    let wrong_audience = w.oidc.id_token("bob-op", "some-other-app").await?;
    let no_role = w.token("carol").await?;
    let refusals = [
        ("garbage".to_string(), Code::Unauthenticated, "well-formed"),
        (String::new(), Code::Unauthenticated, "no ID token"),
        (wrong_audience, Code::Unauthenticated, "another client"),
        (no_role, Code::PermissionDenied, "lock-operator"),
    ];
    for (token, code, says) in &refusals {
        for result in [
            w.approve(&req.request_id, token).await.map(|_| ()),
            w.request("demo/fr-2", token).await.map(|_| ()),
        ] {
            let s = expect_code(result, *code)?;
            assert!(s.message().contains(says), "{}", s.message());
            if !token.is_empty() {
                assert!(!s.message().contains(token.as_str()), "a token in an error");
            }
        }
    }
    // unknown request ids
    let b = w.token("bob-op").await?;
    expect_code(
        w.approve("0123456789abcdef0123456789abcdef", &b).await,
        Code::NotFound,
    )?;
    expect_code(w.approve("../l/demo/fr-2", &b).await, Code::NotFound)?;
    assert_eq!(w.revision().await?, before, "no refusal wrote anything");
    assert!(w.held("demo/fr-2").await?);

    // a workload's SVID never gets this far, whatever its token
    let mut workload = w.s.arbiter.admin("workload/bob").await?;
    let r = workload
        .approve_force_release(ApproveForceReleaseRequest {
            request_id: req.request_id.clone(),
            id_token: b.clone(),
        })
        .await;
    expect_code(r, Code::PermissionDenied)?;
    w.approve(&req.request_id, &b).await?;
    assert!(!w.held("demo/fr-2").await?);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_token_is_refused() -> anyhow::Result<()> {
    let oidc = provider(Some(Duration::from_secs(1))).await?;
    let s = stack_with(ArbiterOptions {
        force_release: config(&oidc, false),
        ..ArbiterOptions::default()
    })
    .await?;
    let w = World { s, oidc };
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let _guard = alice.lock("demo/fr-3", FENCED).acquire(|_| {}).await?;
    let a = w.token("alice-op").await?;
    // Wait with a call that writes nothing (the listing) for the token to
    // expire (1 s, no skew allowed)...
    eventually("the token to expire", Duration::from_secs(20), || async {
        let r = w
            .admin()
            .await?
            .list_force_releases(ListForceReleasesRequest {
                id_token: a.clone(),
            })
            .await;
        anyhow::ensure!(
            matches!(&r, Err(s) if s.code() == Code::Unauthenticated),
            "still accepted: {r:?}"
        );
        Ok(())
    })
    .await?;
    // ...then a request with it is refused and writes nothing.
    let before = w.revision().await?;
    let s = expect_code(w.request("demo/fr-3", &a).await, Code::Unauthenticated)?;
    assert!(s.message().contains("expired"), "{}", s.message());
    assert_eq!(w.revision().await?, before);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn mfa_is_required_when_configured() -> anyhow::Result<()> {
    let w = world(true).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let _guard = alice.lock("demo/fr-4", FENCED).acquire(|_| {}).await?;
    let before = w.revision().await?;
    let password_only = w.token("dave-op").await?;
    let s = expect_code(
        w.request("demo/fr-4", &password_only).await,
        Code::PermissionDenied,
    )?;
    assert!(s.message().contains("multi-factor"), "{}", s.message());
    assert_eq!(w.revision().await?, before);
    // without the MFA requirement the same token is fine
    let relaxed = world(false).await?;
    let bob = connect(relaxed.s.arbiter.addr(), "workload/bob").await?;
    let _g = bob.lock("demo/fr-4", FENCED).acquire(|_| {}).await?;
    relaxed
        .request("demo/fr-4", &relaxed.token("dave-op").await?)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_advisory_class_warns_of_two_writers() -> anyhow::Result<()> {
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let _guard = alice.lock("demo/fr-5", ADVISORY).acquire(|_| {}).await?;
    let req = w.request("demo/fr-5", &w.token("alice-op").await?).await?;
    assert_eq!(req.enforcement, "advisory");
    assert!(
        req.warning.contains("Two writers may follow"),
        "{}",
        req.warning
    );
    Ok(())
}

/// Force-release works per slot of a semaphore (issue 34): the request names
/// the slot, shows the semaphore and its holder, and ends that slot's hold
/// alone; its holder hears of it (an ended hold under the semaphore's name).
#[tokio::test(flavor = "multi_thread")]
async fn a_force_release_ends_one_slot_of_a_semaphore() -> anyhow::Result<()> {
    const NAME: &str = "demo/fr-sem";
    let w = world(false).await?;
    let first = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let second = connect(w.s.arbiter.addr(), "workload/bob").await?;
    let fired: Fired = Arc::default();
    let g1 = first.lock(NAME, "builds").acquire(recorder(&fired)).await?;
    let g2 = second.lock(NAME, "builds").acquire(|_| {}).await?;
    let slot = g1.slot().context("a semaphore's grant names its slot")?;
    let other = g2.slot().context("a semaphore's grant names its slot")?;
    assert_ne!(slot, other);
    let (a, b) = (w.token("alice-op").await?, w.token("bob-op").await?);
    let mut admin = w.admin().await?;
    let ask = |slot: Option<u32>, election: bool| RequestForceReleaseRequest {
        key: NAME.into(),
        reason: "a stuck build".into(),
        revoke_session: false,
        id_token: a.clone(),
        election,
        slot,
        shared_session: None,
    };
    // No semaphore has slot 4096, and an election has none: refused,
    // nothing written. The name alone is a lock's, which nobody holds.
    let before = w.revision().await?;
    expect_code(
        admin.request_force_release(ask(Some(4096), false)).await,
        Code::InvalidArgument,
    )?;
    expect_code(
        admin.request_force_release(ask(Some(slot), true)).await,
        Code::InvalidArgument,
    )?;
    assert!(admin.request_force_release(ask(None, false)).await.is_err());
    assert_eq!(w.revision().await?, before, "a refused request wrote");

    let req = admin
        .request_force_release(ask(Some(slot), false))
        .await?
        .into_inner();
    assert_eq!((req.key.as_str(), req.slot), (NAME, Some(slot)));
    assert_eq!(req.holder_session, g1.session_id());
    assert_eq!(req.hold_revision, g1.revision());
    w.approve(&req.request_id, &b).await?;
    assert!(
        !w.held(&format!("{NAME}//s/{slot:04x}")).await?,
        "the slot is free"
    );
    assert!(
        w.held(&format!("{NAME}//s/{other:04x}")).await?,
        "the other slot is still held"
    );
    hold_ended_reaches(&fired, "alice to hear her slot was force-released").await?;
    assert!(g1.is_fenced() && !g2.is_fenced());
    Ok(())
}

/// A lock held shared by two sessions: a force-release names one shared
/// hold by its holder's session, ends that one alone, and its holder is
/// fenced; a request naming the key alone finds no exclusive hold and says
/// how a shared one is named.
#[tokio::test(flavor = "multi_thread")]
async fn a_force_release_ends_one_shared_hold() -> anyhow::Result<()> {
    const NAME: &str = "demo/fr-shared";
    let w = world(false).await?;
    let first = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let second = connect(w.s.arbiter.addr(), "workload/bob").await?;
    let fired: Fired = Arc::default();
    let g1 = first
        .lock(NAME, FENCED)
        .shared()
        .acquire(recorder(&fired))
        .await?;
    let g2 = second.lock(NAME, FENCED).shared().acquire(|_| {}).await?;
    let (a, b) = (w.token("alice-op").await?, w.token("bob-op").await?);
    let mut admin = w.admin().await?;
    let ask = |shared_session: Option<i64>, slot: Option<u32>| RequestForceReleaseRequest {
        key: NAME.into(),
        reason: "a stuck reader".into(),
        revoke_session: false,
        id_token: a.clone(),
        election: false,
        slot,
        shared_session,
    };
    let before = w.revision().await?;
    let s = expect_code(
        admin.request_force_release(ask(None, None)).await,
        Code::FailedPrecondition,
    )?;
    assert!(
        s.message().contains("shared hold is named by"),
        "{}",
        s.message()
    );
    expect_code(
        admin
            .request_force_release(ask(Some(g1.session_id()), Some(0)))
            .await,
        Code::InvalidArgument,
    )?;
    assert_eq!(w.revision().await?, before, "a refused request wrote");

    let req = admin
        .request_force_release(ask(Some(g1.session_id()), None))
        .await?
        .into_inner();
    assert_eq!((req.key.as_str(), req.shared), (NAME, true));
    assert_eq!(req.holder_session, g1.session_id());
    assert_eq!(req.hold_revision, g1.revision());
    w.approve(&req.request_id, &b).await?;
    let readers = |session: i64| format!("{NAME}//r/{:016x}", session as u64);
    assert!(
        !w.held(&readers(g1.session_id())).await?,
        "alice's shared hold ended"
    );
    assert!(
        w.held(&readers(g2.session_id())).await?,
        "bob's is still held"
    );
    hold_ended_reaches(&fired, "alice to hear her shared hold was force-released").await?;
    assert!(g1.is_fenced() && !g2.is_fenced());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hold_that_changed_since_the_request_is_not_released() -> anyhow::Result<()> {
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let first = alice.lock("demo/fr-6", FENCED).acquire(|_| {}).await?;
    let req = w.request("demo/fr-6", &w.token("alice-op").await?).await?;
    first.release().await?;
    let second = alice.lock("demo/fr-6", FENCED).acquire(|_| {}).await?;
    assert!(second.revision() > req.hold_revision);
    let before = w.revision().await?;
    let s = expect_code(
        w.approve(&req.request_id, &w.token("bob-op").await?).await,
        Code::FailedPrecondition,
    )?;
    assert!(
        s.message().contains("changed since the request"),
        "{}",
        s.message()
    );
    // The new hold's revision is its holder's token (with the epoch): never
    // in an error.
    // Whole words only: the session id's hex (0x…) is one word.
    let numbers: Vec<&str> = s
        .message()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|n| !n.is_empty())
        .collect();
    let (revision, token) = (
        second.revision().to_string(),
        second.token().get().to_string(),
    );
    assert!(
        !numbers.contains(&revision.as_str()) && !numbers.contains(&token.as_str()),
        "{}",
        s.message()
    );
    assert_eq!(w.revision().await?, before, "nothing written");
    assert!(w.held("demo/fr-6").await? && !second.is_fenced());
    // a key nobody holds cannot be requested
    second.release().await?;
    expect_code(
        w.request("demo/fr-6", &w.token("alice-op").await?).await,
        Code::FailedPrecondition,
    )?;
    Ok(())
}

/// Pending requests are bounded: one per hold (a second operator approves
/// the first instead of filing another), and a few per operator, each an
/// etcd key on its own lease until approved or expired.
#[tokio::test(flavor = "multi_thread")]
async fn pending_requests_are_bounded_per_hold_and_per_operator() -> anyhow::Result<()> {
    use latchkey_arbiter::force_release::MAX_PENDING_PER_OPERATOR;
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let token = w.token("alice-op").await?;
    let mut holds = Vec::new();
    for i in 0..=MAX_PENDING_PER_OPERATOR {
        holds.push(
            alice
                .lock(format!("demo/fr-bound-{i}"), FENCED)
                .acquire(|_| {})
                .await?,
        );
    }
    let first = w.request("demo/fr-bound-0", &token).await?;
    let before = w.revision().await?;
    let again = expect_code(
        w.request("demo/fr-bound-0", &w.token("bob-op").await?)
            .await,
        Code::AlreadyExists,
    )?;
    assert!(
        again.message().contains(&first.request_id) && again.message().contains("approve"),
        "{}",
        again.message()
    );
    assert_eq!(w.revision().await?, before, "nothing written");
    for i in 1..MAX_PENDING_PER_OPERATOR {
        w.request(&format!("demo/fr-bound-{i}"), &token).await?;
    }
    let before = w.revision().await?;
    let over = expect_code(
        w.request(&format!("demo/fr-bound-{MAX_PENDING_PER_OPERATOR}"), &token)
            .await,
        Code::ResourceExhausted,
    )?;
    assert!(over.message().contains("pending"), "{}", over.message());
    assert_eq!(w.revision().await?, before, "nothing written");
    // another operator still can
    w.request(
        &format!("demo/fr-bound-{MAX_PENDING_PER_OPERATOR}"),
        &w.token("bob-op").await?,
    )
    .await?;
    drop(holds);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn without_an_oidc_issuer_force_release_is_refused() -> anyhow::Result<()> {
    let s = stack_with(ArbiterOptions::default()).await?;
    let mut admin = s.arbiter.admin(OPERATOR).await?;
    let r = admin
        .request_force_release(RequestForceReleaseRequest {
            key: "demo/fr-7".into(),
            reason: "x".into(),
            revoke_session: false,
            id_token: "anything".into(),
            election: false,
            slot: None,
            shared_session: None,
        })
        .await;
    let s = expect_code(r, Code::FailedPrecondition)?;
    assert!(s.message().contains("--oidc-issuer"), "{}", s.message());
    Ok(())
}

async fn run_latchctl(cmd: &mut tokio::process::Command) -> anyhow::Result<std::process::Output> {
    tokio::time::timeout(Duration::from_secs(30), cmd.output())
        .await
        .context("latchctl did not finish in 30 s")?
        .context("latchctl did not run")
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_requests_and_approves_with_tokens_from_the_environment_and_a_file()
-> anyhow::Result<()> {
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let _fenced = alice.lock("demo/fr-cli", FENCED).acquire(|_| {}).await?;
    let _advisory = alice
        .lock("demo/fr-cli-adv", ADVISORY)
        .acquire(|_| {})
        .await?;
    let (a, b) = (w.token("alice-op").await?, w.token("bob-op").await?);
    let dir = tempfile::tempdir()?;
    let b_file = dir.path().join("id-token");
    std::fs::write(&b_file, format!("{b}\n"))?;
    let addr = w.s.arbiter.addr();

    let mut ids = Vec::new();
    for key in ["demo/fr-cli", "demo/fr-cli-adv"] {
        let out = run_latchctl(
            latchctl(addr, OPERATOR)?
                .env("LATCHKEY_ID_TOKEN", &a)
                .args(["--json", "admin", "force-release", "request", key])
                .args(["--reason", "wedged in the e2e"]),
        )
        .await?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        anyhow::ensure!(out.status.success(), "request failed: {out:?}");
        let line: serde_json::Value = serde_json::from_str(stdout.trim())?;
        ids.push(
            line["request_id"]
                .as_str()
                .context("no request id")?
                .to_string(),
        );
    }
    let approve = |id: &str| -> anyhow::Result<tokio::process::Command> {
        let mut cmd = latchctl(addr, OPERATOR)?;
        cmd.args(["admin", "force-release", "approve", id, "--id-token-file"])
            .arg(&b_file);
        Ok(cmd)
    };
    let out = run_latchctl(&mut approve(&ids[0])?).await?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    anyhow::ensure!(out.status.success(), "approve failed: {out:?}");
    assert!(
        stdout.contains("FENCED") && stdout.contains("force-released"),
        "{stdout}"
    );
    assert!(!w.held("demo/fr-cli").await?);

    // advisory: shown, and not approved without --accept-two-writers
    let out = run_latchctl(&mut approve(&ids[1])?).await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "approved an advisory release unasked"
    );
    assert!(stderr.contains("Two writers may follow"), "{stderr}");
    assert!(w.held("demo/fr-cli-adv").await?);
    let out = run_latchctl(approve(&ids[1])?.arg("--accept-two-writers")).await?;
    anyhow::ensure!(out.status.success(), "approve failed: {out:?}");
    assert!(!w.held("demo/fr-cli-adv").await?);

    // no token: a usage error that says where the token comes from
    let out =
        run_latchctl(latchctl(addr, OPERATOR)?.args(["admin", "force-release", "list"])).await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("LATCHKEY_ID_TOKEN"), "{stderr}");
    for output in [&stdout, &stderr] {
        assert!(
            !output.contains(&a) && !output.contains(&b),
            "a token was printed"
        );
    }
    Ok(())
}

const FORCE_USER: &str = "latchkey-force";
const FORCE_PASSWORD: &str = "force-password-never-logged";
const ARBITER_USER: &str = "latchkey-arbiter";
const ARBITER_PASSWORD: &str = "arbiter-password-never-logged";

/// The force-release role, exactly as docs/security.md lists it.
async fn add_force_user(etcd: &EtcdServer) -> anyhow::Result<()> {
    use latchkey_etcd::auth::{Permission, PermissionType};
    let mut c = etcd.client().await?;
    c.role_add("latchkey-force").await?;
    for (kind, prefix) in [
        (PermissionType::Readwrite, "/latchkey/l/"),
        (PermissionType::Write, "/latchkey/c/"),
        (PermissionType::Readwrite, "/latchkey/sys/force/"),
        (PermissionType::Readwrite, "/latchkey/sys/force-req/"),
        (PermissionType::Readwrite, "/latchkey/e/"),
    ] {
        c.role_grant_permission(
            "latchkey-force",
            Permission::new(kind, prefix).with_prefix(),
        )
        .await?;
    }
    c.user_add(FORCE_USER, FORCE_PASSWORD, None).await?;
    c.user_grant_role(FORCE_USER, "latchkey-force").await?;
    Ok(())
}

/// A client logged in as the force-release user, over etcd's mutual TLS.
async fn force_client(etcd: &EtcdServer) -> anyhow::Result<latchkey_etcd::Client> {
    let tls = etcd.tls().context("etcd without TLS")?;
    let cert = tls.arbiter_cert()?;
    let connection = Connection {
        tls: Some(TlsPem {
            ca: std::fs::read(&tls.ca)?,
            identity: Some((std::fs::read(&cert.cert)?, std::fs::read(&cert.key)?)),
        }),
        login: Some(Login::new(FORCE_USER, FORCE_PASSWORD)),
        ..Connection::new([etcd.endpoint()])
    };
    Ok(latchkey_etcd::connect(&connection).await?)
}

fn permission_denied<T, E: Into<latchkey_etcd::Error>>(r: Result<T, E>) -> bool {
    r.is_err_and(|e| e.into().kind() == ErrorKind::PermissionDenied)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_force_release_role_deletes_holds_and_cannot_write_a_grant() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let mut etcd = EtcdServer::start_with(EtcdOptions {
        tls: Some(EtcdTls::mutual()?),
    })
    .await?;
    etcd.enable_auth("root-password").await?;
    etcd.add_user(ARBITER_USER, ARBITER_PASSWORD, "/latchkey")
        .await?;
    add_force_user(&etcd).await?;
    let dir = tempfile::tempdir()?;
    let (arbiter_pw, force_pw) = (dir.path().join("arbiter-pw"), dir.path().join("force-pw"));
    std::fs::write(&arbiter_pw, format!("{ARBITER_PASSWORD}\n"))?;
    std::fs::write(&force_pw, format!("{FORCE_PASSWORD}\n"))?;
    let tls = etcd.tls().context("etcd without TLS")?;
    let cert = tls.arbiter_cert()?;
    let oidc = provider(None).await?;
    let mut force = config(&oidc, false);
    force.etcd_user = Some(EtcdUser {
        name: FORCE_USER.into(),
        password_file: force_pw,
    });
    let arbiter = latchkey_tests::arbiter::Arbiter::start(
        &etcd,
        ArbiterOptions {
            etcd_credentials: EtcdCredentials {
                ca: Some(tls.ca.clone()),
                client_cert: Some(EtcdClientCert {
                    cert: cert.cert.clone(),
                    key: cert.key.clone(),
                }),
                user: Some(EtcdUser {
                    name: ARBITER_USER.into(),
                    password_file: arbiter_pw,
                }),
            },
            force_release: force,
            ..ArbiterOptions::default()
        },
    )
    .await?;
    let w = World {
        s: Stack { etcd, arbiter },
        oidc,
    };

    // the whole path runs as the force-release user
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let fired: Fired = Arc::default();
    let guard = alice
        .lock("demo/fr-auth", FENCED)
        .acquire(recorder(&fired))
        .await?;
    let req = w
        .request("demo/fr-auth", &w.token("alice-op").await?)
        .await?;
    w.approve(&req.request_id, &w.token("bob-op").await?)
        .await?;
    assert!(!w.held("demo/fr-auth").await?);
    eventually("the holder to be fenced", PUSHED, || async {
        anyhow::ensure!(!snapshot(&fired).is_empty(), "not yet");
        Ok(())
    })
    .await?;
    assert!(guard.is_fenced());

    // the role itself, against etcd: it may delete a hold and put a force record...
    let held = alice.lock("demo/fr-role", FENCED).acquire(|_| {}).await?;
    let session = held.session_id();
    let mut f = force_client(&w.s.etcd).await?;
    f.put(crate::support::layout().force_record("probe"), "{}", None)
        .await?;
    f.delete("/latchkey/l/demo/fr-role", None).await?;
    assert!(!w.held("demo/fr-role").await?);
    // ...and cannot write a grant: a holder record on a session's lease
    // (etcd refuses a put on a lease that carries keys the user may not
    // write: the session record), alone or as the arbiter's grant
    // transaction (which also reads the epoch and session records).
    let on_lease = Some(PutOptions::new().with_lease(session));
    assert!(permission_denied(
        f.put("/latchkey/l/demo/forged", "{}", on_lease.clone())
            .await
    ));
    let grant = Txn::new()
        .when(vec![
            Compare::version("/latchkey/l/demo/forged", CompareOp::Equal, 0),
            Compare::version(
                crate::support::layout().session(session),
                CompareOp::Greater,
                0,
            ),
            Compare::version(crate::support::layout().epoch(), CompareOp::Greater, 0),
        ])
        .and_then(vec![TxnOp::put("/latchkey/l/demo/forged", "{}", on_lease)]);
    assert!(permission_denied(f.txn(grant).await));
    // nor touch sessions, the epoch or the seal
    assert!(permission_denied(
        f.put(crate::support::layout().session(session), "x", None)
            .await
    ));
    assert!(permission_denied(
        f.put(crate::support::layout().epoch(), "x", None).await
    ));
    assert!(permission_denied(
        f.put(crate::support::layout().seal(), "x", None).await
    ));
    assert!(permission_denied(f.lease_client().revoke(session).await));
    assert!(!w.held("demo/forged").await?);
    // The limit, stated so it stays true: etcd has no delete-only
    // permission, so the write a delete needs also lets this user put a
    // record with no lease under l/. Nobody gets a token from it (tokens
    // come from the arbiter's grant answers), and it blocks the key until
    // force-released again (docs/security.md).
    f.put("/latchkey/l/demo/leaseless", "{}", None).await?;
    f.delete("/latchkey/l/demo/leaseless", None).await?;
    Ok(())
}

/// The arbiter as a process, started with the force-release flags as
/// deployed (etcd over mutual TLS with auth on, the restricted force-release
/// user, MFA required, `--oidc-leeway-seconds 0`), and a force-release end
/// to end with latchctl: a `latchctl hold` has its command stopped, the
/// holder's session is revoked, and no token reaches the arbiter's debug log.
/// The leeway flag is in force: with 0, a token just past its `exp` is
/// refused (the 30 s default would still take it).
#[tokio::test(flavor = "multi_thread")]
async fn the_arbiter_process_runs_a_force_release_from_latchctl() -> anyhow::Result<()> {
    use crate::latchctl::latchctl_hold;
    use latchkey_tests::arbiter::ArbiterProcess;

    latchkey_tests::init_tracing();
    let mut etcd = EtcdServer::start_with(EtcdOptions {
        tls: Some(EtcdTls::mutual()?),
    })
    .await?;
    etcd.enable_auth("root-password").await?;
    etcd.add_user(ARBITER_USER, ARBITER_PASSWORD, "/latchkey")
        .await?;
    add_force_user(&etcd).await?;
    let dir = tempfile::tempdir()?;
    let (arbiter_pw, force_pw) = (dir.path().join("arbiter-pw"), dir.path().join("force-pw"));
    std::fs::write(&arbiter_pw, format!("{ARBITER_PASSWORD}\n"))?;
    std::fs::write(&force_pw, format!("{FORCE_PASSWORD}\n"))?;
    let tls = etcd.tls().context("etcd without TLS")?;
    let cert = tls.arbiter_cert()?;
    // Tokens that expire 5 s after they are issued.
    let oidc = provider(Some(Duration::from_secs(5))).await?;
    let mut force = config(&oidc, true);
    force.etcd_user = Some(EtcdUser {
        name: FORCE_USER.into(),
        password_file: force_pw,
    });
    let binary = std::path::PathBuf::from(env!("CARGO_BIN_EXE_arbiter-under-test"));
    let arbiter = ArbiterProcess::start_with(
        &binary,
        &[etcd.endpoint()],
        None,
        ArbiterOptions {
            etcd_credentials: EtcdCredentials {
                ca: Some(tls.ca.clone()),
                client_cert: Some(EtcdClientCert {
                    cert: cert.cert.clone(),
                    key: cert.key.clone(),
                }),
                user: Some(EtcdUser {
                    name: ARBITER_USER.into(),
                    password_file: arbiter_pw,
                }),
            },
            force_release: force,
            ..ArbiterOptions::default()
        },
        "debug",
        &["--oidc-leeway-seconds".into(), "0".into()],
    )
    .await?;
    let addr = arbiter.addr();
    let mut held = latchctl_hold(addr, "workload/alice", "demo/fr-proc", FENCED, 600).await?;
    let mut tokens = Vec::new();

    // operator A requests, the token from the environment
    let a = oidc.id_token("alice-op", AUDIENCE).await?;
    tokens.push(a.clone());
    let out = run_latchctl(
        latchctl(addr, OPERATOR)?
            .env("LATCHKEY_ID_TOKEN", &a)
            .args([
                "--json",
                "admin",
                "force-release",
                "request",
                "demo/fr-proc",
            ])
            .args(["--reason", "wedged in the process e2e", "--revoke-session"]),
    )
    .await?;
    anyhow::ensure!(out.status.success(), "request failed: {out:?}");
    let line: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let id = line["request_id"]
        .as_str()
        .context("no request id")?
        .to_string();
    assert_eq!(line["enforcement"], "fenced", "{line}");
    assert_eq!(
        line["holder_identity"],
        spiffe_of("workload/alice"),
        "{line}"
    );

    // operator B lists and approves, the token from a file
    let b_file = dir.path().join("id-token");
    let b = oidc.id_token("bob-op", AUDIENCE).await?;
    std::fs::write(&b_file, format!("{b}\n"))?;
    tokens.push(b);
    let out = run_latchctl(
        latchctl(addr, OPERATOR)?
            .args(["admin", "force-release", "list", "--id-token-file"])
            .arg(&b_file),
    )
    .await?;
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    anyhow::ensure!(out.status.success(), "list failed: {out:?}");
    assert!(
        listed.contains(&id) && listed.contains("demo (FENCED)"),
        "{listed}"
    );
    assert!(
        listed.contains("revokes the holder's whole session"),
        "{listed}"
    );
    let b = oidc.id_token("bob-op", AUDIENCE).await?;
    std::fs::write(&b_file, format!("{b}\n"))?;
    tokens.push(b);
    let out = run_latchctl(
        latchctl(addr, OPERATOR)?
            .args(["admin", "force-release", "approve", &id, "--id-token-file"])
            .arg(&b_file),
    )
    .await?;
    let approved = String::from_utf8_lossy(&out.stdout).into_owned();
    anyhow::ensure!(out.status.success(), "approve failed: {out:?}");
    assert!(
        approved.contains("force-released at revision"),
        "{approved}"
    );
    assert!(
        approved.contains("the holder's session was revoked"),
        "{approved}"
    );

    // the holder's latchctl stops its command and fails
    let status = tokio::time::timeout(PUSHED, held.child.wait())
        .await
        .context("latchctl hold still runs after the force-release")??;
    assert!(!status.success(), "{status:?}");
    let stderr = std::fs::read_to_string(&held.stderr_path)?;
    assert!(stderr.contains("lost"), "{stderr}");
    let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(held.pid), None).is_ok();
    assert!(!alive, "the held command still runs");
    let etcd_now = etcd.client().await?;
    let mut kv = etcd_now.kv_client();
    assert_eq!(kv.get("/latchkey/l/demo/fr-proc", None).await?.count(), 0);
    let marker = kv
        .get(
            "/latchkey/sys/revoked/",
            Some(GetOptions::new().with_prefix()),
        )
        .await?;
    assert_eq!(marker.count(), 1, "one revoked-session marker");

    // --oidc-leeway-seconds 0: a token past its exp is refused at once
    let late = oidc.id_token("alice-op", AUDIENCE).await?;
    tokens.push(late.clone());
    tokio::time::sleep(Duration::from_millis(6500)).await;
    let out = run_latchctl(
        latchctl(addr, OPERATOR)?
            .env("LATCHKEY_ID_TOKEN", &late)
            .args(["admin", "force-release", "list"]),
    )
    .await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "an expired token was taken");
    assert!(stderr.contains("expired"), "{stderr}");

    let log = arbiter.log()?;
    for t in &tokens {
        assert!(
            !log.contains(t.as_str()),
            "an ID token in the arbiter's log"
        );
    }
    for output in [&listed, &approved, &stderr] {
        assert!(
            tokens.iter().all(|t| !output.contains(t.as_str())),
            "a token was printed"
        );
    }
    Ok(())
}

fn spiffe_of(name: &str) -> String {
    latchkey_tests::arbiter::spiffe(name)
}

/// A bad `--oidc-leeway-seconds` stops the arbiter before it serves,
/// naming the flag.
#[tokio::test(flavor = "multi_thread")]
async fn a_bad_oidc_leeway_fails_the_start_with_a_clear_error() -> anyhow::Result<()> {
    let binary = env!("CARGO_BIN_EXE_arbiter-under-test");
    for (value, want) in [
        ("301", "--oidc-leeway-seconds 301 is too large: at most 300"),
        ("soon", "--oidc-leeway-seconds"),
        ("-5", "--oidc-leeway-seconds"),
    ] {
        let mut cmd = tokio::process::Command::new(binary);
        cmd.args(["--insecure-dev", "--listen", "127.0.0.1:0"])
            .args(["--etcd", "http://127.0.0.1:9"])
            .args([
                "--oidc-issuer",
                "http://127.0.0.1:9",
                "--oidc-audience",
                AUDIENCE,
            ])
            .arg(format!("--oidc-leeway-seconds={value}"))
            .env("NO_COLOR", "1")
            .kill_on_drop(true);
        let out = run_latchctl(&mut cmd).await?;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "started with {value:?}: {stderr}");
        assert!(stderr.contains(want), "{value:?}: {stderr}");
    }
    Ok(())
}

/// Issue 31, finding 1: a reason is shown to the second operator before they
/// approve, and kept in the log and the audit store. One that carries
/// control, line-break, bidirectional or zero-width characters could redraw
/// the key and holder lines the approver reads or forge log lines: it is
/// refused with INVALID_ARGUMENT and nothing is written. The same for an
/// epoch advance's reason.
#[tokio::test(flavor = "multi_thread")]
async fn a_reason_that_could_redraw_the_approvers_terminal_is_refused() -> anyhow::Result<()> {
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let _held = alice.lock("demo/fr-ansi", FENCED).acquire(|_| {}).await?;
    let token = w.token("alice-op").await?;
    let mut admin = w.admin().await?;
    for reason in [
        "stuck\u{1b}[1A\u{1b}[2K\rkey          demo/harmless\n\u{1b}[8m",
        "stuck\nrequest      0000",
        "stuck\rkey          demo/harmless",
        "a \u{202E}desrever\u{202C} reason",
        "zero\u{200B}width",
        "c1 \u{9b}2J",
    ] {
        let before = w.revision().await?;
        let refused = expect_code(
            admin
                .request_force_release(RequestForceReleaseRequest {
                    key: "demo/fr-ansi".into(),
                    reason: reason.into(),
                    revoke_session: false,
                    id_token: token.clone(),
                    election: false,
                    slot: None,
                    shared_session: None,
                })
                .await
                .map(|r| r.into_inner()),
            Code::InvalidArgument,
        )?;
        assert!(
            refused.message().contains("printable") && refused.message().contains("U+"),
            "{}",
            refused.message()
        );
        assert!(
            !refused.message().contains('\u{1b}'),
            "the refusal echoes the escape: {:?}",
            refused.message()
        );
        assert_eq!(
            w.revision().await?,
            before,
            "nothing written for {reason:?}"
        );
    }
    let listed = admin
        .list_force_releases(ListForceReleasesRequest {
            id_token: token.clone(),
        })
        .await?
        .into_inner();
    assert!(listed.pending.is_empty(), "{listed:?}");
    // An ordinary reason, non-ASCII included, still works.
    let ok = w.request("demo/fr-ansi", &token).await?;
    assert_eq!(ok.reason, "stuck since the 03:12 deploy");

    let before = w.revision().await?;
    let advance = admin
        .advance_epoch(latchkey_proto::adminv1::AdvanceEpochRequest {
            expected_epoch: 1,
            reason: "drill\n2026-12-03T00:00:00Z WARN sealed by nobody".into(),
            ..Default::default()
        })
        .await;
    expect_code(advance.map(|r| r.into_inner()), Code::InvalidArgument)?;
    assert_eq!(w.revision().await?, before, "no epoch advanced");
    Ok(())
}

/// Issue 31, finding 1, the reader's side: a request record written before
/// the arbiter checked reasons (or by anything with the force user's
/// password) reaches `latchctl admin force-release list` and `approve` with
/// its control characters escaped, never raw.
#[tokio::test(flavor = "multi_thread")]
async fn latchctl_shows_a_stored_reason_with_its_control_characters_escaped() -> anyhow::Result<()>
{
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let _held = alice.lock("demo/fr-raw", FENCED).acquire(|_| {}).await?;
    let etcd = w.s.etcd.client().await?;
    let hold = etcd.clone().get("/latchkey/l/demo/fr-raw", None).await?;
    let hold = hold.kvs().first().context("no hold")?;
    let id = "0123456789abcdef0123456789abcdef";
    let now = latchkey_records::now_unix_ms();
    let raw = latchkey_arbiter::force_release::RequestRecord {
        id: id.into(),
        key: "demo/fr-raw".into(),
        holder_identity: spiffe_of("workload/alice"),
        holder_session: hold.lease(),
        hold_lease: hold.lease(),
        hold_revision: hold.mod_revision(),
        class: FENCED.into(),
        enforcement: "advisory".into(),
        reason: "stuck\u{1b}[1A\u{1b}[2K\rkey          demo/harmless\n\u{1b}[8m".into(),
        revoke_session: false,
        requester_subject: "alice-op".into(),
        requester_identity: spiffe_of(OPERATOR),
        requested_at_unix_ms: now,
        expires_at_unix_ms: now + 600_000,
        place: None,
        election: false,
        term: 0,
    };
    etcd.clone()
        .put(
            crate::support::layout().force_request(id),
            serde_json::to_vec(&raw)?,
            None,
        )
        .await?;
    let token = w.token("bob-op").await?;
    let addr = w.s.arbiter.addr();
    for args in [
        vec!["admin", "force-release", "list"],
        vec!["admin", "force-release", "approve", id],
    ] {
        let out = run_latchctl(
            latchctl(addr, OPERATOR)?
                .env("LATCHKEY_ID_TOKEN", &token)
                .args(&args),
        )
        .await?;
        for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            let text = String::from_utf8_lossy(bytes);
            assert!(
                !bytes.iter().any(|b| *b == 0x1b || *b == b'\r'),
                "{args:?}: raw control characters on {name}: {text:?}"
            );
            assert!(
                !text.contains("\nkey          demo/harmless"),
                "{args:?}: a forged line on {name}: {text}"
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("stuck\\u{1b}[1A") && stdout.contains("key          demo/fr-raw"),
            "{args:?}: {stdout}"
        );
    }
    Ok(())
}

/// Issue 31, finding 2: the pending bounds were checked by a read and then
/// written, so a burst passed them (40 at once from one operator: 40
/// pending, bound 16; 12 operators on one hold: 12 pending, bound 1). Each
/// bound is now a place the request's own transaction takes: bursts cannot
/// pass either, and the refused write nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_requests_cannot_pass_the_pending_bounds() -> anyhow::Result<()> {
    use latchkey_arbiter::force_release::MAX_PENDING_PER_OPERATOR;
    const BURST: usize = 40;
    const OPERATORS: usize = 12;
    let w = world(false).await?;
    let alice = connect(w.s.arbiter.addr(), "workload/alice").await?;
    let mut holds = Vec::new();
    for i in 0..BURST {
        holds.push(
            alice
                .lock(format!("demo/fr-burst-{i}"), FENCED)
                .acquire(|_| {})
                .await?,
        );
    }
    let w = Arc::new(w);
    // One operator, 40 holds at once.
    let token = w.token("alice-op").await?;
    let answers = futures::future::join_all((0..BURST).map(|i| {
        let (w, token) = (w.clone(), token.clone());
        async move { w.request(&format!("demo/fr-burst-{i}"), &token).await }
    }))
    .await;
    let granted = answers.iter().filter(|a| a.is_ok()).count();
    for a in &answers {
        if let Err(s) = a {
            assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
        }
    }
    assert_eq!(granted, MAX_PENDING_PER_OPERATOR, "{answers:?}");
    let mut admin = w.admin().await?;
    let pending = admin
        .list_force_releases(ListForceReleasesRequest {
            id_token: token.clone(),
        })
        .await?
        .into_inner()
        .pending;
    assert_eq!(pending.len(), MAX_PENDING_PER_OPERATOR);

    // Twelve operators, one hold (one alice-op has not asked for).
    let op = serde_json::json!({"roles": ["lock-operator"], "amr": ["pwd", "otp"]});
    let mut tokens = Vec::new();
    for i in 0..OPERATORS {
        let sub = format!("burst-op-{i}");
        w.oidc.set_user(&sub, op.clone()).await?;
        tokens.push(w.token(&sub).await?);
    }
    let unasked = (0..BURST)
        .map(|i| format!("demo/fr-burst-{i}"))
        .find(|k| !pending.iter().any(|p| &p.key == k))
        .context("every hold has a request")?;
    let answers = futures::future::join_all(tokens.iter().map(|token| {
        let (w, token, key) = (w.clone(), token.clone(), unasked.clone());
        async move { w.request(&key, &token).await }
    }))
    .await;
    let granted: Vec<_> = answers.iter().filter_map(|a| a.as_ref().ok()).collect();
    assert_eq!(granted.len(), 1, "{answers:?}");
    for a in &answers {
        if let Err(s) = a {
            assert_eq!(s.code(), Code::AlreadyExists, "{s:?}");
            assert!(s.message().contains(&granted[0].request_id), "{s:?}");
        }
    }

    // Approving one frees its requester's place: alice-op may ask again.
    let first = &pending[0];
    w.approve(&first.request_id, &w.token("bob-op").await?)
        .await?;
    let again = (0..BURST)
        .map(|i| format!("demo/fr-burst-{i}"))
        .find(|k| k != &unasked && !pending.iter().any(|p| &p.key == k))
        .context("no hold left unasked")?;
    w.request(&again, &token).await?;
    drop(holds);
    Ok(())
}
