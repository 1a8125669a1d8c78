"""GPU benchmark: the engine against the memory roofline, the matrix rate and transformers (issue 5).

    python -m engine.bench [--preset qwen3.5-35b-a3b | --preset tiny | --model PATH]
        [--workloads a,b,c,d,e,f,g,h,i,j] [--quick] [--max-seconds S] [--device cuda] [--dtype bfloat16]
        [--kv-cache-gib G] [--kv-cache-dtype auto|fp8] [--block-size 16] [--long-prompt 131072,262144,1M]
        [--speculative] [--draft-head model|fp8]
        [--json PATH]
    enclave bench ...   (the same arguments)

A preset builds the model with seeded random weights directly on the device (no checkpoint, no tokenizer:
prompts are random token ids). The same run measures the device's copy bandwidth (the roofline) and its
matrix rate, then each workload's tokens/s, the bytes a token must move (weights, KV, DeltaNet state)
and the percentage of the roofline that is:

    (a) single stream: one 512-token prompt, 256 new tokens
    (b) batch decode at 16, 64 and 256 sequences (decode steps only, after every prefill)
    (c) prefill of 8 x 4096 tokens, also as % of the measured matrix rate
    (d) documents: 512 requests of 2048 prompt + 256 new tokens through Engine.submit
    (e) long context: a 131,072-token prompt (or each --long-prompt length), its prefill and the decode
        rate at that context; a preset whose window is shorter gets YaRN as Qwen3.6 documents for 1M tokens
    (f) MTP verify step with k = 1, 2, 3 against a plain decode step at batch 1 (time ratio); then one
        request decoded end to end, plainly and speculating with a drafter right with probability p per
        position (mean accepted lengths 1.8, 2.4, 3.39 at k = 1, 2, 3; the real MTP head drafts first, for
        its cost); `--speculative` does the same at each batch size of (b)
    (g) transformers' Qwen3_5MoeForCausalLM, same geometry and random weights, for (a) and (b, 64)
    (h)-(j) vLLM's published H200 runs (Qwen3.5-35B-A3B-FP8), their shapes through Engine.submit, each
        against vLLM's figure: (h) 1,000 x 1,024+128 at 512 concurrent (50,465 total tok/s); (i) 100 x
        32,000+100, all submitted (56,424 total tok/s); (j) 1,000 x 1,000+2,000 at 200 concurrent (8,146
        output tok/s)
    (k) constrained decoding: (b)'s decode steps with every request held to a mid-size JSON schema against
        the same run without, at batch 1 and (b)'s sizes (the ratio of step times; needs llguidance)

Workloads (a)-(c), (e) and (f) drive an `EngineCore` directly, so each step is timed on its own (the
first decode steps of each run are left untimed: compiles, graph captures); (d) and (h)-(j) go through the
engine's loop thread as the pipeline does, with at most their concurrency in flight (the next request
submitted when one finishes); (g) runs after our model is freed. `--quick` shrinks every workload.
Each measurement (each batch size of (b), each k of (f)) stops at `--max-seconds` and reports what it
measured so far; one that fails (out of memory, say) is recorded as its error and the run goes on.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from engine.bench.device import free, measure_device
from engine.bench.harness import Bench
from engine.bench.measure import describe, say
from engine.bench.presets import PRESETS, expert_load, random_model, with_window
from engine.bench.report import environment, geometry, load_text, param_summary, print_table, write_json
from engine.bench.settings import DTYPES, GIB, QUICK, WARMUP_STEPS, Settings, Sizes
from engine.bench.traffic import ParamCounts, param_counts
from engine.bench.transformers_ref import transformers_comparison
from engine.bench.workloads import RUNNERS, long_positions
from engine.config import ModelConfig, config_from_dict
from engine.engine import Engine
from engine.env import engine_env
from engine.errors import EngineError
from engine.grammar import FILL_POOL, FILL_POOLS, FILL_THREADS
from engine.model.fp8_linear import quantize_model_
from engine.model.model import CausalLM
from engine.options import DRAFT_HEADS, KV_CACHE_DTYPES, QUANTIZATIONS, STATE_DTYPES, EngineOptions
from engine.planner import block_size_for

log = logging.getLogger(__name__)

DEFAULT_JSON = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench.json"
WORKLOADS = "abcdefghijk"


def load(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[CausalLM, ModelConfig, dict]:
    """The model to measure: a preset with random weights, or the checkpoint at --model."""
    if args.model:
        # A small cache only: the workloads plan their own. The engine is dropped, the model kept.
        options = EngineOptions.from_flat(
            {
                "device": str(device),
                "dtype": str(dtype).removeprefix("torch."),
                "quantization": args.quantization,
                "max_num_seqs": 1,
                "max_prefixes": 0,
                "kv_cache_memory": GIB,
            }
        )
        engine = Engine.from_pretrained(args.model, options)
        model, config = engine.model, engine.config
        engine.close()
        return model.requires_grad_(False), config, dict(config.extra.get("raw") or {})
    raw = PRESETS[args.preset]()
    if args.long_prompt and "e" in args.workloads:
        raw = with_window(raw, long_positions(Sizes(), max(args.long_prompt)))
    config = config_from_dict(raw, source=f"preset {args.preset}")
    check_room(param_counts(config), device, dtype)
    model = random_model(config, device, dtype, args.seed)
    if args.quantization == "fp8":
        log.info("quantised %d dense projections and the routed experts to block FP8", quantize_model_(model))
    return model, config, raw


def check_room(counts: ParamCounts, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, in one line, to build weights that cannot fit the device's free memory."""
    need = counts.total * dtype.itemsize
    try:
        if device.type == "cuda":
            room = torch.cuda.mem_get_info(device)[0]
        else:
            room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no such query on this platform: just try
        return
    if need > room:
        raise EngineError(
            f"the random weights need {need / GIB:.1f} GiB and {device} has {room / GIB:.1f} GiB free; "
            "use a GPU with room (--device), --dtype bfloat16, or --preset tiny"
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the device, build or load the model, run the chosen workloads; the report as plain data."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    sizes = replace(QUICK if args.quick else Sizes(), **({"batches": args.batches} if args.batches else {}))
    sizes = replace(sizes, long_prompts=args.long_prompt or ())
    kv_cache_bytes = int((args.kv_cache_gib or (40 if device.type == "cuda" else 1)) * GIB)
    settings = Settings(
        max_seconds=args.max_seconds,
        kv_cache_bytes=kv_cache_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        # (d) and (h)-(j) on CUDA: the engine's own budget, as a server sizes it, unless --kv-cache-gib says
        # (a fixed 40 GiB beside 35B FP8 weights ran an 80 GB card out of memory mid-run).
        serve_kv_cache_bytes=None if device.type == "cuda" and not args.kv_cache_gib else kv_cache_bytes,
        warm_up=args.warm_up,
        long_prefill_chunk=args.long_prefill_chunk,
        kv_cache_dtype=args.kv_cache_dtype,
        state_dtype=args.state_dtype,
        speculative=args.speculative,
        block_size=args.block_size,
        draft_head=args.draft_head,
        draft_vocab=args.draft_vocab,
        fill_pool=args.fill_pool,
        fill_threads=args.fill_threads,
    )
    bandwidth, matmul = measure_device(device, dtype, args.quick)
    say(f"building {args.model or args.preset} on {device} as {dtype}")
    start = time.perf_counter()
    model, config, raw = load(args, device, dtype)
    built_s = time.perf_counter() - start
    counts = param_counts(config, args.quantization)
    try:
        spread = expert_load(model, seed=args.seed)
    except Exception as exc:  # a kernel failing here should not cost the rest of the run
        log.warning("measuring the expert load failed", exc_info=True)
        spread = {"error": describe(exc)}
    say(f"  built in {built_s:.1f} s; expert load {load_text(spread)}")
    bench = Bench(
        model, config, counts, device, dtype, sizes, settings, bandwidth["bytes_per_s"], matmul["flop_per_s"]
    )
    results: dict[str, Any] = {}
    for letter in args.workloads:
        if letter in RUNNERS:
            title, runner = RUNNERS[letter]
            results[letter] = []
            for run_index in range(args.repeat):
                say(
                    f"({letter}) {title}"
                    + (f" [run {run_index + 1} of {args.repeat}]" if args.repeat > 1 else "")
                )
                points = runner(bench)
                if args.repeat > 1:  # the same process again: kernels compiled, caches warm
                    points = [p | {"label": f"{p['label']} [run {run_index + 1}]"} for p in points]
                results[letter] += points
                free(device)
    if "g" in args.workloads:
        bench.model = model = None  # transformers' copy of the model needs the memory
        free(device)
        say("(g) transformers")
        results["g"] = transformers_comparison(bench, raw, results)
    configuration = {
        "source": args.model or f"preset {args.preset} (random weights, seed {args.seed})",
        "model_type": config.model_type,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "state_dtype": args.state_dtype,
        "geometry": geometry(config),
        "rope": f"{config.rope.rope_type} x{config.rope.factor:g}, window {config.max_model_len:,}",
        "params": param_summary(counts),
        "build_s": built_s,
        "quick": args.quick,
        "repeat": args.repeat,
        "sizes": asdict(sizes),
        "settings": asdict(settings),
        "block_size": block_size_for(settings.block_size, device),
        "warmup_decode_steps": WARMUP_STEPS,
        "kernels": engine_env().kernels,
        "sampling": "greedy, ignore_eos, random prompt token ids",
    }
    return {
        **environment(device),
        "configuration": configuration,
        "bandwidth": bandwidth,
        "matmul": matmul,
        "expert_load": spread,
        "workloads": results,
    }


def _workloads(text: str) -> str:
    letters = "".join(x.strip().lower() for x in text.split(",") if x.strip())
    if not letters or any(x not in WORKLOADS for x in letters):
        raise argparse.ArgumentTypeError(f"workloads are letters among {','.join(WORKLOADS)}, e.g. a,b,f")
    return "".join(x for x in WORKLOADS if x in letters)


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(x) for x in text.split(",") if x.strip())
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive integers, e.g. 16,64,256")
    return sizes


_SUFFIXES = {"": 1, "k": 1000, "m": 1000**2, "ki": 1024, "mi": 1024**2}


def _lengths(text: str) -> tuple[int, ...]:
    """Prompt lengths such as 131072,262144,1000000 or 128Ki,256Ki,1M (k, M: 1,000s; Ki, Mi: 1,024s)."""
    lengths = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        number = item.rstrip("kKmMiI")
        scale = _SUFFIXES.get(item[len(number) :].lower())
        if scale is None or not number.isdigit() or int(number) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a prompt length: e.g. 131072,262144,1000000 or 128Ki,256Ki,1M"
            )
        lengths.append(int(number) * scale)
    if not lengths:
        raise argparse.ArgumentTypeError("name at least one prompt length, e.g. 131072,262144,1000000")
    return tuple(lengths)


def _doc(option: str) -> str:
    """An engine option's meaning, as `EngineOptions.flat_fields()` documents it."""
    return next(f.doc for f in EngineOptions.flat_fields() if f.name == option).replace("%", "%%")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; its description is this module's first docstring line."""
    parser = argparse.ArgumentParser(prog="engine.bench", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.5-35b-a3b")
    source.add_argument("--model", help="a checkpoint directory instead of a preset")
    parser.add_argument("--workloads", type=_workloads, default=WORKLOADS, help="e.g. a,b,f (default: all)")
    parser.add_argument("--quick", action="store_true", help="shrink every workload (a few minutes in all)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="time cap of each measurement")
    parser.add_argument("--device", help="default: cuda when available")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, else float32")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        help="cache budget of each workload (default 40 on cuda; (d) and (h)-(j): what the engine plans)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help=_doc("max_num_batched_tokens")
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="of workload (d) ((h), (j): their concurrency; (i): the engine's plan)",
    )
    parser.add_argument("--batches", type=_sizes, help="batch sizes of (b) (default 16,64,256)")
    parser.add_argument(
        "--long-prompt",
        type=_lengths,
        help="prompt lengths of (e), e.g. 131072,262144,1000000 or 128Ki,256Ki,1M (k, M: thousands, "
        "millions; Ki, Mi: 1,024, 1,048,576); default 131072",
    )
    parser.add_argument("--long-prefill-chunk", type=int, help=_doc("long_prefill_chunk"))
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="(b) also decodes each batch plainly and with controlled-acceptance MTP speculation end to end",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        help="the start-up warm-up of the serving engines of (d), (h)-(j) (default: on with cuda graphs)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each workload this many times in the same process (later runs: every kernel compiled)",
    )
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help=_doc("quantization"))
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=_doc("kv_cache_dtype")
    )
    parser.add_argument("--state-dtype", choices=STATE_DTYPES, default="auto", help=_doc("state_dtype"))
    parser.add_argument("--block-size", type=int, help=_doc("block_size"))
    parser.add_argument("--draft-head", choices=DRAFT_HEADS, default="model", help=_doc("draft_head"))
    parser.add_argument("--draft-vocab", type=int, help=_doc("draft_vocab"))
    parser.add_argument(
        "--fill-pool", choices=FILL_POOLS, help=f"(k)'s mask fill pool (default {FILL_POOL}, the engine's)"
    )
    parser.add_argument(
        "--fill-threads", type=int, help=f"(k)'s mask fill threads (default {FILL_THREADS}, the engine's)"
    )
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="write the results here ('' for none)")
    args = parser.parse_args(argv)
    if args.long_prefill_chunk is not None and args.long_prefill_chunk < 1:
        parser.error("--long-prefill-chunk must be positive")
    if args.fill_threads is not None and args.fill_threads < 1:
        parser.error("--fill-threads must be positive")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        parser.error("--draft-vocab must be positive")
    if args.max_seconds <= 0 or args.max_num_batched_tokens < 1 or args.max_num_seqs < 1 or args.repeat < 1:
        parser.error("--max-seconds, --max-num-batched-tokens, --max-num-seqs and --repeat must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with `argv` (sys.argv by default), print the table, write the JSON; exit status."""
    args = parse_args(argv)
    try:
        report = run(args)
    except EngineError as exc:  # a bad checkpoint, or weights too large for the device
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:  # out of memory building the model, say
        log.debug("benchmark failed", exc_info=True)
        print(f"error: {describe(exc)}", file=sys.stderr)
        return 1
    print_table(report)
    if args.json:
        write_json(report, Path(args.json))
    return 0
