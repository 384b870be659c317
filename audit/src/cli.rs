//! `latchkey-audit`'s command line: flags, the metrics server, signals.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use latchkey_etcd::{Connection, Login, TlsPem};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::metrics::{self, AlarmAt, Metrics};
use crate::pseudonym::AuditKey;
use crate::store;
use crate::tailer::{self, TailerConfig};

#[derive(Debug, Parser)]
#[command(
    name = "latchkey-audit",
    version,
    about = "Latchkey's audit tailer: one per etcd cluster, the lock log's revisions into ClickHouse or PostgreSQL"
)]
struct Args {
    /// etcd client URL(s), comma-separated; all http:// or all https://.
    #[arg(long, value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// Trust bundle for etcd's server certificate (PEM); required with https://.
    #[arg(long, value_name = "PEM")]
    etcd_ca: Option<PathBuf>,
    /// The tailer's client certificate (PEM chain), for --client-cert-auth.
    /// With etcd auth on, its CN is the etcd user: give that user a role
    /// with READ on the prefix only.
    #[arg(long, value_name = "PEM", requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    #[arg(long, value_name = "PEM", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// etcd user (a read-only role on the prefix); needs --etcd-password-file.
    #[arg(long, value_name = "NAME", requires = "etcd_password_file")]
    etcd_user: Option<String>,
    #[arg(long, value_name = "PATH", requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
    /// The arbiter's key prefix in etcd.
    #[arg(long, default_value = "/latchkey")]
    prefix: String,
    /// The store: postgresql://… or clickhouse://WRITER@host:8123/database.
    /// From the environment or with --store-password-file: a password in a
    /// URL on the command line is refused (`ps` shows it to every user).
    #[arg(long, env = "LATCHKEY_AUDIT_STORE", hide_env_values = true)]
    store: String,
    /// The store user's password, read from this file (trailing newline
    /// dropped). The user writes; readers (`latchctl audit`) get another,
    /// read-only one.
    #[arg(long, value_name = "PATH", env = "LATCHKEY_AUDIT_STORE_PASSWORD_FILE")]
    store_password_file: Option<PathBuf>,
    /// The audit key (at least 32 bytes, e.g. `openssl rand -hex 32`): the
    /// store keeps ids keyed by it instead of the lock log's revisions,
    /// which rebuild fencing tokens. Keep it for the store's whole life
    /// (a store written under another key is refused); only the tailer
    /// reads it.
    #[arg(long, value_name = "PATH", env = "LATCHKEY_AUDIT_KEY_FILE")]
    audit_key_file: PathBuf,
    /// Serve Prometheus metrics here (plain HTTP, GET /metrics).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// How often the checkpoint is written (after the events it covers).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    checkpoint_every: Duration,
    /// etcd's compaction window in time (--auto-compaction-retention in
    /// periodic mode): the lag alarm fires at half of it.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    compaction_window: Duration,
    /// etcd's compaction window in revisions (revision mode), if it uses one.
    #[arg(long, value_name = "REVISIONS")]
    compaction_window_revisions: Option<i64>,
    /// An arbiter's `<state-dir>/quorum-loss/ready` (repeatable): its spools
    /// of unprotected grants made during quorum loss (ADR-04) are copied
    /// into the store, marked unprotected, and moved to `../shipped`.
    #[arg(long, value_name = "DIR")]
    quorum_loss_spool_dir: Vec<PathBuf>,
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// A password file's text without its trailing newline.
pub fn read_password(path: &Path) -> anyhow::Result<String> {
    let text =
        String::from_utf8(read(path)?).with_context(|| format!("{}: not UTF-8", path.display()))?;
    Ok(text.strip_suffix('\n').unwrap_or(&text).to_string())
}

/// Refuses a store URL whose password is in `argv` (visible in `ps`).
pub fn refuse_password_in_argv(url: &str, argv: &[OsString]) -> anyhow::Result<()> {
    if let Some(password) = store::url_password(url)
        && argv.iter().any(|a| {
            let a = a.to_string_lossy();
            a.contains("://") && a.contains(password)
        })
    {
        bail!(
            "the store URL on the command line has a password, which `ps` shows to every user: \
             pass the URL in LATCHKEY_AUDIT_STORE, or the password in --store-password-file"
        );
    }
    Ok(())
}

fn connection(args: &Args) -> anyhow::Result<Connection> {
    let https = args.etcd.iter().all(|e| e.starts_with("https://"));
    let http = args.etcd.iter().all(|e| e.starts_with("http://"));
    if !https && !http {
        bail!("--etcd URLs must be all http:// or all https://");
    }
    if https && args.etcd_ca.is_none() {
        bail!("https:// etcd endpoints need --etcd-ca");
    }
    let identity = match (&args.etcd_cert, &args.etcd_key) {
        (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
        _ => None,
    };
    let login = match (&args.etcd_user, &args.etcd_password_file) {
        (Some(user), Some(file)) => Some(Login::new(user.clone(), read_password(file)?)),
        _ => None,
    };
    // A client certificate is presented only over TLS, which --etcd-ca turns on.
    let tls = match &args.etcd_ca {
        Some(ca) => Some(TlsPem {
            ca: read(ca)?,
            identity,
        }),
        None => None,
    };
    Ok(Connection {
        tls,
        login,
        ..Connection::service(args.etcd.clone(), Duration::from_secs(5))
    })
}

/// Parses `argv`, connects the store and tails until SIGINT or SIGTERM.
pub async fn main_with(argv: Vec<OsString>) -> anyhow::Result<()> {
    let args = Args::try_parse_from(&argv).unwrap_or_else(|e| e.exit());
    refuse_password_in_argv(&args.store, &argv)?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();

    let mut config = TailerConfig::new(connection(&args)?);
    config.prefix = args.prefix.clone();
    config.checkpoint_every = args.checkpoint_every;
    config.alarm = AlarmAt {
        window: Some(args.compaction_window),
        window_revisions: args.compaction_window_revisions,
    };
    let options = store::StoreOptions {
        password: args
            .store_password_file
            .as_deref()
            .map(read_password)
            .transpose()?,
        audit_key: Some(AuditKey::read(&args.audit_key_file)?),
    };
    let store: Arc<dyn store::AuditStore> = Arc::from(
        store::open_with(&args.store, options)
            .await
            .with_context(|| format!("opening the store {}", store::redact(&args.store)))?,
    );
    store
        .migrate()
        .await
        .context("creating (or moving over) the audit tables")?;
    let metrics = Arc::new(Metrics::new());
    let (stop_tx, stop) = watch::channel(false);
    if let Some(addr) = &args.metrics_listen {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening for metrics on {addr}"))?;
        serve_metrics(listener, metrics.clone(), stop.clone());
    }
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = stop_tx.send(true);
    });
    if !args.quorum_loss_spool_dir.is_empty() {
        tokio::spawn(crate::spool::run(
            args.quorum_loss_spool_dir.clone(),
            store.clone(),
            Duration::from_secs(5),
            stop.clone(),
        ));
    }
    tailer::run(config, store, metrics, stop).await;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Serves `GET /metrics` until `stop`.
fn serve_metrics(listener: TcpListener, metrics: Arc<Metrics>, mut stop: watch::Receiver<bool>) {
    use axum::http::{StatusCode, header};
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            async move {
                match metrics.text() {
                    Ok(text) => (
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
                        text,
                    ),
                    Err(_) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        [(header::CONTENT_TYPE, "text/plain")],
                        "encoding the metrics failed\n".to_string(),
                    ),
                }
            }
        }),
    );
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving Prometheus metrics on /metrics");
    }
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = served {
            warn!(error = %e, "the metrics server stopped");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_password_in_a_store_url_on_the_command_line_is_refused() {
        let url = "clickhouse://w:s3cret-pw@h:8123/db";
        let err = refuse_password_in_argv(url, &argv(&["latchkey-audit", "--store", url]));
        let err = err.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("ps") && !err.contains("s3cret"), "{err}");
        let joined = format!("--store={url}");
        assert!(refuse_password_in_argv(url, &argv(&["latchkey-audit", &joined])).is_err());
        // From the environment: the command line does not show it.
        assert!(
            refuse_password_in_argv(url, &argv(&["latchkey-audit", "--prefix", "/s3cret-pw"]))
                .is_ok()
        );
        let user_only = "clickhouse://w@h:8123/db";
        assert!(refuse_password_in_argv(user_only, &argv(&["x", "--store", user_only])).is_ok());
    }
}
