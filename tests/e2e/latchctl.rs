//! latchctl end to end: the `latchctl-under-test` build of it against the
//! real arbiter on real etcd, over mTLS with the dev SVIDs. The helpers that
//! run it (`latchctl`, `latchctl_hold`) serve the other suites too.

use std::net::SocketAddr;
use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use latchkey_policies::{Date, PolicySet};
use latchkey_records::token::{pack, unpack};
use latchkey_tests::arbiter::{spiffe, svid_flags};
use latchkey_tests::eventually;
use latchkey_tests::proxy::Proxy;
use tokio::process::Command;
use tokio::time::{Instant, timeout};

use crate::client::{FENCE_MARGIN, SHORT_TTL, connect};
use crate::support::{layout, stack};

pub(crate) fn latchctl(addr: SocketAddr, name: &str) -> anyhow::Result<Command> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"));
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .arg("--endpoint")
        .arg(format!("https://{addr}"))
        .args(svid_flags(name)?)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    Ok(cmd)
}

/// A `latchctl hold` whose command (`sleep`) is running.
pub(crate) struct HeldByLatchctl {
    pub child: tokio::process::Child,
    /// The command's pid.
    pub pid: i32,
    /// latchctl's stderr, in a file: `sleep` inherits latchctl's stdio, and
    /// a file can be read whether or not latchctl has exited.
    pub stderr_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// `latchctl hold KEY --class CLASS -- sleep SECS` as `name` against
/// `addr`, once its command runs: the command runs only once latchctl has
/// the grant in hand (the key shows as held at the arbiter earlier, while
/// the reply is in flight).
pub(crate) async fn latchctl_hold(
    addr: SocketAddr,
    name: &str,
    key: &str,
    class: &str,
    secs: u32,
) -> anyhow::Result<HeldByLatchctl> {
    let dir = tempfile::tempdir()?;
    let stderr_path = dir.path().join("stderr");
    let pid_path = dir.path().join("pid");
    let child = latchctl(addr, name)?
        .args(["hold", key, "--class", class, "--", "sh", "-c"])
        .arg(format!(
            "echo $$ > {}; exec sleep {secs}",
            pid_path.display()
        ))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path)?)
        .spawn()
        .context("spawn latchctl")?;
    let pid = eventually(
        "latchctl to start its command",
        Duration::from_secs(10),
        || {
            let pid_path = pid_path.clone();
            async move { Ok(std::fs::read_to_string(&pid_path)?.trim().parse::<i32>()?) }
        },
    )
    .await?;
    Ok(HeldByLatchctl {
        child,
        pid,
        stderr_path,
        _dir: dir,
    })
}

pub(crate) async fn run(cmd: &mut Command) -> anyhow::Result<Output> {
    timeout(Duration::from_secs(30), cmd.output())
        .await
        .context("latchctl did not finish in 30 s")?
        .context("latchctl did not run")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn json(out: &Output) -> anyhow::Result<serde_json::Value> {
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("--json output: {}", text(&out.stdout)))
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_holds_acquires_inspects_and_releases_on_the_real_arbiter() -> anyhow::Result<()> {
    let s = stack().await?;
    let addr = s.arbiter.addr();
    let alice = connect(addr, "workload/alice").await?;
    let dir = tempfile::tempdir()?;

    // hold: the command runs with the token and the key is free afterwards.
    let file = dir.path().join("token");
    let out = run(latchctl(addr, "workload/alice")?.args([
        "hold",
        "demo/cli",
        "--class",
        "demo",
        "--",
        "sh",
        "-c",
        &format!("echo $LATCHKEY_TOKEN > {}", file.display()),
    ]))
    .await?;
    ensure!(out.status.success(), "hold: {}", text(&out.stderr));
    let token: u64 = std::fs::read_to_string(&file)?
        .trim()
        .parse()
        .context("LATCHKEY_TOKEN is a number")?;
    assert_eq!(unpack(token).0, 1, "epoch 1 in the token's high bits");
    assert!(
        !text(&out.stderr).contains(&token.to_string()),
        "hold must not print the token"
    );
    let view = alice.inspect("demo/cli").await?;
    assert!(view.holder.is_none(), "free after hold: {view:?}");

    // acquire --detach, inspect, release by session and token.
    let out = run(latchctl(addr, "workload/alice")?.args([
        "acquire",
        "demo/cli2",
        "--class",
        "demo",
        "--detach",
        "--json",
    ]))
    .await?;
    ensure!(out.status.success(), "acquire: {}", text(&out.stderr));
    let grant = json(&out)?;
    assert_eq!(grant["key"], "demo/cli2");
    let token = grant["token"].as_u64().context("token")?;
    let session = grant["session_id"].as_i64().context("session_id")?;
    assert!(token > 0);

    let out =
        run(latchctl(addr, "workload/alice")?.args(["inspect", "demo/cli2", "--json"])).await?;
    ensure!(out.status.success(), "inspect: {}", text(&out.stderr));
    let view = json(&out)?;
    assert_eq!(view["holder"]["identity"], spiffe("workload/alice"));
    assert_eq!(view["holder"]["session_id"].as_i64(), Some(session));
    assert!(
        view["holder"]["token"].is_null(),
        "inspect never shows a token"
    );

    let out = run(latchctl(addr, "workload/alice")?.args([
        "release",
        "demo/cli2",
        "--session",
        &session.to_string(),
        "--token",
        &token.to_string(),
    ]))
    .await?;
    ensure!(out.status.success(), "release: {}", text(&out.stderr));
    let view = alice.inspect("demo/cli2").await?;
    assert!(view.holder.is_none(), "free after release: {view:?}");

    // mallory: refused with the code and reason on stderr, exit 5.
    let out = run(latchctl(addr, "workload/mallory")?.args([
        "acquire",
        "demo/cli3",
        "--class",
        "demo",
        "--detach",
    ]))
    .await?;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "REFUSED exits 5: {stderr}");
    assert!(
        stderr.contains("PERMISSION_DENIED") && stderr.contains("NOT_AUTHORISED"),
        "{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "no grant printed: {}",
        text(&out.stdout)
    );

    // admin status as the operator.
    let out = run(latchctl(addr, "latchkey/operator")?.args(["admin", "status", "--json"])).await?;
    ensure!(out.status.success(), "admin status: {}", text(&out.stderr));
    let status = json(&out)?;
    assert_eq!(status["epoch"].as_u64(), Some(1), "{status}");
    assert_eq!(status["sealed"], false, "{status}");
    let out = run(latchctl(addr, "latchkey/operator")?.args(["admin", "status"])).await?;
    ensure!(out.status.success(), "admin status: {}", text(&out.stderr));
    let human = text(&out.stdout);
    assert!(
        human
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["epoch", "1"]),
        "{human}"
    );
    Ok(())
}

/// A TLS setup that cannot work fails at once with exit 8, the cause named
/// and never called temporary: a CA that did not sign the server's
/// certificate, a server name the certificate does not have, a key that is
/// not the certificate's.
#[tokio::test(flavor = "multi_thread")]
async fn latchctl_names_a_wrong_tls_setup_and_does_not_call_it_temporary() -> anyhow::Result<()> {
    let s = stack().await?;
    let addr = s.arbiter.addr();
    let certs = latchkey_tests::arbiter::certs()?;
    let alice = certs.svid("workload/alice");
    let bob = certs.svid("workload/bob");
    let other = tempfile::tempdir()?;
    let made = run(Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"))
        .args([
            "dev-certs",
            "--trust-domain",
            "other.test",
            "--name",
            "x",
            "--out",
        ])
        .arg(other.path()))
    .await?;
    ensure!(made.status.success(), "dev-certs: {}", text(&made.stderr));
    let other_ca = other.path().join("ca.pem");
    ensure!(other_ca.exists(), "no ca.pem in {}", other.path().display());
    let base = || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .arg("--endpoint")
            .arg(format!("https://{addr}"))
            .stdin(Stdio::null())
            .kill_on_drop(true);
        cmd
    };
    let files = |ca: &std::path::Path, key: &std::path::Path| -> Vec<std::ffi::OsString> {
        vec![
            "--ca".into(),
            ca.into(),
            "--cert".into(),
            alice.cert.clone().into(),
            "--key".into(),
            key.into(),
        ]
    };
    let ca = certs.ca();
    let mut wrong_name = files(&ca, &alice.key);
    wrong_name.extend(["--tls-domain".into(), "not-the-arbiter.example".into()]);
    let cases: [(&str, Vec<std::ffi::OsString>, &str); 3] = [
        (
            "a CA that did not sign the server's certificate",
            files(&other_ca, &alice.key),
            "UnknownIssuer",
        ),
        (
            "a server name the certificate does not have",
            wrong_name,
            "not valid for name",
        ),
        (
            "a key that is not the certificate's",
            files(&ca, &bob.key),
            "KeyMismatch",
        ),
    ];
    for (what, flags, cause) in cases {
        let began = Instant::now();
        let out = run(base().args(flags).args(["inspect", "demo/tls"])).await?;
        let stderr = text(&out.stderr);
        eprintln!(
            "{what}: {:?} in {:?}: {stderr}",
            out.status.code(),
            began.elapsed()
        );
        assert_eq!(out.status.code(), Some(8), "{what}: {stderr}");
        assert!(stderr.contains(cause), "{what}: {stderr}");
        assert!(!stderr.contains("temporary"), "{what}: {stderr}");
        assert!(stderr.contains("TLS setup"), "{what}: {stderr}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_classes_check_prints_one_review_line_per_class() -> anyhow::Result<()> {
    let policies = latchkey_tests::dev_policies()?;
    let expected = PolicySet::load_dir(policies, Date::today_utc())?;
    // No endpoint or certificates needed: this never dials.
    let out = run(Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"))
        .env_clear()
        .args(["classes", "check"])
        .arg(policies)
        .kill_on_drop(true))
    .await?;
    ensure!(out.status.success(), "classes check: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), expected.classes().len(), "{stdout}");
    for name in expected.classes().keys() {
        assert_eq!(
            lines.iter().filter(|l| mentions(l, name)).count(),
            1,
            "one line for class {name}: {stdout}"
        );
    }
    Ok(())
}

/// Whether `line` names `class` as a whole word (`demo` is not in `demos`).
fn mentions(line: &str, class: &str) -> bool {
    line.split(|c: char| !(c.is_alphanumeric() || c == '-' || c == '_'))
        .any(|word| word == class)
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_hold_stops_its_command_when_the_session_is_lost() -> anyhow::Result<()> {
    const KEY: &str = "demo/cli-lost";
    let s = stack().await?;
    let proxy = Proxy::start(s.arbiter.addr()).await?;
    let bob = connect(s.arbiter.addr(), "workload/bob").await?;
    let held = latchctl_hold(proxy.addr(), "workload/alice", KEY, "short", 60).await?;
    let (mut child, pid) = (held.child, held.pid);
    let stderr = || std::fs::read_to_string(&held.stderr_path).unwrap_or_default();
    let holder = bob.inspect(KEY).await?.holder.context("held by latchctl")?;
    assert_eq!(holder.identity, spiffe("workload/alice"));
    // Inspect gives no token: alice's hold's revision, from etcd itself
    let held_at = s
        .etcd
        .client()
        .await?
        .get(layout().holder(KEY), None)
        .await?
        .kvs()
        .first()
        .map(|kv| kv.mod_revision())
        .context("alice's holder record")?;

    proxy.block();
    let blocked_at = Instant::now();
    let waiter = bob.clone();
    let bob_waiting = tokio::spawn(async move {
        let guard = waiter
            .lock(KEY, "short")
            .wait(Duration::from_secs(20))
            .acquire(|_| {})
            .await;
        (Instant::now(), guard)
    });
    let status = match timeout(SHORT_TTL + Duration::from_secs(3), child.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            let _ = child.start_kill();
            bail!(
                "latchctl kept running {:?} after its session was lost; stderr:\n{}",
                blocked_at.elapsed(),
                stderr()
            );
        }
    };
    let exited_after = blocked_at.elapsed();
    let stderr = stderr();
    eprintln!("latchctl hold exited {exited_after:?} after the block: {stderr}");
    assert_eq!(status.code(), Some(7), "LOST exits 7: {stderr}");
    assert!(stderr.contains(&format!("lock on {KEY} lost")), "{stderr}");
    assert!(
        exited_after <= SHORT_TTL - FENCE_MARGIN + Duration::from_secs(1),
        "latchctl should stop the command at its fence deadline, took {exited_after:?}"
    );
    let sleep_pid = nix::unistd::Pid::from_raw(pid);
    assert_eq!(
        nix::sys::signal::kill(sleep_pid, None),
        Err(nix::errno::Errno::ESRCH),
        "the command must be stopped, not orphaned"
    );

    // The arbiter lets the key go once the lease runs out, and not before
    // latchctl has stopped the command.
    let exited_at = blocked_at + exited_after;
    let (granted_at, granted) = timeout(Duration::from_secs(20), bob_waiting)
        .await
        .context("bob was never granted")??;
    let granted = granted?;
    ensure!(
        exited_at < granted_at,
        "bob was granted {:?} before latchctl stopped its command",
        exited_at - granted_at
    );
    assert!(granted.token().get() > pack(1, held_at).context("a token of epoch 1")?);
    granted.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_admin_shards_adds_a_shard_and_reports_the_map() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let coord = latchkey_tests::etcd::EtcdServer::start().await?;
    let added = latchkey_tests::etcd::EtcdServer::start().await?;
    let s = crate::support::stack_with(latchkey_tests::arbiter::ArbiterOptions {
        coord: Some(latchkey_tests::arbiter::Coord::on(&coord)),
        ..Default::default()
    })
    .await?;
    let addr = s.arbiter.addr();

    // Before any map: the lock cluster alone.
    let out = run(latchctl(addr, "latchkey/operator")?.args(["admin", "shards", "status"])).await?;
    ensure!(out.status.success(), "shards status: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("none yet"),
        "{}",
        text(&out.stdout)
    );

    // A workload identity may not change the map; bad input is refused
    // with a message and exit status, and writes nothing.
    let before = coord.revision().await?;
    let out = run(latchctl(addr, "workload/demo")?.args([
        "admin",
        "shards",
        "add",
        "b",
        "--endpoints",
        &added.endpoint(),
        "--reason",
        "grow",
    ]))
    .await?;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("PERMISSION_DENIED"),
        "{}",
        text(&out.stderr)
    );
    let out = run(latchctl(addr, "latchkey/operator")?.args([
        "admin",
        "shards",
        "add",
        "b",
        "--endpoints",
        "etcd.example:2379",
        "--reason",
        "grow",
    ]))
    .await?;
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("INVALID_ARGUMENT") && stderr.contains("not an etcd client URL"),
        "{stderr}"
    );
    assert_eq!(coord.revision().await?, before);

    // The operator adds a shard; nothing is held, so the move finishes.
    let out = run(latchctl(addr, "latchkey/operator")?.args([
        "admin",
        "shards",
        "add",
        "entity-b",
        "--endpoints",
        &added.endpoint(),
        "--reason",
        "grow the entity tier",
    ]))
    .await?;
    ensure!(out.status.success(), "shards add: {}", text(&out.stderr));
    let out =
        run(latchctl(addr, "latchkey/operator")?.args(["--json", "admin", "shards", "status"]))
            .await?;
    ensure!(out.status.success(), "shards status: {}", text(&out.stderr));
    let status = json(&out)?;
    assert_eq!(status["version"].as_u64(), Some(2), "{status}");
    assert!(status["move"].is_null(), "{status}");
    let shards = status["shards"].as_array().cloned().unwrap_or_default();
    let names: Vec<_> = shards.iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, ["default", "entity-b"], "{status}");
    // The new shard's epoch is above the lock cluster's, both fenced at 2.
    assert!(
        shards[1]["epoch"].as_u64() > shards[0]["epoch"].as_u64(),
        "{status}"
    );
    assert!(
        shards
            .iter()
            .all(|s| s["fence_version"].as_u64() == Some(2)),
        "{status}"
    );
    Ok(())
}

/// `latchctl acquire` holding a key exclusively downgrades it on a line
/// `downgrade` on its input: the arbiter then has one shared hold of
/// latchctl's session, another reader is granted beside it and a writer is
/// not; the end of input releases it. The token is printed once, at the
/// grant, never for the downgrade.
#[tokio::test(flavor = "multi_thread")]
async fn latchctl_acquire_downgrades_its_hold_on_a_downgrade_line() -> anyhow::Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

    let s = stack().await?;
    let addr = s.arbiter.addr();
    let bob = connect(addr, "workload/bob").await?;
    let key = "demo/cli-downgrade";
    let mut child = latchctl(addr, "workload/alice")?
        .args(["acquire", key, "--class", "demo", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn latchctl")?;
    let (Some(mut input), Some(stdout), Some(mut stderr_pipe)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        anyhow::bail!("latchctl's stdio is piped");
    };
    let mut lines = BufReader::new(stdout).lines();
    let mut next = async || -> anyhow::Result<serde_json::Value> {
        let line = timeout(Duration::from_secs(20), lines.next_line())
            .await
            .context("latchctl printed nothing in 20 s")??
            .context("latchctl's stdout ended")?;
        serde_json::from_str(&line).with_context(|| format!("--json output: {line}"))
    };
    let grant = next().await?;
    assert_eq!(grant["mode"], "exclusive", "{grant}");
    let exclusive = grant["token"].as_u64().context("token")?;
    match bob.lock(key, "demo").shared().acquire(|_| {}).await {
        Err(e) if e.reason() == latchkey_client::Reason::Held => {}
        other => anyhow::bail!("a reader beside latchctl's writer: {other:?}"),
    }

    input.write_all(b"downgrade\n").await?;
    let downgraded = next().await?;
    assert_eq!(downgraded["downgraded"], true, "{downgraded}");
    assert_eq!(downgraded["mode"], "shared", "{downgraded}");
    assert!(
        downgraded.get("token").is_none() && downgraded.get("revision").is_none(),
        "no token printed for the downgrade: {downgraded}"
    );
    let view = bob.inspect(key).await?;
    assert!(
        view.holder.is_none() && view.shared_holders.len() == 1,
        "latchctl's hold is shared now: {view:?}"
    );
    let reader = bob.lock(key, "demo").shared().acquire(|_| {}).await?;
    assert!(
        reader.token().get() > exclusive,
        "above the exclusive grant"
    );
    let writer = connect(addr, "workload/demo").await?;
    match writer.lock(key, "demo").acquire(|_| {}).await {
        Err(e) if e.reason() == latchkey_client::Reason::Held => {}
        other => anyhow::bail!("a writer beside the readers: {other:?}"),
    }

    // A second downgrade is refused; latchctl goes on holding.
    input.write_all(b"downgrade\n").await?;
    // End of input: latchctl releases its (shared) hold and exits.
    drop(input);
    let released = next().await?;
    assert_eq!(released["released"], true, "{released}");
    let status = timeout(Duration::from_secs(20), child.wait())
        .await
        .context("latchctl did not exit at the end of its input")??;
    let mut stderr = String::new();
    stderr_pipe.read_to_string(&mut stderr).await?;
    ensure!(status.success(), "latchctl acquire: {stderr}");
    assert!(
        stderr.contains("downgrade_refused") && stderr.contains("shared already"),
        "{stderr}"
    );
    let view = bob.inspect(key).await?;
    assert_eq!(view.shared_holders.len(), 1, "only bob's reader: {view:?}");
    reader.release().await?;
    Ok(())
}
