"""Model configuration read once from a Hugging Face `config.json`.

Supported model types: `qwen3_5_moe` (vision-language release; the text part lives under `text_config`),
`qwen3_5_moe_text` and `qwen3_next`. Missing optional keys take the defaults of the reference implementation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LAYER_TYPES = ("linear_attention", "full_attention")
ROPE_TYPES = ("default", "linear", "yarn")
# `mamba_ssm_dtype`: the dtype a release says its Gated DeltaNet recurrent states are kept in (Qwen3.5 and
# Qwen3.6 write float32).
STATE_DTYPE_NAMES = ("float32", "bfloat16", "float16")

# Defaults of the reference classes (transformers' Qwen3_5MoeTextConfig / Qwen3NextConfig).
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_moe_text": _COMMON_DEFAULTS
    | {"vocab_size": 248320, "num_hidden_layers": 40, "num_experts": 256, "num_experts_per_tok": 8},
    "qwen3_next": _COMMON_DEFAULTS
    | {
        "vocab_size": 151936,
        "num_hidden_layers": 48,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "intermediate_size": 5632,
    },
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding over the first `rotary_dim` channels of each attention head (rotate-half style)."""

    theta: float
    rotary_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
            )
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ConfigError(f"rotary dimension must be a positive even number, got {self.rotary_dim}")


@dataclass(frozen=True)
class Fp8Config:
    """Block-quantised FP8 weights: e4m3 values with one `weight_scale_inv` per `block` of the weight."""

    block: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """The text model's geometry, normalised across the supported checkpoint families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: RopeConfig
    max_position_embeddings: int
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    mamba_ssm_dtype: str = "float32"  # the release's recurrent-state dtype; the `state_dtype` option's auto
    quantization: Fp8Config | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        positive = (
            "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
            "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim "
            "linear_conv_kernel_dim"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config value {name} must be a positive integer, got {value!r}")
        if self.mamba_ssm_dtype not in STATE_DTYPE_NAMES:
            raise ConfigError(
                f"config value mamba_ssm_dtype must be one of {', '.join(STATE_DTYPE_NAMES)}, "
                f"got {self.mamba_ssm_dtype!r}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries "
                f"but num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(
                    f"layer {i} has unknown type {kind!r} (expected one of {', '.join(LAYER_TYPES)})"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.rope.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dimension {self.rope.rotary_dim} exceeds head_dim {self.head_dim}")
        if any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)) or self.mtp_num_hidden_layers:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                    f"num_experts ({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError("moe_intermediate_size must be positive")

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` uses the sparse MoE block (else a dense SwiGLU MLP)."""
        if index in self.mlp_only_layers or self.num_experts <= 0:
            return False
        return (index + 1) % max(self.decoder_sparse_step, 1) == 0

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt plus output) the model is run on."""
        if self.rope.rope_type in ("yarn", "linear") and self.rope.factor > 1:
            original = self.rope.original_max_position_embeddings or self.max_position_embeddings
            return max(self.max_position_embeddings, int(original * self.rope.factor))
        return self.max_position_embeddings

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself) into a `ModelConfig`."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"checkpoint {path} has no config.json")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {file}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} does not hold a JSON object")
    return config_from_dict(raw, source=str(file))


def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a `ModelConfig` from the parsed contents of a Hugging Face `config.json`."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unsupported model type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    text = raw
    if model_type == "qwen3_5_moe":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model type qwen3_5_moe needs a text_config object")
        inner = text.get("model_type", "qwen3_5_moe_text")
        if inner not in ("qwen3_5_moe_text", "qwen3_5_moe"):
            raise ConfigError(f"{source}: unsupported text_config model type {inner!r}")
    family = "qwen3_next" if model_type == "qwen3_next" else "qwen3_5_moe_text"
    try:
        return _build(text, raw, family, model_type)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: malformed value ({exc})") from None


def _build(text: dict[str, Any], outer: dict[str, Any], family: str, model_type: str) -> ModelConfig:
    values = dict(_DEFAULTS[family])
    values.update({k: v for k, v in text.items() if v is not None})

    def get_int(name: str) -> int:
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config value {name} must be an integer, got {value!r}")
        return value

    hidden_act = values.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"unsupported hidden_act {hidden_act!r} (only silu)")
    num_layers = get_int("num_hidden_layers")
    layer_types = values.get("layer_types")
    if layer_types is None:
        interval = int(values.get("full_attention_interval", 4))
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    head_dim = (
        get_int("head_dim")
        if "head_dim" in values
        else values["hidden_size"] // values["num_attention_heads"]
    )
    mtp_layers = int(values.get("mtp_num_hidden_layers", values.get("num_nextn_predict_layers", 0)) or 0)
    return ModelConfig(
        model_type=model_type,
        vocab_size=get_int("vocab_size"),
        hidden_size=get_int("hidden_size"),
        num_hidden_layers=num_layers,
        layer_types=tuple(layer_types),
        num_attention_heads=get_int("num_attention_heads"),
        num_key_value_heads=get_int("num_key_value_heads"),
        head_dim=head_dim,
        rope=_rope(values, head_dim),
        max_position_embeddings=get_int("max_position_embeddings"),
        rms_norm_eps=float(values["rms_norm_eps"]),
        linear_num_key_heads=get_int("linear_num_key_heads"),
        linear_num_value_heads=get_int("linear_num_value_heads"),
        linear_key_head_dim=get_int("linear_key_head_dim"),
        linear_value_head_dim=get_int("linear_value_head_dim"),
        linear_conv_kernel_dim=get_int("linear_conv_kernel_dim"),
        num_experts=get_int("num_experts"),
        num_experts_per_tok=get_int("num_experts_per_tok"),
        moe_intermediate_size=get_int("moe_intermediate_size"),
        shared_expert_intermediate_size=int(values.get("shared_expert_intermediate_size") or 0),
        # Qwen3.5-MoE always renormalises the top-k routing weights; Qwen3-Next makes it an option.
        norm_topk_prob=bool(values.get("norm_topk_prob", True)) if family == "qwen3_next" else True,
        intermediate_size=int(values.get("intermediate_size") or 0),
        decoder_sparse_step=int(values.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(values.get("mlp_only_layers") or ()),
        attention_bias=bool(values.get("attention_bias", False)),
        tie_word_embeddings=bool(outer.get("tie_word_embeddings", values.get("tie_word_embeddings", False))),
        mtp_num_hidden_layers=mtp_layers,
        eos_token_ids=_token_ids(values.get("eos_token_id", outer.get("eos_token_id"))),
        mamba_ssm_dtype=str(values.get("mamba_ssm_dtype", "float32")),
        quantization=_quantization(outer.get("quantization_config") or values.get("quantization_config")),
        extra={"raw": text},
    )


def _rope(values: dict[str, Any], head_dim: int) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older files use top-level rope_theta / partial_rotary_factor
    # and an optional `rope_scaling` dict.
    params = dict(values.get("rope_parameters") or {})
    scaling = dict(values.get("rope_scaling") or {})
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        # Scaling added to a release's `rope_parameters` in the older spelling (YaRN for a longer context)
        # wins, as in transformers; theta and the rotary share stay the release's (transformers drops them).
        params = {k: v for k, v in params.items() if k not in ("rope_type", "type")} | scaling
    for key, value in scaling.items():
        params.setdefault(key, value)
    theta = float(params.get("rope_theta", values.get("rope_theta", 10000.0)))
    factor_partial = float(params.get("partial_rotary_factor", values.get("partial_rotary_factor", 0.25)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("mrope", None):
        # Interleaved M-RoPE equals plain RoPE for text, where all position streams are equal.
        rope_type = "default"
    return RopeConfig(
        theta=theta,
        rotary_dim=int(head_dim * factor_partial),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _quantization(raw: Any) -> Fp8Config | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("quantization_config must be an object")
    method = raw.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"unsupported quantization method {method!r} (supported: fp8 with 128x128 blocks)")
    block = raw.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ConfigError(f"weight_block_size must have two entries, got {block!r}")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"unsupported fp8 format {fmt!r} (supported: e4m3)")
    skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ()
    return Fp8Config(block=(int(block[0]), int(block[1])), modules_to_not_convert=tuple(skip))
