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
from engine.sequence import PENDING, Sequence
from engine.speculative import accept_greedy, accept_sampled

# A test or benchmark may replace the MTP head as drafter: (sequence, how many) -> draft token ids.
Drafter = Callable[[Sequence, int], list[int]]
# Which main-model hidden state the MTP head reads: after the final norm (vLLM's choice) or before it.
MTP_HIDDEN = ("normed", "raw")


@dataclass
class StepResult:
    accepted: list[int]  # drafts accepted, per scheduled sequence
    num_generated: int  # tokens appended to sequences


@dataclass
class Launched:
    """A step whose forward pass and sampling are queued on the device; `finish` reads its tokens.

    `deferred`: its tokens were reserved as placeholders (`Sequence.reserve`) and copied to `host` behind
    `ready`, so the next step can be planned and launched before the host reads them (asynchronous
    scheduling); the next step takes them as input ids from `tokens`, device to device."""

    items: list[ScheduledSeq]
    layout: SeqLayout | None = None
    emit_rows: list[list[int]] | None = None
    logits: torch.Tensor | None = None  # [rows, V] fp32
    tokens: torch.Tensor | None = None  # [rows] int64: each row's argmax or draw (drafts accepted later)
    hidden: torch.Tensor | None = None  # [T, H] before the final norm, and after it, for the MTP head
    normed: torch.Tensor | None = None
    deferred: bool = False
    host: torch.Tensor | None = None  # pinned copy of `tokens`, complete once `ready` has passed
    ready: torch.cuda.Event | None = None
    rows: dict[int, int] | None = None  # id(seq) -> its row in `tokens` (deferred steps)


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
        self._pending: Launched | None = None  # the deferred step whose tokens are not read yet

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run a step and read its tokens."""
        return self.finish(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, defer: bool = False) -> Launched:
        """Queue the step's forward pass, logits and sampling on the device, without waiting for them.

        With `defer` (and no speculation, no log-probs asked for), the sampled tokens are reserved as
        placeholders and copied to pinned memory: `finish` may then run after the next step's launch."""
        self.cache.copy_slots([a for a, _ in out.slot_copies], [b for _, b in out.slot_copies])
        self.cache.copy_blocks([a for a, _ in out.block_copies], [b for _, b in out.block_copies])
        items = out.scheduled
        if not items:
            return Launched(items)
        layout, ids = self._batch(items, defer)
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
        tokens = self._tokens(items, emit_rows, logits)
        launched = Launched(items, layout, emit_rows, logits, tokens, hidden, normed)
        if defer and self._deferrable(items):
            self._defer(launched)
        return launched

    @torch.inference_mode()
    def finish(self, launched: Launched) -> StepResult:
        """Read a launched step's tokens: append them (or resolve its placeholders), verify drafts, draft."""
        items = launched.items
        if not items:
            return StepResult([], 0)
        if launched.deferred:
            return self._resolve(launched)
        accepted, generated = self._emit(launched)
        if self.k:
            hidden = launched.normed if self.mtp_hidden == "normed" else launched.hidden
            self._draft(items, launched.layout, hidden, accepted)
        return StepResult(accepted, generated)

    def _deferrable(self, items: list[ScheduledSeq]) -> bool:
        """Whether the step's tokens can wait on the device: not with drafts to verify or propose, nor with
        log-probabilities to compute from its logits."""
        if self.k or self.drafter is not None:
            return False
        return all(item.seq.params.logprobs is None for item in items if item.samples)

    def _defer(self, launched: Launched) -> None:
        tokens = launched.tokens
        launched.rows = {}
        offset = 0
        for item, rows in zip(launched.items, launched.emit_rows, strict=True):
            if rows:
                launched.rows[id(item.seq)] = offset
                item.seq.reserve()
            offset += len(rows)
        if tokens.device.type == "cuda":
            launched.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            launched.host.copy_(tokens, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        else:
            launched.host = tokens
        launched.deferred = True
        self._pending = launched

    def _resolve(self, launched: Launched) -> StepResult:
        """Replace a deferred step's placeholders with its tokens (their stop checks run now)."""
        if launched.ready is not None:
            launched.ready.synchronize()  # this step's tokens only: later steps keep running
        if self._pending is launched:
            self._pending = None
        tokens = launched.host.tolist()
        generated = 0
        for item, rows in zip(launched.items, launched.emit_rows, strict=True):
            seq = item.seq
            if rows and not seq.finished and seq.num_pending:  # else it ended on an earlier token
                seq.resolve(tokens[launched.rows[id(seq)]], None)
                generated += 1
        return StepResult([0] * len(launched.items), generated)

    def _batch(self, items: list[ScheduledSeq], defer: bool = False) -> tuple[SeqLayout, torch.Tensor]:
        ids: list[int] = []
        state_out: list[tuple[int, ...]] = []
        pending: list[tuple[int, int]] = []  # (flat position, row of the deferred step's tokens)
        verifying = 0
        for item in items:
            seq = item.seq
            known = seq.token_ids[item.context : item.context + item.num_new]
            if known and known[-1] == PENDING:
                pending.append((len(ids) + len(known) - 1, self._pending.rows[id(seq)]))
            ids += known
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
        return layout, self._ids(ids, pending, defer)

    def _ids(self, ids: list[int], pending: list[tuple[int, int]], defer: bool) -> torch.Tensor:
        """The step's input ids on the device. Placeholders take the previous step's sampled tokens, device
        to device; with every input a placeholder in row order (a decode step), those tokens are the input."""
        if not pending:
            if defer:  # the device may still be busy with the previous step: do not wait for it
                return self._to_device(ids)
            # Between steps the device is idle: a plain (synchronising) copy costs less than pinning.
            return torch.tensor(ids, dtype=torch.long, device=self.device)
        tokens = self._pending.tokens
        positions, rows = [p for p, _ in pending], [r for _, r in pending]
        if positions == list(range(len(ids))) and rows == list(range(tokens.shape[0])):
            return tokens
        out = self._to_device([max(t, 0) for t in ids])
        out[self._to_device(positions)] = tokens[self._to_device(rows)]
        return out

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

    def _emit(self, launched: Launched) -> tuple[list[int], int]:
        items, emit_rows, logits = launched.items, launched.emit_rows, launched.logits
        layout = launched.layout
        argmax = launched.tokens.tolist()
        accepted: list[int] = []
        commits: list[tuple[int, int]] = []
        generated = 0
        offset = 0
        for index, (item, rows) in enumerate(zip(items, emit_rows, strict=True)):
            seq, block = item.seq, slice(offset, offset + len(rows))
            offset += len(rows)
            if not rows or seq.finished:  # finished: its end was read after this step was launched
                accepted.append(0)
                continue
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
    def _tokens(items: list[ScheduledSeq], emit_rows: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        """Per logits row, its argmax; for a sampled request without drafts, its draw instead (all rows drawn
        at once on the device, nothing read by the host)."""
        rows, seqs, offset = [], [], 0
        for item, emitted in zip(items, emit_rows, strict=True):
            if emitted and not item.seq.params.greedy and not item.drafts:
                rows.append(offset)
                seqs.append(item.seq)
            offset += len(emitted)
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        return sample_rows(logits, rows, params, generators)

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
