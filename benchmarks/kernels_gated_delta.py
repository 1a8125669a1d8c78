"""Benchmark: the Triton chunked (WY) gated delta rule against its torch reference at Qwen3.5-35B-A3B shapes.

    python benchmarks/kernels_gated_delta.py [--json PATH] [--sweep]

One DeltaNet layer call (bf16, 16 key heads, 32 value heads, dk = dv = 128) for prefill steps of 2 x 4096,
8 x 1024 (half the sequences continuing from a cached state) and 1 x 16384 tokens. Each case checks the Triton
output and final states against the torch reference (inputs upcast to fp32), times the whole Triton call
with triton.testing.do_bench (median), splits that time over its three kernels with torch.profiler, and
times the reference once. --sweep also times the launch choices of `ChunkLaunch` on the 2 x 4096 case.
Without a GPU it runs tiny fp32 cases in Triton's interpreter instead (a check that the script works).
Prints one table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (@triton.jit time)
os.environ["ENCLAVE_TRITON_PREFILL"] = "1"  # the chunked kernels even if the environment switched them off

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from engine.kernels.gated_delta import reference  # noqa: E402
from engine.kernels.gated_delta import triton as gd_triton  # noqa: E402
from engine.kernels.layout import SeqLayout  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "kernels_gated_delta.json"
# (name, query lengths, context lengths) of the GPU cases; the CPU stand-ins are tiny.
GPU_CASES = [
    ("2x4096", (4096,) * 2, (0,) * 2),
    ("8x1024", (1024,) * 8, (0, 512) * 4),
    ("1x16384", (16384,), (0,)),
]
CPU_CASES = [("2x96", (96,) * 2, (0, 0)), ("3x70", (70,) * 3, (0, 9, 0)), ("1x200", (200,), (0,))]
# Against the fp32 reference: bf16 outputs (2^-8 relative rounding), and fp32 states after the kernels'
# bf16 scratch (tests/engine/kernels/test_gated_delta_triton.py explains both; CHUNKED_STATE_BF16 there).
TOL_GPU = {"out": (1.6e-2, 1e-2), "state": (1.6e-2, 1.5e-2)}  # (rtol, atol)
TOL_CPU = {"out": (1e-4, 1e-5), "state": (1e-4, 1e-5)}  # fp32 everywhere: only summation order differs
KERNELS = ("_chunk_wy_kernel", "_chunk_state_kernel", "_chunk_out_kernel")


def make_inputs(lens, ctx, hk, hv, d, dtype, device, seed=0):
    """Strided views as the model passes them (q, k, v split from one packed projection), a layout, and a
    state pool whose slots hold random states for the sequences with context."""
    t = sum(lens)
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(t, 2 * hk * d + hv * d, generator=gen, device=device).to(dtype)
    q, k, v = qkv.split((hk * d, hk * d, hv * d), dim=-1)
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen, device=device)).to(dtype)
    g = -F.softplus(torch.randn(t, hv, generator=gen, device=device))  # fp32 log decay <= 0
    layout = SeqLayout(lens, ctx, tuple(range(len(lens))))
    state = torch.randn(len(lens), hv, d, d, generator=gen, device=device) * 0.3
    return (q.reshape(t, hk, d), k.reshape(t, hk, d), v.reshape(t, hv, d), g, beta), state, layout


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def check(inputs, state, layout, tol) -> dict:
    """Max abs errors of one Triton call against the reference, and whether they are within `tol`."""
    tri_state, ref_state = state.clone(), state.clone()
    out = gd_triton.gated_delta_rule(*inputs, tri_state, layout)
    q, k, v, g, beta = inputs
    sync()
    start = time.perf_counter()
    ref = reference.gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), ref_state, layout)
    sync()
    ref_ms = (time.perf_counter() - start) * 1e3
    ok = all(
        torch.allclose(a.float(), b, rtol=tol[name][0], atol=tol[name][1])
        for name, a, b in (("out", out, ref), ("state", tri_state, ref_state))
    )
    return {
        "out_max_abs_err": (out.float() - ref).abs().max().item(),
        "out_max_abs": ref.abs().max().item(),
        "state_max_abs_err": (tri_state - ref_state).abs().max().item(),
        "state_max_abs": ref_state.abs().max().item(),
        "within_tolerance": ok,
        "reference_ms": ref_ms,
    }


def time_ms(fn) -> float:
    """Median milliseconds of `fn` (do_bench on a GPU; one timed call after a warm-up in the interpreter)."""
    if ON_GPU:
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def kernel_split(fn, iters: int = 5) -> dict[str, float]:
    """Device milliseconds per call of each chunked kernel, from torch.profiler."""
    if not ON_GPU:
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        sync()
    split = dict.fromkeys(KERNELS, 0.0)
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        for name in KERNELS:
            if name in event.key:
                split[name] += us / 1e3 / iters
    return split


def run_case(name, lens, ctx, shape, dtype, device, tol) -> dict:
    hk, hv, d = shape
    inputs, state, layout = make_inputs(lens, ctx, hk, hv, d, dtype, device)
    result = {"case": name, "query_lens": list(lens), "context_lens": list(ctx), "tokens": sum(lens)}
    result.update(check(inputs, state, layout, tol))

    def call():
        gd_triton.gated_delta_rule(*inputs, state, layout)

    result["triton_ms"] = time_ms(call)
    result["kernel_ms"] = kernel_split(call)
    result["launch"] = dataclasses.asdict(gd_triton._chunk_launch(len(lens) * hv, d, torch.device(device)))
    result["mtok_per_s"] = sum(lens) / result["triton_ms"] / 1e3
    return result


def sweep(shape, dtype, device) -> list[dict]:
    """Each launch choice varied alone from the default, on the 2 x 4096 and 1 x 16384 cases."""
    hk, hv, d = shape
    rows = []
    for name, lens, ctx in (GPU_CASES[0], GPU_CASES[2]):
        inputs, state, layout = make_inputs(lens, ctx, hk, hv, d, dtype, device)
        out = torch.empty_like(inputs[2])
        base = gd_triton._chunk_launch(len(lens) * hv, d, torch.device(device))
        variants = [base]
        for field, values in (
            ("state_bv", (16, 32, 64)),
            ("state_warps", (2, 4, 8)),
            ("state_stages", (1, 2, 3)),
            ("out_bv", (64, 128)),
            ("out_warps", (4, 8)),
            ("wy_warps", (4, 8)),
        ):
            variants += [dataclasses.replace(base, **{field: x}) for x in values if x != getattr(base, field)]
        for launch in variants:
            call = functools.partial(gd_triton._chunked, *inputs, state, layout, out, launch=launch)
            row = {"case": name, "launch": dataclasses.asdict(launch)}
            try:
                row.update(triton_ms=time_ms(call), kernel_ms=kernel_split(call, iters=3))
            except Exception as e:  # a launch that does not fit (shared memory, registers) is reported
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(f"  sweep {row}", flush=True)
    return rows


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  {result['dtype']}  Hk={result['hk']} Hv={result['hv']} d={result['d']}")
    head = f"{'case':>9} {'tokens':>7} {'triton ms':>10} {'wy':>7} {'state':>7} {'out':>7} {'ref ms':>8}"
    print(head + f" {'Mtok/s':>7} {'out err':>9} {'state err':>9} ok")
    for r in result["cases"]:
        split = [r["kernel_ms"].get(k) for k in KERNELS]
        cells = " ".join(f"{x:7.3f}" if x is not None else f"{'-':>7}" for x in split)
        print(
            f"{r['case']:>9} {r['tokens']:>7} {r['triton_ms']:10.3f} {cells} {r['reference_ms']:8.1f}"
            f" {r['mtok_per_s']:7.2f} {r['out_max_abs_err']:9.2e} {r['state_max_abs_err']:9.2e}"
            f" {'yes' if r['within_tolerance'] else 'NO'}"
        )


def _commit() -> str:
    # The device machine's copy of the tree may carry a stale .git: ENCLAVE_COMMIT, when set, wins.
    if os.environ.get("ENCLAVE_COMMIT"):
        return os.environ["ENCLAVE_COMMIT"]
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        found = git.stdout.strip() if git.returncode == 0 else ""
    except OSError:
        found = ""
    return found or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="write the results here")
    parser.add_argument("--sweep", action="store_true", help="also time the launch choices (GPU only)")
    args = parser.parse_args()

    device = "cuda" if ON_GPU else "cpu"
    # bf16 tl.dot is meaningless in the interpreter: the CPU stand-in runs fp32 at toy sizes.
    dtype, shape, cases, tol = (
        (torch.bfloat16, (16, 32, 128), GPU_CASES, TOL_GPU)
        if ON_GPU
        else (torch.float32, (1, 2, 16), CPU_CASES, TOL_CPU)
    )
    started = time.perf_counter()
    result = {
        "benchmark": "kernels_gated_delta",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "device": torch.cuda.get_device_name()
        if ON_GPU
        else f"{platform.machine()} CPU (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "hk": shape[0],
        "hv": shape[1],
        "d": shape[2],
        "tolerance": tol,
        "cases": [],
    }
    for name, lens, ctx in cases:
        result["cases"].append(run_case(name, lens, ctx, shape, dtype, device, tol))
        print(f"  {name}: {result['cases'][-1]['triton_ms']:.3f} ms", flush=True)
    if args.sweep and ON_GPU:
        result["sweep"] = sweep(shape, dtype, device)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print_table(result)
    print(f"({result['seconds']} s)")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if all(r["within_tolerance"] for r in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
