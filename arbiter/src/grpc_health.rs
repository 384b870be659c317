//! gRPC health checking (`grpc.health.v1`) and server reflection on the
//! arbiter's port, for Envoy's active health checks and for `grpcurl`.
//!
//! - `latchkey.lock.v1.Lock` is SERVING while the arbiter may grant and
//!   NOT_SERVING while it is sealed (a sealed arbiter refuses every grant
//!   until an operator advances the epoch): Envoy's health check on the
//!   `arbiter` cluster names this service.
//! - `latchkey.admin.v1.Admin` and the server as a whole (`""`) stay SERVING
//!   while the process runs: the admin API is how a seal is lifted.
//!
//! Both services answer any caller that completed the mTLS handshake; they
//! carry no lock state beyond "sealed or not", and the edge forwards neither
//! (the filter answers anything but the lock.v1 and admin.v1 methods it
//! knows with UNIMPLEMENTED, and Envoy routes only `/latchkey.*`).
//!
//! Their streams are bounded ([`ProbeStreams`]): a health `Watch` or a
//! reflection stream stays open for as long as its caller likes, so each
//! takes a place under its caller's bound (`--max-probe-streams-per-identity`,
//! the peer certificate's SPIFFE ID) and the arbiter's bound for everyone
//! (`--max-probe-streams`) until it ends; beyond them a new one is answered
//! RESOURCE_EXHAUSTED (`TOO_MANY_STREAMS`). The unary `Check` (what Envoy's
//! health checks and probes use) is not bounded: it ends on its own.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use latchkey_proto::ERROR_DOMAIN;
use latchkey_proto::lockv1::Reason;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tonic_types::{ErrorDetails, StatusExt};
use tower_service::Service;

use crate::error::reason_name;
use crate::identity::channel::{ForwardedIdentity, Named};
use crate::identity::{IdentitySource, spiffe_id_of_certificate};
use crate::service::Arbiter;

/// The lock service's name as health checks and reflection know it.
pub const LOCK_SERVICE: &str = "latchkey.lock.v1.Lock";
/// The admin service's name.
pub const ADMIN_SERVICE: &str = "latchkey.admin.v1.Admin";
/// How often the seal is looked at (a seal comes from etcd or a check, both
/// slower than this).
const EVERY: Duration = Duration::from_millis(500);

/// The health service's one streaming method.
pub const WATCH_PATH: &str = "/grpc.health.v1.Health/Watch";
/// Default `--max-probe-streams-per-identity`: a client needs one `Watch` per
/// service it follows (three services) and a reflection stream or two.
pub const DEFAULT_MAX_PROBE_STREAMS_PER_IDENTITY: u32 = 16;
/// Default `--max-probe-streams`: 64 identities at their bound.
pub const DEFAULT_MAX_PROBE_STREAMS: u32 = 1024;

/// Bounds on open health `Watch` and server-reflection streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeStreamLimits {
    /// Per caller identity (the peer certificate's SPIFFE ID).
    pub per_identity: u32,
    /// For all callers together.
    pub total: u32,
}

impl Default for ProbeStreamLimits {
    fn default() -> Self {
        Self {
            per_identity: DEFAULT_MAX_PROBE_STREAMS_PER_IDENTITY,
            total: DEFAULT_MAX_PROBE_STREAMS,
        }
    }
}

/// Why a probe stream was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeRefusal {
    /// The caller has its bound of streams open.
    Identity { limit: u32 },
    /// Every caller together has the arbiter's bound open.
    Total { limit: u32 },
}

impl ProbeRefusal {
    pub fn message(self) -> String {
        match self {
            Self::Identity { limit } => format!(
                "this identity already has {limit} health Watch and server-reflection streams open at this arbiter (its --max-probe-streams-per-identity); close the ones it no longer reads (one Watch per service is enough, or poll with Health/Check) and retry"
            ),
            Self::Total { limit } => format!(
                "this arbiter already has {limit} health Watch and server-reflection streams open for all callers together (its --max-probe-streams); retry later, or poll with Health/Check"
            ),
        }
    }

    /// RESOURCE_EXHAUSTED, `ErrorInfo.reason` `TOO_MANY_STREAMS`.
    pub fn status(self) -> Status {
        let mut details = ErrorDetails::new();
        details.set_error_info(
            reason_name(Reason::TooManyStreams),
            ERROR_DOMAIN,
            HashMap::new(),
        );
        Status::with_error_details(tonic::Code::ResourceExhausted, self.message(), details)
    }
}

#[derive(Debug, Default)]
struct Open {
    total: u32,
    /// An entry only while the identity has a stream open, so the map holds
    /// at most `total` entries.
    per_identity: HashMap<String, u32>,
}

/// The open probe streams, per identity and in all.
#[derive(Debug)]
pub struct ProbeStreams {
    limits: ProbeStreamLimits,
    open: Mutex<Open>,
}

/// One open stream's place; dropping it gives the place back.
#[derive(Debug)]
pub struct ProbePlace {
    streams: Arc<ProbeStreams>,
    identity: String,
}

impl Drop for ProbePlace {
    fn drop(&mut self) {
        let mut open = self.streams.open.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.per_identity.get_mut(&self.identity) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.per_identity.remove(&self.identity);
            }
        }
    }
}

impl ProbeStreams {
    pub fn new(limits: ProbeStreamLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            open: Mutex::new(Open::default()),
        })
    }

    /// A place for one more stream of `identity`, or the bound that refuses
    /// it (the identity's first: it is the one its caller can act on).
    pub fn open(self: &Arc<Self>, identity: &str) -> Result<ProbePlace, ProbeRefusal> {
        let mut open = self.open.lock();
        let mine = open.per_identity.get(identity).copied().unwrap_or(0);
        if mine >= self.limits.per_identity {
            return Err(ProbeRefusal::Identity {
                limit: self.limits.per_identity,
            });
        }
        if open.total >= self.limits.total {
            return Err(ProbeRefusal::Total {
                limit: self.limits.total,
            });
        }
        open.total += 1;
        *open.per_identity.entry(identity.to_string()).or_insert(0) += 1;
        Ok(ProbePlace {
            streams: self.clone(),
            identity: identity.to_string(),
        })
    }

    /// Open streams of `identity` (tests and diagnostics).
    pub fn open_of(&self, identity: &str) -> u32 {
        self.open
            .lock()
            .per_identity
            .get(identity)
            .copied()
            .unwrap_or(0)
    }

    /// Open streams in all (tests and diagnostics).
    pub fn total(&self) -> u32 {
        self.open.lock().total
    }
}

/// Puts the health and reflection services under the probe-stream bounds.
#[derive(Debug, Clone)]
pub struct Probes {
    streams: Arc<ProbeStreams>,
    identity: Arc<IdentitySource>,
}

impl Probes {
    pub fn new(limits: ProbeStreamLimits, identity: IdentitySource) -> Self {
        Self {
            streams: ProbeStreams::new(limits),
            identity: Arc::new(identity),
        }
    }

    /// The health service, its `Watch` streams bounded.
    pub fn health<S>(&self, inner: S) -> Bounded<S> {
        self.bounded(inner, Some(WATCH_PATH))
    }

    /// A reflection service: its one method is a stream, every call counts.
    pub fn reflection<S>(&self, inner: S) -> Bounded<S> {
        self.bounded(inner, None)
    }

    fn bounded<S>(&self, inner: S, only: Option<&'static str>) -> Bounded<S> {
        Bounded {
            inner,
            streams: self.streams.clone(),
            identity: self.identity.clone(),
            only,
        }
    }
}

/// A service whose streams take a [`ProbePlace`] each, held until the
/// response body is dropped (the stream ended, was reset, or its connection
/// closed).
#[derive(Debug, Clone)]
pub struct Bounded<S> {
    inner: S,
    streams: Arc<ProbeStreams>,
    identity: Arc<IdentitySource>,
    /// Only this path counts; `None`: every call does.
    only: Option<&'static str>,
}

impl<S: NamedService> NamedService for Bounded<S> {
    const NAME: &'static str = S::NAME;
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S> Service<http::Request<Body>> for Bounded<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if self.only.is_some_and(|p| request.uri().path() != p) {
            return Box::pin(self.inner.call(request));
        }
        let place = probe_caller(&self.identity, &request).and_then(|id| {
            self.streams.open(&id).map_err(|r| {
                tracing::debug!(identity = %id, refusal = ?r, "probe stream refused");
                r.status()
            })
        });
        let place = match place {
            Ok(place) => place,
            Err(status) => return Box::pin(std::future::ready(Ok(status.into_http()))),
        };
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|inner| {
                Body::new(Placed {
                    inner,
                    _place: place,
                })
            }))
        })
    }
}

/// Who a probe stream counts against: the peer certificate's SPIFFE ID (the
/// edge forwards no probe, so no header names anyone here); in insecure dev
/// mode the caller's dev header, or one shared name without it.
fn probe_caller<B>(source: &IdentitySource, request: &http::Request<B>) -> Result<String, Status> {
    match source {
        IdentitySource::Tls { trust_domain, .. } => {
            let certs = request
                .extensions()
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.peer_certs());
            let Some(leaf) = certs.as_deref().and_then(|c| c.first()) else {
                return Err(Status::unauthenticated(
                    "no client certificate on the connection",
                ));
            };
            spiffe_id_of_certificate(leaf.as_ref(), trust_domain).map_err(Status::from)
        }
        IdentitySource::InsecureDev { .. } => Ok(
            match request
                .extensions()
                .get::<ForwardedIdentity>()
                .map(|f| &f.dev)
            {
                Some(Named::One(id)) => id.clone(),
                _ => "insecure-dev".to_string(),
            },
        ),
    }
}

/// A response body that keeps its stream's place until it is dropped.
struct Placed {
    inner: Body,
    /// Held for its `Drop`.
    _place: ProbePlace,
}

impl HttpBody for Placed {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The lock service's status for a seal reason (or none).
pub fn lock_status(seal_reason: Option<&str>) -> ServingStatus {
    match seal_reason {
        Some(_) => ServingStatus::NotServing,
        None => ServingStatus::Serving,
    }
}

/// Keeps the lock service's health in step with the seal until `stop`.
pub(crate) fn spawn(
    arbiter: Arc<Arbiter>,
    reporter: HealthReporter,
    stop: CancellationToken,
    tasks: &TaskTracker,
) {
    tasks.spawn(async move {
        reporter
            .set_service_status("", ServingStatus::Serving)
            .await;
        reporter
            .set_service_status(ADMIN_SERVICE, ServingStatus::Serving)
            .await;
        let mut tick = tokio::time::interval(EVERY);
        loop {
            // Sealed if any tier's cluster is: its locks cannot be served.
            let reason = arbiter
                .tiers
                .all()
                .into_iter()
                .find_map(|c| c.table.seal().guard().seal_reason());
            reporter
                .set_service_status(LOCK_SERVICE, lock_status(reason.as_deref()))
                .await;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_arbiter_is_not_serving_locks() {
        assert_eq!(lock_status(None), ServingStatus::Serving);
        assert_eq!(
            lock_status(Some("restored lock log")),
            ServingStatus::NotServing
        );
    }

    fn limits(per_identity: u32, total: u32) -> ProbeStreamLimits {
        ProbeStreamLimits {
            per_identity,
            total,
        }
    }

    /// Issue 31, finding 6: one identity's streams are bounded, another
    /// identity still gets a place, and places come back when streams end.
    #[test]
    fn probe_streams_are_bounded_per_identity_and_come_back() {
        let streams = ProbeStreams::new(limits(3, 100));
        let mut alice: Vec<_> = (0..3).map(|_| streams.open("alice").unwrap()).collect();
        for _ in 0..10 {
            assert_eq!(
                streams.open("alice").err(),
                Some(ProbeRefusal::Identity { limit: 3 })
            );
        }
        let bob = streams.open("bob").unwrap();
        assert_eq!((streams.open_of("alice"), streams.total()), (3, 4));
        alice.pop();
        alice.push(streams.open("alice").unwrap());
        drop(alice);
        drop(bob);
        assert_eq!(streams.total(), 0);
        assert!(streams.open.lock().per_identity.is_empty(), "no entry left");
    }

    #[test]
    fn probe_streams_are_bounded_in_total() {
        let streams = ProbeStreams::new(limits(3, 5));
        let mut held: Vec<_> = (0..3).map(|_| streams.open("alice").unwrap()).collect();
        held.extend((0..2).map(|_| streams.open("bob").unwrap()));
        assert_eq!(
            streams.open("carol").err(),
            Some(ProbeRefusal::Total { limit: 5 })
        );
        // An identity at its own bound hears about that one.
        assert_eq!(
            streams.open("alice").err(),
            Some(ProbeRefusal::Identity { limit: 3 })
        );
        held.truncate(4);
        assert!(streams.open("carol").is_ok());
    }

    #[test]
    fn a_probe_refusal_is_resource_exhausted_and_names_its_bound() {
        use tonic_types::StatusExt as _;
        for (refusal, flag) in [
            (
                ProbeRefusal::Identity { limit: 16 },
                "--max-probe-streams-per-identity",
            ),
            (ProbeRefusal::Total { limit: 1024 }, "--max-probe-streams"),
        ] {
            let status = refusal.status();
            assert_eq!(status.code(), tonic::Code::ResourceExhausted);
            assert!(status.message().contains(flag), "{}", status.message());
            assert_eq!(
                status
                    .get_error_details()
                    .error_info()
                    .map(|i| i.reason.clone()),
                Some("TOO_MANY_STREAMS".to_string())
            );
        }
    }

    #[test]
    fn the_names_are_the_protos() {
        use latchkey_proto::adminv1::admin_server::SERVICE_NAME as ADMIN;
        use latchkey_proto::lockv1::lock_server::SERVICE_NAME as LOCK;
        assert_eq!((LOCK_SERVICE, ADMIN_SERVICE), (LOCK, ADMIN));
    }
}
