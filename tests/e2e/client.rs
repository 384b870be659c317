//! The client library against the real arbiter on real etcd, over mTLS
//! with the dev SVIDs: re-entrancy that costs the log nothing (ADR-13), one
//! session per TTL (ADR-10), contention, and ADR-12's two stages on a
//! blocked network path (and that the arbiter hands the key on only after
//! the holder has fenced). latchctl end to end is in `latchctl.rs`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use anyhow::{Context, bail, ensure};
use latchkey_client::{Client, ClientConfig, Error, FenceReason, Reason, TlsFiles};
use latchkey_tests::arbiter::{certs, spiffe};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::eventually;
use latchkey_tests::proxy::Proxy;
use tokio::time::{Instant, sleep, timeout};
use tonic::Code;

use crate::support::stack;

/// `short` in policies/dev: the minimum TTL, so expiry happens in seconds.
pub(crate) const SHORT_TTL: Duration = Duration::from_secs(5);
/// ADR-12's margin between the local deadline and the arbiter's expiry.
pub(crate) const FENCE_MARGIN: Duration = Duration::from_secs(1);

pub(crate) fn tls(name: &str) -> anyhow::Result<TlsFiles> {
    let certs = certs()?;
    let svid = certs.svid(name);
    Ok(TlsFiles {
        ca: certs.ca(),
        cert: svid.cert,
        key: svid.key,
    })
}

/// The library, connected over mTLS under `name`'s SVID.
pub(crate) async fn connect(addr: SocketAddr, name: &str) -> anyhow::Result<Client> {
    let mut config = ClientConfig::tls(format!("https://{addr}"), tls(name)?);
    config.connect_timeout = Duration::from_secs(5);
    config.request_timeout = Duration::from_secs(5);
    Client::connect(config)
        .await
        .with_context(|| format!("connecting to {addr} as {name}"))
}

async fn lease_ids(etcd: &EtcdServer) -> anyhow::Result<BTreeSet<i64>> {
    let leases = etcd.client().await?.lease_client().leases().await?;
    Ok(leases.leases().iter().map(|l| l.id()).collect())
}

pub(crate) type Fired = Arc<Mutex<Vec<(Instant, FenceReason)>>>;

pub(crate) fn recorder(fired: &Fired) -> impl Fn(FenceReason) + Send + Sync + 'static {
    let fired = Arc::clone(fired);
    move |reason| {
        let now = Instant::now();
        fired.lock().push((now, reason));
    }
}

pub(crate) fn snapshot(fired: &Fired) -> Vec<(Instant, FenceReason)> {
    fired.lock().clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn nested_acquire_and_release_never_reach_etcd_and_the_final_release_frees_the_key()
-> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;

    let outer = alice.lock("demo/re", "demo").acquire(|_| {}).await?;
    let view = alice.inspect("demo/re").await?;
    let holder = view.holder.context("held after the outermost acquire")?;
    assert_eq!(holder.identity, spiffe("workload/alice"), "mTLS identity");
    assert_eq!(
        holder.session_id,
        outer.session_id(),
        "the holder sees its session"
    );

    let before = s.etcd.revision().await?;
    let inner = alice.lock("demo/re", "demo").acquire(|_| {}).await?;
    assert_eq!(outer.hold_count(), 2);
    assert_eq!(inner.token(), outer.token());
    assert_eq!(inner.session_id(), outer.session_id());
    assert_eq!(
        s.etcd.revision().await?,
        before,
        "a nested acquire must not write to the lock log"
    );
    inner.release().await?;
    assert_eq!(outer.hold_count(), 1);
    assert_eq!(
        s.etcd.revision().await?,
        before,
        "an inner release must not write to the lock log"
    );
    let still = alice.inspect("demo/re").await?.holder;
    assert_eq!(
        still.map(|h| h.session_id),
        Some(outer.session_id()),
        "still held"
    );

    // The same identity on another session is a leak, not re-entrancy.
    let other = connect(s.arbiter.addr(), "workload/alice").await?;
    match other.lock("demo/re", "demo").acquire(|_| {}).await {
        Err(Error::Refused { code, reason, .. }) => {
            assert_eq!((code, reason), (Code::FailedPrecondition, Reason::Leak));
        }
        other => bail!("alice on a second session: {other:?}"),
    }

    let first = outer.token();
    outer.release().await?;
    assert!(
        s.etcd.revision().await? > before,
        "the final release is a write"
    );
    let view = alice.inspect("demo/re").await?;
    assert!(
        view.holder.is_none(),
        "free after the final release: {view:?}"
    );

    let again = alice.lock("demo/re", "demo").acquire(|_| {}).await?;
    assert_eq!(again.hold_count(), 1);
    assert!(again.token() > first, "the next grant has a larger token");
    again.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn holds_of_one_ttl_share_one_session_and_one_lease() -> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let baseline = lease_ids(&s.etcd).await?;

    let a = alice.lock("demo/s1", "demo").acquire(|_| {}).await?;
    let b = alice.lock("demo/s2", "demo").acquire(|_| {}).await?;
    assert_eq!(a.session_id(), b.session_id(), "same class, same session");
    let opened: BTreeSet<i64> = lease_ids(&s.etcd)
        .await?
        .difference(&baseline)
        .copied()
        .collect();
    assert_eq!(
        opened,
        BTreeSet::from([a.session_id()]),
        "one etcd lease, and it is the session"
    );
    let session = alice.open_session("demo").await?;
    assert_eq!(session.id(), a.session_id());
    assert!(
        session.reused(),
        "the arbiter hands back the client's lease"
    );

    let c = alice.lock("demo/s3", "short").acquire(|_| {}).await?;
    assert_ne!(
        c.session_id(),
        a.session_id(),
        "another TTL, another session"
    );
    let opened: BTreeSet<i64> = lease_ids(&s.etcd)
        .await?
        .difference(&baseline)
        .copied()
        .collect();
    assert_eq!(opened, BTreeSet::from([a.session_id(), c.session_id()]));

    for (key, guard) in [("demo/s1", &a), ("demo/s2", &b), ("demo/s3", &c)] {
        let holder = alice.inspect(key).await?.holder.context("held")?;
        assert_eq!(holder.session_id, guard.session_id(), "{key}");
    }
    a.release().await?;
    b.release().await?;
    c.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_is_granted_on_release_a_try_lock_is_refused_held_and_strangers_are_denied()
-> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let bob = connect(s.arbiter.addr(), "workload/bob").await?;
    let mallory = connect(s.arbiter.addr(), "workload/mallory").await?;

    let held = alice.lock("demo/c", "demo").acquire(|_| {}).await?;
    match bob.lock("demo/c", "demo").acquire(|_| {}).await {
        Err(Error::Refused { code, reason, .. }) => {
            assert_eq!((code, reason), (Code::Aborted, Reason::Held));
        }
        other => bail!("a try-lock of a held key: {other:?}"),
    }

    let waiter = bob.clone();
    let waiting = tokio::spawn(async move {
        let guard = waiter
            .lock("demo/c", "demo")
            .wait(Duration::from_secs(20))
            .acquire(|_| {})
            .await;
        (Instant::now(), guard)
    });
    eventually("bob queued on demo/c", Duration::from_secs(10), || {
        let alice = alice.clone();
        async move {
            let waiters = alice.inspect("demo/c").await?.waiters;
            ensure!(waiters == 1, "{waiters} waiting");
            Ok(())
        }
    })
    .await?;
    assert!(!waiting.is_finished(), "granted while alice still holds");

    let first = held.token();
    let released_at = Instant::now();
    held.release().await?;
    let (granted_at, granted) = timeout(Duration::from_secs(10), waiting)
        .await
        .context("bob was not granted after the release")??;
    let granted = granted?;
    assert!(granted_at >= released_at);
    assert!(granted.token() > first, "a later grant, a larger token");
    let holder = alice
        .inspect("demo/c")
        .await?
        .holder
        .context("held by bob")?;
    assert_eq!(holder.identity, spiffe("workload/bob"));
    assert_eq!(holder.session_id, 0, "bob's session is not alice's to see");

    match mallory.lock("demo/c2", "demo").acquire(|_| {}).await {
        Err(Error::Refused { code, reason, .. }) => {
            assert_eq!(
                (code, reason),
                (Code::PermissionDenied, Reason::NotAuthorised)
            );
        }
        other => bail!("mallory outside her prefix: {other:?}"),
    }
    granted.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_blocked_path_stops_new_work_then_fences_before_the_arbiter_hands_the_key_on()
-> anyhow::Result<()> {
    const KEY: &str = "demo/adr12";
    let s = stack().await?;
    let proxy = Proxy::start(s.arbiter.addr()).await?;
    let alice = connect(proxy.addr(), "workload/alice").await?;
    let bob = connect(s.arbiter.addr(), "workload/bob").await?;
    let fired: Fired = Arc::default();

    let guard = alice.lock(KEY, "short").acquire(recorder(&fired)).await?;
    let session = alice
        .session(guard.session_id())
        .context("alice's session")?;
    assert_eq!(session.ttl(), SHORT_TTL);

    // Forwarding: every renewal moves the deadline, and new work may start
    // throughout. Three renewals take us past the deadline of the open.
    let mut deadline = guard.fence_deadline();
    let mut renewals = 0;
    let until = Instant::now() + Duration::from_secs(10);
    while renewals < 3 {
        ensure!(guard.can_start(), "a healthy path must not stop new work");
        ensure!(snapshot(&fired).is_empty(), "fenced on a healthy path");
        ensure!(Instant::now() < until, "only {renewals} renewals in 10 s");
        let now_deadline = guard.fence_deadline();
        if now_deadline > deadline {
            renewals += 1;
            deadline = now_deadline;
        }
        sleep(Duration::from_millis(10)).await;
    }

    proxy.block();
    let blocked_at = Instant::now();
    // Bob queues at once on a direct path: the arbiter may hand him the key
    // only once alice's lease has expired in etcd.
    let waiter = bob.clone();
    let bob_waiting = tokio::spawn(async move {
        let guard = waiter
            .lock(KEY, "short")
            .wait(Duration::from_secs(20))
            .acquire(|_| {})
            .await;
        (Instant::now(), guard)
    });

    let mut stopped_at = None;
    let until = blocked_at + SHORT_TTL + Duration::from_secs(2);
    while snapshot(&fired).is_empty() {
        let now = Instant::now();
        ensure!(now < until, "on_fence never fired");
        if stopped_at.is_none() && !guard.can_start() && !guard.is_fenced() {
            stopped_at = Some(now);
        }
        sleep(Duration::from_millis(5)).await;
    }
    let stopped_at = stopped_at.context("can_start() never turned false before the fence")?;
    // Fenced: the deadline no longer moves; it is the one the fence honoured.
    let deadline = guard.fence_deadline();

    let (bob_at, bob_guard) = timeout(Duration::from_secs(20), bob_waiting)
        .await
        .context("bob was never granted")??;
    let bob_guard = bob_guard.context("bob's waiting acquire")?;

    let fired = snapshot(&fired);
    ensure!(
        fired.len() == 1,
        "on_fence must fire exactly once: {fired:?}"
    );
    let (fence_at, reason) = fired[0];
    assert_eq!(reason, FenceReason::DeadlineExceeded);

    eprintln!(
        "ADR-12 on real etcd: can_start()=false {:?} after the block; deadline {:?} after the \
         block; on_fence {:?} after the deadline ({:?} after can_start()=false); bob granted {:?} \
         after on_fence",
        stopped_at - blocked_at,
        deadline - blocked_at,
        fence_at - deadline,
        fence_at - stopped_at,
        bob_at - fence_at,
    );

    // The deadline is send time + TTL − 1 s of a renewal sent before the
    // block, and no older than one keepalive interval before it.
    let fence_after_send = SHORT_TTL - FENCE_MARGIN;
    ensure!(
        deadline <= blocked_at + fence_after_send,
        "deadline later than any send before the block allows"
    );
    ensure!(
        deadline + session.keepalive_interval() + Duration::from_millis(300)
            >= blocked_at + fence_after_send,
        "deadline older than the last renewal"
    );
    ensure!(fence_at >= deadline, "fenced before the deadline");
    ensure!(
        fence_at <= deadline + Duration::from_millis(500),
        "fenced {:?} after the deadline",
        fence_at - deadline
    );
    ensure!(
        stopped_at + Duration::from_secs(1) <= fence_at,
        "can_start() must turn false well before the fence ({:?} before)",
        fence_at - stopped_at
    );

    // The safety point: the holder believed it had lost before the arbiter
    // let anyone else in.
    ensure!(
        fence_at < bob_at,
        "bob was granted {:?} before alice fenced",
        fence_at - bob_at
    );
    assert!(
        bob_guard.token() > guard.token(),
        "a later grant, a larger token"
    );
    let holder = bob.inspect(KEY).await?.holder.context("held by bob")?;
    assert_eq!(holder.identity, spiffe("workload/bob"));

    assert!(!guard.can_start() && guard.is_fenced());
    let fenced_session = guard.session_id();
    match guard.release().await {
        Err(Error::Fenced { reason, .. }) => assert_eq!(reason, FenceReason::DeadlineExceeded),
        other => bail!("release after the fence: {other:?}"),
    }
    bob_guard.release().await?;

    // The path heals: the client drops the dead session and opens a new one.
    proxy.unblock();
    let again = alice
        .lock("demo/adr12-after", "short")
        .acquire(|_| {})
        .await?;
    assert_ne!(
        again.session_id(),
        fenced_session,
        "a fenced session is not reused"
    );
    assert!(again.can_start());
    again.release().await?;
    Ok(())
}
