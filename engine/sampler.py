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


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from the filtered distribution of a sampled request: logits [V] -> token id."""
    return int(torch.multinomial(filtered_probs(logits, params), 1, generator=generator)[0])


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> SampleResult:
    """logits [B, V] fp32, one SamplingParams and generator per row -> tokens and optional logprobs."""
    tokens = torch.argmax(logits, dim=-1)
    for row, p in enumerate(params):
        if not p.greedy:
            tokens[row] = draw(logits[row], p, generators[row])
    token_list = tokens.tolist()
    return SampleResult(token_list, logprob_entries(logits, token_list, [p.logprobs for p in params]))


def logprob_entries(
    logits: torch.Tensor, tokens: list[int], counts: list[int | None]
) -> list[dict[int, float] | None]:
    """For each row of logits [N, V]: the `counts[row]` most likely tokens' log-probabilities plus the
    chosen token's, or None where no log-probabilities were asked for."""
    want = [k for k in counts if k is not None]
    if not want:
        return [None] * len(counts)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, max(max(want), 1), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[dict[int, float] | None] = []
    for row, k in enumerate(counts):
        if k is None:
            out.append(None)
            continue
        entry = dict(zip(top_ids[row][:k], top_values[row][:k], strict=True))
        entry.setdefault(tokens[row], chosen[row])
        out.append(entry)
    return out
