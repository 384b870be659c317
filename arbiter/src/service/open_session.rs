use latchkey_proto::lockv1::{OpenSessionRequest, OpenSessionResponse};
use tonic::Request;
use tracing::debug;

use super::Arbiter;
use crate::error::{ArbiterError, IdentityBound};

/// More than this many reuse candidates is a client bug, not a session cache.
const MAX_REUSE_CANDIDATES: usize = 32;

impl Arbiter {
    /// One etcd lease per (identity, TTL): a candidate the client already has
    /// is returned if it is the caller's, alive, and has the class's TTL.
    /// A new session needs the identity to be under its bound of open
    /// sessions (`IDENTITY_LIMIT` otherwise).
    pub async fn open_session(
        &self,
        request: Request<OpenSessionRequest>,
    ) -> Result<OpenSessionResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let req = request.into_inner();
        let policies = self.policies.current();
        let class = self.class(&policies, &req.class)?;
        let ttl = class.ttl_seconds;
        // ADR-07: a session is a lease on its class's tier's cluster.
        let cluster = self.tiers.for_tier(class.tier);
        let interval = u32::try_from(class.keepalive_interval_ms()).unwrap_or(u32::MAX);
        if req.reuse_session_ids.len() > MAX_REUSE_CANDIDATES {
            return Err(ArbiterError::BadRequest(format!(
                "at most {MAX_REUSE_CANDIDATES} reuse_session_ids are accepted"
            )));
        }
        let on_tier = |id: i64| self.tiers.for_session(id).tier == cluster.tier;
        for &candidate in req
            .reuse_session_ids
            .iter()
            .filter(|id| **id > 0 && on_tier(**id))
        {
            if let Some(record) = cluster.table.session(candidate).await?
                && record.identity == caller.identity
                && record.ttl_seconds == ttl
            {
                return Ok(OpenSessionResponse {
                    session_id: candidate,
                    ttl_seconds: ttl,
                    keepalive_interval_ms: interval,
                    reused: true,
                });
            }
        }
        // Bounded per grant subject: per-pod identities under one pattern
        // share one bound (issue 30).
        // An identity with no grant can lock nothing: it gets no lease
        // either (with per-pod SVIDs every ungranted pod would otherwise
        // have its own session bound).
        let subject = policies
            .grants()
            .subject(&caller.identity)
            .ok_or(ArbiterError::NotAuthorised)?
            .to_string();
        let opened = self
            .open_within_bound(cluster, &subject, &caller.identity, ttl)
            .await;
        if let Err(e @ ArbiterError::IdentityLimit { bound, .. }) = &opened {
            self.metrics.identity_bound_refused(bound.kind());
            debug!(identity = %caller.identity, error = %e, "session refused");
        }
        let session_id = opened?;
        debug!(identity = %caller.identity, session = session_id, ttl, "session opened");
        Ok(OpenSessionResponse {
            session_id,
            ttl_seconds: ttl,
            keepalive_interval_ms: interval,
            reused: false,
        })
    }

    /// Counts the sessions of `identity`'s grant subject `subject` (itself,
    /// or the pattern it falls under) and reserves one more under the
    /// subject's turn, then creates it outside the turn: opens run side by side,
    /// one arbiter never lets them overshoot the bound (an open in flight
    /// counts until the count has it), and a refusal means the log itself
    /// holds `max` sessions.
    async fn open_within_bound(
        &self,
        cluster: &crate::tiers::Cluster,
        subject: &str,
        identity: &str,
        ttl: u32,
    ) -> Result<i64, ArbiterError> {
        let max = self.bounds.max_sessions;
        let reservation = {
            let _turn = self.bounds.open_turn(subject).await;
            loop {
                let progress = self.bounds.open_progress();
                tokio::pin!(progress);
                progress.as_mut().enable();
                // Before the count's read is sent: opens that finish while
                // it is read stay counted for it (Bounds::counting).
                let window = self.bounds.counting(subject);
                // The bound is over both tiers' sessions: each cluster
                // counted at its own revision. The other cluster down must
                // not stop this tier: it then counts as (0, 0), so only its
                // opens in flight here count (the bound at most doubles for
                // the outage).
                let mut counts = Vec::new();
                let mut on = 0;
                for (i, c) in self.tiers.session_clusters().enumerate() {
                    if c.tier == cluster.tier {
                        on = i;
                        counts.push(c.table.count_sessions_of(subject).await?);
                    } else {
                        counts.push(c.table.count_sessions_of(subject).await.unwrap_or_else(|e| {
                            tracing::warn!(error = %e, tier = c.name(), "the other tier's sessions could not be counted; bounding by this tier's alone");
                            (0, 0)
                        }));
                    }
                }
                let open: u32 = counts.iter().map(|c| c.0).fold(0, u32::saturating_add);
                if open >= max {
                    return Err(ArbiterError::IdentityLimit {
                        bound: IdentityBound::Sessions,
                        limit: max,
                    });
                }
                let reserved = self.bounds.reserve_open_over(subject, on, &counts, max);
                drop(window);
                match reserved {
                    Some(reservation) => break reservation,
                    // Under the bound only with opens in flight that the
                    // count may already have: wait for one to finish.
                    None => progress.await,
                }
            }
        };
        let (session, written_at) = cluster.table.create_session(identity, subject, ttl).await?;
        reservation.written_at(written_at);
        Ok(session)
    }

    /// The session if it belongs to the caller; otherwise SESSION_EXPIRED
    /// (the same answer whether it is someone else's or gone).
    pub(crate) async fn owned_session(
        &self,
        identity: &str,
        session: i64,
    ) -> Result<crate::records::SessionRecord, ArbiterError> {
        match self
            .tiers
            .session_cluster(session)
            .await?
            .table
            .session(session)
            .await?
        {
            Some(record) if record.identity == identity => Ok(record),
            _ => Err(ArbiterError::SessionExpired { session }),
        }
    }
}
