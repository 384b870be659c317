"""The keepalive thread against an in-process fake Lock service (a unit test:
the real stack is tests/e2e/python_client.rs). The fake records when each
renewal arrived and answers after a delay, so the tests can tell the send time
from the receive time."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from conftest import eventually
from latchkey import FenceReason, FencingToken
from latchkey._holds import Hold
from latchkey._liveness import FENCE_MARGIN
from latchkey._session import Session
from latchkey.lock.v1 import lock_pb2, lock_pb2_grpc

SESSION = 42
TTL = 3  # keepalive every 1 s, a reply is late after 0.5 s


class FakeLock(lock_pb2_grpc.LockServicer):
    def __init__(self, reply_delay: float) -> None:
        self.reply_delay = reply_delay
        self.arrivals: list = []
        self.notices: "list[lock_pb2.KeepAliveResponse]" = []
        self.answering = True
        self._lock = threading.Lock()

    def KeepAlive(self, requests, context):
        for request in requests:
            with self._lock:
                self.arrivals.append(time.monotonic())
                notices, self.notices = self.notices, []
            yield from notices
            if not self.answering:
                continue
            time.sleep(self.reply_delay)
            yield lock_pb2.KeepAliveResponse(session_id=request.session_id, remaining_ttl_seconds=TTL)

    def push(self, notice) -> None:
        with self._lock:
            self.notices.append(notice)


@pytest.fixture
def fake():
    servicer = FakeLock(reply_delay=0.2)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    lock_pb2_grpc.add_LockServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, lock_pb2_grpc.LockStub(channel)
    channel.close()
    server.stop(0)


def open_session(stub) -> tuple:
    opened_at = time.monotonic()
    return Session(stub, SESSION, float(TTL), 1.0, opened_at, False, 2.0), opened_at


def test_the_first_renewal_goes_at_stream_open_and_the_deadline_counts_from_its_send(fake):
    servicer, stub = fake
    session, opened_at = open_session(stub)
    try:
        first_deadline = session.fence_deadline
        eventually("a renewal to move the deadline", 3, lambda: session.fence_deadline > first_deadline)
        with servicer._lock:
            arrival = servicer.arrivals[0]
        # Had it waited an interval (1 s) after opening, it could not have arrived yet.
        assert arrival - opened_at < 1.0, "the first renewal is sent when the stream opens"
        sent_at = session.fence_deadline - (TTL - FENCE_MARGIN)
        # The renewal was sent before it arrived; its reply came 0.2 s after
        # that. A deadline from the receive time would put sent_at after arrival.
        assert sent_at <= arrival
        assert session.can_start()
        eventually("a second renewal", 3, lambda: len(servicer.arrivals) >= 2)
        with servicer._lock:
            second = servicer.arrivals[1]
        # Sent an interval after the first send, which was after opened_at.
        assert second - opened_at >= 1.0, "one renewal per interval"
    finally:
        session._shutdown()


def test_unanswered_renewals_stop_new_work_then_fence_at_the_deadline(fake):
    servicer, stub = fake
    session, _ = open_session(stub)
    fired = []
    hold = Hold("demo/k", SESSION, FencingToken(7), 0, 7)
    session._begin_acquire("demo/k", fired.append)
    session._granted(hold, lambda reason: fired.append((time.monotonic(), reason)))
    try:
        eventually("the first renewal", 3, lambda: len(servicer.arrivals) >= 1)
        servicer.answering = False
        eventually("stage one", 3, lambda: not session.can_start())
        assert fired == [] and not session.is_fenced
        deadline = session.fence_deadline
        eventually("the fence", 5, lambda: fired)
        (at, reason), = fired
        assert reason is FenceReason.DEADLINE_EXCEEDED
        assert at >= deadline
        assert session.is_fenced and session.remaining_ttl() == 0
    finally:
        session._shutdown()


def test_a_notice_fences_only_the_hold_it_names(fake):
    servicer, stub = fake
    session, _ = open_session(stub)
    fired = []
    try:
        holds = {}
        for key, revision in (("demo/a", 10), ("demo/b", 11)):
            session._begin_acquire(key, None)
            holds[key] = Hold(key, SESSION, FencingToken(revision), 0, revision)
            session._granted(holds[key], lambda reason, key=key: fired.append((key, reason)))
        eventually("the first renewal", 3, lambda: len(servicer.arrivals) >= 1)
        notice = lock_pb2.KeepAliveResponse(session_id=SESSION, remaining_ttl_seconds=-1)
        notice.ended_holds.add(key="demo/a", revision=9)  # an older hold of the key: not ours
        notice.ended_holds.add(key="demo/a", revision=10)
        servicer.push(notice)
        eventually("the notice", 4, lambda: fired)
        assert fired == [("demo/a", FenceReason.HOLD_ENDED)]
        assert holds["demo/a"].ended and not holds["demo/b"].ended
        assert not session.is_fenced and session.can_start(), "the session lives on"
    finally:
        session._shutdown()


def test_shutdown_stops_the_sessions_threads(fake):
    _, stub = fake
    session, _ = open_session(stub)
    name = f"-{SESSION}"
    session._shutdown()

    def gone():
        return not [t for t in threading.enumerate() if t.name.startswith("latchkey-") and t.name.endswith(name)]

    eventually("the keepalive, reader and watchdog threads to stop", 3, gone)


def test_a_notice_of_a_shared_hold_fences_it_by_key_and_revision(fake):
    # A shared hold's notice names the lock's key (not the arbiter's reader
    # key) with mode SHARED, and is matched like any hold's.
    servicer, stub = fake
    session, _ = open_session(stub)
    fired = []
    try:
        session._begin_acquire("demo/r", None, True)
        hold = Hold("demo/r", SESSION, FencingToken(12), 0, 12, shared=True)
        session._granted(hold, fired.append)
        eventually("the first renewal", 3, lambda: len(servicer.arrivals) >= 1)
        notice = lock_pb2.KeepAliveResponse(session_id=SESSION, remaining_ttl_seconds=-1)
        notice.ended_holds.add(key="demo/r", revision=11, mode=lock_pb2.MODE_SHARED)  # an older hold
        notice.ended_holds.add(key="demo/r", revision=12, mode=lock_pb2.MODE_SHARED)
        servicer.push(notice)
        eventually("the notice", 4, lambda: fired)
        assert fired == [FenceReason.HOLD_ENDED]
        assert hold.ended
        assert not session.is_fenced, "the session lives on"
    finally:
        session._shutdown()
