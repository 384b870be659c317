//! The client handle: the channel, the sessions it keeps open (one per TTL),
//! and the calls that need no session.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use latchkey_proto::adminv1::{
    AdvanceEpochRequest, AdvanceEpochResponse, ApproveForceReleaseRequest,
    ApproveForceReleaseResponse, ForceReleaseRequest, GetStatusRequest, GetStatusResponse,
    ListForceReleasesRequest, ListForceReleasesResponse, RequestForceReleaseRequest,
};
use latchkey_proto::adminv1::{
    ChangeShardsRequest, GetShardsRequest, ShardStatus, StepShardMoveRequest,
};
use latchkey_proto::lockv1::{InspectRequest, OpenSessionRequest, ReleaseRequest};
use parking_lot::{Mutex, MutexGuard};
use tokio::time::Instant;

use crate::config::ClientConfig;
use crate::error::Error;
use crate::lock::LockBuilder;
use crate::rpc::Rpc;
use crate::session::{Session, SessionInner};
use crate::token::FencingToken;

/// A connection to the arbiter under one identity. Cheap to clone; clones
/// share the channel and the sessions.
///
/// ```no_run
/// use latchkey_client::{Client, ClientConfig};
///
/// # async fn run() -> Result<(), latchkey_client::Error> {
/// // A dev arbiter (started with --insecure-dev); see ClientConfig::tls for mTLS.
/// let client = Client::connect(ClientConfig::insecure_dev(
///     "http://127.0.0.1:7000",
///     "spiffe://dev.latchkey/workload/alice",
/// ))
/// .await?;
/// let worker = client.clone(); // same channel, same sessions
/// # let _ = worker;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

struct ClientInner {
    rpc: Rpc,
    sessions: Mutex<Sessions>,
    /// One OpenSession at a time, so two first acquires of a class cannot
    /// open two leases for one TTL.
    opening: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Sessions {
    by_id: HashMap<i64, Arc<SessionInner>>,
    /// Which session served a class last; saves an OpenSession per acquire.
    by_class: HashMap<String, i64>,
}

/// Who holds a key, as the arbiter that answered sees it; see
/// [`Client::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// The key asked about.
    pub key: String,
    /// `None` when the key is free.
    pub holder: Option<Holder>,
    /// Waiters queued on the arbiter that answered.
    pub waiters: u32,
    /// Waiters queued in the lock log (durable classes): the same from
    /// every arbiter.
    pub durable_waiters: u32,
    /// A semaphore's holders, one per held slot, in slot order (empty for
    /// a lock: a key is one kind at a time).
    pub slot_holders: Vec<Holder>,
    /// A lock's shared holders, one per session (empty while it is held
    /// exclusively or not at all).
    pub shared_holders: Vec<Holder>,
}

/// The current holder of a key, in an [`Inspection`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The holder's SPIFFE ID.
    pub identity: String,
    /// The holder's session, shown only to the holder's own identity and
    /// to operators; 0 for everyone else. (Inspect never returns the
    /// token: a token is a capability, and the holder has it from its grant.)
    pub session_id: i64,
    /// The lock class the key was acquired under.
    pub class: String,
    /// When the hold was granted (the arbiter's clock, Unix milliseconds).
    pub acquired_at_unix_ms: i64,
    /// What the class's hooks attached to the grant (a change ticket, say).
    pub annotations: BTreeMap<String, String>,
    /// The slot held, for a semaphore's holder ([`Inspection::slot_holders`]).
    pub slot: Option<u32>,
    /// A shared holder ([`Inspection::shared_holders`]).
    pub shared: bool,
}

impl Client {
    /// Connects (eagerly, so a wrong endpoint or certificate shows here).
    ///
    /// ```no_run
    /// use latchkey_client::{Client, ClientConfig, TlsFiles};
    ///
    /// # async fn run() -> Result<(), latchkey_client::Error> {
    /// let mut config = ClientConfig::tls(
    ///     "https://latchkey.example:7443",
    ///     TlsFiles {
    ///         ca: "/run/spiffe/bundle.pem".into(),
    ///         cert: "/run/spiffe/svid.pem".into(),
    ///         key: "/run/spiffe/svid.key".into(),
    ///     },
    /// );
    /// config.tls_domain = Some("latchkey.example".into());
    /// let client = Client::connect(config).await?;
    /// # let _ = client;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(config: ClientConfig) -> Result<Self, Error> {
        let rpc = Rpc::connect(&config).await?;
        Ok(Self {
            inner: Arc::new(ClientInner {
                rpc,
                sessions: Mutex::new(Sessions::default()),
                opening: tokio::sync::Mutex::new(()),
            }),
        })
    }

    pub(crate) fn rpc(&self) -> &Rpc {
        &self.inner.rpc
    }

    fn sessions(&self) -> MutexGuard<'_, Sessions> {
        self.inner.sessions.lock()
    }

    /// A session with `class`'s TTL: one this client already has if the
    /// arbiter finds one that fits, else a new lease whose keepalive starts now.
    ///
    /// [`Client::lock`] does this by itself; open one explicitly to attach
    /// holds to it with [`LockBuilder::session`] and end them all with
    /// [`Session::close`].
    ///
    /// ```no_run
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let session = client.open_session("jobs").await?;
    /// let a = client.lock("jobs/a", "jobs").session(&session).acquire(|_| {}).await?;
    /// let b = client.lock("jobs/b", "jobs").session(&session).acquire(|_| {}).await?;
    /// a.detach();
    /// b.detach();
    /// session.close().await?; // releases both at the arbiter
    /// # Ok(())
    /// # }
    /// ```
    pub async fn open_session(&self, class: &str) -> Result<Session, Error> {
        let _opening = self.inner.opening.lock().await;
        let reuse_session_ids = {
            let mut sessions = self.sessions();
            sessions.prune();
            let mut ids: Vec<i64> = sessions.by_id.keys().copied().collect();
            ids.sort_unstable();
            ids
        };
        let rpc = &self.inner.rpc;
        let opened_at = Instant::now();
        let reply = rpc
            .lock()
            .open_session(rpc.unary(OpenSessionRequest {
                class: class.to_owned(),
                reuse_session_ids,
            }))
            .await?
            .into_inner();
        if reply.ttl_seconds == 0 {
            return Err(Error::Protocol {
                rpc: "OpenSession",
                problem: "zero TTL",
            });
        }
        let ttl = Duration::from_secs(u64::from(reply.ttl_seconds));
        let interval = match reply.keepalive_interval_ms {
            0 => ttl / 3,
            ms => Duration::from_millis(u64::from(ms)).min(ttl / 2),
        }
        .max(Duration::from_millis(100));

        let mut sessions = self.sessions();
        let existing = sessions
            .by_id
            .get(&reply.session_id)
            .filter(|s| s.core.fenced().is_none())
            .cloned();
        let inner = match existing {
            Some(inner) => inner,
            None => {
                let inner =
                    SessionInner::start(rpc.clone(), reply.session_id, ttl, interval, opened_at);
                sessions.by_id.insert(reply.session_id, Arc::clone(&inner));
                tracing::debug!(
                    session_id = reply.session_id,
                    ttl_s = reply.ttl_seconds,
                    "session opened"
                );
                inner
            }
        };
        sessions.by_class.insert(class.to_owned(), reply.session_id);
        Ok(Session::new(inner, reply.reused))
    }

    /// The live session that served `class` last, or a fresh open.
    pub(crate) async fn session_for_class(&self, class: &str) -> Result<Session, Error> {
        {
            let sessions = self.sessions();
            let cached = sessions
                .by_class
                .get(class)
                .and_then(|id| sessions.by_id.get(id))
                .filter(|s| s.core.fenced().is_none());
            if let Some(inner) = cached {
                return Ok(Session::new(Arc::clone(inner), true));
            }
        }
        self.open_session(class).await
    }

    pub(crate) fn forget_class(&self, class: &str, session_id: i64) {
        let mut sessions = self.sessions();
        if sessions.by_class.get(class) == Some(&session_id) {
            sessions.by_class.remove(class);
        }
    }

    /// How many SVID rotations this client has taken up: the TLS files are
    /// looked at again (at most once a second, from the calls), and once a
    /// change has stayed put for a look, later calls and streams present
    /// the new certificate. Calls and streams already open keep theirs.
    pub fn svid_reloads(&self) -> u64 {
        self.inner.rpc.svid_reloads()
    }

    /// A session of this client by id, if it is still open.
    ///
    /// ```no_run
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let guard = client.lock("jobs/a", "jobs").acquire(|_| {}).await?;
    /// let session = client.session(guard.session_id()).expect("open while the guard lives");
    /// assert!(!session.is_fenced());
    /// # Ok(())
    /// # }
    /// ```
    pub fn session(&self, session_id: i64) -> Option<Session> {
        self.sessions()
            .by_id
            .get(&session_id)
            .filter(|s| s.core.fenced().is_none())
            .map(|inner| Session::new(Arc::clone(inner), true))
    }

    /// Starts a lock request on `key` under the lock class `class` (which
    /// sets its TTL, who may take it and its hooks); see [`LockBuilder`].
    ///
    /// ```no_run
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// use latchkey_client::Reason;
    ///
    /// // Without .wait(..) a held key is refused at once.
    /// match client.lock("reports/daily", "jobs").acquire(|_| {}).await {
    ///     Ok(guard) => guard.release().await?,
    ///     Err(err) if err.reason() == Reason::Held => println!("someone else runs it"),
    ///     Err(err) => return Err(err),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn lock(&self, key: impl Into<String>, class: impl Into<String>) -> LockBuilder {
        LockBuilder::new(self.clone(), key.into(), class.into())
    }

    /// Who holds `key`. Never returns a token.
    ///
    /// ```no_run
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let view = client.inspect("jobs/nightly").await?;
    /// match view.holder {
    ///     Some(holder) => println!("held by {} ({} waiting)", holder.identity, view.waiters),
    ///     None => println!("free"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn inspect(&self, key: &str) -> Result<Inspection, Error> {
        let rpc = &self.inner.rpc;
        let reply = rpc
            .lock()
            .inspect(rpc.unary(InspectRequest {
                key: key.to_owned(),
            }))
            .await?
            .into_inner();
        let holder = |h: latchkey_proto::lockv1::Holder| Holder {
            identity: h.identity,
            session_id: h.session_id,
            class: h.class,
            acquired_at_unix_ms: h.acquired_at_unix_ms,
            annotations: h.annotations.into_iter().collect(),
            slot: h.slot,
            shared: h.mode == latchkey_proto::lockv1::Mode::Shared as i32,
        };
        Ok(Inspection {
            key: reply.key,
            waiters: reply.waiters,
            durable_waiters: reply.durable_waiters,
            holder: reply.holder.map(holder),
            slot_holders: reply.slot_holders.into_iter().map(holder).collect(),
            shared_holders: reply.shared_holders.into_iter().map(holder).collect(),
        })
    }

    /// Releases a hold by its grant, bypassing the re-entrancy count: for a
    /// hold this process did not acquire (`latchctl release` after
    /// `acquire --detach`). Prefer [`LockGuard::release`](crate::LockGuard::release).
    ///
    /// ```no_run
    /// use latchkey_client::FencingToken;
    ///
    /// # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// // The session id and token as another process printed them.
    /// let (session_id, token): (i64, u64) = (7_587_862_381, 281_474_976_710_699);
    /// client
    ///     .release_grant("jobs/nightly", session_id, FencingToken::new(token))
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn release_grant(
        &self,
        key: &str,
        session_id: i64,
        token: FencingToken,
    ) -> Result<(), Error> {
        self.release_grant_in(key, None, session_id, token).await
    }

    /// [`Self::release_grant`] for a semaphore's grant: `slot` is the slot
    /// the grant returned (`None`: a lock's grant).
    pub async fn release_grant_in(
        &self,
        key: &str,
        slot: Option<u32>,
        session_id: i64,
        token: FencingToken,
    ) -> Result<(), Error> {
        self.release_grant_as(key, slot, false, session_id, token)
            .await
    }

    /// [`Self::release_grant`] for a shared grant ([`crate::LockBuilder::shared`]).
    pub async fn release_shared_grant(
        &self,
        key: &str,
        session_id: i64,
        token: FencingToken,
    ) -> Result<(), Error> {
        self.release_grant_as(key, None, true, session_id, token)
            .await
    }

    async fn release_grant_as(
        &self,
        key: &str,
        slot: Option<u32>,
        shared: bool,
        session_id: i64,
        token: FencingToken,
    ) -> Result<(), Error> {
        let rpc = &self.inner.rpc;
        let mode = match shared {
            true => latchkey_proto::lockv1::Mode::Shared,
            false => latchkey_proto::lockv1::Mode::Exclusive,
        };
        rpc.lock()
            .release(rpc.unary(ReleaseRequest {
                key: key.to_owned(),
                session_id,
                token: token.get(),
                slot,
                mode: mode as i32,
            }))
            .await?;
        Ok(())
    }

    /// Proclaims `value` on a leadership named by its session id and token
    /// rather than held as a [`crate::Leadership`] guard (another process's,
    /// or one this process lost track of). The arbiter refuses it with
    /// `NOT_LEADER` unless that leadership is current and the session is
    /// this identity's; no local state is consulted, which is what
    /// `latchctl pause-test --election` needs to ask the arbiter itself.
    pub async fn proclaim_as(
        &self,
        election: &str,
        session_id: i64,
        token: FencingToken,
        value: &str,
    ) -> Result<(), Error> {
        let rpc = &self.inner.rpc;
        rpc.election()
            .proclaim(rpc.unary(latchkey_proto::electionv1::ProclaimRequest {
                election: election.to_owned(),
                session_id,
                token: token.get(),
                value: value.to_owned(),
            }))
            .await?;
        Ok(())
    }

    /// The arbiter's epoch and seal state. Operator identities only.
    ///
    /// ```no_run
    /// # async fn run(operator: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let status = operator.admin_status().await?;
    /// if status.sealed {
    ///     println!("sealed at epoch {}: see the operations guide", status.epoch);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn admin_status(&self) -> Result<GetStatusResponse, Error> {
        self.admin_status_of("").await
    }

    /// [`Self::admin_status`] of one tier's cluster (ADR-07): `"entity"`
    /// (or `""`), or `"coord"` on an arbiter with the tiers split.
    pub async fn admin_status_of(&self, tier: &str) -> Result<GetStatusResponse, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .get_status(rpc.unary(GetStatusRequest {
                tier: tier.to_owned(),
            }))
            .await?
            .into_inner())
    }

    /// Unseals after a restore by moving the epoch from `expected` to
    /// `expected + 1`; deletes every hold. Operator identities only.
    ///
    /// ```no_run
    /// # async fn run(operator: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
    /// let status = operator.admin_status().await?;
    /// let advanced = operator
    ///     .advance_epoch(status.epoch, "restored from snapshot")
    ///     .await?;
    /// # let _ = advanced;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn advance_epoch(
        &self,
        expected: u32,
        reason: &str,
    ) -> Result<AdvanceEpochResponse, Error> {
        self.advance_epoch_at_least(expected, reason, 0).await
    }

    /// [`Self::advance_epoch`] to an epoch of at least `at_least`: after
    /// restoring both clusters from backups older than the serving epoch,
    /// pass one above the highest epoch your fenced resources have seen.
    pub async fn advance_epoch_at_least(
        &self,
        expected: u32,
        reason: &str,
        at_least: u32,
    ) -> Result<AdvanceEpochResponse, Error> {
        self.advance_epoch_in("", expected, reason, at_least).await
    }

    /// The entity shards (ADR-09): the shard map, each shard's epoch, map
    /// fence and holds, and the move under way. Operator identities only.
    pub async fn shards(&self) -> Result<ShardStatus, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .get_shards(rpc.unary(GetShardsRequest {}))
            .await?
            .into_inner()
            .status
            .unwrap_or_default())
    }

    /// Starts a change of the shard map (add a shard, pin a namespace): the
    /// moving ranges take no new grants until [`Self::step_shard_move`]
    /// finishes it. Operator identities only.
    pub async fn change_shards(&self, change: ChangeShardsRequest) -> Result<ShardStatus, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .change_shards(rpc.unary(change))
            .await?
            .into_inner()
            .status
            .unwrap_or_default())
    }

    /// Steps the move under way as far as it can go now; call it until the
    /// answer has no `move`. Operator identities only.
    pub async fn step_shard_move(&self, allow_ending_holds: bool) -> Result<ShardStatus, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .step_shard_move(rpc.unary(StepShardMoveRequest { allow_ending_holds }))
            .await?
            .into_inner()
            .status
            .unwrap_or_default())
    }

    /// [`Self::advance_epoch_at_least`] of one tier's cluster (ADR-07):
    /// `"entity"` (or `""`), or `"coord"` on an arbiter with the tiers split.
    pub async fn advance_epoch_in(
        &self,
        tier: &str,
        expected: u32,
        reason: &str,
        at_least: u32,
    ) -> Result<AdvanceEpochResponse, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .advance_epoch(rpc.unary(AdvanceEpochRequest {
                expected_epoch: expected,
                reason: reason.to_owned(),
                at_least_epoch: at_least,
                tier: tier.to_owned(),
            }))
            .await?
            .into_inner())
    }

    /// Asks for a force-release of `key`'s current hold (ADR-20); a
    /// different operator approves it. `id_token` is the requester's OIDC
    /// ID token. Operator identities only.
    ///
    /// ```no_run
    /// # async fn run(operator: latchkey_client::Client, id_token: String) -> Result<(), latchkey_client::Error> {
    /// let request = operator
    ///     .request_force_release("jobs/nightly", "wedged holder", false, &id_token)
    ///     .await?;
    /// println!("ask a second operator to approve {}", request.request_id);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn request_force_release(
        &self,
        key: &str,
        reason: &str,
        revoke_session: bool,
        id_token: &str,
    ) -> Result<ForceReleaseRequest, Error> {
        self.request_force_release_in(key, None, reason, revoke_session, id_token)
            .await
    }

    /// [`Self::request_force_release`] of the hold in `slot` of semaphore
    /// `key` (as Inspect lists its slot holders); `None`: a lock's hold.
    pub async fn request_force_release_in(
        &self,
        key: &str,
        slot: Option<u32>,
        reason: &str,
        revoke_session: bool,
        id_token: &str,
    ) -> Result<ForceReleaseRequest, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .request_force_release(rpc.unary(RequestForceReleaseRequest {
                key: key.to_owned(),
                reason: reason.to_owned(),
                revoke_session,
                id_token: id_token.to_owned(),
                election: false,
                slot,
                shared_session: None,
            }))
            .await?
            .into_inner())
    }

    /// [`Self::request_force_release`] of `session`'s shared hold of lock
    /// `key` (Inspect lists shared holders, with their sessions, to
    /// operators).
    pub async fn request_force_release_shared(
        &self,
        key: &str,
        session: i64,
        reason: &str,
        revoke_session: bool,
        id_token: &str,
    ) -> Result<ForceReleaseRequest, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .request_force_release(rpc.unary(RequestForceReleaseRequest {
                key: key.to_owned(),
                reason: reason.to_owned(),
                revoke_session,
                id_token: id_token.to_owned(),
                election: false,
                slot: None,
                shared_session: Some(session),
            }))
            .await?
            .into_inner())
    }

    /// Asks for a force-release of election `election`'s current
    /// leadership (issue 33): once a different operator approves, its term
    /// ends (observers, the leader's own client included, see a `FORCED`
    /// vacancy of that term) and the next candidate leads in a new term. A
    /// hold on a lock key of the same name is left alone. The request shows
    /// the leader, its session and term, never its token.
    /// `revoke_session` also revokes the leader's session.
    pub async fn request_election_force_release(
        &self,
        election: &str,
        reason: &str,
        revoke_session: bool,
        id_token: &str,
    ) -> Result<ForceReleaseRequest, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .request_force_release(rpc.unary(RequestForceReleaseRequest {
                key: election.to_owned(),
                reason: reason.to_owned(),
                revoke_session,
                id_token: id_token.to_owned(),
                election: true,
                slot: None,
                shared_session: None,
            }))
            .await?
            .into_inner())
    }

    /// Approves (and so executes) force-release request `request_id`, as a
    /// different operator than its requester.
    pub async fn approve_force_release(
        &self,
        request_id: &str,
        id_token: &str,
    ) -> Result<ApproveForceReleaseResponse, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .approve_force_release(rpc.unary(ApproveForceReleaseRequest {
                request_id: request_id.to_owned(),
                id_token: id_token.to_owned(),
            }))
            .await?
            .into_inner())
    }

    /// Pending force-release requests and the force records of the last 24 h.
    pub async fn list_force_releases(
        &self,
        id_token: &str,
    ) -> Result<ListForceReleasesResponse, Error> {
        let rpc = &self.inner.rpc;
        Ok(rpc
            .admin()
            .list_force_releases(rpc.unary(ListForceReleasesRequest {
                id_token: id_token.to_owned(),
            }))
            .await?
            .into_inner())
    }
}

impl Sessions {
    /// Dead sessions are neither offered for reuse nor kept renewing.
    fn prune(&mut self) {
        self.by_id.retain(|_, s| s.core.fenced().is_none());
        let by_id = &self.by_id;
        self.by_class.retain(|_, id| by_id.contains_key(id));
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sessions: Vec<i64> = self.sessions().by_id.keys().copied().collect();
        f.debug_struct("Client")
            .field("sessions", &sessions)
            .finish()
    }
}
