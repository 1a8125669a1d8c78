"""Benchmark: one decoder layer's non-MoE part at decode, fused kernels against the previous code path.

    python benchmarks/kernels_decoder.py [--batch 1,64] [--context 1024] [--iters 200] [--json PATH]

For a Gated DeltaNet layer and a gated attention layer (Qwen3.5-35B-A3B shapes on CUDA: bf16, hidden 2048;
the tiny demo geometry in fp32 on a CPU, with Triton's interpreter) it times the steady-state work of one
layer without its MoE: the residual add + input norm, the token mixer, the residual add + post-attention
norm. Three variants:
- `fused`: the model's code (`DecoderLayer` with the MLP replaced by an identity);
- `unfused`: the previous code path (separate norm, add, rotary, gate and elementwise launches);
- `reference`: the model's code with ENCLAVE_KERNELS=torch, the plain references.
Each is checked against the reference (outputs and the updated DeltaNet state), timed eagerly and, on
CUDA and for the Triton variants, as a replayed torch.cuda.CUDAGraph; launches per call are counted with
torch.profiler (CUDA kernels and copies). On a CPU, "launches" counts the non-view aten ops and Triton
launches instead, and times are the interpreter's (only the launch counts mean anything there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

if not torch.cuda.is_available():  # before any Triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import kernels
from engine.bench.presets import PRESETS, init_parameter_
from engine.cache import ModelCache
from engine.config import ModelConfig, config_from_dict
from engine.env import reset_engine_env
from engine.kernels import SeqLayout
from engine.model.decoder import DecoderLayer
from engine.model.rotary import rope_parameters

BLOCK = 16  # KV block size, the engine's default
# Relative error (Frobenius) a bf16 layer may show against the fp32-accumulating references: a few bf16
# roundings on O(1) activations. fp32 (the CPU run) differs by summation order only.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def build(config: ModelConfig, kind: str, device: torch.device, dtype: torch.dtype) -> DecoderLayer:
    """One decoder layer with seeded random weights (as engine.bench does) and an identity for its MLP."""
    with torch.device("meta"):
        layer = DecoderLayer(config, kind, moe=config.num_experts > 0)
    layer.mlp = nn.Identity()
    layer.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in layer.named_parameters():
        init_parameter_(name, p, g)
    if kind == "linear_attention":  # as the engine serves it: one GEMM for the input projections
        layer.linear_attn.fuse_input_projections_()
    return layer.eval().requires_grad_(False)


def decode_layout(batch: int, context: int) -> SeqLayout:
    """`batch` sequences of one new token after `context` cached ones, each in its own slot and blocks."""
    per_seq = -(-(context + 1) // BLOCK)
    tables = tuple(tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch))
    return SeqLayout((1,) * batch, (context,) * batch, tuple(range(batch)), tables, BLOCK)


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """ENCLAVE_KERNELS=name for the block (the engine keeps its variables: read again on entry and exit)."""
    before = os.environ.get("ENCLAVE_KERNELS")
    os.environ["ENCLAVE_KERNELS"] = name
    reset_engine_env()
    try:
        yield
    finally:
        if before is None:
            del os.environ["ENCLAVE_KERNELS"]
        else:
            os.environ["ENCLAVE_KERNELS"] = before
        reset_engine_env()


def deltanet_unfused(m, x: torch.Tensor, state, layout: SeqLayout) -> torch.Tensor:
    """The DeltaNet mixer as it was before the gate kernel: eight elementwise launches for beta and g."""
    t = x.shape[0]
    qkv, z = m.in_proj_qkvz(x).split((m.conv_dim, m.value_dim), dim=-1)
    b, a = m.in_proj_ba(x).split((m.num_v_heads, m.num_v_heads), dim=-1)
    qkv = kernels.causal_conv1d(qkv, m.conv1d_weight, state.conv, layout)
    q, k, v = qkv.split((m.key_dim, m.key_dim, m.value_dim), dim=-1)
    beta = torch.sigmoid(b)
    g = -m.A_log.float().exp() * torch.nn.functional.softplus(a.float() + m.dt_bias.float())
    out = kernels.gated_delta_rule(
        q.reshape(t, m.num_k_heads, m.head_k_dim),
        k.reshape(t, m.num_k_heads, m.head_k_dim),
        v.reshape(t, m.num_v_heads, m.head_v_dim),
        g,
        beta,
        state.recurrent,
        layout,
    )
    out = kernels.gated_rms_norm(out, z.reshape(t, m.num_v_heads, m.head_v_dim), m.norm_weight, m.eps)
    return m.out_proj(out.reshape(t, m.value_dim))


def attention_unfused(m, x, cos, sin, kv, layout: SeqLayout) -> torch.Tensor:
    """The attention mixer as it was: q norm, k norm, two rotaries, a gate copy, sigmoid and product."""
    t, d = x.shape[0], m.head_dim
    qg, k, v = m.qkv_proj(x).split(m.split, dim=-1)
    qg = qg.view(t, m.num_heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, m.num_heads * d)
    q = kernels.apply_rotary(m.q_norm(q), cos, sin)
    k = kernels.apply_rotary(m.k_norm(k.view(t, m.num_kv_heads, d)), cos, sin)
    out = kernels.attention(q, k, v.view(t, m.num_kv_heads, d), kv.k, kv.v, layout, d**-0.5)
    return m.o_proj(out.reshape(t, m.num_heads * d) * torch.sigmoid(gate))


def variants(
    layer: DecoderLayer, x, residual, cos, sin, state, layout, kernels_backend
) -> dict[str, Callable]:
    """Each variant computes (norm2(stream), stream) from the previous MLP output `x` and the stream.
    `kernels_backend` is the Triton variants' ENCLAVE_KERNELS: auto on CUDA, triton (interpreted) on a CPU."""

    def fused():
        with backend(kernels_backend):
            return layer(x, residual, cos, sin, state, layout)

    def unfused():
        with backend(kernels_backend):
            return _unfused()

    def _unfused():
        s = residual + x
        h = layer.input_layernorm(s)
        if layer.layer_type == "linear_attention":
            h = deltanet_unfused(layer.linear_attn, h, state, layout)
        else:
            h = attention_unfused(layer.self_attn, h, cos, sin, state, layout)
        s = s + h
        return layer.post_attention_layernorm(s), s

    def reference():
        with backend("torch"):
            return layer(x, residual, cos, sin, state, layout)

    return {"fused": fused, "unfused": unfused, "reference": reference}


def state_tensors(state) -> list[torch.Tensor]:
    return [state.conv, state.recurrent] if hasattr(state, "recurrent") else [state.k, state.v]


def check(fn: Callable, ref: Callable, state) -> float:
    """Largest relative error of `fn`'s outputs and updated state against `ref`'s, from the same state."""
    start = [t.clone() for t in state_tensors(state)]
    expected = ref()
    expected_state = [t.clone() for t in state_tensors(state)]
    for t, s in zip(state_tensors(state), start, strict=True):
        t.copy_(s)
    got = fn()
    got_state = state_tensors(state)
    errors = [
        float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
        for a, b in zip([*got, *got_state], [*expected, *expected_state], strict=True)
    ]
    for t, s in zip(state_tensors(state), start, strict=True):
        t.copy_(s)
    return max(errors)


def count_launches(fn: Callable, device: torch.device) -> int:
    """Device work items of one call: CUDA kernels and copies (profiler), or on a CPU the non-view aten ops
    plus Triton launches (an estimate of what the same call launches on a GPU)."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    counts, inside = [0], [False]
    free = ("empty", "empty_strided", "empty_like")  # allocations launch nothing

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not (inside[0] or func.__name__.split(".")[0] in free or _is_view(func, args, out)):
                counts[0] += 1
            return out

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):  # one launch; the interpreter's own tensor copies are not
        counts[0] += 1
        inside[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False

    InterpretedFunction.run = counted
    try:
        with Ops():
            fn()
    finally:
        InterpretedFunction.run = run
    return counts[0]


def _is_view(func, args, out) -> bool:
    """Whether an op returned a view of its input (`reshape` may alias or copy: look at the storage)."""
    returns = func._schema.returns
    if not any(a.alias_info is not None and not a.alias_info.is_write for a in returns):
        return False
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    result = out[0] if isinstance(out, (tuple, list)) else out
    if first is None or not isinstance(result, torch.Tensor):
        return True
    return result.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def eager_us(fn: Callable, device: torch.device, iters: int) -> float:
    """Microseconds per call, launched back to back (host launch costs included)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def graphed_us(fn: Callable, iters: int) -> float:
    """Microseconds per replay of `fn` captured in a CUDA graph (median of five timed batches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up off the capture stream: Triton compiles, layout tensors are built
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def run_case(config, kind, batch, context, device, dtype, iters) -> list[dict]:
    layer = build(config, kind, device, dtype)
    layout = decode_layout(batch, context)
    per_seq = -(-(context + 1) // BLOCK)
    cache = ModelCache(config, batch, batch * per_seq, BLOCK, device, dtype)
    g = torch.Generator(device=device).manual_seed(1)
    for t in cache.tensors():  # O(1) cached keys/values, a small recurrent state
        t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=torch.float32) * 0.1)
    state = cache.layers[config.layer_types.index(kind)]
    h = config.hidden_size
    x = torch.randn(batch, h, generator=g, device=device, dtype=torch.float32).to(dtype)
    residual = torch.randn(batch, h, generator=g, device=device, dtype=torch.float32).to(dtype)
    inv_freq, scale = rope_parameters(config)
    cos, sin = kernels.rotary_cos_sin(layout.positions(device), inv_freq.to(device), scale)
    fns = variants(layer, x, residual, cos, sin, state, layout, "auto" if device.type == "cuda" else "triton")
    rows = []
    with torch.inference_mode():
        for name, fn in fns.items():
            error = check(fn, fns["reference"], state)
            row = {
                "layer": kind,
                "batch": batch,
                "variant": name,
                "launches": count_launches(fn, device),
                "eager_us": eager_us(fn, device, iters),
                "graph_us": graphed_us(fn, iters) if device.type == "cuda" and name != "reference" else None,
                "rel_error": error,
                "ok": error <= TOLERANCE[dtype],
            }
            rows.append(row)
            print(table_row(row), flush=True)
    return rows


def table_row(r: dict) -> str:
    graph = f"{r['graph_us']:9.1f}" if r["graph_us"] is not None else f"{'-':>9}"
    ok = "ok" if r["ok"] else "MISMATCH"
    return (
        f"{r['layer']:<17} {r['batch']:>5} {r['variant']:<9} {r['launches']:>8} {r['eager_us']:>9.1f} "
        f"{graph} {r['rel_error']:>9.2e} {ok}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    parser.add_argument("--iters", type=int, default=200, help="calls per timing (CUDA)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    preset = "qwen3.5-35b-a3b" if cuda else "tiny"
    config = config_from_dict(PRESETS[preset](), source=f"preset {preset}")
    batches = [int(b) for b in args.batch.split(",")] if cuda else [1, 3]
    context = args.context if cuda else 20
    iters = args.iters if cuda else 2
    print(f"{preset} on {device} ({dtype}), decode with {context} cached tokens per sequence")
    print(
        f"{'layer':<17} {'batch':>5} {'variant':<9} {'launches':>8} {'eager_us':>9} {'graph_us':>9} rel_error"
    )
    start = time.perf_counter()
    rows = []
    for kind in ("linear_attention", "full_attention"):
        for batch in batches:
            rows += run_case(config, kind, batch, context, device, dtype, iters)
    result = {
        "preset": preset,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype),
        "context": context,
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(f"done in {result['seconds']:.1f} s")
    if not all(r["ok"] for r in rows):
        sys.exit("a variant does not match the torch reference")


if __name__ == "__main__":
    main()
