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

            async def first():
                async with client.lock("demo/py/aio") as guard:
                    # Re-entrant within the task.
                    async with client.lock("demo/py/aio") as again:
                        assert again.hold_count == 2 and again.token == guard.token
                    order.append("first in")
                    await asyncio.sleep(1.0)
                    order.append("first out")

            async def second():
                await asyncio.sleep(0.2)
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
            await asyncio.sleep(0.5)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            # alice lets go: bob's cancelled wait may be granted, and gives it back at once.
            await held.release()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                view = await alice.inspect("demo/py/aio-cancel")
                if view.holder is None and view.waiters == 0:
                    break
                await asyncio.sleep(0.1)
            view = await alice.inspect("demo/py/aio-cancel")
            assert view.holder is None, view
            again = await alice.acquire("demo/py/aio-cancel")
            await again.release()

    asyncio.run(main())
