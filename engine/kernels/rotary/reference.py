"""Plain-torch partial rotary embedding (rotate-half style over the first rotary_dim channels)."""

import torch


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, rd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, rd]
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D], cos/sin [T, rd] with rd <= D; channels past rd pass through.
    rd = cos.shape[-1]
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)
