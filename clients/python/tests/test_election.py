"""Elections without the stack: how observed events judge a leadership, the
per-thread election table, the Observe iterator's reconnect, the
leadership-loss push against an in-process fake ElectionService, and token
redaction. The real thing is in test_stack_election.py."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

import latchkey
from conftest import eventually
from latchkey import FenceReason, Gap, Leadership, Proclaimed, TermStarted, TransferRequested, Vacant, VacancyReason
from latchkey._client import Client
from latchkey._election import _KEEP, _LOST, _ASK, ElectionTable, Observation, _event, _judge, _Term
from latchkey.election.v1 import election_pb2, election_pb2_grpc

TOKEN = (1 << 48) + 4242  # epoch 1, revision 4242


def started(term: int, value: str = "v") -> election_pb2.ObserveResponse:
    leader = election_pb2.LeaderInfo(identity="spiffe://t/a", value=value, term=term)
    return election_pb2.ObserveResponse(term_started=election_pb2.TermStarted(leader=leader))


def proclaimed(term: int, value: str) -> election_pb2.ObserveResponse:
    return election_pb2.ObserveResponse(proclaimed=election_pb2.Proclaimed(term=term, value=value))


def vacant(term: int, reason: int = 0) -> election_pb2.ObserveResponse:
    return election_pb2.ObserveResponse(vacant=election_pb2.Vacant(term=term, reason=reason))


def test_events_are_typed():
    assert _event(started(7, "a")) == TermStarted("spiffe://t/a", "a", 7, 0, 0)
    assert _event(proclaimed(7, "b")) == Proclaimed(7, "b")
    assert _event(vacant(7, 1)) == Vacant(7, VacancyReason.RESIGNED)
    assert _event(vacant(7, 99)) == Vacant(7, VacancyReason.UNSPECIFIED), "a reason newer than the stubs"
    gap = election_pb2.ObserveResponse(gap=election_pb2.Gap(from_term=3, to_term=6))
    assert _event(gap) == Gap(3, 6)
    asked = election_pb2.ObserveResponse(transfer_requested=election_pb2.TransferRequested(term=7, priority=5))
    assert _event(asked) == TransferRequested(7, 5)
    assert _judge(7, TransferRequested(7, 5)) == _KEEP, "a request to yield is not a loss"
    assert _event(election_pb2.ObserveResponse()) is None


@pytest.mark.parametrize(
    "event, verdict",
    [
        (TermStarted("i", "v", 10), _KEEP),  # ours
        (TermStarted("i", "v", 9), _KEEP),  # a stale state from before it
        (TermStarted("i", "v", 11), _LOST),  # terms rise: ours ended
        (Proclaimed(10, "w"), _KEEP),
        (Vacant(10, VacancyReason.FORCED), _LOST),
        (Vacant(12, VacancyReason.EPOCH_ADVANCED), _LOST),
        (Vacant(9, VacancyReason.RESIGNED), _KEEP),
        (Vacant(0, VacancyReason.UNSPECIFIED), _ASK),  # never led: read before us?
        (Gap(3, 11), _KEEP),  # the state follows
        (None, _KEEP),
    ],
)
def test_what_an_observed_event_says_of_the_leadership_of_term_10(event, verdict):
    assert _judge(10, event) == verdict


class FakeTerm(_Term):
    def __init__(self, owner, election_class="election"):  # no session, no watch
        self.owner = owner
        self.election = "demo/e"
        self.election_class = election_class
        self.lost = threading.Event()

    def is_lost(self):
        return self.lost.is_set()


def test_one_thread_of_a_client_leads_an_election_the_others_wait():
    table = ElectionTable()
    me, other = threading.current_thread(), threading.Thread(target=lambda: None)
    assert table.begin("demo/e", "election", me, None, None) is None, "campaign"
    with pytest.raises(latchkey.WaitTimeout) as waited:
        table.begin("demo/e", "election", other, time.monotonic() + 0.1, None)
    assert "another thread" in str(waited.value)
    term = FakeTerm(me)
    table.led(term)
    assert table.begin("demo/e", "election", me, None, None) is term, "the leading thread gets it back"
    with pytest.raises(latchkey.ConfigError):
        table.begin("demo/e", "other-class", me, None, None)
    got = queue.Queue()
    waiter = threading.Thread(target=lambda: got.put(table.begin("demo/e", "election", waiter, time.monotonic() + 5, None)))
    waiter.start()
    time.sleep(0.1)
    assert got.empty(), "waits while the first thread leads"
    term.lost.set()
    table.left(term)
    waiter.join(5)
    assert got.get_nowait() is None, "...then campaigns itself"


def test_a_stopped_wait_for_another_thread_ends_promptly():
    from latchkey._election import _Stopped

    table = ElectionTable()
    table.begin("demo/e", "election", threading.current_thread(), None, None)
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started_at = time.monotonic()
    with pytest.raises(_Stopped):
        table.begin("demo/e", "election", threading.Thread(target=lambda: None), None, stop)
    assert time.monotonic() - started_at < 2


class FakeElection(election_pb2_grpc.ElectionServiceServicer):
    """Observe streams scripted per call: a list of responses, then an
    optional status to end with (None: stay open until cancelled)."""

    def __init__(self) -> None:
        self.streams: "queue.Queue[tuple]" = queue.Queue()
        self.requests: list = []
        self.leader = None

    def Observe(self, request, context):
        self.requests.append(request.from_term)
        responses, end = self.streams.get(timeout=10)
        yield from responses
        if end is None:
            while context.is_active():
                time.sleep(0.02)
            return
        context.abort(end, "scripted end")

    def Leader(self, request, context):
        return election_pb2.LeaderResponse(election=request.election, leader=self.leader)


@pytest.fixture
def fake():
    servicer = FakeElection()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    election_pb2_grpc.add_ElectionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    client = SimpleNamespace(
        _election_stub=election_pb2_grpc.ElectionServiceStub(channel),
        _request_timeout=2.0,
        _observe_leaderships=True,
        _elections=ElectionTable(),
    )
    client._call = lambda method, request, timeout=None: Client._call(client, method, request, timeout)
    yield servicer, client
    channel.close()
    server.stop(0)


def test_an_observation_reconnects_from_the_last_term_without_repeating_the_state(fake):
    servicer, client = fake
    servicer.streams.put(([started(5, "a"), proclaimed(5, "b")], grpc.StatusCode.UNAVAILABLE))
    # Opened again: the state (unchanged) first, then what happened next.
    servicer.streams.put(([started(5, "b"), vacant(5, 1)], None))
    with Observation(client, "demo/e", 0, reconnect=True) as observation:
        events = [next(observation) for _ in range(3)]
    assert [type(e).__name__ for e in events] == ["TermStarted", "Proclaimed", "Vacant"]
    assert events[2] == Vacant(5, VacancyReason.RESIGNED)
    assert servicer.requests == [0, 5], "the second stream starts from the last term seen"


def test_an_observation_raises_what_is_not_transient(fake):
    servicer, client = fake
    servicer.streams.put(([], grpc.StatusCode.PERMISSION_DENIED))
    observation = Observation(client, "demo/e", 0, reconnect=True)
    with pytest.raises(latchkey.PermissionDenied):
        next(observation)


def test_closing_an_observation_from_another_thread_ends_the_iteration(fake):
    servicer, client = fake
    servicer.streams.put(([started(1)], None))
    observation = Observation(client, "demo/e", 0, reconnect=True)
    assert next(observation).term == 1
    threading.Timer(0.1, observation.close).start()
    assert list(observation) == []


class FakeSession:
    id = 77

    def __init__(self) -> None:
        self.watching = {}

    def _watch(self, callback):
        self.watching[1] = callback
        return 1

    def _unwatch(self, watch_id):
        self.watching.pop(watch_id, None)

    def can_start(self):
        return True

    def remaining_ttl(self):
        return 10.0

    fence_deadline = 0.0


def term_of(client, session, term=10) -> _Term:
    won = election_pb2.Leadership(election="demo/e", term=term, token=TOKEN, session_id=session.id, value="pod-a")
    t = _Term(client, "demo/e", "election", session, won, threading.current_thread())
    client._elections.led(t)
    return t


def test_another_term_on_the_observe_stream_loses_the_leadership_at_once(fake):
    servicer, client = fake
    servicer.streams.put(([started(10, "pod-a"), proclaimed(10, "pod-a2"), started(11, "pod-b")], None))
    session = FakeSession()
    lost = []
    t = term_of(client, session)
    leadership = Leadership(t, t.add(lost.append))
    eventually("the loss push", 5, leadership.lost.is_set)
    assert leadership.lost_reason is FenceReason.LEADERSHIP_ENDED
    assert lost == [FenceReason.LEADERSHIP_ENDED]
    assert not leadership.can_start()
    assert session.watching == {}, "no longer watching the session"
    with pytest.raises(latchkey.NotLeader):
        leadership.proclaim("late")  # refused here, without a call
    leadership.resign()  # lost: nothing to resign, nothing raised


def test_a_transfer_request_for_its_term_is_told_to_the_leadership(fake):
    servicer, client = fake
    servicer.leader = election_pb2.LeaderInfo(identity="spiffe://t/a", value="pod-a", term=10)
    asked = election_pb2.ObserveResponse(transfer_requested=election_pb2.TransferRequested(term=10, priority=5))
    other = election_pb2.ObserveResponse(transfer_requested=election_pb2.TransferRequested(term=9, priority=5))
    # A request for another term, then the stream ends; the watch observes
    # again and hears one for its own.
    servicer.streams.put(([started(10, "pod-a"), other], grpc.StatusCode.UNAVAILABLE))
    t = term_of(client, FakeSession())
    leadership = Leadership(t, t.add(None))
    eventually("the first stream to be taken", 5, servicer.streams.empty)
    assert leadership.yield_if_requested() is None or t.transfer_requested.is_set()
    servicer.streams.put(([started(10, "pod-a"), asked], None))
    eventually("the request to yield", 5, t.transfer_requested.is_set)
    assert leadership.transfer_requested.is_set()
    assert not t.lost.is_set(), "asked to yield is not lost"


def test_a_vacancy_read_first_is_checked_with_leader(fake):
    servicer, client = fake
    servicer.leader = election_pb2.LeaderInfo(identity="spiffe://t/a", value="pod-a", term=10)
    # A shared watch behind the log: vacant first, then our own term.
    servicer.streams.put(([vacant(0), started(10, "pod-a")], None))
    t = term_of(client, FakeSession())
    time.sleep(0.3)
    assert not t.lost.is_set(), "Leader says term 10 leads: kept"
    t.lose(FenceReason.RESIGNED)
    servicer.leader = None
    servicer.streams.put(([vacant(0)], None))
    t = term_of(client, FakeSession())
    eventually("the loss after Leader says vacant", 5, t.lost.is_set)


def test_the_session_fence_loses_the_leadership(fake):
    servicer, client = fake
    servicer.streams.put(([started(10)], None))
    session = FakeSession()
    t = term_of(client, session)
    leadership = Leadership(t, t.add(None))
    session.watching[1](FenceReason.DEADLINE_EXCEEDED)  # what Session._fence does
    assert leadership.lost.is_set() and leadership.lost_reason is FenceReason.DEADLINE_EXCEEDED
    assert leadership.remaining_ttl() == 0


def test_a_leadership_shows_no_token(fake, caplog):
    servicer, client = fake
    servicer.streams.put(([started(10)], None))
    caplog.set_level(logging.DEBUG)
    t = term_of(client, FakeSession())
    leadership = Leadership(t, t.add(None))
    logging.getLogger("latchkey").warning("leading %s with %s", leadership, leadership.token)
    shown = [repr(leadership), str(leadership), f"{leadership}", "%s" % leadership, "%r" % (leadership,), caplog.text]
    for text in shown:
        assert str(TOKEN) not in text and str(TOKEN & ((1 << 48) - 1)) not in text, text
        assert "redacted" in text
    with pytest.raises(TypeError):
        "%d" % leadership.token
    assert leadership.token.value == TOKEN
    t.lose(FenceReason.RESIGNED)
