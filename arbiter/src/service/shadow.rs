//! Shadow sessions (ADR-09, ADR-10): a session is one lease on the entity
//! (home) cluster; a key homed on another shard is held there on the
//! session's *shadow*, a lease of the same id and TTL with a copy of the
//! session record, made on the first Acquire that needs it.
//!
//! - **Never shorter than the session.** A shadow is made with the full TTL
//!   after the session's record was read, and every renewal of the session
//!   renews every shard's shadow in the same call, each sent after the
//!   client asked (the client's deadline counts from its own send). A
//!   renewal that cannot reach a shard fails the session's renewal: the
//!   holder stops work as after any failed keepalive (ADR-12). The renewal
//!   memo is not used while there are other shards: it knows the home
//!   cluster's renewals only.
//! - **At most one TTL longer.** A shadow made just before the session ended
//!   outlives it by up to its TTL (a liveness cost: its holds are freed when
//!   it expires). Closing a session, or finding it gone on renewal,
//!   revokes its shadows.
//! - **Owned like the session.** The shadow's record is the session's record,
//!   byte for byte, so the grant transaction's compare of the session record
//!   and every ownership check work unchanged; it is made only for the
//!   session's owner. Shadows do not count against the identity's session
//!   bound (only the home and coord clusters' sessions are counted).

use super::Arbiter;
use crate::error::ArbiterError;
use crate::lock_log::{Renewal, StoreError};
use crate::records::{SessionRecord, decode};
use crate::tiers::Cluster;

impl Arbiter {
    /// Makes sure `identity`'s `session` has its shadow on `cluster`.
    pub(crate) async fn ensure_shadow(
        &self,
        cluster: &Cluster,
        identity: &str,
        session: i64,
    ) -> Result<(), ArbiterError> {
        let table = &cluster.table;
        let (here, _) = table.seal().checked(table.log().session(session)).await?;
        if here.is_some() {
            return Ok(());
        }
        let home = &self.tiers.entity().table;
        let (kv, _) = home.seal().checked(home.log().session(session)).await?;
        let record = kv
            .as_ref()
            .and_then(|kv| decode::<SessionRecord>(&kv.value))
            .filter(|r| r.identity == identity)
            .ok_or(ArbiterError::SessionExpired { session })?;
        let value = kv.map(|kv| kv.value).unwrap_or_default();
        match table.log().grant_lease(session, record.ttl_seconds).await {
            Ok(_) | Err(StoreError::LeaseExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        table.log().put_session(session, identity, value).await?;
        Ok(())
    }

    /// Renews `session`'s shadows on every other shard the map names: the
    /// shortest time left among them, counted from each renewal's send
    /// (`None`: no shadow anywhere). A shard of the map this arbiter is not
    /// connected to, or cannot renew on, fails the renewal: a shadow there
    /// would expire unseen.
    pub(crate) async fn renew_shadows(&self, session: i64) -> Result<Option<i64>, ArbiterError> {
        let Some(shards) = self.tiers.shards() else {
            return Ok(None);
        };
        let mut shortest: Option<i64> = None;
        for name in shards.other_names() {
            let cluster = shards.cluster(&name).ok_or_else(|| {
                ArbiterError::store(format!(
                    "shard {name:?} of the shard map is not connected to this arbiter, so the session's shadow there cannot be renewed"
                ))
            })?;
            let r = cluster.table.renew(session).await?;
            if r.ttl_seconds > 0 {
                let left = time_left(&r);
                shortest = Some(shortest.map_or(left, |s| s.min(left)));
            }
        }
        Ok(shortest)
    }

    /// Revokes `session`'s shadows (best effort: one that stays expires
    /// with its TTL, no longer renewed).
    pub(crate) async fn end_shadows(&self, session: i64) {
        let Some(shards) = self.tiers.shards() else {
            return;
        };
        for cluster in shards.others() {
            if let Err(e) = cluster.table.log().revoke(session).await {
                tracing::warn!(error = %e, "could not revoke a session's shadow on another shard; it expires with its TTL");
            }
        }
    }

    /// Whether sessions may have shadows (the map names other shards).
    pub(crate) fn has_shadows(&self) -> bool {
        self.tiers
            .shards()
            .is_some_and(|s| !s.other_names().is_empty())
    }
}

/// Whole seconds of a renewal's TTL left now, counted from when it was
/// sent (the lease's expiry is no later than send + TTL).
pub(crate) fn time_left(r: &Renewal) -> i64 {
    let spent = i64::try_from(r.sent.elapsed().as_secs()).unwrap_or(i64::MAX);
    // Rounded down, then one second off for the part-second spent.
    r.ttl_seconds.saturating_sub(spent).saturating_sub(1)
}
