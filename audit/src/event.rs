//! The audit event: one change to who holds a key, to who leads an
//! election, or to the epoch, as the lock log committed it, at (cluster
//! id, revision, key).
//!
//! Several events can share a revision (a lease expiry ends every hold on
//! it; an epoch advance drops every hold; a batched commit grants several
//! keys), never a held key: one revision changes a key at most once. A
//! semaphore's slot and a session's shared hold of a lock are lock keys of
//! their own (`<name>//s/<slot>`, `<name>//r/<session>`) whose events are
//! under the name callers use, with `detail.slot`, or `detail.mode`
//! ([`MODE_SHARED`]) and `detail.session`: so one revision can make several
//! events of one name (readers granted in one batch; a downgrade's release
//! of the key and its shared grant), and their ids are keyed by the held
//! key ([`Event::id_key`]). Events that
//! are not about a lock key use keys no lock key can have (lock keys never
//! start with `/`): [`EPOCH_KEY`], [`SEAL_KEY`], [`GAP_KEY`]. An election's
//! events ([`Kind::is_election`]) are keyed by the election's name, which
//! is a lock key's syntax, so `latchctl audit <name>` finds them; their ids
//! are keyed by `/e/<name>` ([`Event::id_key`]), so an election and a lock
//! key of the same name (both ended by one epoch advance) never share one.
//! One revision changes an election's leader record at most once, so it
//! makes at most one event per election.
//!
//! Two shapes: [`Event`] is what the tailer derives, with the log's
//! revisions, and lives only in its memory; [`RecordedEvent`] is what the
//! store keeps and readers get. A grant's token is `epoch * 2^48 +
//! revision` and the epoch is guessable, so a stored revision would be a
//! stored token: the store keeps keyed ids instead ([`crate::pseudonym`]),
//! and orders events by `position`, the time the tailer first wrote them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::pseudonym::{self, AuditKey, NeedsKey};

/// The key of an epoch record's events (create, advance).
pub const EPOCH_KEY: &str = "/sys/epoch";
/// The key of a seal's event.
pub const SEAL_KEY: &str = "/sys/seal";
/// The key of a gap's event (at the gap's first revision).
pub const GAP_KEY: &str = "/gap";
/// What an election's event ids are keyed by: this, then the name.
const ELECTION_ID_PREFIX: &str = "/e/";
/// `detail.mode` of a shared hold's events (with `detail.session`, the
/// session whose hold it is): they are under the lock's name.
pub const MODE_SHARED: &str = "shared";

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// A hold was written where there was none.
    Grant,
    /// A hold was written over another session's hold (the release that
    /// handed it straight to the next waiter).
    HandOver,
    /// A hold was deleted by its holder ([`Ended::Released`]), with its
    /// closed session ([`Ended::SessionClosed`]) or with a session an
    /// operator's force-release revoked ([`Ended::ForceRevoked`]).
    Release,
    /// A hold ended with its session's lease ([`Ended::ExpiredOrRevoked`]).
    Expiry,
    /// An operator deleted a hold (ADR-20): the deletion came with a
    /// `sys/force` record in the same revision.
    ForceRelease,
    /// The first epoch record.
    EpochCreate,
    /// The epoch moved on; one event on [`EPOCH_KEY`] and one per hold it
    /// dropped ([`Ended::EpochAdvance`]).
    EpochAdvance,
    /// An arbiter sealed the log (a restore was seen).
    EpochSeal,
    /// Revisions the tailer could not read (etcd compacted them first).
    Gap,
    /// A term of an election started: a campaign over a vacancy, or a
    /// hand-over (a resignation to a successor, a transfer), which ends the
    /// last term in the same revision and is this one event (`prev_identity`
    /// and `detail.previousTerm` name the term it ended), as Observe tells it.
    TermStart,
    /// An election's leader proclaimed a new value.
    Proclaim,
    /// An election's term ended with no successor; `ended` says why:
    /// [`Ended::Resigned`], [`Ended::SessionEnded`], [`Ended::ForceReleased`]
    /// or [`Ended::EpochAdvance`].
    Vacancy,
}

impl Kind {
    pub const ALL: [Kind; 12] = [
        Kind::Grant,
        Kind::HandOver,
        Kind::Release,
        Kind::Expiry,
        Kind::ForceRelease,
        Kind::EpochCreate,
        Kind::EpochAdvance,
        Kind::EpochSeal,
        Kind::Gap,
        Kind::TermStart,
        Kind::Proclaim,
        Kind::Vacancy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Grant => "grant",
            Kind::HandOver => "hand-over",
            Kind::Release => "release",
            Kind::Expiry => "expiry",
            Kind::ForceRelease => "force-release",
            Kind::EpochCreate => "epoch-create",
            Kind::EpochAdvance => "epoch-advance",
            Kind::EpochSeal => "epoch-seal",
            Kind::Gap => "gap",
            Kind::TermStart => "term-start",
            Kind::Proclaim => "proclaim",
            Kind::Vacancy => "vacancy",
        }
    }

    /// An election's event: keyed by the election's name, about no hold.
    pub fn is_election(self) -> bool {
        matches!(self, Kind::TermStart | Kind::Proclaim | Kind::Vacancy)
    }
}

/// Why a hold ended, as far as the log can tell: where two causes write
/// the same revision, the value names both rather than guessing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Ended {
    /// The event ends no hold (a grant, an epoch or gap event).
    #[default]
    No,
    /// Deleted while its session lived: the holder's release, or the
    /// arbiter's release of a grant whose caller went away.
    Released,
    /// Deleted after its session's record was: CloseSession deletes the
    /// record, then revokes the lease (or, if the revoke failed, the lease
    /// lapses); both end every hold left on it.
    SessionClosed,
    /// Deleted with its session's record in one revision: the lease lapsed
    /// (no renewal for a TTL) or someone revoked it outside CloseSession;
    /// etcd writes the same revision for both.
    ExpiredOrRevoked,
    /// Deleted by an operator's force-release.
    ForceReleased,
    /// Deleted with a session an operator's force-release revoked: the
    /// arbiter deleted the session's record and wrote a `sys/revoked/`
    /// marker in one revision, then revoked the lease.
    ForceRevoked,
    /// Dropped by an epoch advance.
    EpochAdvance,
    /// Handed over to another session.
    HandedOver,
    /// The tailer did not know the hold (it started after it, or after a gap).
    Unknown,
    /// An election's leader resigned with no candidate to take over.
    Resigned,
    /// An election's leader record went with its session (closed, lapsed
    /// or revoked: the log records no cause), with no write ending the term.
    SessionEnded,
}

impl Ended {
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::No => "",
            Ended::Released => "released",
            Ended::SessionClosed => "session-closed",
            Ended::ExpiredOrRevoked => "expired-or-revoked",
            Ended::ForceReleased => "force-released",
            Ended::ForceRevoked => "force-revoked",
            Ended::EpochAdvance => "epoch-advance",
            Ended::HandedOver => "handed-over",
            Ended::Unknown => "unknown",
            Ended::Resigned => "resigned",
            Ended::SessionEnded => "session-ended",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown event {what} {value:?}")]
pub struct UnknownName {
    what: &'static str,
    value: String,
}

impl FromStr for Kind {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Kind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownName {
                what: "kind",
                value: s.into(),
            })
    }
}

impl FromStr for Ended {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            Ended::No,
            Ended::Released,
            Ended::SessionClosed,
            Ended::ExpiredOrRevoked,
            Ended::ForceReleased,
            Ended::ForceRevoked,
            Ended::EpochAdvance,
            Ended::HandedOver,
            Ended::Unknown,
            Ended::Resigned,
            Ended::SessionEnded,
        ]
        .into_iter()
        .find(|e| e.as_str() == s)
        .ok_or_else(|| UnknownName {
            what: "ending",
            value: s.into(),
        })
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event, as derived from one revision of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub revision: i64,
    /// The lock key, or one of the `/…` keys above.
    pub key: String,
    pub kind: Kind,
    pub ended: Ended,
    /// The epoch in force at this revision (0 before the first record).
    pub epoch: u32,
    /// The holder: the new one for a grant or hand-over, the one whose hold
    /// ended otherwise; for an election's event its leader (the new one
    /// for a term start, the one whose term ended for a vacancy). Empty
    /// when not about a hold or a leader, or not known.
    pub identity: String,
    /// The holder's session (its etcd lease); 0 for an election's events,
    /// which keep no session, as Observe tells none.
    pub session: i64,
    pub class: String,
    /// The revision of the hold this event is about: the grant's own
    /// revision for a grant, the ended (or handed-over) hold's grant
    /// revision otherwise. Links an end to its grant.
    pub hold_revision: i64,
    /// A hand-over's previous holder.
    pub prev_identity: String,
    pub prev_session: i64,
    /// Kind-specific facts as a JSON object: reasons, the force-release's
    /// operators, a gap's last revision.
    pub detail: serde_json::Value,
}

impl Event {
    /// An event with only its position and kind filled in.
    pub fn new(revision: i64, key: impl Into<String>, kind: Kind, epoch: u32) -> Self {
        Self {
            revision,
            key: key.into(),
            kind,
            ended: Ended::No,
            epoch,
            identity: String::new(),
            session: 0,
            class: String::new(),
            hold_revision: 0,
            prev_identity: String::new(),
            prev_session: 0,
            detail: serde_json::Value::Object(Default::default()),
        }
    }

    /// The gap event: revisions `from..=to` were compacted before the
    /// tailer read them. The detail says how many, not which: the bounds
    /// are revisions, and a revision may be a live grant's.
    pub fn gap(from: i64, to: i64, epoch: u32) -> Self {
        let mut event = Event::new(from, GAP_KEY, Kind::Gap, epoch);
        let revisions = to.saturating_sub(from).saturating_add(1);
        event.detail = serde_json::json!({ "revisions": revisions, "cause": "compacted" });
        event
    }

    /// What the event's id is keyed by: its key, or for an election's
    /// event `/e/<name>` (no lock key starts with `/`, and no other event
    /// key with `/e/`), so an election's events and a lock key's of the
    /// same name and revision have ids of their own.
    pub fn id_key(&self) -> std::borrow::Cow<'_, str> {
        if self.kind.is_election() {
            format!("{ELECTION_ID_PREFIX}{}", self.key).into()
        } else {
            self.held_key()
        }
    }

    /// The lock key the hold is on: a semaphore slot's own key (its name
    /// and `detail.slot`), or a shared hold's (the lock's name,
    /// `detail.mode` shared and `detail.session`), so two slots of one
    /// semaphore, or two readers of one lock, changing at one revision are
    /// two events and two holds (the hostile review: with the name alone
    /// their ids collided and a store kept one of them).
    fn held_key(&self) -> std::borrow::Cow<'_, str> {
        if let Some(slot) = self.detail.get("slot").and_then(serde_json::Value::as_u64) {
            return latchkey_records::slot_key(&self.key, u32::try_from(slot).unwrap_or(u32::MAX))
                .into();
        }
        let shared =
            self.detail.get("mode").and_then(serde_json::Value::as_str) == Some(MODE_SHARED);
        match self
            .detail
            .get("session")
            .and_then(serde_json::Value::as_i64)
        {
            Some(session) if shared => latchkey_records::reader_key(&self.key, session).into(),
            _ => self.key.as_str().into(),
        }
    }

    /// (hold id, previous hold id) as the store keeps them: the hold this
    /// event starts or ends, and for a hand-over the one it ended; none
    /// for an election's event (its term, in the detail, links its start,
    /// proclamations and end).
    fn hold_ids(
        &self,
        audit_key: Option<&AuditKey>,
        cluster_id: u64,
    ) -> Result<(String, String), NeedsKey> {
        let held = self.held_key();
        let id = |revision| pseudonym::hold_id(audit_key, cluster_id, revision, &held);
        Ok(match self.kind {
            k if k.is_election() => (String::new(), String::new()),
            Kind::Grant => (id(self.revision)?, String::new()),
            Kind::HandOver => (id(self.revision)?, id(self.hold_revision)?),
            _ => (id(self.hold_revision)?, String::new()),
        })
    }

    /// The detail as JSON text (what the stores keep).
    pub fn detail_text(&self) -> String {
        self.detail.to_string()
    }
}

/// An event as the store keeps it: no revision, ids instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedEvent {
    /// Keyed by the lock key and the revision: the same on every replay,
    /// so a copy is ignored; says nothing of the revision.
    pub event_id: String,
    pub key: String,
    pub kind: Kind,
    pub ended: Ended,
    pub epoch: u32,
    pub identity: String,
    pub session: i64,
    pub class: String,
    /// The hold this event is about: the new hold of a grant or hand-over,
    /// the ended one otherwise; a grant and its end share it. Empty when
    /// not about a hold, or the tailer never saw the hold granted.
    pub hold_id: String,
    /// A hand-over's previous hold (the one it ended).
    pub prev_hold_id: String,
    pub prev_identity: String,
    pub prev_session: i64,
    pub detail: serde_json::Value,
}

/// An event as a store returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub cluster_id: u64,
    pub event: RecordedEvent,
    /// The order events were first written in (microseconds since the
    /// epoch, strictly rising per writer): the log's order, since the
    /// tailer writes revisions in order.
    pub position: i64,
    /// When the tailer first wrote it (the log keeps no commit time; the
    /// tailer's lag bounds the difference).
    pub observed_at_unix_ms: i64,
}

/// A row as both stores' JSON speaks it (ClickHouse's JSONEachRow).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Row {
    #[serde(deserialize_with = "number_or_string")]
    pub cluster_id: u64,
    pub event_id: String,
    #[serde(deserialize_with = "number_or_string")]
    pub position: i64,
    pub key: String,
    pub kind: String,
    pub ended: String,
    #[serde(deserialize_with = "number_or_string")]
    pub epoch: u32,
    pub identity: String,
    #[serde(deserialize_with = "number_or_string")]
    pub session: i64,
    pub class: String,
    pub hold_id: String,
    pub prev_hold_id: String,
    pub prev_identity: String,
    #[serde(deserialize_with = "number_or_string")]
    pub prev_session: i64,
    pub detail: String,
    #[serde(deserialize_with = "number_or_string")]
    pub observed_at_unix_ms: i64,
}

impl Row {
    /// The row of `e`, first written at `position`: ids keyed by
    /// `audit_key` (needed for every event with a real revision).
    pub fn new(
        cluster_id: u64,
        e: &Event,
        audit_key: Option<&AuditKey>,
        position: i64,
        observed_at_unix_ms: i64,
    ) -> Result<Self, NeedsKey> {
        let (hold_id, prev_hold_id) = e.hold_ids(audit_key, cluster_id)?;
        Ok(Self {
            cluster_id,
            event_id: pseudonym::event_id(audit_key, cluster_id, e.revision, &e.id_key())?,
            position,
            key: e.key.clone(),
            kind: e.kind.as_str().into(),
            ended: e.ended.as_str().into(),
            epoch: e.epoch,
            identity: e.identity.clone(),
            session: e.session,
            class: e.class.clone(),
            hold_id,
            prev_hold_id,
            prev_identity: e.prev_identity.clone(),
            prev_session: e.prev_session,
            detail: e.detail_text(),
            observed_at_unix_ms,
        })
    }

    pub fn into_stored(self) -> Result<StoredEvent, UnknownName> {
        Ok(StoredEvent {
            cluster_id: self.cluster_id,
            position: self.position,
            observed_at_unix_ms: self.observed_at_unix_ms,
            event: RecordedEvent {
                event_id: self.event_id,
                key: self.key,
                kind: self.kind.parse()?,
                ended: self.ended.parse()?,
                epoch: self.epoch,
                identity: self.identity,
                session: self.session,
                class: self.class,
                hold_id: self.hold_id,
                prev_hold_id: self.prev_hold_id,
                prev_identity: self.prev_identity,
                prev_session: self.prev_session,
                detail: serde_json::from_str(&self.detail)
                    .unwrap_or(serde_json::Value::String(self.detail)),
            },
        })
    }
}

/// ClickHouse quotes 64-bit integers in JSON output; accept both forms.
pub(crate) fn number_or_string<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: FromStr + TryFrom<i128>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Unsigned(u64),
        Signed(i64),
        Text(String),
    }
    let bad = || serde::de::Error::custom("an integer out of range");
    match Either::deserialize(d)? {
        Either::Unsigned(n) => T::try_from(i128::from(n)).map_err(|_| bad()),
        Either::Signed(n) => T::try_from(i128::from(n)).map_err(|_| bad()),
        Either::Text(s) => s.parse().map_err(|_| bad()),
    }
}

/// Strips every digit from a text the arbiter wrote for machines and
/// people (a seal's reason names revisions and high-water marks, each a
/// token's low half): the store keeps the words; the numbers are in
/// `latchctl admin status`.
pub fn without_numbers(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_number = false;
    for c in text.chars() {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(c);
        }
    }
    out
}

pub use latchkey_records::now_unix_ms;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in Kind::ALL {
            assert_eq!(kind.as_str().parse::<Kind>(), Ok(kind));
        }
        assert_eq!(
            "expired-or-revoked".parse::<Ended>(),
            Ok(Ended::ExpiredOrRevoked)
        );
        assert_eq!("force-revoked".parse::<Ended>(), Ok(Ended::ForceRevoked));
        assert!("expired".parse::<Ended>().is_err());
    }

    fn key() -> AuditKey {
        AuditKey::from_bytes(&[3u8; 32]).unwrap()
    }

    #[test]
    fn rows_read_quoted_and_plain_integers() {
        let quoted = r#"{"cluster_id":"18446744073709551615","event_id":"e","position":"7","key":"a","kind":"grant","ended":"","epoch":1,"identity":"i","session":"5","class":"c","hold_id":"h","prev_hold_id":"","prev_identity":"","prev_session":0,"detail":"{}","observed_at_unix_ms":"9"}"#;
        let row: Row = serde_json::from_str(quoted).unwrap();
        assert_eq!(row.cluster_id, u64::MAX);
        let stored = row.into_stored().unwrap();
        assert_eq!(stored.event.kind, Kind::Grant);
        assert_eq!(stored.position, 7);
        assert_eq!(stored.observed_at_unix_ms, 9);
    }

    #[test]
    fn a_row_keeps_ids_and_no_revision() {
        let k = key();
        let mut grant = Event::new(40, "ledger/inv-1", Kind::Grant, 3);
        grant.hold_revision = 40;
        let mut e = Event::new(42, "ledger/inv-1", Kind::Expiry, 3);
        e.ended = Ended::ExpiredOrRevoked;
        e.identity = "spiffe://td/w".into();
        e.session = 0x1234;
        e.hold_revision = 40;
        let grant_row = Row::new(9, &grant, Some(&k), 1, 1000).unwrap();
        let row = Row::new(9, &e, Some(&k), 2, 1000).unwrap();
        assert_eq!(
            row.hold_id, grant_row.hold_id,
            "a hold's end names its grant"
        );
        assert_ne!(row.event_id, grant_row.event_id);
        let json = serde_json::to_string(&row).unwrap();
        assert!(!json.contains("40") && !json.contains("42"), "{json}");
        let back: Row = serde_json::from_str(&json).unwrap();
        let stored = back.into_stored().unwrap();
        assert_eq!(stored.event.kind, Kind::Expiry);
        assert_eq!(stored.event.identity, "spiffe://td/w");
        assert_eq!(stored.position, 2);
        assert!(Row::new(9, &e, None, 2, 1000).is_err(), "no key, no row");
    }

    #[test]
    fn a_hand_over_names_both_holds() {
        let k = key();
        let mut h = Event::new(50, "k", Kind::HandOver, 1);
        h.hold_revision = 40;
        let row = Row::new(9, &h, Some(&k), 1, 0).unwrap();
        assert_eq!(
            row.hold_id,
            pseudonym::hold_id(Some(&k), 9, 50, "k").unwrap()
        );
        assert_eq!(
            row.prev_hold_id,
            pseudonym::hold_id(Some(&k), 9, 40, "k").unwrap()
        );
    }

    #[test]
    fn gaps_count_revisions_and_reasons_lose_numbers() {
        let gap = Event::gap(5, 9, 1);
        assert_eq!(
            gap.detail,
            serde_json::json!({"revisions": 5, "cause": "compacted"})
        );
        assert_eq!(
            without_numbers("etcd revision 1234 is below a grant of epoch 2"),
            "etcd revision N is below a grant of epoch N"
        );
    }
}
