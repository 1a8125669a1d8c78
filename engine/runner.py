"""Run one scheduled step on the model: a flat token batch, sampling, draft verification, new drafts.

Prefill chunks, decodes and MTP verify steps share one forward pass. `launch` queues the step on the device;
`sample` reads its tokens: for each sequence that reaches the end of its known tokens, the next token (or,
verifying drafts, the accepted run plus one, committing the DeltaNet state of the accepted length). The
runner never changes a `Sequence`: it returns `Sampled` per scheduled sequence and the scheduler appends
them; with speculation, `draft` then runs the MTP head over the step's positions (filling its KV cache) and
returns the next `k` drafts. For asynchronous scheduling `defer` copies a step's tokens to the host behind an
event and `read` takes them later, while the next step, launched with this one as `previous`, takes them as
its input ids device to device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.cache import ModelCache
from engine.errors import EngineError
from engine.graphs import DecodeGraphs
from engine.kernels import SeqLayout
from engine.model.model import CausalLM
from engine.mtp_graphs import MtpGraphs
from engine.planner import CachePlan
from engine.processors import LogitsProcessors, needs_processing
from engine.sampler import (
    filtered_probs,
    logprob_entries,
    logprob_entry,
    sample_rows,
    to_device,
    top_logprobs,
)
from engine.scheduler import NOTHING, Drafts, Sampled, ScheduledSeq, SchedulerOutput
from engine.sequence import PENDING, Sequence
from engine.spec_policy import SpeculationPolicy
from engine.speculative import accept_greedy, accept_sampled

# A test or benchmark may replace the MTP head as drafter: (sequence, how many) -> draft token ids. One whose
# `after_head` attribute is true lets the head draft first (its cost paid, its KV filled), then replaces its
# tokens (a benchmark's controlled acceptance at the real drafting cost). One with a `force_targets` method,
# (sequence, drafts verified, targets) -> targets, decides greedy acceptance: verifying a greedy sequence's
# drafts, the runner passes it the main model's argmax ids at the len(drafts)+1 positions and accepts against
# the list it returns (drafts equal to their target kept, then the first target that differs). A benchmark
# has exactly the drafts it chose accepted that way, whatever the model's numerics; the tokens it forces are
# then not the model's. Sampled requests never call it; without it, one None check per verified sequence.
Drafter = Callable[[Sequence, int], list[int]]


@dataclass(frozen=True)
class Launched:
    """A step whose forward pass, logits and sampling are queued on the device; `sample` (or `defer` and
    `read`) takes its tokens."""

    items: list[ScheduledSeq]
    layout: SeqLayout
    emit_rows: list[list[int]]  # per item, the flat-batch rows whose logits it samples from
    logits: torch.Tensor  # [rows, V] fp32, after penalties, bias and grammar masks
    # [rows] int64: each row's argmax or draw (drafts accepted later); None until `ModelRunner.finish`
    # queued the sampling of a step launched behind a deferred one
    tokens: torch.Tensor | None
    mtp_input: torch.Tensor | None  # [T, H] the hidden states the MTP head reads (speculation only)
    raw_logits: torch.Tensor | None = None  # [rows, V] the model's own, kept for log-probs when changed
    # Speculating, the drafts the step's sequences propose for the next step, chosen at launch for a step
    # that verifies none (None: chosen in `draft`, after this step's acceptance is known); and whether the
    # MTP head's K/V for the step's positions were queued at launch (next_k 0: the step may be deferred).
    next_k: int | None = None
    filled: bool = False
    # [drafts] int64: the values of the drafts the step verifies that were still on the device (PENDING in
    # the sequences), in item order; `sample` reads them with the tokens, in one copy
    drafted: torch.Tensor | None = None

    def token_rows(self) -> list[int | None]:
        """Per item, its (first) row in `tokens`, or None when it samples nothing."""
        rows: list[int | None] = []
        offset = 0
        for emitted in self.emit_rows:
            rows.append(offset if emitted else None)
            offset += len(emitted)
        return rows


@dataclass(frozen=True)
class StepLogprobs:
    """The log-probabilities a step reports, for the rows whose requests ask for them: `top_logprobs`'
    values [R, k], ids [R, k] and chosen values [R], on the device or their host copies."""

    rows: list[int]  # rows of the step's tokens
    counts: list[int]  # how many of the top entries each row reports
    values: torch.Tensor
    ids: torch.Tensor
    chosen: torch.Tensor


@dataclass(frozen=True)
class Readback:
    """A deferred step's tokens (and log-probabilities) on their way to the host: `host` and `logprobs` are
    complete once `ready` has passed."""

    host: torch.Tensor  # [rows] pinned copy of `Launched.tokens` (the tensor itself off CUDA)
    ready: torch.cuda.Event | None
    logprobs: StepLogprobs | None = None


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
        policy: SpeculationPolicy | None = None,
        mtp_graphs: MtpGraphs | None = None,
    ) -> None:
        self.mtp_hidden = mtp_hidden  # checked by SpeculationOptions
        self.model = model
        self.cache = cache
        self.plan = plan
        self.device = cache.device
        self.k = num_speculative_tokens
        self.drafter = drafter
        self.force_targets = getattr(drafter, "force_targets", None)  # see `Drafter`; None: the model decides
        self.graphs = graphs  # CUDA graphs for decode and verify steps; None runs every step eagerly
        self.processors = LogitsProcessors(self.device)
        self.policy = policy  # adaptive speculation: each step's k (at most `k`); None: always k
        self.mtp_graphs = mtp_graphs  # the MTP head's passes from CUDA graphs; None runs them eagerly
        self.last_graphed = False  # whether the last step launched replayed a graph (else it ran eagerly)

    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, previous: Launched | None = None, nonblocking: bool = False
    ) -> Launched | None:
        """Queue the step's forward pass, logits and sampling on the device, without waiting for them; None
        when nothing is scheduled. Behind a deferred step, a step with penalties, bias or a grammar stops
        before its sampling (its tokens None: see `finish`).

        `previous`: the deferred step whose tokens are still placeholders (`PENDING`) in the sequences; they
        become this step's input ids on the device. `nonblocking`: the device may still be busy with it, so
        input ids are uploaded without waiting."""
        self.cache.copy_slots([a for a, _ in out.slot_copies], [b for _, b in out.slot_copies])
        self.cache.copy_blocks([a for a, _ in out.block_copies], [b for _, b in out.block_copies])
        items = out.scheduled
        if not items:
            return None
        layout, ids, drafted = self._batch(items, previous, nonblocking)
        hidden = self.graphs.run(layout, ids) if self.graphs is not None else None
        self.last_graphed = hidden is not None
        if hidden is None:
            hidden = self.model(ids, layout, self.cache)
        emit_rows = self._emit_rows(items, layout)
        wanted = self._rows(emit_rows, hidden.shape[0])
        mtp_input = None
        if self.k:
            normed = self.model.final_norm(hidden)
            logits = self.model.logits(normed if wanted is None else normed[wanted])
            mtp_input = normed if self.mtp_hidden == "normed" else hidden
        else:
            logits = self.model.logits(self.model.final_norm(hidden if wanted is None else hidden[wanted]))
        launched = Launched(items, layout, emit_rows, logits, None, mtp_input, drafted=drafted)
        processed = self._processed(items)
        if processed and previous is not None and self.samples_late:
            return launched  # `finish` samples it once the previous step's tokens are read
        launched = self._finish(launched, processed)
        tokens = launched.tokens
        next_k, filled = None, False
        if self.k and not any(item.drafts for item in items):
            next_k = self._step_k([item.seq for item in self._decoding(items)])
            if next_k == 0 and self._runs_head():
                self._store_kv_ahead(items, layout, ids, tokens, emit_rows, mtp_input)
                filled = True
        return replace(launched, next_k=next_k, filled=filled)

    @torch.inference_mode()
    def finish(self, launched: Launched) -> Launched:
        """Queue a launched step's penalties, bias and grammar masks, and its sampling: `launched` with its
        tokens. `launch` does this itself, except for a step with such requests launched behind a deferred
        one (tokens None): their changes depend on the tokens that step sampled, so the asynchronous core
        reads them first and calls this while the device runs the new step's forward pass."""
        return self._finish(launched, self._processed(launched.items))

    def _finish(self, launched: Launched, processed: list[ScheduledSeq]) -> Launched:
        items, emit_rows, logits = launched.items, launched.emit_rows, launched.logits
        raw = None
        if processed:
            if any(item.seq.params.logprobs is not None for item in processed):
                raw = logits.clone()  # log-probs report the model's distribution, not the masked one
            # The host fills the grammar masks here, while the device runs the forward pass queued before.
            self.processors.apply(items, emit_rows, logits)
        return replace(launched, tokens=self._tokens(items, emit_rows, logits), raw_logits=raw)

    @staticmethod
    def _processed(items: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The items that sample with penalties, bias or a grammar."""
        return [item for item in items if item.samples and needs_processing(item.seq)]

    def _runs_head(self) -> bool:
        """Whether the MTP head runs (and keeps its cache): not when a drafter stands in for it entirely."""
        after_head = self.drafter is None or getattr(self.drafter, "after_head", False)
        return self.model.mtp is not None and after_head

    def _store_kv_ahead(
        self,
        items: list[ScheduledSeq],
        layout: SeqLayout,
        ids: torch.Tensor,
        tokens: torch.Tensor,
        emit_rows: list[list[int]],
        mtp_input: torch.Tensor,
    ) -> None:
        """Queue the MTP head's K/V for a step that verifies no drafts, pairing position p with token p + 1
        on the device: the step's next input, or, at a sequence's last position, the token it samples now
        (still on the device) or the next prompt token."""
        if ids.shape[0] == len(items) == tokens.shape[0] and all(len(rows) == 1 for rows in emit_rows):
            # A decode step: each sequence's one position pairs with the token its row samples now, so those
            # tokens are the head's input ids as they are (no gather, scatter or upload queued).
            self._mtp_store(tokens, mtp_input, self._mtp_layout(layout))
            return
        next_ids = torch.cat((ids[1:], ids.new_zeros(1)))  # [T] the flat batch's next input ids
        sampled_at, sampled_rows, known_at, known = [], [], [], []
        offset = 0
        for item, start, emitted in zip(items, layout.cu_seqlens[: len(items)], emit_rows, strict=True):
            last = start + item.num_tokens - 1
            if emitted:
                sampled_at.append(last)
                sampled_rows.append(offset)
            else:
                after = item.context + item.num_new
                known_at.append(last)
                known.append(max(item.seq.token_ids[after], 0) if after < item.seq.num_tokens else 0)
            offset += len(emitted)
        if sampled_at:
            next_ids[self._to_device(sampled_at)] = tokens[self._to_device(sampled_rows)]
        if known_at:
            next_ids[self._to_device(known_at)] = self._to_device(known)
        self._mtp_store(next_ids, mtp_input, self._mtp_layout(layout))

    def _mtp_store(self, ids: torch.Tensor, hidden: torch.Tensor, layout: SeqLayout) -> None:
        """The MTP head's K/V-only fill, from its graph where one fits."""
        if self.mtp_graphs is None or not self.mtp_graphs.run_store(layout, ids, hidden):
            self.model.mtp_store_kv(ids, hidden, layout, self.cache)

    def _mtp_pass(
        self, ids: torch.Tensor, hidden: torch.Tensor, layout: SeqLayout, step: int
    ) -> torch.Tensor:
        """The MTP head's normed output [T, H], from its graph where one fits (then a view of the graph's
        output, valid until its next replay)."""
        out = self.mtp_graphs.run_pass(layout, ids, hidden, step) if self.mtp_graphs is not None else None
        return out if out is not None else self.model.mtp_hidden(ids, hidden, layout, self.cache, step)

    @staticmethod
    def _mtp_layout(layout: SeqLayout) -> SeqLayout:
        """The step's layout without its verify states: the MTP head has only attention."""
        return SeqLayout(
            layout.query_lens, layout.context_lens, layout.slots, layout.block_tables, layout.block_size
        )

    def _decoding(self, items: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The step's sequences that will propose drafts for the next step (if its k is above 0)."""
        return [
            item
            for item in items
            if item.samples and not item.seq.finished and self._draft_count(item.seq, self.k) > 0
        ]

    @property
    def samples_late(self) -> bool:
        """Whether a step launched behind a deferred one may leave its sampling to `finish` (without
        speculation): then requests whose logits depend on their tokens (penalties, a grammar) can be
        deferred too, since the next step's changes wait for their tokens."""
        return not self.k and self.drafter is None

    def deferrable(self, launched: Launched) -> bool:
        """Whether the step's tokens can wait on the device: not with drafts to verify or propose (adaptive
        speculation defers its steps at k = 0), nor, speculating, when a request's next logits depend on its
        tokens on the host (penalties, a grammar). Log-probabilities are worked out on the device and read
        with the tokens (`defer`)."""
        if self.policy is None and (self.k or self.drafter is not None):
            return False
        if self.policy is not None and launched.next_k != 0:  # drafts to verify or to propose
            return False
        return all(
            self.samples_late or not needs_processing(item.seq) for item in launched.items if item.samples
        )

    @torch.inference_mode()
    def defer(self, launched: Launched) -> Readback:
        """Queue the step's log-probabilities (where asked for) and start copying them and its tokens to
        pinned host memory; `read` takes them once copied."""
        tokens = launched.tokens
        logprobs = self._step_logprobs(launched)
        if tokens.device.type != "cuda":
            return Readback(tokens, None, logprobs)
        host = _pinned(tokens)
        if logprobs is not None:
            logprobs = replace(
                logprobs, **{f: _pinned(getattr(logprobs, f)) for f in ("values", "ids", "chosen")}
            )
        ready = torch.cuda.Event()
        ready.record()
        return Readback(host, ready, logprobs)

    def _step_logprobs(self, launched: Launched) -> StepLogprobs | None:
        """The log-probabilities of a deferred step's rows whose requests ask for them, queued on the device
        from the model's logits (before penalties, bias and masks), or None."""
        if all(item.seq.params.logprobs is None for item in launched.items):
            return None  # the usual step: nothing more built
        rows, counts = [], []
        for item, row in zip(launched.items, launched.token_rows(), strict=True):
            if row is not None and item.seq.params.logprobs is not None:
                rows.append(row)
                counts.append(item.seq.params.logprobs)
        if not rows:  # the requests that ask sample nothing in this step (prefill chunks)
            return None
        raw = launched.raw_logits if launched.raw_logits is not None else launched.logits
        index = self._to_device(rows)  # not torch.tensor(..., device=): that would wait for the step
        top = top_logprobs(raw[index], launched.tokens[index], max(max(counts), 1))
        return StepLogprobs(rows, counts, *top)

    def read(self, launched: Launched, readback: Readback) -> list[Sampled]:
        """A deferred step's token per sequence that sampled, with its log-probabilities where asked for
        (waiting for this step's copy only: later steps keep running)."""
        if readback.ready is not None:
            readback.ready.synchronize()
        tokens = readback.host.tolist()
        entries: dict[int, tuple[dict[int, float]]] = {}
        lp = readback.logprobs
        if lp is not None:
            values, ids, chosen = lp.values.tolist(), lp.ids.tolist(), lp.chosen.tolist()
            for j, (row, k) in enumerate(zip(lp.rows, lp.counts, strict=True)):
                entries[row] = (logprob_entry(values[j], ids[j], chosen[j], tokens[row], k),)
        return [
            NOTHING if row is None else Sampled((tokens[row],), entries.get(row))
            for row in launched.token_rows()
        ]

    def _batch(
        self, items: list[ScheduledSeq], previous: Launched | None, nonblocking: bool
    ) -> tuple[SeqLayout, torch.Tensor, torch.Tensor | None]:
        """The step's layout, its input ids on the device, and the values of the drafts it verifies that are
        still on the device (None when it has none)."""
        ids: list[int] = []
        state_out: list[tuple[int, ...]] = []
        pending: list[tuple[int, int]] = []  # (flat position, row of the previous step's tokens)
        on_device: list[torch.Tensor] = []  # drafts still on the device (PENDING here), in item order
        draft_at: list[int] = []  # their flat positions
        rows = _rows_by_seq(previous)
        verifying = 0
        for item in items:
            seq = item.seq
            known = seq.token_ids[item.context : item.context + item.num_new]
            if known and known[-1] == PENDING:
                pending.append((len(ids) + len(known) - 1, rows[seq]))
            ids += known
            if item.drafts and item.drafts[0] == PENDING:
                draft_at += range(len(ids), len(ids) + len(item.drafts))
                on_device.append(seq.draft_on_device[: len(item.drafts)])
                ids += [0] * len(item.drafts)
            else:
                ids += item.drafts
            if item.drafts:
                base = self.plan.num_slots + verifying * self.k
                verifying += 1
                if base + len(item.drafts) > self.plan.total_slots:  # the policy keeps within the scratch
                    raise EngineError(f"{verifying} sequences verify drafts, past the plan's scratch slots")
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
        device_ids = self._ids(ids, pending, previous, nonblocking)
        if not on_device:
            return layout, device_ids, None
        drafted = torch.cat(on_device)
        device_ids[self._to_device(draft_at)] = drafted  # device to device: the host never read them
        return layout, device_ids, drafted

    def _ids(
        self, ids: list[int], pending: list[tuple[int, int]], previous: Launched | None, nonblocking: bool
    ) -> torch.Tensor:
        """The step's input ids on the device. Placeholders take the previous step's sampled tokens, device
        to device; with every input a placeholder in row order (a decode step), those tokens are the input."""
        if not pending:
            if nonblocking:  # the device may still be busy with the previous step: do not wait for it
                return self._to_device(ids)
            # Between steps the device is idle: a plain (synchronising) copy costs less than pinning.
            return torch.tensor(ids, dtype=torch.long, device=self.device)
        tokens = previous.tokens
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

    @torch.inference_mode()
    def sample(self, launched: Launched) -> list[Sampled]:
        """Read the step's tokens: per scheduled sequence, its next token, or its drafts kept and the token
        after them (committing the DeltaNet state of the accepted length), with log-probs where asked for."""
        items, emit_rows, logits = launched.items, launched.emit_rows, launched.logits
        raw = launched.raw_logits if launched.raw_logits is not None else logits
        verified = [list(item.drafts) for item in items]  # each item's drafts' values
        if launched.drafted is None:
            argmax = launched.tokens.tolist()
        else:  # drafts still on the device: read with the tokens, in one copy
            rows = launched.tokens.shape[0]
            both = torch.cat((launched.tokens, launched.drafted)).tolist()
            argmax, values = both[:rows], iter(both[rows:])
            verified = [[next(values) for _ in d] if d and d[0] == PENDING else d for d in verified]
        sampled: list[Sampled] = []
        commits: list[tuple[int, int]] = []
        offset = 0
        for index, (item, rows) in enumerate(zip(items, emit_rows, strict=True)):
            seq, block = item.seq, slice(offset, offset + len(rows))
            offset += len(rows)
            if not rows or seq.finished:  # finished: its end was read after this step was launched
                sampled.append(NOTHING)
                continue
            drafts = verified[index]
            if seq.params.greedy:
                targets = argmax[block]
                if self.force_targets is not None and drafts:
                    targets = self.force_targets(seq, drafts, targets)
                tokens = accept_greedy(targets, drafts)
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
            if drafts and self.policy is not None:
                self.policy.observe(seq, len(drafts), kept)
            if drafts and kept < len(drafts):
                # The state after the last accepted input is the verify step's kept[th] position.
                commits.append((launched.layout.state_out[index][kept], seq.slot))
            want = seq.params.logprobs
            lps = None
            if want is not None:  # slicing the logits costs microseconds per sequence: only when asked for
                lps = tuple(logprob_entries(raw[block][: len(tokens)], tokens, [want] * len(tokens)))
            sampled.append(Sampled(tuple(tokens), lps, kept))
        self.cache.copy_slots([a for a, _ in commits], [b for _, b in commits])
        return sampled

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

    @torch.inference_mode()
    def draft(self, launched: Launched, sampled: list[Sampled]) -> list[Drafts | None]:
        """Fill the MTP head's KV for this step's positions and propose the next drafts, per scheduled
        sequence (None: none proposed). Runs once the scheduler appended `sampled`: drafts follow them."""
        items, layout = launched.items, launched.layout
        accepted = [got.accepted for got in sampled]
        proposed: list[Drafts | None] = [None] * len(items)
        if launched.filled:  # k = 0, the head's K/V queued at launch
            return proposed
        will = {id(item) for item in self._decoding(items)}
        decoding = [(i, item) for i, item in enumerate(items) if id(item) in will]
        k = launched.next_k
        if k is None:  # a verify step: chosen now that its acceptance is known
            k = self._step_k([item.seq for _, item in decoding])
        wanting = decoding if k else []
        after_head = self.drafter is not None and getattr(self.drafter, "after_head", False)
        if self.drafter is not None and not (after_head and self.model.mtp is not None):
            return self._stand_in(wanting, proposed, k)
        if self.model.mtp is None:
            return proposed
        # Position p's MTP input pairs the main model's hidden state at p with the token at p + 1.
        next_ids = []
        for item in items:
            tokens = item.seq.token_ids
            for j in range(item.num_tokens):
                p = item.context + j + 1
                next_ids.append(tokens[p] if p < len(tokens) else 0)  # past the accepted run: rewritten later
        mtp_layout = self._mtp_layout(layout)
        if not wanting:  # nothing to draft: only the head's K/V, so that later drafts read no holes
            self._mtp_store(self._to_device(next_ids), launched.mtp_input, mtp_layout)
            return proposed
        h = self._mtp_pass(self._to_device(next_ids), launched.mtp_input, mtp_layout, 0)
        rows = [layout.cu_seqlens[i] + item.num_new - 1 + accepted[i] for i, item in wanting]
        seqs = [item.seq for _, item in wanting]
        counts = [self._draft_count(s, k) for s in seqs]
        positions = [item.context + item.num_new - 1 + accepted[i] for i, item in wanting]
        hidden = h[self._to_device(rows)]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        steps: list[torch.Tensor] = []  # [B] per draft step: each feeds the next on the device
        vocab = self.model.vocab_rows  # the verify step's logits' width: draft distributions padded to it
        for step in range(max(counts)):
            logits = self.model.draft_logits(hidden)
            tokens = self._pick_drafts(seqs, logits, probs, vocab)
            steps.append(tokens)
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
            hidden = self._mtp_pass(tokens, hidden, step_layout, step + 1)
        if after_head:
            return self._stand_in(wanting, proposed, k)
        stacked = torch.stack(steps, dim=1)  # [B, k]
        # The drafts stay on the device, as the next step's input ids, read with its tokens: the host
        # launches it without waiting for the drafting. Masks and penalties need them on the host now.
        host = stacked.tolist() if any(needs_processing(s) for s in seqs) else None
        for b, (i, item) in enumerate(wanting):
            q = None if item.seq.params.greedy else torch.stack(probs[b][: counts[b]])
            if host is not None:
                proposed[i] = Drafts(tuple(host[b][: counts[b]]), q)
            else:
                proposed[i] = Drafts((PENDING,) * counts[b], q, stacked[b, : counts[b]])
        return proposed

    def _stand_in(
        self, wanting: list[tuple[int, ScheduledSeq]], proposed: list[Drafts | None], k: int
    ) -> list[Drafts | None]:
        """The drafter's tokens in place of the head's (a point mass each: no distribution)."""
        for i, item in wanting:
            count = self._draft_count(item.seq, k)
            proposed[i] = Drafts(tuple(self.drafter(item.seq, count))[:count])
        return proposed

    def _step_k(self, seqs: list[Sequence]) -> int:
        """The next step's drafts per sequence: k, or the policy's choice for these decoding sequences."""
        if self.policy is None or not seqs:
            return self.k if seqs else 0
        return self.policy.choose(seqs, sum(s.num_tokens for s in seqs) / len(seqs))

    @staticmethod
    def _draft_count(seq: Sequence, k: int) -> int:
        """Drafts worth proposing: at most k, and fewer near max_tokens or the context limit."""
        left = seq.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - len(seq.output_ids))
        return max(0, min(k, left - 1))

    @staticmethod
    def _pick_drafts(
        seqs: list[Sequence], logits: torch.Tensor, probs: list[list[torch.Tensor]], vocab: int
    ) -> torch.Tensor:
        """One draft per sequence, on the device [B] (nothing read by the host): the argmax, or for a sampled
        request a draw from its filtered distribution, kept in `probs` (over `vocab` tokens: 0 past a limited
        draft vocabulary, which proposes none there) for rejection sampling."""
        tokens = logits.argmax(-1)
        for b, seq in enumerate(seqs):
            if not seq.params.greedy:
                q = filtered_probs(logits[b], seq.params)
                tokens[b] = torch.multinomial(q, 1, generator=seq.generator)[0]
                probs[b].append(torch.nn.functional.pad(q, (0, vocab - q.shape[-1])))
        return tokens


def _rows_by_seq(launched: Launched | None) -> dict[Sequence, int]:
    """Each sequence that sampled in `launched`, with its row in `launched.tokens`."""
    if launched is None:
        return {}
    rows = zip(launched.items, launched.token_rows(), strict=True)
    return {item.seq: row for item, row in rows if row is not None}


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of the CUDA tensor t, queued on the current stream (complete at its next event)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
