"""`enclave db backup FILE`: a consistent copy of the embedded SQLite database, through SQLite's online
backup API. A plain file copy of a database in WAL mode misses what is still in its write-ahead log (a copy
once held 2 of 31 audit events); the backup API copies the database as one transaction sees it, WAL
included, while workers and the API keep writing.

The copy holds everything the database holds (sealed documents and results, the audit log): it is written
0600. The service keys live in the home's `service/` folder, not in the database; back them up apart, or the
copy's ciphertext cannot be opened. PostgreSQL is backed up with its own tool, `pg_dump`.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from pipeline.errors import UserError


@dataclass(frozen=True)
class Backup:
    """The copy: where, how many bytes, and how many audit events it holds."""

    path: Path
    size: int
    audit_events: int


def backup(database_url: str, target: Path, force: bool = False) -> Backup:
    """Copy the SQLite database at `database_url` to `target` (refused if it exists, unless `force`)."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        shown = url.set(drivername=url.get_backend_name()).render_as_string(hide_password=True)
        raise UserError(
            f"the database is {url.get_backend_name()}: back it up with pg_dump, e.g. pg_dump "
            f"--format=custom --file {target} '{shown}' (restore: pg_restore)"
        )
    source = Path(url.database or "")
    if not source.is_file():
        raise UserError(f"no database at {source}: run `enclave init` first (or check ENCLAVE_HOME)")
    if target.exists() and not force:
        raise UserError(f"{target} exists; give another file, or --force to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.unlink(missing_ok=True)
    os.close(os.open(partial, os.O_CREAT | os.O_WRONLY, 0o600))  # 0600 before a byte is written
    src = sqlite3.connect(source, timeout=30)
    dst = sqlite3.connect(partial)
    try:
        src.backup(dst, pages=1024)  # a step at a time: writers are held up for a step, not the whole copy
        dst.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
        if dst.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise UserError(f"the copy at {partial} does not pass SQLite's check; try again")
        events = dst.execute("SELECT count(*) FROM audit_events").fetchone()[0]
    finally:
        dst.close()
        src.close()
    os.replace(partial, target)
    return Backup(target, target.stat().st_size, events)
