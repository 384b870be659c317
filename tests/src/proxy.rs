//! A TCP proxy that can stop forwarding in both directions: a network path that goes
//! dark. TLS passes through it untouched. Bytes already read when the path blocks are
//! held, not dropped, and flow on unblock, as a partition that heals delivers them late.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Forwards every connection to its upstream until [`Proxy::block`]; stops accepting
/// when dropped.
pub struct Proxy {
    addr: SocketAddr,
    blocked: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (blocked, watch) = watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((downstream, _)) = listener.accept().await {
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = downstream.set_nodelay(true);
                let _ = up.set_nodelay(true);
                let (down_read, down_write) = downstream.into_split();
                let (up_read, up_write) = up.into_split();
                tokio::spawn(pipe(down_read, up_write, watch.clone()));
                tokio::spawn(pipe(up_read, down_write, watch.clone()));
            }
        });
        Ok(Self {
            addr,
            blocked,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The path goes dark: nothing more is forwarded either way.
    pub fn block(&self) {
        self.blocked.send_replace(true);
    }

    /// The path heals: held and new bytes flow again.
    pub fn unblock(&self) {
        self.blocked.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut blocked: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if blocked.wait_for(|b| !*b).await.is_err() {
            return;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = blocked.wait_for(|b| *b) => continue,
        };
        // Read just before a block: hold it until the path heals.
        if blocked.wait_for(|b| !*b).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
