//! The key-value fence adapters (issue 35) against real servers: Redis (one
//! Lua script) on a private redis-server (tests/src/redis.rs), and a user's
//! own etcd (one transaction) on a private etcd (tests/src/etcd.rs).

use std::sync::Arc;

use latchkey_fence::{FenceError, FencedStore, Guarded, Mark};
use latchkey_fence_etcd::EtcdStore;
use latchkey_fence_redis::RedisStore;
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::fence_contract::{EPOCH, check_contract, check_race, ensure_scrubbed};
use latchkey_tests::redis::RedisServer;

// --- Redis ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn redis_store_keeps_the_contract() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let server = RedisServer::start().await?;
    let store = RedisStore::connect(&server.url()).await?;
    assert_eq!(store.kind(), "redis");
    check_contract(&store, "rd").await?;
    check_race(
        Arc::new(RedisStore::connect(&server.url()).await?),
        "rd/race",
    )
    .await?;

    // Every u64 token, compared across its 32-bit halves.
    assert_eq!(
        store.guarded_write("rd/max", u64::MAX - 1, b"x").await?,
        Guarded::Applied { version: 1 }
    );
    assert_eq!(
        store.guarded_write("rd/max", u64::MAX, b"y").await?,
        Guarded::Applied { version: 2 }
    );
    assert!(matches!(
        store.guarded_write("rd/max", u64::MAX, b"z").await?,
        Guarded::FencedOut { mark } if mark == Mark::new(u64::MAX)
    ));

    // The record's layout is the documented one: a hash, mark as 16 hex digits.
    let mut conn = server.connection().await?;
    let (mark, payload): (String, Vec<u8>) = redis::cmd("HMGET")
        .arg("rd/max")
        .arg("mark")
        .arg("payload")
        .query_async(&mut conn)
        .await?;
    assert!(
        mark == Mark::new(u64::MAX).to_hex() && payload == b"y",
        "the stored layout"
    );

    // Keys that are not fenced records are refused and left as they were.
    let _: () = redis::cmd("SET")
        .arg("rd/string")
        .arg("theirs")
        .query_async(&mut conn)
        .await?;
    let _: () = redis::cmd("HSET")
        .arg("rd/nomark")
        .arg("payload")
        .arg("theirs")
        .query_async(&mut conn)
        .await?;
    let _: () = redis::cmd("HSET")
        .arg("rd/decimal")
        .arg("mark")
        .arg("5")
        .arg("payload")
        .arg("theirs")
        .query_async(&mut conn)
        .await?;
    for (record, why) in [
        ("rd/string", "string"),
        ("rd/nomark", "no mark"),
        ("rd/decimal", "hex"),
    ] {
        let err = store
            .guarded_write(record, EPOCH + 9, b"ours")
            .await
            .unwrap_err();
        assert!(
            matches!(err, FenceError::Unfenced { store: "redis", .. }),
            "{err}"
        );
        assert!(err.to_string().contains(why), "{err}");
        assert!(matches!(
            store.read(record).await,
            Err(FenceError::Unfenced { .. })
        ));
    }
    let theirs: String = redis::cmd("GET")
        .arg("rd/string")
        .query_async(&mut conn)
        .await?;
    assert_eq!(theirs, "theirs");
    let theirs: Vec<u8> = redis::cmd("HGET")
        .arg("rd/decimal")
        .arg("payload")
        .query_async(&mut conn)
        .await?;
    assert_eq!(theirs, b"theirs");

    // A store error with the token as an argument (over maxmemory, the
    // script is refused) never shows the token.
    let token = EPOCH + 31337;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query_async(&mut conn)
        .await?;
    let err = store
        .guarded_write("rd/oom", token, b"x")
        .await
        .unwrap_err();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query_async(&mut conn)
        .await?;
    assert!(err.to_string().contains("OOM"), "{err}");
    ensure_scrubbed(&err, token)?;
    assert!(
        store
            .guarded_write("rd/oom", token, b"x")
            .await?
            .is_applied()
    );

    // A record with an expiry would lose its mark with it: refused, unchanged.
    let _: () = redis::cmd("PEXPIRE")
        .arg("rd/oom")
        .arg(600_000)
        .query_async(&mut conn)
        .await?;
    let err = store
        .guarded_write("rd/oom", token + 1, b"y")
        .await
        .unwrap_err();
    assert!(
        matches!(err, FenceError::Unfenced { store: "redis", .. })
            && err.to_string().contains("PERSIST"),
        "{err}"
    );
    let payload: Vec<u8> = redis::cmd("HGET")
        .arg("rd/oom")
        .arg("payload")
        .query_async(&mut conn)
        .await?;
    assert_eq!(payload, b"x");

    // The store says what the server's setup means (no AOF here), and a
    // server that may evict any key is refused at connect.
    assert_eq!(store.caveats().len(), 2, "{:?}", store.caveats());
    for (name, value) in [("maxmemory", "100mb"), ("maxmemory-policy", "allkeys-lru")] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(&mut conn)
            .await?;
    }
    let err = match RedisStore::connect(&server.url()).await {
        Ok(_) => anyhow::bail!("a server that evicts any key was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("allkeys-lru"), "{err}");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("volatile-lru")
        .query_async(&mut conn)
        .await?;
    assert!(RedisStore::connect(&server.url()).await.is_ok());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_connect_errors_hide_the_password() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let server = RedisServer::start().await?;
    let wrong = server.url().replace(server.password(), "hunter2-wrong");
    let err = match RedisStore::connect(&wrong).await {
        Ok(_) => anyhow::bail!("connected with a wrong password"),
        Err(e) => e,
    };
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(!text.contains(server.password()), "{text}");
    Ok(())
}

// --- etcd ----------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn etcd_store_keeps_the_contract() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let mut etcd = EtcdServer::start().await?;
    let url = format!("etcd://127.0.0.1:{}/fenced", etcd.client_port());
    let store = EtcdStore::connect(&url).await?;
    assert_eq!(store.kind(), "etcd");
    check_contract(&store, "et").await?;
    check_race(Arc::new(EtcdStore::connect(&url).await?), "et/race").await?;

    assert!(
        store
            .guarded_write("et/max", u64::MAX - 1, b"x")
            .await?
            .is_applied()
    );
    assert!(
        store
            .guarded_write("et/max", u64::MAX, b"y")
            .await?
            .is_applied()
    );
    assert!(matches!(
        store.guarded_write("et/max", u64::MAX, b"z").await?,
        Guarded::FencedOut { mark } if mark == Mark::new(u64::MAX)
    ));

    // The layout is the documented one: <prefix>/<record>/mark, 8 bytes BE.
    let client = etcd.client().await?;
    let mark = latchkey_etcd::kv::get_one(&client, "fenced/et/max/mark").await?;
    assert_eq!(
        mark.value.map(|kv| kv.value().to_vec()),
        Some(u64::MAX.to_be_bytes().to_vec())
    );

    // A payload without a mark, or a mark of another width, is refused and kept.
    let mut kv = client.kv_client();
    kv.put("fenced/et/legacy/payload", "theirs", None).await?;
    // Marks of another width, whether they sort above the token's 8 bytes
    // or below them (etcd's byte-wise `Less` alone would pass 4 zero bytes).
    kv.put("fenced/et/short/mark", vec![0xffu8; 4], None)
        .await?;
    kv.put("fenced/et/short/payload", "theirs", None).await?;
    kv.put("fenced/et/narrow/mark", vec![0u8; 4], None).await?;
    kv.put("fenced/et/narrow/payload", "theirs", None).await?;
    for record in ["et/legacy", "et/short", "et/narrow"] {
        let err = store
            .guarded_write(record, EPOCH + 9, b"ours")
            .await
            .unwrap_err();
        assert!(
            matches!(err, FenceError::Unfenced { store: "etcd", .. }),
            "{err}"
        );
        assert!(matches!(
            store.read(record).await,
            Err(FenceError::Unfenced { .. })
        ));
    }
    for key in ["fenced/et/legacy/payload", "fenced/et/narrow/payload"] {
        let kept = latchkey_etcd::kv::get_one(&client, key).await?;
        assert_eq!(
            kept.value.map(|kv| kv.value().to_vec()),
            Some(b"theirs".to_vec()),
            "{key}"
        );
    }
    assert!(
        latchkey_etcd::kv::get_one(&client, "fenced/et/legacy/mark")
            .await?
            .value
            .is_none()
    );

    // A record another writer changed since this store's last write of it:
    // the remembered revision no longer matches, the record is read again,
    // and the answer is the fence's on what is there now.
    let other = EtcdStore::connect(&url).await?;
    let Guarded::Applied { version: first } =
        store.guarded_write("et/two", EPOCH + 1, b"a").await?
    else {
        anyhow::bail!("the first write of et/two was not applied");
    };
    let Guarded::Applied { version: second } =
        other.guarded_write("et/two", EPOCH + 2, b"b").await?
    else {
        anyhow::bail!("the other store's write was not applied");
    };
    assert!(second > first);
    assert!(matches!(
        store.guarded_write("et/two", EPOCH + 2, b"c").await?,
        Guarded::FencedOut { mark } if mark == Mark::new(EPOCH + 2)
    ));
    assert!(
        store
            .guarded_write("et/two", EPOCH + 3, b"d")
            .await?
            .is_applied()
    );
    // A foreign mark written after this store's own write is caught too.
    kv.put("fenced/et/two/mark", vec![0u8; 4], None).await?;
    assert!(matches!(
        store.guarded_write("et/two", EPOCH + 4, b"e").await,
        Err(FenceError::Unfenced { .. })
    ));

    // A store error with the token in the request (a user whose role
    // does not cover the prefix) never shows the token.
    etcd.enable_auth("root-pw").await?;
    etcd.add_user("app", "app-pw", "fenced/").await?;
    let elsewhere = format!(
        "etcd://app:app-pw@127.0.0.1:{}/elsewhere",
        etcd.client_port()
    );
    let token = EPOCH + 31337;
    let err = EtcdStore::connect(&elsewhere)
        .await?
        .guarded_write("et/denied", token, b"x")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    ensure_scrubbed(&err, token)?;
    Ok(())
}
