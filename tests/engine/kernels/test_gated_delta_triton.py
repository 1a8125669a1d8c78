"""The Triton gated delta rule against the torch reference, over odd shapes and variable-length layouts.

Slots a sequence starts fresh from (and the scratch slots a verify step writes) are filled with NaN, so a
kernel that reads a slot it should ignore, or leaves a state or an output unwritten, fails the comparison.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import SeqLayout, dispatch
from engine.kernels.gated_delta import reference
from engine.kernels.gated_delta import triton as gd_triton

NAN = float("nan")
# The interpreter on the CPU (CI), the compiled kernel where there is a GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Same inputs, fp32 state and accumulation on both sides: only the order of the dk sums differs, and that
# error grows over a 64-token recurrence to about 1e-6 here.
FP32 = {"rtol": 1e-4, "atol": 1e-5}
# fp16 outputs are rounded from fp32 values that agree to ~1e-6: at most one fp16 ulp (~1e-3 near 1) apart.
FP16 = {"rtol": 2e-3, "atol": 2e-3}
# fp32 states after a chunked prefill from fp16 inputs: the chunked kernels keep their scratch (the written
# values u, the factors kd, the decayed keys) in fp16, one rounding (2^-11) in each of a chunk's 64 update
# terms; measured up to 1e-3 here.
CHUNKED_STATE_FP16 = {"rtol": 4e-3, "atol": 4e-3}


def rand(*shape, seed, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def delta_inputs(t, hk, hv, dk, dv, dtype, seed=0, device=DEVICE):
    """Strided views as the model passes them: q, k, v split from one packed projection, beta from [b | a]."""
    qkv = rand(t, 2 * hk * dk + hv * dv, seed=seed, device=device).to(dtype)
    q, k, v = qkv.split((hk * dk, hk * dk, hv * dv), dim=-1)
    ba = rand(t, 2 * hv, seed=seed + 1, device=device)
    beta = torch.sigmoid(ba).to(dtype)[:, :hv]
    g = -F.softplus(rand(t, hv, seed=seed + 2, device=device))  # fp32 log decay <= 0
    return q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), g, beta


def start_state(layout, num_slots, hv, dk, dv, seed=0, device=DEVICE):
    """[S, Hv, dk, dv]: NaN everywhere but the slots of sequences with context."""
    state = torch.full((num_slots, hv, dk, dv), NAN, device=device)
    for slot, c in zip(layout.slots, layout.context_lens, strict=True):
        if c > 0:
            state[slot] = rand(hv, dk, dv, seed=seed + slot, device=device) * 0.3
    return state


def compare(layout, num_slots, hk, hv, dk, dv, dtype, tol, seed=0):
    q, k, v, g, beta = delta_inputs(layout.num_tokens, hk, hv, dk, dv, dtype, seed=seed)
    state = start_state(layout, num_slots, hv, dk, dv, seed=seed)
    ref_state = state.clone()
    out = gd_triton.gated_delta_rule(q, k, v, g, beta, state, layout)
    ref = reference.gated_delta_rule(q, k, v, g, beta, ref_state, layout)
    assert out.dtype == v.dtype and out.shape == v.shape
    torch.testing.assert_close(out, ref, **tol)
    chunked = max(layout.query_lens) > gd_triton.MAX_RECURRENT
    state_tol = CHUNKED_STATE_FP16 if chunked and dtype != torch.float32 else FP32
    torch.testing.assert_close(state, ref_state, equal_nan=True, **state_tol)
    return state


# (hk, hv, dk, dv): dv 40 spans two dv tiles (the second half masked), dk 12 a masked key tile, 3 heads odd.
SHAPES = [(3, 6, 16, 40), (1, 3, 12, 8)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.float16, FP16)])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_batch_matches_reference(dtype, tol, shape):
    ctx = (0, 5, 1, 0, 3, 2, 9)
    layout = SeqLayout((1,) * len(ctx), ctx, (6, 0, 3, 1, 7, 2, 4))
    compare(layout, 9, *shape, dtype, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.float16, FP16)])
def test_verify_step_writes_every_token_state(dtype, tol):
    # Seq 0 ends in its home slot like the runner's verify step; seq 1 starts fresh and never touches its
    # home slot (6 stays NaN); seq 2 decodes plainly beside them; seq 3 keeps states without context.
    layout = SeqLayout(
        query_lens=(4, 4, 1, 3),
        context_lens=(7, 2, 3, 0),
        slots=(0, 6, 1, 2),
        state_out=((8, 9, 10, 0), (11, 12, 13, 14), (), (15, 16, 17)),
    )
    hk, hv, dk, dv = 2, 4, 16, 24
    q, k, v, g, beta = delta_inputs(layout.num_tokens, hk, hv, dk, dv, dtype, seed=3)
    state = start_state(layout, 19, hv, dk, dv, seed=3)
    home = state[[6, 2]].clone()
    ref_state = state.clone()
    out = gd_triton.gated_delta_rule(q, k, v, g, beta, state, layout)
    ref = reference.gated_delta_rule(q, k, v, g, beta, ref_state, layout)
    torch.testing.assert_close(out, ref, **tol)
    for targets in layout.state_out:
        for slot in targets:
            assert not state[slot].isnan().any()
            torch.testing.assert_close(state[slot], ref_state[slot], **FP32)
    torch.testing.assert_close(state, ref_state, equal_nan=True, **FP32)
    torch.testing.assert_close(state[[6, 2]], home, equal_nan=True, rtol=0, atol=0)
    assert state[18].isnan().all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.float16, FP16)])
def test_mixed_layout_of_short_and_long_sequences(dtype, tol):
    # 1..64 new tokens run in the recurrent kernel; 65 and 130 in the chunked kernels, in the same call.
    lens = (1, 3, 63, 64, 65, 130)
    layout = SeqLayout(lens, (4, 0, 0, 2, 3, 0), (5, 1, 7, 0, 2, 4))
    compare(layout, 8, 2, 4, 16, 16, dtype, tol, seed=11)


# Long sequences: one chunk and a token, two full chunks and a 2-token tail, a 200-token and a 300-token
# sequence; each length once without context (NaN slot) and once with.
LONG = (65, 130, 200, 300)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.float16, FP16)])
@pytest.mark.parametrize("ctx", [(0, 9, 0, 40), (3, 0, 70, 0)])
def test_long_sequences_match_reference(dtype, tol, ctx):
    layout = SeqLayout(LONG, ctx, (3, 0, 5, 1))
    compare(layout, 6, 1, 3, 16, 16, dtype, tol, seed=21)


def test_long_sequences_with_masked_tiles():
    # dk 12 masks part of the key tile, dv 40 spans two dv tiles of 32 (the second mostly masked).
    layout = SeqLayout((130, 1, 67), (0, 2, 5), (2, 0, 1))
    compare(layout, 3, 3, 6, 12, 40, torch.float32, FP32, seed=31)


@pytest.mark.parametrize("lens", [(1, 5), (70, 130)])
def test_fresh_slot_garbage_is_ignored(lens):
    layout = SeqLayout(lens, (0, 0), (0, 1))
    q, k, v, g, beta = delta_inputs(sum(lens), 1, 2, 16, 16, torch.float32, seed=5)
    dirty = torch.full((2, 2, 16, 16), NAN, device=DEVICE)
    clean = torch.zeros(2, 2, 16, 16, device=DEVICE)
    out_dirty = gd_triton.gated_delta_rule(q, k, v, g, beta, dirty, layout)
    out_clean = gd_triton.gated_delta_rule(q, k, v, g, beta, clean, layout)
    torch.testing.assert_close(out_dirty, out_clean, rtol=0, atol=0)
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


def test_long_sequence_cannot_keep_states():
    layout = SeqLayout((65,), (0,), (0,), state_out=(tuple(range(1, 66)),))
    q, k, v, g, beta = delta_inputs(65, 1, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="short"):
        gd_triton.gated_delta_rule(q, k, v, g, beta, torch.zeros(66, 2, 16, 16, device=DEVICE), layout)


@pytest.mark.parametrize("state_bv,out_bv", [(16, 16), (32, 64), (64, 128)])
def test_chunked_launch_choices_agree(state_bv, out_bv):
    # dv 40: one to three dv tiles per pass, the last one partly masked.
    layout = SeqLayout((130, 67), (9, 0), (1, 0))
    hk, hv, dk, dv = 1, 2, 16, 40
    q, k, v, g, beta = delta_inputs(layout.num_tokens, hk, hv, dk, dv, torch.float32, seed=41)
    state = start_state(layout, 2, hv, dk, dv, seed=41)
    ref_state = state.clone()
    out = torch.full_like(v, NAN)
    launch = gd_triton.ChunkLaunch(state_bv=state_bv, out_bv=out_bv)
    gd_triton._chunked(q, k, v, g, beta, state, layout, out, launch=launch)
    ref = reference.gated_delta_rule(q, k, v, g, beta, ref_state, layout)
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(state, ref_state, **FP32)


def test_chunked_with_nearly_parallel_keys():
    # Keys that barely differ, strong writes and almost no decay: (I + A) is far from the identity, so the
    # blocked inverse (diagonal blocks by substitution, then the series across blocks) is exercised in full.
    layout = SeqLayout((200,), (0,), (0,))
    hk, hv, dk, dv = 1, 2, 16, 16
    q, k, v, g, beta = delta_inputs(200, hk, hv, dk, dv, torch.float32, seed=51)
    k = rand(1, 1, dk, seed=52) + 0.05 * k
    beta = torch.full_like(beta, 0.95)
    g = g * 1e-3
    state = torch.zeros(1, hv, dk, dv, device=DEVICE)
    ref_state = state.clone()
    out = gd_triton.gated_delta_rule(q, k, v, g, beta, state, layout)
    ref = reference.gated_delta_rule(q, k, v, g, beta, ref_state, layout)
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(state, ref_state, **FP32)


def test_registered_as_the_triton_backend(monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    assert dispatch.pick("gated_delta_rule", torch.zeros(1)) is gd_triton.gated_delta_rule


# Qwen3.5-35B-A3B's DeltaNet: 16 key heads, 32 value heads, dk = dv = 128.
REAL = (16, 32, 128, 128)
# bf16 inputs upcast identically on both sides; the kernel's output is rounded to bf16 (2^-8 relative).
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}
# fp32 states from the same bf16 inputs: only summation order differs (128-term sums, up to 64 tokens).
STATE_GPU = {"rtol": 1e-3, "atol": 1e-4}
# fp32 states after a chunked prefill: the chunked kernels keep their scratch (written values, WY factors,
# per-chunk states) in bf16 as flash-linear-attention does, 2^-9 relative. A torch model of those roundings
# at these shapes is off by at most 4e-3 (0.3% rms) after 1024 and 4096 tokens, and by 8e-3 on states up to
# 1.7 when the decay is 100 times weaker.
CHUNKED_STATE_BF16 = {"rtol": 1.6e-2, "atol": 1.5e-2}

GPU_LAYOUTS = {
    "decode": SeqLayout((1,) * 64, tuple(i % 5 for i in range(64)), tuple(range(100, 164))),
    "verify": SeqLayout(
        (4,) * 16,
        (9,) * 15 + (0,),
        tuple(range(16)),
        state_out=tuple((16 + 3 * i, 17 + 3 * i, 18 + 3 * i, i) for i in range(16)),
    ),
    "prefill": SeqLayout((1, 7, 33, 64, 65, 500), (3, 0, 12, 0, 40, 0), (70, 71, 72, 73, 74, 75)),
    # Chunk boundaries (128, 129) and long chunked prefills, fresh and continuing.
    "long_prefill": SeqLayout((128, 129, 1000, 2048, 3), (0, 64, 7, 0, 1), (80, 81, 82, 83, 84)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(GPU_LAYOUTS))
def test_real_shapes_bf16_on_gpu(name):
    layout = GPU_LAYOUTS[name]
    hk, hv, dk, dv = REAL
    q, k, v, g, beta = delta_inputs(layout.num_tokens, hk, hv, dk, dv, torch.bfloat16, device="cuda")
    state = start_state(layout, 180, hv, dk, dv, device="cuda")
    ref_state = state.clone()
    out = gd_triton.gated_delta_rule(q, k, v, g, beta, state, layout)
    ref = reference.gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), ref_state, layout)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, **BF16)
    chunked = max(layout.query_lens) > gd_triton.MAX_RECURRENT
    torch.testing.assert_close(
        state, ref_state, equal_nan=True, **(CHUNKED_STATE_BF16 if chunked else STATE_GPU)
    )


def test_chunked_kernel_switched_off_uses_the_reference_for_long_sequences(monkeypatch):
    """ENCLAVE_TRITON_PREFILL=0 sends prefill chunks to the chunked reference."""
    monkeypatch.setenv("ENCLAVE_TRITON_PREFILL", "0")
    calls = []
    real = gd_triton.reference.chunked
    monkeypatch.setattr(gd_triton.reference, "chunked", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layout = SeqLayout((1, 65, 3), (4, 0, 2), (5, 1, 7))
    compare(layout, 8, 2, 4, 16, 16, torch.float32, FP32, seed=3)
    assert len(calls) >= 2  # the reference run and the switched-off Triton call both took the WY path
