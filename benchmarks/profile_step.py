"""Where one engine step spends its time: torch.profiler over prefill and decode steps of a preset model.

    python benchmarks/profile_step.py [--preset qwen3.5-35b-a3b|tiny] [--out DIR] [--rows 25]
        [--quantization fp8] [--state-dtype bfloat16] [--cases prefill,decode1,decode64,mixed]

For each case (a prefill step of 2 x 4096 prompt tokens, decode steps at batch 1 and 64, and a mixed step of
512 decoding sequences beside a whole step of prompt chunks, `mixed1` beside one 1,024-token prompt, as
workload (h) runs them; `verify0`-`verify3`, workload (f)'s synchronous batch-1 plain step and verify steps
of 1-3 drafts) it prints the step's wall time, the device time the profiler saw, the number of kernel
launches, and the ops that took most device time and most host time. Take profiles for tuning with
ENCLAVE_PDL=0: with PDL a kernel launched early waits inside the kernel, and the profiler counts the wait as
its time. Tables go to stdout and, with --out, to DIR/profile_<case>.txt; the summary to DIR/profile.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench.device import sync
from engine.bench.harness import Bench
from engine.bench.presets import PRESETS, random_model
from engine.bench.settings import GIB, QUICK, Settings
from engine.bench.traffic import param_counts
from engine.bench.workloads import repeat_last_drafter
from engine.config import config_from_dict
from engine.model.fp8_linear import quantize_model_
from engine.sequence import Sequence


def build(
    preset: str,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str = "none",
    state_dtype: str = "auto",
) -> Bench:
    config = config_from_dict(PRESETS[preset](), source=f"preset {preset}")
    model = random_model(config, device, dtype, seed=0)
    if quantization == "fp8":  # the dense projections and routed experts in block FP8, as the bench does
        quantize_model_(model)
    settings = Settings(
        max_seconds=60.0,
        kv_cache_bytes=8 * GIB,
        max_num_batched_tokens=8192,
        max_num_seqs=64,
        seed=0,
        state_dtype=state_dtype,
    )
    counts = param_counts(config, quantization)
    return Bench(model, config, counts, device, dtype, QUICK, settings, 1.0, 1.0)


def case(b: Bench, name: str, batch: int, prompt: int, decode: bool, rows: int, out: Path | None) -> dict:
    """Prefill `batch` prompts; profile the first prefill step, or (decode) a decode step after warm-up."""
    if not decode:  # compile for the prefill shapes first, on a core of its own
        warm = b.core(batch, prompt + 32)
        b.add(warm, batch, prompt, 2, prompt + 32)
        while warm.has_work():
            warm.step()
        del warm
    core = core_for(b, batch, prompt + 32)
    seqs = b.add(core, batch, prompt, 24, prompt + 32)
    if decode:
        while any(not s.output_ids for s in seqs):
            core.step()
        for _ in range(4):
            core.step()
    if decode:  # how many sequences the profiled step decodes (all of them, unless the plan ran short)
        print(f"{name}: {sum(not s.finished for s in seqs)} of {batch} sequences decoding", flush=True)
    if decode:  # one more step, timed without the profiler (a prefill step is timed by the profiled run)
        sync(b.device)
        start = time.perf_counter()
        core.step()
        sync(b.device)
        wall = time.perf_counter() - start
    return case_step(b, core, name, rows, out, None if not decode else wall)


def case_step(b: Bench, core, name: str, rows: int, out: Path | None, wall: float | None = None) -> dict:
    """Profile the core's next step; `wall` the step's time measured without the profiler (None: the
    profiled step's own)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        core.step()
        sync(b.device)
    if wall is None:
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    by_device = events.table(sort_by="self_device_time_total", row_limit=rows) if kernels else ""
    by_host = events.table(sort_by="self_cpu_time_total", row_limit=rows)
    text = (
        f"== {name}: wall {wall * 1e3:.2f} ms, device {device_us / 1e3:.2f} ms, {launches} kernels\n"
        f"-- by device time\n{by_device}\n-- by host time\n{by_host}\n"
    )
    print(text, flush=True)
    if out is not None:
        (out / f"profile_{name}.txt").write_text(text)
    return {"wall_ms": wall * 1e3, "device_ms": device_us / 1e3, "kernels": launches}


def verify(b: Bench, k: int, prompt: int, rows: int, out: Path | None) -> dict:
    """A batch-1 step verifying `k` drafts as workload (f) times it: synchronous, the drafts repeating the
    last token (`repeat_last_drafter`: the verify pass alone, without the MTP head's drafting), so on random
    weights every draft is rejected and every step commits a kept DeltaNet state; k = 0 is the plain step (f)
    compares them with. One step profiled after warm-up (graphs captured)."""
    max_len = prompt + 64 * (k + 1)
    core = b.core(1, max_len, k, repeat_last_drafter if k else None, asynchronous=False)
    seqs = b.add(core, 1, prompt, 48 * (k + 1), max_len)
    while not seqs[0].output_ids:
        core.step()
    for _ in range(4):
        core.step()
    sync(b.device)
    start = time.perf_counter()
    core.step()
    sync(b.device)
    return case_step(b, core, f"verify{k}", rows, out, time.perf_counter() - start)


def core_for(b: Bench, seqs: int, max_len: int):
    """`b.core`, with room for the DeltaNet states of more than 64 sequences on CUDA (60 MB each): 64 GiB,
    or 70% of the free memory where less is free (an 80 GB card)."""
    settings = b.settings
    if b.device.type == "cuda" and seqs > 64:
        torch.cuda.empty_cache()  # the bf16 weights an FP8 build replaced, held by the caching allocator
        room = min(64 * GIB, int(0.7 * torch.cuda.mem_get_info(b.device)[0]))
        b.settings = dataclasses.replace(settings, kv_cache_bytes=room)
    try:
        return b.core(seqs, max_len)
    finally:
        b.settings = settings


def mixed(
    b: Bench, running: int, waiting: int, prompt: int, rows: int, out: Path | None, name: str = "mixed"
) -> dict:
    """`running` sequences decoding beside the prefill of `waiting` more (workload (h)'s steps): prefill the
    first `running`, then profile the first step that decodes all of them and prefills the others' chunks."""
    # Room to decode while the others prefill (64 steps at (h)'s shapes), so none finishes before the step.
    new, max_len = 200, prompt + 256
    core = core_for(b, running + waiting, max_len)
    first = b.add(core, running, prompt, new, max_len)
    while any(not s.output_ids for s in first):
        core.step()
    # Then the others, queued behind sequences that now decode (ids after the first ones').
    params = first[0].params
    later = [
        Sequence(running + i, ids, params, None, set(), None, max_len, b.device)
        for i, ids in enumerate(b.prompts(waiting, prompt))
    ]
    for seq in later:
        core.add(seq)
    seqs = first + later
    decoding = sum(bool(s.output_ids) for s in seqs)
    before = core.prompt_tokens
    result = case_step(b, core, name, rows, out)
    result.update(decoding=decoding, prefill_tokens=core.prompt_tokens - before)
    print(f"{name} step: {decoding} decoding, {result['prefill_tokens']} prompt tokens", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.5-35b-a3b")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", type=int, default=25)
    # and decode256, decode512, mixed, mixed1, verify0-3 ((f)'s plain and verify steps, synchronous, batch 1)
    parser.add_argument("--cases", default="prefill,decode1,decode64")
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none")
    parser.add_argument("--state-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b = build(args.preset, device, dtype, args.quantization, args.state_dtype)
    small = args.preset == "tiny" or device.type == "cpu"
    plans = {
        "prefill": (2, 512 if small else 4096, False),
        "decode1": (1, 64 if small else 512, True),
        "decode64": (8 if small else 64, 64 if small else 512, True),
        "decode256": (8 if small else 256, 64 if small else 512, True),  # (b, 256)'s steps
        "decode512": (8 if small else 512, 64 if small else 1024, True),  # (h)'s decode steps
    }
    summary = {}
    with torch.inference_mode():
        for name in args.cases.split(","):
            if name.startswith("verify"):  # verify0 (the plain step, synchronous), verify1-3
                k, prompt = int(name.removeprefix("verify")), plans["decode1"][1]
                summary[name] = verify(b, k, prompt, args.rows, args.out)
                continue
            if name in ("mixed", "mixed1"):  # beside a whole step of prompt chunks, or one prompt's
                waiting = 4 if name == "mixed" else 1
                shape = (8, waiting, 1024) if small else (512, 64 if name == "mixed" else 1, 1024)
                summary[name] = mixed(b, *shape, args.rows, args.out, name)
                continue
            batch, prompt, decode = plans[name]
            summary[name] = case(b, name, batch, prompt, decode, args.rows, args.out)
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        (args.out / "profile.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
