//! The latchctl binary against the fake arbiter, in dev mode.

use std::process::Output;
use std::time::Duration;

use tokio::process::Command;

use crate::fake_arbiter::FakeArbiter;
use latchkey_tests::proxy::Proxy;

fn latchctl(addr: std::net::SocketAddr) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_latchctl"));
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .arg("--endpoint")
        .arg(format!("http://{addr}"))
        .arg("--insecure-dev-identity")
        .arg("spiffe://latchkey.test/workload/demo")
        .kill_on_drop(true);
    cmd
}

async fn run(cmd: &mut Command) -> Output {
    match tokio::time::timeout(Duration::from_secs(20), cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("latchctl did not run: {e}"),
        Err(_) => panic!("latchctl did not finish"),
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn hold_runs_the_command_with_the_grant_and_exits_with_its_status() {
    let arbiter = FakeArbiter::new(&[("jobs", 15)]);
    let addr = arbiter.serve().await;
    let out = run(latchctl(addr).args([
        "hold",
        "jobs/nightly",
        "--class",
        "jobs",
        "--",
        "sh",
        "-c",
        "echo \"key=$LATCHKEY_KEY epoch=$LATCHKEY_EPOCH session=$LATCHKEY_SESSION token=$LATCHKEY_TOKEN\"; exit 7",
    ]))
    .await;
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "stderr: {stderr}");
    assert!(
        stdout.contains("key=jobs/nightly epoch=3 session=101"),
        "{stdout}"
    );
    let token = stdout
        .split("token=")
        .nth(1)
        .map(str::trim)
        .unwrap_or_default()
        .to_owned();
    assert!(token.parse::<u64>().is_ok(), "token in env: {stdout}");
    assert!(
        !stderr.contains(&token),
        "hold must not print the token: {stderr}"
    );
    assert_eq!(FakeArbiter::count(&arbiter.counters.release), 1);
    assert_eq!(FakeArbiter::count(&arbiter.counters.close_session), 1);
}

#[tokio::test]
async fn refusals_print_code_reason_message_and_exit_with_their_kind() {
    let arbiter = FakeArbiter::new(&[("jobs", 15)]);
    let addr = arbiter.serve().await;
    let first =
        run(latchctl(addr).args(["--json", "acquire", "jobs/x", "--class", "jobs", "--detach"]))
            .await;
    assert!(first.status.success(), "{}", text(&first.stderr));
    let grant: serde_json::Value = match serde_json::from_slice(&first.stdout) {
        Ok(v) => v,
        Err(e) => panic!("--json output: {e}: {}", text(&first.stdout)),
    };
    assert_eq!(grant["key"], "jobs/x");
    assert!(grant["token"].as_u64().is_some());

    let second = run(latchctl(addr).args(["acquire", "jobs/x", "--class", "jobs"])).await;
    assert_eq!(second.status.code(), Some(3), "HELD exits 3");
    assert_eq!(
        text(&second.stderr).trim(),
        "latchctl: ABORTED: HELD: the key is held"
    );
    // With --json the error is one JSON object on stderr; stdout stays empty.
    let third = run(latchctl(addr).args(["--json", "acquire", "jobs/x", "--class", "jobs"])).await;
    assert_eq!(third.status.code(), Some(3));
    assert!(third.stdout.is_empty(), "{}", text(&third.stdout));
    let error: serde_json::Value = match serde_json::from_slice(&third.stderr) {
        Ok(v) => v,
        Err(e) => panic!("--json error: {e}: {}", text(&third.stderr)),
    };
    assert_eq!(error["error"]["exit"], 3, "{error}");
    assert_eq!(error["error"]["kind"], "call", "{error}");
    assert_eq!(error["error"]["code"], "ABORTED", "{error}");
    assert_eq!(error["error"]["reason"], "HELD", "{error}");
    assert_eq!(error["error"]["temporary"], false, "{error}");

    let token = grant["token"].as_u64().unwrap_or_default().to_string();
    let session = grant["session_id"].as_i64().unwrap_or_default().to_string();
    let release = run(latchctl(addr).args([
        "release",
        "jobs/x",
        "--session",
        &session,
        "--token",
        &token,
    ]))
    .await;
    assert!(release.status.success(), "{}", text(&release.stderr));
}

/// Nothing listening: UNAVAILABLE, exit 6, with the retry hint (under
/// `--json`: `temporary` true).
#[tokio::test]
async fn an_unreachable_endpoint_exits_6_and_says_to_retry() {
    let closed = match std::net::TcpListener::bind("127.0.0.1:0") {
        Ok(l) => l.local_addr().expect("addr"),
        Err(e) => panic!("bind: {e}"),
    };
    let out = run(latchctl(closed).args(["inspect", "jobs/x"])).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "{stderr}");
    assert!(stderr.contains("temporary"), "{stderr}");
    let out = run(latchctl(closed).args(["--json", "inspect", "jobs/x"])).await;
    let error: serde_json::Value = match serde_json::from_slice(&out.stderr) {
        Ok(v) => v,
        Err(e) => panic!("--json error: {e}: {}", text(&out.stderr)),
    };
    assert_eq!(error["error"]["exit"], 6, "{error}");
    assert_eq!(error["error"]["temporary"], true, "{error}");
}

#[tokio::test]
async fn usage_errors_exit_2() {
    let out = run(Command::new(env!("CARGO_BIN_EXE_latchctl"))
        .env_clear()
        .args(["inspect", "jobs/x"]))
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--ca, --cert and --key"));
    let out = run(Command::new(env!("CARGO_BIN_EXE_latchctl"))
        .args(["acquire", "k", "--class", "c", "--wait", "soon"]))
    .await;
    assert_eq!(out.status.code(), Some(2));
}

#[tokio::test]
async fn hold_stops_the_command_when_the_lock_is_lost() {
    let arbiter = FakeArbiter::new(&[("short", 3)]);
    let proxy = Proxy::start(arbiter.serve().await).await.expect("proxy");
    let child = latchctl(proxy.addr())
        .args(["hold", "jobs/long", "--class", "short", "--", "sleep", "30"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => panic!("spawn latchctl: {e}"),
    };
    crate::assert_eventually!(
        FakeArbiter::count(&arbiter.counters.acquire) == 1,
        within = Duration::from_secs(5),
        "latchctl never acquired"
    );
    proxy.block();
    let out = match tokio::time::timeout(Duration::from_secs(8), child.wait_with_output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("wait: {e}"),
        Err(_) => panic!("latchctl kept running after the lock was lost"),
    };
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "a lost lock exits 7: {stderr}");
    assert!(stderr.contains("lock on jobs/long lost"), "{stderr}");
}
