"""On a CUDA device: the engine computes what it computes on the CPU (run with `pytest -m gpu`)."""

import pytest
import torch

from engine import Engine, SamplingParams
from tests.engine.factories import add_mtp, save_text_model
from tests.engine.numerics import all_position_logits, bf16_report
from tests.engine.test_bf16 import check, random_prompts
from tests.engine.test_parity import PROMPTS, check_against_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_fp32_matches_reference_and_cpu(tmp_path):
    ref = save_text_model(tmp_path, seed=3)
    params = SamplingParams(max_tokens=14, temperature=0.0, logprobs=5)
    cuda = Engine.from_pretrained(tmp_path, device="cuda", dtype="float32").generate(PROMPTS, params)
    cpu = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32").generate(PROMPTS, params)
    assert [o.token_ids for o in cuda] == [o.token_ids for o in cpu]
    check_against_reference(ref, cuda, PROMPTS, 96)


def test_cuda_bf16_no_less_accurate_than_reference(demo_dir, tmp_path):
    check(bf16_report(demo_dir, "cuda", random_prompts(600)))
    save_text_model(tmp_path, seed=3)
    check(bf16_report(tmp_path, "cuda", random_prompts(96)))


def test_cuda_serving_matches_cpu(tmp_path):
    """Continuous batching, chunked prefill, speculation and prefix sharing on CUDA give the CPU's tokens."""
    save_text_model(tmp_path, seed=2)
    add_mtp(tmp_path, seed=9)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 96, (21,), generator=g).tolist()
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (1, 7, 70, 33)]
    prompts += [prefix + p for p in prompts]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    cpu = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
    expected = [o.token_ids for o in cpu.generate(prompts, params)]
    memory = 1 << 30
    for options in ({}, {"num_speculative_tokens": 3}, {"max_num_batched_tokens": 16, "max_num_seqs": 3}):
        with Engine.from_pretrained(
            tmp_path, device="cuda", dtype="float32", kv_cache_memory=memory, **options
        ) as cuda:
            futures = [
                cuda.submit(p, params, prefix=prefix if i >= 4 else None) for i, p in enumerate(prompts)
            ]
            assert [f.result().token_ids for f in futures] == expected, options
            assert cuda.core.runner.graphs.replays > 0, "decode steps should replay CUDA graphs"
    with Engine.from_pretrained(tmp_path, device="cuda", dtype="bfloat16", num_speculative_tokens=2) as bf16:
        assert all(len(o.token_ids) == 14 for o in bf16.generate(prompts, params))
        assert bf16.plan.nbytes <= bf16.plan.budget_bytes


def test_cuda_fp8_matches_cpu(tmp_path):
    """quantization="fp8" on CUDA: its Triton kernels (the shared expert stacked with the routed experts, the
    GEMV for a few tokens and the grouped GEMMs for many, the dense FP8 GEMM, CUDA graphs) give the CPU
    references' outputs, both in fp32 with the same e4m3 weights. Experts of 128 channels, so the 128 x 128
    scale blocks let the shared expert stack.

    Tolerances: Hopper's e4m3 tensor-core dots accumulate each 128-channel block with about 14 bits of
    mantissa before the fp32 promotion (as DeepSeek-V3 reports), ~2^-14 relative per block: measured 8e-6 on
    a MoE block and 7e-5 on a dense projection (H200, d2c73e9). Through a whole random model the activation
    quantiser turns such differences into other e4m3 roundings, and they grow layer by layer (0.18 relative
    after 4 layers at 60 tokens), so whole-model logits are compared on a short prompt only."""
    sizes = dict(moe_intermediate_size=128, shared_expert_intermediate_size=128)
    save_text_model(tmp_path, seed=6, **sizes)
    g = torch.Generator().manual_seed(5)
    cpu = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32", quantization="fp8")
    with Engine.from_pretrained(
        tmp_path, device="cuda", dtype="float32", quantization="fp8", kv_cache_memory=1 << 30
    ) as cuda:
        stacked = [n for n, m in cuda.model.named_modules() if getattr(m, "_stacked", None) is not None]
        assert len(stacked) == cuda.config.num_hidden_layers
        hidden = cuda.config.hidden_size
        for name in stacked:
            for tokens in (3, 60):  # 3 x 4 pairs: the GEMV; 60 x 4: the grouped GEMMs
                x = torch.randn(tokens, hidden, generator=g)
                with torch.no_grad():
                    expected = cpu.model.get_submodule(name)(x)
                    got = cuda.model.get_submodule(name)(x.cuda()).cpu()
                assert ((got - expected).norm() / expected.norm()).item() < 1e-4, (name, tokens)
        dense = [n for n, m in cuda.model.named_modules() if type(m).__name__ == "Fp8Linear"]
        for name in dense:
            x = torch.randn(60, cuda.model.get_submodule(name).in_features, generator=g)
            with torch.no_grad():
                expected = cpu.model.get_submodule(name)(x)
                got = cuda.model.get_submodule(name)(x.cuda()).cpu()
            assert ((got - expected).norm() / expected.norm()).item() < 1e-3, name
        ids = torch.randint(0, 96, (3,), generator=g).tolist()
        torch.testing.assert_close(
            all_position_logits(cuda, ids), all_position_logits(cpu, ids), rtol=1e-3, atol=1e-3
        )
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        assert cuda.generate([ids], params)[0].token_ids == cpu.generate([ids], params)[0].token_ids
        assert cuda.core.runner.graphs.replays > 0


def test_cuda_graphs_captured_at_start(tmp_path):
    """With graph_capture_len every batch bucket's decode graph up to that context is captured as the engine
    starts; decoding then replays them without capturing, and gives the CPU's tokens."""
    save_text_model(tmp_path, seed=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 40, 9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    cpu = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
    expected = [o.token_ids for o in cpu.generate(prompts, params)]
    options = dict(device="cuda", dtype="float32", max_num_seqs=4, graph_capture_len=300, block_size=16)
    with Engine.from_pretrained(tmp_path, kv_cache_memory=1 << 30, **options) as cuda:
        graphs = cuda.core.runner.graphs
        # buckets 1, 2, 4 x block-table widths 16 and 32 (300 positions are 19 blocks of 16)
        assert graphs.captures == 6 and graphs.capture_s > 0
        assert [o.token_ids for o in cuda.generate(prompts, params)] == expected
        assert graphs.replays > 0 and graphs.captures == 6
        assert cuda.stats().graphs_captured == 6


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
def test_cuda_mtp_graphs_give_the_eager_heads_tokens(tmp_path, monkeypatch, speculation):
    """ENCLAVE_MTP_GRAPHS=1: the MTP head's passes (the verify rows' pass, each further draft step, the K/V
    fill at k = 0) replay CUDA graphs, and greedy outputs stay the CPU's token for token (fp32)."""
    from engine.env import reset_engine_env

    save_text_model(tmp_path, seed=2)
    add_mtp(tmp_path, seed=9)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (1, 7, 70, 33, 12)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cpu = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
    expected = [o.token_ids for o in cpu.generate(prompts, params)]
    monkeypatch.setenv("ENCLAVE_MTP_GRAPHS", "1")
    monkeypatch.setenv("ENCLAVE_SPECULATION", speculation)
    reset_engine_env()
    options = {"num_speculative_tokens": 3} if speculation == "fixed" else {}
    with Engine.from_pretrained(
        tmp_path, device="cuda", dtype="float32", kv_cache_memory=1 << 30, **options
    ) as e:
        assert [o.token_ids for o in e.generate(prompts, params)] == expected
        graphs = e.core.runner.mtp_graphs
        assert graphs is not None and graphs.failed is None and graphs.replays > 0
    reset_engine_env()
