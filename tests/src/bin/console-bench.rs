//! `console-bench`: the operator console's Keys page with `--holds` holds
//! (10,000 by default), beside `latchctl why` on the same data, in the same run.
//!
//! One real etcd, one in-process arbiter serving the console, and a real OIDC
//! provider (oidc-provider-mock) to sign in with, as a browser would: the
//! authorization-code flow, driven with plain HTTP. The holds are
//! `workload/bench`'s, on `--sessions` sessions renewed in one KeepAlive
//! stream. Then:
//!
//! 1. **Keys page, each a fresh read** (`--fresh`, 40): requests 300 ms apart,
//!    past the console's shared read of every hold and shared render (250 ms),
//!    so each reads the lock log again and renders every row.
//! 2. **Keys page, back to back** (`--back-to-back`, 200): as a page reloaded
//!    at once, or several operators at once, which share that read.
//! 3. **`latchctl why KEY`** (`--why`, 20): one key's holder and waiters, the
//!    question the Keys page answers for every key at once; the baseline.
//!
//! Goal: the Keys page's p95 under 300 ms with 10,000 holds (issue 36).
//! Nothing here reads or prints a token.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_arbiter::console::ConsoleConfig;
use latchkey_arbiter::force_release::ForceReleaseConfig;
use latchkey_arbiter::oidc::OidcConfig;
use latchkey_proto::lockv1::KeepAliveRequest;
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, svid_flags};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::latency::{duration_text, histogram, micros};
use latchkey_tests::lock_calls::{open, try_lock};
use latchkey_tests::oidc::OidcProvider;
use tokio::time::Instant;

const CLASS: &str = "batch-report";
const IDENTITY: &str = "workload/bench";
const CLIENT_ID: &str = "latchctl";
const GOAL: Duration = Duration::from_millis(300);

#[derive(Parser, Debug)]
#[command(about = "The console's Keys page with many holds, beside latchctl why")]
struct Args {
    #[arg(long, default_value_t = 10_000)]
    holds: usize,
    #[arg(long, default_value_t = 100)]
    sessions: usize,
    #[arg(long, default_value_t = 40)]
    fresh: usize,
    #[arg(long, default_value_t = 200)]
    back_to_back: usize,
    #[arg(long, default_value_t = 20)]
    why: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(
        args.sessions > 0 && args.holds >= args.sessions,
        "--holds must be at least --sessions"
    );
    let latchctl = latchkey_tests::workspace_bins::build_as_shipped(&["latchctl"])?
        .pop()
        .context("no latchctl")?;
    let etcd = EtcdServer::start().await?;
    let oidc = OidcProvider::start().await?;
    oidc.set_user("op", serde_json::json!({"roles": ["lock-operator"]}))
        .await?;
    let dir = tempfile::tempdir()?;
    let secret = dir.path().join("client-secret");
    std::fs::write(&secret, "bench\n")?;
    let console_addr: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut console = ConsoleConfig::new(console_addr.to_string());
    console.client_secret_file = Some(secret);
    let mut oidc_config = OidcConfig::new(oidc.issuer().into(), CLIENT_ID.into());
    oidc_config.leeway = Duration::ZERO;
    let arbiter = Arbiter::start(
        &etcd,
        ArbiterOptions {
            force_release: ForceReleaseConfig {
                oidc: Some(oidc_config),
                ..ForceReleaseConfig::default()
            },
            console: Some(console),
            max_holds_per_identity: Some(u32::try_from(args.holds * 2).unwrap_or(u32::MAX)),
            ..ArbiterOptions::default()
        },
    )
    .await?;

    // The holds, on sessions renewed together.
    let started = Instant::now();
    let mut c = arbiter.lock(IDENTITY).await?;
    let mut sessions = Vec::new();
    for _ in 0..args.sessions {
        sessions.push(open(&mut c, CLASS).await?);
    }
    let (renew_tx, renew_rx) = tokio::sync::mpsc::channel::<KeepAliveRequest>(4);
    let mut renewals = c
        .keep_alive(tokio_stream::wrappers::ReceiverStream::new(renew_rx))
        .await?
        .into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = renewals.message().await {} });
    let renewed = sessions.clone();
    tokio::spawn(async move {
        loop {
            let request = KeepAliveRequest {
                session_id: 0,
                session_ids: renewed.clone(),
            };
            if renew_tx.send(request).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
    });
    let workers = 8;
    let mut tasks = Vec::new();
    for w in 0..workers {
        let mut c = arbiter.lock(IDENTITY).await?;
        let sessions = sessions.clone();
        let holds = args.holds;
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while i < holds {
                let session = sessions[i % sessions.len()];
                try_lock(&mut c, &format!("bench/console/{i:05}"), CLASS, session)
                    .await
                    .with_context(|| format!("hold {i}"))?;
                i += workers;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    println!(
        "{} holds on {} sessions of {IDENTITY} in {:.1} s",
        args.holds,
        args.sessions,
        started.elapsed().as_secs_f64()
    );

    // Sign in as a browser does.
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()?;
    let base = format!("http://{console_addr}");
    let cookie = sign_in(&http, &base, "op").await?;
    let page = |http: &reqwest::Client| {
        let request = http
            .get(format!("{base}/keys"))
            .header(reqwest::header::COOKIE, cookie.clone());
        async move {
            let t = Instant::now();
            let r = request.send().await?;
            ensure!(r.status().is_success(), "GET /keys: HTTP {}", r.status());
            let body = r.text().await?;
            Ok::<_, anyhow::Error>((t.elapsed(), body))
        }
    };
    let (_, body) = page(&http).await?;
    ensure!(
        body.contains(&format!("{} holds", args.holds)),
        "the Keys page does not count {} holds",
        args.holds
    );
    println!(
        "Keys page: {} KiB of HTML (the first 500 rows and the count)",
        body.len() / 1024
    );

    let mut fresh = histogram()?;
    for _ in 0..args.fresh {
        tokio::time::sleep(Duration::from_millis(300)).await;
        fresh.record(micros(page(&http).await?.0))?;
    }
    let mut shared = histogram()?;
    for _ in 0..args.back_to_back {
        shared.record(micros(page(&http).await?.0))?;
    }
    let mut why = histogram()?;
    for _ in 0..args.why {
        let t = Instant::now();
        let out = tokio::process::Command::new(&latchctl)
            .arg("--endpoint")
            .arg(format!("https://{}", arbiter.addr()))
            .args(svid_flags(IDENTITY)?)
            .args(["why", "bench/console/00000"])
            .output()
            .await?;
        let took = t.elapsed();
        if !out.status.success() {
            bail!("latchctl why: {}", String::from_utf8_lossy(&out.stderr));
        }
        why.record(micros(took))?;
    }

    let line = |name: &str, h: &Histogram<u64>| {
        println!(
            "{name:<44} n={:<4} p50 {:>10}  p95 {:>10}  p99 {:>10}",
            h.len(),
            duration_text(h.value_at_quantile(0.5)),
            duration_text(h.value_at_quantile(0.95)),
            duration_text(h.value_at_quantile(0.99))
        );
    };
    println!();
    line("latchctl why (one key; baseline)", &why);
    line("Keys page, each a fresh read of every hold", &fresh);
    line("Keys page, back to back (shared read)", &shared);
    let p95 = Duration::from_micros(fresh.value_at_quantile(0.95));
    let base95 = why.value_at_quantile(0.95).max(1);
    println!(
        "\nKeys page p95 (fresh) / latchctl why p95: x{:.2}; goal p95 < {} ms with 10,000 holds: {}",
        fresh.value_at_quantile(0.95) as f64 / base95 as f64,
        GOAL.as_millis(),
        if p95 < GOAL { "met" } else { "NOT met" }
    );
    drop(arbiter);
    Ok(())
}

/// The console's session cookie for `sub`, through the provider's sign-in.
async fn sign_in(http: &reqwest::Client, base: &str, sub: &str) -> anyhow::Result<String> {
    let r = http.get(format!("{base}/login")).send().await?;
    let to_provider = location(&r)?;
    let login_cookie = set_cookie(&r, "latchkey_login")?;
    let r = http.post(&to_provider).form(&[("sub", sub)]).send().await?;
    let callback = location(&r)?;
    let r = http
        .get(&callback)
        .header(reqwest::header::COOKIE, login_cookie)
        .send()
        .await?;
    ensure!(
        r.status().is_redirection(),
        "the callback answered HTTP {}",
        r.status()
    );
    set_cookie(&r, "latchkey_console")
}

fn location(r: &reqwest::Response) -> anyhow::Result<String> {
    r.headers()
        .get(reqwest::header::LOCATION)
        .and_then(|l| l.to_str().ok())
        .map(str::to_string)
        .with_context(|| format!("no redirect (HTTP {})", r.status()))
}

fn set_cookie(r: &reqwest::Response, name: &str) -> anyhow::Result<String> {
    r.headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.split(';').next())
        .find(|c| c.starts_with(&format!("{name}=")))
        .map(str::to_string)
        .with_context(|| format!("no {name} cookie"))
}
