//! What changes to an election's leader and term records mean: a term
//! start, a proclamation or the end of a term. One reading for every
//! follower of the log, so the arbiter's Observe and the audit tailer
//! cannot tell the same revisions apart differently (issue 33).
//!
//! The arbiter's transactions (`arbiter/src/lock_log/etcd/elections.rs`)
//! write, in this order within one revision:
//!
//! | the transaction                  | term record | leader record | reading |
//! |----------------------------------|-------------|---------------|---------|
//! | a campaign over a vacancy        | put         | put           | a term starts |
//! | resign to a successor, transfer  | put         | put           | a term starts (the last one ends by hand-over) |
//! | proclaim                         | —           | put           | a proclamation |
//! | resign with no successor         | put, `ended: resigned` | deleted | a term ends, resigned |
//! | an approved force-release        | put, `ended: forced`   | deleted | a term ends, forced |
//! | the leader's session ends        | —           | deleted       | a term ends with its session |
//! | an epoch advance                 | deleted     | deleted       | a term ends with its session, unless the follower sees the epoch move |
//!
//! An epoch advance deletes every election's records with the same write
//! that puts the epoch record: a follower that sees that put (the audit
//! tailer, which watches the whole prefix) or reads the epoch afterwards
//! (Observe) tells it from a session's end.

use crate::{LeadRecord, TermEnd, TermRecord, decode};

/// One change to an election's leader or term record, in the order the
/// log committed them (a transaction's changes in the order of its
/// operations). Candidate records and other keys are no change here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordChange<'a> {
    /// The term record was put, at `revision`.
    TermPut { value: &'a [u8], revision: i64 },
    /// The leader record was put, at `revision`.
    LeadPut { value: &'a [u8], revision: i64 },
    /// The leader record was deleted.
    LeadDeleted,
}

/// What a change to the leader record means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TermChange {
    /// A term started, led as the record says (over a vacancy, or by
    /// hand-over from the term the follower knew).
    Started(LeadRecord),
    /// The leader of the term the record names proclaimed its value.
    Proclaimed(LeadRecord),
    /// The term the follower knew ended: `ended` as the term record written
    /// with the deletion says, `None` when no write ended it (its session
    /// ended, or an epoch advance).
    Ended(Option<TermEnd>),
}

/// The meaning of `changes`, in order. A term record put at the leader
/// record's revision starts a term; a leader record put alone is a
/// proclamation; a leader record deleted right after a term record put is
/// that record's end, alone it is its session's. A leader record that does
/// not decode means nothing (no arbiter wrote it).
pub fn term_changes<'a>(changes: impl IntoIterator<Item = RecordChange<'a>>) -> Vec<TermChange> {
    let mut out = Vec::new();
    // The term record put just before, and its revision.
    let mut term_put: Option<(TermRecord, i64)> = None;
    for change in changes {
        match change {
            RecordChange::TermPut { value, revision } => {
                term_put = decode::<TermRecord>(value).map(|t| (t, revision));
            }
            RecordChange::LeadPut { value, revision } => {
                let Some(record) = decode::<LeadRecord>(value) else {
                    continue;
                };
                let starts = term_put.take().is_some_and(|(_, at)| at == revision);
                out.push(if starts {
                    TermChange::Started(record)
                } else {
                    TermChange::Proclaimed(record)
                });
            }
            RecordChange::LeadDeleted => {
                let ended = term_put.take().and_then(|(t, _)| t.ended);
                out.push(TermChange::Ended(ended));
            }
        }
    }
    out
}

/// Why an election became vacant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vacancy {
    Resigned,
    SessionEnded,
    Forced,
    EpochAdvanced,
    /// The election was never led in this epoch.
    Unknown,
}

impl Vacancy {
    /// The reason a term ended, from the term record written with its end
    /// (a term that ended by no write ended with its session).
    pub fn of(ended: Option<TermEnd>) -> Self {
        match ended {
            Some(TermEnd::Resigned) => Self::Resigned,
            Some(TermEnd::Forced) => Self::Forced,
            None => Self::SessionEnded,
        }
    }

    /// [`Vacancy::of`] for an end seen with the epoch moving on: a term no
    /// write ended was ended by the advance, not by its session.
    pub fn of_end(ended: Option<TermEnd>, epoch_advanced: bool) -> Self {
        match Self::of(ended) {
            Self::SessionEnded if epoch_advanced => Self::EpochAdvanced,
            reason => reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode;

    fn lead(count: u32, value: &str) -> Vec<u8> {
        encode(&LeadRecord {
            identity: "spiffe://t/a".into(),
            session: 7,
            class: "election".into(),
            epoch: 1,
            count,
            value: value.into(),
            priority: 0,
            since_unix_ms: 1,
            instance: String::new(),
            bound: String::new(),
            yields: false,
        })
    }

    fn term(count: u32, ended: Option<TermEnd>) -> Vec<u8> {
        encode(&TermRecord {
            count,
            ended,
            subject: "spiffe://t/a".into(),
        })
    }

    #[test]
    fn starts_proclamations_and_ends() {
        let (t1, l1, l1b) = (term(1, None), lead(1, "a"), lead(1, "b"));
        let (t2, gone) = (term(1, Some(TermEnd::Forced)), term(2, None));
        let changes = [
            RecordChange::TermPut {
                value: &t1,
                revision: 10,
            },
            RecordChange::LeadPut {
                value: &l1,
                revision: 10,
            },
            RecordChange::LeadPut {
                value: &l1b,
                revision: 11,
            },
            RecordChange::TermPut {
                value: &t2,
                revision: 12,
            },
            RecordChange::LeadDeleted,
            RecordChange::LeadDeleted,
            // A term record put at another revision than the leader
            // record's starts nothing.
            RecordChange::TermPut {
                value: &gone,
                revision: 13,
            },
            RecordChange::LeadPut {
                value: &l1,
                revision: 14,
            },
            RecordChange::LeadPut {
                value: b"not a record",
                revision: 15,
            },
        ];
        let read: Vec<String> = term_changes(changes)
            .into_iter()
            .map(|c| match c {
                TermChange::Started(r) => format!("start {} {}", r.count, r.value),
                TermChange::Proclaimed(r) => format!("proclaim {} {}", r.count, r.value),
                TermChange::Ended(e) => format!("end {e:?}"),
            })
            .collect();
        assert_eq!(
            read,
            [
                "start 1 a",
                "proclaim 1 b",
                "end Some(Forced)",
                "end None",
                "proclaim 1 a"
            ]
        );
        assert_eq!(Vacancy::of_end(None, true), Vacancy::EpochAdvanced);
        assert_eq!(
            Vacancy::of_end(Some(TermEnd::Resigned), true),
            Vacancy::Resigned
        );
        assert_eq!(Vacancy::of_end(None, false), Vacancy::SessionEnded);
    }
}
