//! Shared locks (issue 34) through real arbiters on real etcd: readers on
//! two arbiters hold one key together, a writer (queued on either) waits
//! for every one of them and is granted above all their tokens, a reader's
//! token is above the last writer's; Inspect lists the shared holders;
//! every refusal of the mode's own (upgrade, a slot or an unknown mode, a
//! semaphore class) says what to do and writes nothing.

use std::path::Path;
use std::time::Duration;

use anyhow::ensure;
use latchkey_proto::lockv1::{AcquireRequest, Grant, InspectRequest, Mode, ReleaseRequest};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
use latchkey_tests::copy_dev_policies;
use latchkey_tests::etcd::EtcdServer;
use tempfile::TempDir;
use tonic::{Code, Status};

use crate::support::{Client, expect_refusal, open, release, revision, try_lock};

const RW: &str = "rw";
const DURABLE: &str = "rw-durable";
const SLOTS: &str = "rw-slots";
/// A fenced class whose holds last at most 5 s (its TTL).
const BOUNDED: &str = "rw-bounded";

fn policies() -> anyhow::Result<TempDir> {
    let dir = tempfile::tempdir()?;
    copy_dev_policies(dir.path())?;
    write_classes(dir.path())?;
    latchkey_tests::write_pause_test_fixtures(dir.path())?;
    Ok(dir)
}

fn write_classes(dir: &Path) -> anyhow::Result<()> {
    let class = |name: &str, extra: &str| {
        format!(
            r#"[[class]]
name = "{name}"
description = "shared locks in the e2e tests"
tier = "entity"
enforcement = "advisory"
riskOwner = "team-e2e@example.com"
waiverExpires = "2099-12-31"
ttlSeconds = 30
maxWaitersPerKey = 64
{extra}
"#
        )
    };
    std::fs::write(
        dir.join("classes").join("shared.toml"),
        [
            class(RW, ""),
            class(DURABLE, "fairness = \"durable\""),
            class(SLOTS, "kind = \"semaphore\"\npermits = 2"),
            format!(
                r#"[[class]]
name = "{BOUNDED}"
description = "holds of at most 5 s in the e2e tests"
tier = "entity"
enforcement = "fenced"
ttlSeconds = 5
maxHoldSeconds = 5
[class.pauseTest]
resource = "postgresql:dev.latchkey_fenced_rows"
result = "pause-tests/{BOUNDED}.json"
"#
            ),
        ]
        .concat(),
    )?;
    Ok(())
}

async fn acquire(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
    mode: i32,
    wait: Option<Duration>,
) -> Result<Grant, Status> {
    latchkey_tests::lock_calls::acquire_in_mode(c, key, class, session, "", wait, mode).await
}

async fn shared(c: &mut Client, key: &str, session: i64) -> Result<Grant, Status> {
    acquire(c, key, RW, session, Mode::Shared.into(), None).await
}

#[tokio::test(flavor = "multi_thread")]
async fn readers_on_two_arbiters_hold_together_and_a_writer_waits_for_all() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let dir = policies()?;
    let opts = ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let a = Arbiter::start(&etcd, opts.clone()).await?;
    let b = Arbiter::start(&etcd, opts).await?;
    let mut alice = a.lock("workload/alice").await?;
    let mut bob = b.lock("workload/bob").await?;
    let key = "demo/rw";

    let (s1, s2) = (open(&mut alice, RW).await?, open(&mut bob, RW).await?);
    let g1 = shared(&mut alice, key, s1).await?;
    let g2 = shared(&mut bob, key, s2).await?;
    for g in [&g1, &g2] {
        ensure!(
            g.key == key && g.mode == i32::from(Mode::Shared) && g.slot.is_none(),
            "a shared grant names the key and its mode: {g:?}"
        );
    }
    // Asked again, the same grant.
    let again = shared(&mut alice, key, s1).await?;
    ensure!(again.token == g1.token, "{again:?} vs {g1:?}");
    let seen = alice
        .inspect(InspectRequest { key: key.into() })
        .await?
        .into_inner();
    ensure!(
        seen.holder.is_none()
            && seen.shared_holders.len() == 2
            && seen
                .shared_holders
                .iter()
                .all(|h| h.mode == i32::from(Mode::Shared)),
        "Inspect: {seen:?}"
    );

    // A writer: HELD at once, then queued on arbiter a.
    let s3 = open(&mut alice, RW).await?;
    let before = revision(&etcd).await?;
    expect_refusal(
        try_lock(&mut alice, key, RW, s3).await,
        Code::Aborted,
        "HELD",
    )?;
    ensure!(revision(&etcd).await? == before, "a refused writer wrote");
    let writer = {
        let mut c = alice.clone();
        tokio::spawn(
            async move { acquire(&mut c, key, RW, s3, 0, Some(Duration::from_secs(20))).await },
        )
    };
    // Queued on a (its Inspect counts it), not granted.
    let seen = |c: &Client| {
        let mut c = c.clone();
        async move {
            Ok::<_, anyhow::Error>(
                c.inspect(InspectRequest { key: key.into() })
                    .await?
                    .into_inner(),
            )
        }
    };
    latchkey_tests::eventually("the writer to queue", Duration::from_secs(5), || async {
        let now = seen(&alice).await?;
        ensure!(now.waiters == 1, "{} waiters", now.waiters);
        Ok(())
    })
    .await?;
    ensure!(!writer.is_finished(), "a writer beside two readers");

    // A shared hold is released with its mode; the exclusive mode names
    // no hold of the caller's (NOT_HELD), as for any hold not its own.
    let wrong = ReleaseRequest {
        key: key.into(),
        session_id: s1,
        token: g1.token,
        slot: None,
        mode: 0,
    };
    expect_refusal(
        alice.release(wrong).await,
        Code::FailedPrecondition,
        "NOT_HELD",
    )?;
    release(&mut alice, &g1).await?;
    // Bob's reader still holds: the writer is still queued, no exclusive
    // holder beside it.
    let now = seen(&alice).await?;
    ensure!(
        now.holder.is_none() && now.shared_holders.len() == 1 && now.waiters == 1,
        "a writer beside bob's reader: {now:?}"
    );
    ensure!(!writer.is_finished(), "a writer beside bob's reader");
    // Bob's release on arbiter b: the writer queued on a sees the shared
    // hold end (its driver watches the shared holds) and is granted.
    release(&mut bob, &g2).await?;
    let gw = tokio::time::timeout(Duration::from_secs(5), writer).await???;
    ensure!(
        gw.mode == i32::from(Mode::Exclusive) && gw.token > g1.token && gw.token > g2.token,
        "the writer's token is above every reader's: {gw:?}"
    );
    // A reader now waits for the writer, and its token is above it.
    let s4 = open(&mut bob, RW).await?;
    expect_refusal(shared(&mut bob, key, s4).await, Code::Aborted, "HELD")?;
    release(&mut alice, &gw).await?;
    let g4 = shared(&mut bob, key, s4).await?;
    ensure!(g4.token > gw.token, "{g4:?} after {gw:?}");

    // Upgrade: refused, nothing written.
    let before = revision(&etcd).await?;
    expect_refusal(
        acquire(&mut bob, key, RW, s4, 0, None).await,
        Code::FailedPrecondition,
        "UPGRADE_REFUSED",
    )?;
    ensure!(revision(&etcd).await? == before, "a refused upgrade wrote");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_downgrade_is_a_new_grant_and_bad_modes_are_refused() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let dir = policies()?;
    let opts = ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let a = Arbiter::start(&etcd, opts).await?;
    let mut alice = a.lock("workload/alice").await?;
    let key = "demo/down";

    let s = open(&mut alice, RW).await?;
    let gw = try_lock(&mut alice, key, RW, s).await?;
    let gd = shared(&mut alice, key, s).await?;
    ensure!(
        gd.mode == i32::from(Mode::Shared) && gd.token > gw.token,
        "a downgrade is a new shared grant: {gd:?} after {gw:?}"
    );
    let other = open(&mut alice, RW).await?;
    shared(&mut alice, key, other).await?;
    // The old exclusive token releases nothing.
    expect_refusal(
        release(&mut alice, &gw).await,
        Code::FailedPrecondition,
        "NOT_HELD",
    )?;

    let sem = open(&mut alice, SLOTS).await?;
    let durable = open(&mut alice, DURABLE).await?;
    let before = revision(&etcd).await?;
    let bad = |mode: i32| AcquireRequest {
        key: key.into(),
        class: RW.into(),
        session_id: s,
        wait: 0,
        metadata: Default::default(),
        instance: String::new(),
        mode,
        downgrade_from: None,
    };
    let refused = alice.acquire(bad(7)).await;
    let status = expect_refusal(refused, Code::InvalidArgument, "BAD_REQUEST")?;
    ensure!(
        status.message().contains("MODE_SHARED"),
        "{}",
        status.message()
    );
    // A semaphore takes no shared request.
    let status = expect_refusal(
        acquire(&mut alice, "demo/sem-rw", SLOTS, sem, 1, None).await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    ensure!(
        status.message().contains("semaphore"),
        "{}",
        status.message()
    );
    // A shared release naming a slot.
    let status = expect_refusal(
        alice
            .release(ReleaseRequest {
                key: key.into(),
                session_id: s,
                token: gd.token,
                slot: Some(0),
                mode: 1,
            })
            .await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    ensure!(status.message().contains("slot"), "{}", status.message());
    ensure!(revision(&etcd).await? == before, "a refusal wrote");
    release(&mut alice, &gd).await?;
    // A durable class takes shared holds (its queue in etcd orders readers
    // and writers alike).
    let gs = acquire(&mut alice, "demo/durable-rw", DURABLE, durable, 1, None)
        .await
        .map_err(|s| anyhow::anyhow!("a durable class's shared hold: {s:?}"))?;
    ensure!(gs.mode == 1, "a shared grant says its mode: {gs:?}");
    release(&mut alice, &gs).await?;
    Ok(())
}

/// A downgrade that names its exclusive hold's token (`downgrade_from`, what
/// the clients send) converts exactly that hold and never grants afresh:
/// another revision, another session's hold, an exclusive mode or another
/// class are refused and write nothing; a repeat whose answer was lost is
/// answered with the shared hold that downgrade made; once that hold ended,
/// or when a writer held the key since, the answer is NOT_HELD with nothing
/// written (the hostile review: a plain shared Acquire there granted a new
/// reader the client took for its downgrade, beside a writer it never saw).
#[tokio::test(flavor = "multi_thread")]
async fn a_downgrade_from_converts_only_its_own_hold() -> anyhow::Result<()> {
    use latchkey_tests::lock_calls::downgrade_from;
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let dir = policies()?;
    let opts = ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let a = Arbiter::start(&etcd, opts).await?;
    let mut alice = a.lock("workload/alice").await?;
    let key = "demo/down-from";
    let shared_mode = i32::from(Mode::Shared);
    let not_held = |r: Result<Grant, Status>, what: &str| {
        expect_refusal(r, Code::FailedPrecondition, "NOT_HELD")
            .map_err(|e| anyhow::anyhow!("{what}: {e}"))
    };

    let s = open(&mut alice, RW).await?;
    let other = open(&mut alice, RW).await?;
    let gw = try_lock(&mut alice, key, RW, s).await?;
    let before = revision(&etcd).await?;
    let status = expect_refusal(
        downgrade_from(&mut alice, key, RW, s, gw.token, Mode::Exclusive.into()).await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    ensure!(
        status.message().contains("MODE_SHARED"),
        "{}",
        status.message()
    );
    let status = not_held(
        downgrade_from(&mut alice, key, RW, s, gw.token + 1, shared_mode).await,
        "another revision",
    )?;
    ensure!(
        status.message().contains("acquire it again"),
        "the refusal says what to do: {}",
        status.message()
    );
    let status = expect_refusal(
        downgrade_from(&mut alice, key, DURABLE, s, gw.token, shared_mode).await,
        Code::InvalidArgument,
        "BAD_REQUEST",
    )?;
    ensure!(
        status.message().contains("under class"),
        "{}",
        status.message()
    );
    not_held(
        downgrade_from(&mut alice, key, RW, other, gw.token, shared_mode).await,
        "another session naming the hold's token",
    )?;
    ensure!(
        revision(&etcd).await? == before,
        "a refused downgrade wrote"
    );

    let gd = downgrade_from(&mut alice, key, RW, s, gw.token, shared_mode).await?;
    ensure!(
        gd.mode == shared_mode && gd.token > gw.token,
        "a downgrade is a new shared grant: {gd:?} after {gw:?}"
    );
    let again = downgrade_from(&mut alice, key, RW, s, gw.token, shared_mode).await?;
    ensure!(
        again.token == gd.token && again.mode == shared_mode,
        "a repeat is answered with the hold the downgrade made: {again:?} vs {gd:?}"
    );
    not_held(
        downgrade_from(&mut alice, key, DURABLE, s, gw.token, shared_mode).await,
        "a repeat naming another class",
    )?;
    release(&mut alice, &gd).await?;

    // That shared hold ended: a repeat now grants nothing.
    let before = revision(&etcd).await?;
    not_held(
        downgrade_from(&mut alice, key, RW, s, gw.token, shared_mode).await,
        "a repeat after the downgraded hold ended",
    )?;
    ensure!(
        revision(&etcd).await? == before,
        "a refused downgrade wrote"
    );

    // An exclusive hold that ended before its downgrade came, a writer of
    // another session holding the key since: NOT_HELD, the writer's hold
    // untouched, no reader beside it.
    let gw2 = try_lock(&mut alice, key, RW, s).await?;
    release(&mut alice, &gw2).await?;
    let gb = try_lock(&mut alice, key, RW, other).await?;
    let before = revision(&etcd).await?;
    not_held(
        downgrade_from(&mut alice, key, RW, s, gw2.token, shared_mode).await,
        "a downgrade of a hold that ended",
    )?;
    ensure!(
        revision(&etcd).await? == before,
        "a refused downgrade wrote"
    );
    let seen = alice
        .inspect(InspectRequest { key: key.into() })
        .await?
        .into_inner();
    ensure!(
        seen.holder.as_ref().map(|h| h.session_id) == Some(other) && seen.shared_holders.is_empty(),
        "the writer alone holds the key: {seen:?}"
    );
    release(&mut alice, &gb).await?;
    Ok(())
}

/// The client's downgrade whose answers are all lost (its path goes dark
/// for longer than its attempts): the guard is fenced at once, since the
/// downgrade may have landed and it knows no token of the hold it would
/// have; once the path is back, the client's clean-up asks the downgrade
/// again and releases the shared hold it is answered with. The key ends
/// free (a writer is granted at once, above the exclusive token) and the
/// session lives on.
#[tokio::test(flavor = "multi_thread")]
async fn a_clients_downgrade_of_unknown_outcome_is_fenced_and_cleaned_up() -> anyhow::Result<()> {
    use latchkey_client::{Client, ClientConfig, FenceReason};
    use latchkey_tests::proxy::Proxy;

    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let dir = policies()?;
    let opts = ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let a = Arbiter::start(&etcd, opts).await?;
    let proxy = Proxy::start(a.addr()).await?;
    let mut config = ClientConfig::tls(
        format!("https://{}", proxy.addr()),
        crate::client::tls("workload/alice")?,
    );
    config.connect_timeout = Duration::from_secs(5);
    config.request_timeout = Duration::from_millis(300);
    let alice = Client::connect(config).await?;
    let bob = crate::client::connect(a.addr(), "workload/bob").await?;
    let key = "demo/downgrade-unknown";

    let fired: crate::client::Fired = Default::default();
    let mut guard = alice
        .lock(key, RW)
        .acquire(crate::client::recorder(&fired))
        .await?;
    let exclusive = guard.token();
    proxy.block();
    let err = match guard.downgrade().await {
        Err(e) => e,
        Ok(()) => anyhow::bail!("a downgrade answered through a dark path"),
    };
    ensure!(err.is_transient(), "an outcome unknown: {err:?}");
    ensure!(
        guard.is_fenced(),
        "a downgrade of unknown outcome fences its guard"
    );
    let got = crate::client::snapshot(&fired);
    ensure!(
        got.iter().map(|(_, r)| *r).collect::<Vec<_>>() == vec![FenceReason::HoldEnded],
        "on_fence fired once, HoldEnded: {got:?}"
    );
    proxy.unblock();

    latchkey_tests::eventually(
        "the clean-up to leave the key free",
        Duration::from_secs(20),
        || {
            let bob = bob.clone();
            async move {
                let seen = bob.inspect(key).await?;
                ensure!(
                    seen.holder.is_none() && seen.shared_holders.is_empty(),
                    "{seen:?}"
                );
                Ok(())
            }
        },
    )
    .await?;
    let writer = bob.lock(key, RW).acquire(|_| {}).await?;
    ensure!(writer.token() > exclusive, "granted above the old writer");
    writer.release().await?;
    let again = alice.lock(key, RW).acquire(|_| {}).await?;
    ensure!(
        !again.is_fenced() && again.token() > exclusive,
        "the session lives on"
    );
    again.release().await?;
    Ok(())
}

/// A class's `maxHoldSeconds`: a reader whose client keeps its session
/// alive is ended 5 s after its grant, hears it on its KeepAlive stream
/// (fenced, `HoldEnded`) while its session lives on, and the writer waiting
/// for it is granted.
#[tokio::test(flavor = "multi_thread")]
async fn a_renewing_reader_ends_at_its_classs_max_hold() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let dir = policies()?;
    let opts = ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let a = Arbiter::start(&etcd, opts).await?;
    let alice = crate::client::connect(a.addr(), "workload/alice").await?;
    let bob = crate::client::connect(a.addr(), "workload/bob").await?;
    let key = "demo/bounded";
    let fired: crate::client::Fired = std::sync::Arc::default();
    let started = std::time::Instant::now();
    let reader = alice
        .lock(key, BOUNDED)
        .shared()
        .acquire(crate::client::recorder(&fired))
        .await?;
    ensure!(reader.is_shared(), "a shared guard");
    let writer = bob
        .lock(key, BOUNDED)
        .wait(Duration::from_secs(20))
        .acquire(|_| {})
        .await?;
    let waited = started.elapsed();
    ensure!(
        waited >= Duration::from_millis(4_500) && waited < Duration::from_secs(12),
        "the writer got in after {waited:?}, the reader's bound being 5 s"
    );
    ensure!(writer.token().get() > reader.token().get());
    latchkey_tests::eventually(
        "the reader to be fenced",
        Duration::from_secs(5),
        || async {
            let got = crate::client::snapshot(&fired);
            ensure!(
                got.iter()
                    .any(|(_, r)| *r == latchkey_client::FenceReason::HoldEnded),
                "{got:?}"
            );
            Ok(())
        },
    )
    .await?;
    ensure!(reader.is_fenced(), "the reader's guard is fenced");
    // Its session lives on: it takes another key.
    let other = alice
        .lock("demo/bounded-2", BOUNDED)
        .acquire(|_| {})
        .await?;
    ensure!(other.session_id() == reader.session_id());
    Ok(())
}

/// The client's downgrade ([`latchkey_client::LockGuard::downgrade`])
/// through Envoy and its filter to the arbiter: the guard's exclusive hold
/// becomes shared with a new token above the exclusive one
/// (docs/fencing.md), another reader is granted beside it, a writer is not
/// (neither at once nor from the queue) until the downgraded hold ends, and
/// nothing is fenced on the way.
#[tokio::test(flavor = "multi_thread")]
async fn a_clients_downgrade_lets_readers_in_and_keeps_writers_out_through_the_edge()
-> anyhow::Result<()> {
    use latchkey_client::{Error, Reason};

    let dir = policies()?;
    let edge = crate::edge::edge_with(
        ArbiterOptions {
            policies_dir: dir.path().to_path_buf(),
            ..ArbiterOptions::default()
        },
        serde_json::json!({}),
    )
    .await?;
    let addr = edge.envoy.addr();
    let alice = crate::client::connect(addr, "workload/alice").await?;
    let bob = crate::client::connect(addr, "workload/bob").await?;
    let writer = crate::client::connect(addr, "workload/demo").await?;
    let key = "demo/client-downgrade";
    let held = |r: Result<latchkey_client::LockGuard, Error>, who: &str| match r {
        Err(e) if e.reason() == Reason::Held => Ok(()),
        other => Err(anyhow::anyhow!("{who}: expected HELD, got {other:?}")),
    };

    let fired: crate::client::Fired = Default::default();
    let mut guard = alice
        .lock(key, RW)
        .acquire(crate::client::recorder(&fired))
        .await?;
    let exclusive = guard.token();
    held(
        bob.lock(key, RW).shared().acquire(|_| {}).await,
        "a reader beside the writer",
    )?;

    guard.downgrade().await?;
    ensure!(guard.is_shared(), "the guard holds the key shared now");
    ensure!(
        guard.token() > exclusive,
        "the downgraded token is above the exclusive one"
    );
    let seen = alice.inspect(key).await?;
    ensure!(
        seen.holder.is_none() && seen.shared_holders.len() == 1,
        "the exclusive hold became one shared hold: {seen:?}"
    );

    // Another reader is granted while the downgraded hold lives; its token
    // too is above the last exclusive grant.
    let reader = bob.lock(key, RW).shared().acquire(|_| {}).await?;
    ensure!(reader.is_shared() && reader.token() > exclusive);
    let seen = alice.inspect(key).await?;
    ensure!(
        seen.holder.is_none() && seen.shared_holders.len() == 2,
        "two readers: {seen:?}"
    );
    // A writer is not: refused at once...
    held(
        writer.lock(key, RW).acquire(|_| {}).await,
        "a writer beside the readers",
    )?;
    // ...and a second downgrade is refused without a call.
    match guard.downgrade().await {
        Err(Error::Refused {
            code: Code::FailedPrecondition,
            reason: Reason::BadRequest,
            message,
            ..
        }) => ensure!(message.contains("shared already"), "{message}"),
        other => anyhow::bail!("a downgrade of a shared hold: {other:?}"),
    }

    // A queued writer waits for the downgraded hold, not only for bob's.
    let queued = {
        let writer = writer.clone();
        tokio::spawn(async move {
            writer
                .lock(key, RW)
                .wait(Duration::from_secs(20))
                .acquire(|_| {})
                .await
        })
    };
    latchkey_tests::eventually("the writer to queue", Duration::from_secs(10), || {
        let alice = alice.clone();
        async move {
            let waiters = alice.inspect(key).await?.waiters;
            ensure!(waiters == 1, "{waiters} waiting");
            Ok(())
        }
    })
    .await?;
    let (reader_token, shared_token) = (reader.token(), guard.token());
    reader.release().await?;
    let seen = alice.inspect(key).await?;
    ensure!(
        seen.holder.is_none() && seen.shared_holders.len() == 1 && seen.waiters == 1,
        "the downgraded hold alone keeps the writer queued: {seen:?}"
    );
    ensure!(!queued.is_finished(), "a writer beside the downgraded hold");

    guard.release().await?;
    let granted = tokio::time::timeout(Duration::from_secs(10), queued).await???;
    ensure!(
        !granted.is_shared() && granted.token() > shared_token && granted.token() > reader_token,
        "the writer is granted above every reader"
    );
    granted.release().await?;
    ensure!(
        crate::client::snapshot(&fired).is_empty(),
        "the downgrade fenced nothing"
    );
    Ok(())
}
