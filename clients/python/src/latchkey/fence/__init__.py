"""Fence adapters: enforce the fencing token in the stores a workload writes to.

A token protects nothing until the resource checks it. Every adapter here
keeps a *mark* with each record (the greatest token that wrote it), and a
guarded write carrying token ``t`` lands if and only if the record is missing
or its mark is strictly below ``t``, raising the mark to ``t`` in the same
atomic step of the store. They are the Python twins of the Rust adapters in
``fence/`` and keep records in the same layout (the same table and
statements, keys, script, transaction and object metadata), so a Python
writer and a Rust writer fence each other. docs/fencing.md has the details.

A write flows like this::

    from latchkey import fence
    from latchkey.fence.postgres import PostgresStore

    with client.lock("orders/42") as guard, PostgresStore.connect(url) as store:
        outcome = store.guarded_write("orders/42", guard.token, b"...")
        if isinstance(outcome, fence.FencedOut):
            ...  # a later holder wrote: stop, this holder's work is stale

:meth:`FencedStore.guarded_write` answers :class:`Applied` (with the record's
new ``version``), :class:`FencedOut` (with the record's :class:`Mark`, which
never prints) or :class:`Retry` (nothing changed; try again, or use
:func:`guarded_write_retrying`). Failures are :class:`FenceError`; bad input
is ``TypeError``/``ValueError`` before anything is sent.

Adapters (each imports its driver only when used; a missing driver raises an
``ImportError`` naming the pip extra): :mod:`latchkey.fence.postgres`
(psycopg 3), :mod:`latchkey.fence.mysql` (PyMySQL),
:mod:`latchkey.fence.redis` (redis-py), :mod:`latchkey.fence.etcd` (etcd's
JSON gateway, standard library only) and :mod:`latchkey.fence.s3` (SigV4 and
conditional PUTs, standard library only). :func:`connect` picks one by the
URL's scheme.
"""

from __future__ import annotations

from ._contract import (
    MAX_TOKEN,
    Applied,
    FencedOut,
    FencedStore,
    FenceError,
    Guarded,
    Mark,
    Record,
    Retry,
    TokenOutOfRange,
    Unfenced,
    guarded_write_retrying,
    redact,
    token_value,
)

_SCHEMES = {
    "postgresql": ("postgres", "PostgresStore"),
    "postgres": ("postgres", "PostgresStore"),
    "mysql": ("mysql", "MysqlStore"),
    "redis": ("redis", "RedisStore"),
    "etcd": ("etcd", "EtcdStore"),
    "s3": ("s3", "S3Store"),
}


def connect(url: str) -> FencedStore:
    """The adapter for ``url``'s scheme, connected: ``postgresql://``,
    ``mysql://``, ``redis://``, ``etcd://`` or ``s3://`` (the same URLs as
    ``latchctl pause-test --resource-url``). The error never repeats the URL
    (it may hold a password)."""
    if not isinstance(url, str):
        raise TypeError(f"a store URL is a str, not {type(url).__name__}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        raise ValueError(
            "a store URL starts with postgresql://, mysql://, redis://, etcd:// or s3:// "
            f"(got {'scheme ' + repr(scheme) if scheme else 'no scheme'})"
        )
    module_name, class_name = _SCHEMES[scheme]
    import importlib

    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name).connect(url)


__all__ = [
    "MAX_TOKEN",
    "Applied",
    "FenceError",
    "FencedOut",
    "FencedStore",
    "Guarded",
    "Mark",
    "Record",
    "Retry",
    "TokenOutOfRange",
    "Unfenced",
    "connect",
    "guarded_write_retrying",
    "redact",
    "token_value",
]
