"""A deferred combine: an experts path's output before its last launch, held as that launch's inputs.

Every Triton experts path ends with `combine.combine`, which sums each token's weighted (token, slot) rows
and rounds once. The model's next op after an MoE block is a residual add + RMSNorm (the next layer's input
norm, the MTP head's norm), which can do that sum in its own kernel (`norm.combine_add_rms_norm`) and save a
launch per layer. So `moe.experts(..., defer=True)` returns a `PendingCombine` instead of a tensor, and its
consumer either fuses it or launches the combine (`tensor()`).

The request to defer reaches `combine.combine` through `deferred()`, a context variable set around the one
call of the experts op, rather than as an argument through each of its paths (grouped, FP8 grouped, GEMV)
and their fallbacks: a path that falls back to the reference returns a tensor, which every consumer takes
too. A context variable is per thread, so the engine's loop and a test's thread never see each other's.
Triton-free (the model imports it); `tensor()` runs the combine through the dispatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from engine.kernels import dispatch

_DEFERRED: ContextVar[bool] = ContextVar("moe_combine_deferred", default=False)
# Tokens up to which an MoE block defers its combine (`SparseMoe.forward`); larger steps launch it as before.
# The fused kernel was measured at batch 1 only (an H100, 2026-12-05). It has a program per two tokens where
# the combine has four per token, so at prefill sizes it may be slower; unmeasured, it is not used there.
DEFER_MAX_TOKENS = 16


@dataclass(frozen=True)
class PendingCombine:
    """The inputs of `combine.combine`: what an experts path's [T, H] output sums to, not yet summed.

    A consumer that needs the tensor calls `tensor()` (one combine launch); the residual add + norm that
    reads it takes the object itself (`kernels.combine_add_rms_norm`). Holds device tensors only: no host
    value depends on the data, so it is made and consumed the same way inside a CUDA graph capture.
    """

    part: (
        torch.Tensor
    )  # [P, T*S, H] weighted (token, slot) rows per K split: fp32, or the model dtype if P = 1
    tokens: int  # T
    slots: int  # S
    dtype: torch.dtype  # the model dtype the sum is rounded to
    shared_out: torch.Tensor | None = None  # [T, H] a shared expert run outside the experts' kernels
    shared_gate: torch.Tensor | None = None  # [T] its weight

    @property
    def shape(self) -> tuple[int, int]:
        """(T, H) of the tensor this stands for."""
        return self.tokens, self.part.shape[2]

    def tensor(self) -> torch.Tensor:
        """[T, H] in `dtype`: the combine, launched now (its Triton kernel on CUDA, as the experts would)."""
        return dispatch.pick("moe_combine", self.part)(self)


def as_tensor(x: torch.Tensor | PendingCombine) -> torch.Tensor:
    """`x` itself, or the tensor a `PendingCombine` stands for (its combine launched now)."""
    return x.tensor() if isinstance(x, PendingCombine) else x


@contextmanager
def deferred(on: bool = True) -> Iterator[None]:
    """Inside (when `on`), `combine.combine` returns its inputs as a `PendingCombine` instead of launching."""
    token = _DEFERRED.set(on)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def deferring() -> bool:
    """Whether `combine.combine` defers now (inside `deferred()`)."""
    return _DEFERRED.get()


def reference(pending: PendingCombine) -> torch.Tensor:
    """Plain-torch `combine`: the fp32 sum in the kernel's order (slots, and each slot's K splits, in turn;
    the shared expert's weighted output last), rounded once; equal to the kernel bit for bit on a CPU."""
    parts, _, hidden = pending.part.shape
    rows = pending.part.reshape(parts, pending.tokens, pending.slots, hidden)
    acc = torch.zeros(pending.tokens, hidden, dtype=torch.float32, device=pending.part.device)
    for s in range(pending.slots):
        for k in range(parts):
            acc = acc + rows[k, :, s].float()
    if pending.shared_out is not None:
        acc = acc + pending.shared_gate.float()[:, None] * pending.shared_out.float()
    return acc.to(pending.dtype)
