//! The fence stores the gate's writes rotate through (issue 35): besides
//! the reference PostgreSQL fence, a private MariaDB, Redis, etcd (a
//! user's own, not the lock log's) and S3-compatible server (moto), each
//! written through its adapter (`latchkey-fence-open`). Every key's records
//! live in one store for the whole run (the worker picks it by the key's
//! place in its key list, plus the slot), so the checker judges each
//! store's accepted writes in that store's own commit order: the version
//! its adapter returns (a per-record write count, etcd's revision). The
//! keys readers take stay on the reference fence, whose guarded read the
//! readers use (the worker's `Fences`).

use std::collections::BTreeMap;

use anyhow::Context;
use latchkey_checker::{Function, History, Outcome};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::mariadb::MariaDbServer;
use latchkey_tests::postgres::PostgresServer;
use latchkey_tests::redis::RedisServer;
use latchkey_tests::s3::S3Server;

/// The bucket the S3 records go to.
const BUCKET: &str = "gate-fence";

/// The servers, kept running for the gate's lifetime, and what a worker
/// needs to reach them.
pub struct FenceStores {
    _mariadb: MariaDbServer,
    _redis: RedisServer,
    _etcd: EtcdServer,
    _s3: S3Server,
    /// Every store's URL, the reference fence first (the worker's
    /// `--fence-stores`; they hold passwords, so they go by environment).
    pub urls: Vec<String>,
    /// The environment the S3 adapter takes its credentials from.
    pub env: Vec<(String, String)>,
}

impl FenceStores {
    /// Starts the four servers beside `postgres` (the reference fence) and
    /// creates the bucket.
    pub async fn start(postgres: &PostgresServer) -> anyhow::Result<Self> {
        let (mariadb, redis, etcd, s3) = tokio::try_join!(
            async { MariaDbServer::start().await.context("starting MariaDB") },
            async { RedisServer::start().await.context("starting Redis") },
            async {
                EtcdServer::start()
                    .await
                    .context("starting the fence's etcd")
            },
            async { S3Server::start().await.context("starting the S3 server") },
        )?;
        s3.store(BUCKET, "").await.context("creating the bucket")?;
        let etcd_addr = etcd
            .endpoint()
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let urls = vec![
            postgres.url(),
            mariadb.url(),
            redis.url(),
            format!("etcd://{etcd_addr}/gate-fence"),
            s3.url(BUCKET, "records"),
        ];
        let env = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
            .into_iter()
            .filter_map(|name| Some((name.to_owned(), s3.env(name)?)))
            .collect();
        Ok(Self {
            _mariadb: mariadb,
            _redis: redis,
            _etcd: etcd,
            _s3: s3,
            urls,
            env,
        })
    }
}

/// One store's writes in the judged history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreWrites {
    pub accepted: usize,
    /// Refused by the fence (a stale token).
    pub refused: usize,
    /// Outcome unknown (an error, a store that could not decide).
    pub unknown: usize,
}

/// Writes per store kind (the write's `detail`, which the worker sets to
/// its adapter's kind).
pub fn writes_by_store(history: &History) -> BTreeMap<String, StoreWrites> {
    let mut by_store: BTreeMap<String, StoreWrites> = BTreeMap::new();
    for o in history.ops() {
        if o.f != Function::Write {
            continue;
        }
        let Some(kind) = o.detail.as_deref() else {
            continue;
        };
        let counts = by_store.entry(kind.to_owned()).or_default();
        match o.outcome() {
            Some(Outcome::Ok) => counts.accepted += 1,
            Some(Outcome::Fail) => counts.refused += 1,
            _ => counts.unknown += 1,
        }
    }
    by_store
}
