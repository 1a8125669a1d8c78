"""Every Triton kernel compiles for an H200 (sm_90), without a GPU.

CI runs the kernels in Triton's interpreter, which accepts code the compiler rejects (a variable re-bound to
another shape under a run-time `if`, integer masks, ...). This test lowers each `@triton.jit` kernel in
engine/kernels/*/triton.py all the way to a cubin for `GPUTarget("cuda", 90, 32)` (ptxas ships with the
Triton wheel), for the constexpr combinations its launcher picks at Qwen3.5-35B-A3B's shapes (bf16, plus the
fp32 variants where the launcher picks other constexprs by dtype; PDL True where a kernel has it, as
`engine.kernels.pdl` launches it there), and checks that each fits an H200's shared memory.

`@triton.jit` returns an uncompilable InterpretedFunction when TRITON_INTERPRET is set (conftest.py sets it
on CPU-only machines, and other tests here import the kernel modules under it), so the compilation runs in
subprocesses without it (two on two cores, each taking every other variant).
`python -m tests.engine.kernels.test_compile_sm90 [substring ...]` runs it by hand, printing one line per
compiled variant (name, error, shared memory, seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
# Shared memory one block of an H200 may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90).
SM90_MAX_SHARED = 232448
RESULT, SKIP = "COMPILE-RESULT ", "COMPILE-SKIP "


@pytest.mark.slow  # 40-50 s on 2 cores with a cold Triton cache, 5 s warm
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # One subprocess per core (at most two), each compiling every n-th variant.
    n = max(1, min(2, os.cpu_count() or 1))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.engine.kernels.test_compile_sm90", f"--shard={i}/{n}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    try:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [line for stdout, _ in outputs for line in stdout.splitlines()]
    skip = [line[len(SKIP) :] for line in lines if line.startswith(SKIP)]
    if skip:
        pytest.skip(f"no offline CUDA backend in this Triton: {skip[0]}")
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"compile subprocess failed (rc {proc.returncode}):\n{stderr[-8000:]}"
    results = [json.loads(line[len(RESULT) :]) for line in lines if line.startswith(RESULT)]
    assert sorted(r["name"] for r in results) == sorted(c.name for c in _cases()), "variants went unreported"
    failed = [r for r in results if r["error"]]
    report = "\n\n".join(f"=== {r['name']}\n{r['error']}" for r in failed)
    assert not failed, (
        f"{len(failed)} of {len(results)} kernel variants do not compile for sm_90:\n\n{report}"
    )


# ---------------------------------------------------------------------------------------------------------
# The variants. Kernel arguments are given by name: "*bf16" is a pointer (16-byte aligned, as torch's
# allocations and the model's views are), an int a run-time integer (specialised as the launcher does: 1
# becomes a constexpr, multiples of 16 get tt.divisibility), a float an fp32 scalar; constexpr parameters
# take their value. Integers that vary per batch (token counts, table widths) are given as 17, unspecialised.


@dataclass
class Case:
    name: str
    module: str  # engine.kernels.<module>.triton, or engine.kernels.<module> when dotted ("moe.gemv")
    kernel: str
    args: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def module_name(self) -> str:
        return f"engine.kernels.{self.module}" + ("" if "." in self.module else ".triton")


ANY = 17  # a run-time size with no divisibility
HIDDEN, HEAD_DIM, HQ, HKV, GROUP = 2048, 256, 16, 2, 8
KV_BLOCK = 16  # the engine's default block_size
LIN_HK, LIN_HV, LIN_D, CONV_K = 16, 32, 128, 4
CONV_DIM = 2 * LIN_HK * LIN_D + LIN_HV * LIN_D  # 8192: [q | k | v] of the DeltaNet
QKVZ = CONV_DIM + LIN_HV * LIN_D  # in_proj_qkvz output width
EXPERTS, TOP_K, MOE_INTER = 256, 8, 512


def _attention_cases() -> list[Case]:
    cases = []
    # BLOCK_M = max(16, next_pow2(new tokens * GROUP)): decode (1-2 tokens) 16, 3-4 tokens 32, 5-8 64.
    for dt, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        # fp32 (ieee dots, 4-5 s each to compile): the narrow tile without split, the wide one with.
        for block_m in (16, 32, 64) if dt == "bf16" else (16, 64):
            wide = block_m * HEAD_DIM >= 64 * 256
            for splits in (1, 33) if dt == "bf16" else ((33,) if wide else (1,)):
                split = splits > 1
                cases.append(
                    Case(
                        f"attention {dt} BLOCK_M={block_m} NUM_SPLITS={splits}",
                        "attention",
                        "_paged_attention_kernel",
                        dict(
                            q_ptr=f"*{dt}",
                            k_cache_ptr=f"*{dt}",
                            v_cache_ptr=f"*{dt}",
                            out_ptr="*fp32" if split else f"*{dt}",
                            lse_ptr="*fp32" if split else f"*{dt}",
                            block_tables_ptr="*i32",
                            seq_info_ptr="*i32",
                            scale_log2=HEAD_DIM**-0.5 * 1.4426950408889634,
                            stride_qt=HQ * HEAD_DIM,
                            stride_qh=HEAD_DIM,
                            stride_kb=KV_BLOCK * HKV * HEAD_DIM,
                            stride_kr=HKV * HEAD_DIM,
                            stride_kh=HEAD_DIM,
                            stride_vb=KV_BLOCK * HKV * HEAD_DIM,
                            stride_vr=HKV * HEAD_DIM,
                            stride_vh=HEAD_DIM,
                            stride_ot=0 if split else HQ * HEAD_DIM,
                            stride_oh=0 if split else HEAD_DIM,
                            stride_bt=ANY,
                            GROUP=GROUP,
                            KV_BLOCK=KV_BLOCK,
                            HEAD_DIM=HEAD_DIM,
                            BLOCK_D=HEAD_DIM,
                            BLOCK_M=block_m,
                            BLOCK_N=64,
                            NUM_SPLITS=splits,
                            USE_SPLIT=split,
                            DOT_PRECISION=precision,
                        ),
                        dict(num_warps=8 if wide else 4, num_stages=2 if wide else 3),
                    )
                )
    # The merge after a split: 2..128 slices (BLOCK_S their next power of two).
    for dt, block_m, splits in (("bf16", 16, 2), ("bf16", 64, 33), ("bf16", 32, 128), ("fp32", 16, 5)):
        cases.append(
            Case(
                f"attention merge {dt} BLOCK_M={block_m} NUM_SPLITS={splits}",
                "attention",
                "_merge_splits_kernel",
                dict(
                    part_ptr="*fp32",
                    lse_ptr="*fp32",
                    out_ptr=f"*{dt}",
                    seq_info_ptr="*i32",
                    stride_ot=HQ * HEAD_DIM,
                    stride_oh=HEAD_DIM,
                    GROUP=GROUP,
                    HEAD_DIM=HEAD_DIM,
                    BLOCK_D=HEAD_DIM,
                    BLOCK_M=block_m,
                    NUM_SPLITS=splits,
                    BLOCK_S=1 << (splits - 1).bit_length(),
                ),
                dict(num_warps=4),
            )
        )
    # Prefill chunks (the long path): 16-bit inputs take 64 x 64 tiles and 8 warps, fp32 16 x 16 and 4.
    for dt, precision, block, warps in (("bf16", "tf32", 64, 8), ("fp32", "ieee", 16, 4)):
        cases.append(
            Case(
                f"attention prefill {dt} BLOCK_M={block} BLOCK_N={block}",
                "attention",
                "_prefill_attention_kernel",
                dict(
                    q_ptr=f"*{dt}",
                    k_cache_ptr=f"*{dt}",
                    v_cache_ptr=f"*{dt}",
                    out_ptr=f"*{dt}",
                    block_tables_ptr="*i32",
                    seq_info_ptr="*i32",
                    tiles_ptr="*i32",
                    scale_log2=HEAD_DIM**-0.5 * 1.4426950408889634,
                    stride_qt=HQ * HEAD_DIM,
                    stride_qh=HEAD_DIM,
                    stride_kb=KV_BLOCK * HKV * HEAD_DIM,
                    stride_kr=HKV * HEAD_DIM,
                    stride_kh=HEAD_DIM,
                    stride_vb=KV_BLOCK * HKV * HEAD_DIM,
                    stride_vr=HKV * HEAD_DIM,
                    stride_vh=HEAD_DIM,
                    stride_ot=HQ * HEAD_DIM,
                    stride_oh=HEAD_DIM,
                    stride_bt=ANY,
                    GROUP=GROUP,
                    KV_BLOCK=KV_BLOCK,
                    HEAD_DIM=HEAD_DIM,
                    BLOCK_D=HEAD_DIM,
                    BLOCK_M=block,
                    BLOCK_N=block,
                    DOT_PRECISION=precision,
                ),
                dict(num_warps=warps, num_stages=2),
            )
        )
    return cases


def _conv_cases() -> list[Case]:
    cases = []
    # BT: one tile per sequence up to 32 tokens (next power of two of the longest), else 32-token tiles; BC
    # from a 4096-element tile budget (8192 with per-token states, [BT, BC, BKM1]), capped at 1024.
    for state_out in (False, True):
        for bt in (1, 2, 4, 8, 16, 32):
            budget, per = (8192, 4) if state_out else (4096, 1)
            bc = min(1024, max(16, budget // (bt * per)))
            for silu in (True, False) if bt == 1 and not state_out else (True,):
                cases.append(
                    Case(
                        f"conv1d bf16 BT={bt} BC={bc} USE_STATE_OUT={state_out} USE_SILU={silu}",
                        "conv1d",
                        "_conv_kernel",
                        dict(
                            x="*bf16",
                            weight="*bf16",
                            state="*bf16",
                            out="*bf16",
                            seqs="*i32",
                            tiles="*i32",
                            token_slots="*i32",
                            stride_xt=QKVZ,  # a column slice of in_proj_qkvz's output
                            stride_wc=CONV_K,
                            stride_wk=1,
                            stride_ss=CONV_DIM * (CONV_K - 1),
                            stride_sc=CONV_K - 1,
                            stride_sk=1,
                            C=CONV_DIM,
                            K=CONV_K,
                            BT=bt,
                            BC=bc,
                            BKM1=4,
                            USE_SILU=silu,
                            USE_STATE_OUT=state_out,
                        ),
                        dict(num_warps=4),
                    )
                )
    return cases


def _fp8_cases() -> list[Case]:
    cases = []
    # Activation quantisation: BLOCK_M = min(16, next_pow2(tokens)), 64 from 1,024 tokens; 128-channel groups.
    for dt, block_m, k in (
        ("bf16", 1, HIDDEN),
        ("bf16", 4, 4096),
        ("bf16", 16, MOE_INTER),
        ("fp32", 16, HIDDEN),
        ("bf16", 64, HIDDEN),  # prefill-sized M
    ):
        cases.append(
            Case(
                f"fp8 quantize {dt} BLOCK_M={block_m} K={k}",
                "fp8",
                "_quantize_kernel",
                dict(
                    x=f"*{dt}",
                    q="*fp8e4nv",
                    s="*fp32",
                    M=ANY,
                    K=k,
                    G=k // 128,
                    GROUP=128,
                    stride_xm=k,
                    stride_xk=1,
                    fp8_max=448.0,
                    eps=1e-10,
                    BLOCK_M=block_m,
                    BLOCK_G=128,
                ),
            )
        )
    # The block GEMM: every (BLOCK_M, BLOCK_N, warps, stages) of _CONFIGS at qkv_proj's shape (K 2048), the
    # shared expert's down_proj (K 512: 4 scale blocks, unaligned scale strides), a bias, an fp32 output.
    gemms = [
        ("bf16", 16, 64, 4, 4, 9216, HIDDEN, False),
        ("bf16", 32, 64, 4, 4, 9216, HIDDEN, False),
        ("bf16", 64, 128, 4, 4, 9216, HIDDEN, False),
        ("bf16", 128, 128, 8, 3, 9216, HIDDEN, False),
        ("bf16", 16, 64, 4, 4, HIDDEN, MOE_INTER, False),
        ("bf16", 64, 128, 4, 4, QKVZ, HIDDEN, True),
        ("fp32", 128, 128, 8, 3, HIDDEN, 4096, False),
    ]
    for dt, block_m, block_n, warps, stages, n, k, bias in gemms:
        kb = k // 128
        cases.append(
            Case(
                f"fp8 matmul {dt} BLOCK_M={block_m} BLOCK_N={block_n} N={n} K={k} HAS_BIAS={bias}",
                "fp8",
                "_block_fp8_matmul_kernel",
                dict(
                    a="*fp8e4nv",
                    a_s="*fp32",
                    b="*fp8e4nv",
                    b_s="*fp32",
                    bias=f"*{dt}",
                    c=f"*{dt}",
                    M=ANY,
                    N=n,
                    K=k,
                    GROUP_N=128,
                    stride_am=k,
                    stride_ak=1,
                    stride_asm=kb,
                    stride_ask=1,
                    stride_bn=k,
                    stride_bk=1,
                    stride_bsn=kb,
                    stride_bsk=1,
                    stride_cm=n,
                    stride_cn=1,
                    BLOCK_M=block_m,
                    BLOCK_N=block_n,
                    BLOCK_K=128,
                    GROUP_M=8,
                    HAS_BIAS=bias,
                    USE_FP8_DOT=True,  # sm_89+
                ),
                dict(num_warps=warps, num_stages=stages),
            )
        )
    return cases


def _deltanet_step_cases() -> list[Case]:
    # The fused short step: one program per (sequence, value head, dv tile), 8 warps for the [128, 128 /
    # V_SPLITS] fp32 state tile; BT the next power of two of the longest sequence (decode 1, verify 2-8);
    # bf16 (the model) and fp32; V_SPLITS dv tiles (4 at batch 1-4, 2 at 5-8).
    cases = []
    variants = [("bf16", 1, 1), ("bf16", 2, 1), ("bf16", 4, 1), ("bf16", 8, 1), ("fp32", 4, 1)]
    variants += [("bf16", 1, 2), ("bf16", 1, 4), ("bf16", 1, 8), ("bf16", 4, 4), ("fp32", 4, 4)]
    for dt, bt, splits in variants:
        cases.append(
            Case(
                f"deltanet_step {dt} BT={bt} V_SPLITS={splits}",
                "deltanet_step",
                "_deltanet_step_kernel",
                dict(
                    qkv=f"*{dt}",
                    z=f"*{dt}",
                    a=f"*{dt}",
                    b=f"*{dt}",
                    conv_weight=f"*{dt}",
                    conv_state=f"*{dt}",
                    a_log="*fp32",
                    dt_bias="*fp32",
                    state="*fp32",
                    norm_weight=f"*{dt}",
                    out=f"*{dt}",
                    seqs="*i32",
                    dests="*i32",
                    counters="*i32",
                    stride_xt=QKVZ,  # column slices of in_proj_qkvz's and in_proj_ba's outputs
                    stride_zt=QKVZ,
                    stride_at=2 * LIN_HV,
                    stride_bt=2 * LIN_HV,
                    stride_wc=CONV_K,
                    stride_wk=1,
                    stride_cs=CONV_DIM * (CONV_K - 1),
                    stride_cc=CONV_K - 1,
                    stride_ck=1,
                    stride_ss=LIN_HV * LIN_D * LIN_D,
                    stride_sh=LIN_D * LIN_D,
                    stride_sk=LIN_D,
                    stride_sv=1,
                    HV=LIN_HV,
                    RATIO=LIN_HV // LIN_HK,
                    KEY_DIM=LIN_HK * LIN_D,
                    DK=LIN_D,
                    DV=LIN_D,
                    scale=LIN_D**-0.5,
                    eps=1e-6,
                    K=CONV_K,
                    BT=bt,
                    BK=LIN_D,
                    BV=LIN_D // splits,
                    BDV=LIN_D,
                    BKM1=4,
                    V_SPLITS=splits,
                    SHARED_QK=True,
                    IS_ROUNDED_PRODUCT=dt == "bf16",
                ),
                dict(num_warps=8),
            )
        )
    return cases


def _gated_delta_cases() -> list[Case]:
    cases = []
    # BV = 32; 4 warps with few (sequence, head) programs, else 1.
    for state_out in (False, True):
        for warps in (4, 1):
            cases.append(
                Case(
                    f"gated_delta bf16 USE_STATE_OUT={state_out} num_warps={warps}",
                    "gated_delta",
                    "_recurrent_kernel",
                    dict(
                        q="*bf16",
                        k="*bf16",
                        v="*bf16",
                        g="*fp32",
                        beta="*bf16",
                        state="*fp32",
                        out="*bf16",
                        seqs="*i32",
                        token_slots="*i32",
                        stride_qt=CONV_DIM,  # column slices of the conv output
                        stride_qh=LIN_D,
                        stride_kt=CONV_DIM,
                        stride_kh=LIN_D,
                        stride_vt=CONV_DIM,
                        stride_vh=LIN_D,
                        stride_gt=LIN_HV,
                        stride_gh=1,
                        stride_bt=LIN_HV,
                        stride_bh=1,
                        stride_ss=LIN_HV * LIN_D * LIN_D,
                        stride_sh=LIN_D * LIN_D,
                        stride_sk=LIN_D,
                        stride_sv=1,
                        HV=LIN_HV,
                        RATIO=LIN_HV // LIN_HK,
                        DK=LIN_D,
                        DV=LIN_D,
                        scale=LIN_D**-0.5,
                        BK=LIN_D,
                        BV=32,
                        USE_STATE_OUT=state_out,
                    ),
                    dict(num_warps=warps),
                )
            )
    # Chunked prefill: WY factors per (chunk, value head), the state walk per (dv tile, sequence, head), the
    # outputs per (dv tile, chunk, head), with the launch choices of ChunkLaunch and _chunk_launch (state dv
    # tile 16, 32 or 64). bf16 inputs keep bf16 scratch and take tf32 fp32 products; fp32 inputs keep fp32
    # scratch and take 3xTF32 products.
    shape = dict(HV=LIN_HV, DK=LIN_D, DV=LIN_D, BT=64, BK=LIN_D)
    precisions = {"bf16": "tf32", "fp32": "tf32x3"}
    for dt, precision in precisions.items():
        cases.append(
            Case(
                f"gated_delta {dt} chunk_wy num_warps=4",
                "gated_delta",
                "_chunk_wy_kernel",
                dict(
                    k=f"*{dt}",
                    v=f"*{dt}",
                    g="*fp32",
                    beta=f"*{dt}",
                    chunks="*i32",
                    kd=f"*{dt}",
                    kend=f"*{dt}",
                    w=f"*{dt}",
                    cum="*fp32",
                    stride_kt=CONV_DIM,
                    stride_kh=LIN_D,
                    stride_vt=CONV_DIM,
                    stride_vh=LIN_D,
                    stride_gt=LIN_HV,
                    stride_gh=1,
                    stride_bt=LIN_HV,
                    stride_bh=1,
                    RATIO=LIN_HV // LIN_HK,
                    **shape,
                    BV=LIN_D,
                    BC=16,
                    DOT_PRECISION=precision,
                ),
                dict(num_warps=4),
            )
        )
    for dt, bv in (("bf16", 16), ("bf16", 32), ("bf16", 64), ("fp32", 64)):
        cases.append(
            Case(
                f"gated_delta {dt} chunk_state BV={bv} num_warps=4 num_stages=2",
                "gated_delta",
                "_chunk_state_kernel",
                dict(
                    kd=f"*{dt}",
                    kend=f"*{dt}",
                    w=f"*{dt}",
                    cum="*fp32",
                    h=f"*{dt}",
                    state="*fp32",
                    seqs="*i32",
                    stride_ss=LIN_HV * LIN_D * LIN_D,
                    stride_sh=LIN_D * LIN_D,
                    stride_sk=LIN_D,
                    stride_sv=1,
                    **shape,
                    BV=bv,
                    DOT_PRECISION=precisions[dt],
                ),
                dict(num_warps=4, num_stages=2),
            )
        )
    for dt, precision in precisions.items():
        cases.append(
            Case(
                f"gated_delta {dt} chunk_out BV=64 num_warps=4",
                "gated_delta",
                "_chunk_out_kernel",
                dict(
                    q=f"*{dt}",
                    k=f"*{dt}",
                    u=f"*{dt}",
                    cum="*fp32",
                    h=f"*{dt}",
                    out=f"*{dt}",
                    chunks="*i32",
                    stride_qt=CONV_DIM,
                    stride_qh=LIN_D,
                    stride_kt=CONV_DIM,
                    stride_kh=LIN_D,
                    RATIO=LIN_HV // LIN_HK,
                    **shape,
                    scale=LIN_D**-0.5,
                    BV=64,
                    DOT_PRECISION=precision,
                ),
                dict(num_warps=4),
            )
        )
    return cases


def _moe_cases() -> list[Case]:
    cases = []
    # Routing with the shared expert's gate as logit E (the model) and without; E = 256 -> BLOCK_E 256.
    routes = (("bf16", True, True), ("bf16", False, True), ("bf16", True, False), ("fp32", True, True))
    for dt, renorm, shared in routes:
        slots = TOP_K + shared
        cases.append(
            Case(
                f"moe route {dt} USE_RENORM={renorm} HAS_SHARED={shared}",
                "moe",
                "_route_kernel",
                dict(
                    logits_ptr=f"*{dt}",
                    weights_ptr="*fp32",
                    ids_ptr="*i64",
                    num_experts=EXPERTS,
                    stride_lt=EXPERTS + shared,
                    stride_le=1,
                    TOP_K=TOP_K,
                    OUT_SLOTS=slots,
                    BLOCK_E=EXPERTS,
                    BLOCK_K=16 if shared else TOP_K,
                    USE_RENORM=renorm,
                    HAS_SHARED=shared,
                ),
                dict(num_warps=1),
            )
        )
    # align.align_block_size: 257 experts (256 + shared, BLOCK_E 512) over 9 slots, or 256 over 8 (an FP8
    # shared expert runs on its own); BLOCK_C, BLOCK_B = 4096 // BLOCK_E capped at 16, 32.
    for num_experts, slots in ((EXPERTS + 1, TOP_K + 1), (EXPERTS, TOP_K)):
        block_e = 512 if num_experts > 256 else 256
        ids = dict(ids_ptr="*i64", stride_it=slots, stride_is=1)
        sizes = dict(num_pairs=ANY, chunk=64, num_experts=num_experts)
        tag = f"E={num_experts} NUM_SLOTS={slots}"
        cases.append(
            Case(
                f"moe align count {tag}",
                "moe",
                "_count_kernel",
                dict(
                    **ids,
                    counts_ptr="*i32",
                    **sizes,
                    stride_cc=num_experts,
                    NUM_SLOTS=slots,
                    BLOCK_P=64,
                    BLOCK_E=block_e,
                ),
                dict(num_warps=4),
            )
        )
        for block_m, single in ((16, True), (16, False), (64, False)):
            cases.append(
                Case(
                    f"moe align {tag} BLOCK_M={block_m} IS_SINGLE={single}",
                    "moe",
                    "_align_kernel",
                    dict(
                        **ids,
                        counts_ptr="*i32",
                        cursor_ptr="*i32",
                        sorted_pairs_ptr="*i32",
                        block_experts_ptr="*i32",
                        block_rows_ptr="*i32",
                        **sizes,
                        num_chunks=1 if single else ANY,
                        num_blocks=ANY,
                        stride_cc=num_experts,
                        NUM_SLOTS=slots,
                        BLOCK_M=block_m,
                        BLOCK_P=64,
                        BLOCK_E=block_e,
                        BLOCK_C=min(16, 4096 // block_e),
                        BLOCK_B=min(32, 4096 // block_e),
                        IS_SINGLE=single,
                    ),
                    dict(num_warps=4),
                )
            )
    # moe.config.choose_config: three row buckets, halved BLOCK_K and fewer stages for fp32 (which also uses
    # ieee dots); the down GEMM also split over K in two (fp32 partial sums).
    configs = {
        "bf16": ((16, 32, 128, 4), (32, 64, 64, 4), (64, 64, 64, 3)),
        "fp32": ((16, 32, 64, 3), (32, 64, 32, 3), (64, 64, 32, 2)),
    }
    slots = TOP_K + 1
    for dt, buckets in configs.items():
        precision = "ieee" if dt == "fp32" else "tf32"
        for block_m, block_n, block_k, stages in buckets:
            blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision)
            launch = dict(num_warps=4, num_stages=stages)
            tag = f"{dt} BLOCK_M={block_m} BLOCK_N={block_n} BLOCK_K={block_k}"
            common = dict(
                sorted_pairs_ptr="*i32",
                block_experts_ptr="*i32",
                block_rows_ptr="*i32",
                hidden=HIDDEN,
                inter=MOE_INTER,
                shared_inter=MOE_INTER,
                num_experts=EXPERTS,
            )
            cases.append(
                Case(
                    f"moe gate_up {tag}",
                    "moe",
                    "_gate_up_kernel",
                    dict(
                        x_ptr=f"*{dt}",
                        w13_ptr=f"*{dt}",
                        ws13_ptr=f"*{dt}",
                        act_ptr=f"*{dt}",
                        **common,
                        stride_xt=HIDDEN,
                        stride_xh=1,
                        stride_we=2 * MOE_INTER * HIDDEN,
                        stride_wn=HIDDEN,
                        stride_wh=1,
                        stride_sn=HIDDEN,
                        stride_ap=MOE_INTER,
                        stride_ai=1,
                        NUM_SLOTS=slots,
                        **blocks,
                    ),
                    launch,
                )
            )
            for split in (1, 2) if dt == "bf16" else (1,):
                part = "fp32" if split > 1 else dt
                cases.append(
                    Case(
                        f"moe down {tag} SPLIT_K={split}",
                        "moe",
                        "_down_kernel",
                        dict(
                            act_ptr=f"*{dt}",
                            w2_ptr=f"*{dt}",
                            ws2_ptr=f"*{dt}",
                            weights_ptr="*fp32",
                            part_ptr=f"*{part}",
                            **common,
                            stride_ap=MOE_INTER,
                            stride_ai=1,
                            stride_we=HIDDEN * MOE_INTER,
                            stride_wh=MOE_INTER,
                            stride_wi=1,
                            stride_sh=MOE_INTER,
                            stride_gt=slots,
                            stride_gs=1,
                            stride_ps=ANY * slots * HIDDEN,
                            stride_pp=HIDDEN,
                            stride_ph=1,
                            NUM_SLOTS=slots,
                            SPLIT_K=split,
                            **blocks,
                        ),
                        launch,
                    )
                )
    # The combine: 9 slots (shared expert included), or 8 plus an FP8 shared expert's output (HAS_EXTRA).
    for part, parts, extra in (("bf16", 1, False), ("fp32", 2, False), ("bf16", 1, True)):
        cases.append(
            Case(
                f"moe combine {part} PARTS={parts} HAS_EXTRA={extra}",
                "moe",
                "_combine_kernel",
                dict(
                    part_ptr=f"*{part}",
                    extra_ptr="*bf16",
                    gate_ptr="*fp32",
                    out_ptr="*bf16",
                    hidden=HIDDEN,
                    stride_ps=ANY * slots * HIDDEN,
                    stride_pp=HIDDEN,
                    stride_ph=1,
                    stride_et=HIDDEN,
                    stride_eh=1,
                    stride_g=slots,
                    stride_ot=HIDDEN,
                    stride_oh=1,
                    NUM_SLOTS=TOP_K if extra else slots,
                    PARTS=parts,
                    HAS_EXTRA=extra,
                    BLOCK_H=512,
                ),
                dict(num_warps=4),
            )
        )
    return cases


def _linear_cases() -> list[Case]:
    # linear.triton at decode (ROWS = M tokens): bf16 in_proj_qkvz (no split), qkv_proj with a bias, out_proj
    # and in_proj_ba (K split: fp32 partial sums, then the split sum), the FP8 block linear (e4m3 weights,
    # 128 x 128 scale blocks, FP8_TILES: 32 rows of 256 channels, GROUP 128, KG 2) and fp32; the default
    # LinearTiles otherwise (8 rows, 1 KB of each row per step, 16-byte groups: GROUP 8 for bf16, 4 for fp32).
    cases = []
    variants = (
        ("bf16", "bf16", 1, QKVZ, HIDDEN, 0, False),
        ("bf16", "bf16", 4, QKVZ, HIDDEN, 0, False),
        ("bf16", "bf16", 8, QKVZ, HIDDEN, 0, False),
        ("bf16", "bf16", 3, 9216, HIDDEN, 0, True),
        ("bf16", "bf16", 1, HIDDEN, 4096, 1536, False),
        ("bf16", "bf16", 8, 2 * LIN_HV, HIDDEN, 512, False),
        ("bf16", "fp8e4nv", 1, QKVZ, HIDDEN, 0, False),
        ("bf16", "fp8e4nv", 8, QKVZ, HIDDEN, 0, True),
        ("bf16", "fp8e4nv", 1, HIDDEN, 4096, 2048, False),
        ("fp32", "fp32", 2, 257, HIDDEN, 512, False),
        # x quantised before the kernel (X_QUANT: x e4m3 with its scales), FP8Q_TILES: 16 rows, 4 groups.
        ("fp8e4nv", "fp8e4nv", 1, QKVZ, HIDDEN, 0, False),
        ("fp8e4nv", "fp8e4nv", 1, HIDDEN, 4096, 2048, False),
    )
    for dt, w_dt, rows, n, k, k_split, bias in variants:
        fp8, split = w_dt == "fp8e4nv", k_split > 0
        x_quant = dt == "fp8e4nv"
        out_dt = "bf16" if x_quant else dt
        elem = {"bf16": 2, "fp8e4nv": 1, "fp32": 4}[w_dt]
        group = 128 if fp8 else 16 // elem
        cases.append(
            Case(
                f"linear {dt} w={w_dt} ROWS={rows} N={n} K={k} USE_SPLIT={split} HAS_BIAS={bias}",
                "linear",
                "_linear_kernel",
                dict(
                    x_ptr=f"*{dt}",
                    w_ptr=f"*{w_dt}",
                    scale_ptr="*fp32" if fp8 else f"*{dt}",
                    xs_ptr="*fp32" if x_quant else f"*{dt}",
                    bias_ptr=f"*{out_dt}",
                    out_ptr="*fp32" if split else f"*{out_dt}",
                    n_size=n,
                    k_size=k,
                    k_split=k_split or k,
                    block_rows=128 if fp8 else 1,
                    stride_xm=k,
                    stride_xk=1,
                    stride_wn=k,
                    stride_wk=1,
                    stride_sn=k // 128 if fp8 else 0,
                    stride_sk=1 if fp8 else 0,
                    stride_xsm=k // 128 if x_quant else 0,
                    stride_xsk=1 if x_quant else 0,
                    stride_b=1,
                    stride_os=rows * n,
                    stride_om=n,
                    stride_on=1,
                    ROWS=rows,
                    BLOCK_M=1 << (rows - 1).bit_length(),
                    BLOCK_N=16 if x_quant else 32 if fp8 else 8,
                    GROUP=group,
                    BLOCK_C=group,
                    KG=4 if x_quant else 2 if fp8 else 1024 // elem // group,
                    HAS_BIAS=bias,
                    USE_FP8=fp8,
                    USE_SPLIT=split,
                    X_QUANT=x_quant,
                ),
                dict(num_warps=4),
            )
        )
    for dt, bias in (("bf16", False), ("bf16", True), ("fp32", False)):
        cases.append(
            Case(
                f"linear sum splits {dt} HAS_BIAS={bias}",
                "linear",
                "_sum_splits_kernel",
                dict(
                    part_ptr="*fp32",
                    bias_ptr=f"*{dt}",
                    out_ptr=f"*{dt}",
                    n_size=HIDDEN,
                    splits=3,
                    stride_ps=ANY * HIDDEN,
                    stride_pm=HIDDEN,
                    stride_b=1,
                    stride_om=HIDDEN,
                    stride_on=1,
                    BLOCK=256,
                    HAS_BIAS=bias,
                ),
                dict(num_warps=4),
            )
        )
    return cases


def _moe_gemv_cases() -> list[Case]:
    # moe.gemv at decode: bf16 with the shared slot (9), FP8 (block 128, 8 slots), and fp32 (CPU-sized runs);
    # the default GemvTiles: 1 KB of each weight row per step, 8 act columns / 16 hidden rows per program.
    cases = []
    variants = (
        ("bf16", "bf16", TOP_K + 1, 4, 4),
        ("bf16", "fp8e4nv", TOP_K, 8, 4),
        ("fp32", "fp32", TOP_K + 1, 2, 2),
    )
    for dt, w_dt, slots, kg_up, kg_down in variants:
        fp8 = w_dt == "fp8e4nv"
        bn = 128 if fp8 else 1
        up_scales = (8 * 16, 16, 1) if fp8 else (0, 0, 0)  # [E, 2 * 4, 16]
        down_scales = (16 * 4, 4, 1) if fp8 else (0, 0, 0)  # [E, 16, 4]
        common = dict(
            ids_ptr="*i64",
            hidden=HIDDEN,
            inter=MOE_INTER,
            shared_inter=MOE_INTER,
            num_experts=EXPERTS,
            block_rows=bn,
            stride_it=slots,
            stride_is=1,
            NUM_SLOTS=slots,
            GROUP=128,
            BLOCK_C=128,
            USE_FP8=fp8,
        )
        tag = f"{dt} w={w_dt} NUM_SLOTS={slots}"
        cases.append(
            Case(
                f"moe gemv gate_up {tag} KG={kg_up}",
                "moe.gemv",
                "_gate_up_kernel",
                dict(
                    x_ptr=f"*{dt}",
                    w13_ptr=f"*{w_dt}",
                    ws13_ptr=f"*{w_dt}",
                    scale_ptr="*fp32" if fp8 else f"*{dt}",
                    act_ptr=f"*{dt}",
                    scale_rows_up=MOE_INTER // bn,
                    stride_xt=HIDDEN,
                    stride_xh=1,
                    stride_we=2 * MOE_INTER * HIDDEN,
                    stride_wn=HIDDEN,
                    stride_wh=1,
                    stride_sn=HIDDEN,
                    **dict(zip(("stride_ce", "stride_cn", "stride_ck"), up_scales, strict=True)),
                    stride_ap=MOE_INTER,
                    stride_ai=1,
                    **common,
                    BLOCK_N=8,
                    KG=kg_up,
                ),
                dict(num_warps=4),
            )
        )
        cases.append(
            Case(
                f"moe gemv down {tag} KG={kg_down}",
                "moe.gemv",
                "_down_kernel",
                dict(
                    act_ptr=f"*{dt}",
                    weights_ptr="*fp32",
                    w2_ptr=f"*{w_dt}",
                    ws2_ptr=f"*{w_dt}",
                    scale_ptr="*fp32" if fp8 else f"*{dt}",
                    part_ptr="*fp32",
                    stride_ap=MOE_INTER,
                    stride_ai=1,
                    stride_gt=slots,
                    stride_gs=1,
                    stride_we=HIDDEN * MOE_INTER,
                    stride_wh=MOE_INTER,
                    stride_wi=1,
                    stride_sh=MOE_INTER,
                    **dict(zip(("stride_ce", "stride_cn", "stride_ck"), down_scales, strict=True)),
                    stride_pp=HIDDEN,
                    stride_ph=1,
                    **common,
                    BLOCK_N=16,
                    KG=kg_down,
                ),
                dict(num_warps=4),
            )
        )
    # Its combine: one fp32 part per slot, with an FP8 shared expert's output (HAS_EXTRA) or without.
    for slots, extra in ((TOP_K + 1, False), (TOP_K, True)):
        cases.append(
            Case(
                f"moe gemv combine fp32 PARTS=1 HAS_EXTRA={extra}",
                "moe",
                "_combine_kernel",
                dict(
                    part_ptr="*fp32",
                    extra_ptr="*bf16",
                    gate_ptr="*fp32",
                    out_ptr="*bf16",
                    hidden=HIDDEN,
                    stride_ps=0,
                    stride_pp=HIDDEN,
                    stride_ph=1,
                    stride_et=HIDDEN,
                    stride_eh=1,
                    stride_g=TOP_K + 1,
                    stride_ot=HIDDEN,
                    stride_oh=1,
                    NUM_SLOTS=slots,
                    PARTS=1,
                    HAS_EXTRA=extra,
                    BLOCK_H=512,
                ),
                dict(num_warps=4),
            )
        )
    return cases


def _swiglu_cases() -> list[Case]:
    # The shared expert's [T, 2 * 512] gate_up output (an FP8 one, outside the grouped GEMMs).
    return [
        Case(
            f"swiglu {dt} BLOCK=512",
            "swiglu",
            "_swiglu_kernel",
            dict(x=f"*{dt}", out=f"*{dt}", inter=MOE_INTER, stride_xm=2 * MOE_INTER, BLOCK=MOE_INTER),
            dict(num_warps=4),
        )
        for dt in ("bf16", "fp32")
    ]


def _sampling_cases() -> list[Case]:
    # [B, 248320] logits (fp32 from the model, bf16 in the GPU test), top_k int64 (the sampler's) or int32.
    vocab = 248320
    return [
        Case(
            f"sampling {dt} top_k {kt} CHUNK=4096 CAP=4096",
            "sampling",
            "_sample_kernel",
            dict(
                logits=f"*{dt}",
                race="*fp32",
                temperature="*fp32",
                top_k=f"*{kt}",
                top_p="*fp32",
                out="*i64",
                scratch="*i32",
                tile_max="*fp32",
                V=vocab,
                stride_lb=vocab,
                stride_rb=vocab,
                CHUNK=4096,
                SUB=1024,
                CAP=4096,
                SMALL=256,
                NB=1024,
                NPIV=8,
            ),
            dict(num_warps=8),
        )
        for dt, kt in (("fp32", "i64"), ("bf16", "i32"))
    ]


def _norm_cases() -> list[Case]:
    cases = []

    def norm(name, dt, w_dt, strides, b, d, br, gated, zero_centered, rounded, residual=False):
        cases.append(
            Case(
                f"norm {name} {dt} BR={br} BD={d}",
                "norm",
                "_rms_norm_kernel",
                dict(
                    x=f"*{dt}",
                    weight=f"*{w_dt}",
                    gate=f"*{dt}",
                    residual=f"*{dt}",
                    out=f"*{dt}",
                    residual_out=f"*{dt}",
                    stride_xa=strides[0],
                    stride_xb=strides[1],
                    stride_ga=strides[2],
                    stride_gb=strides[3],
                    stride_ra=strides[0],
                    stride_rb=strides[1],
                    B=b,
                    R=ANY,
                    D=d,
                    eps=1e-6,
                    BR=br,
                    BD=d,
                    IS_GATED=gated,
                    IS_ZERO_CENTERED=zero_centered,
                    IS_ROUNDED_PRODUCT=rounded,
                    HAS_RESIDUAL=residual,
                ),
                dict(num_warps=4),
            )
        )

    # BR = min(4096 // BD, next_pow2(rows)). Hidden [T, 2048] as [1, T, D]: 1 or 2 rows.
    for br in (1, 2):
        norm(
            "hidden",
            "bf16",
            "bf16",
            (ANY * HIDDEN, HIDDEN, ANY * HIDDEN, HIDDEN),
            ANY,
            HIDDEN,
            br,
            False,
            True,
            False,
        )
    # q norm: [T, 16, 256] inside [T, 16, q | gate]; k norm: [T, 2, 256] inside the qkv_proj output (2+ rows).
    norm("q", "bf16", "bf16", (HQ * 2 * HEAD_DIM, 2 * HEAD_DIM) * 2, HQ, HEAD_DIM, 16, False, True, False)
    qkv = HQ * 2 * HEAD_DIM + 2 * HKV * HEAD_DIM
    for br in (2, 4, 8, 16):
        norm("k", "bf16", "bf16", (qkv, HEAD_DIM) * 2, HKV, HEAD_DIM, br, False, True, False)
    norm("plain", "bf16", "bf16", (ANY * HIDDEN, HIDDEN) * 2, ANY, HIDDEN, 2, False, False, False)
    # Residual add + norm (every decoder layer, twice): [T, 2048] and its residual stream.
    for dt, brs in (("bf16", (1, 2)), ("fp32", (2,))):
        for br in brs:
            hidden = (ANY * HIDDEN, HIDDEN) * 2
            norm("add", dt, dt, hidden, ANY, HIDDEN, br, False, True, False, residual=True)
    # Gated: [T, 32, 128] with z's column slice of in_proj_qkvz as the gate; the product is rounded to bf16
    # when the weight is bf16 too, not with an fp32 weight or fp32 activations.
    gated_strides = (LIN_HV * LIN_D, LIN_D, QKVZ, LIN_D)
    norm("gated rounded", "bf16", "bf16", gated_strides, LIN_HV, LIN_D, 32, True, False, True)
    norm("gated fp32-weight", "bf16", "fp32", gated_strides, LIN_HV, LIN_D, 32, True, False, False)
    norm("gated", "fp32", "fp32", gated_strides, LIN_HV, LIN_D, 32, True, False, False)
    norm("hidden", "fp32", "fp32", (ANY * HIDDEN, HIDDEN) * 2, ANY, HIDDEN, 2, False, True, False)
    return cases


def _rotary_cases() -> list[Case]:
    cases = []
    # cos/sin tables [T, 64] from int64 positions: BT = min(32, next_pow2(T)).
    for bt in (1, 32):
        cases.append(
            Case(
                f"rotary cos_sin BT={bt} BD=64",
                "rotary",
                "_cos_sin_kernel",
                dict(
                    positions="*i64",
                    inv_freq="*fp32",
                    cos="*fp32",
                    sin="*fp32",
                    T=ANY,
                    RD=64,
                    scale=1.0,
                    BT=bt,
                    BD=64,
                ),
                dict(num_warps=4),
            )
        )
    # q [T, 16, 256] and k [T, 2, 256] (the norms' contiguous outputs), cos/sin [T, 64] fp32.
    for dt, heads in (("bf16", HQ), ("bf16", HKV), ("fp32", HQ)):
        cases.append(
            Case(
                f"rotary {dt} BH={heads} BD={HEAD_DIM}",
                "rotary",
                "_rotary_kernel",
                dict(
                    x=f"*{dt}",
                    cos="*fp32",
                    sin="*fp32",
                    out=f"*{dt}",
                    stride_xt=heads * HEAD_DIM,
                    stride_xh=HEAD_DIM,
                    stride_ct=64,
                    stride_cd=1,
                    stride_st=64,
                    stride_sd=1,
                    H=heads,
                    D=HEAD_DIM,
                    RD=64,
                    BH=heads,
                    BD=HEAD_DIM,
                ),
                dict(num_warps=4, enable_fp_fusion=False),
            )
        )
    return cases


def _qk_norm_rotary_cases() -> list[Case]:
    # q [T, 16, 256] inside [T, 16, q | gate], k [T, 2, 256] inside the qkv_proj output; 4 heads a program.
    qkv = HQ * 2 * HEAD_DIM + 2 * HKV * HEAD_DIM
    return [
        Case(
            f"qk_norm_rotary {dt} BH=4 BD={HEAD_DIM}",
            "qk_norm_rotary",
            "_qk_norm_rotary_kernel",
            dict(
                q=f"*{dt}",
                k=f"*{dt}",
                q_weight=f"*{dt}",
                k_weight=f"*{dt}",
                cos="*fp32",
                sin="*fp32",
                q_out=f"*{dt}",
                k_out=f"*{dt}",
                stride_qt=qkv,
                stride_qh=2 * HEAD_DIM,
                stride_kt=qkv,
                stride_kh=HEAD_DIM,
                stride_ct=64,
                stride_cd=1,
                stride_st=64,
                stride_sd=1,
                HQ=HQ,
                HKV=HKV,
                D=HEAD_DIM,
                RD=64,
                eps=1e-6,
                BH=4,
                BD=HEAD_DIM,
            ),
            dict(num_warps=4, enable_fp_fusion=False),
        )
        for dt in ("bf16", "fp32")
    ]


def _gate_cases() -> list[Case]:
    cases = []
    # DeltaNet gates: b and a column slices of in_proj_ba's [T, 2 Hv] output; BT = min(32, next_pow2(T)).
    for dt, bt in (("bf16", 1), ("bf16", 32), ("fp32", 32)):
        cases.append(
            Case(
                f"deltanet_gate {dt} BT={bt} BH={LIN_HV}",
                "deltanet_gate",
                "_deltanet_gate_kernel",
                dict(
                    a=f"*{dt}",
                    b=f"*{dt}",
                    a_log=f"*{dt}",
                    dt_bias=f"*{dt}",
                    g="*fp32",
                    beta=f"*{dt}",
                    stride_at=2 * LIN_HV,
                    stride_bt=2 * LIN_HV,
                    T=ANY,
                    HV=LIN_HV,
                    BT=bt,
                    BH=LIN_HV,
                ),
                dict(num_warps=4),
            )
        )
    # Attention output gate: [T, 16, 256] output, gate the second half of each head of the projection.
    qkv = HQ * 2 * HEAD_DIM + 2 * HKV * HEAD_DIM
    for dt in ("bf16", "fp32"):
        cases.append(
            Case(
                f"sigmoid_gate {dt} BH=8 BD={HEAD_DIM}",
                "sigmoid_gate",
                "_sigmoid_gate_kernel",
                dict(
                    x=f"*{dt}",
                    gate=f"*{dt}",
                    out=f"*{dt}",
                    stride_xt=HQ * HEAD_DIM,
                    stride_xh=HEAD_DIM,
                    stride_gt=qkv,
                    stride_gh=2 * HEAD_DIM,
                    H=HQ,
                    D=HEAD_DIM,
                    BH=8,
                    BD=HEAD_DIM,
                ),
                dict(num_warps=4),
            )
        )
    return cases


def _moe_fp8_cases() -> list[Case]:
    # moe.fp8: the W8A8 grouped GEMMs on e4m3 experts (128 x 128 blocks, BLOCK_K 128), 8 routed slots (the
    # shared expert runs outside; weights a column slice of [T, 9]); choose_config's three row buckets by x's
    # dtype (fp32: fewer stages); the down GEMM also split in two (fp32 partial sums). Combine: `_moe_cases`.
    cases = []
    configs = {"bf16": ((16, 32, 4), (32, 64, 4), (64, 64, 3)), "fp32": ((16, 32, 3), (64, 64, 2))}
    for dt, buckets in configs.items():
        for block_m, block_n, stages in buckets:
            blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, USE_FP8_DOT=True)
            launch = dict(num_warps=4, num_stages=stages)
            tag = f"{dt} BLOCK_M={block_m} BLOCK_N={block_n}"
            common = dict(
                sorted_pairs_ptr="*i32",
                block_experts_ptr="*i32",
                block_rows_ptr="*i32",
                hidden=HIDDEN,
                inter=MOE_INTER,
                group_n=128,
                NUM_SLOTS=TOP_K,
            )
            cases.append(
                Case(
                    f"moe fp8 gate_up {tag}",
                    "moe.fp8",
                    "_fp8_gate_up_kernel",
                    dict(
                        xq_ptr="*fp8e4nv",
                        xs_ptr="*fp32",
                        w13_ptr="*fp8e4nv",
                        s13_ptr="*fp32",
                        act_ptr=f"*{dt}",
                        **common,
                        half_blocks=MOE_INTER // 128,
                        stride_xt=HIDDEN,
                        stride_xh=1,
                        stride_xst=HIDDEN // 128,
                        stride_xsk=1,
                        stride_we=2 * MOE_INTER * HIDDEN,
                        stride_wn=HIDDEN,
                        stride_wh=1,
                        stride_se=(2 * MOE_INTER // 128) * (HIDDEN // 128),
                        stride_sn=HIDDEN // 128,
                        stride_sk=1,
                        stride_ap=MOE_INTER,
                        stride_ai=1,
                        **blocks,
                    ),
                    launch,
                )
            )
            for split in (1, 2) if block_m == 16 else (1,):
                part = "fp32" if split > 1 else dt
                cases.append(
                    Case(
                        f"moe fp8 down {tag} SPLIT_K={split}",
                        "moe.fp8",
                        "_fp8_down_kernel",
                        dict(
                            aq_ptr="*fp8e4nv",
                            as_ptr="*fp32",
                            w2_ptr="*fp8e4nv",
                            s2_ptr="*fp32",
                            weights_ptr="*fp32",
                            part_ptr=f"*{part}",
                            **common,
                            stride_ap=MOE_INTER,
                            stride_ai=1,
                            stride_asp=MOE_INTER // 128,
                            stride_ask=1,
                            stride_we=HIDDEN * MOE_INTER,
                            stride_wh=MOE_INTER,
                            stride_wi=1,
                            stride_se=(HIDDEN // 128) * (MOE_INTER // 128),
                            stride_sh=MOE_INTER // 128,
                            stride_sk=1,
                            stride_gt=TOP_K + 1,
                            stride_gs=1,
                            stride_ps=ANY * TOP_K * HIDDEN,
                            stride_pp=HIDDEN,
                            stride_ph=1,
                            SPLIT_K=split,
                            **blocks,
                        ),
                        launch,
                    )
                )
    return cases


def _cases() -> list[Case]:
    return [
        *_attention_cases(),
        *_conv_cases(),
        *_fp8_cases(),
        *_gate_cases(),
        *_deltanet_step_cases(),
        *_gated_delta_cases(),
        *_moe_cases(),
        *_linear_cases(),
        *_moe_gemv_cases(),
        *_moe_fp8_cases(),
        *_swiglu_cases(),
        *_norm_cases(),
        *_qk_norm_rotary_cases(),
        *_rotary_cases(),
        *_sampling_cases(),
    ]


# ---------------------------------------------------------------------------------------------------------
# The subprocess side (no TRITON_INTERPRET).


def _source(fn, args: dict[str, Any]):
    """An ASTSource of `fn` for `args`, signature and specialisation as the launcher would make them."""
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    if "PDL" in names and "PDL" not in args:
        # Launched with programmatic dependent launch on an H200 (`engine.kernels.pdl`): compile that.
        args = {**args, "PDL": True}
    if set(args) != set(names):
        raise TypeError(
            f"arguments {sorted(set(names) - set(args))} missing, {sorted(set(args) - set(names))} unknown"
        )
    params = {p.name: p for p in fn.params}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value, param = args[name], params[name]
        aligned = [["tt.divisibility", 16]]
        if param.is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, str):
            if not value.startswith("*"):
                raise TypeError(f"{name}: a pointer is given as '*dtype', got {value!r}")
            signature[name] = value
            if not getattr(param, "do_not_specialize_on_alignment", False):
                attrs[(i,)] = aligned
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int):
            specialize = not getattr(param, "do_not_specialize", False)
            if specialize and value == 1:
                signature[name], constexprs[(i,)] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if specialize and value % 16 == 0 and not getattr(param, "do_not_specialize_on_alignment", False):
                attrs[(i,)] = aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot pass {value!r}")
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _compile(fn, args: dict[str, Any], options: dict[str, Any]):
    import triton
    from triton.backends.compiler import GPUTarget

    if "PDL" in fn.arg_names:
        options = {**options, "launch_pdl": True}
    return triton.compile(_source(fn, args), target=GPUTarget("cuda", 90, 32), options=options)


def _probe() -> str | None:
    """Why this Triton cannot compile for sm_90 offline, or None when a trivial kernel compiles."""
    try:
        import triton
        import triton.language as tl

        if os.environ.get("TRITON_INTERPRET"):
            return "TRITON_INTERPRET is set"

        @triton.jit
        def _probe_kernel(x, n, BLOCK: tl.constexpr):
            o = tl.arange(0, BLOCK)
            tl.store(x + o, tl.load(x + o, mask=o < n) + 1.0, mask=o < n)

        _compile(_probe_kernel, dict(x="*fp32", n=ANY, BLOCK=128), dict(num_warps=1))
    except Exception as e:  # any failure here: no usable backend, reported as a skip
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return None


def _error(case: Case, fn, e: Exception) -> str:
    """The compiler's message, with the kernel's file and `def` line (a CompilationError's "at R:C" counts
    rows from that line)."""
    import inspect

    path = case.module_name.replace(".", "/") + ".py"
    line = getattr(fn, "def_file_line_number", None) or inspect.getsourcelines(fn.fn)[1]
    where = f"{type(e).__name__} in {path}, {case.kernel} (def at line {line})"
    node = getattr(e, "node", None)
    if getattr(node, "lineno", None):
        where += f", error at line {line + node.lineno - 1}"
    text = str(e)
    if not hasattr(e, "node"):  # not a front-end error: where in the pipeline it failed
        text += "\n" + "".join(traceback.format_exception(e)[-4:])
    return f"{where}:\n{text}"


def _main(argv: list[str]) -> None:
    import importlib

    shard, shards = 0, 1
    filters = []
    for arg in argv:
        if arg.startswith("--shard="):
            shard, shards = map(int, arg.removeprefix("--shard=").split("/"))
        else:
            filters.append(arg)
    why = _probe()
    if why is not None:
        print(SKIP + why, flush=True)
        return
    for index, case in enumerate(_cases()):
        if index % shards != shard or (filters and not any(f in case.name for f in filters)):
            continue
        fn = getattr(importlib.import_module(case.module_name), case.kernel)
        start, error, shared = time.perf_counter(), "", None
        try:
            compiled = _compile(fn, case.args, case.options)
            shared = compiled.metadata.shared
            if shared > SM90_MAX_SHARED:
                error = f"needs {shared} bytes of shared memory, an H200 block has at most {SM90_MAX_SHARED}"
        except Exception as e:  # report every variant's failure, not just the first
            error = _error(case, fn, e)
        seconds = time.perf_counter() - start
        out = dict(name=case.name, error=error, shared=shared, seconds=round(seconds, 2))
        print(RESULT + json.dumps(out), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
