//! The arbiter's own TLS, reloaded from disk: SPIRE (through spiffe-helper or
//! the CSI driver) rotates the arbiter's SVID and trust bundle files well
//! before they expire, and an arbiter that read them once at start would
//! present an expired certificate an hour later and refuse callers whose
//! certificates a rotated bundle signs.
//!
//! Every accepted connection is handshaken with the newest good
//! configuration. The files are looked at again at most every
//! [`RECHECK`]; a change (modification time or length of any of the
//! three) rebuilds the configuration, and one that does not parse or does
//! not match its key is logged and skipped: the arbiter keeps serving the
//! last good one. Handshakes run concurrently, each within
//! [`HANDSHAKE_TIMEOUT`], at most [`MAX_HANDSHAKES`] at once and at most
//! [`MAX_HANDSHAKES_PER_PEER`] from one peer address (a peer that opens
//! connections and never finishes a handshake holds a place only that
//! long, and cannot take every place alone: its extra connections are
//! closed at once); the accept loop never waits for one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::TlsFiles;

/// How often the files are looked at again (on the next accept after it).
pub const RECHECK: Duration = Duration::from_secs(5);
/// Longest a TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; more connections wait to be accepted.
pub const MAX_HANDSHAKES: usize = 1024;
/// Handshakes in progress at once from one IP address; more are closed.
/// The arbiter's callers are a few Envoy replicas and operators, each
/// opening a handful of connections.
pub const MAX_HANDSHAKES_PER_PEER: usize = 64;

/// Handshakes in progress per peer IP address.
#[derive(Default)]
struct PerPeer(Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One handshake's place in [`PerPeer`]; given back on drop.
struct PeerPlace {
    peers: Arc<PerPeer>,
    ip: std::net::IpAddr,
}

impl PerPeer {
    fn enter(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<PeerPlace> {
        let mut map = self.0.lock();
        let n = map.entry(ip).or_insert(0);
        if *n >= MAX_HANDSHAKES_PER_PEER {
            return None;
        }
        *n += 1;
        Some(PeerPlace {
            peers: Arc::clone(self),
            ip,
        })
    }
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut map = self.peers.0.lock();
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// Why a configuration could not be built from the files.
#[derive(Debug, thiserror::Error)]
pub enum TlsLoadError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds no {what}")]
    Missing { path: PathBuf, what: &'static str },
    /// rustls refused the files' contents; `detail` names the files.
    #[error("{detail}")]
    Rustls {
        detail: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl TlsLoadError {
    /// rustls's refusal `source`, with `context` (the files) before it.
    fn rustls(
        context: impl std::fmt::Display,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Rustls {
            detail: format!("{context}: {source}"),
            source: Box::new(source),
        }
    }
}

/// What the files looked like when last loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp(Vec<Option<(SystemTime, u64)>>);

impl Stamp {
    fn of(files: &TlsFiles) -> Self {
        Self(
            [&files.cert, &files.key, &files.client_ca]
                .into_iter()
                .map(|p| {
                    std::fs::metadata(p)
                        .ok()
                        .and_then(|m| Some((m.modified().ok()?, m.len())))
                })
                .collect(),
        )
    }
}

struct Current {
    acceptor: TlsAcceptor,
    stamp: Stamp,
    checked: Instant,
}

/// The server's TLS configuration, rebuilt when its files change.
pub struct ReloadingTls {
    files: TlsFiles,
    current: Mutex<Current>,
}

impl ReloadingTls {
    /// Loads the files once; an error here stops the start.
    pub fn load(files: TlsFiles) -> Result<Self, TlsLoadError> {
        let stamp = Stamp::of(&files);
        let acceptor = TlsAcceptor::from(Arc::new(server_config(&files)?));
        Ok(Self {
            files,
            current: Mutex::new(Current {
                acceptor,
                stamp,
                checked: Instant::now(),
            }),
        })
    }

    /// The acceptor for the next handshake: rebuilt first if the files
    /// changed since the last look (at most every [`RECHECK`]).
    pub fn acceptor(&self) -> TlsAcceptor {
        let mut current = self.current.lock();
        if current.checked.elapsed() >= RECHECK {
            current.checked = Instant::now();
            let stamp = Stamp::of(&self.files);
            if stamp != current.stamp {
                match server_config(&self.files) {
                    Ok(config) => {
                        current.acceptor = TlsAcceptor::from(Arc::new(config));
                        info!("TLS certificate, key or client CA changed on disk: reloaded");
                    }
                    Err(e) => warn!(
                        error = &e as &dyn std::error::Error,
                        "TLS files changed on disk but do not load; still serving the previous ones"
                    ),
                }
                // Also on a failure: a half-written rotation is looked at
                // again when it changes once more, not on every accept.
                current.stamp = stamp;
            }
        }
        current.acceptor.clone()
    }

    /// Accepts on `listener` until `stop`, handshaking each connection in
    /// its own task; the finished TLS streams come out of the returned
    /// stream (Nagle's algorithm off, see [`crate`]'s `no_delay`).
    pub fn incoming(
        self: Arc<Self>,
        listener: TcpListener,
        stop: CancellationToken,
    ) -> ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
        let (tx, rx) = mpsc::channel(64);
        let places = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let peers = Arc::new(PerPeer::default());
        tokio::spawn(async move {
            loop {
                let Ok(place) = Arc::clone(&places).acquire_owned().await else {
                    return;
                };
                let accepted = tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tx.closed() => return,
                    accepted = listener.accept() => accepted,
                };
                let (tcp, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: not fatal.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Some(peer_place) = peers.enter(peer.ip()) else {
                    debug!(%peer, "too many TLS handshakes in progress from this address: closed");
                    continue;
                };
                if let Err(e) = tcp.set_nodelay(true) {
                    warn!(error = %e, "could not turn Nagle's algorithm off on a connection");
                }
                let acceptor = self.acceptor();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _place = place;
                    let _peer_place = peer_place;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send(Ok(tls)).await;
                        }
                        Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        ReceiverStream::new(rx)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsLoadError> {
    std::fs::read(path).map_err(|source| TlsLoadError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsLoadError> {
    let pem = read(path)?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsLoadError::Missing {
            path: path.to_path_buf(),
            what,
        });
    }
    Ok(certs)
}

/// Client certificates required and verified against the client CA; the
/// chain and key from the files; HTTP/2 only (gRPC).
fn server_config(files: &TlsFiles) -> Result<ServerConfig, TlsLoadError> {
    let chain = certs(&files.cert, "certificate")?;
    let key_pem = read(&files.key)?;
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .ok()
        .flatten()
        .ok_or_else(|| TlsLoadError::Missing {
            path: files.key.clone(),
            what: "private key",
        })?;
    let mut roots = RootCertStore::empty();
    for ca in certs(&files.client_ca, "CA certificate")? {
        roots
            .add(ca)
            .map_err(|e| TlsLoadError::rustls(files.client_ca.display(), e))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| TlsLoadError::rustls("client CA", e))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsLoadError::Rustls {
            detail: e.to_string(),
            source: Box::new(e),
        })?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| {
            let files = format!("{} and {}", files.cert.display(), files.key.display());
            TlsLoadError::rustls(files, e)
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 32: a CA file rustls refuses keeps rustls's error as the
    /// source; the message names the file as before.
    #[test]
    fn a_refused_ca_keeps_rustls_error() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let files = TlsFiles {
            cert: dir.path().join("cert.pem"),
            key: dir.path().join("key.pem"),
            client_ca: dir.path().join("ca.pem"),
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        // A PEM block whose contents are no certificate.
        std::fs::write(
            &files.client_ca,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let err = match ReloadingTls::load(files.clone()) {
            Ok(_) => panic!("a CA that is no certificate loaded"),
            Err(e) => e,
        };
        let source = std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<rustls::Error>())
            .unwrap_or_else(|| panic!("no rustls source: {err:?}"));
        assert_eq!(
            err.to_string(),
            format!("{}: {source}", files.client_ca.display())
        );
    }
}
