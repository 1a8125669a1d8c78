"""Run the model over a static batch of sequences: chunked prefill, then one token per step until done."""

from __future__ import annotations

import torch

from engine.cache import StateCache
from engine.kernels import SeqLayout
from engine.model.model import CausalLM
from engine.sampler import sample
from engine.sequence import Sequence


class StaticBatchRunner:
    """Generates a fixed group of sequences together, each in its own cache slot.

    Prompts are prefilled in rounds of at most `prefill_chunk` tokens per sequence (DeltaNet state and KV
    carry across rounds), then every unfinished sequence decodes one token per step.
    """

    def __init__(
        self, model: CausalLM, device: torch.device, dtype: torch.dtype, prefill_chunk: int = 8192
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.prefill_chunk = prefill_chunk

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> None:
        longest_prompt = max(len(s.prompt_ids) for s in seqs)
        capacity = longest_prompt + min(max(s.params.max_tokens or 256 for s in seqs), 256)
        cache = StateCache(self.model.config, len(seqs), capacity, self.device, self.dtype)
        self._prefill(seqs, cache)
        while running := [(slot, s) for slot, s in enumerate(seqs) if not s.finished]:
            cache.reserve(max(s.num_tokens for _, s in running))
            layout = SeqLayout(
                query_lens=(1,) * len(running),
                context_lens=tuple(s.num_tokens - 1 for _, s in running),
                slots=tuple(slot for slot, _ in running),
            )
            ids = torch.tensor([s.output_ids[-1] for _, s in running], device=self.device)
            self._step(ids, layout, cache, [s for _, s in running])

    def _prefill(self, seqs: list[Sequence], cache: StateCache) -> None:
        done = [0] * len(seqs)
        while pending := [i for i, s in enumerate(seqs) if done[i] < len(s.prompt_ids)]:
            lens = [min(self.prefill_chunk, len(seqs[i].prompt_ids) - done[i]) for i in pending]
            layout = SeqLayout(tuple(lens), tuple(done[i] for i in pending), tuple(pending))
            ids = torch.tensor(
                [
                    t
                    for i, n in zip(pending, lens, strict=True)
                    for t in seqs[i].prompt_ids[done[i] : done[i] + n]
                ],
                device=self.device,
            )
            for i, n in zip(pending, lens, strict=True):
                done[i] += n
            finishing = [k for k, i in enumerate(pending) if done[i] == len(seqs[i].prompt_ids)]
            self._step(ids, layout, cache, [seqs[pending[k]] for k in finishing], rows=finishing)

    def _step(
        self,
        ids: torch.Tensor,
        layout: SeqLayout,
        cache: StateCache,
        seqs: list[Sequence],
        rows: list[int] | None = None,
    ) -> None:
        """Run the model on a flat batch; sample for `seqs`, whose last tokens are layout rows `rows`."""
        hidden = self.model(ids, layout, cache)
        if not seqs:
            return
        rows = list(range(layout.num_seqs)) if rows is None else rows
        last = hidden[[layout.last_token_index[r] for r in rows]]
        logits = self.model.logits(self.model.final_norm(last))
        result = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs, strict=True):
            seq.append(token, lp)
