"""Kernel ops used by the model. Each op lives in its own folder beside its plain-torch reference;
`engine.kernels.dispatch` picks the implementation in one place."""

from engine.kernels.attention import attention
from engine.kernels.conv1d import causal_conv1d
from engine.kernels.fp8 import (
    dequantize_block_fp8,
    fp8_block_linear,
    quantize_block_fp8_weight,
    quantize_fp8_per_token_group,
)
from engine.kernels.gated_delta import gated_delta_rule
from engine.kernels.layout import SeqLayout
from engine.kernels.moe import experts as moe_experts
from engine.kernels.moe import route as moe_route
from engine.kernels.norm import gated_rms_norm, rms_norm
from engine.kernels.rotary import apply_rotary, rotary_cos_sin

__all__ = [
    "SeqLayout",
    "apply_rotary",
    "attention",
    "causal_conv1d",
    "dequantize_block_fp8",
    "fp8_block_linear",
    "gated_delta_rule",
    "gated_rms_norm",
    "moe_experts",
    "moe_route",
    "quantize_block_fp8_weight",
    "quantize_fp8_per_token_group",
    "rms_norm",
    "rotary_cos_sin",
]
