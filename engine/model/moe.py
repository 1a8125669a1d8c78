"""Feed-forward blocks: the sparse MoE with a gated shared expert, and the dense SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.config import ModelConfig


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused as [gate rows | up rows]."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoe(nn.Module):
    """Top-k routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

    With `quantization="fp8"` only the shared expert runs in FP8 (`Fp8Linear`); the stacked experts stay in
    the model dtype (an FP8 checkpoint's dequantised at load) until a fused FP8 MoE kernel exists.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)  # router
        # E experts stacked: w13 [E, 2I, H] = gate rows then up rows; w2 [E, H, I] = down.
        self.w13 = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.zeros(e, h, i))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(h, shared) if shared > 0 else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if shared > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = kernels.moe_route(self.gate(x), self.top_k, self.renormalize)
        out = kernels.moe_experts(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
