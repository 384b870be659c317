//! ADR-10 and ADR-13 as the arbiter sees them: nested acquires and one
//! session per TTL cost no calls.

use std::time::Duration;

use latchkey_client::Reason;

use crate::fake_arbiter::FakeArbiter;
use crate::{assert_eventually, dev_client};

#[tokio::test]
async fn only_the_outermost_acquire_and_the_last_release_reach_the_arbiter() {
    let arbiter = FakeArbiter::new(&[("jobs", 15)]);
    let client = dev_client(arbiter.serve().await).await;
    let c = &arbiter.counters;

    let outer = match client.lock("jobs/x", "jobs").acquire(|_| {}).await {
        Ok(g) => g,
        Err(e) => panic!("acquire: {e}"),
    };
    let inner = match client.lock("jobs/x", "jobs").acquire(|_| {}).await {
        Ok(g) => g,
        Err(e) => panic!("nested acquire: {e}"),
    };
    let innermost = match client.lock("jobs/x", "jobs").acquire(|_| {}).await {
        Ok(g) => g,
        Err(e) => panic!("nested acquire: {e}"),
    };
    assert_eq!(FakeArbiter::count(&c.acquire), 1);
    assert_eq!(outer.hold_count(), 3);
    assert_eq!(inner.token(), outer.token());
    assert_eq!(inner.session_id(), outer.session_id());

    if let Err(e) = innermost.release().await {
        panic!("release: {e}");
    }
    drop(inner);
    assert_eq!(outer.hold_count(), 1);
    assert_eq!(FakeArbiter::count(&c.release), 0);
    if let Err(e) = outer.release().await {
        panic!("release: {e}");
    }
    assert_eq!(FakeArbiter::count(&c.release), 1);

    // Free again: the next acquire is an outermost one.
    let again = match client.lock("jobs/x", "jobs").acquire(|_| {}).await {
        Ok(g) => g,
        Err(e) => panic!("acquire after release: {e}"),
    };
    assert_eq!(again.hold_count(), 1);
    assert_eq!(FakeArbiter::count(&c.acquire), 2);

    // Dropping the last guard sends Release from a task.
    drop(again);
    assert_eventually!(
        FakeArbiter::count(&c.release) == 2,
        within = Duration::from_secs(2),
        "drop did not release"
    );
}

#[tokio::test]
async fn one_session_per_ttl_and_other_clients_see_held() {
    let arbiter = FakeArbiter::new(&[("a", 15), ("b", 15), ("slow", 30)]);
    let addr = arbiter.serve().await;
    let client = dev_client(addr).await;
    let c = &arbiter.counters;

    let a = client.lock("k/1", "a").acquire(|_| {}).await;
    let b = client.lock("k/2", "b").acquire(|_| {}).await;
    let slow = client.lock("k/3", "slow").acquire(|_| {}).await;
    let (Ok(a), Ok(b), Ok(slow)) = (a, b, slow) else {
        panic!("acquires failed");
    };
    assert_eq!(a.session_id(), b.session_id(), "same TTL, same session");
    assert_ne!(
        a.session_id(),
        slow.session_id(),
        "other TTL, other session"
    );
    assert_eq!(FakeArbiter::count(&c.open_session), 3);
    let a2 = client.lock("k/4", "a").acquire(|_| {}).await;
    assert!(a2.is_ok());
    assert_eq!(
        FakeArbiter::count(&c.open_session),
        3,
        "class session is cached"
    );

    let session = match client.open_session("b").await {
        Ok(s) => s,
        Err(e) => panic!("open: {e}"),
    };
    assert!(session.reused());
    assert_eq!(session.id(), a.session_id());

    let other = dev_client(addr).await;
    match other.lock("k/1", "a").acquire(|_| {}).await {
        Err(err) => {
            assert_eq!(err.reason(), Reason::Held);
            assert_eq!(err.code(), Some(tonic::Code::Aborted));
            assert!(!err.is_transient());
        }
        Ok(_) => panic!("a key held by another session must be refused"),
    }
}

#[tokio::test]
async fn closing_a_session_fences_its_holds() {
    let arbiter = FakeArbiter::new(&[("jobs", 15)]);
    let client = dev_client(arbiter.serve().await).await;
    let session = match client.open_session("jobs").await {
        Ok(s) => s,
        Err(e) => panic!("open: {e}"),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let guard = match client
        .lock("jobs/y", "jobs")
        .session(&session)
        .acquire(move |reason| {
            let _ = tx.send(reason);
        })
        .await
    {
        Ok(g) => g,
        Err(e) => panic!("acquire: {e}"),
    };
    if let Err(e) = session.close().await {
        panic!("close: {e}");
    }
    assert_eq!(
        rx.try_recv().ok(),
        Some(latchkey_client::FenceReason::Closed)
    );
    assert!(guard.is_fenced());
    assert_eq!(FakeArbiter::count(&arbiter.counters.close_session), 1);
    drop(guard);
    assert_eq!(FakeArbiter::count(&arbiter.counters.release), 0);
}
