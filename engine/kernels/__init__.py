"""Kernel ops used by the model. Each op lives in its own folder beside its plain-torch reference;
`engine.kernels.dispatch` picks the implementation in one place."""

from engine.kernels.attention import attention, store_kv
from engine.kernels.bitmask import apply_token_bitmask
from engine.kernels.conv1d import causal_conv1d
from engine.kernels.deltanet_gate import deltanet_gate
from engine.kernels.deltanet_step import deltanet_step
from engine.kernels.fp8 import (
    dequantize_block_fp8,
    fp8_block_linear,
    quantize_block_fp8_weight,
    quantize_fp8_per_token_group,
)
from engine.kernels.gated_delta import gated_delta_rule
from engine.kernels.layout import SeqLayout
from engine.kernels.linear import linear
from engine.kernels.moe import experts as moe_experts
from engine.kernels.moe import experts_fp8 as moe_experts_fp8
from engine.kernels.moe import route as moe_route
from engine.kernels.moe.pending import PendingCombine
from engine.kernels.norm import (
    add_rms_norm,
    add_rms_norm_fp8,
    combine_add_rms_norm,
    combine_add_rms_norm_fp8,
    gated_rms_norm,
    gated_rms_norm_fp8,
    rms_norm,
)
from engine.kernels.qk_norm_rotary import qk_norm_rotary, qk_norm_rotary_store
from engine.kernels.rotary import apply_rotary, rotary_cos_sin
from engine.kernels.sampling import sample_filtered
from engine.kernels.sigmoid_gate import sigmoid_gate, sigmoid_gate_fp8

__all__ = [
    "PendingCombine",
    "SeqLayout",
    "add_rms_norm",
    "add_rms_norm_fp8",
    "apply_rotary",
    "apply_token_bitmask",
    "attention",
    "causal_conv1d",
    "combine_add_rms_norm",
    "combine_add_rms_norm_fp8",
    "deltanet_gate",
    "deltanet_step",
    "dequantize_block_fp8",
    "fp8_block_linear",
    "gated_delta_rule",
    "gated_rms_norm",
    "gated_rms_norm_fp8",
    "linear",
    "moe_experts",
    "moe_experts_fp8",
    "moe_route",
    "qk_norm_rotary",
    "qk_norm_rotary_store",
    "quantize_block_fp8_weight",
    "quantize_fp8_per_token_group",
    "rms_norm",
    "rotary_cos_sin",
    "sample_filtered",
    "sigmoid_gate",
    "sigmoid_gate_fp8",
    "store_kv",
]
