"""The models a run can measure: preset geometries, seeded random weights made directly on the device,
and how evenly the router then spreads tokens over the experts."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from engine.bench.settings import BLOCK_SIZE
from engine.cache import ModelCache
from engine.config import ModelConfig
from engine.demo_model import demo_config
from engine.kernels import SeqLayout
from engine.model.model import CausalLM
from engine.model.moe import SparseMoe

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
    "mamba_ssm_dtype": "float32",
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
    "eos_token_id": 248044,  # <|endoftext|>: the grammar's end in (k); the bench's requests ignore it
}
# Qwen3.6-35B-A3B's documented 1M-token window: YaRN, factor 4 over the native 262,144 positions.
YARN_FACTOR = 4.0


def with_window(raw: dict[str, Any], positions: int) -> dict[str, Any]:
    """`raw` (a text config) with YaRN over its native window when `positions` exceed it, as Qwen3.6's card
    says to set it for 1M tokens: factor 4 (a larger power of two if even that is short)."""
    native = raw["max_position_embeddings"]
    if positions <= native:
        return raw
    factor = max(YARN_FACTOR, float(2 ** math.ceil(math.log2(positions / native))))
    rope = raw.get("rope_parameters") or {}
    yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": native}
    return raw | {"rope_parameters": rope | yarn}


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "qwen3.5-35b-a3b": lambda: copy.deepcopy(QWEN35_35B_A3B),
    "tiny": lambda: demo_config(1024),  # the demo model's geometry
}


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
