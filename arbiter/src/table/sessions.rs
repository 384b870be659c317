//! Sessions: one lease per (identity, TTL) with every hold attached, its
//! record, and its entry in the identity's session count.

use crate::error::{ArbiterError, IdentityBound};
use crate::lock_log::{Renewal, StoreError};
use crate::records::{SessionRecord, decode, encode};

use super::LockTable;

/// How many fresh ids an OpenSession tries when the log says the lease exists.
const LEASE_ID_ATTEMPTS: usize = 4;

/// Set in the id of every session of the coord tier's table when the tiers
/// are split (ADR-07): a session-scoped call (KeepAlive, CloseSession) finds
/// its cluster from the id alone. Bit 52, so ids stay below 2^53.
pub const COORD_SESSION_BIT: i64 = 1 << 52;

/// Session ids are lease ids the arbiter draws itself: positive, below 2^52
/// before a table's tag (below 2^53 after: exact in a JSON number or a
/// double), from the OS's CSPRNG, so knowing one session id tells nothing
/// about another's.
pub fn random_lease_id() -> Result<i64, ArbiterError> {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes)
        // getrandom's error (no_std) is not a std error: its text is all.
        .map_err(|e| ArbiterError::internal(format!("no randomness for a session id: {e}")))?;
    let id = i64::from_le_bytes(bytes) & (COORD_SESSION_BIT - 1);
    // 0 means "let etcd choose" to LeaseGrant: draw again rather than allow it
    Ok(if id == 0 { 1 } else { id })
}

impl LockTable {
    /// How many sessions `identity` has open, over every arbiter, and the
    /// log revision the count is of.
    pub async fn count_sessions_of(&self, identity: &str) -> Result<(u32, i64), ArbiterError> {
        let (n, header) = self
            .seal
            .checked(self.log.count_sessions_of(identity))
            .await?;
        Ok((n, header.revision))
    }

    /// Opens a session: a lease with an id of our own drawing, its record and
    /// its entry in the identity's session count, both on the lease. Refused
    /// when the identity already has `max_sessions` open (counted just
    /// before). Concurrent opens of one identity may overshoot: the service
    /// bounds opens by the session counts the watch keeps instead
    /// ([`crate::session_counts`]) and calls [`Self::create_session`].
    pub async fn open_session(
        &self,
        identity: &str,
        ttl_seconds: u32,
        max_sessions: u32,
    ) -> Result<i64, ArbiterError> {
        if self.count_sessions_of(identity).await?.0 >= max_sessions {
            return Err(ArbiterError::IdentityLimit {
                bound: IdentityBound::Sessions,
                limit: max_sessions,
            });
        }
        Ok(self
            .create_session(identity, identity, ttl_seconds, |_| {})
            .await?
            .0)
    }

    /// Creates a session (lease, record, count entry) without counting: its
    /// id and the log revision its count entry was written at. The entry is
    /// counted against grant subject `counted_as` (`identity`, or the pattern
    /// it falls under: issue 30). `writing` hears the session's id once its
    /// lease is granted, before the entry is written (a watch on the entries
    /// may show the entry before this call answers).
    pub async fn create_session(
        &self,
        identity: &str,
        counted_as: &str,
        ttl_seconds: u32,
        writing: impl FnOnce(i64),
    ) -> Result<(i64, i64), ArbiterError> {
        let mut attempt = 0;
        let id = loop {
            attempt += 1;
            let id = random_lease_id()? | self.options.session_tag;
            let mark = self.seal.mark_before_request();
            match self.log.grant_lease(id, ttl_seconds).await {
                // A lease call's revision says nothing: only its cluster id
                // is checked.
                Ok(answer) => {
                    self.seal
                        .observe(mark, answer.header.cluster_id, None)
                        .await?;
                    break id;
                }
                Err(StoreError::LeaseExists { .. }) if attempt < LEASE_ID_ATTEMPTS => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let record = encode(&SessionRecord {
            identity: identity.to_string(),
            ttl_seconds,
        });
        writing(id);
        let ((), header) = self
            .seal
            .checked(self.log.put_session(id, counted_as, record))
            .await?;
        Ok((id, header.revision))
    }

    pub async fn session(&self, lease: i64) -> Result<Option<SessionRecord>, ArbiterError> {
        let (kv, _) = self.seal.checked(self.log.session(lease)).await?;
        Ok(kv.and_then(|kv| decode(&kv.value)))
    }

    /// Closes `identity`'s session: one transaction deletes its record and
    /// its entry in the count of grant subject `counted_as` (the subject it
    /// was opened under, which the record does not say) only if the record
    /// still names `identity`, so from then on no grant, renewal or
    /// hand-over uses it; then the lease is revoked, which ends every hold
    /// on it in one entry (and the entry, had `counted_as` missed it).
    /// Someone else's session, or one that is gone, is `SessionExpired`
    /// alike. If the revoke fails after the delete, the holds end with the
    /// TTL (nobody can renew the session any more). Answers the revision of
    /// the delete.
    pub async fn close_session(
        &self,
        identity: &str,
        counted_as: &str,
        session: i64,
    ) -> Result<i64, ArbiterError> {
        let (kv, _) = self.seal.checked(self.log.session(session)).await?;
        let Some(kv) = kv else {
            return Err(ArbiterError::SessionExpired { session });
        };
        let owned = decode::<SessionRecord>(&kv.value).is_some_and(|r| r.identity == identity);
        if !owned || kv.lease != session {
            return Err(ArbiterError::SessionExpired { session });
        }
        let (deleted, header) = self
            .seal
            .checked(self.log.delete_session(session, counted_as, kv.value))
            .await?;
        if !deleted {
            return Err(ArbiterError::SessionExpired { session });
        }
        self.log.revoke(session).await?;
        Ok(header.revision)
    }

    /// Renews `lease` once; a TTL of 0 or less means the log no longer has it.
    pub async fn renew(&self, lease: i64) -> Result<Renewal, ArbiterError> {
        Ok(self.log.renew(lease).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 32: an unavailable store keeps what failed underneath as the
    /// error's source, down to the transport's own error.
    #[test]
    fn a_store_error_keeps_its_source_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let store = StoreError::Unavailable {
            context: "the grant transaction".into(),
            source: Some(Box::new(io)),
        };
        let err = ArbiterError::from(store);
        assert_eq!(
            crate::error::source_chain(&err),
            "the grant transaction: reset by peer"
        );
        // The message a person reads is what it was.
        assert!(err.to_string().contains("the grant transaction"), "{err}");
    }
}
