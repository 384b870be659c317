//! The judge of elections (issue 33): every leadership a Campaign answered,
//! and how long its elector acted on it.
//!
//! What latchkey.election.v1 promises, judged here:
//!
//! 1. **One leader per term**: no two leaderships delivered with one term
//!    but another token or session; one token is one term.
//! 2. **Terms and tokens rise together**: ordered by token, an election's
//!    leaderships have strictly rising terms; a leadership is never
//!    delivered after one with a larger token (the old one would be stale).
//! 3. **No two leaders act at once**: when a leadership is delivered, every
//!    earlier leadership of the election in the same epoch has stopped
//!    acting (its elector resigned or transferred, which it does only after
//!    it stopped, or its fence deadline passed). Across an epoch advance
//!    the old leader may still act until it learns: the fence refuses its
//!    smaller token, as it does for a lock holder's.
//!
//! An elector acts from the Campaign's answer until the moment it stops
//! (before it sends Resign or Transfer, when it crashes, or at its fence
//! deadline); time is the simulation's paused clock, exact for both.

use std::collections::BTreeMap;

use latchkey_records::token::unpack;
use tokio::time::Instant;

/// What a run's elections did, and what they broke.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ElectionReport {
    /// Leaderships answered (a re-campaign that got its own back counts once).
    pub leaderships: u64,
    /// Of them, started by a resignation or transfer handing over.
    pub handed_over: u64,
    /// Campaigns that waited for a term.
    pub waited: u64,
    pub violations: Vec<String>,
}

/// A leadership a Campaign answered: `term` and `token` to `process` on
/// `session` at `now`; `waited`: the campaign waited for it.
pub(crate) struct Delivery<'a> {
    pub(crate) election: &'a str,
    pub(crate) term: u64,
    pub(crate) token: u64,
    pub(crate) session: i64,
    pub(crate) process: &'a str,
    pub(crate) now: Instant,
    pub(crate) waited: bool,
}

struct Led {
    term: u64,
    token: u64,
    session: i64,
    process: String,
    from: Instant,
    /// When its elector stopped acting on it (`None`: still acting).
    until: Option<Instant>,
}

/// The ledger of a run's leaderships.
#[derive(Default)]
pub(crate) struct ElectionLedger {
    by_election: BTreeMap<String, Vec<Led>>,
    report: ElectionReport,
}

impl ElectionLedger {
    /// A Campaign answered a leadership.
    pub(crate) fn delivered(&mut self, d: Delivery<'_>) {
        let Delivery {
            election,
            term,
            token,
            session,
            process,
            now,
            waited,
        } = d;
        let ledger = self.by_election.entry(election.to_string()).or_default();
        if let Some(same) = ledger.iter().find(|l| l.token == token) {
            if same.term != term || same.session != session {
                self.report.violations.push(format!(
                    "{election}: token {token} delivered as term {} to session {:#x} ({}) and as term {term} to session {session:#x} ({process})",
                    same.term, same.session, same.process
                ));
            }
            // The same leadership again (a re-campaign of its session).
            return;
        }
        self.report.leaderships += 1;
        if waited {
            self.report.waited += 1;
        }
        let (epoch, _) = unpack(token);
        for l in ledger.iter() {
            if l.term == term {
                self.report.violations.push(format!(
                    "{election}: term {term} led twice: token {} (session {:#x}, {}) and token {token} (session {session:#x}, {process})",
                    l.token, l.session, l.process
                ));
            }
            if l.token > token {
                self.report.violations.push(format!(
                    "{election}: term {term} (token {token}) delivered to {process} after term {} (token {}) of {}",
                    l.term, l.token, l.process
                ));
            }
            if l.token < token && l.term >= term {
                self.report.violations.push(format!(
                    "{election}: term {term} (token {token}, {process}) is not above term {} (token {}, {})",
                    l.term, l.token, l.process
                ));
            }
            let (l_epoch, _) = unpack(l.token);
            if l.token < token && l_epoch == epoch && l.until.is_none_or(|u| u > now) {
                self.report.violations.push(format!(
                    "{election}: term {term} delivered to {process} (session {session:#x}) at {now:?} while {} still acted on term {} (session {:#x}, since {:?})",
                    l.process, l.term, l.session, l.from
                ));
            }
        }
        ledger.push(Led {
            term,
            token,
            session,
            process: process.to_string(),
            from: now,
            until: None,
        });
    }

    /// The elector of `token` stopped acting on it at `at`.
    pub(crate) fn stopped(&mut self, election: &str, token: u64, at: Instant) {
        if let Some(l) = self
            .by_election
            .get_mut(election)
            .and_then(|v| v.iter_mut().find(|l| l.token == token))
            && l.until.is_none()
        {
            l.until = Some(at);
        }
    }

    /// A Resign or Transfer handed the leadership on.
    pub(crate) fn handed_over(&mut self) {
        self.report.handed_over += 1;
    }

    pub(crate) fn report(&self) -> ElectionReport {
        self.report.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_records::token::pack;

    fn token(rev: i64) -> u64 {
        pack(1, rev).unwrap_or_default()
    }

    fn at(l: &mut ElectionLedger, term: u64, rev: i64, session: i64, secs: u64) {
        let now = Instant::now() + std::time::Duration::from_secs(secs);
        l.delivered(Delivery {
            election: "e",
            term,
            token: token(rev),
            session,
            process: "w",
            now,
            waited: true,
        });
    }

    #[tokio::test(start_paused = true)]
    async fn two_leaders_acting_at_once_and_a_term_twice_are_found() {
        let mut l = ElectionLedger::default();
        let t0 = Instant::now();
        at(&mut l, 10, 10, 1, 0);
        l.stopped("e", token(10), t0 + std::time::Duration::from_secs(1));
        at(&mut l, 11, 12, 2, 2);
        assert!(
            l.report().violations.is_empty(),
            "{:?}",
            l.report().violations
        );
        // The second leader still acts: a third one now is a violation.
        at(&mut l, 12, 14, 3, 3);
        assert_eq!(l.report().violations.len(), 1);
        // The same term again with another token.
        at(&mut l, 12, 15, 4, 4);
        assert!(l.report().violations.len() >= 2);
        // The same leadership again (a re-campaign) is fine.
        let before = l.report().violations.len();
        at(&mut l, 12, 15, 4, 5);
        assert_eq!(l.report().violations.len(), before);
    }
}
