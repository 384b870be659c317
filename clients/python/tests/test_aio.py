"""latchkey.aio against the real stack: a hold belongs to the asyncio task
that took it (re-entrant within it, exclusive between tasks), the event loop
never blocks, and a task cancelled while it waits keeps nothing."""

from __future__ import annotations

import asyncio
import time

import pytest

import latchkey
import latchkey.aio


async def _connect(env, who: str = "ALICE") -> latchkey.aio.Client:
    return await latchkey.aio.Client.connect(
        env["ENDPOINT"],
        ca=env["CA"],
        cert=env[f"{who}_CERT"],
        key=env[f"{who}_KEY"],
        default_class="demo",
        connect_timeout=10.0,
    )


def test_a_hold_belongs_to_its_task(stack_env):
    async def main():
        async with await _connect(stack_env) as client:
            order = []
            first_holds = asyncio.Event()

            async def first():
                async with client.lock("demo/py/aio") as guard:
                    # Re-entrant within the task.
                    async with client.lock("demo/py/aio") as again:
                        assert again.hold_count == 2 and again.token == guard.token
                    order.append("first in")
                    first_holds.set()
                    await asyncio.sleep(1.0)
                    order.append("first out")

            async def second():
                await first_holds.wait()
                # Another task of the same client: a try-lock is refused...
                with pytest.raises(latchkey.Held):
                    await client.acquire("demo/py/aio")
                # ...and a wait waits its turn.
                async with client.lock("demo/py/aio", timeout=10):
                    order.append("second in")

            ticks = 0

            async def ticker():
                nonlocal ticks
                while len(order) < 3:
                    ticks += 1
                    await asyncio.sleep(0.05)

            await asyncio.gather(first(), second(), ticker())
            assert order == ["first in", "first out", "second in"]
            assert ticks >= 10, "the event loop was blocked"

    asyncio.run(main())


def test_a_cancelled_wait_keeps_nothing(stack_env):
    async def main():
        async with await _connect(stack_env) as alice, await _connect(stack_env, "BOB") as bob:
            held = await alice.acquire("demo/py/aio-cancel")
            waiting = asyncio.ensure_future(bob.acquire("demo/py/aio-cancel", wait=20))
            deadline = time.monotonic() + 10
            while (await alice.inspect("demo/py/aio-cancel")).waiters == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            # The cancel reaches the arbiter, which drops bob's wait: alice's
            # release then leaves the key free.
            deadline = time.monotonic() + 10
            while (await alice.inspect("demo/py/aio-cancel")).waiters and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert (await alice.inspect("demo/py/aio-cancel")).waiters == 0
            await held.release()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                view = await alice.inspect("demo/py/aio-cancel")
                if view.holder is None and view.waiters == 0:
                    break
                await asyncio.sleep(0.1)
            view = await alice.inspect("demo/py/aio-cancel")
            assert view.holder is None, view
            # A grant committed just then is given back a moment later.
            for _ in range(100):
                try:
                    again = await alice.acquire("demo/py/aio-cancel")
                    break
                except latchkey.Held:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("the key never came back")
            await again.release()

    asyncio.run(main())


def test_a_task_goes_on_at_once_after_its_wait_is_cancelled(stack_env):
    async def main():
        async with await _connect(stack_env) as alice, await _connect(stack_env, "BOB") as bob:
            held = await alice.acquire("demo/py/aio-carry-on")
            mine = await bob.acquire("demo/py/aio-mine")
            # A wait without end, cancelled in this very task (asyncio.timeout
            # cancels the task and goes on): the task's next call runs at
            # once, not behind the abandoned wait.
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await bob.acquire("demo/py/aio-carry-on", wait=latchkey.FOREVER)
            started = time.monotonic()
            await mine.release()
            assert time.monotonic() - started < 5
            await held.release()

    if not hasattr(asyncio, "timeout"):
        pytest.skip("asyncio.timeout is Python 3.11+")
    asyncio.run(main())


def test_tasks_waiting_without_end_take_turns(stack_env):
    async def main():
        async with await _connect(stack_env) as client:
            order = []

            async def worker(name):
                async with client.lock("demo/py/aio-forever", timeout=None):
                    order.append(name)
                    await asyncio.sleep(0.3)

            await asyncio.gather(worker("a"), worker("b"), worker("c"))
            assert sorted(order) == ["a", "b", "c"]

    asyncio.run(main())
