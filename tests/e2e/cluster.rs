//! Tests of the 3-member etcd cluster harness: the faults the release gate injects must
//! do to a real cluster what the harness says (elections, catch-up, partitions,
//! restores that keep the cluster ID).

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_etcd::Client;
use latchkey_etcd::kv::{GetOptions, get_one};
use latchkey_tests::cluster::{ClusterOptions, EtcdCluster, remove_leftover_networks};
use latchkey_tests::{eventually, init_tracing};

/// Bounds one request: a paused or cut-off member never answers.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Elections take 1-2 election timeouts (1 s each); catch-up is a few heartbeats.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(20);

/// Member `i`'s own copy of `key` (a serializable read: no quorum involved).
async fn local_get(cluster: &EtcdCluster, i: usize, key: &str) -> anyhow::Result<Option<String>> {
    let mut client = cluster.member_client(i).await?;
    let options = GetOptions::new().with_serializable();
    let resp = tokio::time::timeout(REQUEST_TIMEOUT, client.get(key, Some(options)))
        .await
        .with_context(|| format!("serializable get on {} timed out", cluster.name(i)))??;
    match resp.kvs().first() {
        Some(kv) => Ok(Some(kv.value_str()?.to_owned())),
        None => Ok(None),
    }
}

/// Waits until member `i` has `key` = `value` locally.
async fn until_local(
    cluster: &EtcdCluster,
    i: usize,
    key: &str,
    value: Option<&str>,
) -> anyhow::Result<()> {
    let what = format!("{} to have {key} = {value:?}", cluster.name(i));
    eventually(&what, CONVERGE_TIMEOUT, || async {
        let local = local_get(cluster, i, key).await?;
        ensure!(local.as_deref() == value, "has {local:?}");
        Ok(())
    })
    .await
}

/// A put, retried until a request gets through (the client may first try a dead member).
async fn put(client: &Client, key: &str, value: &str) -> anyhow::Result<i64> {
    eventually(&format!("put {key}"), CONVERGE_TIMEOUT, || async {
        let mut client = client.clone();
        let resp = tokio::time::timeout(REQUEST_TIMEOUT, client.put(key, value, None))
            .await
            .context("put timed out")??;
        Ok(resp.header().context("put without header")?.revision())
    })
    .await
}

/// A linearizable get: `(value, revision)`.
async fn get(client: &mut Client, key: &str) -> anyhow::Result<(Option<String>, i64)> {
    let read = tokio::time::timeout(REQUEST_TIMEOUT, get_one(client, key))
        .await
        .context("get timed out")??;
    let revision = read.header.context("get without header")?.revision();
    let value = match read.value {
        Some(kv) => Some(kv.value_str()?.to_owned()),
        None => None,
    };
    Ok((value, revision))
}

async fn etcdctl_in_netns(ns: &str, endpoint: &str, args: &[&str]) -> anyhow::Result<Output> {
    tokio::process::Command::new("ip")
        .args(["netns", "exec", ns, "etcdctl", "--endpoints", endpoint])
        .args(["--dial-timeout", "1s", "--command-timeout", "2s"])
        .args(args)
        .env("ETCDCTL_API", "3")
        .output()
        .await
        .context("running etcdctl in the member's namespace")
}

#[tokio::test(flavor = "multi_thread")]
async fn three_members_elect_a_leader_and_replicate_a_put() -> anyhow::Result<()> {
    init_tracing();
    let cluster = EtcdCluster::start(ClusterOptions::default()).await?;
    assert_eq!(cluster.members(), 3);
    assert!(cluster.leader().await? < 3);

    let endpoints = cluster.endpoints();
    let own_netns = std::fs::read_link("/proc/self/ns/net")?;
    let mut namespaces = Vec::new();
    for (i, endpoint) in endpoints.iter().enumerate() {
        assert_eq!(cluster.name(i), format!("etcd-{i}"));
        assert!(cluster.log_path(i).is_file());
        assert!(!endpoint.contains("127.0.0.1"), "{endpoint}");
        // `ip netns exec` execs: the pid the harness signals is etcd's, in its own netns.
        let pid = cluster.pid(i).context("member not running")?;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))?;
        assert_eq!(comm.trim(), "etcd");
        assert_ne!(
            std::fs::read_link(format!("/proc/{pid}/ns/net"))?,
            own_netns
        );
        namespaces.push(cluster.netns(i).context("no netns")?.to_owned());
    }

    let client = cluster.client().await?;
    put(&client, "cluster/k", "v1").await?;
    let id = cluster.cluster_id().await?;
    for i in 0..3 {
        until_local(&cluster, i, "cluster/k", Some("v1")).await?;
        let status = cluster.member_client(i).await?.status().await?;
        assert_eq!(status.header().context("no header")?.cluster_id(), id);
    }

    drop(client);
    drop(cluster);
    for ns in namespaces {
        assert!(
            !Path::new("/run/netns").join(&ns).exists(),
            "{ns} left behind"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_follower_misses_writes_and_catches_up_after_restart() -> anyhow::Result<()> {
    init_tracing();
    let mut cluster = EtcdCluster::start(ClusterOptions::default()).await?;
    let leader = cluster.leader().await?;
    let follower = (leader + 1) % 3;
    let client = cluster.client().await?;
    put(&client, "cluster/k", "before").await?;
    until_local(&cluster, follower, "cluster/k", Some("before")).await?;

    cluster.kill(follower)?;
    assert!(cluster.pid(follower).is_none());
    assert!(local_get(&cluster, follower, "cluster/k").await.is_err());

    // Two of three still make a quorum.
    put(&client, "cluster/k", "while-down").await?;
    let mut leader_client = cluster.member_client(leader).await?;
    assert_eq!(
        get(&mut leader_client, "cluster/k").await?.0.as_deref(),
        Some("while-down")
    );

    cluster.restart(follower).await?;
    until_local(&cluster, follower, "cluster/k", Some("while-down")).await?;
    cluster.wait_healthy(CONVERGE_TIMEOUT).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn paused_leader_is_replaced_and_rejoins_as_follower() -> anyhow::Result<()> {
    init_tracing();
    let cluster = EtcdCluster::start(ClusterOptions::default()).await?;
    let old = cluster.leader().await?;
    put(&cluster.client().await?, "cluster/k", "before").await?;

    cluster.pause(old)?;
    let new = eventually("a new leader", CONVERGE_TIMEOUT, || async {
        let leader = cluster.leader().await?;
        ensure!(leader != old, "still {}", cluster.name(leader));
        Ok(leader)
    })
    .await?;
    put(
        &cluster.member_client(new).await?,
        "cluster/k",
        "during-pause",
    )
    .await?;
    assert!(
        local_get(&cluster, old, "cluster/k").await.is_err(),
        "a paused member must not answer"
    );

    cluster.resume(old)?;
    cluster.wait_healthy(CONVERGE_TIMEOUT).await?;
    until_local(&cluster, old, "cluster/k", Some("during-pause")).await?;
    assert_ne!(
        cluster.leader().await?,
        old,
        "the old leader rejoins as follower"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn partitioned_leader_is_cut_off_and_catches_up_after_heal() -> anyhow::Result<()> {
    init_tracing();
    let mut cluster = EtcdCluster::start(ClusterOptions::default()).await?;
    assert!(cluster.supports_partition());
    let cut = cluster.leader().await?;
    put(&cluster.client().await?, "cluster/k", "before").await?;
    until_local(&cluster, cut, "cluster/k", Some("before")).await?;

    cluster.partition(cut)?;
    // Clients in the root namespace cannot reach it.
    let mut cut_client = cluster.member_client(cut).await?;
    let status = tokio::time::timeout(REQUEST_TIMEOUT, cut_client.status()).await;
    assert!(
        !matches!(status, Ok(Ok(_))),
        "a partitioned member must be unreachable"
    );

    // The other two elect a leader and keep taking writes.
    let new = eventually(
        "a leader on the majority side",
        CONVERGE_TIMEOUT,
        || async {
            let leader = cluster.leader().await?;
            ensure!(leader != cut, "still {}", cluster.name(leader));
            Ok(leader)
        },
    )
    .await?;
    put(
        &cluster.member_client(new).await?,
        "cluster/k",
        "during-partition",
    )
    .await?;

    // From inside its namespace the member is alive but alone: its local state answers,
    // a linearizable read (needs its peers) does not.
    let ns = cluster.netns(cut).context("no netns")?.to_owned();
    let endpoint = cluster.endpoint(cut)?;
    let local = etcdctl_in_netns(
        &ns,
        &endpoint,
        &["get", "--consistency=s", "--print-value-only", "cluster/k"],
    )
    .await?;
    assert!(local.status.success(), "{local:?}");
    assert_eq!(String::from_utf8_lossy(&local.stdout).trim(), "before");
    let linearizable = etcdctl_in_netns(&ns, &endpoint, &["get", "cluster/k"]).await?;
    assert!(
        !linearizable.status.success(),
        "a cut-off member served a linearizable read: {linearizable:?}"
    );

    cluster.heal(cut)?;
    cluster.wait_healthy(CONVERGE_TIMEOUT).await?;
    until_local(&cluster, cut, "cluster/k", Some("during-partition")).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn restore_with_same_flags_keeps_cluster_id_and_rewinds() -> anyhow::Result<()> {
    init_tracing();
    let mut cluster = EtcdCluster::start(ClusterOptions::default()).await?;
    let client = cluster.client().await?;
    let snapshot_revision = put(&client, "cluster/k", "before").await?;
    let id = cluster.cluster_id().await?;
    let snapshots = tempfile::tempdir()?;
    let snapshot = snapshots.path().join("snap.db");
    cluster.snapshot_save(&snapshot).await?;

    put(&client, "cluster/k", "after").await?;
    let later_revision = put(&client, "cluster/later", "x").await?;
    drop(client);

    cluster.restore(&snapshot).await?;
    assert_eq!(
        cluster.cluster_id().await?,
        id,
        "same names/cluster/token: the cluster ID does not reveal the restore"
    );
    for i in 0..3 {
        until_local(&cluster, i, "cluster/k", Some("before")).await?;
        assert_eq!(local_get(&cluster, i, "cluster/later").await?, None);
    }
    let mut client = cluster.client().await?;
    let (value, revision) = eventually("a linearizable get", CONVERGE_TIMEOUT, || {
        let mut client = client.clone();
        async move { get(&mut client, "cluster/k").await }
    })
    .await?;
    assert_eq!(value.as_deref(), Some("before"));
    assert!(revision < later_revision, "{revision} !< {later_revision}");
    assert_eq!(
        revision, snapshot_revision,
        "back at the snapshot's revision"
    );
    // Still a working cluster.
    put(&client, "cluster/k", "again").await?;
    assert_eq!(
        get(&mut client, "cluster/k").await?.0.as_deref(),
        Some("again")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn loopback_cluster_works_and_refuses_partitions() -> anyhow::Result<()> {
    init_tracing();
    let mut cluster = EtcdCluster::start(ClusterOptions {
        members: 3,
        netns: false,
    })
    .await?;
    assert!(!cluster.supports_partition());
    let err = cluster.partition(0).unwrap_err().to_string();
    assert!(err.contains("network namespaces"), "{err}");
    assert!(cluster.heal(0).is_err());
    for (i, endpoint) in cluster.endpoints().iter().enumerate() {
        assert!(endpoint.starts_with("http://127.0.0.1:"), "{endpoint}");
        assert!(cluster.netns(i).is_none());
    }

    put(&cluster.client().await?, "cluster/k", "v").await?;
    for i in 0..3 {
        until_local(&cluster, i, "cluster/k", Some("v")).await?;
    }
    let follower = (cluster.leader().await? + 1) % 3;
    cluster.kill(follower)?;
    cluster.restart(follower).await?;
    cluster.wait_healthy(CONVERGE_TIMEOUT).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn leftover_networks_of_dead_processes_are_removed() -> anyhow::Result<()> {
    init_tracing();
    // A pid that just exited: the owner of "a crashed run".
    let mut gone = std::process::Command::new("true").spawn()?;
    let pid = gone.id();
    gone.wait()?;
    let ns = format!("lkc{pid:06x}ffm0");
    let bridge = format!("lkc{pid:06x}ffb");
    let ip = |args: &[&str]| -> anyhow::Result<()> {
        let status = std::process::Command::new("ip").args(args).status()?;
        ensure!(status.success(), "ip {args:?} failed");
        Ok(())
    };
    ip(&["netns", "add", &ns])?;
    ip(&["link", "add", &bridge, "type", "bridge"])?;
    // Its temp dir, and a process still using it (as an orphaned etcd would). Another
    // test's cluster start may remove the dir at any moment, so the orphan starts first
    // (every cleanup that sees the dir then also sees the orphan) and keeps running
    // without its file (`tail -F` retries): only a cleanup's SIGKILL may end it.
    let dir = std::env::temp_dir().join(format!("latchkey-cluster-{pid:06x}-crashed"));
    let mut orphan = std::process::Command::new("tail")
        .arg("-F")
        .arg(dir.join("etcd-0.log"))
        .stderr(std::process::Stdio::null())
        .spawn()?;
    std::fs::create_dir_all(&dir)?;

    // Another test's cluster start may remove them first; either way they go.
    tokio::task::spawn_blocking(remove_leftover_networks).await??;
    assert!(!Path::new("/run/netns").join(&ns).exists(), "{ns} left");
    assert!(
        !Path::new("/sys/class/net").join(&bridge).exists(),
        "{bridge} left"
    );
    assert!(!dir.exists(), "{} left", dir.display());
    let killed = eventually("the orphan to be killed", Duration::from_secs(5), || {
        let status = orphan.try_wait();
        async move { status?.context("still running") }
    })
    .await;
    let _ = orphan.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&killed?),
        Some(9)
    );
    Ok(())
}
