"""A request while it generates: its tokens so far, where its state lives, and the stop checks."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.outputs import RequestMetrics, RequestOutput
from engine.reasoning import ReasoningSplit, ThinkTokens
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.grammar import GrammarState

log = logging.getLogger(__name__)

# Stands in `token_ids` / `output_ids` for a token the device has sampled and the host has not read yet.
PENDING = -1


@dataclass(frozen=True)
class PrefixSpec:
    """The first `len(token_ids)` prompt tokens are a prefix other requests share (cached once)."""

    key: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.key)


class Sequence:
    """One request inside the engine.

    `token_ids` is prompt + output so far; `num_computed` of them are in the cache (slot `slot`, KV
    blocks `blocks`). A step computes `token_ids[num_computed:]` (or a chunk of it) plus any `draft_ids`
    the MTP head proposed; when it reaches the end, the next token is sampled.

    The runner never changes a sequence: the scheduler `append`s the tokens a step sampled. With
    asynchronous scheduling (`AsyncEngineCore`) the next step is planned before the host reads this step's
    tokens: each such token is `reserve`d as a PENDING placeholder (counted, so the scheduler plans around
    it; its value goes from device to device into the next step's input) and later `resolve`d, oldest
    first, which runs the stop checks. `num_pending` placeholders are always the last tokens.

    `think` (the vocabulary's `<think>`/`</think>` ids) splits the output into reasoning and answer; when
    the prompt leaves a block open the request starts `in_reasoning`. `grammar` (a constrained request's
    matcher) advances over the answer's tokens only, and a completed grammar ends the request.
    """

    def __init__(
        self,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        stop_ids: set[int],
        tokenizer: Tokenizer | None,
        max_model_len: int,
        device: torch.device,
        priority: int = 0,
        prefix: PrefixSpec | None = None,
        arrival: int = 0,
        *,
        grammar: GrammarState | None = None,
        think: ThinkTokens | None = None,
    ) -> None:
        self.index = index
        self.device = device
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.token_ids = list(prompt_ids)
        self.params = params
        self.priority = priority
        self.prefix = prefix
        self.arrival = arrival  # submission order, ties broken by it
        self.num_computed = 0
        self.slot: int | None = None
        self.blocks: list[int] = []
        self.draft_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None  # [len(draft_ids), V] for sampled requests
        self.draft_on_device: torch.Tensor | None = None  # PENDING draft_ids' values (`Drafts.on_device`)
        self.num_preemptions = 0
        self.compute_target: int | None = None  # a prefix fill stops computing here and never samples
        self.metrics = RequestMetrics(prompt_tokens=len(prompt_ids), arrival_time=time.monotonic())
        self.stop_ids = stop_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.output_ids: list[int] = []
        self.num_pending = 0  # trailing PENDING placeholders in token_ids and output_ids
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text: str | None = None
        self.grammar = grammar
        self.think = think
        self.reasoning_opened = think is not None and think.opens(prompt_ids)
        self.in_reasoning = self.reasoning_opened  # the answer (and the grammar) starts after `</think>`
        self.answer_start: int | None = None if self.in_reasoning else 0  # index into output_ids
        self.split = ReasoningSplit(None, [])
        self.reasoning_tokens = 0
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: the request's priority, then its arrival."""
        return (self.priority, self.arrival)

    @property
    def target(self) -> int:
        """Tokens to have in the cache before the next sample (all known tokens, or the prefix fill's)."""
        return self.num_tokens if self.compute_target is None else self.compute_target

    @property
    def exhausted(self) -> bool:
        """Its tokens, placeholders included, reach max_tokens or the context: nothing more to compute."""
        return self.num_tokens >= self.max_model_len or len(self.output_ids) >= (
            self.params.max_tokens or self.max_model_len
        )

    def clear_drafts(self) -> None:
        """Drop the drafts proposed for the next step (appended, or preempted)."""
        self.draft_ids, self.draft_probs, self.draft_on_device = [], None, None

    def reserve(self) -> None:
        """Count a token sampled on the device that the host has not read yet: a PENDING placeholder."""
        self.token_ids.append(PENDING)
        self.output_ids.append(PENDING)
        self.num_pending += 1

    def resolve(self, token: int, logprobs: dict[int, float] | None) -> None:
        """Replace the oldest placeholder with its token and run the stop checks on it. Placeholders after it
        (tokens of a step already launched) stay, unless this token ends the request: then they are dropped,
        and their step's tokens are discarded when it is resolved."""
        later = self.num_pending - 1
        del self.token_ids[-self.num_pending :], self.output_ids[-self.num_pending :]
        self.num_pending = 0
        self.append(token, logprobs)
        for _ in range(later if not self.finished else 0):
            self.reserve()

    def append(self, token: int, logprobs: dict[int, float] | None) -> None:
        """Record a generated token and decide whether the request is done."""
        if not self.output_ids:
            self.metrics.first_token_time = time.monotonic()
        self.output_ids.append(token)
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        grammar_done = self._advance_answer(token)
        # The grammar's end is an EOS: a stop token even under ignore_eos (which keeps it out of stop_ids).
        if token in self.stop_ids or (grammar_done and token in self.grammar.compiler.stop_ids):
            self._finish("stop", token)
        elif grammar_done:  # the answer is complete: this token is its last, not a stop token
            self._finish("stop", None, keep_last=True)
        elif self.params.stop_strings and self._hit_stop_string():
            pass
        elif self.exhausted:
            self._finish("length", None)

    def _advance_answer(self, token: int) -> bool:
        """Track the reasoning block and advance the grammar over answer tokens; True when nothing may
        follow in the grammar (only a stop token would) or it refuses the token: either ends the request."""
        if self.in_reasoning:
            if self.think is not None and token == self.think.end:
                self.in_reasoning = False
                self.answer_start = len(self.output_ids)
            return False
        if self.grammar is None:
            return False
        if not self.grammar.accept(token):  # masked logits cannot pick it: a bug, not the request's fault
            log.error("request %d: token %d is outside its grammar; ending it", self.index, token)
            return True
        return self.grammar.done

    def force_finish(self, reason: str) -> None:
        """End the request now (the engine could not continue it), keeping what it generated."""
        if not self.finished:
            self.finish_reason, self.stop_reason = reason, None
            self._set_texts(self.output_ids)

    def prefix_filler(self) -> Sequence:
        """An internal sequence that computes this request's shared prefix (all but its last token)."""
        assert self.prefix is not None
        filler = Sequence(
            -1,
            list(self.prefix.key),
            self.params,
            None,
            set(),
            None,
            self.max_model_len,
            self.device,
            priority=self.priority,
            prefix=self.prefix,
            arrival=self.arrival,
        )
        filler.compute_target = self.prefix.length - 1
        return filler

    def _hit_stop_string(self) -> bool:
        """Stop strings end the answer: they are looked for after any reasoning block."""
        if self.answer_start is None:
            return False
        text = self._decode(self.output_ids[self.answer_start :])
        longest = max(len(s) for s in self.params.stop_strings)
        # Only the tail can hold a newly completed stop string; the earliest match in it wins.
        tail_start = max(0, len(text) - longest - 8)
        hits = [(i, s) for s in self.params.stop_strings if (i := text.find(s, tail_start)) >= 0]
        if not hits:
            return False
        cut, which = min(hits)
        self._set_texts(self.output_ids)
        self.text = text[:cut]
        self.finish_reason, self.stop_reason = "stop", which
        return True

    def _finish(self, reason: str, stop_reason: int | str | None, keep_last: bool = False) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self._set_texts(self.output_ids[:-1] if reason == "stop" and not keep_last else self.output_ids)

    def _set_texts(self, ids: list[int]) -> None:
        """Split `ids` (the output without its stop token) into reasoning and answer; `text` is the
        answer's decoding."""
        self.split = self.think.split(ids, self.reasoning_opened) if self.think else ReasoningSplit(None, ids)
        self.text = self._decode(self.split.answer)
        self.reasoning_tokens = len(ids) - len(self.split.answer) if self.split.reasoning is not None else 0

    def _decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def to_output(self) -> RequestOutput:
        m = self.metrics
        m.generated_tokens = len(self.output_ids)
        m.finish_time = m.finish_time or time.monotonic()
        m.num_preemptions = self.num_preemptions
        return RequestOutput(
            index=self.index,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.text,
            finish_reason=self.finish_reason or "length",
            stop_reason=self.stop_reason,
            logprobs=self.logprobs if self.params.logprobs is not None else None,
            metrics=m,
            reasoning=self._decode(self.split.reasoning) if self.split.reasoning is not None else None,
            reasoning_tokens=self.reasoning_tokens,
            reasoning_finished=self.split.finished,
            token_texts=self._token_texts() if self.params.logprobs is not None else None,
        )

    def _token_texts(self) -> dict[int, str] | None:
        """Each token of the output and of its log-probability entries, decoded alone (special tokens
        shown), for OpenAI's `logprobs.content[].token`."""
        if self.tokenizer is None:
            return None
        ids = set(self.output_ids) | {t for entry in self.logprobs for t in entry}
        return {t: self.tokenizer.decode([t], skip_special_tokens=False) for t in sorted(ids) if t >= 0}
