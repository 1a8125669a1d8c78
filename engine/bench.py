"""GPU benchmark: the engine against the memory roofline, the matrix rate and transformers (issue 5).

    python -m engine.bench [--preset qwen3.5-35b-a3b | --preset tiny | --model PATH]
        [--workloads a,b,c,d,e,f,g] [--quick] [--max-seconds S] [--device cuda] [--dtype bfloat16]
        [--kv-cache-gib G] [--json PATH]
    enclave bench ...   (the same arguments)

A preset builds the model with seeded random weights directly on the device (no checkpoint, no tokenizer:
prompts are random token ids). The same run measures the device's copy bandwidth (the roofline) and its
matrix rate, then each workload's tokens/s, the bytes a token must move (weights, KV, DeltaNet state)
and the percentage of the roofline that is:

    (a) single stream: one 512-token prompt, 256 new tokens
    (b) batch decode at 16, 64 and 256 sequences (decode steps only, after every prefill)
    (c) prefill of 8 x 4096 tokens, also as % of the measured matrix rate
    (d) documents: 512 requests of 2048 prompt + 256 new tokens through Engine.submit
    (e) long context: a 131,072-token prompt, its prefill and the decode rate at that context
    (f) MTP verify step with k = 1, 2, 3 against a plain decode step at batch 1 (time ratio)
    (g) transformers' Qwen3_5MoeForCausalLM, same geometry and random weights, for (a) and (b, 64)

Workloads (a)-(c), (e) and (f) drive an `EngineCore` directly, so each step is timed on its own (the
first decode steps of each run are left untimed: compiles, graph captures); (d) goes through the engine's
loop thread as the pipeline does; (g) runs after our model is freed. `--quick` shrinks every workload.
Each measurement (each batch size of (b), each k of (f)) stops at `--max-seconds` and reports what it
measured so far; one that fails (out of memory, say) is recorded as its error and the run goes on.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib.metadata
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.cache import ModelCache, block_bytes, slot_bytes
from engine.config import ModelConfig, config_from_dict
from engine.core import EngineCore, StepFailed
from engine.demo_model import demo_config
from engine.engine import Engine
from engine.errors import EngineError
from engine.kernels import SeqLayout
from engine.model.model import CausalLM
from engine.model.moe import SparseMoe
from engine.planner import plan_cache
from engine.runner import Drafter
from engine.sampling import SamplingParams
from engine.sequence import Sequence

log = logging.getLogger(__name__)

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "bench.json"
WORKLOADS = "abcdefg"
BLOCK_SIZE = 16
WARMUP_STEPS = 3  # decode steps run but not timed: first-use allocations, kernel compiles, graph captures
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 1 << 30

# Qwen3.5-35B-A3B's text model (and Qwen3.6-35B-A3B's, the same geometry), as a config.json would say.
QWEN35_35B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "mtp_num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "attention_bias": False,
}
PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "qwen3.5-35b-a3b": lambda: copy.deepcopy(QWEN35_35B_A3B),
    "tiny": lambda: demo_config(1024),  # the demo model's geometry
}


@dataclass(frozen=True)
class Sizes:
    """How big each workload is; `QUICK` shrinks them so a full run takes minutes on the reference path."""

    single_prompt: int = 512
    single_new: int = 256
    batches: tuple[int, ...] = (16, 64, 256)
    batch_prompt: int = 512
    batch_steps: int = 64
    prefill_seqs: int = 8
    prefill_len: int = 4096
    docs: int = 512
    doc_prompt: int = 2048
    doc_new: int = 256
    long_prompt: int = 131072
    long_steps: int = 16
    verify_prompt: int = 512
    verify_steps: int = 32


QUICK = Sizes(
    single_prompt=128,
    single_new=32,
    batch_prompt=64,
    batch_steps=8,
    prefill_seqs=2,
    prefill_len=1024,
    docs=32,
    doc_prompt=512,
    doc_new=32,
    long_prompt=16384,
    long_steps=4,
    verify_prompt=64,
    verify_steps=8,
)


@dataclass(frozen=True)
class Settings:
    """Serving settings shared by the workloads."""

    max_seconds: float
    kv_cache_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int  # of workload (d)
    seed: int


# ---- random weights


ROUTER_LOGIT_STD = 0.2  # small router logits: a near-uniform softmax, so top-k spreads over all experts
CONV_STD = 0.5


@torch.no_grad()
def init_parameter_(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    """Fill one parameter in place with seeded values that keep activations O(1) through the layers.

    Works on our parameter names and transformers' (`linear_attn.norm.weight`, `experts.gate_up_proj`).
    """
    if name.endswith("A_log"):
        p.uniform_(1.0, 16.0, generator=g).log_()  # decay rates exp(A_log) in [1, 16]
    elif name.endswith("dt_bias"):
        p.fill_(1.0)
    elif name.endswith(("linear_attn.norm_weight", "linear_attn.norm.weight")):
        p.fill_(1.0)  # the gated RMSNorm multiplies by its weight directly
    elif p.ndim == 1:
        p.zero_()  # zero-centred RMSNorms: x * (1 + w)
    elif "conv1d" in name:
        p.normal_(0.0, CONV_STD, generator=g)
    elif name.endswith("mlp.gate.weight"):
        # Equal-norm rows: no expert is favoured, and a logit's spread is the row norm (normed inputs).
        p.normal_(0.0, 1.0, generator=g)
        p.mul_((ROUTER_LOGIT_STD / p.float().norm(dim=-1, keepdim=True)).to(p.dtype))
    elif "embed_tokens" in name:
        p.normal_(0.0, 1.0, generator=g)
    else:
        p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)  # fan-in scaling


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int) -> CausalLM:
    """The model with seeded random weights, created directly on `device` (no CPU copy, nothing left
    uninitialised): built on the meta device, cast there, then materialised and filled in place."""
    with torch.device("meta"):
        model = CausalLM(config, num_mtp_layers=config.mtp_num_hidden_layers)
    model.to(dtype)  # still meta: costs nothing, and never allocates an fp32 copy
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        init_parameter_(name, p, g)
    model.reset_buffers()
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def expert_load(model: CausalLM, seqs: int = 4, tokens_per_seq: int = 128, seed: int = 0) -> dict[str, Any]:
    """How evenly the router spreads one prefill batch of random tokens over the experts (see `_spread`),
    beside the same numbers for routing drawn uniformly at random."""
    config = model.config
    gates = [layer.mlp.gate for layer in model.model.layers if isinstance(layer.mlp, SparseMoe)]
    if not gates:
        return {}
    e, k = config.num_experts, config.num_experts_per_tok
    counts: list[torch.Tensor] = []

    def hook(module, inputs, logits: torch.Tensor) -> None:  # logits [T, E]
        counts.append(torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=e).cpu())

    device = model.inv_freq.device
    per_seq = -(-tokens_per_seq // BLOCK_SIZE)
    cache = ModelCache(
        config, seqs, seqs * per_seq, BLOCK_SIZE, device, model.model.embed_tokens.weight.dtype
    )
    layout = SeqLayout(
        (tokens_per_seq,) * seqs,
        (0,) * seqs,
        tuple(range(seqs)),
        tuple(tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)),
        BLOCK_SIZE,
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (seqs * tokens_per_seq,), generator=g).to(device)
    handles = [gate.register_forward_hook(hook) for gate in gates]
    try:
        model(ids, layout, cache)
    finally:
        for handle in handles:
            handle.remove()
    loads = torch.stack(counts).float()  # [layers, E]
    # The same statistic for routing picked uniformly at random, to compare against.
    ideal = torch.rand(len(gates), seqs * tokens_per_seq, e, generator=g).topk(k, dim=-1).indices
    ideal = torch.stack([torch.bincount(layer.flatten(), minlength=e) for layer in ideal]).float()
    return {
        "tokens": seqs * tokens_per_seq,
        "experts": e,
        "top_k": k,
        "layers": len(gates),
        **_spread(loads),
        "uniform_random": _spread(ideal),
    }


def _spread(loads: torch.Tensor) -> dict[str, float]:
    """loads [layers, E] tokens per expert: max/mean and min/mean (mean over layers), the worst layer's
    max/mean, and the fraction of (layer, expert) pairs without a token."""
    mean = loads.mean(-1)
    ratio = loads.max(-1).values / mean
    return {
        "max_over_mean": float(ratio.mean()),
        "worst_layer_max_over_mean": float(ratio.max()),
        "min_over_mean": float((loads.min(-1).values / mean).mean()),
        "unused_fraction": float((loads == 0).float().mean()),
    }


# ---- bytes a step must move


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the main model by role (the MTP head apart), from which bytes per step follow."""

    total: int  # every parameter, MTP head included
    embedding: int  # the table; a step reads one row (`hidden` values) per token
    lm_head: int  # read whole by every step that computes logits (the embedding table if tied)
    dense: int  # everything else outside the routed experts: projections, router, shared expert, norms
    expert: int  # one routed expert of one layer
    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    mtp: int

    def active(self, tokens: float) -> float:
        """Parameters a step over `tokens` tokens must read: dense, lm_head, one embedding row per token,
        and in each MoE layer the experts its tokens touch."""
        touched = expected_experts(tokens, self.num_experts, self.top_k)
        return self.dense + self.lm_head + tokens * self.hidden + self.moe_layers * touched * self.expert

    def matmul_params(self) -> float:
        """Parameters each token multiplies (embedding lookup and lm_head excluded), for FLOPs."""
        return self.dense + self.moe_layers * self.top_k * self.expert


def expected_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Distinct experts `tokens` tokens touch if each picks `top_k` of `num_experts` evenly at random:
    exactly `top_k` for one token, at most min(num_experts, tokens * top_k)."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def param_counts(config: ModelConfig) -> ParamCounts:
    """Count the parameters of `config`'s model, built on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = CausalLM(config, num_mtp_layers=config.mtp_num_hidden_layers)
    embedding = lm_head = dense = experts = mtp = moe_layers = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("mtp."):
            mtp += n
        elif name == "model.embed_tokens.weight":
            embedding += n
        elif name == "lm_head.weight":
            lm_head += n
        elif name.endswith((".mlp.w13", ".mlp.w2")):
            experts += n
            moe_layers += name.endswith(".w13")
        else:
            dense += n
    if config.tie_word_embeddings:
        lm_head = embedding
    num_experts = config.num_experts if moe_layers else 0
    return ParamCounts(
        total=sum(p.numel() for p in model.parameters()),
        embedding=embedding,
        lm_head=lm_head,
        dense=dense,
        expert=experts // (moe_layers * num_experts) if moe_layers else 0,
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=config.num_experts_per_tok,
        hidden=config.hidden_size,
        mtp=mtp,
    )


@dataclass(frozen=True)
class StepBytes:
    """Bytes moved through device memory: weights, KV cache and DeltaNet state, reads and writes."""

    weights: float
    kv: float
    state: float

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.state

    def per_token(self, tokens: float) -> dict[str, float]:
        return {
            "weights": self.weights / tokens,
            "kv": self.kv / tokens,
            "state": self.state / tokens,
            "total": self.total / tokens,
        }


def step_bytes(
    counts: ParamCounts,
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    seqs: int,
    tokens_per_seq: int = 1,
    context: float = 0.0,
    state_writes: int = 1,
) -> StepBytes:
    """One step of `seqs` sequences, each adding `tokens_per_seq` tokens after `context` cached positions:
    the weights those tokens touch, the KV of every position attended (read) or added (written), and each
    sequence's DeltaNet state read once and written `state_writes` times (k+1 for an MTP verify step)."""
    tokens = seqs * tokens_per_seq
    kv_per_position = block_bytes(config, dtype, 1, 0)
    return StepBytes(
        weights=counts.active(tokens) * dtype.itemsize,
        kv=seqs * (context + tokens_per_seq) * kv_per_position,
        state=seqs * (1 + state_writes) * slot_bytes(config, dtype),
    )


def prefill_bytes(
    counts: ParamCounts, config: ModelConfig, dtype: torch.dtype, *, seqs: int, prompt_len: int, chunk: int
) -> StepBytes:
    """All of a prefill of `seqs` prompts in steps of at most `chunk` tokens (an estimate: each step reads
    the weights its tokens touch once; chunk j of a prompt reads the j * chunk positions before it)."""
    tokens = seqs * prompt_len
    steps = -(-tokens // chunk)
    chunks = -(-prompt_len // chunk)
    per_chunk = min(prompt_len, chunk)
    positions = seqs * (prompt_len + per_chunk * chunks * (chunks - 1) / 2)
    return StepBytes(
        weights=steps * counts.active(tokens / steps) * dtype.itemsize,
        kv=positions * block_bytes(config, dtype, 1, 0),
        state=seqs * chunks * 2 * slot_bytes(config, dtype),
    )


def roofline(
    bytes_: StepBytes, tokens: float, tokens_per_s: float | None, bandwidth: float
) -> dict[str, Any]:
    """Bytes per token, the tokens/s the measured bandwidth allows, and the share of it reached."""
    per_token = bytes_.per_token(tokens)
    bound = bandwidth / per_token["total"]
    return {
        "bytes_per_token": per_token,
        "roofline_tokens_per_s": bound,
        "pct_of_roofline": 100.0 * tokens_per_s / bound if tokens_per_s else None,
    }


# ---- the device's own numbers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_time(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds `fn` takes, host work included, with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def device_time(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds the device spends on the work `fn` queues: CUDA events around it on CUDA, the wall clock
    elsewhere (for kernels launched back to back, not for host-bound loops)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """Device-to-device copy of `nbytes`, best of `repeats`; bytes moved = read + written = 2 * nbytes."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best = min(device_time(lambda: dst.copy_(src), device) for _ in range(repeats))
    return {"bytes_per_s": 2 * nbytes / best, "copy_bytes": nbytes, "best_s": best, "repeats": repeats}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> dict[str, Any]:
    """n x n x n GEMMs in `dtype`, best of `repeats`: FLOP/s = 2 n^3 / time."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.matmul(a, b)
    best = min(device_time(lambda: torch.matmul(a, b, out=out), device) for _ in range(repeats))
    return {"flop_per_s": 2 * n**3 / best, "n": n, "dtype": str(dtype), "best_s": best, "repeats": repeats}


# ---- driving the engine core step by step


@dataclass
class Bench:
    """What every workload needs: the model, the run's sizes and settings, the device measurements."""

    model: CausalLM | None  # None once freed for (g)
    config: ModelConfig
    counts: ParamCounts
    device: torch.device
    dtype: torch.dtype
    sizes: Sizes
    settings: Settings
    bandwidth: float  # bytes/s
    matmul: float  # FLOP/s

    def core(self, max_num_seqs: int, max_len: int, k: int = 0, drafter: Drafter | None = None) -> EngineCore:
        """A fresh engine core whose pools fit `max_num_seqs` sequences of `max_len` positions (at most the
        cache budget); with `k` drafts per step from `drafter`, or from the MTP head when it is None."""
        # The core gives the MTP head its KV cache whenever k > 0, even when a drafter stands in for it.
        num_mtp = len(self.model.mtp.layers) if self.model.mtp is not None and k else 0
        plan = plan_cache(
            self.config,
            self.dtype,
            self.settings.kv_cache_bytes,
            max_num_seqs=max_num_seqs,
            max_model_len=max_len,
            num_speculative_tokens=k,
            num_mtp_layers=num_mtp,
            block_size=BLOCK_SIZE,
            max_prefixes=0,
        )
        return EngineCore(
            self.model,
            plan,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.settings.max_num_batched_tokens,
            num_speculative_tokens=k,
            max_prefixes=0,
            drafter=drafter,
        )

    def prompts(self, n: int, length: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.settings.seed)
        return torch.randint(0, self.config.vocab_size, (n, length), generator=g).tolist()

    def add(self, core: EngineCore, n: int, prompt_len: int, max_tokens: int, max_len: int) -> list[Sequence]:
        """Queue `n` greedy requests of random tokens that ignore EOS."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seqs = [
            Sequence(i, ids, params, None, set(), None, max_len, self.device)
            for i, ids in enumerate(self.prompts(n, prompt_len))
        ]
        for seq in seqs:
            core.add(seq)
        return seqs

    def deadline(self) -> float:
        return time.perf_counter() + self.settings.max_seconds

    def step(self, core: EngineCore) -> float:
        """Run one step; seconds it took, the device synchronised on both sides."""
        return wall_time(core.step, self.device)

    def prefill(self, core: EngineCore, seqs: list[Sequence], deadline: float) -> tuple[float, int, bool]:
        """Step until every sequence has its first token: (seconds, steps, whether it got there)."""
        spent, steps = 0.0, 0
        while any(not s.output_ids for s in seqs):
            if time.perf_counter() > deadline:
                return spent, steps, False
            spent += self.step(core)
            steps += 1
        return spent, steps, True

    def decode(self, core: EngineCore, seqs: list[Sequence], steps: int, deadline: float) -> dict[str, Any]:
        """WARMUP_STEPS untimed decode steps, then up to `steps` timed ones."""
        times: list[float] = []
        contexts: list[float] = []
        tokens = batch = warmup = 0
        for i in range(WARMUP_STEPS + steps):
            live = [s for s in seqs if not s.finished]
            if not live or time.perf_counter() > deadline:
                break
            context = statistics.fmean(s.num_computed for s in live)
            before = core.generated_tokens
            seconds = self.step(core)
            warmup += i < WARMUP_STEPS
            if i >= WARMUP_STEPS:
                times.append(seconds)
                contexts.append(context)
                tokens += core.generated_tokens - before
                batch = max(batch, len(live))
        spent = sum(times)
        return {
            "decode_steps": len(times),
            "warmup_steps": warmup,
            "decode_s": spent,
            "ms_per_step": 1e3 * statistics.median(times) if times else None,
            "tokens_per_s": tokens / spent if spent else None,
            "decode_tokens": tokens,
            "batch": batch,
            "mean_context": statistics.fmean(contexts) if contexts else None,
            "capped": len(times) < steps,
        }

    def warm_up(self, prompt_len: int) -> None:
        """One untimed request (a prefill chunk and a few decode steps): compiles and first-use costs."""
        length = min(prompt_len, self.settings.max_num_batched_tokens)
        core = self.core(1, length + 16)
        self.add(core, 1, length, 4, length + 16)
        while core.has_work():
            core.step()


def decode_point(b: Bench, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
    """`batch` sequences prefilled, then timed decode steps with all of them running."""
    deadline = b.deadline()
    # Sequences prefilled early decode while later ones prefill: leave them room to keep the batch full.
    room = -(-batch * prompt_len // b.settings.max_num_batched_tokens) + 1
    max_tokens = 1 + room + WARMUP_STEPS + steps
    max_len = prompt_len + max_tokens + 8
    core = b.core(batch, max_len)
    seqs = b.add(core, batch, prompt_len, max_tokens, max_len)
    prefill_s, prefill_steps, done = b.prefill(core, seqs, deadline)
    point: dict[str, Any] = {
        "batch": batch,
        "prompt_len": prompt_len,
        "prefill_s": prefill_s,
        "prefill_steps": prefill_steps,
        "prefill_tokens_per_s": core.prompt_tokens / prefill_s if prefill_s else None,
    }
    if not done:
        return point | {"capped": True, "note": f"time cap reached during prefill ({prefill_s:.1f} s)"}
    run = b.decode(core, seqs, steps, deadline)
    point |= run
    if run["decode_steps"]:
        bytes_ = step_bytes(b.counts, b.config, b.dtype, seqs=run["batch"], context=run["mean_context"])
        point |= roofline(bytes_, run["batch"], run["tokens_per_s"], b.bandwidth)
    return point


# ---- the workloads


def single_stream(b: Bench) -> list[dict[str, Any]]:
    """(a) one prompt; decode tok/s over the timed steps, and the whole request end to end."""
    s = b.sizes

    def measure() -> dict[str, Any]:
        b.warm_up(s.single_prompt)
        point = decode_point(b, 1, s.single_prompt, max(1, s.single_new - 1 - WARMUP_STEPS))
        if point.get("decode_steps"):
            # WARMUP_STEPS decode steps ran untimed; count them at the timed steps' rate.
            total_s = point["prefill_s"] + point["decode_s"] * (1 + WARMUP_STEPS / point["decode_steps"])
            point["end_to_end_tokens_per_s"] = s.single_new / total_s
            point["note"] = (
                f"{point['ms_per_step']:.1f} ms/step; prefill {s.single_prompt} in "
                f"{point['prefill_s']:.2f} s; {s.single_new} tokens end to end "
                f"{point['end_to_end_tokens_per_s']:.1f} tok/s"
            )
        return point

    return [guarded(f"1 x {s.single_prompt}+{s.single_new}", measure)]


def batch_decode(b: Bench) -> list[dict[str, Any]]:
    """(b) decode at each batch size: time after prefill only."""
    s = b.sizes

    def measure(batch: int) -> dict[str, Any]:
        point = decode_point(b, batch, s.batch_prompt, s.batch_steps)
        if point.get("decode_steps"):
            point["note"] = f"{point['ms_per_step']:.1f} ms/step at context {point['mean_context']:.0f}"
        return point

    return [guarded(f"batch {n}", lambda n=n: measure(n)) for n in s.batches]


def prefill(b: Bench) -> list[dict[str, Any]]:
    """(c) prompts only (one token each); tokens/s, and FLOP/s as % of the matrix rate."""
    s = b.sizes
    n, length = s.prefill_seqs, s.prefill_len

    def measure() -> dict[str, Any]:
        b.warm_up(length)
        deadline = b.deadline()
        core = b.core(n, length + 8)
        seqs = b.add(core, n, length, 1, length + 8)
        spent, steps, done = b.prefill(core, seqs, deadline)
        tokens = core.prompt_tokens
        tokens_per_s = tokens / spent if spent else None
        # 2 FLOPs per multiply-add: every token through the dense and top-k expert weights, lm_head once per
        # prompt (attention's quadratic term and the delta rule are left out: a lower bound on the work).
        flops = 2 * tokens * b.counts.matmul_params() + 2 * n * b.counts.lm_head
        point = {
            "seqs": n,
            "prompt_len": length,
            "prefill_s": spent,
            "steps": steps,
            "prompt_tokens": tokens,
            "tokens_per_s": tokens_per_s,
            "flops": flops,
            "flop_per_s": flops / spent if spent else None,
            "pct_of_matmul_rate": 100.0 * flops / spent / b.matmul if spent else None,
            "capped": not done,
        }
        bytes_ = prefill_bytes(
            b.counts, b.config, b.dtype, seqs=n, prompt_len=length, chunk=b.settings.max_num_batched_tokens
        )
        point |= roofline(bytes_, n * length, tokens_per_s, b.bandwidth)
        if spent:
            point["note"] = f"{point['pct_of_matmul_rate']:.1f}% of the matrix rate; {spent:.2f} s"
        return point

    return [guarded(f"{n} x {length}", measure)]


def documents(b: Bench) -> list[dict[str, Any]]:
    """(d) many requests through Engine.submit and its loop thread, as the pipeline sends them."""
    s = b.sizes
    return [
        guarded(
            f"{s.docs} x {s.doc_prompt}+{s.doc_new}", lambda: _documents(b, s.docs, s.doc_prompt, s.doc_new)
        )
    ]


def _documents(b: Bench, n: int, prompt_len: int, new: int) -> dict[str, Any]:
    deadline = b.deadline()
    engine = Engine(
        b.model,
        b.config,
        None,
        b.device,
        b.dtype,
        max_num_seqs=b.settings.max_num_seqs,
        max_num_batched_tokens=b.settings.max_num_batched_tokens,
        max_model_len=prompt_len + new + 8,
        kv_cache_memory=b.settings.kv_cache_bytes,
        max_prefixes=0,
    )
    try:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        prompts = b.prompts(n, prompt_len)
        sync(b.device)
        start = time.perf_counter()
        futures = [engine.submit(p, params) for p in prompts]
        finished, pending = wait(futures, timeout=max(0.0, deadline - time.perf_counter()))
        engine.close()  # with requests pending (time cap), they fail after the step in progress
        sync(b.device)
        wall = time.perf_counter() - start
        stats = engine.stats()
    finally:
        engine.close()
    total = stats.prompt_tokens + stats.generated_tokens
    point = {
        "requests": n,
        "completed": sum(1 for f in finished if f.exception() is None),
        "prompt_len": prompt_len,
        "max_tokens": new,
        "max_num_seqs": b.settings.max_num_seqs,
        "wall_s": wall,
        "steps": stats.steps,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "tokens_per_s": total / wall,
        "output_tokens_per_s": stats.generated_tokens / wall,
        "preemptions": stats.num_preemptions,
        "capped": bool(pending),
    }
    if stats.steps and total:
        # Estimate: each step reads the weights its tokens touch; each output token reads its context's KV.
        kv_position = block_bytes(b.config, b.dtype, 1, 0)
        bytes_ = StepBytes(
            weights=stats.steps * b.counts.active(total / stats.steps) * b.dtype.itemsize,
            kv=(stats.generated_tokens * (prompt_len + new / 2) + stats.prompt_tokens) * kv_position,
            state=(stats.generated_tokens + n) * 2 * slot_bytes(b.config, b.dtype),
        )
        point |= roofline(bytes_, total, point["tokens_per_s"], b.bandwidth)
    point["note"] = (
        f"output {point['output_tokens_per_s']:,.0f} tok/s; {point['completed']}/{n} done in {wall:.1f} s"
    )
    return point


def long_context(b: Bench) -> list[dict[str, Any]]:
    """(e) one very long prompt: chunked prefill, then decode steps at that context."""
    s = b.sizes
    length = min(s.long_prompt, b.config.max_model_len - s.long_steps - WARMUP_STEPS - 16)
    max_len = length + s.long_steps + WARMUP_STEPS + 16
    state: dict[str, Any] = {}

    def measure_prefill() -> dict[str, Any]:
        b.warm_up(length)
        deadline = b.deadline()
        core = b.core(1, max_len)
        seqs = b.add(core, 1, length, s.long_steps + WARMUP_STEPS + 1, max_len)
        spent, steps, done = b.prefill(core, seqs, deadline)
        state.update(core=core, seqs=seqs, done=done)
        tokens_per_s = core.prompt_tokens / spent if spent else None
        point = {"prompt_len": length, "prefill_s": spent, "steps": steps, "tokens_per_s": tokens_per_s}
        point["capped"] = not done
        bytes_ = prefill_bytes(
            b.counts, b.config, b.dtype, seqs=1, prompt_len=length, chunk=b.settings.max_num_batched_tokens
        )
        point["note"] = f"prefill {spent:.1f} s" + ("" if done else " (time cap)")
        return point | roofline(bytes_, length, tokens_per_s, b.bandwidth)

    def measure_decode() -> dict[str, Any]:
        if not state.get("done"):
            return {"skipped": "the prefill did not finish"}
        run = b.decode(state["core"], state["seqs"], s.long_steps, b.deadline())
        if run["decode_steps"]:
            bytes_ = step_bytes(b.counts, b.config, b.dtype, seqs=1, context=run["mean_context"])
            run |= roofline(bytes_, 1, run["tokens_per_s"], b.bandwidth)
            run["note"] = f"{run['ms_per_step']:.1f} ms/step"
        return run

    points = [guarded(f"prefill {length}", measure_prefill), guarded(f"decode at {length}", measure_decode)]
    state.clear()
    return points


def repeat_last_drafter(seq: Sequence, count: int) -> list[int]:
    """Drafts without the MTP head, so a step times the verify pass alone."""
    return [seq.token_ids[-1]] * count


def mtp_verify(b: Bench) -> list[dict[str, Any]]:
    """(f) batch-1 step time verifying k drafts (k+1 positions) against a plain decode step."""
    s = b.sizes

    def measure(k: int, drafter: Drafter | None) -> dict[str, Any]:
        deadline = b.deadline()
        max_tokens = (k + 1) * (WARMUP_STEPS + s.verify_steps + 2)
        max_len = s.verify_prompt + max_tokens + 2 * k + 8
        core = b.core(1, max_len, k, drafter)
        seqs = b.add(core, 1, s.verify_prompt, max_tokens, max_len)
        _, _, done = b.prefill(core, seqs, deadline)
        if not done:
            return {"k": k, "capped": True, "note": "time cap reached during prefill"}
        run = b.decode(core, seqs, s.verify_steps, deadline)
        accepted = seqs[0].metrics.accepted_lengths
        run |= {"k": k, "mean_accepted": statistics.fmean(accepted) if accepted else None}
        if run["decode_steps"]:
            bytes_ = step_bytes(
                b.counts,
                b.config,
                b.dtype,
                seqs=1,
                tokens_per_seq=k + 1,
                context=run["mean_context"],
                state_writes=k + 1,
            )
            run["step_bytes"] = bytes_.total
            tokens_per_step = run["decode_tokens"] / run["decode_steps"]
            run |= roofline(bytes_, tokens_per_step, run["tokens_per_s"], b.bandwidth)
        return run

    plain = guarded("plain decode step", lambda: measure(0, None))
    points = [plain]
    for k in (1, 2, 3):
        points.append(guarded(f"verify k={k}", lambda k=k: measure(k, repeat_last_drafter)))
        if b.model.mtp is not None:
            points.append(guarded(f"MTP step k={k}", lambda k=k: measure(k, None)))
    base_ms, base_bytes = plain.get("ms_per_step"), plain.get("step_bytes")
    for point in points:
        if point is plain or not point.get("ms_per_step") or not base_ms:
            continue
        point["ratio_vs_plain"] = point["ms_per_step"] / base_ms
        point["roofline_ratio"] = point["step_bytes"] / base_bytes
        point["note"] = (
            f"{point['ratio_vs_plain']:.2f}x a plain step ({point['ms_per_step']:.1f} vs {base_ms:.1f} ms); "
            f"bytes {point['roofline_ratio']:.2f}x"
        )
    if base_ms:
        plain["note"] = f"{base_ms:.1f} ms/step"
    return points


# ---- (g) transformers on the same geometry


def transformers_comparison(
    b: Bench, raw: dict[str, Any], ours: dict[str, Any]
) -> list[dict[str, Any]] | dict:
    """(g) Qwen3_5MoeForCausalLM with the same geometry and random weights through `generate`, for (a) and
    (b, 64), and our decode tok/s over theirs. Run after our model was freed (`b.model` is None)."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed"}
    if b.config.model_type == "qwen3_next":
        return {"skipped": "the transformers comparison is built for qwen3_5_moe geometries"}
    try:
        model = _transformers_model(raw, b.device, b.dtype, b.settings.seed)
    except Exception as exc:  # out of memory, or a transformers version without the class
        log.warning("building the transformers model failed", exc_info=True)
        return {"error": describe(exc), "transformers": transformers.__version__}
    points = _transformers_points(b, model)
    del model
    free(b.device)
    mine = [_point_rate(ours.get("a"), "1 x"), _point_rate(ours.get("b"), "batch 64")]
    for point, our_rate in zip(points, mine, strict=True):
        point["transformers"] = transformers.__version__
        rate = point.get("tokens_per_s")
        if rate:
            bytes_ = step_bytes(
                b.counts, b.config, b.dtype, seqs=point["batch"], context=point["mean_context"]
            )
            point |= roofline(bytes_, point["batch"], rate, b.bandwidth)
            point["ours_over_transformers"] = our_rate / rate if our_rate else None
            ratio = f"; ours/transformers {point['ours_over_transformers']:.2f}x" if our_rate else ""
            point["note"] = f"{point['ms_per_step']:.1f} ms/step{ratio}"
    return points


def _transformers_points(b: Bench, model) -> list[dict[str, Any]]:
    s = b.sizes
    implementation = {
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    single = guarded("a: single stream", lambda: _hf_point(b, model, 1, s.single_prompt, s.single_new))
    batch = guarded("b: batch 64", lambda: _hf_point(b, model, 64, s.batch_prompt, s.batch_steps + 1))
    return [single | implementation, batch | implementation]


def _transformers_model(raw: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    skip = ("model_type", "architectures", "dtype", "torch_dtype", "mtp_num_hidden_layers", "eos_token_id")
    hf_config = Qwen3_5MoeTextConfig(**{k: v for k, v in raw.items() if k not in skip})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        init_parameter_(name, p, g)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def _hf_point(b: Bench, model, batch: int, prompt_len: int, new: int) -> dict[str, Any]:
    """Decode tok/s from two greedy `generate` calls: one new token (the prefill) and `new` tokens."""
    device = b.device
    g = torch.Generator().manual_seed(b.settings.seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def generate(count: int, max_time: float | None = None) -> torch.Tensor:
        kwargs = {"max_time": max_time} if max_time else {}
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=count, do_sample=False, pad_token_id=0, **kwargs
        )

    generate(2)  # warm-up
    first = wall_time(lambda: generate(1), device)
    out: list[torch.Tensor] = []
    total = wall_time(lambda: out.append(generate(new, max_time=b.settings.max_seconds)), device)
    made = out[0].shape[1] - prompt_len
    decode_s = total - first
    tokens_per_s = batch * (made - 1) / decode_s if made > 1 and decode_s > 0 else None
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": made,
        "prefill_s": first,
        "decode_s": decode_s,
        "tokens_per_s": tokens_per_s,
        "ms_per_step": 1e3 * decode_s / (made - 1) if made > 1 else None,
        "mean_context": prompt_len + made / 2,
        "capped": made < new,
    }


def _point_rate(points: list[dict[str, Any]] | None, label: str) -> float | None:
    for point in points or []:
        if point.get("label", "").startswith(label):
            return point.get("tokens_per_s")
    return None


# ---- running and reporting


def describe(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, StepFailed) else exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"[:300]


def guarded(label: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one measurement; a failure (often out of memory on the reference path) becomes its result."""
    say(f"  {label} ...")
    try:
        point = measure()
    except Exception as exc:
        log.warning("benchmark point %r failed", label, exc_info=True)
        point = {"error": describe(exc)}
    say(f"    {point.get('error') or point.get('note') or point.get('skipped') or 'done'}")
    gc.collect()
    torch.cuda.empty_cache()  # a no-op unless CUDA was used
    return {"label": label, **point}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


RUNNERS: dict[str, tuple[str, Callable[[Bench], list[dict[str, Any]]]]] = {
    "a": ("single stream", single_stream),
    "b": ("batch decode", batch_decode),
    "c": ("prefill", prefill),
    "d": ("documents", documents),
    "e": ("long context", long_context),
    "f": ("MTP verify vs plain step", mtp_verify),
}


def load(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[CausalLM, ModelConfig, dict]:
    """The model to measure: a preset with random weights, or the checkpoint at --model."""
    if args.model:
        # A small cache only: the workloads plan their own. The engine is dropped, the model kept.
        engine = Engine.from_pretrained(
            args.model, device=device, dtype=dtype, max_num_seqs=1, max_prefixes=0, kv_cache_memory=GIB
        )
        model, config = engine.model, engine.config
        engine.close()
        return model.requires_grad_(False), config, dict(config.extra.get("raw") or {})
    raw = PRESETS[args.preset]()
    config = config_from_dict(raw, source=f"preset {args.preset}")
    check_room(param_counts(config), device, dtype)
    return random_model(config, device, dtype, args.seed), config, raw


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
    settings = Settings(
        max_seconds=args.max_seconds,
        kv_cache_bytes=int((args.kv_cache_gib or (40 if device.type == "cuda" else 1)) * GIB),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
    )
    bandwidth, matmul = measure_device(device, dtype, args.quick)
    say(f"building {args.model or args.preset} on {device} as {dtype}")
    start = time.perf_counter()
    model, config, raw = load(args, device, dtype)
    built_s = time.perf_counter() - start
    counts = param_counts(config)
    try:
        spread = expert_load(model, seed=args.seed)
    except Exception as exc:  # a kernel failing here should not cost the rest of the run
        log.warning("measuring the expert load failed", exc_info=True)
        spread = {"error": describe(exc)}
    say(f"  built in {built_s:.1f} s; expert load {_load_text(spread)}")
    bench = Bench(
        model, config, counts, device, dtype, sizes, settings, bandwidth["bytes_per_s"], matmul["flop_per_s"]
    )
    results: dict[str, Any] = {}
    for letter in args.workloads:
        if letter in RUNNERS:
            title, runner = RUNNERS[letter]
            say(f"({letter}) {title}")
            results[letter] = runner(bench)
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
        "geometry": _geometry(config),
        "params": _params(counts),
        "build_s": built_s,
        "quick": args.quick,
        "sizes": asdict(sizes),
        "settings": asdict(settings),
        "block_size": BLOCK_SIZE,
        "warmup_decode_steps": WARMUP_STEPS,
        "kernels": os.environ.get("ENCLAVE_KERNELS", "auto"),
        "sampling": "greedy, ignore_eos, random prompt token ids",
    }
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _machine(device),
        "device": str(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "commit": _commit(),
        "configuration": configuration,
        "bandwidth": bandwidth,
        "matmul": matmul,
        "expert_load": spread,
        "workloads": results,
    }


def measure_device(device: torch.device, dtype: torch.dtype, quick: bool) -> tuple[dict, dict]:
    """The roofline's bandwidth (a 2 GiB copy on CUDA) and the matrix rate (8192^3 GEMMs on CUDA)."""
    say(f"measuring copy bandwidth and {dtype} matmul rate on {device}")
    on_gpu = device.type == "cuda"
    bandwidth = copy_bandwidth(device, (2048 if on_gpu else 64 if quick else 256) << 20)
    bandwidth["counted"] = "bytes read + bytes written by one device-to-device copy"
    matmul = matmul_rate(device, dtype, 8192 if on_gpu else 256 if quick else 1024)
    free(device)
    say(f"  {bandwidth['bytes_per_s'] / 1e9:,.0f} GB/s, {matmul['flop_per_s'] / 1e12:,.2f} TFLOP/s")
    return bandwidth, matmul


def _params(counts: ParamCounts) -> dict[str, float]:
    return {
        "total": counts.total,
        "mtp": counts.mtp,
        "active_per_token_batch_1": counts.active(1),
        "embedding": counts.embedding,
        "lm_head": counts.lm_head,
        "dense": counts.dense,
        "per_expert": counts.expert,
    }


def _geometry(config: ModelConfig) -> dict[str, Any]:
    return {
        "layers": config.num_hidden_layers,
        "full_attention_layers": len(config.full_attention_layers),
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
        "heads": f"{config.num_attention_heads} q / {config.num_key_value_heads} kv x {config.head_dim}",
        "linear_heads": (
            f"{config.linear_num_key_heads} k x {config.linear_key_head_dim} / "
            f"{config.linear_num_value_heads} v x {config.linear_value_head_dim}"
        ),
        "experts": f"{config.num_experts} top-{config.num_experts_per_tok} x {config.moe_intermediate_size}",
        "shared_expert": config.shared_expert_intermediate_size,
        "mtp_layers": config.mtp_num_hidden_layers,
    }


def _load_text(spread: dict[str, Any]) -> str:
    if not spread or "error" in spread:
        return spread.get("error", "(no MoE layers)")
    return (
        f"max/mean {spread['max_over_mean']:.2f} (worst layer {spread['worst_layer_max_over_mean']:.2f}), "
        f"min/mean {spread['min_over_mean']:.2f}, {100 * spread['unused_fraction']:.1f}% unused "
        f"over {spread['tokens']} tokens (uniform random routing: max/mean "
        f"{spread['uniform_random']['max_over_mean']:.2f})"
    )


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU x{os.cpu_count()}, {torch.get_num_threads()} torch threads"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str:
    # The device machine's copy of the tree may carry a stale .git: ENCLAVE_COMMIT, when set, wins.
    if os.environ.get("ENCLAVE_COMMIT"):
        return os.environ["ENCLAVE_COMMIT"]
    try:
        git = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
        )
        found = git.stdout.strip() if git.returncode == 0 else ""
    except OSError:
        found = ""
    return found or "unknown"


def print_table(report: dict[str, Any]) -> None:
    c = report["configuration"]
    print(
        f"{report['machine']} | torch {report['torch']} | triton {report['triton']} | {c['dtype']} | "
        f"commit {report['commit']} | {c['source']} | kernels {c['kernels']}"
        + (" | quick" if c["quick"] else "")
    )
    print(
        f"roofline {report['bandwidth']['bytes_per_s'] / 1e9:,.0f} GB/s (copy) | matrix rate "
        f"{report['matmul']['flop_per_s'] / 1e12:,.2f} TFLOP/s | active params/token (batch 1) "
        f"{_count(c['params']['active_per_token_batch_1'])} of {_count(c['params']['total'])} | "
        f"expert load {_load_text(report['expert_load'])}"
    )
    print(f"{'workload':<28} {'tok/s':>10} {'MB/token':>10} {'roofline tok/s':>14} {'% roofline':>10}  notes")
    for letter, points in report["workloads"].items():
        if isinstance(points, dict):  # skipped or failed as a whole
            print(f"({letter}) {points.get('skipped') or points.get('error')}")
            continue
        for p in points:
            name = f"({letter}) {p['label']}"[:28]
            per_token = p.get("bytes_per_token", {}).get("total")
            note = p.get("error") or p.get("skipped") or p.get("note", "")
            if p.get("capped") and "time cap" not in note:
                note += " (time cap)"
            print(
                f"{name:<28} {_num(p.get('tokens_per_s'), ',.1f'):>10} "
                f"{_num(per_token and per_token / 1e6, ',.2f'):>10} "
                f"{_num(p.get('roofline_tokens_per_s'), ',.1f'):>14} "
                f"{_num(p.get('pct_of_roofline'), '.2f', '%'):>10}  {note}"
            )


def _count(n: float) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
        "--kv-cache-gib", type=float, help="cache budget of each workload (default 40 on cuda)"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="of workload (d)")
    parser.add_argument("--batches", type=_sizes, help="batch sizes of (b) (default 16,64,256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="write the results here ('' for none)")
    args = parser.parse_args(argv)
    if args.max_seconds <= 0 or args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
        parser.error("--max-seconds, --max-num-batched-tokens and --max-num-seqs must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
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
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
