//! An etcd channel that does not fail a call because one member is down.
//!
//! etcd-client balances over every member with tonic's balanced channel.
//! There a member that refuses connections still looks ready: tonic's
//! reconnecting service reports ready and fails the *call* with the connect
//! error, so the balancer keeps picking it, and with one member of three
//! down about a third of the arbiter's calls failed with UNAVAILABLE "tcp
//! connect error" — during every rolling restart of etcd (grpc-rust issue
//! 2839; seen here right after a quorum came back).
//!
//! A connect error means nothing was sent, so the call can go again, to
//! whichever member the balancer picks next. Unary calls (every etcd call
//! but the two streams) keep their encoded request (a few hundred bytes) to
//! send it again, at most [`ATTEMPTS`] times. Any other failure is returned
//! as it is: a call that may have reached etcd is never sent twice (a grant
//! whose answer was lost is the LockTable's to resolve, not a retry's).
//! The streams (Watch, LeaseKeepAlive) are opened again by their owners.
//!
//! [`crate::connect`] builds its client on it for a [`crate::Connection`]
//! with `failover` set (the arbiter's).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use etcd_client::{BalancedChannelBuilder, Channel};
use http_body_util::BodyExt as _;
use tonic::body::Body;
use tower::BoxError;
use tower::util::BoxCloneSyncService;
use tower_service::Service;

/// Sends of one unary call whose connection could not be made, at most.
/// A refused connection costs microseconds, and the balancer may pick the
/// same dead member again: with one of two members down, 8 sends all to it
/// came up about once in several hundred calls (seen in CI as UNAVAILABLE
/// "tcp connect error" in `etcd_members`), 16 about once in 65,000.
pub const ATTEMPTS: usize = 16;

/// The client-streaming etcd methods: their request bodies never end, so
/// they cannot be kept to send again.
const STREAMS: [&str; 2] = [
    "/etcdserverpb.Watch/Watch",
    "/etcdserverpb.Lease/LeaseKeepAlive",
];

/// Where etcd-client adds and removes members of the balanced channel.
type Updater = tokio::sync::mpsc::Sender<
    tonic::transport::channel::Change<http::Uri, tonic::transport::Endpoint>,
>;

/// Builds etcd-client's balanced channel with connect errors retried.
pub struct Failover;

impl BalancedChannelBuilder for Failover {
    type Error = etcd_client::Error;

    fn balanced_channel(self, buffer_size: usize) -> Result<(Channel, Updater), Self::Error> {
        let (channel, updater) = tonic::transport::Channel::balance_channel(buffer_size);
        let service = RetryConnect { inner: channel };
        Ok((Channel::Custom(BoxCloneSyncService::new(service)), updater))
    }
}

#[derive(Clone)]
struct RetryConnect {
    inner: tonic::transport::Channel,
}

type Request = http::Request<Body>;
type Response = http::Response<Body>;

impl Service<Request> for RetryConnect {
    type Response = Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The ready clone serves this call; the spare one the next.
        let spare = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, spare);
        if STREAMS.contains(&request.uri().path()) {
            let call = ready.call(request);
            return Box::pin(async move { call.await.map_err(Into::into) });
        }
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = body.collect().await?.to_bytes();
            let copy = |bytes: Bytes| {
                let mut r = http::Request::new(Body::new(http_body_util::Full::new(bytes)));
                *r.method_mut() = parts.method.clone();
                *r.uri_mut() = parts.uri.clone();
                *r.version_mut() = parts.version;
                *r.headers_mut() = parts.headers.clone();
                *r.extensions_mut() = parts.extensions.clone();
                r
            };
            let mut attempt = 1;
            loop {
                match ready.call(copy(bytes.clone())).await {
                    Err(e) if attempt < ATTEMPTS && never_sent(&e) => {
                        tracing::debug!(error = %e, attempt, "an etcd member refused the connection; sending the call to another");
                        attempt += 1;
                        std::future::poll_fn(|cx| ready.poll_ready(cx)).await?;
                    }
                    other => return other.map_err(Into::into),
                }
            }
        })
    }
}

/// Whether `error` says the call's connection was never made (so nothing
/// of it reached etcd).
fn never_sent(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if e.is::<tonic::ConnectError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_connect_error_is_never_sent() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let connect = tonic::ConnectError(Box::new(refused));
        assert!(never_sent(&connect));
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(!never_sent(&reset));
    }
}
