"""CUDA graphs for the MTP head: its K/V-only fill at a step that drafts nothing, its pass over a verify
step's positions, and each further draft step, replayed like the main model's decode graphs (`graphs.py`).

Eagerly, one pass of the head is a decoder layer's few dozen launches plus its fc and norms: measured on
the H200 at 1.8-2.2 ms a draft and ~2 ms a fill for a few hundred microseconds of device time
(docs/PERFORMANCE.md, 2026-12-05), so drafting and the fill cost more than a whole plain decode step
(2.9 ms). A graph replays a pass in one call. The shapes, padding, buckets and metadata refill are
`DecodeGraphs`' (uniform steps of up to SHORT_QUERY tokens per sequence, padded to a batch bucket with
sequences that write one reserved KV block); the static inputs are the token ids and the hidden states
the head reads ([bucket * q, H] each), the static output the head's normed hidden state (none for the
fill). A pass that does not fit runs eagerly.

On by default since the H100 ran `test_cuda_mtp_graphs_give_the_eager_heads_tokens` (docs/PERFORMANCE.md,
2026-12-05, fourth session); ENCLAVE_MTP_GRAPHS=0 runs the passes eagerly. Each graph is captured on first
use, not at start as the decode graphs are, so a run's first steps at a new batch bucket or block-table
width pay a capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.graphs import DecodeGraphs, GraphKey
from engine.kernels import SeqLayout


@dataclass(frozen=True)
class MtpKey:
    base: GraphKey  # batch bucket, tokens per sequence, block-table width (no per-position states)
    store: bool  # the K/V-only fill (no output) rather than the head's pass
    layer: int  # which of the head's layers (a draft step's index modulo their count)


@dataclass
class _MtpCaptured:
    graph: torch.cuda.CUDAGraph
    layout: SeqLayout
    ids: torch.Tensor  # [batch * query] static next-token ids
    hidden: torch.Tensor  # [batch * query, H] static hidden states the head reads
    out: torch.Tensor | None  # [batch * query, H] the head's normed output; None for the fill


class MtpGraphs(DecodeGraphs):
    """Captures and replays the MTP head's passes (see the module docstring); `run_pass` and `run_store`
    return None / False when the pass must run eagerly."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hidden_size = self.model.config.hidden_size
        self.dtype = self.model.model.embed_tokens.weight.dtype

    def run_pass(
        self, layout: SeqLayout, ids: torch.Tensor, hidden: torch.Tensor, step: int = 0
    ) -> torch.Tensor | None:
        """`model.mtp_hidden(ids, hidden, layout, cache, step)` from a graph: [T, H], a view of the graph's
        static output (valid until its next replay), or None."""
        captured = self._replay(layout, ids, hidden, store=False, step=step)
        return None if captured is None else captured.out[: ids.shape[0]]

    def run_store(self, layout: SeqLayout, ids: torch.Tensor, hidden: torch.Tensor) -> bool:
        """`model.mtp_store_kv(ids, hidden, layout, cache)` from a graph; False when it must run eagerly."""
        return self._replay(layout, ids, hidden, store=True, step=0) is not None

    def _replay(
        self, layout: SeqLayout, ids: torch.Tensor, hidden: torch.Tensor, store: bool, step: int
    ) -> _MtpCaptured | None:
        base = self.key(layout) if self.failed is None else None
        if base is None or base.keeps_states:
            return None
        key = MtpKey(base, store, step % len(self.model.mtp.layers))
        captured = self.graphs.get(key) or self._captured(key)  # `DecodeGraphs._captured`: capture or fail
        if captured is None:
            return None
        captured.layout.refill_from(self._pad(layout, base))
        t = ids.shape[0]
        captured.ids[:t].copy_(ids)  # padding rows keep stale inputs: they touch only the reserved block
        captured.hidden[:t].copy_(hidden)
        captured.graph.replay()
        self.replays += 1
        return captured

    def _pass(self, key: MtpKey, ids: torch.Tensor, hidden: torch.Tensor, layout: SeqLayout):
        if key.store:
            self.model.mtp_store_kv(ids, hidden, layout, self.cache)
            return None
        return self.model.mtp_hidden(ids, hidden, layout, self.cache, key.layer)

    def _capture(self, key: MtpKey) -> _MtpCaptured:  # what `DecodeGraphs._captured` calls, for MtpKey
        layout = self._padding_layout(key.base)
        device = self.cache.device
        n = key.base.batch * key.base.query
        ids = torch.zeros(n, dtype=torch.long, device=device)
        hidden = torch.zeros(n, self.hidden_size, dtype=self.dtype, device=device)
        stream = torch.cuda.Stream(device)  # warm-up on a side stream, as `DecodeGraphs._capture`
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._pass(key, ids, hidden, layout)
        torch.cuda.current_stream(device).wait_stream(stream)
        layout.pack(device)
        torch.cuda.synchronize(device)
        if self.pool is None:  # the head's own pool: its static outputs never share the main graphs' memory
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._pass(key, ids, hidden, layout)
        torch.cuda.synchronize(device)
        return _MtpCaptured(graph, layout, ids, hidden, out)
