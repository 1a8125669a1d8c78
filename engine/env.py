"""Every environment variable the engine reads, with its type, default and meaning: the only place that
reads them.

The values are read once, on first use (`engine_env()`), and kept: kernels ask `engine_env()` for the
parsed record, never `os.environ` per call, and nothing is read at import time. A malformed value raises
`EnvError`, one line naming the variable. Tests that change a variable call `reset_engine_env()` (the root
conftest does so around every test). The pipeline's variables live in `pipeline/settings.py`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class EnvError(ValueError):
    """An engine variable is malformed; the message is one line naming it."""


@dataclass(frozen=True)
class Variable:
    """One variable: its name, the field of `EngineEnv` it sets, its kind, default and meaning."""

    name: str
    field: str
    kind: str  # "switch" (0 turns it off), "choice", "splits" or "text"
    default: str
    doc: str
    choices: tuple[str, ...] = ()


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "ENCLAVE_KERNELS",
        "kernels",
        "choice",
        "auto",
        "kernel backend: `auto` (Triton on CUDA tensors where it exists, else the torch reference), "
        "`torch` or `triton`",
        ("auto", "torch", "triton"),
    ),
    Variable(
        "ENCLAVE_TRITON_PREFILL",
        "triton_prefill",
        "switch",
        "1",
        "`0` sends CUDA prefill chunks to the torch references (for bisecting a numerical problem)",
    ),
    Variable(
        "ENCLAVE_FP8_ATTENTION",
        "fp8_attention",
        "switch",
        "0",
        "`1` runs the prefill attention kernel's QK and PV products in FP8 (e4m3) when the KV cache is FP8 "
        "(`kv_cache_dtype=fp8`); `0`: in the model's dtype",
    ),
    Variable(
        "ENCLAVE_PREFILL_KERNEL",
        "prefill_kernel",
        "choice",
        "packed",
        "the attention prefill kernel: `packed` (one program per kv head, all its query heads in one tile: "
        "1.44-1.59x torch's flash SDPA on Hopper at 8k-32k tokens and 8k after 128k-512k cached with CUDA's "
        "64-position KV blocks, 1.23-1.38x with 16) or `rows` (one per query head and 64 tokens: 0.57-0.68x)",
        ("rows", "packed"),
    ),
    Variable(
        "ENCLAVE_PDL",
        "pdl",
        "switch",
        "1",
        "`0` turns off programmatic dependent launch of the decode kernels (Hopper and later)",
    ),
    Variable(
        "ENCLAVE_CUDA_GRAPHS",
        "cuda_graphs",
        "switch",
        "1",
        "`0` runs decode and verify steps eagerly instead of replaying CUDA graphs",
    ),
    Variable(
        "ENCLAVE_MTP_GRAPHS",
        "mtp_graphs",
        "switch",
        "1",
        "`0` runs the MTP head's passes (drafting, its K/V fill) eagerly instead of replaying CUDA graphs",
    ),
    Variable(
        "ENCLAVE_ASYNC_SCHEDULING",
        "async_scheduling",
        "switch",
        "1",
        "`0` reads each step's tokens before launching the next step",
    ),
    Variable(
        "ENCLAVE_SPECULATION",
        "speculation",
        "choice",
        "auto",
        "`adaptive` chooses each step's drafts (at most `num_speculative_tokens`, unset: 3) from the "
        "measured acceptance and the batch, on any device; `fixed` verifies `num_speculative_tokens` every "
        "step; `auto`: adaptive on cuda when the checkpoint has an MTP head and the option is unset",
        ("auto", "adaptive", "fixed"),
    ),
    Variable(
        "ENCLAVE_DELTANET_V_SPLITS",
        "deltanet_v_splits",
        "splits",
        "",
        "dv tiles per value head of the DeltaNet decode step (1, 2, 4 or 8); unset: chosen from the grid",
    ),
    Variable(
        "ENCLAVE_COMMIT",
        "commit",
        "text",
        "",
        "the commit `engine.bench` records (for a copy of the tree without `.git`); unset: `git rev-parse`",
    ),
)


@dataclass(frozen=True)
class EngineEnv:
    """The parsed variables (see `VARIABLES`), plus whether Triton runs interpreted (TRITON_INTERPRET=1)."""

    kernels: str = "auto"
    triton_prefill: bool = True
    fp8_attention: bool = False
    prefill_kernel: str = "packed"
    pdl: bool = True
    cuda_graphs: bool = True
    mtp_graphs: bool = True
    async_scheduling: bool = True
    speculation: str = "auto"
    deltanet_v_splits: int | None = None
    commit: str | None = None
    triton_interpret: bool = False


def read_env(environ: Mapping[str, str] | None = None) -> EngineEnv:
    """Parse the engine's variables from `environ` (default: os.environ); `EnvError` names a bad one."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for var in VARIABLES:
        raw = environ.get(var.name, "").strip()
        if raw:
            values[var.field] = _parse(var, raw)
    values["triton_interpret"] = environ.get("TRITON_INTERPRET", "").strip() == "1"
    return EngineEnv(**values)


def _parse(var: Variable, raw: str) -> object:
    if var.kind == "switch":
        if raw not in ("0", "1"):
            raise EnvError(f"{var.name} must be 0 or 1, got {raw[:40]!r}")
        return raw == "1"
    if var.kind == "choice":
        choice = raw.lower()
        if choice not in var.choices:
            raise EnvError(f"{var.name} must be one of {', '.join(var.choices)}, got {raw[:40]!r}")
        return choice
    if var.kind == "splits":
        if raw not in ("1", "2", "4", "8"):
            raise EnvError(f"{var.name} must be 1, 2, 4 or 8, got {raw[:40]!r}")
        return int(raw)
    return raw


_current: EngineEnv | None = None


def engine_env() -> EngineEnv:
    """The engine's variables, read from the environment on first use and kept."""
    global _current
    if _current is None:
        _current = read_env()
    return _current


def reset_engine_env() -> None:
    """Forget the kept values: the next `engine_env()` reads the environment again (for tests)."""
    global _current
    _current = None
