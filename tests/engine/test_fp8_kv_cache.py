"""The FP8 KV cache (`kv_cache_dtype="fp8"`): its bytes and tensors, what the planner fits in a budget, the
engine serving with it (the MTP head's layers and the prefix cache's block copies included), and its
accuracy against a cache in the model's dtype on the demo model."""

import pytest
import torch

from engine import Engine, SamplingParams
from engine.bench.kv_accuracy import measure
from engine.bench.presets import PRESETS
from engine.cache import ModelCache, block_bytes, kv_cache_dtype
from engine.config import config_from_dict
from engine.planner import affordable_seqs, plan_cache
from tests.engine.test_cache_pools import small_config

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["Summarise the discharge note.", "Extract the fields: name, date of birth", "Continue metformin"]


def test_kv_cache_dtype_names():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8", torch.float32) == FP8


def test_fp8_block_bytes_by_hand_and_against_the_tensors():
    c = small_config()  # 2 attention layers, 2 kv heads of 16
    # k and v: block_size x 2 kv heads x (16 e4m3 bytes + one fp32 scale); 2 attention layers + 1 MTP.
    assert block_bytes(c, FP8, 4, 1) == 3 * 2 * 4 * 2 * (16 + 4)
    cache = ModelCache(c, 3, 5, 4, "cpu", torch.bfloat16, 1, FP8)
    kv = cache.kv_states()
    assert len(kv) == 3 and len(cache.mtp_layers) == 1
    for p in kv:
        assert p.k.dtype == p.v.dtype == FP8 and p.k.shape == (5, 4, 2, 16)
        assert p.k_scale.dtype == p.v_scale.dtype == torch.float32 and p.k_scale.shape == (5, 4, 2)
    kv_bytes = sum(t.numel() * t.element_size() for p in kv for t in p.tensors())
    assert kv_bytes == 5 * block_bytes(c, FP8, 4, 1)
    assert ModelCache(c, 3, 5, 4, "cpu", torch.bfloat16, 1).kv_states()[0].k_scale is None


def test_copy_blocks_carries_the_scales():
    cache = ModelCache(small_config(), 2, 6, 4, "cpu", torch.float32, 1, FP8)
    g = torch.Generator().manual_seed(0)
    for t in cache.tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    before = [t.clone() for t in cache.tensors()]
    cache.copy_blocks([5, 1], [0, 4])
    kv_before = before[2 * 4 :]  # after 4 DeltaNet layers' (conv, recurrent)
    assert len(kv_before) == 4 * 3  # k, v, k_scale, v_scale of 2 layers and the MTP head's
    for now, then in zip([t for p in cache.kv_states() for t in p.tensors()], kv_before, strict=True):
        for src, dst in ((5, 0), (1, 4)):
            assert torch.equal(now[dst].float(), then[src].float())
        for untouched in (1, 2, 3, 5):
            assert torch.equal(now[untouched].float(), then[untouched].float())


def test_same_budget_fits_about_twice_the_positions_and_sequences():
    """At Qwen3.5-35B-A3B's geometry (D 256, 2 kv heads, 10 attention layers + 1 MTP) an FP8 position costs
    256 + 4 bytes per row against bf16's 512: 1.97x the blocks in what the state slots leave, so 1.97x the
    longest context one sequence can hold, or 1.97x the sequences of a long context whose KV fits."""
    config = config_from_dict(PRESETS["qwen3.5-35b-a3b"]())
    one = dict(max_num_seqs=1, max_model_len=10_000_000, num_mtp_layers=1, max_prefixes=0)
    bf16 = plan_cache(config, torch.bfloat16, 8 << 30, **one)
    fp8 = plan_cache(config, torch.bfloat16, 8 << 30, kv_dtype=FP8, **one)
    assert fp8.block_bytes * 512 == bf16.block_bytes * 260
    assert 1.96 < fp8.num_blocks / bf16.num_blocks < 1.98  # max context = blocks x block_size
    many = dict(max_num_seqs=128, max_model_len=32768, num_mtp_layers=1, max_prefixes=0)
    per_seq = 32768 // 16
    seqs_bf16 = plan_cache(config, torch.bfloat16, 40 << 30, **many).num_blocks // per_seq
    seqs_fp8 = plan_cache(config, torch.bfloat16, 40 << 30, kv_dtype=FP8, **many).num_blocks // per_seq
    assert 1.9 < seqs_fp8 / seqs_bf16 < 2.0, (seqs_bf16, seqs_fp8)
    # Sized from the budget (max_num_seqs unset) at a context where KV weighs more than a state slot.
    short = dict(max_model_len=2048, num_mtp_layers=1, max_prefixes=0)
    auto_bf16 = affordable_seqs(config, torch.bfloat16, 64 << 30, **short)
    assert affordable_seqs(config, torch.bfloat16, 64 << 30, kv_dtype=FP8, **short) > 1.2 * auto_bf16


def test_engine_plans_and_serves_with_an_fp8_cache(demo_dir):
    options = dict(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_memory=8 << 20)
    with Engine.from_pretrained(demo_dir, **options) as plain:
        expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
        plain_blocks = plain.plan.num_blocks
    with Engine.from_pretrained(demo_dir, kv_cache_dtype="fp8", **options) as e:
        assert e.options.cache.kv_cache_dtype == "fp8"
        assert all(p.k.dtype == FP8 and p.k_scale is not None for p in e.core.cache.kv_states())
        assert e.plan.num_blocks > plain_blocks  # fp32 model: 4 bytes a value against 1 + 4/D
        got = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
        again = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]  # over blocks freed and reused
    assert got == again
    same = sum(a == b for g, x in zip(got, expected, strict=True) for a, b in zip(g, x, strict=True))
    assert same / sum(len(x) for x in expected) >= 0.95


def test_shared_prefix_copies_its_partial_block_with_its_scales(demo_dir, monkeypatch):
    """A 37-token prefix in blocks of 16 leaves a partial third block that each request gets a copy of
    (`copy_blocks`); with the scales copied, requests from the cached prefix decode as without it."""
    copies = []
    real = ModelCache.copy_blocks
    monkeypatch.setattr(
        ModelCache, "copy_blocks", lambda self, s, d: copies.append(len(s)) or real(self, s, d)
    )
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 256, (37,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11)]
    options = dict(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_dtype="fp8", block_size=16)
    with Engine.from_pretrained(demo_dir, max_prefixes=0, **options) as e:
        expected = [o.token_ids for o in e.generate(prompts, GREEDY)]
    with Engine.from_pretrained(demo_dir, **options) as e:
        outs = [f.result() for f in [e.submit(p, GREEDY, prefix=prefix) for p in prompts]]
    assert all(o.metrics.cached_prefix_tokens == len(prefix) - 1 for o in outs)
    assert sum(copies) >= len(prompts)  # a partial block copied per request
    assert [o.token_ids for o in outs] == expected


def test_speculation_reads_and_writes_the_mtp_heads_fp8_layers(demo_dir):
    options = dict(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_dtype="fp8")
    with Engine.from_pretrained(demo_dir, num_speculative_tokens=2, **options) as e:
        assert len(e.core.cache.mtp_layers) == 1 and e.core.cache.mtp_layers[0].k_scale is not None
        outputs = e.generate(PROMPTS, GREEDY)
        assert e.core.draft_tokens > 0
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)


@pytest.fixture(scope="module")
def demo_model(demo_dir):
    with Engine.from_pretrained(demo_dir, device="cpu", dtype="float32", max_num_seqs=1) as e:
        return e.model


def test_fp8_cache_logits_and_greedy_agreement_on_the_demo_model(demo_model):
    """Teacher-forced logits of the FP8 cache against the fp32 cache over 64 steps after 48-token prompts.

    Tolerance: e4m3 keeps 3 mantissa bits, so each key and value moves by up to 2^-4 of itself (about 16x
    a bf16 cache's rounding); on this model (logit std ~4) that moves the logits by 0.007 on average and
    0.075 at most (measured). A max below 0.25 (6% of the logits' spread) and a mean below 0.02 leave room
    over that and still catch a wrong scale or a stale row (O(1) errors). Over longer runs one step's max
    can jump when the perturbation flips a token's top-k experts, so the test stays at 64 steps; greedy
    agreement must be at least 95%, the GPU acceptance bar."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, demo_model.config.vocab_size, (3, 48), generator=g)
    result = measure(demo_model, prompts, tokens=64)
    assert result.nonfinite_steps == 0 and result.first_nonfinite_step is None, result
    assert result.max_logit_error < 0.25 and result.mean_logit_error < 0.02, result
    assert result.greedy_agreement >= 0.95 and result.free_run_agreement >= 0.95, result
    assert 0.5 < result.logit_std < 50


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_fp8_cache_agrees_with_the_bf16_cache(demo_dir):
    """The same comparison on CUDA in bf16 (Triton kernels, the one-launch write) over 256 tokens: the GPU
    acceptance's 95% greedy agreement; the logit error by its typical step (median of each step's max) and
    its mean, since over 256 steps a few steps' maxima are expert flips (O(1), as on the CPU)."""
    with Engine.from_pretrained(demo_dir, device="cuda", dtype="bfloat16", max_num_seqs=1) as e:
        model = e.model
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (4, 256), generator=g).cuda()
    result = measure(model, prompts, tokens=256)
    assert result.nonfinite_steps == 0, result  # the baseline's own logits (H100/H200 at 2026-12-05: NaN)
    assert result.greedy_agreement >= 0.95, result
    assert result.step_error_median < 0.1 and result.mean_logit_error < 0.05, result
