"""The Redis fence (redis-py): one Lua script compares the record's mark with
the token and writes the payload, the new mark and the write count, as the
Rust crate ``latchkey-fence-redis`` does. Redis runs a script to the end
before it serves another command, so the comparison and the write are one
step.

A record is one hash (the key is the record name) with the fields ``mark``
(the token of the last accepted write, 16 lower-case hex digits),
``payload`` and ``writes`` (the record's write count, ``HINCRBY`` 1 per
applied write: the applied write's version). The script answers ``{1,
writes}`` written, ``{0, mark}`` fenced out, ``{-1, why}`` a key that is not
a fenced record (never overwritten: :class:`~latchkey.fence.Unfenced`). Marks
are compared as numbers in two 32-bit halves (exact in Lua's doubles), not
as strings (Lua's string ``<`` follows the server's locale).

**Marks must not vanish.** A record whose key expires or is evicted takes its
mark along, and the next write, a stale one too, creates it anew. The script
refuses a key with an expiry (remove it with ``PERSIST``), and
:meth:`RedisStore.connect` refuses a server that may evict any key
(``maxmemory`` with an ``allkeys-*`` policy). A server without an append-only
file loses marks on restart: :meth:`RedisStore.caveats` says so.

**Replication caveat.** Redis replicates asynchronously: a write the script
accepted can be lost when the primary fails before a replica has it, and the
promoted replica then accepts the older holder's stale write. ``WAIT``
narrows that window without closing it. Use a store with synchronous
replication where a lost write matters (docs/fencing.md).

Needs ``pip install 'latchkey[redis]'`` (redis-py).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from ._contract import (
    Applied,
    FencedOut,
    FencedStore,
    FenceError,
    Guarded,
    Mark,
    Record,
    Unfenced,
    missing_driver,
)

KIND = "redis"

#: ``KEYS[1]`` the record, ``ARGV[1]`` the token as 16 lower-case hex
#: digits, ``ARGV[2]`` the payload.
GUARDED_WRITE_LUA = r"""
local token = ARGV[1]
if string.len(token) ~= 16 or not string.match(token, '^[0-9a-f]+$') then
  return redis.error_reply('ERR latchkey fence: the token argument is not 16 lower-case hex digits')
end
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then
  redis.call('HSET', KEYS[1], 'mark', token, 'payload', ARGV[2], 'writes', 1)
  return {1, 1}
end
if kind ~= 'hash' then
  return {-1, 'the key holds a ' .. kind .. ', not a fenced hash'}
end
local mark = redis.call('HGET', KEYS[1], 'mark')
if not mark then
  return {-1, 'the hash has no mark field'}
end
if string.len(mark) ~= 16 or not string.match(mark, '^[0-9a-f]+$') then
  return {-1, 'its mark field is not 16 lower-case hex digits'}
end
if redis.call('PTTL', KEYS[1]) >= 0 then
  return {-1, 'the key has an expiry, and its mark would expire with it (a stale write would then land): remove it with PERSIST'}
end
local writes = redis.call('HGET', KEYS[1], 'writes')
if writes and (not string.match(writes, '^[0-9]+$') or string.len(writes) > 18 or (string.len(writes) > 1 and string.sub(writes, 1, 1) == '0')) then
  return {-1, 'its writes field is not a count'}
end
local mh = tonumber(string.sub(mark, 1, 8), 16)
local th = tonumber(string.sub(token, 1, 8), 16)
if mh < th or (mh == th and tonumber(string.sub(mark, 9), 16) < tonumber(string.sub(token, 9), 16)) then
  redis.call('HSET', KEYS[1], 'mark', token, 'payload', ARGV[2])
  return {1, redis.call('HINCRBY', KEYS[1], 'writes', 1)}
end
return {0, mark}
"""

#: ``{0}`` missing, ``{1, mark, payload}`` (either may be nil), ``{-1, why}``.
READ_LUA = r"""
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then
  return {0}
end
if kind ~= 'hash' then
  return {-1, 'the key holds a ' .. kind .. ', not a fenced hash'}
end
local v = redis.call('HMGET', KEYS[1], 'mark', 'payload')
return {1, v[1], v[2]}
"""

#: The naive writer (tests and benchmarks only): sets the payload, a mark of
#: zero only when the record has none, and counts the write. Never compares.
PLAIN_WRITE_LUA = r"""
redis.call('HSETNX', KEYS[1], 'mark', '0000000000000000')
redis.call('HSET', KEYS[1], 'payload', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'writes', 1)
return 1
"""

_TRANSIENT_CODES = ("LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY", "BUSY")

#: Said of every Redis store (the pause-test result records it).
REPLICATION_CAVEAT = (
    "Redis replicates asynchronously: a write the fence accepted on the primary can be lost in a "
    "failover, and the promoted replica then accepts the older holder's stale write. This test "
    "proves the script on one server, not failover"
)


def eviction_refusal(memory: dict) -> Optional[str]:
    """Why a server with this ``INFO memory`` may not hold fenced records."""
    # Fields missing (a proxy, a fork that renamed them): refuse, never
    # assume no eviction (as the Rust adapter does).
    try:
        limit = int(memory["maxmemory"])
        policy = _text(memory["maxmemory_policy"])
    except (KeyError, TypeError, ValueError):
        limit, policy = None, None
    if limit is None or not policy:
        return (
            "INFO memory does not say maxmemory and maxmemory_policy, so whether the server "
            "may evict a fenced record cannot be known"
        )
    if limit > 0 and policy.startswith("allkeys-"):
        return (
            f"maxmemory is set and maxmemory-policy is {policy}: the server may evict a fenced record, "
            "and its mark with it (a stale write would then land); use noeviction, or a volatile-* policy"
        )
    return None


def caveats_of(persistence: dict) -> List[str]:
    """The caveats a server with this ``INFO persistence`` gets."""
    caveats = [REPLICATION_CAVEAT]
    if str(persistence.get("aof_enabled")) != "1":
        caveats.append(
            "the server has no append-only file: a restart loses the marks written since its last "
            "snapshot (all of them without one), and a stale write to a lost record lands"
        )
    else:
        caveats.append(
            "unless appendfsync is always, a crash of the server loses up to about a second of "
            "marks (everysec), and a stale write to a lost record lands"
        )
    return caveats


def _redis():
    try:
        import redis
    except ImportError:
        raise missing_driver("Redis", "redis", "redis-py", "redis") from None
    return redis


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


class RedisStore(FencedStore):
    """The fence over one Redis server (or primary), through a redis-py
    client (thread-safe: it keeps a connection pool)."""

    kind = KIND

    def __init__(self, client) -> None:
        """Wraps a ``redis.Redis`` client (with ``decode_responses`` off)."""
        self._client = client
        self._caveats = [REPLICATION_CAVEAT]
        self._guarded = client.register_script(GUARDED_WRITE_LUA)
        self._read_script = client.register_script(READ_LUA)
        self._plain = client.register_script(PLAIN_WRITE_LUA)

    @classmethod
    def connect(cls, url: str) -> "RedisStore":
        """Connects with a ``redis://[:password@]host:port[/db]`` URL (no TLS),
        refuses a server that may evict any key, and notes what its
        persistence means (:meth:`caveats`). Errors name neither the URL nor
        its password."""
        redis = _redis()
        if not url.startswith("redis://"):
            raise ValueError("a Redis store URL is redis://[:password@]host:port[/db]")
        try:
            client = redis.Redis.from_url(url, decode_responses=False, socket_connect_timeout=5, socket_timeout=10)
        except ValueError:
            client = None
        if client is None:
            raise ValueError("not a usable redis:// URL (redis://[:password@]host:port[/db])")
        store = cls(client)
        store._check_server()
        return store

    def _check_server(self) -> None:
        op = "checking the server's eviction policy"
        try:
            memory = self._call(op, self._client.info, (), "memory")
            persistence = self._call(op, self._client.info, (), "persistence")
        except FenceError as e:
            if e.transient:
                raise
            err = FenceError(
                KIND,
                op,
                f"{e.message} (the fence reads INFO memory and INFO persistence to know whether the server may "
                "evict or forget a record's mark; allow INFO for this user)",
            )
        else:
            err = None
        if err is not None:
            raise err
        why = eviction_refusal(memory)
        if why:
            raise FenceError(KIND, op, why)
        self._caveats = caveats_of(persistence)

    def caveats(self) -> List[str]:
        return list(self._caveats)

    @property
    def client(self):
        return self._client

    def close(self) -> None:
        self._client.close()

    def _call(self, op: str, fn, secrets: Sequence[int], *args, **kwargs):
        """Runs one call; a scrubbed FenceError raised outside ``except`` (no
        driver exception rides along as its context)."""
        redis = _redis()
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as e:
            text = str(e)
            transient = isinstance(e, (redis.ConnectionError, redis.TimeoutError)) or text.startswith(
                _TRANSIENT_CODES
            )
            err = FenceError.scrubbed(KIND, op, text or type(e).__name__, transient, secrets)
        raise err

    def _unexpected(self, op: str, what: str) -> FenceError:
        return FenceError(KIND, op, f"the script answered {what}, which this adapter does not know")

    def _guarded_write(self, record: str, token: int, payload: bytes) -> Guarded:
        op = "guarded write"
        answer = self._call(op, self._guarded, (token,), keys=[record], args=[Mark(token).to_hex(), payload])
        if not isinstance(answer, list) or not answer:
            raise self._unexpected(op, "something else")
        if answer[0] == 1 and len(answer) >= 2 and isinstance(answer[1], int):
            return Applied(version=answer[1])
        if answer[0] == 0:
            mark = Mark.from_hex(answer[1]) if len(answer) >= 2 and isinstance(answer[1], bytes) else None
            if mark is None:
                raise self._unexpected(op, "fenced out without a readable mark")
            return FencedOut(mark)
        if answer[0] == -1:
            raise Unfenced(KIND, record, _text(answer[1] if len(answer) > 1 else ""))
        raise self._unexpected(op, "something else")

    def _read(self, record: str) -> Optional[Record]:
        op = "reading a record"
        answer = self._call(op, self._read_script, (), keys=[record])
        if not isinstance(answer, list) or not answer:
            raise self._unexpected(op, "something else")
        if answer[0] == 0:
            return None
        if answer[0] == -1:
            raise Unfenced(KIND, record, _text(answer[1] if len(answer) > 1 else ""))
        if answer[0] == 1:
            raw = answer[1] if len(answer) > 1 else None
            if raw is None:
                raise Unfenced(KIND, record, "the hash has no mark field")
            mark = Mark.from_hex(raw) if isinstance(raw, bytes) else None
            if mark is None or raw != raw.lower():
                raise Unfenced(KIND, record, "its mark field is not 16 lower-case hex digits")
            payload = answer[2] if len(answer) > 2 and isinstance(answer[2], bytes) else b""
            return Record(mark, payload)
        raise self._unexpected(op, "something else")

    def _plain_write(self, record: str, payload: bytes) -> None:
        self._call("plain write", self._plain, (), keys=[record], args=[payload])
