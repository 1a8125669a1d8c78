"""Gated DeltaNet linear attention (the `linear_attention` layers)."""

import torch
from torch import nn

from engine import kernels
from engine.cache import LinearState
from engine.config import ModelConfig
from engine.kernels import SeqLayout
from engine.model.linear import Linear

# Sequences up to which short steps take the fused kernel (one program per sequence and value head). H200,
# bf16, one graphed layer without its MoE: batch 1 48.0 us fused against 53.3 us for the separate kernels;
# batch 64 184.5 against 143 (the separate delta-rule kernel splits each head's state over four 1-warp
# programs, which wins once there are enough programs to fill the GPU).
FUSED_MAX_SEQS = 8


class GatedDeltaNet(nn.Module):
    """Projections -> causal conv (q, k, v) + SiLU -> gated delta rule -> gated norm * silu(z) -> out_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim
        self.eps = c.rms_norm_eps
        # [q (all key heads) | k | v (all value heads) | z] and [b | a], each head-major.
        self.in_proj_qkvz = Linear(c.hidden_size, self.conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = Linear(c.hidden_size, 2 * self.num_v_heads, bias=False)
        self.conv1d_weight = nn.Parameter(torch.zeros(self.conv_dim, c.linear_conv_kernel_dim))  # [C, K]
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: LinearState, layout: SeqLayout) -> torch.Tensor:
        qkv, z = self.in_proj_qkvz(x).split((self.conv_dim, self.value_dim), dim=-1)
        b, a = self.in_proj_ba(x).split((self.num_v_heads, self.num_v_heads), dim=-1)  # column views
        if layout.long_seqs or layout.num_seqs > FUSED_MAX_SEQS:
            out = self._unfused(qkv, z, a, b, state, layout)
        else:  # decode, MTP verify, short chunks of a few sequences: conv, gates, rule and norm in one kernel
            out = kernels.deltanet_step(
                qkv,
                z,
                a,
                b,
                self.conv1d_weight,
                state.conv,
                self.A_log,
                self.dt_bias,
                state.recurrent,
                self.norm_weight,
                self.eps,
                layout,
            )
        return self.out_proj(out)

    def _unfused(self, qkv, z, a, b, state: LinearState, layout: SeqLayout) -> torch.Tensor:
        """[T, value_dim] gated delta rule output, op by op (layouts with sequences of any length)."""
        t = qkv.shape[0]
        qkv = kernels.causal_conv1d(qkv, self.conv1d_weight, state.conv, layout)
        q, k, v = qkv.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        g, beta = kernels.deltanet_gate(a, b, self.A_log, self.dt_bias)  # [T, Hv] fp32 log decay, [T, Hv]
        out = kernels.gated_delta_rule(
            q.reshape(t, self.num_k_heads, self.head_k_dim),
            k.reshape(t, self.num_k_heads, self.head_k_dim),
            v.reshape(t, self.num_v_heads, self.head_v_dim),
            g,
            beta,
            state.recurrent,
            layout,
        )  # [T, Hv, dv]
        out = kernels.gated_rms_norm(
            out, z.reshape(t, self.num_v_heads, self.head_v_dim), self.norm_weight, self.eps
        )
        return out.reshape(t, self.value_dim)
