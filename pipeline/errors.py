"""Turn any exception into one line for the user. Expected errors say what to do; unexpected ones are logged
with their stack (message dropped: it may quote data) and reported by type.

Enclave's own expected errors derive from `UserError`. Expected errors of other packages (the job kinds'
parameter and batch-file errors, the engine's, the database's and the broker's) are listed in `DESCRIBED`,
by the dotted name of their class: nothing is imported to describe an error, so a client install, which
has no database driver, broker or engine, describes every error it can meet.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("enclave")
NOT_INITIALISED = "the database is not initialised: run `enclave init` (or `enclave db upgrade`)"


class UserError(Exception):
    """An error the user can act on: its message is one line that says what to do and quotes no content."""


def first_line(text: str) -> str:
    """The first non-empty line of `text`, stripped ("" for none)."""
    return text.strip().splitlines()[0] if text.strip() else ""


def _message(exc: BaseException) -> str:
    return first_line(str(exc)) or type(exc).__name__


def _batch_file(exc: BaseException) -> str:
    from jobs.openai_batch import join_bounded  # its problems are content-free: line numbers, offsets, fields

    errors = getattr(exc, "errors", None) or [str(exc)]
    return f"the batch file has {len(errors)} bad line(s), nothing was stored: " + join_bounded(errors, 2000)


def database_message(exc: BaseException) -> str:
    """One line for a database error (SQLAlchemy's): not initialised, cannot be opened, or its first line."""
    reason = str(getattr(exc, "orig", exc))
    if "no such table" in reason.lower() or (
        type(exc).__name__ == "ProgrammingError" and "does not exist" in reason
    ):
        return NOT_INITIALISED
    if "unable to open database file" in reason:
        return "the database file cannot be opened: run `enclave init` first (or check ENCLAVE_HOME)"
    return f"database error: {first_line(reason)}"


def _broker(exc: BaseException) -> str:
    return f"cannot reach the broker: {first_line(str(exc))}"


# Expected errors of other packages: dotted class name -> its one line. A subclass is found through its MRO.
DESCRIBED: dict[str, Callable[[BaseException], str]] = {
    "jobs.openai_batch.BatchFileError": _batch_file,
    "jobs.params.JobParamError": _message,
    "engine.errors.EngineError": _message,
    "engine.env.EnvError": _message,
    "sqlalchemy.exc.DBAPIError": database_message,
    "kombu.exceptions.OperationalError": _broker,
    "builtins.FileNotFoundError": _message,
    "builtins.PermissionError": _message,
    "builtins.IsADirectoryError": _message,
    "builtins.NotADirectoryError": _message,
}


def _described(exc: BaseException) -> Callable[[BaseException], str] | None:
    for cls in type(exc).__mro__:
        if cls is UserError:
            return _message
        if found := DESCRIBED.get(f"{cls.__module__}.{cls.__qualname__}"):
            return found
    return None


def describe(exc: BaseException, home: Path) -> str:
    """One line for `exc`; an unexpected error's stack goes to `home`/logs/enclave.log (the home the command
    was given, passed in: the settings may be what failed)."""
    if (describer := _described(exc)) is not None:
        return describer(exc)
    try:
        where = f"the stack trace is in {_log_internal(exc, home)}"
    except OSError as failed:  # the home is unwritable: the error still gets its one line
        reason = failed.strerror or type(failed).__name__
        where = f"its stack trace could not be written under {home} ({reason})"
    return f"internal error ({type(exc).__name__}); {where}"


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
