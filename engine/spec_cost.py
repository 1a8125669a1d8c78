"""What a decode or verify step costs, in seconds, as a function of its sequences and drafts: the model the
speculation policy (`engine/spec_policy.py`) weighs accepted tokens against.

A decode step is memory-bound: its time is the bytes it moves over the device's bandwidth, plus fixed costs
per step that bytes do not show (launches, the host's work between steps). The bytes of a step over B
sequences verifying k drafts each (T = B (k+1) tokens):

    main model   dense weights and lm_head once; per MoE layer, the distinct experts the T tokens touch,
                 E (1 - (1 - top_k/E)^T); one embedding row per token; per sequence its KV (the context read,
                 k+1 positions written) and its DeltaNet state read and written, plus k more states written
                 (the verify scratch);
    MTP head     k > 0: the head over the T positions (its dense weights, the experts T tokens touch), then
                 k - 1 more passes over B tokens, and the draft head once per draft (the lm_head, or its e4m3
                 copy with `draft_head="fp8"`); k = 0: only the K/V
                 projections that keep its cache whole (fc and qkv_proj);

A step takes the longer of its bytes over the bandwidth and its GEMMs' FLOPs over the matrix rate (large
batches reach the latter: each token through the dense weights and top_k experts, and a logits row per
token and per draft), plus fixed costs: `step_s` per step, `verify_s` more per verify step, `draft_s` per
draft. The constants come from `spec_costs.json`, keyed by device name (a measured GPU's row; `default`
elsewhere).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.model import CausalLM
from engine.model.moe import SparseMoe

TABLE = Path(__file__).with_name("spec_costs.json")


@dataclass(frozen=True)
class DeviceCosts:
    """A device's side of the model: bandwidth and the fixed costs bytes do not show."""

    bytes_per_s: float
    flop_per_s: float = float("inf")  # the matrix rate a step's GEMMs reach: large batches are bound by it
    step_s: float = 0.0  # every step: launches, the host's work between steps
    verify_s: float = 0.0  # more per verify step (k > 0), beyond its bytes
    draft_s: float = 0.0  # per draft: the head's launches and its pick on the host

    def __post_init__(self) -> None:
        if min(self.bytes_per_s, self.flop_per_s) <= 0 or min(self.step_s, self.verify_s, self.draft_s) < 0:
            raise ValueError(f"device costs must be positive: {self}")


def device_costs(device: torch.device, table: Path = TABLE) -> DeviceCosts:
    """The table's row for `device` (its CUDA name, or `cpu`), else its `default` row."""
    return costs_for(torch.cuda.get_device_name(device) if device.type == "cuda" else device.type, table)


def costs_for(name: str, table: Path = TABLE) -> DeviceCosts:
    """The table's row named `name`, else its `default` row (keys starting with _ are notes)."""
    rows = json.loads(table.read_text())
    row = rows.get(name) or rows["default"]
    return DeviceCosts(**{k: v for k, v in row.items() if not k.startswith("_")})


@dataclass(frozen=True)
class ModelBytes:
    """The model's bytes by role, read from the built model (FP8 tensors count one byte per weight)."""

    fixed: float  # main model's weights read whole by every step: all but the routed experts and the table
    expert: float  # one routed expert of one MoE layer
    moe_layers: int
    num_experts: int
    top_k: int
    embedding_row: float
    kv_position: float  # KV bytes of one position over the main model's attention layers
    state: float  # one slot's DeltaNet state over all layers
    lm_head: float
    draft_head: float  # what a draft reads of the head it is scored with (`draft_head="fp8"`: the e4m3 copy)
    mtp_fixed: float  # the MTP head's weights but its routed experts
    mtp_expert: float
    mtp_fill: float  # the MTP head's fc and qkv_proj: all a k = 0 step runs of it
    token_flops: float = 0.0  # a token through the main model's GEMMs (dense and its top_k experts)
    mtp_token_flops: float = 0.0  # ... through the MTP head's
    logit_flops: float = 0.0  # one row of logits (the lm_head)

    @classmethod
    def of(cls, model: CausalLM, kv_itemsize: int, state_bytes: int) -> ModelBytes:
        config = model.config

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        main_moe = [
            m for n, m in model.named_modules() if isinstance(m, SparseMoe) and not n.startswith("mtp")
        ]
        mtp_moe = [m for n, m in model.named_modules() if isinstance(m, SparseMoe) and n.startswith("mtp")]
        expert_of = [(size(m.w13) + size(m.w2)) / m.w13.shape[0] for m in main_moe + mtp_moe]
        main = mtp = main_params = mtp_params = 0
        for name, p in model.named_parameters():
            if name.endswith((".w13", ".w2")) or name == "model.embed_tokens.weight":
                continue
            if name.startswith("mtp."):
                mtp, mtp_params = mtp + size(p), mtp_params + p.numel()
            elif name != "lm_head.weight":
                main, main_params = main + size(p), main_params + p.numel()
        k = config.num_experts_per_tok
        expert_params = [(m.w13[0].numel() + m.w2[0].numel()) * k for m in main_moe + mtp_moe]
        embed = model.model.embed_tokens.weight
        head = size(embed if model.lm_head is None else model.lm_head.weight)  # tied: the table is the head
        draft = size(model.draft_weight())  # the head, or its first `draft_vocab` rows
        if model.draft_head is not None:
            draft = size(model.draft_head.weight) + size(model.draft_head.weight_scale_inv)
        fill = 0
        if model.mtp is not None:
            layer = model.mtp.layers[0]
            fill = size(model.mtp.fc.weight) + size(layer.self_attn.qkv_proj.weight)
        attention_layers = config.layer_types.count("full_attention")
        return cls(
            fixed=main + head,
            expert=expert_of[0] if main_moe else 0.0,
            moe_layers=len(main_moe),
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            embedding_row=size(embed) / embed.shape[0],
            kv_position=attention_layers * 2 * config.num_key_value_heads * config.head_dim * kv_itemsize,
            state=state_bytes,
            lm_head=head,
            draft_head=draft,
            mtp_fixed=mtp,
            mtp_expert=expert_of[-1] if mtp_moe else 0.0,
            mtp_fill=fill,
            token_flops=2 * (main_params + sum(expert_params[: len(main_moe)])),
            mtp_token_flops=2 * (mtp_params + sum(expert_params[len(main_moe) :])),
            logit_flops=2 * embed.shape[0] * embed.shape[1],
        )


def touched(tokens: float, num_experts: int, top_k: int) -> float:
    """Distinct experts `tokens` tokens touch, each picking top_k of num_experts evenly at random."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class StepCost:
    """Seconds a step takes: `seconds(seqs, k, context)`."""

    bytes: ModelBytes
    device: DeviceCosts

    def step_bytes(self, seqs: int, k: int, context: float, speculating: bool = True) -> float:
        """Bytes of a step over `seqs` sequences at mean `context` verifying k drafts each; `speculating`:
        the MTP head's share (a k = 0 step of an engine that speculates still fills its K/V)."""
        m = self.bytes
        tokens = seqs * (k + 1)
        main = m.fixed + tokens * m.embedding_row
        main += m.moe_layers * touched(tokens, m.num_experts, m.top_k) * m.expert
        main += seqs * ((context + k + 1) * m.kv_position + (2 + k) * m.state)  # KV read and written
        if not speculating:
            return main
        if k == 0:
            return main + m.mtp_fill
        head = m.mtp_fixed + touched(tokens, m.num_experts, m.top_k) * m.mtp_expert
        head += (k - 1) * (m.mtp_fixed + touched(seqs, m.num_experts, m.top_k) * m.mtp_expert)
        return main + head + k * m.draft_head

    def step_flops(self, seqs: int, k: int, speculating: bool = True) -> float:
        """The GEMMs' FLOPs: every token through the main model and its logits row; drafting, the head
        over the T positions and k - 1 more passes over B tokens, and a logits row per draft."""
        m = self.bytes
        tokens = seqs * (k + 1)
        flops = tokens * (m.token_flops + m.logit_flops)
        if speculating and k:
            flops += (tokens + (k - 1) * seqs) * m.mtp_token_flops + k * seqs * m.logit_flops
        return flops

    def seconds(self, seqs: int, k: int, context: float, speculating: bool = True) -> float:
        """The fixed costs, then the longer of moving the step's bytes and running its GEMMs."""
        d = self.device
        fixed = d.step_s + (d.verify_s + k * d.draft_s if k else 0.0)
        moving = self.step_bytes(seqs, k, context, speculating) / d.bytes_per_s
        return fixed + max(moving, self.step_flops(seqs, k, speculating) / d.flop_per_s)
