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

    logits [..., V] -> probabilities [..., V] (fp32), zero outside the kept support. Ties with the k-th
    logit stay; top-p drops a token once the tokens ranked above it cover top_p (the first always stays).
    """
    rows = logits.reshape(-1, logits.shape[-1])
    return batch_filtered_probs(rows, [params] * rows.shape[0]).reshape(logits.shape)


def batch_filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`filtered_probs` for every row at once, each row with its own temperature, top-k and top-p.

    logits [B, V] -> probabilities [B, V] fp32. One sort of the batch serves top-k and top-p (skipped when
    no row restricts its support); the thresholds are per-row tensors, so nothing waits on the host.
    """
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    x = logits.float() / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return torch.softmax(x, dim=-1)
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    # top-k by value, as filtered_probs: ties with the k-th logit stay.
    k_index = torch.tensor(top_k, device=device)[:, None] - 1
    sorted_x = sorted_x.masked_fill(sorted_x < sorted_x.gather(-1, k_index), float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # top-p over what top-k kept: drop a token once the ones ranked above it cover top_p (rows at 1.0
    # keep everything; the first token always stays).
    p_limit = torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]
    drop = (probs.cumsum(-1) - probs >= p_limit) & (p_limit < 1.0)
    drop[:, 0] = False
    x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


def draw_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    """One token per row from its filtered distribution, on the device: logits [B, V] -> ids [B] (int64).

    An exponential race (argmax of p / E with E ~ Exp(1)) draws from p exactly; each row's E comes from
    its request's generator, so a seeded request draws the same tokens alone or in any batch.
    """
    probs = batch_filtered_probs(logits, params)
    race = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        race[row].exponential_(generator=generator)
    return torch.argmax(probs / race, dim=-1)


def sample_rows(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    """Token ids [N] for logits [N, V]: each row's argmax, except `rows`, which draw from their request's
    filtered distribution (`params`, `generators`: one per drawn row). Nothing waits on the host."""
    tokens = torch.argmax(logits, dim=-1)
    if rows:
        index = torch.tensor(rows, device=logits.device)
        tokens[index] = draw_rows(logits[index], params, generators)
    return tokens


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> SampleResult:
    """logits [B, V] fp32, one SamplingParams and generator per row -> tokens and optional logprobs.
    Greedy rows take the argmax; the others draw on the device; the tokens reach the host once."""
    rows = [row for row, p in enumerate(params) if not p.greedy]
    drawn = sample_rows(logits, rows, [params[r] for r in rows], [generators[r] for r in rows])
    token_list = drawn.tolist()
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
