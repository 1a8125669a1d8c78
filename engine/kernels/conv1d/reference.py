"""Plain-torch causal depthwise conv1d with a rolling state, over a flat variable-length batch."""

import torch
import torch.nn.functional as F

from engine.kernels.layout import SeqLayout


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, layout: SeqLayout, activation: bool = True
) -> torch.Tensor:
    # x [T, C]; weight [C, K]; state [S, C, K-1] holds each slot's last K-1 inputs, updated in place.
    if layout.is_decode:
        return _decode(x, weight, state, layout, activation)
    km1 = weight.shape[1] - 1
    out = torch.empty_like(x)
    w = weight.float()[:, None, :]  # [C, 1, K]
    for i, (start, slot, ctx) in enumerate(
        zip(layout.cu_seqlens, layout.slots, layout.context_lens, strict=False)
    ):
        n = layout.query_lens[i]
        xs = x[start : start + n].float().T  # [C, n]
        prev = state[slot].float() if ctx > 0 else xs.new_zeros(xs.shape[0], km1)
        full = torch.cat((prev, xs), dim=1)  # [C, K-1+n]
        y = F.conv1d(full[None], w, groups=xs.shape[0])[0]  # [C, n]
        out[start : start + n] = (F.silu(y) if activation else y).T.to(x.dtype)
        state[slot] = full[:, full.shape[1] - km1 :].to(state.dtype)
    return out


def _decode(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, layout: SeqLayout, activation: bool):
    slots = layout.slot_tensor(x.device)
    has_state = (layout.context_tensor(x.device) > 0)[:, None, None]
    prev = torch.where(has_state, state[slots].float(), 0.0)  # [B, C, K-1]; a fresh slot may hold garbage
    full = torch.cat((prev, x.float()[:, :, None]), dim=2)  # [B, C, K]
    y = (full * weight.float()[None]).sum(-1)  # [B, C]
    state[slots] = full[:, :, 1:].to(state.dtype)
    return (F.silu(y) if activation else y).to(x.dtype)
