"""Elections against the real stack (conftest.py): etcd, the arbiter, and
Envoy with the edge filter, over mTLS. Replicas share an identity (alice,
twice) as pods of one Deployment do."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import latchkey
from conftest import eventually
from latchkey import FenceReason, Gap, Proclaimed, TermStarted, Vacant, VacancyReason

ALICE = "spiffe://dev.latchkey/workload/alice"
BOB = "spiffe://dev.latchkey/workload/bob"


class Background:
    """A call run on its own thread; `result()` joins it and returns or raises."""

    def __init__(self, fn, *args, **kwargs) -> None:
        self._out: dict = {}

        def run():
            try:
                self._out["value"] = fn(*args, **kwargs)
            except BaseException as error:  # handed to result()
                self._out["error"] = error

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 30.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not finish"
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def standing(client, election: str, n: int) -> None:
    eventually(f"{n} candidates in {election}", 10, lambda: len(client.candidates(election)) >= n)


def test_a_replica_takes_over_when_the_leader_resigns(connect, fast_class):
    election = "demo/py/elect/resign"
    a, b = connect("ALICE"), connect("ALICE")
    first = a.campaign(election, fast_class, value="pod-a", timeout=10)
    assert first.election == election and first.value == "pod-a"
    assert first.term > 0 and first.token.value > 0
    leader = a.leader(election)
    assert (leader.identity, leader.value, leader.term) == (ALICE, "pod-a", first.term)
    waiting = Background(b.campaign, election, fast_class, value="pod-b", timeout=20)
    standing(a, election, 1)
    assert [c.value for c in a.candidates(election)] == ["pod-b"]
    assert not waiting.done(), "one leader at a time"
    first.resign()
    assert first.lost.is_set() and first.lost_reason is FenceReason.RESIGNED
    second = waiting.result()
    assert second.term == first.term + 1, "handed over in the resignation's transaction"
    assert second.token > first.token
    assert second.session_id != first.session_id
    assert b.leader(election).value == "pod-b"
    with pytest.raises(latchkey.NotLeader):
        first.proclaim("pod-a-again")  # known lost: refused without a call
    second.proclaim("pod-b2")
    assert second.value == "pod-b2" and a.leader(election).value == "pod-b2"
    second.resign()
    assert a.leader(election) is None


def test_a_replica_takes_over_when_the_leaders_client_closes(connect, fast_class):
    election = "demo/py/elect/close"
    a, b = connect("ALICE"), connect("ALICE")
    lost = []
    first = a.campaign(election, fast_class, value="pod-a", on_lost=lost.append)
    waiting = Background(b.campaign, election, fast_class, value="pod-b", timeout=20)
    standing(a, election, 1)
    a.close()
    assert lost == [FenceReason.CLOSED] and first.lost.is_set()
    second = waiting.result()
    assert second.term > first.term and second.token > first.token
    second.resign()


# A replica in its own process, killed without a word: its session expires
# a TTL (5 s) after its last renewal.
_REPLICA = """
import os, sys, time
import latchkey
client = latchkey.Client(os.environ["LATCHKEY_TEST_ENDPOINT"], ca=os.environ["LATCHKEY_TEST_CA"],
                         cert=os.environ["LATCHKEY_TEST_ALICE_CERT"], key=os.environ["LATCHKEY_TEST_ALICE_KEY"])
leadership = client.campaign(sys.argv[1], sys.argv[2], value="crashing", timeout=10)
print(leadership.term, flush=True)
time.sleep(600)
"""


def test_a_replica_takes_over_when_the_leaders_session_expires(connect, fast_class):
    election = "demo/py/elect/crash"
    replica = subprocess.Popen(
        [sys.executable, "-c", _REPLICA, election, fast_class],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        line = replica.stdout.readline()
        assert line.strip().isdigit(), f"the replica did not lead: {line!r} {replica.stderr.read() if replica.poll() is not None else ''}"
        crashed_term = int(line)
        b = connect("ALICE")
        assert b.leader(election).value == "crashing"
        waiting = Background(b.campaign, election, fast_class, value="pod-b", timeout=30)
        standing(b, election, 1)
        replica.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        second = waiting.result(40)
        took = time.monotonic() - killed_at
        assert second.term > crashed_term
        # The lease runs out a TTL after the last renewal, then the waiting
        # campaign notices (a watch, or its 2 s poll).
        assert took <= 5 + 4, f"failover took {took:.1f} s"
        second.resign()
    finally:
        replica.kill()
        replica.wait(10)
        replica.stdout.close()
        replica.stderr.close()


def test_a_leadership_ended_at_the_arbiter_is_lost_at_once_and_proclaim_says_not_leader(connect, harness):
    # The dev class (TTL 30): a loss within the poll below cannot be the fence.
    election = "demo/py/elect/forced"
    a = connect("ALICE")
    lost = []
    leadership = a.campaign(election, value="pod-a", on_lost=lost.append)
    assert leadership.election_class == "election"
    harness.remove_leader(election)
    eventually("the leadership-loss push", 10, leadership.lost.is_set)
    assert lost == [FenceReason.LEADERSHIP_ENDED]
    assert not leadership.can_start()
    with pytest.raises(latchkey.NotLeader):
        leadership.proclaim("late")
    leadership.resign()  # lost already: nothing sent, nothing raised
    again = a.campaign(election, value="pod-a")
    assert again.term > leadership.term and again.token > leadership.token
    assert not again.is_lost
    again.resign()

    # Without the push, the arbiter's NOT_LEADER is how the client learns.
    quiet = connect("ALICE", observe_leaderships=False)
    unaware = quiet.campaign(election, value="pod-q")
    harness.remove_leader(election)
    time.sleep(0.3)
    assert not unaware.lost.is_set()
    with pytest.raises(latchkey.NotLeader) as refused:
        unaware.proclaim("still me?")
    assert refused.value.reason == "NOT_LEADER"
    assert unaware.lost.is_set() and unaware.lost_reason is FenceReason.LEADERSHIP_ENDED


def test_observe_yields_every_term_proclamation_and_vacancy_in_order(connect, fast_class):
    election = "demo/py/elect/observed"
    watcher, a, b = connect("BOB"), connect("ALICE"), connect("ALICE")
    with watcher.observe(election) as events:
        assert next(events) == Vacant(0, VacancyReason.UNSPECIFIED), "a fresh election is vacant"
        first = a.campaign(election, fast_class, value="a")
        t = first.term
        event = next(events)
        assert isinstance(event, TermStarted)
        assert (event.identity, event.value, event.term) == (ALICE, "a", t)
        first.proclaim("a2")
        assert next(events) == Proclaimed(t, "a2")
        waiting = Background(b.campaign, election, fast_class, value="b", timeout=20)
        standing(a, election, 1)
        first.resign()
        second = waiting.result()
        event = next(events)
        assert (type(event), event.value, event.term) == (TermStarted, "b", t + 1)
        second.resign()
        assert next(events) == Vacant(t + 1, VacancyReason.RESIGNED)
        third = a.campaign(election, fast_class, value="a3")
        assert third.term > t + 1, "a term over a vacancy jumps past the last one"
        assert next(events).term == third.term
        a.close()
        assert next(events) == Vacant(third.term, VacancyReason.SESSION_ENDED)
    # A late observer from an old term (of an election no one observes now)
    # is told of the gap first, then the state.
    with watcher.observe(election, from_term=t) as late:
        assert next(late) == Gap(t, third.term - 1)
        assert next(late) == Vacant(third.term, VacancyReason.SESSION_ENDED)


def test_transfer_hands_over_to_a_named_candidate(connect, fast_class):
    election = "demo/py/elect/transfer"
    a, b = connect("ALICE"), connect("BOB")
    led = a.campaign(election, fast_class, value="a")
    with pytest.raises(latchkey.NoCandidate):
        led.transfer(preferred=True)
    assert not led.is_lost and led.can_start(), "a refused transfer leaves the leadership as it was"
    with pytest.raises(latchkey.ConfigError):
        led.transfer()
    waiting = Background(b.campaign, election, fast_class, value="b", priority=3, timeout=20)
    standing(a, election, 1)
    (candidate,) = a.candidates(election)
    assert (candidate.identity, candidate.value, candidate.priority) == (BOB, "b", 3)
    nxt = led.transfer(candidate.candidate_id)
    assert (nxt.identity, nxt.value, nxt.term) == (BOB, "b", led.term + 1)
    assert led.lost.is_set() and led.lost_reason is FenceReason.RESIGNED
    b_led = waiting.result()
    assert b_led.term == nxt.term and b_led.token > led.token
    with pytest.raises(latchkey.NotLeader):
        led.transfer(preferred=True)
    b_led.resign()


def test_wrong_kinds_are_refused(connect, fast_class):
    a = connect("ALICE")
    with pytest.raises(latchkey.WrongKind) as refused:
        a.campaign("demo/py/elect/kind", "demo", timeout=5)  # a lock class
    assert refused.value.reason == "WRONG_KIND"
    with pytest.raises(latchkey.WrongKind):
        a.acquire("demo/py/elect/kind", fast_class)  # an election class


def test_lead_resigns_at_the_end_of_the_block(connect, fast_class):
    election = "demo/py/elect/with"
    a = connect("ALICE")
    with a.lead(election, fast_class, value="a") as leadership:
        assert a.leader(election).term == leadership.term
        assert leadership.can_start()
        # The leading thread campaigning again gets the same leadership.
        with a.lead(election, fast_class) as again:
            assert again.term == leadership.term and again.token == leadership.token
            assert leadership.hold_count == 2
        assert not leadership.lost.is_set(), "the inner block did not resign it"
        assert a.leader(election) is not None
    assert leadership.lost_reason is FenceReason.RESIGNED
    assert a.leader(election) is None
    with pytest.raises(ZeroDivisionError):
        with a.lead(election, fast_class):
            1 / 0
    assert a.leader(election) is None, "resigned when the block raised"


def test_leading_campaigns_again_by_itself_after_a_loss_until_stopped(connect, harness, fast_class):
    election = "demo/py/elect/loop"
    a = connect("ALICE")
    stop = threading.Event()
    terms = []

    def body(leadership):
        terms.append(leadership.term)
        while not stop.is_set() and not leadership.lost.wait(0.05):
            pass

    loop = Background(a.run_as_leader, election, body, fast_class, value="loop", stop=stop)
    eventually("the first term", 10, lambda: len(terms) == 1)
    harness.remove_leader(election)  # forced out
    eventually("a second term, campaigned for by the loop", 10, lambda: len(terms) == 2)
    assert terms[1] > terms[0]
    assert a.leader(election).term == terms[1]
    stop.set()
    loop.result(10)
    assert a.leader(election) is None, "the last term was resigned"


def test_a_stopped_leading_loop_leaves_no_candidacy_behind(connect, fast_class):
    # Stopping cancels the waiting Campaign; the arbiter withdraws the
    # candidacy of a cancelled call, so a resignation cannot hand the
    # leadership to a session with no one to lead.
    election = "demo/py/elect/stopped"
    a, b = connect("ALICE"), connect("ALICE")
    led = a.campaign(election, fast_class, value="a")
    stop = threading.Event()
    loop = Background(b.run_as_leader, election, lambda leadership: None, fast_class, value="b", stop=stop)
    standing(a, election, 1)
    stop.set()
    loop.result(10)
    # The cancel reaches the arbiter through Envoy, which then withdraws on
    # a task of its own: soon, not at once.
    eventually("the cancelled candidacy withdrawn", 5, lambda: a.candidates(election) == [])
    led.resign()
    assert a.leader(election) is None, "nothing handed to the stopped campaign's session"


def test_one_thread_of_a_client_leads_the_others_wait_for_it(connect, fast_class):
    election = "demo/py/elect/threads"
    a = connect("ALICE")
    leading = []
    both = threading.Lock()
    overlaps = []

    def replica(name):
        with a.lead(election, fast_class, value=name, timeout=30) as leadership:
            if not both.acquire(blocking=False):
                overlaps.append(name)
                return
            try:
                leading.append((name, leadership.term))
                time.sleep(0.3)
            finally:
                both.release()

    threads = [threading.Thread(target=replica, args=(f"t{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert overlaps == [], "two threads of one client led at once"
    assert len(leading) == 3
    terms = [term for _, term in leading]
    assert terms == sorted(terms) and len(set(terms)) == 3, "each thread its own term"


def test_leadership_tokens_never_reach_reprs_errors_or_logs(connect, fast_class, caplog):
    caplog.set_level(logging.DEBUG)
    election = "demo/py/elect/secret"
    a, b = connect("ALICE"), connect("BOB")
    leadership = a.campaign(election, fast_class, value="a")
    value = str(leadership.token.value)
    shown = [repr(leadership), str(leadership), f"{leadership}", repr(leadership.token), f"{leadership.token}"]
    shown += [repr(a.leader(election)), repr(a.candidates(election))]
    with pytest.raises(TypeError):
        "%d" % leadership.token
    with a.observe(election) as events:
        shown.append(repr(next(events)))
    try:
        b.campaign(election, fast_class, timeout=0.5)
    except latchkey.WaitTimeout as error:
        shown += [str(error), repr(error)]
    leadership.resign()
    try:
        leadership.proclaim("x")
    except latchkey.NotLeader as error:
        shown += [str(error), repr(error)]
    shown.append(caplog.text)
    for text in shown:
        assert value not in text, text
    assert "redacted" in repr(leadership)
