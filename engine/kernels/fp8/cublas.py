"""cuBLASLt's block-scaled FP8 GEMM (DeepSeek-style 1x128 activation, 128x128 weight scales), for many rows.

`torch._scaled_mm` runs it on Hopper (sm_90) with cuBLASLt 12.9 or newer: e4m3 x e4m3 with one fp32 scale per
(token, 128 channels) of x and per 128 x 128 block of the weight, fp32 accumulation, the same arithmetic as
`fp8.reference.fp8_block_linear`. On an H200 it ran the Qwen3.5 projections at 1,065-1,158 TFLOP/s from 8,192
rows and 344-662 at 512-1,024 rows, against 95-557 for our Triton block GEMM and 214-751 for bf16 cuBLAS
(benchmarks/gemm_lab.py at f259c7c, docs/PERFORMANCE.md). So the FP8 block linear takes it from `MIN_ROWS`
rows, where it is there and the shapes suit it (`fits`); fewer rows stay on the Triton GEMV and GEMM, which
read the weight at bandwidth.

Its layouts: x [M, K] row-major with scales [M, K/128] M-major (stride (1, M)); the weight as [K, N]
column-major (the stored [N, K] transposed, no copy) with scales [K/128, N/128] K-major, which the stored
[N/128, K/128] scales transposed are when K/128 is a multiple of 4 (cuBLASLt pads that dimension to 4).
"""

from __future__ import annotations

import functools

import torch

MIN_ROWS = 512  # measured faster than the Triton block GEMM at every size from here (f259c7c)
BLOCK = (128, 128)
_REFUSED: set[tuple[int, int, int]] = set()  # (M, N, K) cuBLASLt refused once: the Triton GEMM runs them


@functools.cache
def _available(index: int) -> bool:
    """Whether this CUDA device runs the block-scaled `_scaled_mm` (sm_90, a torch/cuBLASLt that has it):
    asked once per device with a one-block GEMM, since only running it tells."""
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False  # cuBLASLt's 1x128 / 128x128 scaling is an sm_90 feature; sm_100 has its own formats
    device = torch.device("cuda", index)
    try:
        a = torch.ones(16, 512, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(128, 512, device=device).to(torch.float8_e4m3fn)
        sa = torch.ones(4, 16, device=device).t()  # [16, 4], M-major
        sb = torch.ones(1, 4, device=device).t()  # [4, 1]
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        return bool(out.float().eq(512.0).all())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


def fits(
    rows: int, weight: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype, bias: bool = False
) -> str | None:
    """None when `block_gemm` can run these shapes on this device, else the reason it cannot."""
    n, k = weight.shape
    if rows < MIN_ROWS:
        return "fewer rows than cuBLAS pays for"
    if bias:
        # Added to the rounded output it would round twice (1 bf16 ulp more, measured on the H200); the
        # Triton GEMM adds it in fp32 first. Qwen3.5's projections have no bias.
        return "a bias (the Triton GEMM adds it before its one rounding)"
    if (rows, n, k) in _REFUSED:
        return "cuBLASLt refused this shape before"
    if weight.device.type != "cuda" or not _available(weight.device.index or 0):
        return "no block-scaled cuBLASLt GEMM on this device (sm_90, cuBLASLt >= 12.9)"
    if tuple(block) != BLOCK:
        return "scale blocks are not 128 x 128"
    if k % 512 or n % 16:
        return "K is not a multiple of 512 or N of 16 (cuBLASLt's scale and matrix alignment)"
    if out_dtype not in (torch.bfloat16, torch.float16):
        return "output dtype is not bf16 or fp16"
    return None


def block_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor | None:
    """x_q [M, K] e4m3 with x_scale [M, K/128] fp32 times weight [N, K] e4m3 with weight_scale_inv
    [N/128, K/128] -> [M, N] in `out_dtype`, where `fits` said yes; None when cuBLASLt refuses the call (its
    heuristic finds no algorithm, as for 513 rows of in_proj_qkvz on the H200: the shape is remembered, and
    the caller runs the Triton GEMM)."""
    scale_a = x_scale.t().contiguous().t()  # M-major, as cuBLASLt reads it
    try:
        out = torch._scaled_mm(
            x_q, weight.t(), scale_a=scale_a, scale_b=weight_scale_inv.t(), out_dtype=out_dtype
        )
    except RuntimeError:
        _REFUSED.add((x_q.shape[0], *weight.shape))
        return None
    return out
