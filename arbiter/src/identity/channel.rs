//! The one channel a forwarded identity may arrive on: the initial HTTP/2
//! request headers.
//!
//! tonic merges a unary request's *trailers* into its metadata, so a header
//! read from metadata may have been sent after the body, where no proxy looks.
//! This layer runs before tonic: it takes the reserved `x-latchkey-*` headers
//! out of the initial headers into a [`ForwardedIdentity`] extension (the only
//! place [`super::IdentitySource`] reads them from) and fails the request body
//! if its trailers carry any reserved header, so such a request is refused
//! before a handler runs (INVALID_ARGUMENT) and nothing in metadata can ever
//! name a caller.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;
use tower_layer::Layer;
use tower_service::Service;

use super::{DEV_IDENTITY_HEADER, EDGE_IDENTITY_HEADER};

/// Every header whose name starts with this is Latchkey's own: set by the
/// edge (or the dev client) in the initial headers, nowhere else.
pub const RESERVED_PREFIX: &str = "x-latchkey-";

/// What one reserved header carried in the initial request headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Named {
    #[default]
    Absent,
    One(String),
    /// Sent twice, or not valid UTF-8: never guessed at.
    Invalid(&'static str),
}

impl Named {
    fn from_headers(headers: &HeaderMap, name: &str) -> Self {
        let mut values = headers.get_all(name).iter();
        match (values.next(), values.next()) {
            (None, _) => Self::Absent,
            (Some(_), Some(_)) => Self::Invalid("sent more than once"),
            (Some(v), None) => match v.to_str() {
                Ok(s) => Self::One(s.to_string()),
                Err(_) => Self::Invalid("not valid text"),
            },
        }
    }

    pub fn is_absent(&self) -> bool {
        matches!(self, Self::Absent)
    }
}

/// The reserved headers of the initial request headers, taken out of the
/// headers by [`IdentityChannelLayer`]. Absent from a request that did not
/// pass the layer (then nothing is forwarded).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForwardedIdentity {
    /// `x-latchkey-identity`: honoured only from the edge's own SVID.
    pub edge: Named,
    /// `x-latchkey-dev-identity`: honoured only in insecure dev mode.
    pub dev: Named,
}

impl ForwardedIdentity {
    /// Takes every reserved header out of `headers`, keeping the two that mean
    /// something.
    pub fn take_from(headers: &mut HeaderMap) -> Self {
        let taken = Self {
            edge: Named::from_headers(headers, EDGE_IDENTITY_HEADER),
            dev: Named::from_headers(headers, DEV_IDENTITY_HEADER),
        };
        let reserved: Vec<_> = headers
            .keys()
            .filter(|k| is_reserved(k.as_str()))
            .cloned()
            .collect();
        for name in reserved {
            headers.remove(&name);
        }
        taken
    }
}

pub fn is_reserved(name: &str) -> bool {
    name.len() >= RESERVED_PREFIX.len()
        && name.as_bytes()[..RESERVED_PREFIX.len()].eq_ignore_ascii_case(RESERVED_PREFIX.as_bytes())
}

/// Installs the channel in front of every service of the server.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdentityChannelLayer;

impl<S> Layer<S> for IdentityChannelLayer {
    type Service = IdentityChannel<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdentityChannel { inner }
    }
}

#[derive(Debug, Clone)]
pub struct IdentityChannel<S> {
    inner: S,
}

impl<S> Service<http::Request<Body>> for IdentityChannel<S>
where
    S: Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        let forwarded = ForwardedIdentity::take_from(&mut parts.headers);
        parts.extensions.insert(forwarded);
        let body = Body::new(NoReservedTrailers { inner: body });
        self.inner.call(http::Request::from_parts(parts, body))
    }
}

/// A request body whose trailers may not carry a reserved header.
struct NoReservedTrailers {
    inner: Body,
}

impl HttpBody for NoReservedTrailers {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(trailers) = frame.trailers_ref()
                    && let Some(name) = trailers.keys().find(|k| is_reserved(k.as_str()))
                {
                    return Poll::Ready(Some(Err(reserved_in_trailers(name.as_str()))));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pub fn reserved_in_trailers(name: &str) -> Status {
    Status::invalid_argument(format!(
        "the request's trailers carry the reserved header {name:?}; headers starting with \
         {RESERVED_PREFIX} are set by Latchkey's edge in the initial headers only: remove it"
    ))
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Arc;

    use http_body_util::{BodyExt, StreamBody};
    use parking_lot::Mutex;

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, http::HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn reserved_headers_leave_the_headers_and_land_in_the_extension() {
        let mut h = headers(&[
            ("x-latchkey-identity", "spiffe://dev.latchkey/workload/a"),
            ("X-Latchkey-Something", "x"),
            ("x-lock-key", "demo/a"),
            ("content-type", "application/grpc"),
        ]);
        let f = ForwardedIdentity::take_from(&mut h);
        assert_eq!(
            f.edge,
            Named::One("spiffe://dev.latchkey/workload/a".into())
        );
        assert_eq!(f.dev, Named::Absent);
        assert!(h.keys().all(|k| !is_reserved(k.as_str())));
        assert!(h.contains_key("x-lock-key"));
        assert!(h.contains_key("content-type"));
    }

    #[test]
    fn a_repeated_identity_header_is_invalid_not_the_first_or_last() {
        let mut h = headers(&[
            ("x-latchkey-identity", "spiffe://dev.latchkey/workload/a"),
            (
                "x-latchkey-identity",
                "spiffe://dev.latchkey/latchkey/operator",
            ),
        ]);
        assert!(matches!(
            ForwardedIdentity::take_from(&mut h).edge,
            Named::Invalid(_)
        ));
    }

    /// The inner service sees what tonic would: the extension, no reserved
    /// header, and a body that fails on reserved trailers.
    #[tokio::test]
    async fn trailers_naming_an_identity_fail_the_body() {
        type Seen = Arc<Mutex<Option<http::Request<Body>>>>;
        let seen: Seen = Arc::default();
        let inner = {
            let seen = seen.clone();
            tower_service_fn(move |req: http::Request<Body>| {
                *seen.lock() = Some(req);
            })
        };
        let mut svc = IdentityChannelLayer.layer(inner);
        let frames: Vec<Result<Frame<Bytes>, Status>> = vec![
            Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0"))),
            Ok(Frame::trailers(headers(&[(
                "x-latchkey-identity",
                "spiffe://dev.latchkey/latchkey/operator",
            )]))),
        ];
        let body = Body::new(StreamBody::new(futures::stream::iter(frames)));
        let req = http::Request::builder()
            .header("x-latchkey-identity", "spiffe://dev.latchkey/workload/m")
            .body(body)
            .unwrap_or_else(|_| unreachable!());
        let _ = svc.call(req).await;
        let req = seen.lock().take().unwrap_or_else(|| unreachable!());
        assert!(!req.headers().contains_key("x-latchkey-identity"));
        assert_eq!(
            req.extensions()
                .get::<ForwardedIdentity>()
                .map(|f| f.edge.clone()),
            Some(Named::One("spiffe://dev.latchkey/workload/m".into()))
        );
        let err = req.into_body().collect().await.err();
        assert_eq!(
            err.map(|e| e.code()),
            Some(tonic::Code::InvalidArgument),
            "reserved trailers must fail the body"
        );
    }

    #[tokio::test]
    async fn ordinary_trailers_pass() {
        let frames: Vec<Result<Frame<Bytes>, Status>> = vec![
            Ok(Frame::data(Bytes::from_static(b"abc"))),
            Ok(Frame::trailers(headers(&[("grpc-status", "0")]))),
        ];
        let body = NoReservedTrailers {
            inner: Body::new(StreamBody::new(futures::stream::iter(frames))),
        };
        let collected = body.collect().await;
        assert!(collected.is_ok());
    }

    /// A minimal `Service` from a closure, for the layer test.
    fn tower_service_fn<F>(
        f: F,
    ) -> impl Service<http::Request<Body>, Response = (), Error = Infallible>
    where
        F: FnMut(http::Request<Body>),
    {
        struct Fn<F>(F);
        impl<F: FnMut(http::Request<Body>)> Service<http::Request<Body>> for Fn<F> {
            type Response = ();
            type Error = Infallible;
            type Future = std::future::Ready<Result<(), Infallible>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, req: http::Request<Body>) -> Self::Future {
                (self.0)(req);
                std::future::ready(Ok(()))
            }
        }
        Fn(f)
    }
}
