//! Entity shards and moves (ADR-09) on real etcd clusters: an operator adds
//! a shard; the ranges whose home changes take no new grants while their
//! holds on the old shard last; the old shard is fenced at the new map
//! version, so an arbiter that does not follow the map cannot grant there;
//! the new shard's epoch is raised above the old one's, so every moved key's
//! next token is above every token its old home issued. One session serves
//! keys on both shards (its shadow on the new one is renewed with it and
//! ends with it).

use std::collections::BTreeMap;
use std::time::Duration;

use latchkey_arbiter::shards::ShardMap;
use latchkey_arbiter::shards::ShardMaps as _;
use latchkey_arbiter::shards::etcd::ShardMapStore;
use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::adminv1::change_shards_request::Change;
use latchkey_proto::adminv1::{
    AddShard, CancelMove, ChangeShardsRequest, GetShardsRequest, PinNamespace, ShardStatus,
    StepShardMoveRequest,
};
use latchkey_proto::lockv1::{CloseSessionRequest, KeepAliveRequest};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, Coord};
use latchkey_tests::etcd::EtcdServer;
use tonic::Code;
use tonic::transport::Channel;

use crate::support::*;

const CLASS: &str = "batch-report";
const RANGES: usize = 40;

/// The holder record of `key` on `etcd`, as its mod revision.
async fn held_at(etcd: &EtcdServer, key: &str) -> anyhow::Result<Option<i64>> {
    let mut kv = etcd.client().await?.kv_client();
    let resp = kv.get(layout().holder(key), None).await?;
    Ok(resp.kvs().first().map(|kv| kv.mod_revision()))
}

async fn stored_map(coord: &EtcdServer) -> anyhow::Result<ShardMap> {
    let store = ShardMapStore::new(coord.client().await?, "/latchkey-coord");
    Ok(store
        .load()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no shard map on the coord cluster"))?
        .0)
}

/// Seconds left on lease `id` on `etcd` (-1: no such lease).
async fn lease_ttl(etcd: &EtcdServer, id: i64) -> anyhow::Result<i64> {
    let mut leases = etcd.client().await?.lease_client();
    Ok(leases.time_to_live(id, None).await?.ttl())
}

/// Waits until the arbiter behind `op` routes by shard map `version`.
async fn routing_by(op: &AdminClient<Channel>, version: u64) -> anyhow::Result<()> {
    latchkey_tests::eventually(
        &format!("the arbiter to route by version {version}"),
        Duration::from_secs(10),
        || async {
            let status = op
                .clone()
                .get_shards(GetShardsRequest {})
                .await?
                .into_inner();
            let routed = status.status.is_some_and(|s| s.version == version);
            anyhow::ensure!(routed, "not yet at version {version}");
            Ok(())
        },
    )
    .await
}

fn key(i: usize) -> String {
    format!("demo/r{i}/k")
}

/// Renews `session` with one KeepAlive message: its remaining TTL.
async fn renew(c: &mut Client, session: i64) -> anyhow::Result<i64> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(KeepAliveRequest {
        session_id: session,
        session_ids: Vec::new(),
    })
    .await?;
    let mut stream = c
        .keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let resp = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await??
        .ok_or_else(|| anyhow::anyhow!("the keepalive stream ended"))?;
    Ok(resp.remaining_ttl_seconds)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_moved_range_drains_then_issues_tokens_above_its_old_home() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let home = EtcdServer::start().await?;
    let coord = EtcdServer::start().await?;
    let added = EtcdServer::start().await?;
    let arbiter = Arbiter::start(
        &home,
        ArbiterOptions {
            coord: Some(Coord::on(&coord)),
            ..Default::default()
        },
    )
    .await?;
    // An arbiter that does not follow the shard map (no coord cluster) on
    // the same lock cluster: a move fences it out.
    let blind = Arbiter::start(&home, ArbiterOptions::default()).await?;
    let mut c = arbiter.lock("workload/demo").await?;
    let mut b = blind.lock("workload/demo").await?;
    let mut op = arbiter.admin("latchkey/operator").await?;

    // Before any map: one shard, the lock cluster, named by the arbiter.
    let before: ShardStatus = op
        .get_shards(GetShardsRequest {})
        .await?
        .into_inner()
        .status
        .unwrap_or_default();
    assert_eq!(before.version, 0);
    assert_eq!(before.shards.len(), 1);
    assert_eq!(before.shards[0].name, "default");

    // Tokens on every range before the move.
    let session = open(&mut c, CLASS).await?;
    let mut old = BTreeMap::new();
    for i in 0..RANGES {
        let g = try_lock(&mut c, &key(i), CLASS, session).await?;
        old.insert(i, g.token);
        release(&mut c, &g).await?;
    }

    // A workload holds one key in a range that will move; found by the map
    // the move publishes, so take a hold on every range and let go of all
    // but the moving ones after.
    let mut holds = BTreeMap::new();
    for i in 0..RANGES {
        holds.insert(i, try_lock(&mut c, &key(i), CLASS, session).await?);
    }

    // Add a shard; it is refused with bad input first, writing nothing.
    let coord_before = coord.revision().await?;
    let refused = op
        .change_shards(ChangeShardsRequest {
            change: Some(Change::Add(AddShard {
                name: "Bad Name".into(),
                endpoints: vec![added.endpoint()],
                weight: 1,
            })),
            reason: "grow".into(),
        })
        .await
        .expect_err("a bad shard name is refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let refused = op
        .change_shards(ChangeShardsRequest {
            change: Some(Change::Add(AddShard {
                name: "entity-b".into(),
                endpoints: vec![added.endpoint()],
                weight: 1,
            })),
            reason: String::new(),
        })
        .await
        .expect_err("a change without a reason is refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let refused = op
        .change_shards(ChangeShardsRequest {
            change: Some(Change::Add(AddShard {
                name: "entity-b".into(),
                endpoints: vec![home.endpoint()],
                weight: 1,
            })),
            reason: "grow".into(),
        })
        .await
        .expect_err("the lock cluster again under another name is refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(coord.revision().await?, coord_before);

    let started = op
        .change_shards(ChangeShardsRequest {
            change: Some(Change::Add(AddShard {
                name: "entity-b".into(),
                endpoints: vec![added.endpoint()],
                weight: 1,
            })),
            reason: "grow the entity tier".into(),
        })
        .await?
        .into_inner()
        .status
        .unwrap_or_default();
    let moving_map = stored_map(&coord).await?;
    assert_eq!(moving_map.version, 1);
    let moving: Vec<usize> = (0..RANGES)
        .filter(|i| moving_map.is_moving(&key(*i)))
        .collect();
    let fraction = moving.len() as f64 / RANGES as f64;
    println!(
        "adding a second shard moves {} of {RANGES} ranges ({:.0} %)",
        moving.len(),
        fraction * 100.0
    );
    assert!(!moving.is_empty() && moving.len() < RANGES, "{moving:?}");
    let m = started
        .r#move
        .clone()
        .expect("the move waits for the holds");
    assert_eq!(m.phase, "draining");
    assert!(m.detail.contains("waiting for"), "{}", m.detail);
    assert_eq!(
        started.shards[0].moving_holds as usize,
        moving.len(),
        "{started:?}"
    );
    assert_eq!(started.shards[0].fence_version, 1);

    // Release every hold but one in a moving range.
    let kept = moving[0];
    for (i, g) in &holds {
        if *i != kept {
            release(&mut c, g).await?;
        }
    }

    // While draining: a moving range takes no new grant (UNAVAILABLE,
    // RANGE_MOVING, nothing written); a range that stays is served.
    let other_moving = moving.get(1).copied();
    let staying = (0..RANGES).find(|i| !moving.contains(i)).unwrap();
    if let Some(i) = other_moving {
        let (h, a) = (home.revision().await?, added.revision().await?);
        expect_refusal(
            try_lock(&mut c, &key(i), CLASS, session).await,
            Code::Unavailable,
            "RANGE_MOVING",
        )?;
        assert_eq!((home.revision().await?, added.revision().await?), (h, a));
    }
    let g = try_lock(&mut c, &key(staying), CLASS, session).await?;
    assert!(g.token > old[&staying]);
    release(&mut c, &g).await?;
    // The arbiter that does not follow the map is fenced out of the lock
    // cluster, for every range.
    let blind_session = open(&mut b, CLASS).await?;
    expect_refusal(
        try_lock(&mut b, &key(staying), CLASS, blind_session).await,
        Code::Unavailable,
        "SHARD_MAP_CHANGED",
    )?;
    // Nor does it answer renewals any more: sessions may have shadows on
    // shards it does not know.
    let renewal = renew(&mut b, blind_session).await;
    assert!(
        renewal
            .as_ref()
            .is_err_and(|e| format!("{e:?}").contains("shard map")),
        "{renewal:?}"
    );

    // A step does not finish while the kept hold lasts.
    let stepped = op
        .step_shard_move(StepShardMoveRequest {
            allow_ending_holds: false,
        })
        .await?
        .into_inner()
        .status
        .unwrap_or_default();
    assert!(stepped.r#move.is_some(), "{stepped:?}");
    assert_eq!(stepped.version, 1);

    // Its release lets the move finish: version 2, the new shard's epoch
    // above the old one's.
    release(&mut c, &holds[&kept]).await?;
    let done = op
        .step_shard_move(StepShardMoveRequest {
            allow_ending_holds: false,
        })
        .await?
        .into_inner()
        .status
        .unwrap_or_default();
    assert!(done.r#move.is_none(), "{done:?}");
    assert_eq!(done.version, 2);
    let epochs: BTreeMap<_, _> = done
        .shards
        .iter()
        .map(|s| (s.name.clone(), s.epoch))
        .collect();
    assert!(epochs["entity-b"] > epochs["default"], "{epochs:?}");

    // Every moved key is granted on the new shard, with a token above every
    // token its old home issued; every other key stays where it was.
    routing_by(&op, 2).await?;
    // A class with a quota is not served on a sharded entity tier: its
    // places would be kept per shard, not per subject (issue 34).
    let quota_session = open(&mut c, "quota").await?;
    let refused = try_lock(&mut c, &key(0), "quota", quota_session)
        .await
        .expect_err("a quota class on a sharded entity tier is refused");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused.message().contains("maxHoldsPerSubject"),
        "{refused:?}"
    );
    for i in 0..RANGES {
        let g = try_lock(&mut c, &key(i), CLASS, session).await?;
        assert!(
            g.token > old[&i],
            "key {} token went back across the move",
            key(i)
        );
        let (on_home, on_added) = (
            held_at(&home, &key(i)).await?,
            held_at(&added, &key(i)).await?,
        );
        if moving.contains(&i) {
            assert_eq!((on_home, on_added), (None, Some(g.revision)), "{}", key(i));
        } else {
            assert_eq!((on_home, on_added), (Some(g.revision), None), "{}", key(i));
        }
    }

    // One session holds on both shards: a renewal renews its shadow too,
    // and closing it ends the holds on both.
    // The session marks its shadow on the lock cluster, on its lease.
    let mark = layout().shadow_mark(session, "entity-b");
    let mut kv = home.client().await?.kv_client();
    let marked = kv.get(mark.as_str(), None).await?;
    assert_eq!(
        marked.kvs().first().map(|kv| kv.lease()),
        Some(session),
        "{mark}"
    );
    // The shadow's lease is renewed on the new shard itself (not answered
    // for by the renewal of the session's lease on the lock cluster, which
    // has the same id), and renewals close together are answered too.
    let before = lease_ttl(&added, session).await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(renew(&mut c, session).await? > 0);
    assert!(renew(&mut c, session).await? > 0);
    let after = lease_ttl(&added, session).await?;
    assert!(
        after > before - 2,
        "the shadow's lease was not renewed: {before} s left before, {after} s after"
    );
    assert!(lease_ttl(&home, session).await? > 0);
    c.close_session(CloseSessionRequest {
        session_id: session,
    })
    .await?;
    latchkey_tests::eventually(
        "the holds on both shards to end with the session",
        Duration::from_secs(10),
        || async {
            for i in 0..RANGES {
                if held_at(&home, &key(i)).await?.is_some()
                    || held_at(&added, &key(i)).await?.is_some()
                {
                    anyhow::bail!("{} is still held", key(i));
                }
            }
            Ok(())
        },
    )
    .await?;

    // Pinning a namespace to a shard that holds nothing moves its ranges.
    let pinned = op
        .change_shards(ChangeShardsRequest {
            change: Some(Change::Pin(PinNamespace {
                namespace: "demo".into(),
                shard: "default".into(),
            })),
            reason: "tenant demo on its own cluster".into(),
        })
        .await?
        .into_inner()
        .status
        .unwrap_or_default();
    // The lock cluster's epoch must go above the new shard's first, which
    // ends every hold on it: only with the operator's say.
    let m = pinned
        .r#move
        .clone()
        .expect("the pin waits for the operator");
    assert!(m.detail.contains("--allow-ending-holds"), "{}", m.detail);
    assert_eq!(pinned.version, 3);
    let pin = || ChangeShardsRequest {
        change: Some(Change::Pin(PinNamespace {
            namespace: "demo".into(),
            shard: "default".into(),
        })),
        reason: "tenant demo on its own cluster".into(),
    };

    // The operator cancels instead: nothing moves, the moving ranges are
    // served again where they were, and another change may start.
    let refused = op
        .change_shards(pin())
        .await
        .expect_err("a second change while one is under way is refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let cancelled = op
        .change_shards(ChangeShardsRequest {
            change: Some(Change::Cancel(CancelMove {})),
            reason: "not now".into(),
        })
        .await?
        .into_inner()
        .status
        .unwrap_or_default();
    assert!(cancelled.r#move.is_none(), "{cancelled:?}");
    assert_eq!(cancelled.version, 4);
    let session = open(&mut c, CLASS).await?;
    routing_by(&op, 4).await?;
    let g = try_lock(&mut c, &key(moving[0]), CLASS, session).await?;
    assert_eq!(held_at(&added, &key(moving[0])).await?, Some(g.revision));
    release(&mut c, &g).await?;

    // Pinned again, with the operator's say this time.
    let started = op
        .change_shards(pin())
        .await?
        .into_inner()
        .status
        .unwrap_or_default();
    assert_eq!(started.version, 5);
    let pinned = op
        .step_shard_move(StepShardMoveRequest {
            allow_ending_holds: true,
        })
        .await?
        .into_inner()
        .status
        .unwrap_or_default();
    assert!(pinned.r#move.is_none(), "{pinned:?}");
    assert_eq!(pinned.version, 6);
    routing_by(&op, 6).await?;
    for &i in &moving {
        let g = try_lock(&mut c, &key(i), CLASS, session).await?;
        assert_eq!(held_at(&home, &key(i)).await?, Some(g.revision));
        assert!(g.token > old[&i]);
    }

    // A shard fenced at a version the map has not reached (the coord
    // cluster's map went back, as a restore would): no change publishes a
    // second map under a version the shards have seen.
    let mut kv = home.client().await?.kv_client();
    kv.put(layout().map_fence(), format!("{:020}", 100), None)
        .await?;
    let coord_before = coord.revision().await?;
    let refused = op
        .change_shards(ChangeShardsRequest {
            change: Some(Change::Pin(PinNamespace {
                namespace: "demo".into(),
                shard: "entity-b".into(),
            })),
            reason: "after a restore".into(),
        })
        .await
        .expect_err("a map version the shards have seen is not published again");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().contains("restored"),
        "{}",
        refused.message()
    );
    assert_eq!(coord.revision().await?, coord_before);
    blind.stop().await?;
    arbiter.stop().await
}
