"""Gated full attention: GQA with q/k norms, partial rotary and a sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from engine import kernels
from engine.cache import PagedKV
from engine.config import ModelConfig
from engine.kernels import SeqLayout
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.sigmoid_gate import quantises
from engine.model.linear import Linear, fp8_group, project
from engine.model.norm import RMSNorm


class GatedAttention(nn.Module):
    """`q_proj` yields query and gate interleaved per head; the output is multiplied by sigmoid(gate)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        hidden = config.hidden_size
        # [q+gate | k | v] in one projection: q and gate interleaved per head as [q_h (d) | gate_h (d)].
        self.split = (self.num_heads * 2 * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = Linear(hidden, sum(self.split), bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * d, hidden, bias=config.attention_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def fp8_input_group(self) -> int | None:
        """The activation group of an FP8 `qkv_proj` (its input may come quantised), else None."""
        return fp8_group(self.qkv_proj)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: PagedKV,
        layout: SeqLayout,
        xq: Fp8Activation | None = None,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, k, v = project(self.qkv_proj, x, xq).split(self.split, dim=-1)
        qg = qg.view(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]  # [T, Hq, D] strided views, read in place
        k, v = k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        norms = (self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps)
        if kv.k_scale is None:  # a cache in the model's dtype: the norm kernel stores the keys and values
            q = kernels.qk_norm_rotary_store(q, k, v, *norms, kv.k, kv.v, layout.slot_mapping(x.device))
            k = v = None
        else:
            q, k = kernels.qk_norm_rotary(q, k, *norms)
        out = kernels.attention(q, k, v, kv.k, kv.v, layout, d**-0.5, kv.k_scale, kv.v_scale)  # [T, Hq, D]
        group = fp8_group(self.o_proj)
        if group is None or not quantises(d, group):
            return self.o_proj(kernels.sigmoid_gate(out, gate).reshape(t, self.num_heads * d))
        # An FP8 o_proj: the gate quantises its output in the same kernel, so o_proj runs no quantiser.
        gated, xq = kernels.sigmoid_gate_fp8(out, gate, group)
        return project(self.o_proj, gated.reshape(t, self.num_heads * d), xq)

    def store_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: PagedKV, layout: SeqLayout
    ) -> None:
        """Write the keys and values of x [T, H] at the layout's positions, as `forward` does first, without
        attending (the MTP head's cache kept whole at a step that drafts nothing)."""
        t, d = x.shape[0], self.head_dim
        _, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        k, v = k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        norms = (self.k_norm.weight, self.k_norm.weight, cos, sin, self.k_norm.eps)
        if kv.k_scale is None:
            kernels.qk_norm_rotary_store(k, k, v, *norms, kv.k, kv.v, layout.slot_mapping(x.device))
            return
        _, k = kernels.qk_norm_rotary(k, k, *norms)
        kernels.store_kv(k, v, kv.k, kv.v, layout, kv.k_scale, kv.v_scale)
