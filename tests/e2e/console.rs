//! The operator console (issue 36) in a real headless Chromium (Debian's),
//! against the in-process arbiter on real etcd, a real OIDC provider, a
//! real audit tailer writing a real PostgreSQL, and `latchctl hold` as the
//! workloads. Every byte the console serves passes a recording proxy, in
//! which no fencing token handed out in the run may appear.
//!
//! alice holds and bob waits: both show within a second on a live page.
//! ana requests a force-release of bob's hold in the console, ben approves
//! it there, and bob's `latchctl hold` is stopped; the key's timeline is
//! what `latchctl audit` prints. mallory (a workload's role, no viewer or
//! operator role) is refused; vera (viewer) reads and cannot act. An
//! election's page shows its leader.
//! Screenshots of each page land in target/test-artifacts/console/.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_arbiter::console::ConsoleConfig;
use latchkey_proto::lockv1::InspectRequest;
use latchkey_tests::arbiter::ArbiterOptions;
use latchkey_tests::browser::{Browser, RecordingProxy, contains};
use latchkey_tests::eventually;
use latchkey_tests::oidc::OidcProvider;
use latchkey_tests::postgres::PostgresServer;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::audit::{Audit, Tailer};
use crate::latchctl::latchctl;
use crate::support::stack_with;

const KEY: &str = "demo/console-1";
/// Fenced, TTL 15 s.
const CLASS: &str = "demo";
const OPERATOR: &str = "latchkey/operator";
const LIVE: Duration = Duration::from_secs(1);
const WAIT: Duration = Duration::from_secs(30);

/// `latchctl hold` as `name`, whose command writes its token and pid and
/// runs until `release` exists.
struct Held {
    child: Child,
    dir: tempfile::TempDir,
}

impl Held {
    async fn start(addr: SocketAddr, name: &str, wait: Option<&str>) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let d = dir.path().display();
        let mut cmd = latchctl(addr, name)?;
        cmd.args(["hold", KEY, "--class", CLASS]);
        if let Some(wait) = wait {
            cmd.args(["--wait", wait]);
        }
        cmd.args(["--", "sh", "-c"])
            .arg(format!(
                "echo $LATCHKEY_TOKEN > {d}/token.tmp && mv {d}/token.tmp {d}/token; echo $$ > {d}/pid; \
                 while [ ! -e {d}/release ]; do sleep 0.05; done"
            ))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr"))?);
        let child = cmd.spawn().context("spawn latchctl hold")?;
        Ok(Self { child, dir })
    }

    /// The token its command was given, once it holds.
    async fn token(&self) -> anyhow::Result<u64> {
        let path = self.dir.path().join("token");
        eventually("latchctl hold to hold", WAIT, || {
            let path = path.clone();
            async move { Ok(std::fs::read_to_string(&path)?.trim().parse::<u64>()?) }
        })
        .await
    }

    fn release(&self) -> anyhow::Result<()> {
        Ok(std::fs::write(self.dir.path().join("release"), b"")?)
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }
}

fn artifacts() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("test-artifacts/console")
}

/// Signs in as `sub` through the provider's own sign-in page.
async fn sign_in(b: &mut Browser, console: &str, sub: &str, page: &str) -> anyhow::Result<()> {
    b.clear_cookies().await?;
    b.goto(&format!("{console}{page}")).await?;
    b.wait_for(
        "the provider's sign-in form",
        "document.querySelector('input[name=sub]') !== null",
        WAIT,
    )
    .await?;
    b.eval(&format!(
        "document.querySelector('input[name=sub]').value = {sub:?}; \
         document.querySelector('input[name=sub]').form.querySelector('button[type=submit]').click(); true"
    ))
    .await?;
    b.wait_for(
        "the console after sign-in",
        &format!("location.href.startsWith({console:?}) && document.readyState === 'complete'"),
        WAIT,
    )
    .await
}

/// The text of every element `selector` matches.
async fn texts(b: &mut Browser, selector: &str) -> anyhow::Result<Vec<String>> {
    let v = b
        .eval(&format!(
            "Array.from(document.querySelectorAll({selector:?})).map(e => e.innerText)"
        ))
        .await?;
    Ok(serde_json::from_value(v)?)
}

async fn waiters(s: &crate::support::Stack) -> anyhow::Result<u32> {
    let mut lock = s.arbiter.lock("workload/alice").await?;
    let r = lock
        .inspect(InspectRequest { key: KEY.into() })
        .await?
        .into_inner();
    Ok(r.waiters)
}

#[tokio::test(flavor = "multi_thread")]
async fn operators_watch_and_force_release_in_a_real_browser() -> anyhow::Result<()> {
    let shots = artifacts();
    std::fs::create_dir_all(&shots)?;
    let oidc = OidcProvider::start().await?;
    let operator = serde_json::json!({"roles": ["lock-operator"]});
    oidc.set_user("ana", operator.clone()).await?;
    oidc.set_user("ben", operator).await?;
    oidc.set_user("vera", serde_json::json!({"roles": ["lock-viewer"]}))
        .await?;
    oidc.set_user("mallory", serde_json::json!({"roles": ["workload"]}))
        .await?;
    let pg = PostgresServer::start().await?;
    let audit = Audit::postgres(&pg)?;

    // The console behind the recording proxy: browsers reach it there. Its
    // port is one that was free a moment ago (the proxy and the console's
    // public URL must name it before the arbiter starts): another test may
    // take it first, so a start that finds it taken picks another.
    let secret_dir = tempfile::tempdir()?;
    let secret = secret_dir.path().join("client-secret");
    std::fs::write(&secret, "console-secret\n")?;
    let mut attempt = 0;
    let (s, proxy, url) = loop {
        attempt += 1;
        let console_addr: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let proxy = RecordingProxy::start(console_addr).await?;
        let url = format!("http://{}", proxy.addr());
        let mut console = ConsoleConfig::new(console_addr.to_string());
        console.public_url = Some(url.clone());
        console.audit_store = Some(pg.url());
        console.client_secret_file = Some(secret.clone());
        console.force_release = true;
        let started = stack_with(ArbiterOptions {
            force_release: crate::force_release::config(&oidc, false),
            console: Some(console),
            ..ArbiterOptions::default()
        })
        .await;
        match started {
            Ok(s) => break (s, proxy, url),
            Err(e) if attempt < 5 && format!("{e:#}").contains("Address already in use") => {}
            Err(e) => return Err(e),
        }
    };
    let _tailer = Tailer::start(&s.etcd, &audit, &[])?;
    let addr = s.arbiter.addr();
    let mut b = Browser::start().await?;

    // ana signs in and watches the key's page.
    sign_in(
        &mut b,
        &url,
        "ana",
        &format!("/key?k={}", "demo%2Fconsole-1"),
    )
    .await?;
    b.wait_for(
        "the key page",
        "document.getElementById('why') !== null",
        WAIT,
    )
    .await?;
    b.wait_for(
        "live updates to be on",
        "document.getElementById('live-state').textContent.startsWith('on')",
        WAIT,
    )
    .await?;

    // alice holds: shown within a second of her grant.
    let alice = Held::start(addr, "workload/alice", None).await?;
    let alice_token = alice.token().await?;
    b.wait_for(
        "alice as the holder",
        "document.getElementById('holder').innerText.includes('workload/alice')",
        LIVE,
    )
    .await?;
    // bob waits: shown within a second of the arbiter queueing him.
    let bob = Held::start(addr, "workload/bob", Some("120s")).await?;
    eventually("bob to wait at the arbiter", WAIT, || async {
        ensure!(waiters(&s).await? == 1, "not queued yet");
        Ok(())
    })
    .await?;
    let queued = Instant::now();
    b.wait_for(
        "bob in the queue",
        "document.getElementById('queue') !== null && document.getElementById('queue').innerText.includes('workload/bob')",
        LIVE,
    )
    .await?;
    let seen_in = queued.elapsed();
    ensure!(seen_in <= LIVE, "bob showed after {seen_in:?}");
    b.wait_for(
        "alice still the holder",
        "document.getElementById('holder').innerText.includes('workload/alice')",
        LIVE,
    )
    .await?;
    b.screenshot(&shots.join("key-alice-holds-bob-waits.png"))
        .await?;
    b.goto(&format!("{url}/keys")).await?;
    b.wait_for(
        "the keys page lists the hold",
        &format!("document.querySelector('tr[data-key=\"{KEY}\"]') !== null"),
        WAIT,
    )
    .await?;
    b.screenshot(&shots.join("keys.png")).await?;
    b.goto(&format!("{url}/hot")).await?;
    b.wait_for(
        "the hot keys",
        "document.getElementById('longest-queues').innerText.includes('demo/console-1')",
        WAIT,
    )
    .await?;
    b.screenshot(&shots.join("hot.png")).await?;
    b.goto(&format!("{url}/sessions")).await?;
    b.wait_for(
        "the sessions",
        "document.body.innerText.includes('workload/alice')",
        WAIT,
    )
    .await?;
    b.screenshot(&shots.join("sessions.png")).await?;
    b.goto(&format!("{url}/system")).await?;
    b.wait_for(
        "the system page",
        "document.getElementById('epoch') !== null",
        WAIT,
    )
    .await?;
    b.screenshot(&shots.join("system.png")).await?;
    // alice leads an election: its page shows her, with the term latchctl shows.
    let mut leader = latchctl(addr, "workload/alice")?;
    leader
        .args([
            "elect",
            "demo/console-leader",
            "--value",
            "replica-a",
            "--",
            "sleep",
            "600",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _leader = leader.spawn().context("spawn latchctl elect")?;
    b.goto(&format!("{url}/elections?e=demo%2Fconsole-leader"))
        .await?;
    b.wait_for(
        "alice as the leader",
        "document.getElementById('leader').innerText.includes('workload/alice')",
        WAIT,
    )
    .await?;
    b.screenshot(&shots.join("elections.png")).await?;

    // alice lets go: bob holds.
    alice.release()?;
    let bob_token = bob.token().await?;
    ensure!(
        bob_token > alice_token,
        "bob's token {bob_token} is not above alice's"
    );

    // ana requests the force-release of bob's hold, in the console.
    b.goto(&format!("{url}/key?k=demo%2Fconsole-1")).await?;
    b.wait_for(
        "bob as the holder",
        "document.getElementById('holder').innerText.includes('workload/bob')",
        WAIT,
    )
    .await?;
    b.eval(
        "document.getElementById('reason').value = 'bob is wedged (console e2e)'; \
         document.getElementById('request').click(); true",
    )
    .await?;
    b.wait_for(
        "the request",
        "document.getElementById('requested') !== null",
        WAIT,
    )
    .await?;
    let requested = b.text().await?;
    ensure!(
        requested.contains("FENCED"),
        "the request page: {requested}"
    );
    b.screenshot(&shots.join("force-release-requested.png"))
        .await?;

    // ana cannot approve her own request.
    b.goto(&format!("{url}/force-release")).await?;
    b.wait_for(
        "the pending request",
        "document.querySelector('a.review') !== null",
        WAIT,
    )
    .await?;
    b.eval("document.querySelector('a.review').click(); true")
        .await?;
    b.wait_for(
        "the confirm page",
        "document.getElementById('confirm') !== null",
        WAIT,
    )
    .await?;
    ensure!(
        b.eval("document.getElementById('own-request') !== null && document.querySelector('button.approve') === null").await? == true,
        "ana is offered to approve her own request"
    );

    // ben signs in, sees FENCED before approving, and approves.
    sign_in(&mut b, &url, "ben", "/force-release").await?;
    b.wait_for(
        "the pending request",
        "document.querySelector('a.review') !== null",
        WAIT,
    )
    .await?;
    let pending = texts(&mut b, "section.request").await?;
    ensure!(
        pending.len() == 1 && pending[0].contains("FENCED") && pending[0].contains("workload/bob"),
        "{pending:?}"
    );
    b.screenshot(&shots.join("force-release-pending.png"))
        .await?;
    b.eval("document.querySelector('a.review').click(); true")
        .await?;
    b.wait_for(
        "the approve button",
        "document.getElementById('approve') !== null",
        WAIT,
    )
    .await?;
    let confirm = b.text().await?;
    ensure!(confirm.contains("FENCED"), "the confirm page: {confirm}");
    b.screenshot(&shots.join("force-release-confirm.png"))
        .await?;
    b.eval("document.getElementById('approve').click(); true")
        .await?;
    b.wait_for(
        "the approval",
        "document.getElementById('approved') !== null",
        WAIT,
    )
    .await?;
    b.screenshot(&shots.join("force-release-approved.png"))
        .await?;

    // bob's latchctl hold is stopped.
    let mut bob = bob;
    let status = tokio::time::timeout(Duration::from_secs(15), bob.child.wait())
        .await
        .with_context(|| format!("bob's latchctl hold still runs: {}", bob.stderr()))??;
    ensure!(!status.success(), "bob's latchctl hold exited {status:?}");

    // The key's timeline is what `latchctl audit` prints.
    b.goto(&format!("{url}/key?k=demo%2Fconsole-1")).await?;
    b.wait_for(
        "the force-release in the timeline",
        "document.getElementById('timeline').innerText.includes('force-release')",
        WAIT,
    )
    .await?;
    let shown = texts(&mut b, "#timeline li pre").await?;
    let out = Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("LATCHKEY_AUDIT_STORE", pg.url())
        .args(["audit", KEY])
        .output()
        .await?;
    ensure!(out.status.success(), "latchctl audit: {out:?}");
    let printed: Vec<String> = String::from_utf8(out.stdout)?
        .lines()
        .map(str::to_string)
        .collect();
    ensure!(
        shown == printed,
        "the console's timeline differs from latchctl audit:\nconsole: {shown:#?}\nlatchctl: {printed:#?}"
    );
    b.screenshot(&shots.join("key-timeline.png")).await?;
    let _ = OPERATOR;

    // vera reads, but cannot act.
    sign_in(&mut b, &url, "vera", "/keys").await?;
    b.wait_for(
        "vera's keys page",
        "document.getElementById('holds') !== null",
        WAIT,
    )
    .await?;
    b.goto(&format!("{url}/key?k=demo%2Fconsole-1")).await?;
    ensure!(
        b.eval("document.getElementById('request-form') === null")
            .await?
            == true,
        "a viewer is offered the force-release form"
    );
    let refused = b
        .eval(
            "(async () => { const csrf = document.querySelector('input[name=csrf]').value; \
             const r = await fetch('/force-release/request', {method: 'POST', headers: {'content-type': 'application/x-www-form-urlencoded'}, \
             body: 'csrf=' + encodeURIComponent(csrf) + '&key=demo%2Fconsole-1&reason=viewer'}); return r.status; })()",
        )
        .await?;
    ensure!(refused == 403, "a viewer's request answered {refused}");

    // mallory is refused everything.
    sign_in(&mut b, &url, "mallory", "/keys").await?;
    let page = b.text().await?;
    ensure!(page.contains("Not allowed"), "mallory saw: {page}");
    b.screenshot(&shots.join("refused.png")).await?;
    b.goto(&format!("{url}/keys")).await?;
    ensure!(
        !b.url().await?.starts_with(&format!("{url}/keys")),
        "mallory reached the keys page"
    );
    // A POST from a console page (same origin), without a session: no approval.
    b.goto(&format!("{url}/no-such-page")).await?;
    let posted = b
        .eval(
            &format!("(async () => {{ const r = await fetch({:?}, {{method: 'POST', redirect: 'manual', headers: {{'content-type': 'application/x-www-form-urlencoded'}}, body: 'csrf=x&request_id=00'}}); return r.status; }})()", format!("{url}/force-release/approve")),
        )
        .await?;
    ensure!(posted != 200, "mallory's approval answered {posted}");

    // No token handed out in the run is in anything the console served.
    let served = proxy.served();
    ensure!(
        served.len() > 10_000,
        "the proxy saw only {} bytes",
        served.len()
    );
    for token in [alice_token, bob_token] {
        for form in [
            token.to_string(),
            format!("{token:x}"),
            format!("{token:#x}"),
        ] {
            ensure!(
                !contains(&served, form.as_bytes()),
                "a token ({form}) is in what the console served"
            );
        }
    }
    Ok(())
}
