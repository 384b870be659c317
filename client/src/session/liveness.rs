//! ADR-12's two stages as a pure state machine, so the rules are tested
//! without a network: the keepalive task feeds it events and instants.

use std::time::Duration;

use tokio::time::Instant;

use super::FenceReason;

/// How far before the arbiter's expiry the holder gives up.
pub(crate) const FENCE_MARGIN: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(crate) struct Liveness {
    ttl: Duration,
    /// Send time of the last successful renewal + granted TTL - margin.
    deadline: Instant,
    /// Stage one: a keepalive failed and none has succeeded since.
    failing: bool,
    dead: Option<FenceReason>,
}

impl Liveness {
    /// `opened_at` is taken just before OpenSession was sent: the lease
    /// cannot have started earlier, so it counts as the first renewal.
    pub(crate) fn new(opened_at: Instant, ttl: Duration) -> Self {
        Self {
            ttl,
            deadline: deadline_from(opened_at, ttl),
            failing: false,
            dead: None,
        }
    }

    /// A renewal sent at `sent_at` was answered with `remaining` TTL. The
    /// arbiter's expiry for it is no earlier than `sent_at + remaining`.
    pub(crate) fn renewed(&mut self, sent_at: Instant, remaining: Duration) {
        if self.dead.is_some() {
            return;
        }
        self.deadline = deadline_from(sent_at, remaining.min(self.ttl));
        self.failing = false;
    }

    /// A keepalive errored, its stream broke, or its reply is late.
    pub(crate) fn failed(&mut self) {
        self.failing = true;
    }

    /// Marks the session dead; true only the first time.
    pub(crate) fn fence(&mut self, reason: FenceReason) -> bool {
        if self.dead.is_some() {
            return false;
        }
        self.dead = Some(reason);
        true
    }

    pub(crate) fn can_start(&self, now: Instant) -> bool {
        !self.failing && self.dead.is_none() && now < self.deadline
    }

    pub(crate) fn remaining(&self, now: Instant) -> Duration {
        match self.dead {
            Some(_) => Duration::ZERO,
            None => self.deadline.saturating_duration_since(now),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    pub(crate) fn dead(&self) -> Option<FenceReason> {
        self.dead
    }
}

fn deadline_from(sent_at: Instant, granted: Duration) -> Instant {
    sent_at + granted.saturating_sub(FENCE_MARGIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(15);

    #[test]
    fn deadline_is_send_time_plus_ttl_minus_margin() {
        let opened = Instant::now();
        let mut live = Liveness::new(opened, TTL);
        assert_eq!(live.deadline(), opened + Duration::from_secs(14));
        let sent = opened + Duration::from_secs(5);
        live.renewed(sent, TTL);
        assert_eq!(live.deadline(), sent + Duration::from_secs(14));
    }

    #[test]
    fn first_failure_stops_starts_and_success_restores_them() {
        let t0 = Instant::now();
        let mut live = Liveness::new(t0, TTL);
        assert!(live.can_start(t0));
        live.failed();
        assert!(!live.can_start(t0 + Duration::from_secs(1)));
        // Stage one does not move the deadline: holds are still ours.
        assert_eq!(
            live.remaining(t0 + Duration::from_secs(4)),
            Duration::from_secs(10)
        );
        live.renewed(t0 + Duration::from_secs(5), TTL);
        assert!(live.can_start(t0 + Duration::from_secs(6)));
    }

    #[test]
    fn nothing_starts_at_or_after_the_deadline() {
        let t0 = Instant::now();
        let live = Liveness::new(t0, TTL);
        assert!(live.can_start(t0 + Duration::from_millis(13_999)));
        assert!(!live.can_start(t0 + Duration::from_secs(14)));
        assert_eq!(live.remaining(t0 + Duration::from_secs(20)), Duration::ZERO);
    }

    #[test]
    fn a_shorter_remaining_ttl_shortens_the_deadline() {
        let t0 = Instant::now();
        let mut live = Liveness::new(t0, TTL);
        live.renewed(t0, Duration::from_secs(3));
        assert_eq!(live.deadline(), t0 + Duration::from_secs(2));
        // ...and a longer one never extends past the class TTL.
        live.renewed(t0, Duration::from_secs(60));
        assert_eq!(live.deadline(), t0 + Duration::from_secs(14));
    }

    #[test]
    fn fence_is_reported_once_and_is_final() {
        let t0 = Instant::now();
        let mut live = Liveness::new(t0, TTL);
        assert!(live.fence(FenceReason::DeadlineExceeded));
        assert!(!live.fence(FenceReason::Expired));
        assert_eq!(live.dead(), Some(FenceReason::DeadlineExceeded));
        live.renewed(t0, TTL);
        assert!(!live.can_start(t0));
        assert_eq!(live.remaining(t0), Duration::ZERO);
    }
}
