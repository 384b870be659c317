//! The arbiter's HTTP/2 limits (issue 18; docs/sessions.md "HTTP/2 limits"),
//! with raw h2 over mTLS: a client writes KeepAlive renewals as fast as it
//! can, each in its own tiny DATA frame, and reads none of the answers.
//!
//! h2 0.4 closes a connection with GOAWAY `ENHANCE_YOUR_CALM`
//! ("too_many_data_frames") once the framing overhead of the small DATA
//! frames it holds unread passes a budget of half its connection window
//! (a frame under 256 bytes costs 256 minus its length; never below 25,600).
//! Under hyper's default windows (1 MiB connection and stream, what tonic
//! serves with unless told otherwise) a stream the arbiter stopped reading
//! took ~74,900 renewals of flow control but the budget only ~2,170: the
//! GOAWAY came first and ended every call on the connection. With the
//! arbiter's windows (8 MiB connection: a 4 MiB budget; 64 KiB stream) the
//! stream's window stops the writer after ~4,700 unread renewals, a quarter
//! of the budget.
//!
//! The control serves the same arbiter with hyper's defaults (as `run`
//! did before `HTTP2_*`), so the storm is shown to be one that cuts a
//! connection off when nothing holds the writer back.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use parking_lot::Mutex;

use anyhow::{Context, bail, ensure};
use bytes::{BufMut, Bytes, BytesMut};
use h2::client::SendRequest;
use h2::{RecvStream, SendStream};
use latchkey_arbiter::{HTTP2_CONNECTION_WINDOW, HTTP2_STREAM_WINDOW};
use latchkey_proto::lockv1::lock_server::LockServer;
use latchkey_proto::lockv1::{
    InspectRequest, InspectResponse, KeepAliveRequest, KeepAliveResponse, OpenSessionRequest,
    OpenSessionResponse,
};
use latchkey_tests::arbiter::{TRUST_DOMAIN, certs};
use latchkey_tests::etcd::EtcdServer;
use prost::Message;
use tempfile::TempDir;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};
use tonic::Code;

use crate::support::*;

const LOCK: &str = "/latchkey.lock.v1.Lock";

/// h2 0.4 (`proto::DEFAULT_DATA_FRAME_OVERHEAD_THRESHOLD`): a non-empty DATA
/// frame shorter than this costs (this − its length) of the budget until
/// it is read.
const H2_SMALL_FRAME: usize = 256;
/// h2 0.4 (`proto::DEFAULT_DATA_FRAME_BUDGET`): the budget's floor.
const H2_MIN_BUDGET: usize = 25_600;
/// hyper 1.x's HTTP/2 server windows (`DEFAULT_CONN_WINDOW`,
/// `DEFAULT_STREAM_WINDOW`), which tonic keeps unless set: the arbiter's
/// before its limits were set.
const HYPER_DEFAULT_WINDOW: u32 = 1024 * 1024;
/// Renewals in the storm: more than even the arbiter's 8 MiB window
/// budgets for, so a larger budget alone would not save the connection.
const STORM_FRAMES: usize = 20_000;
/// This client's windows: its own h2 budgets the answers it leaves unread
/// the same way, so it takes as much as the arbiter does.
const CLIENT_CONNECTION_WINDOW: u32 = 8 * 1024 * 1024;
const CLIENT_STREAM_WINDOW: u32 = 64 * 1024;
/// How long the writer must make no progress, waiting for window, to count
/// as held back (a wait for a condition, not a bound on anything's speed).
const HELD_FOR: Duration = Duration::from_millis(1000);
/// Bounds every wait: past it the test fails, saying what it waited for.
const WAIT: Duration = Duration::from_secs(15);

/// h2's small-DATA-frame budget for a connection window.
fn small_frame_budget(connection_window: u32) -> usize {
    (connection_window as usize / 2).max(H2_MIN_BUDGET)
}

/// How many unread DATA frames of `len` bytes exhaust that budget: the
/// frame that receives the GOAWAY.
fn frames_over_budget(connection_window: u32, len: usize) -> usize {
    small_frame_budget(connection_window) / (H2_SMALL_FRAME - len) + 1
}

/// How many unread frames of `len` bytes a stream's window admits.
fn frames_in_window(stream_window: u32, len: usize) -> usize {
    stream_window as usize / len
}

/// HTTP/2's GOAWAY frame type and ENHANCE_YOUR_CALM error code (RFC 9113).
const GOAWAY: u8 = 0x7;
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// What the arbiter sent, as the client read it: every GOAWAY frame's
/// error code and debug data.
#[derive(Default)]
struct Seen {
    unparsed: Vec<u8>,
    goaways: Vec<(u32, String)>,
    /// Writes failed because the arbiter had closed the connection.
    peer_closed: bool,
}

impl Seen {
    fn read(&mut self, bytes: &[u8]) {
        self.unparsed.extend_from_slice(bytes);
        while self.unparsed.len() >= 9 {
            let len = u32::from_be_bytes([0, self.unparsed[0], self.unparsed[1], self.unparsed[2]])
                as usize;
            if self.unparsed.len() < 9 + len {
                break;
            }
            let frame: Vec<u8> = self.unparsed.drain(..9 + len).collect();
            if frame[3] == GOAWAY && len >= 8 {
                let payload = &frame[9..];
                let code = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                let debug = String::from_utf8_lossy(&payload[8..]).into_owned();
                self.goaways.push((code, debug));
            }
        }
    }
}

/// The client's transport, tapped: records what the arbiter sends (see
/// [`Seen`]); once the arbiter has closed the connection, writes are
/// dropped instead of failing, so that the client goes on to read what the
/// arbiter sent before it closed (a GOAWAY) rather than stopping at its
/// own broken pipe.
struct Tap<T> {
    io: T,
    seen: Arc<Mutex<Seen>>,
}

fn peer_gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
    )
}

impl<T: AsyncRead + Unpin> AsyncRead for Tap<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let mut seen = this.seen.lock();
            seen.read(&buf.filled()[before..]);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> Tap<T> {
    fn dropping(&self) -> bool {
        self.seen.lock().peer_closed
    }

    fn gone<R>(&self, polled: Poll<io::Result<R>>, instead: R) -> Poll<io::Result<R>> {
        match polled {
            Poll::Ready(Err(e)) if peer_gone(&e) => {
                self.seen.lock().peer_closed = true;
                Poll::Ready(Ok(instead))
            }
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tap<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.dropping() {
            return Poll::Ready(Ok(buf.len()));
        }
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.gone(polled, buf.len())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.dropping() {
            return Poll::Ready(Ok(()));
        }
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.gone(polled, ())
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.dropping() {
            return Poll::Ready(Ok(()));
        }
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        this.gone(polled, ())
    }
}

/// A raw HTTP/2 connection to the arbiter, the task driving it (which
/// returns how the connection ended), and what the arbiter sent on it.
struct Raw {
    h2: SendRequest<Bytes>,
    driver: JoinHandle<Result<(), h2::Error>>,
    seen: Arc<Mutex<Seen>>,
}

/// Every GOAWAY the arbiter sent so far: (error code, debug data).
fn goaways(seen: &Mutex<Seen>) -> Vec<(u32, String)> {
    seen.lock().goaways.clone()
}

/// An mTLS HTTP/2 connection to `addr` with `name`'s dev SVID.
async fn connect(addr: SocketAddr, name: &str) -> anyhow::Result<Raw> {
    let certs = certs()?;
    let svid = certs.svid(name);
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(certs.ca())? {
        roots.add(cert?)?;
    }
    let chain = CertificateDer::pem_file_iter(&svid.cert)?.collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_file(&svid.key)?;
    let mut tls =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let stream = TlsConnector::from(Arc::new(tls))
        .connect(ServerName::try_from("localhost")?, tcp)
        .await
        .context("TLS handshake")?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let tapped = Tap {
        io: stream,
        seen: seen.clone(),
    };
    let (h2, connection) = h2::client::Builder::new()
        .initial_window_size(CLIENT_STREAM_WINDOW)
        .initial_connection_window_size(CLIENT_CONNECTION_WINDOW)
        .handshake::<_, Bytes>(tapped)
        .await
        .context("HTTP/2 handshake")?;
    Ok(Raw {
        h2,
        driver: tokio::spawn(connection),
        seen,
    })
}

fn grpc_request(method: &str) -> anyhow::Result<http::Request<()>> {
    Ok(http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{LOCK}/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?)
}

/// One gRPC message: uncompressed flag, length, message.
fn grpc_frame(message: &impl Message) -> Bytes {
    let encoded = message.encode_to_vec();
    let mut framed = BytesMut::with_capacity(5 + encoded.len());
    framed.put_u8(0);
    framed.put_u32(encoded.len() as u32);
    framed.put_slice(&encoded);
    framed.freeze()
}

/// The next whole message in `buf`, if there is one.
fn take_message<R: Message + Default>(buf: &mut BytesMut) -> anyhow::Result<Option<R>> {
    if buf.len() < 5 {
        return Ok(None);
    }
    ensure!(buf[0] == 0, "a compressed message");
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let framed = buf.split_to(5 + len);
    Ok(Some(R::decode(&framed[5..])?))
}

/// Reads a response body's messages, giving the window back as it goes.
struct Replies {
    body: RecvStream,
    buf: BytesMut,
}

impl Replies {
    async fn next<R: Message + Default>(&mut self) -> anyhow::Result<Option<R>> {
        loop {
            if let Some(message) = take_message(&mut self.buf)? {
                return Ok(Some(message));
            }
            match self.body.data().await {
                Some(chunk) => {
                    let chunk = chunk?;
                    self.body.flow_control().release_capacity(chunk.len())?;
                    self.buf.extend_from_slice(&chunk);
                }
                None => {
                    ensure!(self.buf.is_empty(), "the body ended inside a message");
                    return Ok(None);
                }
            }
        }
    }

    /// The gRPC status, once the body has ended.
    async fn status(&mut self, headers: &http::HeaderMap) -> anyhow::Result<tonic::Status> {
        let trailers = self.body.trailers().await?;
        trailers
            .as_ref()
            .and_then(tonic::Status::from_header_map)
            .or_else(|| tonic::Status::from_header_map(headers))
            .context("no grpc-status in the answer")
    }
}

/// One unary call on the connection; its answer, or why there was none.
async fn unary<M: Message, R: Message + Default>(
    h2: &SendRequest<Bytes>,
    method: &str,
    message: &M,
) -> anyhow::Result<R> {
    let mut h2 = h2.clone().ready().await?;
    let (response, mut body) = h2.send_request(grpc_request(method)?, false)?;
    body.send_data(grpc_frame(message), true)?;
    let (parts, body) = response.await?.into_parts();
    let mut replies = Replies {
        body,
        buf: BytesMut::new(),
    };
    let reply = replies.next::<R>().await?;
    let status = replies.status(&parts.headers).await?;
    ensure!(status.code() == Code::Ok, "{method}: {status:?}");
    reply.with_context(|| format!("{method}: OK without a message"))
}

async fn unary_within<M: Message, R: Message + Default>(
    h2: &SendRequest<Bytes>,
    method: &str,
    message: &M,
) -> anyhow::Result<R> {
    timeout(WAIT, unary(h2, method, message))
        .await
        .with_context(|| format!("{method} got no answer within {WAIT:?}"))?
}

async fn open_session(h2: &SendRequest<Bytes>) -> anyhow::Result<i64> {
    let opened: OpenSessionResponse = unary_within(
        h2,
        "OpenSession",
        &OpenSessionRequest {
            class: "demo".into(),
            reuse_session_ids: vec![],
        },
    )
    .await?;
    Ok(opened.session_id)
}

async fn inspect(h2: &SendRequest<Bytes>) -> anyhow::Result<InspectResponse> {
    unary_within(
        h2,
        "Inspect",
        &InspectRequest {
            key: "demo/h2-storm".into(),
        },
    )
    .await
}

#[derive(Default)]
struct Progress {
    /// Frames handed to h2 with window for them: on the wire, or about to be.
    sent: AtomicUsize,
    /// The writer is waiting for window.
    waiting: AtomicBool,
}

/// Writes `n` copies of `frame`, each in its own DATA frame: window is
/// asked for one message at a time, and a message is written only once
/// the window has room for all of it, so h2 neither splits nor joins them.
async fn write_storm(
    mut tx: SendStream<Bytes>,
    frame: Bytes,
    n: usize,
    progress: Arc<Progress>,
) -> anyhow::Result<SendStream<Bytes>> {
    for _ in 0..n {
        tx.reserve_capacity(frame.len());
        while tx.capacity() < frame.len() {
            progress.waiting.store(true, Ordering::SeqCst);
            let got = std::future::poll_fn(|cx| tx.poll_capacity(cx)).await;
            progress.waiting.store(false, Ordering::SeqCst);
            match got {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
                None => bail!("the stream closed under the writer"),
            }
        }
        tx.send_data(frame.clone(), false)?;
        progress.sent.fetch_add(1, Ordering::SeqCst);
    }
    Ok(tx)
}

/// A KeepAlive stream in full flood: the writer runs, nobody reads.
struct Storm {
    session: i64,
    frame_len: usize,
    progress: Arc<Progress>,
    writer: JoinHandle<anyhow::Result<SendStream<Bytes>>>,
    headers: http::HeaderMap,
    replies: Replies,
}

async fn start_storm(raw: &Raw) -> anyhow::Result<Storm> {
    let session = open_session(&raw.h2).await?;
    let frame = grpc_frame(&KeepAliveRequest {
        session_id: session,
        ..Default::default()
    });
    let frame_len = frame.len();
    let mut h2 = raw.h2.clone().ready().await?;
    let (response, tx) = h2.send_request(grpc_request("KeepAlive")?, false)?;
    // The arbiter answers a KeepAlive with its headers at once.
    let (parts, body) = timeout(WAIT, response)
        .await
        .context("KeepAlive: no response headers")?
        .context("KeepAlive: response headers")?
        .into_parts();
    ensure!(parts.status == 200, "KeepAlive: HTTP {}", parts.status);
    let progress = Arc::new(Progress::default());
    let writer = tokio::spawn(write_storm(tx, frame, STORM_FRAMES, progress.clone()));
    Ok(Storm {
        session,
        frame_len,
        progress,
        writer,
        headers: parts.headers,
        replies: Replies {
            body,
            buf: BytesMut::new(),
        },
    })
}

/// How the storm stopped while nobody read.
enum Stopped {
    /// The writer waits for window and has made no progress for
    /// [`HELD_FOR`], with this many frames written.
    HeldBack(usize),
    /// The connection ended, with this many frames written.
    CutOff(usize),
}

async fn until_stopped(raw: &Raw, storm: &Storm) -> anyhow::Result<Stopped> {
    let deadline = Instant::now() + WAIT;
    let poll = Duration::from_millis(100);
    let (mut last, mut still) = (usize::MAX, Duration::ZERO);
    loop {
        if raw.driver.is_finished() {
            return Ok(Stopped::CutOff(storm.progress.sent.load(Ordering::SeqCst)));
        }
        let sent = storm.progress.sent.load(Ordering::SeqCst);
        let waiting = storm.progress.waiting.load(Ordering::SeqCst);
        still = if waiting && sent == last {
            still + poll
        } else {
            Duration::ZERO
        };
        if still >= HELD_FOR {
            return Ok(Stopped::HeldBack(sent));
        }
        last = sent;
        if Instant::now() >= deadline {
            bail!(
                "after {WAIT:?} the writer was neither held back nor cut off: {sent} of \
                 {STORM_FRAMES} frames written, none answered (finished: {})",
                storm.writer.is_finished()
            );
        }
        sleep(poll).await;
    }
}

/// What the budget arithmetic says for `frame_len`-byte renewals.
fn print_budgets(frame_len: usize) {
    let cost = H2_SMALL_FRAME - frame_len;
    println!(
        "renewal DATA frame: {frame_len} bytes, {cost} bytes of h2's small-frame budget each while unread"
    );
    println!(
        "hyper defaults ({} KiB connection, {} KiB stream window): budget {} bytes, GOAWAY at {} unread frames; the stream's window admits {} unread frames",
        HYPER_DEFAULT_WINDOW / 1024,
        HYPER_DEFAULT_WINDOW / 1024,
        small_frame_budget(HYPER_DEFAULT_WINDOW),
        frames_over_budget(HYPER_DEFAULT_WINDOW, frame_len),
        frames_in_window(HYPER_DEFAULT_WINDOW, frame_len),
    );
    println!(
        "arbiter ({} KiB connection, {} KiB stream window): budget {} bytes, GOAWAY at {} unread frames; the stream's window admits {} unread frames ({} bytes of the budget)",
        HTTP2_CONNECTION_WINDOW / 1024,
        HTTP2_STREAM_WINDOW / 1024,
        small_frame_budget(HTTP2_CONNECTION_WINDOW),
        frames_over_budget(HTTP2_CONNECTION_WINDOW, frame_len),
        frames_in_window(HTTP2_STREAM_WINDOW, frame_len),
        frames_in_window(HTTP2_STREAM_WINDOW, frame_len) * cost,
    );
    println!("storm: {STORM_FRAMES} renewals, one DATA frame each, no answer read");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_keepalive_storm_is_slowed_by_flow_control_not_cut_off_with_goaway() -> anyhow::Result<()>
{
    let s = stack().await?;
    let raw = connect(s.arbiter.addr(), "workload/bob").await?;
    let mut storm = start_storm(&raw).await?;
    let len = storm.frame_len;
    print_budgets(len);
    // The arithmetic the limits rest on: under hyper's defaults the budget
    // binds long before the stream's window (the GOAWAY of issue 18); under
    // the arbiter's the window binds first, and the storm is larger than
    // even the larger budget.
    assert!(
        frames_over_budget(HYPER_DEFAULT_WINDOW, len) < frames_in_window(HYPER_DEFAULT_WINDOW, len)
    );
    assert!(
        frames_in_window(HTTP2_STREAM_WINDOW, len)
            < frames_over_budget(HTTP2_CONNECTION_WINDOW, len)
    );
    assert!(STORM_FRAMES > frames_over_budget(HTTP2_CONNECTION_WINDOW, len));

    let held = match until_stopped(&raw, &storm).await? {
        Stopped::HeldBack(sent) => sent,
        Stopped::CutOff(sent) => {
            let ended = timeout(WAIT, raw.driver).await.context("the driver")??;
            bail!("the arbiter cut the connection off after {sent} frames: {ended:?}");
        }
    };
    println!("held back by flow control after {held} of {STORM_FRAMES} frames (no answer read)");
    ensure!(
        held < STORM_FRAMES,
        "the writer was never held back: all {STORM_FRAMES} frames written with no answer read"
    );

    // Mid-storm, the other calls on the connection are served.
    let view = inspect(&raw.h2).await.context("Inspect mid-storm")?;
    ensure!(view.holder.is_none(), "{view:?}");
    let other = open_session(&raw.h2)
        .await
        .context("OpenSession mid-storm")?;
    ensure!(other != storm.session);
    ensure!(!raw.driver.is_finished(), "the connection ended mid-storm");
    let mid = goaways(&raw.seen);
    ensure!(mid.is_empty(), "GOAWAY mid-storm: {mid:?}");

    // Reading the answers lets the writer go on: the stream was slowed,
    // not reset. The first answers are for the storm's session.
    for i in 0..3 {
        let reply: KeepAliveResponse = timeout(WAIT, storm.replies.next())
            .await
            .with_context(|| format!("answer {i} did not come"))??
            .with_context(|| format!("the stream ended before answer {i}"))?;
        ensure!(reply.session_id == storm.session, "{reply:?}");
        ensure!(reply.remaining_ttl_seconds > 0, "{reply:?}");
    }
    // And every renewal is answered.
    let mut answered = 3;
    let drained = timeout(WAIT, async {
        while answered < STORM_FRAMES {
            let reply: KeepAliveResponse = storm
                .replies
                .next()
                .await?
                .context("the stream ended early")?;
            ensure!(reply.remaining_ttl_seconds > 0, "{reply:?}");
            answered += 1;
        }
        anyhow::Ok(())
    })
    .await;
    let written = storm.progress.sent.load(Ordering::SeqCst);
    drained
        .with_context(|| {
            format!("{answered} of {STORM_FRAMES} answered ({written} written) within {WAIT:?}")
        })?
        .with_context(|| format!("after {answered} answers"))?;
    let mut tx = timeout(WAIT, storm.writer)
        .await
        .context("the writer did not finish")???;
    println!("all {STORM_FRAMES} renewals written and answered once the answers were read");
    tx.send_data(Bytes::new(), true)?;
    let end: Option<KeepAliveResponse> =
        timeout(WAIT, storm.replies.next()).await.context("end")??;
    ensure!(end.is_none(), "an answer too many: {end:?}");
    let status = storm.replies.status(&storm.headers).await?;
    ensure!(status.code() == Code::Ok, "KeepAlive ended with {status:?}");

    inspect(&raw.h2).await.context("Inspect after the storm")?;
    // The connection ends when the client closes it, cleanly: the arbiter
    // sent no GOAWAY with an error at any point.
    drop((tx, storm.replies, raw.h2));
    let ended = timeout(WAIT, raw.driver)
        .await
        .context("the connection did not close")??;
    let goaways = goaways(&raw.seen);
    println!("connection closed by the client: {ended:?}; GOAWAYs from the arbiter: {goaways:?}");
    ensure!(
        goaways.iter().all(|(code, _)| *code == 0),
        "the arbiter sent GOAWAY with an error: {goaways:?}"
    );
    ended.context("the connection ended with an error")?;
    Ok(())
}

/// The arbiter served as `run` served it before its HTTP/2 limits were set:
/// hyper's default windows. Only the control uses it.
struct DefaultWindowsArbiter {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
    _state: TempDir,
}

async fn serve_with_hyper_defaults(etcd: &EtcdServer) -> anyhow::Result<DefaultWindowsArbiter> {
    use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
    let certs = certs()?;
    let state = TempDir::new()?;
    let svid = certs.svid("latchkey/arbiter");
    let mut config = latchkey_arbiter::Config::new(
        vec![etcd.endpoint()],
        latchkey_tests::dev_policies()?.to_path_buf(),
        state.path().to_path_buf(),
    );
    config.tls = Some(latchkey_arbiter::TlsFiles {
        cert: svid.cert.clone(),
        key: svid.key.clone(),
        client_ca: certs.ca(),
    });
    config.trust_domain = TRUST_DOMAIN.into();
    config.allow_direct_workloads = true;
    config.trust_unwitnessed_log = true;
    let arbiter = latchkey_arbiter::build(&config).await?;
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(
            std::fs::read(&svid.cert)?,
            std::fs::read(&svid.key)?,
        ))
        .client_ca_root(Certificate::from_pem(std::fs::read(certs.ca())?));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .tls_config(tls)?
        .layer(latchkey_arbiter::identity::channel::IdentityChannelLayer)
        .add_service(LockServer::new(latchkey_arbiter::LockService::new(arbiter)))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            async {
                let _ = stopped.await;
            },
        );
    tokio::spawn(server);
    Ok(DefaultWindowsArbiter {
        addr,
        _stop: stop,
        _state: state,
    })
}

/// The control: the same storm against the arbiter with hyper's default
/// windows is cut off with GOAWAY ENHANCE_YOUR_CALM, and the other calls
/// on the connection with it. (Were h2's budget to change so that this
/// storm no longer trips it, this test fails, and the test above would no
/// longer show anything.)
#[tokio::test(flavor = "multi_thread")]
async fn control_the_same_storm_under_hyper_default_windows_is_cut_off_with_goaway()
-> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let arbiter = serve_with_hyper_defaults(&etcd).await?;
    let raw = connect(arbiter.addr, "workload/bob").await?;
    let storm = start_storm(&raw).await?;
    print_budgets(storm.frame_len);
    let sent = match until_stopped(&raw, &storm).await? {
        Stopped::CutOff(sent) => sent,
        Stopped::HeldBack(sent) => {
            bail!("hyper's defaults held the writer back after {sent} frames; no GOAWAY")
        }
    };
    let ended = timeout(WAIT, raw.driver).await.context("the driver")??;
    let goaways = goaways(&raw.seen);
    println!(
        "cut off after {sent} frames written: GOAWAYs from the arbiter {goaways:?}; the connection ended with {ended:?}"
    );
    ensure!(
        goaways.contains(&(ENHANCE_YOUR_CALM, "too_many_data_frames".into())),
        "no GOAWAY ENHANCE_YOUR_CALM too_many_data_frames: {goaways:?}, {ended:?}"
    );
    ensure!(ended.is_err(), "the connection ended without an error");
    // Every other call on the connection went with it.
    let after = unary::<_, InspectResponse>(
        &raw.h2,
        "Inspect",
        &InspectRequest {
            key: "demo/h2-storm".into(),
        },
    )
    .await;
    ensure!(after.is_err(), "a call after the GOAWAY was served");
    Ok(())
}
