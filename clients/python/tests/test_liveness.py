"""ADR-12's deadline arithmetic and two stages, with no network: the same cases
as the Rust client's liveness tests (client/src/session/liveness.rs)."""

import pytest

from latchkey import FenceReason
from latchkey._liveness import FENCE_MARGIN, Liveness, deadline_from, keepalive_interval, reply_timeout

TTL = 15.0


def test_deadline_is_send_time_plus_ttl_minus_margin():
    opened = 1000.0
    live = Liveness(opened, TTL)
    assert live.deadline == opened + 14.0
    sent = opened + 5.0
    live.renewed(sent, TTL)
    assert live.deadline == sent + 14.0


def test_the_deadline_counts_from_the_send_time_not_the_reply():
    # A renewal sent at t=10 whose reply arrives at t=13 renews as of t=10:
    # the arbiter may have renewed the lease as early as the send.
    live = Liveness(0.0, TTL)
    sent_at, received_at = 10.0, 13.0
    live.renewed(sent_at, TTL)
    assert live.deadline == sent_at + TTL - FENCE_MARGIN
    assert live.deadline < received_at + TTL - FENCE_MARGIN
    assert live.remaining(received_at) == pytest.approx(11.0)


def test_first_failure_stops_starts_and_success_restores_them():
    t0 = 0.0
    live = Liveness(t0, TTL)
    assert live.can_start(t0)
    live.failed()
    assert not live.can_start(t0 + 1)
    # Stage one does not move the deadline: holds are still ours.
    assert live.remaining(t0 + 4) == 10.0
    live.renewed(t0 + 5, TTL)
    assert live.can_start(t0 + 6)


def test_nothing_starts_at_or_after_the_deadline():
    live = Liveness(0.0, TTL)
    assert live.can_start(13.999)
    assert not live.can_start(14.0)
    assert live.remaining(20.0) == 0.0


def test_a_shorter_remaining_ttl_shortens_the_deadline():
    live = Liveness(0.0, TTL)
    live.renewed(0.0, 3.0)
    assert live.deadline == 2.0
    # ...and a longer one never extends past the class TTL.
    live.renewed(0.0, 60.0)
    assert live.deadline == 14.0


def test_fence_is_reported_once_and_is_final():
    live = Liveness(0.0, TTL)
    assert live.fence(FenceReason.DEADLINE_EXCEEDED)
    assert not live.fence(FenceReason.EXPIRED)
    assert live.dead is FenceReason.DEADLINE_EXCEEDED
    live.renewed(0.0, TTL)
    assert not live.can_start(0.0)
    assert live.remaining(0.0) == 0.0


def test_a_ttl_below_the_margin_leaves_no_time():
    assert deadline_from(5.0, 0.5) == 5.0


@pytest.mark.parametrize(
    "ttl, interval_ms, expected",
    [
        (15, 5000, 5.0),  # the arbiter's TTL/3
        (15, 0, 5.0),  # none sent: TTL/3
        (5, 4000, 2.5),  # capped at half the TTL
        (1, 10, 0.1),  # never below 100 ms
    ],
)
def test_keepalive_interval_follows_the_rust_client(ttl, interval_ms, expected):
    assert keepalive_interval(ttl, interval_ms) == pytest.approx(expected)


def test_a_reply_is_late_after_half_an_interval():
    assert reply_timeout(5.0) == 2.5
