"""The gated attention's q/k preparation: zero-centred RMSNorm of every head, then partial rotary; and the
same with the keys and values stored in the paged cache (a cache in the model's dtype)."""

import torch

from engine.kernels import dispatch
from engine.kernels.attention import fp8_kv
from engine.kernels.qk_norm_rotary import reference

dispatch.register(
    "qk_norm_rotary",
    torch=reference.qk_norm_rotary,
    triton="engine.kernels.qk_norm_rotary.triton:qk_norm_rotary",
)


def in_turn(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots) -> torch.Tensor:
    """`qk_norm_rotary_store` as the two ops it fuses, each picked as usual: on CUDA the Triton norm, then
    the cache write the attention op would make (the path the fused kernel replaces)."""
    q, k = qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, eps)
    fp8_kv.write(k, v, k_cache, v_cache, slots, None, None)
    return q


dispatch.register(
    "qk_norm_rotary_store",
    torch=in_turn,
    triton="engine.kernels.qk_norm_rotary.triton:qk_norm_rotary_store",
)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary(rms_norm(q, q_weight), cos, sin)` and the same for k, in one pass over both.

    Args:
        q: [T, Hq, D] queries, any head and token strides (a view of the projection output).
        k: [T, Hkv, D] keys, likewise.
        q_weight, k_weight: [D] zero-centred norm weights (the scale is `1 + weight`).
        cos, sin: [T, rd] fp32 rotary tables (`rotary_cos_sin`); channels past rd pass through.
        eps: added to the mean square.
    Returns:
        (q, k), contiguous [T, Hq, D] and [T, Hkv, D] in q's and k's dtype.
    """
    return dispatch.pick("qk_norm_rotary", q)(q, k, q_weight, k_weight, cos, sin, eps)


def qk_norm_rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`qk_norm_rotary`, with the normed and rotated keys and the values written into a paged cache in the
    model's dtype instead of returned: `attention(q, None, None, ...)` then attends without writing.

    Args:
        q, k, cos, sin, q_weight, k_weight, eps: as `qk_norm_rotary`.
        v: [T, Hkv, D] new values, any token and head strides.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] paged caches in k's dtype, written in place.
        slots: [T] int64 flat cache row of each token (`SeqLayout.slot_mapping`).
    Returns:
        q, contiguous [T, Hq, D].
    """
    impl = dispatch.pick("qk_norm_rotary_store", q)
    return impl(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots)
