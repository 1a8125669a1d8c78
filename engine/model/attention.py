"""Gated full attention: GQA with q/k norms, partial rotary and a sigmoid output gate."""

import torch
from torch import nn

from engine import kernels
from engine.cache import PagedKV
from engine.config import ModelConfig
from engine.kernels import SeqLayout
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
        self.qkv_proj = nn.Linear(hidden, sum(self.split), bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=config.attention_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: PagedKV, layout: SeqLayout
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        qg = qg.view(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, self.num_heads * d)
        q = kernels.apply_rotary(self.q_norm(q), cos, sin)  # [T, Hq, D]
        k = kernels.apply_rotary(self.k_norm(k.view(t, self.num_kv_heads, d)), cos, sin)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, d)
        out = kernels.attention(q, k, v, kv.k, kv.v, layout, d**-0.5)
        return self.o_proj(out.reshape(t, self.num_heads * d) * torch.sigmoid(gate))
