//! SVID rotation under a long-running Rust client (issue 37): SPIRE's SVIDs
//! last an hour, a client lives longer. The client takes up rotated files by
//! itself; later calls present the new certificate; the session and its hold
//! go on without a fence.
//!
//! A real rotation keeps the identity. Here the files are swapped to another
//! workload's SVID and back, because a call can show that from outside:
//! Inspect shows a holder's session only to the holder's own identity.

use std::path::Path;
use std::time::Duration;

use anyhow::ensure;
use latchkey_client::{Client, ClientConfig, TlsFiles};
use latchkey_tests::arbiter::certs;
use latchkey_tests::eventually;

use crate::client::{Fired, recorder, snapshot};
use crate::support::stack;

const KEY: &str = "demo/rotation";

/// Copies `name`'s SVID into `dir`, each file written beside and renamed
/// over, as SPIRE's helper does.
fn install(name: &str, dir: &Path) -> anyhow::Result<()> {
    let svid = certs()?.svid(name);
    for (from, to) in [(&svid.cert, "svid.pem"), (&svid.key, "svid.key")] {
        let tmp = dir.join(format!(".{to}.tmp"));
        std::fs::copy(from, &tmp)?;
        std::fs::rename(&tmp, dir.join(to))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rotated_svid_is_taken_up_without_a_fence() -> anyhow::Result<()> {
    let s = stack().await?;
    let dir = tempfile::tempdir()?;
    install("workload/alice", dir.path())?;
    let files = TlsFiles {
        ca: certs()?.ca(),
        cert: dir.path().join("svid.pem"),
        key: dir.path().join("svid.key"),
    };
    let mut config = ClientConfig::tls(format!("https://{}", s.arbiter.addr()), files);
    config.request_timeout = Duration::from_secs(5);
    let client = Client::connect(config).await?;
    let fired = Fired::default();
    let guard = client.lock(KEY, "demo").acquire(recorder(&fired)).await?;
    let session = guard.session_id();
    let seen = |client: &Client| {
        let client = client.clone();
        async move {
            Ok::<_, anyhow::Error>(
                client
                    .inspect(KEY)
                    .await?
                    .holder
                    .map(|h| h.session_id)
                    .unwrap_or(-1),
            )
        }
    };
    ensure!(seen(&client).await? == session, "alice sees her session");

    // Rotated to bob's SVID: later calls are bob's, who may not see it.
    install("workload/bob", dir.path())?;
    eventually(
        "calls to present the rotated certificate",
        Duration::from_secs(15),
        || async {
            ensure!(seen(&client).await? == 0, "still alice's certificate");
            Ok(())
        },
    )
    .await?;
    ensure!(
        client.svid_reloads() == 1,
        "{} reloads",
        client.svid_reloads()
    );

    // And back to alice's.
    install("workload/alice", dir.path())?;
    eventually(
        "calls to present alice's certificate again",
        Duration::from_secs(15),
        || async {
            ensure!(seen(&client).await? == session, "still bob's certificate");
            Ok(())
        },
    )
    .await?;
    ensure!(
        client.svid_reloads() == 2,
        "{} reloads",
        client.svid_reloads()
    );
    // Longer than the class's keepalive interval (TTL 15 s): renewals went on.
    tokio::time::sleep(Duration::from_secs(6)).await;
    ensure!(
        snapshot(&fired).is_empty(),
        "fenced: {:?}",
        snapshot(&fired)
    );
    ensure!(guard.can_start(), "the hold cannot start work");
    guard.release().await?;
    Ok(())
}
