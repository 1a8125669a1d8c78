"""Deciding which MTP drafts to keep, given the main model's distribution at each verified position.

Greedy requests keep drafts while they equal the main model's argmax, then add the argmax at the first
mismatch (or after the last draft): exactly the tokens plain greedy decoding would give. Sampled requests
use rejection sampling (Leviathan et al., Chen et al. 2023): draft x drawn from q is kept with probability
min(1, p(x) / q(x)); at the first rejection a token is drawn from max(0, p - q), renormalised; if all are
kept, one more from p. Each emitted token is then distributed exactly as p, whatever q was.
"""

from __future__ import annotations

import torch


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """targets: the main model's argmax at each of the len(drafts)+1 positions -> the tokens to emit."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return targets[: kept + 1]


def accept_sampled(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator,
) -> list[int]:
    """target_probs [d+1, V], draft_probs [d, V] (the distributions the drafts were drawn from) -> tokens."""
    emitted: list[int] = []
    device = target_probs.device
    for j, token in enumerate(drafts):
        p, q = target_probs[j, token], draft_probs[j, token]
        u = torch.rand((), generator=generator, device=device)
        if u * q < p:  # keep with probability min(1, p/q); strict, so p = 0 is never kept
            emitted.append(token)
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_min(0.0)
        if residual.sum() <= 0:  # p == q everywhere: rejection cannot happen in exact arithmetic
            residual = target_probs[j]
        emitted.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return emitted
