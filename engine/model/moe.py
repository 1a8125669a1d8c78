"""Feed-forward blocks: the sparse MoE with a gated shared expert, and the dense SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from engine import kernels
from engine.config import ModelConfig
from engine.kernels import PendingCombine, dispatch
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.moe.pending import DEFER_MAX_TOKENS
from engine.kernels.swiglu import swiglu
from engine.model.linear import fp8_group, project


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused as [gate rows | up rows]."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def fp8_input_group(self) -> int | None:
        """The activation group of an FP8 `gate_up_proj` (its input may come quantised), else None."""
        return fp8_group(self.gate_up_proj)

    def forward(self, x: torch.Tensor, xq: Fp8Activation | None = None) -> torch.Tensor:
        return self.down_proj(swiglu(project(self.gate_up_proj, x, xq)))


def hooked(*modules: nn.Module) -> bool:
    """Whether any of `modules` carries forward hooks (engine.bench's expert load, tests): those run, and may
    change what it computes, only when the module itself is called, so such a module is not fused."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class SparseMoe(nn.Module):
    """Top-k routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

    The shared expert runs as one more expert of the grouped GEMMs (id E, its gate logit one more column of
    the router's GEMM), so the block is router GEMM, routing, and the experts' kernels. With
    `quantization="fp8"` the shared expert is FP8 (`Fp8Linear`), and `use_fp8_experts_` turns the stacked
    experts into e4m3 buffers with block scales, run by the W8A8 `moe_experts_fp8`; for serving,
    `stack_fp8_shared_` appends the FP8 shared expert to them as expert E, so FP8 runs the same three kernels
    as bf16. Modules with forward hooks run as themselves, unfused (see `hooked`).
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
        self._router: tuple[tuple, torch.Tensor] | None = None  # (source key, [E + 1, H] weight)
        self.fp8_block: tuple[int, int] | None = None  # set by use_fp8_experts_
        # (w13, w13_scale_inv, w2, w2_scale_inv) of E + 1 experts, the FP8 shared expert last; see
        # stack_fp8_shared_
        self._stacked: tuple[torch.Tensor, ...] | None = None

    def use_fp8_experts_(self, block: tuple[int, int] = (128, 128)) -> None:
        """Hold the experts in block FP8 from now on: w13 and w2 become empty e4m3 buffers of the same shapes
        on the same device, beside fp32 `w13_scale_inv` [E, 2 * ceil(I/bn), ceil(H/bk)] (the gate half's row
        blocks, then the up half's) and `w2_scale_inv` [E, ceil(H/bn), ceil(I/bk)], for the caller to fill.

        Applied from outside after the model is built (the loader, `fp8_linear.quantize_model_`), after any
        dtype cast: `Module.to(dtype)` would cast the e4m3 buffers too.
        """
        bn, bk = block
        (e, two_i, h), device = self.w13.shape, self.w13.device
        i, fp32 = two_i // 2, torch.float32
        del self.w13, self.w2  # the model-dtype parameters
        with torch.device(device):
            self.register_buffer("w13", torch.empty(e, two_i, h, dtype=torch.float8_e4m3fn))
            self.register_buffer("w13_scale_inv", torch.empty(e, 2 * -(-i // bn), -(-h // bk), dtype=fp32))
            self.register_buffer("w2", torch.empty(e, h, i, dtype=torch.float8_e4m3fn))
            self.register_buffer("w2_scale_inv", torch.empty(e, -(-h // bn), -(-i // bk), dtype=fp32))
        self.fp8_block = block

    def stack_fp8_shared_(self) -> bool:
        """Make an FP8 shared expert expert E of the stacked e4m3 experts; True if it did.

        Run on its own, an FP8 shared expert costs five more launches per layer than bf16's (two FP8 linears
        with their split-K sums, and the SwiGLU): at one token about 200 launches per decode step, most of
        the gap between FP8 and bf16 at batch 1. Stacked, its routing slot (id E, weight sigmoid of its gate
        logit) runs in the same GEMV or grouped GEMMs as the routed experts. The routed `w13`/`w2` and the
        shared expert's `weight`s become views of the stacked tensors (no copy is kept, `state_dict()` is
        unchanged). Only when the shared expert has the routed experts' shapes and block scales (Qwen3.5 and
        3.6: 512 intermediate channels); else it keeps running on its own. For serving, after loading, before
        CUDA graphs are captured.
        """
        shared = self.shared_expert
        if self.fp8_block is None or self._stacked is not None or shared is None:
            return False
        gate_up, down = shared.gate_up_proj, shared.down_proj
        parts = [
            (self.w13, self.w13_scale_inv, gate_up),
            (self.w2, self.w2_scale_inv, down),
        ]
        for weight, scale, linear in parts:
            fits = getattr(linear, "block", None) == self.fp8_block and getattr(linear, "bias", 0) is None
            if not (
                fits
                and linear.weight.dtype == weight.dtype
                and linear.weight.shape == weight.shape[1:]
                and linear.weight_scale_inv.shape == scale.shape[1:]  # equal only when bn divides I
            ):
                return False
        num_experts = self.w13.shape[0]
        stacked = []
        for weight, scale, linear in parts:
            stacked.append(torch.cat([weight, linear.weight[None]]))
            stacked.append(torch.cat([scale, linear.weight_scale_inv[None]]))
        w13, s13, w2, s2 = stacked
        self.w13, self.w13_scale_inv = w13[:num_experts], s13[:num_experts]
        self.w2, self.w2_scale_inv = w2[:num_experts], s2[:num_experts]
        gate_up.weight, gate_up.weight_scale_inv = w13[num_experts], s13[num_experts]
        down.weight, down.weight_scale_inv = w2[num_experts], s2[num_experts]
        self._stacked = (w13, s13, w2, s2)
        return True

    def _fp8_experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared_out: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        xq: Fp8Activation | None = None,
        *,
        defer: bool = False,
    ) -> torch.Tensor | PendingCombine:
        w = (self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv)
        block = self.fp8_block
        return kernels.moe_experts_fp8(x, *w, weights, ids, block, shared_out, shared_gate, xq, defer=defer)

    def fp8_input_group(self) -> int | None:
        """The activation group of FP8 experts (their input may come quantised), else None."""
        return self.fp8_block[1] if self.fp8_block is not None else None

    def forward(
        self, x: torch.Tensor, xq: Fp8Activation | None = None, *, defer: bool = False
    ) -> torch.Tensor | PendingCombine:
        """x [T, H] -> [T, H]; `xq`: x quantised for FP8 experts by the norm that produced it. With `defer`,
        the Triton experts' output before their combine (`PendingCombine`) where they run, for the residual
        add + norm after this block to sum in its kernel: at most DEFER_MAX_TOKENS tokens, and never while
        this module has forward hooks (they would see it)."""
        defer = defer and x.shape[0] <= DEFER_MAX_TOKENS and not hooked(self)
        if self.shared_expert is None:
            weights, ids = kernels.moe_route(self.gate(x), self.top_k, self.renormalize)
            if self.fp8_block is not None:
                return self._fp8_experts(x, weights, ids, xq=xq, defer=defer)
            return kernels.moe_experts(x, self.w13, self.w2, weights, ids, defer=defer)
        if hooked(self.gate, self.shared_expert_gate):
            logits = torch.cat([self.gate(x), self.shared_expert_gate(x)], dim=-1)
        else:
            # [T, E + 1]: router, then shared gate (a view of the aligned [T, E + 1 + pad] product)
            logits = kernels.linear(x, self._router_rows())[..., : self.gate.weight.shape[0] + 1]
        weights, ids = kernels.moe_route(logits, self.top_k, self.renormalize, shared=True)  # [T, k + 1]
        shared = self.shared_expert
        gate_up, down = shared.gate_up_proj, shared.down_proj
        plain = isinstance(gate_up, nn.Linear) and isinstance(down, nn.Linear)
        if plain and self.fp8_block is None and not hooked(shared, gate_up, down):
            dispatch.choose("moe_shared_expert", "fused")  # expert E of the experts' kernels
            shared_w = (gate_up.weight, down.weight)
            return kernels.moe_experts(x, self.w13, self.w2, weights, ids, *shared_w, defer=defer)
        if self._stacked is not None and not hooked(shared, gate_up, down):
            dispatch.choose("moe_shared_expert", "fused")
            return kernels.moe_experts_fp8(
                x, *self._stacked, weights, ids, self.fp8_block, xq=xq, defer=defer
            )
        k = self.top_k  # an FP8 shared expert, or FP8 experts: on its own, added with its slot's weight
        dispatch.choose("moe_shared_expert", "separate")
        shared = self.shared_expert(x, xq) if self.shared_expert.fp8_input_group() else self.shared_expert(x)
        if self.fp8_block is not None:
            return self._fp8_experts(x, weights[:, :k], ids[:, :k], shared, weights[:, k], xq, defer=defer)
        routed = (weights[:, :k], ids[:, :k])
        return kernels.moe_experts(
            x, self.w13, self.w2, *routed, shared_out=shared, shared_gate=weights[:, k], defer=defer
        )

    def router_weight(self) -> torch.Tensor:
        """[E + 1, H]: the router's rows, then the shared expert gate's, so one GEMM gives both.

        The loader fills `gate` and `shared_expert_gate` by name; the concatenation is made on first use and
        again whenever either weight moves or is written in place (its storage or version changes).
        """
        return self._router_rows()[: self.gate.weight.shape[0] + 1]

    def _router_rows(self) -> torch.Tensor:
        """`router_weight` with zero rows after it up to a multiple of 8: [E + 1, H] is 257 rows at Qwen3.5's
        shapes, and logits rows of 257 elements are not 16-byte aligned, so cuBLAS took an sm_75 kernel for
        the prefill router (157 us at 8,192 tokens on an H200, 4% of an FP8 prefill step)."""
        parts = (self.gate.weight, self.shared_expert_gate.weight)
        key = tuple((p.data_ptr(), p.device, p.dtype, 0 if p.is_inference() else p._version) for p in parts)
        if self._router is None or self._router[0] != key:
            rows = torch.cat([p.detach() for p in parts])
            pad = -rows.shape[0] % 8
            self._router = (key, torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows)
        return self._router[1]
