"""Workloads through `Engine.submit` and its loop thread, as the pipeline and serving clients send requests:
(d) documents, all submitted at once, and (h)-(j), the shapes of vLLM's published H200 runs, each against
vLLM's figure. Tokens count for completed requests only (prompt and output), over the wall time from the
first submit to the last result, as vLLM's benchmark_serving counts them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from engine.bench.device import free, sync
from engine.bench.harness import Bench
from engine.bench.measure import guarded
from engine.bench.settings import Served
from engine.bench.traffic import StepBytes, roofline
from engine.cache import block_bytes, slot_bytes
from engine.engine import Engine
from engine.sampling import SamplingParams

VLLM_SOURCE = "vLLM 0.17.1, Qwen3.5-35B-A3B-FP8 on one H200 (GPUStack performance lab)"
# letter: (the Sizes field of its shape, the metric vLLM published, vLLM's figure)
PEERS: dict[str, tuple[str, str, float]] = {
    "h": ("peer_h", "tokens_per_s", 50_465.0),
    "i": ("peer_i", "tokens_per_s", 56_424.0),
    "j": ("peer_j", "output_tokens_per_s", 8_146.0),
}


def peer_metric(letter: str) -> str:
    """The figure vLLM published for (h)-(j): "total" or "output" tok/s."""
    return "total" if PEERS[letter][1] == "tokens_per_s" else "output"


def documents(b: Bench) -> list[dict[str, Any]]:
    """(d) many requests through Engine.submit and its loop thread, as the pipeline sends them; the cache
    budget is the engine's own (from free memory, as a server's), unless --kv-cache-gib says."""
    s = b.sizes
    shape = Served(s.docs, s.doc_prompt, s.doc_new)
    return [
        guarded(
            f"{s.docs} x {s.doc_prompt}+{s.doc_new}",
            lambda: served(b, shape, b.settings.max_num_seqs, b.settings.serve_kv_cache_bytes),
        )
    ]


def peer(letter: str) -> Callable[[Bench], list[dict[str, Any]]]:
    """(h)-(j): the shape vLLM was measured on, at its concurrency; the engine runs as many sequences as the
    client keeps in flight, or, with all submitted at once, as many as its cache plan affords."""
    field, metric, figure = PEERS[letter]

    def run(b: Bench) -> list[dict[str, Any]]:
        shape: Served = getattr(b.sizes, field)
        label = f"{shape.requests} x {shape.prompt_len}+{shape.new}"
        if shape.concurrency:
            label += f" at {shape.concurrency}"

        def measure() -> dict[str, Any]:
            point = served(b, shape, shape.concurrency, b.settings.serve_kv_cache_bytes)
            point["vllm"] = {"metric": metric, "figure": figure, "source": VLLM_SOURCE}
            point["vs_vllm"] = point[metric] / figure
            point["note"] += f"; {point['vs_vllm']:.2f}x vLLM's {figure:,.0f} {peer_metric(letter)} tok/s"
            return point

        return [guarded(label, measure)]

    run.__doc__ = f"({letter}) vLLM's H200 shape, through Engine.submit"
    return run


def _engine(
    b: Bench, shape: Served, max_num_seqs: int | None, kv_cache_bytes: int | None, **flat: object
) -> Engine:
    """A serving engine for `shape`; it captures its decode graphs when it starts (the default), as a server
    does before its first request."""
    options = b.options(
        max_num_seqs=max_num_seqs,
        max_model_len=shape.prompt_len + shape.new + 8,
        kv_cache_memory=kv_cache_bytes,
        warm_up=b.settings.warm_up,
        **flat,
    )
    return Engine(b.model, b.config, None, b.device, b.dtype, options)


def _warm_up(b: Bench, shape: Served, max_num_seqs: int | None, kv_cache_bytes: int | None) -> None:
    # Untimed first: a few requests on an engine of the same settings, so the prefill chunks of several
    # sequences, mixed prefill + decode steps and decode batches up to the concurrency compile outside the
    # measurement (a server compiles them once, at its first requests).
    warm = _engine(b, shape, max_num_seqs, kv_cache_bytes, graph_capture_len=0)
    per_step = max(1, b.settings.max_num_batched_tokens // shape.prompt_len)
    count = min(shape.requests, max(2 * per_step + 4, shape.concurrency or 0))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        for future in [warm.submit(p, params) for p in b.prompts(count, shape.prompt_len)]:
            future.result()
    finally:
        warm.close()
    del warm
    free(b.device)


def submit_all(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int | None, deadline: float
) -> list[Future]:
    """Submit every prompt, with at most `concurrency` in flight (the next as soon as one finishes, like
    benchmark_serving's --max-concurrency), or all at once; stop submitting at the deadline."""
    if concurrency is None:
        return [engine.submit(p, params) for p in prompts]
    room = threading.Semaphore(concurrency)
    futures: list[Future] = []
    for prompt in prompts:
        if not room.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            break
        future = engine.submit(prompt, params)
        future.add_done_callback(lambda _: room.release())  # in the engine's loop thread, or here if done
        futures.append(future)
    return futures


def served(b: Bench, shape: Served, max_num_seqs: int | None, kv_cache_bytes: int | None) -> dict[str, Any]:
    """Run `shape` through a fresh engine: total and output tok/s over the wall time, with the engine's
    counters and a roofline estimate."""
    n, prompt_len, new = shape.requests, shape.prompt_len, shape.new
    _warm_up(b, shape, max_num_seqs, kv_cache_bytes)
    started = time.perf_counter()
    engine = _engine(b, shape, max_num_seqs, kv_cache_bytes)
    start_s = time.perf_counter() - started
    deadline = b.deadline()
    try:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        prompts = b.prompts(n, prompt_len)
        sync(b.device)
        start = time.perf_counter()
        futures = submit_all(engine, prompts, params, shape.concurrency, deadline)
        finished, pending = wait(futures, timeout=max(0.0, deadline - time.perf_counter()))
        engine.close()  # with requests pending (time cap), they fail after the step in progress
        sync(b.device)
        wall = time.perf_counter() - start
        stats = engine.stats()
    finally:
        engine.close()
    outputs = [f.result() for f in finished if f.exception() is None]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    point = {
        "requests": n,
        "submitted": len(futures),
        "completed": len(outputs),
        "prompt_len": prompt_len,
        "max_tokens": new,
        "concurrency": shape.concurrency,
        "max_num_seqs": engine.max_num_seqs,
        "kv_cache_bytes": engine.plan.budget_bytes,
        "wall_s": wall,
        "steps": stats.steps,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "total_tokens": prompt_tokens + output_tokens,
        "tokens_per_s": (prompt_tokens + output_tokens) / wall,
        "output_tokens_per_s": output_tokens / wall,
        # Computed by the engine, recomputation after preemption and unfinished requests included.
        "computed_prompt_tokens": stats.prompt_tokens,
        "computed_output_tokens": stats.generated_tokens,
        "preemptions": stats.num_preemptions,
        "capped": bool(pending) or len(futures) < n,
        "engine_start_s": start_s,  # building the engine, its graphs captured at start-up included
        "graphs_captured": stats.graphs_captured,
        "graph_capture_s": stats.graph_capture_s,
        "busy_s": stats.steps and (stats.prompt_tokens + stats.generated_tokens) / stats.tokens_per_s,
        # Host time launching graph and eager steps: an eager (mixed) step whose launch takes about its
        # share of the wall time is bound by the host's kernel launches, which piecewise graphs would cut.
        "launch_steps": stats.launch_steps,
        "launch_ms_per_step": {
            kind: 1e3 * stats.launch_s[kind] / count for kind, count in stats.launch_steps.items() if count
        },
    }
    computed = stats.prompt_tokens + stats.generated_tokens
    if stats.steps and computed:
        # Estimate: each step reads the weights its tokens touch; each output token reads its context's KV.
        kv_position = block_bytes(b.config, b.kv_dtype, 1, 0)
        bytes_ = StepBytes(
            weights=stats.steps * b.counts.active_bytes(computed / stats.steps, b.dtype.itemsize),
            kv=(stats.generated_tokens * (prompt_len + new / 2) + stats.prompt_tokens) * kv_position,
            state=(stats.generated_tokens + n) * 2 * slot_bytes(b.config, b.dtype, b.state_dtype),
        )
        point |= roofline(bytes_, computed, computed / wall, b.bandwidth)
    point["note"] = (
        f"output {point['output_tokens_per_s']:,.0f} tok/s; {point['completed']}/{n} done in {wall:.1f} s "
        f"({point['busy_s']:.1f} s in steps; {stats.graphs_captured} graphs, {stats.graph_capture_s:.1f} s "
        f"capturing, {start_s:.1f} s engine start)"
    )
    launch = point["launch_ms_per_step"]
    if launch:
        point["note"] += "; launch " + ", ".join(
            f"{stats.launch_steps[kind]} {kind} steps {ms:.1f} ms" for kind, ms in launch.items()
        )
    return point
