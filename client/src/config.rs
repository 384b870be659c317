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
    /// How this client instance names itself on every Acquire
    /// (`AcquireRequest.instance`; [`default_instance`] unless set). The
    /// arbiter answers LEAK only when the key is held by the same identity
    /// AND the same instance under another session: a hold this process
    /// forgot. Replicas of one workload share a SPIFFE ID and name different
    /// instances, so they contend (wait, or HELD) like any two callers. It
    /// is a diagnostic the client asserts about itself, never an identity:
    /// it grants nothing and bounds nothing. Empty: never a LEAK.
    pub instance: String,
    /// The longest one Acquire waits at the arbiter
    /// ([`DEFAULT_WAIT_ASK`](Self::DEFAULT_WAIT_ASK), 50 s: below the
    /// edge's route timeout, 90 s in dev-up and deploy/, and deploy/'s
    /// `--max-wait-seconds`, 60 s). A longer wait asks again, on the same
    /// session, until its own deadline. Each ask joins the key's queue at
    /// its tail.
    pub wait_ask: Duration,
}

/// The instance name a client takes unless told otherwise: `LATCHKEY_INSTANCE`
/// if set, else `<pod or host name>:<process id>:<random>` (`POD_NAME` as the
/// Downward API sets it, else `HOSTNAME`, else the kernel's host name; the
/// random part drawn once per process), so each process is its own instance:
/// two containers of one pod that are both pid 1, or host-network pods that
/// share a node's name, differ too. At most 128 bytes of printable text.
pub fn default_instance() -> String {
    let explicit = std::env::var("LATCHKEY_INSTANCE").ok();
    let name = explicit.unwrap_or_else(|| {
        let host = ["POD_NAME", "HOSTNAME"]
            .iter()
            .find_map(|v| std::env::var(v).ok().filter(|h| !h.trim().is_empty()))
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
                    .filter(|h| !h.is_empty())
            })
            .unwrap_or_else(|| "host".into());
        format!(
            "{}:{}:{:08x}",
            host.trim(),
            std::process::id(),
            process_nonce()
        )
    });
    clean_instance(&name)
}

/// 32 random bits, the same for the whole process (std's hasher keys are
/// drawn from the OS's randomness).
fn process_nonce() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    static NONCE: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        (hasher.finish() & 0xffff_ffff) as u32
    })
}

/// `name` as the arbiter accepts it: printable characters only, trimmed, at
/// most 128 bytes (cut on a character boundary).
pub(crate) fn clean_instance(name: &str) -> String {
    let mut out = String::new();
    for c in name
        .trim()
        .chars()
        .filter(|c| latchkey_proto::text::printable(*c))
    {
        if out.len() + c.len_utf8() > 128 {
            break;
        }
        out.push(c);
    }
    out.trim().to_string()
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
    /// [`ClientConfig::wait_ask`] unless set: 50 s.
    pub const DEFAULT_WAIT_ASK: Duration = Duration::from_secs(50);

    /// mTLS with the given files.
    pub fn tls(endpoint: impl Into<String>, tls: TlsFiles) -> Self {
        Self {
            endpoint: endpoint.into(),
            tls: Some(tls),
            tls_domain: None,
            dev_identity: None,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
            instance: default_instance(),
            wait_ask: Self::DEFAULT_WAIT_ASK,
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
            instance: default_instance(),
            wait_ask: Self::DEFAULT_WAIT_ASK,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_instance_names_this_process() {
        let instance = default_instance();
        if std::env::var("LATCHKEY_INSTANCE").is_err() {
            assert!(
                instance.contains(&format!(":{}:", std::process::id())),
                "{instance}"
            );
            assert_eq!(instance, default_instance(), "one per process");
        }
        assert!(!instance.is_empty() && instance.len() <= 128);
    }

    #[test]
    fn instance_names_are_cleaned_to_what_the_arbiter_accepts() {
        assert_eq!(clean_instance("  pod-1:42 \n"), "pod-1:42");
        assert_eq!(clean_instance("a\u{1b}[2Jb"), "a[2Jb");
        let long = "é".repeat(100);
        let cut = clean_instance(&long);
        assert!(cut.len() <= 128 && cut.chars().all(|c| c == 'é'), "{cut}");
    }
}
