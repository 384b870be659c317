//! lock.v1 and admin.v1 over tonic: one file per RPC under `service/`.
//! Handlers are plain async methods on [`Arbiter`], so tests can call them
//! directly; errors become `tonic::Status` only at this boundary.

mod acquire;
mod admin;
mod close_session;
pub(crate) mod election;
mod inspect;
mod keep_alive;
mod open_session;
mod release;
mod shadow;
mod shards;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use latchkey_policies::{LockClass, LockKey, PolicySet};
use latchkey_proto::adminv1::admin_server::Admin;
use latchkey_proto::adminv1::{
    AdvanceEpochRequest, AdvanceEpochResponse, ApproveForceReleaseRequest,
    ApproveForceReleaseResponse, EdgePolicy, ForceReleaseRequest, GetEdgePolicyRequest,
    GetStatusRequest, GetStatusResponse, ListForceReleasesRequest, ListForceReleasesResponse,
    RequestForceReleaseRequest,
};
use latchkey_proto::adminv1::{
    ChangeShardsRequest, ChangeShardsResponse, GetShardsRequest, GetShardsResponse,
    StepShardMoveRequest, StepShardMoveResponse,
};
use latchkey_proto::lockv1::lock_server::Lock;
use latchkey_proto::lockv1::{
    AcquireRequest, AcquireResponse, CloseSessionRequest, CloseSessionResponse, InspectRequest,
    InspectResponse, KeepAliveRequest, KeepAliveResponse, OpenSessionRequest, OpenSessionResponse,
    ReleaseRequest, ReleaseResponse,
};
use tonic::{Request, Response, Status, Streaming};

use crate::error::ArbiterError;
use crate::hook::ClassHooks;
use crate::identity::{Caller, IdentitySource};
use crate::metrics::{Metrics, Scope};
use crate::overload::{self, Work};
use crate::policy::Policies;

/// Everything a request handler needs.
pub struct Arbiter {
    /// The tiers' clusters (ADR-07), each with its grant protocol table,
    /// hold count, quorum verdict and force-release store.
    pub(crate) tiers: crate::tiers::Tiers,
    pub(crate) policies: Arc<Policies>,
    pub(crate) identity: IdentitySource,
    /// Workloads may call directly (no edge configured, or allowed for dev).
    pub(crate) direct_workloads: bool,
    pub(crate) hooks: Arc<dyn ClassHooks>,
    pub(crate) max_wait: Duration,
    pub(crate) metrics: Arc<Metrics>,
    /// Per-identity bounds on sessions and renewals.
    pub(crate) bounds: Arc<crate::bounds::Bounds>,
    /// New work's admission under overload: renewals first.
    pub(crate) admission: Arc<crate::overload::Admission>,
    /// Campaign calls and Observe streams open here, per grant subject.
    pub(crate) campaign_calls: Arc<election::OpenCalls>,
    pub(crate) observe_calls: Arc<election::OpenCalls>,
    pub(crate) max_campaigns_per_subject: u32,
    /// Leaderships per grant subject (a leadership counts like a hold).
    pub(crate) max_leaderships: u32,
}

impl Arbiter {
    /// The identity the call acts for (see [`IdentitySource::caller`]), and
    /// the production rule that workloads come through the edge.
    pub(crate) fn caller<T>(&self, request: &Request<T>) -> Result<Caller, ArbiterError> {
        let caller = self.identity.caller(request)?;
        if !self.direct_workloads
            && caller.direct
            && !self.policies.current().is_operator(&caller.identity)
        {
            return Err(ArbiterError::DirectCallRefused);
        }
        Ok(caller)
    }

    /// Parses the key and checks the caller's prefix grants. The refusal is
    /// the same whether or not the key exists or is held.
    pub(crate) fn authorised_key(
        &self,
        policies: &PolicySet,
        caller: &Caller,
        raw: &str,
    ) -> Result<LockKey, ArbiterError> {
        self.authorised_key_in(policies, caller, raw, &mut Scope::default())
    }

    /// [`Self::authorised_key`], noting the granted prefix's namespace in `scope`.
    pub(crate) fn authorised_key_in(
        &self,
        policies: &PolicySet,
        caller: &Caller,
        raw: &str,
        scope: &mut Scope,
    ) -> Result<LockKey, ArbiterError> {
        let key = LockKey::parse(raw).map_err(|e| ArbiterError::BadKey(e.to_string()))?;
        let prefix = policies
            .authorise(&caller.identity, &key)
            .ok_or(ArbiterError::NotAuthorised)?;
        scope.authorised(prefix);
        Ok(key)
    }

    /// The Prometheus text exposition of this arbiter's metrics.
    pub fn metrics_text(&self) -> Result<String, std::fmt::Error> {
        self.metrics.encode()
    }

    /// The class `name`, if the grant that authorises `caller` on `key`
    /// allows it (a grant may list the classes its prefixes are for).
    pub(crate) fn granted_class<'p>(
        &self,
        policies: &'p PolicySet,
        caller: &Caller,
        key: &LockKey,
        name: &str,
    ) -> Result<&'p LockClass, ArbiterError> {
        let class = self.class(policies, name)?;
        match policies.grants().classes_for(&caller.identity, key) {
            None => Err(ArbiterError::NotAuthorised),
            Some(None) => Ok(class),
            Some(Some(allowed)) if allowed.contains(&class.name) => Ok(class),
            Some(Some(allowed)) => Err(ArbiterError::ClassNotGranted {
                class: class.name.clone(),
                allowed: allowed.iter().cloned().collect(),
            }),
        }
    }

    pub(crate) fn class<'p>(
        &self,
        policies: &'p PolicySet,
        name: &str,
    ) -> Result<&'p LockClass, ArbiterError> {
        policies
            .class(name)
            .ok_or_else(|| ArbiterError::UnknownClass {
                class: truncate(name, 64),
            })
    }

    /// A place for one call of new work ([`crate::overload`]), after the
    /// caller is known and has a grant subject (which has a bounded share
    /// of the queue, and of the places while others wait): a call refused
    /// for who it is costs no place.
    pub(crate) async fn admit<T>(
        &self,
        request: &Request<T>,
        work: Work,
    ) -> Result<overload::Permit, ArbiterError> {
        if !self.admission.enabled() {
            return self.admission.admit(work, "", None).await;
        }
        let caller = self.caller(request)?;
        let policies = self.policies.current();
        // An identity with no grant can neither open a session nor lock a
        // key: refused before it takes a place (else every ungranted pod
        // would have a queue share of its own).
        let subject = policies
            .grants()
            .subject(&caller.identity)
            .ok_or(ArbiterError::NotAuthorised)?;
        self.admission
            .admit(work, subject, acquire::grpc_timeout(request))
            .await
    }

    pub(crate) fn require_operator(&self, caller: &Caller) -> Result<(), ArbiterError> {
        if self.policies.current().is_operator(&caller.identity) {
            Ok(())
        } else {
            Err(ArbiterError::NotOperator)
        }
    }
}

pub(crate) fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let cut: String = s.chars().take(max).collect();
        format!("{cut}…")
    }
}

pub(crate) fn session_id(raw: i64) -> Result<i64, ArbiterError> {
    if raw <= 0 {
        return Err(ArbiterError::BadRequest(
            "session_id is missing; call OpenSession first and pass its session_id".into(),
        ));
    }
    Ok(raw)
}

/// The tonic-facing service; cheap to clone.
#[derive(Clone)]
pub struct LockService {
    pub(crate) inner: Arc<Arbiter>,
}

impl LockService {
    pub fn new(inner: Arc<Arbiter>) -> Self {
        Self { inner }
    }
}

type KeepAliveStream = Pin<Box<dyn Stream<Item = Result<KeepAliveResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Lock for LockService {
    async fn open_session(
        &self,
        request: Request<OpenSessionRequest>,
    ) -> Result<Response<OpenSessionResponse>, Status> {
        let permit = self.inner.admit(&request, Work::Open).await?;
        let opened = overload::holding(permit, self.inner.open_session(request)).await?;
        Ok(Response::new(opened))
    }

    type KeepAliveStream = KeepAliveStream;

    async fn keep_alive(
        &self,
        request: Request<Streaming<KeepAliveRequest>>,
    ) -> Result<Response<Self::KeepAliveStream>, Status> {
        Ok(Response::new(self.inner.clone().keep_alive(request)?))
    }

    async fn close_session(
        &self,
        request: Request<CloseSessionRequest>,
    ) -> Result<Response<CloseSessionResponse>, Status> {
        Ok(Response::new(self.inner.close_session(request).await?))
    }

    async fn acquire(
        &self,
        mut request: Request<AcquireRequest>,
    ) -> Result<Response<AcquireResponse>, Status> {
        // The time it queues for a place comes off its wait for the key.
        request
            .extensions_mut()
            .insert(acquire::Arrived(tokio::time::Instant::now()));
        // The place is given back when the call starts waiting for its key.
        let permit = self.inner.admit(&request, Work::Acquire).await?;
        let acquired = overload::holding(permit, self.inner.acquire(request)).await?;
        Ok(Response::new(acquired))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        Ok(Response::new(self.inner.release(request).await?))
    }

    async fn inspect(
        &self,
        request: Request<InspectRequest>,
    ) -> Result<Response<InspectResponse>, Status> {
        Ok(Response::new(self.inner.inspect(request).await?))
    }
}

#[derive(Clone)]
pub struct AdminService {
    pub(crate) inner: Arc<Arbiter>,
}

impl AdminService {
    pub fn new(inner: Arc<Arbiter>) -> Self {
        Self { inner }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn get_status(
        &self,
        request: Request<GetStatusRequest>,
    ) -> Result<Response<GetStatusResponse>, Status> {
        Ok(Response::new(self.inner.get_status(request).await?))
    }

    async fn advance_epoch(
        &self,
        request: Request<AdvanceEpochRequest>,
    ) -> Result<Response<AdvanceEpochResponse>, Status> {
        Ok(Response::new(self.inner.advance_epoch(request).await?))
    }

    async fn get_edge_policy(
        &self,
        request: Request<GetEdgePolicyRequest>,
    ) -> Result<Response<EdgePolicy>, Status> {
        Ok(Response::new(self.inner.get_edge_policy(request).await?))
    }

    async fn request_force_release(
        &self,
        request: Request<RequestForceReleaseRequest>,
    ) -> Result<Response<ForceReleaseRequest>, Status> {
        Ok(Response::new(
            self.inner.request_force_release(request).await?,
        ))
    }

    async fn approve_force_release(
        &self,
        request: Request<ApproveForceReleaseRequest>,
    ) -> Result<Response<ApproveForceReleaseResponse>, Status> {
        Ok(Response::new(
            self.inner.approve_force_release(request).await?,
        ))
    }

    async fn list_force_releases(
        &self,
        request: Request<ListForceReleasesRequest>,
    ) -> Result<Response<ListForceReleasesResponse>, Status> {
        Ok(Response::new(
            self.inner.list_force_releases(request).await?,
        ))
    }

    async fn get_shards(
        &self,
        request: Request<GetShardsRequest>,
    ) -> Result<Response<GetShardsResponse>, Status> {
        Ok(Response::new(GetShardsResponse {
            status: Some(self.inner.get_shards(request).await?),
        }))
    }

    async fn change_shards(
        &self,
        request: Request<ChangeShardsRequest>,
    ) -> Result<Response<ChangeShardsResponse>, Status> {
        Ok(Response::new(ChangeShardsResponse {
            status: Some(self.inner.change_shards(request).await?),
        }))
    }

    async fn step_shard_move(
        &self,
        request: Request<StepShardMoveRequest>,
    ) -> Result<Response<StepShardMoveResponse>, Status> {
        Ok(Response::new(StepShardMoveResponse {
            status: Some(self.inner.step_shard_move(request).await?),
        }))
    }
}
