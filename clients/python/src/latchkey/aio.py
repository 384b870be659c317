"""Latchkey for asyncio: ``latchkey.aio.Client``.

It wraps the threaded :class:`latchkey.Client`. Every blocking call an
asyncio task makes runs on that task's own worker thread. So a hold belongs
to the task that took it, as a hold of the threaded client belongs to its
thread:

- **Within one task** the hold is re-entrant (``guard.hold_count``).
- **Between tasks** it excludes: another task's try-lock raises
  :class:`latchkey.Held`, and its wait waits its turn.

The event loop never blocks. Keepalive, the fence deadline and the lock-loss
push are the threaded client's, unchanged.

A task cancelled while it waits for a key stops waiting at once: the call at
the arbiter is cancelled, and the task's thread is free for its next call.
Then the client asks once more, without waiting, on the same session: a grant
the arbiter made as the cancel travelled is answered to that ask and released,
so the key goes to the next waiter. A grant that lands after that ask (the
cancel still on its way) stays with the session until the session ends.

Ownership is per task. A hold taken inside a child task (``asyncio.wait_for``
before Python 3.12 runs its argument in one, as do ``gather`` and
``create_task``) belongs to that child: the parent re-entering the key waits
for it like another task would. A guard that is neither released nor left
with ``async with`` stays held until the client closes (or the session ends).

::

    async with await latchkey.aio.Client.connect("127.0.0.1:8443", ca=..., cert=..., key=...,
                                                  default_class="demo") as client:
        async with client.lock("demo/x", timeout=30) as guard:
            await write(batch, fencing_token=guard.token.value)
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional

from . import _client
from ._election import _Stopped
from ._errors import LatchkeyError
from ._token import FencingToken

__all__ = ["Client", "LockGuard"]


class Client:
    """An asyncio client. Make one with ``await Client.connect(...)``; it
    takes the same arguments as :class:`latchkey.Client`."""

    def __init__(self, sync: _client.Client) -> None:
        self._sync = sync
        # One worker thread per task, while the task lives.
        self._threads: "weakref.WeakKeyDictionary[asyncio.Task, ThreadPoolExecutor]" = weakref.WeakKeyDictionary()

    @classmethod
    async def connect(cls, *args: Any, **kwargs: Any) -> "Client":
        """Connects as :class:`latchkey.Client` does, off the event loop."""
        sync = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(_client.Client, *args, **kwargs)
        )
        return cls(sync)

    @classmethod
    async def from_env(cls, **options: Any) -> "Client":
        """As :meth:`latchkey.Client.from_env`, off the event loop."""
        sync = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(_client.Client.from_env, **options)
        )
        return cls(sync)

    @property
    def sync(self) -> _client.Client:
        """The threaded client underneath (for calls this API lacks)."""
        return self._sync

    def _thread(self) -> ThreadPoolExecutor:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("latchkey.aio is called from an asyncio task")
        executor = self._threads.get(task)
        if executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="latchkey-task")
            self._threads[task] = executor
            task.add_done_callback(lambda _t, e=executor: e.shutdown(wait=False))
        return executor

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn` on this task's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread(), functools.partial(fn, *args, **kwargs))

    async def acquire(
        self,
        key: str,
        lock_class: Optional[str] = None,
        *,
        wait: Optional[float] = None,
        on_fence=None,
        metadata: Optional[Mapping[str, str]] = None,
        shared: bool = False,
    ) -> "LockGuard":
        """As :meth:`latchkey.Client.acquire`, for this task."""
        loop = asyncio.get_running_loop()
        # Set when the task is cancelled: the call at the arbiter is
        # cancelled with it, so the task's thread is free again at once.
        stop = threading.Event()
        handing = threading.Lock()
        handed = []

        def attempt():
            try:
                guard = self._sync.acquire(
                    key,
                    lock_class,
                    wait=wait,
                    on_fence=on_fence,
                    metadata=metadata,
                    shared=shared,
                    _stop=stop,
                )
            except _Stopped:
                return None
            with handing:
                if not stop.is_set():
                    handed.append(guard)
                    return guard
            # Granted as the wait was cancelled: given back here, on the
            # task's own thread, so the key goes to the next waiter.
            _release_quietly(guard)
            return None

        future = loop.run_in_executor(self._thread(), attempt)
        try:
            guard = await asyncio.shield(future)
        except asyncio.CancelledError:
            with handing:
                stop.set()
                late = list(handed)
            # Handed over just as the task was cancelled: given back off
            # the event loop.
            for g in late:
                threading.Thread(target=_release_quietly, args=(g,), daemon=True).start()
            raise
        if guard is None:  # stopped: only a cancel sets `stop`
            raise asyncio.CancelledError()
        return LockGuard(self, guard)

    def lock(
        self,
        key: str,
        lock_class: Optional[str] = None,
        *,
        timeout: Optional[float] = 30.0,
        on_fence=None,
        metadata: Optional[Mapping[str, str]] = None,
        shared: bool = False,
    ) -> "_LockContext":
        """``async with client.lock(key) as guard:``: waits up to `timeout`
        seconds (``None``: until granted) and releases when the block ends."""
        wait = _client.FOREVER if timeout is None else timeout
        return _LockContext(self, key, lock_class, wait, on_fence, metadata, shared)

    async def inspect(self, key: str) -> _client.Inspection:
        return await self._run(self._sync.inspect, key)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._sync.close)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"aio.{self._sync!r}"


def _release_quietly(guard: _client.LockGuard) -> None:
    try:
        guard.release()
    except LatchkeyError:
        pass


class LockGuard:
    """A hold, for asyncio: the threaded :class:`latchkey.LockGuard`'s
    properties, and ``await release()``."""

    def __init__(self, client: Client, guard: _client.LockGuard) -> None:
        self._client = client
        self._guard = guard

    @property
    def token(self) -> FencingToken:
        return self._guard.token

    @property
    def key(self) -> str:
        return self._guard.key

    @property
    def epoch(self) -> int:
        return self._guard.epoch

    @property
    def session_id(self) -> int:
        return self._guard.session_id

    @property
    def shared(self) -> bool:
        return self._guard.shared

    @property
    def hold_count(self) -> int:
        return self._guard.hold_count

    @property
    def is_fenced(self) -> bool:
        return self._guard.is_fenced

    def can_start(self) -> bool:
        return self._guard.can_start()

    def remaining_ttl(self) -> float:
        return self._guard.remaining_ttl()

    async def release(self) -> None:
        await self._client._run(self._guard.release)

    async def __aenter__(self) -> "LockGuard":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self._client._run(self._guard.__exit__, exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"aio.{self._guard!r}"

    __str__ = __repr__


class _LockContext:
    def __init__(self, client: Client, key, lock_class, wait, on_fence, metadata, shared) -> None:
        self._client = client
        self._args = (key, lock_class)
        self._kwargs = {"wait": wait, "on_fence": on_fence, "metadata": metadata, "shared": shared}
        self._guard: Optional[LockGuard] = None

    async def __aenter__(self) -> LockGuard:
        self._guard = await self._client.acquire(*self._args, **self._kwargs)
        return self._guard

    async def __aexit__(self, exc_type, exc, tb) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            await guard.__aexit__(exc_type, exc, tb)
