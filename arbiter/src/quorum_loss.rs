//! The quorum-loss posture of ADR-04: what the arbiter does for each class
//! while the lock cluster has no etcd majority.
//!
//! **How the arbiter decides.** A probe sends a linearizable read of the
//! epoch record (the client requires a leader, so a member cut off from
//! the majority answers "no leader" at once) every `probe_every`, bounded
//! by `probe_timeout`. After `failures_to_lose` failures in a row the
//! cluster is *lost*; the first answer makes it *healthy* again. Grant
//! transactions and renewals fail on their own meanwhile; the probe only
//! decides which answer a caller gets and whether an open class may grant.
//!
//! - **closed** classes (the default, and the only posture a fenced class
//!   may declare): Acquire answers UNAVAILABLE (`STORE_UNAVAILABLE`) with a
//!   message saying the cluster lost quorum and the class is closed, and
//!   sends nothing to etcd. Holders self-fence at their client deadline, as
//!   for any failed renewal.
//! - **open** classes (advisory efficiency classes only): Acquire is
//!   granted from this arbiter's memory with **token 0** and
//!   `Grant.unprotected = true`. Memory grants are exclusive per key within
//!   this arbiter only, bounded per identity (holds and waiters), last one
//!   TTL from the grant (never renewed), and each is appended to the
//!   fsynced [`spool`] *before* the caller is answered; a full spool
//!   refuses. On recovery the spool goes to `ready/` for the audit tailer.
//!
//! **When quorum returns**, new grants go through etcd again; a memory
//! grant still alive keeps its key: a grant in etcd of that key to another
//! session waits (or is refused `HELD` to a try-lock) until the memory
//! grant ends (release with token 0, or its TTL).

mod memory;
mod probe;
pub mod spool;
#[cfg(test)]
mod tests;

pub use memory::EtcdHeld;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::warn;

use self::spool::{Spool, SpoolError, SpoolKind, SpoolRecord};
use crate::error::ArbiterError;
use crate::records::now_unix_ms;

/// Knobs of the quorum-loss posture.
#[derive(Debug, Clone)]
pub struct QuorumLossConfig {
    /// How often the probe reads the lock cluster.
    pub probe_every: Duration,
    /// A probe read not answered in this time failed.
    pub probe_timeout: Duration,
    /// Failed probes in a row that make the cluster lost.
    pub failures_to_lose: u32,
    /// The spool's bound: the open spool and every file waiting for the
    /// audit tailer together (`--quorum-loss-spool-bytes`).
    pub spool_limit_bytes: u64,
}

pub const DEFAULT_SPOOL_LIMIT_BYTES: u64 = 16 << 20;

impl Default for QuorumLossConfig {
    fn default() -> Self {
        Self {
            probe_every: Duration::from_millis(500),
            probe_timeout: Duration::from_secs(1),
            failures_to_lose: 3,
            spool_limit_bytes: DEFAULT_SPOOL_LIMIT_BYTES,
        }
    }
}

/// How the posture meets the world outside the runtime: the wall clock
/// (spool records, and a replayed grant's time left) and the spool's
/// blocking file I/O. The defaults are the arbiter's; the simulation
/// (`sim/`) gives its paused clock and runs the I/O inline, so a seed's
/// task order does not depend on a thread pool.
#[derive(Clone)]
pub struct Seams {
    /// Milliseconds since the Unix epoch.
    pub wall_ms: Arc<dyn Fn() -> i64 + Send + Sync>,
    /// Run the spool's file I/O on the calling task instead of
    /// `spawn_blocking`.
    pub inline_io: bool,
}

impl Default for Seams {
    fn default() -> Self {
        Self {
            wall_ms: Arc::new(now_unix_ms),
            inline_io: false,
        }
    }
}

impl std::fmt::Debug for Seams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seams")
            .field("inline_io", &self.inline_io)
            .finish_non_exhaustive()
    }
}

/// A grant from memory: token 0, unprotected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryGrant {
    pub key: String,
    pub session: i64,
}

#[derive(Debug)]
struct MemoryHold {
    identity: String,
    /// The client instance it was granted to (LEAK against contention).
    instance: String,
    /// The grant subject it counts against ([`GrantRequest::bounded_as`]).
    bounded_as: String,
    session: i64,
    class: String,
    ttl_seconds: u32,
    id: i64,
    expires: Instant,
    /// Its spool line is being synced: held, but not yet answered (nor
    /// "already yours" to its session). It ends at `expires` like any hold,
    /// so a call cancelled while its line was synced keeps the key from
    /// others no longer than its TTL (the hostile reviews of this stop: a
    /// pending hold never expired, and clearing the flag on cancel let the
    /// session use a grant whose line was not on disk).
    pending: bool,
}

#[derive(Debug, Default)]
struct ProbeState {
    failures: u32,
    lost_since: Option<Instant>,
    last_error: String,
    /// When a probe was last answered.
    answered: Option<Instant>,
}

/// The posture's state: the probe's verdict, the memory grants, the spool.
#[derive(Debug)]
pub struct QuorumLoss {
    config: QuorumLossConfig,
    probe: Mutex<ProbeState>,
    holds: Mutex<HashMap<String, MemoryHold>>,
    waiting: Mutex<HashMap<String, u32>>,
    /// Woken when a memory hold ends.
    freed: Notify,
    spool: Arc<Spool>,
    arbiter: String,
    /// The lock cluster's id, for the spool's records.
    cluster_id: AtomicU64,
    seq: AtomicU64,
    max_holds_per_identity: u32,
    max_waiters_per_identity: u32,
    /// Unprotected grants made from memory since the start.
    granted_total: AtomicU64,
    seams: Seams,
}

/// The posture now, for `admin status` and the metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuorumSnapshot {
    /// The lock cluster has no quorum, as far as the probe knows.
    pub lost: bool,
    /// For how long (0 when not lost).
    pub lost_for_ms: u64,
    /// The last probe failure (empty when the last probe answered).
    pub last_error: String,
    /// Live unprotected memory grants.
    pub memory_grants: u64,
    /// Unprotected grants made since the arbiter started.
    pub unprotected_grants_total: u64,
    /// Bytes in the open spool and in spools the audit tailer has not
    /// collected yet.
    pub spool_bytes: u64,
    /// The spool's bound (`--quorum-loss-spool-bytes`).
    pub spool_limit_bytes: u64,
}

impl QuorumLoss {
    /// Opens the spool under `state_dir`; grants left in an open spool by an
    /// earlier run that are not released and within their TTL (by wall
    /// clock) are held again, so a restart during a loss keeps them exclusive.
    pub fn new(
        config: QuorumLossConfig,
        state_dir: &Path,
        max_holds_per_identity: u32,
        max_waiters_per_identity: u32,
    ) -> Result<Self, SpoolError> {
        Self::with_seams(
            config,
            state_dir,
            max_holds_per_identity,
            max_waiters_per_identity,
            Seams::default(),
        )
    }

    /// [`Self::new`] with its clock and I/O given ([`Seams`]).
    pub fn with_seams(
        config: QuorumLossConfig,
        state_dir: &Path,
        max_holds_per_identity: u32,
        max_waiters_per_identity: u32,
        seams: Seams,
    ) -> Result<Self, SpoolError> {
        let (spool, replay) = Spool::open(state_dir, config.spool_limit_bytes)?;
        let arbiter = state_dir
            .canonicalize()
            .unwrap_or_else(|_| state_dir.to_path_buf())
            .display()
            .to_string();
        let this = Self {
            config,
            probe: Mutex::new(ProbeState::default()),
            holds: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashMap::new()),
            freed: Notify::new(),
            spool: Arc::new(spool),
            arbiter,
            cluster_id: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            max_holds_per_identity,
            max_waiters_per_identity,
            granted_total: AtomicU64::new(0),
            seams,
        };
        this.replay(replay);
        Ok(this)
    }

    fn replay(&self, records: Vec<SpoolRecord>) {
        let now_ms = self.wall_ms();
        let now = Instant::now();
        let mut holds = self.holds.lock();
        for r in records {
            match r.kind {
                SpoolKind::Grant => {
                    let ends = r.at_unix_ms + i64::from(r.ttl_seconds) * 1000;
                    if ends > now_ms {
                        let left = Duration::from_millis(u64::try_from(ends - now_ms).unwrap_or(0));
                        holds.insert(
                            r.key.clone(),
                            MemoryHold {
                                bounded_as: r.bounded_as().to_string(),
                                identity: r.identity,
                                // Empty in spools from before it was kept:
                                // a leak of such a hold is answered as
                                // contention.
                                instance: r.instance,
                                session: r.session,
                                class: r.class,
                                ttl_seconds: r.ttl_seconds,
                                id: r.id,
                                expires: now + left,
                                pending: false,
                            },
                        );
                    }
                }
                SpoolKind::Release => {
                    if holds.get(&r.key).is_some_and(|h| h.id == r.id) {
                        holds.remove(&r.key);
                    }
                }
            }
        }
        if !holds.is_empty() {
            warn!(
                holds = holds.len(),
                "holding unprotected memory grants replayed from the quorum-loss spool"
            );
        }
    }

    fn wall_ms(&self) -> i64 {
        (self.seams.wall_ms)()
    }

    /// Runs `f` on the spool: on the blocking pool, or inline ([`Seams`]).
    async fn on_spool<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Spool) -> T + Send + 'static,
    ) -> Result<T, ArbiterError> {
        if self.seams.inline_io {
            return Ok(f(&self.spool));
        }
        let spool = Arc::clone(&self.spool);
        tokio::task::spawn_blocking(move || f(&spool))
            .await
            .map_err(|e| ArbiterError::internal_caused(format!("the spool task failed: {e}"), e))
    }

    /// The lock cluster's id (from the arbiter's first read), for the spool.
    pub fn set_cluster_id(&self, cluster_id: u64) {
        self.cluster_id.store(cluster_id, Ordering::Relaxed);
    }

    /// The posture now (status, metrics).
    pub fn snapshot(&self) -> QuorumSnapshot {
        let (lost_for, last_error) = {
            let probe = self.probe.lock();
            let error = match probe.failures {
                0 => String::new(),
                _ => probe.last_error.clone(),
            };
            (probe.lost_since.map(|t| t.elapsed()), error)
        };
        QuorumSnapshot {
            lost: lost_for.is_some(),
            lost_for_ms: lost_for.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            last_error,
            memory_grants: self.memory_holds() as u64,
            unprotected_grants_total: self.granted_total.load(Ordering::Relaxed),
            spool_bytes: self.spool.used_bytes(),
            spool_limit_bytes: self.config.spool_limit_bytes,
        }
    }

    /// When the lock cluster last answered the probe.
    pub fn log_answered(&self) -> Option<Instant> {
        self.probe.lock().answered
    }

    /// The lock cluster has no quorum, as far as the probe knows.
    pub fn is_lost(&self) -> bool {
        self.probe.lock().lost_since.is_some()
    }

    /// The refusal of a closed class during a loss.
    pub fn closed_refusal(&self, class: &str) -> ArbiterError {
        let (since, error) = {
            let probe = self.probe.lock();
            (
                probe.lost_since.map(|t| t.elapsed().as_secs()).unwrap_or(0),
                probe.last_error.clone(),
            )
        };
        ArbiterError::ClosedOnQuorumLoss {
            detail: format!(
                "the lock cluster has lost quorum (no etcd majority has answered for {since} s; last: {error}); class {class:?} is closed on quorum loss (onQuorumLoss = \"closed\"), so it grants nothing until quorum returns: retry later; operators: bring the etcd members back (docs/operations.md, quorum loss)"
            ),
        }
    }

    /// The refusal of a shared hold during a loss, on a class open to
    /// memory grants: shared holds are never granted from memory.
    pub fn shared_refusal(&self, class: &str) -> ArbiterError {
        let since = self
            .probe
            .lock()
            .lost_since
            .map(|t| t.elapsed().as_secs())
            .unwrap_or(0);
        ArbiterError::ClosedOnQuorumLoss {
            detail: format!(
                "the lock cluster has lost quorum (no etcd majority has answered for {since} s); class {class:?} grants exclusive holds from memory meanwhile, but never shared ones (one arbiter's memory cannot keep a writer on another arbiter from the readers): retry later, or acquire exclusively"
            ),
        }
    }

    /// Where closed spools wait for the audit tailer.
    pub fn ready_dir(&self) -> std::path::PathBuf {
        self.spool.ready_dir()
    }

    /// The open spool's path.
    pub fn spool_path(&self) -> std::path::PathBuf {
        self.spool.path()
    }
}
