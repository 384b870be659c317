//! The lock log on etcd: every etcd request the grant protocol makes,
//! through the workspace's etcd toolkit ([`latchkey_etcd`], the one crate
//! that depends on etcd-client).
//!
//! Each method is one etcd request (a transaction, a read or a lease call)
//! ported from the store's transactions: the same compares, the same
//! operations, the same key layout ([`Layout`]). The log only reports what
//! etcd answered, header included; judging the header (epoch guard,
//! high-water mark, seal) is the table's job, so none of it is here.
//!
//! - `records`: the epoch and seal records (read, create, seal, advance)
//!   and the shard-map fence.
//! - `holds`: grants, hand-overs, releases and reads of holder records.
//! - `sessions`: leases, session records, revocation and renewal.
//! - `watch`: a key watch over an etcd watch stream.
//! - [`follow`]: every key under a prefix, read once and then watched, for
//!   the per-subject counts of holds and sessions.
//! - `lease_renewals`: every session's renewals over a few shared
//!   keep-alive streams.

mod elections;
pub mod follow;
mod force;
mod holds;
mod lease_renewals;
mod queue;
mod records;
mod sessions;
mod watch;

use crate::lock_log::DurableQueueLog;
use crate::lock_log::EpochLog;
use crate::lock_log::HoldLog;
use crate::lock_log::SessionLog;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use latchkey_etcd::txn::TxnOpResponse;
use latchkey_etcd::{Client, Connection, ErrorKind, KeyValue, Login, ResponseHeader, TlsPem};

use super::{
    Answer, BatchOp, BatchOutcome, Claimed, DowngradeTxn, ForceEndTxn, ForceEnded, GrantTxn,
    Granted, HandOverTxn, Header, HeldAt, KeyWatch, Kv, LogResult, Queued, Records, ReleaseTxn,
    ReleasedIf, Renewal, RevokeSessionTxn, SessionRevoked, ShadowMarks, StoreError,
};
use crate::records::Layout;
/// The etcd client handle the log and its followers connect with.
pub use latchkey_etcd::Client as EtcdClient;
use lease_renewals::LeaseRenewals;
pub use lease_renewals::{NoMemo, RenewalMemo, Renewed};

/// Where etcd is and how to reach it.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// TLS for `https://` endpoints (`None` for `http://`).
    pub tls: Option<TlsPem>,
    /// etcd username/password auth.
    pub login: Option<Login>,
}

impl StoreConfig {
    /// How the arbiter reaches this cluster: as every service does
    /// ([`Connection::service`]), with a deadline on every call and a call
    /// that could not connect to one member sent to another.
    pub fn connection(&self) -> Connection {
        Connection {
            tls: self.tls.clone(),
            login: self.login.clone(),
            request_timeout: Some(self.request_timeout),
            failover: true,
            ..Connection::service(self.endpoints.clone(), self.connect_timeout)
        }
    }
}

/// The etcd [`LockLog`]. Cheap to clone: the client is a handle over shared
/// channels and the renewal lanes are shared.
///
/// [`LockLog`]: super::LockLog
#[derive(Clone)]
pub struct EtcdLog {
    client: Client,
    /// The force-release path's client: logged in as the restricted
    /// force-release user when one is configured ([`Self::with_force_client`]),
    /// else the log's own.
    force: Client,
    layout: Layout,
    /// Every session's renewals, over a few shared keep-alive streams.
    renewals: Arc<LeaseRenewals>,
}

impl std::fmt::Debug for EtcdLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLog")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl EtcdLog {
    /// Connects to etcd and starts the renewal lanes (so it must run inside
    /// a tokio runtime). `memo` is consulted and written by the lanes.
    pub async fn connect(
        config: &StoreConfig,
        memo: Arc<dyn RenewalMemo>,
    ) -> Result<Self, StoreError> {
        let client = connect_client(config).await?;
        Ok(Self {
            renewals: Arc::new(LeaseRenewals::start(&client, memo)),
            force: client.clone(),
            client,
            layout: Layout::new(&config.prefix),
        })
    }

    /// Runs [`HoldLog::force_end`] and
    /// [`crate::lock_log::ElectionLog::force_end_term`] with
    /// `client` (logged in as the restricted force-release user) instead of
    /// the log's own.
    pub fn with_force_client(mut self, client: Client) -> Self {
        self.force = client;
        self
    }

    /// The cluster id etcd reports now (a count-only read of the epoch key,
    /// so nothing is transferred but the header).
    pub async fn current_cluster_id(&self) -> Result<u64, StoreError> {
        let head = latchkey_etcd::kv::head(&self.client, self.layout.epoch())
            .await
            .map_err(|e| unavailable("cannot read etcd's cluster id", e))?;
        Ok(header(head.as_ref())?.cluster_id)
    }
}

/// An etcd client for `config` ([`StoreConfig::connection`]). Shared with
/// the coord cluster's witness ([`crate::witness::etcd`]), which must reach
/// its cluster the same way the lock log reaches its own.
pub(crate) async fn connect_client(config: &StoreConfig) -> Result<Client, StoreError> {
    latchkey_etcd::connect(&config.connection())
        .await
        .map_err(|e| unavailable("cannot connect to etcd", e))
}

#[async_trait]
impl HoldLog for EtcdLog {
    async fn grant(&self, txn: GrantTxn<'_>) -> LogResult<Granted> {
        holds::grant(self, txn).await
    }

    async fn hand_over(&self, txn: HandOverTxn<'_>) -> LogResult<Option<Option<Vec<u8>>>> {
        holds::hand_over(self, txn).await
    }

    async fn downgrade(&self, txn: DowngradeTxn<'_>) -> LogResult<bool> {
        holds::downgrade(self, txn).await
    }

    async fn release(&self, held: &HeldAt) -> LogResult<Option<Vec<u8>>> {
        holds::release(self, held).await
    }

    async fn release_if_owned(&self, txn: &ReleaseTxn) -> LogResult<ReleasedIf> {
        holds::release_if_owned(self, txn).await
    }

    fn batch_limit(&self) -> usize {
        holds::BATCH_LIMIT
    }

    async fn batch(&self, ops: Vec<BatchOp<'_>>) -> LogResult<Vec<BatchOutcome>> {
        holds::batch(self, ops).await
    }

    async fn claim(&self, key: &str, session: i64, revision: i64) -> LogResult<Claimed> {
        holds::claim(self, key, session, revision).await
    }

    async fn release_orphan(&self, key: &str, session: i64, revision: i64) -> LogResult<bool> {
        holds::release_orphan(self, key, session, revision).await
    }

    async fn holder(&self, key: &str) -> LogResult<Option<Kv>> {
        holds::holder(self, key).await
    }

    async fn holders_of(&self, keys: &[String]) -> LogResult<Vec<Option<Kv>>> {
        holds::holders_of(self, keys).await
    }

    async fn quota_places(&self, class: &str, subject: &str) -> LogResult<Vec<(u32, Kv)>> {
        holds::quota_places(self, class, subject).await
    }

    async fn free_quota_place(
        &self,
        class: &str,
        subject: &str,
        index: u32,
        revision: i64,
    ) -> LogResult<bool> {
        holds::free_quota_place(self, class, subject, index, revision).await
    }

    async fn holders_under(&self, prefix: &str) -> LogResult<Vec<(String, Kv)>> {
        holds::holders_under(self, prefix).await
    }

    async fn held_keys_page(&self, after: Option<&str>, limit: usize) -> LogResult<Vec<String>> {
        holds::held_keys_page(self, after, limit).await
    }

    async fn count_holds(&self) -> LogResult<i64> {
        holds::count_holds(self).await
    }

    async fn force_end(&self, txn: ForceEndTxn<'_>) -> LogResult<ForceEnded> {
        force::force_end(self, txn).await
    }

    async fn watch(&self, key: &str, from_revision: i64) -> Result<Box<dyn KeyWatch>, StoreError> {
        watch::watch(self, key, from_revision).await
    }
}

#[async_trait]
impl EpochLog for EtcdLog {
    async fn records(&self) -> LogResult<Records> {
        records::read(self).await
    }

    async fn create_epoch(&self, record: Vec<u8>) -> LogResult<bool> {
        records::create_epoch(self, record).await
    }

    async fn put_seal(
        &self,
        record: Vec<u8>,
        seal_at: Option<i64>,
        epoch_at: Option<i64>,
    ) -> LogResult<bool> {
        records::put_seal(self, record, seal_at, epoch_at).await
    }

    async fn put_coord_seen(&self, record: Vec<u8>, at: Option<i64>) -> LogResult<bool> {
        records::put_coord_seen(self, record, at).await
    }

    async fn advance(
        &self,
        expected: Vec<u8>,
        seal_at: Option<i64>,
        record: Vec<u8>,
    ) -> LogResult<Option<i64>> {
        records::advance(self, expected, seal_at, record).await
    }

    async fn raise_map_fence(&self, version: u64) -> LogResult<bool> {
        records::raise_map_fence(self, version).await
    }

    async fn map_fence(&self) -> LogResult<Option<Kv>> {
        records::map_fence(self).await
    }
}

#[async_trait]
impl DurableQueueLog for EtcdLog {
    async fn enqueue(
        &self,
        key: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        queue::enqueue(self, key, session, session_record, record).await
    }

    async fn dequeue(&self, key: &str, session: i64, modified: i64) -> LogResult<bool> {
        queue::dequeue(self, key, session, modified).await
    }

    async fn put_intent(
        &self,
        name: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        queue::put_intent(self, name, session, session_record, record).await
    }

    async fn drop_intent(&self, name: &str, session: i64, modified: i64) -> LogResult<bool> {
        queue::drop_intent(self, name, session, modified).await
    }

    async fn watch_intents(
        &self,
        name: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError> {
        watch::watch_intents(self, name, from_revision).await
    }

    async fn count_queued(&self, key: &str) -> LogResult<i64> {
        queue::count_queued(self, key).await
    }

    async fn queue_head(&self, key: &str) -> LogResult<Option<Kv>> {
        queue::queue_head(self, key).await
    }

    async fn watch_queue(
        &self,
        key: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError> {
        watch::watch_queue(self, key, from_revision).await
    }
}

#[async_trait]
impl SessionLog for EtcdLog {
    async fn mark_shadow(&self, session: i64, shard: &str) -> LogResult<()> {
        sessions::mark_shadow(self, session, shard).await
    }

    async fn shadow_marks(&self, session: i64) -> LogResult<ShadowMarks> {
        sessions::shadow_marks(self, session).await
    }

    async fn vouch_shadows(&self, session: i64, epoch_at: i64) -> LogResult<bool> {
        sessions::vouch_shadows(self, session, epoch_at).await
    }

    async fn grant_lease(&self, id: i64, ttl_seconds: u32) -> LogResult<()> {
        sessions::grant_lease(self, id, ttl_seconds).await
    }

    async fn put_session(&self, session: i64, identity: &str, record: Vec<u8>) -> LogResult<()> {
        sessions::put_session(self, session, identity, record).await
    }

    async fn session(&self, session: i64) -> LogResult<Option<Kv>> {
        sessions::session(self, session).await
    }

    async fn count_sessions_of(&self, identity: &str) -> LogResult<u32> {
        sessions::count_sessions_of(self, identity).await
    }

    async fn delete_session(
        &self,
        session: i64,
        counted_as: &str,
        record: Vec<u8>,
    ) -> LogResult<bool> {
        sessions::delete_session(self, session, counted_as, record).await
    }

    async fn revoke(&self, lease: i64) -> Result<(), StoreError> {
        sessions::revoke(self, lease).await
    }

    async fn renew(&self, lease: i64) -> Result<Renewal, StoreError> {
        self.renewals.renew(lease).await
    }

    async fn revoke_session(
        &self,
        txn: RevokeSessionTxn<'_>,
    ) -> Result<SessionRevoked, StoreError> {
        sessions::revoke_session(self, txn).await
    }
}

/// The header every answer carries; etcd always sends one, so its absence
/// means the answer cannot be checked and must not be used.
pub(crate) fn header(h: Option<&ResponseHeader>) -> Result<Header, StoreError> {
    h.map(|h| Header {
        cluster_id: h.cluster_id(),
        revision: h.revision(),
    })
    .ok_or_else(|| StoreError::Malformed("etcd response without a header".into()))
}

/// An answer with the header of the response it came in.
fn answer<T>(h: Option<&ResponseHeader>, value: T) -> LogResult<T> {
    Ok(Answer {
        header: header(h)?,
        value,
    })
}

fn kv(kv: &KeyValue) -> Kv {
    Kv {
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        lease: kv.lease(),
    }
}

/// The first key a transaction's get operation found.
fn first_kv(resp: &TxnOpResponse) -> Option<Kv> {
    latchkey_etcd::txn::first_kv(resp).map(kv)
}

/// An etcd error as the log's: the store did not answer, or answered with
/// an error, while doing `context`. The error stays the source (its cause
/// chain is what [`StoreError::detail`] walks).
pub(crate) fn unavailable(context: &str, err: impl Into<latchkey_etcd::Error>) -> StoreError {
    StoreError::Unavailable {
        context: context.to_string(),
        source: Some(Box::new(err.into())),
    }
}

/// [`unavailable`] for a request that puts on `lease`: etcd's "lease not
/// found" there means the session expired, never an outage to retry.
fn unavailable_on(context: &str, lease: i64, err: impl Into<latchkey_etcd::Error>) -> StoreError {
    let err = err.into();
    if err.kind() == ErrorKind::LeaseNotFound {
        StoreError::LeaseGone { lease }
    } else {
        unavailable(context, err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, message: &str) -> latchkey_etcd::Error {
        latchkey_etcd::Error::from(tonic::Status::new(code, message))
    }

    #[test]
    fn lease_not_found_on_a_put_is_the_session_gone() {
        let err = unavailable_on(
            "grant",
            7,
            status(
                tonic::Code::NotFound,
                "etcdserver: requested lease not found",
            ),
        );
        assert!(matches!(err, StoreError::LeaseGone { lease: 7 }));
    }

    #[test]
    fn other_errors_on_a_put_are_unavailable() {
        let err = unavailable_on(
            "grant",
            7,
            status(tonic::Code::Unavailable, "etcdserver: leader changed"),
        );
        assert!(matches!(err, StoreError::Unavailable { .. }));
        // another NotFound is not the lease
        let err = unavailable_on("grant", 7, status(tonic::Code::NotFound, "key not found"));
        assert!(matches!(err, StoreError::Unavailable { .. }));
    }

    #[test]
    fn the_source_chain_goes_past_the_etcd_error() {
        use std::error::Error as _;
        let cause = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = unavailable("cannot connect to etcd", latchkey_etcd::Error::from(cause));
        let etcd = err.source();
        assert!(etcd.is_some_and(|e| e.to_string() == "io error: refused"));
        let io = etcd.and_then(|e| e.source());
        assert!(io.is_some_and(|e| e.downcast_ref::<std::io::Error>().is_some()));
        assert!(
            err.detail()
                .starts_with("cannot connect to etcd: io error: refused")
        );
    }

    #[test]
    fn a_missing_header_is_malformed() {
        assert!(matches!(header(None), Err(StoreError::Malformed(_))));
    }
}
