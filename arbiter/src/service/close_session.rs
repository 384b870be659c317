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
            true => self.shadows_to_end(session).await,
            false => Some(Vec::new()),
        };
        // The entry to delete is under the subject the session was opened
        // as: known from the session counts (the watch saw it, or it was
        // opened here); else the subject the grants give now. An entry missed
        // that way still goes with the lease's revoke.
        let counted_as = cluster.sessions.subject_of(session);
        let subject = match &counted_as {
            Some(subject) => subject.clone(),
            None => self
                .policies
                .current()
                .grants()
                .subject(&caller.identity)
                .unwrap_or(&caller.identity)
                .to_string(),
        };
        let deleted_at = cluster
            .owner
            .close_session(&caller.identity, &subject, session)
            .await?;
        // Counted off now, not when the watch shows it: a close and an open
        // at the bound follow each other without a refusal in between.
        if let Some(subject) = counted_as {
            cluster.sessions.closed_here(&subject, session, deleted_at);
        }
        // The next renewal of a closed session must reach etcd (and fail).
        self.bounds.forget_renewal(session);
        if home {
            self.end_shadows(session, marked).await;
        }
        debug!(identity = %caller.identity, session, "session closed");
        Ok(CloseSessionResponse {})
    }
}
