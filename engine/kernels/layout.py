"""How a flat batch of tokens splits into sequences, and where each sequence's cached state lives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

# A sequence whose step adds at most this many tokens goes through the batched short path of the
# reference kernels (decode, MTP verify); longer ones are handled one sequence at a time.
SHORT_QUERY = 8


@dataclass(frozen=True)
class SeqLayout:
    """Per-sequence metadata of a flat token batch.

    Sequence `i` owns tokens `cu_seqlens[i]:cu_seqlens[i+1]` of the batch, has `context_lens[i]` tokens
    already in its cache (0 means it starts from empty state), keeps its DeltaNet state in slot `slots[i]`
    and its keys/values in the KV blocks `block_tables[i]` (position p lives in block
    `block_tables[i][p // block_size]`, row `p % block_size`).

    `state_out`, when given, names for a sequence one slot per new token: the DeltaNet state after that
    token is written there (the MTP verify step keeps every position's state and commits the one the
    accepted length picks). Where it is empty or absent, the state after the last token goes back to
    `slots[i]`. Only short sequences (at most SHORT_QUERY new tokens) may ask for per-token states.

    `kv_capacity`, when set, bounds every sequence's keys (context + new tokens) for the kernels' launch
    choices (split-KV): a CUDA graph fixes those choices at capture, so they may not follow the contexts.

    Kernels build their metadata tensors through `cached(key, device, build)`, where `build(layout)` makes
    the host tensor: a CUDA graph captured with one layout refills those same tensors from the next
    layout of the same shape (`refill_from`) before each replay.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    slots: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...] | None = None
    block_size: int = 0
    state_out: tuple[tuple[int, ...], ...] | None = None
    kv_capacity: int | None = None
    _tensors: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _builders: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _packed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not len(self.query_lens) == len(self.context_lens) == len(self.slots):
            raise ValueError("query_lens, context_lens and slots must have one entry per sequence")
        if any(n <= 0 for n in self.query_lens):
            raise ValueError("every sequence in a batch needs at least one new token")
        if self.block_tables is not None:
            if len(self.block_tables) != self.num_seqs or self.block_size <= 0:
                raise ValueError("block_tables needs one table per sequence and a positive block_size")
            for table, c, n in zip(self.block_tables, self.context_lens, self.query_lens, strict=True):
                if len(table) * self.block_size < c + n:
                    raise ValueError(f"a block table of {len(table)} blocks cannot hold {c + n} positions")
        if self.state_out is not None and any(
            len(s) not in (0, n) for s, n in zip(self.state_out, self.query_lens, strict=True)
        ):
            raise ValueError("state_out needs, per sequence, one slot per new token or none")

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
    def short_seqs(self) -> tuple[int, ...]:
        """Sequences adding at most SHORT_QUERY tokens (batched together by the reference kernels)."""
        return tuple(i for i, n in enumerate(self.query_lens) if n <= SHORT_QUERY)

    @cached_property
    def long_seqs(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.query_lens) if n > SHORT_QUERY)

    def cached(self, key, device, build: Callable[[SeqLayout], torch.Tensor]) -> torch.Tensor:
        """The device tensor `build(self)` makes, built once per key and device."""
        device = torch.device(device)
        found = self._tensors.get((key, device))
        if found is None:
            found = self._tensors[(key, device)] = build(self).to(device)
            self._builders[(key, device)] = build
        return found

    def pack(self, device: torch.device | str) -> None:
        """Move every tensor built so far for `device` into one device buffer, as views, beside a host
        twin (pinned on CUDA), so that `refill_from` fills them all with one transfer. For a CUDA graph's
        metadata: call it before the capture, so the graph reads the views."""
        device = torch.device(device)
        keys = [k for k in self._tensors if k[1] == device]
        offsets, size = [], 0
        for k in keys:
            offsets.append(size)
            size += -(-self._tensors[k].nbytes // 16) * 16  # 16-byte aligned slices suit every dtype
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        views = {}
        for k, start in zip(keys, offsets, strict=True):
            tensor = self._tensors[k].contiguous()
            view = buffer[start : start + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            self._tensors[k] = view
            views[k] = host[start : start + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        done = torch.cuda.Event() if device.type == "cuda" else None  # the last transfer from `host`
        self._packed[device] = (buffer, host, views, done)

    def refill_from(self, other: SeqLayout) -> None:
        """Overwrite, in place, every tensor this layout has built with what `other` builds for the same key
        (a CUDA graph's captured metadata, for the next step). Shapes must match. Packed tensors (`pack`) go
        through their host twin and one copy per device."""
        for _, _, _, done in self._packed.values():
            if done is not None:
                done.synchronize()  # the previous transfer has read the host twin (returns at once if so)
        for (key, device), tensor in self._tensors.items():
            fresh = self._builders[(key, device)](other)
            if fresh.shape != tensor.shape:
                shapes = f"{tuple(fresh.shape)} != {tuple(tensor.shape)}"
                raise ValueError(f"layout tensor {key!r}: shape {shapes}")
            packed = self._packed.get(device)
            if packed is not None and (key, device) in packed[2]:
                packed[2][(key, device)].copy_(fresh)
            else:
                tensor.copy_(fresh, non_blocking=True)
        for buffer, host, _, done in self._packed.values():
            buffer.copy_(host, non_blocking=True)
            if done is not None:
                done.record()

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[T] position of each token within its sequence."""
        return self.cached(
            "positions",
            device,
            lambda lay: torch.tensor(
                [c + j for c, n in zip(lay.context_lens, lay.query_lens, strict=True) for j in range(n)],
                dtype=torch.long,
            ),
        )

    def kv_index(self, positions: list[int], seq: int) -> list[int]:
        """Flat row (block * block_size + offset) of each position of sequence `seq` in a paged KV pool."""
        if self.block_tables is None:
            raise ValueError("this layout has no block tables, so it cannot address a paged KV cache")
        table, bs = self.block_tables[seq], self.block_size
        return [table[p // bs] * bs + p % bs for p in positions]

    def slot_mapping(self, device: torch.device | str) -> torch.Tensor:
        """[T] flat KV row each new token is written to."""

        def build(lay: SeqLayout) -> torch.Tensor:
            rows = []
            for i, (c, n) in enumerate(zip(lay.context_lens, lay.query_lens, strict=True)):
                rows += lay.kv_index(list(range(c, c + n)), i)
            return torch.tensor(rows, dtype=torch.long)

        return self.cached("slot_mapping", device, build)

    def keeps_states(self, seq: int) -> bool:
        """Sequence `seq` writes its state after every new token to `state_out[seq]`."""
        return self.state_out is not None and bool(self.state_out[seq])
