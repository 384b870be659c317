//! From the changes of one revision to audit events.
//!
//! The tailer keeps a [`LogState`]: the holds and open sessions under the
//! prefix, and the epoch, as of the last revision it applied (loaded from a
//! read of the whole prefix at its checkpoint, then kept by the watch). A
//! revision's changes are read together, because the cause of a deletion is
//! in what else that revision did (the arbiter's transactions, see
//! `arbiter/src/lock_log/etcd/*.rs`):
//!
//! | the revision                                             | event |
//! |----------------------------------------------------------|-------|
//! | puts `l/K` where there was no hold                       | grant |
//! | puts `l/K` over another hold                             | hand-over |
//! | deletes `l/K` and puts `sys/force/<id>` naming `K`         | force-release |
//! | puts `sys/epoch` over an epoch and deletes `l/…`         | epoch-advance, per hold and on `/sys/epoch` |
//! | deletes `l/K` and the record `s/L` of its lease          | expiry, `expired-or-revoked` |
//! | deletes `l/K` of a lease with a `sys/revoked/L` marker   | release, `force-revoked` |
//! | deletes `l/K`, its session's record still there          | release, `released` |
//! | deletes `l/K`, its session's record deleted before       | release, `session-closed` |
//! | puts `e/N//term` and `e/N//lead`                          | term-start (over a vacancy, or a hand-over) |
//! | puts `e/N//lead` alone                                    | proclaim |
//! | puts `e/N//term` ended `resigned`/`forced`, deletes `e/N//lead` | vacancy, `resigned` / `force-released` |
//! | deletes `e/N//lead` alone                                 | vacancy, `session-ended` |
//! | puts `sys/epoch` over an epoch and deletes `e/N//lead`    | vacancy, `epoch-advance` |
//!
//! An election's records read as `latchkey_records::election` reads them
//! for the arbiter's Observe, so the audit's sequence for an election is
//! the one its observers were told (the e2e compares them): a hand-over is
//! one term-start, naming the term it ended; a vacancy is told only of a
//! leader the tailer knew (from its state read, or a term start it saw).
//! No event keeps the leader's session (Observe tells none), nor a
//! revision: the term (`epoch * 2^32 + count`) is no token's half.
//!
//! A lease that lapses and a lease revoked by hand delete the same keys in
//! one revision: etcd records no cause, so the event says both. CloseSession
//! is told apart because it deletes the session's record first, in a
//! revision of its own, then revokes the lease. A force-release that
//! revokes the holder's session does the same and also puts a
//! `sys/revoked/L` marker with the record's deletion, so its holds end as
//! `force-revoked`.

use std::collections::{HashMap, HashSet};

use crate::records::{EpochRecord, HolderRecord, SealRecord, decode};
use latchkey_records::LeadRecord;
use latchkey_records::election::{RecordChange, TermChange, Vacancy, term_changes};
use latchkey_records::keys;

use crate::event::{EPOCH_KEY, Ended, Event, Kind, MODE_SHARED, SEAL_KEY, without_numbers};
use crate::force::{self, ForceRecord, RevokeRecord};

/// A put or a delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Put,
    Delete,
}

/// One key's change in a revision; `key` is relative to the prefix
/// (`l/ledger/inv-1`, `s/00000000000000ff`, `sys/epoch`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub op: Op,
    pub key: String,
    pub value: Vec<u8>,
    /// The put's lease (0 for a delete: etcd does not say).
    pub lease: i64,
}

/// A hold as the tailer knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hold {
    identity: String,
    session: i64,
    lease: i64,
    class: String,
    /// Its grant's revision (the put's).
    revision: i64,
    /// The granting arbiter's clock: the only wall-clock time the log has.
    acquired_at_unix_ms: i64,
}

impl Hold {
    fn from_put(value: &[u8], lease: i64, revision: i64) -> Self {
        let record = decode::<HolderRecord>(value);
        Self {
            identity: record
                .as_ref()
                .map(|r| r.identity.clone())
                .unwrap_or_default(),
            session: record.as_ref().map_or(lease, |r| r.session),
            class: record.as_ref().map(|r| r.class.clone()).unwrap_or_default(),
            acquired_at_unix_ms: record.map_or(0, |r| r.acquired_at_unix_ms),
            lease,
            revision,
        }
    }
}

/// What one key of the prefix is to the audit.
enum Role<'a> {
    Hold(&'a str),
    Session(i64),
    Epoch,
    Seal,
    Force,
    Revoked(i64),
    /// An election's leader record (`e/<name>//lead`).
    Lead(&'a str),
    /// An election's term record (`e/<name>//term`).
    Term(&'a str),
    Other,
}

fn role(key: &str) -> Role<'_> {
    if let Some(lock_key) = key.strip_prefix(keys::HOLDERS) {
        return Role::Hold(lock_key);
    }
    if let Some(election) = key.strip_prefix(keys::ELECTIONS) {
        // `e//…` are subjects' entries; candidates are `e/<name>//c/…`.
        return match election.split_once("//") {
            Some((name, "lead")) if !name.is_empty() => Role::Lead(name),
            Some((name, "term")) if !name.is_empty() => Role::Term(name),
            _ => Role::Other,
        };
    }
    if let Some(hex) = key.strip_prefix(keys::SESSIONS) {
        // Leases are positive i64s written as 16 hex digits.
        return match u64::from_str_radix(hex, 16) {
            Ok(lease) => Role::Session(lease as i64),
            Err(_) => Role::Other,
        };
    }
    match key {
        keys::EPOCH => Role::Epoch,
        keys::SEAL => Role::Seal,
        k if k.starts_with(force::REVOKED_DIR) => match force::parse_revoked_name(k) {
            Some(lease) => Role::Revoked(lease),
            None => Role::Other,
        },
        k if k.starts_with(force::FORCE_DIR) => Role::Force,
        _ => Role::Other,
    }
}

/// Holds, open sessions and the epoch as of one revision.
#[derive(Debug, Default, Clone)]
pub struct LogState {
    holds: HashMap<String, Hold>,
    sessions: HashSet<i64>,
    /// Leases an operator's force-release revoked (their `sys/revoked/`
    /// markers, 24 h), with what their holds' events keep of the marker.
    revoked: HashMap<i64, serde_json::Value>,
    /// `None` before the first epoch record.
    epoch: Option<u32>,
    /// Each led election's leader record, by the election's name.
    leaders: HashMap<String, LeadRecord>,
}

impl LogState {
    /// The state a read of the prefix at one revision shows: `(key relative
    /// to the prefix, value, lease, mod_revision)` per key.
    pub fn load<'a>(kvs: impl IntoIterator<Item = (&'a str, &'a [u8], i64, i64)>) -> Self {
        let mut state = Self::default();
        for (key, value, lease, mod_revision) in kvs {
            match role(key) {
                Role::Hold(lock_key) => {
                    state.holds.insert(
                        lock_key.to_string(),
                        Hold::from_put(value, lease, mod_revision),
                    );
                }
                Role::Session(lease) => {
                    state.sessions.insert(lease);
                }
                Role::Epoch => state.epoch = decode::<EpochRecord>(value).map(|r| r.epoch),
                Role::Revoked(lease) => {
                    let record = decode::<RevokeRecord>(value);
                    state
                        .revoked
                        .insert(lease, force::revoke_detail(record.as_ref()));
                }
                Role::Lead(name) => {
                    if let Some(record) = decode::<LeadRecord>(value) {
                        state.leaders.insert(name.to_string(), record);
                    }
                }
                Role::Seal | Role::Force | Role::Term(_) | Role::Other => {}
            }
        }
        state
    }

    pub fn epoch(&self) -> u32 {
        self.epoch.unwrap_or(0)
    }

    pub fn holds(&self) -> usize {
        self.holds.len()
    }

    /// Elections with a leader.
    pub fn leaders(&self) -> usize {
        self.leaders.len()
    }

    /// Applies one revision's changes and returns its events.
    pub fn apply(&mut self, revision: i64, changes: &[Change]) -> Vec<Event> {
        let mut deleted_holds = Vec::new();
        let mut put_holds = Vec::new();
        let mut sessions_deleted = HashSet::new();
        let mut sessions_put = Vec::new();
        let mut epoch_put = None;
        let mut seal_put = None;
        let mut forces: Vec<ForceRecord> = Vec::new();
        let mut revoked_deleted = Vec::new();
        // Each election's changes to its leader and term records, in order.
        // In the revision's order of first change; the index keeps grouping
        // linear when one revision ends many terms (an epoch advance).
        let mut elections: Vec<(&str, Vec<RecordChange<'_>>)> = Vec::new();
        let mut election_at: std::collections::HashMap<&str, usize> =
            std::collections::HashMap::new();
        for change in changes {
            let record_change = match (role(&change.key), change.op) {
                (Role::Term(name), Op::Put) => Some((
                    name,
                    RecordChange::TermPut {
                        value: &change.value,
                        revision,
                    },
                )),
                (Role::Lead(name), Op::Put) => Some((
                    name,
                    RecordChange::LeadPut {
                        value: &change.value,
                        revision,
                    },
                )),
                (Role::Lead(name), Op::Delete) => Some((name, RecordChange::LeadDeleted)),
                _ => None,
            };
            if let Some((name, c)) = record_change {
                match election_at.get(name) {
                    Some(&i) => elections[i].1.push(c),
                    None => {
                        election_at.insert(name, elections.len());
                        elections.push((name, vec![c]));
                    }
                }
            }
            match (role(&change.key), change.op) {
                (Role::Hold(key), Op::Delete) => deleted_holds.push(key.to_string()),
                (Role::Hold(key), Op::Put) => put_holds.push((
                    key.to_string(),
                    Hold::from_put(&change.value, change.lease, revision),
                )),
                (Role::Session(lease), Op::Delete) => {
                    sessions_deleted.insert(lease);
                }
                (Role::Session(lease), Op::Put) => sessions_put.push(lease),
                (Role::Epoch, Op::Put) => epoch_put = Some(decode::<EpochRecord>(&change.value)),
                (Role::Seal, Op::Put) => seal_put = Some(decode::<SealRecord>(&change.value)),
                (Role::Force, Op::Put) => forces.push(force_record(change)),
                (Role::Revoked(lease), Op::Put) => {
                    let record = decode::<RevokeRecord>(&change.value);
                    self.revoked
                        .insert(lease, force::revoke_detail(record.as_ref()));
                }
                (Role::Revoked(lease), Op::Delete) => revoked_deleted.push(lease),
                _ => {}
            }
        }
        let advance = epoch_put.is_some() && self.epoch.is_some();
        let before = self.epoch();
        let mut events = Vec::new();
        // An election's force record goes with the vacancy it caused (below),
        // never with a hold of the same name.
        let (election_forces, mut forces): (Vec<ForceRecord>, Vec<ForceRecord>) =
            forces.into_iter().partition(|f| f.election);

        for key in deleted_holds {
            let prev = self.holds.remove(&key);
            let force = forces
                .iter()
                .position(|f| f.key == key)
                .map(|i| forces.swap_remove(i));
            let (kind, ended) = match (&force, &prev) {
                (Some(_), _) => (Kind::ForceRelease, Ended::ForceReleased),
                (None, _) if advance => (Kind::EpochAdvance, Ended::EpochAdvance),
                (None, None) => (Kind::Release, Ended::Unknown),
                (None, Some(h)) if self.revoked.contains_key(&h.lease) => {
                    (Kind::Release, Ended::ForceRevoked)
                }
                (None, Some(h)) if sessions_deleted.contains(&h.lease) => {
                    (Kind::Expiry, Ended::ExpiredOrRevoked)
                }
                (None, Some(h)) if self.sessions.contains(&h.lease) => {
                    (Kind::Release, Ended::Released)
                }
                (None, Some(_)) => (Kind::Release, Ended::SessionClosed),
            };
            let mut event = Event::new(revision, key, kind, before);
            event.ended = ended;
            if let Some(h) = &prev {
                holder_into(&mut event, h);
            }
            if let Some(f) = &force {
                force_into(&mut event, f, prev.is_some());
            } else if ended == Ended::ForceRevoked
                && let Some(detail) = prev.as_ref().and_then(|h| self.revoked.get(&h.lease))
            {
                event.detail = detail.clone();
            }
            events.push(event);
        }
        // A force record whose hold was not deleted with it (written by
        // hand, or the hold was gone): still the operators' act, recorded.
        for f in forces {
            let mut event = Event::new(revision, f.key.clone(), Kind::ForceRelease, before);
            event.ended = Ended::ForceReleased;
            force_into(&mut event, &f, false);
            events.push(event);
        }

        let after = epoch_put
            .as_ref()
            .map_or(before, |r| r.as_ref().map_or(before, |r| r.epoch));
        for (key, hold) in put_holds {
            let prev = self.holds.insert(key.clone(), hold.clone());
            let mut event = Event::new(revision, key, Kind::Grant, after);
            holder_into(&mut event, &hold);
            event.detail = serde_json::json!({ "acquiredAtUnixMs": hold.acquired_at_unix_ms });
            if let Some(p) = prev {
                event.kind = Kind::HandOver;
                event.hold_revision = p.revision;
                event.prev_identity = p.identity;
                event.prev_session = p.session;
            }
            events.push(event);
        }

        for (name, election_changes) in elections {
            for change in term_changes(election_changes) {
                events.extend(self.term_change(revision, name, change, advance, before, after));
            }
        }
        // The operators' act, on the forced vacancy of the same revision (no
        // session: election events keep none). A vacancy the tailer could
        // not tell (it did not know the leader) has no event, as Observe.
        for f in election_forces {
            if let Some(event) = events.iter_mut().find(|e| {
                e.kind == Kind::Vacancy && e.key == f.key && e.ended == Ended::ForceReleased
            }) {
                let mut detail = force::detail(&f);
                if let (Some(map), Some(own)) = (detail.as_object_mut(), event.detail.as_object()) {
                    for (k, v) in own {
                        map.insert(k.clone(), v.clone());
                    }
                }
                event.detail = detail;
            }
        }

        for lease in sessions_deleted {
            self.sessions.remove(&lease);
        }
        for lease in revoked_deleted {
            self.revoked.remove(&lease);
        }
        self.sessions.extend(sessions_put);

        if let Some(record) = epoch_put {
            let kind = if advance {
                Kind::EpochAdvance
            } else {
                Kind::EpochCreate
            };
            let mut event = Event::new(revision, EPOCH_KEY, kind, after);
            event.detail = match &record {
                Some(r) => serde_json::json!({
                    "previousEpoch": self.epoch,
                    "reason": r.reason,
                    "clusterId": r.cluster_id,
                }),
                None => serde_json::json!({ "undecodable": true }),
            };
            if let Some(r) = record {
                self.epoch = Some(r.epoch);
            }
            events.push(event);
        }
        if let Some(record) = seal_put {
            let mut event = Event::new(revision, SEAL_KEY, Kind::EpochSeal, self.epoch());
            event.detail = match record {
                // The reason names revisions (each a token's low half).
                Some(r) => serde_json::json!({
                    "reason": without_numbers(&r.reason),
                    "nextEpochAtLeast": r.next_epoch_at_least,
                }),
                None => serde_json::json!({ "undecodable": true }),
            };
            events.push(event);
        }
        mark_downgrades(&mut events);
        for event in &mut events {
            named_as_called(event);
        }
        events
    }
}

/// A semaphore's slot (`<name>//s/<slot>`) and a session's shared hold of a
/// lock (`<name>//r/<session>`) are each held on a lock key of their own:
/// their events (grant, release, expiry, force-release, epoch-advance) are
/// the semaphore's or the lock's, under the name callers use (so `latchctl
/// audit` and `why` of the name find them), with the slot, or `mode:
/// "shared"` and the session, in the detail. Their ids stay keyed by the
/// held key ([`Event::id_key`]), which the detail spells back.
fn named_as_called(event: &mut Event) {
    let (name, facts) = if let Some((name, slot)) = latchkey_records::split_slot(&event.key) {
        (name, vec![("slot", serde_json::Value::from(slot))])
    } else if let Some((name, session)) = latchkey_records::split_reader(&event.key) {
        (
            name,
            vec![
                ("mode", serde_json::Value::from(MODE_SHARED)),
                ("session", serde_json::Value::from(session)),
            ],
        )
    } else {
        return;
    };
    let name = name.to_string();
    if !event.detail.is_object() {
        event.detail = serde_json::Value::Object(Default::default());
    }
    if let Some(detail) = event.detail.as_object_mut() {
        for (field, value) in facts {
            detail.insert(field.into(), value);
        }
    }
    event.key = name;
}

/// A downgrade (`table/shared.rs`) deletes a session's exclusive hold of
/// `K` and puts its shared hold `K//r/<session>` in one transaction: the
/// release of `K` and the grant of the shared hold, at one revision, by one
/// session. Both events say `downgrade: true`, so the release reads as the
/// same holder keeping the key shared (no writer came between), not as a
/// release the holder asked for. Runs before [`named_as_called`], on the
/// held keys.
fn mark_downgrades(events: &mut [Event]) {
    use latchkey_records::{HoldKind, hold_kind, split_reader};
    let released: HashSet<(&str, i64)> = events
        .iter()
        .filter(|e| e.kind == Kind::Release && e.ended == Ended::Released)
        .filter(|e| hold_kind(&e.key).0 == HoldKind::Exclusive)
        .map(|e| (e.key.as_str(), e.session))
        .collect();
    if released.is_empty() {
        return;
    }
    // (lock key, session) of each downgrade
    let downgrades: HashSet<(String, i64)> = events
        .iter()
        .filter(|e| e.kind == Kind::Grant)
        .filter_map(|e| split_reader(&e.key).filter(|&(_, session)| session == e.session))
        .filter(|held| released.contains(held))
        .map(|(name, session)| (name.to_string(), session))
        .collect();
    for event in events.iter_mut() {
        let of_downgrade = match event.kind {
            Kind::Grant => split_reader(&event.key)
                .is_some_and(|(name, session)| downgrades.contains(&(name.to_string(), session))),
            Kind::Release => {
                event.ended == Ended::Released
                    && downgrades.contains(&(event.key.clone(), event.session))
            }
            _ => false,
        };
        if of_downgrade && let Some(detail) = event.detail.as_object_mut() {
            detail.insert("downgrade".into(), true.into());
        }
    }
}

impl LogState {
    /// The event of one change to election `name`'s leader record, as
    /// Observe tells it: an end only of a leader the tailer knew.
    fn term_change(
        &mut self,
        revision: i64,
        name: &str,
        change: TermChange,
        advance: bool,
        before: u32,
        after: u32,
    ) -> Option<Event> {
        let leader = |kind, record: &LeadRecord, epoch| {
            let mut event = Event::new(revision, name, kind, epoch);
            event.identity = record.identity.clone();
            event.class = record.class.clone();
            event
        };
        Some(match change {
            TermChange::Started(record) => {
                let mut event = leader(Kind::TermStart, &record, after);
                event.detail = serde_json::json!({
                    "term": record.term(),
                    "value": record.value,
                    "priority": record.priority,
                    "sinceUnixMs": record.since_unix_ms,
                });
                let previous = self.leaders.insert(name.to_string(), record);
                if let Some(p) = previous {
                    if let Some(map) = event.detail.as_object_mut() {
                        map.insert("previousTerm".into(), p.term().into());
                    }
                    event.prev_identity = p.identity;
                }
                event
            }
            TermChange::Proclaimed(record) => {
                let mut event = leader(Kind::Proclaim, &record, after);
                event.detail = serde_json::json!({
                    "term": record.term(),
                    "value": record.value,
                });
                self.leaders.insert(name.to_string(), record);
                event
            }
            TermChange::Ended(ended) => {
                let record = self.leaders.remove(name)?;
                let mut event = leader(Kind::Vacancy, &record, before);
                event.ended = match Vacancy::of_end(ended, advance) {
                    Vacancy::Resigned => Ended::Resigned,
                    Vacancy::SessionEnded => Ended::SessionEnded,
                    Vacancy::Forced => Ended::ForceReleased,
                    Vacancy::EpochAdvanced => Ended::EpochAdvance,
                    Vacancy::Unknown => Ended::Unknown,
                };
                event.detail = serde_json::json!({ "term": record.term() });
                event
            }
        })
    }
}

fn holder_into(event: &mut Event, hold: &Hold) {
    event.identity = hold.identity.clone();
    event.session = hold.session;
    event.class = hold.class.clone();
    event.hold_revision = hold.revision;
}

/// The operators' record on `event`; where the tailer did not know the hold
/// (`known` false), the holder the operators were shown.
fn force_into(event: &mut Event, record: &ForceRecord, known: bool) {
    if !known {
        event.identity = record.holder_identity.clone();
        event.session = record.holder_session;
        event.class = record.class.clone();
        event.hold_revision = record.hold_revision;
    }
    let mut detail = force::detail(record);
    if let Some(map) = detail.as_object_mut() {
        map.insert("holdDeleted".into(), known.into());
    }
    event.detail = detail;
}

/// The record a force put carries. One that does not decode is still
/// recorded, under its own key: its key names only its request
/// (`sys/force/<id>`), not the hold it ended.
fn force_record(change: &Change) -> ForceRecord {
    if let Some(record) = decode::<ForceRecord>(&change.value) {
        return record;
    }
    ForceRecord {
        key: change.key.clone(),
        hold_revision: 0,
        request_id: force::parse_record_name(&change.key)
            .unwrap_or_default()
            .to_string(),
        requested_by: String::new(),
        approved_by: String::new(),
        reason: "(undecodable force record)".into(),
        enforcement: String::new(),
        holder_identity: String::new(),
        holder_session: 0,
        class: String::new(),
        revoke_session: false,
        requested_at_unix_ms: 0,
        approved_at_unix_ms: 0,
        revoked_session: false,
        issuer: String::new(),
        requester_identity: String::new(),
        approver_identity: String::new(),
        election: false,
        term: 0,
    }
}

#[cfg(test)]
mod tests;
