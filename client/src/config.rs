//! How to reach the arbiter, and under which identity.

use std::path::PathBuf;
use std::time::Duration;

/// Where the arbiter (its Envoy) is and how this process proves who it is.
///
/// Build one with [`ClientConfig::tls`] (or [`ClientConfig::insecure_dev`]
/// against a dev arbiter), then adjust the public fields:
///
/// ```
/// use std::time::Duration;
///
/// use latchkey_client::{ClientConfig, TlsFiles};
///
/// let mut config = ClientConfig::tls(
///     "https://latchkey.example:7443",
///     TlsFiles {
///         ca: "/run/spiffe/bundle.pem".into(),
///         cert: "/run/spiffe/svid.pem".into(),
///         key: "/run/spiffe/svid.key".into(),
///     },
/// );
/// config.tls_domain = Some("latchkey.example".into());
/// config.request_timeout = Duration::from_secs(3);
/// assert_eq!(config.connect_timeout, ClientConfig::DEFAULT_CONNECT_TIMEOUT);
/// ```
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `https://host:port` with `tls`, `http://host:port` in dev mode.
    pub endpoint: String,
    /// The SVID and trust bundle. `None` selects the insecure dev mode.
    pub tls: Option<TlsFiles>,
    /// The name the server certificate is checked against.
    /// `None` means "localhost", which is what the dev certificates carry.
    pub tls_domain: Option<String>,
    /// Dev mode only: sent as `x-latchkey-dev-identity`. The arbiter honours
    /// it only when started with `--insecure-dev`.
    pub dev_identity: Option<String>,
    /// How long [`Client::connect`](crate::Client::connect) may take.
    pub connect_timeout: Duration,
    /// Deadline of unary calls other than a waiting acquire, whose deadline is
    /// its wait.
    pub request_timeout: Duration,
}

/// PEM files: the trust bundle and this workload's X.509 SVID. The SVID is
/// what gives the caller its SPIFFE identity at the arbiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The trust bundle the server certificate is checked against.
    pub ca: PathBuf,
    /// This workload's X.509 SVID (the PEM chain).
    pub cert: PathBuf,
    /// The SVID's private key.
    pub key: PathBuf,
}

impl ClientConfig {
    /// [`ClientConfig::connect_timeout`] unless set: 5 s.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    /// [`ClientConfig::request_timeout`] unless set: 10 s.
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

    /// mTLS with the given files.
    pub fn tls(endpoint: impl Into<String>, tls: TlsFiles) -> Self {
        Self {
            endpoint: endpoint.into(),
            tls: Some(tls),
            tls_domain: None,
            dev_identity: None,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// Plain HTTP/2, identity asserted by header. Only for an arbiter started
    /// with `--insecure-dev`.
    ///
    /// ```
    /// use latchkey_client::ClientConfig;
    ///
    /// let config =
    ///     ClientConfig::insecure_dev("http://127.0.0.1:7000", "spiffe://dev.latchkey/workload/alice");
    /// assert!(config.tls.is_none());
    /// ```
    pub fn insecure_dev(endpoint: impl Into<String>, dev_identity: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            tls: None,
            tls_domain: None,
            dev_identity: Some(dev_identity.into()),
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
        }
    }
}
