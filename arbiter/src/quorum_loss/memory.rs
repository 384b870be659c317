//! Grants from memory while the cluster has no quorum: exclusive per key
//! on this arbiter, bounded per identity, spooled before they are
//! answered, and a live one keeps its key from the log's grants.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

use super::spool::{SpoolError, SpoolKind, SpoolRecord};
use super::{MemoryGrant, MemoryHold, QuorumLoss};
use crate::error::{ArbiterError, IdentityBound};
use crate::table::GrantRequest;

/// Whether a key may be held in the lock log by a session other than the
/// given one, as far as this arbiter knows: its hold-count watch shows it
/// held, or a grant of it from this arbiter is on its way to the log.
pub type EtcdHeld<'a> = dyn Fn(&str, i64) -> bool + Send + Sync + 'a;

/// How often a memory Acquire of a key held in etcd looks again.
const HELD_IN_LOG_RECHECK: Duration = Duration::from_millis(250);

/// A live memory grant keeps its key from every other session's etcd
/// grant, queued waiters' hand-overs included.
impl crate::table::KeyGate for QuorumLoss {
    fn blocked(&self, req: &GrantRequest) -> bool {
        let now = Instant::now();
        self.holds.lock().get(&req.key).is_some_and(|h| {
            h.expires > now && !(h.identity == req.identity && h.session == req.session)
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
        let at = self.wall_ms();
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
        // Held in etcd by another session when the quorum was lost (that
        // holder cannot renew, but its hold is not over either), or a grant
        // of the key from this arbiter on its way to the log: not taken from
        // memory; looked at again shortly (or when the loss ends). Asked
        // with the pending hold in place, which keeps the key from the
        // table's grants from now on (see `LockTable::writing`).
        if held_in_log(&req.key, req.session) {
            holds.remove(&req.key);
            return Ok(Attempt::Held(now + HELD_IN_LOG_RECHECK));
        }
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
            if !self.is_lost() {
                // The probe heard from a majority since: the log decides
                // again (a grant of the key may be on its way there).
                return Err(ArbiterError::store(
                    "the lock cluster has quorum again; retry, and the grant goes through etcd",
                ));
            }
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
                    // A release wakes us; an expiry is its own deadline.
                    let _ = tokio::time::timeout_at(expires.min(deadline), freed).await;
                }
            }
        }
    }

    async fn spool_grant(&self, record: SpoolRecord) -> Result<MemoryGrant, ArbiterError> {
        let line = record.clone();
        let written = self
            .on_spool(move |spool| spool.append(&line))
            .await
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
            (Ok(()), None) => Err(ArbiterError::internal(
                "the memory grant vanished while it was spooled",
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
                at_unix_ms: self.wall_ms(),
                token: 0,
                unprotected: true,
                arbiter: self.arbiter.clone(),
                cluster_id: self.cluster_id.load(Ordering::Relaxed),
            }
        };
        let id = record.id;
        // The release is recorded when the spool has room; the grant line
        // (already synced) is what the audit trail must not miss.
        match self.on_spool(move |spool| spool.append(&record)).await {
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
                    Some(h) if h.expires <= now => {
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
}
