//! What observers see of an election: leaders, candidates and the events of
//! an Observe stream, typed. None of them carries a token or a session.
//!
//! The wire's `ObserveResponse.revision` stays inside the library: for a
//! term start it is the revision of the leadership's commit, which with
//! the term's epoch spells the leader's fencing token.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use latchkey_proto::electionv1::{
    self as wire, LeaderInfo, ObserveResponse, observe_response::Event,
};
use tokio_stream::{Stream, StreamExt};
use tonic::Streaming;

use crate::error::Error;

/// The leader of an election as everyone sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    /// The leader's SPIFFE ID.
    pub identity: String,
    /// What the leader announces (the campaign's value, or the last
    /// proclaimed one).
    pub value: String,
    /// The term it leads.
    pub term: u64,
    /// When the term started (the arbiter's clock, Unix milliseconds).
    pub since_unix_ms: i64,
    /// The priority it campaigned with.
    pub priority: u32,
}

impl From<LeaderInfo> for Leader {
    fn from(info: LeaderInfo) -> Self {
        Self {
            identity: info.identity,
            value: info.value,
            term: info.term,
            since_unix_ms: info.since_unix_ms,
            priority: info.priority,
        }
    }
}

/// A standing candidate, as [`Client::candidates`](crate::Client::candidates)
/// lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Names the candidacy in [`TransferTo::Candidate`](crate::TransferTo::Candidate).
    /// Not a session id, not a capability.
    pub id: u64,
    /// The candidate's SPIFFE ID.
    pub identity: String,
    /// The value it would lead with.
    pub value: String,
    /// Higher leads first.
    pub priority: u32,
    /// When it began standing (Unix milliseconds).
    pub since_unix_ms: i64,
}

impl From<wire::Candidate> for Candidate {
    fn from(c: wire::Candidate) -> Self {
        Self {
            id: c.candidate_id,
            identity: c.identity,
            value: c.value,
            priority: c.priority,
            since_unix_ms: c.since_unix_ms,
        }
    }
}

/// Why an election became vacant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VacancyReason {
    /// The leader resigned with no candidate to take over.
    Resigned,
    /// The leader's session ended: it expired, was closed or revoked.
    SessionEnded,
    /// Operators force-released the leadership.
    Forced,
    /// An operator advanced the epoch (after a restore).
    EpochAdvanced,
    /// Not known: the election was vacant when the arbiter first read it.
    Unknown,
}

impl VacancyReason {
    fn of(raw: i32) -> Self {
        match wire::VacancyReason::try_from(raw) {
            Ok(wire::VacancyReason::Resigned) => VacancyReason::Resigned,
            Ok(wire::VacancyReason::SessionEnded) => VacancyReason::SessionEnded,
            Ok(wire::VacancyReason::Forced) => VacancyReason::Forced,
            Ok(wire::VacancyReason::EpochAdvanced) => VacancyReason::EpochAdvanced,
            Ok(wire::VacancyReason::Unspecified) | Err(_) => VacancyReason::Unknown,
        }
    }

    /// The name `latchctl observe --json` prints: `resigned`,
    /// `session_ended`, `forced`, `epoch_advanced` or `unknown`.
    pub fn as_str(&self) -> &'static str {
        match self {
            VacancyReason::Resigned => "resigned",
            VacancyReason::SessionEnded => "session_ended",
            VacancyReason::Forced => "forced",
            VacancyReason::EpochAdvanced => "epoch_advanced",
            VacancyReason::Unknown => "unknown",
        }
    }
}

impl fmt::Display for VacancyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            VacancyReason::Resigned => "the leader resigned",
            VacancyReason::SessionEnded => "the leader's session ended",
            VacancyReason::Forced => "operators forced the leader out",
            VacancyReason::EpochAdvanced => "an operator advanced the epoch",
            VacancyReason::Unknown => "vacant when first read",
        })
    }
}

/// One event of an election, in the order the lock log committed them.
/// Later releases may add kinds: match with a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ElectionEvent {
    /// A term started: a candidate leads (also the first event of a stream
    /// while the election has a leader).
    TermStarted {
        /// Who leads, with what value, in which term.
        leader: Leader,
    },
    /// The leader of `term` replaced its value.
    Proclaimed {
        /// The leader's term.
        term: u64,
        /// The new value.
        value: String,
    },
    /// The election has no leader (also the first event of a stream while
    /// it is vacant, with `term` 0 and [`VacancyReason::Unknown`]).
    Vacant {
        /// The term that ended (0 when not known).
        term: u64,
        /// Why.
        reason: VacancyReason,
    },
    /// The events of the terms `from_term..=to_term` could not be
    /// delivered (the arbiter's history did not reach back, or the stream
    /// fell behind). The next event describes the state after the gap.
    Gap {
        /// The first term missed.
        from_term: u64,
        /// The last term missed.
        to_term: u64,
    },
    /// A candidate of a higher priority than the leader of `term` stands,
    /// and the election's class asks its leader to yield
    /// (`yieldToHigherPriority`): the leader should transfer at its next
    /// safe point ([`Leadership::yield_if_requested`](crate::Leadership::yield_if_requested)).
    TransferRequested {
        /// The term asked to yield.
        term: u64,
        /// The highest priority standing above the leader's.
        priority: u32,
    },
}

/// The event of a response, with its revision (kept inside the library).
pub(crate) fn event_of(response: ObserveResponse) -> Result<(ElectionEvent, i64), Error> {
    let event = match response.event {
        Some(Event::TermStarted(started)) => ElectionEvent::TermStarted {
            leader: started.leader.map(Leader::from).ok_or(Error::Protocol {
                rpc: "Observe",
                problem: "a term start without its leader",
            })?,
        },
        Some(Event::Proclaimed(p)) => ElectionEvent::Proclaimed {
            term: p.term,
            value: p.value,
        },
        Some(Event::Vacant(v)) => ElectionEvent::Vacant {
            term: v.term,
            reason: VacancyReason::of(v.reason),
        },
        Some(Event::Gap(g)) => ElectionEvent::Gap {
            from_term: g.from_term,
            to_term: g.to_term,
        },
        Some(Event::TransferRequested(t)) => ElectionEvent::TransferRequested {
            term: t.term,
            priority: t.priority,
        },
        None => {
            return Err(Error::Protocol {
                rpc: "Observe",
                problem: "an event of a kind this client does not know",
            });
        }
    };
    // The arbiter sends no log revision (a term's start revision is its
    // token's): 0 for every event.
    Ok((event, 0))
}

/// An Observe stream of one election: see [`Client::observe`](crate::Client::observe).
/// A [`Stream`] of events; it ends after the first error (the arbiter
/// ends a stream it stops serving with `UNAVAILABLE`: observe again from
/// [`ElectionEvents::last_term`]).
pub struct ElectionEvents {
    election: String,
    stream: Streaming<ObserveResponse>,
    last_term: u64,
    done: bool,
}

impl ElectionEvents {
    pub(crate) fn new(
        election: String,
        stream: Streaming<ObserveResponse>,
        from_term: u64,
    ) -> Self {
        Self {
            election,
            stream,
            last_term: from_term,
            done: false,
        }
    }

    /// The election observed.
    pub fn election(&self) -> &str {
        &self.election
    }

    /// The latest term the stream has told of (a term start, a vacancy or
    /// the end of a gap): where to observe again from.
    pub fn last_term(&self) -> u64 {
        self.last_term
    }

    /// The next event; `None` once the stream ended.
    pub async fn next_event(&mut self) -> Option<Result<ElectionEvent, Error>> {
        StreamExt::next(self).await
    }

    fn note(&mut self, event: &ElectionEvent) {
        let term = match event {
            ElectionEvent::TermStarted { leader } => leader.term,
            ElectionEvent::Vacant { term, .. } => *term,
            ElectionEvent::Gap { to_term, .. } => *to_term,
            ElectionEvent::Proclaimed { term, .. } => *term,
            ElectionEvent::TransferRequested { term, .. } => *term,
        };
        self.last_term = self.last_term.max(term);
    }
}

impl Stream for ElectionEvents {
    type Item = Result<ElectionEvent, Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let item = loop {
            break match Pin::new(&mut this.stream).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => None,
                // An event of a kind newer than this client: skipped, so a
                // newer arbiter never ends an older client's observation.
                Poll::Ready(Some(Ok(response))) if response.event.is_none() => continue,
                Poll::Ready(Some(Ok(response))) => Some(event_of(response).map(|(event, _)| event)),
                Poll::Ready(Some(Err(status))) => Some(Err(Error::from(status))),
            };
        };
        match &item {
            Some(Ok(event)) => this.note(event),
            Some(Err(_)) | None => this.done = true,
        }
        Poll::Ready(item)
    }
}

impl fmt::Debug for ElectionEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ElectionEvents")
            .field("election", &self.election)
            .field("last_term", &self.last_term)
            .field("done", &self.done)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_proto::electionv1::{Gap, Proclaimed, TermStarted, Vacant};

    fn response(event: Event, _revision: i64) -> ObserveResponse {
        ObserveResponse { event: Some(event) }
    }

    #[test]
    fn responses_become_typed_events() -> Result<(), Error> {
        let started = response(
            Event::TermStarted(TermStarted {
                leader: Some(LeaderInfo {
                    identity: "spiffe://t/a".into(),
                    value: "pod-a".into(),
                    term: 7,
                    since_unix_ms: 5,
                    priority: 2,
                }),
            }),
            40,
        );
        let (event, revision) = event_of(started)?;
        assert_eq!(revision, 0, "no log revision reaches a client");
        assert_eq!(
            event,
            ElectionEvent::TermStarted {
                leader: Leader {
                    identity: "spiffe://t/a".into(),
                    value: "pod-a".into(),
                    term: 7,
                    since_unix_ms: 5,
                    priority: 2,
                }
            }
        );
        let (event, _) = event_of(response(
            Event::Proclaimed(Proclaimed {
                term: 7,
                value: "b".into(),
            }),
            41,
        ))?;
        assert_eq!(
            event,
            ElectionEvent::Proclaimed {
                term: 7,
                value: "b".into()
            }
        );
        let (event, _) = event_of(response(
            Event::Vacant(Vacant {
                term: 7,
                reason: wire::VacancyReason::SessionEnded as i32,
            }),
            42,
        ))?;
        assert_eq!(
            event,
            ElectionEvent::Vacant {
                term: 7,
                reason: VacancyReason::SessionEnded
            }
        );
        let (event, _) = event_of(response(
            Event::Gap(Gap {
                from_term: 3,
                to_term: 6,
            }),
            0,
        ))?;
        assert_eq!(
            event,
            ElectionEvent::Gap {
                from_term: 3,
                to_term: 6
            }
        );
        Ok(())
    }

    #[test]
    fn unknown_or_empty_events_are_protocol_errors() {
        let empty = ObserveResponse { event: None };
        assert!(matches!(event_of(empty), Err(Error::Protocol { .. })));
        let leaderless = response(Event::TermStarted(TermStarted { leader: None }), 1);
        assert!(matches!(event_of(leaderless), Err(Error::Protocol { .. })));
        // A reason this client does not know yet is shown as unknown.
        assert_eq!(VacancyReason::of(99), VacancyReason::Unknown);
    }
}
