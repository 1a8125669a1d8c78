"""How a flat batch of tokens splits into sequences, and where each sequence's cached state lives."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class SeqLayout:
    """Per-sequence metadata of a flat token batch.

    Sequence `i` owns tokens `cu_seqlens[i]:cu_seqlens[i+1]` of the batch, has `context_lens[i]` tokens
    already in its cache (0 means it starts from empty state) and keeps its state in cache slot `slots[i]`.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.query_lens) == len(self.context_lens) == len(self.slots):
            raise ValueError("query_lens, context_lens and slots must have one entry per sequence")
        if any(n <= 0 for n in self.query_lens):
            raise ValueError("every sequence in a batch needs at least one new token")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @cached_property
    def cu_seqlens(self) -> tuple[int, ...]:
        offsets = [0]
        for n in self.query_lens:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)

    @cached_property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (the batched single-step path)."""
        return all(n == 1 for n in self.query_lens)

    @cached_property
    def last_token_index(self) -> tuple[int, ...]:
        """Index in the flat batch of each sequence's last new token."""
        return tuple(end - 1 for end in self.cu_seqlens[1:])

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[T] position of each token within its sequence."""
        parts = [torch.arange(c, c + n) for c, n in zip(self.context_lens, self.query_lens, strict=True)]
        return torch.cat(parts).to(device)

    def slot_tensor(self, device: torch.device | str) -> torch.Tensor:
        return torch.tensor(self.slots, dtype=torch.long, device=device)

    def context_tensor(self, device: torch.device | str) -> torch.Tensor:
        return torch.tensor(self.context_lens, dtype=torch.long, device=device)
