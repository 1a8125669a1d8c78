"""Benchmark: the few-token dense linear (engine/kernels/linear) against cuBLAS, and its FP8 variant against
the quantiser + GEMM path.

    python benchmarks/kernels_linear.py [--rows 1,4,8,16] [--shapes router,out_proj] [--sweep] [--json PATH]

Qwen3.5-35B-A3B's projections at decode, (K, N): in_proj_qkvz 2048 -> 12288, out_proj / o_proj 4096 -> 2048,
in_proj_ba 2048 -> 64, the router 2048 -> 257 (256 experts and the shared gate), qkv_proj 2048 -> 9216. For
each and M token rows:
  - bf16: the Triton kernel (`linear.triton.run_kernel`, above MAX_ROWS too, to show where cuBLAS takes
    over) against F.linear (cuBLAS);
  - FP8 (e4m3 weights, 128 x 128 scale blocks): the kernel with x quantised inline against the quantiser
    launch + tensor-core GEMM (`fp8.triton.fp8_block_gemm`, what `fp8_block_linear` ran before).
Each is checked against its fp32 reference (relative error) and timed as device time per call from
torch.profiler (all the call's kernels summed, a split-K sum or the quantiser included), with the L2 flushed
before every call: at decode each layer's weights are cold. GB/s counts the weight bytes.
--sweep also times the LinearTiles candidates in SWEEP for each shape at M <= MAX_ROWS, and prints the best
(a minute or two more). Prints a table; writes JSON (default benchmarks/results/kernels_linear.json).
Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "in_proj_qkvz": (2048, 12288),
    "out_proj": (4096, 2048),
    "in_proj_ba": (2048, 64),
    "router": (2048, 257),
    "qkv_proj": (2048, 9216),
}
DEVICE = "cuda"
BLOCK = (128, 128)
CALLS = 20  # profiled calls per measurement, each after an L2 flush
FLUSH_BYTES = 256 << 20  # larger than an H200's L2 (50 MB)
REL_TOL = 2e-2  # bf16 outputs (2^-9 rounding) against fp32 references; FP8 against the W8A8 reference
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "kernels_linear.json"


def sweep_candidates():
    from engine.kernels.linear.triton import LinearTiles

    return [
        LinearTiles(block_n=4, k_bytes=1024),  # long K steps for one-byte weights
        LinearTiles(block_n=8, k_bytes=2048),
        LinearTiles(block_n=2, k_bytes=2048),
        LinearTiles(block_n=4, k_bytes=2048, num_warps=8),
        LinearTiles(),  # the default: 8 rows, 1 KB of each per step, split K to ~4 programs per SM
        LinearTiles(block_n=4),
        LinearTiles(block_n=16),
        LinearTiles(k_bytes=2048),
        LinearTiles(k_bytes=512, block_n=16),
        LinearTiles(num_warps=8, block_n=16),
        LinearTiles(split_k=1),  # never split: one launch
        LinearTiles(group_bytes=256),  # 128-channel groups: cross-lane sums every step
        LinearTiles(block_n=32, k_bytes=256),  # FP8_TILES
        LinearTiles(block_n=64, k_bytes=256, num_warps=8),
        LinearTiles(block_n=16, split_k=2),
        LinearTiles(block_n=16, split_k=4),
        LinearTiles(block_n=32, k_bytes=512, split_k=4),
        LinearTiles(block_n=16, k_bytes=2048, num_warps=8),
        LinearTiles(block_n=32, k_bytes=1024, num_warps=8, split_k=2),
        LinearTiles(block_n=4, group_bytes=256),
        LinearTiles(block_n=2),
        LinearTiles(block_n=2, group_bytes=256),
        LinearTiles(block_n=4, num_warps=2),
        LinearTiles(block_n=4, k_bytes=2048),
        LinearTiles(block_n=4, split_k=1),
        LinearTiles(block_n=8, group_bytes=256, split_k=1),
    ]


def device_us(fn, flush: torch.Tensor) -> float:
    """Device microseconds per call of `fn`: the profiler's kernel times, L2 flushes left out."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # compile outside the measurement
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and "FillFunctor" not in e.key:
            total += e.self_device_time_total
    return total / CALLS


def relative(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.float(), expected.float()
    return ((out - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def weights(k: int, n: int, seed: int) -> dict:
    """bf16 weight [N, K] ~1/sqrt(K), and its e4m3 copy with 128 x 128 block scales."""
    from engine.kernels.fp8 import reference as fp8_reference

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=DEVICE) * k**-0.5
    w8, scale = fp8_reference.quantize_block_fp8_weight(w, BLOCK)
    return {"bf16": w.to(torch.bfloat16), "fp8": w8, "scale": scale}


def run_point(name: str, k: int, n: int, m: int, w: dict, flush: torch.Tensor) -> dict:
    from engine.kernels.fp8 import reference as fp8_reference
    from engine.kernels.fp8 import triton as fp8_triton
    from engine.kernels.linear import triton as linear_triton

    tiles, tiles_fp8 = linear_triton.LinearTiles(), linear_triton.FP8_TILES
    x = torch.randn(m, k, generator=torch.Generator(device=DEVICE).manual_seed(m), device=DEVICE)
    x = x.to(torch.bfloat16)
    point = {"shape": name, "k": k, "n": n, "rows": m, "kernel_default": m <= linear_triton.MAX_ROWS}

    def kernel():
        return linear_triton.run_kernel(x, w["bf16"], None, None, None, tiles)

    def kernel_fp8():
        return linear_triton.run_kernel(x, w["fp8"], w["scale"], None, BLOCK, tiles_fp8)

    def cublas():
        return F.linear(x, w["bf16"])

    def gemm_fp8():
        return fp8_triton.fp8_block_gemm(x, w["fp8"], w["scale"], None, BLOCK)

    def kernel_fp8q():  # x quantised by its own launch first, then FP8Q_TILES
        return linear_triton.fp8_linear(x, w["fp8"], w["scale"], None, BLOCK, prequantize=True)

    expected = F.linear(x.float(), w["bf16"].float())
    expected_fp8 = fp8_reference.fp8_block_linear(x.float(), w["fp8"], w["scale"], None, BLOCK)
    point["rel_error"] = relative(kernel(), expected)
    point["rel_error_fp8"] = relative(kernel_fp8(), expected_fp8)
    point["rel_error_fp8q"] = relative(kernel_fp8q(), expected_fp8) if m <= linear_triton.FP8_MAX_ROWS else 0
    point["ok"] = max(point["rel_error"], point["rel_error_fp8"], point["rel_error_fp8q"]) < REL_TOL
    bytes_bf16, bytes_fp8 = n * k * 2, n * k + w["scale"].numel() * 4
    for key, fn, moved in (
        ("triton", kernel, bytes_bf16),
        ("cublas", cublas, bytes_bf16),
        ("triton_fp8", kernel_fp8, bytes_fp8),
        ("gemm_fp8", gemm_fp8, bytes_fp8),
        *((("triton_fp8q", kernel_fp8q, bytes_fp8),) if m <= linear_triton.FP8_MAX_ROWS else ()),
    ):
        us = device_us(fn, flush)
        point[key] = {"us": us, "gb_per_s": moved / us / 1e3 if us > 0 else None}
    return point


def sweep(name: str, k: int, n: int, m: int, w: dict, flush: torch.Tensor) -> dict:
    """Each SWEEP candidate's device us in bf16 and FP8; the best of each."""
    from engine.kernels.linear import triton as linear_triton

    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    rows = []
    for tiles in sweep_candidates():
        row = {"tiles": vars(tiles)}
        for key, args in (
            ("bf16", (w["bf16"], None, None, False)),
            ("fp8", (w["fp8"], w["scale"], BLOCK, False)),
            ("fp8q", (w["fp8"], w["scale"], BLOCK, True)),
        ):

            def call(args=args, tiles=tiles):
                weight, scale, block, pre = args
                return linear_triton.run_kernel(x, weight, scale, None, block, tiles, pre)

            try:
                row[key] = device_us(call, flush)
            except Exception as e:  # a candidate that does not compile or launch is reported, not fatal
                row[key] = None
                print(f"  skip {name} M={m} {tiles} {key}: {type(e).__name__}: {e}", flush=True)
        rows.append(row)
    best = {}
    for key in ("bf16", "fp8", "fp8q"):
        timed = [r for r in rows if r[key] is not None]
        if timed:
            top = min(timed, key=lambda r: r[key])
            best[key] = {"tiles": top["tiles"], "us": top[key]}
    return {"candidates": rows, "best": best}


def print_table(points: list[dict], device: str) -> None:
    print(
        f"\nDense linear on {device}: device us per call (GB/s of weight bytes), L2 flushed before each call"
    )
    head = f"{'shape':>13} {'K':>5} {'N':>6} {'M':>3} | {'bf16 triton':>17} {'cuBLAS':>17} {'x':>5}"
    print(
        head
        + f" | {'fp8 triton':>17} {'quant+GEMM':>17} {'x':>5} | {'fp8 prequant':>17} | {'err':>7} {'err8':>7}"
    )

    def cell(t: dict) -> str:
        return f"{t['us']:7.2f} ({t['gb_per_s'] or 0:6.0f})"

    for p in points:
        speed = p["cublas"]["us"] / p["triton"]["us"] if p["triton"]["us"] else float("nan")
        speed8 = p["gemm_fp8"]["us"] / p["triton_fp8"]["us"] if p["triton_fp8"]["us"] else float("nan")
        mark = "" if p["kernel_default"] else "  (above MAX_ROWS: cuBLAS / GEMM in use)"
        print(
            f"{p['shape']:>13} {p['k']:>5} {p['n']:>6} {p['rows']:>3} |"
            f" {cell(p['triton'])} {cell(p['cublas'])} {speed:5.2f} |"
            f" {cell(p['triton_fp8'])} {cell(p['gemm_fp8'])} {speed8:5.2f} |"
            f" {cell(p['triton_fp8q']) if 'triton_fp8q' in p else '-':>17} |"
            f" {p['rel_error']:7.1e} {p['rel_error_fp8']:7.1e}{'' if p['ok'] else '  MISMATCH'}{mark}"
        )
    for p in points:
        for key, best in p.get("sweep", {}).get("best", {}).items():
            t = best["tiles"]
            tiles = f"block_n={t['block_n']} k_bytes={t['k_bytes']} split_k={t['split_k']}"
            tiles += f" warps={t['num_warps']} group_bytes={t['group_bytes']}"
            print(f"  sweep {p['shape']} M={p['rows']} {key}: best {best['us']:.2f} us with {tiles}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16", help="comma-separated token counts M")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--sweep", action="store_true", help="also time the LinearTiles candidates")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_linear.py times GPU kernels and needs a CUDA device; none is visible here")
    from engine.kernels.linear.triton import MAX_ROWS

    began = time.perf_counter()
    rows = [int(m) for m in args.rows.split(",")]
    names = [s.strip() for s in args.shapes.split(",")]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        sys.exit(f"unknown shapes {unknown}; pick from {', '.join(SHAPES)}")
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device=DEVICE)
    points = []
    with torch.inference_mode():
        for i, name in enumerate(names):
            k, n = SHAPES[name]
            w = weights(k, n, seed=i)
            for m in rows:
                point = run_point(name, k, n, m, w, flush)
                if args.sweep and m <= MAX_ROWS:
                    point["sweep"] = sweep(name, k, n, m, w, flush)
                points.append(point)
                print(f"  {name} M={m} done ({time.perf_counter() - began:.0f} s)", flush=True)
    device = torch.cuda.get_device_name()
    print_table(points, device)
    print(f"\n{time.perf_counter() - began:.1f} s")
    result = {
        "device": device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "max_rows": MAX_ROWS,
        "points": points,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.json}")
    if not all(p["ok"] for p in points):
        sys.exit(1)


if __name__ == "__main__":
    main()
