//! The values the arbiter stores in etcd, the key layout under the
//! configured prefix, and the fencing token's layout ([`token`]): one
//! definition for the arbiter, the audit tailer, the simulation and the
//! tests (issue 32). The key layout:
//!
//! - `{prefix}/sys/epoch` — [`EpochRecord`]: the epoch and the cluster id it was minted for.
//! - `{prefix}/sys/seal`  — present while the log is sealed (a restore was seen).
//! - `{prefix}/sys/coord-seen` — [`CoordSeenRecord`]: what the coord cluster
//!   was seen to witness for this lock log, so a restore of the coord
//!   cluster is seen too (the lock log witnessing its witness).
//! - `{prefix}/sys/shardmap` — the shard-map fence ([`encode_map_fence`]):
//!   the shard map version this cluster was last fenced at, as 20 ASCII
//!   digits. Every grant compares its mod revision, so an arbiter routing by
//!   an older map cannot grant once a move has raised it. Absent: version 0
//!   (a cluster never sharded).
//! - `{prefix}/s/{lease}` — [`SessionRecord`] on the session's lease.
//! - `{prefix}/si/{hex(identity)}/{lease}` — empty, on the session's lease: the
//!   identity's open sessions, counted for `--max-sessions-per-identity`.
//! - `{prefix}/l/{key}`   — [`HolderRecord`] on the holder's session lease:
//!   an exclusive hold of `key`; a shared hold is `l/{key}//r/{session}`
//!   ([`reader_key`]), a semaphore's slot `l/{name}//s/{slot}` ([`slot_key`]).
//! - `{prefix}/c/{key}//{revision}` — empty, on the holder's session lease: the
//!   hold at that revision reached a call as "already yours", so no orphan
//!   release may delete it (`//` cannot occur in a key, so no key's claims
//!   are a prefix of another's).
//! - `{prefix}/q/{key}//{lease}` — [`WaiterRecord`] on the waiter's session
//!   lease: a durable waiter (ADR-14, `fairness = "durable"`), first served
//!   by create revision (deleted by an epoch advance).
//! - `{prefix}/p/{class}/{hex(subject)}/{index:04x}` — [`QuotaPlaceRecord`]
//!   on the holder's session lease: one of the `maxHoldsPerSubject` places
//!   of a class with a quota, taken in the grant transaction of the hold it
//!   names, at that hold's revision (deleted by an epoch advance).
//!
//! - `{prefix}/sys/force-req/…`, `{prefix}/sys/force/{id}`,
//!   `{prefix}/sys/revoked/{lease}` — two-person force-release's requests,
//!   approvals and revoked sessions ([`force`]).
//!
//! The quorum-loss spool's lines, kept in files and not in etcd, are
//! [`spool`]'s.
//!
//! Records are JSON with a fixed field order, so the bytes the arbiter writes
//! are the bytes it can compare in a transaction.

pub mod election;
pub mod force;
pub mod spool;
pub mod token;

pub use force::{ForceRecord, RequestRecord, RevokeRecord};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EpochRecord {
    pub epoch: u32,
    /// etcd cluster id, as a decimal string (JSON numbers lose u64 precision).
    pub cluster_id: String,
    pub advanced_at_unix_ms: i64,
    #[serde(default)]
    pub reason: String,
}

impl EpochRecord {
    pub fn cluster_id(&self) -> Option<u64> {
        self.cluster_id.parse().ok()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SealRecord {
    pub reason: String,
    pub sealed_at_unix_ms: i64,
    /// The lowest epoch the advance may move to: one above every epoch the
    /// sealing arbiters have granted in. After a restore to before an
    /// earlier advance, etcd's epoch record is older than epochs already
    /// used, and advancing it by one would re-use an epoch (and its tokens).
    #[serde(default)]
    pub next_epoch_at_least: u32,
}

/// The lock log's memory of its witness: the coord cluster's records for
/// this lock log as an arbiter read them, in one epoch of the lock log. The
/// coord cluster's mark and epoch only ever go up; a coord cluster that shows
/// less than this was restored from a snapshot, and a later restore of the
/// lock log would go unnoticed by it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CoordSeenRecord {
    /// The lock log's epoch this was recorded in (an advance starts over).
    pub lock_epoch: u32,
    /// The coord cluster's mark: epoch, revision and lock cluster id.
    pub mark_epoch: u32,
    pub mark_revision: i64,
    /// Decimal string (JSON numbers lose u64 precision).
    pub mark_cluster_id: String,
    /// The coord cluster's highest allocated epoch.
    pub epoch: u32,
    pub seen_at_unix_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionRecord {
    pub identity: String,
    pub ttl_seconds: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HolderRecord {
    pub identity: String,
    pub session: i64,
    pub class: String,
    pub acquired_at_unix_ms: i64,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// The client instance the hold was granted to, as the client named
    /// itself (`AcquireRequest.instance`): only for telling a leak (the same
    /// instance under another session) from contention between replicas
    /// that share an identity. Last, and absent when empty, so the owner
    /// prefix of a record is what it always was.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    /// The grant subject the holder was bounded as when that is not its own
    /// identity: the pattern (`spiffe://td/ns/x/sa/y/*`) a per-pod identity
    /// falls under. Holds are counted per subject (`--max-holds-per-identity`
    /// is per subject), so 500 pods under one pattern share one bound.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub bound: String,
    /// The quota place the hold took (`maxHoldsPerSubject`), written in
    /// the same transaction at the same revision: what a release frees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota_place: Option<u32>,
    /// A shared hold made by a downgrade: the revision of the exclusive
    /// hold it replaced (in the same transaction). A downgrade asked again
    /// with that hold's token (`AcquireRequest.downgrade_from`, its answer
    /// lost) is answered with this hold and never with another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downgraded_from: Option<i64>,
}

/// One place of a class's per-subject quota (`maxHoldsPerSubject`), at
/// `p/<class>/<hex(subject)>/<index:04x>` on the holder's session lease.
/// It is taken in the grant transaction of the hold it names, so its mod
/// revision is that hold's revision for as long as the hold lasts; a place
/// whose hold is gone or has another revision is free to take again (the
/// taking transaction compares both).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct QuotaPlaceRecord {
    pub key: String,
    pub session: i64,
}

impl HolderRecord {
    /// Whom the hold counts against: the subject it was granted under.
    pub fn bounded_as(&self) -> &str {
        if self.bound.is_empty() {
            &self.identity
        } else {
            &self.bound
        }
    }
}

/// A durable waiter: who waits, and how long its call waits. A record
/// whose call ended without removing it (its arbiter died) would hold up
/// the queue while its session lives; a waiter behind it that has seen the
/// same record (the same last write) for longer than `wait_ms` and a grace
/// period, on its own monotonic clock, removes it. No wall clocks compared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WaiterRecord {
    pub identity: String,
    pub session: i64,
    pub class: String,
    pub wait_ms: u64,
}

/// Serialises a record; these types cannot fail to serialise.
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(record).unwrap_or_default()
}

pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Option<T> {
    try_decode(bytes).ok()
}

/// [`decode`], saying why the bytes are not a record (for a record that
/// must parse, such as the epoch record: the reason goes to the logs).
pub fn try_decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice(bytes)
}

/// The digits of a shard-map fence record: every version in one width, so
/// the record reads the same to a person, `etcdctl` and a byte compare.
const MAP_FENCE_DIGITS: usize = 20;

/// The shard-map fence record's bytes for `version`: ASCII decimal,
/// zero-padded to 20 digits (u64's widest).
pub fn encode_map_fence(version: u64) -> Vec<u8> {
    format!("{version:020}").into_bytes()
}

/// The version in a shard-map fence record; `None` for anything but
/// exactly 20 ASCII digits that fit a u64 (a record no arbiter wrote).
pub fn decode_map_fence(bytes: &[u8]) -> Option<u64> {
    if bytes.len() != MAP_FENCE_DIGITS || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

/// The layout's names below the prefix (see the module doc): what a reader
/// of the log that strips the prefix (the audit tailer) matches against.
pub mod keys {
    pub const EPOCH: &str = "sys/epoch";
    pub const SEAL: &str = "sys/seal";
    pub const COORD_SEEN: &str = "sys/coord-seen";
    pub const MAP_FENCE: &str = "sys/shardmap";
    /// Force-release records (`sys/force/<request id>`).
    pub const FORCE: &str = "sys/force/";
    /// Force-release requests (`sys/force-req/<request id>`).
    pub const FORCE_REQUESTS: &str = "sys/force-req/";
    /// Sessions an operator's force-release revoked (`sys/revoked/<lease>`).
    pub const REVOKED: &str = "sys/revoked/";
    /// Session records (`s/<lease:016x>`).
    pub const SESSIONS: &str = "s/";
    /// Session count entries (`si/<hex(subject)>/<lease:016x>`).
    pub const SESSION_INDEX: &str = "si/";
    /// Shadow marks (`sh/<session:016x>/<shard>`).
    pub const SHADOW_MARKS: &str = "sh/";
    /// The vouch's name under a session's shadow marks.
    pub const SHADOW_VOUCH: &str = "#all";
    /// Holds (`l/<key>`).
    pub const HOLDERS: &str = "l/";
    /// Claims (`c/<key>//<revision:016x>`).
    pub const CLAIMS: &str = "c/";
    /// Durable waiters (`q/<key>//<lease:016x>`).
    pub const QUEUES: &str = "q/";
    /// Writers' intents (`w/<name>//<lease:016x>`): a writer waiting for a
    /// lock's shared holds to end, on its session's lease; a shared grant
    /// compares the lock's range empty (issue 34).
    pub const INTENTS: &str = "w/";
    /// Quota places (`p/<class>/<hex(subject)>/<index:04x>`).
    pub const QUOTA_PLACES: &str = "p/";
    /// Elections (latchkey.election.v1): `e/<name>//lead` (the leader, on
    /// its session's lease), `e/<name>//term` (the term count, on no lease),
    /// `e/<name>//c/<rank:08x>/<lease:016x>` (candidates, on their
    /// sessions' leases), `e//i/<hex(subject)>/<name>` (a grant subject's
    /// leaderships, on the leader's lease) and `e//t/<hex(subject)>/<name>`
    /// (the term records a subject made, on no lease): the last two are
    /// counted for the subject's bounds. An epoch advance deletes them all.
    pub const ELECTIONS: &str = "e/";
}

/// Where each record lives: every key below a prefix ([`Layout::new`], the
/// arbiter's etcd layout), or the same keys with no prefix at all
/// ([`Layout::bare`], the simulation's in-memory store, and what a reader
/// that strips the prefix sees).
#[derive(Debug, Clone)]
pub struct Layout {
    /// What every key begins with: the prefix and its `/`, or nothing.
    root: String,
}

impl Layout {
    /// The layout below `prefix` (a trailing `/` or none: the same layout).
    pub fn new(prefix: &str) -> Self {
        Self {
            root: format!("{}/", prefix.trim_end_matches('/')),
        }
    }
    /// The layout with no prefix: every key is its name below the prefix
    /// (`l/<key>`, `s/<lease:016x>`, `sys/epoch`, ...), the prefixed
    /// layout's key with the prefix and its `/` stripped.
    pub const fn bare() -> Self {
        Self {
            root: String::new(),
        }
    }
    /// A record below the prefix by its name there (`keys::*` spell them:
    /// `sys/force/<id>`, ...); the bare layout's is the name itself.
    pub fn under(&self, name: &str) -> String {
        format!("{}{name}", self.root)
    }
    pub fn epoch(&self) -> String {
        format!("{}{}", self.root, keys::EPOCH)
    }
    pub fn seal(&self) -> String {
        format!("{}{}", self.root, keys::SEAL)
    }
    pub fn coord_seen(&self) -> String {
        format!("{}{}", self.root, keys::COORD_SEEN)
    }
    /// The shard-map fence (see the module doc).
    pub fn map_fence(&self) -> String {
        format!("{}{}", self.root, keys::MAP_FENCE)
    }
    pub fn session(&self, lease: i64) -> String {
        format!("{}{}{lease:016x}", self.root, keys::SESSIONS)
    }
    /// Every session record.
    pub fn sessions(&self) -> String {
        format!("{}{}", self.root, keys::SESSIONS)
    }
    /// The session's shadow on entity shard `shard` (ADR-09), on the
    /// session's lease on the lock cluster: which shards its renewals must
    /// renew.
    pub fn shadow_mark(&self, session: i64, shard: &str) -> String {
        format!("{}{shard}", self.shadow_marks(session))
    }
    /// Every shadow mark of `session` (and its vouch, [`Self::shadow_vouch`]).
    pub fn shadow_marks(&self, session: i64) -> String {
        format!("{}{}{session:016x}/", self.root, keys::SHADOW_MARKS)
    }
    /// Beside `session`'s shadow marks, on its lease: written after a
    /// renewal found every shadow the session has on any shard and marked
    /// it. Its revision says since when the marks are known complete (a
    /// restore of the lock cluster may take marks back; the epoch advance
    /// after it is newer than any vouch it restored). `#` is in no shard
    /// name, so it is never read as a mark.
    pub fn shadow_vouch(&self, session: i64) -> String {
        format!("{}{}", self.shadow_marks(session), keys::SHADOW_VOUCH)
    }
    /// One open session of `identity` (hex, so no identity is a prefix of
    /// another's entries).
    pub fn identity_session(&self, identity: &str, lease: i64) -> String {
        format!("{}{lease:016x}", self.identity_sessions(identity))
    }
    /// Every open session counted against `identity`, a grant subject (an
    /// identity, or a pattern `spiffe://td/a/*`: `*` is in no ID, so a
    /// pattern's entries are its own): a prefix to count.
    pub fn identity_sessions(&self, identity: &str) -> String {
        let mut hex = String::with_capacity(identity.len() * 2);
        for b in identity.bytes() {
            hex.push_str(&format!("{b:02x}"));
        }
        format!("{}{hex}/", self.session_index())
    }
    /// Every subject's session entries: the prefix the session counts
    /// follow (the arbiter's `session_counts`).
    pub fn session_index(&self) -> String {
        format!("{}{}", self.root, keys::SESSION_INDEX)
    }
    pub fn holder(&self, key: &str) -> String {
        format!("{}{}{key}", self.root, keys::HOLDERS)
    }
    pub fn holders(&self) -> String {
        format!("{}{}", self.root, keys::HOLDERS)
    }
    /// The claim on `key`'s hold at `revision` (see the module doc).
    pub fn claim(&self, key: &str, revision: i64) -> String {
        format!("{}{revision:016x}", self.claims_of(key))
    }
    /// Every claim on `key`'s holds: a prefix to delete with the hold.
    pub fn claims_of(&self, key: &str) -> String {
        format!("{}{}{key}//", self.root, keys::CLAIMS)
    }
    /// Every claim.
    pub fn claims(&self) -> String {
        format!("{}{}", self.root, keys::CLAIMS)
    }
    /// `key`'s durable queue: a prefix (`//` cannot occur in a key).
    pub fn queue_of(&self, key: &str) -> String {
        format!("{}{}{key}//", self.root, keys::QUEUES)
    }
    /// `session`'s waiter record on `key`.
    pub fn waiter(&self, key: &str, session: i64) -> String {
        format!("{}{session:016x}", self.queue_of(key))
    }
    /// The writers' intents on lock `name`: a prefix (`//` cannot occur in
    /// a key).
    pub fn intents_of(&self, name: &str) -> String {
        format!("{}{}{name}//", self.root, keys::INTENTS)
    }
    /// `session`'s writer intent on lock `name`.
    pub fn intent(&self, name: &str, session: i64) -> String {
        format!("{}{session:016x}", self.intents_of(name))
    }
    pub fn durable_waiters(&self) -> String {
        format!("{}{}", self.root, keys::QUEUES)
    }
    /// Every record of election `name`: a prefix (`//` cannot occur in a
    /// name, which is a lock key).
    pub fn election(&self, name: &str) -> String {
        format!("{}{}{name}//", self.root, keys::ELECTIONS)
    }
    /// Election `name`'s leader record.
    pub fn election_lead(&self, name: &str) -> String {
        format!("{}lead", self.election(name))
    }
    /// Election `name`'s term record.
    pub fn election_term(&self, name: &str) -> String {
        format!("{}term", self.election(name))
    }
    /// Election `name`'s candidates: a prefix, ordered by rank (the
    /// priority, highest first) in the key, then by create revision.
    pub fn candidates(&self, name: &str) -> String {
        format!("{}{CANDIDATES}", self.election(name))
    }
    /// `session`'s candidate record in election `name` at `priority`.
    pub fn candidate(&self, name: &str, priority: u32, session: i64) -> String {
        format!(
            "{}{}",
            self.candidates(name),
            candidate_entry(priority, session)
        )
    }
    /// `subject`'s entry for its leadership of election `name` (a name never
    /// begins with '/', so no election's prefix is below `e//`).
    pub fn leadership_entry(&self, subject: &str, name: &str) -> String {
        format!("{}{name}", self.leaderships_of(subject))
    }
    /// Every leadership entry of `subject`: a prefix to count.
    pub fn leaderships_of(&self, subject: &str) -> String {
        let hex: String = subject.bytes().map(|b| format!("{b:02x}")).collect();
        format!("{}{}/i/{hex}/", self.root, keys::ELECTIONS)
    }
    /// `subject`'s entry for election `name`'s term record (no lease: it
    /// lasts as the term record does).
    pub fn election_entry(&self, subject: &str, name: &str) -> String {
        format!("{}{name}", self.elections_of(subject))
    }
    /// Every term record entry of `subject`: a prefix to count.
    pub fn elections_of(&self, subject: &str) -> String {
        let hex: String = subject.bytes().map(|b| format!("{b:02x}")).collect();
        format!("{}{}/t/{hex}/", self.root, keys::ELECTIONS)
    }
    /// Every quota place of grant subject `subject` in class `class` (a
    /// class name has no '/'; the subject is hex, so no subject's places
    /// are a prefix of another's).
    pub fn quota_places(&self, class: &str, subject: &str) -> String {
        let hex: String = subject.bytes().map(|b| format!("{b:02x}")).collect();
        format!("{}{class}/{hex}/", self.all_quota_places())
    }
    /// Place `index` of `subject`'s quota in `class`.
    pub fn quota_place(&self, class: &str, subject: &str, index: u32) -> String {
        format!("{}{index:04x}", self.quota_places(class, subject))
    }
    /// Every writer's intent (what an epoch advance deletes).
    pub fn all_intents(&self) -> String {
        format!("{}{}", self.root, keys::INTENTS)
    }
    /// Every quota place (what an epoch advance deletes).
    pub fn all_quota_places(&self) -> String {
        format!("{}{}", self.root, keys::QUOTA_PLACES)
    }
    /// Every election's records (what an epoch advance deletes).
    pub fn elections(&self) -> String {
        format!("{}{}", self.root, keys::ELECTIONS)
    }
}

/// Where slot `slot` of semaphore `name` is held: a lock key of its own
/// (`<name>//s/<slot:04x>`). `//` occurs in no lock key, so no caller can
/// name a slot, and every slot of `name` is under `<name>//`, the range an
/// exclusive grant of `name` compares empty (a key is a lock or a
/// semaphore, never both at once).
pub fn slot_key(name: &str, slot: u32) -> String {
    format!("{name}{SLOTS}{slot:04x}")
}

/// Every slot of semaphore `name`: a prefix of lock keys.
pub fn slots_of(name: &str) -> String {
    format!("{name}{SLOTS}")
}

/// The semaphore and slot a slot's lock key names; `None` for a lock's
/// own key.
pub fn split_slot(key: &str) -> Option<(&str, u32)> {
    let (name, rest) = key.split_once(SLOTS)?;
    // exactly as `slot_key` spells it: four lowercase hex digits
    let slot = lower_hex(rest, 4)?;
    (!name.is_empty()).then_some((name, slot as u32))
}

/// Where `session`'s shared hold of `name` is held: a lock key of its own
/// (`<name>//r/<session:016x>`), one per session, as a slot is one per
/// permit. A shared hold's grant compares `name` not held exclusively, and
/// an exclusive grant of `name` compares everything under `<name>//`
/// absent, so a writer is never beside a reader; readers never compare each
/// other and hold together.
pub fn reader_key(name: &str, session: i64) -> String {
    // a session id is a lease id: spelled as its 64 bits, so no two differ
    // only in a sign
    format!("{name}{READERS}{:016x}", session as u64)
}

/// Every shared hold of `name`: a prefix of lock keys.
pub fn readers_of(name: &str) -> String {
    format!("{name}{READERS}")
}

/// What sets a shared hold's lock key apart: `<name>//r/<session:016x>`.
pub const READERS: &str = "//r/";

/// What sets a slot's lock key apart: `<name>//s/<slot:04x>`.
pub const SLOTS: &str = "//s/";

/// Whether `key` (a lock key, or a holder record's key) is a prefix of
/// several holds, to watch as one: a semaphore's slots ([`slots_of`]) or a
/// lock's shared holds ([`readers_of`]). No lock key ends so.
pub fn is_holds_prefix(key: &str) -> bool {
    key.ends_with(SLOTS) || key.ends_with(READERS)
}

/// Everything held under `name` besides its exclusive hold (its shared
/// holds, or its semaphore slots): the range an exclusive grant of `name`
/// compares empty.
pub fn under_name(name: &str) -> String {
    format!("{name}//")
}

/// The name and session a shared hold's lock key names; `None` for any
/// other key.
pub fn split_reader(key: &str) -> Option<(&str, i64)> {
    let (name, rest) = key.split_once(READERS)?;
    // exactly as `reader_key` spells it: sixteen lowercase hex digits
    let session = lower_hex(rest, 16)?;
    (!name.is_empty()).then_some((name, session as i64))
}

/// How a lock key is held, from its spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HoldKind {
    /// A lock's exclusive hold: the key as its caller named it.
    Exclusive,
    /// A session's shared hold of a lock ([`reader_key`]).
    Shared,
    /// A slot of a semaphore ([`slot_key`]).
    Slot,
}

/// How `key` is held, and the name its caller asked for.
pub fn hold_kind(key: &str) -> (HoldKind, &str) {
    if let Some((name, _)) = split_slot(key) {
        return (HoldKind::Slot, name);
    }
    if let Some((name, _)) = split_reader(key) {
        return (HoldKind::Shared, name);
    }
    (HoldKind::Exclusive, key)
}

/// The key a hold is on as its caller named it: the semaphore's name for a
/// slot, the lock's for a shared hold, the key itself otherwise.
pub fn named_key(key: &str) -> &str {
    hold_kind(key).1
}

/// The index of a quota place from its key's last segment (`{index:04x}`).
pub fn quota_place_index(key: &str) -> Option<u32> {
    let last = key.rsplit('/').next()?;
    (last.len() == 4).then(|| u32::from_str_radix(last, 16).ok())?
}

/// A candidate's rank in its record's key: higher priorities sort first.
pub fn candidate_rank(priority: u32) -> u32 {
    u32::MAX - priority
}

/// An election's candidates below its prefix ([`Layout::election`]):
/// `c/<rank:08x>/<session:016x>`.
pub const CANDIDATES: &str = "c/";

/// `session`'s candidate record at `priority` below its election's
/// candidates prefix ([`Layout::candidates`]): `<rank:08x>/<session:016x>`
/// ([`candidate_rank`]).
pub fn candidate_entry(priority: u32, session: i64) -> String {
    format!("{:08x}/{session:016x}", candidate_rank(priority))
}

/// `session`'s candidate record at `priority` below its election's prefix
/// ([`Layout::election`]): `c/<rank:08x>/<session:016x>`.
pub fn election_candidate(priority: u32, session: i64) -> String {
    format!("{CANDIDATES}{}", candidate_entry(priority, session))
}

/// The priority and session a candidate's key below its election's
/// candidates prefix names ([`candidate_entry`]); `None` for any other
/// key.
pub fn split_candidate_entry(entry: &str) -> Option<(u32, i64)> {
    let (rank, session) = entry.split_once('/')?;
    let rank = lower_hex(rank, 8).and_then(|r| u32::try_from(r).ok())?;
    // a session is a lease id, spelled as `{:016x}` spells an i64: its 64 bits
    let session = lower_hex(session, 16)? as i64;
    Some((u32::MAX - rank, session))
}

/// `digits` as `{:0<width>x}` spells a number: exactly `width` lowercase
/// hex digits.
fn lower_hex(digits: &str, width: usize) -> Option<u64> {
    let spelled = digits.len() == width
        && digits
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    spelled.then(|| u64::from_str_radix(digits, 16).ok())?
}

/// The leader of an election (`e/<name>//lead`, on the leader's session
/// lease). Proclaim rewrites it with a new value; the leadership itself is
/// the term record's mod revision (the token's revision).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeadRecord {
    pub identity: String,
    pub session: i64,
    pub class: String,
    /// The epoch the term started in (its token's and its term's).
    pub epoch: u32,
    /// The term's count ([`TermRecord::count`]): the term is
    /// [`term_of`]`(epoch, count)`.
    pub count: u32,
    pub value: String,
    pub priority: u32,
    /// When the term started, by the granting arbiter's wall clock.
    pub since_unix_ms: i64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    /// The grant subject, when not the identity itself (as in
    /// [`HolderRecord::bound`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub bound: String,
    /// The leader's class asks it to yield to a higher-priority candidate
    /// (`yieldToHigherPriority`): observers are told when one stands.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub yields: bool,
}

impl LeadRecord {
    /// The term as callers see it.
    pub fn term(&self) -> u64 {
        term_of(self.epoch, self.count)
    }

    /// Whom the leadership counts against: the subject it was granted under.
    pub fn bounded_as(&self) -> &str {
        if self.bound.is_empty() {
            &self.identity
        } else {
            &self.bound
        }
    }
}

/// How a term ended by a write, not by its session's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum TermEnd {
    /// Resigned with no candidate to take over.
    Resigned,
    /// Ended by an approved force-release (admin.v1): the leader record was
    /// deleted and the leader's session left running.
    Forced,
}

/// An election's term record (`e/<name>//term`, on no lease): written by
/// every transaction that starts or ends a term, never by a proclamation,
/// and deleted only by an epoch advance. Every such transaction compares
/// its mod revision, so it sees every term start since its read; while a
/// leader leads, the record's mod revision is the leadership's revision
/// (its token's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TermRecord {
    /// Leaderships of the election in this epoch: the low 32 bits of the term.
    pub count: u32,
    /// How the last term ended, when a write ended it with no successor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<TermEnd>,
    /// The grant subject the record counts against (the first leader's):
    /// its entry below [`Layout::elections_of`].
    pub subject: String,
}

/// The term callers see: `epoch * 2^32 + count`.
pub fn term_of(epoch: u32, count: u32) -> u64 {
    (u64::from(epoch) << 32) | u64::from(count)
}

impl CandidateRecord {
    /// Whom a leadership of this candidate counts against.
    pub fn bounded_as(&self) -> &str {
        if self.bound.is_empty() {
            &self.identity
        } else {
            &self.bound
        }
    }
}

/// A candidate of an election (`e/<name>//c/<rank>/<lease>`, on its
/// session's lease). `wait_ms` is how long its call waits, as in
/// [`WaiterRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CandidateRecord {
    pub identity: String,
    pub session: i64,
    pub class: String,
    pub value: String,
    pub priority: u32,
    pub since_unix_ms: i64,
    pub wait_ms: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub bound: String,
    /// As [`LeadRecord::yields`], for the leadership this candidate would
    /// start (from its own class).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub yields: bool,
}

/// A session's entry's name below its subject's entries (the last segment
/// of [`Layout::identity_session`]): the lease, 16 hex digits.
pub fn session_entry_name(session: i64) -> String {
    format!("{session:016x}")
}

/// The grant subject and session (lease) of a session entry, from its key
/// below [`Layout::session_index`] (`{hex(subject)}/{lease:016x}`); `None`
/// for a key no arbiter wrote.
pub fn session_entry(key: &str) -> Option<(String, i64)> {
    let (hex, lease) = key.split_once('/')?;
    if hex.len() % 2 != 0 || lease.len() != 16 {
        return None;
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    let lease = i64::from_str_radix(lease, 16).ok()?;
    Some((String::from_utf8(bytes).ok()?, lease))
}

/// Why a hold is not the caller's to release or hand over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotOwned {
    /// Not held by the caller's session, or not by the caller's identity:
    /// one answer for both, so a session id is no oracle.
    NotHeld,
    /// The caller's own hold, but not at the token's revision.
    TokenMismatch,
}

/// Whether the hold at `mod_revision` on `lease`, recorded as `record`, is
/// `identity`'s hold through `session` at `revision`. Both the lease and the
/// record must name the session: a token and a session id read from
/// somewhere are not ownership.
pub fn check_owner(
    record: Option<&HolderRecord>,
    lease: i64,
    mod_revision: i64,
    identity: &str,
    session: i64,
    revision: i64,
) -> Result<(), NotOwned> {
    match record {
        Some(r) if r.identity == identity && r.session == session && lease == session => {
            if mod_revision == revision {
                Ok(())
            } else {
                Err(NotOwned::TokenMismatch)
            }
        }
        _ => Err(NotOwned::NotHeld),
    }
}

pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_key_names_its_lock_and_session() {
        let key = reader_key("jobs/batch", 0x1a2b);
        assert_eq!(key, "jobs/batch//r/0000000000001a2b");
        assert_eq!(split_reader(&key), Some(("jobs/batch", 0x1a2b)));
        assert_eq!(hold_kind(&key), (HoldKind::Shared, "jobs/batch"));
        assert_eq!(named_key(&key), "jobs/batch");
        assert!(key.starts_with(&readers_of("jobs/batch")));
        assert!(key.starts_with(&under_name("jobs/batch")));
        assert!(slot_key("jobs/batch", 3).starts_with(&under_name("jobs/batch")));
        // a negative session keeps its own spelling
        assert_eq!(split_reader(&reader_key("a", -5)), Some(("a", -5)));
        assert_eq!(split_reader("jobs/batch"), None);
        assert_eq!(split_reader("a//r/1a2b"), None);
        assert_eq!(split_reader("//r/0000000000001a2b"), None);
        assert_eq!(split_reader("a//r/0000000000001A2B"), None);
        assert_eq!(hold_kind("a"), (HoldKind::Exclusive, "a"));
        assert_eq!(hold_kind(&slot_key("a", 1)), (HoldKind::Slot, "a"));
    }

    #[test]
    fn a_slot_key_names_its_semaphore_and_slot() {
        let key = slot_key("jobs/batch", 7);
        assert_eq!(key, "jobs/batch//s/0007");
        assert_eq!(split_slot(&key), Some(("jobs/batch", 7)));
        assert_eq!(named_key(&key), "jobs/batch");
        assert!(key.starts_with(&slots_of("jobs/batch")));
        assert_eq!(split_slot(&slot_key("a", 255)), Some(("a", 255)));
        // a lock's own key is no slot, and no lock key has `//`
        assert_eq!(split_slot("jobs/batch"), None);
        assert_eq!(named_key("jobs/s/0007"), "jobs/s/0007");
        assert_eq!(split_slot("a//s/07"), None);
        assert_eq!(split_slot("//s/0001"), None);
        assert_eq!(split_slot("a//s/+fff"), None);
        assert_eq!(split_slot("a//s/00FF"), None);
        assert_eq!(split_slot("a//s/00ff"), Some(("a", 255)));
    }

    #[test]
    fn session_bytes_are_stable() {
        let r = SessionRecord {
            identity: "spiffe://td/w".into(),
            ttl_seconds: 15,
        };
        assert_eq!(encode(&r), encode(&r.clone()));
        assert_eq!(
            String::from_utf8_lossy(&encode(&r)),
            r#"{"identity":"spiffe://td/w","ttlSeconds":15}"#
        );
    }

    #[test]
    fn map_fence_records_are_twenty_digits() {
        assert_eq!(encode_map_fence(3), b"00000000000000000003");
        assert_eq!(encode_map_fence(u64::MAX), b"18446744073709551615");
        for version in [0, 3, 1 << 40, u64::MAX] {
            assert_eq!(decode_map_fence(&encode_map_fence(version)), Some(version));
        }
        for bad in [
            &b"3"[..],
            b"",
            b"0000000000000000000x",
            b" 0000000000000000003",
            b"+0000000000000000003",
            b"000000000000000000003",
            // 20 digits above u64::MAX
            b"99999999999999999999",
        ] {
            assert_eq!(decode_map_fence(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn layout() {
        let l = Layout::new("/latchkey/");
        assert_eq!(l.holder("a/b"), "/latchkey/l/a/b");
        assert_eq!(l.map_fence(), "/latchkey/sys/shardmap");
        assert_eq!(l.session(255), "/latchkey/s/00000000000000ff");
        assert_eq!(l.claim("a/b", 16), "/latchkey/c/a/b//0000000000000010");
        // key "a"'s claims are no prefix of key "a/b"'s
        assert!(!l.claim("a/b", 16).starts_with(&l.claims_of("a")));
        assert_eq!(l.identity_sessions("s://a"), "/latchkey/si/733a2f2f61/");
        assert_eq!(
            l.identity_session("s://a", 1),
            "/latchkey/si/733a2f2f61/0000000000000001"
        );
        assert!(
            l.identity_session("s://a", 0x1f)
                .ends_with(&session_entry_name(0x1f))
        );
        // an entry's key names its subject and session again
        let entry = l.identity_session("spiffe://td/a/*", 0x1f);
        let below = entry.strip_prefix(&l.session_index()).unwrap_or_default();
        assert_eq!(
            session_entry(below),
            Some(("spiffe://td/a/*".to_string(), 0x1f))
        );
        for bad in [
            "",
            "zz/0000000000000001",
            "733/0000000000000001",
            "73/1",
            "73",
        ] {
            assert_eq!(session_entry(bad), None, "{bad:?}");
        }
        // "spiffe://td/a" is a string prefix of "spiffe://td/a/b"; their entries are not
        assert!(
            !l.identity_session("spiffe://td/a/b", 1)
                .starts_with(&l.identity_sessions("spiffe://td/a"))
        );
    }

    /// Every key of the layout, by what names it.
    fn every_key(l: &Layout) -> Vec<(&'static str, String)> {
        let (key, name, subject) = ("jobs/a", "ns/leader", "spiffe://td/a/*");
        vec![
            ("under", l.under("sys/force/x")),
            ("epoch", l.epoch()),
            ("seal", l.seal()),
            ("coord_seen", l.coord_seen()),
            ("map_fence", l.map_fence()),
            ("session", l.session(0x1f)),
            ("sessions", l.sessions()),
            ("shadow_mark", l.shadow_mark(0x1f, "shard-1")),
            ("shadow_marks", l.shadow_marks(0x1f)),
            ("shadow_vouch", l.shadow_vouch(0x1f)),
            ("identity_session", l.identity_session(subject, 0x1f)),
            ("identity_sessions", l.identity_sessions(subject)),
            ("session_index", l.session_index()),
            ("holder", l.holder(key)),
            ("holder of a slot", l.holder(&slot_key(key, 2))),
            ("holder of a reader", l.holder(&reader_key(key, 0x1f))),
            ("holders", l.holders()),
            ("claim", l.claim(key, 16)),
            ("claims_of", l.claims_of(key)),
            ("claims", l.claims()),
            ("queue_of", l.queue_of(key)),
            ("waiter", l.waiter(key, 0x1f)),
            ("intents_of", l.intents_of(key)),
            ("intent", l.intent(key, 0x1f)),
            ("durable_waiters", l.durable_waiters()),
            ("election", l.election(name)),
            ("election_lead", l.election_lead(name)),
            ("election_term", l.election_term(name)),
            ("candidates", l.candidates(name)),
            ("candidate", l.candidate(name, 7, 0xab)),
            ("leadership_entry", l.leadership_entry(subject, name)),
            ("leaderships_of", l.leaderships_of(subject)),
            ("election_entry", l.election_entry(subject, name)),
            ("elections_of", l.elections_of(subject)),
            ("quota_places", l.quota_places("batch", subject)),
            ("quota_place", l.quota_place("batch", subject, 3)),
            ("all_intents", l.all_intents()),
            ("all_quota_places", l.all_quota_places()),
            ("elections", l.elections()),
        ]
    }

    #[test]
    fn every_bare_key_is_the_prefixed_key_below_its_prefix() {
        let bare = every_key(&Layout::bare());
        for prefix in ["/latchkey", "/latchkey/", "/p", "/a/b/", "", "/"] {
            let below = format!("{}/", prefix.trim_end_matches('/'));
            let prefixed = every_key(&Layout::new(prefix));
            assert_eq!(prefixed.len(), bare.len());
            for ((what, key), (_, bare)) in prefixed.iter().zip(&bare) {
                assert_eq!(
                    key.strip_prefix(&below),
                    Some(bare.as_str()),
                    "{what} {prefix:?}"
                );
            }
        }
        // the bare names are the `keys` module's, as a reader that strips
        // the prefix matches them
        let l = Layout::bare();
        assert_eq!(l.under("sys/force/x"), "sys/force/x");
        assert_eq!(l.epoch(), keys::EPOCH);
        assert_eq!(l.seal(), keys::SEAL);
        assert_eq!(l.coord_seen(), keys::COORD_SEEN);
        assert_eq!(l.map_fence(), keys::MAP_FENCE);
        assert_eq!(l.session_index(), keys::SESSION_INDEX);
        assert_eq!(l.holders(), keys::HOLDERS);
        assert_eq!(l.claims(), keys::CLAIMS);
        assert_eq!(l.durable_waiters(), keys::QUEUES);
        assert_eq!(l.all_intents(), keys::INTENTS);
        assert_eq!(l.all_quota_places(), keys::QUOTA_PLACES);
        assert_eq!(l.elections(), keys::ELECTIONS);
        assert_eq!(l.sessions(), keys::SESSIONS);
        assert!(l.session(1).starts_with(&l.sessions()));
        assert!(l.shadow_marks(1).starts_with(keys::SHADOW_MARKS));
        // the spellings, byte for byte
        let spelled: Vec<(&str, &str)> = vec![
            ("session", "s/000000000000001f"),
            ("shadow_mark", "sh/000000000000001f/shard-1"),
            ("shadow_vouch", "sh/000000000000001f/#all"),
            (
                "identity_session",
                "si/7370696666653a2f2f74642f612f2a/000000000000001f",
            ),
            ("holder", "l/jobs/a"),
            ("holder of a slot", "l/jobs/a//s/0002"),
            ("holder of a reader", "l/jobs/a//r/000000000000001f"),
            ("claim", "c/jobs/a//0000000000000010"),
            ("waiter", "q/jobs/a//000000000000001f"),
            ("intent", "w/jobs/a//000000000000001f"),
            ("election_lead", "e/ns/leader//lead"),
            ("election_term", "e/ns/leader//term"),
            ("candidate", "e/ns/leader//c/fffffff8/00000000000000ab"),
            (
                "leadership_entry",
                "e//i/7370696666653a2f2f74642f612f2a/ns/leader",
            ),
            (
                "election_entry",
                "e//t/7370696666653a2f2f74642f612f2a/ns/leader",
            ),
            ("quota_place", "p/batch/7370696666653a2f2f74642f612f2a/0003"),
        ];
        for (what, key) in spelled {
            let found = bare
                .iter()
                .find(|(w, _)| *w == what)
                .map(|(_, k)| k.as_str());
            assert_eq!(found, Some(key), "{what}");
        }
    }

    #[test]
    fn a_candidate_key_names_its_priority_and_session() {
        let l = Layout::new("/latchkey");
        let key = l.candidate("e", 7, 0xab);
        assert_eq!(
            key.strip_prefix(&l.election("e")),
            Some(election_candidate(7, 0xab).as_str())
        );
        assert_eq!(
            key.strip_prefix(&l.candidates("e")),
            Some(candidate_entry(7, 0xab).as_str())
        );
        assert_eq!(election_candidate(1, 0xab), "c/fffffffe/00000000000000ab");
        for (priority, session) in [(0, 1), (7, 0xab), (u32::MAX, i64::MAX), (3, -5)] {
            let entry = candidate_entry(priority, session);
            assert_eq!(split_candidate_entry(&entry), Some((priority, session)));
        }
        for bad in [
            "",
            "lead",
            "term",
            "x/yy",
            "fffffffe/ab",
            "fffffffe/00000000000000AB",
            "FFFFFFFE/00000000000000ab",
            "ffffffe/00000000000000ab",
            "fffffffe/00000000000000ab/",
            "c/fffffffe/00000000000000ab",
        ] {
            assert_eq!(split_candidate_entry(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_holds_prefix_is_a_semaphores_slots_or_a_locks_readers() {
        assert!(is_holds_prefix(&slots_of("a/b")));
        assert!(is_holds_prefix(&readers_of("a/b")));
        let l = Layout::bare();
        assert!(is_holds_prefix(&l.holder(&slots_of("a"))));
        assert!(is_holds_prefix(&l.holder(&readers_of("a"))));
        for key in [
            "a/b",
            "a//s",
            "a/s/",
            &slot_key("a", 1),
            &reader_key("a", 1),
        ] {
            assert!(!is_holds_prefix(key), "{key}");
        }
    }

    fn hold(identity: &str, session: i64) -> HolderRecord {
        HolderRecord {
            instance: String::new(),
            bound: String::new(),
            quota_place: None,
            downgraded_from: None,
            identity: identity.into(),
            session,
            class: "demo".into(),
            acquired_at_unix_ms: 1,
            annotations: BTreeMap::new(),
        }
    }

    #[test]
    fn only_the_holding_identity_and_session_own_a_hold() {
        let alice = hold("spiffe://td/alice", 7);
        assert_eq!(
            check_owner(Some(&alice), 7, 40, "spiffe://td/alice", 7, 40),
            Ok(())
        );
        // alice, wrong token: she may learn that
        assert_eq!(
            check_owner(Some(&alice), 7, 40, "spiffe://td/alice", 7, 39),
            Err(NotOwned::TokenMismatch)
        );
        // bob with alice's session and token, or with a wrong token: nothing more than NOT_HELD
        for revision in [40, 39] {
            assert_eq!(
                check_owner(Some(&alice), 7, 40, "spiffe://td/bob", 7, revision),
                Err(NotOwned::NotHeld)
            );
        }
        // another session of alice's, a record on another lease, no record
        assert_eq!(
            check_owner(Some(&alice), 7, 40, "spiffe://td/alice", 8, 40),
            Err(NotOwned::NotHeld)
        );
        assert_eq!(
            check_owner(Some(&alice), 9, 40, "spiffe://td/alice", 7, 40),
            Err(NotOwned::NotHeld)
        );
        assert_eq!(
            check_owner(None, 7, 40, "spiffe://td/alice", 7, 40),
            Err(NotOwned::NotHeld)
        );
    }
}
