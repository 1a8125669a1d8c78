"""Per-request changes to a step's logits before sampling: presence and frequency penalties, logit bias, and
the grammar's token mask (OpenAI's semantics for the first three, on the generated tokens only, as vLLM).

A row of a verify step (MTP drafts) sees the tokens before it: the output so far plus the drafts ahead of
its position, so the grammar's mask for draft j's row comes from the matcher advanced over drafts[:j] (then
rolled back). A draft the grammar rejects cannot equal the masked target's argmax, nor be kept by rejection
sampling (its probability is 0): it is rejected. Every output token before the step's is known on the host
here: the asynchronous core reads a deferred step's tokens before it processes the next step's logits
(`ModelRunner.finish`); the placeholder a deferred request holds for this step's own token is not counted.
"""

from __future__ import annotations

from collections import Counter

import torch

from engine.grammar import GrammarState, allocate_bitmask, apply_bitmask
from engine.sampler import to_device
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


def needs_processing(seq: Sequence) -> bool:
    """Whether a request's logits are changed before sampling."""
    p = seq.params
    return bool(p.presence_penalty or p.frequency_penalty or p.logit_bias or seq.grammar is not None)


class LogitsProcessors:
    """Applies penalties, bias and grammar masks to the rows of a step; holds the step's host bitmask."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bitmask: torch.Tensor | None = None
        self.masked_rows = 0  # rows masked by a grammar since start (tests and benchmarks read it)

    def apply(self, items: list[ScheduledSeq], emit_rows: list[list[int]], logits: torch.Tensor) -> None:
        """Change `logits` [rows, V] in place for every item that samples and needs it. `emit_rows[i]` are
        item i's flat-batch rows, numbered here by their order in `logits`."""
        offset, bias_rows, tokens, deltas, grammar_rows = 0, [], [], [], []
        for item, emitted in zip(items, emit_rows, strict=True):
            first, offset = offset, offset + len(emitted)
            seq = item.seq
            if not emitted or seq.finished or not needs_processing(seq):
                continue
            drafts = list(item.drafts)
            for j in range(len(emitted)):
                row_tokens, row_deltas = _adjustments(seq, drafts[:j])
                bias_rows += [first + j] * len(row_tokens)
                tokens += row_tokens
                deltas += row_deltas
            if seq.grammar is not None:
                grammar_rows.append((seq, first, drafts))
        if tokens:
            device = self.device
            index = (to_device(bias_rows, torch.long, device), to_device(tokens, torch.long, device))
            values = to_device(deltas, torch.float32, self.device).to(logits.dtype)
            logits.index_put_(index, values, accumulate=True)
        if grammar_rows:
            self._mask(grammar_rows, logits)

    def _mask(self, entries: list[tuple[Sequence, int, list[int]]], logits: torch.Tensor) -> None:
        """Fill each constrained row's mask on the host (the forward pass runs meanwhile on a GPU), copy the
        bitmask over and mask the logits."""
        rows, vocab = logits.shape
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = allocate_bitmask(max(rows, 8), vocab, pin=self.device.type == "cuda")
        bitmask = self._bitmask
        plain: list[tuple[GrammarState, int]] = []  # one row at the matcher's current state
        masked: list[int] = []
        for seq, first, drafts in entries:
            if not drafts:
                if not seq.in_reasoning:
                    plain.append((seq.grammar, first))
                    masked.append(first)
                continue
            masked += _fill_with_drafts(seq, first, drafts, bitmask)
        if plain:
            states = [state for state, _ in plain]
            states[0].compiler.fill(states, bitmask, [row for _, row in plain])
        if not masked:
            return
        # Safe to reuse the pinned buffer next step: the next fill starts only once this step's tokens were
        # read (by the synchronous core, or by the asynchronous one before it processes the next step's
        # logits), and this copy precedes their sampling on the stream.
        device_mask = bitmask[:rows].to(self.device, non_blocking=True)
        apply_bitmask(logits, device_mask, sorted(masked))
        self.masked_rows += len(masked)


def _fill_with_drafts(seq: Sequence, first: int, drafts: list[int], bitmask: torch.Tensor) -> list[int]:
    """Masks for a verify step's rows: row j after drafts[:j]. Drafts inside the reasoning block pass
    unmasked; a draft the grammar refuses ends the walk (later rows are never used). The matcher is rolled
    back to where it was. Returns the rows filled."""
    state, think = seq.grammar, seq.think
    in_reasoning, accepted, filled = seq.in_reasoning, 0, []
    for j in range(len(drafts) + 1):
        if in_reasoning:
            if j < len(drafts) and think is not None and drafts[j] == think.end:
                in_reasoning = False
            continue
        state.compiler.fill([state], bitmask, [first + j])
        filled.append(first + j)
        if j == len(drafts) or not state.accept(drafts[j]):
            break
        accepted += 1
    state.rollback(accepted)
    return filled


def _adjustments(seq: Sequence, drafts: list[int]) -> tuple[list[int], list[float]]:
    """(token ids, logit deltas) of one row: -(presence + frequency * count) for each token generated so
    far (drafts ahead of the row included), plus the request's logit bias."""
    p = seq.params
    changes: dict[int, float] = {}
    if p.presence_penalty or p.frequency_penalty:
        counts = Counter(t for t in seq.output_ids if t >= 0)
        counts.update(drafts)
        for token, count in counts.items():
            changes[token] = -(p.presence_penalty + p.frequency_penalty * count)
    for token, bias in (p.logit_bias or {}).items():
        changes[token] = changes.get(token, 0.0) + bias
    return list(changes), list(changes.values())
