"""Bytes a step must move through device memory (weights, KV cache, DeltaNet state), from parameter counts
by role, and the tokens/s the measured bandwidth allows for them (the roofline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.cache import block_bytes, slot_bytes
from engine.config import ModelConfig
from engine.model.fp8_linear import is_fp8_projection
from engine.model.model import CausalLM


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
    fp8_dense: int = 0  # of `dense`, the parameters of projections stored in FP8 (one byte each)
    fp8_experts: bool = False  # routed experts stored in FP8

    def active(self, tokens: float) -> float:
        """Parameters a step over `tokens` tokens must read: dense, lm_head, one embedding row per token,
        and in each MoE layer the experts its tokens touch."""
        return self.dense + self.lm_head + tokens * self.hidden + self._experts_read(tokens)

    def active_bytes(self, tokens: float, itemsize: int) -> float:
        """Bytes of the parameters `active(tokens)` counts: FP8 ones take one byte, the rest `itemsize` (the
        block scales, 1/16384 of an FP8 weight's bytes, are left out)."""
        experts = self._experts_read(tokens)
        fp8 = self.fp8_dense + (experts if self.fp8_experts else 0)
        return (self.active(tokens) - fp8) * itemsize + fp8

    def _experts_read(self, tokens: float) -> float:
        touched = expected_experts(tokens, self.num_experts, self.top_k)
        return self.moe_layers * touched * self.expert

    def matmul_params(self) -> float:
        """Parameters each token multiplies (embedding lookup and lm_head excluded), for FLOPs."""
        return self.dense + self.moe_layers * self.top_k * self.expert


def expected_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Distinct experts `tokens` tokens touch if each picks `top_k` of `num_experts` evenly at random:
    exactly `top_k` for one token, at most min(num_experts, tokens * top_k)."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def param_counts(config: ModelConfig, quantization: str | None = None) -> ParamCounts:
    """Count the parameters of `config`'s model, built on the meta device (nothing is allocated); with
    `quantization="fp8"`, the ones stored in FP8 (the dense projections `Fp8Linear` takes, the routed
    experts)."""
    with torch.device("meta"):
        model = CausalLM(config, num_mtp_layers=config.mtp_num_hidden_layers)
    fp8 = quantization == "fp8"
    fp8_dense = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if fp8 and not n.startswith("mtp.") and is_fp8_projection(n, m)
    )
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
        fp8_dense=fp8_dense,
        fp8_experts=fp8 and moe_layers > 0,
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
    kv_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> StepBytes:
    """One step of `seqs` sequences, each adding `tokens_per_seq` tokens after `context` cached positions:
    the weights those tokens touch, the KV of every position attended (read) or added (written), and each
    sequence's DeltaNet state read once and written `state_writes` times (k+1 for an MTP verify step). KV
    positions are of `kv_dtype` (default `dtype`; an FP8 one's scales included), states of `state_dtype`."""
    tokens = seqs * tokens_per_seq
    kv_per_position = block_bytes(config, kv_dtype or dtype, 1, 0)
    return StepBytes(
        weights=counts.active_bytes(tokens, dtype.itemsize),
        kv=seqs * (context + tokens_per_seq) * kv_per_position,
        state=seqs * (1 + state_writes) * slot_bytes(config, dtype, state_dtype),
    )


def prefill_bytes(
    counts: ParamCounts,
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    seqs: int,
    prompt_len: int,
    chunk: int,
    kv_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> StepBytes:
    """All of a prefill of `seqs` prompts in steps of at most `chunk` tokens (an estimate: each step reads
    the weights its tokens touch once; chunk j of a prompt reads the j * chunk positions before it)."""
    tokens = seqs * prompt_len
    steps = -(-tokens // chunk)
    chunks = -(-prompt_len // chunk)
    per_chunk = min(prompt_len, chunk)
    positions = seqs * (prompt_len + per_chunk * chunks * (chunks - 1) / 2)
    return StepBytes(
        weights=steps * counts.active_bytes(tokens / steps, dtype.itemsize),
        kv=positions * block_bytes(config, kv_dtype or dtype, 1, 0),
        state=seqs * chunks * 2 * slot_bytes(config, dtype, state_dtype),
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
