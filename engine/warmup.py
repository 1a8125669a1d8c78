"""Compile the eager steps' kernels when the engine starts, as its decode graphs are captured then.

Prefill and mixed (prefill beside decode) steps run eagerly, and their Triton kernels compile on first use of
each variant: a tile table entry (the MoE and dense FP8 tables pick tiles by token count) and Triton's own
specialisation of integer arguments (a count of 1, a multiple of 16, or neither). Left to the first requests,
each new variant stalls a step for the compiler (0.5-3 s each on an H200 host; the FP8 engine has more tables,
so more variants). `warm_up` runs synthetic requests through the core before it serves: one prefill at every
token count of `token_counts` up to the step budget (each tuned table count, every power of two, and each
one plus one; several prompts where the context is shorter than the count, as a serving step batches them),
then mixed steps of a few decode batch sizes beside a prompt's chunk, then drops them and resets the
counters.
vLLM warms its engine the same way (dummy runs at its capture sizes) before it takes requests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.kernels.fp8 import config as fp8_config
from engine.kernels.moe import config as moe_config
from engine.sampling import SamplingParams
from engine.sequence import Sequence

log = logging.getLogger(__name__)

DECODE_BATCHES = (1, 3, 16, 17, 64)  # decodes beside a prompt chunk in the mixed warm-up steps (and the most)


@dataclass(frozen=True)
class WarmUp:
    """What the warm-up ran."""

    prefill_steps: int
    mixed_steps: int
    seconds: float


def tuned_token_counts(device: torch.device) -> set[int]:
    """Every token count a tile table of this GPU has an entry for (the tables' keys)."""
    if device.type != "cuda":
        return set()
    counts: set[int] = set()
    for entries in moe_config.tuned_entries(device).values():
        counts.update(entries)
    counts.update(fp8_config.tuned_token_counts(device))
    return counts


def token_counts(max_tokens: int, tuned: set[int]) -> list[int]:
    """Prefill sizes up to `max_tokens` that reach each tuned entry and every power of two, each also plus
    one (an int not divisible by 16 is another compiled variant), and the budget itself."""
    base = {1 << i for i in range(max_tokens.bit_length())} | set(tuned) | {max_tokens}
    counts = base | {t + 1 for t in base}
    return sorted(t for t in counts if 1 <= t <= max_tokens)


def warm_up(core, vocab_size: int, max_model_len: int) -> WarmUp:
    """Run the synthetic steps through `core` (an `EngineCore`), leaving its cache, scheduler and counters
    as they were."""
    start = time.perf_counter()
    device = core.cache.device
    budget = core.scheduler.max_num_batched_tokens
    longest = max(1, min(budget, max_model_len - 2))
    g = torch.Generator().manual_seed(0)
    made = iter(range(-1, -(1 << 30), -1))  # request indices no user request has

    def request(prompt_len: int, new: int) -> Sequence:
        ids = torch.randint(0, vocab_size, (prompt_len,), generator=g).tolist()
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        return Sequence(next(made), ids, params, None, set(), None, max_model_len, device)

    prefill = 0
    for t in token_counts(budget, tuned_token_counts(device)):
        # One step of t prompt tokens: as many prompts as the context needs (a serving step batches several),
        # within the sequence limit.
        count = min(-(-t // longest), core.scheduler.max_num_seqs)
        for i in range(count):
            core.add(request(max(1, t // count + (i < t % count)), 1))
        while core.has_work():
            core.step()
            prefill += 1
    mixed = 0
    most = core.scheduler.max_num_seqs - 1
    chunk = max(1, min(1024, longest // 2))
    for batch in sorted({min(b, most) for b in (*DECODE_BATCHES, most) if b >= 1}):
        decoding = [request(4, 1 << 20) for _ in range(batch)]
        for seq in decoding:
            core.add(seq)
        for _ in range(2):  # their prefills, then a decode step
            core.step()
        prompt = request(min(chunk, longest - batch) if longest > batch else 1, 1)
        core.add(prompt)
        for _ in range(2):  # decodes beside the prompt's chunk
            core.step()
            mixed += 1
        for seq in (*decoding, prompt):
            core.abort(seq)
        while core.has_work():
            core.step()
    core.reset_counters()
    report = WarmUp(prefill, mixed, time.perf_counter() - start)
    log.info("warmed up: %d prefill and %d mixed steps in %.1f s", prefill, mixed, report.seconds)
    return report
