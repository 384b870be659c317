//! Per-class Wasm hooks under test: the guests built once per process with
//! the project's Wasm build step (`scripts/build-wasm`), and an in-process
//! arbiter that keeps a handle on its hook host, so scenarios and the
//! benchmark can read the host's metrics and load refusals.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use latchkey_hook_host::HookHost;
use latchkey_proto::lockv1::lock_client::LockClient;
use parking_lot::Mutex;
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::arbiter::{TRUST_DOMAIN, certs, channel};
use crate::etcd::EtcdServer;
use crate::workspace_root;

/// Every guest package; built together (one cargo invocation).
pub const GUEST_PACKAGES: &[&str] = &[
    "latchkey-hook-change-ticket",
    "latchkey-hook-quota",
    "latchkey-hook-maintenance-window",
    "latchkey-hook-misbehave",
];

/// `target/wasm/<crate_name>.wasm` for a guest package (`latchkey-hook-quota`)
/// or crate name (`latchkey_hook_quota`), running `scripts/build-wasm` for all
/// guests once per process if the artifact is missing.
pub fn hook_wasm(name: &str) -> anyhow::Result<PathBuf> {
    static BUILT: Mutex<bool> = Mutex::new(false);
    let crate_name = name.replace('-', "_");
    let path = workspace_root()
        .join("target/wasm")
        .join(format!("{crate_name}.wasm"));
    if path.is_file() {
        return Ok(path);
    }
    let mut built = BUILT.lock();
    if !*built {
        let status = std::process::Command::new(workspace_root().join("scripts/build-wasm"))
            .args(GUEST_PACKAGES)
            .current_dir(workspace_root())
            .status()
            .context("run scripts/build-wasm")?;
        if !status.success() {
            bail!("scripts/build-wasm {GUEST_PACKAGES:?} failed: {status}");
        }
        *built = true;
    }
    if !path.is_file() {
        bail!("{} was not built", path.display());
    }
    Ok(path)
}

/// Builds every guest (if missing) and returns their paths in
/// [`GUEST_PACKAGES`] order.
pub fn all_hooks() -> anyhow::Result<Vec<PathBuf>> {
    GUEST_PACKAGES.iter().map(|p| hook_wasm(p)).collect()
}

/// An arbiter inside the test process, with its hook host at hand.
pub struct HookedArbiter {
    addr: SocketAddr,
    host: Arc<HookHost>,
    _state: TempDir,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), latchkey_arbiter::RunError>>>,
}

impl HookedArbiter {
    pub async fn start(etcd: &EtcdServer, policies_dir: &Path) -> anyhow::Result<Self> {
        let certs = certs()?;
        let state = TempDir::new()?;
        let svid = certs.svid("latchkey/arbiter");
        let mut config = latchkey_arbiter::Config::new(
            vec![etcd.endpoint()],
            policies_dir.to_path_buf(),
            state.path().to_path_buf(),
        );
        config.tls = Some(latchkey_arbiter::TlsFiles {
            cert: svid.cert,
            key: svid.key,
            client_ca: certs.ca(),
        });
        config.trust_domain = TRUST_DOMAIN.into();
        config.policy_poll = Duration::from_millis(100);
        config.max_wait = Duration::from_secs(30);
        config.retry_poll = Duration::from_millis(500);
        let host = config.hook_host.clone();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(latchkey_arbiter::run(listener, config, async {
            let _ = rx.await;
        }));
        let mut me = Self {
            addr,
            host,
            _state: state,
            shutdown: Some(tx),
            task: Some(task),
        };
        let ready = crate::eventually(
            "the arbiter to answer",
            Duration::from_secs(30),
            || async move {
                let mut c = LockClient::new(channel(addr, "workload/demo").await?);
                match c
                    .inspect(latchkey_proto::lockv1::InspectRequest {
                        key: "demo/ready".into(),
                    })
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(s)
                        if s.code() != tonic::Code::Unavailable
                            && s.code() != tonic::Code::Unknown =>
                    {
                        Ok(())
                    }
                    Err(s) => bail!("{s}"),
                }
            },
        )
        .await;
        if let Err(e) = ready {
            if let Some(task) = me.task.take()
                && task.is_finished()
            {
                bail!("the arbiter exited: {:?}", task.await);
            }
            return Err(e);
        }
        Ok(me)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn hooks(&self) -> &HookHost {
        &self.host
    }

    pub async fn lock(&self, name: &str) -> anyhow::Result<LockClient<Channel>> {
        Ok(LockClient::new(channel(self.addr, name).await?))
    }
}

impl Drop for HookedArbiter {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A copy of `policies/dev` in a temp dir whose hook module paths point at
/// the built guests by absolute path (so the copy loads like the original).
pub fn dev_policies_copy() -> anyhow::Result<TempDir> {
    all_hooks()?;
    let dir = TempDir::new()?;
    crate::copy_dev_policies(dir.path())?;
    Ok(dir)
}
