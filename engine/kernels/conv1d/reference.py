"""Plain-torch causal depthwise conv1d with a rolling state, over a flat variable-length batch."""

import torch
import torch.nn.functional as F

from engine.kernels.layout import SeqLayout


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, layout: SeqLayout, activation: bool = True
) -> torch.Tensor:
    # x [T, C]; weight [C, K]; state [S, C, K-1] holds each slot's last K-1 inputs, updated in place.
    km1 = weight.shape[1] - 1
    out = torch.empty_like(x)
    if layout.short_seqs:
        _short(x, weight, state, layout, activation, out)
    w = weight.float()[:, None, :]  # [C, 1, K]
    for i in layout.long_seqs:
        if layout.keeps_states(i):
            raise ValueError("per-position states are only kept for short (verify) steps")
        start, n, slot, ctx = (
            layout.cu_seqlens[i],
            layout.query_lens[i],
            layout.slots[i],
            layout.context_lens[i],
        )
        xs = x[start : start + n].float().T  # [C, n]
        prev = state[slot].float() if ctx > 0 else xs.new_zeros(xs.shape[0], km1)
        full = torch.cat((prev, xs), dim=1)  # [C, K-1+n]
        y = F.conv1d(full[None], w, groups=xs.shape[0])[0]  # [C, n]
        out[start : start + n] = (F.silu(y) if activation else y).T.to(x.dtype)
        state[slot] = full[:, full.shape[1] - km1 :].to(state.dtype)
    return out


def _short(x, weight, state, layout: SeqLayout, activation: bool, out: torch.Tensor) -> None:
    """Short sequences together: each window is the slot's K-1 inputs followed by the new tokens."""
    seqs = layout.short_seqs
    dev = x.device
    km1 = weight.shape[1] - 1
    n_max = max(layout.query_lens[i] for i in seqs)
    slots = torch.tensor([layout.slots[i] for i in seqs], device=dev)
    has_state = torch.tensor([layout.context_lens[i] > 0 for i in seqs], device=dev)[:, None, None]
    prev = torch.where(has_state, state[slots].float(), 0.0)  # [B, C, K-1]; a fresh slot may hold garbage
    tokens = torch.tensor(
        [[layout.cu_seqlens[i] + min(j, layout.query_lens[i] - 1) for j in range(n_max)] for i in seqs],
        device=dev,
    )  # [B, n]; padding repeats the last real token and is dropped
    full = torch.cat((prev, x[tokens].float().transpose(1, 2)), dim=2)  # [B, C, K-1+n]
    windows = full.unfold(2, km1 + 1, 1)  # [B, C, n, K]
    y = (windows * weight.float()[None, :, None, :]).sum(-1)  # [B, C, n]
    y = F.silu(y) if activation else y
    live = (
        torch.arange(n_max, device=dev)[None, :]
        < torch.tensor([layout.query_lens[i] for i in seqs], device=dev)[:, None]
    )  # [B, n]
    out[tokens[live]] = y.transpose(1, 2)[live].to(out.dtype)
    # The state after new token j is the K-1 inputs ending at it: full[:, :, j+1 : j+K].
    after = full[:, :, 1:].unfold(2, km1, 1)[:, :, :n_max].transpose(1, 2)  # [B, n, C, K-1]
    keep = torch.tensor([layout.keeps_states(i) for i in seqs], device=dev)
    last = torch.tensor([layout.query_lens[i] - 1 for i in seqs], device=dev)
    final = after[torch.arange(len(seqs), device=dev), last]
    state[slots[~keep]] = final[~keep].to(state.dtype)
    if keep.any():
        targets = [
            layout.state_out[i][j]
            for i in seqs
            if layout.keeps_states(i)
            for j in range(layout.query_lens[i])
        ]
        state[torch.tensor(targets, device=dev)] = after[live & keep[:, None]].to(state.dtype)
