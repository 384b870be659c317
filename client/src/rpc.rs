//! The channel to the arbiter and the per-call metadata every request carries.
//!
//! SVID rotation: SPIRE's SVIDs last an hour and a client lives longer, so
//! the TLS files are looked at again (at most once every [`CHECK_EVERY`],
//! from the calls themselves). A change is taken up once the files have
//! stayed as they are for one look (a rotation writes the certificate and
//! the key one after the other): every later call and stream then uses a
//! new channel presenting the new certificate. Calls and streams already
//! open keep the channel they started on.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::electionv1::election_service_client::ElectionServiceClient;
use latchkey_proto::lockv1::lock_client::LockClient;
use tonic::metadata::{AsciiMetadataValue, MetadataKey};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::config::ClientConfig;
use crate::error::Error;

/// The header that carries the caller's SPIFFE ID in dev mode.
pub const DEV_IDENTITY_HEADER: &str = "x-latchkey-dev-identity";

/// How often the TLS files are looked at for a rotation, at most.
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(1);

/// A cheap-to-clone handle: the channel multiplexes every call and stream.
#[derive(Clone, Debug)]
pub(crate) struct Rpc {
    /// The current channel: replaced when the SVID files rotate.
    channel: Arc<parking_lot::RwLock<Channel>>,
    /// How to make the next channel from the files (TLS only).
    reload: Option<Arc<Reload>>,
    dev_identity: Option<AsciiMetadataValue>,
    request_timeout: Duration,
    /// [`ClientConfig::instance`], sent on every Acquire and Campaign.
    pub(crate) instance: String,
    /// [`ClientConfig::wait_ask`]: the longest one Acquire waits.
    pub(crate) wait_ask: Duration,
}

impl Rpc {
    pub(crate) async fn connect(config: &ClientConfig) -> Result<Self, Error> {
        let mut endpoint = Endpoint::from_shared(config.endpoint.clone())
            .map_err(|e| Error::Config {
                field: "endpoint",
                problem: format!("{:?} is not a URI: {e}", config.endpoint),
            })?
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true);
        let https = config.endpoint.starts_with("https://");
        let mut reload = None;
        match &config.tls {
            Some(files) => {
                if !https {
                    return Err(Error::Config {
                        field: "endpoint",
                        problem: "TLS files were given, so the endpoint must be https://".into(),
                    });
                }
                let domain = config.tls_domain.as_deref().unwrap_or("localhost");
                let plain = endpoint.clone();
                let signature = signature(files);
                endpoint = with_tls(endpoint, files, domain).map_err(|e| match e {
                    Made::File(e) => e,
                    Made::Tls(source) => Error::Transport {
                        endpoint: config.endpoint.clone(),
                        source,
                    },
                })?;
                reload = Some(Arc::new(Reload {
                    endpoint: plain,
                    files: files.clone(),
                    domain: domain.to_string(),
                    state: parking_lot::Mutex::new(ReloadState {
                        current: signature,
                        seen: None,
                        next_check: Instant::now() + CHECK_EVERY,
                    }),
                    reloads: AtomicU64::new(0),
                }));
            }
            None => {
                if https {
                    return Err(Error::Config {
                        field: "endpoint",
                        problem: "dev mode speaks plain HTTP/2: use an http:// endpoint".into(),
                    });
                }
            }
        }
        let dev_identity =
            match (&config.tls, &config.dev_identity) {
                (None, Some(id)) => Some(AsciiMetadataValue::try_from(id.as_str()).map_err(
                    |_| Error::Config {
                        field: "dev_identity",
                        problem: "not a valid header value".into(),
                    },
                )?),
                _ => None,
            };
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| Error::Transport {
                endpoint: config.endpoint.clone(),
                source,
            })?;
        Ok(Self {
            channel: Arc::new(parking_lot::RwLock::new(channel)),
            reload,
            dev_identity,
            request_timeout: config.request_timeout,
            // A caller may have set anything in the public field.
            instance: crate::config::clean_instance(&config.instance),
            wait_ask: config.wait_ask.max(Duration::from_millis(100)),
        })
    }

    pub(crate) fn lock(&self) -> LockClient<Channel> {
        LockClient::new(self.channel())
    }

    pub(crate) fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel())
    }

    pub(crate) fn election(&self) -> ElectionServiceClient<Channel> {
        ElectionServiceClient::new(self.channel())
    }

    /// The channel for a new call or stream: a new one when the SVID files
    /// have rotated since.
    fn channel(&self) -> Channel {
        if let Some(reload) = &self.reload {
            reload.check(&self.channel);
        }
        self.channel.read().clone()
    }

    /// How many SVID rotations this client has taken up.
    pub(crate) fn svid_reloads(&self) -> u64 {
        self.reload
            .as_ref()
            .map_or(0, |r| r.reloads.load(Ordering::Relaxed))
    }

    /// A request with the dev identity and the default deadline.
    pub(crate) fn unary<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = self.stream(message);
        request.set_timeout(self.request_timeout);
        request
    }

    /// A request with the dev identity and no deadline (streams, waits).
    pub(crate) fn stream<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(id) = &self.dev_identity {
            request
                .metadata_mut()
                .insert(MetadataKey::from_static(DEV_IDENTITY_HEADER), id.clone());
        }
        #[cfg(feature = "otel")]
        trace_context::inject(request.metadata_mut());
        request
    }
}

/// W3C trace context (`traceparent`, `tracestate`) from the caller's current
/// OpenTelemetry context, written by hand so the library needs only the API
/// crate (no SDK propagator). Nothing is written without a valid span.
#[cfg(feature = "otel")]
pub(crate) mod trace_context {
    use opentelemetry::trace::TraceContextExt as _;
    use tonic::metadata::{AsciiMetadataValue, MetadataMap};

    pub(crate) fn inject(metadata: &mut MetadataMap) {
        let cx = opentelemetry::Context::current();
        let span = cx.span();
        let sc = span.span_context();
        if !sc.is_valid() {
            return;
        }
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        );
        if let Ok(v) = AsciiMetadataValue::try_from(traceparent) {
            metadata.insert("traceparent", v);
        }
        let state = sc.trace_state().header();
        if !state.is_empty()
            && let Ok(v) = AsciiMetadataValue::try_from(state)
        {
            metadata.insert("tracestate", v);
        }
    }

    #[cfg(test)]
    mod tests {
        use opentelemetry::trace::{
            SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
        };

        use super::*;

        #[test]
        fn the_current_span_context_goes_out_as_traceparent() {
            let mut none = MetadataMap::new();
            inject(&mut none);
            assert!(none.get("traceparent").is_none(), "no span, no header");

            let sc = SpanContext::new(
                TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap_or(TraceId::INVALID),
                SpanId::from_hex("00f067aa0ba902b7").unwrap_or(SpanId::INVALID),
                TraceFlags::SAMPLED,
                true,
                TraceState::from_key_value([("vendor", "v1")]).unwrap_or_default(),
            );
            let _attached = opentelemetry::Context::new()
                .with_remote_span_context(sc)
                .attach();
            let mut metadata = MetadataMap::new();
            inject(&mut metadata);
            assert_eq!(
                metadata.get("traceparent").and_then(|v| v.to_str().ok()),
                Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            );
            assert_eq!(
                metadata.get("tracestate").and_then(|v| v.to_str().ok()),
                Some("vendor=v1")
            );
        }
    }
}

/// What tells that a file was replaced or rewritten: inode, modification
/// time and length (`None`: unreadable just now).
type Signature = [Option<(u64, std::time::SystemTime, u64)>; 3];

fn signature(files: &crate::config::TlsFiles) -> Signature {
    let one = |path: &std::path::Path| {
        let meta = std::fs::metadata(path).ok()?;
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        #[cfg(not(unix))]
        let inode = 0;
        Some((inode, meta.modified().ok()?, meta.len()))
    };
    [one(&files.ca), one(&files.cert), one(&files.key)]
}

enum Made {
    File(Error),
    Tls(tonic::transport::Error),
}

/// `endpoint` presenting the SVID in `files` and checking the server's
/// certificate against their bundle for `domain`.
fn with_tls(
    endpoint: Endpoint,
    files: &crate::config::TlsFiles,
    domain: &str,
) -> Result<Endpoint, Made> {
    let ca = read("CA bundle", &files.ca).map_err(Made::File)?;
    let cert = read("SVID certificate", &files.cert).map_err(Made::File)?;
    let key = read("SVID key", &files.key).map_err(Made::File)?;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .identity(Identity::from_pem(cert, key))
        .domain_name(domain);
    endpoint.tls_config(tls).map_err(Made::Tls)
}

/// The SVID files and how far their rotation has been followed.
struct Reload {
    endpoint: Endpoint,
    files: crate::config::TlsFiles,
    domain: String,
    state: parking_lot::Mutex<ReloadState>,
    reloads: AtomicU64,
}

struct ReloadState {
    /// The files the current channel was made from.
    current: Signature,
    /// Changed files seen at the last look, not yet taken up.
    seen: Option<Signature>,
    next_check: Instant,
}

impl std::fmt::Debug for Reload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reload")
            .field("files", &self.files)
            .field("reloads", &self.reloads)
            .finish_non_exhaustive()
    }
}

impl Reload {
    /// Installs a channel with the rotated SVID in `current`, when the
    /// files changed and have stayed as they are since the last look. A
    /// call that finds another looking goes on with the current channel:
    /// no call waits on the files (a slow or hung file system included).
    fn check(&self, current: &parking_lot::RwLock<Channel>) {
        let Some(mut state) = self.state.try_lock() else {
            return;
        };
        let now = Instant::now();
        if now < state.next_check {
            return;
        }
        state.next_check = now + CHECK_EVERY;
        let signature = signature(&self.files);
        if signature == state.current {
            state.seen = None;
            return;
        }
        if state.seen != Some(signature) {
            // Changed since the last look: maybe only half written yet.
            state.seen = Some(signature);
            return;
        }
        match with_tls(self.endpoint.clone(), &self.files, &self.domain) {
            Ok(endpoint) => {
                state.current = signature;
                state.seen = None;
                self.reloads.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    cert = %self.files.cert.display(),
                    "the SVID files changed: new calls and streams present the new certificate"
                );
                // Swapped while the state is held: a later rotation's
                // channel can never be replaced by this older one.
                *current.write() = endpoint.connect_lazy();
            }
            Err(Made::File(e)) => {
                tracing::debug!(error = %e, "the SVID files changed but cannot be read yet; looking again");
            }
            Err(Made::Tls(e)) => {
                tracing::warn!(error = %e, "the rotated SVID files are not a usable TLS identity; keeping the current one");
                state.current = signature;
            }
        }
    }
}

fn read(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::ReadFile {
        what,
        path: path.to_path_buf(),
        source,
    })
}
