"""The kernel calls whose launches `launches.record` compiles: every kernel op's entry point at
Qwen3.5-35B-A3B's shapes (`engine.bench.presets`), as the model calls it (the same views of projection
outputs, the same dtypes), over decode, MTP verify and prefill batches; fp32 inputs beside bf16 ones; and a
few launcher options that the benchmarks' sweeps and the tuned table may pick (explicit tiles, K splits).

Tensors are made with `device="cuda"`: under `launches.simulated_gpu` they are meta tensors, so a call
costs no memory and reads no data (no entry point here needs any).
"""

from __future__ import annotations

import functools

import torch

from engine import kernels
from engine.bench.settings import BLOCK_SIZE as KV_BLOCK
from engine.kernels import PendingCombine
from engine.kernels.layout import SHORT_QUERY, SeqLayout

BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
TOKENS = (1, 8, 64, 512, 4096)  # decode, verify-sized, small and large prefill batches
FP8_BLOCK = (128, 128)  # the FP8 checkpoints' weight scale blocks


@functools.cache
def qwen():
    """Qwen3.5-35B-A3B's geometry as the engine parses it."""
    from engine.bench.presets import QWEN35_35B_A3B
    from engine.config import config_from_dict

    return config_from_dict(QWEN35_35B_A3B)


def empty(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cuda")


def layout(query_lens, context_lens=None, state_out: bool = False) -> SeqLayout:
    """Sequences with these new and cached token counts, in their own KV blocks and state slots; with
    `state_out`, every short sequence keeps its per-token states (an MTP verify step)."""
    context_lens = context_lens or (0,) * len(query_lens)
    tables, first = [], 0
    for n, c in zip(query_lens, context_lens, strict=True):
        blocks = -(-(n + c) // KV_BLOCK)
        tables.append(tuple(range(first, first + blocks)))
        first += blocks
    slots = tuple(range(len(query_lens)))
    outs = None
    if state_out:
        outs, free = [], len(query_lens)
        for n in query_lens:
            outs.append(tuple(range(free, free + n)) if n <= SHORT_QUERY else ())
            free += n
        outs = tuple(outs)
    return SeqLayout(tuple(query_lens), tuple(context_lens), slots, tuple(tables), KV_BLOCK, outs)


# ---------------------------------------------------------------------------------------------------------
# Full attention: the qkv_proj output [T, q+gate | k | v], q/k norms + rotary, paged attention, output gate.


def qkv_proj_out(t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's views of qkv_proj's output: qg [T, Hq, 2D], k and v [T, Hkv, D]."""
    c = qwen()
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    qg, k, v = empty(t, hq * 2 * d + 2 * hkv * d, dtype=dtype).split((hq * 2 * d, hkv * d, hkv * d), -1)
    return qg.view(t, hq, 2 * d), k.view(t, hkv, d), v.view(t, hkv, d)


def attention_call(
    dtype: torch.dtype,
    lay: SeqLayout,
    fp8_cache: bool = False,
    fp8_products: bool = False,
    prefill_kernel: str | None = None,
) -> None:
    c = qwen()
    t = lay.num_tokens
    _, _, v = qkv_proj_out(t, dtype)
    q = empty(t, c.num_attention_heads, c.head_dim, dtype=dtype)  # qk_norm_rotary's contiguous outputs
    k = empty(t, c.num_key_value_heads, c.head_dim, dtype=dtype)
    blocks = max(b for table in lay.block_tables for b in table) + 1
    shape = (blocks, KV_BLOCK, c.num_key_value_heads, c.head_dim)
    cache = [empty(*shape, dtype=FP8 if fp8_cache else dtype) for _ in "kv"]
    scales = [empty(*shape[:3], dtype=FP32) for _ in "kv"] if fp8_cache else [None, None]
    if fp8_products or prefill_kernel:
        from engine.kernels.attention import triton as attention_triton

        k_scale, v_scale = scales
        attention_triton.paged_attention(
            q, k, v, *cache, lay, c.head_dim**-0.5, k_scale=k_scale, v_scale=v_scale,
            fp8_products=fp8_products, prefill_kernel=prefill_kernel,
        )  # fmt: skip
        return
    kernels.attention(q, k, v, *cache, lay, c.head_dim**-0.5, *scales)


def attention() -> None:
    # Short path: 1, 4 and 8 new tokens (decode, MTP verify: BLOCK_M 16, 32, 64), one sequence with few
    # cached keys (one program per kv head) or enough to split them (33 splits on an H200).
    for n in (1, 4, 8):
        for ctx in (100, 4224):
            attention_call(BF16, layout((n,), (ctx,)))
    # fp32 (CPU-sized runs): three only, as ieee dots take 4-5 s each to compile.
    attention_call(FP32, layout((1,), (100,)))
    attention_call(FP32, layout((8,), (4224,)))
    # Splits merged over other tiles: many sequences (2 splits on an H200), a very long context (128), a
    # context just long enough to split (5).
    attention_call(BF16, layout((1,) * 132, (600,) * 132))
    attention_call(BF16, layout((4,), (20000,)))
    attention_call(FP32, layout((1,), (700,)))
    # Long path (prefill chunks) beside a decode.
    for dtype in (BF16, FP32):
        attention_call(dtype, layout((100, 1), (0, 50)))
    # An FP8 cache (e4m3 with scales): decode, a split verify, a prefill beside a decode; the prefill with
    # e4m3 products too (ENCLAVE_FP8_ATTENTION=1).
    for lens in (((1,), (100,)), ((4,), (4224,)), ((100, 1), (0, 50))):
        attention_call(BF16, layout(*lens), fp8_cache=True)
    attention_call(BF16, layout((100,), (50,)), fp8_cache=True, fp8_products=True)
    # The rows prefill kernel (ENCLAVE_PREFILL_KERNEL=rows): a bf16 cache, an FP8 one with e4m3 products.
    attention_call(BF16, layout((100, 1), (0, 50)), prefill_kernel="rows")
    attention_call(BF16, layout((100,), (50,)), fp8_cache=True, fp8_products=True, prefill_kernel="rows")
    # The packed prefill kernel (ENCLAVE_PREFILL_KERNEL=packed): bf16 and fp32 caches, an FP8 one.
    for dtype in (BF16, FP32):
        attention_call(dtype, layout((100, 1), (0, 50)), prefill_kernel="packed")
    attention_call(BF16, layout((100, 1), (0, 50)), fp8_cache=True, prefill_kernel="packed")
    # Past COPY_ONCE_CONTEXT: the packed kernel over a dequantised copy, and with e4m3 products over a
    # gathered copy whose values are transposed.
    long_context = layout((100,), (20000,))
    attention_call(BF16, long_context, fp8_cache=True, prefill_kernel="packed")
    attention_call(BF16, long_context, fp8_cache=True, fp8_products=True, prefill_kernel="packed")


def packed_prefill_tilings() -> None:
    """Every tiling the attention benchmark sweeps (`prefill.SWEEP_TILES`), so the sweep runs only tilings
    that compile and fit an H200's shared memory; plus a cache of 64-position blocks (whole-page tiles)."""
    from engine.kernels.attention import prefill
    from engine.kernels.attention import triton as attention_triton

    c = qwen()
    lay = layout((100,), (50,))
    q = empty(lay.num_tokens, c.num_attention_heads, c.head_dim)
    blocks = max(b for table in lay.block_tables for b in table) + 1
    cache = [empty(blocks, KV_BLOCK, c.num_key_value_heads, c.head_dim) for _ in "kv"]
    for config in prefill.SWEEP_TILES:
        out = empty(*q.shape)
        attention_triton._long_packed(q, *cache, None, lay, c.head_dim**-0.5, out, None, None, config)
    pages = SeqLayout((100,), (50,), (0,), ((0, 1, 2),), 64)
    cache = [empty(3, 64, c.num_key_value_heads, c.head_dim) for _ in "kv"]
    attention_triton._long_packed(q, *cache, None, pages, c.head_dim**-0.5, empty(*q.shape), None, None)
    # The CUDA default's 64-position blocks under a long context over an FP8 cache: the dequantised copy
    # (bf16 products), and the e4m3 products over the copy with transposed values (whole-page value tiles).
    blocks = -(-20100 // 64)
    long_pages = SeqLayout((100,), (20000,), (0,), (tuple(range(blocks)),), 64)
    q = empty(100, c.num_attention_heads, c.head_dim, dtype=BF16)
    fp8 = [empty(blocks, 64, c.num_key_value_heads, c.head_dim, dtype=FP8) for _ in "kv"]
    scales = tuple(empty(blocks, 64, c.num_key_value_heads, dtype=FP32) for _ in "kv")
    for fp8_dot in (False, True):
        out = empty(*q.shape, dtype=BF16)
        attention_triton._long_packed(
            q, *fp8, scales, long_pages, c.head_dim**-0.5, out, None, None, fp8_dot=fp8_dot
        )


def qk_norm_rotary() -> None:
    c = qwen()
    for dtype in (BF16, FP32):
        t = 8
        qg, k, _ = qkv_proj_out(t, dtype)
        cos, sin = (empty(t, c.rope.rotary_dim, dtype=FP32) for _ in "cs")
        weights = [empty(c.head_dim, dtype=dtype) for _ in "qk"]
        kernels.qk_norm_rotary(qg[..., : c.head_dim], k, *weights, cos, sin, c.rms_norm_eps)
        # and with the keys and values stored in a cache of the model's dtype (decode and prefill sizes)
        for t in (1, 8, 4096):
            qg, k, v = qkv_proj_out(t, dtype)
            cos, sin = (empty(t, c.rope.rotary_dim, dtype=FP32) for _ in "cs")
            cache = [
                empty(-(-t // KV_BLOCK) + 1, KV_BLOCK, c.num_key_value_heads, c.head_dim, dtype=dtype)
                for _ in "kv"
            ]
            slots = empty(t, dtype=torch.int64)
            kernels.qk_norm_rotary_store(
                qg[..., : c.head_dim], k, v, *weights, cos, sin, c.rms_norm_eps, *cache, slots
            )


def rotary() -> None:
    c = qwen()
    rd = c.rope.rotary_dim
    for t in TOKENS:
        kernels.rotary_cos_sin(empty(t, dtype=torch.int64), empty(rd // 2, dtype=FP32), 1.0)
    hq, hkv = c.num_attention_heads, c.num_key_value_heads
    for dtype, heads in ((BF16, hq), (BF16, hkv), (FP32, hq)):
        cos, sin = (empty(8, rd, dtype=FP32) for _ in "cs")
        kernels.apply_rotary(empty(8, heads, c.head_dim, dtype=dtype), cos, sin)


def sigmoid_gate() -> None:
    c = qwen()
    for dtype in (BF16, FP32):
        qg, _, _ = qkv_proj_out(8, dtype)
        out = empty(8, c.num_attention_heads, c.head_dim, dtype=dtype)
        kernels.sigmoid_gate(out, qg[..., c.head_dim :])
    qg, _, _ = qkv_proj_out(8, BF16)  # the FP8 o_proj's input, quantised by the gate
    out = empty(8, c.num_attention_heads, c.head_dim, dtype=BF16)
    kernels.sigmoid_gate_fp8(out, qg[..., c.head_dim :], 128)


# ---------------------------------------------------------------------------------------------------------
# Gated DeltaNet: the fused input projection [T, q | k | v | z | b | a], conv, gates, delta rule, gated norm.


def deltanet_proj_out(t: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """qkv [T, conv_dim], z [T, value_dim], b and a [T, Hv]: column views of the fused projection."""
    c = qwen()
    sizes = (c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads, c.linear_num_value_heads)
    return empty(t, sum(sizes), dtype=dtype).split(sizes, -1)


def deltanet_state(
    slots: int, dtype: torch.dtype, state: torch.dtype = FP32
) -> tuple[torch.Tensor, torch.Tensor]:
    """conv [S, conv_dim, K-1] in the model dtype, recurrent [S, Hv, dk, dv] in `state` (fp32, or bf16 with
    `state_dtype="bfloat16"`)."""
    c = qwen()
    conv = empty(slots, c.linear_conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype)
    hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    return conv, empty(slots, hv, dk, dv, dtype=state)


def conv1d() -> None:
    c = qwen()
    weight = empty(c.linear_conv_dim, c.linear_conv_kernel_dim)
    # Token tiles from the longest sequence: 9 short ones (the model takes this op, not deltanet_step, for
    # more than 8 sequences or longer ones), one long; per-token states (verify), also beside a long one.
    batches = [((n,) * 9, keep) for n in (1, 2, 4, 8) for keep in (False, True)]
    batches += [((16,), False), ((100,), False), ((4, 16), True), ((4, 100), True)]
    for query_lens, keep in batches:
        lay = layout(query_lens, (10,) * len(query_lens), state_out=keep)
        qkv = deltanet_proj_out(lay.num_tokens, BF16)[0]
        conv = deltanet_state(lay.num_tokens + len(query_lens), BF16)[0]
        kernels.causal_conv1d(qkv, weight, conv, lay)
    lay = layout((1,) * 16, (10,) * 16)
    kernels.causal_conv1d(deltanet_proj_out(16, BF16)[0], weight, deltanet_state(16, BF16)[0], lay, False)


def deltanet_gate() -> None:
    hv = qwen().linear_num_value_heads
    for dtype, tokens in ((BF16, TOKENS), (FP32, (64,))):
        for t in tokens:
            _, _, b, a = deltanet_proj_out(t, dtype)
            kernels.deltanet_gate(a, b, empty(hv, dtype=dtype), empty(hv, dtype=dtype))


def deltanet_step_call(
    dtype: torch.dtype,
    seqs: int,
    n: int,
    v_splits: int | None = None,
    gate_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = FP32,
) -> None:
    c = qwen()
    lay = layout((n,) * seqs, (10,) * seqs, state_out=n > 1)
    qkv, z, b, a = deltanet_proj_out(lay.num_tokens, dtype)
    conv, state = deltanet_state(lay.num_tokens + seqs, dtype, state_dtype)
    hv = c.linear_num_value_heads
    weights = (empty(c.linear_conv_dim, c.linear_conv_kernel_dim, dtype=dtype), conv)
    gates = (empty(hv, dtype=gate_dtype or dtype), empty(hv, dtype=gate_dtype or dtype))
    args = (qkv, z, a, b, *weights, *gates, state, empty(c.linear_value_head_dim, dtype=dtype))
    if v_splits is None:
        kernels.deltanet_step(*args, c.rms_norm_eps, lay)
    else:  # the launcher's own option (and ENCLAVE_DELTANET_V_SPLITS's)
        from engine.kernels.deltanet_step import triton

        triton.deltanet_step(*args, c.rms_norm_eps, lay, v_splits=v_splits)


def deltanet_step() -> None:
    # 1-8 new tokens (decode, verify) of 1, 4 and 8 sequences: the dv tiles per head follow the batch size
    # (on an H200 4, 2 and 1); more tiles through the launcher's option.
    for seqs, n in ((1, 1), (1, 4), (4, 1), (8, 1), (8, 2), (8, 4), (8, 8)):
        deltanet_step_call(BF16, seqs, n)
    deltanet_step_call(BF16, 1, 1, v_splits=8)
    deltanet_step_call(BF16, 8, 1, gate_dtype=FP32)  # A_log and dt_bias kept in fp32
    for seqs in (1, 8):
        deltanet_step_call(FP32, seqs, 4)
    for n in (1, 4):  # bf16 recurrent states (state_dtype="bfloat16"): decode and verify
        deltanet_step_call(BF16, 8, n, state_dtype=BF16)


def gated_delta_call(dtype: torch.dtype, lay: SeqLayout, state_dtype: torch.dtype = FP32) -> None:
    c = qwen()
    t, hk, hv = lay.num_tokens, c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    q, k, v = empty(t, c.linear_conv_dim, dtype=dtype).split((hk * dk, hk * dk, hv * dv), -1)  # conv output
    g, beta = empty(t, hv, dtype=FP32), empty(t, hv, dtype=dtype)
    state = deltanet_state(t + lay.num_seqs, dtype, state_dtype)[1]
    kernels.gated_delta_rule(q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv), g, beta, state, lay)


def gated_delta() -> None:
    # Recurrent: few sequences and many (other warps per program); per-token states (verify).
    for seqs, n in ((1, 1), (16, 1), (1, 4), (16, 4)):
        gated_delta_call(BF16, layout((n,) * seqs, (10,) * seqs, state_out=n > 1))
    # Chunked (longer sequences): the state walk's dv tile follows their number (16, 32, 64 for 1-3).
    for seqs in (1, 2, 3):
        gated_delta_call(BF16, layout((100,) * seqs, (10,) * seqs))
    gated_delta_call(FP32, layout((100,) * 3, (10,) * 3))
    # bf16 recurrent states: recurrent (with per-token states) and chunked
    gated_delta_call(BF16, layout((1,) * 16, (10,) * 16), BF16)
    gated_delta_call(BF16, layout((4,) * 16, (10,) * 16, state_out=True), BF16)
    gated_delta_call(BF16, layout((100,) * 3, (10,) * 3), BF16)


# ---------------------------------------------------------------------------------------------------------
# Norms, SwiGLU and sampling.


def norm() -> None:
    c = qwen()
    h, eps = c.hidden_size, c.rms_norm_eps
    for dtype, tokens in ((BF16, TOKENS), (FP32, (64,))):
        for t in tokens:
            kernels.rms_norm(empty(t, h, dtype=dtype), empty(h, dtype=dtype), eps)
            kernels.add_rms_norm(
                empty(t, h, dtype=dtype), empty(t, h, dtype=dtype), empty(h, dtype=dtype), eps
            )
    kernels.rms_norm(empty(64, h), empty(h), eps, zero_centered=False)
    # The residual add + norm that also quantises for the FP8 projections and experts (128-channel groups).
    for t in TOKENS:
        kernels.add_rms_norm_fp8(empty(t, h), empty(t, h), empty(h), eps, 128)
    # q and k norms on their own (the model fuses them into qk_norm_rotary): 16 heads, or 2 at 1-8 tokens.
    for t in (1, 2, 4, 8):
        qg, k, _ = qkv_proj_out(t, BF16)
        kernels.rms_norm(qg[..., : c.head_dim], empty(c.head_dim), eps)
        kernels.rms_norm(k, empty(c.head_dim), eps)
    # Gated: the delta rule's [T, Hv, dv] output, gated by z's view; the weight in the model dtype or fp32.
    hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
    for dtype, w_dtype in ((BF16, BF16), (BF16, FP32), (FP32, FP32)):
        z = deltanet_proj_out(64, dtype)[1].view(64, hv, dv)
        kernels.gated_rms_norm(empty(64, hv, dv, dtype=dtype), z, empty(dv, dtype=w_dtype), eps)
    z = deltanet_proj_out(64, BF16)[1].view(64, hv, dv)  # and quantised for an FP8 out_proj: a head a group
    kernels.gated_rms_norm_fp8(empty(64, hv, dv), z, empty(dv), eps, dv)


def combine_norm() -> None:
    """The MoE block's combine summed inside the add + norm after it: the GEMV's fp32 part (decode, verify),
    fp32 K splits, the grouped GEMMs' unsplit bf16 part (prefill); quantising for FP8 consumers too."""
    c = qwen()
    h, eps, k = c.hidden_size, c.rms_norm_eps, c.num_experts_per_tok
    cases = ((1, 1, FP32), (8, 1, FP32), (64, 2, FP32), (512, 1, BF16), (4096, 1, BF16))
    for t, parts, part_dtype in cases:
        pending = PendingCombine(empty(parts, t * (k + 1), h, dtype=part_dtype), t, k + 1, BF16)
        kernels.combine_add_rms_norm(pending, empty(t, h), empty(h), eps)
        kernels.combine_add_rms_norm_fp8(pending, empty(t, h), empty(h), eps, 128)
    # An FP8 shared expert run on its own: its output, weighted by its slot's column of the routing weights.
    shared = (empty(8, h), empty(8, k + 1, dtype=FP32)[:, k])
    pending = PendingCombine(empty(1, 8 * k, h, dtype=FP32), 8, k, BF16, *shared)
    kernels.combine_add_rms_norm_fp8(pending, empty(8, h), empty(h), eps, 128)
    pending = PendingCombine(empty(1, 64 * (k + 1), h, dtype=FP32), 64, k + 1, FP32)  # an fp32 model
    kernels.combine_add_rms_norm(pending, empty(64, h, dtype=FP32), empty(h, dtype=FP32), eps)


def swiglu() -> None:
    from engine.kernels.swiglu import swiglu

    for dtype in (BF16, FP32):
        swiglu(empty(8, 2 * qwen().shared_expert_intermediate_size, dtype=dtype))


def sampling() -> None:
    # fp32 logits and the sampler's int64 top_k; bf16 logits and int32 top_k (the GPU test's).
    v = qwen().vocab_size
    for dtype, k_dtype in ((FP32, torch.int64), (BF16, torch.int32)):
        b = 64
        extra = (empty(b, dtype=k_dtype), empty(b, dtype=FP32), empty(b, v, dtype=FP32))
        kernels.sample_filtered(empty(b, v, dtype=dtype), empty(b, dtype=FP32), *extra)


def token_bitmask() -> None:
    # The grammar's mask at batch 256 over the full vocabulary (fp32 logits, as the sampler gets them).
    v = qwen().vocab_size
    kernels.apply_token_bitmask(
        empty(256, v, dtype=FP32), empty(256, (v + 31) // 32, dtype=torch.int32), empty(256, dtype=torch.long)
    )


CALLS = [
    attention,
    packed_prefill_tilings,
    qk_norm_rotary,
    rotary,
    sigmoid_gate,
    conv1d,
    deltanet_gate,
    deltanet_step,
    gated_delta,
]
CALLS += [norm, combine_norm, swiglu, sampling, token_bitmask]
