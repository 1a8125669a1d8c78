"""Signed heads kept outside the database, where someone who controls the database cannot remove them.

Every head the service signs is appended, after its transaction commits, to two files of JSON lines (one
`SignedHead.line()` each):

- the home's own `service/audit_heads.jsonl`, beside the service keys: `enclave audit verify` checks the
  database against it, so a truncated tail, a deleted checkpoint or a wiped log fails without anything else;
- `ENCLAVE_AUDIT_HEADS_FILE`, when the operator sets one: a path on a write-once or append-only mount (e.g.
  `chattr +a`, a WORM share), for `enclave audit verify --against FILE`, which catches a database rolled back
  together with the home.

Appends open the file with O_APPEND, take an exclusive flock (workers of one host share the home), write the
line in one call and fsync; a new file's directory is fsynced too. A file that cannot be written is logged
and skipped: the signed head is already committed, and the next one covers it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.audit_heads import MAX_LINE, HeadError, SignedHead
from pipeline.settings import Settings

LOCAL_FILE = "audit_heads.jsonl"
log = logging.getLogger("enclave.audit")


class HeadsFileError(HeadError):
    """A heads file is missing, unreadable or holds a line that is not a signed head."""


def local_path(service_key_dir: Path) -> Path:
    """The home's own heads file, beside the service keys."""
    return Path(service_key_dir) / LOCAL_FILE


def append(path: Path, head: SignedHead) -> None:
    """Append `head` as one line, durably (fsync); OSError if the file cannot be written."""
    path = Path(path)
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(
            OSError
        ):  # no locks here: O_APPEND still keeps one write() whole on local disks
            fcntl.flock(fd, fcntl.LOCK_EX)
        line = head.line()
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"short write ({written} of {len(line)} bytes)")
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True)
class KeptHead:
    """A head read from a heads file, and where: "FILE line N"."""

    head: SignedHead
    source: str


def read(path: Path) -> list[KeptHead]:
    """Every head in a heads file, in file order; blank lines are skipped. HeadsFileError names the first line
    that is not a signed head, or why the file cannot be read."""
    return list(_lines(Path(path)))


def _lines(path: Path) -> Iterator[KeptHead]:
    try:
        file = path.open("rb")
    except FileNotFoundError:
        raise HeadsFileError(f"no heads file at {path}") from None
    except OSError as exc:
        raise HeadsFileError(f"cannot read the heads file {path}: {exc.strerror}") from None
    with file:
        for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE + 2), b""), start=1):
            if not raw.strip():
                continue
            where = f"{path} line {number}"
            if not raw.endswith(b"\n") and len(raw) > MAX_LINE:
                raise HeadsFileError(f"{where} is longer than a signed tree head ({MAX_LINE} bytes at most)")
            try:
                head = SignedHead.parse(raw, where)
            except HeadError as exc:
                raise HeadsFileError(str(exc)) from None
            yield KeptHead(head, where)


class Publisher:
    """Appends each signed head to the home's file and, if set, the operator's file (`audit.checkpoint` calls
    it after the head's transaction commits)."""

    def __init__(self, local: Path, external: Path | None = None) -> None:
        self.paths = [Path(local)] + ([Path(external)] if external is not None else [])

    def __call__(self, head: SignedHead) -> None:
        for path in self.paths:
            try:
                append(path, head)
            except OSError as exc:
                log.error(
                    "cannot append the signed audit head of size %d to %s (%s): `enclave audit verify "
                    "--against` will find that file behind the database",
                    head.tree_size,
                    path,
                    exc.strerror or exc,
                )


def publisher(settings: Settings) -> Publisher:
    """The publisher of a service home: its own heads file and ENCLAVE_AUDIT_HEADS_FILE, if set."""
    return Publisher(local_path(settings.service_key_dir), settings.audit_heads_file)
