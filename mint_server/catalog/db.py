"""Engines, transactions and migrations.

Transactions come in two kinds, chosen by an execution option on the engine:

* read: SQLite `BEGIN DEFERRED` (a WAL snapshot that never blocks writers); plain BEGIN on PostgreSQL.
* write: SQLite `BEGIN IMMEDIATE`, which takes the single writer lock up front, so a
  read-then-write transaction can never fail half-way with SQLITE_BUSY and concurrent writers
  (threads or processes) queue on busy_timeout. On PostgreSQL writers lock the rows they change
  (`SELECT … FOR UPDATE` on the policy row) instead.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from mint_server.catalog.errors import InvalidArgument
from mint_server.fsutil import DiskFull

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
VERSION_TABLE = "catalog_alembic_version"  # also named in migrations/env.py
# The newest migration. Opening an up-to-date catalog compares against this instead of loading
# Alembic and its scripts (a test keeps it equal to the real head).
HEAD = "0004"
WRITE = "mint_catalog_write"  # execution option marking a write transaction
BUSY_TIMEOUT_MS = 30_000

# PostgreSQL advisory-lock keys (arbitrary constants, unique to the catalog).
MIGRATION_LOCK = 0x6D696E74_0001
# Publishers hold this shared and GC holds it exclusive; see Catalog.gc for why.
BLOB_LOCK = 0x6D696E74_0002


def default_url(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / 'catalog.db'}"


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL, foreign keys, busy_timeout and explicit BEGINs."""
    parsed = make_url(url)
    # A server runs sync routes on a 40-thread pool; let most of them hold a connection at once.
    pool = {"pool_size": 10, "max_overflow": 30}
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True, **pool)
    if not parsed.database or parsed.database == ":memory:":
        raise InvalidArgument(
            "url: the catalog needs a file-backed SQLite database, not :memory:", field="url"
        )
    Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, **pool)
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    # Turn off the sqlite3 module's own implicit BEGINs so that _sqlite_on_begin decides the kind.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # busy_timeout first: switching to WAL needs a lock another process may briefly hold.
    cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode = WAL")
    # FULL: a commit is on disk when it returns (WAL + NORMAL could lose the last commits on power loss).
    cursor.execute("PRAGMA synchronous = FULL")
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.execute("PRAGMA cache_size = -65536")  # 64 MiB: keeps the hot index pages of 10^6 policies
    # Random lookups in a large catalog (800 MB at 10^6 policies) read pages through the map
    # instead of a pread + copy each: ~10% off median resolve latency, more off the tail.
    cursor.execute("PRAGMA mmap_size = 1073741824")
    cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
    write = connection.get_execution_options().get(WRITE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN DEFERRED")


@contextmanager
def full_database_named() -> Iterator[None]:
    """A write transaction that fails for want of room (SQLite SQLITE_FULL, PostgreSQL 53100
    disk_full) is rolled back; say so as DiskFull rather than as a database error."""
    try:
        yield
    except sa_exc.OperationalError as e:
        full = "database or disk is full" in str(e.orig) or getattr(e.orig, "sqlstate", None) == "53100"
        if not full:
            raise
        raise DiskFull(errno.ENOSPC, "not enough room to write the catalog database; the change was rolled back "
                                     "(free disk space, then retry)") from e


def writer(engine: Engine) -> Engine:
    """The same engine (and pool) with the write-transaction option set."""
    return engine.execution_options(**{WRITE: True})


def current_version(engine: Engine) -> str | None:
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    except sa_exc.DBAPIError:
        return None  # no version table yet: a new database


def migrate(engine: Engine) -> None:
    """`alembic upgrade head`, serialized across processes so concurrent first opens are safe."""
    if current_version(engine) == HEAD:
        return
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with writer(engine).begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        # Alembic sees the transaction is already open and runs inside it, so DDL and the version
        # stamp commit together (both backends have transactional DDL).
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
