"""The multi-token-prediction head (`mtp.*`): predicts token t+2 from h_t and the embedding of token t+1."""

import torch
from torch import nn

from engine.cache import PagedKV
from engine.config import ModelConfig
from engine.kernels import SeqLayout
from engine.model.decoder import DecoderLayer
from engine.model.norm import RMSNorm


class MTPHead(nn.Module):
    """fc(concat(norm_e(embed(t+1)), norm_h(h_t))) -> full-attention MoE decoder layer -> norm.

    The embedding table and lm_head are the main model's. Several MTP layers, where a checkpoint has them,
    are used in turn for successive draft steps.
    """

    def __init__(self, config: ModelConfig, num_layers: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        moe = config.num_experts > 0
        self.layers = nn.ModuleList(DecoderLayer(config, "full_attention", moe) for _ in range(num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def forward(
        self,
        next_embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: PagedKV,
        layout: SeqLayout,
        step: int = 0,
    ) -> torch.Tensor:
        """next_embeds, hidden [T, H] -> [T, H] normed hidden state for the shared lm_head (the layer's MoE
        output may be a deferred combine: the final norm sums it in its own kernel)."""
        x, residual = self.layers[step % len(self.layers)](
            self._joined(next_embeds, hidden), None, cos, sin, kv, layout
        )
        return self.norm.add(x, residual)[0]

    def _joined(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input: fc over the next tokens' normed embeddings beside the normed hidden states."""
        return self.fc(
            torch.cat((self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)
        )

    def store_kv(
        self,
        next_embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: PagedKV,
        layout: SeqLayout,
        step: int = 0,
    ) -> None:
        """Only the K/V `forward` writes: fc, the layer's input norm and its key/value projections."""
        layer = self.layers[step % len(self.layers)]
        layer.self_attn.store_kv(
            layer.input_layernorm(self._joined(next_embeds, hidden)), cos, sin, kv, layout
        )
