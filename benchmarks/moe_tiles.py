"""Tile sweep of the MoE grouped expert GEMMs, bf16 and FP8, from decode batches to prefill chunks.

    python benchmarks/moe_tiles.py [--dtypes bf16,fp8] [--tokens 1,4,...,16384] [--json PATH] [--write-config]

For each expert dtype and token count T it builds Qwen3.5-35B-A3B's MoE block (256 experts, H 2048, I 512,
top 8, seeded random weights routed evenly, as `kernels_moe.py` does; FP8 = the same weights quantised to
128 x 128 blocks), routes a few token batches, and times the grouped path (`moe.triton.fused_experts` or
`moe.fp8.fused_experts`: align, gate/up, down, combine, plus the FP8 activation quantisers) for each
candidate: BLOCK_M from the T bucket, then (gate_up tiles, down tiles, split) pairs. Device time per kernel
comes from the profiler, so launch gaps do not count. Per BLOCK_M the best gate_up and the best down (with
its combine) are taken apart, and the BLOCK_M whose sum of best kernels (plus align and quantisers) is least
wins. --write-config merges the winners into the GPU's table (`engine/kernels/moe/configs/<GPU>.json`, keyed
by dtype: float8_e4m3fn for FP8), which `moe.config.tuned_config` reads. Prints a table; --json writes it all.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels_moe import build, inputs, profile_kernels

from engine import kernels as engine_kernels
from engine.kernels.moe import config as moe_config
from engine.kernels.moe import fp8 as moe_fp8
from engine.kernels.moe import triton as moe_triton
from engine.kernels.moe.config import ExpertsConfig, GemmTiles
from engine.model.fp8_linear import quantize_gate_up

DEFAULT_TOKENS = "1,4,16,64,256,1024,4096,16384"
# (gate_up, down, split_k) pairs; FP8 forces BLOCK_K = 128 (its scale block), so its K choices collapse.
DECODE = [
    (GemmTiles(32, 128, 4, 4), GemmTiles(32, 128, 4, 4), 1),
    (GemmTiles(64, 128, 4, 4), GemmTiles(128, 128, 4, 3), 1),
    (GemmTiles(16, 256, 4, 3), GemmTiles(64, 128, 4, 4), 1),
    (GemmTiles(32, 256, 4, 3), GemmTiles(128, 128, 4, 4), 1),
    (GemmTiles(64, 64, 4, 6), GemmTiles(32, 64, 4, 4), 2),
    (GemmTiles(32, 128, 8, 5), GemmTiles(64, 128, 8, 4), 2),
]
PREFILL = [
    (GemmTiles(64, 64, 4, 3), GemmTiles(64, 64, 4, 3), 1),
    (GemmTiles(64, 128, 4, 3), GemmTiles(128, 128, 4, 3), 1),
    (GemmTiles(128, 64, 4, 3), GemmTiles(128, 64, 4, 3), 1),
    (GemmTiles(128, 128, 8, 3), GemmTiles(128, 128, 8, 3), 1),
    (GemmTiles(64, 128, 8, 4), GemmTiles(256, 64, 8, 3), 1),
    (GemmTiles(128, 64, 8, 4), GemmTiles(128, 128, 4, 4), 1),
]


def block_ms(t: int) -> tuple[int, ...]:
    """BLOCK_M candidates by the mean rows per expert (T * 8 / 256)."""
    rows = t * 8 / 256
    if rows <= 2:
        return (16,)
    if rows <= 16:
        return (16, 32)
    if rows <= 128:
        return (32, 64)
    return (64, 128)


def to_fp8(block) -> None:
    """The block's stacked experts quantised in place to 128 x 128 block FP8 (what `quantize_model_` does)."""
    w13, w2 = block.w13.detach(), block.w2.detach()
    block.use_fp8_experts_((128, 128))
    for e in range(w13.shape[0]):
        block.w13[e], block.w13_scale_inv[e] = quantize_gate_up(w13[e], (128, 128))
        block.w2[e], block.w2_scale_inv[e] = engine_kernels.quantize_block_fp8_weight(w2[e], (128, 128))


def runner(block, fp8: bool):
    shared = (block.shared_expert.gate_up_proj.weight, block.shared_expert.down_proj.weight)

    def run(x, weights, ids, config):
        if fp8:
            k = ids.shape[1] - 1  # the shared expert runs outside on FP8; here only the routed slots
            return moe_fp8.fused_experts(
                x, block.w13, block.w13_scale_inv, block.w2, block.w2_scale_inv,
                weights[:, :k], ids[:, :k], (128, 128), config,
            )  # fmt: skip
        return moe_triton.fused_experts(x, block.w13, block.w2, weights, ids, config, *shared)

    return run


def sweep_point(block, fp8: bool, t: int, device: torch.device) -> dict:
    xs = inputs(block, t, 4 if t <= 256 else 1, device, torch.bfloat16)
    routed = []
    for x in xs:
        logits = torch.nn.functional.linear(x, block.router_weight())
        routed.append((x, *moe_triton.route(logits, block.top_k, block.renormalize, shared=True)))
    run = runner(block, fp8)
    candidates = DECODE if t <= 256 else PREFILL
    per_m = {}
    for block_m in block_ms(t):
        rows = []
        for gate_up, down, split in candidates:
            if fp8:
                gate_up, down = (
                    GemmTiles(gate_up.block_n, 128, gate_up.num_warps, gate_up.num_stages),
                    (GemmTiles(down.block_n, 128, down.num_warps, down.num_stages)),
                )
            config = ExpertsConfig(block_m, gate_up, down, split)

            def calls(config=config):
                for x, weights, ids in routed:
                    run(x, weights, ids, config)

            try:
                found = profile_kernels(calls, device, calls=len(routed))
            except Exception as e:  # a candidate that does not compile (shared memory) is skipped
                print(f"  skip T={t} {config}: {type(e).__name__}", flush=True)
                continue
            us = {"gate_up": 0.0, "down": 0.0, "combine": 0.0, "other": 0.0}
            for name, (_, kernel_us) in found.items():
                part = next((p for p in ("gate_up", "down", "combine") if p in name), "other")
                us[part] += kernel_us
            rows.append({"config": config.to_dict(), "us": us})
        if not rows:
            continue
        up = min(rows, key=lambda r: r["us"]["gate_up"])
        down = min(rows, key=lambda r: r["us"]["down"] + r["us"]["combine"])
        other = min(r["us"]["other"] for r in rows)
        total = other + up["us"]["gate_up"] + down["us"]["down"] + down["us"]["combine"]
        best = ExpertsConfig(
            block_m,
            GemmTiles(**up["config"]["gate_up"]),
            GemmTiles(**down["config"]["down"]),
            down["config"]["split_k"],
        )
        per_m[block_m] = {"candidates": rows, "best": best.to_dict(), "us": total}
    block_m = min(per_m, key=lambda m: per_m[m]["us"])
    shape_rules = moe_config.choose_config(t, block.top_k, block.w13.shape[0], torch.bfloat16)
    if fp8:
        shape_rules = moe_fp8.choose(t, xs[0], block.w2, block.top_k, 128)

    def rule_calls():
        for x, weights, ids in routed:
            run(x, weights, ids, shape_rules)

    rule_us = sum(us for _, us in profile_kernels(rule_calls, device, calls=len(routed)).values())
    return {
        "tokens": t,
        "best": per_m[block_m]["best"],
        "best_us": per_m[block_m]["us"],
        "default_us": rule_us,
        "per_block_m": per_m,
    }


def write_config(points: list[dict], block, fp8: bool, name: str) -> None:
    path = moe_config.table_path(name)
    table = json.loads(path.read_text()) if path.is_file() else {}
    e, _, inter = block.w2.shape
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    key = moe_config.table_key(e, block.w13.shape[2], inter, block.top_k, dtype)
    entries = table.setdefault(key, {})
    for p in points:
        entries[str(p["tokens"])] = p["best"]
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(entries)} entries for {key} to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-config", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_tiles.py needs CUDA")
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    began = time.perf_counter()
    result = {"device": name, "torch": torch.__version__, "dtypes": {}}
    print(f"MoE grouped GEMM tiles on {name}")
    print(f"{'dtype':>6} {'T':>6} {'best us':>9} {'rules us':>9} {'gain':>6}  best")
    for dtype in args.dtypes.split(","):
        fp8 = dtype == "fp8"
        block = build(device, torch.bfloat16)
        if fp8:
            to_fp8(block)
        points = []
        with torch.inference_mode():
            for t in (int(v) for v in args.tokens.split(",")):
                p = sweep_point(block, fp8, t, device)
                points.append(p)
                b = p["best"]
                print(
                    f"{dtype:>6} {t:>6} {p['best_us']:>9.1f} {p['default_us']:>9.1f} "
                    f"{p['default_us'] / p['best_us']:>5.2f}x  M{b['block_m']} "
                    f"up{tuple(b['gate_up'].values())} down{tuple(b['down'].values())} split{b['split_k']}",
                    flush=True,
                )
        result["dtypes"][dtype] = points
        if args.write_config:
            write_config(points, block, fp8, name)
        del block
        torch.cuda.empty_cache()
    print(f"{time.perf_counter() - began:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
