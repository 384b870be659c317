"""The fencing token as a value that cannot leak by accident."""

from __future__ import annotations

import functools

_REDACTED = "FencingToken(<redacted>)"


@functools.total_ordering
class FencingToken:
    """The fencing token of a grant: ``epoch * 2**48 + revision``.

    A token is a capability at the resource, so ``repr``, ``str`` and
    formatting print ``FencingToken(<redacted>)``. Take the integer with
    ``token.value`` at the one place that hands it to the resource (a
    conditional write, a header). A larger token is a later grant.

    ``int(token)``, ``"%d" % token`` (and so ``log.info("... %d", token)``),
    ``hex(token)`` and other integer conversions raise ``TypeError``: Python
    formats ``%d`` through ``__int__``, so a token that converted implicitly
    would print itself into the first log line that asked for a number.
    """

    __slots__ = ("_value",)

    def __init__(self, value: int) -> None:
        if not isinstance(value, int) or value < 0 or value >= 1 << 64:
            raise ValueError("a fencing token is an unsigned 64-bit integer")
        self._value = value

    @property
    def value(self) -> int:
        """The integer to compare at the resource."""
        return self._value

    def __int__(self) -> int:
        # Also what `"%d" % token` calls: refuse, so no log line prints it.
        raise TypeError("a FencingToken is not converted implicitly (nor formatted with %d); use token.value")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FencingToken):
            return self._value == other._value
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        if isinstance(other, FencingToken):
            return self._value < other._value
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("FencingToken", self._value))

    def __repr__(self) -> str:
        return _REDACTED

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return _REDACTED

    def __reduce__(self):  # pickling would write the value somewhere: refuse
        raise TypeError("a FencingToken is not picklable; pass token.value deliberately")
