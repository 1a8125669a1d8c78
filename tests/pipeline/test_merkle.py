"""pipeline.merkle against RFC 9162 itself: its worked example (section 2.1.5), published test vectors, and a
textbook recursive reimplementation of MTH, PATH and PROOF written here from the RFC's definitions (never the
module compared with itself). Verification must accept every honest proof and refuse every tampered one."""

import hashlib
import itertools

import pytest

from pipeline import merkle


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def mth(data: list[bytes]) -> bytes:
    """RFC 9162 2.1.1, as written: recursive, over the leaves' data."""
    n = len(data)
    if n == 0:
        return _h(b"")
    if n == 1:
        return _h(b"\x00" + data[0])
    k = 1
    while k * 2 < n:
        k *= 2
    return _h(b"\x01" + mth(data[:k]) + mth(data[k:]))


def path(m: int, data: list[bytes]) -> list[bytes]:
    """RFC 9162 2.1.3.1 PATH(m, D[n])."""
    n = len(data)
    if n == 1:
        return []
    k = 1
    while k * 2 < n:
        k *= 2
    if m < k:
        return [*path(m, data[:k]), mth(data[k:])]
    return [*path(m - k, data[k:]), mth(data[:k])]


def subproof(m: int, data: list[bytes], whole: bool) -> list[bytes]:
    """RFC 9162 2.1.4.1 SUBPROOF(m, D[n], b)."""
    n = len(data)
    if m == n:
        return [] if whole else [mth(data)]
    k = 1
    while k * 2 < n:
        k *= 2
    if m <= k:
        return [*subproof(m, data[:k], whole), mth(data[k:])]
    return [*subproof(m - k, data[k:], False), mth(data[:k])]


def leaves_of(n: int) -> list[bytes]:
    return [f"event {i}".encode() for i in range(n)]


# Published vectors (transparency-dev/merkle, proof/verify_test.go; the leaves of Google's RFC 6962 tests):
# the roots of the trees of the first 1..8 leaves, and proofs among them.
VECTOR_LEAVES = [bytes.fromhex(x) for x in ("", "00", "10", "2021", "3031", "40414243", "5051525354555657")]
VECTOR_LEAVES.append(bytes.fromhex("606162636465666768696a6b6c6d6e6f"))
VECTOR_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
VECTOR_INCLUSION = {  # (leaf index, tree size): path
    (0, 8): [
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ],
    (5, 8): [
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
    (2, 3): ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"],
    (1, 5): [
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
    ],
}
VECTOR_CONSISTENCY = {  # (old size, size): path
    (1, 8): VECTOR_INCLUSION[(0, 8)],
    (6, 8): [
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
    (2, 5): [
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
    ],
    (6, 7): [
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
}


def _hex(values: list[bytes]) -> list[str]:
    return [v.hex() for v in values]


def test_published_roots_and_proofs():
    hashes = [merkle.leaf_hash(d) for d in VECTOR_LEAVES]
    tree = merkle.Tree(hashes)
    for n in range(1, 9):
        assert merkle.root(hashes[:n]).hex() == VECTOR_ROOTS[n - 1]
        assert tree.root(n).hex() == VECTOR_ROOTS[n - 1]
    for (index, size), proof in VECTOR_INCLUSION.items():
        assert _hex(tree.inclusion_path(index, size)) == proof
        root = bytes.fromhex(VECTOR_ROOTS[size - 1])
        assert merkle.verify_inclusion(index, size, hashes[index], [bytes.fromhex(p) for p in proof], root)
    for (old, size), proof in VECTOR_CONSISTENCY.items():
        assert _hex(tree.consistency_path(old, size)) == proof
        old_root, root = (bytes.fromhex(VECTOR_ROOTS[s - 1]) for s in (old, size))
        assert merkle.verify_consistency(old, size, old_root, root, [bytes.fromhex(p) for p in proof])


def test_the_rfc_worked_example_of_seven_leaves():
    """RFC 9162 2.1.5, naming its subtrees by the leaves they cover: a..f and j are d0..d6, g = d0..d1,
    h = d2..d3, i = d4..d5, k = d0..d3, l = d4..d6."""
    a, b, c, d, e, f, j = ((i, i + 1) for i in range(7))
    g, h, i, k, ell = (0, 2), (2, 4), (4, 6), (0, 4), (4, 7)
    assert merkle.inclusion_ranges(0, 7) == [b, h, ell]
    assert merkle.inclusion_ranges(3, 7) == [c, g, ell]
    assert merkle.inclusion_ranges(4, 7) == [f, j, k]
    assert merkle.inclusion_ranges(6, 7) == [i, k]
    assert merkle.consistency_ranges(3, 7) == [c, d, g, ell]
    assert merkle.consistency_ranges(4, 7) == [ell]
    assert merkle.consistency_ranges(6, 7) == [i, j, k]
    assert (a, e) == ((0, 1), (4, 5))


@pytest.mark.parametrize("n", [*range(1, 34), 63, 64, 65, 100, 127, 128, 129])
def test_roots_and_proofs_equal_the_textbook_recursion(n):
    data = leaves_of(n)
    hashes = [merkle.leaf_hash(x) for x in data]
    expected = mth(data)
    tree = merkle.Tree(hashes)
    compact = merkle.CompactRange()
    for x in hashes:
        compact.append(x)
    assert merkle.root(hashes) == tree.root() == compact.root() == expected
    again = merkle.CompactRange.load(n, compact.dump())
    again.append(merkle.leaf_hash(b"next"))
    assert again.root() == mth([*data, b"next"])
    for m in range(n):
        proof = path(m, data)
        assert tree.inclusion_path(m) == proof
        assert merkle.range_hashes(merkle.inclusion_ranges(m, n), iter(hashes)) == proof
        assert merkle.verify_inclusion(m, n, hashes[m], proof, expected)
    for m in range(1, n + 1):
        proof = subproof(m, data, True)
        assert tree.consistency_path(m) == proof
        assert merkle.range_hashes(merkle.consistency_ranges(m, n), iter(hashes)) == proof
        assert merkle.verify_consistency(m, n, mth(data[:m]), expected, proof)


def _flip(proof: list[bytes], i: int) -> list[bytes]:
    changed = list(proof)
    changed[i] = bytes([changed[i][0] ^ 8]) + changed[i][1:]
    return changed


RANDOM = _h(b"some other hash")


@pytest.mark.parametrize("n", [2, 3, 5, 7, 8, 13, 16, 17, 31])
def test_tampered_inclusion_proofs_are_refused(n):
    data = leaves_of(n)
    hashes = [merkle.leaf_hash(x) for x in data]
    root = mth(data)
    for m in range(n):
        proof = path(m, data)
        # Only the true leaf at its true index checks out against this proof: every other index, leaf or size
        # computes another root.
        for other in range(n + 3):
            assert merkle.verify_inclusion(other, n, hashes[m], proof, root) == (other == m)
        # A tree of another height gives the path another shape. (Trees of the same shape, as 7 and 8 leaves
        # are for leaf 0, compute the same root from the same path: the signed head binds size and root.)
        for size in {2 * n, n // 2}:
            assert not merkle.verify_inclusion(m, size, hashes[m], proof, root)
        wrong = [
            (hashes[m], proof, RANDOM),
            (merkle.leaf_hash(b"forged"), proof, root),
            (data[m][:32].ljust(32, b"\0"), proof, root),  # the raw data, not its leaf hash
            (hashes[m], [*proof, root], root),
            (hashes[m], [root, *proof], root),
            (hashes[m], [*proof, b""], root),
            (hashes[m], proof[:-1], root),
            (hashes[m], [*proof[:1], RANDOM, *proof[1:]], root),
            (hashes[m], proof, root[:31]),
        ]
        wrong += [(hashes[m], _flip(proof, i), root) for i in range(len(proof))]
        for leaf, bad, want in wrong:
            assert not merkle.verify_inclusion(m, n, leaf, bad, want)


@pytest.mark.parametrize("n", [2, 3, 5, 7, 8, 13, 16, 17, 31])
def test_tampered_consistency_proofs_are_refused(n):
    data = leaves_of(n)
    root = mth(data)
    for m in range(1, n):
        old_root = mth(data[:m])
        proof = subproof(m, data, True)
        # The proof checks out for the true old size only (and from no other old tree).
        for other in range(1, n + 2):
            other_root = mth(data[:other]) if other <= n else RANDOM
            assert merkle.verify_consistency(other, n, other_root, root, proof) == (other == m)
        forked = mth([*data[: m - 1], b"rewritten", *data[m:]])
        wrong = [
            (m, n, old_root, forked, proof),
            (m, n, mth([*data[: m - 1], b"rewritten"]), root, proof),
            (m, n, root, old_root, proof),
            (m, n * 2, old_root, root, proof),
            (m, n, old_root, root, []),
            (m, n, old_root, root, proof[:-1]),
            (m, n, old_root, root, [*proof, old_root]),
            (m, n, old_root, root, [proof[0], *proof]),
            (n, m, root, old_root, proof),
            (0, n, merkle.EMPTY_ROOT, root, proof),
        ]
        wrong += [(m, n, old_root, root, _flip(proof, i)) for i in range(len(proof))]
        for args in wrong:
            assert not merkle.verify_consistency(*args)
    assert merkle.verify_consistency(n, n, root, root, [])
    assert not merkle.verify_consistency(n, n, root, root, [root])
    assert not merkle.verify_consistency(n, n, root, RANDOM, [])


def test_proof_ranges_are_disjoint_and_streaming_stops_early():
    for n, m in itertools.product(range(1, 40), range(40)):
        if m < n:
            spans = sorted(merkle.inclusion_ranges(m, n))
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
            assert all(not (s <= m < e) for s, e in spans)
        if 0 < m <= n:
            spans = sorted(merkle.consistency_ranges(m, n))
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    hashes = [merkle.leaf_hash(x) for x in leaves_of(16)]
    consumed = []

    def counted():
        for x in hashes:
            consumed.append(x)
            yield x

    merkle.range_hashes(merkle.inclusion_ranges(0, 4), counted())
    assert len(consumed) == 4  # the proof for a tree of 4 needs no fifth leaf
    with pytest.raises(ValueError, match="fewer leaves"):
        merkle.range_hashes([(0, 20)], iter(hashes))
    with pytest.raises(ValueError, match="overlap"):
        merkle.range_hashes([(0, 4), (2, 6)], iter(hashes))
    for bad in ((-1, 3), (3, 3), (0, 0)):
        with pytest.raises(ValueError):
            merkle.inclusion_ranges(*bad)
    with pytest.raises(ValueError):
        merkle.consistency_ranges(0, 3)
    with pytest.raises(ValueError):
        merkle.CompactRange(3, [RANDOM])
