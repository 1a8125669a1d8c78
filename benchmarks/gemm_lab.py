# ruff: noqa: B023 (every lambda here is timed before its loop variables move on)
"""Kernel lab for the prefill GEMMs (llm.c dev/cuda style): variants of one op, each checked, then timed.

    python benchmarks/gemm_lab.py [--parts dense,grouped,torch] [--tokens 2048,8192,16384] [--json PATH]
        [--first] [--no-time] [--write-config]

- dense: the FP8 projections of Qwen3.5-35B-A3B at prefill sizes: ours (`fp8_block_gemm`, x given quantised,
  its tuned tiles), cuBLAS's block-scaled FP8 GEMM (`torch._scaled_mm` with 1x128 activation and 128x128
  weight scales, sm_90 and cuBLASLt >= 12.9), and bf16 cuBLAS on the same shape.
- grouped: the MoE expert GEMMs (256 experts, H 2048, I 512, top 8, routed slots only) at T tokens: ours
  (`moe.triton` bf16, `moe.fp8` FP8) over tile candidates, and the "wide" gate/up variant below, each
  kernel timed alone by the profiler (launch gaps excluded) and checked against the reference; whether the
  compiled PTX holds wgmma.
- torch: the same experts through torch's grouped GEMM (`torch._grouped_mm`, bf16: gather, GEMM, SwiGLU,
  GEMM, weighted scatter) and, for speed only, `torch._scaled_grouped_mm` with row-wise FP8 scales (not
  our numerics: block scales do not fit it).

The wide gate/up kernel loads the gate rows and the up rows of an output block as one [BLOCK_K, 2 BLOCK_N]
weight tile, so each K step is one dot twice as wide (the tensor cores' N) instead of two; the SwiGLU pairs
the halves after the loop. `--first --no-time` runs one candidate of each, untimed (under `ncu`).
Prints tables; --json writes every number. Needs CUDA, except `--device cpu` (interpreter, tiny shapes), which
checks the variants' arithmetic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels_moe import build, profile_kernels

from engine.kernels.fp8 import triton as fp8_triton
from engine.kernels.fp8.quant import has_fp8_dot, quantize_fp8_per_token_group
from engine.kernels.fp8.reference import Fp8Activation, quantize_block_fp8_weight
from engine.kernels.moe import config as moe_config
from engine.kernels.moe import fp8 as moe_fp8
from engine.kernels.moe import reference as moe_reference
from engine.kernels.moe import triton as moe_triton
from engine.kernels.moe.align import align_block_size
from engine.kernels.moe.combine import block_and_tile, combine
from engine.kernels.moe.config import ExpertsConfig, GemmTiles
from engine.model.fp8_linear import quantize_gate_up

DENSE = {"in_proj_qkvz": (12288, 2048), "qkv_proj": (9216, 2048), "out_proj": (2048, 4096)}  # N, K
DENSE_TOKENS = (64, 128, 256, 512, 1024, 4096, 8192, 16384)
TOP_K = 8


def median_us(fn, reps: int = 20) -> float:
    """Median device microseconds of fn() over `reps` calls after warm-up, each between CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return (
        float((out - ref).norm() / ref.norm().clamp_min(1e-30)) if torch.isfinite(out).all() else float("nan")
    )


# ---------------------------------------------------------------------------------------------------- dense


def dense(device: torch.device) -> list[dict]:
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in DENSE.items():
        wb = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(torch.bfloat16)
        w, ws = quantize_block_fp8_weight(wb, (128, 128))  # [N, K] e4m3, [N/128, K/128] fp32
        for m in DENSE_TOKENS:
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            q, s = quantize_fp8_per_token_group(x, 128)  # [M, K] e4m3, [M, K/128] fp32
            xq = Fp8Activation(q, s, 128)
            flop = 2 * m * n * k
            tiles = fp8_triton.gemm_config(m, n, k, device)  # ours, not the cuBLAS path it takes
            ours = fp8_triton.fp8_block_gemm(x, w, ws, xq=xq, config=tiles)
            ref = (q.float() * s.repeat_interleave(128, 1)[:, :k]) @ (
                w.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            ).T
            row = {"op": name, "m": m, "n": n, "k": k, "ours_err": rel_err(ours, ref)}
            row["ours_us"] = median_us(lambda: fp8_triton.fp8_block_gemm(x, w, ws, xq=xq, config=tiles))
            try:
                sa = s.t().contiguous().t()  # [M, K/128], M-major, as cuBLASLt wants
                sb = ws.t()  # [K/128, N/128]
                out = torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                row["cublas_err"] = rel_err(out, ref)
                row["cublas_us"] = median_us(
                    lambda q=q, sa=sa: torch._scaled_mm(
                        q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
                    )
                )
                row["cublas_t_us"] = median_us(  # with the scale transpose it needs
                    lambda q=q, s=s: torch._scaled_mm(
                        q, w.t(), scale_a=s.t().contiguous().t(), scale_b=sb, out_dtype=torch.bfloat16
                    )
                )
            except Exception as exc:
                row["cublas_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            row["bf16_us"] = median_us(lambda x=x: torch.mm(x, wb.t()))
            for key in ("ours", "cublas", "bf16"):
                if f"{key}_us" in row:
                    row[f"{key}_tflops"] = flop / row[f"{key}_us"] / 1e6
            rows.append(row)
            print(
                f"{name:>13} M={m:>6}  ours {row.get('ours_tflops', 0):7.0f}  cublas-fp8 "
                f"{row.get('cublas_tflops', 0):7.0f}  bf16 {row.get('bf16_tflops', 0):7.0f} TFLOP/s  "
                f"err ours {row['ours_err']:.1e} cublas {row.get('cublas_err', float('nan')):.1e}"
                + (f"  [{row['cublas_error']}]" if "cublas_error" in row else ""),
                flush=True,
            )
    return rows


# ------------------------------------------------------------------------------------------ wide gate/up


@triton.jit
def _gate_up_wide_kernel(
    x_ptr,  # [T, H] bf16, or e4m3 with FP8
    xs_ptr,  # [T, ceil(H/bk)] fp32 (FP8 only)
    w13_ptr,  # [E, 2I, H]: gate rows, then up rows
    s13_ptr,  # [E, 2 * ceil(I/bn), ceil(H/bk)] fp32 (FP8 only)
    act_ptr,  # [T*S, I] out
    sorted_pairs_ptr,
    block_experts_ptr,
    block_rows_ptr,
    hidden,
    inter,
    group_n,
    half_blocks,
    stride_xt,
    stride_xh,
    stride_xst,
    stride_xsk,
    stride_we,
    stride_wn,
    stride_wh,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ap,
    stride_ai,
    NUM_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output channels per program: the tile is 2 * BLOCK_N weight rows wide
    BLOCK_K: tl.constexpr,
    FP8: tl.constexpr,
    USE_FP8_DOT: tl.constexpr,
):
    pid_m, pid_n = block_and_tile(tl.cdiv(inter, BLOCK_N))
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    valid = offs_m < tl.load(block_rows_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + offs_m, mask=valid, other=0)
    tokens = (pairs // NUM_SLOTS).to(tl.int64)
    offs_c = tl.arange(0, 2 * BLOCK_N)  # tile columns: BLOCK_N gate rows, then the same channels' up rows
    is_up = offs_c >= BLOCK_N
    chan = pid_n * BLOCK_N + offs_c - tl.where(is_up, BLOCK_N, 0)
    c_mask = chan < inter
    w_row = chan + tl.where(is_up, inter, 0)
    offs_k = tl.arange(0, BLOCK_K)
    expert = expert.to(tl.int64)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BM, BK]
    w_ptrs = (
        w13_ptr + expert * stride_we + w_row[None, :] * stride_wn + offs_k[:, None] * stride_wh
    )  # [BK, 2BN]
    if FP8:
        xs_ptrs = xs_ptr + tokens * stride_xst
        s_ptrs = (
            s13_ptr + expert * stride_se + (chan // group_n + tl.where(is_up, half_blocks, 0)) * stride_sn
        )
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_mask = offs_k < hidden - kb * BLOCK_K
        xt = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & c_mask[None, :], other=0.0)
        if FP8:
            sx = tl.load(xs_ptrs + kb * stride_xsk, mask=valid, other=0.0)
            sw = tl.load(s_ptrs + kb * stride_sk, mask=c_mask, other=0.0)
            if not USE_FP8_DOT:
                xt, w = xt.to(tl.float16), w.to(tl.float16)
            acc += tl.dot(xt, w) * (sx[:, None] * sw[None, :])
        else:
            acc = tl.dot(xt, w, acc)
        x_ptrs += BLOCK_K * stride_xh
        w_ptrs += BLOCK_K * stride_wh
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
    act = gate * tl.sigmoid(gate) * up
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptrs = act_ptr + pairs.to(tl.int64)[:, None] * stride_ap + offs_n[None, :] * stride_ai
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < inter)[None, :])


def gate_up_wide(x, w13, table, slots, inter, block_m, tiles: GemmTiles, xq=None, xs=None, s13=None):
    """act [T*S, I] by the wide kernel; FP8 when xq/xs/s13 are given (bk = 128)."""
    fp8 = xq is not None
    n = x.shape[0] * slots
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    a = xq if fp8 else x
    xs = xs if fp8 else x
    s13 = s13 if fp8 else x.new_zeros(1, 1, 1, dtype=torch.float32)
    return _gate_up_wide_kernel[(table[1].numel() * triton.cdiv(inter, tiles.block_n),)](
        a, xs, w13, s13, act, *table, x.shape[1], inter, 128, triton.cdiv(inter, 128),
        a.stride(0), a.stride(1), xs.stride(0), xs.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        s13.stride(0), s13.stride(1), s13.stride(2), act.stride(0), act.stride(1),
        NUM_SLOTS=slots, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=128 if fp8 else tiles.block_k,
        FP8=fp8, USE_FP8_DOT=fp8 and has_fp8_dot(x.device), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    ), act  # fmt: skip


# -------------------------------------------------------------------------------------------------- grouped

T = GemmTiles  # (block_n, block_k, num_warps, num_stages)
GATE_UP = [
    T(64, 64, 4, 3),
    T(64, 64, 4, 4),
    T(128, 64, 8, 3),
    T(64, 128, 4, 3),
    T(128, 64, 4, 3),
    T(64, 64, 8, 4),
]
DOWN = [
    T(128, 64, 4, 3),
    T(128, 128, 8, 3),
    T(256, 64, 8, 3),
    T(128, 64, 4, 4),
    T(64, 128, 4, 3),
    T(128, 128, 4, 3),
]
WIDE = [
    T(64, 64, 4, 3),
    T(64, 64, 8, 3),
    T(64, 64, 4, 4),
    T(128, 64, 8, 3),
    T(32, 64, 4, 4),
    T(128, 64, 8, 4),
]
TINY_GATE_UP = [GemmTiles(16, 32, 4, 2)]
TINY_DOWN = [GemmTiles(16, 32, 4, 2)]


class Experts:
    """Routed experts of one MoE block and a routed batch, bf16 and FP8 copies."""

    def __init__(self, block, t: int, device: torch.device):
        g = torch.Generator(device=device).manual_seed(t)
        self.w13, self.w2 = block.w13.detach(), block.w2.detach()  # [E, 2I, H], [E, H, I]
        self.x = torch.randn(t, self.w13.shape[2], generator=g, device=device).to(self.w13.dtype)
        logits = torch.nn.functional.linear(self.x, block.router_weight())
        weights, ids = moe_reference.route(logits, block.top_k, block.renormalize, shared=True)
        self.weights, self.ids = weights[:, :-1].contiguous(), ids[:, :-1].contiguous()  # routed slots only
        if device.type == "cuda":
            self.q13, self.s13 = quantize_gate_up(self.w13, (128, 128))
            self.q2, self.s2 = quantize_block_fp8_weight(self.w2, (128, 128))
        else:  # the interpreter: fp16-exact e4m3 values, quantised expert by expert
            pairs = [quantize_gate_up(w, (128, 128)) for w in self.w13]
            self.q13, self.s13 = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            pairs = [quantize_block_fp8_weight(w, (128, 128)) for w in self.w2]
            self.q2, self.s2 = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        self.xq, self.xs = quantize_fp8_per_token_group(self.x, 128)

    def flop(self) -> dict[str, float]:
        _, two_i, h = self.w13.shape
        pairs = self.ids.numel()
        return {"gate_up": 2 * pairs * two_i * h, "down": 2 * pairs * h * (two_i // 2)}

    def reference(self, fp8: bool) -> torch.Tensor:
        if fp8:
            return moe_reference.fp8_experts(
                self.x, self.q13, self.s13, self.q2, self.s2, self.weights, self.ids, (128, 128)
            )
        return moe_reference.experts(
            self.x.float(), self.w13.float(), self.w2.float(), self.weights, self.ids
        )

    def ours(self, fp8: bool, config: ExpertsConfig) -> torch.Tensor:
        if fp8:
            return moe_fp8.fused_experts(
                self.x, self.q13, self.s13, self.q2, self.s2, self.weights, self.ids, (128, 128), config,
                xq=Fp8Activation(self.xq, self.xs, 128),
            )  # fmt: skip
        return moe_triton.fused_experts(self.x, self.w13, self.w2, self.weights, self.ids, config)

    def wide(self, fp8: bool, block_m: int, tiles: GemmTiles, down: GemmTiles) -> tuple[torch.Tensor, object]:
        """The wide gate/up kernel, then our down GEMM and combine (to check the whole block)."""
        e, two_i, h = self.w13.shape
        inter = two_i // 2
        slots = self.ids.shape[1]
        table = align_block_size(self.ids, e, block_m)
        if fp8:
            kernel, act = gate_up_wide(
                self.x, self.q13, table, slots, inter, block_m, tiles, self.xq, self.xs, self.s13
            )
            act, as_ = quantize_fp8_per_token_group(act, 128)
            w2, s2 = self.q2, self.s2
            mode = dict(
                as_ptr=as_, scale_ptr=s2, group_n=128, stride_asp=as_.stride(0), stride_ask=as_.stride(1),
                stride_ce=s2.stride(0), stride_cn=s2.stride(1), stride_ck=s2.stride(2),
                **moe_triton.DOWN_SHARED_ONLY, BLOCK_K=128, USE_FP8=True, USE_FP8_DOT=has_fp8_dot(act.device),
            )  # fmt: skip
        else:
            kernel, act = gate_up_wide(self.x, self.w13, table, slots, inter, block_m, tiles)
            w2 = self.w2
            mode = dict(
                ws2_ptr=w2[0], shared_inter=inter, num_experts=e, stride_sh=w2.stride(1),
                **moe_triton.DOWN_FP8_ONLY, BLOCK_K=down.block_k, USE_FP8=False,
                DOT_PRECISION="ieee" if self.x.dtype == torch.float32 else "tf32",
            )  # fmt: skip
        part = torch.empty(1, act.shape[0], h, dtype=self.x.dtype, device=self.x.device)
        wt = self.weights
        moe_triton._down_kernel[(table[1].numel() * triton.cdiv(h, down.block_n), 1)](
            act_ptr=act, w2_ptr=w2, weights_ptr=wt, part_ptr=part, sorted_pairs_ptr=table[0],
            block_experts_ptr=table[1], block_rows_ptr=table[2], hidden=h, inter=inter,
            stride_ap=act.stride(0), stride_ai=act.stride(1), stride_we=w2.stride(0), stride_wh=w2.stride(1),
            stride_wi=w2.stride(2), stride_gt=wt.stride(0), stride_gs=wt.stride(1), stride_ps=part.stride(0),
            stride_pp=part.stride(1), stride_ph=part.stride(2), NUM_SLOTS=slots, SPLIT_K=1, BLOCK_M=block_m,
            BLOCK_N=down.block_n, num_warps=down.num_warps, num_stages=down.num_stages, **mode,
        )  # fmt: skip
        return combine(part, self.x.shape[0], slots, self.x.dtype), kernel


def kernel_us(fn, device) -> dict[str, float]:
    """Device us per call of each kernel `fn` launches, grouped as gate_up / down / other."""
    us = {"gate_up": 0.0, "down": 0.0, "other": 0.0}
    for name, (_, t) in profile_kernels(fn, device).items():
        us[next((p for p in ("gate_up", "down") if p in name), "other")] += t
    return us


def has_wgmma(kernel) -> bool | None:
    try:
        return "wgmma" in kernel.asm["ptx"]
    except Exception:
        return None


def grouped(device: torch.device, tokens: list[int], tiny: bool, first: bool, timed: bool) -> list[dict]:
    block = build(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = []
    gate_ups, downs, wides = (TINY_GATE_UP, TINY_DOWN, TINY_GATE_UP) if tiny else (GATE_UP, DOWN, WIDE)
    if first:  # one candidate of each (for ncu)
        gate_ups, downs, wides = gate_ups[:1], downs[:1], wides[:1]
    timed = timed and device.type == "cuda"
    for t in tokens:
        ex = Experts(block, t, device)
        flop = ex.flop()
        for fp8 in (False, True):
            dtype = "fp8" if fp8 else "bf16"
            ref = ex.reference(fp8)
            for block_m in (64, 128) if not (tiny or first) else (16 if tiny else 64,):
                pairs = list(zip(gate_ups, downs, strict=True))
                for gu, dn in pairs if block_m != 128 else pairs[:3]:
                    gu_ = GemmTiles(gu.block_n, 128, gu.num_warps, gu.num_stages) if fp8 else gu
                    dn_ = GemmTiles(dn.block_n, 128, dn.num_warps, dn.num_stages) if fp8 else dn
                    config = ExpertsConfig(block_m, gu_, dn_)
                    row = {"t": t, "dtype": dtype, "variant": "ours", "block_m": block_m,
                           "gate_up": gu_.__dict__, "down": dn_.__dict__}  # fmt: skip
                    try:
                        row["err"] = rel_err(ex.ours(fp8, config), ref)
                        if timed:
                            row["us"] = kernel_us(lambda c=config: ex.ours(fp8, c), device)
                    except Exception as exc:  # shared memory, say
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    rows.append(row)
                    report(row, flop)
                for wd in wides if block_m != 128 else wides[3:]:
                    wd_ = GemmTiles(wd.block_n, 128, wd.num_warps, wd.num_stages) if fp8 else wd
                    dn_ = GemmTiles(128, 128, 4, 3) if fp8 else GemmTiles(128, 64, 4, 3)
                    if tiny:
                        dn_ = TINY_DOWN[0] if not fp8 else GemmTiles(16, 128, 4, 2)
                    row = {"t": t, "dtype": dtype, "variant": "wide", "block_m": block_m,
                           "gate_up": wd_.__dict__, "down": dn_.__dict__}  # fmt: skip
                    try:
                        out, kernel = ex.wide(fp8, block_m, wd_, dn_)
                        row["err"] = rel_err(out, ref)
                        row["wgmma"] = has_wgmma(kernel)
                        if timed:
                            row["us"] = kernel_us(lambda w=wd_, d=dn_: ex.wide(fp8, block_m, w, d), device)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    rows.append(row)
                    report(row, flop)
    return rows


def report(row: dict, flop: dict) -> None:
    us = row.get("us")
    if us:
        row["tflops"] = {k: flop[k] / us[k] / 1e6 for k in ("gate_up", "down") if us[k] > 0}
    tf = row.get("tflops", {})
    tiles = f"BM{row['block_m']} gu{tuple(row['gate_up'].values())} dn{tuple(row['down'].values())}"
    print(
        f"T={row['t']:>6} {row['dtype']:>4} {row['variant']:>5} {tiles:<44} "
        f"gate_up {tf.get('gate_up', 0):6.0f} down {tf.get('down', 0):6.0f} TFLOP/s  "
        f"err {row.get('err', float('nan')):.1e} wgmma {row.get('wgmma')} {row.get('error', '')}",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------------- torch


def torch_grouped(device: torch.device, tokens: list[int]) -> list[dict]:
    """The routed experts through torch's grouped GEMMs, stage by stage."""
    block = build(device, torch.bfloat16)
    rows = []
    for t in tokens:
        ex = Experts(block, t, device)
        flop = ex.flop()
        e, two_i, h = ex.w13.shape
        inter = two_i // 2
        flat = ex.ids.flatten()
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=e)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        token_of = (order // TOP_K).contiguous()
        w13t, w2t = ex.w13.transpose(1, 2), ex.w2.transpose(1, 2)  # [E, H, 2I], [E, I, H] column-major
        row = {"t": t, "variant": "torch._grouped_mm bf16"}
        try:
            xs = ex.x[token_of]
            h13 = torch._grouped_mm(xs, w13t, offs=offs)
            act = torch.nn.functional.silu(h13[:, :inter]) * h13[:, inter:]
            y = torch._grouped_mm(act, w2t, offs=offs)
            out = torch.zeros_like(ex.x, dtype=torch.float32).index_add_(
                0, token_of, y.float() * ex.weights.flatten()[order, None]
            )
            row["err"] = rel_err(out, ex.reference(False))
            row["us"] = {
                "gather": median_us(lambda: ex.x[token_of]),
                "gate_up": median_us(lambda: torch._grouped_mm(xs, w13t, offs=offs)),
                "swiglu": median_us(lambda: torch.nn.functional.silu(h13[:, :inter]) * h13[:, inter:]),
                "down": median_us(lambda: torch._grouped_mm(act, w2t, offs=offs)),
            }
            row["tflops"] = {k: flop[k] / row["us"][k] / 1e6 for k in ("gate_up", "down")}
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(f"T={t:>6} {row['variant']}: {row.get('tflops')} us {row.get('us')} err {row.get('err')} "
              f"{row.get('error', '')}", flush=True)  # fmt: skip
        row = {"t": t, "variant": "torch._scaled_grouped_mm rowwise fp8 (speed only)"}
        try:
            fq = lambda a: a.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0  # noqa: E731
            xs = ex.x[token_of]
            sa = fq(xs)
            a8 = (xs.float() / sa).to(torch.float8_e4m3fn)
            sb = fq(ex.w13).squeeze(-1)  # [E, 2I]
            b8 = (
                (ex.w13.float() / sb[..., None]).to(torch.float8_e4m3fn).transpose(1, 2)
            )  # [E, H, 2I] col-major
            call = lambda: torch._scaled_grouped_mm(  # noqa: E731
                a8, b8, sa.squeeze(-1), sb, offs=offs, out_dtype=torch.bfloat16
            )
            call()
            row["us"] = {"gate_up": median_us(call)}
            row["tflops"] = {"gate_up": flop["gate_up"] / row["us"]["gate_up"] / 1e6}
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(f"T={t:>6} {row['variant']}: {row.get('tflops')} {row.get('error', '')}", flush=True)
        bmm_m = t * TOP_K // e
        a = torch.randn(e, bmm_m, h, device=device, dtype=torch.bfloat16)
        row = {"t": t, "variant": f"torch.bmm bf16, {bmm_m} rows per expert (a ceiling)"}
        us = median_us(lambda: torch.bmm(a, w13t))
        row["tflops"] = {"gate_up": 2 * e * bmm_m * h * two_i / us / 1e6}
        rows.append(row)
        print(f"T={t:>6} {row['variant']}: {row['tflops']}", flush=True)
    return rows


def best_configs(rows: list[dict], max_err: float = 2e-2) -> dict[tuple[str, int], ExpertsConfig]:
    """Per (dtype, T): for each BLOCK_M the fastest correct gate/up and down tiles of our kernels, and the
    BLOCK_M whose two kernels take least time together."""
    best: dict[tuple[str, int], tuple[float, ExpertsConfig]] = {}
    groups: dict[tuple[str, int, int], list[dict]] = {}
    for r in rows:
        if r["variant"] == "ours" and r.get("us") and r.get("err", 1.0) <= max_err:
            groups.setdefault((r["dtype"], r["t"], r["block_m"]), []).append(r)
    for (dtype, t, block_m), found in groups.items():
        up = min(found, key=lambda r: r["us"]["gate_up"])
        down = min(found, key=lambda r: r["us"]["down"])
        total = up["us"]["gate_up"] + down["us"]["down"]
        config = ExpertsConfig(block_m, GemmTiles(**up["gate_up"]), GemmTiles(**down["down"]))
        if (dtype, t) not in best or total < best[(dtype, t)][0]:
            best[(dtype, t)] = (total, config)
    return {key: config for key, (_, config) in best.items()}


def write_config(rows: list[dict], device: torch.device) -> None:
    """Merge the winners into this GPU's MoE tile table: bf16 under E=256, k=8; FP8 under E=256, k=8 and the
    stacked shared-expert layout E=257, k=9 (the FP8 engine's, timed here as its routed part)."""
    path = moe_config.table_path(torch.cuda.get_device_name(device))
    table = json.loads(path.read_text()) if path.is_file() else {}
    for (dtype, t), config in sorted(best_configs(rows).items()):
        keys = (
            [moe_config.table_key(256, 2048, 512, 8, torch.bfloat16)]
            if dtype == "bf16"
            else [moe_config.table_key(e, 2048, 512, k, torch.float8_e4m3fn) for e, k in ((256, 8), (257, 9))]
        )
        for key in keys:
            table.setdefault(key, {})[str(t)] = config.to_dict()
        print(f"table {dtype} T={t}: {config}")
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")


def probe(device: torch.device) -> list[dict]:
    """Which calls of the cuBLAS block-scaled path run, and the error of those that do not (cases as the
    engine makes them: the probe first, then prefill sizes, odd row counts, a bias, quantised-by-norm x)."""
    from engine.kernels.fp8 import cublas

    rows = []
    print(f"cublas available: {cublas._available(device.index or 0)}", flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in {**DENSE, "expert_w2": (2048, 512)}.items():
        wb = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(torch.bfloat16)
        w, ws = quantize_block_fp8_weight(wb, (128, 128))
        for m in (16, 512, 1000, 1001, 4096, 8192, 8191):
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            q, s = quantize_fp8_per_token_group(x, 128)
            row = {"op": name, "m": m}
            for label, call in (
                ("block_gemm", lambda: cublas.block_gemm(q, s, w, ws, None, torch.bfloat16)),
                ("linear", lambda: fp8_triton.fp8_block_linear(x, w, ws)),
            ):
                try:
                    call()
                    torch.cuda.synchronize()
                    row[label] = "ok"
                except Exception as exc:
                    row[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="dense,grouped,torch")
    parser.add_argument("--tokens", default="2048,8192,16384")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--first", action="store_true", help="grouped: the first candidate of each list only")
    parser.add_argument("--no-time", action="store_true", help="check, do not time (under ncu)")
    parser.add_argument("--write-config", action="store_true", help="grouped winners into the MoE table")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokens = [int(v) for v in args.tokens.split(",")]
    began = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": triton.__version__}  # fmt: skip
    parts = args.parts.split(",")
    with torch.inference_mode():
        if "probe" in parts and device.type == "cuda":
            result["probe"] = probe(device)
        if "dense" in parts and device.type == "cuda":
            result["dense"] = dense(device)
        if "grouped" in parts:
            result["grouped"] = grouped(device, tokens, device.type != "cuda", args.first, not args.no_time)
            if args.write_config and device.type == "cuda":
                write_config(result["grouped"], device)
        if "torch" in parts and device.type == "cuda":
            result["torch"] = torch_grouped(device, tokens)
    result["seconds"] = time.perf_counter() - began
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"done in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
