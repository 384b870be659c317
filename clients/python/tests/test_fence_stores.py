"""The fence contract on real stores: one suite, every adapter.

tests/e2e/python_fence.rs starts a PostgreSQL, a MariaDB, a Redis, an etcd
and an S3-compatible server (moto), writes `interop/rust` through each Rust
adapter, and runs this file with:

    LATCHKEY_FENCE_POSTGRES_URL   postgresql://…
    LATCHKEY_FENCE_MYSQL_URL      mysql://…
    LATCHKEY_FENCE_REDIS_URL      redis://…
    LATCHKEY_FENCE_ETCD_URL       etcd://…
    LATCHKEY_FENCE_S3_URL         s3://bucket/prefix?endpoint=…  (+ AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)
    LATCHKEY_FENCE_ETCD_AUTH_URL  etcd://user:password@…/prefix on an etcd with auth on,
                                  the user's role covering that prefix only
    LATCHKEY_FENCE_INTEROP=1      the Rust side wrote interop/rust (the interop test runs)

A store whose variable is unset is skipped, unless LATCHKEY_TEST_REQUIRE_STACK=1
(the harness sets it), which turns it into a failure. Record names carry a
per-run prefix, so the suite can run again against the same servers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from typing import Dict, List, Tuple

import pytest

from latchkey import FencingToken, fence
from latchkey.fence import (
    Applied,
    FencedOut,
    FenceError,
    Mark,
    Retry,
    TokenOutOfRange,
    Unfenced,
    guarded_write_retrying,
)

#: Tokens as the arbiter mints them (epoch 1 and up): at least 2**48, so a
#: leaked one is fifteen digits and never an accidental match.
EPOCH = 1 << 48
#: Each store kind (as `store.kind` names it) and its variable's infix.
VARIABLES = {"postgresql": "POSTGRES", "mysql": "MYSQL", "redis": "REDIS", "etcd": "ETCD", "s3": "S3"}
KINDS = list(VARIABLES)
RUN = secrets.token_hex(4)

# What tests/e2e/python_fence.rs writes and checks (the same numbers there).
RUST_TOKEN = 1_000_000
PYTHON_OVER_RUST = RUST_TOKEN + 1
PYTHON_OVER_RUST_PAYLOAD = b"python over rust"
PYTHON_TOKEN = 2_000_000
PYTHON_PAYLOAD = b"from python"


def _url(kind: str) -> str:
    var = f"LATCHKEY_FENCE_{VARIABLES[kind]}_URL"
    url = os.environ.get(var)
    if not url:
        message = f"{var} unset (run via tests/e2e/python_fence.rs)"
        if os.environ.get("LATCHKEY_TEST_REQUIRE_STACK") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return url


def open_store(kind: str, first: bool = False) -> fence.FencedStore:
    url = _url(kind)
    if kind == "s3":
        from latchkey.fence.s3 import S3Store

        # The first connection creates the bucket and runs the certification
        # probe; the others (one per writer thread) skip both.
        return S3Store.connect(url, probe=first, create_bucket=first)
    return fence.connect(url)


_opened: Dict[str, fence.FencedStore] = {}


@pytest.fixture(params=KINDS)
def store(request) -> fence.FencedStore:
    kind = request.param
    if kind not in _opened:
        _opened[kind] = open_store(kind, first=True)
    return _opened[kind]


@pytest.fixture
def name(request) -> str:
    """A record name unique to this run and test."""
    return f"py-{RUN}/{request.node.originalname}"


def counts_writes(store) -> bool:
    """Whether versions are write counts (1 for a create); etcd's are revisions."""
    return store.kind != "etcd"


def leaks(text: str, *secrets_: int) -> bool:
    return any(str(s) in text or format(s, "016x") in text for s in secrets_)


def test_create_overwrite_and_fence_out(store, name):
    assert store.read(name) is None
    first = store.guarded_write(name, EPOCH + 10, b"ten")
    assert isinstance(first, Applied)
    if counts_writes(store):
        assert first == Applied(1)
    found = store.read(name)
    assert found is not None and found.mark == Mark(EPOCH + 10) and found.payload == b"ten"

    second = store.guarded_write(name, EPOCH + 20, b"twenty")
    assert isinstance(second, Applied) and second.version > first.version
    if counts_writes(store):
        assert second == Applied(2)

    # The same token again (a replay) and an older one: fenced out, reporting the mark.
    for stale in (EPOCH + 20, EPOCH + 15, 1):
        assert store.guarded_write(name, stale, b"stale") == FencedOut(Mark(EPOCH + 20))
    found = store.read(name)
    assert found.mark == Mark(EPOCH + 20) and found.payload == b"twenty"

    third = store.guarded_write(name, FencingToken(EPOCH + 21), b"token object")
    assert isinstance(third, Applied) and third.version > second.version


def test_one_mark_per_record(store, name):
    assert isinstance(store.guarded_write(f"{name}/a", EPOCH + 50, b"a"), Applied)
    # A lower token still writes another record.
    assert isinstance(store.guarded_write(f"{name}/b", EPOCH + 5, b"b"), Applied)
    assert store.read(f"{name}/a").mark == Mark(EPOCH + 50)
    assert store.read(f"{name}/b").mark == Mark(EPOCH + 5)


def test_concurrent_writers_leave_the_greatest_token_and_ordered_versions(store, name):
    writers, each = (4, 4) if store.kind == "s3" else (6, 6)
    tokens = [EPOCH + 1000 + w + writers * k for k in range(each) for w in range(writers)]
    results: List[Tuple[int, object]] = []
    errors: List[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(writers)

    def writer(w: int) -> None:
        try:
            with open_store(store.kind) as mine:  # its own connection: real concurrency at the server
                start.wait()
                for k in range(each):
                    token = EPOCH + 1000 + w + writers * k
                    outcome = guarded_write_retrying(mine, name, token, f"w{w}k{k}".encode(), attempts=50)
                    with lock:
                        results.append((token, outcome))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(results) == len(tokens)
    assert not any(isinstance(o, Retry) for _, o in results)

    top = max(tokens)
    found = store.read(name)
    assert found.mark == Mark(top)
    w, k = (top - EPOCH - 1000) % writers, (top - EPOCH - 1000) // writers
    assert found.payload == f"w{w}k{k}".encode()
    assert isinstance(dict(results)[top], Applied), "the greatest token can never be fenced out"

    applied = sorted((o.version, t) for t, o in results if isinstance(o, Applied))
    versions = [v for v, _ in applied]
    assert len(set(versions)) == len(versions), "two applied writes share a version"
    in_commit_order = [t for _, t in applied]
    assert in_commit_order == sorted(in_commit_order), "versions do not follow commit order"
    for t, o in results:
        if isinstance(o, FencedOut):
            assert o.mark.value >= t


def test_marks_never_print(store, name, caplog):
    token = EPOCH + 777_777
    assert isinstance(store.guarded_write(name, token, b"x"), Applied)
    outcome = store.guarded_write(name, token - 1, b"y")
    record = store.read(name)
    import logging

    logging.getLogger("test_fence_stores").warning("%s %r %s %r", outcome, outcome, record, record.mark)
    for text in (repr(outcome), str(outcome), f"{outcome}", repr(record), str(record.mark), caplog.text):
        assert not leaks(text, token), text
    with pytest.raises(TypeError):
        "%d" % outcome.mark


def test_foreign_records_are_refused_and_left_alone(store, name):
    """A record no fence wrote (another type, no mark, a negative or NULL
    mark, an unmarked object) is never overwritten: Unfenced, without the
    token in its text."""
    plant_foreign_record(store, name)
    token = EPOCH + 424_242
    with pytest.raises(Unfenced) as info:
        store.guarded_write(name, token, b"mine")
    assert not leaks(str(info.value), token) and not info.value.is_transient()
    assert name in str(info.value)
    with pytest.raises(Unfenced):
        store.read(name)


def plant_foreign_record(store, name: str) -> None:
    kind = store.kind
    if kind == "postgresql":
        # A negative mark is no token's: the statement's `t.fence >= 0` leaves it.
        store.connection.execute(
            "INSERT INTO latchkey_fenced_rows (id, fence, payload, writes) VALUES ($1, -1, 'theirs', 1)", (name,)
        )
    elif kind == "mysql":
        with store.connection.cursor() as cur:
            cur.execute(
                "INSERT INTO latchkey_fenced_rows (id, fence, payload) VALUES (%s, NULL, 'theirs')", (name.encode(),)
            )
    elif kind == "redis":
        store.client.set(name, b"theirs")
    elif kind == "etcd":
        _, payload_key = store.keys(name)
        import base64

        store._post("planting", "/v3/kv/put", {"key": base64.b64encode(payload_key.encode()).decode(), "value": ""}, ())
    elif kind == "s3":
        store.put_unfenced(name, b"theirs")
    else:
        raise AssertionError(kind)


def test_plain_writes_never_raise_the_mark(store, name):
    token = EPOCH + 300
    first = store.guarded_write(name, token, b"guarded")
    store.plain_write(name, b"naive")
    found = store.read(name)
    assert found.mark == Mark(token) and found.payload == b"naive"
    # The plain write did not raise the mark: the same token is still refused,
    # and the next one lands with a later version.
    assert store.guarded_write(name, token, b"again") == FencedOut(Mark(token))
    later = store.guarded_write(name, token + 1, b"later")
    assert isinstance(later, Applied) and later.version > first.version

    store.plain_write(f"{name}/new", b"naive")
    assert store.read(f"{name}/new").mark == Mark(0), "a record a plain write creates has mark 0"
    assert isinstance(store.guarded_write(f"{name}/new", 1, b"guarded"), Applied)


@pytest.mark.parametrize(
    "token, payload, error",
    [(0, b"x", ValueError), (True, b"x", TypeError), (2**64, b"x", ValueError), (EPOCH, "text", TypeError)],
)
def test_bad_input_writes_nothing(store, name, token, payload, error):
    with pytest.raises(error):
        store.guarded_write(name, token, payload)
    with pytest.raises((TypeError, ValueError)):
        store.guarded_write("", EPOCH, b"x")
    assert store.read(name) is None


def test_store_limits_are_refused_before_anything_is_written(store, name):
    kind = store.kind
    if kind == "postgresql":
        with pytest.raises(TokenOutOfRange) as info:
            store.guarded_write(name, 2**63, b"x")
        assert not leaks(str(info.value), 2**63)
        with pytest.raises(ValueError):
            store.guarded_write(name, EPOCH, b"\xff not utf-8")
        assert isinstance(store.guarded_write(name, 2**63 - 1, b"x"), Applied)
    elif kind == "mysql":
        with pytest.raises(ValueError):
            store.guarded_write(name + "x" * 256, EPOCH, b"x")
        assert isinstance(store.guarded_write(name, 2**64 - 1, b"\xff\x00binary"), Applied)
        assert store.read(name).payload == b"\xff\x00binary"
        assert store.guarded_write(name, 2**64 - 1, b"y") == FencedOut(Mark(2**64 - 1))
    elif kind == "s3":
        for bad in ("a:b", "a/../b", "a=b"):
            with pytest.raises(ValueError):
                store.guarded_write(f"{name}/{bad}", EPOCH, b"x")
        assert isinstance(store.guarded_write(name, 2**64 - 1, b"\xff\x00binary"), Applied)
    else:
        # Every u64 token, compared across its 32-bit halves (Redis) or bytes (etcd).
        assert isinstance(store.guarded_write(name, 2**64 - 2, b"\xff\x00binary"), Applied)
        assert isinstance(store.guarded_write(name, 2**64 - 1, b"y"), Applied)
        assert store.guarded_write(name, 2**64 - 1, b"z") == FencedOut(Mark(2**64 - 1))
        assert store.guarded_write(name, (1 << 32) + 5, b"z") == FencedOut(Mark(2**64 - 1))
        assert store.read(name).payload == b"y"
    if kind == "redis":
        # A mark that could expire is refused: a stale write would land after it did.
        assert isinstance(store.guarded_write(f"{name}/ttl", EPOCH, b"x"), Applied)
        store.client.expire(f"{name}/ttl", 3600)
        with pytest.raises(Unfenced) as info:
            store.guarded_write(f"{name}/ttl", EPOCH + 1, b"y")
        assert "PERSIST" in str(info.value)
        assert store.read(f"{name}/ttl").payload == b"x"
    if kind == "etcd":
        # A mark of another width that sorts below the token (4 zero bytes)
        # passes etcd's byte-wise Less; the adapter reads it first and refuses.
        import base64

        mark_key, payload_key = store.keys(f"{name}/narrow")
        for key, value in ((mark_key, b"\0\0\0\0"), (payload_key, b"theirs")):
            b64 = base64.b64encode
            store._post("planting", "/v3/kv/put", {"key": b64(key.encode()).decode(), "value": b64(value).decode()}, ())
        with pytest.raises(Unfenced):
            store.guarded_write(f"{name}/narrow", EPOCH, b"ours")


def test_interop_with_the_rust_adapters(store):
    """The Rust adapter wrote `interop/rust` with RUST_TOKEN before this
    suite; after it, python_fence.rs reads what this test wrote."""
    if os.environ.get("LATCHKEY_FENCE_INTEROP") != "1":
        message = "LATCHKEY_FENCE_INTEROP unset: the Rust side did not write interop/rust"
        if os.environ.get("LATCHKEY_TEST_REQUIRE_STACK") == "1":
            pytest.fail(message)
        pytest.skip(message)
    assert store.guarded_write("interop/rust", RUST_TOKEN - 1, b"stale python") == FencedOut(Mark(RUST_TOKEN))
    found = store.read("interop/rust")
    assert found.mark == Mark(RUST_TOKEN) and found.payload == b"from rust"
    assert isinstance(store.guarded_write("interop/rust", PYTHON_OVER_RUST, PYTHON_OVER_RUST_PAYLOAD), Applied)
    created = store.guarded_write("interop/python", PYTHON_TOKEN, PYTHON_PAYLOAD)
    assert isinstance(created, Applied)
    if counts_writes(store):
        assert created == Applied(1)


def test_errors_say_which_store_and_never_echo_a_password(store):
    kind = store.kind
    url = _url(kind)
    broken = {
        "postgresql": "postgresql://postgres:hunter2@127.0.0.1:1/latchkey",
        "mysql": "mysql://latchkey:hunter2@127.0.0.1:1/latchkey",
        "redis": "redis://:hunter2@127.0.0.1:1/0",
        "etcd": "etcd://app:hunter2@127.0.0.1:1/fenced",
        "s3": url.split("?")[0] + "?endpoint=http://127.0.0.1:1&region=us-east-1",
    }[kind]
    with pytest.raises(FenceError) as info:
        fence.connect(broken).close()
    text = str(info.value)
    assert text.startswith(f"{kind}: ") and "hunter2" not in text, text
    assert info.value.is_transient(), "an unreachable store may come back"


# --- an existing table that is not the reference one -------------------------------------
#
# CREATE TABLE IF NOT EXISTS leaves a table of the reference name alone, so
# connect checks it and refuses it with what differs. PostgreSQL's foreign
# tables live in a schema of their own (found through search_path); MySQL's
# user has one database, so the reference table is renamed aside meanwhile.

REFUSED = "drop or rename it, or migrate it to the reference schema"


def _refused(connect, url: str, *expected: str) -> str:
    with pytest.raises(FenceError) as info:
        connect().close()
    text = str(info.value)
    assert "the table latchkey_fenced_rows is not the fence's: " in text and REFUSED in text, text
    for part in expected:
        assert part in text, text
    from urllib.parse import urlsplit

    password = urlsplit(url).password
    assert not password or password not in text, "the password leaked"
    assert not info.value.is_transient(), "a foreign table stays foreign"
    return text


@contextlib.contextmanager
def postgres_schema(*ddl: str):
    """A fresh schema holding what `ddl` creates; yields a conninfo whose
    search_path is that schema (so to_regclass finds the table there)."""
    psycopg = pytest.importorskip("psycopg")
    from psycopg.conninfo import make_conninfo

    url = _url("postgresql")
    schema = f"fence_foreign_{RUN}_{secrets.token_hex(2)}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        try:
            with psycopg.connect(make_conninfo(url, options=f"-c search_path={schema}"), autocommit=True) as conn:
                for statement in ddl:
                    conn.execute(statement)
            yield make_conninfo(url, options=f"-c search_path={schema}")
        finally:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


REFERENCE_PG = (
    "CREATE TABLE latchkey_fenced_rows (id text PRIMARY KEY, fence bigint NOT NULL, payload text NOT NULL, "
    "writes bigint NOT NULL)"
)


def test_postgres_refuses_a_foreign_table_with_what_differs():
    from latchkey.fence.postgres import PostgresStore

    older = "CREATE TABLE latchkey_fenced_rows (id text PRIMARY KEY, fence text, payload text)"
    with postgres_schema(older) as conninfo:
        _refused(
            lambda: PostgresStore.connect(conninfo),
            _url("postgresql"),
            "its `fence` column is text, not bigint",
            "it has no `writes` column",
        )
    with postgres_schema(REFERENCE_PG + "; ALTER TABLE latchkey_fenced_rows ADD extra int DEFAULT 0") as conninfo:
        with PostgresStore.connect(conninfo) as store:  # the reference columns and more: accepted
            assert isinstance(store.guarded_write("a", EPOCH, b"x"), Applied)


def test_postgres_refuses_before_row_triggers():
    from latchkey.fence.postgres import PostgresStore

    keep_mark = (
        "CREATE FUNCTION keep_mark() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN NEW.fence := OLD.fence; RETURN NEW; END $$"
    )
    trigger = "CREATE TRIGGER keep_mark BEFORE UPDATE ON latchkey_fenced_rows FOR EACH ROW EXECUTE FUNCTION keep_mark()"
    with postgres_schema(REFERENCE_PG, keep_mark, trigger) as conninfo:
        _refused(lambda: PostgresStore.connect(conninfo), _url("postgresql"), "BEFORE row triggers (keep_mark)")
    # AFTER row triggers and statement-level BEFORE triggers change no row the statement sets.
    audit = "CREATE FUNCTION audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$"
    after = "CREATE TRIGGER audit AFTER UPDATE ON latchkey_fenced_rows FOR EACH ROW EXECUTE FUNCTION audit()"
    statement = "CREATE TRIGGER once BEFORE UPDATE ON latchkey_fenced_rows FOR EACH STATEMENT EXECUTE FUNCTION audit()"
    with postgres_schema(REFERENCE_PG, audit, after, statement) as conninfo:
        PostgresStore.connect(conninfo).close()


def test_postgres_a_write_count_that_is_not_positive_is_no_version(name):
    store = _opened.get("postgresql") or fence.connect(_url("postgresql"))
    _opened["postgresql"] = store
    assert store.guarded_write(name, EPOCH + 1, b"one") == Applied(1)
    store.connection.execute("UPDATE latchkey_fenced_rows SET writes = -1 WHERE id = $1", (name,))
    token = EPOCH + 2
    with pytest.raises(Unfenced) as info:
        store.guarded_write(name, token, b"two")  # writes becomes 0: not version 0
    text = str(info.value)
    assert "not a positive count" in text and name in text and not leaks(text, token)
    # The write landed; only its version is unknown. (With writes at 0 the
    # row reads as no record, like a row only a guarded read made: READ_SQL,
    # as the Rust crate's, so it is checked here directly.)
    row = store.connection.execute("SELECT fence, payload FROM latchkey_fenced_rows WHERE id = $1", (name,)).fetchone()
    assert row == (token, "two") and store.read(name) is None


def _postgres_store():
    store = _opened.get("postgresql") or fence.connect(_url("postgresql"))
    _opened["postgresql"] = store
    return store


def _read_mark(store, record: str) -> int:
    return store.connection.execute("SELECT read_fence FROM latchkey_fenced_rows WHERE id = $1", (record,)).fetchone()[0]


def test_postgres_guarded_reads_refuse_after_a_newer_write_and_fence_out_stale_writers(name):
    """docs/fencing.md, "Fenced reads": a read with token t is accepted only
    while the record's write mark is at or below t, and raises the read mark
    to t in the same statement; after it no write at or below it lands (as
    tests/e2e/fence_reads.rs on the Rust adapter)."""
    from latchkey.fence.postgres import READ_REFUSED, Current, WrittenSince

    store = _postgres_store()
    base = EPOCH

    # A record no write has created: current, nothing written yet. The read
    # leaves a row carrying its read mark, which plain reads do not see.
    assert store.guarded_read(name, base + 10) == Current(None, 0)
    assert store.read(name) is None, "a read-only row is no record"
    assert _read_mark(store, name) == base + 10

    # A stale writer (granted before the reader) is fenced out by the read
    # mark alone, reporting it; so is one with the reader's token.
    for stale in (base + 5, base + 10):
        assert store.guarded_write(name, stale, b"stale") == FencedOut(Mark(base + 10))
    assert store.read(name) is None, "nothing was written"

    # A writer granted after the reader writes; the reader it ended is refused.
    assert store.guarded_write(name, base + 20, b"twenty") == Applied(1)
    refused = store.guarded_read(name, FencingToken(base + 15))
    assert refused == WrittenSince() and str(refused) == READ_REFUSED and not leaks(str(refused), base + 15)

    # Readers granted after that writer read it (the mark's own token is no
    # later writer's); readers do not refuse each other, the read mark is
    # never lowered.
    for t in (base + 20, base + 25, base + 22):
        assert store.guarded_read(name, t) == Current(b"twenty", 1)
    assert _read_mark(store, name) == base + 25

    # Writers meet the read mark: below it fenced out, above it written.
    assert store.guarded_write(name, base + 23, b"stale again") == FencedOut(Mark(base + 25))
    assert store.guarded_write(name, base + 30, b"thirty") == Applied(2)
    assert store.guarded_read(name, base + 25) == WrittenSince(), "the last readers' hold is over"
    assert _read_mark(store, name) == base + 25, "a refused read changes nothing"
    found = store.read(name)
    assert found.mark == Mark(base + 30) and found.payload == b"thirty"

    # A token above bigint is refused before PostgreSQL sees it, and never printed.
    with pytest.raises(TokenOutOfRange) as info:
        store.guarded_read(name, 2**64 - 12)
    assert not leaks(str(info.value), 2**64 - 12)

    # A negative mark is no token's: refused as unfenced, not "written since".
    plant_foreign_record(store, f"{name}/negative")
    token = base + 50
    with pytest.raises(Unfenced) as info:
        store.guarded_read(f"{name}/negative", token)
    assert not leaks(str(info.value), token) and f"{name}/negative" in str(info.value)


def test_postgres_an_older_reference_table_gains_the_read_mark():
    """A table made before fenced reads (no read_fence) gains the read mark at
    connect, its rows at 0; a read_fence that is not bigint is refused."""
    from latchkey.fence.postgres import Current, PostgresStore

    keep = "INSERT INTO latchkey_fenced_rows VALUES ('old/r1', 281474976710666, 'kept', 3)"
    with postgres_schema(REFERENCE_PG, keep) as conninfo:
        with PostgresStore.connect(conninfo) as store:
            assert _read_mark(store, "old/r1") == 0
            assert store.guarded_read("old/r1", EPOCH + 12) == Current(b"kept", 3)
            assert isinstance(store.guarded_write("old/r1", EPOCH + 11, b"stale"), FencedOut)
            # Connecting again changes nothing.
            PostgresStore.connect(conninfo).close()
            assert _read_mark(store, "old/r1") == EPOCH + 12
            store.connection.execute("ALTER TABLE latchkey_fenced_rows DROP COLUMN read_fence")
            store.connection.execute("ALTER TABLE latchkey_fenced_rows ADD COLUMN read_fence text NOT NULL DEFAULT '0'")
        _refused(lambda: PostgresStore.connect(conninfo), _url("postgresql"), "its `read_fence` column is text, not bigint")
    # A foreign table is refused, never altered.
    older = "CREATE TABLE latchkey_fenced_rows (id text PRIMARY KEY, fence text, payload text)"
    with postgres_schema(older) as conninfo:
        _refused(lambda: PostgresStore.connect(conninfo), _url("postgresql"), "its `fence` column is text")
        psycopg = pytest.importorskip("psycopg")
        with psycopg.connect(conninfo, autocommit=True) as conn:
            columns = conn.execute(
                "SELECT count(*) FROM information_schema.columns "
                "WHERE table_name = 'latchkey_fenced_rows' AND column_name = 'read_fence' "
                "AND table_schema = current_schema()"
            ).fetchone()[0]
        assert columns == 0


@contextlib.contextmanager
def mysql_table(*ddl: str, drop: Tuple[str, ...] = ()):
    """The reference table renamed aside while `ddl` creates another one of
    its name; afterwards that one (and the `drop` tables) goes and the
    reference table comes back."""
    pymysql = pytest.importorskip("pymysql")
    from latchkey.fence.mysql import parse_url

    kept = f"latchkey_fenced_rows_kept_{RUN}"
    conn = pymysql.connect(autocommit=True, **parse_url(_url("mysql")))
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT COUNT(*) FROM information_schema.TABLES "
                "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'latchkey_fenced_rows'"
            )
            had = cur.fetchone()[0] == 1
            if had:
                cur.execute(f"RENAME TABLE latchkey_fenced_rows TO {kept}")
            try:
                for statement in ddl:
                    cur.execute(statement)
                yield
            finally:
                cur.execute("DROP TABLE IF EXISTS latchkey_fenced_rows")
                for table in drop:
                    cur.execute(f"DROP TABLE IF EXISTS {table}")
                if had:
                    cur.execute(f"RENAME TABLE {kept} TO latchkey_fenced_rows")
    finally:
        conn.close()


def _mysql_reference(id_type: str = "VARBINARY(255)", extra: str = "") -> str:
    return (
        f"CREATE TABLE latchkey_fenced_rows (id {id_type} NOT NULL PRIMARY KEY, fence BIGINT UNSIGNED NULL, "
        f"payload LONGBLOB NOT NULL, writes BIGINT UNSIGNED NOT NULL DEFAULT 0{extra}) ENGINE=InnoDB"
    )


def test_mysql_refuses_a_foreign_table_with_what_differs():
    url = _url("mysql")
    older = "CREATE TABLE latchkey_fenced_rows (id VARCHAR(255) PRIMARY KEY, fence BIGINT, payload LONGBLOB)"
    with mysql_table(older):
        _refused(
            lambda: fence.connect(url),
            url,
            "its `id` column is varchar(255), not varbinary",
            "its `fence` column is bigint(20), not bigint unsigned",
            "it has no `writes` column",
        )


def test_mysql_refuses_a_short_varbinary_id():
    url = _url("mysql")
    with mysql_table(_mysql_reference("VARBINARY(16)")):
        text = _refused(lambda: fence.connect(url), url, "its `id` column is varbinary(16), shorter than the 255 bytes")
        assert "not varbinary" not in text, "the type is right, only its length is not"


def test_mysql_refuses_an_auto_increment_column():
    url = _url("mysql")
    with mysql_table(_mysql_reference(extra=", seq BIGINT NOT NULL AUTO_INCREMENT, KEY (seq)")):
        _refused(lambda: fence.connect(url), url, "its `seq` column is AUTO_INCREMENT")


def test_mysql_refuses_before_triggers_and_reads_the_version_past_an_after_trigger(name):
    url = _url("mysql")
    keep_mark = (
        "CREATE TRIGGER keep_mark BEFORE UPDATE ON latchkey_fenced_rows FOR EACH ROW SET NEW.fence = OLD.fence"
    )
    with mysql_table(_mysql_reference(), keep_mark):
        _refused(lambda: fence.connect(url), url, "BEFORE triggers (keep_mark)")
    # An AFTER trigger that inserts elsewhere leaves the OK packet's last-insert
    # id 0: the version is read from the session's LAST_INSERT_ID() instead.
    audit_table = f"fence_audit_{RUN}"
    audit = (
        f"CREATE TRIGGER audit AFTER UPDATE ON latchkey_fenced_rows FOR EACH ROW "
        f"INSERT INTO {audit_table} (id) VALUES (NEW.id)"
    )
    create_audit = f"CREATE TABLE {audit_table} (n BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, id VARBINARY(255))"
    with mysql_table(_mysql_reference(), create_audit, audit, drop=(audit_table,)):
        with fence.connect(url) as store:
            assert store.guarded_write(name, EPOCH + 1, b"one") == Applied(1)
            assert store.guarded_write(name, EPOCH + 2, b"two") == Applied(2)
            assert store.guarded_write(name, EPOCH + 3, b"three") == Applied(3)


def test_mysql_sessions_are_strict_after_connecting_and_after_a_reconnect(name):
    import warnings

    def session_mode(store) -> str:
        with store.connection.cursor() as cur:
            cur.execute("SELECT @@SESSION.sql_mode")
            return cur.fetchone()[0]

    with fence.connect(_url("mysql")) as store:
        assert "STRICT_ALL_TABLES" in session_mode(store).split(",")
        store.connection.close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # PyMySQL deprecates reconnect=True
            store.connection.ping(reconnect=True)
        assert isinstance(store.guarded_write(name, EPOCH, b"x"), Applied)
        assert session_mode(store).split(",").count("STRICT_ALL_TABLES") == 1


def test_etcd_logs_in_and_its_refusals_hold_no_token_or_password():
    url = os.environ.get("LATCHKEY_FENCE_ETCD_AUTH_URL")
    if not url:
        message = "LATCHKEY_FENCE_ETCD_AUTH_URL unset (run via tests/e2e/python_fence.rs)"
        if os.environ.get("LATCHKEY_TEST_REQUIRE_STACK") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from latchkey.fence.etcd import EtcdStore, EtcdUrl

    parsed = EtcdUrl(url)
    user, password = parsed.login
    record = f"py-{RUN}/login"
    with EtcdStore.connect(url) as store:
        assert isinstance(store.guarded_write(record, EPOCH + 1, b"in"), Applied)
        assert store.read(record).payload == b"in"
        # The login token expires or is revoked: the store logs in again.
        store._token = "not-a-token"
        assert store.guarded_write(record, EPOCH + 1, b"again") == FencedOut(Mark(EPOCH + 1))

    # A prefix the user's role does not cover: refused, and the token is not in the text.
    elsewhere = url.replace(f"/{parsed.prefix}", "/elsewhere")
    token = EPOCH + 31337
    with pytest.raises(FenceError) as info:
        EtcdStore(parsed.endpoints, "elsewhere", parsed.login).guarded_write(record, token, b"x")
    assert "permission denied" in str(info.value) and not leaks(str(info.value), token)
    with pytest.raises(FenceError):
        EtcdStore.connect(elsewhere)

    wrong = url.replace(f":{password}@", ":wrong-pw@")
    with pytest.raises(FenceError) as info:
        EtcdStore.connect(wrong)
    text = str(info.value)
    assert "authentication failed" in text and "wrong-pw" not in text and password not in text
    assert not info.value.is_transient()
