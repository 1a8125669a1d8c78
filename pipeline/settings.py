"""Service settings, read once at start-up (by the CLI or the worker, never at import time) from the
environment and an optional `enclave.toml` in the home. Environment variables win over the file.

Production values are URLs such as `postgresql+psycopg://user@host/db` and `redis://host:6379/0`.
Every value is checked at load: numbers have ranges (nan, infinities, overflow and non-numbers are refused),
the file's keys must be known ones, and each refusal is one line naming the variable or the file's key.

This module is the pipeline's registry of `ENCLAVE_*` variables: `variables()` lists each one, built from the
fields below (their descriptions are its documentation), and `settings_table()` renders it, with the engine's
(`engine/env.py`), as the README's table: `python -m pipeline.settings --readme README.md` rewrites it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass

from engine.options import EngineOptions, OptionError, OptionField
from pipeline.errors import UserError

MAX_TOML_BYTES = 64 << 10
_CHECKED = ConfigDict(extra="forbid", allow_inf_nan=False)


class SettingsError(UserError, ValueError):
    """A setting is malformed; the message is one line naming it."""


def setting(
    doc: str, default: Any = ..., *, shown: str | None = None, accepts: str | None = None, **checks: Any
) -> Any:
    """A field with its meaning (the README's settings table lists it), how its default reads where it is
    worked out at load time (`shown`), and what it accepts where type and checks do not say (`accepts`)."""
    extra = {key: text for key, text in (("shown", shown), ("accepts", accepts)) if text}
    return Field(default, description=doc, json_schema_extra=extra or None, **checks)


@dataclass(frozen=True, config=_CHECKED)
class _Numbers:
    """Refuses booleans where numbers are expected (Python and pydantic both count True as 1)."""

    @field_validator("*", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("a boolean is not a number")
        return value


@dataclass(frozen=True, config=_CHECKED)
class Limits(_Numbers):
    """Per-document and per-job limits, from `[limits]` of enclave.toml or ENCLAVE_<NAME>."""

    max_document_bytes: int = setting(  # a document is held in worker memory
        "largest document a client submits, in bytes", 5_000_000, ge=1, le=1 << 30
    )
    max_attempts: int = setting("attempts per document before it fails", 3, ge=1, le=100)
    lease_seconds: float = setting(  # 1 s: tests expire leases on purpose
        "seconds a lease on a document lasts unless renewed; a live worker's heartbeats renew it, and a gone "
        "worker's documents are taken over after the heartbeat timeout",
        300.0,
        ge=1,
        le=7 * 24 * 3600,
    )
    shard_size: int = setting("documents per shard (the unit a worker leases)", 8, ge=1, le=10_000)
    checkpoint_every: int = setting(
        "audit events between two signed checkpoints of the audit log", 100, ge=1, le=1_000_000
    )


@dataclass(frozen=True, config=_CHECKED)
class WorkerSettings(_Numbers):
    """How a worker shows it is alive, bounds its shards and serves its metrics, from `[worker]` of
    enclave.toml or ENCLAVE_<NAME>."""

    heartbeat_seconds: float = setting(  # the lease's third at most: a lease must not lapse between beats
        "seconds between a worker's heartbeats, which renew the leases of the documents it works on (at "
        "most a third of the lease is used)",
        10.0,
        ge=0.1,
        le=3600,
    )
    heartbeat_timeout: float = setting(
        "seconds without a heartbeat after which a worker counts as gone and its documents run elsewhere",
        30.0,
        ge=0.5,
        le=86_400,
    )
    soft_time_limit: float = setting(
        "seconds a shard may run; then its unfinished documents are stopped and fail (`time_limit`)",
        3600.0,
        ge=1,
        le=7 * 86_400,
    )
    time_limit: float = setting(
        "seconds after which a shard still running is abandoned: its documents fail (`time_limit`) and the "
        "worker stops taking tasks",
        3900.0,
        ge=1,
        le=7 * 86_400,
    )
    max_consecutive_errors: int = setting(
        "internal errors in a row after which a worker stops taking tasks and reports itself unhealthy",
        10,
        ge=1,
        le=1_000_000,
    )
    metrics_port: int = setting(
        "port of each worker's /metrics and /healthz (`--gpu N` adds N; 0: any free port; -1: none)",
        9464,
        ge=-1,
        le=65535,
    )
    metrics_host: str = setting(
        "address the workers' metrics listen on (0.0.0.0 for a Prometheus on another host)",
        "127.0.0.1",
        min_length=1,
        max_length=255,
    )

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSettings:
        if self.heartbeat_timeout < 2 * self.heartbeat_seconds:
            raise ValueError(
                f"heartbeat_timeout (ENCLAVE_HEARTBEAT_TIMEOUT, {_plain(self.heartbeat_timeout)}) must be at "
                f"least twice heartbeat_seconds (ENCLAVE_HEARTBEAT_SECONDS, {_plain(self.heartbeat_seconds)})"
            )
        if self.time_limit < self.soft_time_limit:
            raise ValueError(
                f"time_limit (ENCLAVE_TIME_LIMIT, {_plain(self.time_limit)}) must be at least "
                f"soft_time_limit (ENCLAVE_SOFT_TIME_LIMIT, {_plain(self.soft_time_limit)})"
            )
        return self


@dataclass(frozen=True, config=_CHECKED)
class LogSettings(_Numbers):
    """The log file of `enclave worker`, `serve` and `gateway` (`$ENCLAVE_HOME/logs/enclave.log`), from
    `[logs]` of enclave.toml or ENCLAVE_<NAME>."""

    log_format: Literal["text", "json"] = setting(
        "log lines as text, or as one JSON object per line (for a log collector)", "text"
    )
    log_max_bytes: int = setting("size at which the log file is rotated", 50_000_000, ge=10_000, le=1 << 40)
    log_backups: int = setting("rotated log files kept", 5, ge=1, le=1000)


# enclave.toml's [engine] table: every flat option of `engine.options.EngineOptions` (its single source, with
# its checks and docs) but the load options Settings holds at its top level (device, dtype). ENCLAVE_<NAME>
# sets each too, except where the engine's own registry (engine/env.py) owns that variable: there it is the
# engine's default for the option, and only the file's key sets the option itself.
_ENGINE_TOP_LEVEL = ("device", "dtype")


def engine_fields() -> tuple[OptionField, ...]:
    """The [engine] table's keys: the engine's flat options (name, values, default, doc)."""
    return tuple(f for f in EngineOptions.flat_fields() if f.name not in _ENGINE_TOP_LEVEL)


def _engine_env_owned() -> frozenset[str]:
    """[engine] keys whose ENCLAVE_<NAME> variable engine/env.py reads (the engine's default for them)."""
    from engine.env import VARIABLES  # no torch: engine/env.py imports os only

    return frozenset(v.field for v in VARIABLES) & {f.name for f in engine_fields()}


def _engine_options(table: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """The [engine] options given in the file or the environment, checked by `engine.options` (a refusal is
    one SettingsError line naming the key or the variable), as keyword arguments for `from_pretrained`."""
    owned = _engine_env_owned()
    values = {name: table[name] for name in (f.name for f in engine_fields()) if name in table}
    sources = {name: f"enclave.toml [engine] {name}" for name in values}
    for f in engine_fields():
        var = "ENCLAVE_" + f.name.upper()
        if f.name not in owned and env.get(var):
            values[f.name], sources[f.name] = env[var], var
    try:
        options = EngineOptions.from_flat(values, lambda name: sources.get(name, name))
    except OptionError as exc:
        raise SettingsError(str(exc).splitlines()[0]) from None
    flat = options.to_flat()
    return {name: flat[name] for name in values}


@dataclass(frozen=True, config=_CHECKED)
class Settings:
    """Where Enclave keeps its state and which database, broker and model it uses."""

    home: Path = setting(
        "the home: keys, logs, the embedded database and broker, the demo model (`--home` wins)",
        shown="`~/.local/share/enclave`",
    )
    database_url: str = setting(
        "the database of jobs, results and the audit log",
        shown="SQLite in the home",
        accepts="a URL such as postgresql+psycopg://user@host/db",
        min_length=1,
    )
    broker_url: str = setting(
        "the Celery broker, which carries shard ids to the workers",
        shown="Kombu's SQLAlchemy transport on SQLite in the home",
        accepts="a URL such as redis://host:6379/0",
        min_length=1,
    )
    service_url: str | None = setting(
        "the service API (`enclave serve`) the client commands call, with this home's client key; unset: "
        "the same API runs inside each command, on this home's database and broker",
        None,
        accepts="a URL such as https://enclave.example:8443",
        min_length=1,
    )
    service_ca: Path | None = setting(
        "CA certificate (PEM) the client trusts for an https service URL; unset: the system's trust store",
        None,
    )
    model: Path | None = setting(  # None: the demo model, written into the home on first use
        "checkpoint directory the workers serve; unset: the random demo model, written into the home", None
    )
    device: str | None = setting(
        "torch device of the workers' engine; unset: CUDA when available, else the CPU",
        None,
        min_length=1,
        max_length=64,
    )
    dtype: str | None = setting(
        "dtype of the workers' engine; unset: bfloat16 on CUDA, else float32",
        None,
        min_length=1,
        max_length=64,
    )
    audit_heads_file: Path | None = setting(
        "a file outside the database to which every signed head of the audit log is appended (one JSON line "
        "each, fsynced): put it on a write-once or append-only mount, for `enclave audit verify --against`; "
        "unset: only the home's own copy, `service/audit_heads.jsonl`",
        None,
    )
    limits: Limits = Field(default_factory=Limits)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    logs: LogSettings = Field(default_factory=LogSettings)
    # the [engine] options given, by flat name: passed to Engine.from_pretrained as is
    engine: dict[str, Any] = Field(default_factory=dict)
    # The key passphrases come from the environment only (never enclave.toml) and are never shown.
    service_passphrase: str | None = setting(
        "passphrase of the home's `service/` key files (init and workers); unset: unprotected keys",
        None,
        repr=False,
    )
    client_passphrase: str | None = setting(
        "passphrase of the home's `client/` key files (init and clients); unset: unprotected keys",
        None,
        repr=False,
    )
    migrations: Path | None = setting(
        "Alembic migrations folder (an image or a non-editable install points it at its copy)",
        None,
        shown="`migrations/` beside the `pipeline` package",
        accepts="a folder holding Alembic's env.py",
    )

    def passphrase(self, identity: Literal["service", "client"]) -> bytes | None:
        """The passphrase of the service's or the client's key files, or None (unprotected)."""
        value = self.service_passphrase if identity == "service" else self.client_passphrase
        return value.encode() if value else None

    @field_validator("database_url", "broker_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if "://" not in value:
            raise ValueError("not a URL")
        return value

    @field_validator("service_url")
    @classmethod
    def _service_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("not an http(s) URL")
        return value.rstrip("/") if value else value

    @field_validator("migrations")
    @classmethod
    def _migrations(cls, value: Path | None) -> Path | None:
        if value is not None and not (value / "env.py").is_file():
            raise ValueError("no env.py there")
        return value

    @property
    def service_key_dir(self) -> Path:
        return self.home / "service"

    @property
    def client_key_dir(self) -> Path:
        return self.home / "client"

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between a worker's heartbeats: `heartbeat_seconds`, but at most a third of the lease, so
        that a live worker's leases never lapse between two beats."""
        return min(self.worker.heartbeat_seconds, self.limits.lease_seconds / 3)

    @property
    def model_path(self) -> Path:
        return self.model if self.model is not None else self.home / "models" / "demo"


# Settings fields from enclave.toml's top level or ENCLAVE_<NAME>.
_TOP = (
    "database_url",
    "broker_url",
    "service_url",
    "service_ca",
    "model",
    "device",
    "dtype",
    "audit_heads_file",
)
# enclave.toml's tables, each a class whose fields are its keys (and ENCLAVE_<KEY>).
_TABLES: dict[str, type] = {
    "limits": Limits,
    "worker": WorkerSettings,
    "logs": LogSettings,
}  # and [engine]: engine_fields()
# The variables holding the passphrases of a home's `service/` and `client/` key files.
PASSPHRASE_ENV = {"service": "ENCLAVE_SERVICE_PASSPHRASE", "client": "ENCLAVE_CLIENT_PASSPHRASE"}
# Settings fields read from the environment only: field -> variable.
_ENV_ONLY = {
    "home": "ENCLAVE_HOME",
    **{f"{who}_passphrase": var for who, var in PASSPHRASE_ENV.items()},
    "migrations": "ENCLAVE_MIGRATIONS",
}
_UNECHOED = (
    "database_url",
    "broker_url",
    "service_url",
)  # URLs may hold passwords (and passphrases are repr=False)


def home_of(given: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The home: `given` (`--home`), else ENCLAVE_HOME from `env` (default: os.environ), else the default."""
    if given is None:
        given = (os.environ if env is None else env).get("ENCLAVE_HOME") or None
    return Path(given or Path.home() / ".local" / "share" / "enclave").expanduser()


def load_settings(env: Mapping[str, str] | None = None, home: Path | None = None) -> Settings:
    """Settings from `env` (default: os.environ) and the home's `enclave.toml`; `home` (`--home`) wins over
    ENCLAVE_HOME. `SettingsError` names the first bad or unknown key."""
    env = os.environ if env is None else env
    home = home_of(home, env)
    file = _read_toml(home / "enclave.toml")
    tables = {
        table: _checked(cls, *_values(file.get(table, {}), _names(cls), env, f"[{table}] "))
        for table, cls in _TABLES.items()
    }
    engine = _engine_options(file.get("engine", {}), env)
    values, sources = _values(file, _TOP, env)
    values = {
        "database_url": f"sqlite:///{home / 'enclave.db'}",
        "broker_url": f"sqla+sqlite:///{home / 'broker.db'}",
        **values,
    }
    for name, var in _ENV_ONLY.items():
        if name != "home" and env.get(var):
            values[name], sources[name] = env[var], var
    for name in ("model", "migrations", "service_ca", "audit_heads_file"):
        if isinstance(values.get(name), str):
            values[name] = Path(values[name]).expanduser()
    values |= {"home": home, **tables, "engine": engine}
    return _checked(Settings, values, sources)


def check_engine_env() -> None:
    """Read the engine's variables (`engine.env`) now, at a worker's start-up, so that a bad one stops it
    before it takes any task, as a one-line SettingsError."""
    from engine.env import EnvError, engine_env  # imports torch: workers only

    try:
        engine_env()
    except EnvError as exc:
        raise SettingsError(str(exc)) from None


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _variable_name(name: str) -> str:
    return _ENV_ONLY.get(name) or "ENCLAVE_" + name.upper()


def _values(
    table: dict[str, Any], names: tuple[str, ...], env: Mapping[str, str], section: str = ""
) -> tuple[dict[str, Any], dict[str, str]]:
    """The values of `names` (file first, then ENCLAVE_<NAME> over it) and where each came from."""
    values = {name: table[name] for name in names if name in table}
    sources = {name: f"enclave.toml {section}{name}" for name in values}
    for name in names:
        if env.get(var := _variable_name(name)):
            values[name], sources[name] = env[var], var
    return values, sources


def _checked(cls: type, values: dict[str, Any], sources: dict[str, str]) -> Any:
    """`cls(**values)`, or a one-line SettingsError naming the first bad value's variable or key."""
    try:
        return cls(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else ""
        if not name and first["type"] == "value_error":  # a rule across fields (a model validator)
            rule = str(first["msg"]).removeprefix("Value error, ")
            table = next((f"[{t}] " for t, c in _TABLES.items() if c is cls), "")
            raise SettingsError(f"{table}settings: {rule}") from None
        if name not in sources:
            raise SettingsError(f"{cls.__name__.lower()} setting {name or '?'} is invalid") from None
        hidden = name in _UNECHOED or not cls.__pydantic_fields__[name].repr
        got = "" if hidden else f", got {_shown(values[name])}"
        raise SettingsError(f"{sources[name]} must be {_expected(cls, name)}{got}") from None


def _expected(cls: type, name: str) -> str:
    """What field `name` of `cls` accepts, in words (for errors and the settings table)."""
    info = cls.__pydantic_fields__[name]
    if accepts := (info.json_schema_extra or {}).get("accepts"):
        return accepts
    union = typing.get_origin(info.annotation) in (typing.Union, types.UnionType)
    kinds = [a for a in typing.get_args(info.annotation) if a is not type(None)] if union else []
    kinds = kinds or [info.annotation]
    if typing.get_origin(kinds[0]) is Literal:
        return f"one of {', '.join(typing.get_args(kinds[0]))}"
    bounds = [getattr(m, k) for m in info.metadata for k in ("ge", "le") if hasattr(m, k)]
    if len(bounds) == 2:
        kind = "a number" if kinds[0] is float else "a whole number"
        return f"{kind} between {_plain(bounds[0])} and {_plain(bounds[1])}"
    return "a path" if kinds[0] is Path else "text"


def _plain(number: float | str) -> str:
    if isinstance(number, str):
        return number
    return str(int(number)) if float(number).is_integer() else str(number)


def _shown(value: Any, limit: int = 40) -> str:
    text = repr(str(value) if isinstance(value, Path) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_toml(path: Path) -> dict[str, Any]:
    """The file's tables, after refusing unknown keys; {} when there is no file."""
    if not path.exists():
        return {}
    try:
        if path.stat().st_size > MAX_TOML_BYTES:
            raise SettingsError(f"{path} is larger than {MAX_TOML_BYTES} bytes")
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
        raise SettingsError(f"cannot read {path}: {reason}") from None
    except RecursionError:
        raise SettingsError(f"cannot read {path}: nested too deeply") from None
    tables = {
        **{t: _names(cls) for t, cls in _TABLES.items()},
        "engine": tuple(f.name for f in engine_fields()),
    }
    known = [*_TOP, *(f"[{t}]" for t in tables)]
    for key, value in data.items():
        if key in tables:
            if not isinstance(value, dict):
                raise SettingsError(f"enclave.toml: {key} must be a table ([{key}])")
            names = tables[key]
            if unknown := sorted(set(value) - set(names)):
                raise SettingsError(
                    f"enclave.toml: unknown setting {unknown[0]!r} in [{key}] (known: {', '.join(names)})"
                )
        elif key not in _TOP:
            raise SettingsError(f"enclave.toml: unknown setting {key!r} (known: {', '.join(known)})")
    return data


@dataclasses.dataclass(frozen=True)
class Variable:
    """One ENCLAVE_* variable of the pipeline: its enclave.toml key (None: environment only), the values it
    accepts, its default as the table shows it and its meaning."""

    name: str
    key: str | None
    values: str
    default: str
    doc: str


def variables() -> tuple[Variable, ...]:
    """Every variable `load_settings` reads, from the settings' fields: a field added to `Settings`,
    `Limits` or `EngineOptions` is listed here without a second list to keep."""
    found = [_variable(Settings, "home", None)]
    found += [_variable(Settings, name, name) for name in _TOP]
    for table, cls in _TABLES.items():
        found += [_variable(cls, name, f"[{table}] {name}") for name in _names(cls)]
    owned = _engine_env_owned()
    found += [
        Variable("ENCLAVE_" + f.name.upper(), f"[engine] {f.name}", f.type, _engine_default(f), f.doc)
        for f in engine_fields()
        if f.name not in owned
    ]
    found += [_variable(Settings, name, None) for name in _ENV_ONLY if name != "home"]
    return tuple(found)


def _variable(cls: type, name: str, key: str | None) -> Variable:
    info = cls.__pydantic_fields__[name]
    shown = (info.json_schema_extra or {}).get("shown")
    if shown is None:
        shown = "unset" if info.is_required() or info.default is None else f"`{_plain(info.default)}`"
    return Variable(_variable_name(name), key, _expected(cls, name), str(shown), info.description or "")


def _engine_default(f: OptionField) -> str:
    return (
        "unset"
        if f.default is None
        else f"`{_plain(f.default) if isinstance(f.default, float) else f.default}`"
    )


# How engine/env.py's kinds read in the table.
_ENGINE_VALUES = {"switch": "0 or 1", "splits": "1, 2, 4 or 8", "text": "text"}
TABLE_START = "<!-- settings table: `python -m pipeline.settings --readme README.md` writes it -->"
TABLE_END = "<!-- end of the settings table -->"


def settings_table() -> str:
    """The README's settings table: the pipeline's variables, then the engine's (`engine.env.VARIABLES`)."""
    from engine.env import VARIABLES as ENGINE_VARIABLES  # imports torch: only when the table is wanted

    rows = [(v.name, f"`{v.key}`" if v.key else "", v.default, v.values, v.doc) for v in variables()]
    owned = _engine_env_owned()
    for v in ENGINE_VARIABLES:
        values = ", ".join(v.choices) if v.kind == "choice" else _ENGINE_VALUES.get(v.kind, v.kind)
        key = f"`[engine] {v.field}` (the option; the variable is its default)" if v.field in owned else ""
        rows.append((v.name, key, f"`{v.default}`" if v.default else "unset", values, v.doc))
    lines = ["| variable | enclave.toml | default | values | meaning |", "|---|---|---|---|---|"]
    for name, *cells in rows:
        lines.append("| " + " | ".join([f"`{name}`", *(c.replace("|", "\\|") for c in cells)]) + " |")
    return "\n".join(lines)


def readme_with_table(text: str) -> str:
    """`text` (the README) with the table between TABLE_START and TABLE_END replaced by `settings_table()`."""
    head, start, rest = text.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not (start and end):
        raise SettingsError(f"the README has no {TABLE_START} ... {TABLE_END} section")
    return f"{head}{start}\n{settings_table()}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.settings --markdown` prints the settings table; `--readme FILE` rewrites it."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.settings", description=main.__doc__)
    parser.add_argument("--markdown", action="store_true", help="print the settings table")
    parser.add_argument("--readme", type=Path, help="rewrite the settings table of this README")
    args = parser.parse_args(argv)
    if args.readme:
        args.readme.write_text(readme_with_table(args.readme.read_text(encoding="utf-8")), encoding="utf-8")
    if args.markdown or not args.readme:
        print(settings_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
