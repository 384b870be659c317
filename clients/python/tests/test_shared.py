"""Shared holds through the client against an in-process fake Lock service (a
unit test: the real stack is test_stack.py's shared-lock test). What is
checked is what goes on the wire: the mode of each Acquire and Release, that a
re-entry in the other mode sends nothing, and how Inspect's shared holders
read."""

from __future__ import annotations

import threading
import weakref
from concurrent import futures

import grpc
import pytest

import latchkey
from latchkey._client import Client
from latchkey.lock.v1 import lock_pb2, lock_pb2_grpc

SESSION = 42
TTL = 30


class FakeArbiter(lock_pb2_grpc.LockServicer):
    """Grants every Acquire in the mode asked, records every request."""

    def __init__(self) -> None:
        self.acquires: "list[lock_pb2.AcquireRequest]" = []
        self.releases: "list[lock_pb2.ReleaseRequest]" = []
        self._revision = 100
        self._lock = threading.Lock()

    def OpenSession(self, request, context):
        return lock_pb2.OpenSessionResponse(session_id=SESSION, ttl_seconds=TTL, keepalive_interval_ms=10_000)

    def KeepAlive(self, requests, context):
        for request in requests:
            yield lock_pb2.KeepAliveResponse(session_id=request.session_id, remaining_ttl_seconds=TTL)

    def CloseSession(self, request, context):
        return lock_pb2.CloseSessionResponse()

    def Acquire(self, request, context):
        with self._lock:
            self.acquires.append(request)
            self._revision += 1
            revision = self._revision
        grant = lock_pb2.Grant(
            key=request.key,
            token=(1 << 48) + revision,
            epoch=1,
            revision=revision,
            session_id=request.session_id,
            mode=request.mode,
        )
        return lock_pb2.AcquireResponse(grant=grant)

    def Release(self, request, context):
        with self._lock:
            self.releases.append(request)
        return lock_pb2.ReleaseResponse()

    def Inspect(self, request, context):
        def reader(identity: str, session_id: int) -> lock_pb2.Holder:
            return lock_pb2.Holder(
                identity=identity, session_id=session_id, acquired_at_unix_ms=1, mode=lock_pb2.MODE_SHARED,
                **{"class": "demo"},
            )

        return lock_pb2.InspectResponse(
            key=request.key,
            shared_holders=[reader("spiffe://t/a", SESSION), reader("spiffe://t/b", 0)],
        )


@pytest.fixture
def fake():
    servicer = FakeArbiter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    lock_pb2_grpc.add_LockServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    client = _client(channel)
    yield servicer, client
    client.close()
    server.stop(0)


def _client(channel) -> Client:
    """A Client on a plain channel: the constructor insists on mTLS, which
    this fake does not speak; everything after the channel is the same."""
    client = Client.__new__(Client)
    client._instance = "test:1"
    client._endpoint = "fake"
    client._default_class = "demo"
    client._request_timeout = 2.0
    client._channel = channel
    client._stub = lock_pb2_grpc.LockStub(channel)
    client._observations = weakref.WeakSet()
    client._lock = threading.Lock()
    client._opening = threading.Lock()
    client._sessions = {}
    client._by_class = {}
    client._closed = False
    return client


def test_a_shared_acquire_sends_mode_shared_and_its_release_says_so_too(fake):
    servicer, client = fake
    with client.lock("demo/r", shared=True) as guard:
        assert guard.shared
        assert "shared=True" in repr(guard)
    (acquire,) = servicer.acquires
    assert acquire.mode == lock_pb2.MODE_SHARED
    (release,) = servicer.releases
    assert release.mode == lock_pb2.MODE_SHARED
    assert release.token == guard.token.value
    assert not release.HasField("slot")


def test_an_exclusive_acquire_is_the_default(fake):
    servicer, client = fake
    guard = client.acquire("demo/w")
    assert not guard.shared
    guard.release()
    assert [a.mode for a in servicer.acquires] == [lock_pb2.MODE_EXCLUSIVE]
    assert [r.mode for r in servicer.releases] == [lock_pb2.MODE_EXCLUSIVE]


def test_a_shared_hold_is_re_entered_shared_and_never_upgraded(fake):
    servicer, client = fake
    outer = client.acquire("demo/r", shared=True)
    inner = client.acquire("demo/r", shared=True)
    assert inner.shared and inner.token == outer.token and outer.hold_count == 2
    with pytest.raises(latchkey.UpgradeRefused) as refused:
        client.acquire("demo/r")
    assert refused.value.reason == "UPGRADE_REFUSED"
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(refused.value, latchkey.FailedPrecondition)
    assert "release it" in str(refused.value)
    with pytest.raises(latchkey.UpgradeRefused):
        with client.lock("demo/r", timeout=1):
            pass
    assert len(servicer.acquires) == 1, "refused without a call"
    assert outer.hold_count == 2, "the refusal left the hold's count alone"
    inner.release()
    outer.release()
    assert [r.mode for r in servicer.releases] == [lock_pb2.MODE_SHARED]
    # released: the key may be taken exclusively now
    with client.lock("demo/r") as writer:
        assert not writer.shared
    assert [a.mode for a in servicer.acquires] == [lock_pb2.MODE_SHARED, lock_pb2.MODE_EXCLUSIVE]


def test_an_exclusive_hold_is_not_re_entered_shared(fake):
    servicer, client = fake
    with client.lock("demo/w") as writer:
        with pytest.raises(latchkey.FailedPrecondition) as refused:
            client.acquire("demo/w", shared=True)
        assert type(refused.value) is latchkey.FailedPrecondition
        assert refused.value.reason == "BAD_REQUEST"
        assert "exclusively" in str(refused.value)
        assert writer.hold_count == 1
    assert len(servicer.acquires) == 1, "no downgrade is asked of the arbiter"
    assert [r.mode for r in servicer.releases] == [lock_pb2.MODE_EXCLUSIVE]


def test_inspect_lists_shared_holders(fake):
    _, client = fake
    seen = client.inspect("demo/r")
    assert seen.holder is None and seen.slot_holders == []
    assert [(h.identity, h.session_id, h.shared, h.slot) for h in seen.shared_holders] == [
        ("spiffe://t/a", SESSION, True, None),
        ("spiffe://t/b", 0, True, None),
    ]
