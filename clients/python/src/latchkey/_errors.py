"""The client's exceptions, and the mapping from a gRPC status to them.

A refusal's machine-readable reason is the ``google.rpc.ErrorInfo`` detail in
the ``latchkey.dev`` domain (``grpc-status-details-bin``); the exception class
is chosen by that reason first and the gRPC code second. No exception carries
a fencing token: tokens are capabilities and exceptions end up in logs.
"""

from __future__ import annotations

import enum
import grpc

ERROR_DOMAIN = "latchkey.dev"
_DETAILS_KEY = "grpc-status-details-bin"


class FenceReason(enum.Enum):
    """Why the holds of a session (or one hold) were lost."""

    #: No keepalive succeeded before the local deadline (send time of the
    #: last successful renewal + TTL - 1 s).
    DEADLINE_EXCEEDED = "no keepalive succeeded before the fence deadline"
    #: The arbiter answered that the session no longer exists.
    EXPIRED = "the arbiter expired the session"
    #: The session (or the client) was closed while holds were attached.
    CLOSED = "the session was closed"
    #: The arbiter said this hold ended (force-release, the session's
    #: expiry or revocation, an epoch advance): only this hold is fenced.
    HOLD_ENDED = "the arbiter reported that the hold ended (force-released, expired or an epoch advance)"
    #: A leadership ended at the arbiter while its session lived: another
    #: term started (an operator forced it out, an epoch advance) or the
    #: election fell vacant, seen on the leadership's Observe stream or as
    #: NOT_LEADER. Only that leadership is lost.
    LEADERSHIP_ENDED = "the arbiter reported that the leadership ended (another term started, or the election fell vacant)"
    #: This client resigned the leadership or handed it over.
    RESIGNED = "the leadership was resigned or handed over by this client"

    def __str__(self) -> str:
        return self.value


class LatchkeyError(Exception):
    """Everything a Latchkey call raises derives from this."""

    def is_transient(self) -> bool:
        """Worth retrying as is: the network or the store, not the request."""
        return False


class ConfigError(LatchkeyError, ValueError):
    """The client configuration cannot work (a missing file, a bad endpoint)."""


class ProtocolError(LatchkeyError):
    """The arbiter answered OK with a reply this client cannot use."""


class Fenced(LatchkeyError):
    """The session is dead, or the hold ended at the arbiter: the hold is lost."""

    def __init__(self, session_id: int, reason: FenceReason) -> None:
        super().__init__(f"session {session_id} is fenced: {reason}")
        self.session_id = session_id
        self.reason = reason


class Refused(LatchkeyError):
    """The arbiter (or the edge in front of it) answered with a non-OK status.

    ``reason`` is the ErrorInfo reason as sent (``"HELD"``, ``"NOT_HELD"``...),
    empty when the status carried none (a transport error, a local deadline).
    """

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        super().__init__(f"{name}: {reason or 'UNSPECIFIED'}: {message}")
        self.code = code
        self.reason = reason
        self.message = message

    def is_transient(self) -> bool:
        return (
            self.reason == "STORE_UNAVAILABLE"
            or self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
            or (self.code == grpc.StatusCode.DEADLINE_EXCEEDED and self.reason != "WAIT_TIMEOUT")
        )


# One class per gRPC code the API uses, then one per reason worth catching.
class InvalidArgument(Refused):
    """INVALID_ARGUMENT: a bad key, an unknown class, a malformed request."""


class PermissionDenied(Refused):
    """PERMISSION_DENIED: no prefix grant of this identity covers the key (or a hook refused)."""


class Unauthenticated(Refused):
    """UNAUTHENTICATED: the call carried no verified SPIFFE identity."""


class FailedPrecondition(Refused):
    """FAILED_PRECONDITION: see the subclasses and ``reason``."""


class Aborted(Refused):
    """ABORTED."""


class DeadlineExceeded(Refused):
    """DEADLINE_EXCEEDED: the call's deadline passed."""


class ResourceExhausted(Refused):
    """RESOURCE_EXHAUSTED: a queue or a per-identity bound is full."""


class Unavailable(Refused):
    """UNAVAILABLE: the arbiter, its store or the edge cannot answer now; retry."""


class Held(Aborted):
    """HELD: another session holds the key (try-lock), or the wait ended."""


class WaitTimeout(DeadlineExceeded):
    """WAIT_TIMEOUT: the key was not granted before the wait's deadline."""


class Leak(FailedPrecondition):
    """LEAK: this client instance (the same identity and instance name) holds
    the key under another session: a hold the process forgot. Replicas that
    share an identity under different instance names wait for each other
    instead."""


class Sealed(FailedPrecondition):
    """SEALED: the lock log was restored; no grants until an operator advances the epoch."""


class SessionExpired(FailedPrecondition):
    """SESSION_EXPIRED: the session is unknown, expired or not the caller's."""


class NotHeld(FailedPrecondition):
    """NOT_HELD / TOKEN_MISMATCH: the release names a hold this session does not have."""


class NotLeader(FailedPrecondition):
    """NOT_LEADER: the leadership named (its session and token) is not the
    election's current one: it resigned, expired, was forced out or handed
    over. Campaign again."""


class NoCandidate(FailedPrecondition):
    """NO_CANDIDATE: a transfer named no current candidate of the election
    (or it has none). The leadership goes on."""


class QuotaExceeded(FailedPrecondition):
    """QUOTA_EXCEEDED: the caller's grant subject holds as many locks of the
    class as its ``maxHoldsPerSubject`` allows. Release one first."""


class KindInUse(FailedPrecondition):
    """KIND_IN_USE: the key is held as the other kind (a lock asked of a
    semaphore whose slots are held, or a semaphore asked of a held lock). A
    key is one kind at a time: use one class kind per key."""


class UpgradeRefused(FailedPrecondition):
    """UPGRADE_REFUSED: an exclusive request of a key this session holds
    shared. A shared hold is never upgraded (two readers upgrading would wait
    for each other forever): release it, then acquire the key exclusively.
    The client raises it without a call when the asking thread holds the key
    shared itself."""


class WrongKind(InvalidArgument):
    """WRONG_KIND: the class is of another kind than the call needs (an
    election class on Acquire, a lock class on Campaign)."""


_BY_REASON = {
    "HELD": Held,
    "WAIT_TIMEOUT": WaitTimeout,
    "LEAK": Leak,
    "SEALED": Sealed,
    "SESSION_EXPIRED": SessionExpired,
    "NOT_HELD": NotHeld,
    "TOKEN_MISMATCH": NotHeld,
    "NOT_LEADER": NotLeader,
    "NO_CANDIDATE": NoCandidate,
    "QUOTA_EXCEEDED": QuotaExceeded,
    "KIND_IN_USE": KindInUse,
    "UPGRADE_REFUSED": UpgradeRefused,
    "WRONG_KIND": WrongKind,
}

_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
}


def reason_of(error: grpc.RpcError) -> str:
    """The ErrorInfo reason of a failed call in our domain, "" without one."""
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key != _DETAILS_KEY:
            continue
        return _reason_from_details(value)
    return ""


def _reason_from_details(blob: bytes) -> str:
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status()
    try:
        status.ParseFromString(blob)
    except Exception:  # a malformed detail from a foreign proxy: no reason
        return ""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                return info.reason
    return ""


def refusal(code: grpc.StatusCode, reason: str, message: str) -> Refused:
    """The exception for a status with `code` and ErrorInfo `reason`."""
    cls = _BY_REASON.get(reason)
    if cls is None or not issubclass(cls, _BY_CODE.get(code, Refused)):
        cls = _BY_CODE.get(code, Refused)
    return cls(code, reason, message)


def from_rpc_error(error: grpc.RpcError) -> Refused:
    """Maps a failed call to the exception for its code and reason."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else None
    return refusal(code, reason_of(error), details or "")

