"""CUDA graphs for decode and MTP verify steps: one captured forward per (batch bucket, tokens per sequence,
block-table width, per-position states), replayed with the step's metadata copied into the captured
buffers.

A decode step launches a couple of thousand kernels; on the host each costs more than it runs on the GPU.
A graph replays them in one call. What a replay needs:
- static inputs: token ids [bucket * q], and the layout's metadata tensors (`SeqLayout.cached`), packed
  into one buffer after the warm-up (`SeqLayout.pack`), which the captured layout refills from the step's
  padded layout with one host-to-device copy (`SeqLayout.refill_from`);
- launch choices that follow shapes only: the batch is padded to the bucket with sequences that write one
  reserved state slot and one reserved KV block, block tables are padded to a power-of-two width, and the
  split-KV choice follows that width (`SeqLayout.kv_capacity`), not the contexts;
- a static output: the hidden states before the final norm. The final norm and the logits of the rows the
  runner samples from stay eager (three launches), so a graph holds no [T, vocab] buffer of its own.

Steps that do not fit (prefill chunks, mixed query lengths, more sequences than the largest bucket) run
eagerly. The first step of each shape captures its graph (an eager warm-up on padding sequences, then the
capture), so the first use of a shape costs one extra forward, and the compilation of any kernel variant the
shape is the first to need: seconds at the engine's first steps of each batch size. `capture_all` does it for
every batch bucket and block-table width up to a context when the engine starts, as vLLM captures its graphs
at start-up (`KernelOptions.graph_capture_len`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.cache import ModelCache
from engine.env import engine_env
from engine.kernels import SeqLayout, dispatch
from engine.kernels.layout import SHORT_QUERY
from engine.model.model import CausalLM

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MIN_TABLE_BLOCKS = 16  # narrowest block table a graph is captured for (256 positions at block size 16)


def graphs_wanted(device: torch.device, requested: bool | None = None) -> bool:
    """Whether to replay CUDA graphs: only on CUDA with the Triton kernels (the references sync with the
    host), and there as `requested` (the `cuda_graphs` option), or, when that is None, unless
    ENCLAVE_CUDA_GRAPHS=0."""
    if device.type != "cuda" or dispatch.backend() == "torch":
        return False
    return engine_env().cuda_graphs if requested is None else requested


@dataclass(frozen=True)
class GraphKey:
    batch: int  # sequences, padding included
    query: int  # tokens per sequence: 1 for decode, 1 + k for verify
    width: int  # block-table width in blocks
    keeps_states: bool  # verify: the state after every position goes to state_out


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    layout: SeqLayout  # its cached tensors are the graph's metadata buffers
    ids: torch.Tensor  # [batch * query] static token ids
    hidden: torch.Tensor  # [batch * query, H] static output, before the final norm


class DecodeGraphs:
    """Captures and replays the model's forward for uniform short steps (see the module docstring).

    `pad_slot` and `pad_block` are a state slot and a KV block no sequence owns: padding sequences write
    there.
    """

    def __init__(
        self, model: CausalLM, cache: ModelCache, pad_slot: int, pad_block: int, max_batch: int
    ) -> None:
        self.model = model
        self.cache = cache
        self.pad_slot = pad_slot
        self.pad_block = pad_block
        self.buckets = (*(b for b in BUCKETS if b < max_batch), max_batch)
        self.pool = None  # one memory pool shared by every graph (they never run at once)
        self.graphs: dict[GraphKey, _Captured] = {}
        self.replays = 0
        self.captures = 0
        self.capture_s = 0.0  # spent capturing (warm-ups, compiles and captures)
        self.failed: str | None = None  # why capturing failed; every step then runs eagerly

    def capture_all(self, positions: int, query: int = 1, keeps_states: bool = False) -> int:
        """Capture the graph of every batch bucket and block-table width for contexts up to `positions`, with
        `query` tokens per sequence (1: decode; k + 1 with `keeps_states`: MTP verify); how many were new.
        Stops at the first failure (steps then run eagerly, as when a capture fails on first use)."""
        blocks = -(-max(1, positions) // self.cache.block_size)
        widths, width = [], MIN_TABLE_BLOCKS
        while True:
            widths.append(width)
            if width >= blocks:
                break
            width *= 2
        new = 0
        for width in widths:
            for batch in self.buckets:
                key = GraphKey(batch, query, width, keeps_states)
                if self.failed is not None:
                    return new
                if key not in self.graphs and self._captured(key) is not None:
                    new += 1
        return new

    def _captured(self, key: GraphKey) -> _Captured | None:
        """The key's graph, captured now; None (and `failed` set) if capturing failed."""
        start = time.perf_counter()
        try:
            captured = self.graphs[key] = self._capture(key)
        except RuntimeError as exc:  # a kernel that syncs with the host, say: stay correct, run eagerly
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log.warning("capturing a CUDA graph for %s failed; steps run eagerly", key, exc_info=True)
            torch.cuda.synchronize(self.cache.device)
            return None
        finally:
            self.capture_s += time.perf_counter() - start
        self.captures += 1
        return captured

    def key(self, layout: SeqLayout) -> GraphKey | None:
        """The graph a step would replay, or None when it must run eagerly."""
        if layout.block_tables is None or not layout.num_seqs:
            return None
        q = layout.query_lens[0]
        if q > SHORT_QUERY or any(n != q for n in layout.query_lens):
            return None
        batch = next((b for b in self.buckets if b >= layout.num_seqs), None)
        if batch is None:
            return None
        keeps = layout.state_out is not None and any(layout.state_out)
        if keeps and not all(layout.state_out):  # some sequences verify, others decode: eager
            return None
        longest = max(len(t) for t in layout.block_tables)
        width = max(MIN_TABLE_BLOCKS, 1 << (longest - 1).bit_length())
        return GraphKey(batch, q, width, keeps)

    def run(self, layout: SeqLayout, ids: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [T, H] of the step from its graph (captured first if new); None when the step must
        run eagerly."""
        key = self.key(layout) if self.failed is None else None
        if key is None:
            return None
        captured = self.graphs.get(key) or self._captured(key)
        if captured is None:
            return None
        captured.layout.refill_from(self._pad(layout, key))
        t = ids.shape[0]
        captured.ids[:t].copy_(ids)  # padding rows keep stale ids: they touch only the reserved slot, block
        captured.graph.replay()
        self.replays += 1
        return captured.hidden[:t]

    def _pad(self, layout: SeqLayout, key: GraphKey) -> SeqLayout:
        """`layout` padded to the key's batch with sequences that touch only the reserved slot and block."""
        pad = key.batch - layout.num_seqs
        tables = tuple(tuple(t) + (0,) * (key.width - len(t)) for t in layout.block_tables)
        return SeqLayout(
            layout.query_lens + (key.query,) * pad,
            layout.context_lens + (0,) * pad,
            layout.slots + (self.pad_slot,) * pad,
            tables + ((self.pad_block,) * key.width,) * pad,
            layout.block_size,
            (layout.state_out + ((),) * pad) if key.keeps_states else None,
            kv_capacity=key.width * layout.block_size,
        )

    def _padding_layout(self, key: GraphKey) -> SeqLayout:
        """A layout of padding sequences only, with the key's shape: what the graph is captured with (the
        capture's warm-up runs it for real, so it must not touch any sequence's state)."""
        n, q = key.batch, key.query
        return SeqLayout(
            (q,) * n,
            (0,) * n,
            (self.pad_slot,) * n,
            ((self.pad_block,) * key.width,) * n,
            self.cache.block_size,
            ((self.pad_slot,) * q,) * n if key.keeps_states else None,
            kv_capacity=key.width * self.cache.block_size,
        )

    def _capture(self, key: GraphKey) -> _Captured:
        layout = self._padding_layout(key)
        ids = torch.zeros(key.batch * key.query, dtype=torch.long, device=self.cache.device)
        # Warm-up on a side stream, as torch.cuda.graphs does: compiles the kernels for these shapes and
        # builds the layout's metadata tensors outside the graph's pool.
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            self.model(ids, layout, self.cache)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        layout.pack(self.cache.device)  # the metadata in one buffer: one host-to-device copy per replay
        torch.cuda.synchronize(self.cache.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ids, layout, self.cache)
        torch.cuda.synchronize(self.cache.device)
        return _Captured(graph, layout, ids, hidden)
