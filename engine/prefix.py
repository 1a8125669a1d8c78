"""Shared prefixes: the cached state at the end of a prefix many requests start with.

An entry holds one state slot (the DeltaNet state after the prefix's first P-1 tokens) and the KV blocks
of those P-1 positions. The last prefix token is left for each request to compute, because the MTP head's
entry for position P-1 needs the token after the prefix, which differs per request. A request starting
from an entry copies the slot, shares the entry's full KV blocks (reference counts) and copies its last,
partial block. Entries are counted by the requests that name them and evicted, least recently used
first, when unused and room is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.allocator import BlockAllocator, SlotAllocator
from engine.sequence import Sequence


@dataclass
class PrefixEntry:
    key: tuple[int, ...]
    filler: Sequence | None  # the internal sequence computing it, until ready
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    last_used: int = 0

    @property
    def ready(self) -> bool:
        return self.filler is None

    @property
    def num_tokens(self) -> int:
        """Positions cached: all but the prefix's last token."""
        return len(self.key) - 1


class PrefixCache:
    def __init__(self, max_entries: int, slots: SlotAllocator, blocks: BlockAllocator) -> None:
        self.max_entries = max_entries
        self.slots = slots
        self.blocks = blocks
        self.entries: dict[tuple[int, ...], PrefixEntry] = {}
        self.users: dict[tuple[int, ...], int] = {}  # live requests naming each key
        self._clock = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add_user(self, key: tuple[int, ...]) -> None:
        self.users[key] = self.users.get(key, 0) + 1

    def remove_user(self, key: tuple[int, ...]) -> None:
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]

    def get(self, key: tuple[int, ...]) -> PrefixEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self._clock += 1
            entry.last_used = self._clock
        return entry

    def start(self, key: tuple[int, ...], filler: Sequence) -> PrefixEntry | None:
        """A new entry computed by `filler`, or None when every entry is in use and none may be evicted."""
        if len(self.entries) >= self.max_entries and not self.evict_one():
            return None
        entry = self.entries[key] = PrefixEntry(key, filler)
        self.get(key)
        return entry

    def filled(self, entry: PrefixEntry) -> None:
        """The filler has computed the prefix: its slot and blocks become the entry's."""
        filler = entry.filler
        assert filler is not None
        keep = self.blocks.blocks_for(entry.num_tokens)
        self.blocks.free(filler.blocks[keep:])
        entry.slot, entry.blocks, entry.filler = filler.slot, filler.blocks[:keep], None
        filler.slot, filler.blocks = None, []

    def drop(self, key: tuple[int, ...]) -> None:
        """Forget an entry whose filler was abandoned (it holds nothing yet)."""
        entry = self.entries.pop(key)
        assert not entry.ready

    def evict_one(self) -> bool:
        """Free the least recently used ready entry no live request names; False if there is none."""
        idle = [e for e in self.entries.values() if e.ready and e.key not in self.users]
        if not idle:
            return False
        victim = min(idle, key=lambda e: e.last_used)
        del self.entries[victim.key]
        if victim.slot is not None:
            self.slots.free(victim.slot)
        self.blocks.free(victim.blocks)
        return True
