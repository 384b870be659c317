use latchkey_proto::lockv1::{CloseSessionRequest, CloseSessionResponse};
use tonic::Request;
use tracing::debug;

use super::{Arbiter, session_id};
use crate::error::ArbiterError;

impl Arbiter {
    /// Revokes the caller's session's lease: every hold on it goes in one
    /// committed entry. Someone else's session is `SESSION_EXPIRED`, the
    /// same as one that does not exist.
    pub async fn close_session(
        &self,
        request: Request<CloseSessionRequest>,
    ) -> Result<CloseSessionResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let session = session_id(request.get_ref().session_id)?;
        let cluster = self.tiers.session_cluster(session).await?;
        let home = std::ptr::eq(cluster.as_ref(), self.tiers.entity().as_ref());
        // Read before the close: the marks end with the session's lease.
        let marked = match home && self.has_shadows() {
            true => self.shadow_marks(session).await.ok(),
            false => Some(Vec::new()),
        };
        cluster
            .table
            .close_session(&caller.identity, session)
            .await?;
        // The next renewal of a closed session must reach etcd (and fail).
        self.bounds.forget_renewal(session);
        if home {
            self.end_shadows(session, marked).await;
        }
        debug!(identity = %caller.identity, session, "session closed");
        Ok(CloseSessionResponse {})
    }
}
