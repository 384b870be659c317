"""ADR-13's re-entrancy table, with no network (client/src/session/holds.rs)."""

from latchkey import FencingToken
from latchkey._holds import LAST, NOT_HELD, OUTERMOST, REENTERED, WAIT, Hold, Holds


def hold(key: str, revision: int = 42) -> Hold:
    return Hold(key, 7, FencingToken(revision), 1, revision)


def test_only_the_outermost_acquire_and_the_final_release_reach_the_arbiter():
    holds = Holds()
    assert holds.begin("a/b") == (OUTERMOST, None)
    h = hold("a/b")
    holds.granted(h)
    assert h.count == 1
    for expected in (2, 3):
        kind, again = holds.begin("a/b")
        assert kind == REENTERED and again is h
        assert h.count == expected
    assert holds.decrement(h) == 2
    assert holds.decrement(h) == 1
    assert holds.decrement(h) == LAST
    holds.released("a/b")
    assert len(holds) == 0
    assert holds.begin("a/b") == (OUTERMOST, None)


def test_acquirers_wait_while_the_outermost_acquire_is_in_flight():
    holds = Holds()
    holds.begin("k")
    kind, settled = holds.begin("k")
    assert kind == WAIT and not settled.is_set()
    holds.granted(hold("k"))
    assert settled.is_set()
    assert holds.begin("k")[0] == REENTERED


def test_a_failed_outermost_acquire_frees_the_key_and_wakes_waiters():
    holds = Holds()
    holds.begin("k")
    _, settled = holds.begin("k")
    holds.failed("k")
    assert settled.is_set()
    assert len(holds) == 0


def test_acquirers_wait_while_the_final_release_is_in_flight():
    holds = Holds()
    holds.begin("k")
    h = hold("k")
    holds.granted(h)
    assert holds.decrement(h) == LAST
    kind, settled = holds.begin("k")
    assert kind == WAIT, "a new acquire must not overtake the release"
    holds.failed("k")  # not an acquire: must not settle the release
    assert not settled.is_set()
    holds.released("k")
    assert settled.is_set()
    assert holds.begin("k") == (OUTERMOST, None)


def test_a_stale_guard_cannot_decrement_a_newer_hold():
    holds = Holds()
    holds.begin("k")
    old = hold("k", 1)
    holds.granted(old)
    assert holds.decrement(old) == LAST
    holds.released("k")
    holds.begin("k")
    new = hold("k", 2)
    holds.granted(new)
    assert holds.decrement(old) == NOT_HELD
    assert new.count == 1


def test_an_ended_hold_leaves_only_at_its_own_revision():
    holds = Holds()
    holds.begin("k")
    h = hold("k", 5)
    holds.granted(h)
    assert not holds.ended("k", 4), "a notice about an older hold of the key"
    assert holds.ended("k", 5)
    assert h.ended
    assert holds.decrement(h) == NOT_HELD, "its guards send no Release"
    assert holds.begin("k") == (OUTERMOST, None)


def test_a_notice_during_our_own_release_is_ignored():
    holds = Holds()
    holds.begin("k")
    h = hold("k", 5)
    holds.granted(h)
    assert holds.decrement(h) == LAST
    assert not holds.ended("k", 5)
    assert not h.ended
