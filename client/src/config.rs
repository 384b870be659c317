//! How to reach the arbiter, and under which identity.

use std::path::PathBuf;
use std::time::Duration;

/// Where the arbiter (its Envoy) is and how this process proves who it is.
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
    pub connect_timeout: Duration,
    /// Deadline of unary calls other than a waiting acquire, whose deadline is
    /// its wait.
    pub request_timeout: Duration,
}

/// PEM files: the trust bundle and this workload's X.509 SVID. The SVID is
/// what gives the caller its SPIFFE identity at the arbiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl ClientConfig {
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
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
