//! admin.v1 shard calls (ADR-09): the shard map's status, a change of it,
//! and the steps of a move.

use latchkey_proto::adminv1::{
    ChangeShardsRequest, GetShardsRequest, ShardStatus, StepShardMoveRequest,
};
use tonic::Request;

use super::Arbiter;
use crate::error::ArbiterError;

impl Arbiter {
    pub async fn get_shards(
        &self,
        request: Request<GetShardsRequest>,
    ) -> Result<ShardStatus, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        Err(ArbiterError::Internal("shards are not wired yet".into()))
    }

    pub async fn change_shards(
        &self,
        request: Request<ChangeShardsRequest>,
    ) -> Result<ShardStatus, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        Err(ArbiterError::Internal("shards are not wired yet".into()))
    }

    pub async fn step_shard_move(
        &self,
        request: Request<StepShardMoveRequest>,
    ) -> Result<ShardStatus, ArbiterError> {
        let caller = self.caller(&request)?;
        self.require_operator(&caller)?;
        Err(ArbiterError::Internal("shards are not wired yet".into()))
    }
}
