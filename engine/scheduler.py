"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step stays within `max_num_batched_tokens` tokens and `max_num_seqs` sequences, except that a prompt
being prefilled alone (no other request running or waiting) takes chunks of up to `long_prefill_chunk`
tokens: fewer, larger steps, and nobody's latency to lose. Running sequences
go first, most urgent first (lower priority value, then earlier arrival): a decode adds its last token
plus its MTP drafts, a prompt still being prefilled adds its next chunk. Then waiting requests are
admitted while a slot, the token budget and KV blocks allow; admission waits rather than over-commit.
A running sequence that needs a block when none is free takes one from the least urgent running
sequence, which is preempted: its slot and blocks are freed and it is recomputed from scratch later.

The scheduler never computes on tensors: it hands the runner a `SchedulerOutput` (which sequences, how many
tokens, which slot and block copies to make first) and takes back, per scheduled sequence, the tokens the
step sampled (`Sampled`, appended by `apply`) and any new drafts (`Drafts`, kept by `set_drafts`); `update`
then advances each sequence by its computed tokens and accepted drafts.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.allocator import BlockAllocator, SlotAllocator
from engine.prefix import PrefixCache, PrefixEntry
from engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    context: int  # tokens already cached
    num_new: int  # known tokens computed this step: seq.token_ids[context : context + num_new]
    drafts: tuple[int, ...] = ()  # MTP drafts verified after them
    # This step reaches the end of the known tokens, so it yields the next one (fixed when scheduled:
    # its tokens are appended afterwards).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.compute_target is None and self.context + self.num_new == self.seq.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_new + len(self.drafts)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    slot_copies: list[tuple[int, int]] = field(default_factory=list)  # (from, to) before the step
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (cache too small)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(frozen=True)
class Sampled:
    """What one scheduled sequence got from a step: tokens to append (the drafts kept, then one more), their
    log-probabilities where the request asks for them, and how many drafts were kept. No tokens: the step
    did not sample for it (a prefill chunk, or a request that had already ended)."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[dict[int, float], ...] | None = None
    accepted: int = 0


NOTHING = Sampled()


@dataclass(frozen=True)
class Drafts:
    """The next drafts proposed for a sequence, and the distributions they were drawn from."""

    ids: tuple[int, ...]
    probs: torch.Tensor | None = None  # [len(ids), V] for sampled requests; None: greedy, or a fixed drafter
    # [len(ids)] int64 on the device: the drafts' values, where `ids` are PENDING placeholders (the MTP
    # head's drafts stay on the device; the next step takes them as input ids and reads them with its tokens)
    on_device: torch.Tensor | None = None


class Scheduler:
    def __init__(
        self,
        slots: SlotAllocator,
        blocks: BlockAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int = 0,
        max_prefixes: int = 4,
        long_prefill_chunk: int = 0,
    ) -> None:
        self.slots = slots
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_chunk = long_prefill_chunk  # at most max_num_batched_tokens: off
        self.k = num_speculative_tokens
        self.prefixes = PrefixCache(max_prefixes, slots, blocks)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- requests in and out

    def add(self, seq: Sequence) -> None:
        if seq.prefix is not None:
            self.prefixes.add_user(seq.prefix.key)
        self._enqueue(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, freeing what it holds."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._release_prefix_user(seq)
        elif seq in self.running:
            self._finish(seq)
        if seq.compute_target is not None:
            self._abandon_prefix(seq.prefix.key, share=True)

    def _abandon_prefix(self, key: tuple[int, ...], share: bool) -> None:
        """Forget an entry whose filler is gone. Its waiting users queue a new filler or, when the prefix
        cannot be cached (`share` False), compute it themselves."""
        entry = self.prefixes.entries.get(key)
        if entry is not None and not entry.ready:
            self.prefixes.drop(key)
        if not share:
            for seq in self.waiting:
                if seq.prefix is not None and seq.prefix.key == key:
                    self.prefixes.remove_user(key)
                    seq.prefix = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_user_running(self) -> int:
        return sum(1 for s in self.running if s.compute_target is None)

    @property
    def num_user_waiting(self) -> int:
        return sum(1 for s in self.waiting if s.compute_target is None)

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_order)  # after equal keys: arrival order holds

    def _release_prefix_user(self, seq: Sequence) -> None:
        if seq.prefix is not None and seq.compute_target is None:
            self.prefixes.remove_user(seq.prefix.key)

    def _finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        self._release_prefix_user(seq)

    def finish(self, seq: Sequence) -> bool:
        """Release a request that ended when its tokens were read after its step (asynchronous scheduling):
        it may still be running, or waiting after a preemption. False if it was no longer held (aborted)."""
        if seq in self.running:
            self._finish(seq)
            return True
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._release_prefix_user(seq)
            return True
        return False

    def _free(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.slots.free(seq.slot)
        self.blocks.free(seq.blocks)
        seq.slot, seq.blocks = None, []

    # ---- one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._budget()
        self.running.sort(key=_order)
        done: set[int] = set()  # ids of sequences scheduled this step (never preempted by it)
        for seq in list(self.running):
            if seq not in self.running:  # preempted while making room for a more urgent one
                continue
            if budget <= 0:
                break
            if seq.exhausted:  # its last token is still on the device and ends it (asynchronous scheduling)
                continue
            remaining = seq.target - seq.num_computed
            num_new = min(remaining, budget)
            drafts = tuple(seq.draft_ids[: budget - 1]) if remaining == 1 else ()
            if not self._grow(
                seq, seq.num_computed + num_new + len(drafts) + self._lookahead(seq), done, out
            ):
                continue
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, num_new, drafts))
            done.add(id(seq))
            budget -= num_new + len(drafts)
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _budget(self) -> int:
        """The step's tokens: `long_prefill_chunk` when the one request held is a prompt with more than
        `max_num_batched_tokens` tokens left to prefill, else `max_num_batched_tokens`. Never while another
        request decodes or waits: a longer step would delay its tokens."""
        budget = self.max_num_batched_tokens
        if self.long_prefill_chunk <= budget or len(self.running) + len(self.waiting) != 1:
            return budget
        seq = (self.running or self.waiting)[0]
        return self.long_prefill_chunk if seq.target - seq.num_computed > budget else budget

    def _lookahead(self, seq: Sequence) -> int:
        """Positions past the step's tokens the MTP head may write while drafting."""
        return self.k if self.k and seq.compute_target is None else 0

    def _grow(self, seq: Sequence, positions: int, done: set[int], out: SchedulerOutput) -> bool:
        """Give `seq` blocks for `positions` positions, preempting less urgent sequences if needed."""
        need = self.blocks.blocks_for(positions) - len(seq.blocks)
        while need > self.blocks.num_free:
            if self.prefixes.evict_one():
                continue
            victims = [s for s in self.running if id(s) not in done]
            victim = victims[-1]  # the least urgent not yet scheduled; may be `seq` itself
            if victim is seq and len(self.running) == 1 and seq.compute_target is not None:
                # A prefix too long for the cache: give up sharing it; its requests compute it themselves.
                log.warning("a shared prefix of %d tokens does not fit the KV cache; not shared", seq.target)
                self.running.remove(seq)
                self._free(seq)
                self._abandon_prefix(seq.prefix.key, share=False)
                return False
            if victim is seq and len(self.running) == 1 and seq.num_pending:
                return False  # end it once its last token is read, so the output keeps that token
            if victim is seq and len(self.running) == 1:
                # Alone and still out of room: the cache cannot hold this sequence any longer.
                log.warning(
                    "request %s ends early: the KV cache cannot hold %d positions", seq.index, positions
                )
                seq.force_finish("length")
                self._finish(seq)
                out.finished.append(seq)
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        if need > 0:
            seq.blocks += self.blocks.allocate(need)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.clear_drafts()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self._enqueue(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        i = 0
        while i < len(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            seq = self.waiting[i]
            entry = self._prefix_entry(seq)
            if entry is not None and not entry.ready:
                if entry.filler is self.waiting[i]:
                    continue  # just queued, right ahead of `seq`: admit the filler first
                i += 1
                continue  # its prefix is being computed
            if not self.slots.num_free and not self.prefixes.evict_one():
                return
            start = entry.num_tokens if entry is not None else 0
            num_new = min(seq.target - start, budget)
            shared = entry.blocks[: entry.num_tokens // self.blocks.block_size] if entry else []
            need = self.blocks.blocks_for(start + num_new + self._lookahead(seq)) - len(shared)
            while need > self.blocks.num_free and self.prefixes.evict_one():
                pass
            if need > self.blocks.num_free or not self.slots.num_free:
                return  # wait for room
            self.waiting.pop(i)
            seq.slot = self.slots.allocate()
            if entry is not None:
                self.blocks.share(shared)
                seq.blocks = list(shared)
                out.slot_copies.append((entry.slot, seq.slot))
                seq.num_computed = start
                seq.metrics.cached_prefix_tokens = start
            fresh = self.blocks.allocate(need)
            if entry is not None and len(entry.blocks) > len(shared):
                out.block_copies.append((entry.blocks[len(shared)], fresh[0]))  # the partial last block
            seq.blocks += fresh
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, start, num_new))
            budget -= num_new

    def _prefix_entry(self, seq: Sequence) -> PrefixEntry | None:
        """The ready or filling entry for a request starting fresh with a prefix (queueing its filler)."""
        if seq.prefix is None or seq.num_computed or seq.compute_target is not None:
            return None
        key = seq.prefix.key
        entry = self.prefixes.get(key)
        if entry is None:
            filler = seq.prefix_filler()
            entry = self.prefixes.start(key, filler)
            if entry is None:
                return None  # no room for another entry: compute this one in full
            self._enqueue(filler)
        return entry

    # ---- after the step

    def apply(self, out: SchedulerOutput, sampled: list[Sampled]) -> int:
        """Append each scheduled sequence's sampled tokens, running the stop checks on each (the tokens after
        one that ends the request are dropped); returns how many were appended."""
        appended = 0
        for item, got in zip(out.scheduled, sampled, strict=True):
            if not got.tokens:
                continue
            seq = item.seq
            if item.drafts:
                seq.metrics.accepted_lengths.append(got.accepted)
                seq.metrics.num_draft_tokens += len(item.drafts)
            logprobs = got.logprobs or (None,) * len(got.tokens)
            for token, lp in zip(got.tokens, logprobs, strict=True):
                seq.append(token, lp)
                appended += 1
                if seq.finished:
                    break
            seq.clear_drafts()
        return appended

    def set_drafts(self, out: SchedulerOutput, drafts: list[Drafts | None]) -> None:
        """Keep the drafts proposed for the next step (None: nothing proposed for that sequence)."""
        for item, proposed in zip(out.scheduled, drafts, strict=True):
            if proposed is not None:
                seq = item.seq
                seq.draft_ids, seq.draft_probs = list(proposed.ids), proposed.probs
                seq.draft_on_device = proposed.on_device

    def update(self, out: SchedulerOutput, accepted: list[int]) -> list[Sequence]:
        """Advance each scheduled sequence by its computed tokens (and `accepted` drafts); free the finished.

        Returns the user requests that finished in this step (and those the scheduler ended).
        """
        finished = list(out.finished)
        for item, extra in zip(out.scheduled, accepted, strict=True):
            seq = item.seq
            seq.num_computed = item.context + item.num_new + extra
            if seq.compute_target is not None and seq.num_computed >= seq.compute_target:
                self.running.remove(seq)
                self.prefixes.filled(self.prefixes.entries[seq.prefix.key])
            elif seq.finished and seq in self.running:  # not if its end was already read and released
                self._finish(seq)
                finished.append(seq)
        return finished


def _order(seq: Sequence) -> tuple[int, int, int]:
    # A prefix filler runs just ahead of the request that queued it.
    return (*seq.sort_key, 0 if seq.compute_target is not None else 1)
