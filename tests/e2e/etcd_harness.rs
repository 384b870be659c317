//! Tests of the etcd harness itself: the faults later scenarios rely on must behave as
//! the harness documents (notably: a restore with the same flags keeps the cluster ID).

use std::time::Duration;

use anyhow::Context;
use latchkey_etcd::Client;
use latchkey_etcd::kv::get_one;
use latchkey_tests::etcd::{EtcdServer, RestoreFlags};
use latchkey_tests::{eventually, init_tracing};

async fn get(client: &mut Client, key: &str) -> anyhow::Result<(Option<String>, i64)> {
    let read = get_one(client, key).await.context("get")?;
    let revision = read.header.context("get without header")?.revision();
    let value = match read.value {
        Some(kv) => Some(kv.value_str()?.to_owned()),
        None => None,
    };
    Ok((value, revision))
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_restore_rewinds_and_keeps_or_changes_cluster_id() -> anyhow::Result<()> {
    init_tracing();
    let mut etcd = EtcdServer::start().await?;
    let endpoint = etcd.endpoint();
    let mut client = etcd.client().await?;

    client.put("latchkey/k", "before", None).await?;
    let (value, snapshot_revision) = get(&mut client, "latchkey/k").await?;
    assert_eq!(value.as_deref(), Some("before"));
    let original_id = etcd.cluster_id().await?;

    let snapshots = tempfile::tempdir()?;
    let snapshot = snapshots.path().join("snap.db");
    etcd.snapshot_save(&snapshot).await?;

    client.put("latchkey/k", "after", None).await?;
    client.put("latchkey/other", "x", None).await?;
    let (_, later_revision) = get(&mut client, "latchkey/k").await?;
    assert!(later_revision > snapshot_revision);

    etcd.restore(&snapshot, RestoreFlags::Same).await?;
    assert_eq!(etcd.endpoint(), endpoint, "same client port after restore");
    assert_eq!(
        etcd.cluster_id().await?,
        original_id,
        "same name/cluster/token: the cluster ID does not reveal the restore"
    );
    let mut client = etcd.client().await?;
    let (value, revision) = get(&mut client, "latchkey/k").await?;
    assert_eq!(value.as_deref(), Some("before"));
    assert_eq!(revision, snapshot_revision, "revision went back");
    assert_eq!(get(&mut client, "latchkey/other").await?.0, None);

    etcd.restore(&snapshot, RestoreFlags::Different).await?;
    assert_ne!(
        etcd.cluster_id().await?,
        original_id,
        "new token: new cluster ID"
    );
    let mut client = etcd.client().await?;
    assert_eq!(
        get(&mut client, "latchkey/k").await?.0.as_deref(),
        Some("before")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_keeps_data_and_kill_stops_serving() -> anyhow::Result<()> {
    init_tracing();
    let mut etcd = EtcdServer::start().await?;
    let id = etcd.cluster_id().await?;
    etcd.client().await?.put("k", "v", None).await?;

    etcd.kill()?;
    assert!(etcd.pid().is_none());
    assert!(
        etcd.cluster_id().await.is_err(),
        "killed etcd must not answer"
    );

    etcd.restart().await?;
    assert_eq!(etcd.cluster_id().await?, id);
    let mut client = etcd.client().await?;
    assert_eq!(get(&mut client, "k").await?.0.as_deref(), Some("v"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn pause_stalls_requests_until_resume() -> anyhow::Result<()> {
    init_tracing();
    let etcd = EtcdServer::start().await?;
    let mut client = etcd.client().await?;
    client.put("k", "v", None).await?;

    etcd.pause()?;
    let stalled = tokio::time::timeout(Duration::from_millis(300), client.get("k", None)).await;
    assert!(stalled.is_err(), "a paused etcd must not answer");

    etcd.resume()?;
    let value = eventually(
        "etcd to answer after SIGCONT",
        Duration::from_secs(10),
        || {
            let mut client = client.clone();
            async move { get(&mut client, "k").await }
        },
    )
    .await?;
    assert_eq!(value.0.as_deref(), Some("v"));
    Ok(())
}
