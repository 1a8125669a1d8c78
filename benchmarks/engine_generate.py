"""Benchmark: static-batch generation throughput of the engine's reference path.

    python benchmarks/engine_generate.py [--model DIR] [--device cuda] [--dtype bfloat16] [--json out.json]

Without --model it writes the random demo checkpoint to a temporary directory. Prints one table and writes
JSON (date, device, torch version, configuration, per-batch-size timings).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, SamplingParams
from engine.demo_model import write_demo_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parameter_bytes(engine: Engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def run(args: argparse.Namespace, model_dir: str) -> dict:
    engine = Engine.from_pretrained(
        model_dir, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch)
    )
    vocab = engine.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch:
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        sync(engine.device)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        sync(engine.device)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.token_ids) for o in outs)
        step_s = elapsed / args.max_tokens
        rows.append(
            {
                "batch": batch,
                "prompt_len": args.prompt_len,
                "new_tokens": args.max_tokens,
                "seconds": elapsed,
                "output_tokens_per_s": generated / elapsed,
                "ms_per_step": 1000 * step_s,
            }
        )
    weights = parameter_bytes(engine)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "device": torch.cuda.get_device_name(engine.device)
        if engine.device.type == "cuda"
        else f"CPU {platform.machine()}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": str(engine.dtype),
        "model": engine.config.model_type,
        "weight_bytes": weights,
        "path": "reference (torch ops, static batch)",
        "rows": rows,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.model:
        result = run(args, args.model)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(args, str(write_demo_model(tmp)))
    print(f"{result['device']} | torch {result['torch']} | {result['dtype']} | {result['path']}")
    print(f"{'batch':>5} {'prompt':>6} {'new':>4} {'seconds':>8} {'out tok/s':>10} {'ms/step':>8}")
    for r in result["rows"]:
        print(
            f"{r['batch']:>5} {r['prompt_len']:>6} {r['new_tokens']:>4} {r['seconds']:>8.3f} "
            f"{r['output_tokens_per_s']:>10.1f} {r['ms_per_step']:>8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
