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
//!   it expires). Closing a session, or an operator's revocation of it,
//!   revokes its shadows; a session a renewal finds gone has them left to
//!   expire (it may have been lost to a restore of the lock cluster before
//!   the holder's deadline, which its shadows' last renewal set).
//! - **Marked, and the marks vouched for.** Renewals find a session's
//!   shadows by its marks on the lock cluster. A restore of the lock
//!   cluster may take marks back while their shadows live on, so marks are
//!   trusted only when the session opened, or its marks were vouched for,
//!   after the last epoch advance (every restore is followed by one:
//!   ADR-03), and while no seal waits for the next advance. Otherwise a
//!   renewal renews the session on every shard the map names, marks each
//!   that has its shadow, and then vouches, if the epoch record is still
//!   the one its read saw. A shadow's session record is put on its shard
//!   only after the shadow is marked again (a first mark a restore took
//!   back), so no hold is granted on a shadow a vouch could have missed.
//! - **Owned like the session.** The shadow's record is the session's record,
//!   byte for byte, so the grant transaction's compare of the session record
//!   and every ownership check work unchanged; it is made only for the
//!   session's owner. Shadows do not count against the identity's session
//!   bound (only the home and coord clusters' sessions are counted).

use super::Arbiter;
use crate::error::ArbiterError;
use crate::lock_log::{Renewal, ShadowMarks, StoreError};
use crate::records::{SessionRecord, decode};
use crate::tiers::Cluster;

impl Arbiter {
    /// Makes sure `identity`'s `session` has its shadow on `cluster`.
    pub(crate) async fn ensure_shadow(
        &self,
        cluster: &Cluster,
        shard: &str,
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
        // The mark first, on the session's lease: a renewal that begins
        // once the shadow exists reads it, and renews the shadow.
        self.mark_found_shadow(session, shard).await?;
        match table.log().grant_lease(session, record.ttl_seconds).await {
            Ok(_) | Err(StoreError::LeaseExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        // Marked again now that the lease exists: a restore of the lock
        // cluster since the first mark may have taken it back, and a
        // renewal that found no lease here may have vouched for the marks
        // since. Only then the record, without which nothing is granted on
        // the shadow (the grant compares it), and which a later Acquire
        // takes as the shadow being there.
        self.mark_found_shadow(session, shard).await?;
        table.log().put_session(session, identity, value).await?;
        Ok(())
    }

    /// Renews `session`'s shadows: the shortest time left among them,
    /// counted from each renewal's send (`None`: no shadow anywhere).
    ///
    /// With its marks complete ([`ShadowMarks::complete`]), on the shards
    /// it has marked only: other shards, down or not, do not matter to this
    /// session. Otherwise on every shard the map names, marking each that
    /// has the shadow, then vouching for the marks. A shard to renew on
    /// that this arbiter is not connected to, or cannot renew on, fails the
    /// renewal: a shadow there would expire unseen.
    pub(crate) async fn renew_shadows(&self, session: i64) -> Result<Option<i64>, ArbiterError> {
        let Some(shards) = self.tiers.shards() else {
            return Ok(None);
        };
        let marks = self.shadow_marks(session).await?;
        let complete = marks.complete();
        let names = match complete {
            true => marks.shards.clone(),
            false => {
                tracing::debug!(
                    session,
                    "shadow marks not vouched for since the last epoch advance: renewing on every shard"
                );
                let mut all = shards.other_names();
                all.extend(marks.shards.iter().cloned());
                all.sort();
                all.dedup();
                all
            }
        };
        let home = &self.tiers.entity().table;
        let mut shortest: Option<i64> = None;
        let asked = std::time::Instant::now();
        for name in names {
            let cluster = shards.cluster(&name).ok_or_else(|| {
                ArbiterError::store(match complete {
                    true => format!(
                        "shard {name:?}, where the session has a shadow, is not connected to this arbiter, so the shadow cannot be renewed"
                    ),
                    false => format!(
                        "shard {name:?} is not connected to this arbiter, and the session's shadow marks are not vouched for since the last epoch advance, so a shadow there could not be renewed"
                    ),
                })
            })?;
            let mut r = cluster.table.renew(session).await?;
            if r.ttl_seconds <= 0 && r.sent < asked {
                // "No lease" from a renewal sent before this call (joined
                // in flight) may predate the shadow: ask afresh.
                r = cluster.table.renew(session).await?;
            }
            // No lease: not made yet (the mark comes first), or gone.
            if r.ttl_seconds > 0 {
                if !complete && !marks.shards.contains(&name) {
                    self.mark_found_shadow(session, &name).await?;
                }
                let left = time_left(&r);
                shortest = Some(shortest.map_or(left, |s| s.min(left)));
            }
        }
        // Not while sealed (the advance is to come), and only if the epoch
        // record is still the one the read saw: an advance since may
        // follow a restore that took back a mark this pass trusted.
        if !complete && !marks.sealed {
            match home.log().vouch_shadows(session, marks.epoch_at).await {
                Ok(answer) if !answer.value => {
                    tracing::debug!(
                        session,
                        "shadow marks not vouched for: the epoch record changed since they were read"
                    );
                }
                Ok(_) => {}
                Err(StoreError::LeaseGone { .. }) => {
                    return Err(ArbiterError::SessionExpired { session });
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(shortest)
    }

    /// Marks `session`'s shadow on `shard` again: a renewal found it
    /// without a mark, or its Acquire made its lease (a restore of the
    /// lock cluster may have taken the first mark back).
    async fn mark_found_shadow(&self, session: i64, shard: &str) -> Result<(), ArbiterError> {
        let home = &self.tiers.entity().table;
        match home.log().mark_shadow(session, shard).await {
            Ok(_) => Ok(()),
            Err(StoreError::LeaseGone { .. }) => Err(ArbiterError::SessionExpired { session }),
            Err(e) => Err(e.into()),
        }
    }

    /// `session`'s marks on the lock cluster (a linearizable read).
    pub(crate) async fn shadow_marks(&self, session: i64) -> Result<ShadowMarks, ArbiterError> {
        let home = &self.tiers.entity().table;
        let (marks, _) = home
            .seal()
            .checked(home.log().shadow_marks(session))
            .await?;
        Ok(marks)
    }

    /// The shards whose shadows of `session` to end when it ends: its
    /// marks if they are complete, else `None` (every connected shard).
    pub(crate) async fn shadows_to_end(&self, session: i64) -> Option<Vec<String>> {
        let marks = self.shadow_marks(session).await.ok()?;
        marks.complete().then_some(marks.shards)
    }

    /// Revokes `session`'s shadows on `marked` shards, or on every other
    /// connected shard when the marks could not be read (best effort: one
    /// that stays expires with its TTL, no longer renewed).
    pub(crate) async fn end_shadows(&self, session: i64, marked: Option<Vec<String>>) {
        let Some(shards) = self.tiers.shards() else {
            return;
        };
        let clusters = match marked {
            Some(names) => names.iter().filter_map(|n| shards.cluster(n)).collect(),
            None => shards.others(),
        };
        for cluster in clusters {
            if let Err(e) = cluster.owner.end_shadow(session).await {
                tracing::warn!(error = %e, "could not revoke a session's shadow on another shard; it expires with its TTL");
            }
        }
    }

    /// Whether sessions may have shadows: a shard map exists (before the
    /// first change of the map there is no other shard to hold one).
    pub(crate) fn has_shadows(&self) -> bool {
        self.tiers.shards().is_some_and(|s| s.map().is_some())
    }

    /// Refuses a renewal this arbiter cannot answer for: the lock cluster is
    /// fenced at a newer shard map than it routes by (as last read), so
    /// sessions may have shadows on shards it does not know.
    pub(crate) fn renewal_fenced(&self) -> Result<(), ArbiterError> {
        let routed = self.tiers.shards().map_or(0, |s| s.version());
        match self.tiers.entity().table.seal().guard().state() {
            Some(state) if state.fence_version > routed => Err(ArbiterError::ShardMapAhead {
                cluster: state.fence_version,
                arbiter: routed,
            }),
            _ => Ok(()),
        }
    }
}

/// Whole seconds of a renewal's TTL left now, counted from when it was
/// sent (the lease's expiry is no later than send + TTL).
pub(crate) fn time_left(r: &Renewal) -> i64 {
    let spent = i64::try_from(r.sent.elapsed().as_secs()).unwrap_or(i64::MAX);
    // Rounded down, then one second off for the part-second spent.
    r.ttl_seconds.saturating_sub(spent).saturating_sub(1)
}
