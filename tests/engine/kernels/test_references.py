"""The kernel references against each other and against plain definitions, over odd sizes.

Outputs are pre-filled with NaN where an op writes into a buffer, so anything left unwritten shows up.
"""

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.env import EnvError, reset_engine_env
from engine.kernels import SeqLayout, dispatch
from engine.kernels.gated_delta import reference as gd
from tests.engine.factories import dense_layout


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def delta_inputs(n, hk=2, hv=4, dk=8, dv=6, seed=0):
    q, k = rand(n, hk, dk, seed=seed), rand(n, hk, dk, seed=seed + 1)
    v = rand(n, hv, dv, seed=seed + 2)
    g = -F.softplus(rand(n, hv, seed=seed + 3))  # log decay <= 0
    beta = torch.sigmoid(rand(n, hv, seed=seed + 4))
    return q, k, v, g, beta


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 130])
def test_chunked_delta_rule_equals_token_by_token(n):
    q, k, v, g, beta = delta_inputs(n, seed=n)
    r = 2
    qf = (gd.l2norm(q) * q.shape[-1] ** -0.5).repeat_interleave(r, 1)
    kf = gd.l2norm(k).repeat_interleave(r, 1)
    s0 = rand(4, 8, 6, seed=99) * 0.3
    o_ref, s_ref = gd.recurrent(qf, kf, v, g, beta, s0)
    o, s = gd.chunked(qf, kf, v, g, beta, s0, chunk=16)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)


def test_delta_rule_varlen_batch_equals_each_sequence_alone():
    lens, ctx = (5, 1, 70), (0, 3, 0)
    q, k, v, g, beta = delta_inputs(sum(lens), seed=3)
    state = rand(5, 4, 8, 6, seed=7)
    start_state = state.clone()
    layout = SeqLayout(lens, ctx, (4, 0, 2))
    out = kernels.gated_delta_rule(q, k, v, g, beta, state, layout)
    offset = 0
    for n, c, slot in zip(lens, ctx, (4, 0, 2), strict=True):
        sl = slice(offset, offset + n)
        alone_state = start_state.clone()
        if c == 0:
            alone_state[slot] = 0.0  # no context: the op must ignore what the slot held
        alone = kernels.gated_delta_rule(
            q[sl], k[sl], v[sl], g[sl], beta[sl], alone_state, SeqLayout((n,), (1,), (slot,))
        )
        torch.testing.assert_close(out[sl], alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[slot], alone_state[slot], rtol=1e-5, atol=1e-6)
        offset += n
    torch.testing.assert_close(state[[1, 3]], start_state[[1, 3]])  # untouched slots


def test_decode_step_equals_prefill_continuation():
    q, k, v, g, beta = delta_inputs(9, seed=5)
    full_state = torch.zeros(2, 4, 8, 6)
    full = kernels.gated_delta_rule(q, k, v, g, beta, full_state, SeqLayout((9,), (0,), (1,)))
    state = torch.zeros(2, 4, 8, 6)
    kernels.gated_delta_rule(q[:8], k[:8], v[:8], g[:8], beta[:8], state, SeqLayout((8,), (0,), (1,)))
    step = kernels.gated_delta_rule(q[8:], k[8:], v[8:], g[8:], beta[8:], state, SeqLayout((1,), (8,), (1,)))
    torch.testing.assert_close(step, full[8:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, full_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel_size", [2, 4])
def test_conv1d_varlen_and_decode_match_full_convolution(kernel_size):
    channels, lens = 5, (7, 1, 3)
    x = rand(sum(lens), channels, seed=1)
    w = rand(channels, kernel_size, seed=2)
    state = torch.full((3, channels, kernel_size - 1), float("nan"))
    layout = SeqLayout(lens, (0, 0, 0), (2, 0, 1))
    out = kernels.causal_conv1d(x, w, state, layout)
    offset = 0
    for n in lens:
        xs = x[offset : offset + n].T[None]
        expected = F.silu(F.conv1d(F.pad(xs, (kernel_size - 1, 0)), w[:, None, :], groups=channels))[0].T
        torch.testing.assert_close(out[offset : offset + n], expected)
        offset += n
    # one more token per sequence through the decode path equals convolving the extended sequence
    nxt = rand(3, channels, seed=3)
    step = kernels.causal_conv1d(nxt, w, state, SeqLayout((1, 1, 1), lens, (2, 0, 1)))
    offset = 0
    for i, n in enumerate(lens):
        xs = torch.cat((x[offset : offset + n], nxt[i : i + 1])).T[None]
        expected = F.silu(F.conv1d(F.pad(xs, (kernel_size - 1, 0)), w[:, None, :], groups=channels))[0, :, -1]
        torch.testing.assert_close(step[i], expected)
        offset += n


def test_attention_prefill_and_decode_match_dense_causal_attention():
    hq, hkv, d, lens = 6, 2, 16, (5, 9)
    q, k, v = rand(sum(lens), hq, d, seed=1), rand(sum(lens), hkv, d, seed=2), rand(sum(lens), hkv, d, seed=3)
    kc = torch.full((16, 4, hkv, d), float("nan"))  # 16 blocks of 4 positions; slot s owns 8s .. 8s+7
    vc = torch.full((16, 4, hkv, d), float("nan"))
    # first all but the last token of each sequence as prefill, then the last ones as one decode step
    pre = (4, 8)
    idx_pre = [*range(0, 4), *range(5, 13)]
    idx_dec = [4, 13]
    out_pre = kernels.attention(
        q[idx_pre], k[idx_pre], v[idx_pre], kc, vc, dense_layout(pre, (0, 0), (1, 0)), d**-0.5
    )
    out_dec = kernels.attention(
        q[idx_dec], k[idx_dec], v[idx_dec], kc, vc, dense_layout((1, 1), pre, (1, 0)), d**-0.5
    )
    offset = 0
    for i, n in enumerate(lens):
        sl = slice(offset, offset + n)
        expected = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1),
            k[sl].transpose(0, 1).repeat_interleave(3, 0),
            v[sl].transpose(0, 1).repeat_interleave(3, 0),
            is_causal=True,
        ).transpose(0, 1)
        got = torch.cat((out_pre[offset - i : offset - i + n - 1], out_dec[i : i + 1]))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        offset += n


def test_norms_and_rotary():
    x, w = rand(3, 10, seed=1), rand(10, seed=2)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), expected)
    gate = rand(3, 10, seed=3)
    gated = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * F.silu(gate)
    torch.testing.assert_close(kernels.gated_rms_norm(x, gate, w, 1e-6), gated)
    # rotary by position p rotates each channel pair (i, i + rd/2) by p * inv_freq[i]; the rest pass through
    inv = torch.tensor([1.0, 0.1])
    cos, sin = kernels.rotary_cos_sin(torch.tensor([0, 3]), inv, 1.0)
    h = rand(2, 1, 6, seed=4)
    out = kernels.apply_rotary(h, cos, sin)
    torch.testing.assert_close(out[0], h[0])
    angle = 3 * inv
    a, b = h[1, 0, :2], h[1, 0, 2:4]
    torch.testing.assert_close(out[1, 0, :2], a * angle.cos() - b * angle.sin())
    torch.testing.assert_close(out[1, 0, 2:4], b * angle.cos() + a * angle.sin())
    torch.testing.assert_close(out[1, 0, 4:], h[1, 0, 4:])


def test_moe_reference_equals_dense_loop():
    t, e, h, i, k = 7, 5, 6, 4, 2
    x, logits = rand(t, h, seed=1), rand(t, e, seed=2)
    w13, w2 = rand(e, 2 * i, h, seed=3), rand(e, h, i, seed=4)
    weights, ids = kernels.moe_route(logits, k, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(t))
    out = kernels.moe_experts(x, w13, w2, weights, ids)
    for row in range(t):
        expected = sum(
            weights[row, j]
            * (w2[ids[row, j]] @ (F.silu(w13[ids[row, j], :i] @ x[row]) * (w13[ids[row, j], i:] @ x[row])))
            for j in range(k)
        )
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


def test_dispatch_switch(monkeypatch):
    x = torch.zeros(2)

    def plain(t):
        return t

    dispatch.register("test_only_op", torch=plain)
    dispatch.register("test_lazy_op", torch=plain, triton="engine.kernels.norm.reference:rms_norm")
    assert dispatch.pick("test_lazy_op", x) is plain  # auto: the reference for CPU tensors
    monkeypatch.setenv("ENCLAVE_KERNELS", "torch")
    reset_engine_env()  # the engine reads its variables once
    assert dispatch.pick("rms_norm", x) is dispatch.implementation("rms_norm", "torch")
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    reset_engine_env()
    with pytest.raises(ValueError, match="no Triton implementation"):
        dispatch.pick("test_only_op", x)
    from engine.kernels.norm import reference

    assert dispatch.pick("test_lazy_op", x) is reference.rms_norm  # imported by path on first use
    monkeypatch.setenv("ENCLAVE_KERNELS", "cuda-magic")
    reset_engine_env()
    with pytest.raises(EnvError, match="ENCLAVE_KERNELS"):
        dispatch.backend()


def test_single_token_sequences_without_context_ignore_stale_state():
    """A one-token prompt goes through the batched single-step path; its slot's old contents must not leak."""
    q, k, v, g, beta = delta_inputs(2, seed=8)
    layout = SeqLayout((1, 1), (0, 0), (0, 1))
    clean = kernels.gated_delta_rule(q, k, v, g, beta, torch.zeros(2, 4, 8, 6), layout)
    dirty = kernels.gated_delta_rule(q, k, v, g, beta, torch.full((2, 4, 8, 6), float("nan")), layout)
    torch.testing.assert_close(dirty, clean)
    x, w = rand(2, 5, seed=1), rand(5, 4, seed=2)
    conv_clean = kernels.causal_conv1d(x, w, torch.zeros(2, 5, 3), layout)
    conv_dirty = kernels.causal_conv1d(x, w, torch.full((2, 5, 3), float("nan")), layout)
    torch.testing.assert_close(conv_dirty, conv_clean)
    kc, vc = torch.full((16, 4, 1, 8), float("nan")), torch.full((16, 4, 1, 8), float("nan"))
    att = kernels.attention(
        rand(2, 2, 8, seed=3),
        rand(2, 1, 8, seed=4),
        rand(2, 1, 8, seed=5),
        kc,
        vc,
        dense_layout((1, 1), (0, 0), (0, 1)),
        0.3,
    )
    torch.testing.assert_close(
        att, rand(2, 1, 8, seed=5).repeat_interleave(2, 1)
    )  # one key: output = its value


@pytest.mark.parametrize("n, k, block", [(200, 144, (128, 128)), (128, 256, (128, 128)), (90, 100, (64, 32))])
def test_block_fp8_weight_quantiser(n, k, block):
    from tests.engine.factories import quantize_block_fp8

    w = rand(3, n, k, seed=n) / k**0.5
    w[1, : block[0], : block[1]] = (
        0.0  # a block of zeros: its scale is tiny but not 0 (no 0 / 0), values stay 0
    )
    q, scale = kernels.quantize_block_fp8_weight(w, block)  # stacked [E, N, K], as experts are
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, -(-n // block[0]), -(-k // block[1]))
    for e in range(3):
        one_q, one_scale = kernels.quantize_block_fp8_weight(w[e], block)
        assert torch.equal(q[e].view(torch.uint8), one_q.view(torch.uint8)) and torch.equal(
            scale[e], one_scale
        )
    if block == (128, 128):  # the test factory that writes FP8 checkpoints, bit for bit
        ref_q, ref_scale = quantize_block_fp8(w[0])
        assert torch.equal(q[0].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(
            scale[0], ref_scale
        )
    # Round trip: within half an e4m3 step (2**-4 relative), or a subnormal step of the block scale near 0.
    back = kernels.dequantize_block_fp8(q, scale, block, torch.float32)
    assert scale[1, 0, 0] > 0 and not back[1, : block[0], : block[1]].any()
    torch.testing.assert_close(back, w, rtol=2**-4, atol=scale.max().item() * 2**-10)
