"""Triton `align_block_size` against the torch reference: the same block table and the same pair order.

Odd shapes on purpose: fewer pairs than experts, empty experts, every pair on one expert, one and several
chunks (the one-launch path ends at align.SINGLE_MAX_PAIRS pairs), and strided ids (a slice of wider ids, as
the model passes when the shared expert runs on its own). Outputs start as -7 (`nan_empty`), so a slot the
kernel should have written and did not shows up.
"""

import pytest
import torch

from engine.kernels import dispatch
from engine.kernels.moe import align, reference
from tests.engine.kernels.test_moe_triton import DEVICE, nan_empty  # noqa: F401 (the fixture, by name)

pytestmark = pytest.mark.usefixtures("nan_empty")


def random_ids(t, k, e, seed=0, skip=()):
    """[T, k] distinct experts per token (a top-k), drawn from the experts not in `skip`."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([x for x in range(e) if x not in skip])
    rows = [allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)]
    return torch.stack(rows).to(DEVICE)


def assert_same_alignment(ids, num_experts, block_m):
    ref_pairs, ref_experts, ref_rows = reference.align_block_size(ids, num_experts, block_m)
    pairs, experts, rows = align.align_block_size(ids, num_experts, block_m)
    assert experts.dtype == rows.dtype == pairs.dtype == torch.int32
    assert torch.equal(experts, ref_experts)
    assert torch.equal(rows, ref_rows)
    assert pairs.shape == ref_pairs.shape
    held = (torch.arange(block_m, device=rows.device)[None, :] < rows[:, None]).reshape(-1)
    assert torch.equal(pairs[held], ref_pairs[held])  # padding slots are unspecified


@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize(
    "t, k, e",
    [
        (1, 8, 256),  # decode: 8 pairs, 248 empty experts
        (1, 9, 257),  # decode with the shared expert's slot
        (3, 2, 5),
        (17, 3, 7),
        (29, 9, 257),  # 261 pairs: just past one chunk
        (64, 8, 64),
        (130, 8, 256),  # several chunks
        (1000, 3, 7),  # chunks longer than one sub-block
    ],
)
def test_matches_reference(t, k, e, block_m):
    assert_same_alignment(random_ids(t, k, e, seed=t + e), e, block_m)


@pytest.mark.parametrize("t", [1, 40, 300])
def test_all_pairs_on_one_expert(t):
    ids = torch.full((t, 3), 4, device=DEVICE)
    assert_same_alignment(ids, 6, 16)
    _, experts, rows = align.align_block_size(ids, 6, 16)
    used = -(-3 * t // 16)
    assert (experts[:used] == 4).all() and (experts[used:] == -1).all()
    assert rows.sum().item() == 3 * t


def test_first_and_last_expert_empty():
    ids = random_ids(90, 4, 12, seed=3, skip=(0, 11))
    assert_same_alignment(ids, 12, 16)


def test_strided_ids():
    ids = random_ids(70, 9, 33, seed=4)[:, :8]  # a column slice: row stride 9
    assert not ids.is_contiguous()
    assert_same_alignment(ids, 33, 16)


def test_int32_ids():
    ids = random_ids(33, 4, 20, seed=5)
    assert_same_alignment(ids.to(torch.int32), 20, 32)


def test_reference_layout():
    ids = torch.tensor([[2, 0], [2, 4], [0, 2]], device=DEVICE)  # experts 1 and 3 unused
    pairs, experts, rows = reference.align_block_size(ids, 5, block_m=2)
    assert experts.numel() == 3 + 5  # ceil(6 / 2) + min(5, 6) blocks at most
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5 (+ pad); expert 4: pair 3 (+ pad); then unused blocks.
    assert experts.tolist() == [0, 2, 2, 4, -1, -1, -1, -1]
    assert rows.tolist() == [2, 2, 1, 1, 0, 0, 0, 0]
    assert pairs[:8].tolist()[:5] == [1, 4, 0, 2, 5] and pairs[6].item() == 3


def test_one_launch_up_to_single_max_pairs(monkeypatch):
    launched = []
    monkeypatch.setattr(align, "_count_kernel", _Spy(align._count_kernel, launched))
    ids = random_ids(align.SINGLE_MAX_PAIRS // 8, 8, 64, seed=6)
    assert_same_alignment(ids, 64, 16)
    assert launched == []
    assert_same_alignment(random_ids(align.SINGLE_MAX_PAIRS // 8 + 1, 8, 64, seed=7), 64, 16)
    assert launched == ["count"]


class _Spy:
    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        self.log.append("count")
        return self.kernel[grid]


def test_registered_with_dispatch():
    assert dispatch.implementation("moe_align_block_size", "triton") is align.align_block_size
    assert dispatch.implementation("moe_align_block_size", "torch") is reference.align_block_size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 7, 28, 29, 64, 256, 1000, 8192])
@pytest.mark.parametrize("block_m", [16, 64])
def test_real_shapes_gpu(t, block_m):
    # 256 routed experts + the shared one, top 8 + its slot; several seeds: a race shows only at times.
    for seed in range(3):
        routed = random_ids(t, 8, 256, seed=seed)
        ids = torch.cat([routed, torch.full_like(routed[:, :1], 256)], dim=1)
        assert_same_alignment(ids, 257, block_m)
