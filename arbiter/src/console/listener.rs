//! The console's listener: at most a fixed number of connections open at
//! once, and fewer from any one client address. Anyone who can reach the
//! port can open connections before signing in, so their count is bounded
//! here (the next one waits in the kernel's backlog until an open one
//! closes; one past an address's share is closed at once). Places are not
//! kept by doing nothing, nor by doing little: a connection that sends and
//! receives nothing for [`IDLE`] is closed, and so is one whose request
//! has not been answered [`REQUEST_DEADLINE`] after its first byte (a
//! request sent a byte at a time; hyper's own header timeout needs a timer
//! `axum::serve` does not give it).
//!
//! The share per address is above every live stream the console allows
//! ([`super::live::MAX_STREAMS`]): behind an ingress or a tunnel, every
//! browser comes from one address.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Connections from one client address at once.
pub(super) const MAX_PER_ADDRESS: usize = 96;
/// A request must have arrived whole (its answer begun) this long after
/// its first byte.
pub(super) const REQUEST_DEADLINE: Duration = Duration::from_secs(20);
/// A connection with no byte either way for this long is closed (a live
/// stream sends a keep-alive comment every 15 s).
pub(super) const IDLE: Duration = Duration::from_secs(60);

pub(super) struct Bounded {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    per_address: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Bounded {
    pub(super) fn new(inner: TcpListener, max: usize) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max)),
            per_address: Arc::default(),
        }
    }
}

/// A connection and its places among the bounded ones (given back on drop).
pub(super) struct Counted {
    stream: TcpStream,
    idle: Pin<Box<Sleep>>,
    /// Armed by a request's first byte, disarmed by the answer's first:
    /// reads do not push it back.
    request: Option<Pin<Box<Sleep>>>,
    _place: Place,
}

struct Place {
    _permit: OwnedSemaphorePermit,
    address: IpAddr,
    per_address: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut per = self.per_address.lock();
        if let Some(n) = per.get_mut(&self.address) {
            *n -= 1;
            if *n == 0 {
                per.remove(&self.address);
            }
        }
    }
}

impl axum::serve::Listener for Bounded {
    type Io = Counted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // The semaphore is never closed.
            let Ok(permit) = self.permits.clone().acquire_owned().await else {
                continue;
            };
            let (stream, addr) = match self.inner.accept().await {
                Ok(accepted) => accepted,
                // Out of file descriptors and the like: wait, as axum's own
                // listener does, instead of spinning.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            {
                let mut per = self.per_address.lock();
                let n = per.entry(addr.ip()).or_insert(0);
                if *n >= MAX_PER_ADDRESS {
                    // Dropped: closed at once, its permit back.
                    continue;
                }
                *n += 1;
            }
            let _ = stream.set_nodelay(true);
            let place = Place {
                _permit: permit,
                address: addr.ip(),
                per_address: self.per_address.clone(),
            };
            return (
                Counted {
                    stream,
                    idle: Box::pin(tokio::time::sleep(IDLE)),
                    request: None,
                    _place: place,
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

impl Counted {
    fn read_some(&mut self) {
        self.idle.as_mut().reset(Instant::now() + IDLE);
        if self.request.is_none() {
            self.request = Some(Box::pin(tokio::time::sleep(REQUEST_DEADLINE)));
        }
    }

    fn wrote_some(&mut self) {
        self.idle.as_mut().reset(Instant::now() + IDLE);
        self.request = None;
    }

    /// `Ready(Err)` once the connection has been idle too long, or its
    /// request has taken too long to arrive.
    fn timed_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.idle.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the console closes connections idle for 60 s",
            )));
        }
        if let Some(deadline) = &mut self.request
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the console closes a connection whose request takes over 20 s to arrive",
            )));
        }
        Poll::Pending
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.read_some();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => self.timed_out(cx),
        }
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.stream).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.wrote_some();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match self.timed_out(cx) {
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                _ => Poll::Pending,
            },
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
