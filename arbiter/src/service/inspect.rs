use latchkey_proto::lockv1::{Holder, InspectRequest, InspectResponse};
use tonic::Request;

use super::Arbiter;
use crate::error::ArbiterError;
use crate::token;

impl Arbiter {
    /// Who holds a key, for callers with a grant on its prefix only.
    pub async fn inspect(
        &self,
        request: Request<InspectRequest>,
    ) -> Result<InspectResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let policies = self.policies.current();
        let key = self.authorised_key(&policies, &caller, &request.get_ref().key)?;
        let state = self.store.serving_epoch().await.ok();
        let holder = self.store.holder(key.as_str()).await?.map(|h| Holder {
            identity: h.record.identity,
            session_id: h.record.session,
            class: h.record.class,
            token: state
                .as_ref()
                .and_then(|s| token::pack(s.epoch(), h.revision))
                .unwrap_or(0),
            acquired_at_unix_ms: h.record.acquired_at_unix_ms,
            annotations: h.record.annotations.into_iter().collect(),
        });
        Ok(InspectResponse {
            key: key.as_str().to_string(),
            holder,
            waiters: u32::try_from(self.queues.waiting(key.as_str())).unwrap_or(u32::MAX),
        })
    }
}
