"""One pre-norm decoder layer: token mixer (DeltaNet or gated attention) then MoE or dense MLP."""

import torch
from torch import nn

from engine.cache import LinearState, PagedKV
from engine.config import ModelConfig
from engine.kernels import SeqLayout
from engine.model.attention import GatedAttention
from engine.model.deltanet import GatedDeltaNet
from engine.model.moe import MLP, SparseMoe
from engine.model.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, moe: bool) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = SparseMoe(config) if moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: LinearState | PagedKV,
        layout: SeqLayout,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, state, layout)
        else:
            h = self.self_attn(h, cos, sin, state, layout)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))
