"""The client handle (the mTLS channel and the sessions it keeps, one per TTL)
and the guard that is a hold."""

from __future__ import annotations

import logging
import math
import os
import socket
import ssl
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, Optional

import grpc

from ._errors import (
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    FenceReason,
    Fenced,
    Held,
    LatchkeyError,
    NotHeld,
    ProtocolError,
    Refused,
    Unavailable,
    UpgradeRefused,
    WaitTimeout,
    from_rpc_error,
)
from . import _election
from ._election import Candidate, ElectionTable, Leader, Leadership, LostCallback, Observation
from ._holds import LAST, NESTED, NOT_HELD, OTHER_MODE, OTHER_THREAD, OUTERMOST, REENTERED, Hold
from ._liveness import keepalive_interval
from ._session import FenceCallback, Session, SessionDead
from ._token import FencingToken
from .election.v1 import election_pb2_grpc
from .lock.v1 import lock_pb2, lock_pb2_grpc

log = logging.getLogger("latchkey")

_now = time.monotonic

#: ``wait=FOREVER`` (and ``lock(timeout=None)``): wait until granted.
FOREVER = math.inf

#: The longest one Acquire waits at the arbiter: below the edge's route
#: timeout (90 s in dev-up and deploy/, Envoy's "downstream duration
#: timeout") and deploy/'s ``--max-wait-seconds`` (60 s). A longer wait asks
#: again, on the same session, until its deadline (see ``acquire``).
WAIT_ASK = 50.0

#: How often the SVID files are looked at for a rotation (at most).
TLS_CHECK_EVERY = 1.0
#: Channels of earlier SVIDs kept open for the streams still on them.
MAX_RETIRED_CHANNELS = 2

#: The environment latchctl reads its connection from (``Client.from_env``).
ENV_ENDPOINT = "LATCHKEY_ENDPOINT"
ENV_CA = "LATCHKEY_CA"
ENV_CERT = "LATCHKEY_CERT"
ENV_KEY = "LATCHKEY_KEY"
ENV_TLS_DOMAIN = "LATCHKEY_TLS_DOMAIN"
#: latchctl's default endpoint: the edge of the dev stack.
DEFAULT_ENDPOINT = "https://127.0.0.1:8443"


def _ignore(_reason: FenceReason) -> None:
    pass


@dataclass(frozen=True)
class Holder:
    """Who holds a key. Inspect never returns a token: the holder has it from its grant."""

    identity: str
    #: The holder's session, shown only to the holder's own identity and to operators; 0 otherwise.
    session_id: int
    lock_class: str
    acquired_at_unix_ms: int
    annotations: Dict[str, str] = field(default_factory=dict)
    #: The slot held, for a semaphore's holder (in ``Inspection.slot_holders``).
    slot: Optional[int] = None
    #: A shared holder (in ``Inspection.shared_holders``).
    shared: bool = False


@dataclass(frozen=True)
class Inspection:
    key: str
    #: None when the key is free.
    holder: Optional[Holder]
    #: Waiters queued on the arbiter that answered.
    waiters: int
    #: A semaphore's holders, one per held slot, in slot order (empty for a
    #: lock: a key is one kind at a time).
    slot_holders: List[Holder] = field(default_factory=list)
    #: A lock's shared holders, one per session (empty while it is held
    #: exclusively or not at all).
    shared_holders: List[Holder] = field(default_factory=list)


def _read(what: str, path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:
        raise ConfigError(f"reading {what} {path}: {error.strerror or error}") from None


def _left(deadline: float) -> Optional[float]:
    """Seconds until `deadline` for a thread wait: None for no end
    (``FOREVER``), and never more than a thread wait takes."""
    if math.isinf(deadline):
        return None
    return max(0.0, min(deadline - _now(), threading.TIMEOUT_MAX))


def _signature(paths) -> tuple:
    """What tells that a file was replaced or rewritten (a rotation)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def _check_pair(cert, key) -> None:
    """Raises ConfigError unless `key` is the private key of `cert` (no network)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # An encrypted key fails here instead of asking a terminal for its passphrase.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(f"the SVID certificate {cert} and key {key} are not a usable pair: {error}") from None


def _target(endpoint: str) -> str:
    if endpoint.startswith("http://"):
        raise ConfigError("endpoint: Latchkey is reached over mTLS only: use host:port or https://host:port")
    target = endpoint[len("https://"):] if endpoint.startswith("https://") else endpoint
    if not target or "/" in target.rstrip("/"):
        raise ConfigError(f"endpoint: {endpoint!r} is not host:port")
    return target.rstrip("/")


def _tls_preflight(target: str, ca: bytes, cert, key, server_name: str, timeout: float) -> None:
    """Names a TLS setup that cannot work before gRPC would wait it out.

    gRPC reports a failed handshake only as a channel that never becomes
    ready (``connect_timeout`` later, with no cause). So the client checks
    first, with Python's own TLS: the key must be the certificate's (no
    network), and one handshake with the endpoint must verify the server's
    certificate against ``ca`` for ``server_name`` and be accepted. A
    :class:`ConfigError` names what is wrong; an endpoint that cannot be
    reached at all is left to gRPC's connect (retrying may help there).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    try:
        context.load_verify_locations(cadata=ca.decode("utf-8", "replace"))
    except (ssl.SSLError, ValueError) as error:
        raise ConfigError(f"the CA bundle holds no usable certificate: {error}") from None
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as error:
        if "KEY_VALUES_MISMATCH" in str(error):
            raise ConfigError(
                f"the SVID key {key} is not the key of the SVID certificate {cert}: "
                "pass the key that was issued with the certificate"
            ) from None
        raise ConfigError(f"the SVID certificate {cert} or key {key} cannot be used: {error}") from None
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError):
        return
    try:
        with context.wrap_socket(raw, server_hostname=server_name or host) as tls:
            # TLS 1.3: the server judges the client's certificate after the
            # client's Finished; a read brings its alert back, if it sends one.
            tls.settimeout(min(timeout, 0.5))
            try:
                tls.recv(1)
            except (socket.timeout, ssl.SSLWantReadError):
                pass
    except ssl.SSLCertVerificationError as error:
        reason = error.verify_message or str(error)
        if "hostname" in reason.lower() or "ip address mismatch" in reason.lower():
            raise ConfigError(
                f"the server's certificate at {target} does not name {server_name or host!r} ({reason}): "
                "pass server_name= a name the certificate has"
            ) from None
        raise ConfigError(
            f"the server's certificate at {target} does not verify against the CA bundle ({reason}): "
            "pass the trust bundle of the server's trust domain as ca="
        ) from None
    except ssl.SSLError as error:
        text = str(error)
        if "ALERT" in text.upper() or "CERTIFICATE" in text.upper():
            raise ConfigError(
                f"the server at {target} refused this client's TLS setup ({text}): "
                "check that cert= is an SVID the server's trust domain issued"
            ) from None
    except OSError:
        # Reset or timed out: the network's, not the configuration's.
        return


class Client:
    """A connection to the arbiter's Envoy under this workload's SPIFFE identity.

    The identity is the X.509 SVID presented over mTLS (``cert`` and ``key``,
    checked against the trust bundle ``ca``) and nothing else: the client sends
    no identity header. Thread-safe; use one per process and close it (or use
    it as a context manager) to end its sessions.
    """

    DEFAULT_CONNECT_TIMEOUT = 5.0
    DEFAULT_REQUEST_TIMEOUT = 10.0
    #: The dev stack's election class (policies/dev/classes/elections.toml).
    DEFAULT_ELECTION_CLASS = "election"

    @classmethod
    def from_env(cls, **options) -> "Client":
        """A client configured as latchctl is, from the environment:
        ``LATCHKEY_ENDPOINT`` (default the dev stack's edge,
        ``https://127.0.0.1:8443``), ``LATCHKEY_CA``, ``LATCHKEY_CERT`` and
        ``LATCHKEY_KEY`` (file paths, required) and ``LATCHKEY_TLS_DOMAIN``
        (the name the edge's certificate must have; default ``localhost``).
        Keyword arguments are passed on and win over the environment."""
        env = os.environ
        named = {ENV_CA: "ca", ENV_CERT: "cert", ENV_KEY: "key"}
        missing = [v for v, name in named.items() if name not in options and not env.get(v)]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} unset: set the trust bundle, SVID and key paths as for latchctl "
                "(or pass ca=, cert=, key=)"
            )
        endpoint = options.pop("endpoint", None) or env.get(ENV_ENDPOINT) or DEFAULT_ENDPOINT
        for variable, name in named.items():
            options.setdefault(name, env.get(variable, ""))
        if env.get(ENV_TLS_DOMAIN):
            options.setdefault("server_name", env[ENV_TLS_DOMAIN])
        return cls(endpoint, **options)

    def __init__(
        self,
        endpoint: str,
        *,
        ca: str,
        cert: str,
        key: str,
        server_name: str = "localhost",
        default_class: Optional[str] = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        instance: Optional[str] = None,
        default_election_class: str = DEFAULT_ELECTION_CLASS,
        observe_leaderships: bool = True,
    ) -> None:
        target = _target(endpoint)
        # How this client names itself on every Acquire: the arbiter answers
        # LEAK only for a key held by the same identity AND the same instance
        # under another session (a hold this process forgot); replicas that
        # share one SPIFFE ID name different instances and simply contend.
        # A diagnostic the client asserts about itself, never an identity.
        self._instance = _clean_instance(instance if instance is not None else default_instance())
        # Before the files are read: a rotation while connecting is taken up later.
        signature_at_start = _signature((ca, cert, key))
        ca_pem = _read("CA bundle", ca)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca_pem,
            private_key=_read("SVID key", key),
            certificate_chain=_read("SVID certificate", cert),
        )
        # A TLS setup that cannot work fails here, at once and with its
        # cause; gRPC would wait connect_timeout and say only "could not
        # connect". One connect_timeout covers both: an endpoint that does
        # not answer is Unavailable after it, not after two.
        connect_by = time.monotonic() + connect_timeout
        _tls_preflight(target, ca_pem, cert, key, server_name, connect_timeout)
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        self._endpoint = endpoint
        self._default_class = default_class
        self._request_timeout = request_timeout
        self._channel = grpc.secure_channel(target, credentials, options=options)
        try:
            left = max(connect_by - time.monotonic(), 0.1)
            grpc.channel_ready_future(self._channel).result(timeout=left)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise Unavailable(
                grpc.StatusCode.UNAVAILABLE, "", f"could not connect to {endpoint} within {connect_timeout:g} s (mTLS)"
            ) from None
        self._stubs = (
            lock_pb2_grpc.LockStub(self._channel),
            election_pb2_grpc.ElectionServiceStub(self._channel),
        )
        # SVID rotation (SPIRE's SVIDs last an hour): the files are looked at
        # at most once a second, from the calls themselves; a change that
        # forms a usable pair makes a new channel for every later call and
        # stream. Streams open on an older channel go on there.
        self._target = target
        self._channel_options = options
        self._tls_paths = (ca, cert, key)
        self._tls_signature = signature_at_start
        self._tls_seen: Optional[tuple] = None
        self._tls_lock = threading.Lock()
        self._next_tls_check = _now() + TLS_CHECK_EVERY
        self._retired: List[grpc.Channel] = []
        #: How many times the SVID files were reloaded.
        self.svid_reloads = 0
        self._default_election_class = default_election_class
        # One Observe stream per leadership: how a leadership that ends at
        # the arbiter while its session lives (forced out, an epoch advance)
        # is lost at once rather than at the next call about it.
        self._observe_leaderships = observe_leaderships
        self._elections = ElectionTable()
        self._observations: "weakref.WeakSet[Observation]" = weakref.WeakSet()
        self._lock = threading.Lock()
        # One OpenSession at a time, so two first acquires of a class cannot
        # open two leases for one TTL.
        self._opening = threading.Lock()
        self._sessions: Dict[int, Session] = {}
        self._by_class: Dict[str, int] = {}
        self._closed = False

    # -- sessions -----------------------------------------------------------

    def open_session(self, lock_class: Optional[str] = None) -> Session:
        """A session with the class's TTL: one this client already has if the
        arbiter finds one that fits, else a new lease whose keepalive starts now."""
        lock_class = self._class(lock_class)
        with self._opening:
            with self._lock:
                self._prune()
                reuse = sorted(self._sessions)
            opened_at = _now()
            reply = self._call(
                self._stub.OpenSession,
                lock_pb2.OpenSessionRequest(reuse_session_ids=reuse, **{"class": lock_class}),
            )
            if reply.ttl_seconds == 0:
                raise ProtocolError("malformed reply to OpenSession: zero TTL")
            with self._lock:
                session = self._sessions.get(reply.session_id)
                if session is None or session.is_fenced:
                    session = Session(
                        lambda: self._stub,
                        reply.session_id,
                        float(reply.ttl_seconds),
                        keepalive_interval(reply.ttl_seconds, reply.keepalive_interval_ms),
                        opened_at,
                        reply.reused,
                        self._request_timeout,
                    )
                    self._sessions[reply.session_id] = session
                    log.debug("session %d opened (ttl %d s)", reply.session_id, reply.ttl_seconds)
                self._by_class[lock_class] = reply.session_id
                return session

    def _session_for_class(self, lock_class: str) -> Session:
        with self._lock:
            session = self._sessions.get(self._by_class.get(lock_class, 0))
            if session is not None and not session.is_fenced:
                return session
        return self.open_session(lock_class)

    def _forget_class(self, lock_class: str, session_id: int) -> None:
        with self._lock:
            if self._by_class.get(lock_class) == session_id:
                del self._by_class[lock_class]

    def _prune(self) -> None:
        for sid in [sid for sid, s in self._sessions.items() if s.is_fenced]:
            del self._sessions[sid]
        self._by_class = {c: sid for c, sid in self._by_class.items() if sid in self._sessions}

    def _class(self, lock_class: Optional[str]) -> str:
        chosen = lock_class or self._default_class
        if not chosen:
            raise ConfigError("no lock class: pass lock_class or set Client(default_class=...)")
        return chosen

    # -- locks --------------------------------------------------------------

    def acquire(
        self,
        key: str,
        lock_class: Optional[str] = None,
        *,
        wait: Optional[float] = None,
        on_fence: Optional[FenceCallback] = None,
        metadata: Optional[Mapping[str, str]] = None,
        session: Optional[Session] = None,
        shared: bool = False,
        _stop: Optional[threading.Event] = None,
    ) -> "LockGuard":
        """Acquires `key` under `lock_class` (the client's default class if omitted).

        ``wait=None`` is a try-lock: a held key raises :class:`Held` at once.
        ``wait=seconds`` queues at the arbiter (FIFO per key) until granted or
        until that deadline (:class:`WaitTimeout` / :class:`DeadlineExceeded`);
        ``wait=latchkey.FOREVER`` until granted. One Acquire waits at most
        :data:`WAIT_ASK` (50 s: below the edge's route timeout and the
        arbiter's maximum wait); a longer wait asks again on the same session
        until its deadline. Each ask joins the key's queue at its tail, so
        under constant contention a waiter older than one ask can be
        overtaken by one that came later.
        A key this thread already holds on the session returns another guard
        of the same hold at once, without a call (ADR-13). A key another
        thread of this client holds is held as for any other caller: a
        try-lock raises :class:`Held`; a waiting acquire waits (here, not at
        the arbiter) until that thread's hold ends, then queues at the arbiter.

        ``shared=True`` asks for a shared hold: many sessions hold the key
        shared at once, never beside an exclusive holder (``guard.shared``).
        A key this thread holds in the other mode is refused without a call:
        :class:`UpgradeRefused` for an exclusive request of a shared hold,
        :class:`FailedPrecondition` (``BAD_REQUEST``) for a shared request of
        an exclusive one. Release first, then acquire in the other mode (or
        turn a held exclusive lock shared with :meth:`LockGuard.downgrade`). A
        semaphore class takes no shared requests (:class:`InvalidArgument`).

        ``on_fence(reason)`` is called once if the hold is lost while this guard
        exists: by then another holder may have the key, so stop touching the
        resource. It runs on a background thread: keep it short.
        """
        if self._closed:
            raise ConfigError("the client is closed")
        lock_class = self._class(lock_class)
        callback = on_fence or _ignore
        deadline = None if wait is None else _now() + wait
        explicit = session is not None
        current = session if session is not None else self._session_for_class(lock_class)
        retried = False
        while True:
            try:
                return self._acquire_on(current, key, lock_class, deadline, callback, metadata, shared, _stop)
            except SessionDead:
                # The class's session died before this acquire sent anything
                # (e.g. while it waited for another thread's hold): once, on
                # a live one.
                if explicit or retried:
                    raise
                self._forget_class(lock_class, current.id)
                current = self._session_for_class(lock_class)
                retried = True
            except Refused as error:
                stale = error.reason in ("SESSION_EXPIRED", "SESSION_CLASS_MISMATCH")
                if explicit or retried or not stale:
                    raise
                # The class's session went away or its TTL changed since we
                # cached it: open (or be handed) the right one, once.
                if error.reason == "SESSION_EXPIRED":
                    current._fence(FenceReason.EXPIRED)
                self._forget_class(lock_class, current.id)
                current = self._session_for_class(lock_class)
                retried = True

    def lock(
        self,
        key: str,
        lock_class: Optional[str] = None,
        *,
        timeout: Optional[float] = 30.0,
        on_fence: Optional[FenceCallback] = None,
        metadata: Optional[Mapping[str, str]] = None,
        shared: bool = False,
    ) -> "_LockContext":
        """``with client.lock("demo/x") as guard:`` — a blocking acquire that
        waits up to `timeout` seconds for the key (``None``: until granted, as
        redis-py's and kazoo's locks do), released when the block ends.
        ``shared=True`` takes a shared hold (see :meth:`acquire`)."""
        wait = FOREVER if timeout is None else timeout
        return _LockContext(self, key, lock_class, wait, on_fence, metadata, shared)

    def _acquire_on(self, session, key, lock_class, deadline, on_fence, metadata, shared=False, stop=None) -> "LockGuard":
        while True:
            kind, value, guard_id = session._begin_acquire(key, on_fence, shared)
            if kind == REENTERED:
                return LockGuard(value, session, guard_id, self)
            if kind == OUTERMOST:
                break
            if kind == OTHER_MODE:
                # This thread holds the key in the other mode: one hold per
                # key and session, so no re-entry in another mode (as the
                # Rust client). Nothing is sent: the arbiter would refuse an
                # upgrade, and turn a shared request into a downgrade.
                message = (
                    f"this session holds {key!r} {'shared' if value.shared else 'exclusively'} already: "
                    "release it before acquiring it in the other mode"
                    + ("" if value.shared else " (or downgrade its guard: guard.downgrade())")
                )
                if value.shared:
                    raise UpgradeRefused(grpc.StatusCode.FAILED_PRECONDITION, "UPGRADE_REFUSED", message)
                raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "BAD_REQUEST", message)
            if kind == OTHER_THREAD:
                # Another thread of this client holds the key: re-entrancy is
                # per thread, so this one waits its turn (or is refused) as
                # another caller would. The arbiter cannot queue it (one
                # session, one instance), so it waits here for the hold to
                # leave, then asks the arbiter like anyone else.
                if deadline is None:
                    raise Held(grpc.StatusCode.ABORTED, "HELD", f"key {key!r} is held by another thread of this client")
                if not _election._wait(value, _left(deadline), stop):
                    raise WaitTimeout(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "WAIT_TIMEOUT",
                        f"timed out waiting for key {key!r}: another thread of this client still holds it",
                    )
                continue
            # Another thread's outermost acquire or final release of the key
            # on this session is in flight: wait for it to settle.
            limit = _left(deadline) if deadline is not None else self._request_timeout
            if (limit is not None and limit <= 0) or not _election._wait(value, limit, stop):
                raise DeadlineExceeded(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "", f"another acquire or release of {key} on this session is still in flight"
                )
        settled = False
        try:
            request = lock_pb2.AcquireRequest(
                key=key,
                session_id=session.id,
                wait=lock_pb2.WAIT_UNTIL_DEADLINE if deadline is not None else lock_pb2.WAIT_NONE,
                metadata=dict(metadata or {}),
                instance=self._instance,
                mode=lock_pb2.MODE_SHARED if shared else lock_pb2.MODE_EXCLUSIVE,
                **{"class": lock_class},
            )
            grant = self._ask(request, key, deadline, stop)
            if not grant.key:
                raise ProtocolError("malformed reply to Acquire: OK without a grant")
            if grant.session_id != session.id or grant.key != key:
                raise ProtocolError("malformed reply to Acquire: grant for another session or key")
            hold = Hold(key, grant.session_id, FencingToken(grant.token), grant.epoch, grant.revision)
            # Absent from stubs generated before the field existed.
            hold.unprotected = bool(getattr(grant, "unprotected", False))
            if grant.HasField("slot"):
                hold.slot = grant.slot
                if grant.HasField("permits"):
                    hold.permits = grant.permits
            # The mode granted (a downgrade of this session's exclusive hold
            # is granted shared, with a new token).
            hold.shared = grant.mode == lock_pb2.MODE_SHARED
            hold.lock_class = lock_class
            hold.metadata = dict(metadata or {})
            settled = True
            guard_id = session._granted(hold, on_fence)
        finally:
            if not settled:
                session._acquire_failed(key)
        log.debug("acquired %s%s (session %d, epoch %d)", key, " shared" if hold.shared else "", session.id, hold.epoch)
        return LockGuard(hold, session, guard_id, self)

    @property
    def _stub(self):
        self._maybe_reload()
        return self._stubs[0]

    @property
    def _election_stub(self):
        self._maybe_reload()
        return self._stubs[1]

    def _maybe_reload(self) -> None:
        """Takes up the SVID files again if they changed (looked at once a
        second at most): a rotated certificate is what the next call and
        the next stream present. A pair that does not match (a rotation
        half-written) is left for the next look."""
        now = _now()
        if now < self._next_tls_check or self._closed:
            return
        with self._tls_lock:
            if now < self._next_tls_check or self._closed:
                return
            self._next_tls_check = now + TLS_CHECK_EVERY
            signature = _signature(self._tls_paths)
            if signature == self._tls_signature:
                self._tls_seen = None
                return
            if signature != self._tls_seen:
                # Changed since the last look: maybe only half written yet.
                self._tls_seen = signature
                return
            ca, cert, key = self._tls_paths
            try:
                pems = (_read("CA bundle", ca), _read("SVID key", key), _read("SVID certificate", cert))
                _check_pair(cert, key)
            except ConfigError as error:
                log.debug("the SVID files changed but are not usable yet (%s); looking again", error)
                return
            if _signature(self._tls_paths) != signature:
                return  # changed while being read: the next look takes it
            credentials = grpc.ssl_channel_credentials(
                root_certificates=pems[0], private_key=pems[1], certificate_chain=pems[2]
            )
            channel = grpc.secure_channel(self._target, credentials, options=self._channel_options)
            self._retired.append(self._channel)
            self._channel = channel
            self._stubs = (
                lock_pb2_grpc.LockStub(channel),
                election_pb2_grpc.ElectionServiceStub(channel),
            )
            self._tls_signature = signature
            self.svid_reloads += 1
            # The oldest channels go: a stream still on one breaks and is
            # reopened (a session's within its TTL, without a fence).
            while len(self._retired) > MAX_RETIRED_CHANNELS:
                self._retired.pop(0).close()
            log.info("the SVID files changed: new calls and streams present the new certificate (%s)", cert)

    def _ask(self, request, key: str, deadline: Optional[float], stop: Optional[threading.Event] = None):
        """Sends Acquire until granted, refused, or `deadline` passes: one
        ask waits at most :data:`WAIT_ASK`. A wait cut short before the
        deadline (the arbiter's maximum wait, the edge's route timeout, this
        ask's own) asks again on the same session, at most once a second: a
        grant that landed as the ask ended is answered to it again, never a
        second hold. `stop` (set by another thread) cancels the call: the
        arbiter ends the wait with it (raises ``_election._Stopped``)."""
        while True:
            if deadline is None:
                return self._acquire_call(request, None, stop).grant
            started = _now()
            left = deadline - started
            ask = max(0.001, min(left, WAIT_ASK))
            try:
                return self._acquire_call(request, ask, stop).grant
            except (WaitTimeout, DeadlineExceeded) as error:
                if deadline - _now() <= 0.1:
                    raise
                log.debug("no grant of %s within one ask (%s); asking again", key, error.reason or error.code)
                pause = max(0.0, min(1.0 - (_now() - started), deadline - _now() - 0.1))
                if pause > 0 and stop is not None and stop.wait(pause):
                    raise _election._Stopped()
                if pause > 0 and stop is None:
                    time.sleep(pause)

    def _acquire_call(self, request, timeout: Optional[float], stop: Optional[threading.Event]):
        """One Acquire; with `stop`, cancelled when it is set."""
        if stop is None:
            return self._call(self._stub.Acquire, request, timeout=timeout)
        future = self._stub.Acquire.future(
            request, timeout=timeout if timeout is not None else self._request_timeout
        )
        done = threading.Event()
        future.add_done_callback(lambda _f: done.set())
        try:
            _election._wait(done, None, stop)
        except _election._Stopped:
            future.cancel()
            self._give_back_if_granted(request)
            raise
        try:
            return future.result()
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def _give_back_if_granted(self, request) -> None:
        """After a cancelled wait: the arbiter may have granted the key as
        the cancel travelled. Asked again without waiting, on the same
        session, it answers that grant (never a new one while another holds
        the key); a grant found is released at once. Best effort: a grant
        that lands after this ask stays with the session until it ends."""
        probe = lock_pb2.AcquireRequest()
        probe.CopyFrom(request)
        probe.wait = lock_pb2.WAIT_NONE
        try:
            grant = self._call(self._stub.Acquire, probe).grant
        except LatchkeyError:
            return
        if not grant.key:
            return
        release = lock_pb2.ReleaseRequest(key=grant.key, session_id=grant.session_id, token=grant.token)
        if grant.HasField("slot"):
            release.slot = grant.slot
        if grant.mode == lock_pb2.MODE_SHARED:
            release.mode = lock_pb2.MODE_SHARED
        try:
            self._call(self._stub.Release, release)
            log.debug("gave back %s, granted as its wait was cancelled", grant.key)
        except LatchkeyError as error:
            log.debug("giving back %s after a cancelled wait: %s", grant.key, error)

    # -- elections --------------------------------------------------------

    def campaign(
        self,
        election: str,
        election_class: Optional[str] = None,
        *,
        value: str = "",
        priority: int = 0,
        timeout: Optional[float] = 30.0,
        on_lost: Optional[LostCallback] = None,
    ) -> Leadership:
        """Stands for `election` (a key-shaped name, authorised by the same
        prefix grants as keys) and waits until this client leads it: returns
        the :class:`Leadership` (its term and fencing token). Runs on the
        session of `election_class` (kind = "election"; the client's
        ``default_election_class``, "election", if omitted).

        Higher `priority` leads first on a vacancy, then first come. `value`
        is what observers see (an address, a pod name). ``timeout`` seconds
        (``None``: until leading) bound the wait; then :class:`WaitTimeout`,
        and the candidacy ends with it. The arbiter's own maximum wait, if
        shorter, only makes the client stand again (at the back of its
        priority).

        The thread that leads campaigning again gets the same leadership back
        (counted, as a nested lock); another thread of this client waits until
        it ends, then campaigns. ``on_lost(reason)`` is called once, on a
        background thread, when ``leadership.lost`` is set.
        """
        self._open_for("campaign")
        return _election.campaign(
            self,
            election,
            self._election_class(election_class),
            value,
            _priority(priority),
            None if timeout is None else _now() + timeout,
            on_lost,
        )

    def lead(
        self,
        election: str,
        election_class: Optional[str] = None,
        *,
        value: str = "",
        priority: int = 0,
        timeout: Optional[float] = 30.0,
        on_lost: Optional[LostCallback] = None,
    ) -> "_LeadContext":
        """``with client.lead("demo/e", value=pod) as leadership:`` — campaigns
        on enter (as :meth:`campaign`), resigns when the block ends. The block
        is told of loss through ``leadership.lost`` (a :class:`threading.Event`)
        and ``on_lost``; it should stop its leader's work when it is set. A
        lost leadership is not resigned and raises nothing at the end of the
        block."""
        return _LeadContext(self, election, election_class, value, priority, timeout, on_lost)

    def leading(
        self,
        election: str,
        election_class: Optional[str] = None,
        *,
        value: str = "",
        priority: int = 0,
        stop: Optional[threading.Event] = None,
        on_lost: Optional[LostCallback] = None,
        retry_backoff: float = 1.0,
    ) -> Iterator[Leadership]:
        """Leads whenever it can, until `stop` is set: yields a fresh
        :class:`Leadership` each time this client wins the election. The body
        runs the leader's work until ``leadership.lost`` (or `stop`) is set;
        when it returns the leadership is resigned (if still held) and the
        client campaigns again by itself, after a loss too. Transient
        failures (the arbiter unreachable, the session lost) are retried with
        backoff up to `retry_backoff` seconds. Setting `stop` ends a waiting
        campaign promptly and ends the loop after the current body::

            stop = threading.Event()
            for leadership in client.leading("demo/scheduler", value=pod, stop=stop):
                while not stop.is_set() and not leadership.lost.wait(1.0):
                    schedule(fencing_token=leadership.token.value)
        """
        self._open_for("campaign")
        return _election.leading(
            self,
            election,
            self._election_class(election_class),
            value,
            _priority(priority),
            stop,
            on_lost,
            retry_backoff,
        )

    def run_as_leader(
        self,
        election: str,
        fn: Callable[[Leadership], None],
        election_class: Optional[str] = None,
        *,
        value: str = "",
        priority: int = 0,
        stop: Optional[threading.Event] = None,
        retry_backoff: float = 1.0,
    ) -> None:
        """Runs ``fn(leadership)`` each time this client leads, campaigning
        again by itself after each loss, until `stop` is set (:meth:`leading`
        as a call). `fn` should return once ``leadership.lost`` (or `stop`) is
        set; an exception from it resigns and propagates."""
        for leadership in self.leading(
            election, election_class, value=value, priority=priority, stop=stop, retry_backoff=retry_backoff
        ):
            fn(leadership)

    def leader(self, election: str) -> Optional[Leader]:
        """The current leader (identity, value, term), or None while vacant."""
        self._open_for("leader")
        return _election.leader(self, election)

    def candidates(self, election: str) -> List[Candidate]:
        """The election's candidates in the order they would lead."""
        self._open_for("candidates")
        return _election.candidates(self, election)

    def observe(self, election: str, from_term: int = 0, *, reconnect: bool = True) -> Observation:
        """Every term start, proclamation and vacancy of `election`, in order,
        as typed events (:class:`TermStarted`, :class:`Proclaimed`,
        :class:`Vacant`, :class:`Gap`): from the current state on, or from
        `from_term` as far as the arbiter can replay it (a Gap first for what
        it cannot). Iterate it; ``close()`` it (or use ``with``) to stop. A
        stream that breaks transiently is opened again (``reconnect``)."""
        self._open_for("observe")
        observation = Observation(self, election, from_term, reconnect)
        self._observations.add(observation)
        return observation

    def _election_class(self, election_class: Optional[str]) -> str:
        chosen = election_class or self._default_election_class
        if not chosen:
            raise ConfigError("no election class: pass election_class or set Client(default_election_class=...)")
        return chosen

    def _open_for(self, what: str) -> None:
        if self._closed:
            raise ConfigError(f"{what}: the client is closed")

    def inspect(self, key: str) -> Inspection:
        """Who holds `key` (only for callers with a grant on its prefix)."""
        reply = self._call(self._stub.Inspect, lock_pb2.InspectRequest(key=key))
        def seen(h) -> Holder:
            slot = h.slot if h.HasField("slot") else None
            return Holder(
                h.identity,
                h.session_id,
                getattr(h, "class"),
                h.acquired_at_unix_ms,
                dict(h.annotations),
                slot,
                h.mode == lock_pb2.MODE_SHARED,
            )

        holder = seen(reply.holder) if reply.HasField("holder") else None
        return Inspection(
            reply.key,
            holder,
            reply.waiters,
            [seen(h) for h in reply.slot_holders],
            [seen(h) for h in reply.shared_holders],
        )

    def _call(self, method, request, timeout: Optional[float] = None):
        try:
            return method(request, timeout=timeout if timeout is not None else self._request_timeout)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def _downgrade(self, session: Session, hold: Hold) -> Hold:
        """Acquire in mode SHARED of `hold`'s key on its session, naming the
        exclusive hold's token: the arbiter turns that hold into a shared one in
        one transaction, or answers NOT_HELD (never a fresh shared hold)."""
        request = lock_pb2.AcquireRequest(
            key=hold.key,
            session_id=session.id,
            wait=lock_pb2.WAIT_NONE,
            metadata=dict(hold.metadata),
            instance=self._instance,
            mode=lock_pb2.MODE_SHARED,
            downgrade_from=hold.token.value,
            **{"class": hold.lock_class},
        )
        grant = self._call(self._stub.Acquire, request).grant
        if not grant.key:
            raise ProtocolError("malformed reply to Acquire: OK without a grant")
        if grant.session_id != session.id or grant.key != hold.key:
            raise ProtocolError("malformed reply to Acquire: grant for another session or key")
        if grant.mode != lock_pb2.MODE_SHARED or grant.HasField("slot"):
            raise ProtocolError("malformed reply to Acquire: a downgrade granted other than shared")
        shared = Hold(hold.key, grant.session_id, FencingToken(grant.token), grant.epoch, grant.revision)
        shared.shared = True
        shared.lock_class = hold.lock_class
        shared.metadata = dict(hold.metadata)
        log.debug("downgraded %s (session %d, epoch %d)", hold.key, session.id, shared.epoch)
        return shared

    def _release(self, hold: Hold) -> None:
        request = lock_pb2.ReleaseRequest(key=hold.key, session_id=hold.session_id, token=hold.token.value)
        if hold.slot is not None:
            request.slot = hold.slot
        if hold.shared:
            # A shared hold is released as what it is (Grant.mode).
            request.mode = lock_pb2.MODE_SHARED
        self._call(self._stub.Release, request)
        log.debug("released %s (session %d)", hold.key, hold.session_id)

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Closes every session (the arbiter releases their holds; attached
        guards get ``on_fence(CLOSED)``), stops their threads and the channel."""
        if self._closed:
            return
        self._closed = True
        for observation in list(self._observations):
            observation.close()
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._by_class.clear()
        for session in sessions:
            try:
                session.close()
            except LatchkeyError as error:
                log.debug("closing session %d: %s", session.id, error)
        with self._tls_lock:
            self._channel.close()
            for channel in self._retired:
                channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            ids = sorted(self._sessions)
        return f"Client(endpoint={self._endpoint!r}, sessions={ids})"


#: How often a downgrade is sent while its outcome is unknown, and the pause
#: before each repeat (times the attempt), in seconds.
_DOWNGRADE_TRIES = 4
_DOWNGRADE_RETRY = 0.2
#: The background clean-up of a downgrade left unknown: the pause after a
#: failed try, doubling up to the longest, in seconds.
_CLEANUP_FIRST_PAUSE = 0.5
_CLEANUP_LONGEST_PAUSE = 10.0

#: Refusals the arbiter (or the edge) makes before it writes anything: a
#: downgrade so refused did not happen. Any other error may follow a commit.
_BEFORE_WRITING = frozenset(
    {
        "BAD_REQUEST",
        "BAD_KEY",
        "UNKNOWN_CLASS",
        "NOT_AUTHORISED",
        "UNAUTHENTICATED",
        "SESSION_CLASS_MISMATCH",
        "HOOK_DENIED",
        "IDENTITY_LIMIT",
        "HELD",
        "POLICY_NOT_READY",
        "POLICY_STALE",
        "WRONG_TIER",
        "WRONG_KIND",
        "QUOTA_EXCEEDED",
        "KIND_IN_USE",
        "UPGRADE_REFUSED",
    }
)


def _refused_before_writing(error: Refused) -> bool:
    return not error.is_transient() and error.reason in _BEFORE_WRITING


class LockGuard:
    """A hold on a key. Nested acquires of the same key by the same thread
    return more guards of the same hold; the arbiter hears only of the first
    acquire and the last release. Release it with :meth:`release` or by using
    it as a context manager (from any thread: the count is the hold's, the
    right to re-enter its acquiring thread's)."""

    __slots__ = ("_hold", "_session", "_guard_id", "_client", "_armed", "_turn")

    def __init__(self, hold: Hold, session: Session, guard_id: int, client: Client) -> None:
        self._hold = hold
        self._session = session
        self._guard_id = guard_id
        self._client = client
        self._armed = True
        # downgrade(), release() and detach() take turns on one guard: a
        # release racing a downgrade would count down the hold the downgrade
        # is replacing, and leak the shared hold it then installs.
        self._turn = threading.Lock()

    @property
    def token(self) -> FencingToken:
        """The fencing token to present at the resource (``guard.token.value``)."""
        return self._hold.token

    @property
    def key(self) -> str:
        return self._hold.key

    @property
    def epoch(self) -> int:
        return self._hold.epoch

    @property
    def revision(self) -> int:
        return self._hold.revision

    @property
    def slot(self) -> Optional[int]:
        """The slot held, for a semaphore class's grant (``0..permits-1``; the
        token is that slot's, so fence a resource partitioned by slot per
        slot); None for a lock."""
        return self._hold.slot

    @property
    def permits(self) -> Optional[int]:
        """A semaphore's permits (its class's: slots are ``0..permits-1``), as
        the grant said; None for a lock (or from an arbiter too old to say)."""
        return self._hold.permits

    @property
    def shared(self) -> bool:
        """Whether the hold is shared (``acquire(..., shared=True)``): other
        sessions may hold the key shared beside it, never exclusively. Its
        token is above every earlier exclusive grant of the key, so fence a
        read with "no writer since my token"."""
        return self._hold.shared

    @property
    def session_id(self) -> int:
        return self._hold.session_id

    @property
    def session(self) -> Session:
        return self._session

    @property
    def unprotected(self) -> bool:
        """True for a grant made while the lock cluster had no quorum (a class
        with ``onQuorumLoss = "open"``): its token is 0 and fences nothing."""
        return self._hold.unprotected

    @property
    def hold_count(self) -> int:
        """How many guards share this hold."""
        return self._hold.count

    def can_start(self) -> bool:
        """Whether to start a new unit of work under this lock (ADR-12 stage one)."""
        return not self._hold.ended and self._session.can_start()

    def remaining_ttl(self) -> float:
        """Seconds before the hold is fenced unless a keepalive succeeds."""
        return self._session.remaining_ttl()

    @property
    def fence_deadline(self) -> float:
        """When ``on_fence`` fires unless a keepalive succeeds first
        (``time.monotonic()`` clock): the send time of the last successful
        renewal + TTL - 1 s. Moves forward with every renewal."""
        return self._session.fence_deadline

    @property
    def is_fenced(self) -> bool:
        """Whether this hold is lost: its session was fenced, or the arbiter said the hold ended."""
        return self._hold.ended or self._session.is_fenced

    def downgrade(self) -> None:
        """Turns this exclusive hold into a shared one, atomically at the
        arbiter: one transaction ends the exclusive hold and grants the shared
        one, so no writer comes between. Readers queued behind are let in at
        once; a writer waits until this shared hold ends. The guard then holds
        the key shared: :attr:`token` is the shared grant's (a new token,
        above the exclusive one) and :attr:`shared` is True. Release it as any
        guard; ``on_fence`` stays the same. The class's ``maxHoldSeconds``
        still counts from the exclusive grant.

        It is an Acquire of the key with ``shared=True`` on the same session
        that names the exclusive hold's token (``downgrade_from``), with the
        class and metadata of the acquire that was granted (so the class's
        hooks are asked again, as a shared request). It never waits, and the
        arbiter never answers it with a fresh shared hold. Calls on one guard
        from several threads take turns: a ``release()`` or a second
        ``downgrade()`` waits for a downgrade in flight, then acts on the hold
        it left.

        Raises, with the guard left as it was:

        - :class:`Fenced`: the hold is already lost (its session fenced, or
          the arbiter said it ended);
        - :class:`FailedPrecondition` (``BAD_REQUEST``), without a call: the
          hold is shared already, a semaphore's slot, unprotected, released,
          or has other guards (nested acquires, each expecting the exclusive
          hold);
        - the arbiter's refusal before it writes anything: a class with a
          quota takes no downgrade, a hook may deny the shared request, a
          policy refusal. Any other error is taken as an unknown outcome
          (below).

        Raises :class:`NotHeld` (``NOT_HELD``), with the guard fenced
        (``on_fence(HOLD_ENDED)``): the exclusive hold had ended at the
        arbiter (expiry, ``maxHoldSeconds``, force-release, an epoch advance)
        before its notice reached this client; a writer may have held the key
        since.

        When the answer is lost (:class:`Unavailable`, a deadline), the
        downgrade may have landed: it is sent again a few times, and a repeat
        is answered with the shared hold that downgrade made (or
        ``NOT_HELD``). If none settles it (or the call is interrupted), the
        guard is fenced (``HOLD_ENDED``) and the error raised, and a thread
        cleans up while the session lives: it releases the exclusive hold, or
        if that is gone asks the downgrade again and releases the shared hold
        it is answered with. The guard never holds a hold this client has not
        heard of, and nothing is left held. ``on_fence`` runs after the call's
        turn on the guard is over, so it may release or detach the guard.
        """
        # on_fence callbacks fire after the turn is over: one may release or
        # detach this very guard.
        fire: List[Callable[[], None]] = []
        try:
            with self._turn:
                self._downgrade_in_turn(fire)
        finally:
            for f in fire:
                f()

    def _downgrade_in_turn(self, fire: List[Callable[[], None]]) -> None:
        hold, session = self._hold, self._session

        def later(f: Optional[Callable[[], None]]) -> None:
            if f is not None:
                fire.append(f)

        def refuse(why: str) -> FailedPrecondition:
            return FailedPrecondition(
                grpc.StatusCode.FAILED_PRECONDITION, "BAD_REQUEST", f"{hold.key!r} cannot be downgraded: {why}"
            )

        if not self._armed:
            raise refuse("this guard was released or detached")
        reason = session.fence_reason
        if reason is not None:
            raise Fenced(session.id, reason)
        if hold.ended:
            raise Fenced(session.id, FenceReason.HOLD_ENDED)
        if hold.shared:
            raise refuse("it is held shared already (a downgrade turns an exclusive hold into a shared one)")
        if hold.slot is not None:
            raise refuse("it is a semaphore's slot, which has no shared mode")
        if hold.unprotected:
            raise refuse("it was granted from an arbiter's memory without quorum; shared holds never are")
        why = session._begin_downgrade(hold)
        if why == NOT_HELD:
            raise Fenced(session.id, FenceReason.HOLD_ENDED)
        if why == NESTED:
            raise refuse(
                f"it has {hold.count} guards on this thread (nested acquires, each expecting the exclusive hold): "
                "downgrade only with the last one"
            )
        # From here the key is in flight; every way out settles it.
        unknown: Optional[BaseException] = None
        shared: Optional[Hold] = None
        try:
            for attempt in range(_DOWNGRADE_TRIES):
                if attempt:
                    time.sleep(_DOWNGRADE_RETRY * attempt)
                try:
                    shared = self._client._downgrade(session, hold)
                except NotHeld:
                    # The exclusive hold is gone at the arbiter, and no
                    # shared hold of this downgrade exists: fenced.
                    later(session._downgrade_lost(hold.key, cleaning=False))
                    raise
                except Refused as error:
                    if unknown is None and _refused_before_writing(error):
                        # Nothing written: the exclusive hold stays.
                        later(session._downgrade_failed(hold.key))
                        raise
                    unknown = error
                    if error.is_transient():
                        continue
                    # It may follow a commit, or an earlier attempt may have
                    # landed: only a grant or NOT_HELD settles it.
                    break
                break
        except BaseException as error:
            if isinstance(error, Refused) and (
                isinstance(error, NotHeld) or (unknown is None and _refused_before_writing(error))
            ):
                raise
            # Interrupted, or a reply this client cannot use: unknown.
            later(self._clean_up_downgrade(hold))
            raise
        if shared is None:
            later(self._clean_up_downgrade(hold))
            raise unknown if unknown is not None else ProtocolError("a downgrade with no attempt")
        self._hold = shared
        ended = session._downgraded(shared)
        if ended is not None:
            later(ended)
            raise Fenced(session.id, FenceReason.HOLD_ENDED)

    def _clean_up_downgrade(self, hold: Hold) -> Optional[Callable[[], None]]:
        """A downgrade of unknown outcome: the guard is fenced now (the
        returned callable fires its on_fence), and a thread ends whatever the
        downgrade left while the session lives: it releases the exclusive
        hold; if that is gone (NOT_HELD), it asks the downgrade again and
        releases the shared hold it is answered with (the repeat, or NOT_HELD,
        is answered before hooks and admission). An error of unknown outcome
        is tried again, backing off; any other refusal ends the clean-up (what
        it could not end ends with the session). Until it is done the key's other acquirers on this session wait."""
        session, client = self._session, self._client
        fire = session._downgrade_lost(hold.key, cleaning=True)

        def clean_up() -> None:
            pause = _CLEANUP_FIRST_PAUSE
            exclusive_gone = False
            try:
                while session.fence_reason is None and time.monotonic() < session.fence_deadline:
                    try:
                        if not exclusive_gone:
                            try:
                                client._release(hold)
                                return
                            except NotHeld:
                                exclusive_gone = True
                                continue
                        try:
                            shared = client._downgrade(session, hold)
                        except NotHeld:
                            return
                        client._release(shared)
                        return
                    except LatchkeyError as error:
                        if not (isinstance(error, Refused) and error.is_transient()):
                            log.warning(
                                "a downgrade of %s of unknown outcome could not be cleaned up (%s); "
                                "what it left ends with session %d",
                                hold.key,
                                error,
                                session.id,
                            )
                            return
                        log.debug("cleaning up a downgrade of %s (session %d): %s; trying again", hold.key, session.id, error)
                        time.sleep(pause)
                        pause = min(pause * 2, _CLEANUP_LONGEST_PAUSE)
            finally:
                session._downgrade_cleaned(hold.key)

        threading.Thread(target=clean_up, name=f"latchkey-downgrade-{session.id}", daemon=True).start()
        return fire

    def release(self) -> None:
        """Counts this guard down; the last one sends Release. Raises
        :class:`Fenced` if the hold was already lost. Waits for a
        :meth:`downgrade` in flight on another thread."""
        with self._turn:
            self._release_in_turn()

    def _release_in_turn(self) -> None:
        if not self._armed:
            return
        self._armed = False
        session = self._session
        outcome = session._release_one(self._hold, self._guard_id)
        if outcome == NOT_HELD:
            if self._hold.ended:
                raise Fenced(session.id, FenceReason.HOLD_ENDED)
            reason = session.fence_reason
            if reason is not None:
                raise Fenced(session.id, reason)
            return
        if outcome != LAST:
            return
        try:
            reason = session.fence_reason
            if reason is not None:
                raise Fenced(session.id, reason)
            self._client._release(self._hold)
        finally:
            session._released(self._hold.key)

    def detach(self) -> None:
        """Forgets this guard without sending Release: the hold stays until the
        session ends."""
        with self._turn:
            if not self._armed:
                return
            self._armed = False
            if self._session._release_one(self._hold, self._guard_id) == LAST:
                self._session._released(self._hold.key)

    def __enter__(self) -> "LockGuard":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.release()
        except LatchkeyError as error:
            if exc is None:
                raise
            log.warning("releasing %s after an exception in its block: %s", self._hold.key, error)

    def __repr__(self) -> str:
        # Not the revision: with the epoch it spells the token.
        return (
            f"LockGuard(key={self._hold.key!r}, token={self._hold.token!r}, epoch={self._hold.epoch}, "
            f"session_id={self._hold.session_id}, shared={self._hold.shared}, hold_count={self._hold.count}, "
            f"fenced={self.is_fenced})"
        )

    __str__ = __repr__


class _LockContext:
    """What :meth:`Client.lock` returns: acquires on enter, releases on exit."""

    def __init__(self, client, key, lock_class, timeout, on_fence, metadata, shared=False) -> None:
        self._client = client
        self._args = (key, lock_class)
        self._kwargs = {"wait": timeout, "on_fence": on_fence, "metadata": metadata, "shared": shared}
        self._guard: Optional[LockGuard] = None

    def __enter__(self) -> LockGuard:
        self._guard = self._client.acquire(*self._args, **self._kwargs)
        return self._guard

    def __exit__(self, exc_type, exc, tb) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"LockContext(key={self._args[0]!r})"


class _LeadContext:
    """What :meth:`Client.lead` returns: campaigns on enter, resigns on exit."""

    def __init__(self, client, election, election_class, value, priority, timeout, on_lost) -> None:
        self._client = client
        self._election = election
        self._args = (election, election_class)
        self._kwargs = {"value": value, "priority": priority, "timeout": timeout, "on_lost": on_lost}
        self._leadership: Optional[Leadership] = None

    def __enter__(self) -> Leadership:
        self._leadership = self._client.campaign(*self._args, **self._kwargs)
        return self._leadership

    def __exit__(self, exc_type, exc, tb) -> None:
        leadership, self._leadership = self._leadership, None
        if leadership is not None:
            leadership.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"LeadContext(election={self._election!r})"


def _priority(priority: int) -> int:
    if not isinstance(priority, int) or not 0 <= priority < 1 << 32:
        raise ConfigError(f"priority: {priority!r} is not an unsigned 32-bit integer")
    return priority


_NONCE: Dict[int, str] = {}


def default_instance() -> str:
    """The instance name a client takes unless told otherwise:
    ``LATCHKEY_INSTANCE`` if set, else ``<pod or host name>:<pid>:<random>``
    (``POD_NAME`` as the Downward API sets it, else ``HOSTNAME``, else the
    kernel's host name; the random part drawn once per process, again in a
    forked child), so each process is its own instance: two containers of one
    pod that are both pid 1, or host-network pods on one node, differ too."""
    explicit = os.environ.get("LATCHKEY_INSTANCE")
    if explicit is not None:
        return _clean_instance(explicit)
    host = (os.environ.get("POD_NAME") or "").strip() or (os.environ.get("HOSTNAME") or "").strip()
    if not host:
        host = socket.gethostname().strip() or "host"
    pid = os.getpid()
    nonce = _NONCE.setdefault(pid, os.urandom(4).hex())
    return _clean_instance(f"{host}:{pid}:{nonce}")


def _clean_instance(name: str) -> str:
    """`name` as the arbiter accepts it: printable, one line, at most 128 bytes."""
    out = []
    size = 0
    for c in name.strip():
        # not printable: controls, format (bidi, zero-width) and separators
        if not c.isprintable():
            continue
        n = len(c.encode("utf-8"))
        if size + n > 128:
            break
        out.append(c)
        size += n
    return "".join(out).strip()
