//! The arbiter's command line: flags in, [`crate::run`] out. Shared by the
//! `latchkey-arbiter` binary and the test harness's copy of it.

use std::path::PathBuf;
use std::time::Duration;

use crate::{Config, TlsFiles};
use anyhow::{Context, bail};
use clap::Parser;
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Latchkey arbiter: lock.v1 over mTLS, grants as etcd transactions"
)]
struct Args {
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:7443")]
    listen: String,
    /// etcd client URL(s), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    etcd: Vec<String>,
    /// Key prefix in etcd.
    #[arg(long, default_value = "/latchkey")]
    prefix: String,
    /// Directory with classes/*.toml and grants/*.toml.
    #[arg(long, default_value = "policies/dev")]
    policies: PathBuf,
    /// The arbiter's SVID certificate (PEM).
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// The arbiter's private key (PEM).
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// Trust bundle for client SVIDs (PEM).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// SPIFFE trust domain of callers.
    #[arg(long, default_value = "dev.latchkey")]
    trust_domain: String,
    /// SPIFFE ID of the edge proxy, whose identity header is trusted.
    #[arg(long)]
    edge_identity: Option<String>,
    /// Directory for the revision high-water mark (keep it on durable disk).
    #[arg(long, default_value = ".latchkey-arbiter")]
    state_dir: PathBuf,
    /// Longest wait for an Acquire, in seconds.
    #[arg(long, default_value_t = 300)]
    max_wait_seconds: u64,
    /// Serve without TLS; callers name themselves in a header. Laptops only.
    #[arg(long)]
    insecure_dev: bool,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
    /// Run with a deliberate bug so the release gate can prove its checker
    /// catches it (`grant-on-watch`). Only in builds with `test-faults`.
    #[cfg(feature = "test-faults")]
    #[arg(long, value_parser = crate::test_fault::TestFault::parse, default_value = "none")]
    test_fault: crate::test_fault::TestFault,
}

/// Parses the process arguments and serves until SIGINT/SIGTERM.
pub async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if args.log_json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    let tls = match (args.tls_cert, args.tls_key, args.tls_ca, args.insecure_dev) {
        (Some(cert), Some(key), Some(client_ca), false) => Some(TlsFiles {
            cert,
            key,
            client_ca,
        }),
        (None, None, None, true) => None,
        (_, _, _, true) => bail!("--insecure-dev cannot be combined with --tls-* flags"),
        _ => bail!(
            "TLS is required: pass --tls-cert, --tls-key and --tls-ca (or --insecure-dev on a laptop)"
        ),
    };
    let mut config = Config::new(args.etcd, args.policies, args.state_dir);
    config.prefix = args.prefix;
    config.tls = tls;
    config.trust_domain = args.trust_domain;
    config.edge_identity = args.edge_identity;
    config.max_wait = Duration::from_secs(args.max_wait_seconds);
    #[cfg(feature = "test-faults")]
    {
        config.test_fault = args.test_fault;
    }
    let listener = TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
        }
    };
    crate::run(listener, config, shutdown).await?;
    Ok(())
}
