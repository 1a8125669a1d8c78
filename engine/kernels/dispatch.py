"""The one place that picks an implementation for each kernel op.

`ENCLAVE_KERNELS` forces a backend: `torch` (the plain references), `triton`, or `auto` (the default: Triton
on CUDA tensors where an implementation exists, the torch reference everywhere else).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

BACKENDS = ("auto", "torch", "triton")
_IMPLEMENTATIONS: dict[str, dict[str, Callable | str]] = {}


def register(op: str, **implementations: Callable | str) -> None:
    """Record the implementations of `op`, keyed by backend name (`torch`, `triton`).

    An implementation may be given as "module:function", imported on first use: Triton kernels are
    compiled (or, under TRITON_INTERPRET=1, interpreted) as their module is imported, so importing the
    engine never needs Triton.
    """
    _IMPLEMENTATIONS.setdefault(op, {}).update(implementations)


def implementation(op: str, name: str) -> Callable:
    """The `name` backend's implementation of `op`, imported if it was registered by path."""
    found = _IMPLEMENTATIONS[op][name]
    if isinstance(found, str):
        module, attr = found.split(":")
        found = _IMPLEMENTATIONS[op][name] = getattr(importlib.import_module(module), attr)
    return found


def backend() -> str:
    """The backend asked for through `ENCLAVE_KERNELS`."""
    choice = os.environ.get("ENCLAVE_KERNELS", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"ENCLAVE_KERNELS must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


def pick(op: str, like: torch.Tensor) -> Callable:
    """The implementation of `op` to run on tensors like `like`."""
    table = _IMPLEMENTATIONS[op]
    choice = backend()
    if choice == "torch":
        return implementation(op, "torch")
    if choice == "triton":
        if "triton" not in table:
            raise ValueError(f"ENCLAVE_KERNELS=triton, but kernel op {op!r} has no Triton implementation yet")
        return implementation(op, "triton")
    if like.is_cuda and "triton" in table:
        return implementation(op, "triton")
    return implementation(op, "torch")


def prefill_kernels_enabled() -> bool:
    """Whether the Triton prefill kernels (chunked delta rule, paged prefill attention) run for long
    sequences: yes, unless ENCLAVE_TRITON_PREFILL=0 sends CUDA prefill chunks to the torch references (a
    switch for bisecting a numerical problem; the kernels passed the H200 gpu tests at real shapes and are
    120x (delta rule) faster than the references there)."""
    return os.environ.get("ENCLAVE_TRITON_PREFILL", "1").strip() != "0"
