"""Gated DeltaNet linear attention (the `linear_attention` layers)."""

from __future__ import annotations

import torch
from torch import nn

from engine import kernels
from engine.cache import LinearState
from engine.config import ModelConfig
from engine.kernels import SeqLayout, dispatch
from engine.kernels.fp8.reference import Fp8Activation
from engine.model.linear import Linear, fp8_group, project

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
        # [qkvz rows | ba rows] once `fuse_input_projections_` ran (the two weights are then views of it).
        # Not persistent: the checkpoint's names stay the only ones in state_dict().
        self.register_buffer("in_proj_weight", None, persistent=False)
        self.conv1d_weight = nn.Parameter(torch.zeros(self.conv_dim, c.linear_conv_kernel_dim))  # [C, K]
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)

    @torch.no_grad()
    def fuse_input_projections_(self) -> bool:
        """Run `in_proj_qkvz` and `in_proj_ba` as one GEMM; returns whether this call fused them.

        At decode `in_proj_ba` alone costs a whole launch for 0.26 MB of weight (5.1 us in an H200 profile at
        batch 1; fusing saved 1.7 us per graphed layer, 30 layers a step). One [conv_dim + value_dim + 2 Hv,
        hidden] weight takes both, and the two modules' weights become row views of it: no copy is kept, and
        `state_dict()` keeps the checkpoint's names and values. Skipped unless both are `Linear`s of one
        dtype and device without bias (under `quantization="fp8"` in_proj_qkvz is an `Fp8Linear`), and when
        already fused. Once fused, forward no longer calls the two modules: a later FP8 swap of in_proj_qkvz,
        or a hook on either, is bypassed (so fuse after quantisation), and a later `.to()` copies the views
        apart (still correct, twice the memory).
        """
        qkvz, ba = self.in_proj_qkvz, self.in_proj_ba
        if self.in_proj_weight is not None or not (isinstance(qkvz, Linear) and isinstance(ba, Linear)):
            return False
        w, w_ba = qkvz.weight, ba.weight
        if qkvz.bias is not None or ba.bias is not None or (w.dtype, w.device) != (w_ba.dtype, w_ba.device):
            return False
        fused = torch.cat([w, w_ba])  # [N_qkvz + 2 Hv, hidden]
        qkvz.weight = nn.Parameter(fused[: w.shape[0]], requires_grad=w.requires_grad)
        ba.weight = nn.Parameter(fused[w.shape[0] :], requires_grad=w_ba.requires_grad)
        self.in_proj_weight = fused
        return True

    def fp8_input_group(self) -> int | None:
        """The activation group of an FP8 `in_proj_qkvz` (its input may come quantised), else None."""
        return None if self.in_proj_weight is not None else fp8_group(self.in_proj_qkvz)

    def project(self, x: torch.Tensor, xq: Fp8Activation | None = None) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> qkv [T, conv_dim], z [T, value_dim], b, a [T, Hv]: column views of one or two
        projection outputs (the kernels below take any token stride); `xq` x quantised for an FP8
        in_proj_qkvz."""
        if self.in_proj_weight is not None:
            sizes = (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
            return kernels.linear(x, self.in_proj_weight).split(sizes, dim=-1)
        qkv, z = project(self.in_proj_qkvz, x, xq).split((self.conv_dim, self.value_dim), dim=-1)
        b, a = self.in_proj_ba(x).split((self.num_v_heads, self.num_v_heads), dim=-1)
        return qkv, z, b, a

    def forward(
        self, x: torch.Tensor, state: LinearState, layout: SeqLayout, xq: Fp8Activation | None = None
    ) -> torch.Tensor:
        qkv, z, b, a = self.project(x, xq)
        if layout.long_seqs or layout.num_seqs > FUSED_MAX_SEQS:
            dispatch.choose("deltanet_layer", "unfused")
            out, out_q = self._unfused(qkv, z, a, b, state, layout)
            return project(self.out_proj, out, out_q)
        else:  # decode, MTP verify, short chunks of a few sequences: conv, gates, rule and norm in one kernel
            dispatch.choose("deltanet_layer", "fused")
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

    def _unfused(
        self, qkv, z, a, b, state: LinearState, layout: SeqLayout
    ) -> tuple[torch.Tensor, Fp8Activation | None]:
        """[T, value_dim] gated delta rule output, op by op (layouts with sequences of any length); and, for
        an FP8 out_proj whose group is a value head, the same quantised by the gated norm's kernel."""
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
        gate = z.reshape(t, self.num_v_heads, self.head_v_dim)
        if fp8_group(self.out_proj) != self.head_v_dim:
            return kernels.gated_rms_norm(out, gate, self.norm_weight, self.eps).reshape(
                t, self.value_dim
            ), None
        # One scale per (token, head): the row of each head is one group of out_proj's input.
        out, xq = kernels.gated_rms_norm_fp8(out, gate, self.norm_weight, self.eps, self.head_v_dim)
        flat = Fp8Activation(xq.q.reshape(t, self.value_dim), xq.scale.reshape(t, -1), xq.group)
        return out.reshape(t, self.value_dim), flat
