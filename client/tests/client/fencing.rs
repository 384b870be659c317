//! ADR-12 end to end: a blocked network path first stops new work, then
//! fences every hold at last-successful-send + TTL − 1 s, once each.

use std::sync::Arc;
use std::time::Duration;

use latchkey_client::{Error, FenceReason};
use parking_lot::Mutex;
use tokio::time::{Instant, sleep};

use crate::fake_arbiter::FakeArbiter;
use crate::{assert_eventually, dev_client};
use latchkey_tests::proxy::Proxy;

type Fired = Arc<Mutex<Vec<(Instant, FenceReason, &'static str)>>>;

fn recorder(fired: &Fired, label: &'static str) -> impl Fn(FenceReason) + Send + Sync + 'static {
    let fired = Arc::clone(fired);
    move |reason| {
        let now = Instant::now();
        fired.lock().push((now, reason, label));
    }
}

fn snapshot(fired: &Fired) -> Vec<(Instant, FenceReason, &'static str)> {
    fired.lock().clone()
}

#[tokio::test]
async fn blocked_path_stops_new_work_first_then_fences_at_the_send_time_deadline() {
    let arbiter = FakeArbiter::new(&[("short", 3)]);
    let proxy = Proxy::start(arbiter.serve().await).await.expect("proxy");
    let client = dev_client(proxy.addr()).await;
    let fired: Fired = Arc::default();

    let outer = match client
        .lock("jobs/a", "short")
        .acquire(recorder(&fired, "outer"))
        .await
    {
        Ok(g) => g,
        Err(e) => panic!("acquire: {e}"),
    };
    let inner = match client
        .lock("jobs/a", "short")
        .acquire(recorder(&fired, "inner"))
        .await
    {
        Ok(g) => g,
        Err(e) => panic!("nested acquire: {e}"),
    };
    assert_eq!(outer.hold_count(), 2);

    // Forwarding: three renewals take us past the first deadline (open + 2 s)
    // and can_start() holds throughout.
    let renewals = FakeArbiter::count(&arbiter.counters.keepalive);
    let until = Instant::now() + Duration::from_secs(6);
    while FakeArbiter::count(&arbiter.counters.keepalive) < renewals + 3 {
        assert!(outer.can_start(), "a healthy path must not stop new work");
        assert!(snapshot(&fired).is_empty());
        assert!(Instant::now() < until, "keepalives did not flow");
        sleep(Duration::from_millis(10)).await;
    }

    proxy.block();
    let blocked_at = Instant::now();
    // The latest deadline the library reported: now + remaining_ttl() never
    // exceeds its real deadline, so the fence must not come before this.
    let mut deadline_seen = blocked_at;
    let mut stopped_at = None;
    let until = blocked_at + Duration::from_secs(5);
    loop {
        if !snapshot(&fired).is_empty() {
            break;
        }
        let now = Instant::now();
        assert!(now < until, "on_fence never fired");
        deadline_seen = deadline_seen.max(now + outer.remaining_ttl());
        if stopped_at.is_none() && !outer.can_start() && !outer.is_fenced() {
            stopped_at = Some(now);
        }
        sleep(Duration::from_millis(5)).await;
    }

    let Some(stopped_at) = stopped_at else {
        panic!("can_start() never turned false before the fence");
    };
    // Let any duplicate call show up before counting.
    sleep(Duration::from_millis(300)).await;
    let fired = snapshot(&fired);
    let mut labels: Vec<_> = fired.iter().map(|(_, _, label)| *label).collect();
    labels.sort_unstable();
    assert_eq!(
        labels,
        ["inner", "outer"],
        "each hold's on_fence exactly once"
    );
    assert!(
        fired
            .iter()
            .all(|(_, r, _)| *r == FenceReason::DeadlineExceeded)
    );
    let fence_at = fired.iter().map(|(t, _, _)| *t).min().unwrap_or(blocked_at);

    eprintln!(
        "stage one {:?} after the block, deadline {:?} after, fence {:?} after the deadline",
        stopped_at - blocked_at,
        deadline_seen - blocked_at,
        fence_at - deadline_seen
    );
    // The last successful send was before the block, so the deadline is at
    // most blocked_at + TTL − 1 s, and at least one interval earlier.
    assert!(deadline_seen <= blocked_at + Duration::from_secs(2));
    assert!(deadline_seen + Duration::from_millis(1100) >= blocked_at + Duration::from_secs(2));
    assert!(fence_at >= deadline_seen, "fenced before the deadline");
    // The deadline the library reports is the one it fenced at.
    assert!(
        fence_at >= outer.fence_deadline(),
        "fenced before fence_deadline()"
    );
    assert!(
        fence_at <= deadline_seen + Duration::from_millis(300),
        "fenced {:?} after the deadline",
        fence_at - deadline_seen
    );
    assert!(
        stopped_at + Duration::from_millis(300) <= fence_at,
        "can_start() must turn false well before the fence ({:?} before)",
        fence_at - stopped_at
    );

    assert!(outer.is_fenced() && !outer.can_start());
    assert_eq!(outer.remaining_ttl(), Duration::ZERO);
    drop(inner);
    match outer.release().await {
        Err(Error::Fenced { reason, .. }) => assert_eq!(reason, FenceReason::DeadlineExceeded),
        other => panic!("release after fence: {other:?}"),
    }
}

#[tokio::test]
async fn a_blip_shorter_than_the_deadline_only_pauses_new_work() {
    let arbiter = FakeArbiter::new(&[("short", 3)]);
    let proxy = Proxy::start(arbiter.serve().await).await.expect("proxy");
    let client = dev_client(proxy.addr()).await;
    let fired: Fired = Arc::default();
    let guard = match client
        .lock("jobs/b", "short")
        .acquire(recorder(&fired, "g"))
        .await
    {
        Ok(g) => g,
        Err(e) => panic!("acquire: {e}"),
    };
    let renewals = FakeArbiter::count(&arbiter.counters.keepalive);
    assert_eventually!(
        FakeArbiter::count(&arbiter.counters.keepalive) > renewals,
        within = Duration::from_secs(3),
        "no keepalive"
    );

    proxy.block();
    assert_eventually!(
        !guard.can_start(),
        within = Duration::from_secs(3),
        "a late keepalive must stop new work"
    );
    assert!(!guard.is_fenced());
    proxy.unblock();
    assert_eventually!(
        guard.can_start(),
        within = Duration::from_secs(2),
        "a successful renewal must allow new work again"
    );

    // And it stays alive well past the deadline the blip threatened.
    let renewals = FakeArbiter::count(&arbiter.counters.keepalive);
    assert_eventually!(
        FakeArbiter::count(&arbiter.counters.keepalive) >= renewals + 3,
        within = Duration::from_secs(6),
        "keepalives stopped after the blip"
    );
    assert!(snapshot(&fired).is_empty(), "a blip must not fence");
    assert!(guard.can_start());
    if let Err(e) = guard.release().await {
        panic!("release: {e}");
    }
}

#[tokio::test]
async fn the_arbiter_expiring_the_session_fences_at_once() {
    let arbiter = FakeArbiter::new(&[("short", 3)]);
    let client = dev_client(arbiter.serve().await).await;
    let fired: Fired = Arc::default();
    let guard = match client
        .lock("jobs/c", "short")
        .acquire(recorder(&fired, "g"))
        .await
    {
        Ok(g) => g,
        Err(e) => panic!("acquire: {e}"),
    };
    let expired_at = Instant::now();
    arbiter.expire(guard.session_id());
    assert_eventually!(
        !snapshot(&fired).is_empty(),
        within = Duration::from_secs(3),
        "SESSION_EXPIRED must fence"
    );
    let fired = snapshot(&fired);
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].1, FenceReason::Expired);
    // Within about one keepalive interval, before the local deadline.
    assert!(fired[0].0 < expired_at + Duration::from_millis(1500));

    // The next acquire of the class gets a fresh session.
    let again = match client.lock("jobs/c", "short").acquire(|_| {}).await {
        Ok(g) => g,
        Err(e) => panic!("acquire on a fresh session: {e}"),
    };
    assert_ne!(again.session_id(), guard.session_id());
    assert!(again.can_start());
}
