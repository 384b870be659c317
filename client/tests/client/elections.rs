//! Elections against the fake arbiter: the guard's redaction and its
//! resignation on drop, the two ways a leadership is lost (the session's
//! fence deadline on a blocked path; a later term an Observe reports), and
//! `lead()` campaigning again by itself.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use latchkey_client::{CampaignOptions, Error, FenceReason, LeadershipLost};
use latchkey_tests::proxy::Proxy;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

use crate::fake_arbiter::FakeArbiter;
use crate::fake_election::FakeElections;
use crate::{assert_eventually, dev_client};

const CLASS: &str = "elect";

fn options() -> CampaignOptions {
    CampaignOptions {
        wait: Some(Duration::from_secs(2)),
        ..CampaignOptions::default()
    }
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// current_thread: every task runs under the capturing subscriber.
#[tokio::test(flavor = "current_thread")]
async fn a_leadership_shows_no_token_and_its_last_guard_resigns_on_drop() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let lock = FakeArbiter::new(&[(CLASS, 15)]);
    let elections = FakeElections::new();
    let client = dev_client(elections.serve_with(&lock).await).await;
    let led = client
        .campaign("jobs/sched", CLASS, "pod-a", options())
        .await
        .expect("campaign");
    let token = led.token().get();
    assert!(token > 0 && led.term() > 0 && led.value() == "pod-a");
    // Campaigning again on this client: another guard, nothing sent.
    let again = client
        .campaign("jobs/sched", CLASS, "pod-a", options())
        .await
        .expect("second campaign");
    assert_eq!(FakeElections::count(&elections.counters.campaign), 1);
    assert_eq!(again.token(), led.token());
    assert_eq!(led.guard_count(), 2);
    led.proclaim("pod-a2").await.expect("proclaim");
    assert_eq!(again.value(), "pod-a2", "guards share the leadership");

    let shown = format!("{led:?} {led} {:?} {}", led.token(), led.token());
    assert!(shown.contains("<redacted>"), "{shown}");
    assert!(!shown.contains(&token.to_string()), "{shown}");

    drop(again);
    assert_eq!(led.guard_count(), 1);
    let lost = led.lost();
    drop(led);
    assert_eq!(
        timeout(Duration::from_secs(2), lost).await.ok(),
        Some(LeadershipLost::Resigned)
    );
    assert_eventually!(
        FakeElections::count(&elections.counters.resign) == 1,
        within = Duration::from_secs(2),
        "dropping the last guard must resign"
    );
    assert_eq!(elections.leader_term("jobs/sched"), None);
    let text = String::from_utf8_lossy(&logs.0.lock()).into_owned();
    assert!(text.contains("leads"), "logs: {text}");
    assert!(
        !text.contains(&token.to_string()),
        "logs show the token: {text}"
    );
}

#[tokio::test]
async fn an_observed_later_term_ends_the_leadership_at_once() {
    let lock = FakeArbiter::new(&[(CLASS, 15)]);
    let elections = FakeElections::new();
    let client = dev_client(elections.serve_with(&lock).await).await;
    let led = client
        .campaign("jobs/sched", CLASS, "pod-a", options())
        .await
        .expect("campaign");
    let cancelled = led.cancellation_token();
    // Once its observer has subscribed, someone else leads.
    timeout(Duration::from_secs(5), async {
        while elections.observers() == 0 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the leadership's observer subscribes");
    assert!(!led.is_lost() && led.can_start());
    elections.replace_leader("jobs/sched");
    let reason = timeout(Duration::from_secs(2), led.lost())
        .await
        .expect("the observer must report the new term");
    assert_eq!(
        reason,
        LeadershipLost::Replaced {
            term: led.term() + 1
        }
    );
    assert!(cancelled.is_cancelled() && !led.can_start());
    match led.proclaim("mine").await {
        Err(Error::LeadershipLost { reason, .. }) => {
            assert!(matches!(reason, LeadershipLost::Replaced { .. }))
        }
        other => panic!("proclaim on a lost leadership: {other:?}"),
    }
    match led.resign().await {
        Err(Error::LeadershipLost { .. }) => {}
        other => panic!("resign of a lost leadership: {other:?}"),
    }
    assert_eq!(
        FakeElections::count(&elections.counters.resign),
        0,
        "nothing to resign"
    );
}

#[tokio::test]
async fn a_blocked_path_loses_the_leadership_at_the_fence_deadline() {
    let lock = FakeArbiter::new(&[(CLASS, 3)]);
    let elections = FakeElections::new();
    let proxy = Proxy::start(elections.serve_with(&lock).await)
        .await
        .expect("proxy");
    let client = dev_client(proxy.addr()).await;
    let led = client
        .campaign("jobs/sched", CLASS, "pod-a", options())
        .await
        .expect("campaign");
    let deadline = led.fence_deadline();
    proxy.block();
    let blocked_at = Instant::now();
    let reason = timeout(Duration::from_secs(5), led.lost())
        .await
        .expect("the leadership must be lost at the deadline");
    let lost_at = Instant::now();
    assert_eq!(
        reason,
        LeadershipLost::Fenced(FenceReason::DeadlineExceeded)
    );
    // Never before the deadline it reported, and not much after: TTL 3 s,
    // so the deadline is at most 2 s after the last renewal.
    assert!(lost_at >= deadline.min(blocked_at));
    assert!(
        lost_at - blocked_at <= Duration::from_millis(2_500),
        "{:?}",
        lost_at - blocked_at
    );
    assert!(!led.can_start() && led.remaining_ttl() == Duration::ZERO);
}

type Steps = mpsc::UnboundedReceiver<(&'static str, u64, i64)>;

async fn next(rx: &mut Steps) -> (&'static str, u64, i64) {
    timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("a step in time")
        .expect("lead() runs")
}

#[tokio::test]
async fn lead_campaigns_again_by_itself_after_its_session_expires() {
    let lock = FakeArbiter::new(&[(CLASS, 15)]);
    let elections = FakeElections::new();
    let client = dev_client(elections.serve_with(&lock).await).await;
    let (tx, mut rx) = mpsc::unbounded_channel::<(&'static str, u64, i64)>();
    let leader = client.clone();
    let leading = tokio::spawn(async move {
        leader
            .lead("jobs/sched", CLASS, "pod-a", options(), move |leadership| {
                let tx = tx.clone();
                async move {
                    struct Stopped(mpsc::UnboundedSender<(&'static str, u64, i64)>, u64);
                    impl Drop for Stopped {
                        fn drop(&mut self) {
                            let _ = self.0.send(("stopped", self.1, 0));
                        }
                    }
                    let _stopped = Stopped(tx.clone(), leadership.term());
                    let _ = tx.send(("started", leadership.term(), leadership.session_id()));
                    std::future::pending::<()>().await;
                    drop(leadership);
                }
            })
            .await
    });
    let (what, first, session) = next(&mut rx).await;
    assert_eq!(what, "started");
    // The session ends at the arbiter (its lease expired).
    lock.expire(session);
    elections.session_ended(session);
    assert_eq!(next(&mut rx).await, ("stopped", first, 0));
    let (what, second, second_session) = next(&mut rx).await;
    assert_eq!(what, "started");
    assert!(second > first);
    assert_ne!(second_session, session, "a new session");
    leading.abort();
    assert_eq!(next(&mut rx).await, ("stopped", second, 0));
    assert_eventually!(
        elections.leader_term("jobs/sched").is_none(),
        within = Duration::from_secs(2),
        "stopping lead() resigns"
    );
}
