//! Tokens are capabilities: they must not reach Debug, Display, errors or
//! logs (ADR-22).

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use latchkey_client::{Error, FenceReason};
use parking_lot::Mutex;

use crate::fake_arbiter::{EPOCH, FakeArbiter};
use crate::{assert_eventually, dev_client};

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

fn spellings(token: u64) -> Vec<String> {
    vec![
        token.to_string(),
        format!("{token:x}"),
        format!("{token:X}"),
        format!("{:?}", token.to_be_bytes()),
    ]
}

fn assert_clean(what: &str, text: &str, token: u64) {
    for spelling in spellings(token) {
        assert!(!text.contains(&spelling), "{what} shows the token: {text}");
    }
}

// current_thread: every task runs under the capturing subscriber.
#[tokio::test(flavor = "current_thread")]
async fn the_token_shows_in_no_debug_display_error_or_log() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let arbiter = FakeArbiter::new(&[("short", 3)]);
    let addr = arbiter.serve().await;
    let client = dev_client(addr).await;
    let guard = match client.lock("secret/k", "short").acquire(|_| {}).await {
        Ok(g) => g,
        Err(e) => panic!("acquire: {e}"),
    };
    let token = guard.token().get();
    assert!(
        token > u64::from(EPOCH) << 48,
        "the fake grants real-looking tokens"
    );
    let nested = match client.lock("secret/k", "short").acquire(|_| {}).await {
        Ok(g) => g,
        Err(e) => panic!("acquire: {e}"),
    };

    assert_clean("guard Debug", &format!("{guard:?} {guard:#?}"), token);
    assert_clean(
        "token Display",
        &format!("{} {:?}", guard.token(), guard.token()),
        token,
    );
    assert_eq!(format!("{}", guard.token()), "FencingToken(<redacted>)");

    let inspection = match client.inspect("secret/k").await {
        Ok(i) => i,
        Err(e) => panic!("inspect: {e}"),
    };
    assert_eq!(
        inspection.holder.as_ref().map(|h| h.session_id),
        Some(guard.session_id())
    );
    assert_clean("inspection Debug", &format!("{inspection:?}"), token);

    let other = dev_client(addr).await;
    let held = match other.lock("secret/k", "short").acquire(|_| {}).await {
        Err(e) => e,
        Ok(_) => panic!("must be held"),
    };
    assert_clean("refusal", &format!("{held} {held:?}"), token);

    // Wrong-token release through the raw call: the refusal carries no token.
    let mismatch = client
        .release_grant(
            "secret/k",
            guard.session_id(),
            latchkey_client::FencingToken::new(token + 1),
        )
        .await;
    match mismatch {
        Err(e) => assert_clean("release refusal", &format!("{e} {e:?}"), token + 1),
        Ok(()) => panic!("a wrong token must be refused"),
    }

    let fenced = Error::Fenced {
        session_id: guard.session_id(),
        reason: FenceReason::DeadlineExceeded,
    };
    assert_clean("fenced error", &format!("{fenced} {fenced:?}"), token);

    drop(nested);
    drop(guard);
    assert_eventually!(
        FakeArbiter::count(&arbiter.counters.release) == 2,
        within = Duration::from_secs(2),
        "drop did not release"
    );
    let logs = String::from_utf8_lossy(&logs.0.lock()).to_string();
    assert!(
        logs.contains("acquired"),
        "the capture saw the library's logs"
    );
    assert_clean("logs", &logs, token);
}
