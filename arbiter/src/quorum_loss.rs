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

pub mod spool;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{info, warn};

use self::spool::{Spool, SpoolError, SpoolKind, SpoolRecord};
use crate::error::{ArbiterError, IdentityBound};
use crate::lock_log::LockLog;
use crate::records::now_unix_ms;
use crate::table::GrantRequest;

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
    /// Its spool line is being synced: held, but not yet answered.
    pending: bool,
}

#[derive(Debug, Default)]
struct ProbeState {
    failures: u32,
    lost_since: Option<Instant>,
    last_error: String,
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

/// Whether a key is held in the lock log by a session other than the given
/// one, as far as this arbiter has seen (its hold-count watch).
pub type EtcdHeld<'a> = dyn Fn(&str, i64) -> bool + Send + Sync + 'a;

/// How often a memory Acquire of a key held in etcd looks again.
const HELD_IN_LOG_RECHECK: Duration = Duration::from_millis(250);

/// A live memory grant keeps its key from every other session's etcd
/// grant, queued waiters' hand-overs included.
impl crate::table::KeyGate for QuorumLoss {
    fn blocked(&self, req: &GrantRequest) -> bool {
        let now = Instant::now();
        self.holds.lock().get(&req.key).is_some_and(|h| {
            (h.pending || h.expires > now)
                && !(h.identity == req.identity && h.session == req.session)
        })
    }
}

/// One waiting memory Acquire of an identity; counted down on drop.
struct Waiting<'a> {
    owner: &'a QuorumLoss,
    identity: String,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waiting = self.owner.waiting.lock();
        if let Some(n) = waiting.get_mut(&self.identity) {
            *n -= 1;
            if *n == 0 {
                waiting.remove(&self.identity);
            }
        }
    }
}

enum Attempt {
    /// Already this session's.
    Yours,
    /// Reserved: spool it, then answer.
    Spool(SpoolRecord),
    /// Another session's until then.
    Held(Instant),
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
        };
        this.replay(replay);
        Ok(this)
    }

    fn replay(&self, records: Vec<SpoolRecord>) {
        let now_ms = now_unix_ms();
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
        ArbiterError::store(format!(
            "the lock cluster has lost quorum (no etcd majority has answered for {since} s; last: {error}); class {class:?} is closed on quorum loss (onQuorumLoss = \"closed\"), so it grants nothing until quorum returns: retry later; operators: bring the etcd members back (docs/operations.md, quorum loss)"
        ))
    }

    /// Where closed spools wait for the audit tailer.
    pub fn ready_dir(&self) -> std::path::PathBuf {
        self.spool.ready_dir()
    }

    /// The open spool's path.
    pub fn spool_path(&self) -> std::path::PathBuf {
        self.spool.path()
    }

    /// Starts the probe; it ends when the handle drops.
    pub fn spawn_probe(self: &Arc<Self>, log: Arc<dyn LockLog>) -> tokio_util::task::AbortOnDrop {
        let this = Arc::clone(self);
        let task = tokio::spawn(async move {
            loop {
                let outcome =
                    match tokio::time::timeout(this.config.probe_timeout, log.records()).await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err(format!(
                            "no answer in {} ms",
                            this.config.probe_timeout.as_millis()
                        )),
                    };
                this.observe(outcome).await;
                tokio::time::sleep(this.config.probe_every).await;
            }
        });
        tokio_util::task::AbortOnDrop::new(task.abort_handle())
    }

    /// One probe's outcome.
    async fn observe(&self, outcome: Result<(), String>) {
        match outcome {
            Ok(()) => {
                let was = {
                    let mut probe = self.probe.lock();
                    probe.failures = 0;
                    probe.lost_since.take()
                };
                if let Some(since) = was {
                    info!(
                        lost_for_ms = since.elapsed().as_millis() as u64,
                        "the lock cluster has quorum again: grants go through etcd"
                    );
                }
                if self.spool.open_bytes() > 0 {
                    self.ship().await;
                }
            }
            Err(error) => {
                let mut probe = self.probe.lock();
                probe.failures = probe.failures.saturating_add(1);
                probe.last_error = error;
                if probe.lost_since.is_none() && probe.failures >= self.config.failures_to_lose {
                    probe.lost_since = Some(Instant::now());
                    warn!(
                        failures = probe.failures,
                        error = %probe.last_error,
                        "the lock cluster has LOST QUORUM: closed classes refuse, open classes grant unprotected from memory"
                    );
                }
            }
        }
    }

    /// Closes the open spool into `ready/` (for the audit tailer).
    async fn ship(&self) {
        let spool = Arc::clone(&self.spool);
        match tokio::task::spawn_blocking(move || spool.ship()).await {
            Ok(Ok(Some(path))) => info!(
                path = %path.display(),
                "shipped the quorum-loss spool (unprotected grants) for the audit tailer"
            ),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => warn!(error = %e, "cannot ship the quorum-loss spool; will retry"),
            Err(e) => warn!(error = %e, "the spool shipping task failed; will retry"),
        }
    }

    fn enter_wait(&self, identity: &str) -> Result<Waiting<'_>, ArbiterError> {
        let mut waiting = self.waiting.lock();
        let n = waiting.entry(identity.to_string()).or_insert(0);
        if *n >= self.max_waiters_per_identity {
            return Err(ArbiterError::TooManyWaiters {
                limit: self.max_waiters_per_identity,
            });
        }
        *n += 1;
        Ok(Waiting {
            owner: self,
            identity: identity.to_string(),
        })
    }

    fn attempt(
        &self,
        req: &GrantRequest,
        held_in_log: &EtcdHeld<'_>,
    ) -> Result<Attempt, ArbiterError> {
        let now = Instant::now();
        let mut holds = self.holds.lock();
        if let Some(h) = holds.get(&req.key)
            && h.expires <= now
            && !h.pending
        {
            holds.remove(&req.key);
        }
        if let Some(h) = holds.get(&req.key) {
            if h.identity == req.identity && h.session == req.session && !h.pending {
                return Ok(Attempt::Yours);
            }
            if crate::table::is_leak(&h.identity, &h.instance, h.session, req) {
                return Err(ArbiterError::Leak {
                    key: req.key.clone(),
                    holder_session: h.session,
                    session: req.session,
                    instance: req.instance.clone(),
                });
            }
            return Ok(Attempt::Held(h.expires));
        }
        // Held in etcd by another session when the quorum was lost: that
        // holder cannot renew, but its hold is not over either. Not taken
        // from memory; looked at again shortly (or when the loss ends).
        if held_in_log(&req.key, req.session) {
            return Ok(Attempt::Held(now + HELD_IN_LOG_RECHECK));
        }
        let mine = holds
            .values()
            .filter(|h| h.bounded_as == req.bounded_as() && h.expires > now)
            .count();
        if mine >= self.max_holds_per_identity as usize {
            return Err(ArbiterError::IdentityLimit {
                bound: IdentityBound::Holds,
                limit: self.max_holds_per_identity,
            });
        }
        let at = now_unix_ms();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let id = (at << 12) | i64::try_from(seq & 0xfff).unwrap_or(0);
        holds.insert(
            req.key.clone(),
            MemoryHold {
                identity: req.identity.clone(),
                instance: req.instance.clone(),
                bounded_as: req.bounded_as().to_string(),
                session: req.session,
                class: req.class.clone(),
                ttl_seconds: req.ttl_seconds,
                id,
                expires: now + Duration::from_secs(u64::from(req.ttl_seconds)),
                pending: true,
            },
        );
        Ok(Attempt::Spool(SpoolRecord {
            id,
            kind: SpoolKind::Grant,
            key: req.key.clone(),
            identity: req.identity.clone(),
            bound: req.bound.clone(),
            instance: req.instance.clone(),
            session: req.session,
            class: req.class.clone(),
            ttl_seconds: req.ttl_seconds,
            at_unix_ms: at,
            token: 0,
            unprotected: true,
            arbiter: self.arbiter.clone(),
            cluster_id: self.cluster_id.load(Ordering::Relaxed),
        }))
    }

    /// Grants `req` from memory (the cluster is lost and the class open):
    /// at once, or after waiting up to `wait` for the key's memory holder.
    /// The grant is in the synced spool before this returns.
    pub async fn acquire(
        &self,
        req: &GrantRequest,
        wait: Option<Duration>,
        held_in_log: &EtcdHeld<'_>,
    ) -> Result<MemoryGrant, ArbiterError> {
        let deadline = wait.map(|w| Instant::now() + w);
        let _waiting = match wait {
            Some(_) => Some(self.enter_wait(req.bounded_as())?),
            None => None,
        };
        loop {
            let freed = self.freed.notified();
            match self.attempt(req, held_in_log)? {
                Attempt::Yours => {
                    return Ok(MemoryGrant {
                        key: req.key.clone(),
                        session: req.session,
                    });
                }
                Attempt::Spool(record) => return self.spool_grant(record).await,
                Attempt::Held(expires) => {
                    let Some(deadline) = deadline else {
                        return Err(ArbiterError::Held {
                            key: req.key.clone(),
                        });
                    };
                    if Instant::now() >= deadline {
                        return Err(ArbiterError::WaitTimeout {
                            key: req.key.clone(),
                        });
                    }
                    if !self.is_lost() {
                        return Err(ArbiterError::store(
                            "the lock cluster has quorum again while this call waited for an unprotected grant; retry, and it goes through etcd",
                        ));
                    }
                    // A release wakes us; an expiry is its own deadline.
                    let _ = tokio::time::timeout_at(expires.min(deadline), freed).await;
                }
            }
        }
    }

    async fn spool_grant(&self, record: SpoolRecord) -> Result<MemoryGrant, ArbiterError> {
        let spool = Arc::clone(&self.spool);
        let line = record.clone();
        let written = tokio::task::spawn_blocking(move || spool.append(&line))
            .await
            .map_err(|e| ArbiterError::Internal(format!("the spool task failed: {e}")))
            .and_then(|r| {
                r.map_err(|e| match e {
                    SpoolError::Share { share, .. } => ArbiterError::IdentityLimit {
                        bound: IdentityBound::Spool,
                        limit: u32::try_from(share).unwrap_or(u32::MAX),
                    },
                    e => ArbiterError::store_caused(e.to_string(), e),
                })
            });
        let mut holds = self.holds.lock();
        let ours = holds.get_mut(&record.key).filter(|h| h.id == record.id);
        match (written, ours) {
            (Ok(()), Some(hold)) => {
                hold.pending = false;
                self.granted_total.fetch_add(1, Ordering::Relaxed);
                info!(identity = %record.identity, key = %record.key, class = %record.class, "granted UNPROTECTED from memory during quorum loss (token 0, spooled)");
                Ok(MemoryGrant {
                    key: record.key,
                    session: record.session,
                })
            }
            (Ok(()), None) => Err(ArbiterError::Internal(
                "the memory grant vanished while it was spooled".into(),
            )),
            (Err(e), _) => {
                holds.remove(&record.key);
                drop(holds);
                self.freed.notify_waiters();
                Err(e)
            }
        }
    }

    /// Releases the caller's memory grant of `key` (token 0). `None`: there
    /// is no such memory grant, and the lock log answers instead.
    pub async fn release(
        &self,
        identity: &str,
        key: &str,
        session: i64,
        token: u64,
    ) -> Option<Result<(), ArbiterError>> {
        if token != 0 {
            return None;
        }
        // The hold stays until its release line is written: the next
        // grant of the key is spooled after it, never before.
        let record = {
            let holds = self.holds.lock();
            let hold = holds.get(key).filter(|h| {
                h.identity == identity
                    && h.session == session
                    && !h.pending
                    && h.expires > Instant::now()
            })?;
            SpoolRecord {
                id: hold.id,
                kind: SpoolKind::Release,
                key: key.to_string(),
                identity: hold.identity.clone(),
                bound: match hold.bounded_as == hold.identity {
                    true => String::new(),
                    false => hold.bounded_as.clone(),
                },
                instance: hold.instance.clone(),
                session: hold.session,
                class: hold.class.clone(),
                ttl_seconds: hold.ttl_seconds,
                at_unix_ms: now_unix_ms(),
                token: 0,
                unprotected: true,
                arbiter: self.arbiter.clone(),
                cluster_id: self.cluster_id.load(Ordering::Relaxed),
            }
        };
        let id = record.id;
        let spool = Arc::clone(&self.spool);
        // The release is recorded when the spool has room; the grant line
        // (already synced) is what the audit trail must not miss.
        match tokio::task::spawn_blocking(move || spool.append(&record)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %e, "a memory grant's release is not in the spool"),
            Err(e) => warn!(error = %e, "the spool task failed"),
        }
        {
            let mut holds = self.holds.lock();
            if holds.get(key).is_some_and(|h| h.id == id) {
                holds.remove(key);
            }
        }
        self.freed.notify_waiters();
        info!(identity = %identity, key = %key, "released an unprotected memory grant");
        Some(Ok(()))
    }

    /// Before a grant through etcd: a live memory grant of the key by another
    /// session keeps it (try-lock: `HELD`; waiting: until it ends or the
    /// deadline). The same session's memory grant yields to its etcd grant.
    pub async fn before_log_grant(
        &self,
        req: &GrantRequest,
        wait: Option<Duration>,
    ) -> Result<(), ArbiterError> {
        let deadline = wait.map(|w| Instant::now() + w);
        loop {
            let freed = self.freed.notified();
            let expires = {
                let now = Instant::now();
                let mut holds = self.holds.lock();
                match holds.get(&req.key) {
                    None => return Ok(()),
                    Some(h) if h.expires <= now && !h.pending => {
                        holds.remove(&req.key);
                        return Ok(());
                    }
                    Some(h) if h.identity == req.identity && h.session == req.session => {
                        return Ok(());
                    }
                    Some(h) => h.expires,
                }
            };
            let Some(deadline) = deadline else {
                return Err(ArbiterError::Held {
                    key: req.key.clone(),
                });
            };
            if Instant::now() >= deadline {
                return Err(ArbiterError::WaitTimeout {
                    key: req.key.clone(),
                });
            }
            // Waiting is not new work: the call's admission place goes back.
            crate::overload::parked();
            let _ = tokio::time::timeout_at(expires.min(deadline), freed).await;
        }
    }

    /// The session now holds `key` in etcd: its memory grant (if any) ends.
    pub fn granted_in_log(&self, key: &str, session: i64) {
        let mut holds = self.holds.lock();
        if holds.get(key).is_some_and(|h| h.session == session) {
            holds.remove(key);
        }
    }

    /// Live memory grants (status, metrics).
    pub fn memory_holds(&self) -> usize {
        let now = Instant::now();
        self.holds
            .lock()
            .values()
            .filter(|h| h.expires > now)
            .count()
    }

    #[cfg(test)]
    async fn observe_for_test(&self, outcome: Result<(), String>) {
        self.observe(outcome).await;
    }

    #[cfg(test)]
    fn lose_for_test(&self) {
        self.probe.lock().lost_since = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// Nothing held in the lock log.
    static FREE: fn(&str, i64) -> bool = |_, _| false;

    fn req(key: &str, identity: &str, session: i64) -> GrantRequest {
        GrantRequest {
            key: key.into(),
            identity: identity.into(),
            session,
            class: "batch".into(),
            ttl_seconds: 30,
            annotations: BTreeMap::new(),
            routed_by: None,
            instance: format!("{identity}-process"),
            bound: String::new(),
        }
    }

    fn posture(dir: &Path, limit: u64) -> QuorumLoss {
        posture_with(dir, limit, 2)
    }

    /// A posture whose cluster is lost, `max_holds` per identity.
    fn posture_with(dir: &Path, limit: u64, max_holds: u32) -> QuorumLoss {
        let q = QuorumLoss::new(
            QuorumLossConfig {
                spool_limit_bytes: limit,
                ..QuorumLossConfig::default()
            },
            dir,
            max_holds,
            1,
        )
        .unwrap();
        q.lose_for_test();
        q
    }

    #[tokio::test]
    async fn lost_after_failures_in_a_row_healthy_after_one_answer() {
        let dir = tempfile::tempdir().unwrap();
        let q = QuorumLoss::new(QuorumLossConfig::default(), dir.path(), 2, 1).unwrap();
        assert!(!q.is_lost());
        q.observe_for_test(Err("no leader".into())).await;
        q.observe_for_test(Err("no leader".into())).await;
        q.observe_for_test(Ok(())).await;
        q.observe_for_test(Err("no leader".into())).await;
        q.observe_for_test(Err("no leader".into())).await;
        assert!(!q.is_lost(), "an answer resets the count");
        q.observe_for_test(Err("no leader".into())).await;
        assert!(q.is_lost());
        let msg = q.closed_refusal("ledger").to_string();
        assert!(msg.contains("lost quorum"), "{msg}");
        assert!(
            msg.contains("class \"ledger\" is closed on quorum loss"),
            "{msg}"
        );
        assert!(msg.contains("retry later"), "{msg}");
        q.observe_for_test(Ok(())).await;
        assert!(!q.is_lost());
    }

    #[tokio::test]
    async fn a_memory_grant_is_spooled_before_it_is_answered_and_exclusive() {
        let dir = tempfile::tempdir().unwrap();
        let q = posture(dir.path(), 1 << 20);
        q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
        // On disk (synced) by the time the caller hears of it.
        let lines = spool::read(&q.spool_path()).unwrap();
        assert_eq!(lines.len(), 1);
        assert_eq!((lines[0].token, lines[0].unprotected), (0, true));
        assert_eq!(lines[0].kind, SpoolKind::Grant);
        // Exclusive in memory; the same session hears "already yours".
        assert!(matches!(
            q.acquire(&req("k/1", "b", 2), None, &FREE).await,
            Err(ArbiterError::Held { .. })
        ));
        assert!(matches!(
            q.acquire(&req("k/1", "a", 3), None, &FREE).await,
            Err(ArbiterError::Leak { .. })
        ));
        // Another instance of the same identity (a replica): contention.
        let mut replica = req("k/1", "a", 4);
        replica.instance = "a-replica".into();
        assert!(matches!(
            q.acquire(&replica, None, &FREE).await,
            Err(ArbiterError::Held { .. })
        ));
        q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
        assert_eq!(spool::read(&q.spool_path()).unwrap().len(), 1);
        // A waiter gets it on release; the release is spooled too.
        let b = req("k/1", "b", 2);
        let waiter = q.acquire(&b, Some(Duration::from_secs(5)), &FREE);
        let release = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            q.release("a", "k/1", 1, 0).await
        };
        let (granted, released) = tokio::join!(waiter, release);
        granted.unwrap();
        assert!(matches!(released, Some(Ok(()))));
        let kinds: Vec<SpoolKind> = spool::read(&q.spool_path())
            .unwrap()
            .iter()
            .map(|r| r.kind)
            .collect();
        assert_eq!(
            kinds,
            [SpoolKind::Grant, SpoolKind::Release, SpoolKind::Grant]
        );
        // A real token is never a memory release.
        assert!(q.release("b", "k/1", 2, 5).await.is_none());
    }

    #[tokio::test]
    async fn bounded_per_identity_and_by_the_spool() {
        let dir = tempfile::tempdir().unwrap();
        let q = posture(dir.path(), 1 << 20);
        q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
        q.acquire(&req("k/2", "a", 1), None, &FREE).await.unwrap();
        assert!(matches!(
            q.acquire(&req("k/3", "a", 1), None, &FREE).await,
            Err(ArbiterError::IdentityLimit { .. })
        ));
        // One waiter per identity here.
        let b1 = req("k/1", "b", 2);
        let first = q.acquire(&b1, Some(Duration::from_millis(300)), &FREE);
        let second = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            q.acquire(&req("k/2", "b", 2), Some(Duration::from_millis(300)), &FREE)
                .await
        };
        let (first, second) = tokio::join!(first, second);
        assert!(matches!(first, Err(ArbiterError::WaitTimeout { .. })));
        assert!(matches!(second, Err(ArbiterError::TooManyWaiters { .. })));

        // A full spool refuses and keeps nothing (here: files the audit
        // tailer has not collected fill it).
        let small = tempfile::tempdir().unwrap();
        let ready = small.path().join("quorum-loss").join("ready");
        std::fs::create_dir_all(&ready).unwrap();
        std::fs::write(ready.join("1-1-1.jsonl"), vec![b'x'; 64 << 10]).unwrap();
        let q = posture(small.path(), 64 << 10);
        let err = q
            .acquire(&req("k/1", "a", 1), None, &FREE)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("spool is full"), "{err}");
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert_eq!(q.memory_holds(), 0);
    }

    #[tokio::test]
    async fn one_identity_cannot_use_up_the_spool_for_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let q = posture_with(dir.path(), 64 << 10, 10_000);
        let mut granted = 0;
        let refused = loop {
            match q
                .acquire(&req(&format!("a/{granted}"), "a", 1), None, &FREE)
                .await
            {
                Ok(_) => granted += 1,
                Err(e) => break e,
            }
        };
        assert!(granted > 0, "{refused}");
        assert!(
            matches!(
                refused,
                ArbiterError::IdentityLimit {
                    bound: IdentityBound::Spool,
                    ..
                }
            ),
            "{refused}"
        );
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.to_string().contains("share"), "{refused}");
        // Another identity still gets its unprotected grants.
        q.acquire(&req("b/0", "b", 2), None, &FREE).await.unwrap();
        // Every grant taken keeps room for its release line.
        for i in 0..granted {
            let released = q.release("a", &format!("a/{i}"), 1, 0).await;
            assert!(matches!(released, Some(Ok(()))), "{released:?}");
        }
        let lines = spool::read(&q.spool_path()).unwrap();
        assert_eq!(lines.len(), 2 * granted + 1);
    }

    /// Per-pod identities under one pattern grant share its spool share
    /// (issue 30), and a restart restores each hold against the pattern
    /// and with its instance.
    #[tokio::test]
    async fn pods_under_one_pattern_share_one_spool_share() {
        let dir = tempfile::tempdir().unwrap();
        let q = posture_with(dir.path(), 64 << 10, 10_000);
        let pod = |i: usize| {
            let mut r = req(&format!("a/{i}"), &format!("pods/p{i}"), 1);
            r.bound = "pods/*".into();
            r
        };
        let mut granted = 0;
        let refused = loop {
            match q.acquire(&pod(granted), None, &FREE).await {
                Ok(_) => granted += 1,
                Err(e) => break e,
            }
        };
        assert!(
            matches!(
                refused,
                ArbiterError::IdentityLimit {
                    bound: IdentityBound::Spool,
                    ..
                }
            ),
            "every pod its own share would have filled the spool: {refused}"
        );
        // Another subject still gets its unprotected grants.
        q.acquire(&req("b/0", "b", 2), None, &FREE).await.unwrap();
        let lines = spool::read(&q.spool_path()).unwrap();
        assert!(
            lines
                .iter()
                .all(|l| l.identity == "b" || l.bounded_as() == "pods/*")
        );
        assert!(lines.iter().any(|l| l.instance == "pods/p0-process"));
    }

    #[tokio::test]
    async fn a_key_held_in_etcd_by_another_session_is_not_granted_from_memory() {
        let dir = tempfile::tempdir().unwrap();
        let q = posture(dir.path(), 1 << 20);
        let held_by_7 = |key: &str, session: i64| key == "k/1" && session != 7;
        let refused = q.acquire(&req("k/1", "a", 1), None, &held_by_7).await;
        assert!(
            matches!(refused, Err(ArbiterError::Held { .. })),
            "{refused:?}"
        );
        // waiting: until the deadline, or the loss ends
        let refused = q
            .acquire(
                &req("k/1", "a", 1),
                Some(Duration::from_millis(600)),
                &held_by_7,
            )
            .await;
        assert!(
            matches!(refused, Err(ArbiterError::WaitTimeout { .. })),
            "{refused:?}"
        );
        // the holder's own session, and other keys, are served
        q.acquire(&req("k/1", "h", 7), None, &held_by_7)
            .await
            .unwrap();
        q.acquire(&req("k/2", "a", 1), None, &held_by_7)
            .await
            .unwrap();
        assert_eq!(q.memory_holds(), 2);
    }

    #[tokio::test]
    async fn a_live_memory_grant_gates_the_table_for_every_other_session() {
        use crate::table::KeyGate as _;
        let dir = tempfile::tempdir().unwrap();
        let q = posture(dir.path(), 1 << 20);
        q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
        assert!(q.blocked(&req("k/1", "b", 2)), "another identity");
        assert!(
            q.blocked(&req("k/1", "a", 3)),
            "another session of the holder"
        );
        assert!(
            !q.blocked(&req("k/1", "a", 1)),
            "the memory grant's own session"
        );
        assert!(!q.blocked(&req("k/2", "b", 2)), "another key");
        q.release("a", "k/1", 1, 0).await.unwrap().unwrap();
        assert!(!q.blocked(&req("k/1", "b", 2)), "ended");
    }

    #[tokio::test]
    async fn a_restart_during_the_loss_replays_live_grants_and_recovery_ships() {
        let dir = tempfile::tempdir().unwrap();
        {
            let q = posture(dir.path(), 1 << 20);
            q.acquire(&req("k/1", "a", 1), None, &FREE).await.unwrap();
            q.acquire(&req("k/2", "a", 1), None, &FREE).await.unwrap();
            q.release("a", "k/2", 1, 0).await.unwrap().unwrap();
        }
        let q = posture(dir.path(), 1 << 20);
        assert_eq!(q.memory_holds(), 1);
        assert!(matches!(
            q.acquire(&req("k/1", "b", 2), None, &FREE).await,
            Err(ArbiterError::Held { .. })
        ));
        q.acquire(&req("k/2", "b", 2), None, &FREE).await.unwrap();
        // Quorum back: the spool goes to ready/, whole.
        q.observe_for_test(Ok(())).await;
        assert!(!q.spool_path().exists());
        let ready: Vec<_> = std::fs::read_dir(q.ready_dir())
            .unwrap()
            .flatten()
            .collect();
        assert_eq!(ready.len(), 1);
        assert_eq!(spool::read(&ready[0].path()).unwrap().len(), 4);
        // A live memory grant keeps its key from etcd grants to others.
        assert!(matches!(
            q.before_log_grant(&req("k/1", "b", 2), None).await,
            Err(ArbiterError::Held { .. })
        ));
        q.before_log_grant(&req("k/1", "a", 1), None).await.unwrap();
        q.before_log_grant(&req("k/9", "b", 2), None).await.unwrap();
        q.granted_in_log("k/1", 1);
        q.before_log_grant(&req("k/1", "b", 2), None).await.unwrap();
    }
}
