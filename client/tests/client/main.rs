//! The client library against an in-process fake arbiter, optionally behind
//! a TCP proxy that can stop forwarding (a blocked network path). One test
//! binary; the harness pieces and scenarios live in `client/`.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod elections;
mod fake_arbiter;
mod fake_election;
mod fencing;
mod redaction;
mod reentrancy;

use std::time::Duration;

use latchkey_client::{Client, ClientConfig};

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

pub async fn dev_client(addr: std::net::SocketAddr) -> Client {
    let mut config = ClientConfig::insecure_dev(
        format!("http://{addr}"),
        "spiffe://latchkey.test/workload/demo",
    );
    config.connect_timeout = Duration::from_secs(2);
    config.request_timeout = Duration::from_secs(2);
    match Client::connect(config).await {
        Ok(client) => client,
        Err(err) => panic!("connect to {addr}: {err}"),
    }
}
