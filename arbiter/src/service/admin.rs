use latchkey_proto::adminv1::{
    AdvanceEpochRequest, AdvanceEpochResponse, EdgeClass, EdgeGrant, EdgePolicy,
    GetEdgePolicyRequest, GetStatusRequest, GetStatusResponse,
};
use tonic::Request;
use tracing::warn;

use super::Arbiter;
use crate::error::ArbiterError;

impl Arbiter {
    pub async fn get_status(
        &self,
        request: Request<GetStatusRequest>,
    ) -> Result<GetStatusResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        // A fresh read: it also re-checks the header against the epoch.
        let state = self.table.seal().load_epoch().await?;
        let mark = self.table.seal().high_water();
        let seal_reason = self.table.seal().guard().seal_reason();
        // Read by load_epoch just now.
        let witnessed = self.table.seal().witnessed();
        let coord_seen = self.table.seal().coord_seen().unwrap_or_default();
        let witness = self.table.seal().witness().unwrap_or_else(|| {
            "the arbiter's state directory only (one cluster, no --coord-etcd)".into()
        });
        Ok(GetStatusResponse {
            epoch: state.epoch(),
            epoch_cluster_id: state.cluster_id,
            current_cluster_id: self.table.current_cluster_id().await?,
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
        let reason = req.reason.trim();
        if reason.is_empty() || reason.len() > 512 {
            return Err(ArbiterError::BadRequest(
                "an epoch advance needs a reason (1..=512 bytes): it is stored with the new epoch"
                    .into(),
            ));
        }
        let (record, deleted) = self
            .table
            .seal()
            .advance_epoch_at_least(req.expected_epoch, reason, req.at_least_epoch)
            .await?;
        warn!(operator = %caller.identity, epoch = record.epoch, holds_deleted = deleted, reason, "epoch advanced");
        Ok(AdvanceEpochResponse {
            epoch: record.epoch,
            cluster_id: record.cluster_id().unwrap_or(0),
            holds_deleted: deleted,
        })
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
