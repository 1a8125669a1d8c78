"""Run one scheduled step on the model: a flat token batch, sampling, draft verification, new drafts.

Prefill chunks, decodes and MTP verify steps share one forward pass. For each sequence that reaches the
end of its known tokens the runner samples (or verifies its drafts and commits the DeltaNet state of the
accepted length), appends the new tokens to the sequence, and, with speculation on, runs the MTP head over
the step's positions (filling its KV cache) and drafts the next `k` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cache import ModelCache
from engine.graphs import DecodeGraphs
from engine.kernels import SeqLayout
from engine.model.model import CausalLM
from engine.planner import CachePlan
from engine.sampler import filtered_probs, logprob_entries, sample_rows, to_device
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import accept_greedy, accept_sampled

# A test or benchmark may replace the MTP head as drafter: (sequence, how many) -> draft token ids.
Drafter = Callable[[Sequence, int], list[int]]
# Which main-model hidden state the MTP head reads: after the final norm (vLLM's choice) or before it.
MTP_HIDDEN = ("normed", "raw")


@dataclass
class StepResult:
    accepted: list[int]  # drafts accepted, per scheduled sequence
    num_generated: int  # tokens appended to sequences


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: ModelCache,
        plan: CachePlan,
        num_speculative_tokens: int = 0,
        drafter: Drafter | None = None,
        mtp_hidden: str = "normed",
        graphs: DecodeGraphs | None = None,
    ) -> None:
        if mtp_hidden not in MTP_HIDDEN:
            raise ValueError(f"mtp_hidden must be one of {', '.join(MTP_HIDDEN)}, got {mtp_hidden!r}")
        self.mtp_hidden = mtp_hidden
        self.model = model
        self.cache = cache
        self.plan = plan
        self.device = cache.device
        self.k = num_speculative_tokens
        self.drafter = drafter
        self.graphs = graphs  # CUDA graphs for decode and verify steps; None runs every step eagerly

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        self.cache.copy_slots([a for a, _ in out.slot_copies], [b for _, b in out.slot_copies])
        self.cache.copy_blocks([a for a, _ in out.block_copies], [b for _, b in out.block_copies])
        items = out.scheduled
        if not items:
            return StepResult([], 0)
        layout, ids = self._batch(items)
        hidden = self.graphs.run(layout, ids) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model(ids, layout, self.cache)
        emit_rows = self._emit_rows(items, layout)
        wanted = self._rows(emit_rows, hidden.shape[0])
        if self.k:
            normed = self.model.final_norm(hidden)
            logits = self.model.logits(normed if wanted is None else normed[wanted])
        else:
            normed = None
            logits = self.model.logits(self.model.final_norm(hidden if wanted is None else hidden[wanted]))
        accepted, generated = self._emit(items, emit_rows, logits, layout)
        if self.k:
            self._draft(items, layout, normed if self.mtp_hidden == "normed" else hidden, accepted)
        return StepResult(accepted, generated)

    def _batch(self, items: list[ScheduledSeq]) -> tuple[SeqLayout, torch.Tensor]:
        ids: list[int] = []
        state_out: list[tuple[int, ...]] = []
        verifying = 0
        for item in items:
            seq = item.seq
            ids += seq.token_ids[item.context : item.context + item.num_new]
            ids += item.drafts
            if item.drafts:
                base = self.plan.num_slots + verifying * self.k
                verifying += 1
                state_out.append((*range(base, base + len(item.drafts)), seq.slot))
            else:
                state_out.append(())
        layout = SeqLayout(
            tuple(i.num_tokens for i in items),
            tuple(i.context for i in items),
            tuple(i.seq.slot for i in items),
            tuple(tuple(i.seq.blocks) for i in items),
            self.cache.block_size,
            tuple(state_out) if verifying else None,
        )
        # Between steps the device is idle: a plain (synchronising) copy costs less than pinning.
        return layout, torch.tensor(ids, dtype=torch.long, device=self.device)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 device tensor of `values`, copied without stalling the host mid-step (`to_device`)."""
        return to_device(values, torch.long, self.device)

    def _rows(self, emit_rows: list[list[int]], num_rows: int) -> torch.Tensor | None:
        """Index of the flat-batch rows to take logits for, or None when that is every row in order (a
        decode step): then nothing is indexed."""
        flat = [r for rows in emit_rows for r in rows]
        if flat == list(range(num_rows)):
            return None
        return self._to_device(flat)

    @staticmethod
    def _emit_rows(items: list[ScheduledSeq], layout: SeqLayout) -> list[list[int]]:
        """Flat-batch rows whose logits are needed: the last known token and each draft, if sampling."""
        rows = []
        for item, start in zip(items, layout.cu_seqlens, strict=False):
            first = start + item.num_new - 1
            rows.append(list(range(first, first + 1 + len(item.drafts))) if item.samples else [])
        return rows

    def _emit(
        self, items: list[ScheduledSeq], emit_rows: list[list[int]], logits: torch.Tensor, layout: SeqLayout
    ) -> tuple[list[int], int]:
        argmax = self._tokens(items, emit_rows, logits)
        accepted: list[int] = []
        commits: list[tuple[int, int]] = []
        generated = 0
        offset = 0
        for index, (item, rows) in enumerate(zip(items, emit_rows, strict=True)):
            if not rows:
                accepted.append(0)
                continue
            seq, block = item.seq, slice(offset, offset + len(rows))
            offset += len(rows)
            drafts = list(item.drafts)
            if seq.params.greedy:
                tokens = accept_greedy(argmax[block], drafts)
            elif drafts:
                probs = torch.stack([filtered_probs(row, seq.params) for row in logits[block]])
                draft_probs = seq.draft_probs[: len(drafts)] if seq.draft_probs is not None else None
                if draft_probs is None:  # drafted by a fixed drafter: q is a point mass
                    draft_probs = torch.zeros_like(probs[:-1])
                    draft_probs[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
                tokens = accept_sampled(probs, draft_probs, drafts, seq.generator)
            else:
                tokens = [argmax[block.start]]  # drawn on the device by _tokens
            kept = len(tokens) - 1
            if drafts:
                seq.metrics.accepted_lengths.append(kept)
                seq.metrics.num_draft_tokens += len(drafts)
                if kept < len(drafts):
                    # The state after the last accepted input is the verify step's kept[th] position.
                    commits.append((layout.state_out[index][kept], seq.slot))
            want = seq.params.logprobs
            lps = (  # slicing the logits costs microseconds per sequence: only where log-probs are asked for
                logprob_entries(logits[block][: len(tokens)], tokens, [want] * len(tokens))
                if want is not None
                else [None] * len(tokens)
            )
            for token, lp in zip(tokens, lps, strict=True):
                seq.append(token, lp)
                generated += 1
                if seq.finished:
                    break
            accepted.append(kept)
            seq.draft_ids, seq.draft_probs = [], None
        self.cache.copy_slots([a for a, _ in commits], [b for _, b in commits])
        return accepted, generated

    @staticmethod
    def _tokens(items: list[ScheduledSeq], emit_rows: list[list[int]], logits: torch.Tensor) -> list[int]:
        """Per logits row, its argmax; for a sampled request without drafts, its draw instead (all rows drawn
        at once on the device). One host read for the whole step."""
        rows, seqs, offset = [], [], 0
        for item, emitted in zip(items, emit_rows, strict=True):
            if emitted and not item.seq.params.greedy and not item.drafts:
                rows.append(offset)
                seqs.append(item.seq)
            offset += len(emitted)
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        return sample_rows(logits, rows, params, generators).tolist()

    def _draft(
        self,
        items: list[ScheduledSeq],
        layout: SeqLayout,
        main_hidden: torch.Tensor,
        accepted: list[int],
    ) -> None:
        """Fill the MTP head's KV for this step's positions and propose the next drafts."""
        wanting = [
            (i, item)
            for i, item in enumerate(items)
            if item.samples and not item.seq.finished and self._draft_count(item.seq) > 0
        ]
        if self.drafter is not None:
            for _, item in wanting:
                item.seq.draft_ids = list(self.drafter(item.seq, self._draft_count(item.seq)))[: self.k]
            return
        if self.model.mtp is None:
            return
        # Position p's MTP input pairs the main model's hidden state at p with the token at p + 1.
        next_ids = []
        for item in items:
            tokens = item.seq.token_ids
            for j in range(item.num_tokens):
                p = item.context + j + 1
                next_ids.append(tokens[p] if p < len(tokens) else 0)  # past the accepted run: rewritten later
        mtp_layout = SeqLayout(
            layout.query_lens, layout.context_lens, layout.slots, layout.block_tables, layout.block_size
        )
        h = self.model.mtp_hidden(self._to_device(next_ids), main_hidden, mtp_layout, self.cache)
        if not wanting:
            return
        rows = [layout.cu_seqlens[i] + item.num_new - 1 + accepted[i] for i, item in wanting]
        seqs = [item.seq for _, item in wanting]
        counts = [self._draft_count(s) for s in seqs]
        positions = [item.context + item.num_new - 1 + accepted[i] for i, item in wanting]
        hidden = h[self._to_device(rows)]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(counts)):
            logits = self.model.logits(hidden)
            tokens = self._pick_drafts(seqs, logits, probs)
            for b, t in enumerate(tokens):
                drafts[b].append(t)
            if step + 1 == max(counts):
                break
            # The next draft: the head's own output with the draft just made, one position further.
            step_layout = SeqLayout(
                (1,) * len(seqs),
                tuple(p + step + 1 for p in positions),
                tuple(s.slot for s in seqs),
                tuple(tuple(s.blocks) for s in seqs),
                self.cache.block_size,
            )
            token_ids = self._to_device(tokens)
            hidden = self.model.mtp_hidden(token_ids, hidden, step_layout, self.cache, step + 1)
        for b, seq in enumerate(seqs):
            seq.draft_ids = drafts[b][: counts[b]]
            seq.draft_probs = None if seq.params.greedy else torch.stack(probs[b][: counts[b]])

    def _draft_count(self, seq: Sequence) -> int:
        """Drafts worth proposing: at most k, and fewer near max_tokens or the context limit."""
        left = seq.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - len(seq.output_ids))
        return max(0, min(self.k, left - 1))

    @staticmethod
    def _pick_drafts(
        seqs: list[Sequence], logits: torch.Tensor, probs: list[list[torch.Tensor]]
    ) -> list[int]:
        tokens = logits.argmax(-1).tolist()
        for b, seq in enumerate(seqs):
            if not seq.params.greedy:
                q = filtered_probs(logits[b], seq.params)
                tokens[b] = int(torch.multinomial(q, 1, generator=seq.generator)[0])
                probs[b].append(q)
        return tokens
