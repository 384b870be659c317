//! `latchctl elect`, `observe`, `leader` and `candidates` (the
//! `latchctl-under-test` build) against the real arbiter on real etcd,
//! over mTLS with the dev SVIDs, on the short-TTL `elect-fast` class of
//! `elections.rs`.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use latchkey_client::{CampaignOptions, Client};
use latchkey_tests::arbiter::spiffe;
use latchkey_tests::eventually;
use latchkey_tests::proxy::Proxy;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::{Instant, timeout};

use crate::client::connect;
use crate::elections::{CLASS, TTL, policies, stack};
use crate::latchctl::latchctl;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn json(out: &Output) -> anyhow::Result<serde_json::Value> {
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("--json output: {}", text(&out.stdout)))
}

async fn run(cmd: &mut tokio::process::Command) -> anyhow::Result<Output> {
    timeout(Duration::from_secs(30), cmd.output())
        .await
        .context("latchctl did not finish in 30 s")?
        .context("latchctl did not run")
}

/// The number in `path` once it is there.
async fn number_in(path: &Path) -> anyhow::Result<u64> {
    eventually(
        &format!("{} to be written", path.display()),
        Duration::from_secs(15),
        || async { Ok(std::fs::read_to_string(path)?.trim().parse::<u64>()?) },
    )
    .await
}

async fn until_standing(client: &Client, election: &str, n: usize) -> anyhow::Result<()> {
    eventually(
        &format!("{n} candidates in {election}"),
        Duration::from_secs(15),
        || async {
            let standing = client.candidates(election).await?.len();
            ensure!(standing >= n, "{standing} standing");
            Ok(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_elect_runs_the_command_as_leader_and_a_second_elect_takes_over_when_it_exits()
-> anyhow::Result<()> {
    let policies = policies()?;
    let s = stack(&policies).await?;
    let addr = s.arbiter.addr();
    let election = "demo/elect/cli";
    let alice = connect(addr, "workload/alice").await?;
    let dir = tempfile::tempdir()?;
    let p = |name: &str| dir.path().join(name);

    // The first leads until told to stop.
    let first = latchctl(addr, "workload/alice")?
        .args([
            "elect", election, "--class", CLASS, "--value", "one", "--", "sh", "-c",
        ])
        .arg(format!(
            "echo $LATCHKEY_TERM > {t}; echo $LATCHKEY_TOKEN > {k}; \
             while [ ! -e {stop} ]; do sleep 0.1; done; exit 0",
            t = p("term1").display(),
            k = p("token1").display(),
            stop = p("stop").display()
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn the first latchctl elect")?;
    let term1 = number_in(&p("term1")).await?;
    let token1 = number_in(&p("token1")).await?;
    let leader = alice.leader(election).await?.context("the first leads")?;
    ensure!(leader.term == term1 && leader.value == "one", "{leader:?}");
    ensure!(leader.identity == spiffe("workload/alice"));

    // The second (the same identity) stands, and its command does not run.
    let second = latchctl(addr, "workload/alice")?
        .args([
            "elect", election, "--class", CLASS, "--value", "two", "--", "sh", "-c",
        ])
        .arg(format!(
            "echo $LATCHKEY_TERM > {t}; echo $LATCHKEY_TOKEN > {k}; exit 3",
            t = p("term2").display(),
            k = p("token2").display()
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn the second latchctl elect")?;
    until_standing(&alice, election, 1).await?;
    ensure!(!p("term2").exists(), "the candidate's command ran");

    // The first's command exits: it resigns and exits 0; the second leads
    // in the next term, runs its command and exits with its status (3).
    std::fs::write(p("stop"), "")?;
    let out1 = timeout(Duration::from_secs(20), first.wait_with_output())
        .await
        .context("the first latchctl did not exit")??;
    let stderr1 = text(&out1.stderr);
    ensure!(out1.status.code() == Some(0), "first: {stderr1}");
    ensure!(stderr1.contains("resigned"), "{stderr1}");
    let out2 = timeout(Duration::from_secs(20), second.wait_with_output())
        .await
        .context("the second latchctl did not exit")??;
    let stderr2 = text(&out2.stderr);
    ensure!(out2.status.code() == Some(3), "second: {stderr2}");
    let term2 = number_in(&p("term2")).await?;
    let token2 = number_in(&p("token2")).await?;
    ensure!(term2 == term1 + 1, "{term2} after {term1}");
    ensure!(token2 > token1);
    // Terms are laid out like tokens (a term over a vacancy is the
    // revision it was read at), so a term may spell another leadership's
    // token: only what is not a term counts.
    let terms = [term1, term2].map(|t| format!("term {t}"));
    for stderr in [&stderr1, &stderr2] {
        let rest = terms
            .iter()
            .fold(stderr.to_string(), |s, t| s.replace(t.as_str(), "term _"));
        for token in [token1, token2] {
            ensure!(
                !rest.contains(&token.to_string()),
                "latchctl printed the token {token}: {stderr}"
            );
        }
    }
    ensure!(alice.leader(election).await?.is_none(), "both resigned");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_elect_stops_its_command_when_the_leadership_is_lost() -> anyhow::Result<()> {
    let policies = policies()?;
    let s = stack(&policies).await?;
    let election = "demo/elect/cli-lost";
    let proxy = Proxy::start(s.arbiter.addr()).await?;
    let dir = tempfile::tempdir()?;
    let pid_path = dir.path().join("pid");
    let mut child = latchctl(proxy.addr(), "workload/alice")?
        .args(["elect", election, "--class", CLASS, "--", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 60", pid_path.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn latchctl elect")?;
    let pid = i32::try_from(number_in(&pid_path).await?)?;
    proxy.block();
    let blocked_at = Instant::now();
    let status = match timeout(TTL + Duration::from_secs(3), child.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            let _ = child.start_kill();
            bail!("latchctl elect kept its command running after the leadership was lost");
        }
    };
    let exited_after = blocked_at.elapsed();
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        tokio::io::AsyncReadExt::read_to_string(&mut pipe, &mut stderr).await?;
    }
    ensure!(
        status.code() == Some(7),
        "a lost leadership exits 7: {stderr}"
    );
    ensure!(
        stderr.contains(&format!("leadership of {election}")) && stderr.contains("lost"),
        "{stderr}"
    );
    // The fence deadline (TTL - 1 s after the last renewal) plus the
    // command's SIGTERM.
    ensure!(
        exited_after <= TTL + Duration::from_secs(1),
        "took {exited_after:?}"
    );
    ensure!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            == Err(nix::errno::Errno::ESRCH),
        "the command must be stopped, not orphaned"
    );
    Ok(())
}

type Lines = tokio::io::Lines<BufReader<tokio::process::ChildStdout>>;

/// The next JSON line `latchctl observe` prints.
async fn next_line(lines: &mut Lines) -> anyhow::Result<serde_json::Value> {
    let line = timeout(Duration::from_secs(15), lines.next_line())
        .await
        .context("no line within 15 s")??
        .context("latchctl observe ended")?;
    ensure!(!line.contains("token"), "{line}");
    serde_json::from_str(&line).with_context(|| line.clone())
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_observe_json_prints_the_term_starts_and_vacancies() -> anyhow::Result<()> {
    let policies = policies()?;
    let s = stack(&policies).await?;
    let addr = s.arbiter.addr();
    let election = "demo/elect/cli-observed";
    let mut observer = latchctl(addr, "workload/bob")?
        .args(["--json", "observe", election])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn latchctl observe")?;
    let stdout = observer.stdout.take().context("observe's stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = next_line(&mut lines).await?;
    ensure!(
        first["event"] == "vacant" && first["term"] == 0 && first["reason"] == "unknown",
        "{first}"
    );

    let a = connect(addr, "workload/alice").await?;
    let options = CampaignOptions {
        wait: Some(Duration::from_secs(5)),
        ..CampaignOptions::default()
    };
    let led = a
        .campaign(election, CLASS, "pod-a", options.clone())
        .await?;
    let started = next_line(&mut lines).await?;
    ensure!(started["event"] == "term_started", "{started}");
    ensure!(started["election"] == election && started["term"] == led.term());
    ensure!(started["identity"] == spiffe("workload/alice") && started["value"] == "pod-a");
    ensure!(started.get("revision").is_none(), "{started}");
    let term = led.term();
    led.proclaim("pod-a2").await?;
    let proclaimed = next_line(&mut lines).await?;
    ensure!(
        proclaimed["event"] == "proclaimed" && proclaimed["value"] == "pod-a2",
        "{proclaimed}"
    );
    led.resign().await?;
    let vacant = next_line(&mut lines).await?;
    ensure!(
        vacant["event"] == "vacant" && vacant["term"] == term && vacant["reason"] == "resigned",
        "{vacant}"
    );
    let again = a.campaign(election, CLASS, "pod-a3", options).await?;
    let started = next_line(&mut lines).await?;
    ensure!(
        started["event"] == "term_started" && started["term"] == again.term(),
        "{started}"
    );
    again.resign().await?;
    observer.start_kill()?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_leader_and_candidates_print_what_the_api_says() -> anyhow::Result<()> {
    let policies = policies()?;
    let s = stack(&policies).await?;
    let addr = s.arbiter.addr();
    let election = "demo/elect/cli-who";
    let a = connect(addr, "workload/alice").await?;

    // Vacant: no leader, no candidates, exit 0.
    let out = run(latchctl(addr, "workload/bob")?.args(["leader", election])).await?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    ensure!(
        text(&out.stdout).contains("has no leader"),
        "{}",
        text(&out.stdout)
    );
    let out = run(latchctl(addr, "workload/bob")?.args(["--json", "leader", election])).await?;
    ensure!(json(&out)?["leader"].is_null(), "{}", text(&out.stdout));

    let led = a
        .campaign(
            election,
            CLASS,
            "pod-a",
            CampaignOptions {
                priority: 2,
                wait: Some(Duration::from_secs(5)),
                ..CampaignOptions::default()
            },
        )
        .await?;
    let b = connect(addr, "workload/alice").await?;
    let b_campaign = b.clone();
    let waiting = tokio::spawn(async move {
        b_campaign
            .campaign(
                election,
                CLASS,
                "pod-b",
                CampaignOptions {
                    priority: 7,
                    wait: Some(Duration::from_secs(20)),
                    ..CampaignOptions::default()
                },
            )
            .await
    });
    until_standing(&a, election, 1).await?;

    let api = a.leader(election).await?.context("a leads")?;
    let out = run(latchctl(addr, "workload/bob")?.args(["--json", "leader", election])).await?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    let shown = json(&out)?;
    ensure!(shown["election"] == election, "{shown}");
    let l = &shown["leader"];
    ensure!(
        l["identity"] == api.identity && l["value"] == api.value,
        "{shown}"
    );
    ensure!(
        l["term"] == api.term && l["priority"] == api.priority,
        "{shown}"
    );
    ensure!(l["since_unix_ms"] == api.since_unix_ms, "{shown}");
    ensure!(l.get("token").is_none(), "{shown}");
    let out = run(latchctl(addr, "workload/bob")?.args(["leader", election])).await?;
    let human = text(&out.stdout);
    ensure!(
        human.contains(&api.identity) && human.contains("pod-a"),
        "{human}"
    );
    ensure!(
        human.contains(&format!("term      {}", api.term)),
        "{human}"
    );
    ensure!(
        !human.contains(&led.token().get().to_string()),
        "leader printed a token: {human}"
    );

    let api = a.candidates(election).await?;
    ensure!(api.len() == 1, "{api:?}");
    let out = run(latchctl(addr, "workload/bob")?.args(["--json", "candidates", election])).await?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    let shown = json(&out)?;
    let listed = shown["candidates"].as_array().cloned().unwrap_or_default();
    ensure!(listed.len() == 1, "{shown}");
    ensure!(
        listed[0]["candidate_id"] == api[0].id
            && listed[0]["identity"] == api[0].identity
            && listed[0]["value"] == "pod-b"
            && listed[0]["priority"] == 7,
        "{shown}"
    );
    let out = run(latchctl(addr, "workload/bob")?.args(["candidates", election])).await?;
    let human = text(&out.stdout);
    ensure!(
        human.lines().count() == 1 && human.starts_with(&api[0].id.to_string()),
        "{human}"
    );
    ensure!(
        human.contains("priority 7") && human.contains("\"pod-b\""),
        "{human}"
    );

    // mallory has no grant on demo/: refused with the code and reason.
    let out = run(latchctl(addr, "workload/mallory")?.args(["candidates", election])).await?;
    ensure!(out.status.code() == Some(5), "REFUSED exits 5");
    let stderr = text(&out.stderr);
    ensure!(
        stderr.contains("PERMISSION_DENIED") && stderr.contains("NOT_AUTHORISED"),
        "{stderr}"
    );

    led.resign().await?;
    let next = waiting.await??;
    ensure!(next.value() == "pod-b");
    next.resign().await?;
    Ok(())
}
