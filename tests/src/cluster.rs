//! A real multi-member etcd 3.4 cluster for the release gate, with faults injected on
//! the real processes and, with network namespaces, on the real network.
//!
//! With [`ClusterOptions::netns`] (the default) each member runs in its own network
//! namespace (`ip netns exec`, which execs, so the child's pid is etcd's), joined by a
//! veth pair to one Linux bridge in the root namespace. The bridge has `.1` of a private
//! /24 (10.231.x.0/24) and is the clients' route in; members talk to each other across
//! the bridge at L2. A partition sets the member's root-side veth down: it then reaches
//! neither its peers nor any client, and packets are dropped (not refused), as on a real
//! network. Without namespaces the members share loopback on free ports and
//! [`EtcdCluster::partition`] is refused.
//!
//! Names of namespaces and links start with `lkc`, then the owner's pid (6 hex digits)
//! and a per-process counter, so concurrent test processes never collide and leftovers of
//! crashed runs (owner pid gone) are removed by the next start. The subnet is picked
//! under a host-wide lock (an abstract unix socket, released by the kernel even when its
//! holder crashes) among those no root-namespace address uses.

use parking_lot::Mutex;
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::net::TcpListener;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use latchkey_etcd::{Client, Connection, KeepAlive};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tempfile::TempDir;

use crate::disk::StallableDir;
use crate::etcd::{MemberFlags, log_tail, member_flags, path_str, run_etcdctl};
use crate::eventually;

const ETCD_BIN: &str = "etcd";
/// Short raft timings keep elections (and so the fault tests) around a second.
const HEARTBEAT_INTERVAL_MS: &str = "100";
const ELECTION_TIMEOUT_MS: &str = "1000";
/// A cold start of every member plus the first election, on a busy 2-core CI box.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Health probes: a paused member accepts TCP but never answers, so bound every probe.
const PROBE_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
const CLIENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 keep-alives let the cluster client notice a paused or partitioned member.
const CLIENT_KEEP_ALIVE: Duration = Duration::from_secs(1);
/// Loopback mode only: retries when a port picked as free was taken before etcd bound it.
const START_ATTEMPTS: usize = 3;
/// Keeps every interface name (`lkc` + 6 + 2 + `h` + index) within 15 characters.
const MAX_MEMBERS: usize = 9;

const NAME_PREFIX: &str = "lkc";
/// Temp dirs are `latchkey-cluster-<owner pid, 6 hex digits>-<random>`.
const TEMP_DIR_PREFIX: &str = "latchkey-cluster-";
const OWNER_PID_DIGITS: usize = 6;
/// Members listen on their own address in netns mode, so the ports can be fixed.
const NETNS_CLIENT_PORT: u16 = 2379;
const NETNS_PEER_PORT: u16 = 2380;
/// Private /24s are picked from 10.231.1.0 ..= 10.231.254.0.
const SUBNET_PREFIX: [u8; 2] = [10, 231];
const BRIDGE_HOST: u8 = 1;
const FIRST_MEMBER_HOST: u8 = 10;
const NETNS_DIR: &str = "/run/netns";
/// The host-wide lock around leftover cleanup and subnet choice (abstract socket name).
const HOST_LOCK_NAME: &[u8] = b"latchkey-cluster-netns-lock";
const HOST_LOCK_TIMEOUT: Duration = Duration::from_secs(30);
const HOST_LOCK_RETRY: Duration = Duration::from_millis(10);

/// Per-process counter, part of every name so one process can run several clusters.
static NEXT_CLUSTER: AtomicU32 = AtomicU32::new(0);

/// How [`EtcdCluster::start`] lays the cluster out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterOptions {
    /// Number of members (1..=9). Default 3.
    pub members: usize,
    /// One network namespace per member (needed for [`EtcdCluster::partition`]); else
    /// all members share loopback. Default true.
    pub netns: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            members: 3,
            netns: true,
        }
    }
}

/// A running etcd cluster; every member is SIGKILLed and the network torn down on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    // Drop order matters: members (processes) first, then their disks and
    // network, then the dir.
    members: Vec<Member>,
    /// From [`EtcdCluster::start_with_stallable_disks`]: member i's directory
    /// (every data dir generation) is served through `disks[i]`.
    disks: Vec<StallableDir>,
    network: Option<Network>,
    cluster_token: String,
    /// Raft member id of each member, learned once all members answered.
    member_ids: Vec<u64>,
    /// Bumped per restore so each restore gets fresh data dirs.
    generation: u32,
    dir: TempDir,
}

impl EtcdCluster {
    /// Starts every member and waits until the cluster has a leader and every member
    /// answers.
    pub async fn start(opts: ClusterOptions) -> anyhow::Result<Self> {
        Self::start_inner(opts, false).await
    }

    /// [`EtcdCluster::start`], with each member's directory on a FUSE
    /// passthrough the nemesis can stall ([`EtcdCluster::disk`], the release
    /// gate's slow-disk fault).
    pub async fn start_with_stallable_disks(opts: ClusterOptions) -> anyhow::Result<Self> {
        Self::start_inner(opts, true).await
    }

    async fn start_inner(opts: ClusterOptions, stallable_disks: bool) -> anyhow::Result<Self> {
        ensure!(
            (1..=MAX_MEMBERS).contains(&opts.members),
            "an etcd cluster needs 1..={MAX_MEMBERS} members, not {}",
            opts.members
        );
        let attempts = if opts.netns { 1 } else { START_ATTEMPTS };
        let mut last_err = None;
        for _ in 0..attempts {
            let mut cluster = Self::new(opts, stallable_disks).await?;
            match cluster.boot().await {
                Ok(()) => return Ok(cluster),
                Err(err) if !opts.netns && cluster.logs_contain("address already in use") => {
                    tracing::warn!(error = %format!("{err:#}"), "etcd cluster lost a port race; retrying");
                    last_err = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("etcd cluster did not start")))
    }

    async fn new(opts: ClusterOptions, stallable_disks: bool) -> anyhow::Result<Self> {
        if !opts.netns {
            // Netns mode does this (and more) under the host lock in `Network::create`.
            remove_leftover_dirs();
        }
        let dir = tempfile::Builder::new()
            .prefix(&format!(
                "{TEMP_DIR_PREFIX}{:0width$x}-",
                std::process::id(),
                width = OWNER_PID_DIGITS
            ))
            .tempdir()
            .context("creating etcd cluster temp dir")?;
        let network = if opts.netns {
            let count = opts.members;
            let network = tokio::task::spawn_blocking(move || Network::create(count))
                .await
                .context("network setup task")?
                .context(
                    "setting up network namespaces for the etcd cluster (needs root, \
                     iproute2 and bridge/veth support; ClusterOptions { netns: false, .. } \
                     runs on loopback without partitions)",
                )?;
            Some(network)
        } else {
            None
        };
        let loopback_ports = if opts.netns {
            Vec::new()
        } else {
            free_ports(opts.members * 2)?
        };
        let mut disks = Vec::new();
        if stallable_disks {
            for i in 0..opts.members {
                let backing = dir.path().join(format!("{}.disk", member_name(i)));
                disks.push(
                    StallableDir::mount(&backing, &dir.path().join(member_name(i)))
                        .with_context(|| format!("a stallable disk for {}", member_name(i)))?,
                );
            }
        }
        let mut members = Vec::with_capacity(opts.members);
        for i in 0..opts.members {
            let (host, client_port, peer_port, netns, host_veth) = match &network {
                Some(net) => (
                    net.member_ip(i),
                    NETNS_CLIENT_PORT,
                    NETNS_PEER_PORT,
                    Some(net.namespace(i)),
                    Some(net.host_veth(i)),
                ),
                None => (
                    "127.0.0.1".to_owned(),
                    loopback_ports[2 * i],
                    loopback_ports[2 * i + 1],
                    None,
                    None,
                ),
            };
            members.push(Member {
                name: member_name(i),
                host,
                client_port,
                peer_port,
                netns,
                host_veth,
                data_dir: dir.path().join(member_name(i)).join("data-0"),
                log_path: dir.path().join(format!("{}.log", member_name(i))),
                child: Mutex::new(None),
                paused: AtomicBool::new(false),
                partitioned: false,
            });
        }
        let cluster_token = match &network {
            Some(net) => format!("latchkey-cluster-{}", net.owner),
            None => format!("latchkey-cluster-lo-{}", members[0].peer_port),
        };
        Ok(Self {
            members,
            disks,
            network,
            cluster_token,
            member_ids: Vec::new(),
            generation: 0,
            dir,
        })
    }

    /// Spawns every member and waits for a healthy cluster (a leader, all answering).
    async fn boot(&mut self) -> anyhow::Result<()> {
        let initial_cluster = self.initial_cluster();
        for member in &self.members {
            member.spawn(&initial_cluster, &self.cluster_token)?;
        }
        self.wait_healthy(READY_TIMEOUT).await.map_err(|err| {
            err.context(format!("etcd cluster did not start{}", self.log_tails()))
        })?;
        self.learn_member_ids().await
    }

    pub fn members(&self) -> usize {
        self.members.len()
    }

    /// Member `i`'s stallable disk (from [`EtcdCluster::start_with_stallable_disks`]).
    pub fn disk(&self, i: usize) -> Option<&StallableDir> {
        self.disks.get(i)
    }

    /// Client URLs (`http://IP:PORT`) of all members, reachable from the root namespace
    /// and stable across restarts and restores.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::client_url).collect()
    }

    /// The client URL of member `i`.
    pub fn endpoint(&self, i: usize) -> anyhow::Result<String> {
        Ok(self.member(i)?.client_url())
    }

    /// `etcd-<i>`: the member's `--name`, also used in histories and fault names.
    pub fn name(&self, i: usize) -> String {
        member_name(i)
    }

    /// The network namespace member `i` runs in (netns mode only).
    pub fn netns(&self, i: usize) -> Option<&str> {
        self.members.get(i).and_then(|m| m.netns.as_deref())
    }

    /// The pid of member `i`'s etcd, if it is running (or paused).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members.get(i).and_then(Member::pid)
    }

    /// A client balanced over all endpoints. Requests routed to a paused or partitioned
    /// member can hang: wrap them in a timeout when that matters.
    pub async fn client(&self) -> anyhow::Result<Client> {
        let endpoints = self.endpoints();
        latchkey_etcd::connect(&client_connection(endpoints.clone()))
            .await
            .with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))
    }

    /// A client of member `i` alone (e.g. for serializable reads of its local state).
    pub async fn member_client(&self, i: usize) -> anyhow::Result<Client> {
        let endpoint = self.endpoint(i)?;
        latchkey_etcd::connect(&client_connection(vec![endpoint.clone()]))
            .await
            .with_context(|| format!("connecting to etcd at {endpoint}"))
    }

    /// The index of the current leader, as seen by the live (running, not paused, not
    /// partitioned) member with the highest raft term. Right after the leader is paused
    /// or cut off this may still name it until the others' election timeout fires.
    pub async fn leader(&self) -> anyhow::Result<usize> {
        let probes = self.probe_reachable().await;
        let best = probes
            .iter()
            .filter_map(|(_, probe)| probe.as_ref().ok())
            .filter(|p| p.leader != 0)
            .max_by_key(|p| p.raft_term);
        let Some(best) = best else {
            bail!(
                "no live member knows a leader: {}",
                describe_probes(&probes)
            );
        };
        self.member_ids
            .iter()
            .position(|id| *id == best.leader)
            .with_context(|| format!("leader id {:x} is not a known member", best.leader))
    }

    /// SIGKILLs member `i` and reaps it; its data dir is kept. A no-op if it is not
    /// running.
    pub fn kill(&mut self, i: usize) -> anyhow::Result<()> {
        self.member_mut(i)?.kill()
    }

    /// Kills member `i` if running, then starts it with the same flags and data dir and
    /// waits until it serves. A partitioned member cannot be reached to check that: it is
    /// only started.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        let initial_cluster = self.initial_cluster();
        let cluster_token = self.cluster_token.clone();
        let member = self.member_mut(i)?;
        member.kill()?;
        member.spawn(&initial_cluster, &cluster_token)?;
        if member.partitioned {
            return Ok(());
        }
        let member = self.member(i)?;
        if let Err(err) = member.wait_serving(READY_TIMEOUT).await {
            return Err(err.context(format!(
                "{} did not serve after restart; log tail ({}):\n{}",
                member.name,
                member.log_path.display(),
                member.log_tail()
            )));
        }
        Ok(())
    }

    /// SIGSTOP: member `i` keeps its sockets but answers nothing (peers and clients).
    pub fn pause(&self, i: usize) -> anyhow::Result<()> {
        let member = self.member(i)?;
        member.signal(Signal::SIGSTOP)?;
        member.paused.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// SIGCONT after [`Self::pause`].
    pub fn resume(&self, i: usize) -> anyhow::Result<()> {
        let member = self.member(i)?;
        member.signal(Signal::SIGCONT)?;
        member.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Whether [`Self::partition`] works (network namespaces in use).
    pub fn supports_partition(&self) -> bool {
        self.network.is_some()
    }

    /// Cuts member `i` off from the other members and from clients: its root-side veth
    /// goes down, so its packets are dropped both ways (connections hang, not refused).
    pub fn partition(&mut self, i: usize) -> anyhow::Result<()> {
        self.set_link(i, false)
    }

    /// Undoes [`Self::partition`].
    pub fn heal(&mut self, i: usize) -> anyhow::Result<()> {
        self.set_link(i, true)
    }

    fn set_link(&mut self, i: usize, up: bool) -> anyhow::Result<()> {
        ensure!(
            self.network.is_some(),
            "partitions need network namespaces: this cluster runs on loopback \
             (ClusterOptions {{ netns: false, .. }})"
        );
        let member = self.member_mut(i)?;
        let veth = member
            .host_veth
            .as_deref()
            .context("member without a veth")?;
        ip(&["link", "set", veth, if up { "up" } else { "down" }])?;
        member.partitioned = !up;
        Ok(())
    }

    /// `etcdctl snapshot save` into `path` from the first live member that serves it.
    pub async fn snapshot_save(&self, path: &Path) -> anyhow::Result<()> {
        let path = path_str(path)?;
        let mut errors = Vec::new();
        for member in self.members.iter().filter(|m| m.is_reachable()) {
            let endpoint = member.client_url();
            match run_etcdctl(&["--endpoints", &endpoint, "snapshot", "save", path]).await {
                Ok(()) => return Ok(()),
                Err(err) => errors.push(format!("{}: {err:#}", member.name)),
            }
        }
        bail!("no live member saved a snapshot: [{}]", errors.join("; "))
    }

    /// Stops every member, restores each member's data dir from `snapshot` with the same
    /// `--name`, `--initial-cluster`, `--initial-cluster-token` and peer URLs (so the
    /// cluster ID stays the same), starts all of them and waits for a healthy cluster.
    /// Pauses end (the processes are replaced); partitions stay as they are.
    pub async fn restore(&mut self, snapshot: &Path) -> anyhow::Result<()> {
        for member in &mut self.members {
            member.kill()?;
        }
        self.generation += 1;
        let initial_cluster = self.initial_cluster();
        let snapshot = path_str(snapshot)?;
        for (i, member) in self.members.iter_mut().enumerate() {
            let data_dir = self
                .dir
                .path()
                .join(member_name(i))
                .join(format!("data-{}", self.generation));
            run_etcdctl(&[
                "snapshot",
                "restore",
                snapshot,
                "--name",
                &member.name,
                "--initial-cluster",
                &initial_cluster,
                "--initial-cluster-token",
                &self.cluster_token,
                "--initial-advertise-peer-urls",
                &member.peer_url(),
                "--data-dir",
                path_str(&data_dir)?,
            ])
            .await
            .with_context(|| format!("restoring {}", member.name))?;
            member.data_dir = data_dir;
        }
        for member in &self.members {
            member.spawn(&initial_cluster, &self.cluster_token)?;
        }
        self.wait_healthy(READY_TIMEOUT).await.map_err(|err| {
            err.context(format!(
                "etcd cluster did not come back after restore{}",
                self.log_tails()
            ))
        })?;
        // Same names, peer URLs and token: the same ids (checked, not assumed).
        if self.members.iter().all(Member::is_reachable) {
            self.learn_member_ids().await?;
        }
        Ok(())
    }

    /// The cluster ID from the first live member that answers a status request.
    pub async fn cluster_id(&self) -> anyhow::Result<u64> {
        let probes = self.probe_reachable().await;
        probes
            .iter()
            .find_map(|(_, probe)| probe.as_ref().ok().map(|p| p.cluster_id))
            .with_context(|| format!("no live member answered: {}", describe_probes(&probes)))
    }

    /// Waits until some live member is the leader that every live member (running, not
    /// paused, not partitioned) names. Fails at once if a member's process has exited
    /// without [`Self::kill`].
    pub async fn wait_healthy(&self, timeout: Duration) -> anyhow::Result<()> {
        let crashed = eventually(
            "a leader and every live member answering",
            timeout,
            || async {
                if let Some(crash) = self.crashed_member() {
                    return Ok(Some(crash));
                }
                let probes = self.probe_reachable().await;
                let mut leaders = Vec::new();
                for (_, probe) in &probes {
                    match probe {
                        Ok(p) if p.leader != 0 => leaders.push(p.leader),
                        _ => bail!(
                            "not every live member knows a leader: {}",
                            describe_probes(&probes)
                        ),
                    }
                }
                let Some(leader) = leaders.first().copied() else {
                    bail!("no live member");
                };
                ensure!(
                    leaders.iter().all(|l| *l == leader),
                    "live members disagree on the leader: {}",
                    describe_probes(&probes)
                );
                ensure!(
                    probes
                        .iter()
                        .any(|(_, p)| p.as_ref().is_ok_and(|p| p.member_id == leader)),
                    "the leader {leader:x} is not live: {}",
                    describe_probes(&probes)
                );
                Ok(None)
            },
        )
        .await?;
        if let Some(crash) = crashed {
            bail!("{crash}");
        }
        Ok(())
    }

    /// etcd's stdout and stderr for member `i`, appended across restarts.
    pub fn log_path(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("{}.log", member_name(i)))
    }

    /// Records every member's raft id (for [`Self::leader`]); needs all to answer.
    async fn learn_member_ids(&mut self) -> anyhow::Result<()> {
        let probes = self.probe_reachable().await;
        ensure!(
            probes.len() == self.members.len(),
            "member ids can only be learned while every member is live"
        );
        let ids = probes
            .iter()
            .map(|(_, p)| {
                p.as_ref()
                    .map(|p| p.member_id)
                    .map_err(|e| anyhow::anyhow!("{e:#}"))
            })
            .collect::<anyhow::Result<Vec<u64>>>()
            .context("learning member ids")?;
        if !self.member_ids.is_empty() && self.member_ids != ids {
            tracing::warn!(old = ?self.member_ids, new = ?ids, "etcd member ids changed");
        }
        self.member_ids = ids;
        Ok(())
    }

    fn member(&self, i: usize) -> anyhow::Result<&Member> {
        let count = self.members.len();
        self.members
            .get(i)
            .with_context(|| format!("no member {i} in a {count}-member cluster"))
    }

    fn member_mut(&mut self, i: usize) -> anyhow::Result<&mut Member> {
        let count = self.members.len();
        self.members
            .get_mut(i)
            .with_context(|| format!("no member {i} in a {count}-member cluster"))
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Status of every live member, probed concurrently with short timeouts.
    async fn probe_reachable(&self) -> Vec<(usize, anyhow::Result<Probe>)> {
        let live: Vec<usize> = (0..self.members.len())
            .filter(|i| self.members[*i].is_reachable())
            .collect();
        let probes = live.iter().map(|i| probe(self.members[*i].client_url()));
        live.iter()
            .copied()
            .zip(futures::future::join_all(probes).await)
            .collect()
    }

    fn crashed_member(&self) -> Option<String> {
        self.members.iter().find_map(|m| {
            m.exit_status().map(|status| {
                format!(
                    "{} exited with {status}; log tail ({}):\n{}",
                    m.name,
                    m.log_path.display(),
                    m.log_tail()
                )
            })
        })
    }

    fn logs_contain(&self, needle: &str) -> bool {
        self.members.iter().any(|m| m.log_tail().contains(needle))
    }

    fn log_tails(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let _ = write!(
                out,
                "\n--- {} ({}) ---\n{}",
                m.name,
                m.log_path.display(),
                m.log_tail()
            );
        }
        out
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        // Processes first: a namespace with a live etcd in it would outlive `ip netns del`.
        for member in &mut self.members {
            let _ = member.kill();
        }
        // `network` then tears down namespaces and links, `dir` removes the data dirs.
    }
}

fn member_name(i: usize) -> String {
    format!("etcd-{i}")
}

fn client_connection(endpoints: Vec<String>) -> Connection {
    Connection {
        connect_timeout: Some(CLIENT_CONNECT_TIMEOUT),
        keep_alive: Some(KeepAlive {
            interval: CLIENT_KEEP_ALIVE,
            timeout: CLIENT_KEEP_ALIVE,
            while_idle: true,
        }),
        ..Connection::new(endpoints)
    }
}

/// What one member's status says.
#[derive(Debug, Clone, Copy)]
struct Probe {
    member_id: u64,
    cluster_id: u64,
    leader: u64,
    raft_term: u64,
}

async fn probe(endpoint: String) -> anyhow::Result<Probe> {
    let connection = Connection {
        connect_timeout: Some(PROBE_CONNECT_TIMEOUT),
        request_timeout: Some(PROBE_TIMEOUT),
        ..Connection::new([endpoint.as_str()])
    };
    let status = tokio::time::timeout(PROBE_TIMEOUT * 2, async {
        let mut client = latchkey_etcd::connect(&connection).await?;
        Ok::<_, latchkey_etcd::Error>(client.status().await?)
    })
    .await
    .with_context(|| format!("status of {endpoint} timed out"))?
    .with_context(|| format!("status of {endpoint}"))?;
    let header = status.header().context("status response without header")?;
    Ok(Probe {
        member_id: header.member_id(),
        cluster_id: header.cluster_id(),
        leader: status.leader(),
        raft_term: status.raft_term(),
    })
}

fn describe_probes(probes: &[(usize, anyhow::Result<Probe>)]) -> String {
    let parts: Vec<String> = probes
        .iter()
        .map(|(i, probe)| match probe {
            Ok(p) => format!(
                "{}: id {:x} leader {:x} term {}",
                member_name(*i),
                p.member_id,
                p.leader,
                p.raft_term
            ),
            Err(err) => format!("{}: {err:#}", member_name(*i)),
        })
        .collect();
    format!("[{}]", parts.join("; "))
}

/// One etcd process and where it lives.
#[derive(Debug)]
struct Member {
    name: String,
    /// The address etcd listens on (its namespace's veth address, or 127.0.0.1).
    host: String,
    client_port: u16,
    peer_port: u16,
    netns: Option<String>,
    host_veth: Option<String>,
    data_dir: PathBuf,
    log_path: PathBuf,
    /// Behind a lock so `&self` methods (pause, health checks) can use it.
    child: Mutex<Option<Child>>,
    paused: AtomicBool,
    partitioned: bool,
}

impl Member {
    fn client_url(&self) -> String {
        format!("http://{}:{}", self.host, self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://{}:{}", self.host, self.peer_port)
    }

    fn child(&self) -> parking_lot::MutexGuard<'_, Option<Child>> {
        self.child.lock()
    }

    fn pid(&self) -> Option<u32> {
        self.child().as_ref().map(Child::id)
    }

    /// Set when the process exited although nobody killed it.
    fn exit_status(&self) -> Option<ExitStatus> {
        self.child()
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Running, not paused, not partitioned: expected to answer.
    fn is_reachable(&self) -> bool {
        self.pid().is_some() && !self.paused.load(Ordering::SeqCst) && !self.partitioned
    }

    fn spawn(&self, initial_cluster: &str, cluster_token: &str) -> anyhow::Result<()> {
        let mut slot = self.child();
        ensure!(slot.is_none(), "{} is already running", self.name);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .with_context(|| format!("opening {}", self.log_path.display()))?;
        let stderr = log.try_clone().context("cloning log file handle")?;
        // `ip netns exec` execs etcd, so the child's pid (signals, kill) is etcd's.
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, ETCD_BIN]);
                c
            }
            None => Command::new(ETCD_BIN),
        };
        let child = command
            .args(member_flags(&MemberFlags {
                name: &self.name,
                data_dir: &self.data_dir,
                client_url: &self.client_url(),
                peer_url: &self.peer_url(),
                initial_cluster,
                cluster_token,
            }))
            .args(["--heartbeat-interval", HEARTBEAT_INTERVAL_MS])
            .args(["--election-timeout", ELECTION_TIMEOUT_MS])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr))
            .spawn()
            .with_context(|| {
                format!(
                    "spawning `{ETCD_BIN}` for {} (is etcd 3.4 installed? run scripts/setup)",
                    self.name
                )
            })?;
        *slot = Some(child);
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Waits until this member answers a status request (it serves clients only once it
    /// has joined the cluster, so that needs a quorum).
    async fn wait_serving(&self, timeout: Duration) -> anyhow::Result<()> {
        let endpoint = self.client_url();
        let exited = eventually(&format!("{} to answer status", self.name), timeout, || {
            // Checked first so a crashed etcd fails now, not at the deadline.
            let exited = self.exit_status();
            let endpoint = endpoint.clone();
            async move {
                if exited.is_some() {
                    return Ok(exited);
                }
                probe(endpoint).await?;
                Ok(None)
            }
        })
        .await?;
        if let Some(status) = exited {
            bail!("{} exited during startup with {status}", self.name);
        }
        Ok(())
    }

    fn kill(&mut self) -> anyhow::Result<()> {
        let slot = self.child.get_mut();
        if let Some(mut child) = slot.take() {
            // A stopped process still dies on SIGKILL.
            child
                .kill()
                .with_context(|| format!("killing {}", self.name))?;
            child
                .wait()
                .with_context(|| format!("reaping {}", self.name))?;
        }
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let pid = self
            .pid()
            .with_context(|| format!("{} is not running", self.name))?;
        let pid = i32::try_from(pid).context("pid out of range")?;
        kill(Pid::from_raw(pid), signal)
            .with_context(|| format!("sending {signal} to {}", self.name))
    }

    fn log_tail(&self) -> String {
        log_tail(&self.log_path)
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// `count` distinct free loopback ports (all listeners held until all are picked).
fn free_ports(count: usize) -> anyhow::Result<Vec<u16>> {
    let listeners = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").context("binding a free port"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// The bridge, namespaces and veths of one netns-mode cluster; removed on drop.
#[derive(Debug)]
struct Network {
    /// `lkc` + owner pid + counter: the prefix of every name below.
    owner: String,
    /// The third octet of 10.231.x.0/24.
    subnet: u8,
    bridge_created: bool,
    namespaces: Vec<String>,
    veths: Vec<String>,
}

impl Network {
    /// Creates the bridge and one namespace + veth per member. Blocking (runs `ip`).
    fn create(members: usize) -> anyhow::Result<Self> {
        let lock = HostLock::acquire()?;
        match remove_leftovers() {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, "removed leftovers of crashed etcd cluster runs");
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %format!("{err:#}"), "removing leftover networks"),
        }
        let owner = unused_owner()?;
        let subnet = unused_subnet()?;
        let mut net = Self {
            owner,
            subnet,
            bridge_created: false,
            namespaces: Vec::new(),
            veths: Vec::new(),
        };
        let bridge = net.bridge();
        // STP off and no forward delay: a healed port forwards at once.
        ip(&[
            "link",
            "add",
            &bridge,
            "type",
            "bridge",
            "forward_delay",
            "0",
            "stp_state",
            "0",
        ])?;
        net.bridge_created = true;
        ip(&[
            "addr",
            "add",
            &net.address(BRIDGE_HOST, true),
            "dev",
            &bridge,
        ])?;
        ip(&["link", "set", &bridge, "up"])?;
        // The subnet is taken (visible to the next chooser) once the bridge has it.
        drop(lock);

        for i in 0..members {
            let ns = net.namespace(i);
            ip(&["netns", "add", &ns])?;
            net.namespaces.push(ns.clone());
            let veth = net.host_veth(i);
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            net.veths.push(veth.clone());
            ip(&["link", "set", &veth, "master", &bridge, "up"])?;
            let address = net.address(member_host(i)?, true);
            ip(&["-n", &ns, "addr", "add", &address, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        tracing::debug!(owner = %net.owner, subnet = %net.address(0, true), "etcd cluster network ready");
        Ok(net)
    }

    fn bridge(&self) -> String {
        format!("{}b", self.owner)
    }

    fn namespace(&self, i: usize) -> String {
        format!("{}m{i}", self.owner)
    }

    fn host_veth(&self, i: usize) -> String {
        format!("{}h{i}", self.owner)
    }

    fn member_ip(&self, i: usize) -> String {
        // `create` checked that every index maps to a host number.
        self.address(
            FIRST_MEMBER_HOST.saturating_add(u8::try_from(i).unwrap_or(u8::MAX)),
            false,
        )
    }

    fn address(&self, host: u8, with_prefix: bool) -> String {
        let [a, b] = SUBNET_PREFIX;
        let suffix = if with_prefix { "/24" } else { "" };
        format!("{a}.{b}.{}.{host}{suffix}", self.subnet)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Deleting a namespace destroys the veth inside it and so its root-side peer.
        for ns in &self.namespaces {
            if let Err(err) = ip(&["netns", "del", ns]) {
                tracing::warn!(error = %format!("{err:#}"), "removing network namespace");
            }
        }
        for veth in &self.veths {
            if link_exists(veth) {
                let _ = ip(&["link", "del", veth]);
            }
        }
        if self.bridge_created
            && let Err(err) = ip(&["link", "del", &self.bridge()])
        {
            tracing::warn!(error = %format!("{err:#}"), "removing bridge");
        }
    }
}

fn member_host(i: usize) -> anyhow::Result<u8> {
    u8::try_from(i)
        .ok()
        .and_then(|i| FIRST_MEMBER_HOST.checked_add(i))
        .with_context(|| format!("member index {i} out of range"))
}

/// `lkc` + this process's pid + a counter not used by a live namespace or link.
fn unused_owner() -> anyhow::Result<String> {
    let pid = std::process::id();
    for _ in 0..=u8::MAX {
        let seq = NEXT_CLUSTER.fetch_add(1, Ordering::Relaxed) % 256;
        let owner = format!(
            "{NAME_PREFIX}{pid:0width$x}{seq:02x}",
            width = OWNER_PID_DIGITS
        );
        let taken = Path::new(NETNS_DIR).join(format!("{owner}m0")).exists()
            || link_exists(&format!("{owner}b"));
        if !taken {
            return Ok(owner);
        }
    }
    bail!("256 etcd cluster networks already exist for pid {pid}")
}

/// A 10.231.x.0/24 no root-namespace address or route is in. Call with the host lock
/// held (every cluster's bridge address is in the root namespace, so it shows here).
fn unused_subnet() -> anyhow::Result<u8> {
    let addresses = ip(&["-o", "-4", "addr", "show"])? + &ip(&["-4", "route", "show"])?;
    let [a, b] = SUBNET_PREFIX;
    let used: Vec<u8> = addresses
        .split_whitespace()
        .filter_map(|word| {
            let address = word.split('/').next()?;
            let octets: Vec<u8> = address
                .split('.')
                .map(|o| o.parse().ok())
                .collect::<Option<_>>()?;
            match octets.as_slice() {
                [x, y, z, _] if *x == a && *y == b => Some(*z),
                _ => None,
            }
        })
        .collect();
    // Start at a random subnet so concurrent processes rarely scan the same ones.
    let start = fastrand::u8(1..=254);
    (0..254u16)
        .map(|offset| {
            let x = (u16::from(start) - 1 + offset) % 254 + 1;
            u8::try_from(x).unwrap_or(1)
        })
        .find(|x| !used.contains(x))
        .with_context(|| format!("every subnet {a}.{b}.1-254.0/24 is in use"))
}

/// Removes namespaces and links named by this harness whose owner process is gone (a
/// crashed or SIGKILLed test run never ran its `Drop`). Returns the removed names.
/// Takes the host-wide lock, so it never races a cluster being set up.
pub fn remove_leftover_networks() -> anyhow::Result<Vec<String>> {
    let _lock = HostLock::acquire()?;
    remove_leftovers()
}

fn remove_leftovers() -> anyhow::Result<Vec<String>> {
    let mut removed = remove_leftover_dirs();
    if let Ok(entries) = fs::read_dir(NETNS_DIR) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if owner_is_gone(&name) {
                // A SIGKILLed test run leaves its etcds running (re-parented) in there.
                for pid in ip(&["netns", "pids", &name])?.split_whitespace() {
                    if let Ok(pid) = pid.parse::<i32>() {
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                }
                ip(&["netns", "del", &name])?;
                removed.push(name);
            }
        }
    }
    // Namespaces first: their veths vanish with them. Then bridges and stray veths.
    let links = ip(&["-o", "link", "show"])?;
    for line in links.lines() {
        // "12: lkc0012ab01h0@if2: <BROADCAST,..." -> "lkc0012ab01h0"
        let Some(name) = line
            .split(": ")
            .nth(1)
            .map(|n| n.split('@').next().unwrap_or(n))
        else {
            continue;
        };
        if owner_is_gone(name) && link_exists(name) {
            ip(&["link", "del", name])?;
            removed.push(name.to_owned());
        }
    }
    Ok(removed)
}

/// Removes temp dirs of dead owners, SIGKILLing any etcd still running on them (a
/// SIGKILLed test run never kills its members). Best effort; returns the removed dirs.
fn remove_leftover_dirs() -> Vec<String> {
    // First the slow-disk mounts a dead run left in them (or the removal
    // would descend into a mount nobody serves).
    let mut removed = crate::disk::remove_stale_mounts();
    let tmp = std::env::temp_dir();
    let Ok(entries) = fs::read_dir(&tmp) else {
        return removed;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(TEMP_DIR_PREFIX)
            .and_then(|rest| rest.get(..OWNER_PID_DIGITS))
            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
        else {
            continue;
        };
        if process_exists(pid) {
            continue;
        }
        let dir = entry.path();
        kill_processes_using(&dir);
        if fs::remove_dir_all(&dir).is_ok() {
            removed.push(dir.display().to_string());
        }
    }
    removed
}

/// SIGKILLs every process whose command line mentions `dir` (an orphaned member).
fn kill_processes_using(dir: &Path) {
    let Ok(needle) = path_str(dir) else {
        return;
    };
    let Ok(procs) = fs::read_dir("/proc") else {
        return;
    };
    for entry in procs.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let mentions = cmdline
            .split(|b| *b == 0)
            .any(|arg| String::from_utf8_lossy(arg).starts_with(needle));
        if mentions {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `name` is one of ours (`lkc` + 6 hex digits of pid + ...) and that pid is
/// not a live process.
fn owner_is_gone(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
        return false;
    };
    let Some(pid) = rest
        .get(..OWNER_PID_DIGITS)
        .and_then(|hex| u32::from_str_radix(hex, 16).ok())
    else {
        return false;
    };
    // Namespaces/links are named `owner` + `m`/`b`/`h` + index.
    if rest.len() < OWNER_PID_DIGITS + 3 {
        return false;
    }
    !process_exists(pid)
}

fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Runs `ip ARGS`, returning stdout; fails with the command and its stderr.
fn ip(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running `ip` (is iproute2 installed?)")?;
    if !output.status.success() {
        bail!(
            "`ip {}` failed with {}: {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A host-wide mutex: a bound abstract unix socket. The kernel frees the name when the
/// holder exits, however it exits, so a crashed run never leaves the lock taken.
struct HostLock {
    _socket: UnixListener,
}

impl HostLock {
    /// Blocks (up to 30 s) until the lock is free.
    fn acquire() -> anyhow::Result<Self> {
        let address = SocketAddr::from_abstract_name(HOST_LOCK_NAME)
            .context("abstract socket name for the host lock")?;
        let deadline = Instant::now() + HOST_LOCK_TIMEOUT;
        loop {
            match UnixListener::bind_addr(&address) {
                Ok(socket) => return Ok(Self { _socket: socket }),
                Err(err) if err.kind() == std::io::ErrorKind::AddrInUse => {
                    ensure!(
                        Instant::now() < deadline,
                        "the etcd cluster network lock was held for {HOST_LOCK_TIMEOUT:?}"
                    );
                    // A lock wait on a blocking thread; holders keep it for milliseconds.
                    std::thread::sleep(HOST_LOCK_RETRY);
                }
                Err(err) => return Err(err).context("binding the host lock socket"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_names_fit_interface_names() {
        let owner = format!("{NAME_PREFIX}{:06x}{:02x}", 0x3f_ffff, 0xff);
        let net = Network {
            owner,
            subnet: 7,
            bridge_created: false,
            namespaces: Vec::new(),
            veths: Vec::new(),
        };
        assert!(net.bridge().len() <= 15);
        assert!(net.host_veth(MAX_MEMBERS - 1).len() <= 15);
        assert_eq!(net.member_ip(2), "10.231.7.12");
        assert_eq!(net.address(BRIDGE_HOST, true), "10.231.7.1/24");
    }

    #[test]
    fn only_our_names_with_dead_owners_are_leftovers() {
        let live = std::process::id();
        assert!(!owner_is_gone(&format!("lkc{live:06x}00b")));
        assert!(!owner_is_gone("eth0"));
        assert!(!owner_is_gone("lkcxyz"));
        assert!(!owner_is_gone("lkc00"));
        // pid 0x3fffff+1 is above the kernel's pid_max limit: never a live process.
        assert!(owner_is_gone("lkc40000100b"));
        assert!(owner_is_gone("lkc40000100m1"));
    }
}
