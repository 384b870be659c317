//! How far behind the tailer is: in revisions (etcd's current revision
//! less the last one written) and in time (how long ago the tailer first
//! saw etcd at a revision it has still not written). etcd keeps no commit
//! times, so the time is the tailer's own, from its polls.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Polls kept at most (a day of one-second polls): the oldest unwritten
/// one is what counts, so the newest are the ones dropped.
const MAX_SAMPLES: usize = 86_400;

#[derive(Debug, Default)]
pub(super) struct Lag {
    /// (etcd's revision, when it was seen), oldest first, revisions rising.
    samples: VecDeque<(i64, Instant)>,
}

impl Lag {
    pub fn observe(&mut self, head: i64, at: Instant) {
        if self.samples.back().is_some_and(|(r, _)| *r >= head) {
            return;
        }
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push_back((head, at));
        }
    }

    /// (revisions behind, time behind) with everything up to `written` written.
    pub fn behind(&mut self, written: i64, now: Instant) -> (i64, Duration) {
        while self.samples.front().is_some_and(|(r, _)| *r <= written) {
            self.samples.pop_front();
        }
        match (self.samples.front(), self.samples.back()) {
            (Some((_, first)), Some((head, _))) => (head - written, now - *first),
            _ => (0, Duration::ZERO),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_is_the_oldest_unwritten_revision_seen() {
        let t0 = Instant::now();
        let mut lag = Lag::default();
        lag.observe(10, t0);
        lag.observe(20, t0 + Duration::from_secs(5));
        lag.observe(20, t0 + Duration::from_secs(6));
        assert_eq!(
            lag.behind(10, t0 + Duration::from_secs(8)),
            (10, Duration::from_secs(3))
        );
        assert_eq!(
            lag.behind(5, t0 + Duration::from_secs(8)),
            (15, Duration::from_secs(3))
        );
        assert_eq!(
            lag.behind(20, t0 + Duration::from_secs(9)),
            (0, Duration::ZERO)
        );
    }
}
