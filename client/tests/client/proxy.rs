//! A TCP proxy that can stop forwarding: a blocked network path. Bytes
//! already read while blocked are held, not dropped, and flow on unblock,
//! as a partition that heals would deliver them.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    pub addr: SocketAddr,
    blocked: watch::Sender<bool>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = match TcpListener::bind("127.0.0.1:0").await {
            Ok(l) => l,
            Err(e) => panic!("bind: {e}"),
        };
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => panic!("local_addr: {e}"),
        };
        let (blocked, watch) = watch::channel(false);
        tokio::spawn(async move {
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
        Self { addr, blocked }
    }

    pub fn block(&self) {
        self.blocked.send_replace(true);
    }

    pub fn unblock(&self) {
        self.blocked.send_replace(false);
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
