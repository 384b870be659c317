//! OpenTelemetry traces (ADR-22), exported over OTLP/gRPC only when
//! `--otlp-endpoint` is given.
//!
//! The spans are ordinary `tracing` spans at TRACE level under the target
//! [`TARGET`]: with no endpoint the subscriber is the plain log one, whose
//! filter never enables them, so each span site costs one cached callsite
//! check and nothing is allocated or recorded. With an endpoint, only spans
//! of [`TARGET`] reach the OpenTelemetry layer: no log event ever becomes a
//! span event (the log lines name keys and identities; spans must not).
//!
//! Span attributes are the namespace and the class, as the metrics' labels
//! (ADR-22), plus fixed words (`txn`, outcome flags) and counts. Never a key,
//! a token, a session or an identity.

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The `tracing` target of every exported span.
pub const TARGET: &str = "latchkey_otel";

/// The service name the exported resource carries.
pub const SERVICE_NAME: &str = "latchkey-arbiter";

/// What `--otlp-endpoint` and `--otlp-sample-ratio` configure.
#[derive(Clone, Debug)]
pub struct OtlpConfig {
    /// An OTLP/gRPC collector, e.g. `http://127.0.0.1:4317`.
    pub endpoint: String,
    /// The fraction of root traces sampled; a caller's sampled flag (W3C
    /// `traceparent`) decides for its own calls.
    pub sample_ratio: f64,
}

impl OtlpConfig {
    /// Checks the flags before anything starts.
    pub fn check(&self) -> Result<(), String> {
        if !(self.endpoint.starts_with("http://") || self.endpoint.starts_with("https://")) {
            return Err(format!(
                "--otlp-endpoint {:?} must be an http:// or https:// URL of an OTLP/gRPC collector (e.g. http://127.0.0.1:4317)",
                self.endpoint
            ));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(format!(
                "--otlp-sample-ratio {} must be between 0 and 1",
                self.sample_ratio
            ));
        }
        Ok(())
    }
}

/// The exporter pipeline; flush it with [`Tracing::shutdown`] at exit.
pub struct Tracing {
    provider: SdkTracerProvider,
}

impl Tracing {
    /// Builds the OTLP/gRPC exporter and batch processor. Must run inside
    /// the tokio runtime (the exporter's channel lives there).
    pub fn start(config: &OtlpConfig) -> anyhow::Result<(Self, opentelemetry_sdk::trace::Tracer)> {
        config.check().map_err(anyhow::Error::msg)?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.endpoint.clone())
            .build()?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(SERVICE_NAME)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sample_ratio,
            ))))
            .build();
        let tracer = provider.tracer(SERVICE_NAME);
        Ok((Self { provider }, tracer))
    }

    /// Exports what is buffered and stops the exporter (off the runtime's
    /// worker threads: the batch processor's thread waits on the channel).
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(error = %e, "the OTLP exporter did not flush at shutdown");
        }
    }
}

/// The OpenTelemetry layer for the arbiter's subscriber: spans of
/// [`TARGET`] only, without source locations, threads or timing extras.
pub fn layer<S>(tracer: opentelemetry_sdk::trace::Tracer) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(
            tracing_subscriber::filter::Targets::new().with_target(TARGET, tracing::Level::TRACE),
        )
}

/// gRPC metadata as the W3C propagator reads it.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        Vec::new()
    }
}

/// Makes `span` a child of the caller's W3C trace context (`traceparent`,
/// `tracestate`), if it has one. Nothing is read when the span is disabled
/// (no `--otlp-endpoint`). Call before the span is first entered.
pub fn adopt_parent(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    if span.is_disabled() || metadata.get("traceparent").is_none() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&Metadata(metadata));
    // An unparsable traceparent yields an empty context: the span is a root.
    let _ = span.set_parent(parent);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_endpoint_the_spans_are_never_enabled() {
        // The subscriber `cli.rs` installs without --otlp-endpoint.
        let logs = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .finish();
        tracing::subscriber::with_default(logs, || {
            let span = tracing::trace_span!(target: TARGET, "lock.acquire");
            assert!(span.is_disabled());
            let mut metadata = tonic::metadata::MetadataMap::new();
            metadata.insert(
                "traceparent",
                tonic::metadata::MetadataValue::from_static(
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                ),
            );
            // Nothing read, nothing set.
            adopt_parent(&span, &metadata);
        });
    }

    #[test]
    fn flags_are_checked() {
        let ok = OtlpConfig {
            endpoint: "http://127.0.0.1:4317".into(),
            sample_ratio: 1.0,
        };
        assert!(ok.check().is_ok());
        let bad_url = OtlpConfig {
            endpoint: "127.0.0.1:4317".into(),
            ..ok.clone()
        };
        assert!(bad_url.check().unwrap_err().contains("http://"));
        let bad_ratio = OtlpConfig {
            sample_ratio: 1.5,
            ..ok
        };
        assert!(bad_ratio.check().unwrap_err().contains("between 0 and 1"));
    }
}
