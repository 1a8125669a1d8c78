"""Database connections: one SQLAlchemy engine per URL, short transactions, the same code on SQLite and
PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL, foreign keys, a busy timeout and serialised writers."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:
            # Let SQLAlchemy issue BEGIN itself (below) so a write transaction takes the lock up front.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(connection) -> None:
            # IMMEDIATE: writers queue on the database lock at BEGIN instead of failing at COMMIT.
            connection.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True)


# PostgreSQL's "serialization_failure" and "deadlock_detected": the transaction lost a race and may be run
# again as it was (PostgreSQL manual, "Serialization Failure Handling").
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})


def is_retryable(exc: BaseException) -> bool:
    """Whether `exc` is a database error that running the same transaction again may clear: a PostgreSQL
    deadlock or serialization failure."""
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) in RETRYABLE_SQLSTATES


class Database:
    """Sessions over one engine. `transaction()` commits on success and rolls back on any error."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_postgresql(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        with self._sessions() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
