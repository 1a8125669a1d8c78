"""Benchmark: how continuous batching scales the engine's throughput on the CPU demo model.

    python benchmarks/engine_batching.py [--batch 1,2,4,8,16,32,64] [--prompt-len 64] [--max-tokens 32]
        [--repeats 3] [--speculative K] [--device cpu] [--dtype float32] [--json PATH]

For each batch size B it loads one engine with max_num_seqs=B, submits B requests of random prompt tokens
(fixed seed; greedy, ignore_eos) through `Engine.submit` and waits for them all. After a warm-up run, each
point is repeated and the median (with min and max) reported, because CPU timings are noisy. Without
--model it writes the random demo checkpoint to a temporary directory. Prints one table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, SamplingParams
from engine.demo_model import write_demo_model

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "engine_batching.json"
PROMPT_VOCAB = 600  # demo vocabulary is ~635 ids; stay below it whatever the checkpoint


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def once(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit every prompt, wait for all; the wall time spans the first submit to the last result."""
    before = engine.stats()
    sync(engine.device)
    start = time.perf_counter()
    futures = [engine.submit(p, params) for p in prompts]
    outs = [f.result() for f in futures]
    sync(engine.device)
    wall = time.perf_counter() - start
    after = engine.stats()
    generated = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    ttft = [o.metrics.time_to_first_token for o in outs if o.metrics.time_to_first_token is not None]
    decode = [o.metrics.decode_tokens_per_s for o in outs if o.metrics.decode_tokens_per_s is not None]
    drafts = after.draft_tokens - before.draft_tokens
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "output_tokens_per_s": generated / wall,
        "total_tokens_per_s": (prompt_tokens + generated) / wall,
        "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
        "mean_decode_tokens_per_s": statistics.fmean(decode) if decode else None,
        "steps": after.steps - before.steps,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "draft_tokens": drafts,
        "accepted_tokens": after.accepted_tokens - before.accepted_tokens,
    }


def summary(values: list[float | None]) -> dict | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"median": statistics.median(known), "min": min(known), "max": max(known)}


def point(args: argparse.Namespace, model_dir: str, batch: int) -> tuple[dict, dict]:
    """One batch size on a fresh engine; returns its row and what the engine ran on."""
    engine = Engine.from_pretrained(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=batch,
        max_num_batched_tokens=args.max_batched_tokens,
        num_speculative_tokens=args.speculative,
    )
    try:
        vocab = min(engine.config.vocab_size, PROMPT_VOCAB)
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        once(engine, prompts, params)  # warm-up: first-touch allocations, kernel selection
        runs = [once(engine, prompts, params) for _ in range(args.repeats)]
        row = {
            "batch": batch,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "steps": statistics.median(r["steps"] for r in runs),
            "preemptions": max(r["preemptions"] for r in runs),
            **{
                key: summary([r[key] for r in runs])
                for key in (
                    "wall_s",
                    "output_tokens_per_s",
                    "total_tokens_per_s",
                    "mean_ttft_s",
                    "mean_decode_tokens_per_s",
                )
            },
            "runs": runs,
        }
        drafts = sum(r["draft_tokens"] for r in runs)
        if drafts:
            row["draft_acceptance"] = sum(r["accepted_tokens"] for r in runs) / drafts
        loaded = {
            "machine": (
                torch.cuda.get_device_name(engine.device)
                if engine.device.type == "cuda"
                else f"{platform.machine()} CPU x{os.cpu_count()}, {torch.get_num_threads()} torch threads"
            ),
            "model": engine.config.model_type,
            "device": str(engine.device),
            "dtype": str(engine.dtype),
        }
        return row, loaded
    finally:
        engine.close()


def run(args: argparse.Namespace, model_dir: str) -> dict:
    rows = []
    loaded: dict = {}
    load_before = os.getloadavg()
    for batch in args.batch:
        row, loaded = point(args, model_dir, batch)
        rows.append(row)
        print(f"  batch {batch}: {row['output_tokens_per_s']['median']:.1f} output tok/s", file=sys.stderr)
    base = next((r for r in rows if r["batch"] == 1), rows[0])["output_tokens_per_s"]["median"]
    for r in rows:
        r["speedup_vs_batch_1"] = r["output_tokens_per_s"]["median"] / base
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": loaded["machine"],
        "commit": _commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "configuration": {
            "model": loaded["model"],
            "device": loaded["device"],
            "dtype": loaded["dtype"],
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "sampling": "greedy, ignore_eos",
            "repeats": args.repeats,
            "warmup_runs": 1,
            "num_speculative_tokens": args.speculative,
            "max_num_batched_tokens": args.max_batched_tokens,
            "max_num_seqs": "= batch size",
            "seed": args.seed,
            "path": "continuous batching (Engine.submit, background loop)",
        },
        # Other work on the machine skews CPU timings: the 1-minute load average around the sweep.
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "baseline_batch": 1 if any(r["batch"] == 1 for r in rows) else rows[0]["batch"],
        "results": rows,
    }


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


def _batches(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive integers, e.g. 1,8,32")
    return sizes


def print_table(result: dict) -> None:
    c = result["configuration"]
    print(
        f"{result['machine']} | torch {result['torch']} | {c['dtype']} | commit {result['commit']} | "
        f"prompt {c['prompt_len']}, max_tokens {c['max_tokens']}, speculative {c['num_speculative_tokens']}, "
        f"median of {c['repeats']} (min-max) | load {result['load_average_1m']['before']:.2f}"
    )
    print(
        f"{'batch':>5} {'wall s (min-max)':>20} {'out tok/s (min-max)':>22} {'total tok/s':>11} "
        f"{'TTFT ms':>8} {'req dec tok/s':>13} {'speed-up':>8}"
    )
    for r in result["results"]:
        w, o = r["wall_s"], r["output_tokens_per_s"]
        ttft, dec = r["mean_ttft_s"], r["mean_decode_tokens_per_s"]
        ttft_text = f"{1000 * ttft['median']:>8.1f}" if ttft else f"{'-':>8}"
        dec_text = f"{dec['median']:>13.1f}" if dec else f"{'-':>13}"
        wall_text = f"{w['median']:.3f} ({w['min']:.3f}-{w['max']:.3f})"
        out_text = f"{o['median']:.1f} ({o['min']:.0f}-{o['max']:.0f})"
        print(
            f"{r['batch']:>5} {wall_text:>20} {out_text:>22} "
            f"{r['total_tokens_per_s']['median']:>11.1f} {ttft_text} {dec_text} "
            f"{r['speedup_vs_batch_1']:>7.2f}x"
        )
    accepted = [(r["batch"], r["draft_acceptance"]) for r in result["results"] if "draft_acceptance" in r]
    if accepted:
        print("draft acceptance: " + ", ".join(f"batch {b} {a:.0%}" for b, a in accepted))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the random demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=_batches, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculative", type=int, default=0, metavar="K", help="num_speculative_tokens")
    parser.add_argument("--max-batched-tokens", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="write the results here")
    args = parser.parse_args()
    if args.repeats < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        parser.error("--repeats, --prompt-len and --max-tokens must be at least 1")
    if args.model:
        result = run(args, args.model)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(args, str(write_demo_model(tmp)))
    print_table(result)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
