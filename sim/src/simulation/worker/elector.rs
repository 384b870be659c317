//! An elector: a simulated replica campaigning in elections through the
//! whole arbiter's handlers (issue 33), judged by the election ledger
//! (`simulation/elections.rs`).
//!
//! Each incarnation opens a session of the election class, renewed through
//! KeepAlive like a worker's, and campaigns in one of the run's elections
//! (`sim/e<n>`) through any arbiter. Leading, it acts for a few units of
//! work while its fence deadline allows, proclaiming now and then, and
//! ends its leadership one of four ways: it resigns, it transfers to the
//! preferred candidate, it crashes (stops acting and renewing at once), or
//! it freezes (stops renewing and acts until its fence deadline). It tells
//! the ledger when it stopped acting before it sends anything that ends
//! the leadership.

use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::error::ArbiterError;
use latchkey_proto::electionv1::{
    CampaignRequest, ProclaimRequest, ResignRequest, TransferRequest, transfer_request,
};
use latchkey_proto::lockv1::OpenSessionRequest;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::calls::request;
use super::renewals::keep_alive;
use super::{Renewer, Session};
use crate::rng::Rng;
use crate::simulation::elections::Delivery;
use crate::simulation::policies::ELECTION_CLASS;
use crate::simulation::world::{Arbiter, World, lock};

/// How an elector's leadership ends.
enum End {
    Resign,
    Transfer,
    Crash,
    Freeze,
}

/// Electors' incarnations until the run stops.
pub(crate) async fn run(world: Arc<World>, index: usize, mut rng: Rng) {
    // The electors share the workers' grant subject (a per-pod pattern),
    // with identities of their own.
    let identity = super::super::policies::identity(1_000 + index);
    let mut incarnation = 0u32;
    while !world.stopping() {
        incarnation += 1;
        let process = format!("e{index}.{incarnation}");
        let renew_seed = rng.next_u64();
        elect(&world, &identity, &process, &mut rng, renew_seed).await;
    }
}

async fn open(world: &Arc<World>, identity: &str, rng: &mut Rng) -> Option<Session> {
    loop {
        if world.stopping() {
            return None;
        }
        let Some(arbiter) = world.any(rng) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let service = arbiter.service.clone()?;
        let sent = Instant::now();
        let call = service.open_session(request(
            identity,
            None,
            OpenSessionRequest {
                class: ELECTION_CLASS.into(),
                reuse_session_ids: Vec::new(),
            },
        ));
        let opened = tokio::select! {
            biased;
            () = arbiter.killed.cancelled() => None,
            r = call => r.ok(),
        };
        let ttl = Duration::from_secs(u64::from(world.cfg.ttl_seconds));
        match opened {
            Some(o) => {
                return Some(Session {
                    id: o.session_id,
                    renewed: sent,
                    granted: ttl,
                    opened: sent,
                    gone: false,
                    ttl,
                });
            }
            None => tokio::time::sleep(Duration::from_millis(50 + rng.below(200))).await,
        }
    }
}

/// One incarnation: campaigns until its session is gone or it ends a
/// leadership by crashing or freezing.
async fn elect(world: &Arc<World>, identity: &str, process: &str, rng: &mut Rng, renew_seed: u64) {
    let Some(session) = open(world, identity, rng).await else {
        return;
    };
    let id = session.id;
    let session = Arc::new(Mutex::new(session));
    let mut renewer = Some(Renewer(tokio::spawn(keep_alive(
        world.clone(),
        identity.to_string(),
        session.clone(),
        Rng::new(renew_seed),
    ))));
    loop {
        if world.stopping() {
            return;
        }
        {
            let s = lock(&session);
            if s.gone || Instant::now() >= s.deadline() {
                return;
            }
        }
        let election = format!("sim/e{}", rng.below(world.cfg.elections.max(1) as u64));
        let Some(arbiter) = world.any(rng) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Some(service) = arbiter.service.clone() else {
            return;
        };
        let wait = Duration::from_millis(200 + rng.below(world.cfg.wait_ms.max(200) * 2));
        let campaign = CampaignRequest {
            election: election.clone(),
            class: ELECTION_CLASS.into(),
            session_id: id,
            value: process.to_string(),
            priority: u32::try_from(rng.below(3)).unwrap_or(0),
            instance: String::new(),
        };
        let invoked = Instant::now();
        let answer = tokio::select! {
            biased;
            () = arbiter.killed.cancelled() => None,
            r = service.campaign(request(identity, Some(wait), campaign)) => Some(r),
        };
        let leadership = match answer {
            Some(Ok(r)) => match r.leadership {
                Some(l) => l,
                None => continue,
            },
            // The arbiter died with the campaign in flight: it may lead
            // without knowing; the session ends with this incarnation.
            None => return,
            Some(Err(ArbiterError::WaitTimeout { .. } | ArbiterError::IdentityLimit { .. })) => {
                continue;
            }
            Some(Err(_)) => {
                tokio::time::sleep(Duration::from_millis(100 + rng.below(300))).await;
                continue;
            }
        };
        let now = Instant::now();
        let waited = now > invoked + Duration::from_millis(1);
        lock(&world.elections).delivered(Delivery {
            election: &election,
            term: leadership.term,
            token: leadership.token,
            session: id,
            process,
            now,
            waited,
        });
        let end = match rng.below(100) {
            0..=49 => End::Resign,
            50..=79 => End::Transfer,
            80..=89 => End::Crash,
            _ => End::Freeze,
        };
        if matches!(end, End::Freeze) {
            // Stops renewing; acts until its fence deadline.
            renewer = None;
        }
        let steps = 1 + rng.below(4);
        for _ in 0..steps {
            let deadline = lock(&session).deadline();
            let unit = Duration::from_millis(20 + rng.below(world.cfg.unit_ms.max(1) * 2));
            if Instant::now() + unit >= deadline {
                tokio::time::sleep_until(deadline).await;
                lock(&world.elections).stopped(&election, leadership.token, deadline);
                return;
            }
            tokio::time::sleep(unit).await;
            if rng.chance(20)
                && let Some(a) = world.any(rng)
            {
                proclaim(&a, identity, &election, id, leadership.token, process).await;
            }
        }
        let stopped = Instant::now();
        lock(&world.elections).stopped(&election, leadership.token, stopped);
        match end {
            End::Crash => return,
            End::Freeze => {
                let deadline = lock(&session).deadline();
                tokio::time::sleep_until(deadline).await;
                return;
            }
            End::Resign | End::Transfer => {
                let Some(a) = world.any(rng) else { return };
                let Some(service) = a.service.clone() else {
                    return;
                };
                let handed = match end {
                    End::Transfer => {
                        let t = TransferRequest {
                            election: election.clone(),
                            session_id: id,
                            token: leadership.token,
                            to: Some(transfer_request::To::Preferred(true)),
                        };
                        tokio::select! {
                            biased;
                            () = a.killed.cancelled() => None,
                            r = service.transfer(request(identity, None, t)) => Some(r.map(|r| r.next.is_some())),
                        }
                    }
                    _ => None,
                };
                let handed = match handed {
                    Some(Ok(true)) => true,
                    _ => {
                        let r = ResignRequest {
                            election: election.clone(),
                            session_id: id,
                            token: leadership.token,
                        };
                        let resigned = tokio::select! {
                            biased;
                            () = a.killed.cancelled() => None,
                            r = service.resign(request(identity, None, r)) => Some(r),
                        };
                        matches!(resigned, Some(Ok(ref r)) if r.next.is_some())
                    }
                };
                if handed {
                    lock(&world.elections).handed_over();
                }
            }
        }
        if renewer.is_none() {
            return;
        }
    }
}

async fn proclaim(a: &Arbiter, identity: &str, election: &str, id: i64, token: u64, process: &str) {
    let Some(service) = a.service.clone() else {
        return;
    };
    let p = ProclaimRequest {
        election: election.to_string(),
        session_id: id,
        token,
        value: format!("{process}+"),
    };
    tokio::select! {
        biased;
        () = a.killed.cancelled() => {}
        _ = service.proclaim(request(identity, None, p)) => {}
    }
}
