"""ADR-12's two stages as a pure state machine, so the rules are tested
without a network: the keepalive thread feeds it events and instants
(``time.monotonic()`` seconds).

Stage one: from the first failed keepalive until the next successful one,
``can_start`` is false. Stage two: at the deadline — the *send* time of the
last successful renewal plus the granted TTL minus one second — every hold is
fenced. The send time bounds the arbiter's renewal from below (the arbiter
cannot have renewed before the request left), which is what makes the local
deadline come before the arbiter's expiry whatever the reply's delay.
"""

from __future__ import annotations

from typing import Optional

from ._errors import FenceReason

#: How far before the arbiter's expiry the holder gives up, in seconds.
FENCE_MARGIN = 1.0


def deadline_from(sent_at: float, granted_ttl: float) -> float:
    """The fence deadline of a renewal sent at `sent_at` granting `granted_ttl` s."""
    return sent_at + max(0.0, granted_ttl - FENCE_MARGIN)


class Liveness:
    """Deadline, stage one and the final fence of one session."""

    def __init__(self, opened_at: float, ttl: float) -> None:
        # OpenSession counts as the first renewal; `opened_at` is taken just
        # before it was sent, so the lease cannot have started earlier.
        self.ttl = ttl
        self._deadline = deadline_from(opened_at, ttl)
        self._failing = False
        self._dead: Optional[FenceReason] = None

    def renewed(self, sent_at: float, remaining: float) -> None:
        """A renewal sent at `sent_at` was answered with `remaining` s of TTL."""
        if self._dead is not None:
            return
        self._deadline = deadline_from(sent_at, min(remaining, self.ttl))
        self._failing = False

    def failed(self) -> None:
        """A keepalive errored, its stream broke, or its reply is late."""
        self._failing = True

    def fence(self, reason: FenceReason) -> bool:
        """Marks the session dead; true only the first time."""
        if self._dead is not None:
            return False
        self._dead = reason
        return True

    def can_start(self, now: float) -> bool:
        return not self._failing and self._dead is None and now < self._deadline

    def remaining(self, now: float) -> float:
        if self._dead is not None:
            return 0.0
        return max(0.0, self._deadline - now)

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def failing(self) -> bool:
        return self._failing

    @property
    def dead(self) -> Optional[FenceReason]:
        return self._dead


def keepalive_interval(ttl_seconds: int, interval_ms: int) -> float:
    """The renewal cadence for a session, as the Rust client computes it: the
    arbiter's ``keepalive_interval_ms`` capped at half the TTL (TTL/3 when the
    arbiter sends none), and never below 100 ms."""
    ttl = float(ttl_seconds)
    interval = ttl / 3 if interval_ms == 0 else min(interval_ms / 1000.0, ttl / 2)
    return max(interval, 0.1)


def reply_timeout(interval: float) -> float:
    """How late a renewal's reply may be before stage one starts: half an
    interval. With the TTL/3 cadence, waiting a whole interval would put the
    first failure at last success + 2/3 TTL, for short TTLs the deadline itself."""
    return interval / 2
