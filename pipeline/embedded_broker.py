"""The embedded broker: Kombu's SQLAlchemy transport on a SQLite file in the home (`broker.db`), made to
survive that file being deleted or corrupted while workers and the API use it.

- Every operation opens the file anew (no connection pool), so a deleted file is replaced by a fresh one that
  every process sees, instead of living on in the open handles of some of them.
- A fresh file gets its tables (`kombu_queue`, `kombu_message`) when an operation finds them missing.
- A file SQLite cannot read (its first page overwritten, say) is moved aside as `broker.db.unreadable-<time>`,
  under a lock and with one log line, and a fresh file takes its place.

The messages such a file held are lost. The database still knows every open shard: `rebuild.py` notices
that the broker lost its marker and dispatches them again. The transport also polls every 0.1 s instead of
1 s (its transport options all go to `create_engine`, so the interval cannot be one of them).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kombu.transport.sqlalchemy import Channel as SQLAlchemyChannel
from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport
from kombu.transport.sqlalchemy.models import metadata
from sqlalchemy import create_engine
from sqlalchemy.exc import DatabaseError
from sqlalchemy.pool import NullPool

log = logging.getLogger("enclave.broker")
SIDE_FILES = ("-journal", "-wal", "-shm")


def sqlite_path(url: str) -> Path | None:
    """The file of an embedded broker URL (`sqla+sqlite:///path`), or None for any other broker."""
    for prefix in ("sqla+sqlite:///", "sqlalchemy+sqlite:///"):
        if url.startswith(prefix):
            return Path(url.removeprefix(prefix).split("?", 1)[0])
    return None


def readable(path: Path) -> bool:
    """Whether SQLite can read `path` as a database (a missing file counts as readable: it will be made)."""
    if not path.exists():
        return True
    try:
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error:
        return False
    try:
        connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return connection.execute("PRAGMA quick_check(1)").fetchone()[0] == "ok"
    except sqlite3.OperationalError as exc:  # locked or busy: a live file, not a corrupt one
        return "locked" in str(exc) or "busy" in str(exc)
    except sqlite3.DatabaseError:
        return False
    finally:
        connection.close()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`, so that two processes never both move a file aside (the second
    would move the fresh one the first just made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def move_aside_if_unreadable(path: Path) -> Path | None:
    """Move an unreadable broker file (and its journal) aside, so that a fresh one replaces it; where it went,
    or None when the file is readable (another process may have replaced it already)."""
    with _locked(path):
        if readable(path):
            return None
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        target = path.with_name(f"{path.name}.unreadable-{stamp}")
        os.replace(path, target)
        for suffix in SIDE_FILES:
            side = path.with_name(path.name + suffix)
            if side.exists():
                os.replace(side, target.with_name(target.name + suffix))
    log.warning(
        "embedded broker %s could not be read (corrupted): moved it to %s; a fresh one replaces it and the "
        "database's open shards are dispatched again",
        path,
        target.name,
    )
    return target


def _missing_tables(exc: DatabaseError) -> bool:
    return "no such table" in str(exc.orig)


def _corrupt(exc: DatabaseError) -> bool:
    """SQLite's words for a file it cannot read as a database."""
    text = str(exc.orig)
    return "not a database" in text or "malformed" in text


class EmbeddedChannel(SQLAlchemyChannel):
    """Kombu's SQLAlchemy channel on a SQLite file that may be deleted or corrupted under it."""

    def _engine_from_config(self):
        url = self.connection.client.hostname
        if url.startswith("sqlite"):  # each operation opens the file at its path: never a deleted one
            return create_engine(url, poolclass=NullPool)
        return super()._engine_from_config()

    @property
    def path(self) -> Path:
        return Path(self.connection.client.hostname.removeprefix("sqlite:///"))

    def _guarded(self, operation: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`operation`, run again after a missing table was made or an unreadable file replaced (a fresh
        file may need both). Other errors (a lock held too long, a full disk) are Kombu's to retry."""
        attempts = 0
        while True:
            try:
                return operation(*args, **kwargs)
            except DatabaseError as exc:
                attempts += 1
                if attempts == 3 or not (_missing_tables(exc) or _corrupt(exc)):
                    raise
                self._reset_session()
                if _missing_tables(exc):
                    metadata.create_all(self._open()[0])
                else:
                    move_aside_if_unreadable(self.path)  # None: another process replaced it already

    def _reset_session(self) -> None:
        if self._session is not None:
            try:
                self._session.rollback()
                self._session.close()
            except Exception:  # the session's connection may be the broken one; it is dropped either way
                pass
            self._session = None

    def _get(self, queue):
        return self._guarded(super()._get, queue)

    def _put(self, queue, payload, **kwargs):
        return self._guarded(super()._put, queue, payload, **kwargs)

    def _size(self, queue):
        return self._guarded(super()._size, queue)

    def _purge(self, queue):
        return self._guarded(super()._purge, queue)


class EmbeddedTransport(SQLAlchemyTransport):
    """Kombu's SQLAlchemy transport as Enclave uses it (`sqla+...`, registered by `pipeline.celery_app`): the
    guarded channel above on SQLite, and a 0.1 s polling interval on any database."""

    Channel = EmbeddedChannel
    polling_interval = 0.1
