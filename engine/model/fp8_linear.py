"""Dense projections and routed experts kept in block FP8 (`quantization="fp8"`): e4m3 weights and one fp32
scale per block.

Applied from outside, after the model is built: the loader swaps the `nn.Linear`s named in `FP8_PROJECTIONS`
for `Fp8Linear`s and turns each `SparseMoe`'s stacked experts (`w13`/`w2`) into e4m3 buffers with block
scales (`use_fp8_experts_`) while the model is still on the meta device, then fills them. The router, gates,
`in_proj_ba`, embeddings and `lm_head` keep the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine import kernels
from engine.kernels.fp8.reference import Fp8Activation
from engine.model.moe import SparseMoe

# Suffixes of the module names that become Fp8Linear: attention, DeltaNet, shared expert and dense MLP.
FP8_PROJECTIONS = (
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "linear_attn.in_proj_qkvz",
    "linear_attn.out_proj",
    "mlp.shared_expert.gate_up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
)


class Fp8Linear(nn.Module):
    """`x @ W.T (+ bias)` with W [N, K] stored as e4m3 and `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] fp32.

    The forward is the w8a8 block linear: activations are quantised per token and per `block[1]` channels,
    or come quantised (`xq`, from the norm that produced them; see `engine.model.linear.project`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        block: tuple[int, int] = (128, 128),
        bias_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        bn, bk = block
        scales = (-(-out_features // bn), -(-in_features // bk))
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.empty(scales, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype)) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, block: tuple[int, int]) -> Fp8Linear:
        """An empty Fp8Linear of `linear`'s shape, on its device (meta while the model is being built)."""
        with torch.device(linear.weight.device):
            bias = linear.bias is not None
            dtype = linear.bias.dtype if bias else None
            return cls(linear.in_features, linear.out_features, bias, block, dtype)

    def forward(self, x: torch.Tensor, xq: Fp8Activation | None = None) -> torch.Tensor:
        return kernels.fp8_block_linear(x, self.weight, self.weight_scale_inv, self.bias, self.block, xq)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


@dataclass(frozen=True)
class Fp8DraftHead:
    """A block-scaled e4m3 copy of the lm_head that scores MTP drafts only (option `draft_head="fp8"`): a
    draft reads half the lm_head's bf16 bytes (about 0.5 of 1 GB on Qwen3.5-35B-A3B). The main model's
    logits, and so verification, keep the checkpoint's head. Not a module: it is no part of `state_dict()`."""

    weight: torch.Tensor  # [V, H] e4m3
    weight_scale_inv: torch.Tensor  # [ceil(V / 128), ceil(H / 128)] fp32
    block: tuple[int, int] = (128, 128)

    @classmethod
    def of(cls, weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> Fp8DraftHead:
        """Quantised from the lm_head's (or the tied embeddings') weight [V, H]."""
        q, scale = kernels.quantize_block_fp8_weight(weight.detach(), block)
        return cls(q, scale, block)

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] normed hidden states -> [N, V] fp32 draft logits."""
        return kernels.fp8_block_linear(normed, self.weight, self.weight_scale_inv, None, self.block).float()


def is_fp8_projection(name: str, module: nn.Module) -> bool:
    """Whether module `name` is one of the dense projections `quantization="fp8"` converts."""
    return isinstance(module, nn.Linear) and name.endswith(FP8_PROJECTIONS)


def use_fp8_linears_(model: nn.Module, names: list[str], block: tuple[int, int]) -> None:
    """Replace the `nn.Linear` submodules `names` of `model` with empty `Fp8Linear`s of the same shape."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, Fp8Linear.like(getattr(owner, child), block))


def fp8_expert_blocks(model: nn.Module) -> list[str]:
    """Names of the `SparseMoe` blocks of `model` whose routed experts are still in the model dtype."""
    return [n for n, m in model.named_modules() if isinstance(m, SparseMoe) and m.fp8_block is None]


def use_fp8_experts_(model: nn.Module, names: list[str], block: tuple[int, int]) -> None:
    """Turn the routed experts of the `SparseMoe` blocks `names` into empty e4m3 buffers with block scales."""
    for name in names:
        model.get_submodule(name).use_fp8_experts_(block)


def quantize_gate_up(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise stacked gate and up rows [..., 2I, H] to e4m3, each half on its own block grid.

    Returns:
        (e4m3 [..., 2I, H], fp32 scales [..., 2 * ceil(I/bn), ceil(H/bk)]): the gate half's row blocks, then
        the up half's, the layout `moe_experts_fp8` reads; for bn dividing I it is the stacked weight's plain
        block scale, as an FP8 release's gate_proj and up_proj scales stack.
    """
    inter = weight.shape[-2] // 2
    gate, gate_scale = kernels.quantize_block_fp8_weight(weight[..., :inter, :], block)
    up, up_scale = kernels.quantize_block_fp8_weight(weight[..., inter:, :], block)
    return torch.cat([gate, up], dim=-2), torch.cat([gate_scale, up_scale], dim=-2)


@torch.no_grad()
def quantize_model_(model: nn.Module, block: tuple[int, int] = (128, 128), experts: bool = True) -> int:
    """Quantise a built model's dense projections, and with `experts` its routed experts, to block FP8 in
    place; returns how many dense projections were converted.

    For models made without a checkpoint (the benchmark's random weights); the loader does the same while
    reading a checkpoint. Experts are quantised one at a time, so the fp32 temporaries stay small.
    """
    names = [n for n, m in model.named_modules() if is_fp8_projection(n, m)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        linear = getattr(owner, child)
        fp8 = Fp8Linear.like(linear, block)
        fp8.weight, fp8.weight_scale_inv = kernels.quantize_block_fp8_weight(linear.weight, block)
        if linear.bias is not None:
            fp8.bias.copy_(linear.bias)
        setattr(owner, child, fp8)
    for name in fp8_expert_blocks(model) if experts else []:
        moe = model.get_submodule(name)
        w13, w2 = moe.w13.detach(), moe.w2.detach()
        moe.use_fp8_experts_(block)
        for e in range(w13.shape[0]):
            moe.w13[e], moe.w13_scale_inv[e] = quantize_gate_up(w13[e], block)
            moe.w2[e], moe.w2_scale_inv[e] = kernels.quantize_block_fp8_weight(w2[e], block)
    return len(names)
