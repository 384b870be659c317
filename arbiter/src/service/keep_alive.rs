use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use latchkey_proto::lockv1::{KeepAliveRequest, KeepAliveResponse};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Status, Streaming};
use tracing::debug;

use super::{Arbiter, KeepAliveStream, session_id};
use crate::error::ArbiterError;
use crate::store::Renewer;

impl Arbiter {
    /// Renews sessions on request. Each session's ownership is checked once
    /// per stream (someone else's session is SESSION_EXPIRED, as one that is
    /// gone); each renewal is answered with the TTL left, and a session that
    /// is gone ends the stream with SESSION_EXPIRED. Renewals count against
    /// the identity's rate (IDENTITY_LIMIT ends the stream; the client
    /// reopens it after a pause).
    pub fn keep_alive(
        self: Arc<Self>,
        request: Request<Streaming<KeepAliveRequest>>,
    ) -> Result<KeepAliveStream, ArbiterError> {
        let caller = self.caller(&request)?;
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<KeepAliveResponse, Status>>(8);
        tokio::spawn(async move {
            let mut renewers: HashMap<i64, Renewer> = HashMap::new();
            while let Some(Ok(req)) = inbound.next().await {
                let reply = async {
                    let session = session_id(req.session_id)?;
                    self.bounds.renewal(&caller.identity)?;
                    let renewer = match renewers.entry(session) {
                        Entry::Occupied(e) => e.into_mut(),
                        Entry::Vacant(e) => {
                            self.owned_session(&caller.identity, session).await?;
                            e.insert(self.store.renewer(session).await?)
                        }
                    };
                    let ttl = renewer.renew().await?;
                    if ttl <= 0 {
                        return Err(ArbiterError::SessionExpired { session });
                    }
                    Ok(KeepAliveResponse {
                        session_id: session,
                        remaining_ttl_seconds: ttl,
                    })
                }
                .await;
                let end = reply.is_err();
                if let Err(e) = &reply {
                    debug!(identity = %caller.identity, error = %e, "keepalive refused");
                    self.metrics.renewal_refused(e);
                    if let ArbiterError::IdentityLimit { bound, .. } = e {
                        self.metrics.identity_bound_refused(bound.kind());
                    }
                }
                if tx.send(reply.map_err(Status::from)).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}
