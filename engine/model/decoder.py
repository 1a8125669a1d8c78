"""One pre-norm decoder layer: token mixer (DeltaNet or gated attention) then MoE or dense MLP."""

import torch
from torch import nn

from engine.cache import LinearState, PagedKV
from engine.config import ModelConfig
from engine.kernels import PendingCombine, SeqLayout
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.moe.pending import as_tensor
from engine.model.attention import GatedAttention
from engine.model.deltanet import GatedDeltaNet
from engine.model.moe import MLP, SparseMoe, hooked
from engine.model.norm import RMSNorm


class DecoderLayer(nn.Module):
    """`residual += mixer(norm(residual)); residual += mlp(norm(residual))`, with each residual add fused
    into the norm that reads it: the layer returns its MLP output and the residual stream before that
    output is added, and the next layer's input norm (or the caller) does the add. Where the mixer's input
    projection or the MLP's experts are FP8, the norm also quantises its output for them (`add_fp8`). An MoE
    layer's output may be its experts' deferred combine (`PendingCombine`), which that norm sums in its own
    kernel; a caller that needs the tensor takes `as_tensor(output)`."""

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
        x: torch.Tensor | PendingCombine,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: LinearState | PagedKV,
        layout: SeqLayout,
    ) -> tuple[torch.Tensor | PendingCombine, torch.Tensor]:
        """x [T, H]: the previous layer's MLP output, with `residual` the stream it adds to (None: x is the
        stream itself, as for the first layer). Returns (this layer's MLP output, the stream before it); the
        output is a `PendingCombine` where the MoE's Triton experts ran, unless this layer has forward hooks
        (they see plain tensors)."""
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        hq = None
        if residual is None:
            x = as_tensor(x)
            h, residual = self.input_layernorm(x), x
        else:
            h, residual, hq = _add_norm(self.input_layernorm, x, residual, _input_group(mixer))
        extra = () if hq is None else (hq,)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, state, layout, *extra)
        else:
            h = self.self_attn(h, cos, sin, state, layout, *extra)
        h, residual, hq = _add_norm(self.post_attention_layernorm, h, residual, _input_group(self.mlp))
        extra = () if hq is None else (hq,)
        defer = {"defer": True} if isinstance(self.mlp, SparseMoe) and not hooked(self) else {}
        return self.mlp(h, *extra, **defer), residual


def _input_group(module: nn.Module) -> int | None:
    """The FP8 activation group `module` takes its input quantised in, or None (a model-dtype module, or one
    a test put in its place)."""
    group = getattr(module, "fp8_input_group", None)
    return group() if group is not None else None


def _add_norm(
    norm: RMSNorm, x: torch.Tensor | PendingCombine, residual: torch.Tensor, group: int | None
) -> tuple[torch.Tensor, torch.Tensor, Fp8Activation | None]:
    """(norm(x + residual), x + residual, the normed rows quantised for FP8 consumers of `group`, or None);
    x may be a deferred combine, summed in the norm's kernel."""
    if group is None:
        return (*norm.add(x, residual), None)
    return norm.add_fp8(x, residual, group)
