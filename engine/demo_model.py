"""Write a small random-weight checkpoint in the exact Hugging Face layout of Qwen3.5-MoE.

    python -m engine.demo_model DIR

The weights are RANDOM: the checkpoint proves the plumbing (config, per-expert safetensors, `mtp.*`, a
byte-level BPE tokenizer with a ChatML template, generation config), not language quality. The output is
deterministic and needs neither transformers nor the network.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

LABEL = "RANDOM WEIGHTS - Enclave demo model: proves the plumbing, not language quality"
# Qwen's pre-tokenisation: split words, single digits, punctuation runs and newlines, then map bytes.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CORPUS = """
Patient is a 64-year-old with hypertension and type 2 diabetes, admitted with chest pain. Troponin negative.
Discharge summary: symptoms resolved, follow up with cardiology in two weeks.
Continue metformin and lisinopril.
Extract the fields: name, date of birth, diagnosis, medication, dose, allergies. Return JSON only.
Summarise the record in three sentences for the referring physician. Findings, assessment and plan.
def main(argv: list[str]) -> int:\n    for path in sorted(paths):\n        if not path.exists():\n
class Repository:\n    def __init__(self, root):\n        self.root = root\n\n    def files(self):
Review this code for bugs, security issues and unclear names. Report each finding with file and line.
The quick brown fox jumps over the lazy dog. Numbers 0 1 2 3 4 5 6 7 8 9.
Punctuation: , . ; : ! ? ( ) [ ] { } " ' - + * / = < > # @ & % $
"""


def demo_config(vocab_size: int) -> dict:
    """config.json of the demo model: Qwen3.5-MoE text layout with one MTP layer."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "enclave_demo": LABEL,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "mtp_num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eos_token_id": 2,
        "bos_token_id": None,
        "pad_token_id": 0,
        "dtype": "bfloat16",
    }


def build_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """A byte-level BPE with Qwen's normaliser and pre-tokeniser, trained on a small built-in corpus
    (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line] * 4, trainer=trainer)
    return tok


def layer_tensors(config: dict, prefix: str, kind: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one decoder layer's tensors, as `save_pretrained` writes them."""
    h, e = config["hidden_size"], config["num_experts"]
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate.weight": (e, h),
        "mlp.shared_expert.gate_proj.weight": (config["shared_expert_intermediate_size"], h),
        "mlp.shared_expert.up_proj.weight": (config["shared_expert_intermediate_size"], h),
        "mlp.shared_expert.down_proj.weight": (h, config["shared_expert_intermediate_size"]),
        "mlp.shared_expert_gate.weight": (1, h),
    }
    inter = config["moe_intermediate_size"]
    for x in range(e):
        shapes[f"mlp.experts.{x}.gate_proj.weight"] = (inter, h)
        shapes[f"mlp.experts.{x}.up_proj.weight"] = (inter, h)
        shapes[f"mlp.experts.{x}.down_proj.weight"] = (h, inter)
    if kind == "linear_attention":
        key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
        hv = config["linear_num_value_heads"]
        shapes |= {
            "linear_attn.in_proj_qkv.weight": (2 * key + value, h),
            "linear_attn.in_proj_z.weight": (value, h),
            "linear_attn.in_proj_b.weight": (hv, h),
            "linear_attn.in_proj_a.weight": (hv, h),
            "linear_attn.conv1d.weight": (2 * key + value, 1, config["linear_conv_kernel_dim"]),
            "linear_attn.A_log": (hv,),
            "linear_attn.dt_bias": (hv,),
            "linear_attn.norm.weight": (config["linear_value_head_dim"],),
            "linear_attn.out_proj.weight": (h, value),
        }
    else:
        d, hq, hkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
        shapes |= {
            "self_attn.q_proj.weight": (2 * hq * d, h),
            "self_attn.k_proj.weight": (hkv * d, h),
            "self_attn.v_proj.weight": (hkv * d, h),
            "self_attn.o_proj.weight": (h, hq * d),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
        }
    return {prefix + k: v for k, v in shapes.items()}


def checkpoint_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    h, v = config["hidden_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i, kind in enumerate(config["layer_types"]):
        shapes |= layer_tensors(config, f"model.layers.{i}.", kind)
    for i in range(config.get("mtp_num_hidden_layers", 0)):
        shapes |= layer_tensors(config, f"mtp.layers.{i}.", "full_attention")
    if config.get("mtp_num_hidden_layers", 0):
        shapes |= {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        }
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Scaled so activations stay O(1) through the layers and the logits are not flat."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape)
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape) + 0.1 * torch.randn(shape, generator=g)
    if len(shape) == 1:  # zero-centred norms: x * (1 + w)
        return 0.1 * torch.randn(shape, generator=g)
    if "embed_tokens" in name:
        return torch.randn(shape, generator=g)
    if "conv1d" in name:
        return 0.5 * torch.randn(shape, generator=g)
    scale = 4.0 if name == "lm_head.weight" else 1.0
    return torch.randn(shape, generator=g) * scale / math.sqrt(shape[-1])


def write_demo_model(path: str | Path, seed: int = 0) -> Path:
    """Write the demo checkpoint into directory `path` (created if needed) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = demo_config(tokenizer.get_vocab_size())
    config["eos_token_id"] = tokenizer.token_to_id("<|im_end|>")
    g = torch.Generator().manual_seed(seed)
    tensors = {
        name: random_tensor(name, shape, g).to(torch.bfloat16).contiguous()
        for name, shape in sorted(checkpoint_tensors(config).items())
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": config["max_position_embeddings"],
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL_TOKENS
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {
        "eos_token_id": [config["eos_token_id"], tokenizer.token_to_id("<|endoftext|>")],
        "do_sample": False,
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (path / "README.md").write_text(f"# {LABEL}\n\nWritten by `python -m engine.demo_model`.\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the random-weight Enclave demo checkpoint.")
    parser.add_argument("directory", help="where to write the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = write_demo_model(args.directory, args.seed)
    except OSError as exc:
        print(f"error: cannot write the demo model: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({LABEL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
