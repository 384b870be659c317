//! The arbiter under test: in-process ([`Arbiter`], through the library's
//! `run` on a port-0 listener) or as a real process ([`ArbiterProcess`], for
//! log inspection and SIGKILL), plus mTLS clients carrying dev SVIDs.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, bail};
use latchctl::dev_certs::{self, DevTrustDomain};
use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::electionv1::election_service_client::ElectionServiceClient;
use latchkey_proto::lockv1::InspectRequest;
use latchkey_proto::lockv1::lock_client::LockClient;
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::etcd::EtcdServer;
use crate::eventually;
use crate::faulty_log::{self, TestFault};

pub const TRUST_DOMAIN: &str = "dev.latchkey";
pub use latchctl::dev_certs::DEV_NAMES as NAMES;

/// The dev trust domain for this test process (generated once).
pub fn certs() -> anyhow::Result<&'static DevTrustDomain> {
    static CERTS: OnceLock<Result<(TempDir, DevTrustDomain), String>> = OnceLock::new();
    let made = CERTS.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-certs-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let td = dev_certs::generate(dir.path(), TRUST_DOMAIN, NAMES).map_err(|e| e.to_string())?;
        Ok((dir, td))
    });
    match made {
        Ok((_, td)) => Ok(td),
        Err(e) => bail!("dev certificates: {e}"),
    }
}

/// `--ca <bundle> --cert <svid> --key <key>` for `name`: the connection
/// flags latchctl and the gate's workers take.
pub fn svid_flags(name: &str) -> anyhow::Result<Vec<std::ffi::OsString>> {
    let certs = certs()?;
    let svid = certs.svid(name);
    Ok(vec![
        "--ca".into(),
        certs.ca().into(),
        "--cert".into(),
        svid.cert.into(),
        "--key".into(),
        svid.key.into(),
    ])
}

/// `spiffe://dev.latchkey/<name>`.
pub fn spiffe(name: &str) -> String {
    dev_certs::spiffe_id(TRUST_DOMAIN, name)
}

#[derive(Debug, Clone)]
pub struct ArbiterOptions {
    pub policies_dir: PathBuf,
    /// Each test gets its own etcd, so the default prefix is fine.
    pub prefix: String,
    pub edge_identity: Option<String>,
    /// With an edge: serve workloads that call directly too
    /// (`--allow-direct-workloads`). On by default: most scenarios call the
    /// arbiter directly; the trust-boundary tests turn it off.
    pub allow_direct_workloads: bool,
    pub retry_poll: Duration,
    pub max_wait: Duration,
    /// Reuse a state dir (high-water mark) across restarts; a temp dir otherwise.
    pub state_dir: Option<PathBuf>,
    /// The arbiter's etcd TLS and user (`--etcd-ca`, `--etcd-cert`, ...);
    /// none by default, for a plain-http etcd.
    pub etcd_credentials: latchkey_arbiter::EtcdCredentials,
    /// Serve Prometheus metrics (`--metrics-listen`) on a free loopback port.
    pub metrics: bool,
    /// A deliberate bug or timing widener ([`crate::faulty_log`]); none by
    /// default. In process it is a layer around the lock log; a process gets
    /// `--test-fault`, which only the tests' `arbiter-under-test` takes (the
    /// shipped `latchkey-arbiter` has no faults and refuses the flag).
    pub test_fault: TestFault,
    /// A coord cluster that witnesses the lock cluster (`--coord-etcd`);
    /// none by default: one cluster, the state dir the only witness.
    pub coord: Option<Coord>,
    /// `--trust-unwitnessed-log`: on by default, since most scenarios start
    /// arbiters with fresh state dirs on an etcd another arbiter already
    /// used; the tests of that safe default turn it off.
    pub trust_unwitnessed_log: bool,
    /// `--max-holds-per-identity` (the arbiter's default when `None`).
    pub max_holds_per_identity: Option<u32>,
    /// `--max-sessions-per-identity` (the arbiter's default when `None`).
    pub max_sessions_per_identity: Option<u32>,
    /// Force-release (`--oidc-*`, `--force-etcd-*`); off by default. In
    /// process only.
    pub force_release: latchkey_arbiter::force_release::ForceReleaseConfig,
    /// The operator console (`--console-*`); none by default. In process only.
    pub console: Option<latchkey_arbiter::console::ConsoleConfig>,
    /// The arbiter's own certificate, key and client CA files; the dev
    /// trust domain's `latchkey/arbiter` SVID when `None`. In process only.
    pub tls: Option<latchkey_arbiter::TlsFiles>,
    /// New work's admission under overload; the arbiter's default when
    /// `None`. A process gets `--no-overload-protection` (when off),
    /// `--renewal-latency-target-ms` and `--{max,min}-new-work-in-flight`.
    pub overload: Option<latchkey_arbiter::overload::OverloadConfig>,
}

/// A coord etcd cluster for the arbiter (issue 15), reached with the same
/// credentials as its lock cluster.
#[derive(Debug, Clone)]
pub struct Coord {
    pub endpoints: Vec<String>,
    /// `--coord-prefix` (the arbiter's default when `None`).
    pub prefix: Option<String>,
    /// `--lock-cluster-name` (the arbiter's default when `None`).
    pub lock_cluster_name: Option<String>,
    /// `--split-tiers`: coord-tier keys on this cluster (ADR-07).
    pub split_tiers: bool,
    /// `--coord-tier-witness-etcd` (with `split_tiers`); empty: the lock cluster.
    pub coord_tier_witness: Vec<String>,
}

impl Coord {
    /// `etcd` as the coord cluster, with the arbiter's default prefix and name.
    pub fn on(etcd: &EtcdServer) -> Self {
        Self {
            endpoints: vec![etcd.endpoint()],
            prefix: None,
            lock_cluster_name: None,
            split_tiers: false,
            coord_tier_witness: Vec::new(),
        }
    }

    /// `etcd` as the coord cluster serving the coord tier's keys too
    /// (`--split-tiers`).
    pub fn split(etcd: &EtcdServer) -> Self {
        Self {
            split_tiers: true,
            ..Self::on(etcd)
        }
    }
}

impl Default for ArbiterOptions {
    // A harness default: without policies/dev the checkout is broken.
    #[allow(clippy::panic)]
    fn default() -> Self {
        Self {
            // policies/dev, with fixture pause-test results (ADR-17).
            policies_dir: crate::dev_policies()
                .map(Path::to_path_buf)
                .unwrap_or_else(|e| panic!("{e:#}")),
            prefix: "/latchkey".into(),
            edge_identity: None,
            allow_direct_workloads: true,
            retry_poll: Duration::from_millis(500),
            max_wait: Duration::from_secs(60),
            state_dir: None,
            etcd_credentials: latchkey_arbiter::EtcdCredentials::default(),
            metrics: false,
            test_fault: TestFault::None,
            coord: None,
            trust_unwitnessed_log: true,
            max_holds_per_identity: None,
            max_sessions_per_identity: None,
            force_release: Default::default(),
            console: None,
            tls: None,
            overload: None,
        }
    }
}

/// An arbiter running inside the test process.
pub struct Arbiter {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    state_dir: PathBuf,
    _state: Option<TempDir>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), latchkey_arbiter::RunError>>>,
}

impl Arbiter {
    pub async fn start(etcd: &EtcdServer, opts: ArbiterOptions) -> anyhow::Result<Self> {
        Self::start_on(vec![etcd.endpoint()], opts).await
    }

    /// [`Arbiter::start`] on any etcd endpoints (a cluster's members).
    pub async fn start_on(endpoints: Vec<String>, opts: ArbiterOptions) -> anyhow::Result<Self> {
        let certs = certs()?;
        let (state_tmp, state_dir) = match &opts.state_dir {
            Some(d) => (None, d.clone()),
            None => {
                let t = TempDir::new()?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        let svid = certs.svid("latchkey/arbiter");
        let mut config =
            latchkey_arbiter::Config::new(endpoints, opts.policies_dir.clone(), state_dir.clone());
        config.prefix = opts.prefix.clone();
        config.etcd_credentials = opts.etcd_credentials.clone();
        config.tls = Some(opts.tls.clone().unwrap_or(latchkey_arbiter::TlsFiles {
            cert: svid.cert,
            key: svid.key,
            client_ca: certs.ca(),
        }));
        config.trust_domain = TRUST_DOMAIN.into();
        config.edge_identity = opts.edge_identity.clone();
        config.allow_direct_workloads = opts.allow_direct_workloads;
        config.retry_poll = opts.retry_poll;
        config.max_wait = opts.max_wait;
        config.policy_poll = Duration::from_millis(200);
        config.log_layer = faulty_log::layer(opts.test_fault);
        config.trust_unwitnessed_log = opts.trust_unwitnessed_log;
        if let Some(max) = opts.max_holds_per_identity {
            config.max_holds_per_identity = max;
        }
        if let Some(max) = opts.max_sessions_per_identity {
            config.max_sessions_per_identity = max;
        }
        config.force_release = opts.force_release.clone();
        config.console = opts.console.clone();
        if let Some(overload) = &opts.overload {
            config.overload = overload.clone();
        }
        if let Some(coord) = &opts.coord {
            config.coord_endpoints = coord.endpoints.clone();
            if let Some(prefix) = &coord.prefix {
                config.coord_prefix = prefix.clone();
            }
            if let Some(name) = &coord.lock_cluster_name {
                config.lock_cluster_name = name.clone();
            }
            config.split_tiers = coord.split_tiers;
            config.coord_tier_witness_endpoints = coord.coord_tier_witness.clone();
        }
        // A port that was free a moment ago: `run` binds the address itself.
        let metrics_addr = match opts.metrics {
            true => Some(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?),
            false => None,
        };
        config.metrics_listen = metrics_addr.map(|a| a.to_string());
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(latchkey_arbiter::run(listener, config, async {
            let _ = rx.await;
        }));
        let mut arbiter = Self {
            addr,
            metrics_addr,
            state_dir,
            _state: state_tmp,
            shutdown: Some(tx),
            task: Some(task),
        };
        arbiter.wait_ready().await?;
        Ok(arbiter)
    }

    /// Polls until the arbiter answers; fails at once (with `run`'s error)
    /// if it exits, e.g. because it cannot reach etcd.
    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let addr = self.addr;
        let task = &self.task;
        let ready = eventually("the arbiter to answer", Duration::from_secs(20), || {
            let exited = task.as_ref().is_some_and(JoinHandle::is_finished);
            async move {
                if exited {
                    return Ok(false);
                }
                answers(addr).await.map(|()| true)
            }
        })
        .await;
        match ready {
            Ok(true) => Ok(()),
            Ok(false) | Err(_) if self.task.as_ref().is_some_and(JoinHandle::is_finished) => {
                let Some(task) = self.task.take() else {
                    bail!("the arbiter exited");
                };
                match task.await {
                    Ok(Err(e)) => Err(anyhow::Error::from(e).context("the arbiter exited")),
                    other => bail!("the arbiter exited: {other:?}"),
                }
            }
            Ok(false) => bail!("the arbiter exited"),
            Err(e) => Err(e),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where `GET /metrics` is served (with [`ArbiterOptions::metrics`]).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    pub async fn lock(&self, name: &str) -> anyhow::Result<LockClient<Channel>> {
        Ok(LockClient::new(channel(self.addr, name).await?))
    }

    pub async fn admin(&self, name: &str) -> anyhow::Result<AdminClient<Channel>> {
        Ok(AdminClient::new(channel(self.addr, name).await?))
    }

    pub async fn election(&self, name: &str) -> anyhow::Result<ElectionServiceClient<Channel>> {
        Ok(ElectionServiceClient::new(channel(self.addr, name).await?))
    }

    /// Graceful stop; returns what `run` returned.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .context("arbiter did not stop")???;
        }
        Ok(())
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Whether the arbiter at `addr` answers lock.v1 (even a refusal means it is up).
async fn answers(addr: SocketAddr) -> anyhow::Result<()> {
    let mut c = LockClient::new(channel(addr, "workload/demo").await?);
    match c
        .inspect(InspectRequest {
            key: "demo/ready".into(),
        })
        .await
    {
        Ok(_) => Ok(()),
        Err(s) if s.code() != tonic::Code::Unavailable && s.code() != tonic::Code::Unknown => {
            Ok(())
        }
        Err(s) => bail!("{s}"),
    }
}

/// An mTLS channel to `addr` carrying `name`'s dev SVID.
pub async fn channel(addr: SocketAddr, name: &str) -> anyhow::Result<Channel> {
    channel_from(addr, name, None).await
}

/// [`channel`], its connection made from the local address `from` (any
/// loopback address works on Linux: a second client address for tests).
pub async fn channel_from(
    addr: SocketAddr,
    name: &str,
    from: Option<std::net::IpAddr>,
) -> anyhow::Result<Channel> {
    let certs = certs()?;
    let svid = certs.svid(name);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(certs.ca())?))
        .identity(Identity::from_pem(
            std::fs::read(&svid.cert)?,
            std::fs::read(&svid.key)?,
        ))
        .domain_name("localhost");
    let channel = Channel::from_shared(format!("https://{addr}"))?
        .local_address(from)
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(channel)
}

/// A TLS channel without a client certificate (must be refused).
pub async fn anonymous_channel(addr: SocketAddr) -> anyhow::Result<Channel> {
    let certs = certs()?;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(certs.ca())?))
        .domain_name("localhost");
    Ok(Channel::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?)
}

/// The arbiter as a real process (usually the binary built from this crate's
/// `arbiter-under-test` target: `latchkey-arbiter` plus `--test-fault`).
pub struct ArbiterProcess {
    child: Option<Child>,
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    log: PathBuf,
    _dir: TempDir,
}

impl ArbiterProcess {
    pub async fn start(
        binary: &Path,
        etcd: &EtcdServer,
        opts: ArbiterOptions,
        rust_log: &str,
    ) -> anyhow::Result<Self> {
        Self::start_with(binary, &[etcd.endpoint()], None, opts, rust_log, &[]).await
    }

    /// [`ArbiterProcess::start`] against any etcd endpoints, on `listen` (a
    /// free port when `None`; pass the old address to restart in place) and
    /// with extra flags.
    pub async fn start_with(
        binary: &Path,
        etcd_endpoints: &[String],
        listen: Option<SocketAddr>,
        opts: ArbiterOptions,
        rust_log: &str,
        extra_args: &[String],
    ) -> anyhow::Result<Self> {
        Self::start_with_env(
            binary,
            etcd_endpoints,
            listen,
            opts,
            rust_log,
            extra_args,
            &[],
        )
        .await
    }

    /// [`ArbiterProcess::start_with`] with extra environment variables (the
    /// release gate's libfaketime preload for a steppable wall clock).
    pub async fn start_with_env(
        binary: &Path,
        etcd_endpoints: &[String],
        listen: Option<SocketAddr>,
        opts: ArbiterOptions,
        rust_log: &str,
        extra_args: &[String],
        env: &[(&str, String)],
    ) -> anyhow::Result<Self> {
        let certs = certs()?;
        let dir = TempDir::new()?;
        let addr: SocketAddr = match listen {
            Some(addr) => addr,
            None => {
                let l = std::net::TcpListener::bind("127.0.0.1:0")?;
                l.local_addr()?
            }
        };
        let state = opts
            .state_dir
            .clone()
            .unwrap_or_else(|| dir.path().join("state"));
        let log = dir.path().join("arbiter.log");
        let out = std::fs::File::create(&log)?;
        let svid = certs.svid("latchkey/arbiter");
        let mut cmd = Command::new(binary);
        cmd.arg("--listen")
            .arg(addr.to_string())
            .arg("--etcd")
            .arg(etcd_endpoints.join(","))
            .arg("--prefix")
            .arg(&opts.prefix)
            .arg("--policies")
            .arg(&opts.policies_dir)
            .arg("--tls-cert")
            .arg(&svid.cert)
            .arg("--tls-key")
            .arg(&svid.key)
            .arg("--tls-ca")
            .arg(certs.ca())
            .arg("--trust-domain")
            .arg(TRUST_DOMAIN)
            .arg("--state-dir")
            .arg(&state)
            .env("RUST_LOG", rust_log)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        if let Some(edge) = &opts.edge_identity {
            cmd.arg("--edge-identity").arg(edge);
        }
        if opts.allow_direct_workloads {
            cmd.arg("--allow-direct-workloads");
        }
        let etcd = &opts.etcd_credentials;
        if let Some(ca) = &etcd.ca {
            cmd.arg("--etcd-ca").arg(ca);
        }
        if let Some(c) = &etcd.client_cert {
            cmd.arg("--etcd-cert")
                .arg(&c.cert)
                .arg("--etcd-key")
                .arg(&c.key);
        }
        if let Some(u) = &etcd.user {
            cmd.arg("--etcd-user")
                .arg(&u.name)
                .arg("--etcd-password-file")
                .arg(&u.password_file);
        }
        let metrics_addr = match opts.metrics {
            true => Some(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?),
            false => None,
        };
        if let Some(m) = metrics_addr {
            cmd.arg("--metrics-listen").arg(m.to_string());
        }
        if opts.trust_unwitnessed_log {
            cmd.arg("--trust-unwitnessed-log");
        }
        if let Some(max) = opts.max_holds_per_identity {
            cmd.arg("--max-holds-per-identity").arg(max.to_string());
        }
        if let Some(max) = opts.max_sessions_per_identity {
            cmd.arg("--max-sessions-per-identity").arg(max.to_string());
        }
        if let Some(o) = &opts.overload {
            if !o.enabled {
                cmd.arg("--no-overload-protection");
            }
            cmd.arg("--renewal-latency-target-ms")
                .arg(o.renewal_target.as_millis().max(1).to_string())
                .arg("--max-new-work-in-flight")
                .arg(o.max_in_flight.to_string())
                .arg("--min-new-work-in-flight")
                .arg(o.min_in_flight.to_string());
        }
        if let Some(coord) = &opts.coord {
            cmd.arg("--coord-etcd").arg(coord.endpoints.join(","));
            if let Some(prefix) = &coord.prefix {
                cmd.arg("--coord-prefix").arg(prefix);
            }
            if let Some(name) = &coord.lock_cluster_name {
                cmd.arg("--lock-cluster-name").arg(name);
            }
            if coord.split_tiers {
                cmd.arg("--split-tiers");
            }
            if !coord.coord_tier_witness.is_empty() {
                cmd.arg("--coord-tier-witness-etcd")
                    .arg(coord.coord_tier_witness.join(","));
            }
        }
        if let Some(oidc) = &opts.force_release.oidc {
            cmd.arg("--oidc-issuer").arg(&oidc.issuer);
            cmd.arg("--oidc-audience").arg(&oidc.audience);
            cmd.arg("--oidc-role-claim").arg(&oidc.role_claim);
            cmd.arg("--oidc-role").arg(&oidc.role);
            if oidc.require_mfa {
                cmd.arg("--oidc-require-mfa");
            }
            cmd.arg("--force-request-ttl-seconds")
                .arg(opts.force_release.request_ttl.as_secs().max(1).to_string());
        }
        if let Some(user) = &opts.force_release.etcd_user {
            cmd.arg("--force-etcd-user").arg(&user.name);
            cmd.arg("--force-etcd-password-file")
                .arg(&user.password_file);
        }
        if opts.test_fault != TestFault::None {
            cmd.arg(faulty_log::FLAG).arg(opts.test_fault.name());
        }
        cmd.args(extra_args);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", binary.display()))?;
        let proc = Self {
            child: Some(child),
            addr,
            metrics_addr,
            log,
            _dir: dir,
        };
        eventually(
            "the arbiter process to answer",
            Duration::from_secs(20),
            || answers(addr),
        )
        .await
        .with_context(|| {
            format!(
                "log:\n{}",
                std::fs::read_to_string(&proc.log).unwrap_or_default()
            )
        })?;
        Ok(proc)
    }

    /// Where `GET /metrics` is served (with [`ArbiterOptions::metrics`]).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The process id (for CPU and memory readings).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn log(&self) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(&self.log)?)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait: the graceful path.
    pub fn terminate(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(i32::try_from(c.id())?);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
            c.wait()?;
        }
        Ok(())
    }
}

impl Drop for ArbiterProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
