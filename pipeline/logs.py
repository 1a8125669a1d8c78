"""Logging for the long-running commands (`enclave worker`, `serve`, `gateway`) and the in-process API: to
`$ENCLAVE_HOME/logs/enclave.log`, rotated by size by default (`[logs]` settings), as text or as one JSON
object per line (`ENCLAVE_LOG_FORMAT=json`, for a log collector). Log lines carry ids, counts, codes and
timings, never content; exceptions are logged by type and stack (`errors.stack_without_message`).

Several processes write the one file (workers, the API, commands), so rotation takes a lock beside the file,
and a process whose file was rotated away by another reopens it before its next line."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
from datetime import UTC, datetime
from logging.handlers import RotatingFileHandler
from pathlib import Path

from pipeline.settings import LogSettings, Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, process, thread and, for an
    exception, its formatted stack."""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False)


class SharedRotatingFileHandler(RotatingFileHandler):
    """A size-rotated log file that several processes append to: each record is written under an exclusive
    lock beside the file, after reopening the file if another process rotated it away."""

    def __init__(self, filename: Path, max_bytes: int, backups: int) -> None:
        super().__init__(filename, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self._lock_path = f"{self.baseFilename}.lock"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with open(self._lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._reopen_if_moved()
                super().emit(record)
        except OSError:
            self.handleError(record)

    def _reopen_if_moved(self) -> None:
        if self.stream is None:
            return
        try:
            current = os.stat(self.baseFilename)
        except FileNotFoundError:
            current = None
        opened = os.fstat(self.stream.fileno())
        if current is None or (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino):
            self.stream.close()
            self.stream = self._open()


def formatter(settings: LogSettings) -> logging.Formatter:
    return JsonFormatter() if settings.log_format == "json" else logging.Formatter(TEXT_FORMAT)


def file_handler(settings: Settings) -> logging.Handler:
    """The home's log file, rotated by size, in the configured format."""
    file = settings.home / "logs" / "enclave.log"
    file.parent.mkdir(parents=True, exist_ok=True)
    handler = SharedRotatingFileHandler(file, settings.logs.log_max_bytes, settings.logs.log_backups)
    handler.setFormatter(formatter(settings.logs))
    return handler


def configure(settings: Settings, level: str = "INFO") -> Path:
    """The root logger to the home's log file and to stderr (both in the configured format); the file."""
    handler = file_handler(settings)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(formatter(settings.logs))
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), handlers=[handler, console], force=True
    )
    return Path(handler.baseFilename)
