"""The model's cached state on the device: DeltaNet state slots and a paged KV pool per attention layer.

A *slot* holds, for every Gated DeltaNet layer, the conv window [C, K-1] and the recurrent state
[Hv, dk, dv] of one sequence: in the dtype the release's `mamba_ssm_dtype` names (fp32 for Qwen3.5/3.6, and
when it names none), or the `state_dtype` option's (bf16 halves the bytes; the kernels compute in fp32 and
round the state after every token). A *block* holds `block_size` positions of
keys and values for every full-attention layer (and the MTP head's attention layers, which share the block
tables). Which slot and blocks a sequence owns is decided by the allocators (engine/allocator.py); this
file only holds tensors.

The KV blocks are in the model's dtype, or with `kv_cache_dtype="fp8"` in float8 e4m3 with an fp32 scale
per (position, kv head) in a parallel tensor (engine/kernels/attention/fp8_kv.py): about half the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kernels.attention.fp8_kv import FP8_KV_DTYPE

KV_SCALE_DTYPE = torch.float32


@dataclass
class LinearState:
    """State of one Gated DeltaNet layer for every slot."""

    conv: torch.Tensor  # [S, conv_dim, K-1] last inputs of the causal conv
    recurrent: torch.Tensor  # [S, Hv, dk, dv] delta-rule state (fp32, or bf16: `state_dtype`)


@dataclass
class PagedKV:
    """Keys and values of one attention layer, in blocks of positions."""

    k: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, Hkv] fp32 of an FP8 cache, else None
    v_scale: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV blocks' dtype for the `kv_cache_dtype` option: auto, the model's `dtype`; fp8, e4m3."""
    return FP8_KV_DTYPE if name == "fp8" else dtype


def state_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """The recurrent states' dtype for the `state_dtype` option: auto, the config's `mamba_ssm_dtype`;
    float32; bfloat16."""
    return getattr(torch, config.mamba_ssm_dtype if name == "auto" else name)


def is_scaled(kv_dtype: torch.dtype) -> bool:
    """Whether KV blocks of this dtype carry scales (FP8)."""
    return kv_dtype == FP8_KV_DTYPE


def slot_bytes(config: ModelConfig, dtype: torch.dtype, state: torch.dtype = torch.float32) -> int:
    """Bytes of one slot over all DeltaNet layers: conv windows in `dtype`, recurrent states in `state`."""
    c = config
    conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * dtype.itemsize
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * state.itemsize
    return c.layer_types.count("linear_attention") * (conv + rec)


def block_bytes(config: ModelConfig, kv_dtype: torch.dtype, block_size: int, num_mtp_layers: int) -> int:
    """Bytes of one KV block of `kv_dtype` over all attention layers, the MTP head's included (an FP8
    block's scales too)."""
    layers = config.layer_types.count("full_attention") + num_mtp_layers
    row = config.head_dim * kv_dtype.itemsize + (KV_SCALE_DTYPE.itemsize if is_scaled(kv_dtype) else 0)
    return layers * 2 * block_size * config.num_key_value_heads * row


class ModelCache:
    """`num_slots` DeltaNet state slots and `num_blocks` KV blocks of `block_size` positions, preallocated;
    recurrent states in `state_dtype` (default fp32), KV blocks in `kv_dtype` (default `dtype`)."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        num_mtp_layers: int = 0,
        kv_dtype: torch.dtype | None = None,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the KV blocks'; FP8 ones carry scales
        # Every DeltaNet layer's states are views of one pool per kind, [layers, S, ...], so copying slots
        # (a verify step's commit, a prefix's fork) is one gather and scatter per pool, not two per layer.
        c = config
        linear = c.layer_types.count("linear_attention")
        conv = (linear, num_slots, c.linear_conv_dim, c.linear_conv_kernel_dim - 1)
        rec = (linear, num_slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.conv_pool = torch.empty(conv, device=self.device, dtype=dtype)
        self.recurrent_pool = torch.empty(rec, device=self.device, dtype=state_dtype)
        views = iter(range(linear))
        self.layers: dict[int, LinearState | PagedKV] = {
            i: self._linear(next(views)) if kind == "linear_attention" else self._kv()
            for i, kind in enumerate(config.layer_types)
        }
        self.mtp_layers = [self._kv() for _ in range(num_mtp_layers)]

    def _linear(self, index: int) -> LinearState:
        return LinearState(self.conv_pool[index], self.recurrent_pool[index])

    def _kv(self) -> PagedKV:
        c = self.config
        shape = (self.num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        kv = [torch.empty(shape, device=self.device, dtype=self.kv_dtype) for _ in range(2)]
        if not is_scaled(self.kv_dtype):
            return PagedKV(*kv)
        scales = [torch.empty(shape[:3], device=self.device, dtype=KV_SCALE_DTYPE) for _ in range(2)]
        return PagedKV(*kv, *scales)

    def linear_states(self) -> list[LinearState]:
        return [s for s in self.layers.values() if isinstance(s, LinearState)]

    def kv_states(self) -> list[PagedKV]:
        return [s for s in self.layers.values() if isinstance(s, PagedKV)] + self.mtp_layers

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the DeltaNet state of slots `src` into slots `dst` (pairwise), in every layer.

        One pair (a verify step's commit at batch 1, a prefix's fork) is a strided copy per pool: no index
        tensors uploaded (`torch.tensor(..., device=cuda)` waits for the device) and no gathered temporary
        (60 MiB of recurrent state at the full geometry, written and read again): two eager launches
        instead of six."""
        if not src:
            return
        if len(src) == 1:
            self.conv_pool[:, dst[0]].copy_(self.conv_pool[:, src[0]])
            self.recurrent_pool[:, dst[0]].copy_(self.recurrent_pool[:, src[0]])
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        self.conv_pool[:, d] = self.conv_pool[:, s]
        self.recurrent_pool[:, d] = self.recurrent_pool[:, s]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy KV blocks `src` into `dst` (pairwise), with their scales, in every attention layer."""
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for kv in self.kv_states():
            for t in kv.tensors():
                t[d] = t[s]

    def tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for s in self.linear_states():
            out += [s.conv, s.recurrent]
        for kv in self.kv_states():
            out += kv.tensors()
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
