"""Latchkey's Python client: take locks from the arbiter through its Envoy.

A lock flows through it like this. :class:`Client` opens one gRPC channel to
the arbiter's Envoy under the workload's SPIFFE identity (its X.509 SVID over
mTLS; never a header). ``client.acquire(key, class)`` (or ``with
client.lock(key):``) first finds the session for the class's TTL (ADR-10: one
arbiter lease per TTL per client), then consults the session's re-entrancy
table (ADR-13): a key already held on the session just gets another
:class:`LockGuard` of the same hold; otherwise Acquire is sent and the grant,
with its :class:`FencingToken`, becomes the hold. Meanwhile the session's
keepalive thread renews the lease over one bidirectional stream and keeps
ADR-12's two stages: after the first failed keepalive ``can_start()`` is false,
and when the send time of the last successful renewal plus the TTL minus one
second passes, every hold's ``on_fence`` fires once. A notice from the arbiter
that a hold ended fences that hold at once. Releasing the last guard of a hold
sends Release. A hold belongs to the thread that acquired it: another thread
of the same client waits for it (or is refused ``Held``) like any other caller.

An election flows the same way: ``client.campaign(election)`` (or ``with
client.lead(election):``, or ``for leadership in client.leading(...)``) finds
the session of the election class, waits at the arbiter until this session
leads, and returns a :class:`Leadership` with its term and token, whose
``lost`` event is set at the session's fence deadline or as soon as the loss
is known (resigned, NOT_LEADER, or another term seen on its Observe stream).
``client.observe(election)`` yields typed events. Tokens never appear in
``repr``, ``str``, exceptions or logs.
"""

import logging as _logging

from ._client import FOREVER, WAIT_ASK, Client, Holder, Inspection, LockGuard, default_instance
from ._election import (
    Candidate,
    Gap,
    Leader,
    Leadership,
    Observation,
    Proclaimed,
    TermStarted,
    TransferRequested,
    Vacant,
    VacancyReason,
)
from ._errors import (
    Aborted,
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    FenceReason,
    Fenced,
    Held,
    InvalidArgument,
    LatchkeyError,
    Leak,
    NoCandidate,
    NotHeld,
    NotLeader,
    PermissionDenied,
    QuotaExceeded,
    KindInUse,
    ProtocolError,
    Refused,
    ResourceExhausted,
    Sealed,
    SessionExpired,
    Unauthenticated,
    Unavailable,
    UpgradeRefused,
    WaitTimeout,
    WrongKind,
)
from ._liveness import FENCE_MARGIN
from ._session import Session
from ._token import FencingToken

__all__ = [
    "FOREVER",
    "WAIT_ASK",
    "Aborted",
    "Candidate",
    "Client",
    "default_instance",
    "ConfigError",
    "DeadlineExceeded",
    "FENCE_MARGIN",
    "FailedPrecondition",
    "FenceReason",
    "Fenced",
    "FencingToken",
    "Gap",
    "Held",
    "Holder",
    "Inspection",
    "InvalidArgument",
    "LatchkeyError",
    "Leader",
    "Leadership",
    "Leak",
    "LockGuard",
    "NoCandidate",
    "NotHeld",
    "NotLeader",
    "Observation",
    "PermissionDenied",
    "Proclaimed",
    "ProtocolError",
    "QuotaExceeded",
    "KindInUse",
    "Refused",
    "ResourceExhausted",
    "Sealed",
    "Session",
    "SessionExpired",
    "TermStarted",
    "TransferRequested",
    "Unauthenticated",
    "Unavailable",
    "UpgradeRefused",
    "Vacant",
    "VacancyReason",
    "WaitTimeout",
    "WrongKind",
]

__version__ = "0.1.0"

# A library is quiet unless the application configures logging: its
# records go to the "latchkey" logger, and nowhere by default.
_logging.getLogger("latchkey").addHandler(_logging.NullHandler())
