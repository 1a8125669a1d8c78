"""Recurrent states stored in bf16 (`state_dtype="auto"` with a bf16 model): the Triton gated delta rule and
the fused DeltaNet step against their torch references, which compute in fp32 and round the state to its
dtype after every token (a long sequence's chunked form once, at the end).

The inputs are fp32 or fp16 here (bf16 `tl.dot` is wrong in the interpreter; the chunked kernels' dots take
the inputs' dtype, so only the state's loads and stores are bf16). Unread slots are NaN as in the fp32 tests.

The invariant the per-token rounding buys: a verify step's state after its j-th token equals the state j plain
decode steps leave, bit for bit, so speculation does not change greedy output with bf16 states either.
"""

import pytest
import torch

from engine.kernels import SeqLayout
from engine.kernels.deltanet_step import reference as step_reference
from engine.kernels.deltanet_step import triton as fused
from engine.kernels.gated_delta import reference as delta_reference
from engine.kernels.gated_delta import triton as gd_triton
from tests.engine.kernels.test_deltanet_step_triton import run, start_states, step_inputs
from tests.engine.kernels.test_gated_delta_triton import delta_inputs, start_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
# Both sides round the same fp32 values (they agree to ~1e-6 before rounding) to bf16 after every token: a
# value near a rounding boundary may land one bf16 ulp (2^-8 relative) apart and carry that into the next
# tokens' updates, so states and outputs agree to about one bf16 ulp.
STATE_BF16 = {"rtol": 1.6e-2, "atol": 1e-2}
OUT = {torch.float32: {"rtol": 1.6e-2, "atol": 1e-2}, torch.float16: {"rtol": 1.6e-2, "atol": 1e-2}}

DECODE = SeqLayout((1,) * 5, (4, 0, 2, 0, 9), (5, 0, 3, 1, 6))
VERIFY = SeqLayout(
    query_lens=(4, 4, 1, 3),
    context_lens=(7, 2, 3, 0),
    slots=(0, 6, 1, 2),
    state_out=((8, 9, 10, 0), (11, 12, 13, 14), (), (15, 16, 17)),
)
# 1..64 new tokens in the recurrent kernel, 65 and 130 in the chunked ones.
MIXED = SeqLayout((1, 3, 64, 65, 130), (4, 0, 2, 3, 0), (5, 1, 7, 0, 2))
LAYOUTS = {"decode": (DECODE, 8), "verify": (VERIFY, 19), "mixed": (MIXED, 8)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_gated_delta_rule_with_bf16_states(name, dtype):
    layout, slots = LAYOUTS[name]
    hk, hv, dk, dv = 2, 4, 16, 24
    q, k, v, g, beta = delta_inputs(layout.num_tokens, hk, hv, dk, dv, dtype, seed=7)
    state = start_state(layout, slots, hv, dk, dv, seed=7).to(BF16)
    ref_state = state.clone()
    out = gd_triton.gated_delta_rule(q, k, v, g, beta, state, layout)
    ref = delta_reference.gated_delta_rule(q, k, v, g, beta, ref_state, layout)
    assert state.dtype == BF16 and not out.isnan().any()
    torch.testing.assert_close(out, ref, **OUT[dtype])
    torch.testing.assert_close(state, ref_state, equal_nan=True, **STATE_BF16)
    for targets in layout.state_out or ():
        assert not state[list(targets)].isnan().any()


def test_many_decodes_take_the_bf16_launch_choice():
    """70 decodes of 4 value heads with dv 40 (two 32-wide tiles each): enough programs that bf16 states take
    their own tiling (one 64-wide tile, masked past 40, two warps), against the reference."""
    assert gd_triton._launch_config(70 * 4, 40, 2) == (64, 2)
    assert gd_triton._launch_config(70 * 4, 40, 4) == (32, 1)
    ctx = tuple(i % 4 for i in range(70))
    layout = SeqLayout((1,) * 70, ctx, tuple(range(70)))
    q, k, v, g, beta = delta_inputs(70, 2, 4, 16, 40, torch.float32, seed=19)
    state = start_state(layout, 70, 4, 16, 40, seed=19).to(BF16)
    ref_state = state.clone()
    out = gd_triton.gated_delta_rule(q, k, v, g, beta, state, layout)
    ref = delta_reference.gated_delta_rule(q, k, v, g, beta, ref_state, layout)
    torch.testing.assert_close(out, ref, **OUT[torch.float32])
    torch.testing.assert_close(state, ref_state, **STATE_BF16)


def test_the_reference_rounds_after_every_token():
    # One sequence of 3 tokens from a bf16 state: the state after it is the fp32 recurrence with a rounding
    # after each token, not one rounding at the end (which differs: 3 tokens of fp32 carry).
    layout = SeqLayout((3,), (1,), (0,))
    q, k, v, g, beta = delta_inputs(3, 1, 2, 16, 16, torch.float32, seed=9)
    state = start_state(layout, 1, 2, 16, 16, seed=9).to(BF16)
    s = state[0].float()
    qf = delta_reference.l2norm(q) * 16**-0.5
    kf = delta_reference.l2norm(k)
    qf, kf = (x.repeat_interleave(2, dim=1) for x in (qf, kf))
    for t in range(3):
        _, s = delta_reference.recurrent_step(qf[t : t + 1], kf[t : t + 1], v[t : t + 1], g[t : t + 1],
                                              beta[t : t + 1], s[None])  # fmt: skip
        s = s[0].to(BF16).float()
    delta_reference.gated_delta_rule(q, k, v, g, beta, state, layout)
    assert torch.equal(state[0].float(), s)


def _sequential_decode_states(op, layout, num_slots, inputs, states):
    """The states each token of the (single-sequence) verify `layout` leaves when its tokens run as plain
    decode steps one at a time; inputs sliced per token."""
    conv, recurrent = (t.clone() for t in states)
    slot, ctx = layout.slots[0], layout.context_lens[0]
    after = []
    for j in range(layout.query_lens[0]):
        step = SeqLayout((1,), (ctx + j,), (slot,))
        op([x[j : j + 1] for x in inputs], step, conv, recurrent)
        after.append(recurrent[slot].clone())
    return after


@pytest.mark.parametrize("kind", ["triton", "torch"])
def test_verify_states_equal_sequential_decode_bitwise(kind):
    """A 4-token verify step keeping per-token states against four decode steps, both with bf16 states."""
    shape, k = (2, 4, 16, 32), 4
    layout = SeqLayout((4,), (5,), (0,), state_out=((1, 2, 3, 4),))
    inputs, weights = step_inputs(4, *shape, k, torch.float32, seed=13)
    conv, recurrent = start_states(layout, 5, *shape, k, torch.float32, seed=13)
    recurrent = recurrent.to(BF16)
    impl = fused.deltanet_step if kind == "triton" else step_reference.deltanet_step

    def op(xs, lay, c, r):
        return run(impl, xs, weights, c, r, lay)

    expected = _sequential_decode_states(op, layout, 5, inputs, (conv, recurrent))
    op(inputs, layout, conv, recurrent)
    for j, slot in enumerate(layout.state_out[0]):
        assert torch.equal(recurrent[slot], expected[j]), f"token {j}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["decode", "verify"])
def test_fused_step_with_bf16_states(name, dtype):
    layout, slots = LAYOUTS[name]
    shape, k = (2, 4, 16, 24), 4
    inputs, weights = step_inputs(layout.num_tokens, *shape, k, dtype, seed=17)
    conv, recurrent = start_states(layout, slots, *shape, k, dtype, seed=17)
    recurrent = recurrent.to(BF16)
    ref_conv, ref_recurrent = conv.clone(), recurrent.clone()
    out = run(fused.deltanet_step, inputs, weights, conv, recurrent, layout)
    ref = run(step_reference.deltanet_step, inputs, weights, ref_conv, ref_recurrent, layout)
    assert recurrent.dtype == BF16 and not out.isnan().any()
    torch.testing.assert_close(out, ref, **OUT[dtype])
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(recurrent, ref_recurrent, equal_nan=True, **STATE_BF16)


# Qwen3.5-35B-A3B's DeltaNet (16 key heads, 32 value heads, dk = dv = 128), bf16 everything.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["decode", "verify", "prefill"])
def test_real_shapes_bf16_states_on_gpu(name):
    from tests.engine.kernels.test_gated_delta_triton import GPU_LAYOUTS

    layout = GPU_LAYOUTS[name]  # 64 decodes; 16 verify steps of 4; short and chunked prefills together
    hk, hv, dk, dv = 16, 32, 128, 128
    q, k, v, g, beta = delta_inputs(layout.num_tokens, hk, hv, dk, dv, BF16, device="cuda")
    state = start_state(layout, 180, hv, dk, dv, device="cuda").to(BF16)
    ref_state = state.clone()
    out = gd_triton.gated_delta_rule(q, k, v, g, beta, state, layout)
    ref = delta_reference.gated_delta_rule(
        q.float(), k.float(), v.float(), g, beta.float(), ref_state, layout
    )
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=2e-2)
    torch.testing.assert_close(state.float(), ref_state.float(), equal_nan=True, rtol=3e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("v_splits", [1, 4])
@pytest.mark.parametrize("name", ["decode8", "verify3"])
def test_fused_step_real_shapes_bf16_states_on_gpu(name, v_splits):
    """The fused step (the model's decode and verify path up to 8 sequences) with bf16 states against its
    reference at Qwen3.5-35B-A3B's shapes, and its states after a verify step against sequential decode."""
    from tests.engine.kernels.test_deltanet_step_triton import GPU_LAYOUTS, REAL

    layout = GPU_LAYOUTS[name]
    inputs, weights = step_inputs(layout.num_tokens, *REAL, 4, BF16, device="cuda")
    conv, recurrent = start_states(layout, 180, *REAL, 4, BF16, device="cuda")
    recurrent = recurrent.to(BF16)
    ref_conv, ref_recurrent = conv.clone(), recurrent.clone()
    ref = run(step_reference.deltanet_step, inputs, weights, ref_conv, ref_recurrent, layout)
    out = run(lambda *a: fused.deltanet_step(*a, v_splits=v_splits), inputs, weights, conv, recurrent, layout)
    assert recurrent.dtype == BF16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=2e-2)
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(recurrent.float(), ref_recurrent.float(), equal_nan=True, rtol=3e-2, atol=2e-2)
