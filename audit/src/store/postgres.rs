//! PostgreSQL: a primary key on (cluster id, revision, key) and `ON
//! CONFLICT DO NOTHING`, so a replayed event is a no-op. The cluster id is
//! kept as decimal text (etcd's ids use all 64 bits; BIGINT is signed).
//!
//! The connection is plain TCP (`NoTls`): run it over a loopback or a
//! private network, or put the store behind a TLS-terminating proxy.

use async_trait::async_trait;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls};

use super::{AuditStore, HistoryQuery, StoreError};
use crate::event::{Event, Row, StoredEvent, now_unix_ms};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS latchkey_audit_events (
    cluster_id          TEXT   NOT NULL,
    revision            BIGINT NOT NULL,
    key                 TEXT   NOT NULL,
    kind                TEXT   NOT NULL,
    ended               TEXT   NOT NULL,
    epoch               BIGINT NOT NULL,
    identity            TEXT   NOT NULL,
    session             BIGINT NOT NULL,
    class               TEXT   NOT NULL,
    hold_revision       BIGINT NOT NULL,
    prev_identity       TEXT   NOT NULL,
    prev_session        BIGINT NOT NULL,
    detail              TEXT   NOT NULL,
    observed_at_unix_ms BIGINT NOT NULL,
    PRIMARY KEY (cluster_id, revision, key)
);
CREATE INDEX IF NOT EXISTS latchkey_audit_events_by_key
    ON latchkey_audit_events (key, revision);
CREATE TABLE IF NOT EXISTS latchkey_audit_checkpoints (
    cluster_id         TEXT   PRIMARY KEY,
    revision           BIGINT NOT NULL,
    written_at_unix_ms BIGINT NOT NULL
);
";

const COLUMNS: &str = "cluster_id, revision, key, kind, ended, epoch, identity, session, class, \
     hold_revision, prev_identity, prev_session, detail, observed_at_unix_ms";
const PER_ROW: usize = 14;
/// Rows per INSERT: well under PostgreSQL's 65,535 parameters.
const ROWS_PER_INSERT: usize = 1000;

pub struct PostgresStore {
    client: Client,
}

impl PostgresStore {
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let (client, connection) = tokio_postgres::connect(url, NoTls)
            .await
            .map_err(|source| StoreError::Postgres {
                context: "connecting",
                source,
            })?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "the PostgreSQL connection ended");
            }
        });
        Ok(Self { client })
    }
}

fn pg(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> StoreError {
    move |source| StoreError::Postgres { context, source }
}

fn row_of(r: &tokio_postgres::Row) -> Result<StoredEvent, StoreError> {
    let get_i64 = |i: usize| r.try_get::<_, i64>(i);
    let get_text = |i: usize| r.try_get::<_, String>(i);
    let malformed = |e: tokio_postgres::Error| StoreError::Malformed(e.to_string());
    let cluster: String = get_text(0).map_err(malformed)?;
    let row = Row {
        cluster_id: cluster
            .parse()
            .map_err(|_| StoreError::Malformed(format!("cluster id {cluster:?}")))?,
        revision: get_i64(1).map_err(malformed)?,
        key: get_text(2).map_err(malformed)?,
        kind: get_text(3).map_err(malformed)?,
        ended: get_text(4).map_err(malformed)?,
        epoch: u32::try_from(get_i64(5).map_err(malformed)?)
            .map_err(|_| StoreError::Malformed("epoch out of range".into()))?,
        identity: get_text(6).map_err(malformed)?,
        session: get_i64(7).map_err(malformed)?,
        class: get_text(8).map_err(malformed)?,
        hold_revision: get_i64(9).map_err(malformed)?,
        prev_identity: get_text(10).map_err(malformed)?,
        prev_session: get_i64(11).map_err(malformed)?,
        detail: get_text(12).map_err(malformed)?,
        observed_at_unix_ms: get_i64(13).map_err(malformed)?,
    };
    row.into_stored()
        .map_err(|e| StoreError::Malformed(e.to_string()))
}

#[async_trait]
impl AuditStore for PostgresStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        self.client
            .batch_execute(SCHEMA)
            .await
            .map_err(pg("creating the audit tables"))
    }

    async fn checkpoint(&self, cluster_id: u64) -> Result<Option<i64>, StoreError> {
        let row = self
            .client
            .query_opt(
                "SELECT revision FROM latchkey_audit_checkpoints WHERE cluster_id = $1",
                &[&cluster_id.to_string()],
            )
            .await
            .map_err(pg("reading the checkpoint"))?;
        row.map(|r| r.try_get::<_, i64>(0))
            .transpose()
            .map_err(|e| StoreError::Malformed(e.to_string()))
    }

    async fn put_checkpoint(&self, cluster_id: u64, revision: i64) -> Result<(), StoreError> {
        // GREATEST: a checkpoint never goes back, whatever order two writes land in.
        self.client
            .execute(
                "INSERT INTO latchkey_audit_checkpoints (cluster_id, revision, written_at_unix_ms) \
                 VALUES ($1, $2, $3) ON CONFLICT (cluster_id) DO UPDATE SET \
                 revision = GREATEST(latchkey_audit_checkpoints.revision, EXCLUDED.revision), \
                 written_at_unix_ms = EXCLUDED.written_at_unix_ms",
                &[&cluster_id.to_string(), &revision, &now_unix_ms()],
            )
            .await
            .map_err(pg("writing the checkpoint"))?;
        Ok(())
    }

    async fn write(&self, cluster_id: u64, events: &[Event]) -> Result<(), StoreError> {
        let observed = now_unix_ms();
        for chunk in events.chunks(ROWS_PER_INSERT) {
            let rows: Vec<Row> = chunk
                .iter()
                .map(|e| Row::new(cluster_id, e, observed))
                .collect();
            let epochs: Vec<i64> = rows.iter().map(|r| i64::from(r.epoch)).collect();
            let cluster = cluster_id.to_string();
            let mut params: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(rows.len() * PER_ROW);
            let mut values = Vec::with_capacity(rows.len());
            for (i, (row, epoch)) in rows.iter().zip(&epochs).enumerate() {
                let base = i * PER_ROW;
                let placeholders: Vec<String> =
                    (1..=PER_ROW).map(|n| format!("${}", base + n)).collect();
                values.push(format!("({})", placeholders.join(", ")));
                params.extend([
                    &cluster as &(dyn ToSql + Sync),
                    &row.revision,
                    &row.key,
                    &row.kind,
                    &row.ended,
                    epoch,
                    &row.identity,
                    &row.session,
                    &row.class,
                    &row.hold_revision,
                    &row.prev_identity,
                    &row.prev_session,
                    &row.detail,
                    &row.observed_at_unix_ms,
                ]);
            }
            let sql = format!(
                "INSERT INTO latchkey_audit_events ({COLUMNS}) VALUES {} \
                 ON CONFLICT (cluster_id, revision, key) DO NOTHING",
                values.join(", ")
            );
            self.client
                .execute(&sql, &params)
                .await
                .map_err(pg("writing events"))?;
        }
        Ok(())
    }

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredEvent>, StoreError> {
        let cluster = query.cluster_id.map(|c| c.to_string());
        let sql = format!(
            "SELECT {COLUMNS} FROM latchkey_audit_events WHERE key = $1 \
             AND ($2::BIGINT IS NULL OR observed_at_unix_ms >= $2) \
             AND ($3::TEXT IS NULL OR cluster_id = $3) \
             ORDER BY observed_at_unix_ms DESC, revision DESC LIMIT $4"
        );
        let rows = self
            .client
            .query(
                &sql,
                &[
                    &query.key,
                    &query.since_unix_ms,
                    &cluster,
                    &i64::from(query.limit),
                ],
            )
            .await
            .map_err(pg("reading a key's history"))?;
        let mut events = rows.iter().map(row_of).collect::<Result<Vec<_>, _>>()?;
        events.reverse();
        Ok(events)
    }

    async fn all(&self, cluster_id: u64) -> Result<Vec<StoredEvent>, StoreError> {
        let rows = self
            .client
            .query(
                &format!(
                    "SELECT {COLUMNS} FROM latchkey_audit_events WHERE cluster_id = $1 \
                     ORDER BY revision, key"
                ),
                &[&cluster_id.to_string()],
            )
            .await
            .map_err(pg("reading events"))?;
        rows.iter().map(row_of).collect()
    }
}
