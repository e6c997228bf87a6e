"""Which DB-API driver a SQL connection uses, and how its rows are read.

The connection's ``driver`` option picks it: ``auto`` (the default) uses the fastest
driver that is installed for the URL's database, whatever driver the URL names, so
``mysql+pymysql://...`` keeps working and is read through MariaDB Connector/C when the
``mariadb`` package is there. Measured on TPC-H orders (150k rows x 6 columns, SF 0.1;
``benchmarks/connectors.py drivers``), fastest first:

    MySQL / MariaDB   mariadbconnector (``mariadb``: MariaDB Connector/C, binary protocol,
                      server-side prepared statements), else pymysql (pure Python, always
                      installed); mysqldb (``mysqlclient``) only when asked for
    PostgreSQL        the URL's driver (psycopg 3 or psycopg2)

``driver: <name>`` forces one (``pymysql``, ``mysqldb``, ``mariadbconnector``), and
``driver: url`` keeps the URL's; the environment variable ``FABRIC_SQL_DRIVER`` gives the
value for connections that do not set the option (the tests run under both). The fast MySQL drivers compile against the MariaDB client
library: ``apt-get install libmariadb-dev pkg-config`` then ``pip install
'agent-data-fabric[fast]'`` (``scripts/bootstrap`` does both).

Every driver is given the statement with its session values as bound parameters;
MariaDB Connector/C sends them in the binary protocol (``cursor(binary=True)``, a
server-side prepared statement), the others escape them into the statement themselves.
Rows are read from the DB-API cursor as tuples, without SQLAlchemy's per-row processing
(which cost ~3x the driver's own time), and become Arrow columns in ``connectors.sql``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, CursorResult, Engine

#: MySQL drivers ``auto`` chooses from, fastest first: (SQLAlchemy driver name, module).
#: mysqlclient (``mysqldb``, between the two in speed) is taken only when asked for: loaded
#: in one process with MariaDB Connector/Python, it crashed the test run once (SIGSEGV
#: reading an interrupted statement), so it is not a default.
MYSQL_DRIVERS = (("mariadbconnector", "mariadb"), ("pymysql", "pymysql"))
_MODULE = {**dict(MYSQL_DRIVERS), "mysqldb": "MySQLdb"}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def choose(url: URL, option: Any = None) -> URL:
    """``url`` with the driver the ``driver`` option asks for (see the module doc)."""
    want = str(option or os.environ.get("FABRIC_SQL_DRIVER") or "auto").strip().lower()
    if want == "url" or url.get_backend_name() not in ("mysql", "mariadb"):
        return url
    if want == "auto":
        name = next(n for n, m in MYSQL_DRIVERS if installed(m))
    elif want in _MODULE:
        if not installed(_MODULE[want]):
            raise ValueError(
                f"driver {want!r} needs the Python module {_MODULE[want]!r}, which is not "
                "installed: apt-get install libmariadb-dev pkg-config && "
                "pip install 'agent-data-fabric[fast]' (or use driver: auto)"
            )
        name = want
    else:
        raise ValueError(
            f"unknown SQL driver {option!r} for {url.get_backend_name()}; use auto, url or "
            + ", ".join(_MODULE)
        )
    return url.set(drivername=f"{url.get_backend_name()}+{name}")


def prepare_engine(engine: Engine, ping_timeout: float = 5.0) -> None:
    """Streaming cursors of MariaDB Connector/C use the binary protocol (server-side
    prepared statements: parameters bound, not escaped into the text), buffered: the
    client library holds the whole result (compact, in C) and Python reads it in batches.
    Its unbuffered cursor is not used: Connector/Python 1.1.14 ended such a result quietly
    when the server interrupted the statement (max_statement_time: 68,818 of 1,000,000
    rows and no error), and the test run that read one crashed later (heap corruption)."""
    if engine.dialect.driver != "mariadbconnector":
        return
    base = engine.dialect.execution_ctx_cls

    class _BinaryStreaming(base):  # type: ignore[misc,valid-type]
        def create_server_side_cursor(self) -> Any:
            return self._dbapi_connection.cursor(buffered=True, binary=True)

    engine.dialect.execution_ctx_cls = _BinaryStreaming
    sa.event.listen(engine, "checkout", lambda c, rec, _p: _ping(c, rec, ping_timeout))


def _ping(dbapi_conn: Any, record: Any, timeout: float) -> None:
    """Pessimistic disconnect handling for Connector/C, waiting at most ``timeout`` (the
    connect timeout) for the server's answer; its own ``ping()`` waits the read timeout
    (set when connecting, not changeable after). The ping runs on a thread; one that has
    no answer in time keeps the connection (the pool forgets it and connects anew) and
    closes it when its ping ends, so no two threads use one connection."""
    done = threading.Event()
    lock = threading.Lock()
    failed: list[BaseException] = []
    orphaned: list[bool] = []

    def run() -> None:
        try:
            dbapi_conn.ping()
        except Exception as exc:
            failed.append(exc)
        with lock:  # the caller gave up on it, or will see it done: never both
            done.set()
            mine = bool(orphaned)
        if mine:
            with contextlib.suppress(Exception):
                dbapi_conn.close()

    threading.Thread(target=run, name="fabric-sql-ping", daemon=True).start()
    if not done.wait(timeout):
        with lock:
            if not done.is_set():
                orphaned.append(True)
                record.dbapi_connection = None  # the ping thread closes it; the pool reconnects
        raise sa_exc.DisconnectionError(f"ping unanswered after {timeout:g} s")
    if failed:
        raise sa_exc.DisconnectionError(f"ping failed: {failed[0]}") from failed[0]


#: drivers whose cursors return Python values of the columns' types (date, Decimal, ...)
NATIVE_TYPES = frozenset({"mariadbconnector", "mysqldb", "pymysql", "psycopg", "psycopg2"})


def partitions(result: CursorResult[Any], size: int) -> Iterator[list[tuple[Any, ...]]]:
    """The rows of a streaming ``result`` in lists of ``size``, read from the DB-API cursor
    (the one row SQLAlchemy fetched ahead comes first) for the drivers that return typed
    values themselves; through SQLAlchemy's rows for the others (SQLite returns times as
    text, which SQLAlchemy's result processing parses)."""
    if result.dialect.driver not in NATIVE_TYPES:
        for part in result.partitions(size):
            yield [tuple(r) for r in part]
        return
    # the row SQLAlchemy fetched ahead, as the driver returned it: fetchone() would run
    # SQLAlchemy's result processors on it (MySQL DOUBLE -> Decimal rounded to 10 digits)
    first = result.cursor_strategy.fetchone(result, result.cursor)
    if first is None:
        return
    cur = result.cursor
    rows: list[Any] = [tuple(first), *cur.fetchmany(size - 1)]
    while rows:
        yield rows
        rows = list(cur.fetchmany(size))


def single_floats(result: CursorResult[Any]) -> list[int]:
    """Positions of the single-precision FLOAT columns in a MariaDB Connector/C result:
    the binary protocol sends their float32 value (3.7 arrives as 3.700000047683716), which
    ``shortest`` turns into the shortest decimal that is the same float32 (3.7); the text
    protocol of the other drivers sends the server's 6-digit rendering instead."""
    if result.dialect.driver != "mariadbconnector":
        return []
    return [i for i, d in enumerate(result.cursor.description or ()) if d[1] == _FLOAT]


_FLOAT = 4  # MYSQL_TYPE_FLOAT (mariadb.constants.FIELD_TYPE.FLOAT)


def shortest(a: pa.Array) -> pa.Array:
    """float64 values that are float32s as the shortest decimals with the same float32."""
    return a.cast(pa.float32()).cast(pa.string()).cast(pa.float64())


def driver_error(engine: Engine) -> type[BaseException]:
    """The DB-API error class of the engine's driver (raised while reading the cursor)."""
    return engine.dialect.loaded_dbapi.Error  # type: ignore[no-any-return]
