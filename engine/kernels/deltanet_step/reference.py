"""The fused step's reference: the unfused references, in the model's order."""

import torch

from engine.kernels.conv1d.reference import causal_conv1d
from engine.kernels.deltanet_gate.reference import deltanet_gate
from engine.kernels.gated_delta.reference import gated_delta_rule
from engine.kernels.layout import SeqLayout
from engine.kernels.norm.reference import gated_rms_norm


def deltanet_step(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    recurrent_state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    layout: SeqLayout,
) -> torch.Tensor:
    # qkv [T, 2 Hk dk + Hv dv]; z [T, Hv dv]; a, b [T, Hv]; recurrent_state [S, Hv, dk, dv] -> [T, Hv dv].
    t = qkv.shape[0]
    hv, dk, dv = recurrent_state.shape[1:]
    key_dim = (qkv.shape[1] - hv * dv) // 2
    x = causal_conv1d(qkv, conv_weight, conv_state, layout)
    q, k, v = x.split((key_dim, key_dim, hv * dv), dim=-1)
    g, beta = deltanet_gate(a, b, a_log, dt_bias)
    out = gated_delta_rule(
        q.reshape(t, -1, dk), k.reshape(t, -1, dk), v.reshape(t, hv, dv), g, beta, recurrent_state, layout
    )
    return gated_rms_norm(out, z.reshape(t, hv, dv), norm_weight, eps).reshape(t, hv * dv)
