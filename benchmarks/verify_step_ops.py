"""What an MTP verify step runs that a plain decode step does not (issue 18: verify at most 1.1x its bytes).

    python benchmarks/verify_step_ops.py [--positions 1,2,3,4] [--context 531] [--list] [--json PATH]

Workload (f) times a plain decode step (one position) against verify steps of 1 + k positions (the last
token and k drafts, `SeqLayout.state_out` set so the DeltaNet layers keep each position's state). Both
replay a CUDA graph of the model's forward (`DecodeGraphs`); around it the runner queues the final norm, the
logits and the argmax eagerly and reads the tokens (`tail`), and a verify step that rejects a draft then
copies the kept DeltaNet state home (`commit`, `ModelCache.copy_slots`).

No GPU is needed: the model and cache are built at Qwen3.5-35B-A3B's geometry on the meta device while
torch.cuda answers as an H200 (`tests.engine.kernels.launches.simulated_gpu`), so every launcher takes the
choices it takes there. Triton's `JITFunction.run` records each launch (kernel, programs, PDL) instead of
running it, and a TorchDispatchMode records the torch ops that would launch CUDA work (cuBLAS GEMMs, copies,
index ops). Each op gets its bytes (weights and states it reads and writes; routed experts as
`traffic.expected_experts`) and a time: in the graph, bytes at BANDWIDTH plus GRAPH_LAUNCH_US; eagerly,
the host's cost of launching it (EAGER_US), which the device waits for in (f)'s synchronous steps.

Prints a table of ops by part (count, MB and estimated us per step for each position count; the commit also
as the engine made it at and before 49459db), then each verify step's predicted cost beyond the plain step's,
by cause: the graph's extra bytes, the dense projections' switch from one-row Triton kernels launched with PDL
to cuBLAS (PROJECTION_US, PDL_BOUNDARY_US), the tail, the host's drafting bookkeeping (HOST_PYTHON_US) and
the commit, beside what (f) measured at a83eb24 (MEASURED_MS). Writes JSON (every launch, in order).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # kernel modules imported under it hold no compilable kernels
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.bench.presets import QWEN35_35B_A3B
from engine.bench.traffic import expected_experts
from engine.cache import ModelCache
from engine.config import ModelConfig, config_from_dict
from engine.kernels.layout import SeqLayout
from engine.model.model import CausalLM
from engine.sampler import sample_rows
from tests.engine.kernels.launches import SM90, simulated_gpu

BANDWIDTH = 4.27e12  # bytes/s: the H200's copy rate in (f)'s run (docs/PERFORMANCE.md, 2026-12-05)
# A kernel in the graph costs ~2 us beyond its bytes: the plain step's 2.90 ms, less the host's 0.44 ms
# between steps (host_step_b70ae53) and the eager tail's ~0.3 ms, is ~2.2 ms for 5.0 GB (1.17 ms at
# BANDWIDTH) and ~455 launches.
GRAPH_LAUNCH_US = 2.0
# The overlap PDL gives one boundary between two PDL kernels: 0.29 ms over ~430 at batch 1 (803ccbe). A
# kernel launched without PDL (cuBLAS, torch) between two PDL ones costs two boundaries.
PDL_BOUNDARY_US = 0.7
# Host time of one eager launch on the H200's host (host_step_2545122, batch 1): the argmax with its Python
# took 26 us, an upper bound for a torch op (15 taken); the final norm (a Triton launch), the logits GEMM and
# its cast took 200 us, which leaves ~170 for the Triton launch. A synchronous copy of a few bytes: ~20 us.
EAGER_US = {"triton": 170.0, "aten": 15.0, "copy": 20.0}
# Device us per call, L2 flushed, (K, N) -> (one-row Triton WIDE_TILES, cuBLAS at 1-4 rows), from
# docs/PERFORMANCE.md, 2026-11-30 (first session: cuBLAS at 1 and 4 rows within 1%; second: the WIDE_TILES
# sweep).
PROJECTION_US = {(2048, 12352): (17.69, 19.30), (2048, 9216): (14.07, 14.57), (4096, 2048): (8.72, 9.90)}
# The drafts' bookkeeping on the host, verify less plain (the drafter's call, acceptance, the scheduler's
# drafts): cProfile of the tiny preset's synchronous steps on a CPU, model and cache copies left out.
HOST_PYTHON_US = 35.0
# (f) on the H200 at a83eb24 (bench_a83eb24_f.json): ms per step by positions.
MEASURED_MS = {1: 2.901, 2: 5.261, 3: 5.585, 4: 5.900}
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "cpu" / "verify_step_ops.json"
# Aten ops that launch nothing on CUDA (views, allocations, metadata).
NO_LAUNCH = {
    "empty", "empty_strided", "view", "_unsafe_view", "t", "unsqueeze", "squeeze", "slice", "select",
    "split", "split_with_sizes", "detach", "lift_fresh", "alias", "expand", "as_strided", "permute",
    "transpose", "reshape", "_reshape_alias", "unbind", "resolve_conj", "resolve_neg", "is_pinned", "detach_",
}  # fmt: skip


@dataclass
class Op:
    """One launch: which part of the step, what, how many programs (Triton), bytes moved, whether it is a
    PDL launch, and its estimated H200 cost in us (device time in the graph, host time eagerly)."""

    part: str
    name: str
    programs: int | None
    bytes: float
    pdl: bool
    shape: tuple[int, ...] | None = None  # a GEMM's (M, K, N)
    us: float = 0.0


def qwen() -> ModelConfig:
    return config_from_dict(QWEN35_35B_A3B)


def nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(nbytes(v) for v in value)
    return 0


class Recorder(TorchDispatchMode):
    """Records Triton launches (through the patched `JITFunction.run`) and launching aten ops into `ops`."""

    def __init__(self, config: ModelConfig, positions: int, context: int) -> None:
        super().__init__()
        self.config, self.positions, self.context = config, positions, context
        self.ops: list[Op] = []
        self.part = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in NO_LAUNCH or (name == "to" and out is args[0]):  # a `.to` to its own dtype
            return out
        if name in ("index_put_", "index", "embedding", "copy_"):  # into or out of a pool: rows moved, twice
            moved = 2 * nbytes(args[2] if name == "index_put_" else args[1] if name == "copy_" else out)
        else:
            moved = nbytes(list(args)) + nbytes(out)
        shape = None
        if name in ("mm", "linear"):  # cuBLAS: (M, K, N)
            n = args[1].shape[1] if name == "mm" else args[1].shape[0]
            shape = (args[0].shape[0], args[0].shape[1], n)
            name = f"{name} (cuBLAS) {shape[1]}->{shape[2]}"
        self.ops.append(Op(self.part, f"aten {name}", None, moved, False, shape))
        return out

    def triton_run(self, fn, *args, grid, warmup, **kwargs) -> None:
        kernel = fn.fn.__name__.strip("_").removesuffix("_kernel")
        module = fn.module.removeprefix("engine.kernels.").removesuffix(".triton")
        programs = 1
        for g in grid if isinstance(grid, tuple) else ():
            programs *= int(g)
        moved = self.kernel_bytes(kernel, args)
        name = f"{module} {kernel}"
        if kernel == "linear":  # weight [N, K]
            name += f" {args[1].shape[1]}->{args[1].shape[0]}"
        self.ops.append(Op(self.part, name, programs, moved, bool(kwargs.get("launch_pdl"))))

    def kernel_bytes(self, kernel: str, args: tuple) -> float:
        """Bytes a Triton launch moves: the pools and expert stacks it indexes counted by what it reads of
        them, anything else as the tensors passed."""
        c, q = self.config, self.positions
        if kernel == "deltanet_step":  # the fp32 state read once, written after every kept position
            state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
            conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * 2
            writes = q if q > 1 else 1
            io = q * (c.linear_conv_dim + 2 * c.linear_value_dim + 2 * c.linear_num_value_heads) * 2
            return (state + conv) * (1 + writes) + io
        if kernel == "paged_attention":  # every cached key and value of the sequence, in bf16
            kv = (self.context + q) * c.num_key_value_heads * c.head_dim * 2 * 2
            return kv + 2 * q * c.num_attention_heads * c.head_dim * 2
        if kernel in ("gate_up", "down"):  # the experts the tokens touch, and the shared one
            touched = expected_experts(q, c.num_experts, c.num_experts_per_tok) + 1
            rows = 2 * c.moe_intermediate_size if kernel == "gate_up" else c.hidden_size
            cols = c.hidden_size if kernel == "gate_up" else c.moe_intermediate_size
            return touched * rows * cols * 2
        return nbytes([a for a in args if isinstance(a, torch.Tensor)])

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        from triton.runtime.jit import JITFunction

        def run(fn, *args, grid, warmup, **kwargs):
            self.triton_run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        with mock.patch.object(JITFunction, "run", run), _Uploads(self), self:
            yield


class _Uploads(TorchFunctionMode):
    """`torch.tensor(values, device=cuda)`: a copy from pageable host memory, which waits for the device."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.tensor and str(kwargs.get("device", "cpu")).startswith("cuda"):
            upload = Op(self.recorder.part, "H2D torch.tensor (synchronous)", None, nbytes(out), False)
            self.recorder.ops.append(upload)
        return out


def build(config: ModelConfig, slots: int, blocks: int) -> tuple[CausalLM, ModelCache]:
    """The model (MTP head included, projections fused as `EngineCore` does) and a cache, on the meta
    device; call under `simulated_gpu`."""
    with torch.device("cuda"):
        model = CausalLM(config, config.mtp_num_hidden_layers).to(torch.bfloat16)
    model.fuse_projections_()
    cache = ModelCache(config, slots, blocks, 16, "cuda", torch.bfloat16, config.mtp_num_hidden_layers)
    return model, cache


def layout_for(positions: int, context: int) -> SeqLayout:
    """One sequence in slot 0: a decode, or a verify step keeping its states in scratch slots 1.. and home."""
    blocks = tuple(range(-(-(context + positions) // 16)))
    keep = ((*range(1, positions), 0),) if positions > 1 else None
    return SeqLayout((positions,), (context,), (0,), (blocks,), 16, keep)


def commit_per_layer(cache: ModelCache, src: list[int], dst: list[int]) -> None:
    """`copy_slots` before 49459db: a gather and a scatter per DeltaNet layer and kind (for its ops)."""
    s, d = torch.tensor(src, device=cache.device), torch.tensor(dst, device=cache.device)
    for state in cache.linear_states():
        state.conv[d] = state.conv[s]
        state.recurrent[d] = state.recurrent[s]


def commit_pooled(cache: ModelCache, src: list[int], dst: list[int]) -> None:
    """`copy_slots` at 49459db: a gather and a scatter per pool, whatever the pairs (for its ops)."""
    s, d = torch.tensor(src, device=cache.device), torch.tensor(dst, device=cache.device)
    cache.conv_pool[:, d] = cache.conv_pool[:, s]
    cache.recurrent_pool[:, d] = cache.recurrent_pool[:, s]


# A rejected draft's commit (scratch slot 1 home to slot 0): as the engine does it now, and as it did before.
COMMITS: dict[str, Callable[[ModelCache, list[int], list[int]], None]] = {
    "commit": ModelCache.copy_slots,
    "commit at 49459db": commit_pooled,
    "commit before 49459db": commit_per_layer,
}


def record_step(model: CausalLM, cache: ModelCache, positions: int, context: int) -> list[Op]:
    """Every launch of a step of `positions` positions: graph (the forward), tail (final norm, logits,
    argmax, the token read) and, verifying, the commit of a rejected draft's state (COMMITS: now and
    before)."""
    rec = Recorder(model.config, positions, context)
    layout = layout_for(positions, context)
    ids = torch.zeros(positions, dtype=torch.long, device="cuda")
    with torch.inference_mode(), rec.recording():
        model(ids, layout, cache)  # builds the layout's metadata, as a graph's capture warm-up does
        rec.ops.clear()
        rec.part = "graph"
        hidden = model(ids, layout, cache)
        rec.part = "tail"
        sample_rows(model.logits(model.final_norm(hidden)), [], [], [])
        rec.ops.append(Op("tail", "D2H tokens.tolist() (waits for the device)", None, 8 * positions, False))
        for part, commit in COMMITS.items() if positions > 1 else ():
            rec.part = part
            commit(cache, [1], [0])
    for op in rec.ops:
        op.us = cost_us(op)
    return rec.ops


def cost_us(op: Op) -> float:
    """The op's estimated H200 cost: device time in the graph; eagerly, the host's launch (the device waits
    for it in a synchronous step), or the device time if longer."""
    device = op.bytes / BANDWIDTH * 1e6
    if op.part == "graph":
        return device + GRAPH_LAUNCH_US
    if op.name.startswith(("H2D", "D2H")):
        return max(EAGER_US["copy"], device)
    return max(EAGER_US["aten" if op.name.startswith("aten") else "triton"], device)


def projection_switch_us(ops: list[Op]) -> float:
    """What the graph's dense projections cost more on cuBLAS than as one-row Triton kernels: the measured
    per-call difference (PROJECTION_US) and two lost PDL boundaries per call."""
    total = 0.0
    for op in ops:
        if op.part == "graph" and op.shape is not None:
            wide, cublas = PROJECTION_US.get(op.shape[1:], (0.0, 0.0))
            total += cublas - wide + 2 * PDL_BOUNDARY_US
    return total


def by_op(ops: list[Op]) -> dict[tuple[str, str], dict[str, float]]:
    """(part, name) -> count, MB and estimated us, in first-seen order."""
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for op in ops:
        row = rows.setdefault((op.part, op.name), {"count": 0, "mb": 0.0, "us": 0.0})
        row["count"] += 1
        row["mb"] += op.bytes / 1e6
        row["us"] += op.us
    return rows


def part_us(ops: list[Op], part: str) -> float:
    return sum(op.us for op in ops if op.part == part)


def breakdown(plain: list[Op], verify: list[Op], positions: int) -> dict[str, float]:
    """A verify step's predicted cost beyond the plain step's, in ms, by cause; and the measured one where
    (f) has it."""
    graph_bytes = sum(op.bytes for op in verify if op.part == "graph")
    graph_bytes -= sum(op.bytes for op in plain if op.part == "graph")
    launches = sum(op.part == "graph" for op in verify) - sum(op.part == "graph" for op in plain)
    out = {
        "graph_bytes_ms": graph_bytes / BANDWIDTH * 1e3,
        "graph_launches_ms": launches * GRAPH_LAUNCH_US / 1e3,
        "projections_on_cublas_ms": (projection_switch_us(verify) - projection_switch_us(plain)) / 1e3,
        "tail_ms": (part_us(verify, "tail") - part_us(plain, "tail")) / 1e3,
        "host_python_ms": HOST_PYTHON_US / 1e3,
    }
    out |= {f"{part.replace(' ', '_')}_ms": part_us(verify, part) / 1e3 for part in COMMITS}
    fixed = out["graph_launches_ms"] + out["projections_on_cublas_ms"] + out["host_python_ms"]
    for part in COMMITS:
        when = part.removeprefix("commit").strip().replace(" ", "_") or "now"
        out[f"fixed_{when}_ms"] = fixed + out[f"{part.replace(' ', '_')}_ms"]
        out[f"predicted_extra_{when}_ms"] = out["graph_bytes_ms"] + out["tail_ms"] + out[f"fixed_{when}_ms"]
    if positions in MEASURED_MS:  # what (f) measured, and its part beyond the predicted bytes: the fixed cost
        out["measured_extra_ms"] = MEASURED_MS[positions] - MEASURED_MS[1]
        out["measured_beyond_bytes_ms"] = out["measured_extra_ms"] - out["graph_bytes_ms"] - out["tail_ms"]
    return out


PARTS = ("graph", "tail", *COMMITS)


def table(steps: dict[int, list[Op]]) -> str:
    """Ops by part and name, with count / MB / est. us per position count."""
    counts = list(steps)
    rows: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for positions, ops in steps.items():
        for key, row in by_op(ops).items():
            rows.setdefault(key, {})[positions] = row
    order = sorted(rows, key=lambda key: PARTS.index(key[0]))  # stable: first seen within a part
    head = f"{'part':<22} {'op':<44}" + "".join(f" | {f'{p} pos: n, MB, us':>24}" for p in counts)
    lines = [head, "-" * len(head)]
    for part, name in order:
        line = f"{part:<22} {name:<44}"
        for p in counts:
            c = rows[(part, name)].get(p)
            line += f" | {'-':>24}" if c is None else f" | {c['count']:>4} {c['mb']:>9.1f} {c['us']:>9.1f}"
        lines.append(line)
    for part in PARTS:
        line = f"{part:<22} {'total':<44}"
        for p in counts:
            ops = [op for op in steps[p] if op.part == part]
            mb, us = sum(op.bytes for op in ops) / 1e6, sum(op.us for op in ops)
            line += f" | {len(ops):>4} {mb:>9.1f} {us:>9.1f}" if ops else f" | {'-':>24}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", default="1,2,3,4", help="positions per step; 1 is the plain step")
    parser.add_argument("--context", type=int, default=531, help="cached positions ((f)'s mean)")
    parser.add_argument("--list", action="store_true", help="also print every launch of each step in order")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="write the results here")
    args = parser.parse_args(argv)
    counts = sorted({1, *(int(p) for p in args.positions.split(","))})
    config = qwen()
    with simulated_gpu(SM90):
        blocks = -(-(args.context + max(counts)) // 16)
        model, cache = build(config, slots=max(counts) + 1, blocks=blocks)
        steps = {p: record_step(model, cache, p, args.context) for p in counts}
    print(table(steps))
    results = {p: breakdown(steps[1], steps[p], p) for p in counts if p > 1}
    print("\nverify step less plain step, ms (H200 estimates; measured from bench_a83eb24_f.json):")
    keys = list(next(iter(results.values()))) if results else []
    print(f"{'':<36}" + "".join(f" {f'{p} pos':>9}" for p in results))
    for key in keys:
        print(f"{key:<36}" + "".join(f" {results[p].get(key, float('nan')):>9.3f}" for p in results))
    if args.list:
        for p, ops in steps.items():
            print(f"\n{p} positions:")
            for op in ops:
                programs = op.programs or "-"
                print(f"  {op.part:<22} {op.name:<44} programs {programs:>6} {op.bytes / 1e6:>9.2f} MB")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "device": "simulated " + SM90.device_name,
        "context": args.context,
        "constants": {"bandwidth": BANDWIDTH, "graph_launch_us": GRAPH_LAUNCH_US, "eager_us": EAGER_US},
        "breakdown": results,
        "steps": {p: [asdict(op) for op in ops] for p, ops in steps.items()},
    }
    args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
