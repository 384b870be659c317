use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Instant;

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
    /// is gone ends the stream with SESSION_EXPIRED. A session renewed in
    /// etcd within the last quarter of its TTL is answered from the
    /// arbiter's memo of renewals ([`crate::bounds`]): renewing faster costs
    /// etcd nothing, and no renewal is ever refused for its rate.
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
                    let renewer = match renewers.entry(session) {
                        Entry::Occupied(e) => e.into_mut(),
                        Entry::Vacant(e) => {
                            self.owned_session(&caller.identity, session).await?;
                            e.insert(self.store.renewer(session).await?)
                        }
                    };
                    // Ownership is settled above (once per stream); only then
                    // may the memo answer.
                    if let Some(ttl) = self.bounds.recent_renewal(session) {
                        self.metrics.renewal("coalesced");
                        return Ok(KeepAliveResponse {
                            session_id: session,
                            remaining_ttl_seconds: ttl,
                        });
                    }
                    let sent = Instant::now();
                    let ttl = renewer.renew().await?;
                    self.bounds.renewed(session, sent, ttl);
                    if ttl <= 0 {
                        return Err(ArbiterError::SessionExpired { session });
                    }
                    self.metrics.renewal("renewed");
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
                }
                if tx.send(reply.map_err(Status::from)).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}
