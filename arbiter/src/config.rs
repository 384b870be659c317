//! Arbiter configuration. Built by `main.rs` from flags and by tests directly;
//! nothing here reads the process environment.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use latchkey_hook_host::{HookHost, HostSettings};

use crate::hook::{ClassHooks, NoHooks};
use crate::test_fault::TestFault;

#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The arbiter's own SVID (PEM chain) and key.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Trust bundle that client SVIDs must chain to.
    pub client_ca: PathBuf,
}

#[derive(Clone)]
pub struct Config {
    pub etcd_endpoints: Vec<String>,
    /// Key prefix in etcd; several deployments may share one cluster.
    pub prefix: String,
    pub policies_dir: PathBuf,
    pub policy_poll: Duration,
    /// `None` only in insecure dev mode.
    pub tls: Option<TlsFiles>,
    pub trust_domain: String,
    /// The edge proxy's SPIFFE ID: only this peer may name the caller in a header.
    pub edge_identity: Option<String>,
    /// Where the revision high-water mark lives (outside etcd).
    pub state_dir: PathBuf,
    /// Longest an Acquire may wait, whatever its deadline.
    pub max_wait: Duration,
    /// Poll period for waiters whose watch is lost (jittered ±50%).
    pub retry_poll: Duration,
    pub etcd_connect_timeout: Duration,
    pub etcd_request_timeout: Duration,
    pub hooks: Arc<dyn ClassHooks>,
    /// Runs the classes' Wasm hooks; its compiled-module cache defaults to
    /// `state_dir/hook-cache`. Shared so tests can read its metrics.
    pub hook_host: Arc<HookHost>,
    /// A deliberate bug for the release gate's self-test; always
    /// [`TestFault::None`] unless built with the `test-faults` feature.
    pub test_fault: TestFault,
}

impl Config {
    pub fn new(etcd_endpoints: Vec<String>, policies_dir: PathBuf, state_dir: PathBuf) -> Self {
        Self {
            etcd_endpoints,
            prefix: "/latchkey".into(),
            policies_dir,
            policy_poll: Duration::from_secs(2),
            tls: None,
            trust_domain: "dev.latchkey".into(),
            edge_identity: None,
            state_dir: state_dir.clone(),
            max_wait: Duration::from_secs(300),
            retry_poll: Duration::from_secs(1),
            etcd_connect_timeout: Duration::from_secs(5),
            etcd_request_timeout: Duration::from_secs(10),
            hooks: Arc::new(NoHooks),
            hook_host: Arc::new(HookHost::new(HostSettings {
                cache_dir: Some(state_dir.join("hook-cache")),
                ..HostSettings::default()
            })),
            test_fault: TestFault::None,
        }
    }
}
