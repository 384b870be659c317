"""Sessions (ADR-10): one arbiter lease per TTL per client, renewed by one
keepalive stream, with every hold of that TTL attached to it. The session is
also where ADR-12's two stages live: ``can_start()`` turns false at the first
failed keepalive, and at the send-time deadline every hold's ``on_fence``
fires, once.

Two daemon threads per session: the keepalive thread (one bidirectional
KeepAlive stream, one request per interval, the first at stream open) and a
watchdog on the fence deadline that does not depend on the network answering
at all. A third, per stream, reads replies; it acts on the arbiter's notices
of ended holds as they come, fencing each such hold at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Dict, Iterator, Optional, Tuple

import grpc

from ._errors import FenceReason, Fenced, from_rpc_error, reason_of
from ._holds import REENTERED, Hold, Holds
from ._liveness import Liveness, reply_timeout
from .lock.v1 import lock_pb2

log = logging.getLogger("latchkey")

FenceCallback = Callable[[FenceReason], None]


class SessionDead(Fenced):
    """The session was already fenced when an acquire (or a campaign) began:
    nothing was sent, so the caller may go on with a live session."""

MIN_BACKOFF = 0.05
MAX_BACKOFF = 1.0

_now = time.monotonic


class Session:
    """One lease at the arbiter. Obtained from :meth:`latchkey.Client.open_session`
    or implicitly by an acquire; every hold of the same TTL shares it."""

    def __init__(self, stub, session_id: int, ttl: float, keepalive_interval: float,
                 opened_at: float, reused: bool, request_timeout: float) -> None:
        self.id = session_id
        self.ttl = ttl
        self.keepalive_interval = keepalive_interval
        self.reused = reused
        # The client's current stub (a callable: it changes when the SVID
        # files are reloaded), or a stub.
        self._stub_source = stub if callable(stub) else (lambda: stub)
        self._request_timeout = request_timeout
        self._lock = threading.Lock()
        self._liveness = Liveness(opened_at, ttl)
        self._holds = Holds()
        # guard id -> (its key, or None for a leadership; its callback)
        self._on_fence: Dict[int, Tuple[Optional[str], FenceCallback]] = {}
        self._next_guard = 0
        self._stop = threading.Event()
        self._stream: Optional[_KeepAliveStream] = None
        self._keepalive = threading.Thread(target=self._run_keepalive, name=f"latchkey-keepalive-{session_id}", daemon=True)
        self._watchdog = threading.Thread(target=self._run_watchdog, name=f"latchkey-watchdog-{session_id}", daemon=True)
        self._keepalive.start()
        self._watchdog.start()

    # -- ADR-12 ---------------------------------------------------------

    def can_start(self) -> bool:
        """False from the first failed keepalive until the next successful one,
        and for good once the session is fenced. Check before each unit of work."""
        with self._lock:
            return self._liveness.can_start(_now())

    def remaining_ttl(self) -> float:
        """Seconds until the fence deadline (0 once fenced)."""
        with self._lock:
            return self._liveness.remaining(_now())

    @property
    def fence_deadline(self) -> float:
        """When the holds are fenced unless a keepalive succeeds first, on the
        ``time.monotonic()`` clock: send time of the last successful renewal +
        TTL - 1 s."""
        with self._lock:
            return self._liveness.deadline

    @property
    def fence_reason(self) -> Optional[FenceReason]:
        with self._lock:
            return self._liveness.dead

    @property
    def is_fenced(self) -> bool:
        return self.fence_reason is not None

    def close(self) -> None:
        """Ends the session at the arbiter, which releases every hold on it.
        Holds still attached get ``on_fence(CLOSED)``; renewal stops even if the
        call fails, so the lease then runs out with its TTL."""
        reason = self.fence_reason
        if reason is not None:
            self._shutdown()
            if reason is FenceReason.CLOSED:
                return
            raise Fenced(self.id, reason)
        self._fence(FenceReason.CLOSED)
        try:
            self._stub.CloseSession(lock_pb2.CloseSessionRequest(session_id=self.id), timeout=self._request_timeout)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def __repr__(self) -> str:
        return f"Session(id={self.id}, ttl={self.ttl:g}, reused={self.reused}, fenced={self.fence_reason})"

    # -- state shared with guards and the keepalive -----------------------

    def _renewed(self, sent_at: float, remaining: float) -> None:
        with self._lock:
            self._liveness.renewed(sent_at, remaining)

    def _keepalive_failed(self) -> None:
        with self._lock:
            if self._liveness.dead is None:
                if not self._liveness.failing:
                    log.debug("keepalive failed; not starting new work", extra={"session_id": self.id})
                self._liveness.failed()

    def _fence(self, reason: FenceReason) -> None:
        """Marks the session dead, stops renewing and calls every registered
        ``on_fence`` once."""
        with self._lock:
            if not self._liveness.fence(reason):
                return
            callbacks = [cb for (_, cb) in self._on_fence.values()]
            self._on_fence.clear()
            # Threads waiting for a key held on this session look again, and
            # go to a live session.
            self._holds.wake_all()
        self._shutdown()
        # A close is the caller's own doing: nothing to warn about.
        level = logging.DEBUG if reason is FenceReason.CLOSED else logging.WARNING
        log.log(level, "session %d fenced (%s holds): %s", self.id, len(callbacks), reason)
        _call_all(callbacks, reason, self.id)

    def _hold_ended(self, key: str, revision: int) -> None:
        """The arbiter says the hold of `key` granted at `revision` ended. If
        that is the hold we have (not one we are releasing, nor a later one of
        the key), it is fenced: its guards' ``on_fence`` fire, once."""
        with self._lock:
            if not self._holds.ended(key, revision):
                return
            callbacks = self._take_callbacks(key)
        log.warning("hold of %s ended at the arbiter; fenced (session %d, %d guards)", key, self.id, len(callbacks))
        _call_all(callbacks, FenceReason.HOLD_ENDED, self.id)

    def _take_callbacks(self, key: str):
        ids = [gid for gid, (k, _) in self._on_fence.items() if k == key]
        return [self._on_fence.pop(gid)[1] for gid in ids]

    def _begin_downgrade(self, hold: Hold) -> Optional[str]:
        """None, or why `hold` cannot be downgraded (NOT_HELD, NESTED);
        raises SessionDead on a dead session, before anything is sent."""
        with self._lock:
            if self._liveness.dead is not None:
                raise SessionDead(self.id, self._liveness.dead)
            return self._holds.begin_downgrade(hold)

    def _downgraded(self, shared: Hold) -> Optional[Callable[[], None]]:
        """`shared` replaces the exclusive hold (under the same guard); raises
        Fenced, with the hold replaced all the same, if the session died. If
        the arbiter said already that `shared` ended, it is fenced now: returns
        what fires its on_fence callbacks (as _downgrade_failed does)."""
        with self._lock:
            ended = self._holds.downgraded(shared)
            callbacks = self._take_callbacks(shared.key) if ended else []
            dead = self._liveness.dead
        if ended:
            log.warning("hold of %s ended at the arbiter; fenced (session %d, %d guards)", shared.key, self.id, len(callbacks))
            return lambda: _call_all(callbacks, FenceReason.HOLD_ENDED, self.id)
        if dead is not None:
            raise Fenced(self.id, dead)
        return None

    def _downgrade_failed(self, key: str) -> Optional[Callable[[], None]]:
        """The exclusive hold stays, unless the arbiter said meanwhile that it
        ended: then it is fenced now, as _hold_ended would have done. Returns
        what fires its on_fence callbacks, for the caller to run once it holds
        no lock of its own (a callback may release or detach the guard)."""
        with self._lock:
            if not self._holds.downgrade_failed(key):
                return None
            callbacks = self._take_callbacks(key)
        log.warning("hold of %s ended at the arbiter; fenced (session %d, %d guards)", key, self.id, len(callbacks))
        return lambda: _call_all(callbacks, FenceReason.HOLD_ENDED, self.id)

    def _downgrade_lost(self, key: str, cleaning: bool) -> Optional[Callable[[], None]]:
        """The downgrade left its guard without a hold: fenced now (see
        Holds.downgrade_lost; with `cleaning`, until _downgrade_cleaned the
        key's other acquirers on this session wait). Returns what fires the
        on_fence callbacks, as _downgrade_failed does."""
        with self._lock:
            if not self._holds.downgrade_lost(key, cleaning):
                return None
            callbacks = self._take_callbacks(key)
        log.warning("downgrade of %s left no hold; fenced (session %d, %d guards)", key, self.id, len(callbacks))
        return lambda: _call_all(callbacks, FenceReason.HOLD_ENDED, self.id)

    def _downgrade_cleaned(self, key: str) -> None:
        with self._lock:
            self._holds.downgrade_cleaned(key)

    def _register(self, key: str, on_fence: FenceCallback) -> int:
        guard_id = self._next_guard
        self._next_guard += 1
        self._on_fence[guard_id] = (key, on_fence)
        return guard_id

    def _watch(self, on_fence: FenceCallback) -> int:
        """Calls `on_fence` once if the session dies (a leadership on it
        ends with it); raises SessionDead if it already has."""
        with self._lock:
            if self._liveness.dead is not None:
                raise SessionDead(self.id, self._liveness.dead)
            # Not a key: no notice of an ended hold matches it.
            guard_id = self._next_guard
            self._next_guard += 1
            self._on_fence[guard_id] = (None, on_fence)
            return guard_id

    def _unwatch(self, watch_id: int) -> None:
        with self._lock:
            self._on_fence.pop(watch_id, None)

    def _begin_acquire(self, key: str, on_fence: FenceCallback, shared: bool = False):
        """(kind, hold or event, guard id) for the calling thread asking for
        `key` shared or exclusively; raises SessionDead (a Fenced) on a dead
        session, before anything is sent. A guard id only for a re-entry."""
        with self._lock:
            if self._liveness.dead is not None:
                raise SessionDead(self.id, self._liveness.dead)
            kind, value = self._holds.begin(key, threading.current_thread(), shared)
            guard_id = self._register(key, on_fence) if kind == REENTERED else None
            return kind, value, guard_id

    def _granted(self, hold: Hold, on_fence: FenceCallback) -> int:
        with self._lock:
            if self._liveness.dead is not None:
                self._holds.failed(hold.key)
                raise Fenced(self.id, self._liveness.dead)
            self._holds.granted(hold)
            return self._register(hold.key, on_fence)

    def _acquire_failed(self, key: str) -> None:
        with self._lock:
            self._holds.failed(key)

    def _release_one(self, hold: Hold, guard_id: int):
        with self._lock:
            self._on_fence.pop(guard_id, None)
            return self._holds.decrement(hold)

    def _released(self, key: str) -> None:
        with self._lock:
            self._holds.released(key)

    def _shutdown(self) -> None:
        """Stops both threads (idempotent; safe from either of them)."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()

    # -- threads ----------------------------------------------------------

    def _run_watchdog(self) -> None:
        while not self._stop.is_set():
            deadline = self.fence_deadline
            now = _now()
            if now >= deadline:
                self._fence(FenceReason.DEADLINE_EXCEEDED)
                return
            self._stop.wait(deadline - now)

    def _run_keepalive(self) -> None:
        try:
            reason = self._renew()
        except Exception:  # a bug here must not leave holds unfenced silently
            log.exception("keepalive thread of session %d failed", self.id)
            reason = None
        if reason is not None:
            self._fence(reason)

    @property
    def _stub(self):
        return self._stub_source()

    def _renew(self) -> Optional[FenceReason]:
        """Renews until the arbiter says the session is gone (returns EXPIRED)
        or the session is stopped (None); never returns for network trouble
        (the watchdog ends that)."""
        interval = self.keepalive_interval
        late = reply_timeout(interval)
        backoff = MIN_BACKOFF
        # OpenSession itself counted as a renewal, but the first message on a
        # stream goes at once all the same: the arbiter pushes notices of
        # ended holds only on a stream that has renewed the session.
        next_send = _now()
        while not self._stop.is_set():
            stream = _KeepAliveStream(self._stub, self)
            self._stream = stream
            if self._stop.is_set():
                stream.close()
                return None
            try:
                while True:
                    # Until the next renewal is due, only notices should come.
                    item = stream.next_by(next_send)
                    if self._stop.is_set():
                        return None
                    if item is not None:
                        if _expired(item):
                            return FenceReason.EXPIRED
                        log.debug("keepalive stream of session %d broke between renewals: %s", self.id, item[0])
                        self._keepalive_failed()
                        break
                    # The send time bounds the arbiter's renewal from below,
                    # which is what makes the local deadline safe (ADR-12).
                    sent_at = _now()
                    next_send = sent_at + interval
                    stream.send(lock_pb2.KeepAliveRequest(session_id=self.id))
                    item = stream.next_by(sent_at + late)
                    if item is None:
                        self._keepalive_failed()
                        # A late reply still renewed the lease as of `sent_at`.
                        item = stream.next_by(next_send)
                        if item is None:
                            break
                    if self._stop.is_set():
                        return None
                    kind, value = item
                    if kind == "reply" and value.session_id == self.id:
                        if value.remaining_ttl_seconds <= 0:
                            return FenceReason.EXPIRED
                        self._renewed(sent_at, float(value.remaining_ttl_seconds))
                        backoff = MIN_BACKOFF
                        continue
                    if _expired(item):
                        return FenceReason.EXPIRED
                    if kind == "reply":
                        log.warning("keepalive reply for another session than %d", self.id)
                    else:
                        log.debug("keepalive stream of session %d failed: %s", self.id, _describe(item))
                    self._keepalive_failed()
                    break
            finally:
                stream.close()
            # Renew as soon as a new stream is up; the deadline is what matters.
            if self._stop.wait(backoff):
                return None
            backoff = min(backoff * 2, MAX_BACKOFF)
            next_send = _now()
        return None


def _expired(item) -> bool:
    kind, value = item
    return kind == "error" and reason_of(value) == "SESSION_EXPIRED"


def _describe(item) -> str:
    kind, value = item
    if kind == "error" and hasattr(value, "code"):
        return f"{value.code().name}"
    return kind


def _call_all(callbacks, reason: FenceReason, session_id: int) -> None:
    for callback in callbacks:
        try:
            callback(reason)
        except Exception:  # one failing callback must not keep the others from firing
            log.exception("an on_fence callback of session %d raised", session_id)


_CLOSE = object()


class _KeepAliveStream:
    """One KeepAlive call: requests go in through a queue; a reader thread
    hands renewals' replies, the end or the error to the keepalive thread and
    acts on notices of ended holds itself."""

    def __init__(self, stub, session: Session) -> None:
        self._session = session
        self._requests: "queue.Queue[object]" = queue.Queue()
        self._items: "queue.Queue[Tuple[str, object]]" = queue.Queue()
        self._call = stub.KeepAlive(self._outbox())
        self._closed = False
        self._reader = threading.Thread(target=self._read, name=f"latchkey-keepalive-reader-{session.id}", daemon=True)
        self._reader.start()

    def _outbox(self) -> Iterator[lock_pb2.KeepAliveRequest]:
        while True:
            request = self._requests.get()
            if request is _CLOSE:
                return
            yield request

    def _read(self) -> None:
        session = self._session
        try:
            for reply in self._call:
                if len(reply.ended_holds) > 0:
                    if reply.session_id == session.id:
                        for hold in reply.ended_holds:
                            session._hold_ended(hold.key, hold.revision)
                    continue
                self._items.put(("reply", reply))
            self._items.put(("end", None))
        except grpc.RpcError as error:
            self._items.put(("error", error))
        except Exception as error:  # e.g. a failing callback from another thread's close
            self._items.put(("error", error))

    def send(self, request) -> None:
        self._requests.put(request)

    def next_by(self, deadline: float):
        """The next item, or None if none came by `deadline` (monotonic)."""
        try:
            return self._items.get(timeout=max(0.0, deadline - _now()))
        except queue.Empty:
            return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._requests.put(_CLOSE)
        self._call.cancel()
        # Wake a keepalive thread waiting on this stream.
        self._items.put(("end", None))
