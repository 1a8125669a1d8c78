"""The engine's step loop without threads: schedule, run, apply; one call per step.

`EngineCore` is synchronous: each step's tokens are read before the next step is planned. The asynchronous
core, which plans and launches step N+1 before reading step N's tokens, extends it (`engine/async_core.py`,
where `build_core` picks one of the two from the options).
"""

from __future__ import annotations

import logging
import time

from engine.allocator import BlockAllocator, SlotAllocator
from engine.cache import ModelCache, kv_cache_dtype, slot_bytes, state_dtype
from engine.env import engine_env
from engine.errors import EngineError
from engine.graphs import DecodeGraphs, graphs_wanted
from engine.kernels import dispatch
from engine.model.model import CausalLM
from engine.mtp_graphs import MtpGraphs
from engine.options import EngineOptions
from engine.outputs import EngineStats
from engine.planner import CachePlan, step_tokens
from engine.runner import Drafter, Launched, ModelRunner
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_cost import ModelBytes, StepCost, device_costs
from engine.spec_policy import SpeculationMode, SpeculationPolicy, speculation_mode

log = logging.getLogger(__name__)


class StepFailed(Exception):
    """The model raised during a step; the sequences in it were dropped and should fail with `cause`."""

    def __init__(self, seqs: list[Sequence], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.seqs = seqs
        self.cause = cause


class EngineCore:
    """Scheduler, cache and runner for one model, stepped by the caller.

    `options.serving.max_num_seqs` must be set (`Engine` sizes it from the cache plan); `drafter` stands in
    for the MTP head (tests, benchmarks); `mode`: speculation as `Engine` worked it out (default: the
    options', `speculation_mode`), adaptive ones choosing each step's k with a `SpeculationPolicy`."""

    async_scheduling = False  # whether steps are launched before the previous step's tokens are read

    def __init__(
        self,
        model: CausalLM,
        plan: CachePlan,
        options: EngineOptions,
        drafter: Drafter | None = None,
        mode: SpeculationMode | None = None,
    ) -> None:
        serving = options.serving
        device = model.inv_freq.device
        mode = mode or speculation_mode(
            options.speculation, model.mtp is not None or drafter is not None, device, model
        )
        k = mode.k
        if serving.max_num_seqs is None:
            raise EngineError("EngineCore needs max_num_seqs; Engine sizes it from the cache plan")
        # One GEMM per DeltaNet layer's input projections: after any FP8 swap, before graphs are captured.
        model.fuse_projections_()
        if k:  # `Engine` did before planning; a core built alone does it here (again: a no-op)
            model.prepare_draft_head_(options.speculation)
        dtype = model.model.embed_tokens.weight.dtype
        num_mtp = len(model.mtp.layers) if model.mtp is not None and k else 0
        self.options = options
        self.plan = plan
        graphs = int(graphs_wanted(device, options.kernels.cuda_graphs))
        # With CUDA graphs one more slot and block, past the allocators' ranges, take the padding sequences.
        slots, blocks = plan.total_slots + graphs, plan.num_blocks + graphs
        kv_dtype = kv_cache_dtype(options.cache.kv_cache_dtype, dtype)
        states = state_dtype(options.cache.state_dtype, model.config)
        self.cache = ModelCache(
            model.config, slots, blocks, plan.block_size, device, dtype, num_mtp, kv_dtype, states
        )
        self.slots = SlotAllocator(plan.num_slots)
        self.blocks = BlockAllocator(plan.num_blocks, plan.block_size)
        self.scheduler = Scheduler(
            self.slots,
            self.blocks,
            max_num_seqs=serving.max_num_seqs,
            max_num_batched_tokens=serving.max_num_batched_tokens,
            long_prefill_chunk=step_tokens(options, device),
            num_speculative_tokens=k,
            max_prefixes=options.cache.max_prefixes,
        )
        pads = (plan.total_slots, plan.num_blocks)
        decode_graphs = DecodeGraphs(model, self.cache, *pads, serving.max_num_seqs) if graphs else None
        mtp_graphs = None
        if graphs and num_mtp and engine_env().mtp_graphs:
            mtp_graphs = MtpGraphs(model, self.cache, *pads, serving.max_num_seqs)
        mtp_hidden = options.speculation.mtp_hidden
        policy = None
        if mode.adaptive:
            kv_itemsize = (
                self.cache.mtp_layers[0].k.element_size() if self.cache.mtp_layers else dtype.itemsize
            )
            costs = ModelBytes.of(model, kv_itemsize, slot_bytes(model.config, dtype, states))
            policy = SpeculationPolicy(StepCost(costs, device_costs(device)), k, mode.verify_seqs)
        self.runner = ModelRunner(
            model, self.cache, plan, k, drafter, mtp_hidden, decode_graphs, policy, mtp_graphs
        )
        self.graphs = decode_graphs
        if decode_graphs is not None and options.kernels.graph_capture_len:
            self._capture_graphs(options.kernels.graph_capture_len, k)
        self.deferred_steps = 0  # steps whose tokens were read after the next step's launch
        self.steps = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.busy_s = 0.0
        # The host's seconds in `ModelRunner.launch` (batching, uploads, the forward's launches), and the
        # steps, of steps replayed from a graph and of eager ones (prefill chunks, mixed steps)
        self.launch_s = {"graph": 0.0, "eager": 0.0}
        self.launch_steps = {"graph": 0, "eager": 0}
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.aborted = 0  # requests dropped before they finished (Engine.abort, or a failed loop)
        self.batch_size = 0  # sequences in the last step

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, freeing its slot and blocks."""
        self.scheduler.abort(seq)
        self.aborted += 1

    def _capture_graphs(self, positions: int, k: int) -> None:
        """Every decode (and, speculating, verify) graph for contexts up to `positions`, at start-up."""
        longest = self.options.serving.max_model_len or self.graphs.model.config.max_model_len
        positions = min(positions, longest)
        self.graphs.capture_all(positions)
        for drafts in range(1 if self.runner.policy is not None else k, k + 1) if k else ():
            self.graphs.capture_all(positions, drafts + 1, keeps_states=True)  # adaptive: every k up to k
        log.info(
            "captured %d CUDA graphs for contexts up to %d in %.1f s",
            self.graphs.captures,
            positions,
            self.graphs.capture_s,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset_counters(self) -> None:
        """Zero the step and token counters (after the start-up warm-up, which is not served work)."""
        self.steps = self.prompt_tokens = self.generated_tokens = 0
        self.draft_tokens = self.accepted_tokens = self.aborted = 0
        self.busy_s = 0.0
        self.launch_s = {"graph": 0.0, "eager": 0.0}
        self.launch_steps = {"graph": 0, "eager": 0}
        self.scheduler.num_preemptions = 0
        if self.runner.policy is not None:
            self.runner.policy.reset()

    def step(self) -> list[Sequence]:
        """Run one step; return the requests that finished in it."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self.batch_size = len(out.scheduled)
        launched = self._launch(out)
        finished = self._complete(out, launched)
        self._timed(start)
        return finished

    def _launch(
        self, out: SchedulerOutput, previous: Launched | None = None, nonblocking: bool = False
    ) -> Launched | None:
        """Queue the step on the device and count its prompt tokens and drafts (generated tokens are counted
        when read)."""
        start = time.perf_counter()
        try:
            launched = self.runner.launch(out, previous, nonblocking)
        except Exception as exc:
            raise self._failed(exc, out) from exc
        if launched is not None:
            kind = "graph" if self.runner.last_graphed else "eager"
            self.launch_s[kind] += time.perf_counter() - start
            self.launch_steps[kind] += 1
        self.prompt_tokens += sum(
            max(0, min(i.context + i.num_new, len(i.seq.prompt_ids)) - i.context) for i in out.scheduled
        )
        self.draft_tokens += sum(len(i.drafts) for i in out.scheduled)
        return launched

    def _complete(self, out: SchedulerOutput, launched: Launched | None) -> list[Sequence]:
        """Read a launched step's tokens, have the scheduler append them, draft the next tokens (speculation),
        advance the scheduler; the requests that finished."""
        try:
            sampled = self.runner.sample(launched) if launched is not None else []
            self.generated_tokens += self.scheduler.apply(out, sampled)
            if launched is not None and self.runner.k:
                self.scheduler.set_drafts(out, self.runner.draft(launched, sampled))
        except Exception as exc:
            raise self._failed(exc, out) from exc
        accepted = [got.accepted for got in sampled]
        self.accepted_tokens += sum(accepted)
        return self.scheduler.update(out, accepted)

    def _timed(self, start: float) -> None:
        self.steps += 1
        self.busy_s += time.perf_counter() - start

    def _failed(self, exc: Exception, *outs: SchedulerOutput) -> StepFailed:
        """Drop every sequence of the failed steps; the user requests among them fail with `exc`."""
        items = [item for out in outs for item in out.scheduled]
        # A sequence may be in two of them (asynchronous scheduling): once each.
        seqs = list(dict.fromkeys(item.seq for item in items if item.seq.compute_target is None))
        for item in items:
            self.scheduler.abort(item.seq)
        return StepFailed(seqs, exc)

    def stats(self) -> EngineStats:
        busy = self.busy_s or float("inf")
        return EngineStats(
            steps=self.steps,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            tokens_per_s=(self.prompt_tokens + self.generated_tokens) / busy,
            generated_tokens_per_s=self.generated_tokens / busy,
            num_running=self.scheduler.num_user_running,
            num_waiting=self.scheduler.num_user_waiting,
            slots_used=self.slots.num_slots - self.slots.num_free,
            slots_total=self.slots.num_slots,
            blocks_used=self.blocks.num_used,
            blocks_total=self.blocks.num_blocks,
            prefix_entries=len(self.scheduler.prefixes),
            num_preemptions=self.scheduler.num_preemptions,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            graphs_captured=self.graphs.captures if self.graphs is not None else 0,
            graph_capture_s=self.graphs.capture_s if self.graphs is not None else 0.0,
            kernels=dispatch.usage(),
            batch_size=self.batch_size,
            aborted_requests=self.aborted,
            launch_s=dict(self.launch_s),
            launch_steps=dict(self.launch_steps),
        )
