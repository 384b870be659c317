//! The lock log: every etcd call the arbiter makes, and the only module that
//! names `etcd_client`.
//!
//! Each response header goes through the epoch guard (cluster id and revision
//! against the epoch record and the high-water mark) before its result is used.
//! A grant is one transaction comparing key absence, the epoch record's bytes,
//! the seal's absence and the session record; a release with a local waiter
//! hands over in one transaction too. Watches and polls only trigger attempts.

mod lease_renewals;

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, GetResponse,
    Identity, LeaseGrantOptions, PutOptions, ResponseHeader, TlsOptions, Txn, TxnOp, TxnOpResponse,
    TxnResponse, WatchOptions, WatchStream,
};
use tracing::{error, warn};

use crate::epoch::{EpochGuard, EpochState};
use crate::error::ArbiterError;
use crate::error::IdentityBound;
use crate::high_water::{HighWater, Mark};
use crate::records::{
    EpochRecord, HolderRecord, Layout, NotOwned, SealRecord, SessionRecord, check_owner, decode,
    encode, now_unix_ms,
};
use crate::token;
use lease_renewals::LeaseRenewals;
pub use lease_renewals::{Answer as RenewalAnswer, RenewalMemo, Renewed};

/// A committed grant. The token is derived, never stored separately.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub key: String,
    pub session: i64,
    pub epoch: u32,
    pub revision: i64,
}

impl Grant {
    pub fn token(&self) -> Option<u64> {
        token::pack(self.epoch, self.revision)
    }
}

/// Everything a grant transaction needs for one caller.
#[derive(Debug, Clone)]
pub struct GrantRequest {
    pub key: String,
    pub identity: String,
    pub session: i64,
    pub class: String,
    pub ttl_seconds: u32,
    pub annotations: std::collections::BTreeMap<String, String>,
}

impl GrantRequest {
    fn session_bytes(&self) -> Vec<u8> {
        encode(&SessionRecord {
            identity: self.identity.clone(),
            ttl_seconds: self.ttl_seconds,
        })
    }
    fn holder_bytes(&self) -> Vec<u8> {
        encode(&HolderRecord {
            identity: self.identity.clone(),
            session: self.session,
            class: self.class.clone(),
            acquired_at_unix_ms: now_unix_ms(),
            annotations: self.annotations.clone(),
        })
    }
}

#[derive(Debug)]
pub enum GrantOutcome {
    Granted(Grant),
    /// The key is already held by the requesting session: its existing grant
    /// (a retry, or a new call of the same session). Before it reaches a
    /// caller it must be claimed ([`crate::waiters::Queues::claim_reused`]),
    /// since the same grant may be being released as an orphan.
    Reused(Grant),
    /// Held by another session; watch from `watch_from` so nothing between the
    /// failed transaction and the watch is missed.
    Held {
        watch_from: i64,
    },
}

#[derive(Debug, Clone)]
pub struct HolderView {
    pub record: HolderRecord,
    pub revision: i64,
    pub lease: i64,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// TLS for `https://` endpoints (`None` for `http://`).
    pub tls: Option<EtcdTlsPem>,
    /// etcd username/password auth.
    pub login: Option<EtcdLogin>,
}

/// etcd TLS material, already read from disk (PEM).
#[derive(Clone)]
pub struct EtcdTlsPem {
    /// Trust bundle for etcd's server certificate.
    pub ca: Vec<u8>,
    /// The arbiter's client certificate chain and key.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTlsPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTlsPem")
            .field("ca_bytes", &self.ca.len())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

/// An etcd user and its password. `Debug` never shows the password, and
/// there is no `Display`.
#[derive(Clone)]
pub struct EtcdLogin {
    pub name: String,
    password: String,
}

impl EtcdLogin {
    pub fn new(name: String, password: String) -> Self {
        Self { name, password }
    }
}

impl std::fmt::Debug for EtcdLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLogin")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// An etcd client error with its causes: tonic keeps the interesting part
/// of a connection failure (refused, TLS alert, unknown issuer) in the
/// source chain, which `Display` alone drops.
fn etcd_error(err: etcd_client::Error) -> ArbiterError {
    let mut detail = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !detail.contains(&text) {
            detail.push_str(": ");
            detail.push_str(&text);
        }
        source = cause.source();
    }
    ArbiterError::store(detail)
}

#[derive(Clone)]
pub struct Store {
    client: Client,
    layout: Layout,
    guard: Arc<EpochGuard>,
    high_water: Arc<HighWater>,
    /// The highest revision any checked etcd answer has shown in the serving
    /// epoch (in memory only). The durable mark holds this arbiter's own
    /// grants; this one also holds every other arbiter's grants it has seen,
    /// so a restore to below them seals this arbiter too, even when its own
    /// grants all lie below the restored revision.
    seen: Arc<std::sync::Mutex<Option<Mark>>>,
    /// Every session's renewals, over a few shared keep-alive streams.
    renewals: Arc<LeaseRenewals>,
}

fn header_of(h: Option<&ResponseHeader>) -> Result<(u64, i64), ArbiterError> {
    h.map(|h| (h.cluster_id(), h.revision()))
        .ok_or_else(|| ArbiterError::store("etcd response without a header"))
}

/// A hand-over's new grant, and the record of the hold it replaced.
pub struct HandedOver {
    pub grant: Grant,
    pub previous: Option<HolderRecord>,
}

/// A hold the caller was found to own: its record's bytes, lease and
/// revision, which the release or hand-over transaction compares again.
#[derive(Debug, Clone)]
pub struct OwnedHold {
    pub key: String,
    pub session: i64,
    pub revision: i64,
    value: Vec<u8>,
}

/// Session ids are etcd lease ids the arbiter draws itself: positive, below
/// 2^53 (exact in a JSON number or a double), from the OS's CSPRNG, so
/// knowing one session id tells nothing about another's.
pub fn random_lease_id() -> Result<i64, ArbiterError> {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| ArbiterError::Internal(format!("no randomness for a session id: {e}")))?;
    let id = i64::from_le_bytes(bytes) & ((1i64 << 53) - 1);
    // 0 means "let etcd choose" to LeaseGrant: draw again rather than allow it
    Ok(if id == 0 { 1 } else { id })
}

/// How many fresh ids an OpenSession tries when etcd says the lease exists.
const LEASE_ID_ATTEMPTS: usize = 4;

fn lease_exists(err: &etcd_client::Error) -> bool {
    matches!(err, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::FailedPrecondition && s.message().contains("lease already exists"))
}

/// etcd refused a put on a lease it no longer has: the session expired
/// (never a store outage to retry).
fn lease_not_found(err: &etcd_client::Error) -> bool {
    matches!(err, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::NotFound && s.message().contains("lease not found"))
}

fn first_kv(resp: &TxnOpResponse) -> Option<&etcd_client::KeyValue> {
    match resp {
        TxnOpResponse::Get(g) => g.kvs().first(),
        _ => None,
    }
}

impl Store {
    pub async fn connect(
        config: &StoreConfig,
        guard: Arc<EpochGuard>,
        high_water: Arc<HighWater>,
        memo: Arc<dyn RenewalMemo>,
    ) -> Result<Self, ArbiterError> {
        // require_leader: a member cut off from the quorum fails fast instead
        // of serving a stale view or hanging.
        let mut options = ConnectOptions::new()
            .with_require_leader(true)
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.request_timeout)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        if let Some(tls) = &config.tls {
            // No domain_name: tonic verifies etcd's certificate against each
            // endpoint's own host, so every member is checked by its name.
            let mut tls_options = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca));
            if let Some((cert, key)) = &tls.identity {
                tls_options = tls_options.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls_options);
        }
        if let Some(login) = &config.login {
            // Tokens expire (etcd's --auth-token-ttl); refresh rather than fail.
            options = options
                .with_user(login.name.clone(), login.password.clone())
                .with_auto_token_refresh(true);
        }
        // `options` holds the password in its Debug output: never log it.
        let client = Client::connect(&config.endpoints, Some(options))
            .await
            .map_err(etcd_error)?;
        Ok(Self {
            renewals: Arc::new(LeaseRenewals::start(&client, memo)),
            client,
            layout: Layout::new(&config.prefix),
            guard,
            high_water,
            seen: Arc::new(std::sync::Mutex::new(None)),
        })
    }

    pub fn guard(&self) -> &EpochGuard {
        &self.guard
    }

    pub fn high_water(&self) -> Option<Mark> {
        self.high_water.current()
    }

    /// Checks a header before its response is used. On a fresh seal, records
    /// it in the log for every arbiter; while sealed, nothing read or written
    /// under this header is used (a grant committed in a restored log is never
    /// answered with its token).
    ///
    /// `mark` is the high-water mark read BEFORE the request was sent: every
    /// grant made durable by then committed at or below any revision etcd can
    /// report for this request. Comparing with the mark as it is when the
    /// response is handled would mistake a slow response, overtaken by a later
    /// grant of another request, for a restore.
    async fn observe(
        &self,
        mark: Option<Mark>,
        cluster_id: u64,
        revision: Option<i64>,
    ) -> Result<(), ArbiterError> {
        if let Some(reason) = self.guard.observe(cluster_id, revision, mark) {
            self.publish_seal(&reason).await;
        }
        if self.guard.serving().is_err() {
            // Sealed: an advance made through another arbiter may have lifted it.
            self.load_epoch().await?;
        }
        self.guard.serving().map(|_| ())
    }

    /// Runs a transaction; its header is checked before anything in it is used.
    async fn checked_txn(&self, txn: Txn) -> Result<(TxnResponse, i64), ArbiterError> {
        self.checked_txn_on(txn, None).await
    }

    /// [`Self::checked_txn`] for a transaction that puts on `session`'s
    /// lease: etcd's "lease not found" is `SessionExpired`.
    async fn checked_txn_on(
        &self,
        txn: Txn,
        session: Option<i64>,
    ) -> Result<(TxnResponse, i64), ArbiterError> {
        let mark = self.mark_before_request();
        let resp = self
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(|e| match session {
                Some(session) if lease_not_found(&e) => ArbiterError::SessionExpired { session },
                _ => etcd_error(e),
            })?;
        let (cluster_id, revision) = header_of(resp.header())?;
        self.observe(mark, cluster_id, Some(revision)).await?;
        self.saw(cluster_id, revision);
        Ok((resp, revision))
    }

    /// What an answer to a request sent now must not go below: the durable
    /// mark of this arbiter's grants, or the highest revision it has seen in
    /// this epoch, whichever is further. Read BEFORE the request is sent.
    fn mark_before_request(&self) -> Option<Mark> {
        let durable = self.high_water.current();
        let seen = self.seen.lock().ok().and_then(|s| *s);
        match (durable, seen) {
            (Some(d), Some(s)) if s.epoch == d.epoch && s.cluster_id == d.cluster_id => {
                Some(if s.covers(&d) { s } else { d })
            }
            (Some(d), Some(s)) if s.epoch > d.epoch => Some(s),
            (Some(d), _) => Some(d),
            (None, s) => s,
        }
    }

    /// Raises the seen mark after an answer passed the checks.
    fn saw(&self, cluster_id: u64, revision: i64) {
        let Some(state) = self.guard.state() else {
            return;
        };
        if state.cluster_id != cluster_id || self.guard.serving().is_err() {
            return;
        }
        let now = Mark {
            epoch: state.epoch(),
            cluster_id,
            revision,
        };
        if let Ok(mut seen) = self.seen.lock()
            && seen.is_none_or(|s| !s.covers(&now))
        {
            *seen = Some(now);
        }
    }

    /// A linearizable read; its header is checked before its values are used.
    async fn checked_get(
        &self,
        key: String,
        options: Option<GetOptions>,
    ) -> Result<GetResponse, ArbiterError> {
        let mark = self.mark_before_request();
        let resp = self
            .client
            .kv_client()
            .get(key, options)
            .await
            .map_err(etcd_error)?;
        let (cluster_id, revision) = header_of(resp.header())?;
        self.observe(mark, cluster_id, Some(revision)).await?;
        self.saw(cluster_id, revision);
        Ok(resp)
    }

    /// One above every epoch this arbiter has granted in or served.
    fn next_epoch_floor(&self) -> u32 {
        let marked = self.high_water.current().map_or(0, |m| m.epoch);
        let served = self.guard.state().map_or(0, |s| s.epoch());
        marked.max(served).saturating_add(1)
    }

    /// Writes the seal record so every arbiter, even one with no memory of
    /// the old log, refuses too. Not when the epoch record already shows an
    /// epoch above everything this arbiter served or marked: then an advance
    /// came after what this arbiter saw (it only noticed late), the anomaly
    /// is behind the new epoch, and a seal written now would shut the
    /// advanced log for good. The local seal then lifts on the next epoch
    /// read.
    async fn publish_seal(&self, reason: &str) {
        error!(
            reason,
            "lock log sealed: refusing every grant until the epoch advances"
        );
        let floor = self.next_epoch_floor();
        let record = encode(&SealRecord {
            reason: reason.to_string(),
            sealed_at_unix_ms: now_unix_ms(),
            next_epoch_at_least: floor,
        });
        let seal = self.layout.seal();
        let epoch_key = self.layout.epoch();
        let mut kv = self.client.kv_client();
        // Write the seal, or raise the floor of one another arbiter wrote.
        for _ in 0..3 {
            let read = Txn::new().and_then([
                TxnOp::get(seal.clone(), None),
                TxnOp::get(epoch_key.clone(), None),
            ]);
            let resp = match kv.txn(read).await {
                Ok(resp) => resp,
                Err(e) => {
                    warn!(error = %e, "could not read the seal record; this arbiter stays sealed");
                    return;
                }
            };
            let ops = resp.op_responses();
            let existing = ops.first().and_then(first_kv).map(|kv| {
                let floor = decode::<SealRecord>(kv.value()).map_or(0, |s| s.next_epoch_at_least);
                (kv.mod_revision(), floor)
            });
            let epoch_now = ops.get(1).and_then(first_kv);
            if let Some(kv) = epoch_now
                && let Some(record) = decode::<EpochRecord>(kv.value())
                && record.epoch >= floor
            {
                warn!(
                    epoch = record.epoch,
                    "the epoch advanced past what this arbiter saw; not sealing the new epoch"
                );
                return;
            }
            let epoch_unchanged = match epoch_now {
                Some(kv) => {
                    Compare::mod_revision(epoch_key.clone(), CompareOp::Equal, kv.mod_revision())
                }
                None => Compare::create_revision(epoch_key.clone(), CompareOp::Equal, 0),
            };
            let seal_guard = match existing {
                None => Compare::create_revision(seal.clone(), CompareOp::Equal, 0),
                Some((_, theirs)) if theirs >= floor => return,
                Some((rev, _)) => Compare::mod_revision(seal.clone(), CompareOp::Equal, rev),
            };
            let txn = Txn::new()
                .when([seal_guard, epoch_unchanged])
                .and_then([TxnOp::put(seal.clone(), record.clone(), None)]);
            match kv.txn(txn).await {
                Ok(resp) if resp.succeeded() => return,
                Ok(_) => continue,
                Err(e) => {
                    warn!(error = %e, "could not write the seal record; this arbiter stays sealed");
                    return;
                }
            }
        }
    }

    /// Reads (creating on first start) the epoch record and installs it.
    pub async fn load_epoch(&self) -> Result<EpochState, ArbiterError> {
        let mut kv = self.client.kv_client();
        let epoch_key = self.layout.epoch();
        let txn = Txn::new().and_then([
            TxnOp::get(epoch_key.clone(), None),
            TxnOp::get(self.layout.seal(), None),
        ]);
        let mark = self.high_water.current();
        let resp = kv.txn(txn).await.map_err(etcd_error)?;
        let (cluster_id, revision) = header_of(resp.header())?;
        let ops = resp.op_responses();
        let seal = ops
            .get(1)
            .and_then(first_kv)
            .and_then(|kv| decode::<SealRecord>(kv.value()));
        let (record, bytes) = match ops.first().and_then(first_kv) {
            Some(kv) => {
                let record: EpochRecord = decode(kv.value()).ok_or_else(|| {
                    ArbiterError::Internal(format!("the epoch record at {epoch_key} is not valid"))
                })?;
                (record, kv.value().to_vec())
            }
            None => {
                let record = EpochRecord {
                    epoch: 1,
                    cluster_id: cluster_id.to_string(),
                    advanced_at_unix_ms: now_unix_ms(),
                    reason: "first start".into(),
                };
                let bytes = encode(&record);
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        epoch_key.clone(),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then([TxnOp::put(epoch_key.clone(), bytes.clone(), None)]);
                let created = kv.txn(txn).await.map_err(etcd_error)?;
                if !created.succeeded() {
                    // Another arbiter created it first: read theirs.
                    return Box::pin(self.load_epoch()).await;
                }
                tracing::info!(cluster_id, "created epoch record: epoch 1");
                (record, bytes)
            }
        };
        let state = EpochState {
            cluster_id: record.cluster_id().unwrap_or(0),
            record,
            bytes,
        };
        if let Some(reason) = self.guard.install(
            state.clone(),
            cluster_id,
            Some(revision),
            mark,
            seal.as_ref(),
        ) && seal.is_none()
        {
            self.publish_seal(&reason).await;
        }
        Ok(state)
    }

    /// The epoch to grant in; while sealed, re-reads the record first so an
    /// advance made through another arbiter is seen.
    pub async fn serving_epoch(&self) -> Result<EpochState, ArbiterError> {
        match self.guard.serving() {
            Ok(s) => Ok(s),
            Err(ArbiterError::Sealed { .. }) | Err(ArbiterError::StoreUnavailable { .. }) => {
                self.load_epoch().await?;
                self.guard.serving()
            }
            Err(e) => Err(e),
        }
    }

    /// How many sessions `identity` has open, over every arbiter.
    pub async fn count_sessions_of(&self, identity: &str) -> Result<u32, ArbiterError> {
        let resp = self
            .checked_get(
                self.layout.identity_sessions(identity),
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await?;
        Ok(u32::try_from(resp.count()).unwrap_or(u32::MAX))
    }

    /// Opens a session: a lease with an id of our own drawing (see
    /// [`random_lease_id`]), its record and its entry in the identity's
    /// session count, both on the lease. Refused when the identity already
    /// has `max_sessions` open (counted just before; callers serialise the
    /// opens of one identity, so one arbiter never overshoots).
    pub async fn open_session(
        &self,
        identity: &str,
        ttl_seconds: u32,
        max_sessions: u32,
    ) -> Result<i64, ArbiterError> {
        if self.count_sessions_of(identity).await? >= max_sessions {
            return Err(ArbiterError::IdentityLimit {
                bound: IdentityBound::Sessions,
                limit: max_sessions,
            });
        }
        let mut attempt = 0;
        let (id, lease) = loop {
            attempt += 1;
            let id = random_lease_id()?;
            let mark = self.high_water.current();
            match self
                .client
                .lease_client()
                .grant(
                    i64::from(ttl_seconds),
                    Some(LeaseGrantOptions::new().with_id(id)),
                )
                .await
            {
                Ok(lease) => break (id, (lease, mark)),
                Err(e) if lease_exists(&e) && attempt < LEASE_ID_ATTEMPTS => continue,
                Err(e) => return Err(etcd_error(e)),
            }
        };
        let (lease, mark) = lease;
        let (cluster_id, _) = header_of(lease.header())?;
        self.observe(mark, cluster_id, None).await?;
        if lease.id() != id {
            return Err(ArbiterError::Internal(
                "etcd granted a lease under another id than the one asked for".into(),
            ));
        }
        let record = encode(&SessionRecord {
            identity: identity.to_string(),
            ttl_seconds,
        });
        let on_lease = || Some(PutOptions::new().with_lease(id));
        let txn = Txn::new().and_then([
            TxnOp::put(self.layout.session(id), record, on_lease()),
            TxnOp::put(self.layout.identity_session(identity, id), "", on_lease()),
        ]);
        let mark = self.high_water.current();
        let resp = self.client.kv_client().txn(txn).await.map_err(|e| {
            if lease_not_found(&e) {
                ArbiterError::SessionExpired { session: id }
            } else {
                etcd_error(e)
            }
        })?;
        let (cluster_id, revision) = header_of(resp.header())?;
        self.observe(mark, cluster_id, Some(revision)).await?;
        Ok(id)
    }

    pub async fn session(&self, lease: i64) -> Result<Option<SessionRecord>, ArbiterError> {
        let resp = self.checked_get(self.layout.session(lease), None).await?;
        Ok(resp.kvs().first().and_then(|kv| decode(kv.value())))
    }

    /// Closes `identity`'s session: one transaction deletes its record (and
    /// its entry in the identity's count) only if the record still names
    /// `identity`, so from then on no grant, renewal or hand-over uses it;
    /// then the lease is revoked, which ends every hold on it in one entry.
    /// Someone else's session, or one that is gone, is `SessionExpired`
    /// alike. If the revoke fails after the delete, the holds end with the
    /// TTL (nobody can renew the session any more).
    pub async fn close_session(&self, identity: &str, session: i64) -> Result<(), ArbiterError> {
        let session_key = self.layout.session(session);
        let resp = self.checked_get(session_key.clone(), None).await?;
        let Some(kv) = resp.kvs().first() else {
            return Err(ArbiterError::SessionExpired { session });
        };
        let owned = decode::<SessionRecord>(kv.value()).is_some_and(|r| r.identity == identity);
        if !owned || kv.lease() != session {
            return Err(ArbiterError::SessionExpired { session });
        }
        let txn = Txn::new()
            .when([
                Compare::value(session_key.clone(), CompareOp::Equal, kv.value().to_vec()),
                Compare::lease(session_key.clone(), CompareOp::Equal, session),
            ])
            .and_then([
                TxnOp::delete(session_key, None),
                TxnOp::delete(self.layout.identity_session(identity, session), None),
            ]);
        let (resp, _) = self.checked_txn(txn).await?;
        if !resp.succeeded() {
            return Err(ArbiterError::SessionExpired { session });
        }
        self.revoke(session).await
    }

    async fn revoke(&self, lease: i64) -> Result<(), ArbiterError> {
        match self.client.lease_client().revoke(lease).await {
            Ok(_) => Ok(()),
            Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(e) => Err(etcd_error(e)),
        }
    }

    /// Renews `lease` once over the shared keep-alive streams; a TTL of 0
    /// or less means etcd no longer has it.
    pub async fn renew(&self, lease: i64) -> Result<RenewalAnswer, ArbiterError> {
        self.renewals.renew(lease).await
    }

    /// One grant attempt: one transaction, classified. A refusal caused by a
    /// change under us (epoch advanced, key freed between compare and read)
    /// is retried a few times, never answered with a guess.
    pub async fn try_grant(&self, req: &GrantRequest) -> Result<GrantOutcome, ArbiterError> {
        for _ in 0..4 {
            if let Some(outcome) = self.grant_once(req).await? {
                return Ok(outcome);
            }
        }
        Err(ArbiterError::store(
            "the lock log kept changing under the grant transaction",
        ))
    }

    async fn grant_once(&self, req: &GrantRequest) -> Result<Option<GrantOutcome>, ArbiterError> {
        let state = self.serving_epoch().await?;
        let holder_key = self.layout.holder(&req.key);
        let session_key = self.layout.session(req.session);
        let epoch_key = self.layout.epoch();
        let seal_key = self.layout.seal();
        let txn = Txn::new()
            .when([
                Compare::create_revision(holder_key.clone(), CompareOp::Equal, 0),
                Compare::value(epoch_key.clone(), CompareOp::Equal, state.bytes.clone()),
                Compare::create_revision(seal_key.clone(), CompareOp::Equal, 0),
                Compare::value(session_key.clone(), CompareOp::Equal, req.session_bytes()),
            ])
            .and_then([TxnOp::put(
                holder_key.clone(),
                req.holder_bytes(),
                Some(PutOptions::new().with_lease(req.session)),
            )])
            .or_else([
                TxnOp::get(holder_key, None),
                TxnOp::get(epoch_key, None),
                TxnOp::get(seal_key, None),
                TxnOp::get(session_key, None),
            ]);
        let (resp, revision) = self.checked_txn_on(txn, Some(req.session)).await?;
        if resp.succeeded() {
            let grant = Grant {
                key: req.key.clone(),
                session: req.session,
                epoch: state.epoch(),
                revision,
            };
            self.make_durable(&state, revision).await?;
            return Ok(Some(GrantOutcome::Granted(grant)));
        }
        let ops = resp.op_responses();
        let holder = ops.first().and_then(first_kv);
        let epoch_now = ops.get(1).and_then(first_kv).map(|kv| kv.value().to_vec());
        let seal = ops.get(2).and_then(first_kv);
        let session = ops.get(3).and_then(first_kv);

        if seal.is_some() || epoch_now.as_deref() != Some(state.bytes.as_slice()) {
            // The epoch moved or the log was sealed under us: re-read, and let
            // the caller try again against the new state.
            self.load_epoch().await?;
            self.guard.serving()?;
            return Ok(None);
        }
        let session_record = session.and_then(|kv| decode::<SessionRecord>(kv.value()));
        match session_record {
            Some(s) if s.identity == req.identity && s.ttl_seconds != req.ttl_seconds => {
                return Err(ArbiterError::SessionClassMismatch {
                    session: req.session,
                    session_ttl: s.ttl_seconds,
                    class: req.class.clone(),
                    class_ttl: req.ttl_seconds,
                });
            }
            Some(s) if s.identity == req.identity => {}
            _ => {
                return Err(ArbiterError::SessionExpired {
                    session: req.session,
                });
            }
        }
        let Some(holder) = holder else {
            // Everything matched by the time we read it: the key was freed in
            // between. Another attempt decides.
            return Ok(None);
        };
        let record: Option<HolderRecord> = decode(holder.value());
        match record {
            Some(h) if h.session == req.session => {
                // Idempotent retry: the same grant, same token.
                let grant = Grant {
                    key: req.key.clone(),
                    session: req.session,
                    epoch: state.epoch(),
                    revision: holder.mod_revision(),
                };
                Ok(Some(GrantOutcome::Reused(grant)))
            }
            Some(h) if h.identity == req.identity => Err(ArbiterError::Leak {
                key: req.key.clone(),
                holder_session: h.session,
            }),
            _ => Ok(Some(GrantOutcome::Held {
                watch_from: revision + 1,
            })),
        }
    }

    /// The gate's deliberate bug (`TestFault::GrantOnWatch`): a put with no
    /// compares at all. Never compiled into a release build.
    #[cfg(feature = "test-faults")]
    pub async fn grant_blind(&self, req: &GrantRequest) -> Result<Grant, ArbiterError> {
        let state = self.serving_epoch().await?;
        let txn = Txn::new().and_then([TxnOp::put(
            self.layout.holder(&req.key),
            req.holder_bytes(),
            Some(PutOptions::new().with_lease(req.session)),
        )]);
        let (_, revision) = self.checked_txn(txn).await?;
        self.make_durable(&state, revision).await?;
        Ok(Grant {
            key: req.key.clone(),
            session: req.session,
            epoch: state.epoch(),
            revision,
        })
    }

    async fn make_durable(&self, state: &EpochState, revision: i64) -> Result<(), ArbiterError> {
        self.high_water
            .record(Mark {
                epoch: state.epoch(),
                cluster_id: state.cluster_id,
                revision,
            })
            .await
            .map_err(|e| {
                // The grant is committed but cannot be vouched for after a
                // restore: refuse to hand out its token.
                error!(error = %e, "high-water mark not durable; refusing the grant");
                ArbiterError::Internal(
                    "the arbiter could not make the grant durable in its state directory".into(),
                )
            })
    }

    pub async fn holder(&self, key: &str) -> Result<Option<HolderView>, ArbiterError> {
        let resp = self.checked_get(self.layout.holder(key), None).await?;
        Ok(resp.kvs().first().and_then(|kv| {
            decode(kv.value()).map(|record| HolderView {
                record,
                revision: kv.mod_revision(),
                lease: kv.lease(),
            })
        }))
    }

    /// Whether `session` holds `key` at exactly `revision` now (a
    /// linearizable read).
    pub async fn holds(
        &self,
        key: &str,
        session: i64,
        revision: i64,
    ) -> Result<bool, ArbiterError> {
        let resp = self.checked_get(self.layout.holder(key), None).await?;
        Ok(resp
            .kvs()
            .first()
            .is_some_and(|kv| kv.mod_revision() == revision && kv.lease() == session))
    }

    /// The hold on `key` if it is `identity`'s through `session` at
    /// `revision` (the token's); otherwise `NotHeld` — the same answer for
    /// another identity's hold as for no hold, so session ids and tokens
    /// read from somewhere are no oracle — or `TokenMismatch` for the
    /// caller's own hold at another revision.
    pub async fn owned_hold(
        &self,
        key: &str,
        identity: &str,
        session: i64,
        revision: i64,
    ) -> Result<OwnedHold, ArbiterError> {
        let resp = self.checked_get(self.layout.holder(key), None).await?;
        let kv = resp.kvs().first();
        let record = kv.and_then(|kv| decode::<HolderRecord>(kv.value()));
        let checked = match kv {
            Some(kv) => check_owner(
                record.as_ref(),
                kv.lease(),
                kv.mod_revision(),
                identity,
                session,
                revision,
            ),
            None => Err(NotOwned::NotHeld),
        };
        match (checked, kv) {
            (Ok(()), Some(kv)) => Ok(OwnedHold {
                key: key.to_string(),
                session,
                revision,
                value: kv.value().to_vec(),
            }),
            (Err(NotOwned::TokenMismatch), _) => Err(ArbiterError::TokenMismatch {
                key: key.to_string(),
            }),
            _ => Err(ArbiterError::NotHeld {
                key: key.to_string(),
                session,
            }),
        }
    }

    /// Compares that make a write act only on the hold `owned` found: the
    /// same record bytes (the caller's identity and session), on the same
    /// lease, at the same revision.
    fn still_owned(&self, owned: &OwnedHold) -> [Compare; 3] {
        let holder_key = self.layout.holder(&owned.key);
        [
            Compare::mod_revision(holder_key.clone(), CompareOp::Equal, owned.revision),
            Compare::lease(holder_key.clone(), CompareOp::Equal, owned.session),
            Compare::value(holder_key, CompareOp::Equal, owned.value.clone()),
        ]
    }

    /// Hands the caller's hold straight to `next` in one transaction.
    /// `Ok(None)` if any compare failed (the caller then does a plain
    /// release, which answers why).
    pub async fn hand_over(
        &self,
        owned: &OwnedHold,
        next: &GrantRequest,
    ) -> Result<Option<HandedOver>, ArbiterError> {
        let state = self.serving_epoch().await?;
        let holder_key = self.layout.holder(&owned.key);
        let mut compares = self.still_owned(owned).to_vec();
        compares.extend([
            Compare::value(self.layout.epoch(), CompareOp::Equal, state.bytes.clone()),
            Compare::create_revision(self.layout.seal(), CompareOp::Equal, 0),
            Compare::value(
                self.layout.session(next.session),
                CompareOp::Equal,
                next.session_bytes(),
            ),
        ]);
        let txn = Txn::new().when(compares).and_then([TxnOp::put(
            holder_key,
            next.holder_bytes(),
            Some(PutOptions::new().with_lease(next.session).with_prev_key()),
        )]);
        let (resp, rev) = self.checked_txn(txn).await?;
        if !resp.succeeded() {
            return Ok(None);
        }
        let previous = match resp.op_responses().first() {
            Some(TxnOpResponse::Put(p)) => p.prev_key().and_then(|kv| decode(kv.value())),
            _ => None,
        };
        self.make_durable(&state, rev).await?;
        Ok(Some(HandedOver {
            grant: Grant {
                key: owned.key.clone(),
                session: next.session,
                epoch: state.epoch(),
                revision: rev,
            },
            previous,
        }))
    }

    /// Deletes the caller's hold; returns its record (for the metrics).
    /// `NotHeld` if it changed since [`Self::owned_hold`] found it (expired,
    /// or released by another call of the same caller).
    pub async fn release_owned(
        &self,
        owned: &OwnedHold,
    ) -> Result<Option<HolderRecord>, ArbiterError> {
        let txn = Txn::new()
            .when(self.still_owned(owned))
            .and_then([TxnOp::delete(
                self.layout.holder(&owned.key),
                Some(etcd_client::DeleteOptions::new().with_prev_key()),
            )]);
        let (resp, _) = self.checked_txn(txn).await?;
        if !resp.succeeded() {
            return Err(ArbiterError::NotHeld {
                key: owned.key.clone(),
                session: owned.session,
            });
        }
        Ok(match resp.op_responses().first() {
            Some(TxnOpResponse::Delete(d)) => {
                d.prev_kvs().first().and_then(|kv| decode(kv.value()))
            }
            _ => None,
        })
    }

    /// Deletes a grant this arbiter made whose caller went away, if `session`
    /// still holds `key` at `revision` (the orphan release; never on a
    /// caller's say-so).
    pub async fn release_orphan(
        &self,
        key: &str,
        session: i64,
        revision: i64,
    ) -> Result<(), ArbiterError> {
        let holder_key = self.layout.holder(key);
        let txn = Txn::new()
            .when([
                Compare::mod_revision(holder_key.clone(), CompareOp::Equal, revision),
                Compare::lease(holder_key.clone(), CompareOp::Equal, session),
            ])
            .and_then([TxnOp::delete(holder_key, None)]);
        let (resp, _) = self.checked_txn(txn).await?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(ArbiterError::NotHeld {
                key: key.to_string(),
                session,
            })
        }
    }

    /// Watches `key` from `from_revision`; see [`KeyWatch`].
    pub async fn watch(&self, key: &str, from_revision: i64) -> Result<KeyWatch, ArbiterError> {
        let stream = self
            .client
            .watch_client()
            .watch(
                self.layout.holder(key),
                Some(WatchOptions::new().with_start_revision(from_revision)),
            )
            .await
            .map_err(etcd_error)?;
        Ok(KeyWatch { stream })
    }

    /// ADR-03's unseal: compare epoch E, write E+1 bound to the current
    /// cluster id, delete every hold, every durable waiter and the seal.
    pub async fn advance_epoch(
        &self,
        expected: u32,
        reason: &str,
    ) -> Result<(EpochRecord, i64), ArbiterError> {
        let mut kv = self.client.kv_client();
        let epoch_key = self.layout.epoch();
        let seal_key = self.layout.seal();
        let current = kv
            .txn(Txn::new().and_then([
                TxnOp::get(epoch_key.clone(), None),
                TxnOp::get(seal_key.clone(), None),
            ]))
            .await
            .map_err(etcd_error)?;
        let (cluster_id, _) = header_of(current.header())?;
        let ops = current.op_responses();
        let seal = ops.get(1).and_then(first_kv);
        let seal_floor = seal
            .and_then(|kv| decode::<SealRecord>(kv.value()))
            .map_or(0, |s| s.next_epoch_at_least);
        let seal_compare = match seal {
            Some(kv) => {
                Compare::mod_revision(seal_key.clone(), CompareOp::Equal, kv.mod_revision())
            }
            None => Compare::create_revision(seal_key.clone(), CompareOp::Equal, 0),
        };
        let Some(existing) = ops.first().and_then(first_kv) else {
            return Err(ArbiterError::BadRequest(
                "there is no epoch record yet; start an arbiter against this etcd first".into(),
            ));
        };
        let record: EpochRecord = decode(existing.value())
            .ok_or_else(|| ArbiterError::Internal("the epoch record is not valid".into()))?;
        if record.epoch != expected {
            return Err(ArbiterError::BadRequest(format!(
                "the epoch is {}, not {expected}; check `latchctl admin status` and pass the current epoch",
                record.epoch
            )));
        }
        // Above etcd's record, above every epoch a sealing arbiter has used
        // (the seal's floor) and above every epoch this arbiter has used:
        // after a restore to before an earlier advance, record + 1 may be an
        // epoch that already issued tokens.
        let next = (record.epoch + 1)
            .max(seal_floor)
            .max(self.next_epoch_floor());
        if next >= token::MAX_EPOCH {
            return Err(ArbiterError::Internal(
                "the epoch space is exhausted".into(),
            ));
        }
        let new_record = EpochRecord {
            epoch: next,
            cluster_id: cluster_id.to_string(),
            advanced_at_unix_ms: now_unix_ms(),
            reason: reason.to_string(),
        };
        let txn = Txn::new()
            .when([
                Compare::value(
                    epoch_key.clone(),
                    CompareOp::Equal,
                    existing.value().to_vec(),
                ),
                // a seal raised meanwhile may carry a higher floor
                seal_compare,
            ])
            .and_then([
                TxnOp::put(epoch_key, encode(&new_record), None),
                TxnOp::delete(
                    self.layout.holders(),
                    Some(etcd_client::DeleteOptions::new().with_prefix()),
                ),
                TxnOp::delete(
                    self.layout.durable_waiters(),
                    Some(etcd_client::DeleteOptions::new().with_prefix()),
                ),
                TxnOp::delete(self.layout.seal(), None),
            ]);
        let resp = kv.txn(txn).await.map_err(etcd_error)?;
        if !resp.succeeded() {
            return Err(ArbiterError::BadRequest(
                "the epoch record or the seal changed while advancing; read the status and try again".into(),
            ));
        }
        let deleted = match resp.op_responses().get(1) {
            Some(TxnOpResponse::Delete(d)) => d.deleted(),
            _ => 0,
        };
        self.load_epoch().await?;
        Ok((new_record, deleted))
    }

    /// The cluster id etcd reports now.
    pub async fn current_cluster_id(&self) -> Result<u64, ArbiterError> {
        let resp = self
            .client
            .kv_client()
            .get(
                self.layout.epoch(),
                Some(GetOptions::new().with_count_only()),
            )
            .await
            .map_err(etcd_error)?;
        Ok(header_of(resp.header())?.0)
    }

    /// How many keys `identity` holds in `class`, over every arbiter: the
    /// holder records under each of `prefixes` (the identity's grants; it
    /// can hold nothing elsewhere), read with one range per prefix. For a
    /// hook that asks for `holdCount`; exact as of the read, not part of the
    /// grant transaction.
    pub async fn count_holds_of(
        &self,
        identity: &str,
        class: &str,
        prefixes: &[&str],
    ) -> Result<u32, ArbiterError> {
        let mut seen = std::collections::HashSet::new();
        let mut count = 0u32;
        for prefix in prefixes {
            let resp = self
                .checked_get(
                    self.layout.holder(prefix),
                    Some(GetOptions::new().with_prefix()),
                )
                .await?;
            for kv in resp.kvs() {
                if !seen.insert(kv.key().to_vec()) {
                    continue;
                }
                if let Some(record) = decode::<HolderRecord>(kv.value())
                    && record.identity == identity
                    && record.class == class
                {
                    count = count.saturating_add(1);
                }
            }
        }
        Ok(count)
    }

    /// Keys held under a prefix, for tests and inspection tools.
    pub async fn count_holds(&self) -> Result<i64, ArbiterError> {
        let resp = self
            .client
            .kv_client()
            .get(
                self.layout.holders(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .map_err(etcd_error)?;
        Ok(resp.count())
    }
}

/// What a key watch reported.
#[derive(Debug, PartialEq, Eq)]
pub enum WatchSignal {
    /// The key was deleted (release or session expiry): worth an attempt.
    Freed,
    /// The key changed hands or was written: the wait goes on.
    Changed,
    /// The watch ended (compaction, cancel, stream error): fall back to polling.
    Lost,
}

pub struct KeyWatch {
    stream: WatchStream,
}

impl KeyWatch {
    pub async fn next(&mut self) -> WatchSignal {
        loop {
            match self.stream.message().await {
                Ok(Some(resp)) => {
                    if resp.canceled() {
                        return WatchSignal::Lost;
                    }
                    if resp.events().is_empty() {
                        continue;
                    }
                    let freed = resp
                        .events()
                        .iter()
                        .any(|e| e.event_type() == EventType::Delete);
                    return if freed {
                        WatchSignal::Freed
                    } else {
                        WatchSignal::Changed
                    };
                }
                Ok(None) | Err(_) => return WatchSignal::Lost,
            }
        }
    }
}
