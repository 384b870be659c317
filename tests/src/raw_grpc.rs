//! gRPC calls that no well-behaved client makes: extra headers and HTTP/2
//! request *trailers* after the message. The hostile suites use it to send an
//! identity header where no proxy looks for one.
//!
//! A tonic `Channel` is a tower service over `http::Request<Body>`, so a call
//! is built by hand: one length-prefixed message, then a trailers frame.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Request};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tonic::body::Body;
use tonic::transport::Channel;
use tower_service::Service;

/// What came back: the gRPC status, and the message when it was OK.
pub struct RawReply<R> {
    pub status: tonic::Status,
    pub message: Option<R>,
}

fn header_map(pairs: &[(&str, &str)]) -> anyhow::Result<HeaderMap> {
    let mut map = HeaderMap::new();
    for (k, v) in pairs {
        map.append(HeaderName::try_from(*k)?, HeaderValue::try_from(*v)?);
    }
    Ok(map)
}

/// One unary call on `path` (e.g. `/latchkey.lock.v1.Lock/Inspect`) with
/// `headers` added to the initial headers and `trailers` sent after the message.
pub async fn unary<M, R>(
    channel: Channel,
    path: &str,
    message: &M,
    headers: &[(&str, &str)],
    trailers: &[(&str, &str)],
) -> anyhow::Result<RawReply<R>>
where
    M: prost::Message,
    R: prost::Message + Default,
{
    let encoded = message.encode_to_vec();
    let mut framed = BytesMut::with_capacity(5 + encoded.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(encoded.len())?);
    framed.put_slice(&encoded);
    let mut frames: Vec<Result<Frame<Bytes>, tonic::Status>> =
        vec![Ok(Frame::data(framed.freeze()))];
    if !trailers.is_empty() {
        frames.push(Ok(Frame::trailers(header_map(trailers)?)));
    }
    let body = Body::new(StreamBody::new(futures::stream::iter(frames)));
    let mut request = Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)?;
    request.headers_mut().extend(header_map(headers)?);
    let mut channel = channel;
    futures::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
    let response = channel.call(request).await?;
    let (parts, body) = response.into_parts();
    let collected = body
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("response body: {e}"))?;
    let trailers = collected.trailers().cloned();
    let data = collected.to_bytes();
    // A trailers-only answer puts grpc-status in the headers.
    let status = trailers
        .as_ref()
        .and_then(tonic::Status::from_header_map)
        .or_else(|| tonic::Status::from_header_map(&parts.headers))
        .ok_or_else(|| anyhow::anyhow!("no grpc-status in the answer ({})", parts.status))?;
    let message = if status.code() == tonic::Code::Ok && data.len() >= 5 {
        Some(R::decode(data.slice(5..))?)
    } else {
        None
    };
    Ok(RawReply { status, message })
}
