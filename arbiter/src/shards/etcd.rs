//! The shard map on the coord cluster: one JSON document at
//! `{coord prefix}/sys/shards`, changed only by a compare-and-swap on its
//! mod revision (so two operators' changes never both land), and followed
//! by every arbiter with a watch.

use latchkey_etcd::Client;
use latchkey_etcd::kv::{get_one, head};
use latchkey_etcd::txn::{self, Compare, CompareOp, Txn, TxnOp};
use latchkey_etcd::watch::{EventType, WatchOptions, watch_from};
use tokio::sync::watch;
use tracing::warn;

pub use super::PublishError;
use super::{ShardMap, ShardMaps, newer};
use crate::lock_log::StoreError;
use crate::lock_log::etcd::{StoreConfig, connect_client, unavailable};

/// The shard map's home on the coord cluster.
pub struct ShardMapStore {
    client: Client,
    key: String,
}

impl ShardMapStore {
    /// Connects to the coord cluster as `config` says.
    pub async fn connect(config: &StoreConfig) -> Result<Self, StoreError> {
        Ok(Self::new(connect_client(config).await?, &config.prefix))
    }

    pub fn new(client: Client, coord_prefix: &str) -> Self {
        Self {
            client,
            key: format!("{}/sys/shards", coord_prefix.trim_end_matches('/')),
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }
}

#[async_trait::async_trait]
impl ShardMaps for ShardMapStore {
    async fn cluster_id(&self) -> Result<u64, StoreError> {
        let header = head(&self.client, self.key.as_str())
            .await
            .map_err(|e| unavailable("cannot read the coord cluster's id", e))?;
        Ok(header.map_or(0, |h| h.cluster_id()))
    }

    async fn load(&self) -> Result<Option<(ShardMap, i64)>, StoreError> {
        let read = get_one(&self.client, self.key.as_str())
            .await
            .map_err(|e| unavailable("cannot read the shard map", e))?;
        match read.value {
            None => Ok(None),
            Some(kv) => {
                let map = parse(kv.value())?;
                Ok(Some((map, kv.mod_revision())))
            }
        }
    }

    async fn publish(
        &self,
        current: Option<&ShardMap>,
        read_at: Option<i64>,
        next: &ShardMap,
    ) -> Result<(), PublishError> {
        super::check_publish(current, next)?;
        let body = serde_json::to_vec(next).map_err(|e| StoreError::Unavailable {
            context: format!("cannot encode the shard map: {e}"),
            source: None,
        })?;
        let compare = match read_at {
            Some(rev) => Compare::mod_revision(self.key.as_str(), CompareOp::Equal, rev),
            None => Compare::create_revision(self.key.as_str(), CompareOp::Equal, 0),
        };
        let txn = Txn::new()
            .when([compare])
            .and_then([TxnOp::put(self.key.as_str(), body, None)])
            .or_else([TxnOp::get(self.key.as_str(), None)]);
        let resp = txn::run(&self.client, txn)
            .await
            .map_err(|e| unavailable("cannot write the shard map", e))?;
        if resp.succeeded() {
            return Ok(());
        }
        let current = resp
            .op_responses()
            .iter()
            .find_map(|op| txn::first_kv(op).map(|kv| kv.value().to_vec()))
            .and_then(|v| parse(&v).ok())
            .map_or(0, |m| m.version);
        Err(PublishError::Raced { current })
    }

    async fn follow(&self, tx: watch::Sender<Option<ShardMap>>) {
        loop {
            if let Err(e) = self.follow_once(&tx).await {
                warn!(error = %e, "lost the shard map's watch; reading it again");
            }
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }
}

impl ShardMapStore {
    async fn follow_once(&self, tx: &watch::Sender<Option<ShardMap>>) -> Result<(), StoreError> {
        let read = get_one(&self.client, self.key.as_str())
            .await
            .map_err(|e| unavailable("cannot read the shard map", e))?;
        let revision = read.header.map_or(0, |h| h.revision());
        let first = read.value.map(|kv| parse(kv.value())).transpose()?;
        newer(tx, first);
        let options = WatchOptions::new();
        let mut stream = watch_from(&self.client, self.key.as_str(), revision + 1, options)
            .await
            .map_err(|e| unavailable("cannot watch the shard map", e))?;
        while let Some(resp) = stream
            .message()
            .await
            .map_err(|e| unavailable("the shard map's watch failed", e))?
        {
            if tx.is_closed() {
                return Ok(());
            }
            for event in resp.events() {
                match (event.event_type(), event.kv()) {
                    (EventType::Put, Some(kv)) => match parse(kv.value()) {
                        Ok(map) => newer(tx, Some(map)),
                        Err(e) => {
                            warn!(error = %e, "a shard map that does not parse was written; keeping the last good one")
                        }
                    },
                    _ => warn!("the shard map was deleted; keeping the last good one"),
                }
            }
            if resp.canceled() {
                return Ok(());
            }
        }
        Ok(())
    }
}

fn parse(bytes: &[u8]) -> Result<ShardMap, StoreError> {
    let map: ShardMap = serde_json::from_slice(bytes).map_err(|e| StoreError::Unavailable {
        context: format!("the stored shard map does not parse: {e}"),
        source: None,
    })?;
    map.check().map_err(|e| StoreError::Unavailable {
        context: format!("the stored shard map is not valid: {e}"),
        source: None,
    })?;
    Ok(map)
}
