"""Service settings, read once at start from the environment and an optional `enclave.toml` in the home.

Environment variables win over the file. Production values are URLs such as
`postgresql+psycopg://user@host/db` and `redis://host:6379/0`.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class SettingsError(ValueError):
    """A setting is malformed."""


@dataclass(frozen=True)
class Limits:
    """Per-document and per-job limits."""

    max_document_bytes: int = 5_000_000
    max_attempts: int = 3
    lease_seconds: float = 300.0
    shard_size: int = 8
    checkpoint_every: int = 100

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise SettingsError(f"{f.name} must be positive, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class Settings:
    """Where Enclave keeps its state and which database, broker and model it uses."""

    home: Path
    database_url: str
    broker_url: str
    model: Path | None  # None: the demo model, written into the home on first use
    device: str | None = None
    dtype: str | None = None
    limits: Limits = field(default_factory=Limits)
    # Options passed to Engine.from_pretrained (max_num_seqs, max_num_batched_tokens, num_speculative_tokens,
    # kv_cache_memory, quantization): the `[engine]` table of enclave.toml or ENCLAVE_<NAME>.
    engine: dict[str, int | str] = field(default_factory=dict)

    @property
    def service_key_dir(self) -> Path:
        return self.home / "service"

    @property
    def client_key_dir(self) -> Path:
        return self.home / "client"

    @property
    def model_path(self) -> Path:
        return self.model if self.model is not None else self.home / "models" / "demo"


_ENV = {
    "database_url": "ENCLAVE_DATABASE_URL",
    "broker_url": "ENCLAVE_BROKER_URL",
    "model": "ENCLAVE_MODEL",
    "device": "ENCLAVE_DEVICE",
    "dtype": "ENCLAVE_DTYPE",
}
_LIMIT_ENV = {f.name: "ENCLAVE_" + f.name.upper() for f in fields(Limits)}
_ENGINE_ENV = {
    name: "ENCLAVE_" + name.upper()
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "num_speculative_tokens",
        "kv_cache_memory",
        "quantization",
    )
}
_ENGINE_STRINGS = ("quantization",)  # passed as text (the engine checks the value); the others are integers


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Settings from `env` (default: os.environ) and `$ENCLAVE_HOME/enclave.toml`."""
    env = dict(os.environ if env is None else env)
    home = Path(env.get("ENCLAVE_HOME") or Path.home() / ".local" / "share" / "enclave").expanduser()
    file_values = _read_toml(home / "enclave.toml")
    values: dict[str, Any] = {k: v for k, v in file_values.items() if k in _ENV}
    values |= {k: env[var] for k, var in _ENV.items() if env.get(var)}
    limit_values = dict(file_values.get("limits", {}))
    limit_values |= {k: env[var] for k, var in _LIMIT_ENV.items() if env.get(var)}
    limits = Limits(**{k: _number(k, v) for k, v in limit_values.items() if k in _LIMIT_ENV})
    engine_values = dict(file_values.get("engine", {}))
    engine_values |= {k: env[var] for k, var in _ENGINE_ENV.items() if env.get(var)}
    if unknown := sorted(set(engine_values) - set(_ENGINE_ENV)):
        raise SettingsError(f"unknown [engine] setting {unknown[0]!r} (known: {', '.join(_ENGINE_ENV)})")
    engine = {
        k: _text(k, v) if k in _ENGINE_STRINGS else int(_number(k, v)) for k, v in engine_values.items()
    }
    return Settings(
        home=home,
        database_url=values.get("database_url") or f"sqlite:///{home / 'enclave.db'}",
        broker_url=values.get("broker_url") or f"sqla+sqlite:///{home / 'broker.db'}",
        model=Path(values["model"]).expanduser() if values.get("model") else None,
        device=values.get("device"),
        dtype=values.get("dtype"),
        limits=limits,
        engine=engine,
    )


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read {path}: {exc}") from None


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise SettingsError(f"{name} must be a string, got {value!r}")
    return value


def _number(name: str, value: Any) -> int | float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{name} must be a number, got {value!r}") from None
    return int(number) if number.is_integer() and name != "lease_seconds" else number
