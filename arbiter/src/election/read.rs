//! An election as one read of the lock log shows it, decoded: its leader
//! and term records and its candidates in the order they would lead.

use latchkey_records::{CandidateRecord, LeadRecord, TermRecord, decode};

use crate::error::ArbiterError;
use crate::lock_log::{ElectionRead, Kv};

/// One candidate record, decoded, with its place.
#[derive(Debug, Clone)]
pub(super) struct Standing {
    pub(super) record: CandidateRecord,
    pub(super) created: i64,
    pub(super) modified: i64,
}

/// An election as read, decoded.
pub(super) struct Read {
    pub(super) lead: Option<(LeadRecord, Kv)>,
    pub(super) term: Option<(TermRecord, Kv)>,
    /// In the order they lead.
    pub(super) candidates: Vec<Standing>,
    pub(super) revision: i64,
}

impl Read {
    pub(super) fn of(read: ElectionRead, revision: i64) -> Result<Self, ArbiterError> {
        let lead = match read.lead {
            Some(kv) => Some((record::<LeadRecord>(&kv, "leader")?, kv)),
            None => None,
        };
        let term = match read.term {
            Some(kv) => Some((record::<TermRecord>(&kv, "term")?, kv)),
            None => None,
        };
        let mut candidates: Vec<(String, Standing)> = read
            .candidates
            .into_iter()
            .filter_map(|(key, kv)| {
                // A record no arbiter wrote is skipped, never led.
                let record = decode::<CandidateRecord>(&kv.value)?;
                let (rank, _) = key.split_once('/')?;
                Some((
                    rank.to_string(),
                    Standing {
                        record,
                        created: kv.create_revision,
                        modified: kv.mod_revision,
                    },
                ))
            })
            .collect();
        candidates.sort_by(|(ra, a), (rb, b)| ra.cmp(rb).then(a.created.cmp(&b.created)));
        Ok(Self {
            lead,
            term,
            candidates: candidates.into_iter().map(|(_, s)| s).collect(),
            revision,
        })
    }

    /// The term record's mod revision (0: absent) and count.
    pub(super) fn term_at(&self) -> (i64, u32) {
        self.term
            .as_ref()
            .map_or((0, 0), |(r, kv)| (kv.mod_revision, r.count))
    }

    /// The count of the term that starts next: one more than the last.
    pub(super) fn next_count(&self) -> Result<u32, ArbiterError> {
        self.term_at()
            .1
            .checked_add(1)
            .ok_or_else(|| ArbiterError::internal("the election's term count is exhausted"))
    }

    /// The grant subject the term record counts against.
    pub(super) fn term_subject(&self) -> Option<&str> {
        self.term.as_ref().map(|(r, _)| r.subject.as_str())
    }

    /// `session`'s leadership, if it leads: the leader record names it and
    /// `identity`, on its lease.
    pub(super) fn led_by(&self, identity: &str, session: i64) -> Option<&LeadRecord> {
        let (record, kv) = self.lead.as_ref()?;
        (record.identity == identity && record.session == session && kv.lease == session)
            .then_some(record)
    }

    /// `session`'s record at `priority` (its key): a session may have left
    /// a record at another priority, which is not this call's.
    pub(super) fn standing(&self, session: i64, priority: u32) -> Option<&Standing> {
        self.candidates
            .iter()
            .find(|c| c.record.session == session && c.record.priority == priority)
    }
}

fn record<T: for<'de> serde::Deserialize<'de>>(kv: &Kv, what: &str) -> Result<T, ArbiterError> {
    latchkey_records::try_decode(&kv.value).map_err(|e| {
        ArbiterError::internal_caused(format!("an election's {what} record does not parse"), e)
    })
}
