//! Each leadership's observer: an Observe stream of its election, judged
//! event by event. The session's fence covers a leadership this process
//! can no longer vouch for; this covers one the election moved past while
//! the session lives (operators forced it out, the session's lease was
//! revoked, an epoch advance). When the stream breaks, one Leader call
//! decides, then the stream is opened again with backoff.

use std::sync::{Arc, Weak};
use std::time::Duration;

use latchkey_proto::electionv1::{LeaderRequest, ObserveRequest};
use tokio::time::sleep;

use super::LeadershipLost;
use super::events::{ElectionEvent, VacancyReason, event_of};
use crate::rpc::Rpc;
use crate::session::{Lead, SessionCore};

const MIN_BACKOFF: Duration = Duration::from_millis(100);

/// The revision bits of a token (`epoch * 2^48 + revision`).
const REVISION_BITS: u64 = (1 << 48) - 1;

/// What the watcher needs of its leadership; the task holds the lead
/// weakly and is aborted when the last guard goes.
pub(super) struct Watched {
    pub(super) rpc: Rpc,
    pub(super) core: Arc<SessionCore>,
    pub(super) lead: Weak<Lead>,
    pub(super) election: String,
    pub(super) term: u64,
    /// The revision the leadership started at (the token's).
    pub(super) started_at: i64,
    /// The longest pause between attempts to observe (the session's
    /// keepalive interval): also how often a refused observer polls Leader.
    pub(super) max_backoff: Duration,
}

pub(super) fn started_at(token: u64) -> i64 {
    i64::try_from(token & REVISION_BITS).unwrap_or(i64::MAX)
}

/// Whether `event` (at `revision`) says the leadership of `term`, started
/// at revision `started_at`, is over. Events about earlier states are
/// ignored: an observer's first event is the state its arbiter last knew,
/// which may predate this term by a moment.
pub(super) fn verdict(
    term: u64,
    started_at: i64,
    event: &ElectionEvent,
    revision: i64,
) -> Option<LeadershipLost> {
    match event {
        ElectionEvent::TermStarted { leader } if leader.term > term => {
            Some(LeadershipLost::Replaced { term: leader.term })
        }
        ElectionEvent::Vacant {
            term: ended,
            reason,
        } if *ended >= term => Some(LeadershipLost::Vacated(*reason)),
        // A vacancy whose term is not known is the state as read at
        // `revision`: after this term started, it ended.
        ElectionEvent::Vacant { term: 0, reason } if revision > started_at => {
            Some(LeadershipLost::Vacated(*reason))
        }
        _ => None,
    }
}

/// What a Leader answer says of the leadership: the read is current, so
/// no leader, or another term, means it is over.
fn leader_verdict(term: u64, leader: Option<u64>) -> Option<LeadershipLost> {
    match leader {
        None => Some(LeadershipLost::Vacated(VacancyReason::Unknown)),
        Some(now) if now != term => Some(LeadershipLost::Replaced { term: now }),
        Some(_) => None,
    }
}

pub(super) async fn run(w: Watched) {
    let mut backoff = MIN_BACKOFF;
    loop {
        if let Some(reason) = observe(&w, &mut backoff).await {
            return lose(&w, reason);
        }
        if let Some(reason) = ask_leader(&w).await {
            return lose(&w, reason);
        }
        sleep(backoff).await;
        backoff = (backoff * 2).min(w.max_backoff.max(MIN_BACKOFF));
    }
}

/// Follows one Observe stream; a verdict, or `None` when the stream ended.
async fn observe(w: &Watched, backoff: &mut Duration) -> Option<LeadershipLost> {
    let opened = w
        .rpc
        .election()
        .observe(w.rpc.stream(ObserveRequest {
            election: w.election.clone(),
            from_term: 0,
            transfer_requests: true,
        }))
        .await;
    let mut stream = match opened {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tracing::debug!(election = %w.election, code = ?status.code(), "cannot observe the led election");
            return None;
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(response)) => {
                *backoff = MIN_BACKOFF;
                let Ok((event, revision)) = event_of(response) else {
                    continue;
                };
                if let ElectionEvent::TransferRequested { term, .. } = &event
                    && *term == w.term
                    && let Some(lead) = w.lead.upgrade()
                {
                    lead.request_transfer();
                }
                if let Some(reason) = verdict(w.term, w.started_at, &event, revision) {
                    return Some(reason);
                }
            }
            Ok(None) | Err(_) => {
                tracing::debug!(election = %w.election, "the led election's observer ended");
                return None;
            }
        }
    }
}

async fn ask_leader(w: &Watched) -> Option<LeadershipLost> {
    let answer = w
        .rpc
        .election()
        .leader(w.rpc.unary(LeaderRequest {
            election: w.election.clone(),
        }))
        .await
        .ok()?;
    leader_verdict(w.term, answer.into_inner().leader.map(|l| l.term))
}

fn lose(w: &Watched, reason: LeadershipLost) {
    let Some(lead) = w.lead.upgrade() else {
        return;
    };
    if lead.lose(reason) {
        w.core.leadership_ended(&lead);
        tracing::warn!(
            election = %w.election,
            term = w.term,
            session_id = lead.session_id,
            %reason,
            "leadership lost"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::election::Leader;

    fn started(term: u64) -> ElectionEvent {
        ElectionEvent::TermStarted {
            leader: Leader {
                identity: "spiffe://t/a".into(),
                value: "v".into(),
                term,
                since_unix_ms: 0,
                priority: 0,
            },
        }
    }

    const TERM: u64 = 50;
    const AT: i64 = 1_000;

    #[test]
    fn a_later_term_or_a_vacancy_of_this_term_ends_the_leadership() {
        assert_eq!(
            verdict(TERM, AT, &started(TERM + 1), AT + 5),
            Some(LeadershipLost::Replaced { term: TERM + 1 })
        );
        let vacant = ElectionEvent::Vacant {
            term: TERM,
            reason: VacancyReason::SessionEnded,
        };
        assert_eq!(
            verdict(TERM, AT, &vacant, AT + 5),
            Some(LeadershipLost::Vacated(VacancyReason::SessionEnded))
        );
    }

    #[test]
    fn this_term_earlier_terms_proclamations_and_gaps_do_not() {
        assert_eq!(verdict(TERM, AT, &started(TERM), AT), None);
        // The observer's arbiter had not seen this term start yet.
        assert_eq!(verdict(TERM, AT, &started(TERM - 1), AT - 10), None);
        let earlier = ElectionEvent::Vacant {
            term: TERM - 1,
            reason: VacancyReason::Resigned,
        };
        assert_eq!(verdict(TERM, AT, &earlier, AT - 1), None);
        let proclaimed = ElectionEvent::Proclaimed {
            term: TERM,
            value: "v2".into(),
        };
        assert_eq!(verdict(TERM, AT, &proclaimed, AT + 1), None);
        let gap = ElectionEvent::Gap {
            from_term: 1,
            to_term: TERM + 3,
        };
        assert_eq!(verdict(TERM, AT, &gap, 0), None, "the next event decides");
    }

    #[test]
    fn a_vacancy_as_first_read_counts_only_after_the_term_started() {
        let read_vacant = ElectionEvent::Vacant {
            term: 0,
            reason: VacancyReason::Unknown,
        };
        assert_eq!(verdict(TERM, AT, &read_vacant, AT - 3), None);
        assert_eq!(
            verdict(TERM, AT, &read_vacant, AT + 3),
            Some(LeadershipLost::Vacated(VacancyReason::Unknown))
        );
    }

    #[test]
    fn leader_answers_are_current() {
        assert_eq!(leader_verdict(TERM, Some(TERM)), None);
        assert_eq!(
            leader_verdict(TERM, Some(TERM + 2)),
            Some(LeadershipLost::Replaced { term: TERM + 2 })
        );
        assert_eq!(
            leader_verdict(TERM, None),
            Some(LeadershipLost::Vacated(VacancyReason::Unknown))
        );
    }

    #[test]
    fn the_start_revision_is_the_tokens_low_bits() {
        assert_eq!(started_at((3 << 48) + 12_345), 12_345);
    }
}
