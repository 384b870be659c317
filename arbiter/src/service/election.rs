//! latchkey.election.v1: identity, policy and bounds, then the cluster's
//! [`crate::election::Elections`] decides.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use latchkey_policies::{ClassKind, LockKey, PolicySet};
use latchkey_proto::electionv1::election_service_server::ElectionService;
use latchkey_proto::electionv1::{
    CampaignRequest, CampaignResponse, Candidate, CandidatesRequest, CandidatesResponse, Gap,
    LeaderInfo, LeaderRequest, LeaderResponse, Leadership as WireLeadership, ObserveRequest,
    ObserveResponse, ProclaimRequest, ProclaimResponse, Proclaimed, ResignRequest, ResignResponse,
    TermStarted, TransferRequest, TransferResponse, VacancyReason, Vacant, observe_response,
    transfer_request,
};
use tonic::{Request, Response, Status};
use tracing::debug;

use super::acquire::{checked_instance, time_left};
use super::{Arbiter, session_id, truncate};
use crate::election::{Campaign, Claim, LeaderView, Leadership, Observation, TransferTo, Vacancy};
use crate::error::{ArbiterError, IdentityBound};
use crate::identity::Caller;
use crate::overload::{self, Work};
use crate::tiers::Cluster;

/// Longest value a leader announces (`CampaignRequest.value`).
pub const MAX_VALUE_BYTES: usize = 1_024;

/// Elections one grant subject may have started (each keeps its term
/// record, on no lease, until an epoch advance).
pub const MAX_ELECTIONS_PER_SUBJECT: u32 = 4_096;

/// Observe streams one grant subject may have open at this arbiter.
pub const MAX_OBSERVERS_PER_SUBJECT: u32 = 64;

/// Answer a little before the caller's deadline (as Acquire does).
const DEADLINE_MARGIN: Duration = Duration::from_millis(50);

fn checked_value(value: &str) -> Result<String, ArbiterError> {
    if value.is_empty() {
        return Ok(String::new());
    }
    latchkey_proto::text::checked(value, "the value", MAX_VALUE_BYTES)
        .map(str::to_string)
        .map_err(ArbiterError::BadRequest)
}

fn token(raw: u64) -> Result<u64, ArbiterError> {
    if raw == 0 {
        return Err(ArbiterError::BadRequest(
            "token is missing; pass the token of the leadership Campaign returned".into(),
        ));
    }
    Ok(raw)
}

/// The leadership a Proclaim, Resign or Transfer names: the caller's own
/// identity, with the session and token from the request, checked.
fn claim<'a>(
    key: &'a LockKey,
    caller: &'a Caller,
    session: i64,
    raw_token: u64,
) -> Result<Claim<'a>, ArbiterError> {
    Ok(Claim {
        election: key.as_str(),
        identity: &caller.identity,
        session: session_id(session)?,
        token: token(raw_token)?,
    })
}

fn leader_info(view: LeaderView) -> LeaderInfo {
    LeaderInfo {
        identity: view.identity,
        value: view.value,
        term: view.term,
        since_unix_ms: view.since_unix_ms,
        priority: view.priority,
    }
}

fn wire_leadership(l: Leadership) -> WireLeadership {
    WireLeadership {
        election: l.election,
        term: l.term,
        token: l.token,
        session_id: l.session,
        value: l.value,
    }
}

fn observed(event: Observation) -> ObserveResponse {
    let event = match event {
        Observation::TermStarted { leader } => observe_response::Event::TermStarted(TermStarted {
            leader: Some(leader_info(leader)),
        }),
        Observation::Proclaimed { term, value } => {
            observe_response::Event::Proclaimed(Proclaimed { term, value })
        }
        Observation::Vacant { term, reason } => observe_response::Event::Vacant(Vacant {
            term,
            reason: match reason {
                Vacancy::Resigned => VacancyReason::Resigned,
                Vacancy::SessionEnded => VacancyReason::SessionEnded,
                Vacancy::Forced => VacancyReason::Forced,
                Vacancy::EpochAdvanced => VacancyReason::EpochAdvanced,
                Vacancy::Unknown => VacancyReason::Unspecified,
            } as i32,
        }),
        Observation::Gap { from_term, to_term } => {
            observe_response::Event::Gap(Gap { from_term, to_term })
        }
        Observation::TransferRequested { term, priority } => {
            observe_response::Event::TransferRequested(
                latchkey_proto::electionv1::TransferRequested { term, priority },
            )
        }
    };
    ObserveResponse { event: Some(event) }
}

/// Per-subject counts of calls open at this arbiter (campaigns, observe
/// streams), each released when its guard drops.
#[derive(Default)]
pub struct OpenCalls {
    counts: parking_lot::Mutex<std::collections::HashMap<String, u32>>,
}

pub struct OpenCall {
    calls: Arc<OpenCalls>,
    subject: String,
}

impl OpenCalls {
    fn open(
        self: &Arc<Self>,
        subject: &str,
        limit: u32,
        bound: IdentityBound,
    ) -> Result<OpenCall, ArbiterError> {
        let mut counts = self.counts.lock();
        let n = counts.entry(subject.to_string()).or_insert(0);
        if *n >= limit {
            return Err(ArbiterError::IdentityLimit { bound, limit });
        }
        *n += 1;
        Ok(OpenCall {
            calls: self.clone(),
            subject: subject.to_string(),
        })
    }
}

impl Drop for OpenCall {
    fn drop(&mut self) {
        let mut counts = self.calls.counts.lock();
        if let Some(n) = counts.get_mut(&self.subject) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.subject);
            }
        }
    }
}

impl Arbiter {
    /// The election's name (a lock key, authorised by the caller's prefix
    /// grants) and its cluster.
    async fn election_of(
        &self,
        policies: &PolicySet,
        caller: &Caller,
        raw: &str,
    ) -> Result<(LockKey, Arc<Cluster>), ArbiterError> {
        let key = self.authorised_key(policies, caller, raw)?;
        let cluster = self.tiers.for_key(&key).await?;
        Ok((key, cluster))
    }

    fn subject_of<'p>(&self, policies: &'p PolicySet, caller: &'p Caller) -> &'p str {
        policies
            .grants()
            .subject(&caller.identity)
            .unwrap_or(&caller.identity)
    }

    pub async fn campaign(
        &self,
        request: Request<CampaignRequest>,
    ) -> Result<CampaignResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let deadline = time_left(&request);
        let req = request.into_inner();
        let policies = self.policies.current();
        let key = self.authorised_key(&policies, &caller, &req.election)?;
        let subject = self.subject_of(&policies, &caller).to_string();
        let class = self.granted_class(&policies, &caller, &key, &req.class)?;
        if class.kind != ClassKind::Election {
            return Err(ArbiterError::WrongKind {
                class: truncate(&class.name, 64),
                kind: match class.kind {
                    ClassKind::Semaphore => "semaphore",
                    _ => "lock",
                },
                wanted: "election",
                call: "Campaign",
            });
        }
        let session = session_id(req.session_id)?;
        let value = checked_value(&req.value)?;
        let instance = checked_instance(&req.instance)?;
        let route = self
            .tiers
            .for_acquire(&policies, &key, class, session)
            .await?;
        if route.other_shard.is_some() {
            return Err(ArbiterError::BadRequest(format!(
                "election {:?} is homed on another entity shard than the session; elections run on one cluster: use a coord-tier election class",
                key.as_str()
            )));
        }
        let cluster = &route.cluster;
        let _open = self.campaign_calls.open(
            &subject,
            self.max_campaigns_per_subject,
            IdentityBound::Campaigns,
        )?;
        let elections = &cluster.elections;
        let wait = deadline
            .map(|d| d.saturating_sub(DEADLINE_MARGIN.min(d / 20)))
            .unwrap_or(self.max_wait)
            .min(self.max_wait);
        let campaign = Campaign {
            election: key.as_str().to_string(),
            identity: caller.identity.clone(),
            session,
            class: class.name.clone(),
            ttl_seconds: class.ttl_seconds,
            value,
            priority: req.priority,
            instance,
            bound: if subject == caller.identity {
                String::new()
            } else {
                subject
            },
            wait,
            max_leaderships: self.max_leaderships,
            max_elections: MAX_ELECTIONS_PER_SUBJECT,
            max_candidates: class.max_waiters_per_key,
            yields: class.yield_to_higher_priority,
        };
        let leadership = elections.campaign(&campaign).await?;
        debug!(identity = %caller.identity, election = %key.as_str(), term = leadership.term, "leads");
        Ok(CampaignResponse {
            leadership: Some(wire_leadership(leadership)),
        })
    }

    pub async fn proclaim(
        &self,
        request: Request<ProclaimRequest>,
    ) -> Result<ProclaimResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let req = request.into_inner();
        let policies = self.policies.current();
        let (key, cluster) = self.election_of(&policies, &caller, &req.election).await?;
        let claim = claim(&key, &caller, req.session_id, req.token)?;
        let value = checked_value(&req.value)?;
        cluster.elections.proclaim(&claim, &value).await?;
        Ok(ProclaimResponse {})
    }

    pub async fn resign(
        &self,
        request: Request<ResignRequest>,
    ) -> Result<ResignResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let req = request.into_inner();
        let policies = self.policies.current();
        let (key, cluster) = self.election_of(&policies, &caller, &req.election).await?;
        let claim = claim(&key, &caller, req.session_id, req.token)?;
        let next = cluster.elections.resign(&claim).await?;
        Ok(ResignResponse {
            next: next.map(leader_info),
        })
    }

    pub async fn transfer(
        &self,
        request: Request<TransferRequest>,
    ) -> Result<TransferResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let req = request.into_inner();
        let policies = self.policies.current();
        let (key, cluster) = self.election_of(&policies, &caller, &req.election).await?;
        let to = match req.to {
            Some(transfer_request::To::CandidateId(id)) if id > 0 => TransferTo::Candidate(id),
            Some(transfer_request::To::Preferred(true)) => TransferTo::Preferred,
            Some(transfer_request::To::HigherPriority(true)) => TransferTo::HigherPriority,
            _ => {
                return Err(ArbiterError::BadRequest(
                    "name whom to transfer to: candidate_id (from Candidates), preferred = true or higher_priority = true"
                        .into(),
                ));
            }
        };
        let claim = claim(&key, &caller, req.session_id, req.token)?;
        let next = cluster.elections.transfer(&claim, to).await?;
        Ok(TransferResponse {
            next: Some(leader_info(next)),
        })
    }

    pub async fn leader(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<LeaderResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let policies = self.policies.current();
        let (key, cluster) = self
            .election_of(&policies, &caller, &request.get_ref().election)
            .await?;
        let leader = cluster.elections.leader(key.as_str()).await?;
        Ok(LeaderResponse {
            election: key.as_str().to_string(),
            leader: leader.map(leader_info),
        })
    }

    pub async fn candidates(
        &self,
        request: Request<CandidatesRequest>,
    ) -> Result<CandidatesResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let policies = self.policies.current();
        let (key, cluster) = self
            .election_of(&policies, &caller, &request.get_ref().election)
            .await?;
        let candidates = cluster.elections.candidates(key.as_str()).await?;
        Ok(CandidatesResponse {
            election: key.as_str().to_string(),
            candidates: candidates
                .into_iter()
                .map(|c| Candidate {
                    candidate_id: c.id,
                    identity: c.identity,
                    value: c.value,
                    priority: c.priority,
                    since_unix_ms: c.since_unix_ms,
                })
                .collect(),
        })
    }

    /// An Observe stream: bounded per grant subject while it is open.
    pub async fn observe(
        &self,
        request: Request<ObserveRequest>,
    ) -> Result<ObserveStream, ArbiterError> {
        let caller = self.caller(&request)?;
        let req = request.into_inner();
        let policies = self.policies.current();
        let (key, cluster) = self.election_of(&policies, &caller, &req.election).await?;
        let subject = self.subject_of(&policies, &caller).to_string();
        let open = self.observe_calls.open(
            &subject,
            MAX_OBSERVERS_PER_SUBJECT,
            IdentityBound::Observers,
        )?;
        let observer = cluster
            .elections
            .observe(key.as_str(), req.from_term)
            .await?;
        // The stream keeps its place in the bound until it is dropped.
        // Transfer requests go only to observers that asked for them (a
        // client that does not know the event is never sent it).
        let transfers = req.transfer_requests;
        let stream = futures::stream::unfold(Some((observer, open)), move |state| async move {
            let (mut observer, open) = state?;
            let next = loop {
                match observer.next().await {
                    Some(Observation::TransferRequested { .. }) if !transfers => continue,
                    other => break other,
                }
            };
            match next {
                Some(event) => Some((Ok(observed(event)), Some((observer, open)))),
                None => Some((
                    Err(Status::unavailable(
                        "the arbiter stopped observing this election; observe again",
                    )),
                    None,
                )),
            }
        });
        Ok(Box::pin(stream))
    }
}

pub type ObserveStream = Pin<Box<dyn Stream<Item = Result<ObserveResponse, Status>> + Send>>;

/// The tonic-facing election service; cheap to clone.
#[derive(Clone)]
pub struct ElectionApi {
    pub(crate) inner: Arc<Arbiter>,
}

impl ElectionApi {
    pub fn new(inner: Arc<Arbiter>) -> Self {
        Self { inner }
    }
}

#[tonic::async_trait]
impl ElectionService for ElectionApi {
    async fn campaign(
        &self,
        mut request: Request<CampaignRequest>,
    ) -> Result<Response<CampaignResponse>, Status> {
        request
            .extensions_mut()
            .insert(super::acquire::Arrived(tokio::time::Instant::now()));
        let permit = self.inner.admit(&request, Work::Acquire).await?;
        let led = overload::holding(permit, self.inner.campaign(request)).await?;
        Ok(Response::new(led))
    }

    async fn proclaim(
        &self,
        request: Request<ProclaimRequest>,
    ) -> Result<Response<ProclaimResponse>, Status> {
        Ok(Response::new(self.inner.proclaim(request).await?))
    }

    async fn leader(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<LeaderResponse>, Status> {
        Ok(Response::new(self.inner.leader(request).await?))
    }

    type ObserveStream = ObserveStream;

    async fn observe(
        &self,
        request: Request<ObserveRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        Ok(Response::new(self.inner.observe(request).await?))
    }

    async fn resign(
        &self,
        request: Request<ResignRequest>,
    ) -> Result<Response<ResignResponse>, Status> {
        Ok(Response::new(self.inner.resign(request).await?))
    }

    async fn transfer(
        &self,
        request: Request<TransferRequest>,
    ) -> Result<Response<TransferResponse>, Status> {
        Ok(Response::new(self.inner.transfer(request).await?))
    }

    async fn candidates(
        &self,
        request: Request<CandidatesRequest>,
    ) -> Result<Response<CandidatesResponse>, Status> {
        Ok(Response::new(self.inner.candidates(request).await?))
    }
}
