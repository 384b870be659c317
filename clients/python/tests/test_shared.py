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
        #: Runs inside each shared Acquire before it is answered (a notice
        #: arriving while a downgrade is in flight, say).
        self.during_shared = None
        #: A shared Acquire is refused with this (code, reason) instead...
        self.refuse_shared = None
        #: ...this many times (None: every time).
        self.refuse_times = None
        #: Releases of these tokens are refused NOT_HELD.
        self.not_held_tokens = set()

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
        if request.mode == lock_pb2.MODE_SHARED:
            if self.during_shared is not None:
                self.during_shared()
            if self.refuse_shared is not None and self.refuse_times != 0:
                if self.refuse_times is not None:
                    self.refuse_times -= 1
                _refuse(context, *self.refuse_shared)
        grant = lock_pb2.Grant(
            key=request.key,
            token=(1 << 48) + revision,
            epoch=1,
            revision=revision,
            session_id=request.session_id,
            mode=request.mode,
        )
        if getattr(request, "class") == "slots":
            # A semaphore class of 3 permits: the grant names its slot.
            grant.slot = 1
            grant.permits = 3
        return lock_pb2.AcquireResponse(grant=grant)

    def Release(self, request, context):
        if request.token in self.not_held_tokens:
            _refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "NOT_HELD")
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


def _refuse(context, code: grpc.StatusCode, reason: str) -> None:
    """Aborts the call as the arbiter refuses: the code, and an ErrorInfo
    reason in the status details trailer."""
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status(code=code.value[0], message=f"refused: {reason}")
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain="latchkey.dev"))
    context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
    context.abort(code, f"refused: {reason}")


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
    client._stubs = (lock_pb2_grpc.LockStub(channel), None)
    client._retired = []
    client._tls_lock = threading.Lock()
    # No SVID files to look at.
    client._next_tls_check = float("inf")
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


def test_a_downgrade_is_a_shared_acquire_whose_grant_replaces_the_hold(fake):
    servicer, client = fake
    fenced = []
    guard = client.acquire("demo/d", metadata={"ticket": "CHG-1"}, on_fence=fenced.append)
    writer = guard.token
    guard.downgrade()
    assert guard.shared and "shared=True" in repr(guard)
    assert guard.token > writer, "the shared grant's token is above the exclusive one"
    exclusive, downgrade = servicer.acquires
    assert exclusive.mode == lock_pb2.MODE_EXCLUSIVE
    assert downgrade.mode == lock_pb2.MODE_SHARED
    assert downgrade.wait == lock_pb2.WAIT_NONE, "a downgrade never queues"
    assert (downgrade.key, downgrade.session_id, getattr(downgrade, "class")) == ("demo/d", SESSION, "demo")
    assert dict(downgrade.metadata) == {"ticket": "CHG-1"}, "the class's hooks see the same request"
    assert downgrade.HasField("downgrade_from") and downgrade.downgrade_from == writer.value, (
        "it names the exclusive hold it converts: never a fresh shared grant"
    )
    assert not exclusive.HasField("downgrade_from")
    assert downgrade.instance == exclusive.instance
    # Re-entered in its new mode only.
    with pytest.raises(latchkey.UpgradeRefused):
        client.acquire("demo/d")
    inner = client.acquire("demo/d", shared=True)
    assert inner.token == guard.token and guard.hold_count == 2
    inner.release()
    guard.release()
    (release,) = servicer.releases
    assert release.mode == lock_pb2.MODE_SHARED
    assert release.token == guard.token.value, "released with the shared grant's token"
    assert fenced == []


def test_the_notice_that_the_exclusive_hold_ended_fences_nothing_when_the_downgrade_lands(fake):
    servicer, client = fake
    fenced = []
    guard = client.acquire("demo/d", on_fence=fenced.append)
    old_revision = guard.revision
    # The downgrade ends the exclusive hold at the arbiter, whose notice of
    # that may beat the answer to the client.
    servicer.during_shared = lambda: guard.session._hold_ended("demo/d", old_revision)
    guard.downgrade()
    assert guard.shared and not guard.is_fenced and fenced == []
    guard.session._hold_ended("demo/d", old_revision)  # or come after it
    assert not guard.is_fenced and fenced == []
    guard.release()
    assert [r.mode for r in servicer.releases] == [lock_pb2.MODE_SHARED]


def test_a_refused_downgrade_leaves_the_exclusive_hold(fake):
    servicer, client = fake
    guard = client.acquire("demo/d")
    writer = guard.token
    servicer.refuse_shared = (grpc.StatusCode.PERMISSION_DENIED, "HOOK_DENIED")
    with pytest.raises(latchkey.Refused) as refused:
        guard.downgrade()
    assert refused.value.reason == "HOOK_DENIED"
    assert not guard.shared and guard.token == writer and not guard.is_fenced
    # The key is still this thread's, exclusively: re-entered, no call.
    with client.lock("demo/d") as inner:
        assert inner.token == writer
    guard.release()
    assert [(r.mode, r.token) for r in servicer.releases] == [(lock_pb2.MODE_EXCLUSIVE, writer.value)]


def test_a_failed_downgrade_whose_hold_ended_meanwhile_is_fenced(fake):
    servicer, client = fake
    fenced = []
    guard = client.acquire("demo/d", on_fence=fenced.append)
    old_revision = guard.revision
    servicer.during_shared = lambda: guard.session._hold_ended("demo/d", old_revision)
    servicer.refuse_shared = (grpc.StatusCode.ABORTED, "HELD")
    with pytest.raises(latchkey.Held):
        guard.downgrade()
    assert guard.is_fenced and fenced == [latchkey.FenceReason.HOLD_ENDED]
    with pytest.raises(latchkey.Fenced):
        guard.downgrade()
    with pytest.raises(latchkey.Fenced):
        guard.release()
    assert servicer.releases == []


def test_what_cannot_be_downgraded_is_refused_without_a_call(fake):
    servicer, client = fake
    reader = client.acquire("demo/r", shared=True)
    with pytest.raises(latchkey.FailedPrecondition) as refused:
        reader.downgrade()
    assert refused.value.reason == "BAD_REQUEST"
    assert "shared already" in str(refused.value)
    reader.release()

    outer = client.acquire("demo/w")
    inner = client.acquire("demo/w")
    with pytest.raises(latchkey.FailedPrecondition) as refused:
        inner.downgrade()
    assert "2 guards" in str(refused.value)
    assert outer.hold_count == 2 and not outer.shared
    inner.release()
    released = outer
    released.release()
    with pytest.raises(latchkey.FailedPrecondition):
        released.downgrade()

    lost = client.acquire("demo/l")
    lost.session._hold_ended("demo/l", lost.revision)
    with pytest.raises(latchkey.Fenced) as fenced:
        lost.downgrade()
    assert fenced.value.reason == latchkey.FenceReason.HOLD_ENDED
    assert [a.mode for a in servicer.acquires] == [
        lock_pb2.MODE_SHARED,
        lock_pb2.MODE_EXCLUSIVE,
        lock_pb2.MODE_EXCLUSIVE,
    ], "no downgrade was asked of the arbiter"


def test_a_downgrade_refused_not_held_fences_the_guard(fake):
    """NOT_HELD: the exclusive hold had ended at the arbiter before its notice
    came; a writer may have held the key since, so the guard holds nothing."""
    servicer, client = fake
    fenced = []
    guard = client.acquire("demo/d", on_fence=fenced.append)
    servicer.refuse_shared = (grpc.StatusCode.FAILED_PRECONDITION, "NOT_HELD")
    with pytest.raises(latchkey.NotHeld):
        guard.downgrade()
    assert guard.is_fenced and fenced == [latchkey.FenceReason.HOLD_ENDED]
    assert len(servicer.acquires) == 2, "NOT_HELD is an answer: not asked again"
    with pytest.raises(latchkey.Fenced):
        guard.release()
    assert servicer.releases == []
    # The key is free for this session again: a new acquire is a new call.
    servicer.refuse_shared = None
    with client.lock("demo/d") as again:
        assert again.token > guard.token
    assert len(servicer.acquires) == 3


def test_a_downgrade_whose_answer_was_lost_is_sent_again(fake):
    servicer, client = fake
    fenced = []
    guard = client.acquire("demo/d", on_fence=fenced.append)
    writer = guard.token
    servicer.refuse_shared = (grpc.StatusCode.UNAVAILABLE, "")
    servicer.refuse_times = 2
    guard.downgrade()
    assert guard.shared and guard.token > writer and fenced == []
    repeats = servicer.acquires[1:]
    assert len(repeats) == 3 and all(r.downgrade_from == writer.value for r in repeats), (
        "every repeat names the same exclusive hold"
    )
    guard.release()
    assert [r.mode for r in servicer.releases] == [lock_pb2.MODE_SHARED]


def _eventually(what, predicate, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_downgrade_that_stays_unknown_fences_the_guard_and_cleans_up(fake):
    """No attempt answered: the downgrade may have landed, so the guard is
    fenced (it never holds a hold this client has not heard of), and a thread
    ends whatever is left: here the downgrade never landed, so releasing the
    exclusive hold does. Until then the key's other acquirers wait."""
    servicer, client = fake
    fenced = []
    guard = client.acquire("demo/d", on_fence=fenced.append)
    writer = guard.token
    servicer.refuse_shared = (grpc.StatusCode.UNAVAILABLE, "")
    with pytest.raises(latchkey.Unavailable):
        guard.downgrade()
    assert guard.is_fenced and fenced == [latchkey.FenceReason.HOLD_ENDED]
    with pytest.raises(latchkey.Fenced):
        guard.release()
    _eventually("the clean-up never released the exclusive hold", lambda: servicer.releases)
    (release,) = servicer.releases
    assert (release.mode, release.token) == (lock_pb2.MODE_EXCLUSIVE, writer.value)
    assert len(servicer.acquires) == 1 + 4, "the four attempts, no repeat: the release settled it"
    # Then the key is the session's to acquire again.
    servicer.refuse_shared = None
    with client.lock("demo/d") as again:
        assert not again.shared
    assert len(servicer.releases) == 2


def test_a_downgrade_of_unknown_outcome_that_landed_is_found_and_released(fake):
    """The exclusive hold is gone at the arbiter (NOT_HELD to its release):
    the clean-up asks the downgrade again, which is answered with the shared
    hold it made, and releases that."""
    servicer, client = fake
    guard = client.acquire("demo/d")
    writer = guard.token
    servicer.refuse_shared = (grpc.StatusCode.DEADLINE_EXCEEDED, "")
    servicer.refuse_times = 4
    servicer.not_held_tokens.add(writer.value)
    with pytest.raises(latchkey.DeadlineExceeded):
        guard.downgrade()
    assert guard.is_fenced
    _eventually("the clean-up never released the downgrade's hold", lambda: servicer.releases)
    (release,) = servicer.releases
    assert release.mode == lock_pb2.MODE_SHARED and release.token > writer.value
    assert all(r.downgrade_from == writer.value for r in servicer.acquires[1:])


def test_an_error_that_may_follow_a_commit_is_an_unknown_outcome(fake):
    """Only refusals made before anything is written leave the exclusive hold
    to the guard; an INTERNAL error may follow the downgrade's commit."""
    servicer, client = fake
    fenced = []
    guard = client.acquire("demo/d", on_fence=fenced.append)
    servicer.refuse_shared = (grpc.StatusCode.INTERNAL, "")
    with pytest.raises(latchkey.Refused):
        guard.downgrade()
    assert len(servicer.acquires) == 2, "not sent again: it is no transient error"
    assert guard.is_fenced and fenced == [latchkey.FenceReason.HOLD_ENDED]
    _eventually("the clean-up never ran", lambda: servicer.releases)


def test_on_fence_may_release_its_guard_while_the_downgrade_fails(fake):
    """on_fence runs after the downgrade's turn on the guard: a callback that
    releases (or detaches) that guard does not wait for itself."""
    servicer, client = fake
    guards = []

    def on_fence(reason):
        guards[0].detach()

    guards.append(client.acquire("demo/d", on_fence=on_fence))
    servicer.refuse_shared = (grpc.StatusCode.FAILED_PRECONDITION, "NOT_HELD")
    done = threading.Event()

    def downgrade():
        with pytest.raises(latchkey.NotHeld):
            guards[0].downgrade()
        done.set()

    threading.Thread(target=downgrade, daemon=True).start()
    assert done.wait(5), "the downgrade deadlocked in its own on_fence"


def test_a_release_racing_a_downgrade_waits_for_it(fake):
    """downgrade() and release() on one guard take turns: a release from
    another thread while the downgrade is in flight releases the shared hold
    the downgrade installs, never the exclusive hold it replaced."""
    servicer, client = fake
    guard = client.acquire("demo/d")
    writer = guard.token
    in_flight = threading.Event()
    go = threading.Event()

    def hold_the_answer() -> None:
        in_flight.set()
        assert go.wait(5)

    servicer.during_shared = hold_the_answer
    downgrading = threading.Thread(target=guard.downgrade)
    downgrading.start()
    assert in_flight.wait(5)
    releasing = threading.Thread(target=guard.release)
    releasing.start()
    releasing.join(0.3)
    assert releasing.is_alive(), "the release waits for the downgrade in flight"
    go.set()
    downgrading.join(5)
    releasing.join(5)
    assert not downgrading.is_alive() and not releasing.is_alive()
    (release,) = servicer.releases
    assert release.mode == lock_pb2.MODE_SHARED and release.token > writer.value


def test_the_shared_holds_end_heard_before_the_downgrades_answer_fences_it(fake):
    """The notice that the downgrade's shared hold ended (its maxHoldSeconds
    counts from the exclusive grant) may beat the answer: the guard is fenced
    when the answer comes, never left holding an ended hold."""
    servicer, client = fake
    fenced = []
    guard = client.acquire("demo/d", on_fence=fenced.append)
    servicer.during_shared = lambda: guard.session._hold_ended("demo/d", servicer._revision)
    with pytest.raises(latchkey.Fenced):
        guard.downgrade()
    assert guard.is_fenced and fenced == [latchkey.FenceReason.HOLD_ENDED]
    with pytest.raises(latchkey.Fenced):
        guard.release()
    assert servicer.releases == []
    servicer.during_shared = None
    with client.lock("demo/d") as again:
        assert not again.is_fenced


def test_a_semaphores_grant_says_its_slot_and_permits(fake):
    _, client = fake
    with client.lock("demo/s", lock_class="slots") as guard:
        assert (guard.slot, guard.permits) == (1, 3)
    with client.lock("demo/l") as guard:
        assert (guard.slot, guard.permits) == (None, None)
