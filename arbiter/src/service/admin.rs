use std::sync::Arc;

use latchkey_policies::LockKey;
use latchkey_proto::adminv1::{
    AdvanceEpochRequest, AdvanceEpochResponse, ApproveForceReleaseRequest,
    ApproveForceReleaseResponse, EdgeClass, EdgeGrant, EdgePolicy, ForceRecord,
    ForceReleaseRequest, GetEdgePolicyRequest, GetStatusRequest, GetStatusResponse,
    ListForceReleasesRequest, ListForceReleasesResponse, RequestForceReleaseRequest,
};
use tonic::{Request, Status};
use tracing::{debug, warn};

use super::{Arbiter, session_id};
use crate::error::ArbiterError;
use crate::force_release::{self, ForceError, ForceRelease, RequestRecord};
use crate::lock_log::{SessionRevoked, StoreError};
use crate::oidc::SignedIn;

impl Arbiter {
    pub async fn get_status(
        &self,
        request: Request<GetStatusRequest>,
    ) -> Result<GetStatusResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        let cluster = self.tier_named(&request.get_ref().tier)?;
        self.status_of(cluster).await
    }

    /// `cluster`'s epoch, seal, witness and quorum posture (GetStatus, and
    /// the console's System page).
    pub(crate) async fn status_of(
        &self,
        cluster: &crate::tiers::Cluster,
    ) -> Result<GetStatusResponse, ArbiterError> {
        let table = &cluster.table;
        // A fresh read: it also re-checks the header against the epoch.
        // During a quorum loss etcd cannot answer: the status still does,
        // from what the arbiter last read.
        let quorum = cluster.quorum.snapshot();
        let state = match table.seal().load_epoch().await {
            Ok(state) => state,
            Err(e) if quorum.lost => table.seal().guard().state().ok_or(e)?,
            Err(e) => return Err(e),
        };
        let mark = table.seal().high_water();
        let seal_reason = table.seal().guard().seal_reason();
        // Read by load_epoch just now.
        let witnessed = table.seal().witnessed();
        let coord_seen = table.seal().coord_seen().unwrap_or_default();
        let witness = table.seal().witness().unwrap_or_else(|| {
            "the arbiter's state directory only (one cluster, no --coord-etcd)".into()
        });
        let current_cluster_id = match table.current_cluster_id().await {
            Ok(id) => id,
            Err(_) if quorum.lost => 0,
            Err(e) => return Err(e),
        };
        Ok(GetStatusResponse {
            epoch: state.epoch(),
            epoch_cluster_id: state.cluster_id,
            current_cluster_id,
            sealed: seal_reason.is_some(),
            seal_reason: seal_reason.unwrap_or_default(),
            revision_high_water_mark: mark.map_or(0, |m| m.revision),
            policy_error: self.policies.last_error().unwrap_or_default(),
            grants_version: self.policies.current().grants().version(),
            witness,
            witnessed_revision: witnessed.mark.map_or(0, |m| m.revision),
            witnessed_mark_epoch: witnessed.mark.map_or(0, |m| m.epoch),
            witnessed_epoch: witnessed.epoch,
            coord_seen_revision: coord_seen.mark.map_or(0, |m| m.revision),
            coord_seen_mark_epoch: coord_seen.mark.map_or(0, |m| m.epoch),
            coord_seen_epoch: coord_seen.epoch,
            quorum_lost: quorum.lost,
            quorum_lost_for_ms: quorum.lost_for_ms,
            quorum_last_error: quorum.last_error,
            unprotected_memory_grants: u32::try_from(quorum.memory_grants).unwrap_or(u32::MAX),
            quorum_loss_spool_bytes: quorum.spool_bytes,
            quorum_loss_spool_limit_bytes: quorum.spool_limit_bytes,
            tier: cluster.name().to_string(),
            tiers_split: self.tiers.split(),
        })
    }

    /// ADR-03's unseal. Requires the operator role (two-person approval comes
    /// with the operations work).
    pub async fn advance_epoch(
        &self,
        request: Request<AdvanceEpochRequest>,
    ) -> Result<AdvanceEpochResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        let req = request.into_inner();
        // Stored with the new epoch and shown by status: one line of
        // printable text (latchkey_proto::text says why).
        let reason = latchkey_proto::text::checked(&req.reason, "an epoch advance's reason", 512)
            .map_err(ArbiterError::BadRequest)?;
        let cluster = self.tier_named(&req.tier)?;
        let (record, deleted) = cluster
            .table
            .seal()
            .advance_epoch_at_least(req.expected_epoch, reason, req.at_least_epoch)
            .await?;
        warn!(operator = %caller.identity, tier = cluster.name(), epoch = record.epoch, holds_deleted = deleted, reason, "epoch advanced");
        Ok(AdvanceEpochResponse {
            epoch: record.epoch,
            cluster_id: record.cluster_id().unwrap_or(0),
            holds_deleted: deleted,
        })
    }
}

impl Arbiter {
    /// The cluster an admin call names by tier ("" is the entity cluster).
    fn tier_named(&self, tier: &str) -> Result<&Arc<crate::tiers::Cluster>, ArbiterError> {
        match tier.trim() {
            "" | "entity" => Ok(self.tiers.entity()),
            "coord" => self.tiers.coord().ok_or_else(|| {
                ArbiterError::BadRequest(
                    "the tiers are not split on this arbiter (no --split-tiers): the coord tier's keys live on the entity cluster; leave --tier out".into(),
                )
            }),
            other => Err(ArbiterError::BadRequest(format!(
                "unknown tier {:?}: the tiers are \"entity\" and \"coord\"",
                super::truncate(other, 32)
            ))),
        }
    }
}

impl Arbiter {
    /// The grant table for the edge filter: served to the edge acting on its
    /// own behalf (its SVID, no caller named: the filter's refresh) and to
    /// operators. A call the edge forwards names its caller and is judged as
    /// that caller, so a workload never reads the table through the edge.
    pub async fn get_edge_policy(
        &self,
        request: Request<GetEdgePolicyRequest>,
    ) -> Result<EdgePolicy, ArbiterError> {
        let policies = self.policies.current();
        if !self.identity.is_edge_itself(&request) {
            let caller = self.caller(&request)?;
            if !policies.is_operator(&caller.identity) {
                return Err(ArbiterError::NotOperator);
            }
        }
        let grants = policies.grants();
        Ok(EdgePolicy {
            version: grants.version(),
            grants: grants
                .identities()
                .map(|identity| EdgeGrant {
                    identity: identity.to_string(),
                    prefixes: grants.prefixes(identity).map(str::to_string).collect(),
                })
                .collect(),
            classes: policies
                .classes()
                .values()
                .map(|c| EdgeClass {
                    name: c.name.clone(),
                    max_waiters_per_key: c.max_waiters_per_key,
                })
                .collect(),
        })
    }
}

/// Force-release (ADR-20). Every call needs both an operator SVID on the
/// channel and a verified ID token with the lock-operator role; the
/// handlers translate, [`ForceRelease`] decides. No token is ever logged.
impl Arbiter {
    /// The channel's operator identity and the signed-in person, or the refusal.
    async fn force_caller<T>(
        &self,
        request: &Request<T>,
        id_token: &str,
    ) -> Result<(Arc<ForceRelease>, String, SignedIn), Status> {
        let caller = self.caller(request)?;
        self.require_operator(&caller)?;
        // Signs in with the entity cluster's (every cluster's verifier is
        // configured alike).
        let force = self
            .tiers
            .entity()
            .force
            .clone()
            .ok_or(ForceError::Disabled)?;
        let signed_in = match force.sign_in(id_token).await {
            Ok(s) => s,
            Err(e) => {
                warn!(operator = %caller.identity, refusal = e.reason(), "force-release call refused: {e}");
                return Err(e.into());
            }
        };
        Ok((force, caller.identity, signed_in))
    }

    pub async fn request_force_release(
        &self,
        request: Request<RequestForceReleaseRequest>,
    ) -> Result<ForceReleaseRequest, Status> {
        let (_, operator, requester) = self
            .force_caller(&request, &request.get_ref().id_token)
            .await?;
        self.force_request_as(&requester, &operator, request.into_inner())
            .await
    }

    /// A force-release request by `requester` (signed in; the operator
    /// role judged by the caller), through `operator` (the SVID on the
    /// channel, or the console): RequestForceRelease and the console's.
    pub(crate) async fn force_request_as(
        &self,
        requester: &SignedIn,
        operator: &str,
        req: RequestForceReleaseRequest,
    ) -> Result<ForceReleaseRequest, Status> {
        // An election's name is a lock key too (its own records, though).
        let key = LockKey::parse(&req.key).map_err(|e| ArbiterError::BadKey(e.to_string()))?;
        let target = match req.election {
            true => force_release::Target::Leadership,
            false => force_release::Target::Hold,
        };
        // A semaphore's hold is on its slot's key (as Inspect lists it), a
        // shared hold on its session's reader key.
        let held = match (req.slot, req.election, req.shared_session) {
            (None, false, Some(session)) => {
                crate::records::reader_key(key.as_str(), session_id(session)?)
            }
            (_, _, Some(_)) => {
                return Err(ArbiterError::BadRequest(
                    "a shared hold is named by its session alone: no slot, no election".into(),
                )
                .into());
            }
            (None, _, None) => key.as_str().to_string(),
            (Some(slot), false, None) if slot < latchkey_policies::MAX_PERMITS => {
                crate::records::slot_key(key.as_str(), slot)
            }
            (Some(_), true, None) => {
                return Err(ArbiterError::BadSlot(
                    "an election has no slots: name the election without a slot".into(),
                )
                .into());
            }
            (Some(slot), false, None) => {
                return Err(ArbiterError::BadSlot(format!(
                    "slot {slot} is above every semaphore's permits (at most {})",
                    latchkey_policies::MAX_PERMITS
                ))
                .into());
            }
        };
        let policies = self.policies.current();
        // The request lives with the hold (or the election), on the key's
        // cluster (ADR-07).
        let force = self
            .tiers
            .for_key(&key)
            .await?
            .force
            .clone()
            .ok_or(ForceError::Disabled)?;
        let record = force
            .request(
                requester,
                operator,
                target,
                &held,
                &req.reason,
                req.revoke_session,
                |class| policies.class(class).map(|c| c.enforcement),
            )
            .await?;
        warn!(
            operator = %operator,
            subject = ?requester.subject,
            key = %record.key,
            election = record.election,
            term = record.term,
            request_id = %record.id,
            holder = %record.holder_identity,
            class = %record.class,
            enforcement = %record.enforcement,
            revoke_session = record.revoke_session,
            reason = ?record.reason,
            "force-release requested; a different operator must approve it"
        );
        Ok(request_view(&record))
    }

    pub async fn approve_force_release(
        &self,
        request: Request<ApproveForceReleaseRequest>,
    ) -> Result<ApproveForceReleaseResponse, Status> {
        let (_, operator, approver) = self
            .force_caller(&request, &request.get_ref().id_token)
            .await?;
        let id = request.into_inner().request_id;
        self.force_approve_as(&approver, &operator, &id).await
    }

    /// Approves request `id` as `approver` (signed in; the operator role
    /// judged by the caller), through `operator`: ApproveForceRelease and
    /// the console's.
    pub(crate) async fn force_approve_as(
        &self,
        approver: &SignedIn,
        operator: &str,
        id: &str,
    ) -> Result<ApproveForceReleaseResponse, Status> {
        // The request is on its key's cluster: ask each until one has it.
        // A cluster that cannot answer does not stop the one that has it.
        let (mut found, mut unknown, mut store) = (None, None, None);
        for cluster in self.tiers.all() {
            let Some(force) = &cluster.force else {
                continue;
            };
            match force
                .approve(
                    &cluster.owner,
                    &cluster.elections,
                    approver,
                    operator,
                    id.trim(),
                )
                .await
            {
                Err(e @ ForceError::UnknownRequest { .. }) => unknown = Some(e),
                Err(e @ ForceError::Store { .. }) => store = store.or(Some(e)),
                other => {
                    found = Some(other);
                    break;
                }
            }
        }
        let outcome = match found {
            Some(outcome) => outcome,
            None => Err(store.or(unknown).unwrap_or(ForceError::Disabled)),
        };
        let approved = match outcome {
            Ok(a) => a,
            Err(e) => {
                warn!(operator = %operator, subject = ?approver.subject, refusal = e.reason(), "force-release approval refused: {e}");
                return Err(e.into());
            }
        };
        let revoked = match &approved.revoke {
            Some(marker) => Some(self.revoke_holder_session(marker).await),
            None => None,
        };
        let (session_revoked, session_revoke_error) = match &revoked {
            Some(Ok(())) => (true, String::new()),
            Some(Err(e)) => {
                warn!(session = approved.request.holder_session, error = %e, "force-release: the hold is released but the session could not be revoked");
                (false, e.clone())
            }
            None => (false, String::new()),
        };
        warn!(
            operator = %operator,
            approver = ?approver.subject,
            requester = ?approved.request.requester_subject,
            key = %approved.request.key,
            election = approved.request.election,
            term = approved.request.term,
            request_id = %approved.request.id,
            holder = %approved.request.holder_identity,
            enforcement = %approved.request.enforcement,
            revision = approved.revision,
            session_revoked,
            "{}",
            match approved.request.election {
                true => "FORCE-RELEASED a leadership (its term ended)",
                false => "FORCE-RELEASED a hold",
            }
        );
        Ok(ApproveForceReleaseResponse {
            request: Some(request_view(&approved.request)),
            approver: approved.record.approved_by.clone(),
            approved_at_unix_ms: approved.record.approved_at_unix_ms,
            revision: approved.revision,
            session_revoked,
            session_revoke_error,
        })
    }

    /// The holder's session an approved force-release revokes: on its home
    /// cluster (the key may be on a shard that holds only its shadow), as
    /// CloseSession ends one: its shadows on other shards go too, and its
    /// next renewal must reach etcd (and fail).
    async fn revoke_holder_session(
        &self,
        marker: &force_release::RevokeRecord,
    ) -> Result<(), String> {
        match self.revoke_approved_session(marker).await {
            Ok(revoked) => force_release::revocation_said(&revoked),
            Err(e) => Err(format!("finding the session's cluster: {e}")),
        }
    }

    /// An approval's revocation of the holder's session (`marker.session`),
    /// as CloseSession ends one: on its home cluster (the key may be on a
    /// shard holding only its shadow), counted as the session counts say,
    /// its renewal forgotten, its shadows on other shards ended once it has
    /// ended. `Err`: its cluster could not be found, nothing was revoked.
    pub async fn revoke_approved_session(
        &self,
        marker: &force_release::RevokeRecord,
    ) -> Result<Result<SessionRevoked, StoreError>, ArbiterError> {
        let session = marker.session;
        let cluster = self.tiers.session_cluster(session).await?.clone();
        let home = std::ptr::eq(cluster.as_ref(), self.tiers.entity().as_ref());
        // Read before the revocation: the marks end with the session's lease.
        let marked = match home && self.has_shadows() {
            true => self.shadows_to_end(session).await,
            false => Some(Vec::new()),
        };
        let counted_as = cluster
            .sessions
            .subject_of(session)
            .unwrap_or_else(|| marker.holder_identity.clone());
        let revoked = force_release::revoke_session(&cluster.owner, &counted_as, marker).await;
        self.bounds.forget_renewal(session);
        // The session has ended (now or before) unless the store failed.
        if home && revoked.is_ok() {
            self.end_shadows(session, marked).await;
        }
        Ok(revoked)
    }

    /// Pending force-release requests and the force records still kept,
    /// over every cluster.
    pub(crate) async fn force_list(
        &self,
    ) -> Result<(Vec<RequestRecord>, Vec<force_release::ForceRecord>), ForceError> {
        let (mut pending, mut done) = (Vec::new(), Vec::new());
        for force in self.tiers.all().into_iter().filter_map(|c| c.force.clone()) {
            let (p, d) = force.list().await?;
            pending.extend(p);
            done.extend(d);
        }
        Ok((pending, done))
    }

    pub async fn list_force_releases(
        &self,
        request: Request<ListForceReleasesRequest>,
    ) -> Result<ListForceReleasesResponse, Status> {
        let (_, operator, subject) = self
            .force_caller(&request, &request.get_ref().id_token)
            .await?;
        let (pending, done) = self.force_list().await?;
        debug!(operator = %operator, subject = ?subject.subject, pending = pending.len(), "force-release requests listed");
        Ok(ListForceReleasesResponse {
            pending: pending.iter().map(request_view).collect(),
            done: done
                .into_iter()
                .map(|r| ForceRecord {
                    id: r.request_id,
                    key: r.key,
                    holder_identity: r.holder_identity,
                    holder_session: r.holder_session,
                    hold_revision: r.hold_revision,
                    class: r.class,
                    enforcement: r.enforcement,
                    reason: r.reason,
                    requester: r.requested_by,
                    approver: r.approved_by,
                    requested_at_unix_ms: r.requested_at_unix_ms,
                    approved_at_unix_ms: r.approved_at_unix_ms,
                    revoke_session: r.revoke_session,
                    election: r.election,
                    term: r.term,
                })
                .collect(),
        })
    }
}

/// What an approver sees of a request, warning included.
pub(crate) fn request_view(r: &RequestRecord) -> ForceReleaseRequest {
    let (kind, name) = crate::records::hold_kind(&r.key);
    let slot = crate::records::split_slot(&r.key).map(|(_, slot)| slot);
    let key = name.to_string();
    ForceReleaseRequest {
        request_id: r.id.clone(),
        key,
        holder_identity: r.holder_identity.clone(),
        holder_session: r.holder_session,
        // A term's revision is its leader's token's: never shown.
        hold_revision: match r.election {
            true => 0,
            false => r.hold_revision,
        },
        class: r.class.clone(),
        enforcement: r.enforcement.clone(),
        warning: force_release::warning_for(&r.enforcement).to_string(),
        reason: r.reason.clone(),
        revoke_session: r.revoke_session,
        requester: r.requester_subject.clone(),
        requested_at_unix_ms: r.requested_at_unix_ms,
        expires_at_unix_ms: r.expires_at_unix_ms,
        requester_identity: r.requester_identity.clone(),
        election: r.election,
        term: r.term,
        slot,
        shared: kind == crate::records::HoldKind::Shared,
    }
}
