"""Leader elections (latchkey.election.v1) on the client's sessions.

A campaign runs on a session opened for an election class (kind =
"election"), so a leadership lives on a lease the session's keepalive
renews, and ADR-12 applies to it as to a hold: the session's fence deadline
ends it locally, at the latest, before the arbiter can hand it to anyone.
Three more things end one while the session lives, each setting
``leadership.lost``: this client resigns or hands it over; a call about it
is refused NOT_LEADER; its Observe stream (one per leadership, the
leadership-loss push) shows another term starting or the term falling vacant
(an operator forced it out, an epoch advance).

Leaderships are per thread, as holds are (issue 37): the thread whose
campaign won leads; the same thread campaigning again gets the same
leadership back (counted, as the arbiter gives a session its leadership
back); another thread of the same client waits until it ends, then
campaigns itself. The arbiter cannot tell the threads apart: one session,
one instance.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Union

import grpc

from ._errors import (
    ConfigError,
    FenceReason,
    Fenced,
    LatchkeyError,
    NoCandidate,
    NotLeader,
    ProtocolError,
    Refused,
    WaitTimeout,
    from_rpc_error,
)
from ._token import FencingToken
from .election.v1 import election_pb2

log = logging.getLogger("latchkey")

_now = time.monotonic

#: Called once, on a background thread, when a leadership is lost.
LostCallback = Callable[[FenceReason], None]

MIN_BACKOFF = 0.05
MAX_BACKOFF = 1.0
#: How often a wait that can be stopped looks at its stop event.
_STOP_POLL = 0.05


# -- what the arbiter reports ------------------------------------------------


@dataclass(frozen=True)
class Leader:
    """The leader as observers see it: never a token or a session."""

    identity: str
    value: str
    term: int
    since_unix_ms: int = 0
    priority: int = 0


@dataclass(frozen=True)
class Candidate:
    """A candidate, in the order they would lead. ``candidate_id`` names it
    in :meth:`Leadership.transfer`; it is not a session id nor a capability."""

    candidate_id: int
    identity: str
    value: str
    priority: int
    since_unix_ms: int


class VacancyReason(enum.Enum):
    """Why an election fell vacant."""

    #: Not known: the state as first read.
    UNSPECIFIED = 0
    RESIGNED = 1
    #: The leader's session expired, was closed or revoked.
    SESSION_ENDED = 2
    FORCED = 3
    EPOCH_ADVANCED = 4


@dataclass(frozen=True)
class TermStarted:
    """A term began (or, as a stream's first event, is the current one)."""

    identity: str
    value: str
    term: int
    since_unix_ms: int = 0
    priority: int = 0


@dataclass(frozen=True)
class Proclaimed:
    """The leader of `term` announced a new value."""

    term: int
    value: str


@dataclass(frozen=True)
class Vacant:
    """`term` ended with no leader after it (term 0: never led)."""

    term: int
    reason: VacancyReason


@dataclass(frozen=True)
class Gap:
    """Events of terms `from_term` to `to_term` could not be delivered; the
    next event describes the state after the gap. Never a silent skip."""

    from_term: int
    to_term: int


@dataclass(frozen=True)
class TransferRequested:
    """A candidate above the leader of `term`'s priority stands, and the
    election's class asks its leader to yield (``yieldToHigherPriority``):
    it should hand over at its next safe point
    (:meth:`Leadership.yield_if_requested`)."""

    term: int
    priority: int


Event = Union[TermStarted, Proclaimed, Vacant, Gap, TransferRequested]


def _leader(info) -> Leader:
    return Leader(info.identity, info.value, info.term, info.since_unix_ms, info.priority)


def _event(response) -> Optional[Event]:
    kind = response.WhichOneof("event")
    if kind == "term_started":
        l = response.term_started.leader
        return TermStarted(l.identity, l.value, l.term, l.since_unix_ms, l.priority)
    if kind == "proclaimed":
        p = response.proclaimed
        return Proclaimed(p.term, p.value)
    if kind == "vacant":
        v = response.vacant
        try:
            reason = VacancyReason(v.reason)
        except ValueError:  # a reason newer than these stubs
            reason = VacancyReason.UNSPECIFIED
        return Vacant(v.term, reason)
    if kind == "gap":
        return Gap(response.gap.from_term, response.gap.to_term)
    if kind == "transfer_requested":
        t = response.transfer_requested
        return TransferRequested(t.term, t.priority)
    return None  # an event kind newer than these stubs: skipped


class _Stopped(Exception):
    """A campaign or a wait was stopped by the caller's stop event."""


def _wait(event: threading.Event, limit: Optional[float], stop: Optional[threading.Event]) -> bool:
    """Waits for `event` up to `limit` seconds (None: no limit), looking at
    `stop` meanwhile (raises _Stopped). Whether `event` is set."""
    if stop is None:
        return event.wait(limit)
    until = None if limit is None else _now() + limit
    while True:
        if stop.is_set():
            raise _Stopped()
        step = _STOP_POLL if until is None else min(_STOP_POLL, until - _now())
        if step <= 0:
            return event.is_set()
        if event.wait(step):
            return True


# -- one leadership ----------------------------------------------------------


class _Term:
    """One leadership as this client has it, shared by every :class:`Leadership`
    handle its owner thread got for it."""

    def __init__(self, client, election: str, election_class: str, session, won, owner: threading.Thread) -> None:
        self.client = client
        self.election = election
        self.election_class = election_class
        self.session = session
        self.term = won.term
        self.token = FencingToken(won.token)
        self.value = won.value
        self.owner = owner
        self.count = 0
        self.lost = threading.Event()
        #: Set when the class asks this leadership to yield (its watch saw
        #: TransferRequested for this term).
        self.transfer_requested = threading.Event()
        self.reason: Optional[FenceReason] = None
        #: can_start() is false while a transfer is in flight.
        self.ending = False
        self._lock = threading.Lock()
        self._callbacks: Dict[int, LostCallback] = {}
        self._next = 0
        # The session's death ends the leadership (its record is on the lease).
        self._fence_watch = session._watch(self._session_fenced)
        self._watch: Optional[_LeadershipWatch] = None
        if client._observe_leaderships:
            self._watch = _LeadershipWatch(self)

    def add(self, on_lost: Optional[LostCallback]) -> int:
        """Counts a handle in; its callback fires on loss."""
        with self._lock:
            self.count += 1
            handle = self._next
            self._next += 1
            if on_lost is not None:
                self._callbacks[handle] = on_lost
            return handle

    def drop(self, handle: int) -> bool:
        """Counts a handle out; whether it was the last."""
        with self._lock:
            self._callbacks.pop(handle, None)
            self.count -= 1
            return self.count <= 0

    def is_lost(self) -> bool:
        return self.lost.is_set()

    def _session_fenced(self, reason: FenceReason) -> None:
        self.lose(reason)

    def lose(self, reason: FenceReason, leave_table: bool = True) -> bool:
        """Marks the leadership lost (once): `lost` is set, the callbacks run,
        its watch stops. Whether this call was the one that lost it."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        self.lost.set()
        if leave_table:
            self.client._elections.left(self)
        self.session._unwatch(self._fence_watch)
        if self._watch is not None:
            self._watch.stop()
        if reason is FenceReason.RESIGNED:
            log.debug("leadership of %s (term %d) ended: %s", self.election, self.term, reason)
        else:
            log.warning("leadership of %s (term %d) lost: %s", self.election, self.term, reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:  # one failing callback must not keep the others from firing
                log.exception("an on_lost callback of the leadership of %s raised", self.election)
        return True

    def not_leader(self, what: str) -> NotLeader:
        reason = self.reason or FenceReason.LEADERSHIP_ENDED
        return NotLeader(
            grpc.StatusCode.FAILED_PRECONDITION,
            "NOT_LEADER",
            f"cannot {what}: the leadership of {self.election!r} (term {self.term}) is lost: {reason}",
        )

    def call(self, what: str, method, request):
        """A call about this leadership; NOT_LEADER loses it."""
        try:
            return self.client._call(method, request)
        except NotLeader:
            self.lose(FenceReason.LEADERSHIP_ENDED)
            raise


class _LeadershipWatch:
    """The leadership-loss push: one Observe stream of the election while the
    leadership lasts, on a daemon thread. Another term starting, or this term
    falling vacant, loses the leadership at once; an event that cannot be
    judged alone (the vacancy a fresh stream reads first, which may predate
    this term) is checked with Leader."""

    def __init__(self, term: _Term) -> None:
        self._term = term
        self._stop = threading.Event()
        self._call = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"latchkey-leadership-{term.session.id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def _run(self) -> None:
        try:
            self._observe()
        except Exception:  # a bug here must not go unseen; the deadline still fences
            log.exception("the leadership watch of %s failed", self._term.election)

    def _observe(self) -> None:
        term = self._term
        backoff = MIN_BACKOFF
        while not self._stop.is_set():
            # The client's current stub: a rotated SVID's channel, not a
            # retired one.
            stub = term.client._election_stub
            call = stub.Observe(election_pb2.ObserveRequest(election=term.election, from_term=0, transfer_requests=True))
            with self._lock:
                self._call = call
            if self._stop.is_set():
                call.cancel()
                return
            try:
                for response in call:
                    backoff = MIN_BACKOFF
                    event = _event(response)
                    if isinstance(event, TransferRequested) and event.term == term.term:
                        term.transfer_requested.set()
                    verdict = _judge(term.term, event)
                    if verdict == _ASK:
                        verdict = self._ask()
                    if verdict == _LOST:
                        # With a transfer in flight, the next term is most
                        # likely the one it started (its reply still on the way).
                        term.lose(FenceReason.RESIGNED if term.ending else FenceReason.LEADERSHIP_ENDED)
                        return
            except grpc.RpcError as error:
                if self._stop.is_set():
                    return
                refused = from_rpc_error(error)
                log.debug("the leadership watch of %s broke: %s", term.election, refused.code)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _ask(self) -> str:
        """Whether the leadership is current, by a (consistent) Leader read."""
        term = self._term
        try:
            reply = term.client._call(term.client._election_stub.Leader, election_pb2.LeaderRequest(election=term.election))
        except LatchkeyError as error:
            log.debug("the leadership watch of %s could not read the leader: %s", term.election, error)
            return _KEEP
        if reply.HasField("leader") and reply.leader.term == term.term:
            return _KEEP
        return _LOST


_KEEP, _LOST, _ASK = "keep", "lost", "ask"


def _judge(term: int, event: Optional[Event]) -> str:
    """What an observed event says of the leadership of `term`. Terms rise
    and are never reused in an election, so any other term starting means
    this one ended; an older one is a stale state."""
    if isinstance(event, TermStarted):
        return _LOST if event.term > term else _KEEP
    if isinstance(event, Vacant):
        if event.term == 0:
            # "Never led" while this term exists: a state read before it
            # began (an arbiter's shared watch behind the log), or not.
            return _ASK
        return _LOST if event.term >= term else _KEEP
    return _KEEP  # Proclaimed, Gap (the state follows), unknown kinds


class Leadership:
    """This client leads an election: one term, with its fencing token.

    ``lost`` is a :class:`threading.Event` set once the leadership is over
    for this client — at the session's fence deadline at the latest (ADR-12),
    at once when the arbiter is known to have ended it (another term, a
    vacancy, NOT_LEADER), or when this client resigns or hands it over. The
    leader's work checks it (``while not leadership.lost.wait(1): ...``) and
    presents ``leadership.token.value`` to the resources it writes.

    Used as a context manager, it resigns when the block ends. The same
    thread campaigning again while it leads gets another handle of the same
    leadership (``hold_count``); only the last :meth:`resign` reaches the
    arbiter. Handles may be used from any thread.
    """

    __slots__ = ("_term", "_handle", "_armed")

    def __init__(self, term: _Term, handle: int) -> None:
        self._term = term
        self._handle = handle
        self._armed = True

    @property
    def election(self) -> str:
        return self._term.election

    @property
    def election_class(self) -> str:
        return self._term.election_class

    @property
    def term(self) -> int:
        """Rises by one per leadership of the election (jumps on an epoch advance)."""
        return self._term.term

    @property
    def token(self) -> FencingToken:
        """The fencing token to present at the resource (``leadership.token.value``)."""
        return self._term.token

    @property
    def value(self) -> str:
        """The value as last announced by this leadership (campaign or proclaim)."""
        return self._term.value

    @property
    def session_id(self) -> int:
        return self._term.session.id

    @property
    def session(self):
        return self._term.session

    @property
    def lost(self) -> threading.Event:
        """Set once the leadership is lost (see the class docstring); never cleared."""
        return self._term.lost

    @property
    def lost_reason(self) -> Optional[FenceReason]:
        return self._term.reason

    @property
    def is_lost(self) -> bool:
        return self._term.is_lost()

    @property
    def hold_count(self) -> int:
        """How many handles of this thread share the leadership."""
        return self._term.count

    @property
    def transfer_requested(self) -> threading.Event:
        """Set once the election's class asks this leadership to yield: a
        candidate of a higher priority stands (``yieldToHigherPriority``;
        learned from the leadership's watch). Cleared only when a yield finds
        no candidate above this leadership any more."""
        return self._term.transfer_requested

    def yield_if_requested(self) -> Optional[Leader]:
        """The leader's safe point: when a transfer was requested, hands the
        leadership to the preferred candidate if its priority is above this
        leadership's, and returns the next leader (this leadership is then
        over); otherwise (nothing asked, or the candidate that asked left)
        does nothing and returns None. Call it between units of work."""
        term = self._term
        if not term.transfer_requested.is_set():
            return None
        if term.is_lost():
            raise term.not_leader("transfer")
        request = election_pb2.TransferRequest(
            election=term.election, session_id=term.session.id, token=term.token.value, higher_priority=True
        )
        term.ending = True
        try:
            reply = term.call("transfer", term.client._election_stub.Transfer, request)
        except NoCandidate:
            # The candidate that asked left and none above this leadership
            # stands: it leads on.
            term.transfer_requested.clear()
            return None
        finally:
            term.ending = False
        self._armed = False
        term.lose(FenceReason.RESIGNED)
        if not reply.HasField("next"):
            raise ProtocolError("malformed reply to Transfer: no next leader")
        return _leader(reply.next)

    def can_start(self) -> bool:
        """Whether to start a new unit of leader's work (ADR-12 stage one):
        false once lost, while a keepalive of its session is failing, and
        while a transfer is in flight."""
        term = self._term
        return not term.is_lost() and not term.ending and term.session.can_start()

    def remaining_ttl(self) -> float:
        """Seconds before the session's fence deadline ends the leadership
        unless a keepalive succeeds (0 once lost)."""
        return 0.0 if self.is_lost else self._term.session.remaining_ttl()

    @property
    def fence_deadline(self) -> float:
        """When ``lost`` is set unless a keepalive succeeds first
        (``time.monotonic()`` clock): the session's fence deadline."""
        return self._term.session.fence_deadline

    def proclaim(self, value: str) -> None:
        """Replaces the value observers see, only while this leadership is
        current. A lost leadership raises :class:`NotLeader` without a call;
        the arbiter's NOT_LEADER also sets ``lost``."""
        term = self._term
        if term.is_lost():
            raise term.not_leader("proclaim")
        term.call(
            "proclaim",
            term.client._election_stub.Proclaim,
            election_pb2.ProclaimRequest(
                election=term.election, session_id=term.session.id, token=term.token.value, value=value
            ),
        )
        term.value = value

    def resign(self) -> None:
        """Counts this handle out; the last one ends the leadership (``lost``
        is set first, so the leader's work stops before the next leader is
        named, in the same transaction, by the arbiter). A leadership already
        lost is not resigned (nothing to end): the loss was told through
        ``lost``. Transient failures are retried within the client's request
        timeout; if Resign still fails, the arbiter keeps the leadership
        until this client's session ends (or this client campaigns again,
        which gets it back)."""
        if not self._armed:
            return
        self._armed = False
        term = self._term
        if not term.drop(self._handle):
            return
        if not term.lose(FenceReason.RESIGNED, leave_table=False):
            term.client._elections.left(term)
            return
        try:
            _retrying(
                term.client,
                term.client._election_stub.Resign,
                election_pb2.ResignRequest(election=term.election, session_id=term.session.id, token=term.token.value),
            )
        except NotLeader:
            pass  # it had ended already: nothing to resign
        except LatchkeyError as error:
            log.warning(
                "resigning %s (term %d) failed; the arbiter keeps it until the session ends: %s",
                term.election,
                term.term,
                error,
            )
            raise
        finally:
            term.client._elections.left(term)

    def transfer(self, candidate_id: Optional[int] = None, preferred: bool = False) -> Leader:
        """Hands the leadership to a candidate in one transaction: the one
        named by `candidate_id` (from :meth:`latchkey.Client.candidates`), or
        with ``preferred=True`` the first in order. Ends it for every handle.
        Returns the next leader. :class:`NoCandidate` leaves the leadership
        as it was; :class:`NotLeader` means it had already ended."""
        if (candidate_id is None) == (not preferred):
            raise ConfigError("transfer: name one candidate_id, or pass preferred=True")
        term = self._term
        if term.is_lost():
            raise term.not_leader("transfer")
        if candidate_id is not None:
            request = election_pb2.TransferRequest(
                election=term.election, session_id=term.session.id, token=term.token.value, candidate_id=candidate_id
            )
        else:
            request = election_pb2.TransferRequest(
                election=term.election, session_id=term.session.id, token=term.token.value, preferred=True
            )
        term.ending = True
        try:
            reply = term.call("transfer", term.client._election_stub.Transfer, request)
        finally:
            term.ending = False
        self._armed = False
        term.lose(FenceReason.RESIGNED)
        if not reply.HasField("next"):
            raise ProtocolError("malformed reply to Transfer: no next leader")
        return _leader(reply.next)

    def __enter__(self) -> "Leadership":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.resign()
        except LatchkeyError as error:
            if exc is None:
                raise
            log.warning("resigning %s after an exception in its block: %s", self._term.election, error)

    def __repr__(self) -> str:
        # The term spells the epoch, not the revision: it may show.
        t = self._term
        return (
            f"Leadership(election={t.election!r}, term={t.term}, token={t.token!r}, value={t.value!r}, "
            f"session_id={t.session.id}, hold_count={t.count}, lost={t.reason})"
        )

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a Leadership is not picklable")


def _retrying(client, method, request):
    """A call retried on transient refusals within the client's request timeout."""
    until = _now() + client._request_timeout
    backoff = MIN_BACKOFF
    while True:
        try:
            return client._call(method, request, timeout=max(0.001, until - _now()))
        except Refused as error:
            if not error.is_transient() or _now() + backoff >= until:
                raise
        time.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF)


# -- the client's elections ---------------------------------------------------


class _Campaigning:
    """A campaign of this client in flight (its thread will lead, or not)."""

    __slots__ = ("owner",)

    def __init__(self, owner: threading.Thread) -> None:
        self.owner = owner


class ElectionTable:
    """Which thread of this client leads (or is campaigning for) each
    election. A second thread waits here until the first's leadership ends
    (or its campaign fails), then campaigns itself."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._entries: Dict[str, Union[_Term, _Campaigning]] = {}

    def begin(
        self,
        election: str,
        election_class: str,
        thread: threading.Thread,
        deadline: Optional[float],
        stop: Optional[threading.Event],
    ) -> Optional[_Term]:
        """The leadership `thread` already has (counted in by the caller), or
        None once `thread` may campaign (its campaign is now in flight)."""
        with self._cond:
            while True:
                entry = self._entries.get(election)
                if entry is None:
                    self._entries[election] = _Campaigning(thread)
                    return None
                if isinstance(entry, _Term) and entry.owner is thread and not entry.is_lost():
                    if entry.election_class != election_class:
                        raise ConfigError(
                            f"this thread leads {election!r} under class {entry.election_class!r}, not {election_class!r}"
                        )
                    return entry
                if stop is not None and stop.is_set():
                    raise _Stopped()
                limit = None if deadline is None else deadline - _now()
                if limit is not None and limit <= 0:
                    raise WaitTimeout(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "WAIT_TIMEOUT",
                        f"timed out campaigning for {election!r}: another thread of this client still leads it or campaigns for it",
                    )
                if stop is not None:
                    limit = _STOP_POLL if limit is None else min(limit, _STOP_POLL)
                self._cond.wait(limit)

    def led(self, term: _Term) -> None:
        with self._cond:
            if term.is_lost():
                # Lost before it was entered (its watch or its session was
                # quick): left() already ran and found the campaign.
                self._entries.pop(term.election, None)
            else:
                self._entries[term.election] = term
            self._cond.notify_all()

    def failed(self, election: str, thread: threading.Thread) -> None:
        with self._cond:
            entry = self._entries.get(election)
            if isinstance(entry, _Campaigning) and entry.owner is thread:
                del self._entries[election]
                self._cond.notify_all()

    def left(self, term: _Term) -> None:
        with self._cond:
            if self._entries.get(term.election) is term:
                del self._entries[term.election]
                self._cond.notify_all()


def campaign(
    client,
    election: str,
    election_class: str,
    value: str,
    priority: int,
    deadline: Optional[float],
    on_lost: Optional[LostCallback],
    stop: Optional[threading.Event] = None,
) -> Leadership:
    """Client.campaign, and each campaign of Client.leading (with `stop`)."""
    thread = threading.current_thread()
    table = client._elections
    term = table.begin(election, election_class, thread, deadline, stop)
    if term is not None:
        return Leadership(term, term.add(on_lost))
    try:
        term = _win(client, election, election_class, value, priority, deadline, stop, thread)
        handle = term.add(on_lost)
    except BaseException:
        table.failed(election, thread)
        raise
    table.led(term)
    return Leadership(term, handle)


def _win(client, election, election_class, value, priority, deadline, stop, thread) -> _Term:
    """Campaigns until this client's session leads, `deadline` passes
    (WaitTimeout) or `stop` is set (_Stopped). The arbiter answers
    WAIT_TIMEOUT at its maximum wait; the campaign then stands again."""
    from ._session import SessionDead  # the session module imports nothing of ours

    session = client._session_for_class(election_class)
    retried = False
    while True:
        remaining = None if deadline is None else deadline - _now()
        if remaining is not None and remaining <= 0:
            raise WaitTimeout(
                grpc.StatusCode.DEADLINE_EXCEEDED, "WAIT_TIMEOUT", f"timed out campaigning for {election!r}"
            )
        request = election_pb2.CampaignRequest(
            election=election,
            session_id=session.id,
            value=value,
            priority=priority,
            instance=client._instance,
            **{"class": election_class},
        )
        try:
            reply = _campaign_call(client, request, remaining, stop)
            won = reply.leadership
            if not won.election or won.token == 0:
                raise ProtocolError("malformed reply to Campaign: OK without a leadership")
            if won.session_id != session.id or won.election != election:
                raise ProtocolError("malformed reply to Campaign: a leadership of another session or election")
            return _Term(client, election, election_class, session, won, thread)
        except WaitTimeout:
            if deadline is not None and deadline - _now() <= 0.05:
                raise
            # The arbiter's maximum wait, shorter than ours: stand again.
        except SessionDead:
            if retried:
                raise
            client._forget_class(election_class, session.id)
            session = client._session_for_class(election_class)
            retried = True
        except Refused as error:
            if retried or error.reason not in ("SESSION_EXPIRED", "SESSION_CLASS_MISMATCH"):
                raise
            if error.reason == "SESSION_EXPIRED":
                session._fence(FenceReason.EXPIRED)
            client._forget_class(election_class, session.id)
            session = client._session_for_class(election_class)
            retried = True


def _campaign_call(client, request, remaining: Optional[float], stop: Optional[threading.Event]):
    """One Campaign call (no deadline: the arbiter's maximum wait bounds it)."""
    method = client._election_stub.Campaign
    if stop is None:
        try:
            return method(request, timeout=remaining)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
    future = method.future(request, timeout=remaining)
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    try:
        _wait(done, None, stop)
    except _Stopped:
        # The arbiter ends the candidacy with the call.
        future.cancel()
        raise
    try:
        return future.result()
    except grpc.RpcError as error:
        raise from_rpc_error(error) from None


def leading(
    client,
    election: str,
    election_class: str,
    value: str,
    priority: int,
    stop: Optional[threading.Event],
    on_lost: Optional[LostCallback],
    retry_backoff: float,
) -> Iterator[Leadership]:
    """Client.leading: campaign, yield, resign, again, until `stop`."""
    stop = stop if stop is not None else threading.Event()
    backoff = MIN_BACKOFF
    while not stop.is_set():
        try:
            leadership = campaign(client, election, election_class, value, priority, None, on_lost, stop)
        except _Stopped:
            return
        except (Refused, Fenced) as error:
            transient = isinstance(error, Fenced) or error.is_transient()
            if not transient or client._closed:
                raise
            log.info("campaign for %s failed (%s); campaigning again", election, error)
            if stop.wait(backoff):
                return
            backoff = min(max(backoff * 2, MIN_BACKOFF), retry_backoff)
            continue
        backoff = MIN_BACKOFF
        try:
            yield leadership
        finally:
            try:
                leadership.resign()
            except LatchkeyError as error:
                log.warning("resigning %s between terms: %s", election, error)


class Observation:
    """An Observe stream of an election, as an iterator of typed events:
    :class:`TermStarted`, :class:`Proclaimed`, :class:`Vacant` and
    :class:`Gap`. The first event describes the state (or, with a
    ``from_term``, a gap first). A stream that breaks for a transient reason
    is opened again from the last term seen; what was missed meanwhile comes
    as a Gap from the arbiter, and the state it sends first is not repeated
    when it is the last event already given. :meth:`close` (from any thread)
    ends the iteration."""

    def __init__(self, client, election: str, from_term: int, reconnect: bool) -> None:
        self._client = client
        self._election = election
        self._from_term = from_term
        self._reconnect = reconnect
        self._lock = threading.Lock()
        self._call = None
        self._closed = False
        #: What the events given so far say the election is now.
        self._state: Optional[tuple] = None
        self._reopened = False
        self._backoff = MIN_BACKOFF

    def __iter__(self) -> "Observation":
        return self

    def _open(self):
        stub = self._client._election_stub
        call = stub.Observe(election_pb2.ObserveRequest(
                election=self._election, from_term=self._from_term, transfer_requests=True
            ))
        with self._lock:
            if self._closed:
                call.cancel()
                raise StopIteration
            self._call = call
        return call

    def __next__(self) -> Event:
        while True:
            with self._lock:
                if self._closed:
                    raise StopIteration
                call = self._call
            if call is None:
                call = self._open()
            try:
                response = next(call)
            except StopIteration:
                error: Optional[Refused] = None
            except grpc.RpcError as rpc_error:
                if self._closed:
                    raise StopIteration from None
                error = from_rpc_error(rpc_error)
            else:
                event = _event(response)
                if event is None:
                    continue
                if self._reopened:
                    self._reopened = False
                    if _describes(event) is not None and _describes(event) == self._state:
                        continue  # the state as the stream was opened again: already given
                self._backoff = MIN_BACKOFF
                self._note(event)
                return event
            # The stream ended or broke.
            if error is not None and not (self._reconnect and _reconnectable(error)):
                raise error
            if not self._reconnect:
                raise StopIteration
            with self._lock:
                self._call = None
            time.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, MAX_BACKOFF)
            self._reopened = self._state is not None

    def _note(self, event: Event) -> None:
        self._state = _describes(event, self._state)
        if isinstance(event, TermStarted):
            self._from_term = event.term
        elif isinstance(event, Gap) and event.to_term:
            self._from_term = max(self._from_term, event.to_term)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            call, self._call = self._call, None
        if call is not None:
            call.cancel()

    def __enter__(self) -> "Observation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Observation(election={self._election!r}, closed={self._closed})"


def _reconnectable(error: Refused) -> bool:
    """Transient, or a stream a proxy reset (INTERNAL with no reason of ours:
    e.g. an idle timeout on a long quiet stream)."""
    return error.is_transient() or (error.code == grpc.StatusCode.INTERNAL and not error.reason)


def _describes(event: Event, before: Optional[tuple] = None) -> Optional[tuple]:
    """The state an event leaves the election in, as far as an observer
    can tell: who leads which term with which value, or vacant."""
    if isinstance(event, TermStarted):
        return ("lead", event.identity, event.term, event.value)
    if isinstance(event, Proclaimed):
        if before is not None and before[0] == "lead" and before[2] == event.term:
            return ("lead", before[1], event.term, event.value)
        return None
    if isinstance(event, Vacant):
        return ("vacant",)
    return None  # a Gap: the next event says


def leader(client, election: str) -> Optional[Leader]:
    reply = client._call(client._election_stub.Leader, election_pb2.LeaderRequest(election=election))
    return _leader(reply.leader) if reply.HasField("leader") else None


def candidates(client, election: str) -> List[Candidate]:
    reply = client._call(client._election_stub.Candidates, election_pb2.CandidatesRequest(election=election))
    return [Candidate(c.candidate_id, c.identity, c.value, c.priority, c.since_unix_ms) for c in reply.candidates]
