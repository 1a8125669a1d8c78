"""Tile sweep of the dense block-FP8 GEMM (`fp8.triton.fp8_block_gemm`) at Qwen3.5-35B-A3B's FP8 projections.

    python benchmarks/fp8_gemm_tiles.py [--tokens 2,4,...,16384] [--shapes in_proj_qkvz,...] [--json PATH]
        [--write-config]

For each projection (N outputs, K inputs; e4m3 weights with 128 x 128 scale blocks, seeded random) and token
count M it times the GEMM kernel alone (x quantised once beforehand: the quantiser is the same for every
candidate) for each (BLOCK_M, BLOCK_N, num_warps, num_stages) in CANDIDATES whose BLOCK_M suits M, with
CUDA events around CALLS back-to-back calls after an L2 flush (the weights are cold at decode), best of
REPEATS. The shape rules' tiles (`gemm_config` without a table) are timed too; each winner is checked
against the W8A8 reference. --write-config merges the winners into
`engine/kernels/fp8/configs/<GPU>.json`, which `fp8.config.tuned_config` reads. Prints a table; --json
writes every timing. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.fp8 import config as fp8_config
from engine.kernels.fp8 import reference as fp8_reference
from engine.kernels.fp8 import triton as fp8_triton
from engine.kernels.fp8.config import GemmConfig
from engine.kernels.moe.config import table_path

# (K, N) of the projections that stay dense in FP8 serving (the shared expert is stacked with the experts).
SHAPES = {
    "in_proj_qkvz": (2048, 12288),
    "out_proj": (4096, 2048),
    "qkv_proj": (2048, 9216),
}
DEFAULT_TOKENS = "2,4,8,16,32,64,128,256,512,1024,4096,8192,16384"
BLOCK = (128, 128)
CALLS, REPEATS = 10, 3
# Below this many tokens the timings were bound by the host launching the calls (quantiser + GEMM from Python,
# 80-170 us per call on the H200 machine at 2-512 tokens, whatever the tiles), so their ranking says nothing
# about the GPU: they are printed but not written to the table.
MIN_TABLE_TOKENS = 1024
FLUSH_BYTES = 256 << 20  # larger than an H200's L2 (50 MB)
CANDIDATES = [
    GemmConfig(bm, bn, w, s)
    for bm in (16, 32, 64, 128)
    for bn in (32, 64, 128, 256)
    for w in (4, 8)
    for s in (3, 4)
    if not (bm * bn >= 128 * 256 and w == 4) and not (bm * bn <= 16 * 64 and w == 8)
]


def suits(config: GemmConfig, m: int) -> bool:
    """BLOCK_M no wider than twice the rows (at least 16), and not tiny on large batches."""
    return config.block_m <= max(16, 2 * m) and (m < 1024 or config.block_m >= 64)


def time_us(fn, flush: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / CALLS)
    return best


def sweep_point(name: str, k: int, n: int, m: int, w, scale, flush) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rule = fp8_triton.gemm_config(m, n, k, torch.device("cpu"))  # the shape rules (no table off CUDA)
    results = []
    for config in [rule] + [c for c in CANDIDATES if suits(c, m) and c != rule]:
        try:
            call = lambda config=config: fp8_triton.fp8_block_gemm(x, w, scale, None, BLOCK, config=config)  # noqa: E731
            call()
            results.append((time_us(call, flush), config))
        except Exception as exc:  # out of shared memory or registers: not a candidate here
            print(f"  {name} M={m} {config}: {type(exc).__name__}", file=sys.stderr)
    best_us, best = min(results, key=lambda r: r[0])
    out = fp8_triton.fp8_block_gemm(x, w, scale, None, BLOCK, config=best)
    expected = fp8_reference.fp8_block_linear(x, w, scale, None, BLOCK).float()
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    if rel > 2e-2:  # same e4m3 values and scales as the reference: only the bf16 output rounding differs
        raise SystemExit(f"{name} M={m} {best}: relative error {rel:.2e} against the W8A8 reference")
    rule_us = results[0][0]
    flops = 2 * m * n * k
    return {
        "shape": name, "n": n, "k": k, "m": m, "best": asdict(best), "best_us": best_us,
        "rule": asdict(rule), "rule_us": rule_us, "speedup": rule_us / best_us,
        "tflops": flops / best_us / 1e6, "weight_gb_per_s": n * k / best_us / 1e3, "rel_err": rel,
        "all": [{"config": asdict(c), "us": t} for t, c in results],
    }  # fmt: skip


def write_config(points: list[dict]) -> Path:
    path = table_path(torch.cuda.get_device_name(), fp8_config.CONFIG_DIR)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = json.loads(path.read_text()) if path.is_file() else {}
    for p in points:
        if p["m"] < MIN_TABLE_TOKENS:
            continue
        table.setdefault(fp8_config.table_key(p["n"], p["k"]), {})[str(p["m"])] = p["best"]
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=DEFAULT_TOKENS)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-config", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_gemm_tiles.py needs a CUDA device")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    points, started = [], time.perf_counter()
    print(
        f"{'shape':>13} {'M':>6} {'rules us':>9} {'best us':>8} {'x':>5} {'TFLOP/s':>8} {'GB/s w':>7}  best"
    )
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w, scale = fp8_reference.quantize_block_fp8_weight(
            torch.randn(n, k, generator=g, device="cuda") * k**-0.5, BLOCK
        )
        for m in (int(t) for t in args.tokens.split(",")):
            p = sweep_point(name, k, n, m, w, scale, flush)
            points.append(p)
            b = p["best"]
            print(
                f"{name:>13} {m:>6} {p['rule_us']:>9.1f} {p['best_us']:>8.1f} {p['speedup']:>5.2f} "
                f"{p['tflops']:>8.1f} {p['weight_gb_per_s']:>7.0f}  "
                f"{b['block_m']}x{b['block_n']} w{b['num_warps']} s{b['num_stages']}"
                f" (rel {p['rel_err']:.1e})",
                flush=True,
            )
    result = {
        "device": torch.cuda.get_device_name(),
        "seconds": time.perf_counter() - started,
        "points": points,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.write_config:
        print(f"wrote {write_config(points)}")


if __name__ == "__main__":
    main()
