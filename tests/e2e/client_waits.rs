//! Waits longer than one ask (issue 37): the edge cuts a call at its route
//! timeout (90 s) and the arbiter a wait at `--max-wait-seconds`, so the Rust
//! client asks again, on the same session, until the wait's own deadline.
//! Here one ask is 1 s (`ClientConfig::wait_ask`), standing for the 50 s of
//! the default.

use std::time::Duration;

use anyhow::{bail, ensure};
use latchkey_client::{Client, ClientConfig, Error};
use tokio::time::Instant;
use tonic::Code;

use crate::client::{connect, tls};
use crate::support::stack;

async fn short_asks(addr: std::net::SocketAddr, name: &str) -> anyhow::Result<Client> {
    let mut config = ClientConfig::tls(format!("https://{addr}"), tls(name)?);
    config.wait_ask = Duration::from_secs(1);
    Ok(Client::connect(config).await?)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wait_longer_than_one_ask_asks_again_within_its_deadline() -> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let bob = short_asks(s.arbiter.addr(), "workload/bob").await?;
    let held = alice.lock("demo/long-wait", "demo").acquire(|_| {}).await?;
    let first = held.token();
    let started = Instant::now();
    let waiter = tokio::spawn(async move {
        let got = bob
            .lock("demo/long-wait", "demo")
            .wait(Duration::from_secs(10))
            .acquire(|_| {})
            .await;
        (started.elapsed(), got.map(|g| g.token()))
    });
    tokio::time::sleep(Duration::from_millis(3500)).await;
    ensure!(!waiter.is_finished(), "bob got a held key");
    held.release().await?;
    let (waited, token) = waiter.await?;
    let token = token?;
    ensure!(waited >= Duration::from_millis(3500), "{waited:?}");
    ensure!(token > first, "the later grant's token is not larger");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wait_that_outlives_its_asks_still_ends_at_its_deadline() -> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let bob = short_asks(s.arbiter.addr(), "workload/bob").await?;
    let _held = alice
        .lock("demo/long-timeout", "demo")
        .acquire(|_| {})
        .await?;
    let started = Instant::now();
    let got = bob
        .lock("demo/long-timeout", "demo")
        .wait(Duration::from_millis(2500))
        .acquire(|_| {})
        .await;
    let took = started.elapsed();
    // The arbiter answers WAIT_TIMEOUT a moment before the call's deadline;
    // should tonic's own deadline come first, it says CANCELLED.
    match got {
        Err(Error::Refused {
            code: Code::DeadlineExceeded | Code::Cancelled,
            ..
        }) => {}
        other => bail!("expected a deadline, got {other:?}"),
    }
    ensure!(
        took >= Duration::from_millis(2400) && took < Duration::from_secs(6),
        "{took:?}"
    );
    Ok(())
}
