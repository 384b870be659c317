"""Fixtures for the tests against the real stack.

tests/e2e/python_client.rs starts etcd, the arbiter and Envoy with the edge
filter (over mTLS, the arbiter behind a TCP proxy that can go dark), writes dev
SVIDs, and runs this suite with:

    LATCHKEY_TEST_ENDPOINT   Envoy's listener, host:port
    LATCHKEY_TEST_CA         the dev trust bundle
    LATCHKEY_TEST_{ALICE,BOB}_{CERT,KEY}   two workloads' SVIDs
    LATCHKEY_TEST_CONTROL    a directory for asking the harness to act
    LATCHKEY_TEST_FAST_ELECTION_CLASS an election class with a 5 s TTL

Without them the stack tests are skipped and only the pure tests run. The
harness runs pytest with LATCHKEY_TEST_REQUIRE_STACK=1, which turns a missing
variable into a failure instead.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import time

import pytest

import latchkey

_VARS = [
    "ENDPOINT",
    "CA",
    "ALICE_CERT",
    "ALICE_KEY",
    "BOB_CERT",
    "BOB_KEY",
    "CONTROL",
    "FAST_ELECTION_CLASS",
]


def pytest_collection_modifyitems(config, items):
    # Tests that take the arbiter away run after every other test.
    items.sort(key=lambda item: item.get_closest_marker("takes_arbiter_away") is not None)


def pytest_configure(config):
    config.addinivalue_line("markers", "takes_arbiter_away: runs last; leaves the arbiter unreachable")


@pytest.fixture(scope="session")
def stack_env():
    missing = [v for v in _VARS if not os.environ.get(f"LATCHKEY_TEST_{v}")]
    if missing:
        message = f"no stack: LATCHKEY_TEST_{', LATCHKEY_TEST_'.join(missing)} unset (run via tests/e2e/python_client.rs)"
        if os.environ.get("LATCHKEY_TEST_REQUIRE_STACK") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return {v: os.environ[f"LATCHKEY_TEST_{v}"] for v in _VARS}


def _client(env, who: str, default_class: str = "demo", request_timeout: float = 10.0, **options) -> latchkey.Client:
    return latchkey.Client(
        env["ENDPOINT"],
        ca=env["CA"],
        cert=env[f"{who}_CERT"],
        key=env[f"{who}_KEY"],
        default_class=default_class,
        connect_timeout=10.0,
        request_timeout=request_timeout,
        **options,
    )


@pytest.fixture
def alice(stack_env):
    with _client(stack_env, "ALICE") as client:
        yield client


@pytest.fixture
def bob(stack_env):
    with _client(stack_env, "BOB") as client:
        yield client


@pytest.fixture
def connect(stack_env):
    """Opens more clients (closed at the end of the test)."""
    made = []

    def make(who: str = "ALICE", default_class: str = "demo", request_timeout: float = 10.0, **options) -> latchkey.Client:
        client = _client(stack_env, who, default_class, request_timeout, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def fast_class(stack_env) -> str:
    """An election class with a 5 s TTL."""
    return stack_env["FAST_ELECTION_CLASS"]


class Harness:
    """Asks the Rust test to act: one request file per command, answered by a
    `.done` file ("ok <value>" or "error <message>")."""

    _ids = itertools.count()

    def __init__(self, control: str) -> None:
        self._dir = pathlib.Path(control)

    def ask(self, command: str, timeout: float = 15.0) -> str:
        n = f"{os.getpid()}-{next(self._ids):04d}"
        tmp = self._dir / f"{n}.tmp"
        tmp.write_text(command)
        tmp.rename(self._dir / f"{n}.req")
        done = self._dir / f"{n}.done"
        limit = time.monotonic() + timeout
        while not done.exists():
            if time.monotonic() > limit:
                raise TimeoutError(f"the harness did not answer {command!r} in {timeout} s")
            time.sleep(0.02)
        status, _, value = done.read_text().partition(" ")
        if status != "ok":
            raise RuntimeError(f"the harness failed {command!r}: {value}")
        return value

    def etcd_revision(self) -> int:
        return int(self.ask("revision"))

    def remove_hold(self, key: str) -> None:
        """What an operator's force-release does: the hold's record leaves the log."""
        self.ask(f"remove-hold {key}")

    def remove_leader(self, election: str) -> None:
        """The leader record leaves the log while its session lives (as when
        operators force the leadership out)."""
        self.ask(f"remove-leader {election}")

    def block_arbiter(self) -> None:
        """The network path from Envoy to the arbiter goes dark."""
        self.ask("block-arbiter")


@pytest.fixture
def harness(stack_env) -> Harness:
    return Harness(stack_env["CONTROL"])


def eventually(what: str, timeout: float, check):
    """Polls `check` (returns truthy when done) until `timeout` seconds pass."""
    limit = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > limit:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
