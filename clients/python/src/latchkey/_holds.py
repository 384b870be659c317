"""ADR-13's re-entrancy count: per key within one session and per thread, kept
here and never in the lock log. Only the outermost acquire and the final
release reach the arbiter; while either is in flight, other acquirers of the
key wait for it to settle.

A hold belongs to the thread whose acquire reached the arbiter (issue 37:
four threads sharing one client were all inside ``with client.lock(k)`` at
once when the count was per session). That thread re-enters; another thread
of the same client is told the key is held (``OTHER_THREAD``) and waits for
the hold to leave the table, or is refused, like any other caller. It cannot
ask the arbiter instead: the arbiter sees one session and one instance, and
re-entrancy is the client's alone. A hold is re-entered only in its own
mode: the same thread asking for it in the other mode (shared vs exclusive)
is refused (``OTHER_MODE``), since the session holds the key once. A
downgrade (exclusive to shared) of a hold with one guard is in flight like an
acquire: until the arbiter answers, the key's entry is ``_Downgrading`` and
other acquirers wait. Every method is called under the session's lock."""

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
    #: The slot held, for a semaphore class's grant (0..permits-1); None for a lock.
    slot: Optional[int] = None
    #: A semaphore class's permits, as its grant said (Grant.permits).
    permits: Optional[int] = None
    #: A shared hold (MODE_SHARED); False: exclusive.
    shared: bool = False
    #: The thread whose acquire reached the arbiter: the one that re-enters.
    owner: Optional[threading.Thread] = None
    #: Set when the hold leaves the table (its final release starts, the
    #: arbiter ended it, the session died, a downgrade replaced it): other
    #: threads waiting for the key look again.
    left: threading.Event = field(default_factory=threading.Event)
    #: The class and metadata of the acquire that was granted: a downgrade
    #: is an Acquire of the key again, which the class's hooks see too.
    lock_class: str = ""
    metadata: Dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # never the token, nor the revision (with the epoch it spells it)
        return (
            f"Hold(key={self.key!r}, session_id={self.session_id}, epoch={self.epoch}, "
            f"shared={self.shared}, count={self.count})"
        )


REENTERED = "reentered"  # this thread holds the key: the count went up, no call needed
WAIT = "wait"  # an outermost acquire or a final release is in flight: wait, then try again
OTHER_THREAD = "other_thread"  # another thread holds the key: wait for `left`, or refuse (try-lock)
OUTERMOST = "outermost"  # send Acquire, then call granted() or failed()
#: this thread holds the key in the other mode (shared vs exclusive): refuse
#: without a call. One hold per key and session, so no re-entry in another
#: mode; the count is left as it was.
OTHER_MODE = "other_mode"

#: decrement(): the count reached zero (send Release, then released())
LAST = "last"
#: decrement(): the guard's hold is not the key's current hold (already settled)
NOT_HELD = "not_held"
#: begin_downgrade(): other guards of the hold exist (nested acquires, each
#: expecting the exclusive hold)
NESTED = "nested"


@dataclass
class _Settling:
    """An outermost acquire or a final release in flight."""

    releasing: bool
    owner: Optional[threading.Thread] = None
    settled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Downgrading:
    """A downgrade of `hold` in flight. `ended`: the arbiter said meanwhile
    that `hold` ended, which a downgrade that landed looks like too, so it is
    acted on only if the downgrade fails."""

    hold: Hold
    ended: bool = False
    settled: threading.Event = field(default_factory=threading.Event)
    #: The arbiter said a later hold of the key ended (at this revision): the
    #: downgrade's own shared hold, whose notice can beat the answer; acted
    #: on when the downgrade is answered.
    ended_after: Optional[int] = None


class Holds:
    def __init__(self) -> None:
        self._keys: Dict[str, Union[Hold, _Settling, _Downgrading]] = {}

    def begin(
        self, key: str, thread: threading.Thread, shared: bool = False
    ) -> Tuple[str, Optional[Union[Hold, threading.Event]]]:
        """What `thread` asking for `key` (shared or exclusively) does:
        (REENTERED, hold), (OTHER_MODE, hold: held by `thread` in the other
        mode, not counted), (OTHER_THREAD, the hold's `left`), (WAIT, an event
        that settles) or (OUTERMOST, None)."""
        entry = self._keys.get(key)
        if isinstance(entry, Hold):
            if entry.owner is not thread:
                return (OTHER_THREAD, entry.left)
            if entry.shared != shared:
                return (OTHER_MODE, entry)
            entry.count += 1
            return (REENTERED, entry)
        if isinstance(entry, (_Settling, _Downgrading)):
            return (WAIT, entry.settled)
        self._keys[key] = _Settling(releasing=False, owner=thread)
        return (OUTERMOST, None)

    def granted(self, hold: Hold) -> None:
        hold.count = 1
        previous = self._keys.get(hold.key)
        if isinstance(previous, _Settling) and hold.owner is None:
            hold.owner = previous.owner
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
            entry.left.set()
            return True
        if isinstance(entry, _Downgrading) and entry.hold.revision == revision:
            # The downgrade's own end of the exclusive hold, or another:
            # which one is known when the downgrade is answered.
            entry.ended = True
        elif isinstance(entry, _Downgrading) and revision > entry.hold.revision:
            entry.ended_after = revision
        return False

    def begin_downgrade(self, hold: Hold) -> Optional[str]:
        """Starts a downgrade of `hold`: None, or NOT_HELD (not the key's
        current hold) or NESTED (it has other guards). Until downgraded() or
        downgrade_failed(), other acquirers of the key wait."""
        if self._keys.get(hold.key) is not hold:
            return NOT_HELD
        if hold.count > 1:
            return NESTED
        self._keys[hold.key] = _Downgrading(hold)
        return None

    def downgraded(self, shared: Hold) -> bool:
        """The arbiter granted the downgrade: `shared` is the key's hold now,
        with the one guard (and the owner) the exclusive hold had — unless the
        arbiter said already that it ended: then it leaves at once, as ended()
        would have done. Whether it ended."""
        entry = self._keys.get(shared.key)
        if not isinstance(entry, _Downgrading):
            return False
        shared.count = 1
        shared.owner = entry.hold.owner
        entry.hold.left.set()
        if entry.ended_after == shared.revision:
            shared.ended = True
            shared.left.set()
            del self._keys[shared.key]
            entry.settled.set()
            return True
        self._keys[shared.key] = shared
        entry.settled.set()
        return False

    def downgrade_failed(self, key: str) -> bool:
        """The downgrade of `key` failed: its exclusive hold is the key's hold
        again, unless the arbiter said meanwhile that it ended; then it leaves
        as ended() would have done. Whether it ended."""
        entry = self._keys.get(key)
        if not isinstance(entry, _Downgrading):
            return False
        if entry.ended:
            entry.hold.ended = True
            del self._keys[key]
            entry.hold.left.set()
        else:
            self._keys[key] = entry.hold
        entry.settled.set()
        return entry.ended

    def downgrade_lost(self, key: str, cleaning: bool) -> bool:
        """The downgrade of `key` left its guard without a hold (NOT_HELD: the
        exclusive hold was gone; or its outcome stayed unknown): the exclusive
        hold ends here. With `cleaning` the key stays in flight until
        downgrade_cleaned(): the downgrade may have landed and is asked again
        so that its shared hold is released, and a new acquire of the key
        meanwhile could be answered with the hold that clean-up converts.
        Whether it was the key's downgrade."""
        entry = self._keys.get(key)
        if not isinstance(entry, _Downgrading):
            return False
        entry.hold.ended = True
        entry.hold.left.set()
        if not cleaning:
            del self._keys[key]
            entry.settled.set()
        return True

    def downgrade_cleaned(self, key: str) -> None:
        """See downgrade_lost()."""
        entry = self._keys.get(key)
        if isinstance(entry, _Downgrading) and entry.hold.ended:
            del self._keys[key]
            entry.settled.set()

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
        hold.left.set()
        return LAST

    def released(self, key: str) -> None:
        entry = self._keys.get(key)
        if isinstance(entry, _Settling) and entry.releasing:
            del self._keys[key]
            _wake(entry)

    def wake_all(self) -> None:
        """The session died: everyone waiting on it looks again (and finds it dead)."""
        for entry in self._keys.values():
            if isinstance(entry, Hold):
                entry.left.set()
            else:
                entry.settled.set()
                if isinstance(entry, _Downgrading):
                    entry.hold.left.set()

    def __len__(self) -> int:
        return len(self._keys)


def _wake(entry: object) -> None:
    if isinstance(entry, _Settling):
        entry.settled.set()
