"""Turn a batch of logits into next tokens (greedy, temperature, top-k, top-p) and their log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import sample_filtered
from engine.kernels.sampling import reference as sampling_reference
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
    vocab = logits.shape[-1]
    temperature, top_k, top_p = _row_params(params, logits.device)
    restrict = any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)
    return sampling_reference.filtered_probs(logits, temperature, top_k, top_p, restrict=restrict)


def draw_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    """One token per row from its filtered distribution, on the device: logits [B, V] -> ids [B] (int64).

    An exponential race (argmax of p / E with E ~ Exp(1)) draws from p exactly; each row's E comes from
    its request's generator, so a seeded request draws the same tokens alone or in any batch. The filter
    and the race run in one kernel op (`engine.kernels.sample_filtered`: Triton on CUDA, no sort).
    """
    temperature, top_k, top_p = _row_params(params, logits.device)
    race = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for row, generator in enumerate(generators):
        race[row].exponential_(generator=generator)
    return sample_filtered(logits, temperature, top_k, top_p, race)


def _row_params(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature [B] fp32, top_k [B] int64 and top_p [B] fp32 on the device."""
    temperature = to_device([p.temperature for p in params], torch.float32, device)
    top_k = to_device([p.top_k for p in params], torch.int64, device)
    top_p = to_device([p.top_p for p in params], torch.float32, device)
    return temperature, top_k, top_p


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device tensor of `values` that does not make the host wait: `torch.tensor(values, device=cuda)`
    synchronises with the stream, which mid-step would stall the host behind the graph it just launched.
    From pinned memory the copy is asynchronous (torch keeps the pinned block until the copy ran)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def sample_rows(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    """Token ids [N] for logits [N, V]: each row's argmax, except `rows`, which draw from their request's
    filtered distribution (`params`, `generators`: one per drawn row). Nothing waits on the host."""
    tokens = torch.argmax(logits, dim=-1)
    if rows:
        index = to_device(rows, torch.long, logits.device)
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
    chosen_ids = torch.tensor(tokens, device=logits.device)
    values, ids, chosen = (t.tolist() for t in top_logprobs(logits, chosen_ids, max(max(want), 1)))
    return [
        None if k is None else logprob_entry(values[row], ids[row], chosen[row], tokens[row], k)
        for row, k in enumerate(counts)
    ]


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V] and the chosen tokens [N] on the same device -> the log-softmax's k largest values
    [N, k] fp32 and their ids [N, k], and the chosen tokens' values [N], all left on the device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, k, dim=-1)
    return top.values, top.indices, logprobs.gather(-1, tokens[:, None])[:, 0]


def logprob_entry(values: list[float], ids: list[int], chosen: float, token: int, k: int) -> dict[int, float]:
    """One row's report: its k most likely tokens' log-probabilities, plus the chosen token's."""
    entry = dict(zip(ids[:k], values[:k], strict=True))
    entry.setdefault(token, chosen)
    return entry
