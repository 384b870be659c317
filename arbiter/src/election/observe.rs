//! Observe: one watch per observed election on this arbiter, fanned out to
//! every observer of it. An observer first gets the state (the current
//! term, or the vacancy), then every term start, proclamation and vacancy
//! in the order the log committed them. What it cannot be given is one
//! `Gap`, never a silent skip: a stream that fell behind the fan-out's
//! buffer, or a watch the log ended (compaction, a lost connection), after
//! which the state is read again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Duration;

use latchkey_records::election::{RecordChange, TermChange, term_changes};
use latchkey_records::{
    CANDIDATES, CandidateRecord, EpochRecord, decode, election_candidate, term_of,
};
use parking_lot::Mutex;
use tokio::sync::broadcast;
use tokio_util::task::AbortOnDrop;
use tracing::debug;

use super::{LeaderView, Read};
use crate::error::ArbiterError;
use crate::lock_log::{FollowEvent, FollowSignal};
use crate::table::LockTable;

/// Events buffered per election for observers that read slowly; one that
/// falls further behind gets a `Gap` and the state.
const BUFFER: usize = 256;

/// How long the watch task waits before reading again after the log failed.
const RETRY: Duration = Duration::from_secs(1);

pub use latchkey_records::election::Vacancy;

/// One event of an election, as observers see it: identities, values and
/// terms, never a token, a session or a log revision (a term's start
/// revision is its token's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    TermStarted {
        leader: LeaderView,
    },
    Proclaimed {
        term: u64,
        value: String,
    },
    Vacant {
        term: u64,
        reason: Vacancy,
    },
    Gap {
        from_term: u64,
        to_term: u64,
    },
    /// A candidate above the leader's priority stands, and the leader's
    /// class asks it to yield (`yieldToHigherPriority`).
    TransferRequested {
        term: u64,
        priority: u32,
    },
}

/// What the watch task knows of the election.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Known {
    /// The current leader (session kept here only, never sent).
    leader: Option<(i64, LeaderView)>,
    /// The last term started (0: none in this epoch).
    term: u64,
    /// The epoch the records are read in.
    epoch: u32,
    /// The last event that describes the state (a new observer's first).
    state: Option<Observation>,
    /// The current leadership's class asks it to yield to a higher
    /// priority.
    yields: bool,
    /// The transfer request standing for the current term (a new
    /// observer's second event).
    transfer: Option<Observation>,
    /// The candidates standing, by their key below the election
    /// (`c/<rank>/<session>`): (priority, session).
    candidates: std::collections::BTreeMap<String, (u32, i64)>,
}

impl Known {
    fn of(read: &Read, epoch: u32) -> Self {
        let mut known = Known {
            epoch,
            term: read
                .term
                .as_ref()
                .map_or(0, |(t, _)| term_of(epoch, t.count)),
            ..Known::default()
        };
        if let Some((record, _)) = &read.lead {
            let view = LeaderView::of(record);
            known.term = record.term();
            known.state = Some(Observation::TermStarted {
                leader: view.clone(),
            });
            known.yields = record.yields;
            known.leader = Some((record.session, view));
        } else {
            let reason = match read.term.as_ref() {
                Some((t, _)) => Vacancy::of(t.ended),
                None => Vacancy::Unknown,
            };
            known.state = Some(Observation::Vacant {
                term: known.term,
                reason,
            });
        }
        for c in &read.candidates {
            known.candidates.insert(
                election_candidate(c.record.priority, c.record.session),
                (c.record.priority, c.record.session),
            );
        }
        known.refresh_transfer();
        known
    }

    /// The transfer request the standing candidates make now, if it is
    /// new: the leader's class yields, and a candidate of another session
    /// stands above its priority, higher than any request already made in
    /// this term. (A request is never taken back: the candidate may leave;
    /// the leader's transfer then goes only above its priority, or to no
    /// one.)
    fn refresh_transfer(&mut self) -> Option<Observation> {
        let (session, leader) = self.leader.as_ref()?;
        if !self.yields {
            return None;
        }
        let top = self
            .candidates
            .values()
            .filter(|(_, s)| s != session)
            .map(|(p, _)| *p)
            .max()
            .filter(|p| *p > leader.priority)?;
        if let Some(Observation::TransferRequested {
            priority: asked, ..
        }) = &self.transfer
            && *asked >= top
        {
            return None;
        }
        let request = Observation::TransferRequested {
            term: leader.term,
            priority: top,
        };
        self.transfer = Some(request.clone());
        Some(request)
    }

    /// Applies an event the watch task sends.
    fn apply(&mut self, event: &Observation) {
        match event {
            Observation::TermStarted { .. } | Observation::Vacant { .. } => {
                self.state = Some(event.clone());
                self.transfer = None;
            }
            Observation::TransferRequested { .. } => self.transfer = Some(event.clone()),
            Observation::Proclaimed { term, value } => {
                if let Some(Observation::TermStarted { leader }) = &mut self.state
                    && leader.term == *term
                {
                    leader.value = value.clone();
                }
            }
            Observation::Gap { .. } => {}
        }
    }
}

/// One observed election: its watch task and its fan-out.
struct Hub {
    tx: broadcast::Sender<Observation>,
    known: Mutex<Known>,
    task: Mutex<Option<AbortOnDrop>>,
}

/// Every observed election of a cluster.
pub(super) struct Hubs {
    table: Arc<LockTable>,
    hubs: Mutex<HashMap<String, Weak<Hub>>>,
}

/// An observer's stream.
pub struct Observer {
    first: VecDeque<Observation>,
    rx: broadcast::Receiver<Observation>,
    hub: Arc<Hub>,
    /// The last term this observer was told of.
    term: u64,
}

impl Observer {
    /// The next event; `None` when the election's watch task ended.
    pub async fn next(&mut self) -> Option<Observation> {
        if let Some(event) = self.first.pop_front() {
            self.note(&event);
            return Some(event);
        }
        match self.rx.recv().await {
            Ok(event) => {
                self.note(&event);
                Some(event)
            }
            Err(broadcast::error::RecvError::Lagged(_)) => {
                // Fell behind: one gap, then the state as it is now.
                let (state, transfer, term) = {
                    let known = self.hub.known.lock();
                    // Resubscribe under the lock: nothing sent after the
                    // state is read can be missed.
                    self.rx = self.hub.tx.subscribe();
                    (known.state.clone(), known.transfer.clone(), known.term)
                };
                if let Some(state) = state {
                    self.first.push_back(state);
                }
                if let Some(transfer) = transfer {
                    self.first.push_back(transfer);
                }
                let gap = Observation::Gap {
                    from_term: self.term,
                    to_term: term.max(self.term),
                };
                self.term = term.max(self.term);
                Some(gap)
            }
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }

    fn note(&mut self, event: &Observation) {
        if let Observation::TermStarted { leader } = event {
            self.term = leader.term;
        }
    }
}

impl Hubs {
    pub(super) fn new(table: Arc<LockTable>) -> Self {
        Self {
            table,
            hubs: Mutex::new(HashMap::new()),
        }
    }

    /// An observer of `election`: the state first (after a `Gap` when
    /// `from_term` asks for terms before the current one, which are not
    /// kept), then every change.
    pub(super) async fn subscribe(
        &self,
        election: &str,
        from_term: u64,
    ) -> Result<Observer, ArbiterError> {
        let hub = self.hub(election).await?;
        let (rx, state, transfer, term) = {
            let known = hub.known.lock();
            (
                hub.tx.subscribe(),
                known.state.clone(),
                known.transfer.clone(),
                known.term,
            )
        };
        let mut first = VecDeque::new();
        if from_term != 0 && from_term < term {
            first.push_back(Observation::Gap {
                from_term,
                to_term: term - 1,
            });
        }
        if let Some(state) = state {
            first.push_back(state);
        }
        if let Some(transfer) = transfer {
            first.push_back(transfer);
        }
        Ok(Observer {
            first,
            rx,
            hub,
            term: from_term.min(term),
        })
    }

    async fn hub(&self, election: &str) -> Result<Arc<Hub>, ArbiterError> {
        if let Some(hub) = self.hubs.lock().get(election).and_then(Weak::upgrade) {
            return Ok(hub);
        }
        // Read before the hub is shared, so its first observer gets a
        // state; the watch starts right after this read.
        let (read, epoch) = read(&self.table, election).await?;
        let (tx, _) = broadcast::channel(BUFFER);
        let fresh = Arc::new(Hub {
            tx,
            known: Mutex::new(Known::of(&read, epoch)),
            task: Mutex::new(None),
        });
        let mut hubs = self.hubs.lock();
        hubs.retain(|_, h| h.strong_count() > 0);
        if let Some(hub) = hubs.get(election).and_then(Weak::upgrade) {
            // Another observer made one meanwhile.
            return Ok(hub);
        }
        hubs.insert(election.to_string(), Arc::downgrade(&fresh));
        drop(hubs);
        let task = tokio::spawn(watch_task(
            self.table.clone(),
            election.to_string(),
            Arc::downgrade(&fresh),
            read.revision,
        ));
        *fresh.task.lock() = Some(AbortOnDrop::new(task.abort_handle()));
        Ok(fresh)
    }
}

/// The election's records (its candidates too, for transfer requests), and
/// the epoch this arbiter serves.
async fn read(table: &LockTable, election: &str) -> Result<(Read, u32), ArbiterError> {
    let (read, header) = table
        .seal()
        .checked(table.log().election(election, super::MAX_CANDIDATES))
        .await?;
    let read = Read::of(read, header.revision)?;
    let epoch = table.seal().guard().state().map_or(0, |s| s.epoch());
    Ok((read, epoch))
}

/// Follows the election's watch from the revision after `read_at`; when
/// the watch is lost, reads again and tells observers of a gap if the
/// state moved meanwhile.
async fn watch_task(table: Arc<LockTable>, election: String, hub: Weak<Hub>, mut read_at: i64) {
    loop {
        let mut watch = match table.log().watch_election(&election, read_at + 1).await {
            Ok(w) => w,
            Err(_) => {
                tokio::time::sleep(RETRY).await;
                read_at = match resync(&table, &election, &hub).await {
                    Some(at) => at,
                    None => return,
                };
                continue;
            }
        };
        loop {
            match watch.next().await {
                FollowSignal::Lost => break,
                FollowSignal::Events { events, .. } => {
                    let Some(hub) = hub.upgrade() else { return };
                    let (mut out, epoch) = {
                        let mut known = hub.known.lock();
                        (translate(&mut known, &events), known.epoch)
                    };
                    if out.iter().any(ended_by_session)
                        && let Some(now) = epoch_now(&table).await
                        && now != epoch
                    {
                        for event in &mut out {
                            if let Observation::Vacant { reason, .. } = event
                                && *reason == Vacancy::SessionEnded
                            {
                                *reason = Vacancy::EpochAdvanced;
                            }
                        }
                        hub.known.lock().epoch = now;
                    }
                    let mut known = hub.known.lock();
                    for event in out {
                        known.apply(&event);
                        let _ = hub.tx.send(event);
                    }
                }
            }
        }
        read_at = match resync(&table, &election, &hub).await {
            Some(at) => at,
            None => return,
        };
    }
}

/// Reads the election again after a lost watch (retrying until the log
/// answers); tells observers of a gap and the state if it moved. The
/// revision read at, or `None` once nobody observes.
async fn resync(table: &LockTable, election: &str, hub: &Weak<Hub>) -> Option<i64> {
    loop {
        match read(table, election).await {
            Ok((read, epoch)) => {
                let hub = hub.upgrade()?;
                let now = Known::of(&read, epoch);
                let mut known = hub.known.lock();
                if known.term != now.term || known.leader != now.leader {
                    let gap = Observation::Gap {
                        from_term: known.term,
                        to_term: now.term.max(known.term),
                    };
                    let _ = hub.tx.send(gap);
                    if let Some(state) = &now.state {
                        let _ = hub.tx.send(state.clone());
                    }
                }
                if let Some(transfer) = &now.transfer
                    && now.transfer != known.transfer
                {
                    let _ = hub.tx.send(transfer.clone());
                }
                *known = now;
                return Some(read.revision);
            }
            Err(e) => {
                debug!(error = %e, "cannot read an observed election");
                if hub.strong_count() == 0 {
                    return None;
                }
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

fn ended_by_session(event: &Observation) -> bool {
    matches!(
        event,
        Observation::Vacant {
            reason: Vacancy::SessionEnded,
            ..
        }
    )
}

/// The epoch the log's epoch record says now (`None`: no answer).
async fn epoch_now(table: &LockTable) -> Option<u32> {
    let records = table.log().records().await.ok()?;
    decode::<EpochRecord>(&records.value.epoch?.value).map(|r| r.epoch)
}

/// The observations a batch of changes makes, in order: the log's
/// reading of them ([`term_changes`], the audit tailer's too), told to
/// observers in terms of the leader they know. A transaction's changes
/// come in one batch (etcd never splits a revision's events), in the order
/// of its operations. An end no write caused is its session's (or an epoch
/// advance's, which the watch task tells by the epoch record).
fn translate(known: &mut Known, events: &[FollowEvent]) -> Vec<Observation> {
    for event in events {
        if !event.key.starts_with(CANDIDATES) {
            continue;
        }
        match &event.put {
            Some(kv) => {
                if let Some(c) = decode::<CandidateRecord>(&kv.value) {
                    known
                        .candidates
                        .insert(event.key.clone(), (c.priority, c.session));
                }
            }
            None => {
                known.candidates.remove(&event.key);
            }
        }
    }
    let changes = events
        .iter()
        .filter_map(|event| match (event.key.as_str(), &event.put) {
            ("term", Some(kv)) => Some(RecordChange::TermPut {
                value: &kv.value,
                revision: kv.mod_revision,
            }),
            ("lead", Some(kv)) => Some(RecordChange::LeadPut {
                value: &kv.value,
                revision: kv.mod_revision,
            }),
            ("lead", None) => Some(RecordChange::LeadDeleted),
            _ => None,
        });
    let mut out = Vec::new();
    for change in term_changes(changes) {
        match change {
            TermChange::Started(record) => {
                let view = LeaderView::of(&record);
                known.term = record.term();
                out.push(Observation::TermStarted {
                    leader: view.clone(),
                });
                known.leader = Some((record.session, view));
                known.yields = record.yields;
                known.transfer = None;
            }
            TermChange::Proclaimed(record) => {
                out.push(Observation::Proclaimed {
                    term: record.term(),
                    value: record.value.clone(),
                });
                known.leader = Some((record.session, LeaderView::of(&record)));
            }
            TermChange::Ended(ended) => {
                let Some((_, leader)) = known.leader.take() else {
                    continue;
                };
                out.push(Observation::Vacant {
                    term: leader.term,
                    reason: Vacancy::of(ended),
                });
                known.yields = false;
                known.transfer = None;
            }
        }
    }
    // After the batch: the standing candidates may ask this term's leader
    // to yield (a candidate that stood, or a term that started under one).
    if let Some(request) = known.refresh_transfer() {
        out.push(request);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock_log::Kv;
    use latchkey_records::{LeadRecord, TermEnd, TermRecord, encode};

    fn kv(value: Vec<u8>, revision: i64) -> Kv {
        Kv {
            value,
            create_revision: revision,
            mod_revision: revision,
            lease: 7,
        }
    }

    fn lead(session: i64, count: u32, value: &str) -> Vec<u8> {
        encode(&LeadRecord {
            identity: "spiffe://t/a".into(),
            session,
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

    fn put(key: &str, value: Vec<u8>, revision: i64) -> FollowEvent {
        FollowEvent {
            key: key.into(),
            put: Some(kv(value, revision)),
            prev: None,
        }
    }

    fn delete(key: &str) -> FollowEvent {
        FollowEvent {
            key: key.into(),
            put: None,
            prev: None,
        }
    }

    fn kinds(events: &[Observation]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                Observation::TermStarted { leader } => format!("start {}", leader.term & 0xffff),
                Observation::Proclaimed { term, value } => {
                    format!("proclaim {} {value}", term & 0xffff)
                }
                Observation::Vacant { term, reason } => {
                    format!("vacant {} {reason:?}", term & 0xffff)
                }
                Observation::Gap { from_term, to_term } => format!("gap {from_term}-{to_term}"),
                Observation::TransferRequested { term, priority } => {
                    format!("yield {} {priority}", term & 0xffff)
                }
            })
            .collect()
    }

    fn yielding_lead(count: u32, priority: u32) -> Vec<u8> {
        encode(&LeadRecord {
            identity: "spiffe://t/a".into(),
            session: 1,
            class: "election".into(),
            epoch: 1,
            count,
            value: "a".into(),
            priority,
            since_unix_ms: 1,
            instance: String::new(),
            bound: String::new(),
            yields: true,
        })
    }

    fn candidate(priority: u32) -> Vec<u8> {
        encode(&CandidateRecord {
            identity: "spiffe://t/b".into(),
            session: 2,
            class: "election".into(),
            value: "b".into(),
            priority,
            since_unix_ms: 1,
            wait_ms: 1_000,
            instance: String::new(),
            bound: String::new(),
            yields: true,
        })
    }

    /// `yieldToHigherPriority`: a candidate above the leader's priority
    /// asks it to yield, once per higher priority; one at or below it, or
    /// under a leader whose class does not yield, asks nothing; a new term
    /// starts with no request standing.
    #[test]
    fn a_higher_priority_candidate_asks_a_yielding_leader_to_transfer() {
        let mut known = Known::default();
        let batches = vec![
            vec![
                put("term", term(1, None), 10),
                put("lead", yielding_lead(1, 3), 10),
            ],
            vec![put("c/a/2", candidate(3), 11)],
            vec![put("c/b/3", candidate(5), 12)],
            vec![put("c/c/4", candidate(4), 13)],
            vec![put("c/d/5", candidate(9), 14)],
            vec![
                put("term", term(2, None), 15),
                put("lead", lead(2, 2, "b"), 15),
                delete("c/d/5"),
            ],
            vec![put("c/e/6", candidate(7), 16)],
        ];
        let mut all = Vec::new();
        for batch in &batches {
            all.extend(translate(&mut known, batch));
        }
        assert_eq!(
            kinds(&all),
            ["start 1", "yield 1 5", "yield 1 9", "start 2"],
            "the non-yielding leader of term 2 is asked nothing"
        );
    }

    /// A yielding term that starts while a higher candidate stands is asked
    /// at once (after its start, in the same batch); the leader's own
    /// session's record asks nothing; a candidate that came and went within
    /// a batch asks nothing.
    #[test]
    fn a_term_starting_under_a_higher_candidate_is_asked_and_its_own_record_is_not() {
        let mut known = Known::default();
        let own = encode(&CandidateRecord {
            session: 1,
            ..decode::<CandidateRecord>(&candidate(8)).expect("decodes")
        });
        let batches = vec![
            vec![put("c/x/1", own, 9), put("c/y/2", candidate(6), 9)],
            vec![
                put("term", term(1, None), 10),
                put("lead", yielding_lead(1, 3), 10),
            ],
            vec![put("c/z/9", candidate(7), 11), delete("c/z/9")],
        ];
        let mut all = Vec::new();
        for batch in &batches {
            all.extend(translate(&mut known, batch));
        }
        assert_eq!(kinds(&all), ["start 1", "yield 1 6"]);
    }

    #[test]
    fn a_term_a_proclamation_a_hand_over_a_resignation_and_an_expiry() {
        let mut known = Known::default();
        let batches = vec![
            vec![
                put("term", term(1, None), 10),
                put("lead", lead(1, 1, "a"), 10),
                delete("c/x"),
            ],
            vec![put("lead", lead(1, 1, "a2"), 11)],
            vec![
                put("term", term(2, None), 12),
                put("lead", lead(2, 2, "b"), 12),
            ],
            vec![
                put("term", term(2, Some(TermEnd::Resigned)), 13),
                delete("lead"),
            ],
            vec![
                put("term", term(3, None), 15),
                put("lead", lead(3, 3, "c"), 15),
            ],
            vec![delete("lead")],
            // A campaign over that vacancy, then an epoch advance.
            vec![
                put("term", term(4, None), 17),
                put("lead", lead(4, 4, "d"), 17),
            ],
            vec![delete("c/y"), delete("lead"), delete("term")],
        ];
        let mut all = Vec::new();
        for batch in &batches {
            all.extend(translate(&mut known, batch));
        }
        assert_eq!(
            kinds(&all),
            [
                "start 1",
                "proclaim 1 a2",
                "start 2",
                "vacant 2 Resigned",
                "start 3",
                "vacant 3 SessionEnded",
                "start 4",
                "vacant 4 SessionEnded",
            ]
        );
    }

    /// An election's force-release writes what a resignation does, the
    /// term record marked forced: observers hear FORCED for that term, and
    /// the leadership entry's delete (outside the election's prefix) says
    /// nothing; the next term starts over the vacancy as any does.
    #[test]
    fn a_forced_end_is_a_forced_vacancy_of_that_term() {
        let mut known = Known::default();
        let batches = vec![
            vec![
                put("term", term(1, None), 10),
                put("lead", lead(1, 1, "a"), 10),
            ],
            vec![
                put("term", term(1, Some(TermEnd::Forced)), 14),
                delete("lead"),
            ],
            vec![
                put("term", term(2, None), 16),
                put("lead", lead(2, 2, "b"), 16),
            ],
        ];
        let mut all = Vec::new();
        for batch in &batches {
            all.extend(translate(&mut known, batch));
        }
        assert_eq!(kinds(&all), ["start 1", "vacant 1 Forced", "start 2"]);
        assert_eq!(
            known.leader.as_ref().map(|(s, l)| (*s, l.value.as_str())),
            Some((2, "b"))
        );
    }
}
