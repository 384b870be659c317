"""The etcd fence, for a user's own etcd (a resource, not Latchkey's lock
log): one transaction compares the record's mark and puts the mark and the
payload, as the Rust crate ``latchkey-fence-etcd`` does.

It talks to etcd's v3 JSON gateway (``POST /v3/kv/txn``, keys and values in
base64) with the standard library only: the gateway is part of every etcd
server since 3.3 and carries the same ``Txn`` as gRPC, so no generated stubs
or extra package are needed (docs/fencing.md says why).

A record is two keys under ``<prefix>/<record>/``: ``mark`` (the token of the
last accepted write, 8 bytes big-endian, so etcd's byte-wise comparison is
the numeric one) and ``payload``. The guarded write is a compare-and-swap on
the mark key's ``mod_revision``, one ``Txn`` per attempt::

    record not seen yet:   IF version(mark) = 0 AND version(payload) = 0
    mark seen at rev r:    IF mod_revision(mark) = r AND value(mark) < token_bytes
    THEN put(mark, token_bytes), put(payload, payload)
    ELSE get(mark), get(payload)

etcd applies a transaction atomically at one revision: that revision is the
applied write's version. When the compare fails, the gets show the record as
it is: a mark at or above the token is a fenced-out write (strictly ``<``: a
replayed token is refused); a payload without a mark, or a mark that is not
exactly 8 bytes, is :class:`~latchkey.fence.Unfenced` (never overwritten); an
8-byte mark below the token is tried again at the revision just read. So a
write lands only over a mark this adapter read and validated and that has not
changed since (etcd's byte-wise ``Less`` alone would pass a mark of another
width that sorts below the token). The store remembers the revision its own
last write of a record left, so a holder writing one record again pays one
transaction. The same transaction as the Rust crate ``latchkey-fence-etcd``.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple
from urllib.parse import unquote

from ._contract import (
    Applied,
    FencedOut,
    FencedStore,
    FenceError,
    Guarded,
    Mark,
    Record,
    Retry,
    Unfenced,
)

KIND = "etcd"
CONNECT_TIMEOUT = 5.0
REQUEST_TIMEOUT = 10.0

#: Compare-and-swap attempts of one guarded write before it answers Retry.
ATTEMPTS = 4
#: Records whose last-written revision the store remembers; past this the
#: memory starts again (a forgotten record costs one more transaction).
REMEMBERED = 4096

#: A write is sent on a kept-alive connection only if it was used this
#: recently (an older one may be closing at the server's end); reads retry.
IDLE_REUSE = 2.0

# gRPC codes worth retrying: DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, UNAVAILABLE.
_TRANSIENT_GRPC = {4, 8, 10, 14}
_UNAUTHENTICATED = 16


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class OutcomeUnknown(Exception):
    """A request was sent and no answer came back."""


class EtcdUrl:
    """``etcd://[user:password@]host:port[,host:port…][/prefix]``. The
    password never prints."""

    def __init__(self, url: str) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(
                f"not a usable etcd:// URL: {why} (etcd://[user:password@]host:port[,host:port][/prefix])"
            )

        if not url.startswith("etcd://"):
            raise bad("it does not start with etcd:// (TLS is not supported here)")
        rest = url[len("etcd://") :]
        authority, _, prefix = rest.partition("/")
        self.prefix = prefix.rstrip("/")
        self.login: Optional[Tuple[str, str]] = None
        if "@" in authority:
            userinfo, _, authority = authority.rpartition("@")
            user, sep, password = userinfo.partition(":")
            if not sep:
                raise bad("the user has no password")
            if not user:
                raise bad("the user name is empty")
            self.login = (unquote(user), unquote(password))
        self.endpoints: List[Tuple[str, int]] = []
        for host in authority.split(","):
            name, sep, port = host.rpartition(":")
            if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
                raise bad("an endpoint is not host:port")
            self.endpoints.append((name.strip("[]"), int(port)))

    def __repr__(self) -> str:
        user = self.login[0] if self.login else None
        return f"EtcdUrl(endpoints={self.endpoints!r}, user={user!r}, prefix={self.prefix!r})"


class EtcdStore(FencedStore):
    """The fence over a user's etcd cluster, through its JSON gateway.
    Thread-safe: each thread keeps its own HTTP connection."""

    kind = KIND

    def __init__(
        self,
        endpoints: Sequence[Tuple[str, int]],
        prefix: str = "",
        login: Optional[Tuple[str, str]] = None,
    ) -> None:
        if not endpoints:
            raise ValueError("an etcd store needs at least one endpoint (host, port)")
        self._endpoints = list(endpoints)
        self.prefix = prefix
        self._login = login
        self._token: Optional[str] = None
        self._auth_lock = threading.Lock()
        self._local = threading.local()
        self._conns: List[http.client.HTTPConnection] = []
        self._conns_lock = threading.Lock()
        self._written: Dict[str, int] = {}
        self._written_lock = threading.Lock()

    @classmethod
    def connect(cls, url: str) -> "EtcdStore":
        """Connects with an ``etcd://`` URL (plain HTTP) and checks an
        endpoint answers (logging in first when the URL names a user)."""
        parsed = EtcdUrl(url)
        store = cls(parsed.endpoints, parsed.prefix, parsed.login)
        # A read under the prefix: a user's role may cover nothing else.
        probe = f"{parsed.prefix}/".encode() if parsed.prefix else b"\0"
        store._post("connecting", "/v3/kv/range", {"key": _b64(probe), "limit": "1"}, (), idempotent=True)
        return store

    def keys(self, record: str) -> Tuple[str, str]:
        """The mark's and the payload's keys for ``record``."""
        base = f"{self.prefix}/{record}" if self.prefix else record
        return f"{base}/mark", f"{base}/payload"

    def close(self) -> None:
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    # --- HTTP ---------------------------------------------------------------

    def _connection(self, index: int, fresh: bool) -> http.client.HTTPConnection:
        """This thread's connection to endpoint ``index``, connected. With
        ``fresh``, one that has not sat idle (a write is never sent on a
        connection the server may be closing)."""
        cached = getattr(self._local, "conn", None)
        if cached is not None:
            same, idle = cached[0] == index, time.monotonic() - cached[2]
            if same and cached[1].sock is not None and not (fresh and idle > IDLE_REUSE):
                return cached[1]
            self._drop_connection()
        host, port = self._endpoints[index]
        conn = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT)
        conn.connect()  # raises before anything is sent
        if conn.sock is not None:
            conn.sock.settimeout(REQUEST_TIMEOUT)
        self._local.conn = (index, conn, time.monotonic())
        with self._conns_lock:
            self._conns.append(conn)
        return conn

    def _drop_connection(self) -> None:
        cached = getattr(self._local, "conn", None)
        if cached is not None:
            cached[1].close()
            with self._conns_lock:
                if cached[1] in self._conns:
                    self._conns.remove(cached[1])
            self._local.conn = None

    def _exchange(self, path: str, body: dict, auth: Optional[str], idempotent: bool) -> Tuple[int, dict]:
        """One request to the first endpoint that answers: (HTTP status, JSON).
        An endpoint that cannot be reached is passed over; a request that was
        sent and got no answer is sent again only when ``idempotent`` (a
        write may have landed: :class:`OutcomeUnknown`)."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = auth
        start = getattr(self._local, "endpoint", 0)
        last: Optional[BaseException] = None
        for step in range(len(self._endpoints)):
            index = (start + step) % len(self._endpoints)
            for attempt in range(2):
                try:
                    conn = self._connection(index, fresh=not idempotent)
                except (OSError, http.client.HTTPException) as e:
                    last = e
                    break  # nothing sent: the next endpoint
                try:
                    conn.request("POST", path, body=data, headers=headers)
                    resp = conn.getresponse()
                    raw = resp.read()
                except (OSError, http.client.HTTPException) as e:
                    self._drop_connection()
                    last = e
                    if idempotent and attempt == 0:
                        continue
                    if idempotent:
                        break
                    raise OutcomeUnknown(f"{type(e).__name__}: {e}") from None
                self._local.endpoint = index
                self._local.conn = (index, conn, time.monotonic())
                if resp.will_close:
                    self._drop_connection()
                try:
                    answer = json.loads(raw or b"{}")
                except ValueError:
                    answer = {"error": f"a non-JSON answer (HTTP {resp.status})"}
                return resp.status, answer if isinstance(answer, dict) else {}
        raise ConnectionError(f"no etcd endpoint answered: {type(last).__name__}: {last}")

    def _authenticate(self, op: str) -> str:
        with self._auth_lock:
            if self._token is None and self._login is not None:
                user, password = self._login
                try:
                    status, answer = self._exchange(
                        "/v3/auth/authenticate", {"name": user, "password": password}, None, idempotent=True
                    )
                except ConnectionError as e:
                    raise FenceError(KIND, op, str(e), True) from None
                if status != 200 or not answer.get("token"):
                    raise FenceError(
                        KIND, op, f"logging in failed: {self._why(status, answer)}", self._is_transient(status, answer)
                    )
                self._token = str(answer["token"])
            return self._token or ""

    @staticmethod
    def _why(status: int, answer: dict) -> str:
        return str(answer.get("message") or answer.get("error") or f"HTTP {status}")

    @staticmethod
    def _is_transient(status: int, answer: dict) -> bool:
        return answer.get("code") in _TRANSIENT_GRPC or status in (408, 429, 502, 503, 504)

    def _post(self, op: str, path: str, body: dict, secrets: Sequence[int], idempotent: bool = False) -> dict:
        """One gateway call; its answer, or a FenceError scrubbed of
        ``secrets`` (raised outside ``except``: nothing rides along)."""
        for attempt in range(2):
            auth = self._authenticate(op) if self._login else None
            try:
                status, answer = self._exchange(path, body, auth, idempotent)
            except OutcomeUnknown as e:
                err = FenceError.scrubbed(
                    KIND,
                    op,
                    f"the connection broke after the request was sent ({e}): it may have been applied; "
                    "read the record (a mark equal to your token is your own write)",
                    True,
                    secrets,
                )
                break
            except ConnectionError as e:
                err = FenceError.scrubbed(KIND, op, str(e), True, secrets)
                break
            if status == 200:
                return answer
            if answer.get("code") == _UNAUTHENTICATED and self._login and attempt == 0:
                with self._auth_lock:  # the token expired: log in again once
                    self._token = None
                continue
            err = FenceError.scrubbed(KIND, op, self._why(status, answer), self._is_transient(status, answer), secrets)
            break
        raise err

    # --- the fence ----------------------------------------------------------

    @staticmethod
    def guarded_txn(mark_key: str, payload_key: str, seen: Optional[int], token: int, payload: bytes) -> dict:
        """One attempt of the guarded write, as the gateway's JSON: create the
        record when ``seen`` is ``None``, else overwrite it if its mark key is
        still at revision ``seen`` and below the token. The else branch reads
        the record."""
        mk, pk, tb = _b64(mark_key.encode()), _b64(payload_key.encode()), _b64(Mark(token).to_be_bytes())
        if seen is None:
            when = [
                {"key": mk, "target": "VERSION", "result": "EQUAL", "version": "0"},
                {"key": pk, "target": "VERSION", "result": "EQUAL", "version": "0"},
            ]
        else:
            when = [
                {"key": mk, "target": "MOD", "result": "EQUAL", "mod_revision": str(seen)},
                {"key": mk, "target": "VALUE", "result": "LESS", "value": tb},
            ]
        return {
            "compare": when,
            "success": [
                {"request_put": {"key": mk, "value": tb}},
                {"request_put": {"key": pk, "value": _b64(payload)}},
            ],
            "failure": [{"request_range": {"key": mk}}, {"request_range": {"key": pk}}],
        }

    def _remembered(self, record: str) -> Optional[int]:
        with self._written_lock:
            return self._written.get(record)

    def _remember(self, record: str, revision: Optional[int]) -> None:
        with self._written_lock:
            if revision is None:
                self._written.pop(record, None)
                return
            if len(self._written) >= REMEMBERED and record not in self._written:
                self._written.clear()
            self._written[record] = revision

    @staticmethod
    def _first_kv(response: object) -> Optional[dict]:
        """A range response's first key-value, ``None`` when it found nothing."""
        if not isinstance(response, dict):
            return None
        kvs = (response.get("response_range") or {}).get("kvs") or []
        return kvs[0] if kvs and isinstance(kvs[0], dict) else None

    @classmethod
    def _got(cls, response: object) -> Optional[bytes]:
        """The value of a range response's first key, ``None`` when it found nothing."""
        kv = cls._first_kv(response)
        return None if kv is None else base64.b64decode(kv.get("value") or "")

    @staticmethod
    def _mark_of(record: str, data: bytes) -> Mark:
        mark = Mark.from_be_bytes(data)
        if mark is None:
            raise Unfenced(KIND, record, "its mark key does not hold 8 bytes")
        return mark

    def _guarded_write(self, record: str, token: int, payload: bytes) -> Guarded:
        op = "guarded write"
        mark_key, payload_key = self.keys(record)
        seen = self._remembered(record)
        for _ in range(ATTEMPTS):
            txn = self.guarded_txn(mark_key, payload_key, seen, token, payload)
            answer = self._post(op, "/v3/kv/txn", txn, (token,))
            if answer.get("succeeded"):
                try:
                    revision = int(answer["header"]["revision"])
                except (KeyError, TypeError, ValueError):
                    revision = 0
                if revision <= 0:
                    self._remember(record, None)
                    raise FenceError(KIND, op, "the write was applied but etcd's answer carries no revision")
                self._remember(record, revision)
                return Applied(version=revision)
            ops = (answer.get("responses") or []) + [None, None]
            mark_kv = self._first_kv(ops[0])
            if mark_kv is None:
                if self._got(ops[1]) is not None:
                    raise Unfenced(KIND, record, "it has a payload key but no mark key")
                seen = None  # missing now: create it
                continue
            mark = self._mark_of(record, base64.b64decode(mark_kv.get("value") or ""))
            if mark >= Mark(token):
                self._remember(record, None)
                return FencedOut(mark)
            try:
                seen = int(mark_kv.get("mod_revision"))
            except (TypeError, ValueError):
                raise FenceError(KIND, op, "etcd's answer carries a mark without its mod_revision") from None
        return Retry()

    def _read(self, record: str) -> Optional[Record]:
        mark_key, payload_key = self.keys(record)
        txn = {
            "success": [
                {"request_range": {"key": _b64(mark_key.encode())}},
                {"request_range": {"key": _b64(payload_key.encode())}},
            ]
        }
        answer = self._post("reading a record", "/v3/kv/txn", txn, (), idempotent=True)
        ops = (answer.get("responses") or []) + [None, None]
        mark, data = self._got(ops[0]), self._got(ops[1])
        if mark is None and data is None:
            return None
        if mark is None:
            raise Unfenced(KIND, record, "it has a payload key but no mark key")
        return Record(self._mark_of(record, mark), data or b"")

    def _plain_write(self, record: str, payload: bytes) -> None:
        mark_key, payload_key = self.keys(record)
        mk, pk = _b64(mark_key.encode()), _b64(payload_key.encode())
        put_payload = {"request_put": {"key": pk, "value": _b64(payload)}}
        txn = {
            "compare": [{"key": mk, "target": "VERSION", "result": "EQUAL", "version": "0"}],
            "success": [{"request_put": {"key": mk, "value": _b64(Mark(0).to_be_bytes())}}, put_payload],
            "failure": [put_payload],
        }
        self._post("plain write", "/v3/kv/txn", txn, ())
