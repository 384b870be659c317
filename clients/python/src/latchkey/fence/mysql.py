"""The MySQL/MariaDB fence (PyMySQL): the reference table and statement of
the Rust crate ``latchkey-fence-mysql``, byte for byte.

One statement decides::

    INSERT INTO latchkey_fenced_rows (id, fence, payload, writes)
      VALUES (?, ?, ?, LAST_INSERT_ID(1))
    ON DUPLICATE KEY UPDATE
      payload = IF(fence < ?, ?, payload),
      writes  = IF(fence < ?, LAST_INSERT_ID(writes + 1), writes),
      fence   = IF(fence < ?, ?, fence)

bound as ``(id, token, payload, token, payload, token, token, token)``.
InnoDB locks the row for the statement. The answer is the affected-row
count: 1 inserted, 2 updated, 0 left as it was (fenced out, or a ``NULL``
fence: unfenced). That holds only without ``CLIENT_FOUND_ROWS``, with which
an unchanged row counts 1 like an insert: :meth:`MysqlStore.connect` refuses
the flag and checks the server's counts on a temporary table before trusting
them. The applied write's version is the record's write count, which
``LAST_INSERT_ID(expr)`` hands back in the statement's OK packet (PyMySQL's
``cursor.lastrowid``).

PyMySQL interpolates parameters into the statement text on the client, so a
server error can echo the token: every driver message is scrubbed.

Every session the store uses turns on ``STRICT_ALL_TABLES`` first
(:data:`STRICT_SQL`, again after a reconnect), so a value too long for its
column is an error rather than cut. An existing table of the reference name
is checked before anything is written, and refused with what differs: the
reference column types (``id`` a ``VARBINARY`` of at least 255 bytes,
``fence`` and ``writes`` ``BIGINT UNSIGNED``, a blob ``payload``), ``id`` its
only unique key, no ``AUTO_INCREMENT`` column (its last-insert id would be
read as the write count) and no BEFORE triggers (one that keeps the old mark
lets a stale write land and read as applied).

Needs ``pip install 'latchkey[mysql]'`` (PyMySQL).
"""

from __future__ import annotations

import threading
from typing import List, Optional, Sequence, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit

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

KIND = "mysql"
TABLE = "latchkey_fenced_rows"
#: The reference table's ``id`` holds this many bytes; a longer name is
#: refused before any statement (a non-strict server would cut it and the
#: write would land on another record).
MAX_RECORD_BYTES = 255

CREATE_TABLE_SQL = """CREATE TABLE IF NOT EXISTS latchkey_fenced_rows (
    id      VARBINARY(255)  NOT NULL PRIMARY KEY,
    fence   BIGINT UNSIGNED NULL,
    payload LONGBLOB        NOT NULL,
    writes  BIGINT UNSIGNED NOT NULL DEFAULT 0
) ENGINE=InnoDB"""

GUARDED_WRITE_SQL = """INSERT INTO latchkey_fenced_rows (id, fence, payload, writes)
  VALUES (?, ?, ?, LAST_INSERT_ID(1))
ON DUPLICATE KEY UPDATE
  payload = IF(fence < ?, ?, payload),
  writes  = IF(fence < ?, LAST_INSERT_ID(writes + 1), writes),
  fence   = IF(fence < ?, ?, fence)"""

READ_SQL = "SELECT fence, payload FROM latchkey_fenced_rows WHERE id = ?"

#: The naive writer (tests and benchmarks only): overwrites the payload and
#: never compares or raises the mark; bind ``(id, payload, payload)``.
PLAIN_WRITE_SQL = """INSERT INTO latchkey_fenced_rows (id, fence, payload, writes) VALUES (?, 0, ?, 1)
ON DUPLICATE KEY UPDATE payload = ?, writes = writes + 1"""

#: Turns on ``STRICT_ALL_TABLES`` for the session, keeping its other modes:
#: a record name or payload too long for its column is an error, never cut
#: onto another record or short. Run on every session the store uses (after
#: connecting and after any reconnect).
STRICT_SQL = (
    "SET SESSION sql_mode = IF(@@SESSION.sql_mode = '', "
    "'STRICT_ALL_TABLES', CONCAT(@@SESSION.sql_mode, ',STRICT_ALL_TABLES'))"
)

#: name, the DATA_TYPEs accepted, whether COLUMN_TYPE must be unsigned.
REQUIRED_COLUMNS: Sequence[Tuple[str, Sequence[str], bool]] = (
    # VARBINARY: record names compare byte for byte (BINARY pads with zero
    # bytes, so `a` and `a\0` would be one record).
    ("id", ("varbinary",), False),
    ("fence", ("bigint",), True),
    ("payload", ("longblob", "mediumblob", "blob", "varbinary"), False),
    ("writes", ("bigint",), True),
)

COLUMNS_SQL = """SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, \
CAST(COALESCE(CHARACTER_MAXIMUM_LENGTH, 0) AS UNSIGNED), EXTRA FROM information_schema.COLUMNS
 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'latchkey_fenced_rows'"""

#: Triggers that run before a row is written: they can change the mark or the
#: write count the statement set (``SET NEW.fence = OLD.fence`` lets a stale
#: write land and read as applied).
BEFORE_TRIGGERS_SQL = """SELECT TRIGGER_NAME FROM information_schema.TRIGGERS
 WHERE EVENT_OBJECT_SCHEMA = DATABASE() AND EVENT_OBJECT_TABLE = 'latchkey_fenced_rows'
   AND ACTION_TIMING = 'BEFORE'"""

UNIQUE_SQL = """SELECT INDEX_NAME, COLUMN_NAME, SUB_PART IS NOT NULL FROM information_schema.STATISTICS
 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'latchkey_fenced_rows' AND NON_UNIQUE = 0"""

#: The table's storage engine: InnoDB locks the row for the statement and
#: keeps a committed mark through a crash (BLACKHOLE keeps nothing; MyISAM
#: and MEMORY lose marks).
ENGINE_SQL = """SELECT ENGINE FROM information_schema.TABLES
 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'latchkey_fenced_rows'"""

_PROBE_TABLE = "CREATE TEMPORARY TABLE latchkey_fence_probe (id INT PRIMARY KEY, fence BIGINT UNSIGNED)"
_PROBE = (
    "INSERT INTO latchkey_fence_probe (id, fence) VALUES (1, 5) "
    "ON DUPLICATE KEY UPDATE fence = IF(fence < 5, 5, fence)"
)
_PROBE_DROP = "DROP TEMPORARY TABLE latchkey_fence_probe"

# Server errors worth retrying: lock wait timeout, deadlock, too many
# connections, shutdown, connection killed, read-only (a failover), and the
# client's own "cannot connect", "gone away", "lost connection".
_TRANSIENT_ERRNOS = {1205, 1213, 1040, 1053, 1927, 1290, 1792, 2003, 2006, 2013, 2055}


def _pymysql():
    try:
        import pymysql
    except ImportError:
        raise missing_driver("MySQL", "pymysql", "PyMySQL", "mysql") from None
    return pymysql


def _pyformat(sql: str) -> str:
    """The statement with PyMySQL's placeholder (``%s``) for each ``?``: the
    text sent is the Rust statement with the values in place."""
    return sql.replace("%", "%%").replace("?", "%s")


def schema_problems(
    columns: Sequence[Tuple[str, str, str, int, str]],
    unique: Sequence[Tuple],
    before_triggers: Sequence[str] = (),
    engine: Optional[str] = "InnoDB",
) -> Optional[str]:
    """What differs between the table and the reference one, or None.

    ``columns`` are (name, DATA_TYPE, COLUMN_TYPE, CHARACTER_MAXIMUM_LENGTH
    or 0, EXTRA); ``unique`` (index, column[, indexes only a prefix]) for
    every unique index; ``before_triggers`` the names of its BEFORE
    triggers; ``engine`` its storage engine."""
    wrong: List[str] = []
    for name, types, unsigned in REQUIRED_COLUMNS:
        found = [(c[1], c[2]) for c in columns if c[0].lower() == name]
        if not found:
            wrong.append(f"it has no `{name}` column")
            continue
        data_type, column_type = found[0][0].lower(), found[0][1]
        if data_type not in types or (unsigned and "unsigned" not in column_type.lower()):
            wrong.append(
                f"its `{name}` column is {column_type}, not {' or '.join(types)}{' unsigned' if unsigned else ''}"
            )
    ids = [c for c in columns if c[0].lower() == "id"]
    if ids and int(ids[0][3] or 0) < MAX_RECORD_BYTES:
        wrong.append(
            f"its `id` column is {ids[0][2]}, shorter than the {MAX_RECORD_BYTES} bytes a record name may have"
        )
    for column in columns:
        if "auto_increment" in str(column[4] or "").lower():
            wrong.append(
                f"its `{column[0]}` column is AUTO_INCREMENT, whose last-insert id would be read as the write count"
            )
    if before_triggers:
        wrong.append(
            f"it has BEFORE triggers ({', '.join(before_triggers)}), which can change the mark or the write "
            "count the guarded statement sets"
        )
    prefixes = [u for u in unique if len(u) > 2 and u[2]]
    unique = [(u[0], u[1]) for u in unique]
    others = [f"{i}({c})" for i, c in unique if not (i == "PRIMARY" and c.lower() == "id")]
    if others:
        wrong.append(
            f"it has unique keys besides the primary key on `id` ({', '.join(others)}), "
            "on which the upsert could update another row"
        )
    if not any(i == "PRIMARY" and c.lower() == "id" for i, c in unique):
        wrong.append("its primary key is not `id`")
    if prefixes:
        wrong.append(
            "a unique key indexes only a prefix of its column (`id(4)`), so records sharing the "
            "prefix are one row"
        )
    if engine is None:
        wrong.append("its engine is unknown")
    elif engine.lower() != "innodb":
        wrong.append(
            f"its engine is {engine}, not InnoDB (which locks the row for the statement and keeps "
            "a committed mark through a crash)"
        )
    return "; ".join(wrong) or None


def _text(value) -> str:
    """An information_schema value as text (some servers answer bytes)."""
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _found_rows_refused(why: str) -> FenceError:
    return FenceError(
        KIND,
        "checking the affected-row count",
        f"{why}: with CLIENT_FOUND_ROWS an unchanged (fenced-out) row counts as 1 affected, "
        "the same as an insert, so the fence's answer cannot be read; connect without client_found_rows",
    )


def parse_url(url: str) -> dict:
    """``mysql://user:password@host[:port]/database`` as PyMySQL's keyword
    arguments. Refuses ``client_found_rows=true``; errors never repeat the
    URL (it holds a password)."""
    if not url.startswith("mysql://"):
        raise ValueError("a MySQL store URL is mysql://user:password@host[:port]/database")
    try:
        parts = urlsplit(url)
        port = parts.port or 3306
    except ValueError:
        raise ValueError("not a usable mysql:// URL (its port is not a number)") from None
    if not parts.hostname:
        raise ValueError("a mysql:// URL names a host: mysql://user:password@host[:port]/database")
    database = unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise ValueError("a mysql:// URL names one database: mysql://user:password@host[:port]/database")
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "client_found_rows":
            if value.lower() in ("true", "1", "yes"):
                raise _found_rows_refused("the URL sets client_found_rows")
        else:
            raise ValueError(f"unknown mysql:// URL parameter {key!r} (only client_found_rows=false is understood)")
    return {
        "host": parts.hostname,
        "port": port,
        "user": unquote(parts.username or ""),
        "password": unquote(parts.password or ""),
        "database": database,
    }


class MysqlStore(FencedStore):
    """The reference table as a fenced store, over one PyMySQL connection
    (used by one thread at a time)."""

    kind = KIND

    def __init__(self, connection, *, checked: bool = False) -> None:
        """Wraps an open PyMySQL connection in autocommit mode. Refuses a
        connection with CLIENT_FOUND_ROWS (or without autocommit); unless
        ``checked``, creates and checks the reference table and the server's
        affected-row counts. Turns on ``STRICT_ALL_TABLES`` for the
        connection's session (:data:`STRICT_SQL`) before its first statement
        and again after any reconnect (``ping(reconnect=True)``)."""
        pymysql = _pymysql()
        if connection.client_flag & pymysql.constants.CLIENT.FOUND_ROWS:
            raise _found_rows_refused("the connection sets CLIENT_FOUND_ROWS")
        if not connection.get_autocommit():
            raise ValueError(
                "the MySQL fence needs a connection in autocommit mode (pymysql.connect(..., "
                "autocommit=True)): inside an open transaction an Applied write is not yet committed"
            )
        self._conn = connection
        self._lock = threading.Lock()
        # The socket whose session has STRICT_SQL applied (held, so that a
        # reconnect's new socket can never compare equal to it).
        self._strict_sock = None
        if not checked:
            self.ensure_schema()

    @classmethod
    def connect(cls, url: str) -> "MysqlStore":
        """Connects with a ``mysql://`` URL (no TLS), creates the reference
        table if it is missing, checks it, and checks that the server reports
        an unchanged row as 0 affected."""
        pymysql = _pymysql()
        kwargs = parse_url(url)
        try:
            conn = pymysql.connect(autocommit=True, client_flag=0, charset="utf8mb4", **kwargs)
        except pymysql.MySQLError as e:
            err = cls._error("connecting", e, (), kwargs["password"])
        else:
            err = None
        if err is not None:
            raise err
        try:
            return cls(conn)
        except BaseException:
            conn.close()
            raise

    @property
    def connection(self):
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn.open:
                self._conn.close()

    @staticmethod
    def _error(op: str, err, secrets: Sequence[int], password: str = "") -> FenceError:
        args = getattr(err, "args", ())
        if len(args) >= 2 and isinstance(args[0], int):
            errno, text = args[0], str(args[1])
            message = f"{text} (errno {errno})"
            transient = errno in _TRANSIENT_ERRNOS
        else:
            message, transient = str(err) or type(err).__name__, False
        if password:
            message = message.replace(password, "<redacted>")
        return FenceError.scrubbed(KIND, op, message, transient, secrets)

    def _run(self, op: str, sql: str, params: Optional[Sequence[object]], secrets: Sequence[int] = ()):
        """One statement: (affected rows, last-insert id, rows). The caller
        holds the lock. Raised outside ``except``: no driver exception (which
        may hold the token) rides along as the error's context."""
        pymysql = _pymysql()
        try:
            self._ensure_strict()
            with self._conn.cursor() as cur:
                affected = cur.execute(sql, params)
                return affected, cur.lastrowid, cur.fetchall()
        except pymysql.MySQLError as e:
            err = self._error(op, e, secrets)
        raise err

    def _ensure_strict(self) -> None:
        """Runs STRICT_SQL once per session: on the first statement, and on
        the first after the connection was re-established (a new socket).
        Without it a lax server cuts a too-long value instead of refusing."""
        sock = getattr(self._conn, "_sock", None)
        if sock is not None and sock is self._strict_sock:
            return
        with self._conn.cursor() as cur:
            cur.execute(STRICT_SQL)
        self._strict_sock = sock

    def ensure_schema(self) -> None:
        """Creates the reference table if missing; refuses a table of that
        name that is not the reference one; checks the affected-row counts."""
        with self._lock:
            self._run("creating the reference table", CREATE_TABLE_SQL, None)
            op = "checking the reference table"
            _, _, columns = self._run(op, COLUMNS_SQL, None)
            _, _, unique = self._run(op, UNIQUE_SQL, None)
            _, _, triggers = self._run(op, BEFORE_TRIGGERS_SQL, None)
            _, _, engines = self._run(op, ENGINE_SQL, None)
            why = schema_problems(
                [(_text(n), _text(d), _text(c), int(length or 0), _text(x)) for n, d, c, length, x in columns],
                [(_text(i), _text(c), bool(int(p or 0))) for i, c, p in unique],
                [_text(t) for (t,) in triggers],
                _text(engines[0][0]) if engines else None,
            )
            if why:
                raise FenceError(
                    KIND,
                    op,
                    f"the table {TABLE} is not the fence's: {why}; drop or rename it, "
                    "or migrate it to the reference schema",
                )
            self._check_affected_rows()

    def _check_affected_rows(self) -> None:
        op = "checking the affected-row count"
        self._run(op, _PROBE_TABLE, None)
        counts = [self._run(op, _PROBE, None)[0] for _ in range(2)]
        self._run(op, _PROBE_DROP, None)
        if counts != [1, 0]:
            raise _found_rows_refused(
                f"the server reported {counts[0]} then {counts[1]} affected rows for an insert and an "
                "unchanged row (expected 1 then 0)"
            )

    def _check_record(self, record: str) -> None:
        size = len(record.encode("utf-8"))
        if size > MAX_RECORD_BYTES:
            raise ValueError(
                f"the record name is {size} bytes; the fenced table's id holds {MAX_RECORD_BYTES} "
                "(a longer one would be cut by a non-strict server and land on another record)"
            )

    def _guarded_write(self, record: str, token: int, payload: bytes) -> Guarded:
        op = "guarded write"
        rid = record.encode("utf-8")
        with self._lock:
            affected, last_id, _ = self._run(
                op,
                _pyformat(GUARDED_WRITE_SQL),
                (rid, token, payload, token, payload, token, token, token),
                (token,),
            )
            if affected in (1, 2):
                if not last_id:
                    # A trigger on the table (an audit trigger that inserts
                    # elsewhere) leaves the OK packet's id 0; the session's
                    # LAST_INSERT_ID() still holds the statement's value.
                    _, _, rows = self._run("reading the write count", "SELECT LAST_INSERT_ID()", None, (token,))
                    last_id = rows[0][0] if rows else None
                if not isinstance(last_id, int) or last_id <= 0:
                    # The write landed; only its version is unknown. Not a
                    # fence answer to guess at.
                    raise FenceError(
                        KIND,
                        op,
                        "the write was applied but the server reports no last-insert id (the record's "
                        "write count)",
                    )
                return Applied(version=int(last_id))
            if affected != 0:
                raise FenceError(
                    KIND,
                    op,
                    f"{affected} rows affected by a write of one record (expected 0, 1 or 2): the table "
                    "has another unique key, or the count is not MySQL's; refusing to read it",
                )
            # Left as it was: a mark at or above the token, or none at all
            # (the read says which). The read only reports.
            found = self._read_locked(record)
        if found is None:
            raise FenceError(
                KIND,
                op,
                "0 rows affected and the record is missing: the table has another unique key (the "
                "upsert matched another row), or the record was deleted meanwhile; nothing was written",
            )
        return FencedOut(found.mark)

    def _read(self, record: str) -> Optional[Record]:
        with self._lock:
            return self._read_locked(record)

    def _read_locked(self, record: str) -> Optional[Record]:
        _, _, rows = self._run("reading a record", _pyformat(READ_SQL), (record.encode("utf-8"),))
        if not rows:
            return None
        fence, payload = rows[0]
        if fence is None:
            raise Unfenced(KIND, record, "its fence column is NULL")
        if not isinstance(fence, int) or not 0 <= fence < (1 << 64):
            raise Unfenced(KIND, record, "its fence column is not an unsigned 64-bit number")
        return Record(Mark(fence), bytes(payload))

    def _plain_write(self, record: str, payload: bytes) -> None:
        with self._lock:
            self._run("plain write", _pyformat(PLAIN_WRITE_SQL), (record.encode("utf-8"), payload, payload))
