"""Where the host spends a decode step, and how long the device waits for it.

    python benchmarks/host_step.py [--preset qwen3.5-35b-a3b|tiny] [--batches 1,64] [--steps 50] [--out F]

Times each phase of `EngineCore.step` with perf_counter stamps (no extra synchronisation): scheduling,
building the batch (`build`), the graph replay call (metadata refill and launch), the eager tail (final
norm, logits, sampling launches), the wait for the sampled tokens (the one host read), emitting them, and
the scheduler's update, all with synchronous scheduling. Everything after the token read until the next
step's graph is launched is time the device sits idle: the `idle` column (emit, update, schedule, build and
the replay call, which refills the metadata). `async_step_us` is the step time with asynchronous
scheduling, which runs that host work while the device computes the step before.
Prints one table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profile_step import build
from engine import runner as runner_module
from engine.bench.device import sync
from engine.bench.presets import PRESETS

PHASES = ("schedule", "build", "replay", "tail", "sample", "read", "emit", "update")


class Stamps:
    """Accumulated seconds per phase, from wrappers around the runner's and scheduler's methods."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.on:
                    self.total[phase] += time.perf_counter() - start

        setattr(owner, name, timed)


def instrument(core, stamps: Stamps):
    """Wrap the phases in timers; returns the sampler to put back afterwards."""
    runner = core.runner
    stamps.wrap(core.scheduler, "schedule", "schedule")
    stamps.wrap(core.scheduler, "update", "update")
    stamps.wrap(runner, "_batch", "build")
    if runner.graphs is not None:
        stamps.wrap(runner.graphs, "run", "replay")
    stamps.wrap(runner, "sample", "emit")  # reads the tokens and makes each sequence's `Sampled`
    stamps.wrap(core.scheduler, "apply", "emit")  # appends them, with the stop checks
    stamps.wrap(runner.model, "logits", "tail")
    stamps.wrap(runner.model, "final_norm", "tail")
    # The token read is the .tolist() inside _tokens: time sample_rows (launch) apart from the read.
    original = runner_module.sample_rows

    def sample_rows(*args, **kwargs):
        start = time.perf_counter()
        tokens = original(*args, **kwargs)
        if stamps.on:
            stamps.total["sample"] += time.perf_counter() - start
        return _Read(tokens, stamps)

    runner_module.sample_rows = sample_rows
    return original


class _Read:
    """Stands in for the sampled-token tensor so its .tolist() (the device wait) is timed as `read`."""

    def __init__(self, tokens: torch.Tensor, stamps: Stamps) -> None:
        self.tokens, self.stamps = tokens, stamps

    def tolist(self) -> list[int]:
        start = time.perf_counter()
        out = self.tokens.tolist()
        if self.stamps.on:
            self.stamps.total["read"] += time.perf_counter() - start
        return out


def measure(b, batch: int, prompt: int, steps: int, asynchronous: bool = False) -> dict:
    """Phases of synchronous steps; with `asynchronous`, the step time alone (the next step is launched
    before the host reads this one's tokens, so the phases overlap the device and are not stamped)."""
    core = b.core(batch, prompt + steps + 64, asynchronous=asynchronous)
    seqs = b.add(core, batch, prompt, steps + 32, prompt + steps + 64)
    while any(not s.output_ids for s in seqs):
        core.step()
    for _ in range(4):  # graphs captured, caches warm
        core.step()
    if asynchronous:
        sync(b.device)
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        sync(b.device)
        return {"async_step_us": (time.perf_counter() - start) / steps * 1e6}
    stamps = Stamps()
    original = instrument(core, stamps)
    sync(b.device)
    stamps.on = True
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(b.device)
    wall = time.perf_counter() - start
    stamps.on = False
    runner_module.sample_rows = original
    per_step = {p: stamps.total[p] / steps * 1e6 for p in PHASES}
    per_step["emit"] -= per_step["read"]  # `sample` reads the tokens (sampled at launch): its own share
    step_us = wall / steps * 1e6
    # The device waits from the token read's return until the next replay is launched (decode steps).
    idle = sum(per_step[p] for p in ("emit", "update", "schedule", "build", "replay"))
    replays = core.runner.graphs.replays if core.runner.graphs is not None else 0
    return {"batch": batch, "step_us": step_us, "idle_us": idle, "replays": replays, **per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.5-35b-a3b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b = build(args.preset, device, dtype)
    prompt = 512 if device.type == "cuda" else 64
    rows = []
    with torch.inference_mode():
        for batch in (int(x) for x in args.batches.split(",")):
            row = measure(b, batch, prompt, args.steps)
            rows.append(row | measure(b, batch, prompt, args.steps, asynchronous=True))
    cols = ("batch", "step_us", "async_step_us", "idle_us", *PHASES)
    print(" | ".join(f"{c:>9}" for c in cols))
    for row in rows:
        print(" | ".join(f"{row[c]:>9.0f}" if isinstance(row[c], float) else f"{row[c]:>9}" for c in cols))
    if args.out is not None:
        summary = {"preset": args.preset, "device": str(device), "rows": rows}
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
