//! The Python fence adapters (`latchkey.fence` in clients/python) against the
//! same real servers as the Rust ones, and against the Rust adapters
//! themselves: a PostgreSQL, a MariaDB, a Redis, an etcd and an S3-compatible
//! server (moto) are started in parallel by the harnesses in `tests/src`, and
//! pytest runs `clients/python/tests/test_fence_stores.py` with their URLs
//! (the contract suite on every store, then the interop checks).
//!
//! Interop, both ways, on every store:
//! - before pytest, each Rust adapter writes `interop/rust` with token
//!   [`RUST_TOKEN`]; pytest sees a Python write with `RUST_TOKEN - 1` fenced
//!   out (the mark is the Rust writer's), writes `RUST_TOKEN + 1` over it
//!   ([`PYTHON_OVER_RUST`]), and writes `interop/python` with
//!   [`PYTHON_TOKEN`] and [`PYTHON_PAYLOAD`];
//! - after pytest, each Rust adapter reads both records back (marks and
//!   payloads) and its write with `PYTHON_TOKEN - 1` is fenced out by the
//!   Python writer's mark.
//!
//! A second etcd has auth on, for the Python adapter's login
//! (`LATCHKEY_FENCE_ETCD_AUTH_URL`, a user whose role covers one prefix).
//!
//! Versions (`Applied { version }`) are compared within each language's
//! suite only; here marks and payloads are, which is what fencing each other
//! takes. Needs Python with pytest and the drivers (psycopg, PyMySQL,
//! redis-py) that `scripts/setup` installs.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use latchkey_fence::{FencedStore, Guarded, Mark};
use latchkey_fence_etcd::EtcdStore;
use latchkey_fence_mysql::MysqlStore;
use latchkey_fence_postgres::PostgresStore;
use latchkey_fence_redis::RedisStore;
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::mariadb::MariaDbServer;
use latchkey_tests::postgres::PostgresServer;
use latchkey_tests::redis::RedisServer;
use latchkey_tests::s3::S3Server;
use latchkey_tests::workspace_root;
use mysql_async::prelude::Queryable;
use tokio::process::Command;

/// pytest's budget; the suite takes a few seconds.
const SUITE_TIMEOUT: Duration = Duration::from_secs(120);
/// The Rust writer's token on `interop/rust` (what pytest's interop test
/// expects; tests/test_fence_stores.py has the same numbers).
const RUST_TOKEN: u64 = 1_000_000;
/// The Python writer's token over `interop/rust`.
const PYTHON_OVER_RUST: u64 = RUST_TOKEN + 1;
const PYTHON_OVER_RUST_PAYLOAD: &[u8] = b"python over rust";
/// The Python writer's token and payload on `interop/python`.
const PYTHON_TOKEN: u64 = 2_000_000;
const PYTHON_PAYLOAD: &[u8] = b"from python";
/// The bucket and prefix both languages write under on the S3 server.
const S3_BUCKET: &str = "fences";
const S3_PREFIX: &str = "py/";

/// The MySQL reference table as docs/fencing.md and both adapters define it
/// (with the per-record `writes` count), created before either adapter
/// connects, so both write the same table whichever creates it first.
const MYSQL_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS latchkey_fenced_rows (
    id      VARBINARY(255)  NOT NULL PRIMARY KEY,
    fence   BIGINT UNSIGNED NULL,
    payload LONGBLOB        NOT NULL,
    writes  BIGINT UNSIGNED NOT NULL DEFAULT 0
) ENGINE=InnoDB";

#[tokio::test(flavor = "multi_thread")]
async fn python_fence_adapters_keep_the_contract_and_fence_the_rust_adapters() -> anyhow::Result<()>
{
    latchkey_tests::init_tracing();
    let (pg, maria, redis, etcd, mut etcd_auth, s3) = tokio::try_join!(
        PostgresServer::start(),
        MariaDbServer::start(),
        RedisServer::start(),
        EtcdServer::start(),
        EtcdServer::start(),
        S3Server::start(),
    )?;
    // An etcd with auth on, and a user whose role covers `fenced/` only.
    etcd_auth.enable_auth("root-pw").await?;
    etcd_auth.add_user("app", "app-pw", "fenced/").await?;
    let etcd_auth_url = format!(
        "etcd://app:app-pw@127.0.0.1:{}/fenced",
        etcd_auth.client_port()
    );
    maria.conn().await?.query_drop(MYSQL_TABLE_SQL).await?;
    let etcd_url = format!("etcd://127.0.0.1:{}/fenced", etcd.client_port());
    let stores: Vec<(&str, Box<dyn FencedStore>)> = vec![
        (
            "postgres",
            Box::new(PostgresStore::connect(&pg.url()).await?),
        ),
        ("mysql", Box::new(MysqlStore::connect(&maria.url()).await?)),
        ("redis", Box::new(RedisStore::connect(&redis.url()).await?)),
        ("etcd", Box::new(EtcdStore::connect(&etcd_url).await?)),
        ("s3", Box::new(s3.store(S3_BUCKET, S3_PREFIX).await?)),
    ];

    for (name, store) in &stores {
        let g = store
            .guarded_write("interop/rust", RUST_TOKEN, b"from rust")
            .await
            .with_context(|| format!("{name}: the Rust write of interop/rust"))?;
        ensure!(
            g.is_applied(),
            "{name}: the Rust write of interop/rust was {g}"
        );
    }

    let client_dir = workspace_root().join("clients/python");
    let out_dir = tempfile::Builder::new()
        .prefix("latchkey-pytest-fence-")
        .tempdir()?;
    let (out_path, err_path) = (out_dir.path().join("out"), out_dir.path().join("err"));
    let mut pytest = Command::new("python3")
        .args([
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            "tests/test_fence_stores.py",
        ])
        .current_dir(&client_dir)
        .env("PYTHONPATH", client_dir.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LATCHKEY_TEST_REQUIRE_STACK", "1")
        .env("LATCHKEY_FENCE_POSTGRES_URL", pg.url())
        .env("LATCHKEY_FENCE_MYSQL_URL", maria.url())
        .env("LATCHKEY_FENCE_REDIS_URL", redis.url())
        .env("LATCHKEY_FENCE_ETCD_URL", &etcd_url)
        .env("LATCHKEY_FENCE_ETCD_AUTH_URL", &etcd_auth_url)
        .env("LATCHKEY_FENCE_S3_URL", s3.url(S3_BUCKET, S3_PREFIX))
        .env("LATCHKEY_FENCE_INTEROP", "1")
        .env("AWS_ACCESS_KEY_ID", s3.credentials().access_key())
        .env("AWS_SECRET_ACCESS_KEY", s3.credentials().secret_key())
        .env_remove("AWS_SESSION_TOKEN")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .kill_on_drop(true)
        .spawn()
        .context("starting python3 -m pytest (scripts/setup installs what it needs)")?;
    let status = match tokio::time::timeout(SUITE_TIMEOUT, pytest.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            let _ = pytest.start_kill();
            bail!(
                "pytest did not finish in {SUITE_TIMEOUT:?}; output so far:\n{}",
                std::fs::read_to_string(&out_path).unwrap_or_default()
            );
        }
    };
    let out = std::fs::read_to_string(&out_path)?;
    let err = std::fs::read_to_string(&err_path)?;
    println!("{out}");
    ensure!(status.success(), "pytest failed ({status}):\n{out}\n{err}");
    let summary = out.lines().last().unwrap_or_default();
    ensure!(
        summary.contains(" passed") && !summary.contains("skipped") && !summary.contains("failed"),
        "every Python fence test must run and pass: {summary}"
    );

    for (name, store) in &stores {
        let r = store
            .read("interop/python")
            .await?
            .with_context(|| format!("{name}: interop/python is missing"))?;
        ensure!(
            r.mark == Mark::new(PYTHON_TOKEN) && r.payload == PYTHON_PAYLOAD,
            "{name}: interop/python as Rust reads it: {r:?}"
        );
        let r = store
            .read("interop/rust")
            .await?
            .with_context(|| format!("{name}: interop/rust is missing"))?;
        ensure!(
            r.mark == Mark::new(PYTHON_OVER_RUST) && r.payload == PYTHON_OVER_RUST_PAYLOAD,
            "{name}: interop/rust after the Python write over it: {r:?}"
        );
        let g = store
            .guarded_write("interop/python", PYTHON_TOKEN - 1, b"stale rust")
            .await?;
        ensure!(
            matches!(g, Guarded::FencedOut { mark } if mark == Mark::new(PYTHON_TOKEN)),
            "{name}: a Rust write below the Python writer's mark was {g}"
        );
    }
    Ok(())
}
