"""The fused DeltaNet step (conv + SiLU, gates, l2 norm, gated delta rule, gated RMSNorm in one kernel)
against the unfused references, over decode and verify layouts, odd head sizes, fp32 and fp16; the conv and
recurrent states after the step included; unsplit and with the value dimension split into 2 and 4 tiles
(`v_splits`), whose programs meet through counters that every launch must leave at zero.

Slots a sequence starts fresh from, and the scratch slots a verify step writes, are NaN-filled: a kernel that
reads a slot it should ignore, or leaves a state or an output unwritten, fails the comparison.
"""

import functools

import pytest
import torch

from engine.bench.presets import init_parameter_
from engine.cache import ModelCache
from engine.config import config_from_dict
from engine.env import EnvError, reset_engine_env
from engine.kernels import SeqLayout, deltanet_step, dispatch
from engine.kernels.conv1d import triton as conv_triton
from engine.kernels.deltanet_gate import triton as gate_triton
from engine.kernels.deltanet_step import reference
from engine.kernels.deltanet_step import triton as fused
from engine.kernels.gated_delta import triton as delta_triton
from engine.kernels.norm import triton as norm_triton
from engine.model.deltanet import GatedDeltaNet
from tests.engine.factories import text_config
from tests.engine.kernels.cases import crossed, ids

NAN = float("nan")
# The interpreter on the CPU (CI), the compiled kernel where there is a GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6

# Outputs. fp32: the same math on both sides, only the order of the K-, dk- and dv-term sums differs (a few
# fp32 ulps, grown through a few tokens of recurrence and the norm's 1/rms; measured up to 7e-6). fp16: both
# sides round the conv outputs, the delta rule's output, the normed row and the weight product to fp16 from
# fp32 values that agree to ~1e-6, so a rounding may land one fp16 ulp (2^-10 relative) apart (measured: one
# ulp, on under 0.1% of the outputs).
OUT_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
# fp32 recurrent states from the same inputs, sums in other orders (measured 3e-7); with fp16 inputs a conv
# output one fp16 ulp apart moves a state element by k * beta * that (measured up to 4e-5). Conv states are
# copies of the inputs: exact.
STATE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-4, atol=2e-4)}

# (Hk, Hv, dk, dv): two value heads per key head (dv 24 masks part of a 32-wide tile), three per key head with
# a masked 12-wide key tile and tiny dv, and one per key head (no shared q/k channels).
SHAPES = [(2, 4, 16, 24), (2, 4, 16, 32), (1, 3, 12, 8), (3, 3, 16, 16)]


def rand(*shape, seed, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


def step_inputs(t, hk, hv, dk, dv, k, dtype, seed=0, device=DEVICE):
    """The op's inputs and weights, as the model passes them: qkv and z column slices of one projection, b and
    a of another."""
    c = 2 * hk * dk + hv * dv
    qkv, z = rand(t, c + hv * dv, seed=seed, dtype=dtype, device=device).split((c, hv * dv), dim=-1)
    b, a = rand(t, 2 * hv, seed=seed + 1, dtype=dtype, device=device).split((hv, hv), dim=-1)
    weights = dict(
        conv_weight=rand(c, k, seed=seed + 2, dtype=dtype, device=device) * 0.5,
        a_log=rand(hv, seed=seed + 3, dtype=dtype, device=device) * 0.5,
        dt_bias=rand(hv, seed=seed + 4, dtype=dtype, device=device),
        norm_weight=1.0 + 0.2 * rand(dv, seed=seed + 5, dtype=dtype, device=device),
    )
    return (qkv, z, a, b), weights


def start_states(layout, num_slots, hk, hv, dk, dv, k, dtype, seed=0, device=DEVICE):
    """Conv [S, C, K-1] and fp32 recurrent [S, Hv, dk, dv] states: NaN but in the slots of sequences with
    context."""
    c = 2 * hk * dk + hv * dv
    conv = torch.full((num_slots, c, k - 1), NAN, dtype=dtype, device=device)
    recurrent = torch.full((num_slots, hv, dk, dv), NAN, device=device)
    for slot, ctx in zip(layout.slots, layout.context_lens, strict=True):
        if ctx > 0:
            conv[slot] = rand(c, k - 1, seed=seed + 10 + slot, dtype=dtype, device=device)
            recurrent[slot] = rand(hv, dk, dv, seed=seed + 50 + slot, device=device) * 0.3
    return conv, recurrent


def run(op, inputs, weights, conv, recurrent, layout):
    qkv, z, a, b = inputs
    w = weights
    return op(
        qkv,
        z,
        a,
        b,
        w["conv_weight"],
        conv,
        w["a_log"],
        w["dt_bias"],
        recurrent,
        w["norm_weight"],
        EPS,
        layout,
    )


def compare(layout, num_slots, shape, dtype, k=4, seed=0, v_splits=None):
    """Fused (`v_splits` dv tiles, or the launcher's choice) against the references: output, conv and
    recurrent states. Returns the states before and after the fused step."""
    inputs, weights = step_inputs(layout.num_tokens, *shape, k, dtype, seed=seed)
    conv, recurrent = start_states(layout, num_slots, *shape, k, dtype, seed=seed)
    before = conv.clone(), recurrent.clone()
    ref_conv, ref_recurrent = conv.clone(), recurrent.clone()
    step = functools.partial(fused.deltanet_step, v_splits=v_splits)
    out = run(step, inputs, weights, conv, recurrent, layout)
    ref = run(reference.deltanet_step, inputs, weights, ref_conv, ref_recurrent, layout)
    hv, dv = shape[1], shape[3]
    assert out.shape == (layout.num_tokens, hv * dv) and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **OUT_TOL[dtype])
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(recurrent, ref_recurrent, equal_nan=True, **STATE_TOL[dtype])
    return before, (conv, recurrent)


# dv tiles per value head: unsplit, and 2 and 4 tiles of the power-of-two row: 16 and 8 columns at dv 32 and
# 24 (where the last tile is partly, or with 4 tiles wholly, masked), 8 and 4 at dv 16, 4 and 2 at dv 8.
SPLITS = [1, 2, 4]


def decode_layout(batch):
    # Sequences 1 and 3 start fresh: their NaN slots must not be read.
    return SeqLayout((1,) * batch, (4, 0, 2, 0, 9)[:batch], (5, 0, 3, 1, 6)[:batch])


def verify_layout():
    # Seq 0 ends in its home slot as the runner's verify step does; seq 1 starts fresh and never touches its
    # home slot (6 stays NaN); seq 2 decodes plainly beside them; seq 3 keeps states without context; seq 4 is
    # a 2-token chunk without context or per-token states (its state goes home). 19 slots.
    return SeqLayout(
        query_lens=(4, 4, 1, 3, 2),
        context_lens=(7, 2, 3, 0, 0),
        slots=(0, 6, 1, 2, 3),
        state_out=((8, 9, 10, 0), (11, 12, 13, 14), (), (15, 16, 17), ()),
    )


DTYPES = [torch.float32, torch.float16]


# Every shape with every split (which columns a tile masks); dtype and batch size in turn, every pair of
# values meeting (cases.crossed): the 72 combinations add no path, at seconds each in the interpreter.
@pytest.mark.parametrize("shape, v_splits, dtype, batch", crossed(SHAPES, SPLITS, DTYPES, [1, 2, 5]))
def test_decode_matches_reference(batch, shape, dtype, v_splits):
    compare(decode_layout(batch), 7, shape, dtype, seed=batch, v_splits=v_splits)


@pytest.mark.parametrize("shape, v_splits, dtype", crossed(SHAPES[1:3], SPLITS, DTYPES))
def test_verify_writes_every_token_state(shape, dtype, v_splits):
    layout = verify_layout()
    before, after = compare(layout, 19, shape, dtype, seed=3, v_splits=v_splits)
    for start, end in zip(before, after, strict=True):  # conv, then recurrent states
        for targets in layout.state_out:
            assert not end[list(targets)].isnan().any()
        # The homes of sequences keeping per-token states elsewhere, and slots nobody names, are left alone.
        untouched = [6, 2, 4, 5, 7, 18]
        torch.testing.assert_close(end[untouched], start[untouched], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("k", [2, 3])
def test_other_conv_widths(k):
    # K - 1 = 1 and 2 cached inputs (K 4 elsewhere): the state tile masks other widths.
    layout = SeqLayout((3, 1, 2), (5, 0, 1), (2, 0, 1), state_out=((3, 4, 2), (), (5, 6)))
    compare(layout, 7, SHAPES[0], torch.float32, k=k, seed=7)


# The key heads' counters alone (Hv > Hk, unsplit), the value heads' alone (Hv = Hk, split), both (on a
# decode and on a verify layout).
@pytest.mark.parametrize(
    "kind, shape, v_splits",
    [("decode", SHAPES[0], 1), ("decode", SHAPES[3], 2), ("decode", SHAPES[0], 4), ("verify", SHAPES[2], 2)],
    ids=ids,
)
def test_counters_reset_for_the_next_layer(kind, shape, v_splits):
    # The layers of a step (and a CUDA graph's replays) share the layout and so the key heads' and value
    # heads' counters: each launch must leave them zero, or the next layer's q/k conv states would go
    # unwritten (and stay NaN here) and its output rows unnormalised. Hv = Hk (SHAPES[3]) shares q/k between
    # the dv tiles only.
    layout, slots = (decode_layout(2), 7) if kind == "decode" else (verify_layout(), 19)
    for layer in range(2):
        compare(layout, slots, shape, torch.float32, seed=20 * layer, v_splits=v_splits)
    if shape[1] > shape[0] or v_splits > 1:
        counters = layout.cached(("deltanet_step.counters", shape[0], shape[1]), DEVICE, None)
        assert not counters.any()


def test_split_choice(monkeypatch):
    # Qwen3.5-35B-A3B on an H200 (32 value heads, 132 SMs): 4 tiles up to 2 sequences, 2 up to 4, none
    # from 5; never tiles narrower than one column.
    assert [fused._v_splits(32 * n, 128, 132) for n in (1, 2, 3, 4, 5, 8, 64)] == [4, 4, 2, 2, 1, 1, 1]
    assert fused._v_splits(1, 2, 132) == 2
    monkeypatch.setenv("ENCLAVE_DELTANET_V_SPLITS", "8")
    reset_engine_env()  # the engine reads its variables once
    assert fused._v_splits(32 * 64, 128, 132) == 8
    with pytest.raises(ValueError, match="power of two up to 4"):
        fused._v_splits(32, 4, 132)  # 8 tiles of a 4-wide state tile
    for bad in ("3", "256", "x"):
        monkeypatch.setenv("ENCLAVE_DELTANET_V_SPLITS", bad)
        reset_engine_env()
        with pytest.raises(EnvError, match="ENCLAVE_DELTANET_V_SPLITS must be 1, 2, 4 or 8"):
            fused._v_splits(32, 128, 132)


def test_matches_the_unfused_triton_kernels():
    # What the model ran before for these layouts: the four Triton kernels one after another.
    layout = SeqLayout((4, 1, 3), (6, 2, 0), (0, 1, 2), state_out=((3, 4, 5, 0), (), (6, 7, 8)))
    hk, hv, dk, dv = SHAPES[0]
    dtype, t = torch.float16, layout.num_tokens
    inputs, w = step_inputs(t, hk, hv, dk, dv, 4, dtype, seed=9)
    conv, recurrent = start_states(layout, 9, hk, hv, dk, dv, 4, dtype, seed=9)
    ref_conv, ref_recurrent = conv.clone(), recurrent.clone()
    out = run(fused.deltanet_step, inputs, w, conv, recurrent, layout)

    qkv, z, a, b = inputs
    x = conv_triton.causal_conv1d(qkv, w["conv_weight"], ref_conv, layout)
    q, k, v = x.split((hk * dk, hk * dk, hv * dv), dim=-1)
    g, beta = gate_triton.deltanet_gate(a, b, w["a_log"], w["dt_bias"])
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    o = delta_triton.gated_delta_rule(q, k, v, g, beta, ref_recurrent, layout)
    ref = norm_triton.gated_rms_norm(o, z.reshape(t, hv, dv), w["norm_weight"], EPS).reshape(t, hv * dv)
    torch.testing.assert_close(out, ref, **OUT_TOL[dtype])
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(recurrent, ref_recurrent, equal_nan=True, **STATE_TOL[dtype])


def test_long_sequences_are_refused():
    layout = SeqLayout((9, 1), (0, 3), (0, 1))
    inputs, weights = step_inputs(10, 1, 2, 16, 16, 4, torch.float32)
    conv, recurrent = start_states(layout, 2, 1, 2, 16, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="short"):
        run(deltanet_step, inputs, weights, conv, recurrent, layout)


def test_registered_as_the_triton_backend(monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    assert dispatch.pick("deltanet_step", torch.zeros(1)) is fused.deltanet_step


def test_layer_takes_the_fused_step_for_short_layouts(monkeypatch):
    # The model's DeltaNet layer on the Triton kernels against the same layer on the torch references, over a
    # long prefill (unfused), a verify step keeping per-token states and a decode (fused); states included.
    config = config_from_dict(text_config().to_dict())
    layer = GatedDeltaNet(config).to(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            init_parameter_(name, p, g)
    state = ModelCache(config, 8, 1, 4, DEVICE, torch.float32).linear_states()[0]
    steps = [
        SeqLayout((11, 2), (0, 0), (0, 1)),
        SeqLayout((3, 3), (11, 2), (0, 1), state_out=((2, 3, 0), (4, 5, 6))),
        SeqLayout((1, 1), (14, 5), (0, 6)),
    ]
    xs = [rand(lay.num_tokens, config.hidden_size, seed=i) for i, lay in enumerate(steps)]
    calls = []
    real = dispatch.implementation("deltanet_step", "triton")
    monkeypatch.setitem(
        dispatch._IMPLEMENTATIONS["deltanet_step"], "triton", lambda *a: calls.append(1) or real(*a)
    )
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("ENCLAVE_KERNELS", backend)
        reset_engine_env()  # the engine reads its variables once
        for t in (state.conv, state.recurrent):
            t.fill_(NAN)
        with torch.no_grad():
            outs = [layer(x, state, lay) for x, lay in zip(xs, steps, strict=True)]
        results[backend] = (*outs, state.conv.clone(), state.recurrent.clone())
    assert len(calls) == 2  # the verify step and the decode
    for got, expected in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True)


# Qwen3.5-35B-A3B's DeltaNet: 16 key heads, 32 value heads, dk = dv = 128, conv kernel 4.
REAL = (16, 32, 128, 128)
# bf16 (not measurable in the interpreter, whose bf16 casts truncate): the fp16 roundings above, 8 times
# coarser. fp16 at these shapes in the interpreter: outputs one ulp apart on 0.06% of elements, states up to
# 4e-5 apart; so one bf16 ulp (2^-7 relative) for outputs, and about 3e-4 for states, with margin for 64
# sequences.
BF16_OUT = dict(rtol=1.6e-2, atol=1e-2)
BF16_STATE = dict(rtol=1e-2, atol=2e-3)
GPU_LAYOUTS = {
    f"decode{n}": SeqLayout((1,) * n, tuple(i % 3 for i in range(n)), tuple(range(100, 100 + n)))
    for n in (1, 8, 64)
}
GPU_LAYOUTS["verify3"] = SeqLayout(
    (4,) * 16,
    (9,) * 15 + (0,),
    tuple(range(16)),
    state_out=tuple((16 + 3 * i, 17 + 3 * i, 18 + 3 * i, i) for i in range(16)),
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("v_splits", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(GPU_LAYOUTS))
def test_real_shapes_bf16_on_gpu(name, v_splits):
    # Twice from the same start: the second launch finds the counters the first left (zero).
    layout = GPU_LAYOUTS[name]
    inputs, weights = step_inputs(layout.num_tokens, *REAL, 4, torch.bfloat16, device="cuda")
    start = start_states(layout, 180, *REAL, 4, torch.bfloat16, device="cuda")
    ref_conv, ref_recurrent = (x.clone() for x in start)
    ref = run(reference.deltanet_step, inputs, weights, ref_conv, ref_recurrent, layout)
    step = functools.partial(fused.deltanet_step, v_splits=v_splits)
    for _ in range(2):
        conv, recurrent = (x.clone() for x in start)
        out = run(step, inputs, weights, conv, recurrent, layout)
        assert out.dtype == torch.bfloat16 and not out.isnan().any()
        torch.testing.assert_close(out.float(), ref.float(), **BF16_OUT)
        torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(recurrent, ref_recurrent, equal_nan=True, **BF16_STATE)
