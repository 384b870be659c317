//! The keepalive task: one bidirectional KeepAlive stream per session, one
//! request per interval, and a watchdog on the fence deadline that does not
//! depend on the network answering at all. Between renewals it listens for
//! the arbiter's notices of ended holds and fences each such hold at once.

use std::sync::Arc;
use std::time::Duration;

use latchkey_proto::lockv1::{KeepAliveRequest, KeepAliveResponse, Reason};
use tokio::sync::mpsc;
use tokio::time::error::Elapsed;
use tokio::time::{Instant, sleep, sleep_until, timeout, timeout_at};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::{FenceReason, SessionCore};
use crate::error::reason_of;
use crate::rpc::Rpc;

const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

pub(super) async fn run(core: Arc<SessionCore>, rpc: Rpc) {
    let reason = tokio::select! {
        reason = renew(&core, &rpc) => reason,
        () = watchdog(&core) => FenceReason::DeadlineExceeded,
    };
    core.fence(reason);
}

/// Returns once the deadline has passed without a renewal moving it.
async fn watchdog(core: &SessionCore) {
    loop {
        let deadline = core.deadline();
        if Instant::now() >= deadline {
            return;
        }
        sleep_until(deadline).await;
    }
}

/// Renews until the arbiter says the session is gone; never returns for
/// network trouble (the watchdog ends that).
async fn renew(core: &SessionCore, rpc: &Rpc) -> FenceReason {
    let interval = core.keepalive_interval;
    // Stage one triggers when a reply is half an interval late. With the
    // TTL/3 cadence, waiting a whole interval would put the first failure at
    // last success + 2/3 TTL, which for short TTLs is the deadline itself.
    let reply_timeout = interval / 2;
    let mut backoff = MIN_BACKOFF;
    // OpenSession itself counted as a renewal; but the first message on a
    // stream goes at once all the same: the arbiter pushes notices of ended
    // holds only on a stream that has renewed the session (so it knows the
    // stream is the session owner's), and a hold taken right after opening
    // must not wait a whole interval to be told it ended.
    let mut next_send = Instant::now();
    loop {
        let (requests, outbox) = mpsc::channel(1);
        let opened = timeout(
            interval,
            rpc.lock()
                .keep_alive(rpc.stream(ReceiverStream::new(outbox))),
        )
        .await;
        let mut replies = match opened {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => {
                if reason_of(&status) == Reason::SessionExpired {
                    return FenceReason::Expired;
                }
                tracing::debug!(session_id = core.id, code = ?status.code(), "keepalive stream refused");
                core.keepalive_failed();
                sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            Err(_) => {
                tracing::debug!(
                    session_id = core.id,
                    "keepalive stream did not open in time"
                );
                core.keepalive_failed();
                continue;
            }
        };

        loop {
            // Until the next renewal is due, only notices should come.
            let between = tokio::select! {
                () = sleep_until(next_send) => None,
                reply = next_reply(core, &mut replies) => Some(reply),
            };
            match between {
                None => {}
                Some(Some(Err(status))) if reason_of(&status) == Reason::SessionExpired => {
                    return FenceReason::Expired;
                }
                Some(other) => {
                    tracing::debug!(
                        session_id = core.id,
                        ended = other.is_none(),
                        "keepalive stream broke between renewals"
                    );
                    core.keepalive_failed();
                    break;
                }
            }
            // The send time bounds the arbiter's renewal from below, which
            // is what makes the local deadline safe (ADR-12).
            let sent_at = Instant::now();
            next_send = sent_at + interval;
            let request = KeepAliveRequest {
                session_id: core.id,
                ..Default::default()
            };
            match timeout_at(sent_at + reply_timeout, requests.send(request)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    core.keepalive_failed();
                    break;
                }
            }
            let reply = match reply_by(core, &mut replies, sent_at + reply_timeout).await {
                Ok(reply) => reply,
                Err(_) => {
                    core.keepalive_failed();
                    // A late reply still renewed the lease as of `sent_at`.
                    match reply_by(core, &mut replies, next_send).await {
                        Ok(reply) => reply,
                        Err(_) => break,
                    }
                }
            };
            match reply {
                Some(Ok(reply)) if reply.session_id == core.id => {
                    if reply.remaining_ttl_seconds <= 0 {
                        return FenceReason::Expired;
                    }
                    let remaining = Duration::from_secs(reply.remaining_ttl_seconds.unsigned_abs());
                    core.renewed(sent_at, remaining);
                    backoff = MIN_BACKOFF;
                }
                Some(Ok(_)) => {
                    tracing::warn!(session_id = core.id, "keepalive reply for another session");
                    core.keepalive_failed();
                    break;
                }
                Some(Err(status)) => {
                    if reason_of(&status) == Reason::SessionExpired {
                        return FenceReason::Expired;
                    }
                    tracing::debug!(session_id = core.id, code = ?status.code(), "keepalive stream failed");
                    core.keepalive_failed();
                    break;
                }
                None => {
                    tracing::debug!(session_id = core.id, "keepalive stream ended");
                    core.keepalive_failed();
                    break;
                }
            }
        }
        // Renew as soon as a new stream is up; the deadline is what matters.
        sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        next_send = Instant::now();
    }
}

/// The next message that is not a notice of ended holds (those are acted
/// on here, as they come); `None` when the stream ended.
async fn next_reply(
    core: &SessionCore,
    replies: &mut Streaming<KeepAliveResponse>,
) -> Option<Result<KeepAliveResponse, Status>> {
    loop {
        match replies.next().await {
            Some(Ok(reply)) if !reply.ended_holds.is_empty() => {
                if reply.session_id == core.id {
                    for hold in &reply.ended_holds {
                        core.hold_ended(&hold.key, hold.revision);
                    }
                }
            }
            other => return other,
        }
    }
}

/// [`next_reply`] by `deadline`.
async fn reply_by(
    core: &SessionCore,
    replies: &mut Streaming<KeepAliveResponse>,
    deadline: Instant,
) -> Result<Option<Result<KeepAliveResponse, Status>>, Elapsed> {
    timeout_at(deadline, next_reply(core, replies)).await
}
