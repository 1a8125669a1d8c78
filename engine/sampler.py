"""Turn a batch of logits into next tokens (greedy, temperature, top-k, top-p) and their log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: softmax(logits / T) restricted by top-k then top-p.

    logits [..., V] -> probabilities [..., V] (fp32), zero outside the kept support.
    """
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p; the first one always stays.
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[..., 0] = False
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> SampleResult:
    """logits [B, V] fp32, one SamplingParams and generator per row -> tokens and optional logprobs."""
    tokens = torch.argmax(logits, dim=-1)
    for row, p in enumerate(params):
        if not p.greedy:
            probs = filtered_probs(logits[row], p)
            tokens[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
    want = [p.logprobs for p in params if p.logprobs is not None]
    token_list = tokens.tolist()
    if not want:
        return SampleResult(token_list, [None] * len(params))
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, max(max(want), 1), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[dict[int, float] | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        entry = dict(zip(top_ids[row][: p.logprobs], top_values[row][: p.logprobs], strict=True))
        entry.setdefault(token_list[row], chosen[row])
        out.append(entry)
    return SampleResult(token_list, out)
