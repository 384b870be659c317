//! The latchctl binary against the client library's in-process fake arbiter
//! (shared with `client/tests`), optionally behind a TCP proxy that can stop
//! forwarding. The real-arbiter scenarios are in `tests/e2e/latchctl.rs`.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod cli;
#[path = "../../../client/tests/client/fake_arbiter.rs"]
mod fake_arbiter;

/// Polls `cond` every 10 ms until it holds or `within` passes.
#[macro_export]
macro_rules! assert_eventually {
    ($cond:expr, within = $within:expr, $($msg:tt)+) => {{
        let deadline = tokio::time::Instant::now() + $within;
        loop {
            if $cond {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!($($msg)+);
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }};
}
