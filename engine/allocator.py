"""Bookkeeping of which cache slots and KV blocks are in use (host-side, no tensors).

Blocks are reference-counted: a shared prefix's full blocks are held by the prefix entry and by every
sequence that starts from it, and return to the free list when the last holder lets go.
"""

from __future__ import annotations


class SlotAllocator:
    """Slots 0..num_slots-1, handed out lowest first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"slot {slot} is not in use")
        self._free.append(slot)


class BlockAllocator:
    """KV blocks 0..num_blocks-1 with reference counts."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, positions: int) -> int:
        """Blocks needed to hold `positions` positions."""
        return -(-positions // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"{count} KV blocks asked for, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Another holder takes the (already used) `blocks`."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} is not in use and cannot be shared")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
