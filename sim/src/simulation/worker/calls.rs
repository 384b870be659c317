//! A worker's calls into an arbiter: through its handlers with the whole
//! arbiter (as the edge forwards them in the insecure dev mode), else
//! through its table.

use std::time::Duration;

use latchkey_arbiter::error::ArbiterError;
use latchkey_arbiter::identity::channel::{ForwardedIdentity, Named};
use latchkey_arbiter::table::{Grant, GrantRequest};
use latchkey_proto::lockv1::{AcquireRequest, WaitMode};
use tonic::Request;
use tonic::metadata::MetadataValue;

use super::{Call, MAX_WAITERS_PER_KEY};
use crate::simulation::world::Arbiter;

/// A call in the insecure dev mode: the caller's SPIFFE ID in the dev
/// header of its initial headers (as the identity channel's layer hands it
/// to the handlers), and the call's deadline.
pub(crate) fn request<T>(identity: &str, deadline: Option<Duration>, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.extensions_mut().insert(ForwardedIdentity {
        edge: Named::Absent,
        dev: Named::One(identity.to_string()),
    });
    if let Some(d) = deadline
        && let Ok(v) = MetadataValue::try_from(format!("{}m", d.as_millis().max(1)))
    {
        request.metadata_mut().insert("grpc-timeout", v);
    }
    request
}

/// How an acquire was granted.
pub(super) enum Got {
    /// Through the log, with a fencing token.
    Log(Grant),
    /// From memory during a quorum loss: token 0, unprotected.
    Memory,
}

/// One Acquire through `arbiter`, cut off if the arbiter dies or, with
/// `cancel_after`, when the client gives up (the future is dropped, as a
/// cancelled RPC drops the handler's).
pub(super) async fn acquire(
    arbiter: &Arbiter,
    req: GrantRequest,
    wait: Option<Duration>,
    cancel_after: Option<Duration>,
    durable: bool,
) -> Call<Got> {
    let table = arbiter.table.clone();
    let service = arbiter.service.clone();
    let call = async {
        let Some(service) = service else {
            // The table alone (the presets from before the whole arbiter).
            let acquired = if durable {
                table.acquire_durable(req, wait, MAX_WAITERS_PER_KEY).await
            } else {
                table.acquire(req, wait, MAX_WAITERS_PER_KEY).await
            };
            return acquired.map(|a| Got::Log(a.grant));
        };
        // The Acquire handler: identity, policy, then the key's owner (the
        // hold count or the quorum-loss posture lets it in; granted through
        // the log or from memory). A wait is the call's deadline.
        let acquire = AcquireRequest {
            key: req.key.clone(),
            class: req.class.clone(),
            session_id: req.session,
            wait: match wait {
                Some(_) => WaitMode::WaitUntilDeadline,
                None => WaitMode::WaitNone,
            } as i32,
            mode: i32::from(req.shared),
            ..AcquireRequest::default()
        };
        let answer = service
            .acquire(request(&req.identity, wait, acquire))
            .await?;
        let grant = answer
            .grant
            .ok_or_else(|| ArbiterError::internal("an Acquire answered without a grant"))?;
        if grant.unprotected {
            return Ok(Got::Memory);
        }
        Ok(Got::Log(Grant {
            key: grant.key,
            session: grant.session_id,
            epoch: grant.epoch,
            revision: grant.revision,
        }))
    };
    let cancel = async {
        match cancel_after {
            Some(after) => tokio::time::sleep(after).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        () = arbiter.killed.cancelled() => Call::Killed,
        r = call => Call::Answered(r),
        () = cancel => Call::Cancelled,
    }
}

/// A downgrade as the clients send it: a shared Acquire of the lock that
/// names the session's exclusive hold by its token (`downgrade_from`),
/// through the handlers with the whole arbiter, else the table's
/// [`latchkey_arbiter::table::LockTable::downgrade_from`]. `req` is the
/// exclusive hold's request, asked again in mode SHARED.
pub(super) async fn downgrade(arbiter: &Arbiter, mut req: GrantRequest, token: u64) -> Call<Grant> {
    req.shared = true;
    let table = arbiter.table.clone();
    let service = arbiter.service.clone();
    let call = async {
        let Some(service) = service else {
            return table.downgrade_from(&req, token).await;
        };
        let acquire = AcquireRequest {
            key: req.key.clone(),
            class: req.class.clone(),
            session_id: req.session,
            wait: WaitMode::WaitNone as i32,
            mode: 1,
            downgrade_from: Some(token),
            ..AcquireRequest::default()
        };
        let answer = service
            .acquire(request(&req.identity, None, acquire))
            .await?;
        let grant = answer
            .grant
            .ok_or_else(|| ArbiterError::internal("an Acquire answered without a grant"))?;
        if grant.mode != 1 {
            return Err(ArbiterError::internal(
                "a downgrade answered other than shared",
            ));
        }
        Ok(Grant {
            // The wire names the lock; the hold is the session's reader key.
            key: latchkey_arbiter::records::reader_key(&grant.key, grant.session_id),
            session: grant.session_id,
            epoch: grant.epoch,
            revision: grant.revision,
        })
    };
    tokio::select! {
        biased;
        () = arbiter.killed.cancelled() => Call::Killed,
        r = call => Call::Answered(r),
    }
}
