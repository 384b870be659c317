use latchkey_proto::lockv1::{ReleaseRequest, ReleaseResponse};
use tonic::Request;
use tracing::{debug, info};

use super::{Arbiter, session_id};
use crate::error::ArbiterError;
use crate::metrics::Scope;
use crate::token;

impl Arbiter {
    /// Releases a hold. With a waiter queued here, the key is handed to it in
    /// the same transaction (one etcd commit per contended handoff).
    pub async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<ReleaseResponse, ArbiterError> {
        let mut scope = Scope::default();
        let result = self.release_in(request, &mut scope).await;
        self.metrics
            .release(&scope, &result, matches!(result, Ok(Released::HandedOver)));
        result.map(|_| ReleaseResponse {})
    }

    async fn release_in(
        &self,
        request: Request<ReleaseRequest>,
        scope: &mut Scope,
    ) -> Result<Released, ArbiterError> {
        let caller = self.caller(&request)?;
        let req = request.into_inner();
        let policies = self.policies.current();
        let key = self.authorised_key_in(&policies, &caller, &req.key, scope)?;
        let session = session_id(req.session_id)?;
        let (epoch, revision) = token::unpack(req.token);
        let current = self.store.guard().state().map(|s| s.epoch());
        if current != Some(epoch) || revision <= 0 {
            return Err(ArbiterError::TokenMismatch {
                key: key.as_str().to_string(),
            });
        }
        if let Some(head) = self.queues.head(key.as_str()) {
            match self
                .store
                .hand_over(key.as_str(), session, revision, &head.req)
                .await
            {
                Ok(Some(grant)) => {
                    info!(identity = %caller.identity, key = %key.as_str(), next = %head.req.identity, "released and handed over");
                    self.queues.deliver(&head, Ok(grant));
                    self.hooks.after_release(&caller.identity, key.as_str());
                    return Ok(Released::HandedOver);
                }
                Ok(None) => {}
                Err(e) => debug!(error = %e, "hand-over failed; releasing plainly"),
            }
        }
        self.store.release(key.as_str(), session, revision).await?;
        // the released grant and anything older
        self.queues.forget_claims_before(key.as_str(), revision + 1);
        self.queues.kick(key.as_str());
        info!(identity = %caller.identity, key = %key.as_str(), "released");
        self.hooks.after_release(&caller.identity, key.as_str());
        Ok(Released::Plainly)
    }
}

/// How a release ended.
enum Released {
    Plainly,
    /// The key went to the next waiter in the same transaction.
    HandedOver,
}
