"""Benchmark: one Qwen3.5-35B-A3B MoE block (router GEMM to output) on the Triton kernels.

    python benchmarks/kernels_moe.py [--tokens 1,16,64,256] [--json PATH] [--sweep] [--gemv] [--gemv-sweep]

Builds one real-shape `SparseMoe` (bf16, seeded random weights; router rows of equal norm and small logits,
so tokens spread evenly over the experts, as engine.bench does) and for each token count T:
  - checks the Triton block against the torch references on the same weights (relative error of the output);
  - times the block: T <= 256 as a CUDA graph of GRAPH_CALLS calls on different tokens (so each call routes
    to other experts, whose weights are not in L2 yet), replayed; larger T as plain calls, CUDA events;
  - counts its kernel launches and each kernel's device time (torch.profiler, one eager call);
  - reports GB/s of expert weights touched (distinct routed experts + the shared expert, per call).
--sweep also times the grouped GEMMs' tile candidates (`SWEEP`) per T <= 256, kernel by kernel, and prints
the best of each, to tune `engine.kernels.moe.config.choose_config`. --gemv also times the experts alone, the
grouped GEMMs (align included) against `engine.kernels.moe.gemv`, per T <= 64 (say --tokens 1,2,4,8,16,32,64,
to find where the grouped GEMMs take over). --gemv-sweep times `moe.gemv`'s tile candidates per T <= 16,
gate_up and down kernels apart. Prints a table; --json writes it all.
Without CUDA it runs a tiny fp32 layer under Triton's interpreter, to check that the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

from engine.bench.presets import QWEN35_35B_A3B, init_parameter_  # noqa: E402
from engine.config import config_from_dict  # noqa: E402
from engine.env import reset_engine_env  # noqa: E402
from engine.kernels.moe import config as moe_config  # noqa: E402
from engine.kernels.moe import gemv as moe_gemv  # noqa: E402
from engine.kernels.moe import reference  # noqa: E402
from engine.kernels.moe import triton as moe_triton  # noqa: E402
from engine.kernels.moe.config import ExpertsConfig, GemmTiles  # noqa: E402
from engine.model.moe import SparseMoe  # noqa: E402

GRAPH_CALLS = 8  # calls per captured graph, each on its own tokens
TINY = dict(hidden_size=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)
TINY_SHARED = 32
REL_TOL = 2e-2  # bf16: each slot's output and the block's rounded to 2^-8 relative, in another order

# (gate_up tiles, down tiles, split_k) tried by --sweep with BLOCK_M 16: narrow N tiles and split K give more
# programs to stream weights with; wide ones fewer, longer streams.
SWEEP = [
    (GemmTiles(32, 128, 4, 4), GemmTiles(32, 128, 4, 4), 1),  # the default
    (GemmTiles(16, 128, 4, 4), GemmTiles(16, 128, 4, 4), 1),
    (GemmTiles(16, 256, 4, 3), GemmTiles(64, 128, 4, 4), 1),
    (GemmTiles(32, 256, 4, 3), GemmTiles(128, 128, 4, 3), 1),
    (GemmTiles(64, 128, 4, 4), GemmTiles(64, 64, 4, 4), 1),
    (GemmTiles(64, 64, 4, 6), GemmTiles(32, 64, 4, 4), 2),
    (GemmTiles(32, 64, 4, 6), GemmTiles(64, 128, 4, 4), 2),
    (GemmTiles(64, 128, 8, 4), GemmTiles(128, 64, 8, 4), 2),
    (GemmTiles(16, 64, 2, 6), GemmTiles(32, 128, 4, 4), 4),
    (GemmTiles(32, 128, 8, 5), GemmTiles(16, 128, 2, 4), 1),
]


def build(device: torch.device, dtype: torch.dtype) -> SparseMoe:
    raw = dict(QWEN35_35B_A3B)
    if device.type != "cuda":
        raw.update(TINY, shared_expert_intermediate_size=TINY_SHARED)
    config = config_from_dict(raw, source="kernels_moe")
    with torch.device("meta"):
        block = SparseMoe(config)
    block.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in block.named_parameters():
        init_parameter_("mlp." + name, p, g)
    return block.eval().requires_grad_(False)


@contextmanager
def kernels(backend: str):
    old = os.environ.get("ENCLAVE_KERNELS")
    os.environ["ENCLAVE_KERNELS"] = backend
    reset_engine_env()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ENCLAVE_KERNELS")
        else:
            os.environ["ENCLAVE_KERNELS"] = old
        reset_engine_env()


def inputs(block: SparseMoe, t: int, count: int, device: torch.device, dtype: torch.dtype) -> list:
    """`count` token batches [T, H] of unit RMS (as out of the RMSNorm before the block)."""
    g = torch.Generator(device=device).manual_seed(t)
    h = block.w13.shape[-1]
    return [torch.randn(t, h, generator=g, device=device).to(dtype) for _ in range(count)]


def expert_bytes(block: SparseMoe, xs: list[torch.Tensor]) -> float:
    """Mean bytes of expert weights one call reads: its distinct routed experts, the shared expert, router."""
    per_expert = (block.w13[0].numel() + block.w2[0].numel()) * block.w13.element_size()
    shared = sum(p.numel() * p.element_size() for p in block.shared_expert.parameters())
    router = block.router_weight().numel() * block.w13.element_size()
    touched = []
    for x in xs:
        logits = torch.nn.functional.linear(x, block.router_weight())
        _, ids = reference.route(logits, block.top_k, block.renormalize, shared=True)
        touched.append(torch.unique(ids[:, :-1]).numel())
    return sum(touched) / len(touched) * per_expert + shared + router


def timed(fn, calls: int, device: torch.device, repeats: int) -> float:
    """Seconds per call of `fn` (which makes `calls` calls), best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            fn()
            seconds = time.perf_counter() - began
        best = min(best, seconds / calls)
    return best


def time_block(block: SparseMoe, xs: list[torch.Tensor], device: torch.device, graph: bool) -> float:
    def calls():
        for x in xs:
            block(x)

    calls()  # compile, build the router weight
    if not graph:
        return timed(calls, len(xs), device, repeats=3 if device.type == "cuda" else 1)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream(device).wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    g.replay()
    torch.cuda.synchronize(device)
    return timed(g.replay, len(xs), device, repeats=20)


def profile_kernels(fn, device: torch.device, calls: int = 1) -> dict[str, tuple[int, float]]:
    """{kernel: (launches per call, device us per call)} of what `fn` runs (`calls` calls' worth)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    found = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            found[e.key] = (e.count / calls, e.self_device_time_total / calls)
    return found


def check(block: SparseMoe, x: torch.Tensor) -> float:
    """Relative error of the Triton block against the torch references on the same weights."""
    with kernels("torch"):
        expected = block(x).float()
    with kernels("triton"):
        out = block(x).float()
    return ((out - expected).norm() / expected.norm()).item()


def sweep(block: SparseMoe, xs: list[torch.Tensor], device: torch.device) -> dict:
    """Each SWEEP candidate's gate_up, down and combine device us per call (profiler), on routed inputs."""
    routed = []
    for x in xs:
        logits = torch.nn.functional.linear(x, block.router_weight())
        routed.append((x, *moe_triton.route(logits, block.top_k, block.renormalize, shared=True)))
    shared = (block.shared_expert.gate_up_proj.weight, block.shared_expert.down_proj.weight)
    rows = []
    for gate_up, down, split in SWEEP:
        config = ExpertsConfig(16, gate_up, down, split)

        def calls(config=config):
            for x, weights, ids in routed:
                moe_triton.fused_experts(x, block.w13, block.w2, weights, ids, config, *shared)

        try:
            found = profile_kernels(calls, device, calls=len(routed))
        except Exception as e:  # a candidate that does not compile (shared memory) is skipped
            print(f"  skip {config}: {type(e).__name__}", flush=True)
            continue
        us = {k: sum(v[1] for name, v in found.items() if k in name) for k in ("gate_up", "down", "combine")}
        rows.append({"gate_up": vars(gate_up), "down": vars(down), "split_k": split, "us": us})
    best_up = min(rows, key=lambda r: r["us"]["gate_up"])
    best_down = min(rows, key=lambda r: r["us"]["down"] + r["us"]["combine"])
    return {"candidates": rows, "best_gate_up": best_up, "best_down": best_down}


def gemv_compare(block: SparseMoe, xs: list[torch.Tensor], device: torch.device) -> dict:
    """Device us per call of the experts on the grouped GEMMs and on `moe.gemv` (all their kernels, profiler),
    on the same routed inputs, and the relative difference of their outputs."""
    shared = (block.shared_expert.gate_up_proj.weight, block.shared_expert.down_proj.weight)
    routed = []
    for x in xs:
        logits = torch.nn.functional.linear(x, block.router_weight())
        routed.append((x, *moe_triton.route(logits, block.top_k, block.renormalize, shared=True)))
    result = {}
    for name, experts in (("grouped", moe_triton.experts), ("gemv", moe_gemv.experts)):

        def calls(experts=experts):
            for x, weights, ids in routed:
                experts(x, block.w13, block.w2, weights, ids, *shared)

        found = profile_kernels(calls, device, calls=len(routed))
        result[name] = {
            "us": sum(us for _, us in found.values()),
            "kernels": {k: us for k, (_, us) in found.items()},
        }
    x, weights, ids = routed[0]
    grouped = moe_triton.experts(x, block.w13, block.w2, weights, ids, *shared).float()
    gemv = moe_gemv.experts(x, block.w13, block.w2, weights, ids, *shared).float()
    result["rel_diff"] = ((gemv - grouped).norm() / grouped.norm()).item()
    return result


def gemv_sweep(block: SparseMoe, xs: list[torch.Tensor], device: torch.device) -> dict:
    """Device us per call of `moe.gemv`'s gate_up and down kernels for each tile candidate (profiler, routed
    inputs); the best of each kernel, to set `GemvTiles`' defaults."""
    shared = (block.shared_expert.gate_up_proj.weight, block.shared_expert.down_proj.weight)
    routed = []
    for x in xs:
        logits = torch.nn.functional.linear(x, block.router_weight())
        routed.append((x, *moe_triton.route(logits, block.top_k, block.renormalize, shared=True)))
    rows = []
    for up_n, down_n in ((4, 8), (8, 16), (16, 32), (32, 64)):
        for k_bytes in (512, 1024, 2048):
            for warps in (2, 4, 8):
                tiles = moe_gemv.GemvTiles(up_n, down_n, k_bytes, warps)

                def calls(tiles=tiles):
                    for x, weights, ids in routed:
                        moe_gemv.experts(x, block.w13, block.w2, weights, ids, *shared, tiles=tiles)

                try:
                    found = profile_kernels(calls, device, calls=len(routed))
                except Exception as e:  # a candidate that does not compile is skipped
                    print(f"  skip {tiles}: {type(e).__name__}", flush=True)
                    continue
                us = {k: sum(v[1] for name, v in found.items() if k in name) for k in ("gate_up", "down")}
                rows.append({"tiles": vars(tiles), "us": us})
    best_up = min(rows, key=lambda r: r["us"]["gate_up"])
    best_down = min(rows, key=lambda r: r["us"]["down"])
    default = next((r for r in rows if r["tiles"] == vars(moe_gemv.GemvTiles())), None)
    return {"candidates": rows, "best_gate_up": best_up, "best_down": best_down, "default": default}


def run_point(block: SparseMoe, t: int, device: torch.device, dtype: torch.dtype, args) -> dict:
    graph = device.type == "cuda" and t <= 256
    xs = inputs(block, t, GRAPH_CALLS if graph else 1, device, dtype)
    with kernels("triton"):
        error = check(block, xs[0])
        seconds = time_block(block, xs, device, graph)
        found = profile_kernels(lambda: block(xs[0]), device)
        moved = expert_bytes(block, xs)
        point = {
            "tokens": t,
            "us_per_call": seconds * 1e6,
            "cuda_graph": graph,
            "rel_error": error,
            "ok": error < REL_TOL,
            "expert_bytes": moved,
            "expert_gb_per_s": moved / seconds / 1e9,
            "launches": sum(c for c, _ in found.values()) if found else None,
            "kernels": {k: {"launches": c, "us": us} for k, (c, us) in found.items()},
        }
        if args.sweep and device.type == "cuda" and t <= 256:
            point["sweep"] = sweep(block, xs, device)
        if args.gemv and t <= 64:
            point["gemv"] = gemv_compare(block, xs, device)
        if args.gemv_sweep and device.type == "cuda" and t <= 16:
            point["gemv_sweep"] = gemv_sweep(block, xs, device)
    return point


def print_table(points: list[dict], device_name: str) -> None:
    print(f"\nMoE block on {device_name} (router GEMM to output)")
    print(f"{'T':>6} {'us/call':>10} {'GB/s':>8} {'launches':>9} {'rel err':>9}  graph")
    for p in points:
        launches = "n/a" if p["launches"] is None else f"{p['launches']:.0f}"
        print(
            f"{p['tokens']:>6} {p['us_per_call']:>10.1f} {p['expert_gb_per_s']:>8.0f} {launches:>9}"
            f" {p['rel_error']:>9.1e}  {'yes' if p['cuda_graph'] else 'no'}{'' if p['ok'] else '  MISMATCH'}"
        )
    for p in points:
        if p["kernels"]:
            top = sorted(p["kernels"].items(), key=lambda kv: -kv[1]["us"])
            text = ", ".join(f"{k[:40]} {v['us']:.1f}us" for k, v in top[:8])
            print(f"  T={p['tokens']}: {text}")
        if "sweep" in p:
            s = p["sweep"]
            up, down = s["best_gate_up"], s["best_down"]
            print(f"  T={p['tokens']} sweep best gate_up {up['gate_up']}: {up['us']}")
            print(f"  T={p['tokens']} sweep best down {down['down']} split {down['split_k']}: {down['us']}")
        if "gemv" in p:
            g, moved = p["gemv"], p["expert_bytes"]
            times = ", ".join(
                f"{k} {g[k]['us']:.1f}us ({moved / g[k]['us'] / 1e3:.0f} GB/s)"
                for k in ("grouped", "gemv")
                if g[k]["us"]
            )
            print(f"  T={p['tokens']} experts: {times or 'no device times'}; rel diff {g['rel_diff']:.1e}")
        if "gemv_sweep" in p:
            s = p["gemv_sweep"]
            for key in ("default", "best_gate_up", "best_down"):
                if s[key] is not None:
                    print(f"  T={p['tokens']} gemv {key}: {s[key]['tiles']} -> {s[key]['us']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--sweep", action="store_true", help="also time the GEMM tile candidates (T <= 256)")
    parser.add_argument("--gemv", action="store_true", help="also time the experts on moe.gemv (T <= 64)")
    parser.add_argument("--gemv-sweep", action="store_true", help="also time moe.gemv's tiles (T <= 16)")
    parser.add_argument(
        "--write-config",
        nargs="?",
        const="auto",
        help="with --sweep: merge the best tiles per T into this JSON table (default: the GPU's file in "
        "engine/kernels/moe/configs/, which the engine reads)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if CUDA else torch.float32
    default = "1,16,64,256,8192" if CUDA else "1,16,64"
    counts = [int(t) for t in (args.tokens or default).split(",")]
    began = time.perf_counter()
    block = build(device, dtype)
    with torch.inference_mode():
        points = [run_point(block, t, device, dtype, args) for t in counts]
    name = torch.cuda.get_device_name(device) if CUDA else "cpu (Triton interpreter, tiny layer)"
    print_table(points, name)
    print(f"\n{time.perf_counter() - began:.1f} s")
    result = {
        "device": name,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "shapes": {"w13": list(block.w13.shape), "w2": list(block.w2.shape), "top_k": block.top_k},
        "points": points,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}")
    if args.write_config and CUDA:
        write_config(block, dtype, points, name, args.write_config)
    if not all(p["ok"] for p in points):
        sys.exit(1)


def write_config(block: SparseMoe, dtype: torch.dtype, points: list[dict], name: str, where: str) -> None:
    """Merge each swept T's best gate_up tiles and best down tiles (with their split) into the table."""
    path = moe_config.table_path(name) if where == "auto" else Path(where)
    table = json.loads(path.read_text()) if path.is_file() else {}
    e, _, inter = block.w2.shape
    key = moe_config.table_key(e, block.w13.shape[2], inter, block.top_k, dtype)
    entries = table.setdefault(key, {})
    for p in points:
        if "sweep" in p:
            up, down = p["sweep"]["best_gate_up"], p["sweep"]["best_down"]
            config = ExpertsConfig(16, GemmTiles(**up["gate_up"]), GemmTiles(**down["down"]), down["split_k"])
            entries[str(p["tokens"])] = config.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(entries)} tuned entries for {key} to {path}")


if __name__ == "__main__":
    main()
