"""Plain-torch sampling: softmax(logits / T) restricted by top-k then top-p, drawn by an exponential race."""

import torch


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    restrict: bool | None = None,
) -> torch.Tensor:
    """logits [B, V], per-row temperature [B] (> 0), top_k [B] and top_p [B] -> probabilities [B, V] fp32,
    zero outside each row's kept support.

    top-k keeps the values >= the k-th largest (ties with it stay; k <= 0 or >= V: no limit). top-p, over
    what top-k kept, drops a token once the tokens ranked above it cover top_p (the first always stays;
    top_p >= 1: no limit). The ranking is a stable sort, so a tie group that top-p cuts keeps its lowest
    indices. One sort of the batch serves both; `restrict` False skips it (the caller knows no row limits its
    support), None decides from the values on the CPU and sorts on CUDA rather than wait for the host.
    """
    vocab = logits.shape[-1]
    x = logits.float() / temperature.float()[:, None]
    k = top_k.to(device=logits.device, dtype=torch.int64)
    k = torch.where((k > 0) & (k < vocab), k, vocab)
    p_limit = top_p.to(device=logits.device, dtype=torch.float32)[:, None]
    if restrict is None:
        restrict = logits.is_cuda or bool((k < vocab).any() or (p_limit < 1.0).any())
    if not restrict:
        return torch.softmax(x, dim=-1)
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    # top-k by value: ties with the k-th logit stay.
    sorted_x = sorted_x.masked_fill(sorted_x < sorted_x.gather(-1, k[:, None] - 1), float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # top-p over what top-k kept: drop a token once the ones ranked above it cover top_p (rows at 1.0 keep
    # everything; the first token always stays).
    drop = (probs.cumsum(-1) - probs >= p_limit) & (p_limit < 1.0)
    drop[:, 0] = False
    x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


def sample_filtered(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    race: torch.Tensor,
) -> torch.Tensor:
    # ids [B] int64: argmax over the vocabulary of p / E, E = race [B, V] ~ Exp(1), draws from p exactly.
    return torch.argmax(filtered_probs(logits, temperature, top_k, top_p) / race, dim=-1)
