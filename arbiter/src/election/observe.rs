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

use latchkey_records::{LeadRecord, decode};
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

/// Why an election became vacant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vacancy {
    Resigned,
    SessionEnded,
    Forced,
    EpochAdvanced,
    /// The state as first read: vacant, for a reason no longer known.
    Unknown,
}

/// One event of an election, as observers see it: identities, values and
/// terms, never a token or a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    TermStarted {
        leader: LeaderView,
        revision: i64,
    },
    Proclaimed {
        term: u64,
        value: String,
        revision: i64,
    },
    Vacant {
        term: u64,
        reason: Vacancy,
        revision: i64,
    },
    Gap {
        from_term: u64,
        to_term: u64,
    },
}

/// What the watch task knows of the election.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Known {
    /// The current leader (session kept here only, never sent), and
    /// whether it is resigning.
    leader: Option<(i64, LeaderView, bool)>,
    /// The last term started (0: none seen).
    term: u64,
    /// The last event that describes the state (a new observer's first).
    state: Option<Observation>,
}

impl Known {
    fn of(read: &Read) -> Self {
        let mut known = Known::default();
        if let Some((record, kv)) = &read.lead {
            let view = LeaderView::of(record);
            known.term = record.term;
            known.state = Some(Observation::TermStarted {
                leader: view.clone(),
                revision: kv.mod_revision,
            });
            known.leader = Some((record.session, view, record.resigning));
        } else {
            // The vacancy's cause is not in the records.
            let reason = Vacancy::Unknown;
            known.state = Some(Observation::Vacant {
                term: 0,
                reason,
                revision: read.revision,
            });
        }
        known
    }

    fn set_state(&mut self, event: &Observation) {
        self.state = Some(event.clone());
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
                let (state, term) = {
                    let known = self.hub.known.lock();
                    // Resubscribe under the lock: nothing sent after the
                    // state is read can be missed.
                    self.rx = self.hub.tx.subscribe();
                    (known.state.clone(), known.term)
                };
                if let Some(state) = state {
                    self.first.push_back(state);
                }
                let gap = Observation::Gap {
                    from_term: self.term,
                    to_term: term,
                };
                self.term = term;
                Some(gap)
            }
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }

    fn note(&mut self, event: &Observation) {
        if let Observation::TermStarted { leader, .. } = event {
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
    /// `from_term` is older than the current term), then every change.
    pub(super) async fn subscribe(
        &self,
        election: &str,
        from_term: u64,
    ) -> Result<Observer, ArbiterError> {
        let hub = self.hub(election).await?;
        let (rx, state, term) = {
            let known = hub.known.lock();
            (hub.tx.subscribe(), known.state.clone(), known.term)
        };
        let mut first = VecDeque::new();
        if from_term != 0 && from_term < term {
            // Terms before the current one are not kept: say so.
            first.push_back(Observation::Gap {
                from_term,
                to_term: term - 1,
            });
        }
        if let Some(state) = state {
            first.push_back(state);
        }
        Ok(Observer {
            first,
            rx,
            hub,
            term: from_term,
        })
    }

    async fn hub(&self, election: &str) -> Result<Arc<Hub>, ArbiterError> {
        if let Some(hub) = self.hubs.lock().get(election).and_then(Weak::upgrade) {
            return Ok(hub);
        }
        // Read before the hub is shared, so its first observer gets a state.
        let read = read(&self.table, election).await?;
        let (tx, _) = broadcast::channel(BUFFER);
        let fresh = Arc::new(Hub {
            tx,
            known: Mutex::new(Known::of(&read)),
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
        ));
        *fresh.task.lock() = Some(AbortOnDrop::new(task.abort_handle()));
        Ok(fresh)
    }
}

/// The election's leader and term records (no candidates), with the
/// epoch they are in.
async fn read(table: &LockTable, election: &str) -> Result<Read, ArbiterError> {
    let (read, header) = table
        .seal()
        .checked(table.log().election(election, 1))
        .await?;
    let mut read = Read::of(read, header.revision)?;
    read.epoch = table.seal().guard().state().map_or(0, |s| s.epoch());
    Ok(read)
}

/// Reads the election, then follows its watch; reads again whenever the
/// watch is lost, telling observers of a gap if the state moved meanwhile.
async fn watch_task(table: Arc<LockTable>, election: String, hub: Weak<Hub>) {
    let mut first = true;
    loop {
        let read = match read(&table, &election).await {
            Ok(read) => read,
            Err(e) => {
                debug!(error = %e, "cannot read an observed election");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        {
            let Some(hub) = hub.upgrade() else { return };
            let now = Known::of(&read);
            let mut known = hub.known.lock();
            if !first && (known.term != now.term || known.leader != now.leader) {
                let gap = Observation::Gap {
                    from_term: known.term,
                    to_term: now.term,
                };
                let _ = hub.tx.send(gap);
                if let Some(state) = &now.state {
                    let _ = hub.tx.send(state.clone());
                }
            }
            if !first || *known != now {
                *known = now;
            }
        }
        first = false;
        let epoch = table.seal().guard().state().map(|s| s.bytes);
        let mut watch = match table
            .log()
            .watch_election(&election, read.revision + 1)
            .await
        {
            Ok(w) => w,
            Err(_) => {
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        loop {
            match watch.next().await {
                FollowSignal::Lost => break,
                FollowSignal::Events { events, through } => {
                    let Some(hub) = hub.upgrade() else { return };
                    let mut out = translate(&mut hub.known.lock(), &events, through);
                    if out.iter().any(ended_by_session) && advanced(&table, &epoch).await {
                        for event in &mut out {
                            if let Observation::Vacant { reason, .. } = event
                                && *reason == Vacancy::SessionEnded
                            {
                                *reason = Vacancy::EpochAdvanced;
                            }
                        }
                    }
                    let mut known = hub.known.lock();
                    for event in out {
                        known.set_state_if_describes(&event);
                        let _ = hub.tx.send(event);
                    }
                }
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

/// Whether the epoch record is no longer `epoch` (an advance deleted every
/// leadership); a log that does not answer says no.
async fn advanced(table: &LockTable, epoch: &Option<Vec<u8>>) -> bool {
    match table.log().records().await {
        Ok(now) => now.value.epoch.map(|kv| kv.value) != *epoch,
        Err(_) => false,
    }
}

impl Known {
    fn set_state_if_describes(&mut self, event: &Observation) {
        match event {
            Observation::TermStarted { .. } | Observation::Vacant { .. } => self.set_state(event),
            Observation::Proclaimed {
                term,
                value,
                revision,
            } => {
                if let Some(Observation::TermStarted { leader, .. }) = &mut self.state
                    && leader.term == *term
                {
                    leader.value = value.clone();
                    let _ = revision;
                }
            }
            Observation::Gap { .. } => {}
        }
    }
}

/// The observations a batch of changes makes, in order. A transaction's
/// changes come in one batch (etcd never splits a revision's events), in
/// the order of its operations. A vacancy is a deleted leader record: a
/// resignation marked it `resigning` first; otherwise its session ended,
/// or an epoch advance deleted it (`SessionEnded` here; the watch task
/// tells the advance by the epoch record).
fn translate(known: &mut Known, events: &[FollowEvent], through: i64) -> Vec<Observation> {
    let mut out = Vec::new();
    for event in events {
        match (event.key.as_str(), &event.put) {
            ("lead", Some(kv)) => {
                let Some(record) = decode::<LeadRecord>(&kv.value) else {
                    continue;
                };
                let view = LeaderView::of(&record);
                match &known.leader {
                    Some((session, current, _))
                        if *session == record.session && current.term == record.term =>
                    {
                        if current.value != record.value {
                            out.push(Observation::Proclaimed {
                                term: record.term,
                                value: record.value.clone(),
                                revision: kv.mod_revision,
                            });
                        }
                    }
                    _ => {
                        known.term = record.term;
                        out.push(Observation::TermStarted {
                            leader: view.clone(),
                            revision: kv.mod_revision,
                        });
                    }
                }
                known.leader = Some((record.session, view, record.resigning));
            }
            ("lead", None) => {
                let Some((_, leader, resigning)) = known.leader.take() else {
                    continue;
                };
                out.push(Observation::Vacant {
                    term: leader.term,
                    reason: if resigning {
                        Vacancy::Resigned
                    } else {
                        Vacancy::SessionEnded
                    },
                    revision: through,
                });
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock_log::Kv;
    use latchkey_records::encode;

    fn kv(value: Vec<u8>, revision: i64) -> Kv {
        Kv {
            value,
            create_revision: revision,
            mod_revision: revision,
            lease: 7,
        }
    }

    fn lead(session: i64, term: u64, value: &str) -> Vec<u8> {
        encode(&LeadRecord {
            identity: "spiffe://t/a".into(),
            session,
            class: "election".into(),
            term,
            value: value.into(),
            priority: 0,
            since_unix_ms: 1,
            instance: String::new(),
            bound: String::new(),
            resigning: false,
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
                Observation::TermStarted { leader, .. } => format!("start {}", leader.term),
                Observation::Proclaimed { term, value, .. } => format!("proclaim {term} {value}"),
                Observation::Vacant { term, reason, .. } => format!("vacant {term} {reason:?}"),
                Observation::Gap { from_term, to_term } => format!("gap {from_term}-{to_term}"),
            })
            .collect()
    }

    #[test]
    fn a_term_a_proclamation_a_hand_over_a_resignation_and_an_expiry() {
        let mut known = Known::default();
        let resigning = |session, term, value: &str| {
            let mut r: LeadRecord =
                decode(&lead(session, term, value)).unwrap_or_else(|| unreachable!());
            r.resigning = true;
            encode(&r)
        };
        let batches = vec![
            vec![
                put("term", vec![], 10),
                put("lead", lead(1, 1, "a"), 10),
                delete("c/x"),
            ],
            vec![put("lead", lead(1, 1, "a2"), 11)],
            vec![put("term", vec![], 12), put("lead", lead(2, 2, "b"), 12)],
            vec![put("lead", resigning(2, 2, "b"), 13)],
            vec![delete("term"), delete("lead")],
            vec![put("term", vec![], 15), put("lead", lead(3, 15, "c"), 15)],
            vec![delete("lead"), delete("term")],
        ];
        let mut all = Vec::new();
        for (i, batch) in batches.iter().enumerate() {
            all.extend(translate(&mut known, batch, 10 + i as i64));
        }
        assert_eq!(
            kinds(&all),
            [
                "start 1",
                "proclaim 1 a2",
                "start 2",
                "vacant 2 Resigned",
                "start 15",
                "vacant 15 SessionEnded",
            ]
        );
    }
}
