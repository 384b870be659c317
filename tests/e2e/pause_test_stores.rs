//! `latchctl pause-test --resource-url` (issue 35) against real MariaDB,
//! Redis and etcd (and PostgreSQL through the same flag): the kit passes
//! each store's fence adapter, and FAILs a naive writer (`--naive`: the
//! adapter's plain, unfenced write) with the reason to fix.
//!
//! The kit is `latchctl-under-test`, re-running itself as the holder child,
//! frozen for the class TTL (5 s) plus 2 s, as in e2e/pause_test.rs.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_fence::FencedStore;
use latchkey_policies::{PauseTestOutcome, WriteOutcome as Observed};
use latchkey_tests::arbiter::{ArbiterOptions, svid_flags};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::mariadb::MariaDbServer;
use latchkey_tests::postgres::PostgresServer;
use latchkey_tests::redis::RedisServer;
use mysql_async::prelude::Queryable;
use tempfile::TempDir;
use tokio::process::Command;
use tokio::time::timeout;

use crate::pause_test::{CLASS, IDENTITY, KIT_TIMEOUT, policy_dir, read_result, text};
use crate::support::{Stack, stack_with};

struct Rig {
    stack: Stack,
    _policies: TempDir,
    work: TempDir,
}

async fn rig() -> anyhow::Result<Rig> {
    let policies = policy_dir()?;
    let stack = stack_with(ArbiterOptions {
        policies_dir: policies.path().to_path_buf(),
        ..Default::default()
    })
    .await?;
    Ok(Rig {
        stack,
        _policies: policies,
        work: TempDir::new()?,
    })
}

impl Rig {
    /// `latchctl pause-test KEY --resource NAME --resource-url URL --out …`
    /// plus `extra`. The URL (with its password) is on the kit's command
    /// line here; the kit hands it to its holder by environment.
    async fn kit(
        &self,
        key: &str,
        resource: &str,
        url: &str,
        out: &Path,
        extra: &[&str],
        secret: &str,
    ) -> anyhow::Result<Output> {
        self.kit_with_env(key, resource, url, out, extra, secret, &[])
            .await
    }

    /// [`Rig::kit`] with environment variables for the kit (an S3 store's
    /// credentials, which never go in the URL).
    #[allow(clippy::too_many_arguments, reason = "a test helper's knobs")]
    async fn kit_with_env(
        &self,
        key: &str,
        resource: &str,
        url: &str,
        out: &Path,
        extra: &[&str],
        secret: &str,
        envs: &[(&str, String)],
    ) -> anyhow::Result<Output> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .arg("--endpoint")
            .arg(format!("https://{}", self.stack.arbiter.addr()))
            .args(svid_flags(IDENTITY)?)
            .args(["pause-test", key, "--class", CLASS, "--resource", resource])
            .arg("--resource-url")
            .arg(url)
            .arg("--out")
            .arg(out)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = cmd.spawn().context("pause-test did not start")?;
        let kit_pid = child.id().context("the kit's pid")?;
        // While the kit runs, its holder child's command line must not
        // carry the URL's password (`ps` shows it to every user).
        // A kit that refuses to run exits without one.
        let holder_argv = latchkey_tests::eventually(
            "the holder child to start (or the kit to exit)",
            Duration::from_secs(60),
            || async {
                match holder_cmdline(kit_pid) {
                    Ok(argv) => Ok(Some(argv)),
                    Err(_) if exited(kit_pid) => Ok(None),
                    Err(e) => Err(e),
                }
            },
        )
        .await?;
        if let Some(argv) = holder_argv {
            ensure!(
                argv.contains("pause-test-holder") && !argv.contains(secret),
                "the holder's command line carries the resource URL's password"
            );
        }
        let output = timeout(KIT_TIMEOUT, child.wait_with_output())
            .await
            .context("pause-test did not finish in time")?
            .context("pause-test did not run")?;
        eprintln!(
            "pause-test exited {:?}\n--- stdout\n{}\n--- stderr\n{}",
            output.status.code(),
            text(&output.stdout),
            text(&output.stderr)
        );
        for (what, haystack) in [("stdout", &output.stdout), ("stderr", &output.stderr)] {
            ensure!(
                !text(haystack).contains(secret),
                "the resource URL's password leaked into the kit's {what}"
            );
        }
        Ok(output)
    }
}

/// Whether `pid` has exited (a zombie not yet reaped, or gone).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) S …`: the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// The command line of `parent`'s child that is the pause-test holder.
fn holder_cmdline(parent: u32) -> anyhow::Result<String> {
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid …; comm may hold spaces, so split after ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid != Some(parent) {
            continue;
        }
        let argv = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let argv = String::from_utf8_lossy(&argv).replace('\0', " ");
        if argv.contains("pause-test-holder") {
            return Ok(argv);
        }
    }
    anyhow::bail!("no holder child yet")
}

/// Neither token the run wrote appears in its output or result file.
fn ensure_no_token_leaked(output: &Output, result: &Path, tokens: &[u64]) -> anyhow::Result<()> {
    let file = std::fs::read_to_string(result)?;
    ensure!(!tokens.is_empty(), "no tokens to look for");
    for token in tokens {
        ensure!(*token >= 1 << 48, "a token below 2^48");
        for form in [token.to_string(), format!("{token:016x}")] {
            for (what, haystack) in [
                ("stdout", text(&output.stdout)),
                ("stderr", text(&output.stderr)),
                ("the result file", file.clone()),
            ] {
                ensure!(!haystack.contains(&form), "a token leaked into {what}");
            }
        }
    }
    Ok(())
}

/// A pass, with the record left holding the second holder's write.
async fn ensure_pass(
    output: &Output,
    out: &Path,
    resource: &str,
    store: &dyn FencedStore,
    row: &str,
) -> anyhow::Result<u64> {
    ensure!(output.status.code() == Some(0), "expected exit 0 (pass)");
    let result = read_result(out)?;
    assert_eq!(result.resource, resource);
    assert_eq!(result.outcome, PauseTestOutcome::Pass);
    assert_eq!(result.failure, None);
    let e = &result.evidence;
    assert!(e.paused_for_ms >= 7_000, "paused {} ms", e.paused_for_ms);
    assert_eq!(e.first_write, Observed::Accepted);
    assert_eq!(e.second_holder_write, Observed::Accepted);
    assert!(e.second_token_greater);
    assert_eq!(e.stale_write_after_resume, Observed::Rejected);
    assert_eq!(e.final_row_from, "second-holder");
    assert!(text(&output.stdout).contains("pause-test PASS"));
    // The result says which adapter was proven, where (no credentials),
    // and what the store's setup means for the fence.
    let proven = result
        .store
        .as_ref()
        .context("the result names the store")?;
    assert_eq!(proven.kind, store.kind());
    assert!(
        proven
            .locator
            .starts_with(&format!("{}://", resource.split(':').next().unwrap_or("")))
            || proven.locator.starts_with("mysql://")
            || proven.locator.starts_with("postgresql://"),
        "{}",
        proven.locator
    );
    assert!(!proven.locator.contains('@'), "{}", proven.locator);
    assert_eq!(proven.caveats, store.caveats());
    if store.kind() == "redis" {
        assert!(
            proven
                .caveats
                .iter()
                .any(|c| c.contains("replicates asynchronously")),
            "{:?}",
            proven.caveats
        );
        assert!(text(&output.stdout).contains("caveat: Redis replicates asynchronously"));
    }
    let record = store.read(row).await?.context("the record")?;
    assert!(record.payload.ends_with(b"second-holder"));
    Ok(record.mark.get())
}

/// A naive writer's run: exit 1, FAIL, the stale write accepted and the
/// record left with the first holder's write, and the reason to fix.
fn ensure_naive_fails(output: &Output, out: &Path) -> anyhow::Result<()> {
    ensure!(output.status.code() == Some(1), "expected exit 1 (fail)");
    let result = read_result(out)?;
    assert_eq!(result.outcome, PauseTestOutcome::Fail);
    assert_eq!(result.evidence.second_holder_write, Observed::Accepted);
    assert_eq!(result.evidence.stale_write_after_resume, Observed::Accepted);
    assert_eq!(result.evidence.final_row_from, "first-holder");
    let failure = result.failure.context("a failure reason")?;
    assert!(
        failure.contains("ACCEPTED") && failure.contains("mark < token"),
        "{failure}"
    );
    assert!(text(&output.stdout).contains("pause-test FAIL"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_passes_the_mariadb_fence_and_fails_a_naive_writer() -> anyhow::Result<()> {
    let rig = rig().await?;
    let db = MariaDbServer::start().await?;
    let store = latchkey_fence_mysql::MysqlStore::connect(&db.url()).await?;
    // Every mark written, so the test knows both holders' tokens.
    let mut conn = db.conn().await?;
    conn.query_drop(
        "CREATE TABLE marks_seen (fence BIGINT UNSIGNED);
         CREATE TRIGGER mark_ins AFTER INSERT ON latchkey_fenced_rows
           FOR EACH ROW INSERT INTO marks_seen VALUES (NEW.fence);
         CREATE TRIGGER mark_upd AFTER UPDATE ON latchkey_fenced_rows
           FOR EACH ROW INSERT INTO marks_seen VALUES (NEW.fence)",
    )
    .await?;
    let resource = "mysql:latchkey_fenced_rows";
    let out = rig.work.path().join("mysql.json");
    let key = "pausetest/mysql-1";
    let output = rig
        .kit(key, resource, &db.url(), &out, &[], db.password())
        .await?;
    let mark = ensure_pass(
        &output,
        &out,
        resource,
        &store,
        &format!("latchkey-pause-test/{key}"),
    )
    .await?;
    let marks: Vec<Option<u64>> = conn.query("SELECT fence FROM marks_seen").await?;
    // MariaDB fires AFTER UPDATE for an upsert that changed nothing too
    // (the refused stale write): the distinct marks are the two tokens.
    let mut marks: Vec<u64> = marks.into_iter().flatten().collect();
    marks.dedup();
    assert_eq!(marks.len(), 2, "two accepted writes");
    assert!(marks[1] > marks[0] && marks[1] == mark);
    ensure_no_token_leaked(&output, &out, &marks)?;

    let out = rig.work.path().join("mysql-naive.json");
    let output = rig
        .kit(
            "pausetest/mysql-2",
            resource,
            &db.url(),
            &out,
            &["--naive"],
            db.password(),
        )
        .await?;
    ensure_naive_fails(&output, &out)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_passes_the_redis_fence_and_fails_a_naive_writer() -> anyhow::Result<()> {
    let rig = rig().await?;
    let server = RedisServer::start().await?;
    let store = latchkey_fence_redis::RedisStore::connect(&server.url()).await?;
    let resource = "redis:ledger";
    let out = rig.work.path().join("redis.json");
    let key = "pausetest/redis-1";
    let output = rig
        .kit(key, resource, &server.url(), &out, &[], server.password())
        .await?;
    let mark = ensure_pass(
        &output,
        &out,
        resource,
        &store,
        &format!("latchkey-pause-test/{key}"),
    )
    .await?;
    ensure_no_token_leaked(&output, &out, &[mark])?;

    let out = rig.work.path().join("redis-naive.json");
    let output = rig
        .kit(
            "pausetest/redis-2",
            resource,
            &server.url(),
            &out,
            &["--naive"],
            server.password(),
        )
        .await?;
    ensure_naive_fails(&output, &out)?;

    // A --resource that names another kind of store than the URL opens
    // cannot run: the result would claim a fence nobody proved.
    let out = rig.work.path().join("redis-mismatch.json");
    let output = rig
        .kit(
            "pausetest/redis-3",
            "postgresql:ledger",
            &server.url(),
            &out,
            &[],
            server.password(),
        )
        .await?;
    ensure!(
        output.status.code() == Some(2),
        "expected exit 2 (could not run)"
    );
    let stderr = text(&output.stderr);
    ensure!(
        stderr.contains("does not name a redis resource"),
        "the refusal says why: {stderr}"
    );
    ensure!(
        !out.exists(),
        "a result was written for a run that could not run"
    );
    assert!(
        store
            .read("latchkey-pause-test/pausetest/redis-3")
            .await?
            .is_none()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_passes_the_etcd_fence_and_fails_a_naive_writer() -> anyhow::Result<()> {
    let rig = rig().await?;
    // The user's own etcd, not the lock log's.
    let mut etcd = EtcdServer::start().await?;
    etcd.enable_auth("root-secret-pw").await?;
    etcd.add_user("app", "app-secret-pw", "fenced/").await?;
    let url = format!(
        "etcd://app:app-secret-pw@127.0.0.1:{}/fenced",
        etcd.client_port()
    );
    let store = latchkey_fence_etcd::EtcdStore::connect(&url).await?;
    let resource = "etcd:fenced";
    let out = rig.work.path().join("etcd.json");
    let key = "pausetest/etcd-1";
    let output = rig
        .kit(key, resource, &url, &out, &[], "app-secret-pw")
        .await?;
    let row = format!("latchkey-pause-test/{key}");
    let mark = ensure_pass(&output, &out, resource, &store, &row).await?;
    // The first holder's mark: the mark key's previous version.
    let client = etcd.client().await?;
    let mark_key = format!("fenced/{row}/mark");
    let now = latchkey_etcd::kv::get_one(&client, mark_key.clone())
        .await?
        .value
        .context("the mark key")?;
    let earlier = client
        .kv_client()
        .get(
            mark_key,
            Some(latchkey_etcd::kv::GetOptions::new().with_revision(now.mod_revision() - 1)),
        )
        .await?;
    let first = earlier.kvs().first().context("the first holder's mark")?;
    let first = u64::from_be_bytes(first.value().try_into()?);
    assert!(first < mark);
    ensure_no_token_leaked(&output, &out, &[first, mark])?;

    let out = rig.work.path().join("etcd-naive.json");
    let output = rig
        .kit(
            "pausetest/etcd-2",
            resource,
            &url,
            &out,
            &["--naive"],
            "app-secret-pw",
        )
        .await?;
    ensure_naive_fails(&output, &out)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_fails_a_naive_postgres_writer_through_the_url() -> anyhow::Result<()> {
    let rig = rig().await?;
    let pg = PostgresServer::start().await?;
    let out = rig.work.path().join("pg-naive.json");
    // The harness's URL has no password; its user name stands in as the secret.
    let output = rig
        .kit(
            "pausetest/pg-naive",
            crate::pause_test::RESOURCE,
            &pg.url(),
            &out,
            &["--naive"],
            "postgres@",
        )
        .await?;
    ensure_naive_fails(&output, &out)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_probes_and_passes_the_s3_fence_and_fails_a_naive_writer() -> anyhow::Result<()> {
    let rig = rig().await?;
    let server = latchkey_tests::s3::S3Server::start().await?;
    let store = server.store("pausetest", "ledger/").await?;
    let url = server.url("pausetest", "ledger");
    let secret = server.credentials().secret_key().to_string();
    let envs: Vec<(&str, String)> = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
        .into_iter()
        .filter_map(|name| Some((name, server.env(name)?)))
        .collect();
    let resource = "s3:pausetest/ledger";
    let out = rig.work.path().join("s3.json");
    let key = "pausetest/s3-1";
    // The default record name is one S3 takes.
    let output = rig
        .kit_with_env(key, resource, &url, &out, &[], &secret, &envs)
        .await?;
    let mark = ensure_pass(
        &output,
        &out,
        resource,
        &store,
        "latchkey-pause-test/pausetest/s3-1",
    )
    .await?;
    ensure_no_token_leaked(&output, &out, &[mark])?;

    let out = rig.work.path().join("s3-naive.json");
    let output = rig
        .kit_with_env(
            "pausetest/s3-2",
            resource,
            &url,
            &out,
            &["--naive", "--row", "pausetest-s3-2"],
            &secret,
            &envs,
        )
        .await?;
    ensure_naive_fails(&output, &out)?;
    Ok(())
}
