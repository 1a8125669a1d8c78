"""Merkle trees as RFC 9162 (Certificate Transparency 2.0, section 2.1) defines them, over SHA-256.

The tree of n leaves is MTH(D[n]): a leaf hashes as SHA-256(0x00 || data), a node as
SHA-256(0x01 || left || right), and D[n] splits at k, the largest power of two below n. An inclusion proof
(PATH) shows that one leaf is in a tree of a given root; a consistency proof (PROOF) shows that the tree of
the first m leaves is a prefix of the tree of n: the log only grew. Both are lists of subtree hashes; the
`*_ranges` functions say which subtrees (as half-open leaf ranges), so that a caller can hash them from an
in-memory `Tree` or from leaves streamed once (`range_hashes`). Verification follows the RFC's
algorithms (2.1.3.2 and 2.1.4.2) step by step. Everything here takes leaf *hashes*; `leaf_hash` makes one.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence

HASH_SIZE = 32
MAX_PROOF = 64  # a tree of fewer than 2**63 leaves needs no longer proof
EMPTY_ROOT = hashlib.sha256(b"").digest()  # MTH({}) = HASH()


def leaf_hash(data: bytes) -> bytes:
    """MTH({d}) = SHA-256(0x00 || d)."""
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """SHA-256(0x01 || left || right): the hash of an interior node."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def split(n: int) -> int:
    """k, the largest power of two smaller than n (n >= 2): where MTH(D[n]) splits."""
    return 1 << ((n - 1).bit_length() - 1)


class CompactRange:
    """The first `size` leaves as their perfect subtrees, largest first (one per set bit of `size`): enough to
    append a leaf and to compute the root in O(log n) hashes, so a log's root is kept up to date without
    rereading it. MTH(D[n]) is these subtrees' hashes folded from the right, since D[n] splits at the
    largest power of two below n."""

    def __init__(self, size: int = 0, hashes: Sequence[bytes] = ()) -> None:
        if size < 0 or len(hashes) != size.bit_count() or any(len(h) != HASH_SIZE for h in hashes):
            raise ValueError(f"a compact range of {size} leaves holds {size.bit_count()} hashes of 32 bytes")
        self.size = size
        self.hashes = list(hashes)

    def append(self, leaf: bytes) -> None:
        """Add the next leaf's hash: equal-sized subtrees at the end merge, as a binary counter carries."""
        self.hashes.append(leaf)
        carried = self.size
        while carried & 1:
            right = self.hashes.pop()
            self.hashes[-1] = node_hash(self.hashes[-1], right)
            carried >>= 1
        self.size += 1

    def root(self) -> bytes:
        """MTH of the leaves so far."""
        if not self.hashes:
            return EMPTY_ROOT
        result = self.hashes[-1]
        for left in reversed(self.hashes[:-1]):
            result = node_hash(left, result)
        return result

    def dump(self) -> str:
        """The subtree hashes as one hex string (stored beside a signed head)."""
        return b"".join(self.hashes).hex()

    @classmethod
    def load(cls, size: int, text: str) -> CompactRange:
        """The range `dump` wrote for `size` leaves; ValueError if the text cannot be that."""
        raw = bytes.fromhex(text)
        return cls(size, [raw[i : i + HASH_SIZE] for i in range(0, len(raw), HASH_SIZE)])


def root(leaves: Sequence[bytes]) -> bytes:
    """MTH of a list of leaf hashes."""
    tree = CompactRange()
    for leaf in leaves:
        tree.append(leaf)
    return tree.root()


def inclusion_ranges(index: int, size: int) -> list[tuple[int, int]]:
    """The leaf ranges whose subtree hashes form PATH(index, D[size]), in the RFC's order (bottom up)."""
    if not 0 <= index < size:
        raise ValueError(f"leaf {index} is not in a tree of {size} leaves")
    ranges: list[tuple[int, int]] = []
    start, end = 0, size
    while end - start > 1:  # walk down to the leaf, noting each sibling; the path lists them bottom up
        k = split(end - start)
        if index < start + k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start += k
    return ranges[::-1]


def consistency_ranges(old: int, size: int) -> list[tuple[int, int]]:
    """The leaf ranges whose subtree hashes form PROOF(old, D[size]) (SUBPROOF(old, D[size], true))."""
    if not 0 < old <= size:
        raise ValueError(f"no consistency proof from a tree of {old} leaves to one of {size}")
    ranges: list[tuple[int, int]] = []
    start, end, whole = 0, size, True  # `whole`: the old tree is exactly this subtree's left part so far
    while old != end:  # SUBPROOF(m, D[n], b) until m == n, with m and n relative to `start`
        k = split(end - start)
        if old - start <= k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start, whole = start + k, False
    if not whole:  # SUBPROOF(m, D[m], false) = {MTH(D[m])}
        ranges.append((start, end))
    return ranges[::-1]


def range_hashes(ranges: Sequence[tuple[int, int]], leaves: Iterable[bytes]) -> list[bytes]:
    """MTH of each of the disjoint `ranges`, from leaf hashes streamed once from leaf 0; memory O(log n).

    Stops reading as soon as the last range is complete; ValueError if the leaves end first."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    for a, b in itertools.pairwise(order):
        if ranges[a][1] > ranges[b][0]:
            raise ValueError("proof ranges overlap")
    hashes = [EMPTY_ROOT] * len(ranges)
    if not ranges:
        return []
    position, tree = 0, CompactRange()
    for index, leaf in enumerate(leaves):
        start, end = ranges[order[position]]
        if index >= start:
            tree.append(leaf)
        if index + 1 == end:
            hashes[order[position]], tree = tree.root(), CompactRange()
            position += 1
            if position == len(order):
                return hashes
    raise ValueError(f"the tree has fewer leaves than a proof needs ({ranges[order[position]][1]})")


class Tree:
    """Every complete subtree of a list of leaves, level by level (32 bytes each, about 64 bytes per leaf),
    so that many proofs come from one pass over the leaves: each range hash is O(log n) lookups."""

    def __init__(self, leaves: Iterable[bytes] = ()) -> None:
        self.levels: list[bytearray] = [bytearray()]
        for leaf in leaves:
            self.append(leaf)

    @property
    def size(self) -> int:
        return len(self.levels[0]) // HASH_SIZE

    def append(self, leaf: bytes) -> None:
        level, node = 0, leaf
        while True:
            if level == len(self.levels):
                self.levels.append(bytearray())
            self.levels[level] += node
            count = len(self.levels[level]) // HASH_SIZE
            if count % 2:
                return
            node = node_hash(self._node(level, count - 2), node)
            level += 1

    def _node(self, level: int, index: int) -> bytes:
        return bytes(self.levels[level][index * HASH_SIZE : (index + 1) * HASH_SIZE])

    def range_hash(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]), split as the RFC splits it."""
        if not 0 <= start < end <= self.size:
            raise ValueError(f"leaves {start}..{end} are not in a tree of {self.size}")
        n = end - start
        if n & (n - 1) == 0 and start % n == 0:  # a complete, aligned subtree: stored
            return self._node(n.bit_length() - 1, start // n)
        k = split(n)
        return node_hash(self.range_hash(start, start + k), self.range_hash(start + k, end))

    def root(self, size: int | None = None) -> bytes:
        """MTH of the first `size` leaves (all of them by default)."""
        size = self.size if size is None else size
        return EMPTY_ROOT if size == 0 else self.range_hash(0, size)

    def inclusion_path(self, index: int, size: int | None = None) -> list[bytes]:
        size = self.size if size is None else size
        return [self.range_hash(a, b) for a, b in inclusion_ranges(index, size)]

    def consistency_path(self, old: int, size: int | None = None) -> list[bytes]:
        size = self.size if size is None else size
        return [self.range_hash(a, b) for a, b in consistency_ranges(old, size)]


def _hashes_ok(*values: bytes) -> bool:
    return all(isinstance(v, bytes) and len(v) == HASH_SIZE for v in values)


def verify_inclusion(index: int, size: int, leaf: bytes, path: Sequence[bytes], root_hash: bytes) -> bool:
    """RFC 9162 2.1.3.2: True when `path` proves that `leaf` (a leaf hash) is leaf `index` of the tree of
    `size` leaves whose root is `root_hash`."""
    if not 0 <= index < size or len(path) > MAX_PROOF or not _hashes_ok(leaf, root_hash, *path):
        return False
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root_hash


def verify_consistency(old: int, size: int, old_root: bytes, root_hash: bytes, path: Sequence[bytes]) -> bool:
    """RFC 9162 2.1.4.2: True when `path` proves that the tree of `old` leaves with root `old_root` is a
    prefix of the tree of `size` leaves with root `root_hash`. Equal sizes need an empty path and equal
    roots."""
    if not 0 < old <= size or len(path) > MAX_PROOF or not _hashes_ok(old_root, root_hash, *path):
        return False
    if old == size:
        return not path and old_root == root_hash
    if not path:
        return False
    if old & (old - 1) == 0:  # a power of two: the old root is itself a node of the new tree
        path = [old_root, *path]
    fn, sn = old - 1, size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return fr == old_root and sr == root_hash and sn == 0
