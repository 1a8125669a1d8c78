"""Reasoning blocks of Qwen3-style models: `<think> reasoning </think> answer`.

Qwen3.5's chat template opens `<think>` at the generation prompt when thinking is on, so the output starts
inside the block and holds only its end; with thinking off the prompt already holds an empty, closed block
and the output is the answer. vLLM's `qwen3` reasoning parser splits the text at `</think>`; here the split
is on token ids (the tags are single tokens in Qwen's vocabulary, special or not, so it holds whether or not
the decoding skips special tokens), and it also knows whether the prompt left a block open: an output that
ends before `</think>` is then all reasoning, cut off, rather than an answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.tokenizer import Tokenizer

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """An output's reasoning and answer token ids. `reasoning` is None when the output had no reasoning
    block; `finished` is False when generation stopped inside one (before its answer)."""

    reasoning: list[int] | None
    answer: list[int]
    finished: bool = True


@dataclass(frozen=True)
class ThinkTokens:
    """The ids of `<think>` and `</think>` in a vocabulary."""

    start: int
    end: int

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> ThinkTokens | None:
        """The tokenizer's think tags, or None when it has no single token for each."""
        if tokenizer is None:
            return None
        start, end = tokenizer.backend.token_to_id(START), tokenizer.backend.token_to_id(END)
        return None if start is None or end is None else cls(start, end)

    def opens(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves a reasoning block open: its last `<think>` comes after its last
        `</think>` (the generation prompt of a template with thinking on)."""
        last_start = _last(prompt_ids, self.start)
        return last_start >= 0 and last_start > _last(prompt_ids, self.end)

    def split(self, output_ids: list[int], opened: bool) -> ReasoningSplit:
        """Reasoning and answer of `output_ids` (without the token that stopped generation): before and
        after the first `</think>`, a leading `<think>` dropped; with no `</think>`, all reasoning when the
        prompt opened a block (`opened`) or the output opened one itself, else all answer."""
        ids = list(output_ids)
        began = bool(ids) and ids[0] == self.start
        if self.end in ids:
            at = ids.index(self.end)
            return ReasoningSplit(ids[int(began) : at], ids[at + 1 :], True)
        if opened or began:
            return ReasoningSplit(ids[int(began) :], [], False)
        return ReasoningSplit(None, ids, True)


def _last(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
