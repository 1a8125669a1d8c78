"""Benchmark: the Triton sampling op (temperature, top-k, top-p, race) against its torch reference (a sort).

    python benchmarks/kernels_sampling.py [--batch 1,16,64,256] [--dtype float32] [--warps 8] [--json PATH]

Qwen3.5's 248,320-token vocabulary. For each batch size, logits distribution and request mix it checks the
Triton ids against the reference's (the same race noise; a row may differ only where an fp32 rounding
decides, see engine/kernels/sampling/triton.py) and times both on the device (the call captured in a CUDA
graph, replayed) and as one eager call with its launches (median of REPEATS), plus the sampler's whole draw
(`engine.sampler.draw_rows`: each request's noise, then the op). Distributions: `peaked` (48 tokens 6-12
above a normal bulk, like a language model's next token) and `flat` (normal logits: top-p keeps tens of
thousands of tokens, the kernel's longer path). Mixes: `qwen` (T 0.7, top-k 20, top-p 0.8), `top_p` (T 1,
top-p 0.95), `mixed` (a cycle of those and wider sets). The engine's logits are fp32 (the default);
--dtype bfloat16 halves the bytes read. Prints a table; writes JSON (default
benchmarks/results/kernels_sampling.json). Needs a CUDA device; exits non-zero when more rows differ from
the reference than roundings explain.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.sampling import reference
from engine.sampling import SamplingParams

VOCAB = 248320
DEVICE = "cuda"
REPEATS = 20
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "kernels_sampling.json"
MIXES = {
    "qwen": [(0.7, 20, 0.8)],
    "top_p": [(1.0, 0, 0.95)],
    "mixed": [
        (0.7, 20, 0.8),
        (1.0, 0, 0.95),
        (0.6, 20, 0.95),
        (1.0, 0, 1.0),
        (1.0, 1000, 0.9),
        (1.5, 0, 0.99),
    ],
}


def make_logits(batch: int, dist: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(batch, VOCAB, generator=g, device=DEVICE) * 2.0
    if dist == "peaked":  # 48 tokens per row well above the rest
        top = torch.randint(0, VOCAB, (batch, 48), generator=g, device=DEVICE)
        lift = 6.0 + 6.0 * torch.rand(batch, 48, generator=g, device=DEVICE)
        logits.scatter_add_(1, top, lift)
    return logits.to(dtype)


def row_params(batch: int, mix: str) -> list[SamplingParams]:
    cycle = MIXES[mix]
    return [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t, k, p in (cycle[i % len(cycle)] for i in range(batch))
    ]


def eager_us(fn, repeats: int = REPEATS) -> float:
    """Median microseconds of one call, launches included (what the sampler pays outside a graph)."""
    fn()  # compile, warm the caches and the allocator
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_us(fn, replays: int = REPEATS) -> float | None:
    """Microseconds per call on the device: `fn` captured in a CUDA graph, replayed; None if it cannot be
    captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
    except RuntimeError as e:
        print(f"  (no CUDA graph: {str(e).splitlines()[0]})", flush=True)
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def run_point(batch: int, dist: str, mix: str, dtype: torch.dtype, warps: int) -> dict:
    from engine.kernels.sampling import triton as sampling_triton
    from engine.sampler import draw_rows

    logits = make_logits(batch, dist, dtype, seed=batch)
    params = row_params(batch, mix)
    temperature = torch.tensor([p.temperature for p in params], device=DEVICE)
    top_k = torch.tensor([p.top_k for p in params], device=DEVICE)
    top_p = torch.tensor([p.top_p for p in params], device=DEVICE)
    race = torch.empty(batch, VOCAB, device=DEVICE).exponential_()
    args = (logits, temperature, top_k, top_p, race)

    def triton_op():
        return sampling_triton.sample_filtered(*args, num_warps=warps)

    def torch_op():
        return reference.sample_filtered(*args)

    differ = int((triton_op() != torch_op()).sum())
    generators = [torch.Generator(device=DEVICE).manual_seed(i) for i in range(batch)]
    point = {
        "batch": batch,
        "dist": dist,
        "mix": mix,
        "triton_us": graph_us(triton_op),
        "torch_us": graph_us(torch_op, replays=max(3, REPEATS // 4)),
        "triton_call_us": eager_us(triton_op),
        "torch_call_us": eager_us(torch_op, repeats=max(3, REPEATS // 4)),
        "draw_rows_us": eager_us(lambda: draw_rows(logits, params, generators)),
        "logits_mb": logits.numel() * logits.element_size() / 1e6,
        "rows_differ": differ,
    }
    if point["triton_us"] and point["torch_us"]:
        point["speedup"] = point["torch_us"] / point["triton_us"]
        point["logits_gb_per_s"] = point["logits_mb"] / 1e3 / (point["triton_us"] / 1e6)  # one read per call
    return point


def print_table(points: list[dict], device: str, dtype: torch.dtype, warps: int) -> None:
    print(f"\nsample_filtered on {device}, V={VOCAB}, {dtype} logits, num_warps={warps}")
    print("device us: CUDA graph replays; call us: one eager call, launches included; draw_rows: noise + op")
    print(
        f"{'B':>5} {'dist':>7} {'mix':>6} {'triton us':>10} {'torch us':>9} {'speedup':>8} {'GB/s':>6}"
        f" {'triton call':>12} {'torch call':>11} {'draw_rows':>10} {'differ':>7}"
    )

    def us(v):
        return "n/a" if v is None else f"{v:.1f}"

    for p in points:
        if "error" in p:
            print(f"{p['batch']:>5} {p['dist']:>7} {p['mix']:>6}  failed: {p['error']}")
            continue
        speedup = f"{p['speedup']:.1f}x" if "speedup" in p else "n/a"
        gbs = f"{p['logits_gb_per_s']:.0f}" if "logits_gb_per_s" in p else "n/a"
        print(
            f"{p['batch']:>5} {p['dist']:>7} {p['mix']:>6} {us(p['triton_us']):>10} {us(p['torch_us']):>9}"
            f" {speedup:>8} {gbs:>6} {us(p['triton_call_us']):>12} {us(p['torch_call_us']):>11}"
            f" {us(p['draw_rows_us']):>10} {p['rows_differ']:>7}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,16,64,256", help="comma-separated batch sizes")
    parser.add_argument("--dist", default="peaked,flat", help="comma-separated: peaked, flat")
    parser.add_argument("--mix", default="qwen,top_p,mixed", help=f"comma-separated: {', '.join(MIXES)}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warps", type=int, default=8, help="num_warps of the kernel")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "kernels_sampling.py needs a CUDA device: it times the Triton op against the torch reference on "
            "the GPU (tests/engine/kernels/test_sampling_triton.py checks the op on the CPU, in Triton's "
            "interpreter)"
        )
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    points = []
    with torch.inference_mode():
        for batch in (int(b) for b in args.batch.split(",")):
            for dist in args.dist.split(","):
                for mix in args.mix.split(","):
                    try:
                        points.append(run_point(batch, dist, mix, dtype, args.warps))
                    except RuntimeError as e:  # out of memory, say: report it and go on with the others
                        message = str(e).splitlines()[0]
                        points.append({"batch": batch, "dist": dist, "mix": mix, "error": message})
                        torch.cuda.empty_cache()
                    print(f"  done B={batch} {dist} {mix}", flush=True)
    print_table(points, device, dtype, args.warps)
    result = {
        "device": device,
        "dtype": args.dtype,
        "num_warps": args.warps,
        "vocab": VOCAB,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "points": points,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    if any(p.get("rows_differ", 0) > p["batch"] // 64 for p in points):
        sys.exit("more rows differ from the reference than fp32 roundings explain (see the table)")
    if any("error" in p for p in points):
        sys.exit("some points failed (see the table)")


if __name__ == "__main__":
    main()
