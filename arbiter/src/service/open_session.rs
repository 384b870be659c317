use latchkey_proto::lockv1::{OpenSessionRequest, OpenSessionResponse};
use tonic::Request;
use tracing::info;

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
        let req = request.into_inner();
        let policies = self.policies.current();
        let class = self.class(&policies, &req.class)?;
        let ttl = class.ttl_seconds;
        let interval = u32::try_from(class.keepalive_interval_ms()).unwrap_or(u32::MAX);
        if req.reuse_session_ids.len() > MAX_REUSE_CANDIDATES {
            return Err(ArbiterError::BadRequest(format!(
                "at most {MAX_REUSE_CANDIDATES} reuse_session_ids are accepted"
            )));
        }
        for &candidate in req.reuse_session_ids.iter().filter(|id| **id > 0) {
            if let Some(record) = self.table.session(candidate).await?
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
        let opened = {
            let _turn = self.bounds.open_turn(&caller.identity).await;
            self.table
                .open_session(&caller.identity, ttl, self.bounds.max_sessions)
                .await
        };
        if let Err(e @ ArbiterError::IdentityLimit { bound, .. }) = &opened {
            self.metrics.identity_bound_refused(bound.kind());
            info!(identity = %caller.identity, error = %e, "session refused");
        }
        let session_id = opened?;
        info!(identity = %caller.identity, session = session_id, ttl, "session opened");
        Ok(OpenSessionResponse {
            session_id,
            ttl_seconds: ttl,
            keepalive_interval_ms: interval,
            reused: false,
        })
    }

    /// The session if it belongs to the caller; otherwise SESSION_EXPIRED
    /// (the same answer whether it is someone else's or gone).
    pub(crate) async fn owned_session(
        &self,
        identity: &str,
        session: i64,
    ) -> Result<crate::records::SessionRecord, ArbiterError> {
        match self.table.session(session).await? {
            Some(record) if record.identity == identity => Ok(record),
            _ => Err(ArbiterError::SessionExpired { session }),
        }
    }
}
