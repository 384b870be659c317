//! The client library and latchctl against the real arbiter on real etcd,
//! over mTLS with the dev SVIDs: re-entrancy that costs the log nothing
//! (ADR-13), one session per TTL (ADR-10), contention, ADR-12's two stages
//! on a blocked network path (and that the arbiter hands the key on only
//! after the holder has fenced), and the CLI end to end.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use latchkey_client::{Client, ClientConfig, Error, FenceReason, Reason, TlsFiles};
use latchkey_policies::{Date, PolicySet};
use latchkey_tests::arbiter::{certs, spiffe, svid_flags};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::eventually;
use latchkey_tests::proxy::Proxy;
use tokio::process::Command;
use tokio::time::{Instant, sleep, timeout};
use tonic::Code;

use crate::support::stack;

/// `short` in policies/dev: the minimum TTL, so expiry happens in seconds.
const SHORT_TTL: Duration = Duration::from_secs(5);
/// ADR-12's margin between the local deadline and the arbiter's expiry.
const FENCE_MARGIN: Duration = Duration::from_secs(1);

fn tls(name: &str) -> anyhow::Result<TlsFiles> {
    let certs = certs()?;
    let svid = certs.svid(name);
    Ok(TlsFiles {
        ca: certs.ca(),
        cert: svid.cert,
        key: svid.key,
    })
}

/// The library, connected over mTLS under `name`'s SVID.
pub(crate) async fn connect(addr: SocketAddr, name: &str) -> anyhow::Result<Client> {
    let mut config = ClientConfig::tls(format!("https://{addr}"), tls(name)?);
    config.connect_timeout = Duration::from_secs(5);
    config.request_timeout = Duration::from_secs(5);
    Client::connect(config)
        .await
        .with_context(|| format!("connecting to {addr} as {name}"))
}

async fn lease_ids(etcd: &EtcdServer) -> anyhow::Result<BTreeSet<i64>> {
    let leases = etcd.client().await?.lease_client().leases().await?;
    Ok(leases.leases().iter().map(|l| l.id()).collect())
}

pub(crate) type Fired = Arc<Mutex<Vec<(Instant, FenceReason)>>>;

pub(crate) fn recorder(fired: &Fired) -> impl Fn(FenceReason) + Send + Sync + 'static {
    let fired = Arc::clone(fired);
    move |reason| {
        let now = Instant::now();
        fired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((now, reason));
    }
}

pub(crate) fn snapshot(fired: &Fired) -> Vec<(Instant, FenceReason)> {
    fired.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn nested_acquire_and_release_never_reach_etcd_and_the_final_release_frees_the_key()
-> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;

    let outer = alice.lock("demo/re", "demo").acquire(|_| {}).await?;
    let view = alice.inspect("demo/re").await?;
    let holder = view.holder.context("held after the outermost acquire")?;
    assert_eq!(holder.identity, spiffe("workload/alice"), "mTLS identity");
    assert_eq!(
        holder.session_id,
        outer.session_id(),
        "the holder sees its session"
    );

    let before = s.etcd.revision().await?;
    let inner = alice.lock("demo/re", "demo").acquire(|_| {}).await?;
    assert_eq!(outer.hold_count(), 2);
    assert_eq!(inner.token(), outer.token());
    assert_eq!(inner.session_id(), outer.session_id());
    assert_eq!(
        s.etcd.revision().await?,
        before,
        "a nested acquire must not write to the lock log"
    );
    inner.release().await?;
    assert_eq!(outer.hold_count(), 1);
    assert_eq!(
        s.etcd.revision().await?,
        before,
        "an inner release must not write to the lock log"
    );
    let still = alice.inspect("demo/re").await?.holder;
    assert_eq!(
        still.map(|h| h.session_id),
        Some(outer.session_id()),
        "still held"
    );

    // The same identity on another session is a leak, not re-entrancy.
    let other = connect(s.arbiter.addr(), "workload/alice").await?;
    match other.lock("demo/re", "demo").acquire(|_| {}).await {
        Err(Error::Refused { code, reason, .. }) => {
            assert_eq!((code, reason), (Code::FailedPrecondition, Reason::Leak));
        }
        other => bail!("alice on a second session: {other:?}"),
    }

    let first = outer.token();
    outer.release().await?;
    assert!(
        s.etcd.revision().await? > before,
        "the final release is a write"
    );
    let view = alice.inspect("demo/re").await?;
    assert!(
        view.holder.is_none(),
        "free after the final release: {view:?}"
    );

    let again = alice.lock("demo/re", "demo").acquire(|_| {}).await?;
    assert_eq!(again.hold_count(), 1);
    assert!(again.token() > first, "the next grant has a larger token");
    again.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn holds_of_one_ttl_share_one_session_and_one_lease() -> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let baseline = lease_ids(&s.etcd).await?;

    let a = alice.lock("demo/s1", "demo").acquire(|_| {}).await?;
    let b = alice.lock("demo/s2", "demo").acquire(|_| {}).await?;
    assert_eq!(a.session_id(), b.session_id(), "same class, same session");
    let opened: BTreeSet<i64> = lease_ids(&s.etcd)
        .await?
        .difference(&baseline)
        .copied()
        .collect();
    assert_eq!(
        opened,
        BTreeSet::from([a.session_id()]),
        "one etcd lease, and it is the session"
    );
    let session = alice.open_session("demo").await?;
    assert_eq!(session.id(), a.session_id());
    assert!(
        session.reused(),
        "the arbiter hands back the client's lease"
    );

    let c = alice.lock("demo/s3", "short").acquire(|_| {}).await?;
    assert_ne!(
        c.session_id(),
        a.session_id(),
        "another TTL, another session"
    );
    let opened: BTreeSet<i64> = lease_ids(&s.etcd)
        .await?
        .difference(&baseline)
        .copied()
        .collect();
    assert_eq!(opened, BTreeSet::from([a.session_id(), c.session_id()]));

    for (key, guard) in [("demo/s1", &a), ("demo/s2", &b), ("demo/s3", &c)] {
        let holder = alice.inspect(key).await?.holder.context("held")?;
        assert_eq!(holder.session_id, guard.session_id(), "{key}");
    }
    a.release().await?;
    b.release().await?;
    c.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_is_granted_on_release_a_try_lock_is_refused_held_and_strangers_are_denied()
-> anyhow::Result<()> {
    let s = stack().await?;
    let alice = connect(s.arbiter.addr(), "workload/alice").await?;
    let bob = connect(s.arbiter.addr(), "workload/bob").await?;
    let mallory = connect(s.arbiter.addr(), "workload/mallory").await?;

    let held = alice.lock("demo/c", "demo").acquire(|_| {}).await?;
    match bob.lock("demo/c", "demo").acquire(|_| {}).await {
        Err(Error::Refused { code, reason, .. }) => {
            assert_eq!((code, reason), (Code::Aborted, Reason::Held));
        }
        other => bail!("a try-lock of a held key: {other:?}"),
    }

    let waiter = bob.clone();
    let waiting = tokio::spawn(async move {
        let guard = waiter
            .lock("demo/c", "demo")
            .wait(Duration::from_secs(20))
            .acquire(|_| {})
            .await;
        (Instant::now(), guard)
    });
    eventually("bob queued on demo/c", Duration::from_secs(10), || {
        let alice = alice.clone();
        async move {
            let waiters = alice.inspect("demo/c").await?.waiters;
            ensure!(waiters == 1, "{waiters} waiting");
            Ok(())
        }
    })
    .await?;
    assert!(!waiting.is_finished(), "granted while alice still holds");

    let first = held.token();
    let released_at = Instant::now();
    held.release().await?;
    let (granted_at, granted) = timeout(Duration::from_secs(10), waiting)
        .await
        .context("bob was not granted after the release")??;
    let granted = granted?;
    assert!(granted_at >= released_at);
    assert!(granted.token() > first, "a later grant, a larger token");
    let holder = alice
        .inspect("demo/c")
        .await?
        .holder
        .context("held by bob")?;
    assert_eq!(holder.identity, spiffe("workload/bob"));
    assert_eq!(holder.session_id, 0, "bob's session is not alice's to see");

    match mallory.lock("demo/c2", "demo").acquire(|_| {}).await {
        Err(Error::Refused { code, reason, .. }) => {
            assert_eq!(
                (code, reason),
                (Code::PermissionDenied, Reason::NotAuthorised)
            );
        }
        other => bail!("mallory outside her prefix: {other:?}"),
    }
    granted.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_blocked_path_stops_new_work_then_fences_before_the_arbiter_hands_the_key_on()
-> anyhow::Result<()> {
    const KEY: &str = "demo/adr12";
    let s = stack().await?;
    let proxy = Proxy::start(s.arbiter.addr()).await?;
    let alice = connect(proxy.addr(), "workload/alice").await?;
    let bob = connect(s.arbiter.addr(), "workload/bob").await?;
    let fired: Fired = Arc::default();

    let guard = alice.lock(KEY, "short").acquire(recorder(&fired)).await?;
    let session = alice
        .session(guard.session_id())
        .context("alice's session")?;
    assert_eq!(session.ttl(), SHORT_TTL);

    // Forwarding: every renewal moves the deadline, and new work may start
    // throughout. Three renewals take us past the deadline of the open.
    let mut deadline = guard.fence_deadline();
    let mut renewals = 0;
    let until = Instant::now() + Duration::from_secs(10);
    while renewals < 3 {
        ensure!(guard.can_start(), "a healthy path must not stop new work");
        ensure!(snapshot(&fired).is_empty(), "fenced on a healthy path");
        ensure!(Instant::now() < until, "only {renewals} renewals in 10 s");
        let now_deadline = guard.fence_deadline();
        if now_deadline > deadline {
            renewals += 1;
            deadline = now_deadline;
        }
        sleep(Duration::from_millis(10)).await;
    }

    proxy.block();
    let blocked_at = Instant::now();
    // Bob queues at once on a direct path: the arbiter may hand him the key
    // only once alice's lease has expired in etcd.
    let waiter = bob.clone();
    let bob_waiting = tokio::spawn(async move {
        let guard = waiter
            .lock(KEY, "short")
            .wait(Duration::from_secs(20))
            .acquire(|_| {})
            .await;
        (Instant::now(), guard)
    });

    let mut stopped_at = None;
    let until = blocked_at + SHORT_TTL + Duration::from_secs(2);
    while snapshot(&fired).is_empty() {
        let now = Instant::now();
        ensure!(now < until, "on_fence never fired");
        if stopped_at.is_none() && !guard.can_start() && !guard.is_fenced() {
            stopped_at = Some(now);
        }
        sleep(Duration::from_millis(5)).await;
    }
    let stopped_at = stopped_at.context("can_start() never turned false before the fence")?;
    // Fenced: the deadline no longer moves; it is the one the fence honoured.
    let deadline = guard.fence_deadline();

    let (bob_at, bob_guard) = timeout(Duration::from_secs(20), bob_waiting)
        .await
        .context("bob was never granted")??;
    let bob_guard = bob_guard.context("bob's waiting acquire")?;

    let fired = snapshot(&fired);
    ensure!(
        fired.len() == 1,
        "on_fence must fire exactly once: {fired:?}"
    );
    let (fence_at, reason) = fired[0];
    assert_eq!(reason, FenceReason::DeadlineExceeded);

    eprintln!(
        "ADR-12 on real etcd: can_start()=false {:?} after the block; deadline {:?} after the \
         block; on_fence {:?} after the deadline ({:?} after can_start()=false); bob granted {:?} \
         after on_fence",
        stopped_at - blocked_at,
        deadline - blocked_at,
        fence_at - deadline,
        fence_at - stopped_at,
        bob_at - fence_at,
    );

    // The deadline is send time + TTL − 1 s of a renewal sent before the
    // block, and no older than one keepalive interval before it.
    let fence_after_send = SHORT_TTL - FENCE_MARGIN;
    ensure!(
        deadline <= blocked_at + fence_after_send,
        "deadline later than any send before the block allows"
    );
    ensure!(
        deadline + session.keepalive_interval() + Duration::from_millis(300)
            >= blocked_at + fence_after_send,
        "deadline older than the last renewal"
    );
    ensure!(fence_at >= deadline, "fenced before the deadline");
    ensure!(
        fence_at <= deadline + Duration::from_millis(500),
        "fenced {:?} after the deadline",
        fence_at - deadline
    );
    ensure!(
        stopped_at + Duration::from_secs(1) <= fence_at,
        "can_start() must turn false well before the fence ({:?} before)",
        fence_at - stopped_at
    );

    // The safety point: the holder believed it had lost before the arbiter
    // let anyone else in.
    ensure!(
        fence_at < bob_at,
        "bob was granted {:?} before alice fenced",
        fence_at - bob_at
    );
    assert!(
        bob_guard.token() > guard.token(),
        "a later grant, a larger token"
    );
    let holder = bob.inspect(KEY).await?.holder.context("held by bob")?;
    assert_eq!(holder.identity, spiffe("workload/bob"));

    assert!(!guard.can_start() && guard.is_fenced());
    let fenced_session = guard.session_id();
    match guard.release().await {
        Err(Error::Fenced { reason, .. }) => assert_eq!(reason, FenceReason::DeadlineExceeded),
        other => bail!("release after the fence: {other:?}"),
    }
    bob_guard.release().await?;

    // The path heals: the client drops the dead session and opens a new one.
    proxy.unblock();
    let again = alice
        .lock("demo/adr12-after", "short")
        .acquire(|_| {})
        .await?;
    assert_ne!(
        again.session_id(),
        fenced_session,
        "a fenced session is not reused"
    );
    assert!(again.can_start());
    again.release().await?;
    Ok(())
}

// --- latchctl ---------------------------------------------------------------

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

async fn run(cmd: &mut Command) -> anyhow::Result<Output> {
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
    assert_eq!(token >> 48, 1, "epoch 1 in the token's high bits");
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

    // mallory: refused with the code and reason on stderr, exit 1.
    let out = run(latchctl(addr, "workload/mallory")?.args([
        "acquire",
        "demo/cli3",
        "--class",
        "demo",
        "--detach",
    ]))
    .await?;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
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
        .get(format!("/latchkey/l/{KEY}"), None)
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
    assert_eq!(status.code(), Some(1), "{stderr}");
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
    assert!(granted.token().get() > (1u64 << 48) + u64::try_from(held_at)?);
    granted.release().await?;
    Ok(())
}
