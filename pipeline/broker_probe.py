"""Looking into the broker without Celery: the marker that says it still holds what it was sent, and how many
messages wait in its queue.

The marker is a random id written into the broker and into the database (`rebuild.py`). A broker that lost
its messages (the embedded file deleted or corrupted, Redis restarted without persistence, a FLUSHDB) lost
the marker with them. Supported: Redis (`redis://`, `rediss://`), the embedded SQLite broker and Kombu's
SQLAlchemy transport on another database; for any other broker `supported` is False and a lost broker is
only rebuilt by `enclave broker rebuild`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from pipeline.embedded_broker import sqlite_path

MARKER_KEY = "enclave:broker-marker"  # Redis
MARKER_TABLE = "enclave_marker"  # SQL brokers: one row
QUEUE = "celery"  # the default queue the shard tasks go to
REDIS_PRIORITY_SEP = "\x06\x16"  # Kombu's Redis transport keeps priority p of queue q in list "q<sep>p"


class BrokerUnavailable(Exception):
    """The broker cannot be reached now (its message is the cause's type only)."""


class BrokerUnreadable(Exception):
    """The embedded broker's file exists but SQLite cannot read it."""


class BrokerProbe:
    """Reads and writes the marker of the broker at `url`, and counts the messages waiting in a queue."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.path: Path | None = sqlite_path(url)
        self.redis = url.startswith(("redis://", "rediss://"))
        self.sql_url = url.split("+", 1)[1] if url.startswith(("sqla+", "sqlalchemy+")) else None

    @property
    def supported(self) -> bool:
        return self.redis or self.sql_url is not None

    def read(self) -> str | None:
        """The marker the broker holds, or None (never written, or lost with the messages)."""
        if self.path is not None:
            return self._sqlite(lambda c: _select_marker(c))
        if self.redis:
            value = self._redis(lambda r: r.get(MARKER_KEY))
            return value.decode() if value is not None else None
        if self.sql_url is not None:
            return self._sql(_select_marker_sql)
        return None

    def write(self, marker: str) -> None:
        if self.path is not None:
            self._sqlite(lambda c: _replace_marker(c, marker), create=True)
        elif self.redis:
            self._redis(lambda r: r.set(MARKER_KEY, marker))
        elif self.sql_url is not None:
            self._sql(lambda c: _replace_marker_sql(c, marker))

    def queue_depth(self, queue: str = QUEUE) -> int | None:
        """Messages waiting in `queue` (not yet taken by a worker); None when it cannot be counted."""
        if self.path is not None:
            return self._sqlite(lambda c: _count_messages(c, queue))
        if self.redis:
            names = [queue, *(f"{queue}{REDIS_PRIORITY_SEP}{p}" for p in range(1, 10))]
            return self._redis(lambda r: sum(r.llen(n) for n in names))
        return None

    def _sqlite(self, operation, create: bool = False):
        if not create and not self.path.exists():
            return None
        try:
            connection = sqlite3.connect(self.path, timeout=10)
        except sqlite3.Error as exc:
            raise BrokerUnavailable(type(exc).__name__) from None
        try:
            with connection:
                return operation(connection)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc) or "unable to open" in str(exc):
                raise BrokerUnavailable(type(exc).__name__) from None
            raise BrokerUnreadable(str(self.path)) from None
        except sqlite3.DatabaseError:
            raise BrokerUnreadable(str(self.path)) from None
        finally:
            connection.close()

    def _redis(self, operation):
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=3, socket_connect_timeout=3)
        try:
            return operation(client)
        except redis.RedisError as exc:
            raise BrokerUnavailable(type(exc).__name__) from None
        finally:
            client.close()

    def _sql(self, operation):
        from sqlalchemy import create_engine
        from sqlalchemy.exc import SQLAlchemyError
        from sqlalchemy.pool import NullPool

        engine = create_engine(self.sql_url, poolclass=NullPool)
        try:
            with engine.begin() as connection:
                return operation(connection)
        except SQLAlchemyError as exc:
            raise BrokerUnavailable(type(exc).__name__) from None
        finally:
            engine.dispose()


def _select_marker(connection: sqlite3.Connection) -> str | None:
    exists = connection.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (MARKER_TABLE,)
    ).fetchone()
    if not exists:
        return None
    row = connection.execute(f"SELECT marker FROM {MARKER_TABLE}").fetchone()
    return row[0] if row else None


def _replace_marker(connection: sqlite3.Connection, marker: str) -> None:
    connection.execute(f"CREATE TABLE IF NOT EXISTS {MARKER_TABLE} (marker TEXT NOT NULL)")
    connection.execute(f"DELETE FROM {MARKER_TABLE}")
    connection.execute(f"INSERT INTO {MARKER_TABLE} (marker) VALUES (?)", (marker,))


def _count_messages(connection: sqlite3.Connection, queue: str) -> int:
    tables = {r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"kombu_queue", "kombu_message"} <= tables:
        return 0
    return connection.execute(
        "SELECT count(*) FROM kombu_message m JOIN kombu_queue q ON m.queue_id = q.id "
        "WHERE q.name = ? AND m.visible",
        (queue,),
    ).fetchone()[0]


def _select_marker_sql(connection) -> str | None:
    from sqlalchemy import inspect, text

    if not inspect(connection).has_table(MARKER_TABLE):
        return None
    return connection.execute(text(f"SELECT marker FROM {MARKER_TABLE}")).scalar()


def _replace_marker_sql(connection, marker: str) -> None:
    from sqlalchemy import text

    connection.execute(text(f"CREATE TABLE IF NOT EXISTS {MARKER_TABLE} (marker VARCHAR(64) NOT NULL)"))
    connection.execute(text(f"DELETE FROM {MARKER_TABLE}"))
    connection.execute(text(f"INSERT INTO {MARKER_TABLE} (marker) VALUES (:m)"), {"m": marker})
