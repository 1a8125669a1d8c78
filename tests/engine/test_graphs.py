"""CUDA-graph bookkeeping that needs no GPU: which steps replay, how a step is padded, and how captured
metadata is refilled. The replays themselves are checked against the CPU in test_gpu.py."""

from types import SimpleNamespace

import pytest
import torch

from engine.graphs import MIN_TABLE_BLOCKS, DecodeGraphs
from engine.kernels import SeqLayout


def graphs(max_batch: int = 64) -> DecodeGraphs:
    cache = SimpleNamespace(block_size=16)  # all the bookkeeping reads of the cache
    return DecodeGraphs(model=None, cache=cache, pad_slot=99, pad_block=500, max_batch=max_batch)


def decode(contexts, query=1, state_out=None, block_size=16) -> SeqLayout:
    tables = tuple(
        tuple(range(10 * i, 10 * i + -(-(c + query) // block_size))) for i, c in enumerate(contexts)
    )
    return SeqLayout(
        (query,) * len(contexts),
        tuple(contexts),
        tuple(range(len(contexts))),
        tables,
        block_size,
        state_out,
    )


def test_key_buckets_batch_and_table_width():
    g = graphs()
    key = g.key(decode([5, 200, 17]))
    assert (key.batch, key.query, key.width, key.keeps_states) == (4, 1, MIN_TABLE_BLOCKS, False)
    assert g.key(decode([16 * 40])).width == 64  # 41 blocks -> next power of two
    assert g.key(decode([3] * 64)).batch == 64
    assert graphs(max_batch=40).key(decode([3] * 33)).batch == 40  # the last bucket is max_batch itself


@pytest.mark.parametrize(
    "layout",
    [
        decode([3] * 65),  # more sequences than the largest bucket
        SeqLayout((1, 2), (4, 4), (0, 1), ((0,), (1,)), 16),  # mixed query lengths
        SeqLayout((9,), (0,), (0,), ((0,),), 16),  # a prefill chunk
        decode([4, 4], query=3, state_out=((7, 8, 0), ())),  # one verifies, one does not
    ],
)
def test_eager_steps(layout):
    assert graphs().key(layout) is None


def test_padding_touches_only_the_reserved_slot_and_block():
    g = graphs()
    layout = decode([40, 7], query=3, state_out=((7, 8, 0), (9, 10, 1)))
    key = g.key(layout)
    assert key.keeps_states and key.batch == 2
    layout3 = decode([40, 7, 2], query=3, state_out=((7, 8, 0), (9, 10, 1), (11, 12, 2)))
    padded = g._pad(layout3, g.key(layout3))
    assert padded.num_seqs == 4 and padded.slots[3] == 99 and padded.context_lens[3] == 0
    assert padded.block_tables[3] == (500,) * MIN_TABLE_BLOCKS
    assert all(len(t) == MIN_TABLE_BLOCKS for t in padded.block_tables)
    assert padded.state_out[3] == () and padded.kv_capacity == MIN_TABLE_BLOCKS * 16
    assert padded.slot_mapping("cpu")[-3:].tolist() == [500 * 16, 500 * 16 + 1, 500 * 16 + 2]
    # The capture layout has the same shape and writes nothing but the reserved slot and block.
    capture = g._padding_layout(g.key(layout3))
    assert set(capture.slots) == {99} and {b for t in capture.block_tables for b in t} == {500}
    assert {s for out in capture.state_out for s in out} == {99}


def test_refill_from_rewrites_captured_tensors_in_place():
    g = graphs()
    first, second = decode([5, 9]), decode([30, 2])
    captured = g._pad(first, g.key(first))
    positions = captured.positions("cpu")
    mapping = captured.slot_mapping("cpu")
    captured.refill_from(g._pad(second, g.key(second)))
    assert captured.positions("cpu") is positions and positions.tolist() == [30, 2]
    assert mapping.tolist() == [0 * 16 + 30 % 16 + 16, 10 * 16 + 2]
    with pytest.raises(ValueError, match="shape"):
        captured.refill_from(decode([1, 2, 3]))


def test_packed_tensors_refill_through_one_buffer():
    g = graphs()
    first, second = decode([5, 9]), decode([30, 2])
    captured = g._pad(first, g.key(first))
    before = (captured.positions("cpu").clone(), captured.slot_mapping("cpu").clone())
    tables = captured.cached("tables", "cpu", lambda lay: torch.tensor(lay.block_tables, dtype=torch.int32))
    captured.pack("cpu")
    positions, mapping = captured.positions("cpu"), captured.slot_mapping("cpu")
    packed = captured.cached("tables", "cpu", lambda lay: torch.zeros(1))  # built already: not rebuilt
    assert torch.equal(positions, before[0]) and torch.equal(mapping, before[1])
    assert torch.equal(packed, tables)
    buffer = captured._packed[torch.device("cpu")][0]
    assert all(t.untyped_storage().data_ptr() == buffer.data_ptr() for t in (positions, mapping, packed))
    assert packed.dtype == torch.int32 and positions.dtype == torch.long
    expected = g._pad(second, g.key(second))
    captured.refill_from(expected)
    assert captured.positions("cpu") is positions and positions.tolist() == [30, 2]
    assert torch.equal(mapping, expected.slot_mapping("cpu"))
    assert torch.equal(packed, torch.tensor(expected.block_tables, dtype=torch.int32))


def test_graphs_stay_off_without_cuda():
    from engine.graphs import graphs_wanted

    assert not graphs_wanted(torch.device("cpu"))
