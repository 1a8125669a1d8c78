"""Plain-torch q/k norm and rotary: the two reference ops in turn, so the rounding is theirs."""

import torch

from engine.kernels.norm.reference import rms_norm
from engine.kernels.rotary.reference import apply_rotary


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # q [T, Hq, D], k [T, Hkv, D]; the normed heads are rounded to their dtype before the rotation.
    q = apply_rotary(rms_norm(q, q_weight, eps), cos, sin)
    k = apply_rotary(rms_norm(k, k_weight, eps), cos, sin)
    return q, k
