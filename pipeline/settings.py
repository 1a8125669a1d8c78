"""Service settings, read once at start-up (by the CLI or the worker, never at import time) from the
environment and an optional `enclave.toml` in the home. Environment variables win over the file.

Production values are URLs such as `postgresql+psycopg://user@host/db` and `redis://host:6379/0`.
Every value is checked at load: numbers have ranges (nan, infinities, overflow and non-numbers are refused),
the file's keys must be known ones, and each refusal is one line naming the variable or the file's key.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

MAX_TOML_BYTES = 64 << 10
_CHECKED = ConfigDict(extra="forbid", allow_inf_nan=False)


class SettingsError(ValueError):
    """A setting is malformed; the message is one line naming it."""


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

    max_document_bytes: int = Field(5_000_000, ge=1, le=1 << 30)  # a document is held in worker memory
    max_attempts: int = Field(3, ge=1, le=100)
    lease_seconds: float = Field(300.0, ge=1, le=7 * 24 * 3600)  # 1 s: tests expire leases on purpose
    shard_size: int = Field(8, ge=1, le=10_000)
    checkpoint_every: int = Field(100, ge=1, le=1_000_000)


@dataclass(frozen=True, config=_CHECKED)
class EngineOptions(_Numbers):
    """Options for `Engine.from_pretrained`, from `[engine]` of enclave.toml or ENCLAVE_<NAME>; those left
    unset take the engine's defaults."""

    max_num_seqs: int | None = Field(None, ge=1, le=4096)
    max_num_batched_tokens: int | None = Field(None, ge=1, le=1 << 20)
    num_speculative_tokens: int | None = Field(None, ge=0, le=4)  # the engine's MAX_SPECULATIVE_TOKENS
    kv_cache_memory: int | None = Field(None, ge=1 << 20, le=1 << 42)  # bytes: 1 MiB .. 4 TiB
    quantization: Literal["none", "fp8"] | None = None

    @field_validator("quantization", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    def as_kwargs(self) -> dict[str, int | str]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True, config=_CHECKED)
class Settings:
    """Where Enclave keeps its state and which database, broker and model it uses."""

    home: Path
    database_url: str = Field(min_length=1)
    broker_url: str = Field(min_length=1)
    model: Path | None = None  # None: the demo model, written into the home on first use
    device: str | None = Field(None, min_length=1, max_length=64)
    dtype: str | None = Field(None, min_length=1, max_length=64)
    limits: Limits = Field(default_factory=Limits)
    # EngineOptions.as_kwargs(): passed to Engine.from_pretrained as is
    engine: dict[str, int | str] = Field(default_factory=dict)
    # The key passphrases, from PASSPHRASE_ENV only (never enclave.toml); never shown.
    service_passphrase: str | None = Field(None, repr=False)
    client_passphrase: str | None = Field(None, repr=False)

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

    @property
    def service_key_dir(self) -> Path:
        return self.home / "service"

    @property
    def client_key_dir(self) -> Path:
        return self.home / "client"

    @property
    def model_path(self) -> Path:
        return self.model if self.model is not None else self.home / "models" / "demo"


_TOP = ("database_url", "broker_url", "model", "device", "dtype")
# The variables holding the passphrases of a home's `service/` and `client/` key files.
PASSPHRASE_ENV = {"service": "ENCLAVE_SERVICE_PASSPHRASE", "client": "ENCLAVE_CLIENT_PASSPHRASE"}
_TABLES: dict[str, type] = {"limits": Limits, "engine": EngineOptions}
_SECRET = {  # URLs may hold passwords: never echoed
    "database_url": "a URL such as postgresql+psycopg://user@host/db",
    "broker_url": "a URL such as redis://host:6379/0",
}


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Settings from `env` (default: os.environ) and `$ENCLAVE_HOME/enclave.toml`; `SettingsError` names the
    first bad or unknown key."""
    env = dict(os.environ if env is None else env)
    home = Path(env.get("ENCLAVE_HOME") or Path.home() / ".local" / "share" / "enclave").expanduser()
    file = _read_toml(home / "enclave.toml")
    limits = _checked(Limits, *_values(file.get("limits", {}), _names(Limits), env, "[limits] "))
    engine = _checked(
        EngineOptions, *_values(file.get("engine", {}), _names(EngineOptions), env, "[engine] ")
    )
    values, sources = _values(file, _TOP, env)
    values = {
        "database_url": f"sqlite:///{home / 'enclave.db'}",
        "broker_url": f"sqla+sqlite:///{home / 'broker.db'}",
        **values,
    }
    if isinstance(values.get("model"), str):
        values["model"] = Path(values["model"]).expanduser()
    values |= {"home": home, "limits": limits, "engine": engine.as_kwargs()}
    values |= {f"{who}_passphrase": env.get(var) or None for who, var in PASSPHRASE_ENV.items()}
    return _checked(Settings, values, sources)


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _values(
    table: dict[str, Any], names: tuple[str, ...], env: dict[str, str], section: str = ""
) -> tuple[dict[str, Any], dict[str, str]]:
    """The values of `names` (file first, then ENCLAVE_<NAME> over it) and where each came from."""
    values = {name: table[name] for name in names if name in table}
    sources = {name: f"enclave.toml {section}{name}" for name in values}
    for name in names:
        if env.get(var := "ENCLAVE_" + name.upper()):
            values[name], sources[name] = env[var], var
    return values, sources


def _checked(cls: type, values: dict[str, Any], sources: dict[str, str]) -> Any:
    """`cls(**values)`, or a one-line SettingsError naming the first bad value's variable or key."""
    try:
        return cls(**values)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        name = str(loc[0]) if loc else ""
        if name not in sources:
            raise SettingsError(f"{cls.__name__.lower()} setting {name or '?'} is invalid") from None
        got = "" if name in _SECRET else f", got {_shown(values[name])}"
        raise SettingsError(f"{sources[name]} must be {_expected(cls, name)}{got}") from None


def _expected(cls: type, name: str) -> str:
    info = cls.__pydantic_fields__[name]
    if name in _SECRET:
        return _SECRET[name]
    if name == "quantization":
        return "one of none, fp8"
    bounds = [getattr(m, k) for m in info.metadata for k in ("ge", "le") if hasattr(m, k)]
    if len(bounds) == 2:
        kind = "a number" if info.annotation is float else "a whole number"
        return f"{kind} between {_plain(bounds[0])} and {_plain(bounds[1])}"
    return "text" if name != "model" else "a path"


def _plain(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else str(number)


def _shown(value: Any, limit: int = 40) -> str:
    text = repr(value)
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
    known = [*_TOP, *(f"[{t}]" for t in _TABLES)]
    for key, value in data.items():
        if key in _TABLES:
            if not isinstance(value, dict):
                raise SettingsError(f"enclave.toml: {key} must be a table ([{key}])")
            names = _names(_TABLES[key])
            if unknown := sorted(set(value) - set(names)):
                raise SettingsError(
                    f"enclave.toml: unknown setting {unknown[0]!r} in [{key}] (known: {', '.join(names)})"
                )
        elif key not in _TOP:
            raise SettingsError(f"enclave.toml: unknown setting {key!r} (known: {', '.join(known)})")
    return data
