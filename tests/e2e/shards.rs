//! The entity tier's shard map (ADR-09) on a real etcd (the coord
//! cluster's role): published by compare-and-swap on its revision, so two
//! changes from the same version never both land; followed by a watch; and
//! homing by rendezvous hashing moves about a quarter of the keys when a
//! fourth shard is added.

use std::time::Duration;

use latchkey_arbiter::shards::etcd::ShardMapStore;
use latchkey_arbiter::shards::{MapError, Shard, ShardMap};
use latchkey_arbiter::shards::{PublishError, ShardMaps as _};
use latchkey_tests::etcd::EtcdServer;

fn map(version: u64, names: &[&str]) -> ShardMap {
    ShardMap {
        version,
        shards: names
            .iter()
            .map(|n| Shard {
                name: (*n).to_string(),
                endpoints: vec![format!("https://{n}.latchkey.svc:2379")],
                weight: 1,
            })
            .collect(),
        overrides: Default::default(),
        moving: None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_shard_map_changes_by_compare_and_swap_and_every_follower_sees_it() -> anyhow::Result<()>
{
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let store = ShardMapStore::new(etcd.client().await?, "/latchkey-coord");
    assert!(store.load().await?.is_none());
    let follower = ShardMapStore::new(etcd.client().await?, "/latchkey-coord");
    let (tx, mut rx) = tokio::sync::watch::channel(None);
    let following = tokio::spawn(async move { follower.follow(tx).await });

    // The first map is version 1, written only if there is none.
    let three = map(1, &["entity-a", "entity-b", "entity-c"]);
    store.publish(None, None, &three).await?;
    assert!(matches!(
        store.publish(None, None, &three).await,
        Err(PublishError::Raced { current: 1 })
    ));
    let (stored, at) = store
        .load()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no map"))?;
    assert_eq!(stored, three);

    // Two operators change version 1: the first lands, the second is told
    // to read again, and nothing of it is written.
    let four = map(2, &["entity-a", "entity-b", "entity-c", "entity-d"]);
    let other = map(2, &["entity-a", "entity-b", "entity-c", "entity-x"]);
    store.publish(Some(&stored), Some(at), &four).await?;
    let raced = store.publish(Some(&stored), Some(at), &other).await;
    assert!(
        matches!(raced, Err(PublishError::Raced { current: 2 })),
        "{raced:?}"
    );
    assert!(raced.is_err_and(|e| e.to_string().contains("read it again")));
    // A change that skips a version is refused before etcd.
    let (now, at) = store
        .load()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no map"))?;
    assert_eq!(now, four);
    assert!(matches!(
        store
            .publish(Some(&now), Some(at), &map(5, &["entity-a"]))
            .await,
        Err(PublishError::Invalid(MapError::Version {
            current: 2,
            next: 5
        }))
    ));

    // The follower has version 2.
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if rx.borrow().as_ref().is_some_and(|m| m.version == 2) {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    })
    .await?;
    assert_eq!(rx.borrow().as_ref(), Some(&four));

    // What version 2 moves, of 100,000 keys over 5,000 ranges.
    let keys: Vec<String> = (0..100_000)
        .map(|i| format!("ns{}/p{}/k{i}", i % 50, (i / 50) % 100))
        .collect();
    let moved = three.moves_to(&four, keys.iter().map(String::as_str));
    let fraction = moved.len() as f64 / keys.len() as f64;
    println!(
        "shard map v1 -> v2 (a fourth shard): {} of {} keys change home ({:.1} %), all to entity-d",
        moved.len(),
        keys.len(),
        fraction * 100.0
    );
    assert!((0.20..0.30).contains(&fraction), "{fraction}");
    assert!(moved.iter().all(|(_, _, to)| to == "entity-d"));
    drop(rx);
    following.abort();
    Ok(())
}
