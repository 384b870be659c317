//! PostgreSQL: a primary key on (cluster id, event id) and `ON CONFLICT DO
//! NOTHING`, so a replayed event is a no-op and the first copy stays. The
//! cluster id is kept as decimal text (etcd's ids use all 64 bits; BIGINT
//! is signed).
//!
//! The connection is plain TCP (`NoTls`): run it over a loopback or a
//! private network, or put the store behind a TLS-terminating proxy.
//! Readers get a role with `SELECT` on the events table only (see
//! docs/operations.md, "The audit store").

use async_trait::async_trait;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls};

use super::migrate_v1::{PAGE, V1Row, V1Tables};
use super::{AuditStore, HistoryQuery, Positions, StoreError, StoreOptions};
use crate::event::{Event, Row, StoredEvent, now_unix_ms};
use crate::pseudonym::{AuditKey, NeedsKey};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS latchkey_audit_events_v2 (
    cluster_id          TEXT   NOT NULL,
    event_id            TEXT   NOT NULL,
    position            BIGINT NOT NULL,
    key                 TEXT   NOT NULL,
    kind                TEXT   NOT NULL,
    ended               TEXT   NOT NULL,
    epoch               BIGINT NOT NULL,
    identity            TEXT   NOT NULL,
    session             BIGINT NOT NULL,
    class               TEXT   NOT NULL,
    hold_id             TEXT   NOT NULL,
    prev_hold_id        TEXT   NOT NULL,
    prev_identity       TEXT   NOT NULL,
    prev_session        BIGINT NOT NULL,
    detail              TEXT   NOT NULL,
    observed_at_unix_ms BIGINT NOT NULL,
    PRIMARY KEY (cluster_id, event_id)
);
CREATE INDEX IF NOT EXISTS latchkey_audit_events_v2_by_key
    ON latchkey_audit_events_v2 (key, position);
CREATE TABLE IF NOT EXISTS latchkey_audit_checkpoints_v2 (
    cluster_id         TEXT   PRIMARY KEY,
    position           BIGINT NOT NULL,
    sealed             TEXT   NOT NULL,
    written_at_unix_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS latchkey_audit_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
";

const COLUMNS: &str = "cluster_id, event_id, position, key, kind, ended, epoch, identity, \
     session, class, hold_id, prev_hold_id, prev_identity, prev_session, detail, \
     observed_at_unix_ms";
const PER_ROW: usize = 16;
/// Rows per INSERT: well under PostgreSQL's 65,535 parameters.
const ROWS_PER_INSERT: usize = 1000;

pub struct PostgresStore {
    client: Client,
    audit_key: Option<AuditKey>,
    positions: Positions,
}

impl PostgresStore {
    pub async fn connect(url: &str, options: StoreOptions) -> Result<Self, StoreError> {
        let mut config: tokio_postgres::Config =
            url.parse().map_err(|source| StoreError::Postgres {
                context: "reading the connection string",
                source,
            })?;
        if let Some(password) = &options.password {
            if config.get_password().is_some() {
                return Err(StoreError::PasswordTwice);
            }
            config.password(password);
        }
        let (client, connection) =
            config
                .connect(NoTls)
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
        Ok(Self {
            client,
            audit_key: options.audit_key,
            positions: Positions::default(),
        })
    }

    async fn check_key(&self, audit_key: &AuditKey) -> Result<(), StoreError> {
        let check = audit_key.check_value();
        self.client
            .execute(
                "INSERT INTO latchkey_audit_meta (name, value) VALUES ('key_check', $1) \
                 ON CONFLICT (name) DO NOTHING",
                &[&check],
            )
            .await
            .map_err(pg("recording the key check"))?;
        let row = self
            .client
            .query_one(
                "SELECT value FROM latchkey_audit_meta WHERE name = 'key_check'",
                &[],
            )
            .await
            .map_err(pg("reading the key check"))?;
        let recorded: String = row.try_get(0).map_err(StoreError::malformed_by)?;
        if recorded == check {
            Ok(())
        } else {
            Err(StoreError::WrongKey)
        }
    }

    async fn table_exists(&self, name: &str) -> Result<bool, StoreError> {
        let row = self
            .client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
            .await
            .map_err(pg("looking for a table"))?;
        row.try_get(0).map_err(StoreError::malformed_by)
    }
}

fn pg(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> StoreError {
    move |source| StoreError::Postgres { context, source }
}

fn row_of(r: &tokio_postgres::Row) -> Result<StoredEvent, StoreError> {
    let get_i64 = |i: usize| r.try_get::<_, i64>(i).map_err(StoreError::malformed_by);
    let get_text = |i: usize| r.try_get::<_, String>(i).map_err(StoreError::malformed_by);
    let cluster: String = get_text(0)?;
    let row = Row {
        cluster_id: cluster
            .parse()
            .map_err(|_| StoreError::malformed(format!("cluster id {cluster:?}")))?,
        event_id: get_text(1)?,
        position: get_i64(2)?,
        key: get_text(3)?,
        kind: get_text(4)?,
        ended: get_text(5)?,
        epoch: u32::try_from(get_i64(6)?)
            .map_err(|_| StoreError::malformed("epoch out of range"))?,
        identity: get_text(7)?,
        session: get_i64(8)?,
        class: get_text(9)?,
        hold_id: get_text(10)?,
        prev_hold_id: get_text(11)?,
        prev_identity: get_text(12)?,
        prev_session: get_i64(13)?,
        detail: get_text(14)?,
        observed_at_unix_ms: get_i64(15)?,
    };
    row.into_stored().map_err(StoreError::malformed_by)
}

fn v1_row_of(r: &tokio_postgres::Row) -> Result<V1Row, StoreError> {
    let get_i64 = |i: usize| r.try_get::<_, i64>(i).map_err(StoreError::malformed_by);
    let get_text = |i: usize| r.try_get::<_, String>(i).map_err(StoreError::malformed_by);
    let cluster: String = get_text(0)?;
    Ok(V1Row {
        cluster_id: cluster
            .parse()
            .map_err(|_| StoreError::malformed(format!("cluster id {cluster:?}")))?,
        revision: get_i64(1)?,
        key: get_text(2)?,
        kind: get_text(3)?,
        ended: get_text(4)?,
        epoch: u32::try_from(get_i64(5)?)
            .map_err(|_| StoreError::malformed("epoch out of range"))?,
        identity: get_text(6)?,
        session: get_i64(7)?,
        class: get_text(8)?,
        hold_revision: get_i64(9)?,
        prev_identity: get_text(10)?,
        prev_session: get_i64(11)?,
        detail: get_text(12)?,
        observed_at_unix_ms: get_i64(13)?,
    })
}

#[async_trait]
impl AuditStore for PostgresStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        self.client
            .batch_execute(SCHEMA)
            .await
            .map_err(pg("creating the audit tables"))?;
        if let Some(audit_key) = &self.audit_key {
            self.check_key(audit_key).await?;
        }
        let row = self
            .client
            .query_one(
                "SELECT COALESCE(GREATEST(\
                   (SELECT max(position) FROM latchkey_audit_events_v2), \
                   (SELECT max(position) FROM latchkey_audit_checkpoints_v2)), 0)",
                &[],
            )
            .await
            .map_err(pg("reading the last position"))?;
        self.positions
            .at_least(row.try_get(0).map_err(StoreError::malformed_by)?);
        super::migrate_v1(self, self.audit_key.as_ref()).await?;
        self.client
            .execute(
                "INSERT INTO latchkey_audit_meta (name, value) VALUES ('schema_version', '2') \
                 ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
                &[],
            )
            .await
            .map_err(pg("recording the schema version"))?;
        Ok(())
    }

    async fn checkpoint(&self, cluster_id: u64) -> Result<Option<i64>, StoreError> {
        let audit_key = self.audit_key.as_ref().ok_or(NeedsKey)?;
        let row = self
            .client
            .query_opt(
                "SELECT position, sealed FROM latchkey_audit_checkpoints_v2 WHERE cluster_id = $1",
                &[&cluster_id.to_string()],
            )
            .await
            .map_err(pg("reading the checkpoint"))?;
        let Some(row) = row else { return Ok(None) };
        let position: i64 = row.try_get(0).map_err(StoreError::malformed_by)?;
        let sealed: String = row.try_get(1).map_err(StoreError::malformed_by)?;
        audit_key
            .open_checkpoint(cluster_id, position, &sealed)
            .map(Some)
            .ok_or(StoreError::WrongKey)
    }

    async fn put_checkpoint(&self, cluster_id: u64, revision: i64) -> Result<(), StoreError> {
        let audit_key = self.audit_key.as_ref().ok_or(NeedsKey)?;
        // Sealed, so the database cannot keep the higher of two (as a plain
        // GREATEST would): a lower one written last only replays events.
        let position = self.positions.next();
        let sealed = audit_key.seal_checkpoint(cluster_id, position, revision);
        self.client
            .execute(
                "INSERT INTO latchkey_audit_checkpoints_v2 \
                 (cluster_id, position, sealed, written_at_unix_ms) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (cluster_id) DO UPDATE SET position = EXCLUDED.position, \
                 sealed = EXCLUDED.sealed, written_at_unix_ms = EXCLUDED.written_at_unix_ms",
                &[&cluster_id.to_string(), &position, &sealed, &now_unix_ms()],
            )
            .await
            .map_err(pg("writing the checkpoint"))?;
        Ok(())
    }

    async fn write(&self, cluster_id: u64, events: &[Event]) -> Result<(), StoreError> {
        let rows = super::rows(cluster_id, events, self.audit_key.as_ref(), &self.positions)?;
        self.insert_rows(&rows).await
    }

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredEvent>, StoreError> {
        let cluster = query.cluster_id.map(|c| c.to_string());
        let sql = format!(
            "SELECT {COLUMNS} FROM latchkey_audit_events_v2 WHERE key = $1 \
             AND ($2::BIGINT IS NULL OR observed_at_unix_ms >= $2) \
             AND ($3::TEXT IS NULL OR cluster_id = $3) \
             ORDER BY position DESC LIMIT $4"
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
                    "SELECT {COLUMNS} FROM latchkey_audit_events_v2 WHERE cluster_id = $1 \
                     ORDER BY position, key"
                ),
                &[&cluster_id.to_string()],
            )
            .await
            .map_err(pg("reading events"))?;
        rows.iter().map(row_of).collect()
    }
}

#[async_trait]
impl V1Tables for PostgresStore {
    async fn v1_events_exist(&self) -> Result<bool, StoreError> {
        self.table_exists("latchkey_audit_events").await
    }

    async fn v1_clusters(&self) -> Result<Vec<u64>, StoreError> {
        let rows = self
            .client
            .query(
                "SELECT DISTINCT cluster_id FROM latchkey_audit_events ORDER BY cluster_id",
                &[],
            )
            .await
            .map_err(pg("listing schema 1's clusters"))?;
        rows.iter()
            .map(|r| {
                let text: String = r.try_get(0).map_err(StoreError::malformed_by)?;
                text.parse()
                    .map_err(|_| StoreError::malformed(format!("cluster id {text:?}")))
            })
            .collect()
    }

    async fn v1_page(
        &self,
        cluster_id: u64,
        after: Option<&(i64, String)>,
    ) -> Result<Vec<V1Row>, StoreError> {
        let (revision, key) = match after {
            Some((r, k)) => (Some(*r), Some(k.as_str())),
            None => (None, None),
        };
        let rows = self
            .client
            .query(
                "SELECT cluster_id, revision, key, kind, ended, epoch, identity, session, class, \
                 hold_revision, prev_identity, prev_session, detail, observed_at_unix_ms \
                 FROM latchkey_audit_events WHERE cluster_id = $1 \
                 AND ($2::BIGINT IS NULL OR (revision, key) > ($2, $3::TEXT)) \
                 ORDER BY revision, key LIMIT $4",
                &[&cluster_id.to_string(), &revision, &key, &i64::from(PAGE)],
            )
            .await
            .map_err(pg("reading schema 1's events"))?;
        rows.iter().map(v1_row_of).collect()
    }

    async fn v1_checkpoints(&self) -> Result<Option<Vec<(u64, i64)>>, StoreError> {
        if !self.table_exists("latchkey_audit_checkpoints").await? {
            return Ok(None);
        }
        let rows = self
            .client
            .query(
                "SELECT cluster_id, revision FROM latchkey_audit_checkpoints",
                &[],
            )
            .await
            .map_err(pg("reading schema 1's checkpoints"))?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let cluster: String = r.try_get(0).map_err(StoreError::malformed_by)?;
            let cluster = cluster
                .parse()
                .map_err(|_| StoreError::malformed(format!("cluster id {cluster:?}")))?;
            out.push((cluster, r.try_get(1).map_err(StoreError::malformed_by)?));
        }
        Ok(Some(out))
    }

    async fn insert_rows(&self, rows: &[Row]) -> Result<(), StoreError> {
        for chunk in rows.chunks(ROWS_PER_INSERT) {
            let epochs: Vec<i64> = chunk.iter().map(|r| i64::from(r.epoch)).collect();
            let clusters: Vec<String> = chunk.iter().map(|r| r.cluster_id.to_string()).collect();
            let mut params: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(chunk.len() * PER_ROW);
            let mut values = Vec::with_capacity(chunk.len());
            for (i, ((row, epoch), cluster)) in chunk.iter().zip(&epochs).zip(&clusters).enumerate()
            {
                let base = i * PER_ROW;
                let placeholders: Vec<String> =
                    (1..=PER_ROW).map(|n| format!("${}", base + n)).collect();
                values.push(format!("({})", placeholders.join(", ")));
                params.extend([
                    cluster as &(dyn ToSql + Sync),
                    &row.event_id,
                    &row.position,
                    &row.key,
                    &row.kind,
                    &row.ended,
                    epoch,
                    &row.identity,
                    &row.session,
                    &row.class,
                    &row.hold_id,
                    &row.prev_hold_id,
                    &row.prev_identity,
                    &row.prev_session,
                    &row.detail,
                    &row.observed_at_unix_ms,
                ]);
            }
            let sql = format!(
                "INSERT INTO latchkey_audit_events_v2 ({COLUMNS}) VALUES {} \
                 ON CONFLICT (cluster_id, event_id) DO NOTHING",
                values.join(", ")
            );
            self.client
                .execute(&sql, &params)
                .await
                .map_err(pg("writing events"))?;
        }
        Ok(())
    }

    async fn drop_v1_events(&self) -> Result<(), StoreError> {
        self.client
            .batch_execute("DROP TABLE IF EXISTS latchkey_audit_events")
            .await
            .map_err(pg("dropping schema 1's events"))
    }

    async fn drop_v1_checkpoints(&self) -> Result<(), StoreError> {
        self.client
            .batch_execute("DROP TABLE IF EXISTS latchkey_audit_checkpoints")
            .await
            .map_err(pg("dropping schema 1's checkpoints"))
    }
}
