//! Schema 1 to schema 2: events keyed and ordered by the raw revision (a
//! token's low half, issue 31) become events with ids, and schema 1's
//! tables are dropped.
//!
//! Each cluster's events are read in pages in revision order and written
//! again with their ids, at positions from their observation time (rising
//! with the revision), so the history reads as it did. Then the checkpoint
//! is sealed into schema 2 and the old tables dropped, events first. Every
//! step is idempotent: a migration cut short starts again from the old
//! tables (the new ones ignore copies, and the positions come out the
//! same), and one whose old events are gone finishes the checkpoints.
//!
//! What it cannot reach: copies of the old tables elsewhere (backups,
//! exports, replicas being restored). Expire those.

use async_trait::async_trait;
use serde::Deserialize;
use tracing::info;

use super::{AuditStore, StoreError};
use crate::event::{Ended, Event, Kind, Row, without_numbers};
use crate::pseudonym::AuditKey;

/// Schema 1 rows per page.
pub(super) const PAGE: u32 = 5000;

/// A row of schema 1 (`latchkey_audit_events`).
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct V1Row {
    #[serde(deserialize_with = "crate::event::number_or_string")]
    pub cluster_id: u64,
    #[serde(deserialize_with = "crate::event::number_or_string")]
    pub revision: i64,
    pub key: String,
    pub kind: String,
    pub ended: String,
    #[serde(deserialize_with = "crate::event::number_or_string")]
    pub epoch: u32,
    pub identity: String,
    #[serde(deserialize_with = "crate::event::number_or_string")]
    pub session: i64,
    pub class: String,
    #[serde(deserialize_with = "crate::event::number_or_string")]
    pub hold_revision: i64,
    pub prev_identity: String,
    #[serde(deserialize_with = "crate::event::number_or_string")]
    pub prev_session: i64,
    pub detail: String,
    #[serde(deserialize_with = "crate::event::number_or_string")]
    pub observed_at_unix_ms: i64,
}

impl V1Row {
    /// The event it recorded, with what schema 2 no longer keeps in the
    /// detail taken out (a gap's last revision, the numbers of a seal's reason).
    fn into_event(self) -> Result<Event, StoreError> {
        let kind: Kind = self.kind.parse().map_err(StoreError::malformed_by)?;
        let mut detail: serde_json::Value =
            serde_json::from_str(&self.detail).unwrap_or(serde_json::Value::String(self.detail));
        if let Some(map) = detail.as_object_mut() {
            if let Some(to) = map.remove("toRevision").and_then(|v| v.as_i64()) {
                let revisions = to.saturating_sub(self.revision).saturating_add(1);
                map.insert("revisions".into(), revisions.into());
            }
            if kind == Kind::EpochSeal
                && let Some(reason) = map.get("reason").and_then(|r| r.as_str())
            {
                let reason = without_numbers(reason);
                map.insert("reason".into(), reason.into());
            }
        }
        let mut event = Event::new(self.revision, self.key, kind, self.epoch);
        event.ended = self
            .ended
            .parse::<Ended>()
            .map_err(StoreError::malformed_by)?;
        event.identity = self.identity;
        event.session = self.session;
        event.class = self.class;
        event.hold_revision = self.hold_revision;
        event.prev_identity = self.prev_identity;
        event.prev_session = self.prev_session;
        event.detail = detail;
        Ok(event)
    }
}

/// What a store offers the migration.
#[async_trait]
pub(crate) trait V1Tables: AuditStore {
    async fn v1_events_exist(&self) -> Result<bool, StoreError>;
    async fn v1_clusters(&self) -> Result<Vec<u64>, StoreError>;
    /// Up to [`PAGE`] rows of `cluster_id` after (revision, key), in that order.
    async fn v1_page(
        &self,
        cluster_id: u64,
        after: Option<&(i64, String)>,
    ) -> Result<Vec<V1Row>, StoreError>;
    /// Each cluster's checkpoint; `None` if the table is gone.
    async fn v1_checkpoints(&self) -> Result<Option<Vec<(u64, i64)>>, StoreError>;
    async fn insert_rows(&self, rows: &[Row]) -> Result<(), StoreError>;
    async fn drop_v1_events(&self) -> Result<(), StoreError>;
    async fn drop_v1_checkpoints(&self) -> Result<(), StoreError>;
}

/// Moves schema 1 over, if there is any. Needs the key.
pub(crate) async fn migrate_v1<S: V1Tables>(
    store: &S,
    audit_key: Option<&AuditKey>,
) -> Result<(), StoreError> {
    let events = store.v1_events_exist().await?;
    let checkpoints = store.v1_checkpoints().await?;
    if !events && checkpoints.is_none() {
        return Ok(());
    }
    let audit_key = audit_key.ok_or(StoreError::MigrationNeedsKey)?;
    if events {
        let mut moved = 0usize;
        for cluster_id in store.v1_clusters().await? {
            let mut after: Option<(i64, String)> = None;
            let mut last_position = 0i64;
            loop {
                let page = store.v1_page(cluster_id, after.as_ref()).await?;
                let Some(last) = page.last() else { break };
                after = Some((last.revision, last.key.clone()));
                let mut rows = Vec::with_capacity(page.len());
                for old in page {
                    let (observed, cluster) = (old.observed_at_unix_ms, old.cluster_id);
                    let position = observed.saturating_mul(1000).max(last_position + 1);
                    last_position = position;
                    let event = old.into_event()?;
                    rows.push(Row::new(
                        cluster,
                        &event,
                        Some(audit_key),
                        position,
                        observed,
                    )?);
                }
                moved += rows.len();
                store.insert_rows(&rows).await?;
            }
        }
        store.drop_v1_events().await?;
        info!(
            events = moved,
            "moved the audit store's schema 1 events (raw revisions) to schema 2 (ids) and dropped them"
        );
    }
    if let Some(checkpoints) = checkpoints {
        for (cluster_id, revision) in checkpoints {
            store.put_checkpoint(cluster_id, revision).await?;
        }
        store.drop_v1_checkpoints().await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v1(kind: &str, revision: i64, detail: &str) -> V1Row {
        V1Row {
            cluster_id: 1,
            revision,
            key: "/gap".into(),
            kind: kind.into(),
            ended: String::new(),
            epoch: 1,
            identity: String::new(),
            session: 0,
            class: String::new(),
            hold_revision: 0,
            prev_identity: String::new(),
            prev_session: 0,
            detail: detail.into(),
            observed_at_unix_ms: 5,
        }
    }

    #[test]
    fn schema_1_details_lose_their_revisions() {
        let gap = v1("gap", 10, r#"{"toRevision":14,"cause":"compacted"}"#)
            .into_event()
            .unwrap();
        assert_eq!(
            gap.detail,
            serde_json::json!({"revisions": 5, "cause": "compacted"})
        );
        let seal = v1(
            "epoch-seal",
            20,
            r#"{"reason":"etcd revision 19 is below a grant","nextEpochAtLeast":2}"#,
        )
        .into_event()
        .unwrap();
        assert_eq!(seal.detail["reason"], "etcd revision N is below a grant");
        assert_eq!(seal.detail["nextEpochAtLeast"], 2);
    }
}
