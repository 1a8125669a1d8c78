"""Tile sweep of the FP8 kernels that decode steps run, timed the way a decode step runs them: inside a CUDA
graph, with PDL, on weights that are not in L2, and with x quantised by the norm before them.

    python benchmarks/fp8_decode_tiles.py [--parts gemm,gemv] [--tokens 2,4,...] [--json PATH]
        [--write-config]

gemm: the dense block-FP8 GEMM (`fp8.triton.fp8_block_gemm`, x given as an `Fp8Activation`) at Qwen3.5's
dense FP8 projections, for 2-512 token rows, over (BLOCK_M, BLOCK_N, warps, stages, K splits). The earlier
sweep (`fp8_gemm_tiles.py`) timed these sizes with CUDA events around Python calls and measured the host;
here GRAPH_CALLS calls, each on its own copy of the weight (copies past L2 together), are captured in one
graph and replayed. --write-config merges the winners from MIN_TABLE_TOKENS up into
`engine/kernels/fp8/configs/<GPU>.json`.

gemv: the FP8 MoE GEMV experts (`moe.gemv.experts_fp8`) at 1-16 tokens with the shared expert stacked as
expert 256 (k = 9 slots), x given quantised, routed to random experts per call (257 experts of 3 MB: not in
L2). gate_up's tiles (rows per program, bytes per step, warps) are swept with down at its default, then down's
with gate_up at the winner. The table shows the us per MoE block's experts and the weight bytes' rate.

Prints a table per part; --json writes every timing. Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from engine.kernels.fp8.reference import Fp8Activation
from engine.kernels.moe import gemv
from engine.kernels.moe.config import table_path

SHAPES = {"in_proj_qkvz": (2048, 12288), "out_proj": (4096, 2048), "qkv_proj": (2048, 9216)}  # (K, N)
GEMM_TOKENS = "2,4,8,16,32,64,128,256,512"
GEMV_TOKENS = "1,4,16"
MIN_TABLE_TOKENS = 2
BLOCK = (128, 128)
GRAPH_CALLS = 16
REPEATS = 10
L2_BYTES = 50 << 20
# Few rows are bound by streaming the weight: deep pipelines (4 stages), 4 warps but for the largest tiles,
# and K splits to give 132 SMs enough programs (out_proj has 16 N tiles of 128).
GEMM_CANDIDATES = [
    GemmConfig(bm, bn, w, 4, split)
    for bm in (16, 32, 64)
    for bn in (32, 64, 128)
    for w in (4, 8)
    for split in (1, 2, 4, 8)
    if w == 4 or bm * bn >= 64 * 64
]
# gemv: (rows per program, bytes of each row per step, warps) of gate_up, then of down (K = 512: 512 bytes).
UP_CANDIDATES = [(n, kb, w) for n in (4, 8, 16, 32) for kb in (512, 1024, 2048) for w in (2, 4, 8)]
DOWN_CANDIDATES = [(n, kb, w) for n in (8, 16, 32, 64) for kb in (256, 512) for w in (2, 4, 8)]


def graph_us(calls: list) -> float:
    """Device us per call of `calls` (callables), captured once in a graph and replayed; best of REPEATS."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up: compile, allocate, make the split counters outside the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / len(calls))
    return best


def quantised(x: torch.Tensor) -> Fp8Activation:
    return Fp8Activation(*fp8_triton.quantize_fp8_per_token_group(x, BLOCK[1]), BLOCK[1])


def gemm_point(name: str, k: int, n: int, m: int, weights: list) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq = quantised(x)
    rule = fp8_triton.gemm_config(m, n, k, torch.device("cpu"))  # the shape rules (no table off CUDA)
    results = []
    for config in [rule] + [c for c in GEMM_CANDIDATES if c.block_m <= max(16, 2 * m) and c != rule]:
        calls = [
            lambda w=w, s=s, c=config: fp8_triton.fp8_block_gemm(x, w, s, None, BLOCK, config=c, xq=xq)
            for w, s in weights
        ]
        try:
            results.append((graph_us(calls), config))
        except Exception as exc:  # out of shared memory or registers: not a candidate here
            print(f"  {name} M={m} {config}: {type(exc).__name__}", file=sys.stderr)
    best_us, best = min(results, key=lambda r: r[0])
    w, s = weights[0]
    out = fp8_triton.fp8_block_gemm(x, w, s, None, BLOCK, config=best, xq=xq).float()
    expected = fp8_reference.fp8_block_linear(x, w, s, None, BLOCK).float()
    rel = ((out - expected).norm() / expected.norm()).item()
    if rel > 2e-2:
        raise SystemExit(f"{name} M={m} {best}: relative error {rel:.2e} against the W8A8 reference")
    return {
        "shape": name, "n": n, "k": k, "m": m, "best": asdict(best), "best_us": best_us, "rule": asdict(rule),
        "rule_us": results[0][0], "speedup": results[0][0] / best_us,
        "weight_gb_per_s": n * k / best_us / 1e3, "rel_err": rel,
        "all": [{"config": asdict(c), "us": t} for t, c in results],
    }  # fmt: skip


def sweep_gemm(tokens: list[int]) -> list[dict]:
    points = []
    print(f"{'shape':>13} {'M':>4} {'rules us':>9} {'best us':>8} {'x':>5} {'GB/s':>6}  best")
    for name, (k, n) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        w, s = fp8_reference.quantize_block_fp8_weight(torch.randn(n, k, generator=g, device="cuda") / k**0.5)
        copies = max(2, -(-2 * L2_BYTES // (n * k)))  # together at least twice L2: each call reads cold rows
        weights = [(w.clone(), s.clone()) for _ in range(min(copies, GRAPH_CALLS))]
        for m in tokens:
            p = gemm_point(name, k, n, m, weights)
            points.append(p)
            b = p["best"]
            print(
                f"{name:>13} {m:>4} {p['rule_us']:>9.1f} {p['best_us']:>8.1f} {p['speedup']:>5.2f} "
                f"{p['weight_gb_per_s']:>6.0f}  {b['block_m']}x{b['block_n']} w{b['num_warps']} "
                f"s{b['num_stages']} split {b['split_k']} (rel {p['rel_err']:.1e})",
                flush=True,
            )
    return points


def stacked_experts() -> tuple[torch.Tensor, ...]:
    """Qwen3.5's 256 experts plus the shared one as expert 256, in block FP8 (random, ~unit outputs)."""
    e, h, i = 257, 2048, 512
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn, device="cuda")
    w2 = torch.empty(e, h, i, dtype=torch.float8_e4m3fn, device="cuda")
    s13 = torch.empty(e, 2 * i // 128, h // 128, device="cuda")
    s2 = torch.empty(e, h // 128, i // 128, device="cuda")
    quantize = fp8_reference.quantize_block_fp8_weight
    for x in range(e):
        w13[x], s13[x] = quantize(torch.randn(2 * i, h, generator=g, device="cuda"))
        w2[x], s2[x] = quantize(torch.randn(h, i, generator=g, device="cuda"))
    return w13, s13 * h**-0.5, w2, s2 * i**-0.5


def gemv_calls(experts, t: int, tiles: gemv.GemvTiles) -> list:
    g = torch.Generator(device="cuda").manual_seed(t)
    calls = []
    for _ in range(GRAPH_CALLS):
        x = torch.randn(t, 2048, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(256, generator=g, device="cuda")[:8] for _ in range(t)])
        ids = torch.cat([ids, torch.full((t, 1), 256, device="cuda")], dim=1)  # the shared expert, slot k
        weights = torch.rand(t, 9, generator=g, device="cuda")
        xq = quantised(x)

        def call(x=x, ids=ids, w=weights, xq=xq):
            return gemv.experts_fp8(x, *experts, w, ids, tiles=tiles, xq=xq)

        calls.append(call)
    return calls


def sweep_gemv(tokens: list[int]) -> list[dict]:
    experts = stacked_experts()
    points = []
    head = "best (up_n, k_bytes, warps | down)"
    print(f"{'T':>3} {'default us':>10} {'best us':>8} {'x':>5} {'GB/s':>6}  {head}")
    for t in tokens:
        default = gemv.fp8_tiles(t)
        # down keeps the default's own bytes and warps while gate_up's change
        down_default = dict(
            down_k_bytes=default.down_k_bytes or default.k_bytes,
            down_warps=default.down_warps or default.num_warps,
        )
        up = []
        for n, kb, w in UP_CANDIDATES:
            tiles = dataclasses.replace(default, up_n=n, k_bytes=kb, num_warps=w, **down_default)
            up.append((graph_us(gemv_calls(experts, t, tiles)), tiles))
        best_up = min(up, key=lambda r: r[0])[1]
        down = []
        for n, kb, w in DOWN_CANDIDATES:
            tiles = dataclasses.replace(best_up, down_n=n, down_k_bytes=kb, down_warps=w)
            down.append((graph_us(gemv_calls(experts, t, tiles)), tiles))
        best_us, best = min(down, key=lambda r: r[0])
        default_us = graph_us(gemv_calls(experts, t, default))
        touched = min(256, 8 * t) + 1  # distinct experts at most (random routing, no repeats in a token)
        gbps = touched * 3 * 2048 * 512 / best_us / 1e3
        points.append({
            "tokens": t, "default": asdict(default), "default_us": default_us, "best": asdict(best),
            "best_us": best_us, "weight_gb_per_s": gbps,
            "up": [{"tiles": asdict(c), "us": u} for u, c in up],
            "down": [{"tiles": asdict(c), "us": u} for u, c in down],
        })  # fmt: skip
        print(
            f"{t:>3} {default_us:>10.1f} {best_us:>8.1f} {default_us / best_us:>5.2f} {gbps:>6.0f}  "
            f"{best.up_n}, {best.k_bytes}, {best.num_warps} | {best.down_n}, {best.down_k_bytes}, "
            f"{best.down_warps}",
            flush=True,
        )
    return points


def write_gemm_config(points: list[dict]) -> Path:
    path = table_path(torch.cuda.get_device_name(), fp8_config.CONFIG_DIR)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = json.loads(path.read_text()) if path.is_file() else {}
    for p in points:
        if p["m"] >= MIN_TABLE_TOKENS:
            table.setdefault(fp8_config.table_key(p["n"], p["k"]), {})[str(p["m"])] = p["best"]
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="gemm,gemv")
    parser.add_argument("--tokens", help="token counts of both parts (default: each part's own)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-config", action="store_true", help="merge the GEMM winners into the table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_decode_tiles.py needs a CUDA device")
    started, result = time.perf_counter(), {"device": torch.cuda.get_device_name()}
    parts = args.parts.split(",")
    if "gemm" in parts:
        result["gemm"] = sweep_gemm([int(t) for t in (args.tokens or GEMM_TOKENS).split(",")])
        if args.write_config:
            print(f"wrote {write_gemm_config(result['gemm'])}")
    if "gemv" in parts:
        result["gemv"] = sweep_gemv([int(t) for t in (args.tokens or GEMV_TOKENS).split(",")])
    result["seconds"] = time.perf_counter() - started
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
