"""The Qwen3.5/3.6-MoE (and Qwen3-Next) causal language model as a plain nn.Module.

Parameter names follow the checkpoints' (`model.layers.{i}...`, `lm_head`, `mtp.*`) where the layout allows,
so the loader's mapping stays short; fused projections are noted where they are declared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine import kernels
from engine.cache import ModelCache
from engine.config import ModelConfig
from engine.kernels import SeqLayout
from engine.kernels.moe.pending import as_tensor
from engine.model.decoder import DecoderLayer
from engine.model.deltanet import GatedDeltaNet
from engine.model.fp8_linear import Fp8DraftHead
from engine.model.moe import SparseMoe
from engine.model.mtp import MTPHead
from engine.model.norm import RMSNorm
from engine.model.rotary import rope_parameters

if TYPE_CHECKING:
    from engine.options import SpeculationOptions


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # An explicit (uninitialised) weight skips nn.Embedding's normal_ init, which on the meta device
        # imports torch._dynamo (seconds); the loader overwrites every parameter anyway.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(config, kind, config.is_moe_layer(i)) for i, kind in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Embeddings -> decoder layers -> final norm -> lm_head, with an optional MTP head."""

    def __init__(self, config: ModelConfig, num_mtp_layers: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.mtp = MTPHead(config, num_mtp_layers) if num_mtp_layers else None
        inv_freq, self.rope_scale = rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.draft_head: Fp8DraftHead | None = None  # `use_fp8_draft_head_`
        self.draft_vocab: int | None = None  # `limit_draft_vocab_`: drafts score the first N token ids

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after the module was built on the meta device)."""
        inv_freq, self.rope_scale = rope_parameters(self.config)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def fuse_projections_(self) -> int:
        """Give each DeltaNet layer one GEMM for its input projections (`fuse_input_projections_`), and each
        FP8 MoE block its shared expert stacked with the routed experts (`SparseMoe.stack_fp8_shared_`);
        returns how many modules this call fused. For serving: after loading and any quantisation, before
        CUDA graphs are captured. The parameters and `state_dict()` keep the checkpoint's names and values."""
        fused = sum(m.fuse_input_projections_() for m in self.modules() if isinstance(m, GatedDeltaNet))
        fused += sum(m.stack_fp8_shared_() for m in self.modules() if isinstance(m, SparseMoe))
        if fused and self.inv_freq.is_cuda:
            # Each replaced in_proj_qkvz weight (50 MB on Qwen3.5-35B-A3B) would stay in torch's cache,
            # too small for the next layer's fused weight and for the KV cache allocated after this.
            torch.cuda.empty_cache()
        return fused

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rotary_cos_sin(positions, self.inv_freq, self.rope_scale)

    def forward(self, input_ids: torch.Tensor, layout: SeqLayout, cache: ModelCache) -> torch.Tensor:
        """input_ids [T] (flat, per `layout`) -> [T, H] hidden states before the final norm."""
        cos, sin = self.rotary(layout.positions(input_ids.device))
        x, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, cache.layers[i], layout)
        # The last layer's MLP output joins the stream here (layers fuse the others into their norms); its
        # deferred combine, if any, is launched first.
        return as_tensor(x) + residual

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] normed hidden states -> [N, V] fp32 logits."""
        return torch.nn.functional.linear(normed, self._head_weight()).float()

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[T, V'] fp32 logits MTP drafts are picked from, column j scoring token j: the FP8 draft head's
        where one was made (`use_fp8_draft_head_`), else the lm_head's; V' is `draft_vocab` where the draft
        vocabulary is limited (`limit_draft_vocab_`), else the head's rows."""
        if self.draft_head is not None:
            return self.draft_head(normed)
        return torch.nn.functional.linear(normed, self.draft_weight()).float()

    def prepare_draft_head_(self, options: SpeculationOptions) -> None:
        """The drafts' head as the options say: its vocabulary limited (`draft_vocab`), then, with
        `draft_head="fp8"`, the e4m3 copy of what is left. Again, a no-op."""
        if options.draft_vocab is not None and self.draft_head is None:
            self.limit_draft_vocab_(options.draft_vocab)
        if options.draft_head == "fp8":
            self.use_fp8_draft_head_()

    def limit_draft_vocab_(self, n: int) -> None:
        """Drafts score the first `n` token ids only (option `draft_vocab`); before `use_fp8_draft_head_`."""
        if self.draft_head is not None:
            raise RuntimeError("limit the draft vocabulary before making the FP8 draft head")
        self.draft_vocab = n if n < self.vocab_rows else None

    def use_fp8_draft_head_(self) -> None:
        """Score drafts with a block-scaled e4m3 copy of the lm_head (option `draft_head="fp8"`), of its
        first `draft_vocab` rows where limited; once."""
        if self.draft_head is None:
            self.draft_head = Fp8DraftHead.of(self.draft_weight())

    @property
    def vocab_rows(self) -> int:
        """Columns of `logits`: the lm_head's rows (the padded vocabulary)."""
        return self._head_weight().shape[0]

    def draft_weight(self) -> torch.Tensor:
        """The lm_head rows drafts are scored with: a view of the first `draft_vocab`, or all."""
        weight = self._head_weight()
        return weight if self.draft_vocab is None else weight[: self.draft_vocab]

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def mtp_hidden(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        layout: SeqLayout,
        cache: ModelCache,
        step: int = 0,
    ) -> torch.Tensor:
        """The MTP head's normed output [T, H] for the token after `next_ids` [T].

        `hidden` [T, H] is the main model's final-normed hidden state at each position (what vLLM feeds
        its MTP proposer), or the head's own output when drafting further ahead.
        """
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP head (no mtp.* tensors)")
        cos, sin = self.rotary(layout.positions(next_ids.device))
        kv = cache.mtp_layers[step % len(cache.mtp_layers)]
        return self.mtp(self.model.embed_tokens(next_ids), hidden, cos, sin, kv, layout, step)

    def mtp_store_kv(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, layout: SeqLayout, cache: ModelCache
    ) -> None:
        """The MTP head's K/V at the layout's positions, as `mtp_hidden` writes them, without its output: what
        a step that drafts nothing needs so that later drafts read no holes."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP head (no mtp.* tensors)")
        cos, sin = self.rotary(layout.positions(next_ids.device))
        self.mtp.store_kv(self.model.embed_tokens(next_ids), hidden, cos, sin, cache.mtp_layers[0], layout)
