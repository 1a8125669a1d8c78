"""Per-sequence state of a running batch: DeltaNet conv/recurrent state and a KV cache per attention layer.

Each sequence owns one slot. This is the simple static layout (contiguous KV per slot, grown on demand);
the serving core replaces the KV part with a paged pool behind the same per-layer views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass
class LinearState:
    """State of one Gated DeltaNet layer for every slot."""

    conv: torch.Tensor  # [S, conv_dim, K-1] last inputs of the causal conv
    recurrent: torch.Tensor  # [S, Hv, dk, dv] fp32 delta-rule state


@dataclass
class KVState:
    """Keys and values of one full-attention layer for every slot."""

    k: torch.Tensor  # [S, Hkv, L, D]
    v: torch.Tensor  # [S, Hkv, L, D]


class StateCache:
    """All layers' state for `num_slots` sequences of up to `capacity` tokens (grown with `reserve`)."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        capacity: int,
        device: torch.device | str,
        dtype: torch.dtype,
        num_mtp_layers: int = 0,
    ) -> None:
        self.config = config
        self.num_slots = num_slots
        self.capacity = capacity
        self.device = torch.device(device)
        self.dtype = dtype
        self.layers: dict[int, LinearState | KVState] = {}
        for i, kind in enumerate(config.layer_types):
            self.layers[i] = self._linear() if kind == "linear_attention" else self._kv(capacity)
        self.mtp_layers = [self._kv(capacity) for _ in range(num_mtp_layers)]

    def _linear(self) -> LinearState:
        c = self.config
        conv = torch.zeros(
            self.num_slots,
            c.linear_conv_dim,
            c.linear_conv_kernel_dim - 1,
            device=self.device,
            dtype=self.dtype,
        )
        rec = torch.zeros(
            self.num_slots,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
            device=self.device,
            dtype=torch.float32,
        )
        return LinearState(conv, rec)

    def _kv(self, capacity: int) -> KVState:
        c = self.config
        shape = (self.num_slots, c.num_key_value_heads, capacity, c.head_dim)
        return KVState(
            torch.zeros(shape, device=self.device, dtype=self.dtype),
            torch.zeros(shape, device=self.device, dtype=self.dtype),
        )

    def reserve(self, length: int) -> None:
        """Make room for sequences of `length` tokens, doubling the KV length when it grows."""
        if length <= self.capacity:
            return
        new = max(length, 2 * self.capacity)
        for kv in [*self.kv_states(), *self.mtp_layers]:
            for name in ("k", "v"):
                old = getattr(kv, name)
                grown = torch.zeros(*old.shape[:2], new, old.shape[3], device=old.device, dtype=old.dtype)
                grown[:, :, : old.shape[2]] = old
                setattr(kv, name, grown)
        self.capacity = new

    def kv_states(self) -> list[KVState]:
        return [s for s in self.layers.values() if isinstance(s, KVState)]
