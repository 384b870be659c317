//! What the grant protocol needs from the log, and nothing more.
//!
//! [`LockLog`] is the seam between the protocol ([`crate::table::LockTable`],
//! which owns queues, claims, hand-over, orphan releases and the seal) and
//! the store that makes grants durable. Two implementations:
//! [`etcd::EtcdLog`], the real one, and `latchkey_sim::MemLog` (crate `sim/`), an in-memory log
//! with etcd's semantics (one revision counter, leases on a controllable
//! clock, watches, compare failures) and injectable faults, which the
//! deterministic simulation drives. One contract suite
//! (`tests/src/log_contract.rs`) holds both to the same behaviour, the etcd
//! one on a real etcd.
//!
//! Every answer carries the [`Header`] it came with: the table checks it
//! (cluster id and revision against the epoch record and the high-water
//! mark) before it uses anything in the answer. A log never judges a header.
//!
//! Keys are lock keys (`ledger/inv-1`) and session ids; where they live in the
//! store is the implementation's business.

pub mod etcd;
pub mod fallback;

use std::time::Instant;

use async_trait::async_trait;

/// Which cluster answered, at which revision (etcd's response header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub cluster_id: u64,
    pub revision: i64,
}

/// A value read from the log, with the header of the read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer<T> {
    pub header: Header,
    pub value: T,
}

impl<T> Answer<T> {
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Answer<U> {
        Answer {
            header: self.header,
            value: f(self.value),
        }
    }
}

/// A stored key's value and its metadata, as etcd reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    /// The lease the key is attached to (0: none).
    pub lease: i64,
}

/// A session's shadow marks on the lock cluster (ADR-09) and the
/// revisions that say whether a restore may have taken some back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShadowMarks {
    /// The shards marked, in name order.
    pub shards: Vec<String>,
    /// Since when the marks are known to be complete: the newer of the
    /// session record's creation and the marks' last vouch (0: neither).
    pub since: i64,
    /// The epoch record's last write (0: none). Every restore of the lock
    /// cluster is followed by an epoch advance, which writes it at a
    /// revision above everything the restore put back.
    pub epoch_at: i64,
    /// The lock cluster is sealed (an arbiter noticed a restore, or
    /// another reason): until the advance, marks are not to be trusted.
    pub sealed: bool,
}

impl ShadowMarks {
    /// Whether the marks name every shard the session has a shadow on:
    /// the session opened, or its marks were vouched for, after the last
    /// epoch advance, and no seal waits for the next one. A session the
    /// lock cluster got back from a snapshot may have marked shards after
    /// the snapshot was taken.
    pub fn complete(&self) -> bool {
        !self.sealed && self.since > self.epoch_at
    }
}

/// The epoch record and the seal record, read together.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Records {
    pub epoch: Option<Kv>,
    pub seal: Option<Kv>,
    /// What the coord cluster was last seen to witness ([`crate::records::CoordSeenRecord`]).
    pub coord_seen: Option<Kv>,
    /// The shard-map fence ([`crate::records::encode_map_fence`]); absent
    /// on a cluster never sharded (version 0).
    pub map_fence: Option<Kv>,
}

/// One grant transaction: put the holder record of `key` on `session`'s lease
/// if the key is absent, the epoch record's bytes are `epoch`, there is no
/// seal, the shard-map fence is at `fence_at`, `session`'s record is
/// `session_record` and the key's durable queue agrees (`queue`).
#[derive(Debug, Clone)]
pub struct GrantTxn<'a> {
    pub key: &'a str,
    pub session: i64,
    pub holder_record: Vec<u8>,
    pub epoch: &'a [u8],
    /// The shard-map fence's mod revision as the grantor last read it (0:
    /// absent; a missing key compares as mod revision 0). A fence raised
    /// since fails the grant.
    pub fence_at: i64,
    pub session_record: &'a [u8],
    pub queue: QueueTurn,
    /// The class's per-subject quota place the grant takes in the same
    /// transaction (`maxHoldsPerSubject`); `None` for a class without one.
    /// Boxed: most grants have none.
    pub quota: Option<Box<QuotaTake>>,
}

/// Keys one [`HoldLog::holders_of`] request reads (one etcd transaction of
/// gets, well inside `--max-txn-ops`).
pub const HOLDERS_OF_AT_ONCE: usize = 64;

/// A place of a class's per-subject quota, taken by a grant in its own
/// transaction: the place's record is put on the session's lease (as the
/// holder record is, at the same revision) only if the place is as the
/// grantor read it. A burst of N grants for one subject can then never
/// take more places than there are, whichever arbiters run them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaTake {
    pub class: String,
    /// The grant subject the quota counts ([`crate::table::GrantRequest::bounded_as`]).
    pub subject: String,
    pub index: u32,
    /// The place's record (`QuotaPlaceRecord`).
    pub record: Vec<u8>,
    pub was: PlaceWas,
}

/// What a quota place was when the grantor read it; the grant compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlaceWas {
    /// Absent.
    Free,
    /// Written at `revision` for the hold on `key`, which has since ended or
    /// changed hands: the place is still at `revision` and the hold on
    /// `key` is not (absent, or at another revision; a place and its hold
    /// are written at one revision, so a hold still at it is the same hold).
    Stale { revision: i64, key: String },
}

/// A durable waiter's record as [`DurableQueueLog::enqueue`] left it: its
/// place (create revision) and its last write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queued {
    pub created: i64,
    pub modified: i64,
}

/// A grant's place in its key's durable queue (ADR-14: waiter records
/// `q/<key>//<session>` on the waiters' session leases, first come first
/// served by create revision).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueTurn {
    /// No durable waiter is queued on the key. Every grant but a durable
    /// waiter's own, and every hand-over, defers to a non-empty queue, so a
    /// try-lock or an in-memory waiter never overtakes a durable one.
    #[default]
    Empty,
    /// The session's own waiter record, created at `created`, is there and
    /// no record of the key is older; the grant deletes it.
    Mine { created: i64 },
}

/// How a grant transaction ended.
// Large only on a refusal, which is read once and dropped: no box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Granted {
    /// Committed at the answer's header revision.
    Yes,
    /// A compare failed; what the failure branch read, in the same
    /// transaction.
    No {
        holder: Option<Kv>,
        epoch: Option<Vec<u8>>,
        sealed: bool,
        session: Option<Vec<u8>>,
        /// The key's oldest durable waiter record, if any.
        queue_head: Option<Kv>,
        /// The shard-map fence's mod revision (0: absent).
        fence_at: i64,
        /// The key is held as the other kind: a lock's key has a held
        /// semaphore slot under it, or a slot's semaphore name is held as a
        /// lock ([`crate::records::split_slot`]). A key is one kind at a
        /// time, and every grant compares it.
        other_kind: bool,
        /// The key is held in the other mode: for a shared hold's grant,
        /// the lock's exclusive hold; for an exclusive grant, one of its
        /// shared holds ([`crate::records::reader_key`]). A writer is
        /// never beside a reader, and every grant compares it.
        other_mode: Option<Kv>,
        /// For a shared hold's grant: the oldest writer's intent on the
        /// lock ([`DurableQueueLog::put_intent`]), which every shared grant
        /// compares absent; `None` for other grants.
        intent: Option<Kv>,
    },
}

/// A downgrade: the caller's exclusive hold `held` becomes its session's
/// shared hold of the same name in one transaction (the exclusive record
/// and its claims deleted, the shared record put on the session's lease),
/// if `held` is still exactly that hold and the epoch record's bytes are
/// `epoch`, there is no seal, the shard-map fence is at `fence_at` and the
/// session record is `session_record` (as in a grant). No moment passes
/// in which the name is free, so no writer can come between.
#[derive(Debug, Clone)]
pub struct DowngradeTxn<'a> {
    pub held: &'a HeldAt,
    /// The shared hold's lock key ([`crate::records::reader_key`]).
    pub reader_key: &'a str,
    pub holder_record: Vec<u8>,
    pub epoch: &'a [u8],
    pub fence_at: i64,
    pub session_record: &'a [u8],
}

/// A hold found to be the caller's: the exact record bytes, lease and
/// revision that a release or hand-over compares again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldAt {
    pub key: String,
    pub session: i64,
    pub revision: i64,
    pub value: Vec<u8>,
}

/// How a claim ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// Claimed by this call: the claim record was written (a new revision).
    Now,
    /// Claimed before (a retry of a retry): nothing written.
    Already,
    /// The hold is not (or no longer) that one: nothing written.
    Gone,
}

/// A hand-over: put `next`'s holder record on `next`'s lease over `from`
/// (compared as in a release), if the epoch record's bytes are `epoch`,
/// there is no seal, the shard-map fence is at `fence_at` (as in a grant)
/// and `next`'s session record is `next_session_record`.
#[derive(Debug, Clone)]
pub struct HandOverTxn<'a> {
    pub from: HandOverFrom<'a>,
    pub next_session: i64,
    pub holder_record: Vec<u8>,
    pub epoch: &'a [u8],
    pub fence_at: i64,
    pub next_session_record: &'a [u8],
}

/// The hold a hand-over replaces, and how it is compared.
#[derive(Debug, Clone, Copy)]
pub enum HandOverFrom<'a> {
    /// Exactly this record, found and checked before (bytes, lease,
    /// revision), as [`HoldLog::release`] compares it.
    Exact(&'a HeldAt),
    /// The caller's hold as [`HoldLog::release_if_owned`] compares it: on
    /// the session's lease at the token's revision, its record beginning
    /// with the owner's bytes. No read before it; a failed compare does not
    /// say which (the table then reads the hold and answers why).
    Owned(&'a ReleaseTxn),
}

impl HandOverFrom<'_> {
    /// The key handed over.
    pub fn key(&self) -> &str {
        match self {
            Self::Exact(held) => &held.key,
            Self::Owned(txn) => &txn.key,
        }
    }
}

/// A release that checks ownership in its own transaction: deletes the hold
/// on `key`, with its claims, if it is on lease `session` at `revision` and
/// its record begins with `owner` (the record's identity and session as the
/// table encodes them; records have a fixed field order, so this is the
/// record's own say of whose hold it is). No read before it: the compares
/// are the check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseTxn {
    pub key: String,
    pub session: i64,
    pub revision: i64,
    pub owner: Vec<u8>,
}

/// How a [`ReleaseTxn`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleasedIf {
    /// Deleted: the record it had.
    Yes(Vec<u8>),
    /// A compare failed; the hold as the failure branch read it, in the
    /// same transaction, so the caller learns why.
    No { holder: Option<Kv> },
}

/// A forced end of one hold, approved by two operators (force-release,
/// ADR-19): the hold on `key` is deleted with its claims only if it is
/// still the one the request named — on lease `lease` at mod revision
/// `revision` (a hold granted again since, even to the same session, has
/// another revision, so a hand-over is never ended by a request made for
/// the hold before it) — and only if the approval's own records agree, all
/// in one transaction. Nothing about the epoch, a seal or the shard-map
/// fence is compared: ending a hold hands nothing out.
#[derive(Debug, Clone, Copy)]
pub struct ForceEndTxn<'a> {
    pub key: &'a str,
    pub lease: i64,
    pub revision: i64,
    pub records: &'a ForceRecords,
}

/// The approval's own records, written in the same transaction as a
/// [`ForceEndTxn`]. Names are below the log's prefix, as
/// `latchkey_records::keys` spells them (`sys/force/<id>`, …).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForceRecords {
    /// Records that must still be at these mod revisions (the pending
    /// request: approved or expired meanwhile, nothing happens).
    pub unchanged: Vec<(String, i64)>,
    /// Records put, together on one new lease of `ttl_seconds` (the force
    /// record, kept for the audit trail a while).
    pub put: Vec<(String, Vec<u8>)>,
    pub ttl_seconds: u32,
    /// Records deleted (the request and the places it took).
    pub delete: Vec<String>,
}

/// How a [`ForceEndTxn`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForceEnded {
    /// The hold and its claims are deleted, the records written.
    Ended,
    /// Nothing written: the hold is not the one named. `now` is the hold
    /// as the failed transaction read it (`None`: not held); for a term
    /// ([`ForceTermTxn`]), the leader record (`None`: vacant).
    HoldChanged { now: Option<Kv> },
    /// Nothing written: a record in [`ForceRecords::unchanged`] moved.
    RecordsChanged,
}

/// One member of a batch ([`HoldLog::batch`]).
#[derive(Debug, Clone)]
pub enum BatchOp<'a> {
    Grant(GrantTxn<'a>),
    Release(&'a ReleaseTxn),
}

impl BatchOp<'_> {
    /// The lock key the member acts on: no two members of a batch share one.
    pub fn key(&self) -> &str {
        match self {
            BatchOp::Grant(txn) => txn.key,
            BatchOp::Release(txn) => &txn.key,
        }
    }

    /// The quota place a grant member takes (class, subject, index): no two
    /// members of a batch share one either (their compares would both be
    /// judged on the store before the batch, and both puts land).
    pub fn place(&self) -> Option<(&str, &str, u32)> {
        match self {
            BatchOp::Grant(GrantTxn {
                quota: Some(take), ..
            }) => Some((&take.class, &take.subject, take.index)),
            _ => None,
        }
    }
}

/// Whether `ops` can go as one batch: distinct keys and distinct quota
/// places (what both logs check before sending a batch).
pub fn batch_is_distinct(ops: &[BatchOp<'_>]) -> Result<(), StoreError> {
    let mut keys = std::collections::BTreeSet::new();
    if !ops.iter().all(|op| keys.insert(op.key())) {
        return Err(StoreError::Refused {
            context: "two members of a batch on one key".into(),
        });
    }
    // An exclusive grant, a shared hold's grant and a slot's grant under
    // one name compare each other's absence: both would pass on the store
    // before the batch. Grants of one kind under a name (readers, slots)
    // go together.
    let mut kinds: std::collections::BTreeMap<&str, crate::records::HoldKind> =
        std::collections::BTreeMap::new();
    for op in ops.iter().filter(|op| matches!(op, BatchOp::Grant(_))) {
        let (kind, name) = crate::records::hold_kind(op.key());
        if *kinds.entry(name).or_insert(kind) != kind {
            return Err(StoreError::Refused {
                context: "grants of two kinds of hold under one name in one batch".into(),
            });
        }
    }
    let mut places = std::collections::BTreeSet::new();
    if !ops
        .iter()
        .filter_map(BatchOp::place)
        .all(|p| places.insert(p))
    {
        return Err(StoreError::Refused {
            context: "two members of a batch take one quota place".into(),
        });
    }
    Ok(())
}

/// How one member of a batch ended: what its own transaction would have
/// answered.
// Large only on a refused grant, read once and dropped (as `Granted`).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOutcome {
    Grant(Granted),
    Release(ReleasedIf),
}

impl BatchOutcome {
    /// The member wrote (at the batch's revision).
    pub fn committed(&self) -> bool {
        matches!(
            self,
            BatchOutcome::Grant(Granted::Yes) | BatchOutcome::Release(ReleasedIf::Yes(_))
        )
    }
}

/// What a key watch reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchSignal {
    /// The key was deleted (release or session expiry): worth an attempt.
    Freed,
    /// The key changed hands or was written: the wait goes on.
    Changed,
    /// The watch ended (compaction, cancel, stream error): fall back to polling.
    Lost,
}

/// A watch on one key; only ever a hint to try a grant.
#[async_trait]
pub trait KeyWatch: Send {
    async fn next(&mut self) -> WatchSignal;
}

/// An answer to a lease renewal: the TTL left (0 or less: the lease is
/// gone) and when the renewal it answers was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal {
    pub ttl_seconds: i64,
    pub sent: Instant,
    /// This ask reached the store (others were answered from a memo or
    /// joined a renewal in flight).
    pub sent_to_store: bool,
}

/// Why the log could not answer. Keeps its source; what a person should do
/// about it is said where errors become gRPC statuses.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store did not answer, or answered with an error: the outcome of a
    /// write is unknown.
    #[error("{context}")]
    Unavailable {
        context: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// A put on a lease the store no longer has: the session expired.
    #[error("lease {lease:#x} is gone")]
    LeaseGone { lease: i64 },
    /// A lease with this id exists already.
    #[error("lease {lease:#x} exists already")]
    LeaseExists { lease: i64 },
    /// The store answered something the protocol cannot read.
    #[error("{0}")]
    Malformed(String),
    /// The store refused the credentials the request ran with (a role
    /// without the permission, e.g. the force-release user's): nothing was
    /// written.
    #[error("{context}")]
    Denied {
        context: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The store refused the request before applying any of it (a batch
    /// etcd will not take as one transaction): nothing was written.
    #[error("{context}")]
    Refused { context: String },
}

impl StoreError {
    pub fn unavailable(context: impl Into<String>) -> Self {
        Self::Unavailable {
            context: context.into(),
            source: None,
        }
    }

    /// The message with every cause in the source chain (tonic keeps the
    /// interesting part of a connection failure there).
    pub fn detail(&self) -> String {
        let mut detail = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            let text = cause.to_string();
            if !detail.contains(&text) {
                detail.push_str(": ");
                detail.push_str(&text);
            }
            source = cause.source();
        }
        detail
    }
}

pub type LogResult<T> = Result<Answer<T>, StoreError>;

/// The log under the grant protocol: the core ([`HoldLog`], the holds) and
/// the capabilities the arbiter needs beside it ([`EpochLog`], the epoch,
/// seal and shard-map fence records; [`DurableQueueLog`], ADR-14's waiters;
/// [`SessionLog`], sessions as leases; [`FollowLog`], every hold and
/// session entry read and then watched, for the per-subject counts). Every
/// method but `follow` is one request to the store (one transaction, read
/// or lease call), so an answer's header is the header of everything in
/// it. Any type with all five is a `LockLog`.
pub trait LockLog:
    HoldLog + EpochLog + DurableQueueLog + SessionLog + FollowLog + ElectionLog
{
}

impl<T: HoldLog + EpochLog + DurableQueueLog + SessionLog + FollowLog + ElectionLog> LockLog for T {}

/// The core of the log: holds, their claims, batches and watches — what
/// the grant protocol (`LockTable`) itself runs on.
#[async_trait]
pub trait HoldLog: Send + Sync + 'static {
    /// One grant transaction ([`GrantTxn`]). A put on a lease the store no
    /// longer has is [`StoreError::LeaseGone`].
    async fn grant(&self, txn: GrantTxn<'_>) -> LogResult<Granted>;
    /// One hand-over transaction ([`HandOverTxn`]), which also deletes the
    /// replaced hold's claims: the replaced record's
    /// bytes when it committed (`Some(None)` if the store did not return
    /// them), `None` when a compare failed.
    async fn hand_over(&self, txn: HandOverTxn<'_>) -> LogResult<Option<Option<Vec<u8>>>>;
    /// One [`DowngradeTxn`]: whether it committed (`false`: a compare
    /// failed, nothing written).
    async fn downgrade(&self, txn: DowngradeTxn<'_>) -> LogResult<bool>;
    /// Deletes `held` if it is still exactly that hold (bytes, lease,
    /// revision), with the key's claims: the deleted record's bytes, `None`
    /// when a compare failed.
    async fn release(&self, held: &HeldAt) -> LogResult<Option<Vec<u8>>>;
    /// One [`ReleaseTxn`]: releases the hold only if it is still the
    /// owner's, in one transaction where the log can compare a record's
    /// beginning ([`fallback::release_if_owned`] is the two-request form for
    /// a log that cannot).
    async fn release_if_owned(&self, txn: &ReleaseTxn) -> LogResult<ReleasedIf>;

    /// The most members [`Self::batch`] takes; 1: this log does not batch,
    /// and every batch is one of its single transactions.
    fn batch_limit(&self) -> usize;
    /// Grants and releases on distinct keys in ONE transaction, each member
    /// a nested transaction with its own compares: every member that
    /// commits does so at the answer's revision, each outcome is what its
    /// own transaction would have answered, in order. More than
    /// [`Self::batch_limit`] members, or two on one key, are
    /// [`StoreError::Refused`] (nothing written); so is a put on a lease the
    /// store no longer has (it refuses the whole transaction, and cannot
    /// say whose lease it was). A log that does not batch answers with
    /// [`fallback::batch`] (a batch of one as that member's own
    /// transaction).
    async fn batch(&self, ops: Vec<BatchOp<'_>>) -> LogResult<Vec<BatchOutcome>>;
    /// Ends the hold a force-release names ([`ForceEndTxn`]): one
    /// transaction, run with the force-release path's own credentials where
    /// the log has them (etcd: the restricted force-release user).
    async fn force_end(&self, txn: ForceEndTxn<'_>) -> LogResult<ForceEnded>;
    /// Claims `session`'s hold on `key` at `revision` for a call it is about
    /// to reach as "already yours": puts the claim record on the session's
    /// lease if the hold is still exactly that and has no claim yet. From
    /// then on no orphan release deletes that hold, whichever arbiter runs it.
    async fn claim(&self, key: &str, session: i64, revision: i64) -> LogResult<Claimed>;
    /// Deletes `key` if it is held on lease `session` at `revision` and that
    /// hold has no claim (the orphan release of a grant whose caller went
    /// away); whether it did.
    async fn release_orphan(&self, key: &str, session: i64, revision: i64) -> LogResult<bool>;
    /// The hold on `key` (a linearizable read).
    async fn holder(&self, key: &str) -> LogResult<Option<Kv>>;
    /// The holds on `keys`, in order (`None`: not held): what a full
    /// quota's places are checked against. At most
    /// [`HOLDERS_OF_AT_ONCE`] keys per request (the answer's header is the
    /// last request's); [`fallback::holders_of`] reads them one by one.
    async fn holders_of(&self, keys: &[String]) -> LogResult<Vec<Option<Kv>>>;
    /// Every taken place of `subject`'s quota in `class`, by index.
    async fn quota_places(&self, class: &str, subject: &str) -> LogResult<Vec<(u32, Kv)>>;
    /// Deletes place `index` of `subject`'s quota in `class` if it is still
    /// at `revision` (the hold that took it has just ended); whether it did.
    /// Only a quicker way back to a free place: a place whose hold is gone
    /// is taken again as [`PlaceWas::Stale`] anyway.
    async fn free_quota_place(
        &self,
        class: &str,
        subject: &str,
        index: u32,
        revision: i64,
    ) -> LogResult<bool>;
    /// Every hold whose key starts with `prefix`, in key order.
    async fn holders_under(&self, prefix: &str) -> LogResult<Vec<(String, Kv)>>;
    /// Up to `limit` held lock keys after `after` (all from the first with
    /// `None`), in key order, keys only: a scan of every hold in pages of
    /// bounded size ([`fallback::held_keys_page`] reads every hold, for
    /// in-memory logs).
    async fn held_keys_page(&self, after: Option<&str>, limit: usize) -> LogResult<Vec<String>>;
    /// How many keys are held.
    async fn count_holds(&self) -> LogResult<i64>;
    /// Watches `key` from `from_revision` (inclusive); a semaphore's slots
    /// prefix ([`crate::records::slots_of`]) watches every slot of it, a
    /// lock's shared holds prefix ([`crate::records::readers_of`]) every
    /// shared hold of it.
    async fn watch(&self, key: &str, from_revision: i64) -> Result<Box<dyn KeyWatch>, StoreError>;
}

/// The epoch record, the seal, the coord-seen record and the shard-map
/// fence: what the seal (`table/seal.rs`) and the operator's advance run on.
#[async_trait]
pub trait EpochLog: Send + Sync + 'static {
    /// The epoch record, the seal, the coord-seen record and the
    /// shard-map fence, in one read.
    async fn records(&self) -> LogResult<Records>;
    /// Creates the epoch record if there is none; whether this call did.
    async fn create_epoch(&self, record: Vec<u8>) -> LogResult<bool>;
    /// Puts the seal record if the seal is at `seal_at` (`None`: absent) and
    /// the epoch record at `epoch_at` (`None`: absent); whether it did.
    async fn put_seal(
        &self,
        record: Vec<u8>,
        seal_at: Option<i64>,
        epoch_at: Option<i64>,
    ) -> LogResult<bool>;
    /// Puts the coord-seen record if it is at `at` (`None`: absent);
    /// whether it did.
    async fn put_coord_seen(&self, record: Vec<u8>, at: Option<i64>) -> LogResult<bool>;
    /// The operator's advance: if the epoch record's bytes are `expected` and
    /// the seal is at `seal_at`, puts `record`, deletes every hold, every
    /// claim, every durable waiter and the seal, in one transaction (the
    /// shard-map fence is neither compared nor changed). `Some(holds
    /// deleted)`, or `None` when a compare failed.
    async fn advance(
        &self,
        expected: Vec<u8>,
        seal_at: Option<i64>,
        record: Vec<u8>,
    ) -> LogResult<Option<i64>>;
    /// Raises the shard-map fence to `version` if it is absent or below it
    /// (never lowers it); whether this call wrote. A compare-and-put on the
    /// record as read, retried a few times when another raise came between.
    async fn raise_map_fence(&self, version: u64) -> LogResult<bool>;
    /// The shard-map fence record (a linearizable read).
    async fn map_fence(&self) -> LogResult<Option<Kv>>;
}

/// Durable waiters (ADR-14, `fairness = "durable"`): a key's queue kept in
/// the log, so a waiter keeps its place when its arbiter stops.
#[async_trait]
pub trait DurableQueueLog: Send + Sync + 'static {
    /// Puts `session`'s waiter record for `key` on the session's lease if
    /// the session's record is `session_record` (the caller's own session,
    /// as a grant compares it); `None` if it is not. A put over the
    /// session's existing record keeps its create revision, so a retry of
    /// the same session keeps its place (and its new record says how long
    /// it waits now). [`StoreError::LeaseGone`] if the lease is gone.
    async fn enqueue(
        &self,
        key: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>>;
    /// How many durable waiter records `key` has.
    async fn count_queued(&self, key: &str) -> LogResult<i64>;
    /// `key`'s oldest durable waiter record (a linearizable read).
    async fn queue_head(&self, key: &str) -> LogResult<Option<Kv>>;
    /// Deletes `session`'s waiter record for `key` if it was last written
    /// at `modified`; whether it did.
    async fn dequeue(&self, key: &str, session: i64, modified: i64) -> LogResult<bool>;
    /// Puts `session`'s writer intent on lock `name` (issue 34: a writer
    /// waiting for the lock's shared holds to end, whichever arbiter it
    /// waits on) on the session's lease, if the session's record is
    /// `session_record`; `None` if it is not. Every shared grant of `name`
    /// compares the lock's intents absent, so readers that come later wait
    /// behind the writer instead of starving it. `record` is a
    /// [`crate::records::WaiterRecord`] (how long the writer waits: an
    /// intent left by a call that ended is removed as stale, as durable
    /// waiters are).
    async fn put_intent(
        &self,
        name: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>>;
    /// Deletes `session`'s intent on `name` if it was last written at
    /// `modified`; whether it did.
    async fn drop_intent(&self, name: &str, session: i64, modified: i64) -> LogResult<bool>;
    /// Watches the intents on lock `name` from `from_revision`
    /// (inclusive): any change is a hint. A log without it answers
    /// [`fallback::no_intent_watch`] and its readers poll.
    async fn watch_intents(
        &self,
        name: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError>;
    /// Watches `key`'s durable queue from `from_revision` (inclusive): any
    /// change is a hint. A log without it answers
    /// [`fallback::no_queue_watch`] and its waiters poll.
    async fn watch_queue(
        &self,
        key: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError>;
}

/// Sessions: leases, their records and the per-subject count entries.
#[async_trait]
pub trait SessionLog: Send + Sync + 'static {
    /// Grants lease `id` with `ttl_seconds`; [`StoreError::LeaseExists`] if
    /// the id is taken.
    async fn grant_lease(&self, id: i64, ttl_seconds: u32) -> LogResult<()>;
    /// Puts `session`'s record and its entry in the session count of grant
    /// subject `identity` (the caller's own identity, or the pattern it falls
    /// under), both on the session's lease ([`StoreError::LeaseGone`] if it
    /// expired).
    async fn put_session(&self, session: i64, identity: &str, record: Vec<u8>) -> LogResult<()>;
    /// `session`'s record.
    async fn session(&self, session: i64) -> LogResult<Option<Kv>>;
    /// Marks that `session` has a shadow on entity shard `shard` (ADR-09):
    /// a key on the session's lease, so the mark ends with the session.
    /// Logs that never serve shards keep no marks and answer
    /// [`fallback::no_shadow_marks`].
    async fn mark_shadow(&self, session: i64, shard: &str) -> LogResult<()>;
    /// The shards `session` has marked shadows on, in name order, read in
    /// one revision with what says whether they are all its shadows
    /// ([`ShadowMarks::complete`]).
    async fn shadow_marks(&self, session: i64) -> LogResult<ShadowMarks>;
    /// Vouches that `session`'s marks name every shard it has a shadow on
    /// (the caller found each and marked it after reading the marks): a
    /// key beside the marks, on the session's lease, written only if the
    /// epoch record is still as the read saw it (`epoch_at`, 0: absent)
    /// and there is no seal; whether it was ([`StoreError::LeaseGone`] if
    /// the session expired). An advance after the read (a restore may have
    /// taken a mark back since) leaves the marks unvouched.
    async fn vouch_shadows(&self, session: i64, epoch_at: i64) -> LogResult<bool>;
    /// How many sessions are counted against grant subject `identity` (the
    /// `counted_as` of [`Self::put_session`]).
    async fn count_sessions_of(&self, identity: &str) -> LogResult<u32>;
    /// Deletes `session`'s record and its count entry under grant subject
    /// `counted_as` (the `identity` it was put with, [`Self::put_session`])
    /// if the record's bytes are `record` on the session's lease; whether it
    /// did.
    async fn delete_session(
        &self,
        session: i64,
        counted_as: &str,
        record: Vec<u8>,
    ) -> LogResult<bool>;
    /// Revokes the lease: every key on it goes in one revision. A lease
    /// that is gone already is not an error.
    async fn revoke(&self, lease: i64) -> Result<(), StoreError>;
    /// Renews the lease once.
    async fn renew(&self, lease: i64) -> Result<Renewal, StoreError>;
    /// An operator's revocation of a session (a force-release that names
    /// it, [`RevokeSessionTxn`]): ONE transaction deletes the session's
    /// record and its count entry, if the record is still on that lease, so
    /// no grant can be made on it from then on (every grant compares that
    /// record), and puts the revocation marker on a lease of its own; then
    /// the session's lease is revoked, and its holds go. A record already
    /// gone gets no marker; the lease is revoked anyway.
    async fn revoke_session(&self, txn: RevokeSessionTxn<'_>)
    -> Result<SessionRevoked, StoreError>;
}

/// What [`SessionLog::revoke_session`] ends and what it leaves behind.
#[derive(Debug, Clone, Copy)]
pub struct RevokeSessionTxn<'a> {
    pub session: i64,
    /// The grant subject the session is counted against (its count entry).
    pub counted_as: &'a str,
    /// The revocation marker (`sys/revoked/<session>`), which tells the
    /// audit tailer the lease's deletions from an expiry.
    pub marker: &'a [u8],
    /// How long the marker stays.
    pub marker_ttl_seconds: u32,
}

/// How a [`SessionLog::revoke_session`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionRevoked {
    /// Record deleted, marker put, lease revoked.
    Revoked,
    /// The session's record was already gone (closed or expiring): no
    /// marker; its lease is revoked.
    RecordGone,
    /// The store no longer had the session's lease: it had ended.
    Ended,
}

/// One batch member as its own transaction ([`HoldLog::grant`] or
/// [`HoldLog::release_if_owned`]): what a batch of one is, with the single
/// transaction's own errors (a grant on a lease gone is
/// [`StoreError::LeaseGone`], not a refused batch).
pub async fn alone<L: HoldLog + ?Sized>(log: &L, op: BatchOp<'_>) -> LogResult<BatchOutcome> {
    Ok(match op {
        BatchOp::Grant(txn) => log.grant(txn).await?.map(BatchOutcome::Grant),
        BatchOp::Release(txn) => log.release_if_owned(txn).await?.map(BatchOutcome::Release),
    })
}

/// The key spaces a follower counts ([`FollowLog`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Every holder record (`l/`): the hold counts, and the ends of holds
    /// pushed to their sessions' KeepAlive streams.
    Holds,
    /// Every subject's session entries (`si/`): the session counts.
    SessionIndex,
}

/// One change of a followed key, as the log reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowEvent {
    /// The key below the followed prefix (a lock key for [`Counted::Holds`]).
    pub key: String,
    /// The value put; `None` for a delete (an expiry's included).
    pub put: Option<Kv>,
    /// The value before the change, when the follower asked for it and the
    /// log still had it.
    pub prev: Option<Kv>,
}

/// One answer of a [`PrefixWatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FollowSignal {
    /// Changes, every one at or below `through`: how far the log is known
    /// once they are applied.
    Events {
        events: Vec<FollowEvent>,
        through: i64,
    },
    /// The watch ended or missed events (compaction): only a fresh read is
    /// exact now.
    Lost,
}

/// The changes under a followed prefix, from the revision after a read.
#[async_trait]
pub trait PrefixWatch: Send {
    async fn next(&mut self) -> FollowSignal;
}

/// Every key of a counted key space read once, then watched: what the hold
/// and session counts follow (`crate::follow`).
#[async_trait]
pub trait FollowLog: Send + Sync + 'static {
    /// Reads every key of `counted` at one revision (in pages, where the
    /// store needs them), handing each to `each` with its key below the
    /// prefix, then watches the key space from the next revision on
    /// (`prev_kv`: deletes carry the value they deleted). The revision read
    /// at, and the watch.
    ///
    /// The read's revision comes back even when the watch could not be
    /// opened, so the follower installs what it read either way (a watch
    /// that keeps failing must not keep an old count in force).
    async fn follow(
        &self,
        counted: Counted,
        prev_kv: bool,
        each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
    ) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError>;
}

/// An election as one read saw it ([`ElectionLog::election`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ElectionRead {
    /// The leader record (`None`: vacant).
    pub lead: Option<Kv>,
    /// The term record (`None`: never led in this epoch).
    pub term: Option<Kv>,
    /// Candidate records by key (rank, then session), each with its key
    /// below the election's candidates prefix (`<rank:08x>/<lease:016x>`):
    /// at most the limit asked for.
    pub candidates: Vec<(String, Kv)>,
}

/// Where a [`LeadTxn`] starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeadFrom<'a> {
    /// A vacancy: no leader record.
    Vacant,
    /// The current leadership: the leader record on `session`'s lease (the
    /// term record's mod revision, [`LeadTxn::term_at`], names the term),
    /// counted against grant subject `subject` (its entry is deleted).
    Leader { session: i64, subject: &'a str },
}

/// Who leads after a [`LeadTxn`].
#[derive(Debug, Clone)]
pub struct LeadTo<'a> {
    pub session: i64,
    /// The candidate's record: its priority (its key's rank) and create
    /// revision, compared and deleted.
    pub priority: u32,
    pub created: i64,
    /// The leader record, put on `session`'s lease.
    pub lead_record: Vec<u8>,
    /// `session`'s record, compared when the caller has it (its own
    /// campaign); a hand-over to another candidate compares that
    /// candidate's record only (it lives on the same lease).
    pub session_record: Option<&'a [u8]>,
    /// The grant subject the leadership counts against: its entry is put
    /// on `session`'s lease.
    pub subject: &'a str,
}

/// One transaction that starts or ends a term of election `election`, if
/// the epoch record's bytes are `epoch`, there is no seal, the shard-map
/// fence is at `fence_at`, the term record is at `term_at` (its mod
/// revision; 0: absent), `from` holds and `to`'s candidate record is there.
/// It puts the term record (`term_record`, on no lease; with `creates_for`,
/// the first, and that subject's entry for it too). With a `to`, it puts
/// the leader record and the subject's leadership entry on `to`'s lease
/// and deletes its candidate record; with none (a resignation without
/// successor) it deletes the leader record. Either way the ending
/// leadership's entry goes. The commit's revision is the new leadership's
/// (its token's).
#[derive(Debug, Clone)]
pub struct LeadTxn<'a> {
    pub election: &'a str,
    pub epoch: &'a [u8],
    pub fence_at: i64,
    pub term_at: i64,
    pub term_record: Vec<u8>,
    /// The grant subject whose entry the first term record gets (only when
    /// `term_at` is 0).
    pub creates_for: Option<&'a str>,
    pub from: LeadFrom<'a>,
    pub to: Option<LeadTo<'a>>,
}

/// A proclamation: the leader record replaced by `lead_record` if the
/// leadership is still the one whose term record is at `term_at` and whose
/// leader record is on `session`'s lease, the epoch record's bytes are
/// `epoch` and there is no seal.
#[derive(Debug, Clone)]
pub struct ProclaimTxn<'a> {
    pub election: &'a str,
    pub session: i64,
    pub term_at: i64,
    pub epoch: &'a [u8],
    pub lead_record: Vec<u8>,
}

/// A forced end of one leadership, approved by two operators (an
/// election's force-release): the leader record of `election` is deleted,
/// the term record put as `term_record` (the same count, ended by the
/// operators) and the leadership's entry under grant subject `subject`
/// deleted, only if the leader record is still on `session`'s lease and the
/// term record still at `term_at` (its mod revision: the term the request
/// named; a term started since, even by the same session, has moved it),
/// and only if the approval's own records agree, all in one transaction.
/// Like [`ForceEndTxn`], nothing about the epoch, a seal or the shard-map
/// fence is compared: ending a term hands nothing out (an epoch advance
/// deletes the term record, so a request from before one fails its
/// compare).
#[derive(Debug, Clone)]
pub struct ForceTermTxn<'a> {
    pub election: &'a str,
    pub session: i64,
    pub subject: &'a str,
    pub term_at: i64,
    pub term_record: Vec<u8>,
    pub records: &'a ForceRecords,
}

/// Elections (latchkey.election.v1): a leader record, a term record and
/// candidate records per election, each operation one request to the store.
/// Safety rests on the [`LeadTxn`] compares alone (one leader record; the
/// term record's revision names the leadership); candidates only order who
/// is tried next.
#[async_trait]
pub trait ElectionLog: Send + Sync + 'static {
    /// The leader, term and first `limit` candidate records of `election`,
    /// in one read.
    async fn election(&self, election: &str, limit: usize) -> LogResult<ElectionRead>;
    /// Puts `session`'s candidate record at `priority` on the session's
    /// lease if the session record is `session_record`; over an existing
    /// one the store keeps its create revision (the candidate's place).
    /// `None` when the session record did not match.
    async fn stand(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>>;
    /// Deletes `session`'s candidate record at `priority` if it was last
    /// written at `modified`; whether it did.
    async fn withdraw(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        modified: i64,
    ) -> LogResult<bool>;
    /// One [`LeadTxn`]: whether it committed. A put on a lease the store no
    /// longer has is [`StoreError::LeaseGone`].
    async fn lead(&self, txn: LeadTxn<'_>) -> LogResult<bool>;
    /// One [`ProclaimTxn`]: whether it committed.
    async fn proclaim(&self, txn: ProclaimTxn<'_>) -> LogResult<bool>;
    /// One [`ForceTermTxn`]: [`ForceEnded::Ended`]; or nothing written and
    /// [`ForceEnded::RecordsChanged`] when an approval record moved, else
    /// [`ForceEnded::HoldChanged`] with the leader record as the failed
    /// transaction read it (`None`: vacant).
    async fn force_end_term(&self, txn: ForceTermTxn<'_>) -> LogResult<ForceEnded>;
    /// How many leaderships grant subject `subject` has (a count-only read
    /// of its entries).
    async fn count_leaderships(&self, subject: &str) -> LogResult<i64>;
    /// How many elections' term records grant subject `subject` made.
    async fn count_elections(&self, subject: &str) -> LogResult<i64>;
    /// Every change of `election`'s records from `from_revision` on, with
    /// the deleted values (keys below the election's prefix: `lead`,
    /// `term`, `c/...`).
    async fn watch_election(
        &self,
        election: &str,
        from_revision: i64,
    ) -> Result<Box<dyn PrefixWatch>, StoreError>;
}
