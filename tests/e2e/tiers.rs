//! Two tiers (ADR-07) on two real etcd clusters: with `--split-tiers`, keys
//! in a namespace a coord-tier class names (`leader`, in policies/dev) live
//! on the coord cluster, every other key on the lock (entity) cluster. A
//! key's tier is the key's, not the caller's: a class or a session of the
//! other tier is refused before anything is written, so no key can be held
//! on both clusters. Sessions are leases on their class's tier; session
//! calls (KeepAlive, CloseSession) find the cluster from the session id.
//! The coord tier's grants are witnessed by the entity cluster, so a second
//! arbiter with an empty state directory serves both tiers unsealed, and
//! the coord tier's epoch advances on its own.

use std::time::Duration;

use latchkey_proto::adminv1::{AdvanceEpochRequest, GetStatusRequest};
use latchkey_proto::lockv1::{
    CloseSessionRequest, KeepAliveRequest, KeepAliveResponse, OpenSessionRequest,
};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, Coord};
use latchkey_tests::etcd::EtcdServer;
use tonic::Code;

use latchkey_records::token::unpack;

use crate::support::*;

const COORD_CLASS: &str = "leader";
const ENTITY_CLASS: &str = "batch-report";

/// The holder record of `key` on `etcd`, as its mod revision.
async fn held_at(etcd: &EtcdServer, key: &str) -> anyhow::Result<Option<i64>> {
    let mut kv = etcd.client().await?.kv_client();
    let resp = kv.get(layout().holder(key), None).await?;
    Ok(resp.kvs().first().map(|kv| kv.mod_revision()))
}

/// Renews `sessions` with one KeepAlive message on a fresh stream: one
/// answer per session, in the order they come.
async fn renew_once(c: &mut Client, sessions: &[i64]) -> anyhow::Result<Vec<KeepAliveResponse>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(KeepAliveRequest {
        session_id: sessions[0],
        session_ids: sessions[1..].to_vec(),
    })
    .await?;
    let mut stream = c
        .keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut answers = Vec::new();
    while answers.len() < sessions.len() {
        answers.push(
            tokio::time::timeout(Duration::from_secs(10), stream.message())
                .await??
                .ok_or_else(|| anyhow::anyhow!("the keepalive stream ended"))?,
        );
    }
    Ok(answers)
}

/// The value of `key` on `etcd`.
async fn value_at(etcd: &EtcdServer, key: &str) -> anyhow::Result<Option<Vec<u8>>> {
    let mut kv = etcd.client().await?.kv_client();
    let got = kv.get(key, None).await?;
    Ok(got.kvs().first().map(|kv| kv.value().to_vec()))
}

/// Every key under the arbiter's prefix on `etcd`.
async fn keys_on(etcd: &EtcdServer) -> anyhow::Result<Vec<String>> {
    let mut kv = etcd.client().await?.kv_client();
    let resp = kv
        .get(
            "/latchkey/",
            Some(
                latchkey_etcd::kv::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await?;
    Ok(resp
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect())
}

async fn split_arbiter(lock: &EtcdServer, coord: &EtcdServer) -> anyhow::Result<Arbiter> {
    Arbiter::start(
        lock,
        ArbiterOptions {
            coord: Some(Coord::split(coord)),
            ..Default::default()
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn each_key_lives_on_its_tiers_cluster_and_the_other_tier_is_refused() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let coord = EtcdServer::start().await?;
    let arbiter = split_arbiter(&lock, &coord).await?;
    let mut c = arbiter.lock("workload/demo").await?;

    // A coord-tier key on the coord cluster, an entity key on the lock cluster.
    let coord_session = open(&mut c, COORD_CLASS).await?;
    let entity_session = open(&mut c, ENTITY_CLASS).await?;
    assert_ne!(
        coord_session & (1 << 52),
        0,
        "coord sessions carry the tier bit"
    );
    assert_eq!(entity_session & (1 << 52), 0);
    let leader = try_lock(&mut c, "leader/scheduler", COORD_CLASS, coord_session).await?;
    let entity = try_lock(&mut c, "demo/tiers/a", ENTITY_CLASS, entity_session).await?;
    assert_eq!(
        held_at(&coord, "leader/scheduler").await?,
        Some(leader.revision)
    );
    assert_eq!(held_at(&lock, "leader/scheduler").await?, None);
    assert_eq!(held_at(&lock, "demo/tiers/a").await?, Some(entity.revision));
    assert_eq!(held_at(&coord, "demo/tiers/a").await?, None);
    // Each token is its own cluster's revision under that cluster's epoch.
    assert_eq!(unpack(leader.token).1, leader.revision);
    assert_eq!(unpack(entity.token).1, entity.revision);

    // The other tier's class or session is refused, and writes nothing.
    let (lock_before, coord_before) = (lock.revision().await?, coord.revision().await?);
    let refused = expect_refusal(
        try_lock(&mut c, "demo/tiers/b", COORD_CLASS, coord_session).await,
        Code::InvalidArgument,
        "WRONG_TIER",
    )?;
    assert!(
        refused.message().contains("entity tier") && refused.message().contains("\"leader\""),
        "{}",
        refused.message()
    );
    expect_refusal(
        try_lock(&mut c, "leader/other", ENTITY_CLASS, entity_session).await,
        Code::InvalidArgument,
        "WRONG_TIER",
    )?;
    // A coord-tier key with an entity session: answered like a session of
    // another class (the client library opens one for the class).
    let refused = expect_refusal(
        try_lock(&mut c, "leader/other", COORD_CLASS, entity_session).await,
        Code::InvalidArgument,
        "SESSION_CLASS_MISMATCH",
    )?;
    assert!(
        refused.message().contains("open a session"),
        "{}",
        refused.message()
    );
    // A wrong-tier class on a namespace nobody has served yet binds nothing.
    expect_refusal(
        try_lock(&mut c, "payments/tiers/x", COORD_CLASS, coord_session).await,
        Code::InvalidArgument,
        "WRONG_TIER",
    )?;
    assert_eq!(lock.revision().await?, lock_before);
    assert_eq!(coord.revision().await?, coord_before);

    // Reuse: a session of the other tier is never handed back for a class.
    let reused = c
        .open_session(OpenSessionRequest {
            class: COORD_CLASS.into(),
            reuse_session_ids: vec![entity_session, coord_session],
        })
        .await?
        .into_inner();
    assert!(reused.reused);
    assert_eq!(reused.session_id, coord_session);

    // KeepAlive renews both sessions in one message, each on its cluster.
    let mut renewed = Vec::new();
    for resp in renew_once(&mut c, &[coord_session, entity_session]).await? {
        assert!(resp.remaining_ttl_seconds > 0, "{resp:?}");
        renewed.push(resp.session_id);
    }
    renewed.sort_unstable();
    let mut both = vec![coord_session, entity_session];
    both.sort_unstable();
    assert_eq!(renewed, both);

    // Release and close find the coord cluster too.
    release(&mut c, &leader).await?;
    assert_eq!(held_at(&coord, "leader/scheduler").await?, None);
    let again = try_lock(&mut c, "leader/scheduler", COORD_CLASS, coord_session).await?;
    assert!(again.token > leader.token);
    c.close_session(CloseSessionRequest {
        session_id: coord_session,
    })
    .await?;
    latchkey_tests::eventually(
        "the coord hold to end with its session",
        Duration::from_secs(10),
        || async {
            anyhow::ensure!(
                held_at(&coord, "leader/scheduler").await?.is_none(),
                "still held"
            );
            Ok(())
        },
    )
    .await?;
    // The entity hold is untouched by the coord session's close.
    assert_eq!(held_at(&lock, "demo/tiers/a").await?, Some(entity.revision));

    // Nothing of the coord tier's locks is on the lock cluster but the
    // coord tier's witness records; nothing of the entity tier's on coord.
    assert!(
        keys_on(&lock).await?.iter().all(|k| !k.contains("leader/")),
        "{:?}",
        keys_on(&lock).await?
    );
    assert!(
        keys_on(&coord).await?.iter().all(|k| !k.contains("demo/")),
        "{:?}",
        keys_on(&coord).await?
    );
    arbiter.stop().await
}

#[tokio::test(flavor = "multi_thread")]
async fn each_tier_has_its_own_epoch_and_a_fresh_arbiter_serves_both_unsealed() -> anyhow::Result<()>
{
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let coord = EtcdServer::start().await?;
    let first = split_arbiter(&lock, &coord).await?;
    let mut c = first.lock("workload/demo").await?;
    let session = open(&mut c, COORD_CLASS).await?;
    let before = try_lock(&mut c, "leader/a", COORD_CLASS, session).await?;
    release(&mut c, &before).await?;

    // Status per tier; an unknown tier is a clear error.
    let mut admin = first.admin("latchkey/operator").await?;
    let status = |tier: &str| GetStatusRequest { tier: tier.into() };
    let coord_status = admin.get_status(status("coord")).await?.into_inner();
    let entity_status = admin.get_status(status("")).await?.into_inner();
    assert_eq!(
        (coord_status.tier.as_str(), coord_status.tiers_split),
        ("coord", true)
    );
    assert_eq!(entity_status.tier, "entity");
    assert_eq!(coord_status.current_cluster_id, coord.cluster_id().await?);
    assert_eq!(entity_status.current_cluster_id, lock.cluster_id().await?);
    assert!(!coord_status.sealed && !entity_status.sealed);
    let bad = admin.get_status(status("edge")).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("unknown tier"), "{}", bad.message());

    // Advancing the coord tier's epoch leaves the entity tier's alone.
    let advanced = admin
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: coord_status.epoch,
            reason: "tiers e2e".into(),
            at_least_epoch: 0,
            tier: "coord".into(),
        })
        .await?
        .into_inner();
    assert!(advanced.epoch > coord_status.epoch);
    assert_eq!(
        admin.get_status(status("")).await?.into_inner().epoch,
        entity_status.epoch
    );
    let session = open(&mut c, COORD_CLASS).await?;
    let after = try_lock(&mut c, "leader/a", COORD_CLASS, session).await?;
    assert_eq!(after.epoch, advanced.epoch);
    assert!(after.token > before.token);
    release(&mut c, &after).await?;

    // A second arbiter with an empty state directory (no
    // --trust-unwitnessed-log): the entity cluster witnesses the coord
    // tier, so it serves coord keys at once, with tokens above the first's.
    let second = Arbiter::start(
        &lock,
        ArbiterOptions {
            coord: Some(Coord::split(&coord)),
            trust_unwitnessed_log: false,
            ..Default::default()
        },
    )
    .await?;
    let mut c2 = second.lock("workload/demo").await?;
    let s2 = open(&mut c2, COORD_CLASS).await?;
    let third = try_lock(&mut c2, "leader/a", COORD_CLASS, s2).await?;
    assert!(third.token > after.token);
    let mut admin2 = second.admin("latchkey/operator").await?;
    assert!(
        !admin2
            .get_status(status("coord"))
            .await?
            .into_inner()
            .sealed
    );
    second.stop().await?;
    first.stop().await
}

#[tokio::test(flavor = "multi_thread")]
async fn one_cluster_serves_both_tiers_without_split_tiers() -> anyhow::Result<()> {
    // The default: --coord-etcd witnesses, and both tiers' keys stay on the
    // lock cluster, with any class (as before tiers existed).
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let coord = EtcdServer::start().await?;
    let arbiter = Arbiter::start(
        &lock,
        ArbiterOptions {
            coord: Some(Coord::on(&coord)),
            ..Default::default()
        },
    )
    .await?;
    let mut c = arbiter.lock("workload/demo").await?;
    let session = open(&mut c, COORD_CLASS).await?;
    assert_eq!(session & (1 << 52), 0);
    let g = try_lock(&mut c, "leader/x", COORD_CLASS, session).await?;
    assert_eq!(held_at(&lock, "leader/x").await?, Some(g.revision));
    let entity = open(&mut c, ENTITY_CLASS).await?;
    let d = try_lock(&mut c, "demo/tiers/single", COORD_CLASS, session).await?;
    release(&mut c, &d).await?;
    let e = try_lock(&mut c, "demo/tiers/single", ENTITY_CLASS, entity).await?;
    assert!(e.token > d.token);
    let mut admin = arbiter.admin("latchkey/operator").await?;
    let refused = admin
        .get_status(GetStatusRequest {
            tier: "coord".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("not split"),
        "{}",
        refused.message()
    );
    arbiter.stop().await
}

#[test]
fn split_tiers_without_a_coord_cluster_is_refused_at_start() -> anyhow::Result<()> {
    let mut config = latchkey_arbiter::Config::new(
        vec!["http://127.0.0.1:2".into()],
        std::path::PathBuf::from("policies/dev"),
        std::env::temp_dir(),
    );
    config.split_tiers = true;
    let err = config.check_coord().unwrap_err();
    assert!(err.to_string().contains("pass --coord-etcd"), "{err}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_stays_on_the_tier_that_first_served_it() -> anyhow::Result<()> {
    // Arbiters reload policies at different moments and roll out one by
    // one: the namespace's binding on the coord cluster, not each
    // arbiter's policies, decides its cluster, so no key is ever served by
    // both clusters.
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let coord = EtcdServer::start().await?;

    // A hold from before tiers: an arbiter with no coord cluster at all.
    let old = Arbiter::start(&lock, ArbiterOptions::default()).await?;
    let mut c_old = old.lock("workload/demo").await?;
    let s_old = open(&mut c_old, COORD_CLASS).await?;
    let legacy = try_lock(&mut c_old, "leader/legacy", COORD_CLASS, s_old).await?;

    // The split arbiter will not take `leader` to the coord cluster under
    // it: UNAVAILABLE, retry (it says nothing about whose holds).
    let split = split_arbiter(&lock, &coord).await?;
    let mut c = split.lock("workload/demo").await?;
    let s = open(&mut c, COORD_CLASS).await?;
    let refused = expect_refusal(
        try_lock(&mut c, "leader/legacy", COORD_CLASS, s).await,
        Code::Unavailable,
        "TIER_MOVING",
    )?;
    assert!(
        refused.message().contains("retry later"),
        "{}",
        refused.message()
    );
    assert!(
        !refused.message().contains("workload/"),
        "{}",
        refused.message()
    );
    release(&mut c_old, &legacy).await?;
    old.stop().await?;
    // The same key on the coord cluster now: its token is above the one
    // the entity cluster gave it (the coord tier's epoch was raised above
    // the entity tier's before the namespace was bound to it).
    let g = try_lock(&mut c, "leader/legacy", COORD_CLASS, s).await?;
    assert_eq!(held_at(&coord, "leader/legacy").await?, Some(g.revision));
    assert!(
        g.token > legacy.token,
        "the moved key's token went back: {:#x} after {:#x}",
        g.token,
        legacy.token
    );
    release(&mut c, &g).await?;
    let g = try_lock(&mut c, "leader/new", COORD_CLASS, s).await?;
    assert_eq!(held_at(&coord, "leader/new").await?, Some(g.revision));
    // The binding is on both clusters.
    assert_eq!(
        value_at(&coord, "/latchkey-coord/sys/tiers/default/leader").await?,
        Some(b"coord".to_vec())
    );
    assert_eq!(
        value_at(&lock, "/latchkey/sys/tiers/leader").await?,
        Some(b"coord".to_vec())
    );

    // An arbiter without --split-tiers beside it (a rollout) refuses the
    // coord-bound namespace instead of granting it on the lock cluster...
    let single = Arbiter::start(
        &lock,
        ArbiterOptions {
            coord: Some(Coord::on(&coord)),
            ..Default::default()
        },
    )
    .await?;
    let mut c1 = single.lock("workload/demo").await?;
    let s1 = open(&mut c1, COORD_CLASS).await?;
    let refused = expect_refusal(
        try_lock(&mut c1, "leader/new", COORD_CLASS, s1).await,
        Code::Unavailable,
        "TIER_MOVING",
    )?;
    assert!(
        refused.message().contains("bound to the coord tier"),
        "{}",
        refused.message()
    );
    // ... and binds what it serves first to the entity tier.
    let sb = open(&mut c1, ENTITY_CLASS).await?;
    let b = try_lock(&mut c1, "payments/tiers", ENTITY_CLASS, sb).await?;
    release(&mut c1, &b).await?;
    assert_eq!(held_at(&lock, "leader/new").await?, None);
    let mut kv = coord.client().await?.kv_client();
    let bound = kv
        .get("/latchkey-coord/sys/tiers/default/leader", None)
        .await?;
    assert_eq!(
        bound.kvs().first().map(|kv| kv.value().to_vec()),
        Some(b"coord".to_vec())
    );
    let bound = kv
        .get("/latchkey-coord/sys/tiers/default/payments", None)
        .await?;
    assert_eq!(
        bound.kvs().first().map(|kv| kv.value().to_vec()),
        Some(b"entity".to_vec())
    );
    // The split arbiter serves `payments` on the entity cluster, as bound.
    let se = open(&mut c, ENTITY_CLASS).await?;
    let p = try_lock(&mut c, "payments/tiers", ENTITY_CLASS, se).await?;
    assert_eq!(held_at(&lock, "payments/tiers").await?, Some(p.revision));
    release(&mut c, &p).await?;
    single.stop().await?;
    split.stop().await
}

#[tokio::test(flavor = "multi_thread")]
async fn per_identity_bounds_and_ownership_hold_across_both_tiers() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let coord = EtcdServer::start().await?;
    let arbiter = Arbiter::start(
        &lock,
        ArbiterOptions {
            coord: Some(Coord::split(&coord)),
            max_sessions_per_identity: Some(2),
            max_holds_per_identity: Some(2),
            ..Default::default()
        },
    )
    .await?;
    let mut c = arbiter.lock("workload/demo").await?;

    // Sessions: one on each tier uses the bound of two; a third on either
    // tier is refused (the split does not double the bound).
    let coord_session = open(&mut c, COORD_CLASS).await?;
    let entity_session = open(&mut c, ENTITY_CLASS).await?;
    for class in [COORD_CLASS, ENTITY_CLASS] {
        expect_refusal(
            c.open_session(OpenSessionRequest {
                class: class.into(),
                reuse_session_ids: vec![],
            })
            .await
            .map(|r| r.into_inner()),
            Code::ResourceExhausted,
            "IDENTITY_LIMIT",
        )?;
    }

    // Holds: one on each tier uses the bound of two.
    let a = try_lock(&mut c, "leader/bound", COORD_CLASS, coord_session).await?;
    let b = try_lock(&mut c, "demo/tiers/bound", ENTITY_CLASS, entity_session).await?;
    for (key, class, session) in [
        ("leader/bound2", COORD_CLASS, coord_session),
        ("demo/tiers/bound2", ENTITY_CLASS, entity_session),
    ] {
        expect_refusal(
            try_lock(&mut c, key, class, session).await,
            Code::ResourceExhausted,
            "IDENTITY_LIMIT",
        )?;
    }

    // Another identity cannot close or renew a coord-tier session, and
    // learns nothing from trying.
    let mut alice = arbiter.lock("workload/alice").await?;
    expect_refusal(
        alice
            .close_session(CloseSessionRequest {
                session_id: coord_session,
            })
            .await
            .map(|r| r.into_inner()),
        Code::FailedPrecondition,
        "SESSION_EXPIRED",
    )?;
    for resp in renew_once(&mut alice, &[coord_session]).await? {
        assert_eq!(resp.remaining_ttl_seconds, 0, "{resp:?}");
    }
    // ... and demo's hold and session are still there.
    assert_eq!(held_at(&coord, "leader/bound").await?, Some(a.revision));
    release(&mut c, &a).await?;
    release(&mut c, &b).await?;
    arbiter.stop().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restored_coord_cluster_never_reissues_a_coord_tier_token() -> anyhow::Result<()> {
    // Issue 15's promise for the coord tier: its cluster restored from a
    // snapshot with the same member flags, every arbiter's state dir lost.
    // The entity cluster witnesses the coord tier, so the fresh arbiter
    // seals it, and after the operator's advance every coord-tier token is
    // above every one handed out before.
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let mut coord = EtcdServer::start().await?;
    let first = split_arbiter(&lock, &coord).await?;
    let mut c = first.lock("workload/demo").await?;
    let session = open(&mut c, COORD_CLASS).await?;
    churn_in(&mut c, "leader", COORD_CLASS, session, 3).await?;
    let snapshot = tempfile::NamedTempFile::new()?;
    coord.snapshot_save(snapshot.path()).await?;
    let before_restore = churn_in(&mut c, "leader", COORD_CLASS, session, 20).await?;
    first.stop().await?; // its temporary state dir goes with it

    let cluster_id = coord.cluster_id().await?;
    coord
        .restore(snapshot.path(), latchkey_tests::etcd::RestoreFlags::Same)
        .await?;
    assert_eq!(coord.cluster_id().await?, cluster_id);
    let second = split_arbiter(&lock, &coord).await?;
    let mut op = second.admin("latchkey/operator").await?;
    let status = op
        .get_status(GetStatusRequest {
            tier: "coord".into(),
        })
        .await?
        .into_inner();
    assert!(status.sealed, "the coord tier must seal: {status:?}");
    let mut c = second.lock("workload/demo").await?;
    expect_refusal(
        open_class(&mut c, COORD_CLASS).await,
        Code::FailedPrecondition,
        "SEALED",
    )?;
    let advanced = op
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: status.epoch,
            reason: "coord cluster restored".into(),
            at_least_epoch: 0,
            tier: "coord".into(),
        })
        .await?
        .into_inner();
    let session = open(&mut c, COORD_CLASS).await?;
    let after = churn_in(&mut c, "leader", COORD_CLASS, session, 3).await?;
    assert!(
        after > before_restore,
        "a coord-tier token went back: {after:#x} after {before_restore:#x} (epoch {})",
        advanced.epoch
    );
    second.stop().await
}

#[tokio::test(flavor = "multi_thread")]
async fn leader_election_survives_the_entity_clusters_quorum_loss() -> anyhow::Result<()> {
    // ADR-07's point: with 2 of the entity cluster's 3 members down, the
    // coord tier keeps granting fenced tokens (its cluster and its witness
    // are elsewhere), the entity tier's closed class refuses with
    // UNAVAILABLE and its open class grants unprotected from memory.
    use latchkey_tests::cluster::{ClusterOptions, EtcdCluster};
    latchkey_tests::init_tracing();
    let mut entity = EtcdCluster::start(ClusterOptions::default()).await?;
    let coord = EtcdServer::start().await?;
    let witness = EtcdServer::start().await?;
    let policies = tempfile::tempdir()?;
    latchkey_tests::copy_dev_policies(policies.path())?;
    std::fs::write(
        policies.path().join("classes/quorum-loss.toml"),
        crate::quorum_loss::OPEN_CLASS,
    )?;
    let arbiter = Arbiter::start_on(
        entity.endpoints(),
        ArbiterOptions {
            policies_dir: policies.path().to_path_buf(),
            coord: Some(Coord {
                coord_tier_witness: vec![witness.endpoint()],
                ..Coord::split(&coord)
            }),
            metrics: true,
            ..Default::default()
        },
    )
    .await?;
    let mut c = arbiter.lock("workload/demo").await?;
    let coord_session = open(&mut c, COORD_CLASS).await?;
    let closed_session = open(&mut c, ENTITY_CLASS).await?;
    let open_session = open(&mut c, "spare-capacity").await?;
    let before = try_lock(&mut c, "leader/q", COORD_CLASS, coord_session).await?;
    release(&mut c, &before).await?;
    let entity_before = try_lock(&mut c, "demo/q/closed", ENTITY_CLASS, closed_session).await?;
    release(&mut c, &entity_before).await?;

    let leader = entity.leader().await?;
    entity.kill(leader)?;
    entity.kill((leader + 1) % 3)?;
    let converge = Duration::from_secs(30);
    latchkey_tests::eventually(
        "the entity tier to refuse its closed class",
        converge,
        || {
            let mut c = c.clone();
            async move {
                let r = try_lock(&mut c, "demo/q/closed", ENTITY_CLASS, closed_session).await;
                let status = expect_refusal(r, Code::Unavailable, "STORE_UNAVAILABLE")?;
                anyhow::ensure!(
                    status.message().contains("lost quorum"),
                    "{}",
                    status.message()
                );
                Ok(())
            }
        },
    )
    .await?;
    // The coord tier grants fenced tokens throughout, above the earlier one.
    let mut last = before.token;
    for i in 0..5 {
        let g = try_lock(&mut c, &format!("leader/q{i}"), COORD_CLASS, coord_session).await?;
        assert!(!g.unprotected && g.token > last, "{g:?} after {last:#x}");
        last = g.token;
        release(&mut c, &g).await?;
    }
    // The entity tier's open class: token 0, unprotected.
    let memory = try_lock(&mut c, "demo/q/open", "spare-capacity", open_session).await?;
    assert!(memory.unprotected && memory.token == 0, "{memory:?}");
    release(&mut c, &memory).await?;
    let mut op = arbiter.admin("latchkey/operator").await?;
    let coord_status = op
        .get_status(GetStatusRequest {
            tier: "coord".into(),
        })
        .await?
        .into_inner();
    assert!(
        !coord_status.quorum_lost && !coord_status.sealed,
        "{coord_status:?}"
    );
    let entity_status = op
        .get_status(GetStatusRequest::default())
        .await?
        .into_inner();
    assert!(entity_status.quorum_lost, "{entity_status:?}");
    // The metrics say it per tier.
    let metrics_addr = arbiter
        .metrics_addr()
        .ok_or_else(|| anyhow::anyhow!("no metrics address"))?;
    let text = latchkey_tests::envoy::admin_get(metrics_addr, "/metrics").await?;
    for line in [
        "latchkey_arbiter_quorum_lost 1",
        "latchkey_arbiter_coord_tier_quorum_lost 0",
        "latchkey_arbiter_coord_tier_sealed 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
    }

    entity.restart(leader).await?;
    entity.restart((leader + 1) % 3).await?;
    entity.wait_healthy(converge).await?;
    arbiter.stop().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_from_before_the_split_with_the_coord_bit_still_works() -> anyhow::Result<()> {
    // Session ids were drawn below 2^53 before the tiers existed, so about
    // half of them carry bit 52, which now means "coord tier". Such a
    // session lives on the entity cluster: it must still acquire, renew and
    // close there.
    latchkey_tests::init_tracing();
    let lock = EtcdServer::start().await?;
    let coord = EtcdServer::start().await?;
    let arbiter = split_arbiter(&lock, &coord).await?;
    let mut c = arbiter.lock("workload/demo").await?;
    let ttl = c
        .open_session(OpenSessionRequest {
            class: ENTITY_CLASS.into(),
            reuse_session_ids: vec![],
        })
        .await?
        .into_inner()
        .ttl_seconds;
    // What the old arbiter wrote: a lease with its own id, and the record.
    let legacy: i64 = (1 << 52) | 0x5eed;
    let mut etcd = lock.client().await?;
    etcd.lease_grant(
        i64::from(ttl),
        Some(latchkey_etcd::lease::LeaseGrantOptions::new().with_id(legacy)),
    )
    .await?;
    let record =
        format!(r#"{{"identity":"spiffe://dev.latchkey/workload/demo","ttlSeconds":{ttl}}}"#);
    etcd.put(
        layout().session(legacy),
        record,
        Some(latchkey_etcd::kv::PutOptions::new().with_lease(legacy)),
    )
    .await?;

    let g = try_lock(&mut c, "demo/tiers/legacy", ENTITY_CLASS, legacy).await?;
    assert_eq!(held_at(&lock, "demo/tiers/legacy").await?, Some(g.revision));
    for resp in renew_once(&mut c, &[legacy]).await? {
        assert!(resp.remaining_ttl_seconds > 0, "{resp:?}");
    }
    c.close_session(CloseSessionRequest { session_id: legacy })
        .await?;
    latchkey_tests::eventually(
        "the legacy session's hold to end",
        Duration::from_secs(10),
        || async {
            anyhow::ensure!(
                held_at(&lock, "demo/tiers/legacy").await?.is_none(),
                "still held"
            );
            Ok(())
        },
    )
    .await?;
    arbiter.stop().await
}
