"""The fence for S3-compatible object stores: the record is an object, its
mark lives in the object's metadata and on the body's first line, and the
guarded write is a compare-and-swap on the object's ETag, as in the Rust
crate ``latchkey-fence-s3`` (docs/fencing-s3.md has the exact requests).

:meth:`S3Store.guarded_write` loops:

1. ``HEAD`` the object: its ETag, mark (``x-amz-meta-latchkey-fence``, 16
   hex digits) and write count (``x-amz-meta-latchkey-writes``, decimal,
   missing = 0). Present without a readable mark:
   :class:`~latchkey.fence.Unfenced`, never overwritten;
2. mark >= token: :class:`~latchkey.fence.FencedOut`, nothing written;
3. ``PUT`` the body ``latchkey-fence/1 <16 hex>\\n`` + payload, the token as
   the new mark and the count + 1, with ``If-Match: <that ETag>`` (or
   ``If-None-Match: *`` when there was no object);
4. ``2xx``: :class:`~latchkey.fence.Applied` with the count written as its
   version; ``412`` (or ``404``: the object went away): someone wrote in
   between, back to 1; ``409`` (a concurrent conditional write): back to 1
   after a short jittered pause. After ``attempts`` rounds:
   :class:`~latchkey.fence.Retry`.

The mark is on the body's first line too because a single-part ETag is the
MD5 of the bytes, not of the metadata: a later holder writing the same
payload would otherwise leave the ETag unchanged (ABA).

Requests are signed with SigV4 by the standard library (no boto3 or
botocore needed) and sent with ``http.client``, which follows no redirect: a
``303`` never turns a conditional PUT into a GET that reads as written. A
store that accepts conditional headers and ignores them cannot fence:
:func:`probe_conditional_writes` (run by :meth:`S3Store.connect`) refuses it.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import random
import re
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import parse_qsl, urlsplit

from . import _sigv4
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
from ._sigv4 import Credentials

KIND = "s3"
MARK_HEADER = "x-amz-meta-latchkey-fence"
WRITES_HEADER = "x-amz-meta-latchkey-writes"
BODY_PREFIX = b"latchkey-fence/1 "
DEFAULT_ATTEMPTS = 8
PLAIN_ATTEMPTS = 8
DEFAULT_TIMEOUT = 30.0
#: A PUT is sent on a kept-alive connection only if it was used this recently
#: (an older one may be closing at the server's end).
IDLE_REUSE = 2.0

_RECORD_CHARS = re.compile(r"[A-Za-z0-9\-_.~/ ]*")

__all__ = [
    "BODY_PREFIX",
    "Credentials",
    "KIND",
    "MARK_HEADER",
    "NotHonoured",
    "S3Config",
    "S3Store",
    "WRITES_HEADER",
    "config_from_url",
    "fenced_body",
    "probe_conditional_writes",
]


@dataclasses.dataclass
class S3Config:
    """Where the records live and how to sign for them."""

    endpoint: str
    bucket: str
    credentials: Credentials
    prefix: str = ""
    region: str = "us-east-1"
    #: ``endpoint/bucket/key`` (local servers) rather than ``bucket.endpoint/key``.
    path_style: bool = True
    attempts: int = DEFAULT_ATTEMPTS
    #: Per request, in seconds.
    timeout: float = DEFAULT_TIMEOUT


@dataclasses.dataclass(frozen=True)
class ObjectHead:
    etag: str
    mark: Optional[Mark]
    #: The write count (``x-amz-meta-latchkey-writes``); 0 when it has none,
    #: None when it has one that is not a count below 2**63 (foreign data: a
    #: guarded write refuses the object rather than reuse a version).
    writes: Optional[int]


@dataclasses.dataclass(frozen=True)
class _Reply:
    status: int
    etag: Optional[str]
    mark: Optional[str]
    writes: Optional[str]
    body: bytes

    def code(self) -> Optional[str]:
        return _xml_field(self.body, "Code")


def _config_error(message: str) -> ValueError:
    return ValueError(f"s3 store configuration: {message}")


def config_from_url(url: str, env: Optional[Mapping[str, str]] = None) -> S3Config:
    """``s3://bucket[/prefix]?endpoint=http://127.0.0.1:9000&region=us-east-1``
    (optional ``path_style=true|false``, ``attempts=N``), as the Rust
    ``config_from_url``. Credentials come from ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY`` and optionally ``AWS_SESSION_TOKEN`` in ``env``
    (default: the process environment), never from the URL. Without
    ``endpoint``: AWS, virtual-hosted; with one: path-style unless
    ``path_style=false``."""
    env = os.environ if env is None else env
    if not url.startswith("s3://"):
        raise _config_error("the URL's scheme must be s3://")
    parts = urlsplit(url)
    if "@" in parts.netloc:
        # Not echoed: it may hold a secret.
        raise _config_error("credentials in the URL are refused: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    bucket = parts.netloc
    if not bucket:
        raise _config_error("s3://<bucket>/… names no bucket")
    prefix = parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    endpoint = region = path_style = attempts = None
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "endpoint":
            endpoint = value.rstrip("/")
        elif key == "region":
            region = value
        elif key == "path_style":
            if value not in ("true", "false"):
                raise _config_error("path_style must be true or false")
            path_style = value == "true"
        elif key == "attempts":
            if not value.isdigit() or int(value) < 1:
                raise _config_error("attempts must be a positive number")
            attempts = int(value)
        else:
            raise _config_error(f"unknown parameter {key!r}")
    region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    if path_style is None:
        path_style = endpoint is not None
    endpoint = endpoint or f"https://s3.{region}.amazonaws.com"
    access_key = env.get("AWS_ACCESS_KEY_ID") or ""
    secret_key = env.get("AWS_SECRET_ACCESS_KEY") or ""
    if not access_key:
        raise _config_error("AWS_ACCESS_KEY_ID is not set")
    if not secret_key:
        raise _config_error("AWS_SECRET_ACCESS_KEY is not set")
    return S3Config(
        endpoint=endpoint,
        bucket=bucket,
        credentials=Credentials(access_key, secret_key, env.get("AWS_SESSION_TOKEN") or None),
        prefix=prefix,
        region=region,
        path_style=path_style,
        attempts=attempts or DEFAULT_ATTEMPTS,
    )


def fenced_body(mark: Mark, payload: bytes) -> bytes:
    """The stored bytes of a fenced write: the fence line, then the payload."""
    return BODY_PREFIX + mark.to_hex().encode() + b"\n" + payload


def _split_body(mark: Mark, body: bytes) -> Optional[bytes]:
    header = fenced_body(mark, b"")
    return body[len(header) :] if body.startswith(header) else None


def _xml_field(body: bytes, tag: str) -> Optional[str]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    start += len(tag) + 2
    end = text.find(f"</{tag}>", start)
    value = text[start:end].strip() if end >= 0 else ""
    return value or None


def check_record(record: str) -> None:
    """Record names become object keys under the prefix: limited to
    characters every S3-compatible server signs alike, and no empty name or
    ``.``/``..`` segment (which HTTP clients resolve, leaving the prefix)."""
    bad = next((c for c in record if not _RECORD_CHARS.fullmatch(c)), None)
    if bad is not None:
        raise ValueError(
            f"record name {record!r} has {bad!r}: S3 record names are limited to letters, digits, "
            "'-', '_', '.', '~', '/' and spaces (choose another name)"
        )
    if not record or any(seg in (".", "..") for seg in record.split("/")):
        raise ValueError(f"record name {record!r} is empty or has a . or .. segment")


def check_names(config: S3Config) -> None:
    """The bucket, region and prefix become parts of the request's host and
    path: anything but the characters those names use is refused, so that no
    name can move a signed request to another host or outside the prefix."""
    bucket, region = config.bucket, config.region
    if not re.fullmatch(r"[A-Za-z0-9._\-]{1,63}", bucket or ""):
        raise _config_error("the bucket name must be 1 to 63 letters, digits, '.', '-' or '_'")
    if not re.fullmatch(r"[a-z0-9\-]{1,32}", region or ""):
        raise _config_error("the region must be 1 to 32 lower-case letters, digits or '-' (e.g. us-east-1)")
    prefix = config.prefix.rstrip("/")
    if prefix:
        try:
            check_record(prefix)
        except ValueError:
            raise _config_error(
                "the prefix is limited to letters, digits, '-', '_', '.', '~', '/' and spaces, "
                "without empty, . or .. segments"
            ) from None
        if "" in prefix.split("/") or config.prefix.startswith("/"):
            raise _config_error("the prefix has an empty segment ('//')")


class S3Store(FencedStore):
    """A fenced record store on one bucket (and prefix) of an S3-compatible
    store. Thread-safe: each thread keeps its own HTTP connection."""

    kind = KIND

    def __init__(self, config: S3Config) -> None:
        check_names(config)
        parts = urlsplit(config.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _config_error("endpoint must be http(s)://host[:port]")
        # Credentials go by environment only, and an endpoint has no path,
        # query or fragment (as the Rust adapter). Not echoed: it may hold a
        # secret.
        if parts.username is not None or parts.password is not None or parts.query or parts.fragment or parts.path not in ("", "/"):
            raise _config_error(
                "the endpoint must be http(s)://host[:port] without a path, user, password, query or "
                "fragment (credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            )
        try:
            port = parts.port
        except ValueError:
            raise _config_error("the endpoint's port is not a number") from None
        # A prefix names a "directory": `fences` and record `-x` must not
        # make `fences-x`.
        if config.prefix and not config.prefix.endswith("/"):
            config = dataclasses.replace(config, prefix=config.prefix + "/")
        self.config = config
        self._https = parts.scheme == "https"
        host = parts.hostname if config.path_style else f"{config.bucket}.{parts.hostname}"
        self._host = host
        self._port = port
        self._host_header = f"{host}:{port}" if port is not None else host
        self._base_path = parts.path.rstrip("/")
        self._local = threading.local()

    @classmethod
    def connect(cls, url: str, *, probe: bool = True, create_bucket: bool = False) -> "S3Store":
        """A store from an ``s3://`` URL (:func:`config_from_url`). With
        ``create_bucket``, the bucket is created if missing. With ``probe``
        (the default) the store must enforce conditional writes
        (:func:`probe_conditional_writes`) or :class:`NotHonoured` is raised."""
        store = cls(config_from_url(url))
        if create_bucket:
            store.create_bucket()
        if probe:
            probe_conditional_writes(store)
        return store

    def __repr__(self) -> str:
        c = self.config
        return f"<S3Store endpoint={c.endpoint!r} bucket={c.bucket!r} prefix={c.prefix!r}>"

    def caveats(self) -> List[str]:
        return [
            "an object lifecycle rule that expires fenced objects removes their marks with them, and a "
            "stale write then creates the object anew: keep expiration rules off the fenced prefix"
        ]

    def key(self, record: str) -> str:
        """The object key of ``record``."""
        return f"{self.config.prefix}{record}"

    def close(self) -> None:
        """Closes this thread's connection (each thread keeps its own)."""
        self._drop_connection()

    def _check_record(self, record: str) -> None:
        check_record(record)

    # --- requests -----------------------------------------------------------

    def _connection(self, fresh: bool) -> http.client.HTTPConnection:
        """This thread's connection, connected. With ``fresh``, one that has
        not sat idle (a write is never sent on a connection the server may be
        closing)."""
        cached = getattr(self._local, "conn", None)
        if cached is not None:
            conn, used = cached
            if conn.sock is not None and not (fresh and time.monotonic() - used > IDLE_REUSE):
                return conn
            self._drop_connection()
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.config.timeout)
        conn.connect()  # raises before anything is sent
        self._local.conn = (conn, time.monotonic())
        return conn

    def _drop_connection(self) -> None:
        cached = getattr(self._local, "conn", None)
        if cached is not None:
            cached[0].close()
            self._local.conn = None

    def _send(
        self,
        method: str,
        record: Optional[str],
        extra: Sequence[Tuple[str, str]],
        body: bytes,
        op: str,
        secrets: Sequence[int],
    ) -> _Reply:
        path = self._base_path
        if self.config.path_style:
            path += "/" + _sigv4.uri_encode(self.config.bucket, False)
        path += "/"
        if record is not None:
            check_record(record)
            path += _sigv4.uri_encode(self.key(record), True)
        payload_sha = _sigv4.sha256_hex(body)
        date = _sigv4.amz_date()
        headers: List[Tuple[str, str]] = [
            ("host", self._host_header),
            ("x-amz-content-sha256", payload_sha),
            ("x-amz-date", date),
        ]
        if body:
            headers.append(("content-type", "application/octet-stream"))
        if self.config.credentials.session_token:
            headers.append(("x-amz-security-token", self.config.credentials.session_token))
        headers.extend(extra)
        auth = _sigv4.authorization(
            self.config.credentials, method, path, headers, payload_sha, date, self.config.region
        )
        send: Dict[str, str] = {name: value for name, value in headers}
        send["authorization"] = auth
        # A PUT that was sent and got no answer may have landed: it is not
        # sent again (the caller reads the record); reads are, once.
        idempotent = method != "PUT"
        for attempt in range(2):
            try:
                conn = self._connection(fresh=not idempotent)
            except (OSError, http.client.HTTPException) as e:
                err = FenceError.scrubbed(KIND, op, f"cannot connect: {type(e).__name__}: {e}", True, secrets)
                break
            try:
                conn.request(method, path, body=body if method in ("PUT", "POST") else None, headers=send)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self._drop_connection()
                if idempotent and attempt == 0:
                    continue
                why = f"{type(e).__name__}: {e}"
                if not idempotent:
                    why = (
                        f"the connection broke after the request was sent ({why}): the write may have landed; "
                        "read the record (a mark equal to your token is your own write)"
                    )
                err = FenceError.scrubbed(KIND, op, why, True, secrets)
                break
            self._local.conn = (conn, time.monotonic())
            if resp.will_close:
                self._drop_connection()
            return _Reply(
                status=resp.status,
                etag=resp.getheader("etag"),
                mark=resp.getheader(MARK_HEADER),
                writes=resp.getheader(WRITES_HEADER),
                body=data,
            )
        raise err

    @staticmethod
    def _error(reply: _Reply, op: str, secrets: Sequence[int]) -> FenceError:
        message = f"HTTP {reply.status}"
        code = reply.code()
        if code:
            message += f" {code}"
        text = _xml_field(reply.body, "Message")
        if text:
            message += f": {text}"
        if 300 <= reply.status < 400:
            message += " (a redirect: not followed; point the endpoint at the bucket's region)"
        # Throttling and server-side trouble may pass; refusals do not.
        transient = reply.status >= 500 or reply.status in (408, 429)
        return FenceError.scrubbed(KIND, op, message, transient, secrets)

    def create_bucket(self) -> None:
        """Creates the bucket; one that exists already (and is ours) is fine."""
        body = b""
        if self.config.region != "us-east-1":
            body = (
                '<CreateBucketConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<LocationConstraint>{self.config.region}</LocationConstraint></CreateBucketConfiguration>"
            ).encode()
        op = "creating the bucket"
        reply = self._send("PUT", None, (), body, op, ())
        if reply.status == 200 or (reply.status == 409 and reply.code() == "BucketAlreadyOwnedByYou"):
            return
        raise self._error(reply, op, ())

    def head(self, record: str) -> Optional[ObjectHead]:
        """``HEAD`` of ``record``'s object, or ``None`` when it does not exist."""
        reply = self._send("HEAD", record, (), b"", "HEAD", ())
        if reply.status == 404:
            return None
        if reply.status != 200:
            raise self._error(reply, "HEAD", ())
        if not reply.etag:
            raise FenceError(KIND, "HEAD", "HEAD answered without an ETag")
        # Missing (or unreadable, as the Rust crate reads it): 0.
        if reply.writes is None:
            writes: Optional[int] = 0
        elif reply.writes.isascii() and reply.writes.isdigit() and int(reply.writes) < 1 << 63:
            writes = int(reply.writes)
        else:
            writes = None
        return ObjectHead(reply.etag, Mark.from_hex(reply.mark) if reply.mark else None, writes)

    def put(
        self,
        record: str,
        precondition: Tuple[str, str],
        mark: Mark,
        writes: int,
        payload: bytes,
    ) -> Tuple[str, Optional[str]]:
        """One ``PUT`` of a fenced body under ``precondition`` (``("", "")``,
        ``("if-match", etag)`` or ``("if-none-match", "*")``): ``("written",
        etag)``, ``("precondition-failed", None)`` (412), ``("conflict",
        None)`` (409) or ``("not-found", None)`` (404 to an If-Match)."""
        headers = [(MARK_HEADER, mark.to_hex()), (WRITES_HEADER, str(writes))]
        if precondition[0]:
            headers.append(precondition)
        secrets = (mark.value,)
        reply = self._send("PUT", record, headers, fenced_body(mark, payload), "PUT", secrets)
        if 200 <= reply.status < 300:
            return "written", reply.etag
        if reply.status == 412:
            return "precondition-failed", None
        if reply.status == 409:
            return "conflict", None
        if reply.status == 404 and precondition[0] == "if-match":
            return "not-found", None
        raise self._error(reply, "PUT", secrets)

    def put_unfenced(self, record: str, payload: bytes) -> None:
        """A ``PUT`` of ``payload`` as it is, without a mark or the fence
        line: what any other S3 client writes. Guarded writes refuse it."""
        reply = self._send("PUT", record, (), bytes(payload), "PUT", ())
        if not 200 <= reply.status < 300:
            raise self._error(reply, "PUT", ())

    def delete(self, record: str) -> None:
        """``DELETE`` of ``record``'s object (unconditional; missing is fine)."""
        reply = self._send("DELETE", record, (), b"", "DELETE", ())
        if not (200 <= reply.status < 300 or reply.status == 404):
            raise self._error(reply, "DELETE", ())

    # --- the fence ----------------------------------------------------------

    @staticmethod
    def _unfenced(record: str, why: str) -> Unfenced:
        return Unfenced(KIND, record, f"{why} in {MARK_HEADER}; refusing to overwrite an object no fence wrote")

    def _fenced_head(self, record: str, head: ObjectHead) -> Tuple[Mark, int]:
        if head.mark is None:
            raise self._unfenced(record, "no readable mark")
        if head.writes is None:
            raise Unfenced(
                KIND, record, f"{WRITES_HEADER} is not a write count; refusing to overwrite an object no fence wrote"
            )
        return head.mark, head.writes

    def _guarded_write(self, record: str, token: int, payload: bytes) -> Guarded:
        new_mark = Mark(token)
        for attempt in range(max(self.config.attempts, 1)):
            head = self.head(record)
            if head is None:
                precondition, writes = ("if-none-match", "*"), 0
            else:
                mark, writes = self._fenced_head(record, head)
                if mark >= new_mark:
                    return FencedOut(mark)
                precondition = ("if-match", head.etag)
            answer, _ = self.put(record, precondition, new_mark, writes + 1, payload)
            if answer == "written":
                return Applied(version=writes + 1)
            if answer == "conflict":
                time.sleep((5 * (attempt + 1) + random.randrange(10)) / 1000)
            # 412 / 404: another writer changed (or removed) the object since the HEAD.
        return Retry()

    def _read(self, record: str) -> Optional[Record]:
        reply = self._send("GET", record, (), b"", "GET", ())
        if reply.status == 404:
            return None
        if reply.status != 200:
            raise self._error(reply, "GET", ())
        mark = Mark.from_hex(reply.mark) if reply.mark else None
        if mark is None:
            raise self._unfenced(record, "no readable mark")
        payload = _split_body(mark, reply.body)
        if payload is None:
            raise self._unfenced(
                record,
                "its body does not begin with the fence line its metadata names "
                "(written by something other than this fence)",
            )
        return Record(mark, payload)

    def _plain_write(self, record: str, payload: bytes) -> None:
        # What a naive writer does: no fence, but the record's mark kept as it
        # is. The PUT is conditional on the object the HEAD saw, so a guarded
        # write that landed in between is never undone.
        for _ in range(PLAIN_ATTEMPTS):
            head = self.head(record)
            if head is None:
                precondition, mark, writes = ("if-none-match", "*"), Mark(0), 0
            else:
                mark, writes = self._fenced_head(record, head)
                precondition = ("if-match", head.etag)
            answer, _ = self.put(record, precondition, mark, writes + 1, payload)
            if answer == "written":
                return
        raise FenceError(
            KIND,
            "plain PUT",
            f"the object changed under each of {PLAIN_ATTEMPTS} attempts; nothing was written",
            True,
        )


class NotHonoured(FenceError):
    """The store cannot be certified for fencing: it ignores conditional
    writes (or drops the mark). The text says what was seen and what to do."""

    def __init__(self, endpoint: str, why: str) -> None:
        super().__init__(KIND, "probing conditional writes", f"{endpoint} {why}", False)
        self.endpoint = endpoint


def probe_conditional_writes(store: S3Store) -> None:
    """Certifies ``store`` for fencing, on a scratch object under its prefix:
    a create with ``If-None-Match: *`` must land, an unconditional overwrite
    must change the ETag, a PUT with the stale ETag in ``If-Match`` and one
    with ``If-None-Match: *`` over the object must both be refused (412), a
    PUT with the current ETag must land, and the mark must come back on
    ``HEAD``. Raises :class:`NotHonoured` otherwise. The scratch object is
    deleted after (best effort)."""
    record = f".latchkey-probe-{random.getrandbits(64):016x}"
    try:
        _probe(store, record)
    finally:
        try:
            store.delete(record)
        except FenceError:
            pass  # a leftover probe object is harmless


def _probe(store: S3Store, record: str) -> None:
    endpoint = store.config.endpoint
    mark = Mark(0)
    use = (
        "Use a store that enforces conditional writes on PutObject (docs/fencing-s3.md), "
        "or fence through another store"
    )

    def refused(step: str, answer: str) -> NotHonoured:
        return NotHonoured(
            endpoint,
            f"refused a conditional PUT whose precondition held ({step}: {answer}): it does not "
            "implement conditional writes, so it cannot be fenced",
        )

    answer, first = store.put(record, ("if-none-match", "*"), mark, 1, b"probe 1")
    if answer != "written":
        raise refused("create with If-None-Match: *", answer)
    answer, second = store.put(record, ("", ""), mark, 2, b"probe 2")
    if answer != "written":
        raise refused("unconditional overwrite", answer)
    if not first or not second:
        raise FenceError(KIND, "probe", "a PUT answered without an ETag")
    if first == second:
        raise NotHonoured(
            endpoint,
            "kept the same ETag after the object's bytes changed: If-Match cannot tell two versions "
            "apart, so it cannot be fenced",
        )
    answer, _ = store.put(record, ("if-match", first), mark, 3, b"probe 3")
    if answer == "written":
        raise NotHonoured(
            endpoint,
            f"accepted a PUT whose If-Match named a stale ETag: it ignores If-Match, so writes to it "
            f"can never be declared fenced. {use}",
        )
    if answer != "precondition-failed":
        raise refused("If-Match with a stale ETag", answer)
    answer, _ = store.put(record, ("if-none-match", "*"), mark, 3, b"probe 4")
    if answer == "written":
        raise NotHonoured(
            endpoint,
            "accepted a PUT with If-None-Match: * over an existing object: it ignores If-None-Match, "
            f"so writes to it can never be declared fenced (two holders could both create a record). {use}",
        )
    if answer != "precondition-failed":
        raise refused("If-None-Match: * over an existing object", answer)
    answer, _ = store.put(record, ("if-match", second), mark, 3, b"probe 5")
    if answer != "written":
        raise refused("If-Match with the current ETag", answer)
    head = store.head(record)
    if head is None or head.mark != mark:
        raise NotHonoured(
            endpoint,
            f"did not return the {MARK_HEADER} metadata it was given: the mark cannot live there, "
            "so it cannot be fenced",
        )
