"""The one place that picks an implementation for each kernel op, and records which one ran.

`ENCLAVE_KERNELS` (read once, through `engine.env`) forces a backend: `torch` (the plain references),
`triton`, or `auto` (the default: Triton on CUDA tensors where an implementation exists, the torch reference
everywhere else). `pick` chooses the backend. Inside a Triton entry point the finer choices report here too:
`choose` for a variant picked by design (GEMV or grouped experts, cuBLAS for many rows), `fallback` for an
input the kernel does not take (a dtype, a shape past its tiles), sent to the reference and logged once per
(op, reason) with the tensors' shapes and dtypes.

`usage()` maps each op to the implementation it last ran. Recording is one dict assignment per call, so it
stays on the hot path; a replayed CUDA graph runs no Python, so for graphed steps it names what the capture
ran.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch

from engine.env import engine_env

log = logging.getLogger(__name__)

_IMPLEMENTATIONS: dict[str, dict[str, Callable | str]] = {}
_USAGE: dict[str, str] = {}  # op -> implementation it last ran
_HELD_BACK: set[str] = set()  # ops whose Triton kernel has not run on a GPU yet: the reference on CUDA
_LOGGED: set[tuple[str, str]] = set()  # (op, reason) of the fallbacks logged so far

PREFILL_OFF = "ENCLAVE_TRITON_PREFILL=0 sends prefill chunks to the torch reference"
EMPTY = "empty batch"  # a reason several kernels share; such a fallback is expected (logged at info)


def register(op: str, *, on_cuda_by_default: bool = True, **implementations: Callable | str) -> None:
    """Record the implementations of `op`, keyed by backend name (`torch`, `triton`).

    An implementation may be given as "module:function", imported on first use: Triton kernels are
    compiled (or, under TRITON_INTERPRET=1, interpreted) as their module is imported, so importing the
    engine never needs Triton. A kernel graduates into the CUDA path once it has run on a GPU
    (docs/ARCHITECTURE.md, section 11): until then it is registered with `on_cuda_by_default=False`, and
    ENCLAVE_KERNELS=auto keeps the reference on CUDA too (ENCLAVE_KERNELS=triton still runs it).
    """
    _IMPLEMENTATIONS.setdefault(op, {}).update(implementations)
    if not on_cuda_by_default:
        _HELD_BACK.add(op)


def implementation(op: str, name: str) -> Callable:
    """The `name` backend's implementation of `op`, imported if it was registered by path."""
    found = _IMPLEMENTATIONS[op][name]
    if isinstance(found, str):
        module, attr = found.split(":")
        found = _IMPLEMENTATIONS[op][name] = getattr(importlib.import_module(module), attr)
    return found


def backend() -> str:
    """The backend asked for through `ENCLAVE_KERNELS`: auto, torch or triton (`EnvError` if malformed)."""
    return engine_env().kernels


def pick(op: str, like: torch.Tensor) -> Callable:
    """The implementation of `op` to run on tensors like `like`, recorded in `usage()`.

    Under `auto` a CPU tensor, or an op without a Triton implementation, takes the reference by design: that
    is recorded, not logged.
    """
    table = _IMPLEMENTATIONS[op]
    choice = engine_env().kernels
    if choice == "auto":
        choice = "triton" if like.is_cuda and "triton" in table and op not in _HELD_BACK else "torch"
    elif choice == "triton" and "triton" not in table:
        raise ValueError(f"ENCLAVE_KERNELS=triton, but kernel op {op!r} has no Triton implementation yet")
    _USAGE[op] = choice
    return implementation(op, choice)


def choose(op: str, impl: str) -> None:
    """Record that `op` runs `impl`, a variant its inputs call for by design (e.g. `triton-gemv`)."""
    _USAGE[op] = impl


def fallback(
    op: str, reason: str, impl: str = "torch", *, expected: bool = False, **tensors: torch.Tensor | None
) -> None:
    """Record that `op` runs `impl` instead of its Triton kernel because of `reason`, and log it the first
    time for this (op, reason): a warning, or info when `expected` (a switch the user set, an empty batch).

    `reason` should not hold token counts, so that one cause logs once; `tensors` (name=tensor) are the
    inputs whose shape, dtype or layout the reason is about.
    """
    _USAGE[op] = impl
    if (op, reason) in _LOGGED:
        return
    _LOGGED.add((op, reason))
    given = [(name, t) for name, t in tensors.items() if t is not None]
    shown = ", ".join(describe(name, t) for name, t in given) + f" on {given[0][1].device}" if given else ""
    level = logging.INFO if expected else logging.WARNING
    log.log(level, "kernel op %s falls back to %s for %s: %s", op, impl, shown or "these inputs", reason)


def first_failed(*checks: tuple[bool, str]) -> str:
    """The reason paired with the first false condition: `fallback`'s reason where a kernel checks several."""
    return next((reason for ok, reason in checks if not ok), "unsupported inputs")


def describe(name: str, t: torch.Tensor) -> str:
    """`x [5, 64] bfloat16`, with `strided` when t is not contiguous."""
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{name} {list(t.shape)} {dtype}" + ("" if t.is_contiguous() else " strided")


def usage() -> dict[str, str]:
    """Each op that ran since the last `reset_usage()`, with the implementation it last ran (a copy)."""
    return dict(_USAGE)


def reset_usage() -> None:
    """Forget the recorded implementations and which fallbacks were logged (a new engine, tests)."""
    _USAGE.clear()
    _LOGGED.clear()


def prefill_kernels_enabled(op: str, **tensors: torch.Tensor) -> bool:
    """Whether `op`'s Triton prefill kernels (chunked delta rule, paged prefill attention) run its long
    sequences: yes, unless ENCLAVE_TRITON_PREFILL=0 sends CUDA prefill chunks to the torch references (a
    switch for bisecting a numerical problem; the kernels passed the H200 gpu tests at real shapes and are
    120x (delta rule) faster than the references there). A no is a `fallback` (`triton+torch-prefill`)."""
    if engine_env().triton_prefill:
        return True
    fallback(op, PREFILL_OFF, "triton+torch-prefill", expected=True, **tensors)
    return False
