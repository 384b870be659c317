"""The fence adapter contract: the answers, the mark, the errors, the store base.

The same contract as the Rust crate ``latchkey-fence`` (fence/core): a
guarded write answers :class:`Applied`, :class:`FencedOut` or :class:`Retry`;
everything else is a :class:`FenceError`, whose text never holds a token or a
mark.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Iterable, List, Optional, Tuple, Union

from .._token import FencingToken

#: The greatest token (and mark) any store keeps: an unsigned 64-bit integer.
MAX_TOKEN = (1 << 64) - 1

#: Values below this are no capability (a probe's mark 0, an unprotected
#: grant's token 0; every real token is at least 2**48): :func:`redact`
#: leaves them alone, since replacing a few digits would garble a message
#: ("HTTP 4<redacted>3") and hint at the value. As the Rust ``redact``.
REDACT_BELOW = 1 << 20

_REDACTED = "<redacted>"


@functools.total_ordering
class Mark:
    """A record's fencing mark: the token of the last write it accepted.

    It is a token (a capability), so ``repr`` shows ``Mark(<redacted>)`` and
    ``str``/``format`` show ``<redacted>``. It is not an ``int``:
    ``int(mark)``, ``"%d" % mark`` and ``hex(mark)`` raise ``TypeError``
    (Python formats ``%d`` through ``__int__``). Take the integer with
    ``mark.value`` where you compare it deliberately.
    """

    __slots__ = ("_value",)

    def __init__(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN:
            raise ValueError("a mark is an unsigned 64-bit integer")
        self._value = value

    @property
    def value(self) -> int:
        """The raw value, for comparisons and for storing it back."""
        return self._value

    def to_hex(self) -> str:
        """16 lower-case hex digits: string order is numeric order."""
        return format(self._value, "016x")

    @classmethod
    def from_hex(cls, text: Union[str, bytes]) -> Optional["Mark"]:
        """Parses :meth:`to_hex`'s form; anything else is ``None``."""
        if isinstance(text, bytes):
            try:
                text = text.decode("ascii")
            except UnicodeDecodeError:
                return None
        if len(text) != 16 or any(c not in "0123456789abcdefABCDEF" for c in text):
            return None
        return cls(int(text, 16))

    def to_be_bytes(self) -> bytes:
        """8 bytes big-endian: byte order is numeric order (etcd compares bytes)."""
        return self._value.to_bytes(8, "big")

    @classmethod
    def from_be_bytes(cls, data: bytes) -> Optional["Mark"]:
        """Parses :meth:`to_be_bytes`'s form; any other length is ``None``."""
        if len(data) != 8:
            return None
        return cls(int.from_bytes(data, "big"))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mark):
            return self._value == other._value
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        if isinstance(other, Mark):
            return self._value < other._value
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("Mark", self._value))

    def __int__(self) -> int:
        # Also what `"%d" % mark` calls: refuse, so no log line prints it.
        raise TypeError("a Mark is not converted implicitly (nor formatted with %d); use mark.value")

    def __repr__(self) -> str:
        return "Mark(<redacted>)"

    def __str__(self) -> str:
        return _REDACTED

    def __format__(self, spec: str) -> str:
        return _REDACTED

    def __reduce__(self):  # pickling would write the value somewhere: refuse
        raise TypeError("a Mark is not picklable; pass mark.value deliberately")


@dataclasses.dataclass(frozen=True)
class Applied:
    """The write landed; the record's mark is now the token.

    ``version`` is the record's version after this write: the versions of one
    record strictly increase in the order its writes committed (its write
    count in the SQL stores, Redis and S3, 1 for the write that created it;
    the transaction's revision in etcd).
    """

    version: int

    def __str__(self) -> str:
        return "applied"


@dataclasses.dataclass(frozen=True)
class FencedOut:
    """The record's mark is at or above the token: a later (or the same)
    grant already wrote. Nothing changed. ``mark`` never prints."""

    mark: Mark

    def __str__(self) -> str:
        return "fenced out: a later holder wrote this record"


@dataclasses.dataclass(frozen=True)
class Retry:
    """The store could not decide atomically this time (a conditional request
    lost a race with another writer). Nothing changed; the same write may be
    tried again."""

    def __str__(self) -> str:
        return "not decided: retry the same write"


#: What :meth:`FencedStore.guarded_write` answers.
Guarded = Union[Applied, FencedOut, Retry]


@dataclasses.dataclass(frozen=True)
class Record:
    """A record as a store holds it. Its repr shows the payload's length,
    never the mark's value (nor the payload, which may be large)."""

    mark: Mark
    payload: bytes

    def __repr__(self) -> str:
        return f"Record(mark={self.mark!r}, payload_bytes={len(self.payload)})"


class FenceError(Exception):
    """A guarded write (or read) could not be attempted or did not complete:
    the store is unreachable or refused the request. The text never holds a
    token or a mark: adapters scrub driver messages with :func:`redact`.

    ``transient`` says whether the same write may succeed if retried
    (connection trouble, a server shutting down, throttling).
    """

    def __init__(self, store: str, op: str, message: str, transient: bool = False) -> None:
        super().__init__(f"{store}: {op}: {message}")
        self.store = store
        self.op = op
        #: The store's (scrubbed) words, without the store and the operation.
        self.message = message
        self.transient = transient

    def is_transient(self) -> bool:
        return self.transient

    @classmethod
    def scrubbed(
        cls, store: str, op: str, message: object, transient: bool, secrets: Iterable[int] = ()
    ) -> "FenceError":
        """A store error whose text is scrubbed of every one of ``secrets``."""
        text = str(message)
        for secret in secrets:
            text = redact(text, secret)
        return cls(store, op, text, transient)


class TokenOutOfRange(FenceError):
    """The store cannot keep this token as a mark (PostgreSQL's signed bigint
    and a token above 2**63-1): refused rather than stored wrapped, which
    would compare below every real mark."""

    def __init__(self, store: str) -> None:
        super().__init__(
            store,
            "guarded write",
            "the fencing token does not fit this store's mark; refusing to write",
            transient=False,
        )


class Unfenced(FenceError):
    """The record exists but was not written by a fence (no mark, or one this
    adapter cannot read): refused rather than overwritten."""

    def __init__(self, store: str, record: str, why: str) -> None:
        Exception.__init__(self, f"{store}: record {record!r} carries no readable fencing mark: {why}")
        self.store = store
        self.op = "reading the mark"
        self.message = why
        self.transient = False
        self.record = record
        self.why = why


def redact(text: str, secret: int) -> str:
    """``text`` with every occurrence of ``secret``'s decimal digits, and of
    its 16-digit hex form, replaced by ``<redacted>``. Values below
    :data:`REDACT_BELOW` are left alone (as the Rust ``redact``)."""
    if isinstance(secret, bool) or not isinstance(secret, int) or secret < REDACT_BELOW:
        return text
    return text.replace(str(secret), _REDACTED).replace(format(secret, "016x"), _REDACTED)


def token_value(token: object) -> int:
    """The integer of a fencing token: an ``int`` in 1..2**64-1 or a
    :class:`latchkey.FencingToken`. Anything else raises ``TypeError`` or
    ``ValueError`` naming what is wrong, never the value."""
    if isinstance(token, FencingToken):
        value = token.value
    elif isinstance(token, bool):
        raise TypeError("a fencing token is an int or a latchkey.FencingToken, not a bool")
    elif isinstance(token, int):
        value = token
    else:
        raise TypeError(
            f"a fencing token is an int or a latchkey.FencingToken (guard.token), not {type(token).__name__}"
        )
    if not 1 <= value <= MAX_TOKEN:
        raise ValueError("a fencing token is an integer in 1..2**64-1 (take it from guard.token)")
    return value


def check_input(record: object, payload: object = b"") -> Tuple[str, bytes]:
    """A record name (a non-empty ``str``) and a payload (bytes-like), as
    ``(str, bytes)``, or ``TypeError``/``ValueError`` saying what is wrong."""
    if not isinstance(record, str):
        raise TypeError(f"a record name is a str, not {type(record).__name__}")
    if not record:
        raise ValueError("a record name must not be empty")
    if isinstance(payload, str):
        raise TypeError("a payload is bytes; encode a str first (e.g. text.encode())")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"a payload is bytes, not {type(payload).__name__}")
    return record, bytes(payload)


class FencedStore(abc.ABC):
    """One store that fences writes by token. Adapters keep the mark beside
    the payload of every record and decide each write in one atomic step of
    the store (one statement, one script, one transaction, one conditional
    request).

    The public methods check their input (raising ``TypeError`` or
    ``ValueError`` before anything is sent) and call the adapter's ``_``
    methods with a plain ``int`` token and ``bytes`` payload. A store is a
    context manager; ``close()`` releases its connection.
    """

    #: The store kind, as in ``<kind>://…`` (``postgresql``, ``mysql``,
    #: ``redis``, ``etcd``, ``s3``).
    kind: str = ""

    def guarded_write(self, record: str, token: Union[int, FencingToken], payload: bytes) -> Guarded:
        """Writes ``payload`` to ``record`` if and only if the record is
        missing or its mark is strictly below ``token``, raising the mark to
        ``token`` in the same atomic step."""
        value = token_value(token)
        record, data = check_input(record, payload)
        self._check_record(record)
        return self._guarded_write(record, value, data)

    def read(self, record: str) -> Optional[Record]:
        """The record's mark and payload, or ``None`` when it does not exist."""
        record, _ = check_input(record)
        self._check_record(record)
        return self._read(record)

    def plain_write(self, record: str, payload: bytes) -> None:
        """A write with no fence at all, what a naive writer does: for tests
        and benchmarks only. It keeps the record's mark as it is (a record it
        creates gets mark 0)."""
        record, data = check_input(record, payload)
        self._check_record(record)
        self._plain_write(record, data)

    def caveats(self) -> List[str]:
        """What this store's setup means for the fence, in words a pause-test
        result records beside its verdict (asynchronous replication, a server
        that forgets on restart). Empty when there is nothing to say."""
        return []

    def close(self) -> None:
        """Releases the store's connection (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_record(self, record: str) -> None:
        """Raises ``ValueError`` for a record name this store cannot keep."""

    @abc.abstractmethod
    def _guarded_write(self, record: str, token: int, payload: bytes) -> Guarded: ...

    @abc.abstractmethod
    def _read(self, record: str) -> Optional[Record]: ...

    @abc.abstractmethod
    def _plain_write(self, record: str, payload: bytes) -> None: ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__} kind={self.kind!r}>"


def guarded_write_retrying(
    store: FencedStore,
    record: str,
    token: Union[int, FencingToken],
    payload: bytes,
    attempts: int = 8,
) -> Guarded:
    """:meth:`FencedStore.guarded_write`, tried again while the store answers
    :class:`Retry` (``attempts`` times in all). A caller that still gets
    ``Retry`` knows nothing changed."""
    if isinstance(attempts, bool) or not isinstance(attempts, int):
        raise TypeError("attempts is an int")
    last: Guarded = Retry()
    for _ in range(max(attempts, 1)):
        last = store.guarded_write(record, token, payload)
        if not isinstance(last, Retry):
            break
    return last


def missing_driver(store: str, module: str, package: str, extra: str) -> ImportError:
    """The error an adapter raises when its driver is not installed."""
    return ImportError(
        f"the {store} fence needs {package} (the Python module {module!r} is not importable): "
        f"pip install 'latchkey[{extra}]'"
    )
