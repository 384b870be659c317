"""The PostgreSQL fence (psycopg 3): the reference table and statements of
the Rust crate ``latchkey-fence-postgres``, byte for byte.

One ``INSERT … ON CONFLICT DO UPDATE … WHERE t.fence < EXCLUDED.fence AND
t.read_fence < EXCLUDED.fence AND t.fence >= 0 RETURNING writes`` creates the
record, or overwrites it and raises its mark to the token, or changes nothing
and returns no row (fenced out). PostgreSQL's row lock makes the comparison
and the write one step; the returned write count is the applied write's
version. A negative ``fence`` is no token's (a table that marks unfenced rows
with -1): never overwritten, reported as :class:`~latchkey.fence.Unfenced`.
Tokens above 2**63-1 do not fit ``bigint`` and are refused
(:class:`~latchkey.fence.TokenOutOfRange`).

Shared holders (readers) fence their reads with
:meth:`PostgresStore.guarded_read` (:data:`GUARDED_READ_SQL`): accepted
(:class:`Current`) only while the record's mark is at or below the reader's
token, i.e. no writer granted after the reader has written, and it raises the
record's *read mark* (``read_fence``) to the token in the same statement, so
a stale writer whose token is at or below it can no longer write the record:
the guarded write compares the read mark too. A refusal is
:class:`WrittenSince` (its text is :data:`READ_REFUSED`). A fenced-out write
reports the greater of the write and read marks. docs/fencing.md, "Fenced
reads", has the rule and why.

The statements are sent with PostgreSQL's own ``$n`` placeholders
(psycopg's ``RawCursor``), so their text is the Rust crate's. Payloads are
the table's ``text`` column: they must be UTF-8 without NUL bytes.

An existing table of the reference name (``CREATE TABLE IF NOT EXISTS``
leaves it alone) is checked before anything is written and refused with
what differs: other column types (a ``read_fence`` that is not ``bigint``
too), or BEFORE row triggers (they can change the mark or the write count
the statement sets). A reference table made before fenced reads gains the
read mark (:data:`ADD_READ_FENCE_SQL`) once it has passed every other check;
a foreign table is refused, never altered. An applied write whose ``writes``
comes back not positive has no version: :class:`Unfenced`.

Needs ``pip install 'latchkey[postgres]'`` (psycopg 3 with its binary libpq).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union
from urllib.parse import urlsplit

from .._token import FencingToken
from ._contract import (
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
    check_input,
    missing_driver,
    token_value,
)

KIND = "postgresql"
TABLE = "latchkey_fenced_rows"

#: ``read_fence`` is the read mark: the greatest token a guarded read was
#: accepted with (0: none). It is last and has a default, so an older table
#: gains it in place (:data:`ADD_READ_FENCE_SQL`) and inserts that name four
#: columns still work.
CREATE_TABLE_SQL = """CREATE TABLE IF NOT EXISTS latchkey_fenced_rows (
    id         text   PRIMARY KEY,
    fence      bigint NOT NULL,
    payload    text   NOT NULL,
    writes     bigint NOT NULL,
    read_fence bigint NOT NULL DEFAULT 0
)"""

#: Adds the read mark to a reference table made before fenced reads (every
#: row starts at 0: no read yet). :meth:`PostgresStore.ensure_schema` runs it
#: only when the table is otherwise the reference one and lacks the column.
ADD_READ_FENCE_SQL = (
    "ALTER TABLE latchkey_fenced_rows ADD COLUMN IF NOT EXISTS read_fence bigint NOT NULL DEFAULT 0"
)

#: ``$1`` id, ``$2`` token, ``$3`` payload. Creates a missing record;
#: otherwise writes only if the record's mark *and* its read mark are strictly
#: below the token (a reader with this or a later token has read it: a writer
#: granted before that reader is stale). One row back (the record's write
#: count) means applied; no row means fenced out.
GUARDED_WRITE_SQL = """INSERT INTO latchkey_fenced_rows AS t (id, fence, payload, writes)
VALUES ($1, $2, $3, 1)
ON CONFLICT (id) DO UPDATE
   SET fence = EXCLUDED.fence, payload = EXCLUDED.payload, writes = t.writes + 1
 WHERE t.fence < EXCLUDED.fence AND t.read_fence < EXCLUDED.fence AND t.fence >= 0
RETURNING writes"""

#: The plain guarded update for a record that already exists (``$1`` id,
#: ``$2`` token, ``$3`` payload): the affected row count is the answer (1
#: written, 0 fenced out or no such record). The adapter does not run it; it
#: is here, as in the Rust crate, to be copied with the read mark compare.
GUARDED_UPDATE_SQL = """UPDATE latchkey_fenced_rows
   SET payload = $3, fence = $2, writes = writes + 1
 WHERE id = $1 AND fence < $2 AND read_fence < $2 AND fence >= 0"""

#: The guarded read of a shared holder: ``$1`` id, ``$2`` the reader's token.
#: Accepted if and only if the record's mark is at or below the token (no
#: writer granted after this reader has written), and then the read mark is
#: raised to the token (never lowered: readers do not refuse each other) in
#: the same statement. A missing record is created empty (mark 0, write count
#: 0, the read mark the token), so a stale writer cannot create it after the
#: read either. One row back (payload and write count) means accepted; no row
#: means refused.
GUARDED_READ_SQL = """INSERT INTO latchkey_fenced_rows AS t (id, fence, payload, writes, read_fence)
VALUES ($1, 0, '', 0, $2)
ON CONFLICT (id) DO UPDATE
   SET read_fence = GREATEST(t.read_fence, EXCLUDED.read_fence)
 WHERE t.fence <= EXCLUDED.read_fence AND t.fence >= 0
RETURNING payload, writes"""

#: Reads a record's mark and payload. A row only a guarded read made (no
#: write yet: ``writes = 0``) is no record.
READ_SQL = "SELECT fence, payload FROM latchkey_fenced_rows WHERE id = $1 AND writes <> 0"

#: What refused a write, to report it: the record's write mark and read mark
#: (a write is fenced out by the greater of the two).
MARKS_SQL = "SELECT fence, read_fence FROM latchkey_fenced_rows WHERE id = $1"

#: The refusal reason of a :class:`WrittenSince`, in words (no token, no mark).
READ_REFUSED = (
    "guarded read refused: a writer granted after this reader has written the record, so the shared hold is over"
)

#: The naive writer: overwrites the payload, never compares or raises the
#: mark (a record it creates gets mark 0). Tests and benchmarks only.
PLAIN_WRITE_SQL = """INSERT INTO latchkey_fenced_rows AS t (id, fence, payload, writes)
VALUES ($1, 0, $2, 1)
ON CONFLICT (id) DO UPDATE
   SET payload = EXCLUDED.payload, writes = t.writes + 1"""

#: The columns the statements need, with the types ``format_type`` names
#: (other columns may exist).
REQUIRED_COLUMNS: Sequence[Tuple[str, Sequence[str]]] = (
    # text: a varchar(3) silently trims trailing spaces ('abc  ' is abc).
    ("id", ("text",)),
    ("fence", ("bigint",)),
    ("payload", ("text",)),
    ("writes", ("bigint",)),
)

#: The read mark's column: added by :meth:`PostgresStore.ensure_schema` when
#: missing, and ``bigint`` when present (a text read mark would compare
#: ``"9" > "10"``).
READ_FENCE_COLUMN: Tuple[str, Sequence[str]] = ("read_fence", ("bigint",))

COLUMNS_SQL = """SELECT a.attname::text, format_type(a.atttypid, NULL)
  FROM pg_attribute a
 WHERE a.attrelid = to_regclass('latchkey_fenced_rows') AND a.attnum > 0 AND NOT a.attisdropped"""

#: Row triggers that run BEFORE the write (``tgtype`` bits: 1 row, 2 before):
#: they can change the mark or the write count the statement sets (one that
#: keeps the old mark lets a stale write land and read as applied).
BEFORE_TRIGGERS_SQL = """SELECT tgname::text FROM pg_trigger
 WHERE tgrelid = to_regclass('latchkey_fenced_rows') AND NOT tgisinternal
   AND (tgtype & 3) = 3"""

#: The relation the name resolves to: its kind ('r' a plain table; a view or
#: a partitioned table routes writes elsewhere), whether tables inherit from
#: it, and whether id's collation is deterministic (a case-insensitive ICU
#: collation makes two record names one record).
RELATION_SQL = """SELECT c.relkind::text,
       EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhparent = c.oid),
       COALESCE((SELECT coll.collisdeterministic FROM pg_attribute a
                   JOIN pg_collation coll ON coll.oid = a.attcollation
                  WHERE a.attrelid = c.oid AND a.attname = 'id'), true)
  FROM pg_class c WHERE c.oid = to_regclass('latchkey_fenced_rows')"""

#: The table's unique indexes, and whether one is the primary key on id
#: alone: ON CONFLICT (id) uses any unique index on id, whatever its
#: collation, so the primary key must be the only one (as in Rust).
KEYS_SQL = """SELECT count(*),
       COALESCE(bool_or(ix.indisprimary AND ix.indnatts = 1 AND ix.indexprs IS NULL
                        AND ix.indpred IS NULL
                        AND ix.indkey[0] = (SELECT attnum FROM pg_attribute
                                             WHERE attrelid = ix.indrelid AND attname = 'id')), false)
  FROM pg_index ix WHERE ix.indrelid = to_regclass('latchkey_fenced_rows') AND ix.indisunique"""

_BIGINT_MAX = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class Current:
    """A :meth:`PostgresStore.guarded_read` was accepted: no write with a
    larger token than the reader's has landed, so what was read is current
    for this shared hold (the Rust ``ReadOutcome::Current``).

    ``payload`` is ``None`` when no write has landed yet; ``write_seq``
    counts the writes the record has accepted (0: none), the same count an
    :class:`~latchkey.fence.Applied` write's ``version`` gives, so a read is
    ordered among the writes. The record's read mark is now at least the
    token: a writer with a token at or below it is fenced out from here on.
    Its repr shows the payload's length, never the payload."""

    payload: Optional[bytes]
    write_seq: int

    def __repr__(self) -> str:
        size = None if self.payload is None else len(self.payload)
        return f"Current(payload_bytes={size}, write_seq={self.write_seq})"

    def __str__(self) -> str:
        if self.write_seq == 0:
            return "current (no write yet)"
        return f"current (after write #{self.write_seq})"


@dataclasses.dataclass(frozen=True)
class WrittenSince:
    """A :meth:`PostgresStore.guarded_read` was refused: a writer granted
    after this reader has written the record, so the reader's shared hold is
    over. Discard what it read and stop (do not retry with the same token);
    nothing changed. The Rust ``ReadOutcome::WrittenSince``; its text is
    :data:`READ_REFUSED`."""

    def __str__(self) -> str:
        return READ_REFUSED


#: What :meth:`PostgresStore.guarded_read` answers.
ReadOutcome = Union[Current, WrittenSince]


def _psycopg():
    try:
        import psycopg
    except ImportError:
        raise missing_driver("PostgreSQL", "psycopg", "psycopg 3", "postgres") from None
    return psycopg


def schema_problems(
    columns: Sequence[Tuple[str, str]],
    before_triggers: Sequence[str] = (),
    relation: Tuple[str, bool, bool] = ("r", False, True),
    keys: Tuple[int, bool] = (1, True),
) -> Optional[str]:
    """What differs between the table (``columns`` as (name, type), the names
    of its BEFORE row triggers, ``relation`` as (relkind, inherited from,
    id collation deterministic)) and the reference table, or None."""
    wrong: List[str] = []
    kind, inherited, deterministic = relation
    unique, primary_on_id = keys
    if not primary_on_id:
        wrong.append("its primary key is not `id` alone")
    if unique != 1:
        wrong.append(
            f"it has {unique} unique indexes where the fence needs exactly one, the primary key on `id` "
            "(`ON CONFLICT (id)` takes any unique index on `id`, whatever its collation, and another "
            "unique key can refuse or redirect writes)"
        )
    if kind != "r":
        wrong.append(
            f"it is not a plain table (pg_class.relkind {kind!r}: a view or a partitioned table "
            "routes the write to a table whose triggers and keys are not checked)"
        )
    if inherited:
        wrong.append("other tables inherit from it")
    if not deterministic:
        wrong.append(
            "its `id` collation is not deterministic (a case-insensitive collation makes two "
            "record names one record)"
        )
    for name, types in REQUIRED_COLUMNS:
        found = [t for n, t in columns if n == name]
        if not found:
            wrong.append(f"it has no `{name}` column")
        elif found[0] not in types:
            wrong.append(f"its `{name}` column is {found[0]}, not {' or '.join(types)}")
    name, types = READ_FENCE_COLUMN
    found = [t for n, t in columns if n == name]
    if found and found[0] not in types:
        wrong.append(f"its `{name}` column is {found[0]}, not {' or '.join(types)}")
    if before_triggers:
        wrong.append(
            f"it has BEFORE row triggers ({', '.join(before_triggers)}), which can change the mark or "
            "the write count the guarded statement sets"
        )
    return "; ".join(wrong) or None


def _transient(err) -> bool:
    code = getattr(err, "sqlstate", None) or ""
    if code:
        return code.startswith(("08", "40", "57P")) or code == "53300"
    # No SQLSTATE: the connection failed or is gone.
    return True


def _message(err) -> str:
    """Severity, message and SQLSTATE only: a DETAIL may echo the row."""
    diag = getattr(err, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    if primary:
        return f"{diag.severity or 'ERROR'}: {primary} (SQLSTATE {err.sqlstate})"
    return str(err).strip()


def _scrub_url(text: str, url: str) -> str:
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        text = text.replace(password, "<redacted>")
    return text


class PostgresStore(FencedStore):
    """The reference table as a fenced store, over one psycopg connection
    (psycopg serialises its use across threads)."""

    kind = KIND

    def __init__(self, connection) -> None:
        """Wraps an open psycopg 3 connection in autocommit mode (each guarded
        write is its own statement, decided when it returns). The reference
        table must exist (:meth:`ensure_schema`)."""
        if not getattr(connection, "autocommit", False):
            raise ValueError(
                "the PostgreSQL fence needs a connection in autocommit mode (psycopg.connect(..., "
                "autocommit=True)): inside an open transaction an Applied write is not yet committed"
            )
        self._conn = connection

    @classmethod
    def connect(cls, conninfo: str) -> "PostgresStore":
        """Connects (``postgresql://…`` or a libpq key/value string),
        creates the reference table if it is missing and checks an existing
        one. Errors name neither the URL nor its password."""
        psycopg = _psycopg()
        try:
            conn = psycopg.connect(conninfo, autocommit=True, cursor_factory=psycopg.RawCursor)
        except psycopg.Error as e:
            err = FenceError(KIND, "connecting", _scrub_url(_message(e), conninfo), True)
        else:
            err = None
        if err is not None:
            raise err
        store = cls(conn)
        try:
            store.ensure_schema()
        except BaseException:
            store.close()
            raise
        return store

    @property
    def connection(self):
        return self._conn

    def close(self) -> None:
        self._conn.close()

    def _execute(self, op: str, sql: str, params: Sequence[object], secrets: Sequence[int] = ()):
        """Runs one statement; the rows back (or None), or a scrubbed FenceError.
        Raised outside the ``except`` so no driver exception (which may hold
        the token) rides along as its context."""
        psycopg = _psycopg()
        try:
            cur = psycopg.RawCursor(self._conn)
            cur.execute(sql, params)
            rows = cur.fetchall() if cur.description is not None else None
            cur.close()
            return rows
        except psycopg.Error as e:
            err = FenceError.scrubbed(KIND, op, _message(e), _transient(e), secrets)
        raise err

    def ensure_schema(self) -> None:
        """Creates the reference table (idempotent) and refuses a table of
        that name that is not the reference one: other column types, or
        BEFORE row triggers (``CREATE TABLE IF NOT EXISTS`` leaves an older or
        foreign table alone). A reference table made before fenced reads
        gains the read mark (:data:`ADD_READ_FENCE_SQL`), and only then."""
        self._execute("creating the reference table", CREATE_TABLE_SQL, ())
        rows = self._execute("reading the fenced table's columns", COLUMNS_SQL, ()) or []
        triggers = self._execute("reading the fenced table's triggers", BEFORE_TRIGGERS_SQL, ()) or []
        relation = self._execute("reading the fenced table's kind", RELATION_SQL, ()) or []
        keys = self._execute("reading the fenced table's keys", KEYS_SQL, ()) or []
        why = schema_problems(
            [(str(n), str(t)) for n, t in rows],
            [str(t) for (t,) in triggers],
            (str(relation[0][0]), bool(relation[0][1]), bool(relation[0][2])) if relation else ("r", False, True),
            (int(keys[0][0]), bool(keys[0][1])) if keys else (0, False),
        )
        if why:
            raise FenceError(
                KIND,
                "checking the reference table",
                f"the table {TABLE} is not the fence's: {why}; drop or rename it, "
                "or migrate it to the reference schema",
            )
        # A reference table made before fenced reads: add the read mark, only
        # now that everything else about the table is known to be the fence's
        # (a foreign table is refused above, never altered).
        if not any(str(n) == READ_FENCE_COLUMN[0] for n, _ in rows):
            self._execute("adding the read mark column", ADD_READ_FENCE_SQL, ())

    @staticmethod
    def _text(payload: bytes) -> str:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the PostgreSQL reference table keeps text payloads: this payload is not UTF-8") from None
        if "\x00" in text:
            raise ValueError("the PostgreSQL reference table keeps text payloads: PostgreSQL text cannot hold NUL bytes")
        return text

    def _guarded_write(self, record: str, token: int, payload: bytes) -> Guarded:
        text = self._text(payload)
        if token > _BIGINT_MAX:
            raise TokenOutOfRange(KIND)
        rows = self._execute("guarded write", GUARDED_WRITE_SQL, (record, token, text), (token,))
        if rows:
            # The write count is at least 1 (`writes = 1` on create); one that
            # is not (a row someone set to -5) cannot order anything: the
            # write landed, its version is unknown.
            writes = rows[0][0]
            if not isinstance(writes, int) or writes <= 0:
                raise Unfenced(
                    KIND,
                    record,
                    "the write landed, but its writes column is not a positive count, so the write "
                    "has no version; repair the column",
                )
            return Applied(version=writes)
        # No row back: the WHERE refused the update, by the write mark or the
        # read mark (a reader with this or a later token read the record): the
        # greater one is the mark it met. The read only reports.
        marks = self._marks(record, token)
        if marks is None:
            # Deleted since: nothing changed, and the same write may land now.
            return Retry()
        write_mark, read_mark = marks
        if write_mark < 0:
            raise Unfenced(KIND, record, "its fence column is negative, which no token is")
        return FencedOut(Mark(max(write_mark, read_mark, 0)))

    def guarded_read(self, record: str, token: Union[int, FencingToken]) -> ReadOutcome:
        """The guarded read of a shared holder whose grant's token is
        ``token`` (``guard.token`` of the shared grant): :class:`Current` with
        the record's payload and write count if and only if no write with a
        larger token has landed, raising the record's read mark to ``token``
        in the same statement (:data:`GUARDED_READ_SQL`); otherwise
        :class:`WrittenSince`. Act on the payload only if it is
        :class:`Current`. A shared holder must never call
        :meth:`guarded_write` (its token would pass, and raise the mark above
        the next writer's).

        A record whose mark is negative is :class:`Unfenced`; a token above
        2**63-1 is :class:`TokenOutOfRange`; errors never hold the token."""
        value = token_value(token)
        record, _ = check_input(record)
        self._check_record(record)
        if value > _BIGINT_MAX:
            raise TokenOutOfRange(KIND)
        rows = self._execute("guarded read", GUARDED_READ_SQL, (record, value), (value,))
        if not rows:
            # The row-count check, as for the write: no row back is the
            # refusal. The statement refuses a negative mark too: that record
            # was never the fence's, and saying "written since" would hide it.
            marks = self._marks(record, value)
            if marks is not None and marks[0] < 0:
                raise Unfenced(KIND, record, "its fence column is negative, which no token is")
            return WrittenSince()
        payload, writes = rows[0]
        return Current(None if writes == 0 else str(payload).encode("utf-8"), int(writes))

    def _marks(self, record: str, token: int) -> Optional[Tuple[int, int]]:
        """The record's write mark and read mark as stored, or None when it
        does not exist. Only reports: nothing is decided by this read."""
        rows = self._execute("reading a record's marks", MARKS_SQL, (record,), (token,))
        if not rows:
            return None
        write_mark, read_mark = rows[0]
        # The reference table's columns are NOT NULL; a copy's may not be.
        if write_mark is None:
            raise Unfenced(KIND, record, "its fence column is NULL")
        return int(write_mark), 0 if read_mark is None else int(read_mark)

    def _read(self, record: str) -> Optional[Record]:
        rows = self._execute("reading a record", READ_SQL, (record,))
        if not rows:
            return None
        fence, payload = rows[0]
        if fence is None:
            raise Unfenced(KIND, record, "its fence column is NULL")
        if fence < 0:
            raise Unfenced(KIND, record, "its fence column is negative, which no token is")
        return Record(Mark(int(fence)), str(payload).encode("utf-8"))

    def _plain_write(self, record: str, payload: bytes) -> None:
        self._execute("plain write", PLAIN_WRITE_SQL, (record, self._text(payload)))
