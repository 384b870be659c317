//! A hostile review of the overload protection and the session counts
//! (issue 31): each of these failed before its fix.
//!
//! - An attacker's KeepAlive stream it does not read made its renewals look
//!   late, so the arbiter shed everyone's new work: renewals are now timed
//!   at the lanes (ask to etcd's answer), which no caller's stream moves.
//! - Queued calls cancelled by their clients kept (or leaked) their places.
//! - etcd's `created` answer on a new watch was taken as "the log is known
//!   up to its header revision", so opens and grants made since the read
//!   stopped counting before the watch showed them.

use std::time::Duration;

use anyhow::Context as _;
use latchkey_arbiter::overload::OverloadConfig;
use latchkey_proto::lockv1::KeepAliveRequest;
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_tests::arbiter::{ArbiterOptions, certs};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::support::*;

/// One pod of the attacker's per-pod identities (granted by the pattern
/// `spiffe://dev.latchkey/ns/payments/sa/ledger/*`).
const ATTACKER: &str = "ns/payments/sa/ledger/ledger-7d9f-a";
const VICTIM: &str = "workload/alice";

/// A channel whose HTTP/2 receive window is tiny: a client that does not
/// read its responses stops the server's sends after a few of them.
async fn stingy_channel(addr: std::net::SocketAddr, name: &str) -> anyhow::Result<Channel> {
    let certs = certs()?;
    let svid = certs.svid(name);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(certs.ca())?))
        .identity(Identity::from_pem(
            std::fs::read(&svid.cert)?,
            std::fs::read(&svid.key)?,
        ))
        .domain_name("localhost");
    Ok(Channel::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .initial_stream_window_size(Some(1024))
        .initial_connection_window_size(Some(1024))
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?)
}

async fn metric(s: &Stack, parts: &[&str]) -> anyhow::Result<u64> {
    let addr = s.arbiter.metrics_addr().context("no metrics listener")?;
    Ok(total(&scrape(addr).await?, parts))
}

/// An attacker with a valid SVID renews its own sessions on a KeepAlive
/// stream it does not read for a while. The arbiter's stream task blocks on
/// the full reply queue, so the renewals etcd already answered are not
/// polled. Timed from the message read to the answer (before the fix) each
/// counted seconds late, and one late window was enough: the arbiter cut
/// the limit and refused other tenants' new work (184-196 of 200 opens),
/// though etcd and every other renewal were on time. Timed at the lanes,
/// nothing the attacker's stream does moves the clock.
#[tokio::test(flavor = "multi_thread")]
async fn an_unread_keepalive_stream_does_not_make_the_arbiter_shed_others_new_work()
-> anyhow::Result<()> {
    let shed = unread_stream_then_victim_burst(true).await?;
    anyhow::ensure!(
        shed == 0,
        "{shed} of the victim's 200 opens refused OVERLOADED (renewals late); \
         only the attacker's unread stream was slow (the control, the same \
         renewals read at once, is refused nothing)"
    );
    Ok(())
}

/// The control: the same sessions renewed on a stream that is read.
#[tokio::test(flavor = "multi_thread")]
async fn control_the_same_renewals_read_at_once_shed_nothing() -> anyhow::Result<()> {
    let shed = unread_stream_then_victim_burst(false).await?;
    anyhow::ensure!(shed == 0, "{shed} refused in the control");
    Ok(())
}

/// Returns how many of the victim's 200 opens were refused OVERLOADED
/// with renewals late.
async fn unread_stream_then_victim_burst(stall: bool) -> anyhow::Result<usize> {
    const SESSIONS: usize = 3000;
    let s = stack_with(ArbiterOptions {
        metrics: true,
        max_sessions_per_identity: Some(4_000),
        overload: Some(OverloadConfig {
            max_in_flight: 64,
            min_in_flight: 2,
            // 2 s (the default is 1 s): well above what 3,000 renewals at
            // once take on a debug build, so the control is quiet
            renewal_target: Duration::from_secs(2),
            ..OverloadConfig::default()
        }),
        ..ArbiterOptions::default()
    })
    .await?;
    let attacker = s.arbiter.lock(ATTACKER).await?;
    let mut sessions = Vec::new();
    while sessions.len() < SESSIONS {
        let batch = (0..50).map(|_| {
            let mut c = attacker.clone();
            async move { open(&mut c, "demo").await }
        });
        for r in futures::future::join_all(batch).await {
            sessions.push(r?);
        }
    }
    anyhow::ensure!(
        metric(&s, &["latchkey_arbiter_renewals_late"]).await? == 0,
        "late before the attack"
    );

    // The control reads on an ordinary channel. (A reading client with a
    // small receive window, i.e. an honest slow consumer, was also seen to
    // trigger shedding: 173 of 200 in one run.)
    let mut stingy = match stall {
        true => LockClient::new(stingy_channel(s.arbiter.addr(), ATTACKER).await?),
        false => s.arbiter.lock(ATTACKER).await?,
    };
    let (tx, rx) = mpsc::channel(8);
    let mut replies = stingy
        .keep_alive(ReceiverStream::new(rx))
        .await?
        .into_inner();
    for chunk in sessions.chunks(1000) {
        tx.send(KeepAliveRequest {
            session_id: 0,
            session_ids: chunk.to_vec(),
        })
        .await?;
    }
    if stall {
        // Not reading.
        tokio::time::sleep(Duration::from_millis(3500)).await;
    }
    let mut got = 0;
    while got < SESSIONS {
        let r = replies.message().await?.context("stream ended")?;
        anyhow::ensure!(r.remaining_ttl_seconds > 0, "a session was lost");
        got += 1;
    }
    // Let the window close; the victim's burst rolls it.
    tokio::time::sleep(Duration::from_millis(150)).await;

    let victim = s.arbiter.lock(VICTIM).await?;
    let calls = (0..200).map(|_| {
        let mut c = victim.clone();
        async move { open_class(&mut c, "demo").await }
    });
    let results = futures::future::join_all(calls).await;
    let shed: Vec<_> = results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .filter(|st| {
            st.code() == Code::Unavailable && st.message().contains("renewals are running late")
        })
        .collect();
    let limit = metric(&s, &["latchkey_arbiter_new_work_limit"]).await?;
    eprintln!(
        "stall={stall}: {} of 200 victim opens shed, new_work_limit {limit}",
        shed.len()
    );
    drop(tx);
    Ok(shed.len())
}

/// A watch started in the past: etcd's first answer (`created`) has no
/// events and the store's current revision in its header, while the events
/// from the start revision on are still to come (etcd sends an unsynced
/// watcher's backlog from its sync loop, every 100 ms). follow.rs took that
/// header as "the log is known up to here", so opens and grants written
/// here in between stopped counting early. It must claim nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_watchs_first_answer_claims_no_revision_it_has_not_shown() -> anyhow::Result<()> {
    let etcd = latchkey_tests::etcd::EtcdServer::start().await?;
    let mut c = etcd.client().await?;
    let read_at = c
        .put("/p/a", "1", None)
        .await?
        .header()
        .context("header")?
        .revision();
    for i in 0..50 {
        c.put(format!("/p/k{i}"), "1", None).await?;
    }
    let options = latchkey_etcd::watch::WatchOptions::new().with_prefix();
    let mut stream = latchkey_etcd::watch::watch_from(&c, "/p/", read_at + 1, options).await?;
    let first = stream.message().await?.context("no answer")?;
    let claimed = first.header().map_or(0, |h| h.revision());
    eprintln!(
        "first answer: created={} events={} header revision={claimed} (watch from {})",
        first.created(),
        first.events().len(),
        read_at + 1
    );
    // what the counts' watch takes as known after this answer
    let at = latchkey_arbiter::lock_log::etcd::follow::known_through(&first).unwrap_or(read_at);
    anyhow::ensure!(
        at <= read_at + first.events().len() as i64,
        "follow.rs would mark the log known up to {at} after an answer with {} events \
         (the events {}..={claimed} are still to come)",
        first.events().len(),
        read_at + 1
    );
    Ok(())
}
