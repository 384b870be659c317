"""ADR-13's re-entrancy count: per key within one session, kept here and never
in the lock log. Only the outermost acquire and the final release reach the
arbiter; while either is in flight, other acquirers of the key wait for it to
settle. Every method is called under the session's lock."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Union

from ._token import FencingToken


@dataclass(eq=False, repr=False)
class Hold:
    """One grant of a key, shared by every guard of the same hold."""

    key: str
    session_id: int
    token: FencingToken
    epoch: int
    revision: int
    count: int = 0
    #: The arbiter said this hold ended before it was released.
    ended: bool = False
    #: Granted from an arbiter's memory while the lock cluster had no quorum
    #: (a class with onQuorumLoss = "open", ADR-04): token 0, no fencing.
    unprotected: bool = False

    def __repr__(self) -> str:  # never the token, nor the revision (with the epoch it spells it)
        return f"Hold(key={self.key!r}, session_id={self.session_id}, epoch={self.epoch}, count={self.count})"


REENTERED = "reentered"  # the key is already held: the count went up, no call needed
WAIT = "wait"  # an outermost acquire or a final release is in flight: wait, then try again
OUTERMOST = "outermost"  # send Acquire, then call granted() or failed()

#: decrement(): the count reached zero (send Release, then released())
LAST = "last"
#: decrement(): the guard's hold is not the key's current hold (already settled)
NOT_HELD = "not_held"


@dataclass
class _Settling:
    """An outermost acquire or a final release in flight."""

    releasing: bool
    settled: threading.Event = field(default_factory=threading.Event)


class Holds:
    def __init__(self) -> None:
        self._keys: Dict[str, Union[Hold, _Settling]] = {}

    def begin(self, key: str) -> Tuple[str, Optional[Union[Hold, threading.Event]]]:
        entry = self._keys.get(key)
        if isinstance(entry, Hold):
            entry.count += 1
            return (REENTERED, entry)
        if isinstance(entry, _Settling):
            return (WAIT, entry.settled)
        self._keys[key] = _Settling(releasing=False)
        return (OUTERMOST, None)

    def granted(self, hold: Hold) -> None:
        hold.count = 1
        previous = self._keys.get(hold.key)
        self._keys[hold.key] = hold
        _wake(previous)

    def ended(self, key: str, revision: int) -> bool:
        """The hold of `key` at `revision` ended at the arbiter: if it is the
        key's current hold it leaves (its guards count down to nothing and send
        no Release). Whether it was."""
        entry = self._keys.get(key)
        if isinstance(entry, Hold) and entry.revision == revision:
            entry.ended = True
            del self._keys[key]
            return True
        return False

    def failed(self, key: str) -> None:
        entry = self._keys.get(key)
        if isinstance(entry, _Settling) and not entry.releasing:
            del self._keys[key]
            _wake(entry)

    def decrement(self, hold: Hold) -> Union[int, str]:
        """Counts a guard of `hold` down: the count left, LAST or NOT_HELD."""
        if self._keys.get(hold.key) is not hold:
            return NOT_HELD
        hold.count -= 1
        if hold.count > 0:
            return hold.count
        self._keys[hold.key] = _Settling(releasing=True)
        return LAST

    def released(self, key: str) -> None:
        entry = self._keys.get(key)
        if isinstance(entry, _Settling) and entry.releasing:
            del self._keys[key]
            _wake(entry)

    def __len__(self) -> int:
        return len(self._keys)


def _wake(entry: object) -> None:
    if isinstance(entry, _Settling):
        entry.settled.set()
