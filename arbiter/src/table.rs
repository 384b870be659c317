//! The one owner of the grant protocol: queues, claims, hand-over, orphan
//! releases and seal checks, over a [`LockLog`].
//!
//! The RPC handlers do identity, policy, hooks and metrics, then call
//! [`LockTable::acquire`] or [`LockTable::release`]. Everything that decides
//! who holds a key lives here:
//!
//! - A grant is one log transaction comparing key absence, the epoch
//!   record's bytes, the seal's absence, the shard-map fence's revision
//!   (`sys/shardmap`, ADR-09) and the session record; its token is
//!   `epoch × 2^48 + revision`, made durable in the high-water mark before it
//!   is returned ([`seal::Seal`] checks every answer's header first).
//! - A held key queues the caller FIFO (`queues`); one driver per contended
//!   key attempts a grant for the head waiter whenever something suggests
//!   the key may be free: a delete on the key's watch, a kick from a local
//!   release or cancellation, or a poll. Every attempt is a full grant
//!   transaction; a notification never grants.
//! - A release with a local waiter hands the key over in one transaction.
//! - Delivery is exactly-once per waiter; a grant made for a caller that went
//!   away is released at once as an orphan — unless a call of the same
//!   session has claimed it: a session's grant goes to its new call or to the
//!   orphan release, never both. The claim is a record in the log
//!   ([`LockLog::claim`]) and the orphan release compares its absence, so
//!   the log decides which came first, whichever arbiters ran them. (An
//!   in-memory claim, as before, could not see a claim made through another
//!   arbiter: the deterministic simulation found that double grant.)
//!
//! Background work (drivers, orphan releases) is tracked:
//! [`LockTable::shutdown`] returns once it has all stopped.
//!
//! [`LockLog::claim`]: crate::lock_log::HoldLog::claim

mod batch;
mod driver;
pub mod durable;
mod grants;
mod intent;
pub mod max_hold;
mod queues;
mod quota;
pub mod seal;
mod semaphore;
pub mod sessions;
mod shared;
mod waiters;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::epoch::{EpochGuard, EpochState};
use crate::error::ArbiterError;
use crate::high_water::HighWater;
use crate::lock_log::{ForceEndTxn, ForceEnded, HandOverFrom, Kv, LockLog, ReleaseTxn};
use crate::records::{HolderRecord, SessionRecord, decode, encode, now_unix_ms};
use crate::token;
use crate::witness::Witness;
use batch::Batches;
pub use batch::{BatchStats, DEFAULT_BATCH_LIMIT, DEFAULT_BATCHES_IN_FLIGHT};
use queues::Head;
use queues::{Book, Delivery, Reply, Slot, Waiter};
use seal::Seal;
pub use waiters::{QueueView, WaiterView};

/// The default `--max-waiters-per-identity`: the edge's own per-identity
/// bound, so a direct caller gets no more than one through the edge.
pub const DEFAULT_MAX_WAITERS_PER_IDENTITY: u32 = 64;

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
    pub annotations: BTreeMap<String, String>,
    /// The grant subject the caller is bounded as, when it is not the
    /// caller's own identity (a pattern its per-pod identity falls under);
    /// empty otherwise. Kept in the holder record, so holds count per subject.
    pub bound: String,
    /// The client instance asking, as it names itself (empty: unnamed).
    /// Decides LEAK against contention only ([`is_leak`]), never who may hold.
    pub instance: String,
    /// The shard map version the request was routed by (ADR-09): a cluster
    /// fenced at a newer one refuses it, whatever map this arbiter has
    /// adopted since (a move fences the old home before the range changes
    /// hands). `None`: not routed by a map (the coord tier; the table's
    /// own [`MapVersion`] alone decides).
    pub routed_by: Option<u64>,
    /// The class's `maxHoldsPerSubject`: every grant takes one of that many
    /// quota places of the grant subject in its own transaction
    /// (`table/quota.rs`). `None`: the class has no quota.
    pub quota: Option<u32>,
    /// A semaphore class's `permits`: `key` is the semaphore's name, and a
    /// grant holds one of its slots (`table/semaphore.rs`). `None`: a lock.
    pub permits: Option<u32>,
    /// A shared hold of lock `key` (`mode = SHARED`): held on the session's
    /// own reader key beside other sessions' (`table/shared.rs`). `false`:
    /// exclusive.
    pub shared: bool,
}

impl GrantRequest {
    /// Whom the request counts against: its grant subject.
    pub fn bounded_as(&self) -> &str {
        if self.bound.is_empty() {
            &self.identity
        } else {
            &self.bound
        }
    }

    fn session_bytes(&self) -> Vec<u8> {
        encode(&SessionRecord {
            identity: self.identity.clone(),
            ttl_seconds: self.ttl_seconds,
        })
    }

    fn holder_bytes(&self, quota_place: Option<u32>) -> Vec<u8> {
        self.holder_bytes_at(quota_place, now_unix_ms())
    }

    /// [`Self::holder_bytes`] granted at `acquired_at_unix_ms`.
    fn holder_bytes_at(&self, quota_place: Option<u32>, acquired_at_unix_ms: i64) -> Vec<u8> {
        encode(&self.holder_record(quota_place, acquired_at_unix_ms))
    }

    fn holder_record(&self, quota_place: Option<u32>, acquired_at_unix_ms: i64) -> HolderRecord {
        HolderRecord {
            identity: self.identity.clone(),
            session: self.session,
            class: self.class.clone(),
            acquired_at_unix_ms,
            annotations: self.annotations.clone(),
            instance: self.instance.clone(),
            bound: self.bound.clone(),
            quota_place,
            downgraded_from: None,
        }
    }

    /// The record of the shared hold a downgrade of the exclusive hold at
    /// `from` (its revision) makes: granted at the exclusive hold's time
    /// (`acquired_at_unix_ms`, `maxHoldSeconds` is not restarted), and
    /// naming `from`, so a repeat of that downgrade finds it.
    fn downgraded_bytes(&self, acquired_at_unix_ms: Option<i64>, from: i64) -> Vec<u8> {
        let mut record = self.holder_record(None, acquired_at_unix_ms.unwrap_or_else(now_unix_ms));
        record.downgraded_from = Some(from);
        encode(&record)
    }
}

/// Whether a hold of `holder_identity`, granted to `holder_instance` under
/// `holder_session`, makes `req` a leak (issue 30): the same identity AND
/// the same named client instance under another session, i.e. the process
/// that holds the key asks for it again under a new session. Replicas of
/// one workload share a SPIFFE ID and differ in instance: for them it is
/// contention. An unnamed instance (an older client) is never a leak, so
/// no deployment of replicas is refused because its clients are old.
pub fn is_leak(
    holder_identity: &str,
    holder_instance: &str,
    holder_session: i64,
    req: &GrantRequest,
) -> bool {
    holder_identity == req.identity
        && holder_session != req.session
        && !req.instance.is_empty()
        && holder_instance == req.instance
}

/// Who holds a key now.
#[derive(Debug, Clone)]
pub struct HolderView {
    pub record: HolderRecord,
    pub revision: i64,
    pub lease: i64,
}

/// How a release ended.
#[derive(Debug)]
pub struct Released {
    /// The key went to the next waiter in the same transaction.
    pub handed_over: bool,
    /// The record of the hold that ended, when the log returned it.
    pub previous: Option<HolderRecord>,
}

/// How an Acquire was answered.
#[derive(Debug)]
pub struct Acquired {
    pub grant: Grant,
    /// It queued before it was granted.
    pub waited: bool,
}

/// Knobs of a table.
#[derive(Debug, Clone)]
pub struct TableOptions {
    /// Poll period for waiters whose watch is lost (jittered ±50%).
    pub poll: Duration,
    /// Waiting calls one identity may have queued here, over all keys.
    pub max_waiters_per_identity: u32,
    /// Seeds the poll jitter (a simulation passes its own, for replay).
    pub seed: u64,
    /// Most grants and releases sent to the log as one transaction (the
    /// log may allow fewer; 1: no batching).
    pub batch_limit: usize,
    /// Batches in flight at once; members arriving meanwhile wait for the
    /// next.
    pub batches_in_flight: usize,
    /// OR'ed into every session id this table draws (0, or
    /// [`sessions::COORD_SESSION_BIT`] for the coord tier's table when the
    /// tiers are split).
    pub session_tag: i64,
    /// The shard map version this arbiter routes by (0: it follows no map),
    /// shared with whatever follows the map. The table grants nothing on a
    /// cluster fenced at a newer version ([`ArbiterError::ShardMapAhead`]).
    pub map_version: MapVersion,
}

/// The shard map version an arbiter routes by (ADR-09), shared between the
/// task that follows the map and the tables that check it before every
/// grant. Cheap to clone: clones share one value. The default is 0, the
/// version of a cluster never sharded.
#[derive(Debug, Clone, Default)]
pub struct MapVersion(Arc<AtomicU64>);

impl MapVersion {
    pub fn new(version: u64) -> Self {
        Self(Arc::new(AtomicU64::new(version)))
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Routes by `version` from now on: the next grant checks it.
    pub fn set(&self, version: u64) {
        self.0.store(version, Ordering::Release);
    }
}

impl Default for TableOptions {
    fn default() -> Self {
        Self {
            poll: Duration::from_secs(1),
            max_waiters_per_identity: DEFAULT_MAX_WAITERS_PER_IDENTITY,
            seed: fastrand::u64(..),
            batch_limit: DEFAULT_BATCH_LIMIT,
            batches_in_flight: DEFAULT_BATCHES_IN_FLIGHT,
            session_tag: 0,
            map_version: MapVersion::default(),
        }
    }
}

/// One grant attempt, classified.
#[derive(Debug)]
enum Attempt {
    Granted(Grant),
    /// The key is already held by the requesting session: its existing grant
    /// (a retry, or a new call of the same session). It must be claimed
    /// before it reaches a caller.
    Reused(Grant),
    /// Held by another session; watch from `watch_from` so nothing between
    /// the failed transaction and the watch is missed.
    Held {
        watch_from: i64,
    },
    /// Held shared by other sessions, and asked exclusively: watch the
    /// shared holds ([`crate::records::readers_of`]) from `watch_from`.
    Readers {
        watch_from: i64,
    },
    /// Asked shared, and a writer waits for the lock's shared holds to end
    /// (its intent, on any arbiter): watch the lock's intents from
    /// `watch_from`.
    Intent {
        watch_from: i64,
    },
    /// Free, but a durable waiter was queued first. Watch as for `Held`.
    Behind {
        watch_from: i64,
    },
    /// A durable waiter's own record is gone (its caller's session ended,
    /// or another arbiter took it for stale): it must queue again.
    Unqueued,
    /// The gate kept the key from this session as the grant was about to
    /// go to the log (a memory grant made a moment before): nothing was
    /// sent. Queue and poll, as for a gated key.
    Gated,
}

/// How much of a wait's budget (at most a quarter) is kept for a grant
/// transaction already on its way when the wait ends, to land (one etcd
/// round trip, usually a few milliseconds): its grant is then the answer,
/// within the budget.
const SETTLE: Duration = Duration::from_millis(30);

/// The part of `budget` kept for settling ([`SETTLE`]).
fn settle_time(budget: Duration) -> Duration {
    SETTLE.min(budget / 4)
}

/// Who asks in a grant attempt: the caller itself (its call is running),
/// or a queue's driver for a waiter — whose caller may have gone (its wait
/// timed out, or the call was cancelled) while the attempt was on its way,
/// and whose session may since hold the key through another call. Only the
/// caller itself may change a hold its session has (a downgrade): a queue's
/// attempt that finds one waits for it to end like any other waiter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Asker {
    Caller,
    Queue,
}

/// Where a call goes after an attempt.
enum Next {
    /// Deliver (a fresh grant, or a session's existing grant this call now
    /// holds a claim on).
    Deliver(Grant),
    /// Queue, watching the key from this revision when known.
    Queue(Option<i64>),
}

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// Still held by the session, and now claimed: deliver it.
    Claimed,
    /// Gone since it was read (released, expired, or released as an orphan
    /// first): try again.
    Gone,
}

/// Keys the table must not grant to a request's session for now, whatever
/// the log says: a live memory grant made during a quorum loss
/// ([`crate::quorum_loss`]) keeps its key from every other session, and the
/// log knows nothing of it. Checked before every attempt and hand-over.
pub trait KeyGate: Send + Sync {
    /// Whether `req.key` is kept from `req.session` now.
    fn blocked(&self, req: &GrantRequest) -> bool;
}

/// What the policies say of a class now: a semaphore's permits (a waiter
/// queued before a reload is granted by the new number, not the one it
/// came with) and a class's `maxHoldSeconds` (`table/max_hold.rs`).
pub trait ClassPermits: Send + Sync {
    /// `class`'s permits now; `None` if it is not (or no longer) a
    /// semaphore class (the waiter's own number then stands).
    fn permits(&self, class: &str) -> Option<u32>;
    /// `class`'s `maxHoldSeconds` now, if it sets one.
    fn max_hold(&self, _class: &str) -> Option<Duration> {
        None
    }
    /// Whether any class sets `maxHoldSeconds` now.
    fn any_max_hold(&self) -> bool {
        false
    }
}

pub struct LockTable {
    log: Arc<dyn LockLog>,
    gate: parking_lot::RwLock<Option<Arc<dyn KeyGate>>>,
    permits: parking_lot::RwLock<Option<Arc<dyn ClassPermits>>>,
    seal: Seal,
    book: Mutex<Book>,
    batches: Batches,
    next_id: AtomicU64,
    options: TableOptions,
    jitter: Mutex<fastrand::Rng>,
    tasks: TaskTracker,
    stop: CancellationToken,
    /// Cancelled when the arbiter starts stopping: waiting calls end at
    /// once (UNAVAILABLE, retry) so the server can drain its calls.
    waits_end: CancellationToken,
    durable: durable::DurableCounters,
    /// Durable queue heads seen, per key, for the stale-record rule.
    stale_heads: Mutex<std::collections::HashMap<String, durable::Seen>>,
    /// Grants and hand-overs of each key on their way to the log, from
    /// just before their gate check until their answer: a memory grant of
    /// the key waits for them ([`LockTable::writing`]).
    writes: Mutex<std::collections::HashMap<String, u32>>,
    /// The highest revision a grant or hand-over of this table committed at.
    granted_through: std::sync::atomic::AtomicI64,
    /// Holds a `maxHoldSeconds` timer is set for (`table/max_hold.rs`).
    max_holds: max_hold::Timed,
    /// The `maxHoldSeconds` sweep has started.
    sweeping: std::sync::atomic::AtomicBool,
}

/// A grant or hand-over of one key on its way to the log; counted down on
/// drop.
pub(crate) struct Writing<'t> {
    table: &'t LockTable,
    key: String,
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        let mut writes = self.table.writes.lock();
        if let Some(n) = writes.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                writes.remove(&self.key);
            }
        }
    }
}

impl LockTable {
    /// A table whose state directory is its only witness.
    pub fn new(
        log: Arc<dyn LockLog>,
        guard: Arc<EpochGuard>,
        high_water: Arc<HighWater>,
        options: TableOptions,
    ) -> Arc<Self> {
        Self::witnessed(log, guard, high_water, None, options)
    }

    /// A table with a witness outside the lock log ([`crate::witness`]).
    pub fn witnessed(
        log: Arc<dyn LockLog>,
        guard: Arc<EpochGuard>,
        high_water: Arc<HighWater>,
        witness: Option<Arc<dyn Witness>>,
        options: TableOptions,
    ) -> Arc<Self> {
        Arc::new(Self {
            seal: Seal::new(
                log.clone(),
                guard,
                high_water,
                witness,
                options.map_version.clone(),
            ),
            log,
            gate: parking_lot::RwLock::new(None),
            permits: parking_lot::RwLock::new(None),
            book: Mutex::new(Book::default()),
            batches: Batches::default(),
            next_id: AtomicU64::new(1),
            jitter: Mutex::new(fastrand::Rng::with_seed(options.seed)),
            options,
            tasks: TaskTracker::new(),
            stop: CancellationToken::new(),
            waits_end: CancellationToken::new(),
            durable: Default::default(),
            stale_heads: Mutex::new(std::collections::HashMap::new()),
            writes: Mutex::new(std::collections::HashMap::new()),
            granted_through: std::sync::atomic::AtomicI64::new(0),
            max_holds: Default::default(),
            sweeping: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn seal(&self) -> &Seal {
        &self.seal
    }

    /// Installs the [`KeyGate`] consulted before every grant.
    pub fn set_gate(&self, gate: Arc<dyn KeyGate>) {
        *self.gate.write() = Some(gate);
    }

    /// Installs where semaphore classes' current permits (and classes'
    /// `maxHoldSeconds`) are read, and starts the `maxHoldSeconds` sweep.
    pub fn set_permits_source(self: &Arc<Self>, source: Arc<dyn ClassPermits>) {
        *self.permits.write() = Some(source);
        self.start_max_hold_sweep();
    }

    /// `class`'s `maxHoldSeconds` now, if it sets one.
    pub fn max_hold_of(&self, class: &str) -> Option<Duration> {
        self.permits.read().as_ref().and_then(|p| p.max_hold(class))
    }

    fn any_max_hold(&self) -> bool {
        self.permits
            .read()
            .as_ref()
            .is_some_and(|p| p.any_max_hold())
    }

    /// `class`'s permits now, if a source is installed and says.
    fn permits_now(&self, class: &str) -> Option<u32> {
        self.permits.read().as_ref().and_then(|p| p.permits(class))
    }

    /// Whether the gate keeps `req.key` from `req.session` now.
    fn gated(&self, req: &GrantRequest) -> bool {
        self.gate.read().as_ref().is_some_and(|g| g.blocked(req))
    }

    /// Whether a grant or hand-over of `key` is on its way to the log from
    /// this table: its outcome is not known yet, so a memory grant of the
    /// key must wait (the log may be about to hold it for another session).
    /// A memory grant is recorded (and gates the key) before it asks this,
    /// and a grant registers here before it checks the gate, so of two
    /// that meet, at least one sees the other.
    pub fn writing(&self, key: &str) -> bool {
        self.writes.lock().contains_key(key)
    }

    /// The highest revision a grant or hand-over of this table committed
    /// at: a hold count that has not seen the log up to it may miss a hold
    /// this arbiter granted (a watch on a member cut off from the majority
    /// stops before the majority's last commits).
    pub fn granted_through(&self) -> i64 {
        self.granted_through
            .load(std::sync::atomic::Ordering::Acquire)
    }

    pub(crate) fn granted_at(&self, revision: i64) {
        self.granted_through
            .fetch_max(revision, std::sync::atomic::Ordering::AcqRel);
    }

    /// Registers a grant or hand-over of `key` on its way to the log.
    pub(crate) fn write_on(&self, key: &str) -> Writing<'_> {
        *self.writes.lock().entry(key.to_string()).or_insert(0) += 1;
        Writing {
            table: self,
            key: key.to_string(),
        }
    }

    /// The head of `key`'s queue a release may hand the key to: not while
    /// the gate keeps the key from it (it then stays queued; its driver
    /// polls), nor when its class has a quota (a hand-over takes no quota
    /// place: the release kicks its driver, whose grant transaction takes
    /// one), nor to a semaphore's waiter (it takes a slot, not the key),
    /// nor to a reader (its own key; the readers behind it go with it).
    fn ungated_head(&self, key: &str) -> Option<Head> {
        self.head(key).filter(|h| {
            !self.gated(&h.req) && h.req.quota.is_none() && h.req.permits.is_none() && !h.req.shared
        })
    }

    pub fn log(&self) -> &Arc<dyn LockLog> {
        &self.log
    }

    /// Reads (creating on first start) the epoch record.
    pub async fn start(&self) -> Result<EpochState, ArbiterError> {
        self.seal.load_epoch().await
    }

    /// Stops every driver, orphan release and the sweeper, answers every
    /// waiter UNAVAILABLE, and returns once they have all finished.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        self.end_waits();
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// Answers every waiting call UNAVAILABLE now and refuses new ones (the
    /// arbiter is stopping), so a graceful stop does not wait out their
    /// budgets. Durable waiters keep their records: a retry on the same
    /// session keeps its place.
    pub fn end_waits(&self) {
        self.waits_end.cancel();
        let waiters = self.book.lock().drain();
        for w in waiters {
            if let Some(tx) = w.slot.lock().take() {
                let _ = tx.send(Err(ArbiterError::store("the arbiter is shutting down")));
            }
        }
    }

    pub fn waiting(&self, key: &str) -> usize {
        self.book
            .lock()
            .keys
            .get(key)
            .map_or(0, |q| q.waiters.len())
    }

    /// (keys with a queue, waiters over all keys), for the metrics.
    pub fn totals(&self) -> (usize, usize) {
        let book = self.book.lock();
        let queued = book.keys.values().filter(|q| !q.waiters.is_empty());
        queued.fold((0, 0), |(keys, n), q| (keys + 1, n + q.waiters.len()))
    }

    /// Grants `req` at once, or — with `wait` — queues it FIFO behind this
    /// key's other waiters for at most `wait`. Without `wait` a held key is
    /// `Held`. `max_waiters_per_key` is the class's queue bound.
    pub async fn acquire(
        self: &Arc<Self>,
        req: GrantRequest,
        wait: Option<Duration>,
        max_waiters_per_key: u32,
    ) -> Result<Acquired, ArbiterError> {
        // Waiters already queued here go first: a newcomer never barges.
        let next = if self.waiting(&req.key) > 0 {
            let held = match (req.permits, req.shared) {
                (Some(_), _) => self.permit_held(&req).await?.map(Some),
                (None, true) => self.shared_held(&req).await?,
                (None, false) => {
                    // Its own shared hold: refused now, not queued behind
                    // waiters that wait for it (the hostile review).
                    if self.holds_shared(&req).await? {
                        return Err(ArbiterError::UpgradeRefused { key: req.key });
                    }
                    self.already_held(&req).await?.map(Some)
                }
            };
            match held {
                Some(Some(grant)) => self.reuse(grant).await?,
                // its own exclusive hold, asked shared: downgraded now
                Some(None) => {
                    self.next_after(self.attempt(&req, Asker::Caller).await?)
                        .await?
                }
                None => Next::Queue(None),
            }
        } else if self.gated(&req) {
            Next::Queue(None)
        } else {
            self.next_after(self.attempt(&req, Asker::Caller).await?)
                .await?
        };
        let watch_from = match next {
            Next::Deliver(grant) => {
                return Ok(Acquired {
                    grant,
                    waited: false,
                });
            }
            Next::Queue(from) => from,
        };
        let Some(budget) = wait else {
            return Err(ArbiterError::Held { key: req.key });
        };
        let key = req.key.clone();
        let until = tokio::time::Instant::now() + budget;
        let mut ticket = self.enqueue(req, watch_from, max_waiters_per_key, until)?;
        // Waiting is not new work: the call's admission place goes back.
        crate::overload::parked();
        // The last moments of the budget are kept for a transaction on its
        // way when the wait ends, so the answer still beats the deadline.
        let settle = settle_time(budget);
        match tokio::time::timeout(budget - settle, ticket.wait()).await {
            Ok(reply) => reply.map(|delivery| Acquired {
                grant: delivery.grant,
                waited: true,
            }),
            Err(_) => {
                // No attempt starts for it any more; one on its way decides
                // if it lands within the call's last moments (the budget
                // ends ~50 ms before the caller's deadline), and its grant
                // is the answer.
                self.remove(&key, ticket.id);
                ticket.uncertain.settle(settle).await;
                if let Some(reply) = ticket.answered() {
                    return reply.map(|delivery| Acquired {
                        grant: delivery.grant,
                        waited: true,
                    });
                }
                // Dropping the ticket releases a grant that raced with this
                // (as an orphan). A grant transaction for this waiter that
                // failed without an answer, or is still on its way, may
                // commit without anyone hearing (the release gate caught a
                // WAIT_TIMEOUT beside such a hidden shared grant).
                Err(ticket.uncertain.timed_out(key))
            }
        }
    }

    /// Releases a hold of `identity`'s: its record must name the identity and
    /// `session`, on that session's lease, at the token's revision. Without a
    /// waiter queued here that is one transaction whose compares are the
    /// check (batched with others); with one, the hold is read and checked,
    /// and handed to the waiter in one transaction that compares it again.
    /// Another identity's hold is `NotHeld`, as if there were none.
    pub async fn release(
        self: &Arc<Self>,
        identity: &str,
        key: &str,
        session: i64,
        token: u64,
    ) -> Result<Released, ArbiterError> {
        let (epoch, revision) = token::unpack(token);
        let current = self.seal.guard().state().map(|s| s.epoch());
        // This arbiter served a later epoch: every hold of `epoch` ended at
        // that advance, even if the log now shows one again — restored to a
        // backup from before the advance, its epoch record with it (the
        // simulation, seed 47 of `durable-three-arbiters`: a release of a
        // hold so brought back was answered OK). Nothing is written: the
        // seal and the next advance clear what the restore brought back.
        let ended_with_its_epoch = self.seal.high_water().is_some_and(|m| m.epoch > epoch);
        if current != Some(epoch) || revision <= 0 || ended_with_its_epoch {
            // A token no hold of this epoch can have. The answer is the one
            // any wrong token gets: TOKEN_MISMATCH only for the caller's own
            // hold, NOT_HELD for anyone else's or none (no revision
            // matches -1), so the reason never tells whether someone else
            // holds the key.
            return match self.owned_hold(key, identity, session, -1).await {
                Ok(_) | Err(ArbiterError::TokenMismatch { .. }) => {
                    Err(ArbiterError::TokenMismatch {
                        key: key.to_string(),
                    })
                }
                Err(e) => Err(e),
            };
        }
        match self.ungated_head(key) {
            None => {
                if let Some(released) = self
                    .release_checked(identity, key, session, revision)
                    .await?
                {
                    self.free_quota_place(released.previous.as_ref(), revision);
                    self.kick(key);
                    return Ok(released);
                }
            }
            // The hot key's path: hand over without reading the hold first,
            // its ownership compared in the hand-over transaction itself. A
            // failed compare wrote nothing; the read-then-compare path below
            // then answers why (or hands over if only the record's bytes
            // were unexpected).
            Some(head) => {
                if let Some(owner) = grants::owner_prefix(identity, session) {
                    let owned = ReleaseTxn {
                        key: key.to_string(),
                        session,
                        revision,
                        owner,
                    };
                    // On its way until delivered; dropped unfinished (an
                    // error, or this Release cancelled mid-way), the head's
                    // outcome is unknown.
                    let sending = head.sending();
                    let handed = self.hand_over(HandOverFrom::Owned(&owned), &head.req).await;
                    match handed {
                        Ok(Some((grant, previous))) => {
                            self.free_quota_place(previous.as_ref(), revision);
                            self.deliver(&head, grant);
                            sending.done();
                            return Ok(Released {
                                handed_over: true,
                                previous,
                            });
                        }
                        Ok(None)
                        | Err(ArbiterError::SessionExpired { .. })
                        | Err(ArbiterError::ShardMapAhead { .. }) => sending.done(),
                        // May have committed: as below, the outcome is unknown
                        // (for the head waiter too: `sending` drops unfinished).
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        let held = self.owned_hold(key, identity, session, revision).await?;
        if let Some(head) = self.ungated_head(key) {
            let sending = head.sending();
            let handed = self.hand_over(HandOverFrom::Exact(&held), &head.req).await;
            match handed {
                Ok(Some((grant, previous))) => {
                    self.free_quota_place(previous.as_ref(), revision);
                    self.deliver(&head, grant);
                    sending.done();
                    return Ok(Released {
                        handed_over: true,
                        previous,
                    });
                }
                // A compare failed, the next waiter's session is gone, or
                // this arbiter may not grant on the fenced cluster (refused
                // before anything was sent): nothing was written, so a plain
                // release answers why. (Releasing is always safe; a fence
                // only stops grants.)
                Ok(None)
                | Err(ArbiterError::SessionExpired { .. })
                | Err(ArbiterError::ShardMapAhead { .. }) => sending.done(),
                // Anything else may have committed (an answer lost after the
                // commit): a plain release would then find the hold handed
                // over and answer NOT_HELD for a release that happened. The
                // outcome is unknown, and the caller hears exactly that. (The
                // head waiter, if the hand-over did commit, gets the key from
                // its driver, which finds its session already holding it; if
                // its wait ends first, it hears that the outcome is unknown:
                // `sending` drops unfinished.)
                Err(e) => return Err(e),
            }
        }
        let previous = self.release_owned(&held).await?;
        self.free_quota_place(previous.as_ref(), revision);
        self.kick(key);
        Ok(Released {
            handed_over: false,
            previous,
        })
    }

    /// Ends the hold a force-release names, whoever holds it, if it is
    /// still that hold ([`ForceEndTxn`]); the key's waiters here are woken
    /// (others' arbiters see the delete in their watch). The header is
    /// judged, but a sealed log still answers: ending a hold hands nothing
    /// out.
    /// Returns the outcome with the revision it was read or written at.
    pub async fn force_end(&self, txn: ForceEndTxn<'_>) -> Result<(ForceEnded, i64), ArbiterError> {
        let (ended, header) = self.seal.judged(self.log.force_end(txn)).await?;
        if ended == ForceEnded::Ended {
            self.kick(txn.key);
        }
        Ok((ended, header.revision))
    }

    /// The hold on `key`, if any.
    pub async fn holder(&self, key: &str) -> Result<Option<HolderView>, ArbiterError> {
        let (kv, _) = self.seal.checked(self.log.holder(key)).await?;
        Ok(kv.and_then(holder_view))
    }

    /// Whether any key under `prefix` (whole segments: pass `ns/`) is held.
    pub async fn holds_any_under(&self, prefix: &str) -> Result<bool, ArbiterError> {
        let (holds, _) = self.seal.checked(self.log.holders_under(prefix)).await?;
        Ok(!holds.is_empty())
    }

    /// How many keys grant subject `identity` holds in `class`, over every
    /// arbiter: the holds under each of `prefixes` (the subject's grants; it
    /// can hold nothing elsewhere) whose record counts against it (a
    /// pattern's holds are every per-pod identity's under it: issue 30).
    /// Exact as of the reads, not part of any grant.
    pub async fn count_holds_of(
        &self,
        identity: &str,
        class: &str,
        prefixes: &[&str],
    ) -> Result<u32, ArbiterError> {
        let mut seen = std::collections::BTreeSet::new();
        let mut count = 0u32;
        for prefix in prefixes {
            let (holds, _) = self.seal.checked(self.log.holders_under(prefix)).await?;
            for (key, kv) in holds {
                if !seen.insert(key) {
                    continue;
                }
                if let Some(record) = decode::<HolderRecord>(&kv.value)
                    && record.bounded_as() == identity
                    && record.class == class
                {
                    count = count.saturating_add(1);
                }
            }
        }
        Ok(count)
    }

    // --- queues and delivery ---

    fn head(&self, key: &str) -> Option<Head> {
        self.book.lock().head(key)
    }

    /// Joins the tail of `req.key`'s queue, starting the key's driver if the
    /// queue was empty. Refused when the key's queue holds `limit` waiters,
    /// the caller's identity has its share of them, or its bound of waiters
    /// queued here (`Book::admit`).
    fn enqueue(
        self: &Arc<Self>,
        req: GrantRequest,
        watch_from: Option<i64>,
        limit: u32,
        until: tokio::time::Instant,
    ) -> Result<Ticket, ArbiterError> {
        if self.stop.is_cancelled() || self.waits_end.is_cancelled() {
            return Err(ArbiterError::store("the arbiter is shutting down"));
        }
        let (tx, rx) = oneshot::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let key = req.key.clone();
        let mut book = self.book.lock();
        if self.waits_end.is_cancelled() {
            // Checked under the book's lock: `end_waits` drains after it
            // cancels, so no waiter joins after the drain.
            return Err(ArbiterError::store("the arbiter is shutting down"));
        }
        // Counted per grant subject (issue 30): per-pod identities under
        // one pattern share one set of waiter places.
        book.admit(
            req.bounded_as(),
            &key,
            self.options.max_waiters_per_identity,
            limit,
        )?;
        let queued = book.keys.get(&key).map(|q| q.waiters.len());
        let uncertain = Arc::new(queues::Unknown::default());
        let intent = intent::Intent::new(until);
        let session = req.session;
        let kick = book.join(Waiter {
            id,
            since: std::time::Instant::now(),
            req,
            slot: Arc::new(Mutex::new(Some(tx))),
            uncertain: uncertain.clone(),
            intent: intent.clone(),
        });
        drop(book);
        if queued.is_none() {
            self.tasks.spawn(driver::drive(
                self.clone(),
                key.clone(),
                kick,
                watch_from,
                self.stop.clone(),
            ));
        }
        Ok(Ticket {
            table: self.clone(),
            key,
            id,
            session,
            rx: Some(rx),
            uncertain,
            intent,
        })
    }

    /// Wakes the key's driver (a local release, or a cancelled head); a
    /// slot's key wakes its semaphore's.
    fn kick(&self, key: &str) {
        if let Some(q) = self.book.lock().keys.get(crate::records::named_key(key)) {
            q.kick.notify_one();
        }
    }

    fn remove(&self, key: &str, id: u64) {
        self.book.lock().remove(key, id);
    }

    /// Removes the key's queue if it is empty; returns the head otherwise.
    fn head_or_retire(&self, key: &str) -> Option<Head> {
        let mut book = self.book.lock();
        match book.head(key) {
            Some(head) => Some(head),
            None => {
                book.keys.remove(key);
                None
            }
        }
    }

    /// Delivers a grant made for the waiter in `head` unless another path
    /// already answered it; a grant its caller no longer takes is released
    /// as an orphan.
    fn deliver(self: &Arc<Self>, head: &Head, grant: Grant) {
        self.answer(head, Ok(Delivery { grant, fresh: true }));
    }

    /// Answers the waiter in `head` (a refusal, or its session's existing
    /// grant, claimed for it) unless another path already did.
    fn answer(self: &Arc<Self>, head: &Head, reply: Reply) {
        let Some(tx) = take(&head.slot) else {
            return; // answered already (e.g. by a hand-over): nothing to do
        };
        self.remove(&head.req.key, head.id);
        if let Err(Ok(delivery)) = tx.send(reply) {
            // Its caller went away. A grant made for it goes; a claimed
            // one was its session's before this call and stays.
            if delivery.fresh {
                self.release_orphan(delivery.grant);
            }
        }
    }

    /// A grant made for a caller that went away: release it now rather than
    /// leave a hold on a session that may live for a long time — unless a
    /// call of the same session has claimed it meanwhile, which the release
    /// transaction compares.
    fn release_orphan(self: &Arc<Self>, grant: Grant) {
        let table = self.clone();
        self.tasks.spawn(async move {
            debug!(key = %grant.key, "releasing a grant whose caller went away");
            let released = table
                .seal
                .checked(table.log.release_orphan(&grant.key, grant.session, grant.revision))
                .await;
            match released {
                Ok((true, _)) => {}
                Ok((false, _)) => {
                    debug!(key = %grant.key, "the abandoned grant was claimed by its session, or had ended");
                }
                Err(e) => {
                    warn!(key = %grant.key, error = %e, "could not release an abandoned grant; it ends with its session");
                }
            }
            table.kick(&grant.key);
        });
    }

    /// A poll period with ±50% jitter, from the table's seeded generator.
    fn jittered(&self, base: Duration) -> Duration {
        let ms = u64::try_from(base.as_millis()).unwrap_or(1000).max(1);
        let extra = self.jitter.lock().u64(0..=ms);
        Duration::from_millis(ms / 2 + extra)
    }
}

fn take(slot: &Slot) -> Option<oneshot::Sender<Reply>> {
    slot.lock().take()
}

fn holder_view(kv: Kv) -> Option<HolderView> {
    decode(&kv.value).map(|record| HolderView {
        record,
        revision: kv.mod_revision,
        lease: kv.lease,
    })
}

/// A queued Acquire. Dropping it (cancelled call, timeout) leaves the queue
/// at once; a grant that raced with the drop is released.
struct Ticket {
    table: Arc<LockTable>,
    key: String,
    id: u64,
    session: i64,
    rx: Option<oneshot::Receiver<Reply>>,
    /// See [`queues::Waiter::uncertain`].
    uncertain: Arc<queues::Unknown>,
    /// See [`queues::Waiter::intent`].
    intent: Arc<intent::Intent>,
}

impl Ticket {
    /// The reply already delivered, if any (taken: the ticket's drop then
    /// has nothing to release).
    fn answered(&mut self) -> Option<Reply> {
        let reply = self.rx.as_mut()?.try_recv().ok()?;
        self.rx = None;
        Some(reply)
    }

    async fn wait(&mut self) -> Reply {
        match self.rx.as_mut() {
            Some(rx) => {
                let reply = rx.await.unwrap_or_else(|_| {
                    Err(ArbiterError::store(
                        "the waiter was dropped (arbiter stopping)",
                    ))
                });
                self.rx = None;
                reply
            }
            None => Err(ArbiterError::internal("waited twice")),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.table.remove(&self.key, self.id);
        self.table.end_intent(&self.key, self.session, &self.intent);
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if let Ok(Ok(delivery)) = rx.try_recv()
                && delivery.fresh
            {
                self.table.release_orphan(delivery.grant);
            }
        }
    }
}

impl LockTable {
    /// Makes the log's current revision this arbiter's durable mark (and the
    /// witness's), so a restart with the same state directory remembers the
    /// log even if this arbiter never granted.
    pub async fn mark_start(&self, state: &EpochState) -> Result<(), ArbiterError> {
        let (_, header) = self.seal.checked(self.log.count_holds()).await?;
        self.seal.make_durable(state, header.revision).await
    }

    /// The cluster id the log reports now (a count-only read).
    pub async fn current_cluster_id(&self) -> Result<u64, ArbiterError> {
        Ok(self.log.count_holds().await?.header.cluster_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_of_a_map_version_share_it() {
        let version = MapVersion::default();
        assert_eq!(version.get(), 0, "a cluster never sharded is at 0");
        let options = TableOptions {
            map_version: version.clone(),
            ..TableOptions::default()
        };
        version.set(4);
        assert_eq!(options.map_version.get(), 4);
        assert_eq!(options.clone().map_version.get(), 4);
        assert_eq!(MapVersion::new(7).get(), 7);
    }
}
