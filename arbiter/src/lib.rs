//! The Latchkey arbiter: the one service that holds etcd write credentials
//! and turns lock.v1 calls into etcd transactions.
//!
//! A request flows: TLS (rustls) → [`identity`] finds the caller's SPIFFE ID
//! (the peer SVID, or the edge proxy's header when the peer is the edge) →
//! `service/` validates the key and class and checks the caller's prefix
//! grants ([`policy`], reloaded from `policies/`) → the class [`hook`] may
//! refuse → [`table`] runs ONE grant transaction comparing key absence, the
//! epoch record, the seal and the session record → the fencing [`token`] is
//! `epoch × 2^48 + revision` of that transaction, made durable in the
//! [`high_water`] mark before it is returned. A held key queues the caller in
//! the [`table`] (FIFO per key), whose driver retries on watch events, local
//! releases and polls. [`epoch`] seals the arbiter when the lock log is not
//! the one the epoch was minted for.

pub mod bounds;

/// The arbiter's allocator, for its binaries' `#[global_allocator]`
/// (`latchkey-arbiter` and the tests' `arbiter-under-test`): mimalloc gives
/// freed pages back to the system soon after a load passes, where glibc's
/// per-thread arenas kept an arbiter at its peak RSS (issue 31: 38 -> 130 MiB
/// under load, never given back).
pub use mimalloc::MiMalloc as Allocator;
pub mod assemble;
pub mod cli;
pub mod config;
pub mod console;
pub mod election;
pub mod epoch;
pub mod error;
pub mod follow;
pub mod force_release;
pub mod grpc_health;
pub mod high_water;
pub mod hold_counts;
pub mod hook;
pub mod identity;
pub mod lock_log;
pub mod metrics;
pub mod oidc;
pub mod overload;
pub mod owner;
pub mod policy;
pub mod quorum_loss;
/// The lock log's key layout and records (the `latchkey-records` crate,
/// shared with the audit tailer, the simulation and the tests).
pub use latchkey_records as records;
mod service;
pub mod session_counts;
pub mod shards;
mod start;
pub mod subject_counts;
pub mod table;
pub mod telemetry;
pub mod tiers;
pub mod tls_reload;
pub use latchkey_records::token;
pub mod wasm_hooks;
pub mod witness;

use std::future::Future;
use std::sync::Arc;

use latchkey_proto::adminv1::admin_server::AdminServer;
use latchkey_proto::electionv1::election_service_server::ElectionServiceServer;
use latchkey_proto::lockv1::lock_server::LockServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Server;
use tracing::{info, warn};

pub use config::{
    Config, CoordConfigError, EtcdClientCert, EtcdConfigError, EtcdCredentials, EtcdUser, LogLayer,
    TlsFiles,
};
pub use error::ArbiterError;
pub use service::{AdminService, Arbiter, LockService};

pub use start::{COORD_TIER_WITNESS_NAME, build};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The reflection service could not be built from the descriptors (a
    /// build defect, never the operator's).
    #[error("cannot build the gRPC reflection service: {0}")]
    Reflection(#[source] tonic_reflection::server::Error),
    #[error("policies: {0}")]
    Policies(#[from] policy::LoadError),
    #[error(transparent)]
    HighWater(#[from] high_water::HighWaterError),
    #[error("etcd: {0}")]
    Store(#[source] ArbiterError),
    #[error(transparent)]
    EtcdConfig(#[from] EtcdConfigError),
    #[error(transparent)]
    CoordConfig(#[from] CoordConfigError),
    /// The first request to the coord cluster failed.
    #[error("cannot reach the coord etcd cluster at {endpoints} ({access})")]
    CoordUnreachable {
        endpoints: String,
        access: String,
        #[source]
        source: lock_log::StoreError,
    },
    /// --coord-etcd names the lock cluster itself (by other addresses).
    #[error(
        "the coord cluster (--coord-etcd) is the lock cluster (--etcd): both report cluster id {cluster_id:#018x}; a restore of the lock cluster would roll back its own witness, so give the coord cluster its own etcd"
    )]
    CoordIsLockCluster { cluster_id: u64 },
    /// The first requests to etcd failed: a wrong address, etcd down, or
    /// credentials etcd refuses.
    #[error("cannot reach etcd at {endpoints} ({access}){hint}")]
    EtcdUnreachable {
        endpoints: String,
        /// How the arbiter tried (TLS, client certificate, user), never a password.
        access: String,
        /// What to check, when the credentials suggest it.
        hint: &'static str,
        #[source]
        source: Box<ArbiterError>,
    },
    #[error("{path}: {what}")]
    BadFile {
        path: std::path::PathBuf,
        what: &'static str,
    },
    #[error("cannot read {path}: {source}")]
    ReadTls {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(#[source] tls_reload::TlsLoadError),
    #[error("force-release: {0}")]
    ForceRelease(String),
    /// The OIDC provider's HTTP client could not be built.
    #[error("force-release: cannot build the OIDC HTTP client: {0}")]
    OidcClient(#[source] reqwest::Error),
    #[error("quorum-loss spool: {0}")]
    QuorumLossSpool(#[source] quorum_loss::spool::SpoolError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("console: {0}")]
    Console(#[from] console::ConsoleError),
    #[error("cannot listen for metrics on {addr}: {source}")]
    MetricsListen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// The HTTP/2 connection flow-control window. h2 closes a connection with
/// GOAWAY `ENHANCE_YOUR_CALM` ("too_many_data_frames") when the framing
/// overhead of small DATA frames it buffers unread passes a budget of half
/// this window (each frame under 256 bytes costs 256 minus its length;
/// hyper 1.12 does not let us set that budget itself). A KeepAlive renewal is
/// a 14-byte frame from clients that send one message per frame (grpcio):
/// the hyper default (1 MiB, a 512 KiB budget) let ~2,100 unread renewals
/// cut off every call on a connection (issue 18). 8 MiB: a 4 MiB budget,
/// ~17,000 unread 14-byte frames.
pub const HTTP2_CONNECTION_WINDOW: u32 = 8 * 1024 * 1024;
/// The per-stream window: a stream the arbiter does not read stops its
/// sender after 64 KiB, ~4,700 14-byte renewals (~1.1 MiB of that budget),
/// so flow control slows a fast sender long before the budget is reached;
/// three fully stalled streams fit in it at once. Calls are small, so the
/// window does not limit anyone's throughput on a loopback or LAN path.
pub const HTTP2_STREAM_WINDOW: u32 = 64 * 1024;
/// Concurrent streams per connection (the edge bounds them per identity).
pub const HTTP2_MAX_CONCURRENT_STREAMS: u32 = 1024;
/// Streams the client may reset before the arbiter has accepted them,
/// before h2 closes the connection (its rapid-reset defence; hyper's
/// default is 20). Every tenant's streams share the edge's connections to
/// the arbiter, so at 20 one identity opening and dropping calls at once
/// got a shared connection closed and other tenants' KeepAlive streams
/// reset with it (issue 31, `hostile_keepalive`). Such a stream costs the
/// arbiter no work (it was never accepted) and the edge ends the flooder's
/// own connection (Envoy's premature-reset check); this is what bounds the
/// reset streams queued on one connection.
pub const HTTP2_MAX_PENDING_ACCEPT_RESETS: usize = 1024;

/// Serves `GET /metrics` (Prometheus text) until `stop`.
fn spawn_metrics_server(
    listener: TcpListener,
    arbiter: Arc<Arbiter>,
    stop: CancellationToken,
    tasks: &TaskTracker,
) {
    use axum::http::{StatusCode, header};
    let addr = listener.local_addr().ok();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let arbiter = arbiter.clone();
            async move {
                match arbiter.metrics_text() {
                    Ok(text) => (
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
                        text,
                    ),
                    Err(_) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                        "encoding the metrics failed\n".to_string(),
                    ),
                }
            }
        }),
    );
    info!(?addr, "serving Prometheus metrics on /metrics");
    tasks.spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await;
        if let Err(e) = served {
            warn!(error = %e, "the metrics server stopped");
        }
    });
}

/// Hook metrics also go to the log once a minute (latency percentiles are
/// only there).
fn spawn_hook_metrics_log(
    host: Arc<latchkey_hook_host::HookHost>,
    stop: CancellationToken,
    tasks: &TaskTracker,
) {
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(60));
        tick.tick().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => wasm_hooks::WasmHooks::log_metrics(&host),
            }
        }
    });
}

/// Serves lock.v1 and admin.v1 on `listener` until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
    // Bound before anything else starts: a taken port fails the start.
    let metrics_listener = match &config.metrics_listen {
        Some(addr) => {
            Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| RunError::MetricsListen {
                        addr: addr.clone(),
                        source,
                    })?,
            )
        }
        None => None,
    };
    let console_listener = match &config.console {
        Some(console) if config.force_release.oidc.is_none() => {
            let _ = console;
            return Err(console::ConsoleError::NoOidc.into());
        }
        Some(console) => Some(console::bind(console).await?),
        None => None,
    };
    let arbiter = build(&config).await?;
    let stop = CancellationToken::new();
    let tasks = TaskTracker::new();
    if let Some(listener) = metrics_listener {
        spawn_metrics_server(listener, arbiter.clone(), stop.clone(), &tasks);
    }
    if let (Some(listener), Some(console)) = (console_listener, &config.console) {
        console::start(
            listener,
            console,
            config.force_release.oidc.as_ref(),
            arbiter.clone(),
            stop.clone(),
            &tasks,
        )
        .await?;
    }
    arbiter
        .policies
        .clone()
        .spawn_reloader(config.policy_poll, stop.clone(), &tasks);
    spawn_hook_metrics_log(config.hook_host.clone(), stop.clone(), &tasks);
    let (health_reporter, health) = tonic_health::server::health_reporter();
    let probes = grpc_health::Probes::new(config.probe_streams, arbiter.identity.clone());
    grpc_health::spawn(arbiter.clone(), health_reporter, stop.clone(), &tasks);
    let reflection = |b: tonic_reflection::server::Builder<'static>| {
        b.register_encoded_file_descriptor_set(latchkey_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(RunError::Reflection)?;
    // grpcurl before 1.9 speaks only v1alpha.
    let reflection_v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(RunError::Reflection)?;

    let server = Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(5)))
        // HTTP/2 limits, on purpose: see HTTP2_CONNECTION_WINDOW and docs/sessions.md.
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
        .initial_stream_window_size(HTTP2_STREAM_WINDOW)
        .http2_adaptive_window(Some(false))
        .max_concurrent_streams(HTTP2_MAX_CONCURRENT_STREAMS)
        .http2_max_pending_accept_reset_streams(Some(HTTP2_MAX_PENDING_ACCEPT_RESETS));
    // Client certificates are required: no SVID, no handshake. The files
    // are reloaded when SPIRE rotates them (tls_reload.rs).
    let tls = match &config.tls {
        Some(files) => Some(Arc::new(
            tls_reload::ReloadingTls::load(files.clone()).map_err(RunError::Tls)?,
        )),
        None => {
            warn!(
                "INSECURE DEV MODE: no TLS, callers name themselves in a header; never run this way outside a laptop"
            );
            None
        }
    };
    let addr = listener.local_addr().ok();
    info!(
        ?addr,
        tls = config.tls.is_some(),
        "arbiter serving lock.v1 and admin.v1"
    );
    // Waiting calls end as the stop begins, or the server's drain would
    // wait out their budgets.
    let shutdown = {
        let tables: Vec<_> = arbiter
            .tiers
            .all()
            .into_iter()
            .map(|c| c.table.clone())
            .collect();
        async move {
            shutdown.await;
            for table in &tables {
                table.end_waits();
            }
        }
    };
    let router = server
        // Forwarded identities count only from the initial headers.
        .layer(identity::channel::IdentityChannelLayer)
        .add_service(LockServer::new(LockService::new(arbiter.clone())))
        .add_service(ElectionServiceServer::new(
            service::election::ElectionApi::new(arbiter.clone()),
        ))
        .add_service(AdminServer::new(AdminService::new(arbiter.clone())))
        // Health Watch and reflection streams, bounded per identity and in all.
        .add_service(probes.health(health))
        .add_service(probes.reflection(reflection_v1))
        .add_service(probes.reflection(reflection_v1alpha));
    let result = match tls {
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(tls.incoming(listener, stop.clone()), shutdown)
                .await
        }
        None => {
            router
                .serve_with_incoming_shutdown(no_delay(TcpListenerStream::new(listener)), shutdown)
                .await
        }
    };
    // Returns only once everything it started has stopped: the table's
    // drivers and orphan releases, the reloader, the metrics server.
    stop.cancel();
    for cluster in arbiter.tiers.all() {
        cluster.table.shutdown().await;
    }
    tasks.close();
    tasks.wait().await;
    result.map_err(RunError::from)
}

/// Every accepted connection with Nagle's algorithm off. tonic sets
/// `TCP_NODELAY` only on connections it accepts itself; ours come from our
/// own listener, so without this a small answer (a renewal, a grant) waits
/// for the peer's ACK of the previous one whenever one is in flight.
fn no_delay(
    incoming: TcpListenerStream,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt as _;
    incoming.map(|accepted| {
        if let Ok(stream) = &accepted
            && let Err(e) = stream.set_nodelay(true)
        {
            warn!(error = %e, "could not turn Nagle's algorithm off on a connection");
        }
        accepted
    })
}
