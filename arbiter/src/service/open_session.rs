use latchkey_proto::lockv1::{OpenSessionRequest, OpenSessionResponse};
use tonic::Request;
use tracing::debug;

use super::Arbiter;
use crate::error::ArbiterError;

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
        let wait = super::acquire::count_wait(&request);
        let req = request.into_inner();
        let policies = self.policies.current();
        let class = self.class(&policies, &req.class)?;
        // A session of a class no grant of the caller's is for would lock
        // nothing (and take a lease on its tier's cluster).
        if !policies
            .grants()
            .grants_class(&caller.identity, &class.name)
        {
            return Err(match policies.grants().granted_classes(&caller.identity) {
                Some(allowed) => ArbiterError::ClassNotGranted {
                    class: class.name.clone(),
                    allowed: allowed.into_iter().collect(),
                },
                None => ArbiterError::NotAuthorised,
            });
        }
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
            .open_within_bound(cluster, &subject, &caller.identity, ttl, wait)
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

    /// Admits the open against the sessions of `identity`'s grant subject
    /// `subject` (itself, or the pattern it falls under) as this arbiter
    /// counts them, from memory ([`crate::session_counts`]: no etcd read,
    /// whatever the subject has), then creates it. The open counts from its
    /// admission until the count has its entry, so opens here never pass the
    /// bound, bursts included; other arbiters' opens count once this
    /// arbiter's watch has them. An arbiter with no count yet (just started,
    /// or its watch is being set up again) waits `wait` for it, then
    /// refuses UNAVAILABLE: never an admission without a count.
    async fn open_within_bound(
        &self,
        cluster: &crate::tiers::Cluster,
        subject: &str,
        identity: &str,
        ttl: u32,
        wait: std::time::Duration,
    ) -> Result<i64, ArbiterError> {
        cluster
            .sessions
            .counted_within(wait)
            .await
            .inspect_err(|_| self.metrics.session_count_missing())?;
        let mut opening = {
            // The bound is over both tiers' sessions, each tier's counted
            // under its own lock: one admission at a time, so two opens on
            // different tiers cannot both take the last place.
            let _one = self.bounds.admitting_open();
            // The other tier's count not in (its cluster down, or just
            // started) must not stop this tier: then only the opens in
            // flight here on it count (the bound at most doubles for the
            // outage).
            let beside = self
                .tiers
                .session_clusters()
                .filter(|c| !std::ptr::eq(c.as_ref(), cluster))
                .map(|c| c.sessions.held_or_in_flight(subject))
                .fold(0, u32::saturating_add);
            cluster.sessions.admit_beside(subject, beside)?
        };
        let created = cluster
            .table
            .create_session(identity, subject, ttl, |session| {
                opening.writing(session, std::time::Duration::from_secs(u64::from(ttl)));
            })
            .await;
        match created {
            Ok((session, written_at)) => {
                opening.written(written_at);
                Ok(session)
            }
            Err(e) => {
                opening.unknown(std::time::Duration::from_secs(u64::from(ttl)));
                Err(e)
            }
        }
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
