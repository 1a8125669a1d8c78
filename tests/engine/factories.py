"""Tiny real checkpoints for tests, written by transformers' `save_pretrained` (the oracle's own layout)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.kernels import SeqLayout

BASE: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 20,
    "shared_expert_intermediate_size": 24,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "max_position_embeddings": 512,
}


def text_config(**overrides: Any):
    from transformers import Qwen3_5MoeTextConfig

    return eager(Qwen3_5MoeTextConfig(**{**BASE, **overrides}))


def eager(config):
    """Plain-torch reference paths (loop-over-experts MoE, eager attention) on a config and its text part."""
    for c in (config, getattr(config, "text_config", None)):
        if c is not None:
            c._experts_implementation = "eager"
            c._attn_implementation = "eager"
    return config


def widen_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight so activations stay O(1) and logits are decisive (well separated top tokens)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 3.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.ndim == 1 or "norm" in name:
                # zero-centred norms use 1 + w; the gated norm uses w directly
                base = 1.0 if "linear_attn.norm" in name else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 4.0 / math.sqrt(p.shape[-1]))
            else:
                fan_in = p.shape[-1]
                gain = 1.5 if leaf in ("gate_up_proj", "weight") else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / math.sqrt(fan_in))


def save_text_model(path: Path, seed: int = 0, **overrides: Any):
    """A Qwen3_5MoeForCausalLM checkpoint (text layout, per-expert tensors); returns the reference model."""
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(text_config(**overrides)).eval()
    widen_(model, seed)
    model.save_pretrained(path)
    return model


def save_vl_model(path: Path, seed: int = 0, **overrides: Any):
    """A Qwen3_5MoeForConditionalGeneration checkpoint (model.language_model.* and model.visual.*)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 48}
    config = eager(Qwen3_5MoeConfig(text_config={**BASE, **overrides}, vision_config=vision))
    model = Qwen3_5MoeForConditionalGeneration(config).eval()
    widen_(model, seed)
    model.save_pretrained(path)
    return model


def save_next_model(path: Path, seed: int = 0, **overrides: Any):
    """A Qwen3NextForCausalLM checkpoint (interleaved in_proj_qkvz / in_proj_ba)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(
        eager(Qwen3NextConfig(**{**BASE, "intermediate_size": 40, **overrides}))
    ).eval()
    widen_(model, seed)
    model.save_pretrained(path)
    return model


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Log-probabilities [len(generated), V] the reference assigns at each generated position."""
    ids = torch.tensor([prompt + generated])
    logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], dim=-1)


FP8_MAX = 448.0
# Tensors Qwen's FP8 releases keep in bf16.
FP8_SKIP = (
    "norm",
    "mlp.gate.weight",
    "shared_expert_gate",
    "conv1d",
    "A_log",
    "dt_bias",
    "in_proj_a",
    "in_proj_b",
    "embed_tokens",
    "lm_head",
)


def quantize_block_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, per-block multiplier `weight_scale_inv` [ceil(N/b), ceil(K/b)]) of a 2-D weight."""
    n, k = weight.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, block, cols, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * block, cols * block)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def write_fp8_copies(source: Path, fp8_dir: Path, dequant_dir: Path, block: int = 128) -> None:
    """From a bf16/fp32 checkpoint write its block-FP8 version (`block` x `block` scale blocks) and, beside
    it, the dequantised weights."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    fp8, dequant = {}, {}
    for name, t in tensors.items():
        if t.ndim == 2 and not any(s in name for s in FP8_SKIP):
            q, scale = quantize_block_fp8(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: t.shape[0], : t.shape[1]]
            dequant[name] = q.float() * full
        else:
            fp8[name] = dequant[name] = t
    for out, table in ((fp8_dir, fp8), (dequant_dir, dequant)):
        out.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, out / f.name)
        save_file(table, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))


def dense_layout(
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    slots: tuple[int, ...],
    block_size: int = 4,
    blocks_per_slot: int = 8,
) -> SeqLayout:
    """A layout whose sequence in slot s owns KV blocks s*blocks_per_slot .. (s+1)*blocks_per_slot - 1."""
    tables = tuple(tuple(range(s * blocks_per_slot, (s + 1) * blocks_per_slot)) for s in slots)
    return SeqLayout(query_lens, context_lens, slots, tables, block_size)


def single_cache(config, capacity: int, device="cpu", dtype=torch.float32, num_mtp_layers: int = 0):
    """A cache for one sequence in slot 0 of up to `capacity` positions, and its layout maker."""
    from engine.cache import ModelCache

    block = 16
    blocks = -(-capacity // block)
    cache = ModelCache(config, 1, blocks, block, device, dtype, num_mtp_layers)

    def layout(n: int, context: int = 0) -> SeqLayout:
        return SeqLayout((n,), (context,), (0,), (tuple(range(blocks)),), block)

    return cache, layout


def add_mtp(path, seed=0):
    """Append a random MTP head to a saved checkpoint, in the release layout (per-expert tensors)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

    config = text_config()
    full = config.layer_types.index("full_attention")
    layer = Qwen3_5MoeDecoderLayer(config, full)
    head = torch.nn.ModuleDict(
        {
            "layers": torch.nn.ModuleList([layer]),
            "fc": torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
            "pre_fc_norm_embedding": Qwen3_5MoeRMSNorm(config.hidden_size),
            "pre_fc_norm_hidden": Qwen3_5MoeRMSNorm(config.hidden_size),
            "norm": Qwen3_5MoeRMSNorm(config.hidden_size),
        }
    )
    widen_(head, seed)
    tensors = load_file(str(path / "model.safetensors"))
    inter = config.moe_intermediate_size
    for name, value in head.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            base = "mtp." + name.removesuffix("gate_up_proj")
            for e in range(value.shape[0]):
                tensors[f"{base}{e}.gate_proj.weight"] = value[e, :inter].clone()
                tensors[f"{base}{e}.up_proj.weight"] = value[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            base = "mtp." + name.removesuffix("down_proj")
            for e in range(value.shape[0]):
                tensors[f"{base}{e}.down_proj.weight"] = value[e].clone()
        else:
            tensors["mtp." + name] = value.clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return config, head
