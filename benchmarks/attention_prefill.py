"""Benchmark: the prefill attention kernels against torch's flash SDPA at Qwen3.5's shape (issue 19).

    python benchmarks/attention_prefill.py [--cases 8192,32768,8192@131072,8192@524288] [--repeats 5]
        [--sweep] [--block-size 64] [--kv-cache-dtype fp8] [--json PATH]
    python benchmarks/attention_prefill.py --device cpu --quick      (Triton's interpreter: fp32, D 16)

One sequence per case: N new tokens after C cached ones (`N@C`; `N` alone: a whole causal prompt), 16 query
heads, 2 kv heads, head dim 256, bf16, a paged cache of 16-position blocks handed out shuffled (the block
table is no run). Three implementations attend the same queries over the same keys and values:
- `rows`: the current prefill kernel (`triton._prefill_attention_kernel`, one program per query head and 64
  tokens);
- `packed`: the packed GQA kernel (`prefill._prefill_packed_kernel`, one program per kv head and 16 tokens x
  8 query heads), at its default tiles or, with `--sweep`, at each of `prefill.SWEEP_TILES`;
- `sdpa`: torch's SDPA on the FLASH_ATTENTION backend over contiguous [1, H, S, D] tensors with
  `enable_gqa` (repeated kv heads if this torch's flash path refuses GQA). A chunk after a context needs the
  causal mask aligned to the bottom right (query j sees keys 0 .. C + j): `causal_lower_right(N, C + N)`,
  which SDPA hands to the flash kernel as is_causal (flash aligns it so when the lengths differ), not a
  materialised mask.
With `--kv-cache-dtype fp8` the caches hold e4m3 keys and values with a scale per (position, kv head), as
the engine's FP8 cache does (`fp8_kv.quantize`); `packed` and `rows` read them (products in bf16; `packed`
past `COPY_ONCE_CONTEXT` cached positions through a bf16 copy dequantised once, the copy timed too),
`packed-fp8` and `rows-fp8` run the QK and PV products in e4m3 (ENCLAVE_FP8_ATTENTION's path), and SDPA
runs on the dequantised keys and values in bf16, so the error is the kernels' own over the same cache
(issue 19: a 1M-token prompt in 150 s with the FP8 cache needs about 650 TFLOP/s of attention).
Only attention is timed (the caches hold every position beforehand; `paged_attention`'s write of the new
rows is left out). TFLOP/s count the causal work: 4 * D * Hq * (sum over queries of the keys they see),
N * C + N (N + 1) / 2 keys in all. The error is the max |ours - SDPA| over the outputs. On a CPU (Triton's
interpreter, fp32, D 16) only the error means anything: the run keeps the script from rotting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before any Triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import SeqLayout
from engine.kernels.attention import fp8_kv, prefill
from engine.kernels.attention import triton as attention_triton

BLOCK = 16  # KV block size (--block-size 64, the engine's CUDA default, gives the packed kernel whole pages)
CASES = "8192,32768,8192@131072,8192@524288"
QUICK_CASES = "40,24@40"  # tiny: seconds in the interpreter, a smoke test on a GPU


def parse_cases(text: str) -> list[tuple[int, int]]:
    """`8192,8192@131072` -> [(8192, 0), (8192, 131072)]: (new tokens, cached tokens)."""
    cases = []
    for item in text.split(","):
        n, _, ctx = item.partition("@")
        cases.append((int(n), int(ctx or 0)))
    return cases


def causal_flops(n: int, ctx: int, hq: int, d: int) -> int:
    """4 * D * Hq * (keys seen, summed over queries): query j of the chunk sees ctx + j + 1 keys."""
    return 4 * d * hq * (n * ctx + n * (n + 1) // 2)


def make_inputs(n, ctx, hq, hkv, d, dtype, device, block=BLOCK, seed=0):
    """Queries [N, Hq, D], all keys/values [S, Hkv, D], and paged caches holding them in shuffled blocks."""
    s = ctx + n
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(n, hq, d, generator=gen, device=device, dtype=dtype)
    k = torch.randn(s, hkv, d, generator=gen, device=device, dtype=dtype)
    v = torch.randn(s, hkv, d, generator=gen, device=device, dtype=dtype)
    blocks = -(-s // block)
    table = list(range(blocks))
    random.Random(seed).shuffle(table)
    k_cache = torch.zeros(blocks, block, hkv, d, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(s, device=device)
    rows = torch.tensor(table, device=device)[pos // block] * block + pos % block
    k_cache.view(-1, hkv, d)[rows] = k
    v_cache.view(-1, hkv, d)[rows] = v
    layout = SeqLayout(
        query_lens=(n,), context_lens=(ctx,), slots=(0,), block_tables=(tuple(table),), block_size=block
    )
    return q, k, v, k_cache, v_cache, layout


def fp8_cache(k_cache, v_cache, layout, dtype):
    """The caches as the engine's FP8 cache holds them (e4m3 with a scale per position and kv head):
    (k8, v8, (k_scale, v_scale)); and the keys and values they hold, dequantised in sequence order
    [S, Hkv, D] (what SDPA attends over)."""
    (k8, ks), (v8, vs) = fp8_kv.quantize(k_cache), fp8_kv.quantize(v_cache)
    block = layout.block_size
    pos = torch.arange(layout.context_lens[0] + layout.query_lens[0], device=k_cache.device)
    rows = torch.tensor(layout.block_tables[0], device=k_cache.device)[pos // block] * block + pos % block
    hkv, d = k_cache.shape[2:]
    k = fp8_kv.dequantize(k8, ks, dtype).view(-1, hkv, d)[rows]
    v = fp8_kv.dequantize(v8, vs, dtype).view(-1, hkv, d)[rows]
    return (k8, v8, (ks, vs)), k, v


def ours(kernel: str, q, k_cache, v_cache, layout, config=None, scales=None):
    """A call of one prefill kernel (the launcher `paged_attention` uses for long sequences) into `out`;
    `scales` (k, v) for an FP8 cache; kernels `rows-fp8` and `packed-fp8`: with e4m3 products."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5

    def run():
        if kernel.startswith("packed"):
            args = (q, k_cache, v_cache, scales, layout, scale, out, None, None, config)
            attention_triton._long_packed(*args, fp8_dot=kernel == "packed-fp8")
        else:
            fp8_dot = kernel == "rows-fp8"
            attention_triton._long(q, k_cache, v_cache, scales, layout, scale, out, None, None, fp8_dot)
        return out

    return run


def sdpa(q, k, v, n, ctx):
    """Torch's SDPA (flash on CUDA) on the same inputs: out [N, Hq, D], and which variant ran."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q4 = q.transpose(0, 1)[None]  # [1, Hq, N, D]
    k4, v4 = (t.transpose(0, 1).contiguous()[None] for t in (k, v))  # [1, Hkv, S, D]
    group = q.shape[1] // k.shape[1]
    mask = {"is_causal": True} if ctx == 0 else {"attn_mask": causal_lower_right(n, ctx + n)}
    backend = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]

    def gqa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True, **mask)[0].transpose(0, 1)

    try:
        gqa()
        return gqa, "flash, enable_gqa" if q.is_cuda else "math, enable_gqa"
    except RuntimeError:  # this torch's flash path takes no GQA: repeat the kv heads (outside the timing)
        kr, vr = (t.repeat_interleave(group, dim=1) for t in (k4, v4))

        def repeated():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, kr, vr, **mask)[0].transpose(0, 1)

        return repeated, "flash, repeated kv"


def time_ms(fn, repeats: int) -> float:
    """Median milliseconds of `repeats` calls after two warm-up calls (one untimed call on a CPU)."""
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def bench_case(n, ctx, args, hq, hkv, d, dtype, device, configs) -> list[dict]:
    q, k, v, k_cache, v_cache, layout = make_inputs(n, ctx, hq, hkv, d, dtype, device, args.block_size)
    scales = None
    runs = [("rows", None), *(("packed", c) for c in configs)]
    if args.kv_cache_dtype == "fp8":
        (k_cache, v_cache, scales), k, v = fp8_cache(k_cache, v_cache, layout, dtype)
        runs[1:1] = [("rows-fp8", None), *(("packed-fp8", c) for c in configs)]
    flops = causal_flops(n, ctx, hq, d)
    reference, variant = sdpa(q, k, v, n, ctx)
    expected = reference().float()
    sdpa_ms = time_ms(reference, args.repeats)
    rows = [dict(kernel="sdpa", variant=variant, ms=sdpa_ms, max_err=0.0)]
    for kernel, config in runs:
        row = dict(kernel=kernel, config=list(config) if config else None)
        try:
            fn = ours(kernel, q, k_cache, v_cache, layout, config, scales)
            row["max_err"] = (fn().float() - expected).abs().max().item()
            row["ms"] = time_ms(fn, args.repeats)
        except Exception as e:  # a tiling past the GPU's resources: report it, keep sweeping
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
    for row in rows:
        row.update(case=f"{n}@{ctx}", new_tokens=n, context=ctx, flops=flops)
        if "ms" in row:
            row["tflops"] = flops / row["ms"] / 1e9
            row["vs_sdpa"] = sdpa_ms / row["ms"]
    del q, k, v, k_cache, v_cache, expected
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help=f"tiny cases ({QUICK_CASES}) for a smoke run")
    parser.add_argument("--cases", help=f"N or N@C, comma-separated (default {CASES})")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=BLOCK, help="positions per KV cache block")
    parser.add_argument(
        "--sweep", action="store_true", help="the packed kernel at each tiling of prefill.SWEEP_TILES"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="fp8: e4m3 caches with scales, as kv_cache_dtype=fp8 (and the rows kernel's e4m3 products too)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # the interpreter: fp32 (its bf16 dots are wrong), a small head dim
        hq, hkv, d, dtype = 16, 2, 16, torch.float32
    else:
        hq, hkv, d, dtype = 16, 2, 256, torch.bfloat16
    default_cases = QUICK_CASES if args.quick else CASES
    default = prefill.tiling(dtype, hq // hkv)
    configs = [default, *(c for c in prefill.SWEEP_TILES if c != default)] if args.sweep else [default]
    results = []
    for n, ctx in parse_cases(args.cases or default_cases):
        results += bench_case(n, ctx, args, hq, hkv, d, dtype, device, configs)
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        torch=torch.__version__,
        shape=dict(hq=hq, hkv=hkv, d=d, dtype=str(dtype).removeprefix("torch."), block=args.block_size)
        | dict(kv_cache_dtype=args.kv_cache_dtype),
        results=results,
        best=best_configs(results),
    )
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


def best_configs(results: list[dict]) -> dict:
    """Per case, the fastest packed tiling; and the tiling with the best geometric mean over the cases."""
    packed = [r for r in results if r["kernel"] == "packed" and "ms" in r]
    per_case = {}
    for r in packed:
        if r["case"] not in per_case or r["ms"] < per_case[r["case"]]["ms"]:
            per_case[r["case"]] = r
    cases = {r["case"] for r in packed}
    totals = {}
    for r in packed:
        totals.setdefault(tuple(r["config"]), []).append(r["tflops"])
    complete = {c: v for c, v in totals.items() if len(v) == len(cases)}
    overall = max(complete, key=lambda c: statistics.geometric_mean(complete[c])) if complete else None
    return dict(per_case={k: v["config"] for k, v in per_case.items()}, overall=overall)


def print_table(results: list[dict]) -> None:
    print(f"{'case':>14} {'kernel':>7} {'tiles':>16} {'ms':>9} {'TFLOP/s':>8} {'x SDPA':>7} {'max err':>8}")
    for r in results:
        tiles = "x".join(map(str, r["config"])) if r.get("config") else r.get("variant", "")
        if "error" in r:
            print(f"{r['case']:>14} {r['kernel']:>7} {tiles:>16} {r['error']}")
            continue
        print(
            f"{r['case']:>14} {r['kernel']:>7} {tiles[:16]:>16} {r['ms']:9.3f} {r['tflops']:8.1f} "
            f"{r['vs_sdpa']:7.2f} {r['max_err']:8.1e}"
        )


if __name__ == "__main__":
    main()
