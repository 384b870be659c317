//! The renewal task of an incarnation's session: through the KeepAlive
//! handler with the whole arbiter, else through the table.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use latchkey_arbiter::error::ArbiterError;
use latchkey_proto::lockv1::KeepAliveRequest;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::Session;
use super::calls::request;
use crate::rng::Rng;
use crate::simulation::world::{World, lock};

/// Renews the session through the KeepAlive handler of any arbiter that is
/// up, as the client library does: one stream, a renewal every third of
/// the TTL (jittered), a new stream through another arbiter when it ends
/// (or its arbiter dies). A renewal the arbiter could not make is not
/// answered; an answer (`remaining_ttl_seconds` above 0) moves the fence
/// deadline to the send time of the earliest renewal still unanswered plus
/// the TTL answered (an answer does not say which renewal it is for, and
/// that time is never later than the renewal's it answers); 0 says the
/// session is gone; a notice of an ended hold (-1) is not an answer.
pub(super) async fn keep_alive(
    world: Arc<World>,
    identity: String,
    session: Arc<Mutex<Session>>,
    mut rng: Rng,
) {
    let (id, ttl) = {
        let s = lock(&session);
        (s.id, s.ttl)
    };
    let third = ttl.as_millis() as u64 / 3;
    let mut pause = Duration::from_millis(third / 2 + rng.below(third));
    loop {
        tokio::time::sleep(pause).await;
        let Some(arbiter) = world.any(&mut rng) else {
            pause = Duration::from_millis(100);
            continue;
        };
        let Some(service) = arbiter.service.clone() else {
            pause = Duration::from_millis(100);
            continue;
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<KeepAliveRequest, tonic::Status>>(4);
        let inbound = tokio_stream::wrappers::ReceiverStream::new(rx);
        let Ok(mut replies) = service.keep_alive(request(&identity, None, inbound)) else {
            pause = Duration::from_millis(200 + rng.below(300));
            continue;
        };
        let mut unanswered: std::collections::VecDeque<Instant> = Default::default();
        let mut next = Instant::now();
        // One stream until it ends or its arbiter dies.
        loop {
            let reply = tokio::select! {
                biased;
                () = arbiter.killed.cancelled() => break,
                r = replies.next() => r,
                () = tokio::time::sleep_until(next) => {
                    let sent = Instant::now();
                    let message = KeepAliveRequest { session_id: id, session_ids: Vec::new() };
                    if tx.send(Ok(message)).await.is_err() {
                        break;
                    }
                    unanswered.push_back(sent);
                    next = sent + Duration::from_millis(third / 2 + rng.below(third));
                    continue;
                }
            };
            match reply {
                Some(Ok(r)) if r.session_id != id || r.remaining_ttl_seconds < 0 => {}
                Some(Ok(r)) if r.remaining_ttl_seconds == 0 => {
                    lock(&session).gone = true;
                    return;
                }
                Some(Ok(r)) => {
                    let Some(sent) = unanswered.pop_front() else {
                        continue;
                    };
                    let granted =
                        Duration::from_secs(u64::try_from(r.remaining_ttl_seconds).unwrap_or(0))
                            .min(ttl);
                    let mut s = lock(&session);
                    if sent + granted > s.renewed + s.granted {
                        s.renewed = sent;
                        s.granted = granted;
                    }
                }
                // The stream ended (an error ends it): another one.
                Some(Err(_)) | None => break,
            }
        }
        pause = Duration::from_millis(100 + rng.below(200));
    }
}

/// Renews the session every third of its TTL (jittered) through any
/// arbiter that is up, noting when each successful renewal was sent.
pub(super) async fn renew(world: Arc<World>, session: Arc<Mutex<Session>>, mut rng: Rng) {
    let id = lock(&session).id;
    let third = lock(&session).ttl.as_millis() as u64 / 3;
    let mut pause = Duration::from_millis(third / 2 + rng.below(third));
    loop {
        tokio::time::sleep(pause).await;
        pause = Duration::from_millis(third / 2 + rng.below(third));
        let Some(arbiter) = world.any(&mut rng) else {
            pause = Duration::from_millis(100);
            continue;
        };
        let sent = Instant::now();
        let table = arbiter.table.clone();
        let answer = tokio::select! {
            biased;
            () = arbiter.killed.cancelled() => None,
            r = table.renew(id) => Some(r),
        };
        match answer {
            Some(Ok(r)) if r.ttl_seconds > 0 => {
                let mut s = lock(&session);
                if sent > s.renewed {
                    s.renewed = sent;
                }
            }
            Some(Ok(_)) | Some(Err(ArbiterError::SessionExpired { .. })) => {
                lock(&session).gone = true;
                return;
            }
            // Unknown: try again soon.
            Some(Err(_)) | None => pause = Duration::from_millis(200 + rng.below(300)),
        }
    }
}
