//! Arbiter configuration. Built by `main.rs` from flags and by tests directly;
//! nothing here reads the process environment.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use latchkey_hook_host::{HookHost, HostSettings};

use crate::hook::{ClassHooks, NoHooks};
use crate::lock_log::LockLog;

#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The arbiter's own SVID (PEM chain) and key.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Trust bundle that client SVIDs must chain to.
    pub client_ca: PathBuf,
}

/// How the arbiter authenticates to etcd: the arbiter is the only holder of
/// etcd write credentials (a client certificate and/or a user).
///
/// `https://` endpoints need [`EtcdCredentials::ca`]; etcd's certificate is
/// verified against each endpoint's host (a DNS name or an IP address, which
/// must then be an IP SAN), so list etcd by the names its certificate carries.
#[derive(Debug, Clone, Default)]
pub struct EtcdCredentials {
    /// Trust bundle for etcd's server certificate (PEM).
    pub ca: Option<PathBuf>,
    /// The arbiter's client certificate, for etcd's `--client-cert-auth`.
    pub client_cert: Option<EtcdClientCert>,
    /// etcd's username/password auth.
    pub user: Option<EtcdUser>,
}

#[derive(Debug, Clone)]
pub struct EtcdClientCert {
    /// PEM chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

/// An etcd user whose password is in a file, read once when the arbiter
/// starts (so the password is never on a command line or in `Debug` output).
#[derive(Debug, Clone)]
pub struct EtcdUser {
    pub name: String,
    pub password_file: PathBuf,
}

/// What is wrong with the etcd endpoints or credentials, found before connecting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EtcdConfigError {
    #[error("no etcd endpoint given (--etcd)")]
    NoEndpoints,
    #[error(
        "etcd endpoint {endpoint:?} has no scheme; write http://{endpoint} or https://{endpoint}"
    )]
    NoScheme { endpoint: String },
    #[error(
        "etcd endpoints mix http:// ({http:?}) and https:// ({https:?}); use https:// for every member"
    )]
    MixedSchemes { http: String, https: String },
    #[error(
        "https:// etcd endpoints need --etcd-ca (the trust bundle for etcd's server certificate)"
    )]
    HttpsWithoutCa,
    #[error("--etcd-ca and --etcd-cert/--etcd-key need https:// etcd endpoints (got {endpoint:?})")]
    TlsOverHttp { endpoint: String },
    #[error("--etcd-user sends a password: it needs https:// etcd endpoints (got {endpoint:?})")]
    PasswordOverHttp { endpoint: String },
    #[error("the etcd user name is empty")]
    EmptyUser,
}

impl EtcdCredentials {
    /// Checks `endpoints` against these credentials: one scheme for all,
    /// TLS material exactly when that scheme is `https`, and never a password
    /// over plain http.
    pub fn check(&self, endpoints: &[String]) -> Result<(), EtcdConfigError> {
        let first = endpoints.first().ok_or(EtcdConfigError::NoEndpoints)?;
        let (mut http, mut https) = (None, None);
        for e in endpoints {
            if e.starts_with("https://") {
                https.get_or_insert(e);
            } else if e.starts_with("http://") {
                http.get_or_insert(e);
            } else {
                return Err(EtcdConfigError::NoScheme {
                    endpoint: e.clone(),
                });
            }
        }
        if let (Some(http), Some(https)) = (http, https) {
            return Err(EtcdConfigError::MixedSchemes {
                http: http.clone(),
                https: https.clone(),
            });
        }
        if https.is_some() {
            if self.ca.is_none() {
                return Err(EtcdConfigError::HttpsWithoutCa);
            }
        } else if self.ca.is_some() || self.client_cert.is_some() {
            return Err(EtcdConfigError::TlsOverHttp {
                endpoint: first.clone(),
            });
        } else if self.user.is_some() {
            return Err(EtcdConfigError::PasswordOverHttp {
                endpoint: first.clone(),
            });
        }
        if self.user.as_ref().is_some_and(|u| u.name.is_empty()) {
            return Err(EtcdConfigError::EmptyUser);
        }
        Ok(())
    }

    /// How the arbiter reaches etcd, for logs and errors (never a password).
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        match (&self.ca, &self.client_cert) {
            (None, _) => parts.push("plain http, no credentials".to_string()),
            (Some(ca), None) => parts.push(format!(
                "TLS trusting {}, no client certificate",
                ca.display()
            )),
            (Some(ca), Some(c)) => parts.push(format!(
                "TLS trusting {}, client certificate {}",
                ca.display(),
                c.cert.display()
            )),
        }
        if let Some(user) = &self.user {
            parts.push(format!("user {:?}", user.name));
        }
        parts.join(", ")
    }
}

/// What is wrong with the coord cluster's flags, found before connecting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoordConfigError {
    #[error("coord etcd (--coord-etcd): {0}")]
    Endpoints(EtcdConfigError),
    #[error(
        "the coord cluster must not be the lock cluster: {endpoint} is in both --etcd and --coord-etcd (a restore of the lock cluster would roll back its own witness)"
    )]
    SameEndpoint { endpoint: String },
    #[error(
        "--lock-cluster-name must be 1 to 128 characters of A-Z a-z 0-9 . _ - (got {0:?}): it names this lock cluster's records on the coord cluster"
    )]
    BadClusterName(String),
    #[error("--coord-prefix must start with '/' and name more than the root (got {0:?})")]
    BadPrefix(String),
    #[error(
        "--split-tiers puts the coord tier's locks on the coord cluster: pass --coord-etcd too"
    )]
    SplitWithoutCoord,
    #[error(
        "--lock-cluster-name coord-tier is reserved with --split-tiers: the entity cluster witnesses the coord tier under that name; choose another name"
    )]
    ReservedClusterName,
    #[error(
        "the coord tier's witness must not be the coord cluster: {endpoint} is in both --coord-tier-witness-etcd and --coord-etcd (a restore of the coord cluster would roll back its own witness)"
    )]
    WitnessIsCoord { endpoint: String },
    #[error(
        "--coord-tier-witness-etcd witnesses the coord tier's own cluster: it needs --split-tiers"
    )]
    WitnessWithoutSplit,
}

impl Config {
    /// Checks the coord cluster's settings (nothing to check without one).
    /// Its endpoints are reached with the lock cluster's credentials, so they
    /// are held to the same rules.
    pub fn check_coord(&self) -> Result<(), CoordConfigError> {
        if self.coord_endpoints.is_empty() {
            return match self.split_tiers {
                true => Err(CoordConfigError::SplitWithoutCoord),
                false => Ok(()),
            };
        }
        self.etcd_credentials
            .check(&self.coord_endpoints)
            .map_err(CoordConfigError::Endpoints)?;
        if let Some(endpoint) = shared_endpoint(&self.coord_endpoints, &self.etcd_endpoints) {
            return Err(CoordConfigError::SameEndpoint {
                endpoint: endpoint.clone(),
            });
        }
        let name = &self.lock_cluster_name;
        if name.is_empty()
            || name.len() > 128
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(CoordConfigError::BadClusterName(name.clone()));
        }
        if self.split_tiers && name == crate::COORD_TIER_WITNESS_NAME {
            return Err(CoordConfigError::ReservedClusterName);
        }
        if !self.coord_tier_witness_endpoints.is_empty() {
            if !self.split_tiers {
                return Err(CoordConfigError::WitnessWithoutSplit);
            }
            self.etcd_credentials
                .check(&self.coord_tier_witness_endpoints)
                .map_err(CoordConfigError::Endpoints)?;
            if let Some(endpoint) =
                shared_endpoint(&self.coord_tier_witness_endpoints, &self.coord_endpoints)
            {
                return Err(CoordConfigError::WitnessIsCoord {
                    endpoint: endpoint.clone(),
                });
            }
        }
        if !self.coord_prefix.starts_with('/') || self.coord_prefix.trim_end_matches('/').is_empty()
        {
            return Err(CoordConfigError::BadPrefix(self.coord_prefix.clone()));
        }
        Ok(())
    }
}

/// The first of `a` that is also in `b` (URLs compared without a trailing
/// `/` and case).
fn shared_endpoint<'a>(a: &'a [String], b: &[String]) -> Option<&'a String> {
    let normal = |e: &str| e.trim_end_matches('/').to_ascii_lowercase();
    a.iter().find(|x| b.iter().any(|y| normal(x) == normal(y)))
}

/// Wraps a lock log in another (see [`LogLayer`]).
pub type WrapLog = dyn Fn(Arc<dyn LockLog>) -> Arc<dyn LockLog> + Send + Sync;

/// A wrapper around the lock log, with a name for the start-up log.
#[derive(Clone)]
pub struct LogLayer {
    pub name: String,
    pub wrap: Arc<WrapLog>,
}

impl std::fmt::Debug for LogLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogLayer")
            .field("name", &self.name)
            .finish()
    }
}

/// `--coord-prefix`'s default.
pub const DEFAULT_COORD_PREFIX: &str = "/latchkey-coord";
/// `--lock-cluster-name`'s default.
pub const DEFAULT_LOCK_CLUSTER_NAME: &str = "default";

#[derive(Clone)]
pub struct Config {
    pub etcd_endpoints: Vec<String>,
    /// TLS material and user for etcd (none: plain http).
    pub etcd_credentials: EtcdCredentials,
    /// Key prefix in etcd; several deployments may share one cluster.
    pub prefix: String,
    /// The coord etcd cluster that witnesses this lock cluster (issue 15);
    /// empty: one cluster for everything, and the arbiter's state directory
    /// is the only witness. Reached with [`Config::etcd_credentials`].
    pub coord_endpoints: Vec<String>,
    /// Key prefix on the coord cluster.
    pub coord_prefix: String,
    /// This lock cluster's name on the coord cluster: every arbiter of one
    /// lock cluster must use the same name, and no two lock clusters may.
    pub lock_cluster_name: String,
    /// ADR-07's two tiers: coord-tier keys on the coord cluster, entity-tier
    /// keys on `etcd_endpoints` (needs `coord_endpoints`). Off: both tiers'
    /// keys on `etcd_endpoints`, the one-cluster configuration.
    pub split_tiers: bool,
    /// With `split_tiers`: the etcd cluster that witnesses the coord tier's
    /// grants; empty: the entity cluster (`etcd_endpoints`), which then
    /// must answer for the coord tier to grant.
    pub coord_tier_witness_endpoints: Vec<String>,
    pub policies_dir: PathBuf,
    pub policy_poll: Duration,
    /// `None` only in insecure dev mode.
    pub tls: Option<TlsFiles>,
    pub trust_domain: String,
    /// The edge proxy's SPIFFE ID: only this peer may name the caller in a header.
    pub edge_identity: Option<String>,
    /// With an edge configured: may workloads call the arbiter directly? In
    /// production no (the arbiter serves only the edge and operators, so the
    /// edge's admission bounds cannot be walked around); dev and tests may.
    /// Without an edge, direct calls are the only way in and always allowed.
    pub allow_direct_workloads: bool,
    /// With one cluster, no state and an existing lock log: serve anyway
    /// (`--trust-unwitnessed-log`); otherwise such an arbiter starts sealed.
    pub trust_unwitnessed_log: bool,
    /// Where the revision high-water mark lives (outside etcd).
    pub state_dir: PathBuf,
    /// Longest an Acquire may wait, whatever its deadline.
    pub max_wait: Duration,
    /// Sessions one identity may have open (over every arbiter, counted in etcd).
    pub max_sessions_per_identity: u32,
    /// Acquire calls one identity may have waiting in this arbiter, over all keys.
    pub max_waiters_per_identity: u32,
    /// Keys one identity may hold, over every arbiter (counted from the log).
    pub max_holds_per_identity: u32,
    /// Open health `Watch` and reflection streams, per identity and in all.
    pub probe_streams: crate::grpc_health::ProbeStreamLimits,
    /// Poll period for waiters whose watch is lost (jittered ±50%).
    pub retry_poll: Duration,
    pub etcd_connect_timeout: Duration,
    pub etcd_request_timeout: Duration,
    pub hooks: Arc<dyn ClassHooks>,
    /// Runs the classes' Wasm hooks; its compiled-module cache defaults to
    /// `state_dir/hook-cache`. Shared so tests can read its metrics.
    pub hook_host: Arc<HookHost>,
    /// Wraps the lock log before the arbiter uses it. Only a program that
    /// embeds the arbiter can set one (there is no flag): the release gate's
    /// arbiter-under-test puts its deliberate bugs here, outside this crate.
    pub log_layer: Option<LogLayer>,
    /// Where to serve Prometheus metrics over plain HTTP (`GET /metrics`); none: not served.
    pub metrics_listen: Option<String>,
    /// Two-person force-release (ADR-20): off unless an OIDC provider is set.
    pub force_release: crate::force_release::ForceReleaseConfig,
    /// The operator console (`--console-listen`); none: not served.
    pub console: Option<crate::console::ConsoleConfig>,
    /// ADR-04: how quorum loss is decided, and the open classes' spool bound.
    pub quorum_loss: crate::quorum_loss::QuorumLossConfig,
    /// New work's admission under overload (renewals first).
    pub overload: crate::overload::OverloadConfig,
}

impl Config {
    pub fn new(etcd_endpoints: Vec<String>, policies_dir: PathBuf, state_dir: PathBuf) -> Self {
        Self {
            etcd_endpoints,
            etcd_credentials: EtcdCredentials::default(),
            prefix: "/latchkey".into(),
            coord_endpoints: Vec::new(),
            coord_prefix: DEFAULT_COORD_PREFIX.into(),
            lock_cluster_name: DEFAULT_LOCK_CLUSTER_NAME.into(),
            split_tiers: false,
            coord_tier_witness_endpoints: Vec::new(),
            policies_dir,
            policy_poll: Duration::from_secs(2),
            tls: None,
            trust_domain: "dev.latchkey".into(),
            edge_identity: None,
            allow_direct_workloads: false,
            trust_unwitnessed_log: false,
            state_dir: state_dir.clone(),
            max_wait: Duration::from_secs(300),
            max_sessions_per_identity: crate::bounds::DEFAULT_MAX_SESSIONS_PER_IDENTITY,
            max_waiters_per_identity: crate::table::DEFAULT_MAX_WAITERS_PER_IDENTITY,
            max_holds_per_identity: crate::hold_counts::DEFAULT_MAX_HOLDS_PER_IDENTITY,
            probe_streams: crate::grpc_health::ProbeStreamLimits::default(),
            retry_poll: Duration::from_secs(1),
            etcd_connect_timeout: Duration::from_secs(5),
            etcd_request_timeout: Duration::from_secs(10),
            hooks: Arc::new(NoHooks),
            hook_host: Arc::new(HookHost::new(HostSettings {
                cache_dir: Some(state_dir.join("hook-cache")),
                ..HostSettings::default()
            })),
            log_layer: None,
            metrics_listen: None,
            force_release: crate::force_release::ForceReleaseConfig::default(),
            console: None,
            quorum_loss: crate::quorum_loss::QuorumLossConfig::default(),
            overload: crate::overload::OverloadConfig::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn tls() -> EtcdCredentials {
        EtcdCredentials {
            ca: Some("ca.pem".into()),
            client_cert: Some(EtcdClientCert {
                cert: "c.pem".into(),
                key: "c.key".into(),
            }),
            user: None,
        }
    }

    #[test]
    fn plain_http_without_credentials_is_fine() {
        let none = EtcdCredentials::default();
        assert_eq!(
            none.check(&eps(&["http://a:2379", "http://b:2379"])),
            Ok(())
        );
    }

    #[test]
    fn https_with_ca_is_fine() {
        assert_eq!(
            tls().check(&eps(&["https://a:2379", "https://b:2379"])),
            Ok(())
        );
    }

    #[test]
    fn mixing_http_and_https_is_refused() {
        let err = tls()
            .check(&eps(&["https://a:2379", "http://b:2379"]))
            .unwrap_err();
        assert!(matches!(err, EtcdConfigError::MixedSchemes { .. }), "{err}");
        assert!(err.to_string().contains("http://b:2379"), "{err}");
    }

    #[test]
    fn https_without_ca_is_refused() {
        let err = EtcdCredentials::default()
            .check(&eps(&["https://a:2379"]))
            .unwrap_err();
        assert_eq!(err, EtcdConfigError::HttpsWithoutCa);
        assert!(err.to_string().contains("--etcd-ca"), "{err}");
    }

    #[test]
    fn tls_material_over_http_is_refused() {
        let err = tls().check(&eps(&["http://a:2379"])).unwrap_err();
        assert!(matches!(err, EtcdConfigError::TlsOverHttp { .. }), "{err}");
    }

    #[test]
    fn a_password_over_http_is_refused() {
        let creds = EtcdCredentials {
            user: Some(EtcdUser {
                name: "arbiter".into(),
                password_file: "pw".into(),
            }),
            ..EtcdCredentials::default()
        };
        let err = creds.check(&eps(&["http://a:2379"])).unwrap_err();
        assert!(
            matches!(err, EtcdConfigError::PasswordOverHttp { .. }),
            "{err}"
        );
    }

    fn with_coord(coord: &[&str]) -> Config {
        let mut config = Config::new(eps(&["http://lock:2379"]), "p".into(), "s".into());
        config.coord_endpoints = eps(coord);
        config
    }

    #[test]
    fn the_coord_cluster_is_checked_only_when_there_is_one() {
        assert_eq!(with_coord(&[]).check_coord(), Ok(()));
        assert_eq!(with_coord(&["http://coord:2379"]).check_coord(), Ok(()));
        let mut no_coord = with_coord(&[]);
        no_coord.lock_cluster_name = String::new();
        assert_eq!(no_coord.check_coord(), Ok(()));
    }

    #[test]
    fn bad_coord_settings_are_refused() {
        let err = with_coord(&["http://coord:2379", "http://LOCK:2379/"])
            .check_coord()
            .unwrap_err();
        assert!(
            matches!(err, CoordConfigError::SameEndpoint { .. }),
            "{err}"
        );
        let err = with_coord(&["coord:2379"]).check_coord().unwrap_err();
        assert!(err.to_string().contains("--coord-etcd"), "{err}");
        for name in ["", "a/b", "has space", "x".repeat(129).as_str()] {
            let mut config = with_coord(&["http://coord:2379"]);
            config.lock_cluster_name = name.to_string();
            let err = config.check_coord().unwrap_err();
            assert!(matches!(err, CoordConfigError::BadClusterName(_)), "{err}");
        }
        for prefix in ["", "/", "coord"] {
            let mut config = with_coord(&["http://coord:2379"]);
            config.coord_prefix = prefix.to_string();
            let err = config.check_coord().unwrap_err();
            assert!(matches!(err, CoordConfigError::BadPrefix(_)), "{err}");
        }
    }

    #[test]
    fn the_coord_tiers_witness_is_its_own_cluster_and_needs_split_tiers() {
        let mut config = with_coord(&["http://coord:2379"]);
        config.coord_tier_witness_endpoints = eps(&["http://witness:2379"]);
        assert_eq!(
            config.check_coord(),
            Err(CoordConfigError::WitnessWithoutSplit)
        );
        config.split_tiers = true;
        assert_eq!(config.check_coord(), Ok(()));
        config.coord_tier_witness_endpoints = eps(&["http://COORD:2379/"]);
        let err = config.check_coord().unwrap_err();
        assert!(
            matches!(err, CoordConfigError::WitnessIsCoord { .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("--coord-tier-witness-etcd"),
            "{err}"
        );
    }

    #[test]
    fn endpoints_need_a_scheme() {
        let err = EtcdCredentials::default()
            .check(&eps(&["127.0.0.1:2379"]))
            .unwrap_err();
        assert!(matches!(err, EtcdConfigError::NoScheme { .. }), "{err}");
        assert_eq!(
            EtcdCredentials::default().check(&[]),
            Err(EtcdConfigError::NoEndpoints)
        );
    }
}
