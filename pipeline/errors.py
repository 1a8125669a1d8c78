"""Turn any exception into one line for the user. Expected errors say what to do; unexpected ones are logged
with their stack (message dropped: it may quote data) and reported by type."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

log = logging.getLogger("enclave")


def describe(exc: BaseException, home: Path) -> str:
    """One line for `exc`; an unexpected error's stack goes to `home`/logs/enclave.log (the home the command
    was given, passed in: the settings may be what failed)."""
    from kombu.exceptions import OperationalError as BrokerError
    from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

    from engine import EngineError
    from engine.env import EnvError
    from jobs.base import JobParamError
    from jobs.openai_batch import BatchFileError, join_bounded
    from pipeline.client import ClientError
    from pipeline.envelope import EnvelopeError, ManifestError
    from pipeline.keys import KeyFileError
    from pipeline.settings import SettingsError

    if isinstance(exc, BatchFileError):  # its problems are content-free: line numbers, offsets, field names
        errors = getattr(exc, "errors", None) or [str(exc)]
        head = f"the batch file has {len(errors)} bad line(s), nothing was stored: "
        return head + join_bounded(errors, 2000)
    if isinstance(exc, (OperationalError, ProgrammingError)) and "no such table" in str(exc.orig).lower():
        return "the database is not initialised: run `enclave init` (or `enclave db upgrade`)"
    if isinstance(exc, ProgrammingError) and "does not exist" in str(exc.orig):
        return "the database is not initialised: run `enclave init` (or `enclave db upgrade`)"
    if isinstance(exc, OperationalError) and "unable to open database file" in str(exc.orig):
        return "the database file cannot be opened: run `enclave init` first (or check ENCLAVE_HOME)"
    if isinstance(exc, DBAPIError):
        return f"database error: {_first_line(str(exc.orig))}"
    if isinstance(exc, BrokerError):
        return f"cannot reach the broker: {_first_line(str(exc))}"
    known = (
        SettingsError,
        EnvError,
        KeyFileError,
        EnvelopeError,
        ManifestError,
        ClientError,
        JobParamError,
        EngineError,
        FileNotFoundError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
    )
    if isinstance(exc, known):
        return _first_line(str(exc)) or type(exc).__name__
    try:
        where = f"the stack trace is in {_log_internal(exc, home)}"
    except OSError as failed:  # the home is unwritable: the error still gets its one line
        reason = failed.strerror or type(failed).__name__
        where = f"its stack trace could not be written under {home} ({reason})"
    return f"internal error ({type(exc).__name__}); {where}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def stack_without_message(exc: BaseException) -> str:
    """The exception's type and stack frames; its message is dropped, since messages can quote data."""
    frames = "".join(traceback.format_tb(exc.__traceback__))
    return f"{type(exc).__name__} (message withheld: it may quote data)\n{frames}"


def _log_internal(exc: BaseException, home: Path) -> Path:
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    file = logs / "enclave.log"
    with open(file, "a") as f:
        f.write(f"internal error {stack_without_message(exc)}\n")
    return file
