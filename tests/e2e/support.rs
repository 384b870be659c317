//! Small helpers shared by the scenarios: a stack (real etcd + in-process
//! arbiter), lock.v1 calls with short names (`latchkey_tests::lock_calls`,
//! shared with the gate's tests), and refusal inspection.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
use latchkey_tests::envoy::admin_get;
use latchkey_tests::etcd::EtcdServer;
pub use latchkey_tests::lock_calls::{
    Client, TEST_INSTANCE, acquire_as, open, open_class, release, try_lock, wait_lock,
};
use tonic::{Code, Status};
use tonic_types::StatusExt;

pub struct Stack {
    pub etcd: EtcdServer,
    pub arbiter: Arbiter,
}

pub async fn stack() -> anyhow::Result<Stack> {
    stack_with(ArbiterOptions::default()).await
}

pub async fn stack_with(opts: ArbiterOptions) -> anyhow::Result<Stack> {
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let arbiter = Arbiter::start(&etcd, opts).await?;
    Ok(Stack { etcd, arbiter })
}

/// The key layout of the scenarios' arbiters, below their default prefix
/// (`ArbiterOptions::default().prefix`).
pub fn layout() -> latchkey_records::Layout {
    latchkey_records::Layout::new("/latchkey")
}

/// (code, ErrorInfo.reason) of a refusal.
pub fn refusal(s: &Status) -> (Code, String) {
    let reason = s
        .get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
        .unwrap_or_default();
    (s.code(), reason)
}

pub fn expect_refusal<T: std::fmt::Debug>(
    r: Result<T, Status>,
    code: Code,
    reason: &str,
) -> anyhow::Result<Status> {
    match r {
        Ok(v) => anyhow::bail!("expected {code:?}/{reason}, got OK {v:?}"),
        Err(s) => {
            let got = refusal(&s);
            anyhow::ensure!(
                got == (code, reason.to_string()),
                "expected {code:?}/{reason}, got {got:?}: {}",
                s.message()
            );
            Ok(s)
        }
    }
}

/// The etcd revision now (a cheap read).
pub async fn revision(etcd: &EtcdServer) -> anyhow::Result<i64> {
    etcd.revision().await
}

/// Grants and releases `n` times on a few keys of `demo`; returns the
/// largest token handed out.
pub async fn churn(c: &mut Client, session: i64, n: usize) -> anyhow::Result<u64> {
    churn_in(c, "demo", "demo", session, n).await
}

/// [`churn`] on `{namespace}/r0..r2` with `class`.
pub async fn churn_in(
    c: &mut Client,
    namespace: &str,
    class: &str,
    session: i64,
    n: usize,
) -> anyhow::Result<u64> {
    let mut max = 0;
    for i in 0..n {
        let g = try_lock(c, &format!("{namespace}/r{}", i % 3), class, session).await?;
        max = max.max(g.token);
        release(c, &g).await?;
    }
    Ok(max)
}

/// The gRPC status inside an error from a call (UNKNOWN with the text if
/// there is none).
pub fn status_of(e: anyhow::Error) -> Status {
    match e.downcast::<Status>() {
        Ok(s) => s,
        Err(e) => Status::unknown(e.to_string()),
    }
}

/// Every sample of a Prometheus text exposition: `name{labels}` -> value.
pub async fn scrape(addr: SocketAddr) -> anyhow::Result<BTreeMap<String, f64>> {
    let text = admin_get(addr, "/metrics").await?;
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect())
}

/// The sum of the samples whose name and labels contain every one of `parts`.
pub fn total(samples: &BTreeMap<String, f64>, parts: &[&str]) -> u64 {
    let sum: f64 = samples
        .iter()
        .filter(|(name, _)| parts.iter().all(|p| name.contains(p)))
        .map(|(_, v)| *v)
        .sum();
    sum as u64
}

/// Range calls etcd has served (every code): a KeepAlive ownership lookup is
/// one, and so was an OpenSession's count of its identity's sessions.
pub async fn etcd_ranges(s: &Stack) -> anyhow::Result<u64> {
    let addr: SocketAddr = format!("127.0.0.1:{}", s.etcd.client_port()).parse()?;
    let samples = scrape(addr).await?;
    let n = total(
        &samples,
        &["grpc_server_handled_total{", "grpc_method=\"Range\""],
    );
    anyhow::ensure!(n > 0, "no Range counter in etcd's /metrics");
    Ok(n)
}
