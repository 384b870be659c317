"""ADR-13's re-entrancy table, with no network (client/src/session/holds.rs)."""

import threading

from latchkey import FencingToken
from latchkey._holds import LAST, NOT_HELD, OTHER_MODE, OTHER_THREAD, OUTERMOST, REENTERED, WAIT, Hold, Holds

ME = threading.current_thread()
# Stands for another thread of the same client (only its identity matters).
OTHER = threading.Thread(target=lambda: None)


def hold(key: str, revision: int = 42, shared: bool = False) -> Hold:
    return Hold(key, 7, FencingToken(revision), 1, revision, shared=shared)


def test_only_the_outermost_acquire_and_the_final_release_reach_the_arbiter():
    holds = Holds()
    assert holds.begin("a/b", ME) == (OUTERMOST, None)
    h = hold("a/b")
    holds.granted(h)
    assert h.count == 1
    for expected in (2, 3):
        kind, again = holds.begin("a/b", ME)
        assert kind == REENTERED and again is h
        assert h.count == expected
    assert holds.decrement(h) == 2
    assert holds.decrement(h) == 1
    assert holds.decrement(h) == LAST
    holds.released("a/b")
    assert len(holds) == 0
    assert holds.begin("a/b", ME) == (OUTERMOST, None)


def test_acquirers_wait_while_the_outermost_acquire_is_in_flight():
    holds = Holds()
    holds.begin("k", ME)
    kind, settled = holds.begin("k", ME)
    assert kind == WAIT and not settled.is_set()
    holds.granted(hold("k"))
    assert settled.is_set()
    assert holds.begin("k", ME)[0] == REENTERED


def test_a_failed_outermost_acquire_frees_the_key_and_wakes_waiters():
    holds = Holds()
    holds.begin("k", ME)
    _, settled = holds.begin("k", ME)
    holds.failed("k")
    assert settled.is_set()
    assert len(holds) == 0


def test_acquirers_wait_while_the_final_release_is_in_flight():
    holds = Holds()
    holds.begin("k", ME)
    h = hold("k")
    holds.granted(h)
    assert holds.decrement(h) == LAST
    kind, settled = holds.begin("k", ME)
    assert kind == WAIT, "a new acquire must not overtake the release"
    holds.failed("k")  # not an acquire: must not settle the release
    assert not settled.is_set()
    holds.released("k")
    assert settled.is_set()
    assert holds.begin("k", ME) == (OUTERMOST, None)


def test_a_stale_guard_cannot_decrement_a_newer_hold():
    holds = Holds()
    holds.begin("k", ME)
    old = hold("k", 1)
    holds.granted(old)
    assert holds.decrement(old) == LAST
    holds.released("k")
    holds.begin("k", ME)
    new = hold("k", 2)
    holds.granted(new)
    assert holds.decrement(old) == NOT_HELD
    assert new.count == 1


def test_an_ended_hold_leaves_only_at_its_own_revision():
    holds = Holds()
    holds.begin("k", ME)
    h = hold("k", 5)
    holds.granted(h)
    assert not holds.ended("k", 4), "a notice about an older hold of the key"
    assert holds.ended("k", 5)
    assert h.ended
    assert holds.decrement(h) == NOT_HELD, "its guards send no Release"
    assert holds.begin("k", ME) == (OUTERMOST, None)


def test_a_notice_during_our_own_release_is_ignored():
    holds = Holds()
    holds.begin("k", ME)
    h = hold("k", 5)
    holds.granted(h)
    assert holds.decrement(h) == LAST
    assert not holds.ended("k", 5)
    assert not h.ended


def test_re_entrancy_is_per_thread():
    # Issue 37: four threads of one client were all inside `with lock(k)`.
    holds = Holds()
    assert holds.begin("k", ME) == (OUTERMOST, None)
    h = hold("k")
    holds.granted(h)
    assert h.owner is ME
    kind, left = holds.begin("k", OTHER)
    assert kind == OTHER_THREAD and not left.is_set()
    assert h.count == 1, "another thread does not count up the hold"
    assert holds.begin("k", ME) == (REENTERED, h)
    assert holds.decrement(h) == 1
    assert not left.is_set()
    assert holds.decrement(h) == LAST
    assert left.is_set(), "the waiting thread looks again once the final release starts"
    assert holds.begin("k", OTHER)[0] == WAIT, "...and waits for that release to settle"
    holds.released("k")
    assert holds.begin("k", OTHER) == (OUTERMOST, None)
    other = hold("k", 43)
    holds.granted(other)
    assert other.owner is OTHER
    assert holds.begin("k", ME)[0] == OTHER_THREAD


def test_a_thread_waiting_behind_a_settling_acquire_finds_it_owned():
    holds = Holds()
    holds.begin("k", ME)
    kind, settled = holds.begin("k", OTHER)
    assert kind == WAIT
    holds.granted(hold("k"))
    assert settled.is_set()
    assert holds.begin("k", OTHER)[0] == OTHER_THREAD, "not a re-entry of ME's hold"


def test_an_ended_hold_and_a_dead_session_wake_waiting_threads():
    holds = Holds()
    holds.begin("k", ME)
    h = hold("k", 5)
    holds.granted(h)
    _, left = holds.begin("k", OTHER)
    assert holds.ended("k", 5)
    assert left.is_set()
    holds.begin("j", ME)
    j = hold("j", 6)
    holds.granted(j)
    _, j_left = holds.begin("j", OTHER)
    holds.wake_all()
    assert j_left.is_set()


def test_a_hold_is_re_entered_only_in_its_own_mode():
    # One hold per key and session: a shared hold is not re-entered
    # exclusively (the arbiter would refuse the upgrade), nor an exclusive one
    # shared (the arbiter would downgrade it under its other guards).
    holds = Holds()
    assert holds.begin("r", ME, shared=True) == (OUTERMOST, None)
    reader = hold("r", 5, shared=True)
    holds.granted(reader)
    assert holds.begin("r", ME, shared=True) == (REENTERED, reader)
    assert reader.count == 2
    assert holds.begin("r", ME) == (OTHER_MODE, reader)
    assert reader.count == 2, "a refused re-entry does not count"
    assert holds.begin("r", OTHER)[0] == OTHER_THREAD, "another thread waits whatever the mode"
    assert holds.begin("r", OTHER, shared=True)[0] == OTHER_THREAD, "...shared too: one session, one hold"

    assert holds.begin("w", ME) == (OUTERMOST, None)
    writer = hold("w", 6)
    holds.granted(writer)
    assert holds.begin("w", ME, shared=True) == (OTHER_MODE, writer)
    assert writer.count == 1
    assert holds.decrement(writer) == LAST
