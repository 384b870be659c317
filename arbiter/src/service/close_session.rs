use latchkey_proto::lockv1::{CloseSessionRequest, CloseSessionResponse};
use tonic::Request;
use tracing::info;

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
        cluster
            .table
            .close_session(&caller.identity, session)
            .await?;
        // The next renewal of a closed session must reach etcd (and fail).
        self.bounds.forget_renewal(session);
        if std::ptr::eq(cluster.as_ref(), self.tiers.entity().as_ref()) {
            self.end_shadows(session).await;
        }
        info!(identity = %caller.identity, session, "session closed");
        Ok(CloseSessionResponse {})
    }
}
