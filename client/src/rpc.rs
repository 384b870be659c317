//! The channel to the arbiter and the per-call metadata every request carries.

use std::time::Duration;

use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::electionv1::election_service_client::ElectionServiceClient;
use latchkey_proto::lockv1::lock_client::LockClient;
use tonic::metadata::{AsciiMetadataValue, MetadataKey};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::config::ClientConfig;
use crate::error::Error;

/// The header that carries the caller's SPIFFE ID in dev mode.
pub const DEV_IDENTITY_HEADER: &str = "x-latchkey-dev-identity";

/// A cheap-to-clone handle: the channel multiplexes every call and stream.
#[derive(Clone, Debug)]
pub(crate) struct Rpc {
    channel: Channel,
    dev_identity: Option<AsciiMetadataValue>,
    request_timeout: Duration,
    /// [`ClientConfig::instance`], sent on every Acquire and Campaign.
    pub(crate) instance: String,
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
        match &config.tls {
            Some(files) => {
                if !https {
                    return Err(Error::Config {
                        field: "endpoint",
                        problem: "TLS files were given, so the endpoint must be https://".into(),
                    });
                }
                let ca = read("CA bundle", &files.ca)?;
                let cert = read("SVID certificate", &files.cert)?;
                let key = read("SVID key", &files.key)?;
                let tls = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(ca))
                    .identity(Identity::from_pem(cert, key))
                    .domain_name(config.tls_domain.as_deref().unwrap_or("localhost"));
                endpoint = endpoint
                    .tls_config(tls)
                    .map_err(|source| Error::Transport {
                        endpoint: config.endpoint.clone(),
                        source,
                    })?;
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
            channel,
            dev_identity,
            request_timeout: config.request_timeout,
            // A caller may have set anything in the public field.
            instance: crate::config::clean_instance(&config.instance),
        })
    }

    pub(crate) fn lock(&self) -> LockClient<Channel> {
        LockClient::new(self.channel.clone())
    }

    pub(crate) fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel.clone())
    }

    pub(crate) fn election(&self) -> ElectionServiceClient<Channel> {
        ElectionServiceClient::new(self.channel.clone())
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

fn read(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::ReadFile {
        what,
        path: path.to_path_buf(),
        source,
    })
}
