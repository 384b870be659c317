"""The client against the real stack: Envoy with the edge filter, the arbiter,
etcd, over mTLS with dev SVIDs (see conftest.py for how it is started)."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest

import latchkey
from conftest import eventually
from latchkey import FenceReason
from latchkey.lock.v1 import lock_pb2

ALICE = "spiffe://dev.latchkey/workload/alice"
BOB = "spiffe://dev.latchkey/workload/bob"


class Recorder:
    """An on_fence callback that records (monotonic time, reason)."""

    def __init__(self) -> None:
        self.fired: list = []
        self._lock = threading.Lock()

    def __call__(self, reason: FenceReason) -> None:
        with self._lock:
            self.fired.append((time.monotonic(), reason))

    def reasons(self) -> list:
        with self._lock:
            return [reason for _, reason in self.fired]


def test_acquire_and_release_hand_out_increasing_tokens(alice):
    first = alice.acquire("demo/py/tokens")
    assert not first.unprotected, "etcd has quorum: a fenced grant"
    seen = alice.inspect("demo/py/tokens")
    assert seen.holder is not None
    assert seen.holder.identity == ALICE, "the identity is the SVID's"
    assert seen.holder.session_id == first.session_id
    first.release()
    assert alice.inspect("demo/py/tokens").holder is None
    second = alice.acquire("demo/py/tokens")
    assert second.token > first.token
    assert second.token.value > first.token.value > 0
    assert second.session_id == first.session_id, "one session per TTL"
    second.release()


def test_nested_acquires_are_one_hold_at_the_arbiter(alice, harness):
    outer = alice.acquire("demo/py/nested")
    before = harness.etcd_revision()
    inner = alice.acquire("demo/py/nested")
    assert inner.token == outer.token
    assert outer.hold_count == 2
    assert harness.etcd_revision() == before, "a nested acquire must not write to the lock log"
    inner.release()
    assert outer.hold_count == 1
    assert harness.etcd_revision() == before, "an inner release must not write to the lock log"
    assert alice.inspect("demo/py/nested").holder.session_id == outer.session_id, "still held"
    outer.release()
    assert alice.inspect("demo/py/nested").holder is None, "the outermost release frees the key"
    assert harness.etcd_revision() > before


def test_with_lock_holds_for_the_block_and_releases_on_exit(alice):
    with alice.lock("demo/py/with", timeout=5) as guard:
        assert guard.can_start()
        assert alice.inspect("demo/py/with").holder.identity == ALICE
        with alice.lock("demo/py/with") as again:  # re-entrant
            assert again.hold_count == 2
    assert alice.inspect("demo/py/with").holder is None
    with pytest.raises(ZeroDivisionError):
        with alice.lock("demo/py/with"):
            1 / 0
    assert alice.inspect("demo/py/with").holder is None, "released when the block raised"


def test_a_second_identity_waits_and_gets_the_key_with_a_larger_token(alice, bob):
    held = alice.acquire("demo/py/contended")
    with pytest.raises(latchkey.Held):
        bob.acquire("demo/py/contended")  # try-lock
    got = {}

    def wait_for_it():
        try:
            with bob.lock("demo/py/contended", timeout=20) as guard:
                got["token"] = guard.token
                got["holder"] = bob.inspect("demo/py/contended").holder.identity
        except Exception as error:  # reported below
            got["error"] = error

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    eventually("bob to queue", 10, lambda: alice.inspect("demo/py/contended").waiters == 1)
    assert "token" not in got, "bob must not get a held key"
    held.release()
    waiter.join(20)
    assert not waiter.is_alive()
    assert "error" not in got, got.get("error")
    assert got["holder"] == BOB
    assert got["token"] > held.token


def test_threads_sharing_a_client_take_a_key_one_at_a_time(alice, harness):
    # Issue 37: four threads sharing one client were all inside `with
    # client.lock(k)` at once (re-entrancy counted per session).
    key = "demo/py/threads"
    inside = []
    overlaps = []
    grants = []
    guard_lock = threading.Lock()

    def worker(n):
        for _ in range(5):
            with alice.lock(key, timeout=30) as guard:
                with guard_lock:
                    inside.append(n)
                    if len(inside) > 1:
                        overlaps.append(list(inside))
                    grants.append(guard.token)
                with alice.lock(key) as again:  # the same thread re-enters
                    assert again.hold_count == 2
                time.sleep(0.01)
                with guard_lock:
                    inside.remove(n)

    before = harness.etcd_revision()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert overlaps == [], f"two threads inside at once: {overlaps[:3]}"
    assert len(grants) == 20
    assert len(set(grants)) == 20, "each entry of each thread is its own grant"
    assert harness.etcd_revision() > before
    assert alice.inspect(key).holder is None


def test_another_thread_of_the_client_is_refused_or_waits_like_anyone(alice):
    key = "demo/py/threads-try"
    held = alice.acquire(key)
    got = {}

    def other():
        try:
            alice.acquire(key)
        except latchkey.Held as error:
            got["try"] = error
        try:
            alice.acquire(key, wait=0.3)
        except latchkey.WaitTimeout as error:
            got["timeout"] = error
        guard = alice.acquire(key, wait=10)
        got["token"] = guard.token
        guard.release()

    thread = threading.Thread(target=other)
    thread.start()
    eventually("the other thread's refusals", 5, lambda: "timeout" in got)
    assert got["try"].reason == "HELD"
    assert "another thread" in str(got["try"])
    assert "token" not in got, "it waits while this thread holds the key"
    held.release()
    thread.join(15)
    assert got["token"] > held.token


def test_a_wait_that_runs_out_is_a_deadline(alice, bob):
    with alice.lock("demo/py/timeout"):
        with pytest.raises(latchkey.DeadlineExceeded):
            bob.acquire("demo/py/timeout", wait=0.5)


def test_a_key_outside_the_callers_grants_is_refused(alice):
    # alice's grants are demo/ and shared/; payments/ belongs to workload/demo
    with pytest.raises(latchkey.PermissionDenied) as refused:
        alice.acquire("payments/py/ledger")
    assert refused.value.reason == "NOT_AUTHORISED"
    assert not refused.value.is_transient()
    # ...and refusing it left nothing behind in the session's table
    with pytest.raises(latchkey.PermissionDenied):
        alice.acquire("payments/py/ledger")


def test_releasing_twice_and_releasing_what_is_not_ours(alice, bob):
    guard = alice.acquire("demo/py/twice")
    guard.release()
    guard.release()  # a released guard is done; nothing is sent
    other = bob.acquire("demo/py/twice")
    with pytest.raises(latchkey.NotHeld):
        # alice's stale grant against bob's hold: the arbiter refuses it
        alice._release(guard._hold)
    other.release()


def test_a_removed_hold_is_fenced_at_once_and_the_session_lives_on(connect, harness):
    # batch-report's TTL is 60 s: a fence within the poll below can only be the push.
    alice = connect("ALICE", default_class="batch-report")
    lost, kept = Recorder(), Recorder()
    a = alice.acquire("demo/py/push-a", on_fence=lost)
    a2 = alice.acquire("demo/py/push-a", on_fence=lost)
    b = alice.acquire("demo/py/push-b", on_fence=kept)
    harness.remove_hold("demo/py/push-a")
    eventually("the notice of the ended hold", 10, lambda: len(lost.reasons()) == 2)
    assert lost.reasons() == [FenceReason.HOLD_ENDED] * 2, "once per guard"
    assert a.is_fenced and a2.is_fenced and not a.can_start()
    assert kept.reasons() == [], "only that hold is fenced"
    assert not b.is_fenced and b.can_start(), "the session lives on"
    with pytest.raises(latchkey.Fenced) as fenced:
        a.release()
    assert fenced.value.reason is FenceReason.HOLD_ENDED
    with pytest.raises(latchkey.Fenced):
        a2.release()
    again = alice.acquire("demo/py/push-a")
    assert again.session_id == b.session_id
    assert again.revision > b.revision
    again.release()  # her own release tells her nothing
    b.release()
    time.sleep(0.3)  # let a (wrong) notice of her own releases arrive
    assert kept.reasons() == []


def test_closing_the_client_fences_its_holds(connect, harness):
    alice = connect("ALICE")
    fired = Recorder()
    guard = alice.acquire("demo/py/closed", on_fence=fired)
    alice.close()
    assert fired.reasons() == [FenceReason.CLOSED]
    assert guard.is_fenced and not guard.can_start()
    session = f"-{guard.session_id}"
    eventually(
        "the session's threads to stop",
        3,
        lambda: not [t for t in threading.enumerate() if t.name.startswith("latchkey-") and t.name.endswith(session)],
    )
    with pytest.raises(latchkey.ConfigError, match="closed"):
        alice.acquire("demo/py/closed")
    other = connect("BOB")
    assert other.inspect("demo/py/closed").holder is None, "CloseSession released the hold"


def test_tokens_never_reach_reprs_errors_or_logs(alice, bob, caplog):
    caplog.set_level(logging.DEBUG)
    guard = alice.acquire("demo/py/secret")
    value = str(guard.token.value)
    shown = [repr(guard), str(guard), repr(guard.token), str(guard.token), f"{guard.token}", repr(guard.session), repr(alice)]
    try:
        bob.acquire("demo/py/secret")
    except latchkey.Held as error:
        shown += [str(error), repr(error)]
    nested = alice.acquire("demo/py/secret")
    shown.append(repr(nested))
    nested.release()
    guard.release()
    try:
        guard._client._release(guard._hold)  # a refused release names no token
    except latchkey.NotHeld as error:
        shown += [str(error), repr(error)]
    shown.append(caplog.text)
    for text in shown:
        assert value not in text, text
    assert "redacted" in repr(guard)


@pytest.mark.takes_arbiter_away
def test_a_dark_path_stops_new_work_then_fences_at_the_send_time_deadline(connect, harness):
    # `short` has a 5 s TTL: renewals every ~1.7 s, the deadline 4 s after the
    # send of the last successful renewal.
    alice = connect("ALICE", default_class="short")
    fired = Recorder()
    guard = alice.acquire("demo/py/dark", on_fence=fired)
    # Renewals through Envoy move the deadline, interval after interval.
    for renewal in ("the renewal at stream open", "the next renewal"):
        before = guard.fence_deadline
        eventually(renewal, 5, lambda: guard.fence_deadline > before)
    assert guard.can_start()
    harness.block_arbiter()
    blocked_at = time.monotonic()
    eventually("can_start() to turn false", 6, lambda: not guard.can_start())
    # Stage one starts half an interval after a renewal goes unanswered,
    # well before the deadline (1.5 s before it with this TTL).
    assert fired.reasons() == [], "stage one comes before the fence"
    deadline = guard.fence_deadline
    # The last renewal that moved the deadline was sent before the path went
    # dark, so the deadline is at most TTL - margin after the block.
    assert deadline <= blocked_at + 5 - latchkey.FENCE_MARGIN + 0.05
    eventually("on_fence at the deadline", 8, lambda: fired.reasons())
    (fired_at, reason), = fired.fired
    assert reason is FenceReason.DEADLINE_EXCEEDED
    assert fired_at >= deadline, "never before the send-time deadline"
    assert guard.is_fenced and guard.remaining_ttl() == 0
    with pytest.raises(latchkey.Fenced):
        alice.acquire("demo/py/dark-2", session=guard.session)
    with pytest.raises(latchkey.Fenced):
        guard.release()
    # A new session cannot be had on the dark path either: a transient refusal.
    late = connect("BOB", request_timeout=2.0)
    with pytest.raises((latchkey.DeadlineExceeded, latchkey.Unavailable)) as refused:
        late.acquire("demo/py/dark-3")
    assert refused.value.is_transient()


def test_bad_input_is_refused_with_an_actionable_reason(alice):
    with pytest.raises(latchkey.InvalidArgument) as refused:
        alice.acquire("demo//double-slash")
    assert refused.value.reason == "BAD_KEY", refused.value
    with pytest.raises(latchkey.InvalidArgument) as refused:
        alice.acquire("demo/py/x", "no-such-class")
    assert refused.value.reason == "UNKNOWN_CLASS", refused.value
    assert "no-such-class" in refused.value.message


def test_a_semaphore_grants_one_slot_per_session(connect):
    # class builds: kind = "semaphore", permits = 2
    a = connect("ALICE", default_class="builds")
    b = connect("BOB", default_class="builds")
    c = connect("ALICE", default_class="builds")
    first = a.acquire("demo/py/pool")
    second = b.acquire("demo/py/pool")
    assert {first.slot, second.slot} == {0, 1}
    assert first.key == "demo/py/pool"
    with pytest.raises(latchkey.Held):
        c.acquire("demo/py/pool")
    seen = a.inspect("demo/py/pool")
    assert seen.holder is None
    assert [h.slot for h in seen.slot_holders] == [0, 1]
    # a key is one kind at a time
    plain = connect("ALICE", default_class="demo")
    with pytest.raises(latchkey.KindInUse) as refused:
        plain.acquire("demo/py/pool")
    assert refused.value.reason == "KIND_IN_USE"
    # a released slot goes to the next caller, with a larger token
    freed = first.slot
    first.release()
    third = c.acquire("demo/py/pool")
    assert third.slot == freed
    assert third.token.value > first.token.value
    second.release()
    third.release()
    assert a.inspect("demo/py/pool").slot_holders == []


def test_shared_holds_exclude_only_exclusive_holders(connect):
    # class demo: a plain lock class (kind = "lock", fairness "memory": the
    # arbiter's own queue), so it takes shared holds
    key = "demo/py/shared"
    a = connect("ALICE", default_class="demo")
    b = connect("BOB", default_class="demo")
    writer = connect("ALICE", default_class="demo", instance="py-shared-writer")
    first = a.acquire(key, shared=True)
    second = b.acquire(key, shared=True)
    assert first.shared and second.shared
    assert first.token.value > 0 and second.token.value > 0
    assert first.session_id != second.session_id, "two sessions hold the key at once"
    with pytest.raises(latchkey.Held) as refused:
        writer.acquire(key)
    assert refused.value.reason == "HELD"
    seen = a.inspect(key)
    assert seen.holder is None, "no exclusive holder beside the shared ones"
    assert len(seen.shared_holders) == 2
    assert all(h.shared for h in seen.shared_holders)
    assert sorted(h.identity for h in seen.shared_holders) == [ALICE, BOB]
    # The client never upgrades its own shared hold: refused without a call...
    with pytest.raises(latchkey.UpgradeRefused) as refused:
        with a.lock(key, timeout=2):
            pass
    assert refused.value.reason == "UPGRADE_REFUSED"
    assert first.hold_count == 1
    # ...as the arbiter refuses the session's exclusive Acquire of it.
    request = lock_pb2.AcquireRequest(
        key=key, session_id=first.session_id, wait=lock_pb2.WAIT_NONE, instance=a._instance, **{"class": "demo"}
    )
    with pytest.raises(latchkey.UpgradeRefused) as refused:
        a._call(a._stub.Acquire, request)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    first.release()
    second.release()
    assert a.inspect(key).shared_holders == []
    with writer.lock(key, timeout=10) as exclusive:
        assert not exclusive.shared
        assert exclusive.token > first.token and exclusive.token > second.token
        seen = a.inspect(key)
        assert seen.holder is not None and not seen.holder.shared
        assert seen.shared_holders == []


def test_a_downgraded_writer_reads_beside_other_readers_and_keeps_writers_out(connect):
    key = "demo/py/downgrade"
    a = connect("ALICE", default_class="demo")
    b = connect("BOB", default_class="demo")
    writer = connect("ALICE", default_class="demo", instance="py-downgrade-writer")
    fenced = []
    guard = a.acquire(key, on_fence=fenced.append)
    exclusive_token = guard.token
    with pytest.raises(latchkey.Held):
        b.acquire(key, shared=True)
    guard.downgrade()
    assert guard.shared
    # docs/fencing.md: a shared token is above the last exclusive grant.
    assert guard.token > exclusive_token
    reader = b.acquire(key, shared=True)
    assert reader.shared and reader.token > exclusive_token
    with pytest.raises(latchkey.Held):
        writer.acquire(key)
    seen = a.inspect(key)
    assert seen.holder is None, "the exclusive hold is gone"
    assert sorted(h.identity for h in seen.shared_holders) == [ALICE, BOB]
    with pytest.raises(latchkey.FailedPrecondition):
        guard.downgrade()
    guard.release()
    reader.release()
    with writer.lock(key, timeout=10) as exclusive:
        assert exclusive.token > guard.token and exclusive.token > reader.token
    assert fenced == [], "the downgrade fenced nothing"


def test_a_semaphore_takes_no_shared_holds(connect):
    with pytest.raises(latchkey.InvalidArgument) as refused:
        connect("ALICE", default_class="builds").acquire("demo/py/shared-pool", shared=True)
    assert refused.value.reason == "BAD_REQUEST", refused.value


def test_a_full_quota_is_quota_exceeded(connect):
    # class quota: maxHoldsPerSubject = 2, enforced in the grant transaction
    client = connect("ALICE", default_class="quota")
    first = client.acquire("demo/py/quota-1")
    second = client.acquire("demo/py/quota-2")
    with pytest.raises(latchkey.QuotaExceeded) as refused:
        client.acquire("demo/py/quota-3")
    assert refused.value.reason == "QUOTA_EXCEEDED"
    assert isinstance(refused.value, latchkey.FailedPrecondition)
    assert not refused.value.is_transient()
    assert "maxHoldsPerSubject" in str(refused.value)
    first.release()
    # a released hold gives its place back
    third = client.acquire("demo/py/quota-3")
    second.release()
    third.release()
