//! The arbiter's command line: flags in, [`crate::run`] out. Shared by the
//! `latchkey-arbiter` binary and the test harness's copy of it.

use std::path::PathBuf;
use std::time::Duration;

use crate::{Config, EtcdClientCert, EtcdCredentials, EtcdUser, TlsFiles};
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
    /// etcd client URL(s), comma-separated; all http:// or all https://.
    /// With https://, etcd's certificate is verified against each URL's host
    /// (a DNS name, or an IP address that must be an IP SAN of the certificate).
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    etcd: Vec<String>,
    /// Trust bundle for etcd's server certificate (PEM); required with https:// endpoints.
    #[arg(long, value_name = "PEM")]
    etcd_ca: Option<PathBuf>,
    /// The arbiter's client certificate for etcd's --client-cert-auth (PEM chain); needs --etcd-key.
    #[arg(long, value_name = "PEM", requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    /// The private key of --etcd-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// etcd user for etcd's password auth; needs --etcd-password-file and https:// endpoints.
    #[arg(long, value_name = "NAME", requires = "etcd_password_file")]
    etcd_user: Option<String>,
    /// File holding the etcd user's password (one trailing newline is ignored); read once at start.
    #[arg(long, value_name = "PATH", requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
    /// Key prefix in etcd.
    #[arg(long, default_value = "/latchkey")]
    prefix: String,
    /// The coord etcd cluster's client URL(s), comma-separated: a cluster
    /// separate from --etcd that witnesses this lock cluster's grants and
    /// allocates its epochs, so a restore of the lock cluster seals even
    /// arbiters with no state directory. Reached with the same --etcd-ca,
    /// --etcd-cert/--etcd-key and --etcd-user/--etcd-password-file as --etcd.
    /// Without it (one cluster for everything) the arbiter's --state-dir is
    /// the only witness.
    #[arg(long, value_name = "URLS", value_delimiter = ',')]
    coord_etcd: Vec<String>,
    /// Key prefix on the coord cluster (with --coord-etcd). Default: /latchkey-coord.
    #[arg(long, value_name = "PREFIX", requires = "coord_etcd")]
    coord_prefix: Option<String>,
    /// This lock cluster's name on the coord cluster (with --coord-etcd):
    /// the same for every arbiter of this lock cluster, different for every
    /// other lock cluster. Default: default.
    #[arg(long, value_name = "NAME", requires = "coord_etcd")]
    lock_cluster_name: Option<String>,
    /// Two tiers (ADR-07): the locks of coord-tier classes (keys in the
    /// namespaces coord classes name) live on the coord cluster, every other
    /// lock on --etcd. Without it both tiers' locks live on --etcd.
    #[arg(long, requires = "coord_etcd")]
    split_tiers: bool,
    /// With --split-tiers: the etcd cluster(s) that witness the coord
    /// tier's grants and allocate its epochs (comma-separated URLs). Default:
    /// the --etcd cluster, which then must answer for the coord tier to
    /// grant; a witness of its own keeps leader election up through an
    /// entity-cluster outage (docs/tiers-and-shards.md).
    #[arg(
        long,
        value_name = "URLS",
        value_delimiter = ',',
        requires = "split_tiers"
    )]
    coord_tier_witness_etcd: Vec<String>,
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
    /// With --edge-identity: also serve workloads that call the arbiter
    /// directly (dev and tests). Without it only the edge and operators are
    /// served, so no workload walks around the edge's admission bounds.
    #[arg(long)]
    allow_direct_workloads: bool,
    /// One cluster only (no --coord-etcd) and an empty --state-dir on a lock
    /// log that already has an epoch record: serve anyway. Without it such an
    /// arbiter starts SEALED, because nothing can tell whether the lock log
    /// was restored from a snapshot since tokens were handed out. Say it only
    /// when you know it was not.
    #[arg(long)]
    trust_unwitnessed_log: bool,
    /// Directory for the revision high-water mark (keep it on durable disk).
    #[arg(long, default_value = ".latchkey-arbiter")]
    state_dir: PathBuf,
    /// Longest wait for an Acquire, in seconds.
    #[arg(long, default_value_t = 300)]
    max_wait_seconds: u64,
    /// Sessions one identity may have open, over every arbiter (OpenSession
    /// answers RESOURCE_EXHAUSTED / IDENTITY_LIMIT beyond it).
    #[arg(long, default_value_t = crate::bounds::DEFAULT_MAX_SESSIONS_PER_IDENTITY)]
    max_sessions_per_identity: u32,
    /// Acquire calls one identity may have waiting in this arbiter, over all
    /// keys (RESOURCE_EXHAUSTED / QUEUE_FULL beyond it).
    #[arg(long, default_value_t = crate::table::DEFAULT_MAX_WAITERS_PER_IDENTITY)]
    max_waiters_per_identity: u32,
    /// Keys one identity may hold, over every arbiter (Acquire answers
    /// RESOURCE_EXHAUSTED / IDENTITY_LIMIT beyond it): every hold is a key
    /// in etcd, and etcd refuses every write once its quota is full.
    #[arg(long, default_value_t = crate::hold_counts::DEFAULT_MAX_HOLDS_PER_IDENTITY)]
    max_holds_per_identity: u32,
    /// grpc.health.v1 Watch and server-reflection streams one identity (its
    /// certificate's SPIFFE ID) may have open at this arbiter
    /// (RESOURCE_EXHAUSTED / TOO_MANY_STREAMS beyond it). Health/Check is
    /// not counted.
    #[arg(long, default_value_t = crate::grpc_health::DEFAULT_MAX_PROBE_STREAMS_PER_IDENTITY,
          value_parser = clap::value_parser!(u32).range(1..))]
    max_probe_streams_per_identity: u32,
    /// grpc.health.v1 Watch and server-reflection streams open at this
    /// arbiter for all callers together.
    #[arg(long, default_value_t = crate::grpc_health::DEFAULT_MAX_PROBE_STREAMS,
          value_parser = clap::value_parser!(u32).range(1..))]
    max_probe_streams: u32,
    /// Serve new work (OpenSession, Acquire) without the overload
    /// protection: never limited, queued or refused for load. For
    /// measuring the protection (the overload benchmark); never in
    /// production, where it lets a flood of new work expire established
    /// sessions.
    #[arg(long)]
    no_overload_protection: bool,
    /// A renewal served later than this (its KeepAlive message read to
    /// etcd's answer) is late; while renewals are late, new work gives way
    /// (the limit on new work in flight falls, and new work that finds it
    /// full is refused UNAVAILABLE / OVERLOADED).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    renewal_latency_target_ms: u64,
    /// Most new work (OpenSession, Acquire before it waits) this arbiter
    /// runs at once; the limit moves between --min-new-work-in-flight and
    /// this with how late renewals are.
    #[arg(long, default_value_t = crate::overload::DEFAULT_MAX_IN_FLIGHT,
          value_parser = clap::value_parser!(u32).range(1..))]
    max_new_work_in_flight: u32,
    /// The least the new-work limit falls to.
    #[arg(long, default_value_t = crate::overload::DEFAULT_MIN_IN_FLIGHT,
          value_parser = clap::value_parser!(u32).range(1..))]
    min_new_work_in_flight: u32,
    /// Bound on the quorum-loss spool (ADR-04): the unprotected grants open
    /// classes get from memory while etcd has no quorum, plus spools not yet
    /// collected by the audit tailer. Beyond it such grants are refused.
    #[arg(long, default_value_t = crate::quorum_loss::DEFAULT_SPOOL_LIMIT_BYTES)]
    quorum_loss_spool_bytes: u64,
    /// Serve without TLS; callers name themselves in a header. Laptops only.
    #[arg(long)]
    insecure_dev: bool,
    /// Serve Prometheus metrics on this address (plain HTTP, `GET /metrics`).
    /// Labels are namespace and class only: no key, identity or token.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
    /// Serve the operator console (web pages: holders, queues, hot keys,
    /// the audit timeline, force-release) on this address, over plain
    /// HTTP: keep it on loopback or behind your ingress's TLS. Operators
    /// sign in with the --oidc-issuer provider.
    #[arg(long, value_name = "ADDR", requires = "oidc_issuer")]
    console_listen: Option<String>,
    /// The URL browsers reach the console at (its sign-in redirect URI is
    /// <URL>/callback, to be registered with the provider); default
    /// http://<--console-listen>.
    #[arg(long, value_name = "URL", requires = "console_listen")]
    console_url: Option<String>,
    /// The role (in --oidc-role-claim) that lets a signed-in person read
    /// the console; --oidc-role also acts (force-release).
    #[arg(long, value_name = "ROLE", default_value = crate::console::DEFAULT_VIEWER_ROLE)]
    console_viewer_role: String,
    /// The console's OIDC client secret, from this file, when the provider
    /// requires one (without it the console signs in as a public client,
    /// with PKCE). The client id is --oidc-audience.
    #[arg(long, value_name = "PATH", requires = "console_listen")]
    console_client_secret_file: Option<PathBuf>,
    /// The audit store whose timeline the console's Key page shows:
    /// postgresql://READER@host/db or clickhouse://READER@host:8123/db
    /// (a read-only user; the password in the next flag).
    #[arg(
        long,
        value_name = "URL",
        requires = "console_listen",
        env = "LATCHKEY_CONSOLE_AUDIT_STORE",
        hide_env_values = true
    )]
    console_audit_store: Option<String>,
    /// Let operators request and approve force-releases in the console. A
    /// sign-in with the operator role then acts without the operator SVID
    /// latchctl needs: give it only where the console is reached through
    /// an authenticated front (SSO or mTLS at the ingress) or on loopback.
    #[arg(long, requires = "console_listen")]
    console_force_release: bool,
    /// File holding the console's audit store user's password.
    #[arg(long, value_name = "PATH", requires = "console_audit_store")]
    console_audit_store_password_file: Option<PathBuf>,
    /// The OIDC provider operators sign in with for force-release (ADR-20),
    /// exactly as its ID tokens' `iss` says; https:// (http:// only on a
    /// loopback address). Without it force-release is refused.
    #[arg(long, value_name = "URL", requires = "oidc_audience")]
    oidc_issuer: Option<String>,
    /// The `aud` operators' ID tokens must carry (the client id they sign in with).
    #[arg(long, value_name = "CLIENT_ID", requires = "oidc_issuer")]
    oidc_audience: Option<String>,
    /// The ID-token claim holding the operator's roles: a name or a dotted
    /// path (Keycloak: realm_access.roles).
    #[arg(long, value_name = "CLAIM", default_value = crate::oidc::DEFAULT_ROLE_CLAIM)]
    oidc_role_claim: String,
    /// The role that allows force-release.
    #[arg(long, value_name = "ROLE", default_value = crate::oidc::DEFAULT_ROLE)]
    oidc_role: String,
    /// Require an `amr` claim naming a second factor (otp, hwk, mfa, ...).
    #[arg(long, requires = "oidc_issuer")]
    oidc_require_mfa: bool,
    /// Clock skew allowed on the ID token's exp, nbf and iat, in seconds
    /// (0 to 300).
    #[arg(long, value_name = "SECONDS", default_value_t = crate::oidc::DEFAULT_LEEWAY.as_secs())]
    oidc_leeway_seconds: u64,
    /// The oldest ID token (by its iat) accepted to request or approve a
    /// force-release, in seconds (60 to 86400): operators sign in shortly
    /// before they act.
    #[arg(long, value_name = "SECONDS", default_value_t = crate::oidc::DEFAULT_MAX_TOKEN_AGE.as_secs())]
    oidc_max_token_age_seconds: u64,
    /// The etcd user force-release transactions run as: a role that may
    /// only touch holds, claims and force records (docs/security.md).
    #[arg(long, value_name = "NAME", requires_all = ["force_etcd_password_file", "oidc_issuer"])]
    force_etcd_user: Option<String>,
    /// File holding --force-etcd-user's password; read once at start.
    #[arg(long, value_name = "PATH", requires = "force_etcd_user")]
    force_etcd_password_file: Option<PathBuf>,
    /// How long a force-release request waits for its approver, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 900)]
    force_request_ttl_seconds: u64,
    /// Export traces (acquire, release, hand-over, hook calls, etcd
    /// transactions) over OTLP/gRPC to this collector, e.g.
    /// http://127.0.0.1:4317. Off by default: nothing is exported without it.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// The fraction of traces sampled that no caller's traceparent decides.
    #[arg(
        long,
        value_name = "RATIO",
        default_value_t = 1.0,
        requires = "otlp_endpoint"
    )]
    otlp_sample_ratio: f64,
}

/// The force-release settings the flags name.
fn force_release(args: &Args) -> anyhow::Result<crate::force_release::ForceReleaseConfig> {
    let oidc = match (&args.oidc_issuer, &args.oidc_audience) {
        (Some(issuer), Some(audience)) => {
            let mut oidc = crate::oidc::OidcConfig::new(issuer.clone(), audience.clone());
            oidc.role_claim = args.oidc_role_claim.clone();
            oidc.role = args.oidc_role.clone();
            oidc.require_mfa = args.oidc_require_mfa;
            oidc.leeway = Duration::from_secs(args.oidc_leeway_seconds);
            if !(60..=86_400).contains(&args.oidc_max_token_age_seconds) {
                bail!(
                    "--oidc-max-token-age-seconds {} is out of range: 60 to 86400 (how long after sign-in an operator's ID token may be used)",
                    args.oidc_max_token_age_seconds
                );
            }
            oidc.max_age = Duration::from_secs(args.oidc_max_token_age_seconds);
            oidc.check().map_err(anyhow::Error::msg)?;
            Some(oidc)
        }
        (None, None) => None,
        _ => bail!("--oidc-issuer and --oidc-audience go together"),
    };
    if args.oidc_leeway_seconds > crate::oidc::MAX_LEEWAY.as_secs() {
        bail!(
            "--oidc-leeway-seconds {} is too large: at most {} (the clock skew allowed on an ID token's expiry; a larger one keeps expired tokens good)",
            args.oidc_leeway_seconds,
            crate::oidc::MAX_LEEWAY.as_secs()
        );
    }
    let etcd_user = match (&args.force_etcd_user, &args.force_etcd_password_file) {
        (Some(name), Some(password_file)) => Some(EtcdUser {
            name: name.clone(),
            password_file: password_file.clone(),
        }),
        (None, None) => None,
        _ => bail!("--force-etcd-user and --force-etcd-password-file go together"),
    };
    if args.force_request_ttl_seconds == 0 {
        bail!("--force-request-ttl-seconds must be at least 1");
    }
    Ok(crate::force_release::ForceReleaseConfig {
        oidc,
        etcd_user,
        request_ttl: Duration::from_secs(args.force_request_ttl_seconds),
    })
}

/// The etcd credentials the flags name, checked against the endpoints
/// before anything is read or connected.
fn etcd_credentials(args: &Args) -> anyhow::Result<EtcdCredentials> {
    let client_cert = match (&args.etcd_cert, &args.etcd_key) {
        (Some(cert), Some(key)) => Some(EtcdClientCert {
            cert: cert.clone(),
            key: key.clone(),
        }),
        (None, None) => None,
        _ => bail!("--etcd-cert and --etcd-key go together: pass both or neither"),
    };
    let user = match (&args.etcd_user, &args.etcd_password_file) {
        (Some(name), Some(password_file)) => Some(EtcdUser {
            name: name.clone(),
            password_file: password_file.clone(),
        }),
        (None, None) => None,
        _ => bail!("--etcd-user and --etcd-password-file go together: pass both or neither"),
    };
    let credentials = EtcdCredentials {
        ca: args.etcd_ca.clone(),
        client_cert,
        user,
    };
    credentials.check(&args.etcd)?;
    Ok(credentials)
}

/// Parses the process arguments and serves until SIGINT/SIGTERM.
pub async fn main() -> anyhow::Result<()> {
    main_with(std::env::args_os().collect(), None).await
}

/// [`main`] with the given arguments and a [`LogLayer`] around the lock log
/// (for a program that embeds the arbiter, such as the release gate's
/// arbiter-under-test with its deliberate bugs).
///
/// [`LogLayer`]: crate::LogLayer
pub async fn main_with(
    argv: Vec<std::ffi::OsString>,
    log_layer: Option<crate::config::LogLayer>,
) -> anyhow::Result<()> {
    let args = Args::parse_from(argv);
    let etcd_credentials = etcd_credentials(&args)?;
    let force_release = force_release(&args)?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let otlp = args
        .otlp_endpoint
        .clone()
        .map(|endpoint| crate::telemetry::OtlpConfig {
            endpoint,
            sample_ratio: args.otlp_sample_ratio,
        });
    let traces = match &otlp {
        // Without an endpoint, the log subscriber alone: the spans'
        // callsites are never enabled (telemetry.rs).
        None => {
            if args.log_json {
                tracing_subscriber::fmt()
                    .json()
                    .with_env_filter(filter)
                    .init();
            } else {
                tracing_subscriber::fmt().with_env_filter(filter).init();
            }
            None
        }
        Some(otlp) => {
            use tracing_subscriber::Layer as _;
            use tracing_subscriber::layer::SubscriberExt as _;
            use tracing_subscriber::util::SubscriberInitExt as _;
            let (traces, tracer) = crate::telemetry::Tracing::start(otlp)?;
            let logs = if args.log_json {
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_filter(filter)
                    .boxed()
            } else {
                tracing_subscriber::fmt::layer().with_filter(filter).boxed()
            };
            tracing_subscriber::registry()
                .with(logs)
                .with(crate::telemetry::layer(tracer))
                .init();
            tracing::info!(endpoint = %otlp.endpoint, ratio = otlp.sample_ratio, "exporting traces over OTLP");
            Some(traces)
        }
    };
    if let Some(oidc) = &force_release.oidc
        && oidc.issuer.starts_with("http://")
    {
        tracing::warn!(
            issuer = %oidc.issuer,
            "force-release signs operators in with a provider on this host over plain http: for dev and tests only (whoever controls that provider can sign in as both operators)"
        );
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
    config.etcd_credentials = etcd_credentials;
    config.prefix = args.prefix;
    config.coord_endpoints = args.coord_etcd;
    if let Some(prefix) = args.coord_prefix {
        config.coord_prefix = prefix;
    }
    if let Some(name) = args.lock_cluster_name {
        config.lock_cluster_name = name;
    }
    config.split_tiers = args.split_tiers;
    config.coord_tier_witness_endpoints = args.coord_tier_witness_etcd;
    config.check_coord()?;
    config.tls = tls;
    config.trust_domain = args.trust_domain;
    config.edge_identity = args.edge_identity;
    config.allow_direct_workloads = args.allow_direct_workloads;
    config.trust_unwitnessed_log = args.trust_unwitnessed_log;
    config.max_wait = Duration::from_secs(args.max_wait_seconds);
    config.max_sessions_per_identity = args.max_sessions_per_identity;
    config.max_holds_per_identity = args.max_holds_per_identity;
    config.probe_streams = crate::grpc_health::ProbeStreamLimits {
        per_identity: args.max_probe_streams_per_identity,
        total: args.max_probe_streams,
    };
    config.max_waiters_per_identity = args.max_waiters_per_identity;
    config.quorum_loss.spool_limit_bytes = args.quorum_loss_spool_bytes;
    config.overload = crate::overload::OverloadConfig {
        enabled: !args.no_overload_protection,
        renewal_target: Duration::from_millis(args.renewal_latency_target_ms),
        max_in_flight: args.max_new_work_in_flight,
        min_in_flight: args.min_new_work_in_flight.min(args.max_new_work_in_flight),
        ..crate::overload::OverloadConfig::default()
    };
    config.metrics_listen = args.metrics_listen;
    config.log_layer = log_layer;
    config.force_release = force_release;
    config.console = args.console_listen.clone().map(|listen| {
        let mut console = crate::console::ConsoleConfig::new(listen);
        console.public_url = args.console_url.clone();
        console.viewer_role = args.console_viewer_role.clone();
        console.client_secret_file = args.console_client_secret_file.clone();
        console.audit_store = args.console_audit_store.clone();
        console.audit_store_password_file = args.console_audit_store_password_file.clone();
        console.force_release = args.console_force_release;
        console
    });
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
    let served = crate::run(listener, config, shutdown).await;
    if let Some(traces) = traces {
        traces.shutdown().await;
    }
    served?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "hunter2-do-not-print";

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let mut argv = vec!["latchkey-arbiter", "--insecure-dev"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv)
    }

    fn refusal(extra: &[&str]) -> String {
        match parse(extra) {
            Err(e) => e.to_string(),
            Ok(args) => match etcd_credentials(&args) {
                Err(e) => format!("{e:#}"),
                Ok(c) => panic!("accepted {extra:?}: {c:?}"),
            },
        }
    }

    #[test]
    fn mutual_tls_with_a_user_is_accepted() {
        let args = parse(&[
            "--etcd",
            "https://10.0.0.1:2379,https://etcd-b:2379",
            "--etcd-ca",
            "ca.pem",
            "--etcd-cert",
            "arbiter.pem",
            "--etcd-key",
            "arbiter.key",
            "--etcd-user",
            "latchkey",
            "--etcd-password-file",
            "pw",
        ])
        .unwrap();
        let creds = etcd_credentials(&args).unwrap();
        assert!(creds.client_cert.is_some());
        assert_eq!(creds.user.map(|u| u.name), Some("latchkey".into()));
    }

    #[test]
    fn the_default_plain_http_endpoint_needs_no_credentials() {
        let args = parse(&[]).unwrap();
        assert!(etcd_credentials(&args).unwrap().ca.is_none());
    }

    #[test]
    fn a_cert_without_a_key_is_refused() {
        let msg = refusal(&[
            "--etcd",
            "https://127.0.0.1:2379",
            "--etcd-ca",
            "ca.pem",
            "--etcd-cert",
            "arbiter.pem",
        ]);
        assert!(msg.contains("--etcd-key"), "{msg}");
        let msg = refusal(&[
            "--etcd",
            "https://127.0.0.1:2379",
            "--etcd-ca",
            "ca.pem",
            "--etcd-key",
            "arbiter.key",
        ]);
        assert!(msg.contains("--etcd-cert"), "{msg}");
    }

    #[test]
    fn https_without_a_ca_is_refused() {
        let msg = refusal(&["--etcd", "https://127.0.0.1:2379"]);
        assert!(msg.contains("--etcd-ca"), "{msg}");
    }

    #[test]
    fn mixed_schemes_are_refused() {
        let msg = refusal(&[
            "--etcd",
            "https://127.0.0.1:2379,http://127.0.0.1:2380",
            "--etcd-ca",
            "ca.pem",
        ]);
        assert!(msg.contains("mix http://"), "{msg}");
    }

    #[test]
    fn a_user_without_a_password_file_is_refused() {
        let msg = refusal(&[
            "--etcd",
            "https://127.0.0.1:2379",
            "--etcd-ca",
            "ca.pem",
            "--etcd-user",
            "latchkey",
        ]);
        assert!(msg.contains("--etcd-password-file"), "{msg}");
    }

    #[test]
    fn coord_flags_need_a_coord_cluster() {
        for flag in ["--coord-prefix", "--lock-cluster-name"] {
            let msg = match parse(&[flag, "x"]) {
                Err(e) => e.to_string(),
                Ok(args) => panic!("accepted {flag} without --coord-etcd: {args:?}"),
            };
            assert!(msg.contains("--coord-etcd"), "{msg}");
        }
        let args = parse(&[
            "--coord-etcd",
            "http://c1:2379,http://c2:2379",
            "--lock-cluster-name",
            "east",
        ])
        .unwrap();
        assert_eq!(args.coord_etcd, ["http://c1:2379", "http://c2:2379"]);
        assert_eq!(args.lock_cluster_name.as_deref(), Some("east"));
        assert!(parse(&[]).unwrap().coord_etcd.is_empty());
    }

    #[test]
    fn help_lists_the_etcd_credential_flags() {
        let help = <Args as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        for flag in [
            "--etcd-ca",
            "--etcd-cert",
            "--etcd-key",
            "--etcd-user",
            "--etcd-password-file",
            "--coord-etcd",
            "--coord-prefix",
            "--lock-cluster-name",
            "--oidc-issuer",
            "--oidc-audience",
            "--oidc-role-claim",
            "--oidc-role",
            "--oidc-require-mfa",
            "--oidc-leeway-seconds",
            "--force-etcd-user",
            "--force-etcd-password-file",
        ] {
            assert!(help.contains(flag), "{flag} missing from --help");
        }
    }

    #[test]
    fn force_release_flags() {
        let args = parse(&[]).unwrap();
        let off = force_release(&args).unwrap();
        assert!(off.oidc.is_none() && off.etcd_user.is_none());
        assert_eq!(off.request_ttl, Duration::from_secs(900));
        let args = parse(&[
            "--oidc-issuer",
            "https://sso.example.com/realms/ops",
            "--oidc-audience",
            "latchctl",
            "--oidc-role-claim",
            "realm_access.roles",
            "--oidc-require-mfa",
            "--force-etcd-user",
            "latchkey-force",
            "--force-etcd-password-file",
            "pw",
        ])
        .unwrap();
        let on = force_release(&args).unwrap();
        let oidc = on.oidc.unwrap();
        assert!(oidc.require_mfa);
        assert_eq!(oidc.role_claim, "realm_access.roles");
        assert_eq!(oidc.role, "lock-operator");
        assert_eq!(on.etcd_user.map(|u| u.name), Some("latchkey-force".into()));
        for bad in [
            &["--oidc-issuer", "https://sso"][..],
            &["--oidc-audience", "x"],
            &["--oidc-require-mfa"],
            &["--force-etcd-user", "u", "--force-etcd-password-file", "pw"],
        ] {
            assert!(parse(bad).is_err(), "accepted {bad:?}");
        }
        let args = parse(&["--oidc-issuer", "http://sso", "--oidc-audience", "x"]).unwrap();
        let err = force_release(&args).unwrap_err().to_string();
        assert!(err.contains("https://"), "{err}");
    }

    #[test]
    fn oidc_leeway_flag() {
        let on = ["--oidc-issuer", "https://sso", "--oidc-audience", "x"];
        let leeway = |extra: &[&str]| {
            let args = parse(&[&on[..], extra].concat())?;
            force_release(&args).map(|c| c.oidc.map(|o| o.leeway))
        };
        let default = leeway(&[]).unwrap();
        assert_eq!(default, Some(crate::oidc::DEFAULT_LEEWAY));
        assert_eq!(default, Some(Duration::from_secs(30)));
        for (flag, want) in [("0", 0), ("5", 5), ("300", 300)] {
            let got = leeway(&["--oidc-leeway-seconds", flag]).unwrap();
            assert_eq!(got, Some(Duration::from_secs(want)), "{flag}");
        }
        let err = leeway(&["--oidc-leeway-seconds", "301"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--oidc-leeway-seconds 301 is too large: at most 300"),
            "{err}"
        );
        for bad in ["-1", "30s", "", "1e3"] {
            assert!(
                parse(&[&on[..], &["--oidc-leeway-seconds", bad]].concat()).is_err(),
                "accepted --oidc-leeway-seconds {bad:?}"
            );
        }
    }

    /// Starts far enough to read the credentials; returns the error.
    async fn start_error(config: Config) -> String {
        let err = match crate::build(&config).await {
            Ok(_) => panic!("the arbiter started"),
            Err(e) => e,
        };
        let msg = format!("{:#}", anyhow::Error::from(err));
        assert!(!msg.contains(SECRET), "the password leaked: {msg}");
        msg
    }

    /// A config whose policies dir does not exist: the etcd checks come first.
    fn config_in(dir: &std::path::Path, endpoint: &str) -> Config {
        Config::new(
            vec![endpoint.into()],
            dir.join("no-policies"),
            dir.join("state"),
        )
    }

    #[tokio::test]
    async fn an_unreadable_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = config_in(dir.path(), "https://127.0.0.1:1");
        let missing = dir.path().join("no-such-ca.pem");
        config.etcd_credentials.ca = Some(missing.clone());
        let msg = start_error(config).await;
        assert!(msg.contains(&missing.display().to_string()), "{msg}");

        let mut config = config_in(dir.path(), "https://127.0.0.1:1");
        let not_pem = dir.path().join("not-pem.pem");
        std::fs::write(&not_pem, "hello").unwrap();
        config.etcd_credentials.ca = Some(not_pem.clone());
        let msg = start_error(config).await;
        assert!(msg.contains(&not_pem.display().to_string()), "{msg}");
        assert!(msg.contains("no PEM certificate"), "{msg}");
    }

    #[tokio::test]
    async fn the_password_is_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, test_cert_pem()).unwrap();
        let password_file = dir.path().join("etcd-password");
        std::fs::write(&password_file, format!("{SECRET}\n")).unwrap();
        // Nothing listens on port 1: the start fails after reading the password.
        let mut config = config_in(dir.path(), "https://127.0.0.1:1");
        config.policies_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../policies/dev").into();
        config.etcd_connect_timeout = Duration::from_millis(200);
        config.etcd_request_timeout = Duration::from_millis(500);
        config.etcd_credentials = EtcdCredentials {
            ca: Some(ca),
            client_cert: None,
            user: Some(EtcdUser {
                name: "latchkey".into(),
                password_file: password_file.clone(),
            }),
        };
        let debug = format!("{:?}", config.etcd_credentials);
        assert!(!debug.contains(SECRET), "{debug}");
        let msg = start_error(config).await;
        assert!(msg.contains("cannot reach etcd"), "{msg}");
        assert!(msg.contains("user \"latchkey\""), "{msg}");

        let login = latchkey_etcd::Login::new("latchkey", SECRET);
        assert!(!format!("{login:?}").contains(SECRET));

        let empty = dir.path().join("empty-password");
        std::fs::write(&empty, "\n").unwrap();
        let mut config = config_in(dir.path(), "https://127.0.0.1:1");
        config.etcd_credentials = EtcdCredentials {
            ca: Some(dir.path().join("ca.pem")),
            client_cert: None,
            user: Some(EtcdUser {
                name: "latchkey".into(),
                password_file: empty.clone(),
            }),
        };
        let msg = start_error(config).await;
        assert!(
            msg.contains("empty") && msg.contains(&empty.display().to_string()),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_coord_cluster_is_named() {
        let dir = tempfile::tempdir().unwrap();
        // Nothing listens on ports 1 and 2.
        let mut config = config_in(dir.path(), "http://127.0.0.1:1");
        config.policies_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../policies/dev").into();
        config.etcd_connect_timeout = Duration::from_millis(200);
        config.etcd_request_timeout = Duration::from_millis(500);
        config.coord_endpoints = vec!["http://127.0.0.1:2".into()];
        let msg = start_error(config).await;
        assert!(
            msg.contains("cannot reach the coord etcd cluster at http://127.0.0.1:2"),
            "{msg}"
        );
    }

    /// A well-formed certificate: these tests never get to a handshake.
    fn test_cert_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem()
    }
}
