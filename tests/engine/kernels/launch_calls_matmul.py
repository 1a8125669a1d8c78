"""The matmul ops' calls for `launches.record` (see `launch_calls.py`): dense linear, block-FP8 linear, and
the MoE block (routing, experts in the model dtype and in FP8, GEMV and grouped paths) at Qwen3.5-35B-A3B's
shapes. The MoE grouped GEMMs and the block-FP8 GEMM take their tiles from the GPU's tuned tables
(`moe/configs/<GPU name>.json`, `fp8/configs/<GPU name>.json`) by token count, so the calls run at every
token count of those tables (and past the MoE one: the shape rules)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from unittest import mock

import torch

from engine import kernels
from tests.engine.kernels.launch_calls import BF16, FP8, FP8_BLOCK, FP32, empty, qwen

SHAPE_RULE_TOKENS = (64, 1024, 4096)  # choose_config's three row buckets at top-8 of 256 experts


def tuned_tokens(directory: Path) -> set[int]:
    """Every token count of the GPU's tuned table in `directory` (`<GPU name>.json`), any key."""
    from engine.kernels.moe.config import table_path

    path = table_path(torch.cuda.get_device_name(0), directory)  # the simulated GPU's name
    table = json.loads(path.read_text()) if path.is_file() else {}
    return {int(t) for rows in table.values() for t in rows}


def moe_tokens() -> list[int]:
    """Token counts for the experts: the GEMV path's (a few tokens), the grouped GEMMs' with the one-launch
    align (24), every token count of the GPU's tuned table (each picks its own entry; those few enough for
    the GEMV path take it instead), and one past the table (the shape rules)."""
    from engine.kernels.moe.config import CONFIG_DIR

    tuned = tuned_tokens(CONFIG_DIR)
    return sorted({1, 8, 24} | tuned | ({2 * max(tuned) + 1} if tuned else set()))


def blocks(n: int, block: int = 128) -> int:
    return -(-n // block)


# ---------------------------------------------------------------------------------------------------------
# Dense linears.


def projections() -> dict[str, tuple[int, int]]:
    """[N, K] of the model's projections that run `kernels.linear`."""
    c = qwen()
    h, qkvz = c.hidden_size, c.linear_conv_dim + c.linear_value_dim
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    return {
        "in_proj (qkvz and ba fused)": (qkvz + 2 * c.linear_num_value_heads, h),
        "in_proj_qkvz": (qkvz, h),
        "in_proj_ba": (2 * c.linear_num_value_heads, h),
        "qkv_proj": (hq * 2 * d + 2 * hkv * d, h),
        "o_proj, out_proj": (h, c.linear_value_dim),
        "router and shared gate, padded to 8 rows": (-(-(c.num_experts + 1) // 8) * 8, h),
    }


def linear_in_capture() -> None:
    """A split linear first used inside a CUDA graph capture has no tile counters yet: its partial sums go to
    `_sum_splits_kernel`. So this runs before any other linear call (first in CALLS)."""
    n, k = projections()["router and shared gate, padded to 8 rows"]
    with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
        for dtype, bias in ((BF16, False), (BF16, True), (FP32, False)):
            kernels.linear(
                empty(2, k, dtype=dtype), empty(n, k, dtype=dtype), empty(n, dtype=dtype) if bias else None
            )


def linear() -> None:
    from engine.kernels.linear import triton as linear_triton

    shapes = projections()
    for n, k in shapes.values():
        for m in (1, 2, 4, 8):  # the kernel at 1 row (wide tiles), and at up to 8 for narrow outputs
            kernels.linear(empty(m, k), empty(n, k))
    h = qwen().hidden_size
    kernels.linear(empty(2, h, dtype=FP32), empty(qwen().num_experts + 1, h, dtype=FP32))
    for m, name in ((1, "qkv_proj"), (3, "router and shared gate, padded to 8 rows")):  # attention_bias
        n, k = shapes[name]
        kernels.linear(empty(m, k), empty(n, k), empty(n))
    # The default tiles on wide outputs and several rows (benchmarks/kernels_linear.py, against cuBLAS).
    runs = [(m, "in_proj_qkvz", False) for m in (1, 4, 8)] + [
        (3, "qkv_proj", True),
        (1, "o_proj, out_proj", False),
    ]
    for m, name, bias in runs:
        n, k = shapes[name]
        b = empty(n) if bias else None
        linear_triton.run_kernel(empty(m, k), empty(n, k), None, b, None, linear_triton.LinearTiles())


def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return empty(n, k, dtype=FP8), empty(blocks(n), blocks(k), dtype=FP32)


def quantised(m: int, k: int):
    """x [m, k] quantised per 128 channels, as the norm before an FP8 projection hands it over."""
    from engine.kernels.fp8.reference import Fp8Activation

    return Fp8Activation(empty(m, k, dtype=FP8), empty(m, blocks(k), dtype=FP32), 128)


def fp8_linear() -> None:
    from engine.kernels.fp8 import triton as fp8_triton
    from engine.kernels.fp8.config import GemmConfig
    from engine.kernels.linear import triton as linear_triton

    c = qwen()
    h, i = c.hidden_size, c.shared_expert_intermediate_size
    shapes = [projections()[name] for name in ("in_proj_qkvz", "qkv_proj", "o_proj, out_proj")]
    shapes += [(2 * i, h), (h, i)]  # the FP8 shared expert's gate_up and down
    # One row: the few-token kernel (x quantised first on wide outputs); then the GEMM, at its shape rules'
    # M buckets and every token count of the GPU's tuned table.
    from engine.kernels.fp8.config import CONFIG_DIR

    for n, k in shapes:
        for m in sorted({1, 4, 16, 32, 64, 4096} | tuned_tokens(CONFIG_DIR)):
            kernels.fp8_block_linear(empty(m, k), *fp8_weight(n, k))
    qkvz, o_proj = projections()["in_proj_qkvz"], projections()["o_proj, out_proj"]
    kernels.fp8_block_linear(empty(64, qkvz[1]), *fp8_weight(*qkvz), bias=empty(qkvz[0]))
    kernels.fp8_block_linear(empty(4096, i, dtype=FP32), *fp8_weight(h, i))  # no tuned entry: the rules
    kernels.quantize_fp8_per_token_group(empty(64, h, dtype=FP32))
    # The few-token kernel's options: inline quantisation on a wide output, at 8 rows with a bias, with K
    # split as it chooses and unsplit (explicit tiles); a prequantised narrow output.
    unsplit = dataclasses.replace(linear_triton.FP8_TILES, split_k=1)
    for tiles in (None, unsplit):
        linear_triton.fp8_linear(empty(1, qkvz[1]), *fp8_weight(*qkvz), tiles=tiles)
        linear_triton.fp8_linear(empty(8, qkvz[1]), *fp8_weight(*qkvz), empty(qkvz[0]), tiles=tiles)
    linear_triton.fp8_linear(empty(1, o_proj[1]), *fp8_weight(*o_proj), prequantize=True)
    # x quantised by the norm before it: one row (either width), and the GEMM; the GEMM's K splits.
    for m, (n, k) in ((1, qkvz), (1, o_proj), (64, qkvz)):
        kernels.fp8_block_linear(empty(m, k), *fp8_weight(n, k), xq=quantised(m, k))
    for split in (2, 4):
        config = GemmConfig(64, 64, 4, 4, split)
        fp8_triton.fp8_block_gemm(empty(64, o_proj[1]), *fp8_weight(*o_proj), config=config)


# ---------------------------------------------------------------------------------------------------------
# MoE.


def routing(t: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route`'s outputs: weights [T, S] fp32, ids [T, S] int64."""
    return empty(t, slots, dtype=FP32), empty(t, slots, dtype=torch.int64)


def moe_route() -> None:
    c = qwen()
    e, k = c.num_experts, c.num_experts_per_tok
    padded = projections()["router and shared gate, padded to 8 rows"][0]
    for dtype, renorm in ((BF16, True), (BF16, False), (FP32, True)):
        logits = empty(8, padded, dtype=dtype)[:, : e + 1]  # the model's view of the router GEMM
        kernels.moe_route(logits, k, renorm, shared=True)
    kernels.moe_route(empty(8, e), k, True)  # no shared expert


def moe_experts() -> None:
    from engine.kernels.moe import triton as moe_triton
    from engine.kernels.moe.config import choose_config

    c = qwen()
    e, k, h, i = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    si = c.shared_expert_intermediate_size
    for dtype, tokens in ((BF16, moe_tokens()), (FP32, (1, *SHAPE_RULE_TOKENS))):
        experts = (empty(e, 2 * i, h, dtype=dtype), empty(e, h, i, dtype=dtype))
        shared = (empty(2 * si, h, dtype=dtype), empty(h, si, dtype=dtype))
        for t in tokens:  # the shared expert as slot k
            kernels.moe_experts(empty(t, h, dtype=dtype), *experts, *routing(t, k + 1), *shared)
    # A shared expert run on its own (FP8, or hooked), added by the combine.
    experts = (empty(e, 2 * i, h), empty(e, h, i))
    for t in (1, 64):
        weights, ids = routing(t, k + 1)
        out = dict(shared_out=empty(t, h), shared_gate=weights[:, k])
        kernels.moe_experts(empty(t, h), *experts, weights[:, :k], ids[:, :k], **out)
    # The shape rules (GPUs without a tuned table), each also with the down GEMM's K split in two.
    shared = (empty(2 * si, h), empty(h, si))
    for t in SHAPE_RULE_TOKENS:
        config = choose_config(t, k, e, BF16)
        for split in (1, 2):
            args = (empty(t, h), *experts, *routing(t, k + 1), dataclasses.replace(config, split_k=split))
            moe_triton.fused_experts(*args, *shared)


def fp8_experts(experts: int) -> tuple[torch.Tensor, ...]:
    """w13, w13_scale, w2, w2_scale of `experts` block-FP8 experts."""
    c = qwen()
    h, i = c.hidden_size, c.moe_intermediate_size
    w13, s13 = empty(experts, 2 * i, h, dtype=FP8), empty(experts, 2 * blocks(i), blocks(h), dtype=FP32)
    return w13, s13, empty(experts, h, i, dtype=FP8), empty(experts, blocks(h), blocks(i), dtype=FP32)


def moe_experts_fp8() -> None:
    from engine.kernels.moe import fp8 as moe_fp8
    from engine.kernels.moe.config import choose_config

    c = qwen()
    e, k, h = c.num_experts, c.num_experts_per_tok, c.hidden_size
    routed, stacked = fp8_experts(e), fp8_experts(e + 1)
    for t in moe_tokens():  # serving: the FP8 shared expert stacked as expert E (slot k)
        kernels.moe_experts_fp8(empty(t, h), *stacked, *routing(t, k + 1), FP8_BLOCK)
    for t in (1, 64):  # x quantised by the norm before the block (GEMV, grouped)
        kernels.moe_experts_fp8(empty(t, h), *stacked, *routing(t, k + 1), FP8_BLOCK, xq=quantised(t, h))
    for t in (1, 24, 64):  # the shared expert on its own, added by the combine (GEMV, both aligns)
        weights, ids = routing(t, k + 1)
        extra = (empty(t, h), weights[:, k])
        kernels.moe_experts_fp8(empty(t, h), *routed, weights[:, :k], ids[:, :k], FP8_BLOCK, *extra)
    # The shape rules for bf16 and fp32 tokens (fp32: two buckets), and the down GEMM's K split in two.
    for dtype, tokens in ((BF16, SHAPE_RULE_TOKENS), (FP32, SHAPE_RULE_TOKENS[::2])):
        for t in tokens:
            config = choose_config(t, k, e, dtype)
            for split in (1, 2) if t == tokens[0] else (1,):
                args = (empty(t, h, dtype=dtype), *routed, *routing(t, k), FP8_BLOCK)
                moe_fp8.fused_experts(*args, dataclasses.replace(config, split_k=split))


CALLS = [linear_in_capture, linear, fp8_linear, moe_route, moe_experts, moe_experts_fp8]
