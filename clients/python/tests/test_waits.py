"""Waits as long as the caller asks, against the real stack: ``lock(timeout=None)``
waits until granted, and a wait longer than one ask (the edge's route timeout,
the arbiter's maximum wait) asks again within its deadline. And a normal
``close()`` is quiet."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import latchkey
import latchkey._client as client_module
from conftest import eventually


def _waiter(client, key, timeout, got):
    started = time.monotonic()

    def run():
        try:
            with client.lock(key, timeout=timeout) as guard:
                got["waited"] = time.monotonic() - started
                got["token"] = guard.token
        except Exception as error:  # reported by the test
            got["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_lock_without_a_timeout_waits_until_granted(alice, bob):
    held = alice.acquire("demo/py/forever")
    got: dict = {}
    waiter = _waiter(bob, "demo/py/forever", None, got)
    eventually("bob to queue", 10, lambda: alice.inspect("demo/py/forever").waiters == 1)
    time.sleep(1.0)
    assert not got, "bob must not get a held key"
    held.release()
    waiter.join(20)
    assert "error" not in got, got.get("error")
    assert got["token"] > held.token


def test_a_wait_longer_than_one_ask_asks_again_within_its_deadline(alice, bob, monkeypatch):
    # One ask of 1 s stands for the edge's 90 s route timeout: the wait of
    # 10 s outlives several asks and still gets the key.
    monkeypatch.setattr(client_module, "WAIT_ASK", 1.0)
    held = alice.acquire("demo/py/long-wait")
    got: dict = {}
    waiter = _waiter(bob, "demo/py/long-wait", 10, got)
    time.sleep(3.5)
    assert not got, "bob must not get a held key"
    held.release()
    waiter.join(15)
    assert "error" not in got, got.get("error")
    assert got["waited"] >= 3.5
    assert got["token"] > held.token


def test_a_wait_that_outlives_its_asks_still_ends_at_its_deadline(alice, bob, monkeypatch):
    monkeypatch.setattr(client_module, "WAIT_ASK", 1.0)
    with alice.lock("demo/py/long-timeout"):
        started = time.monotonic()
        with pytest.raises((latchkey.DeadlineExceeded, latchkey.WaitTimeout)):
            bob.acquire("demo/py/long-timeout", wait=2.5)
        took = time.monotonic() - started
    assert 2.4 <= took < 6, took


def test_closing_a_client_is_quiet(connect, caplog):
    client = connect("ALICE")
    with client.lock("demo/py/quiet") as guard:
        session = guard.session_id
    with caplog.at_level(logging.DEBUG, logger="latchkey"):
        client.close()
    # Only this client's records: other tests' clients' threads may still
    # be saying their last words.
    ours = [r for r in caplog.records if f"session {session} " in r.getMessage()]
    assert ours, "the close was not logged at all (at DEBUG)"
    loud = [r for r in ours if r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]


def test_on_fence_runs_after_every_thread_sees_the_hold_lost(connect, harness):
    # batch-report's TTL is 60 s: the fence below is the arbiter's push.
    client = connect("ALICE", default_class="batch-report")
    seen: dict = {}
    guard_box: dict = {}

    def lost(reason):
        guard = guard_box["guard"]
        seen["fenced"] = guard.is_fenced
        seen["can_start"] = guard.can_start()
        # Another thread, asked from inside the callback, sees it lost too.
        other: dict = {}
        t = threading.Thread(target=lambda: other.update(fenced=guard.is_fenced))
        t.start()
        t.join(5)
        seen["other_thread_fenced"] = other.get("fenced")

    guard_box["guard"] = client.acquire("demo/py/fence-order", on_fence=lost)
    harness.remove_hold("demo/py/fence-order")
    eventually("on_fence", 10, lambda: "other_thread_fenced" in seen)
    assert seen == {"fenced": True, "can_start": False, "other_thread_fenced": True}


def test_without_a_timeout_a_thread_waits_for_another_thread_of_its_client(alice):
    # The other thread's hold is waited for here, without an end.
    held = alice.acquire("demo/py/forever-thread")
    got: dict = {}
    waiter = _waiter(alice, "demo/py/forever-thread", None, got)
    time.sleep(0.5)
    assert not got, got
    held.release()
    waiter.join(10)
    assert "error" not in got, got.get("error")
    assert got["token"] > held.token
