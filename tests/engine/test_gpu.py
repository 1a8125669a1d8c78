"""On a CUDA device: the engine computes what it computes on the CPU (run with `pytest -m gpu`)."""

import pytest
import torch

from engine import Engine, SamplingParams
from tests.engine.factories import save_text_model
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


def test_cuda_bf16_stays_close_to_fp32(tmp_path):
    save_text_model(tmp_path, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    fp32 = Engine.from_pretrained(tmp_path, device="cuda", dtype="float32").generate(PROMPTS, params)
    bf16 = Engine.from_pretrained(tmp_path, device="cuda", dtype="bfloat16").generate(PROMPTS, params)
    # bf16 weights and activations: compare the first generated position (same prefix) only.
    for a, b in zip(fp32, bf16, strict=True):
        first_a, first_b = a.logprobs[0], b.logprobs[0]
        shared = set(first_a) & set(first_b)
        assert len(shared) >= 3
        assert max(abs(first_a[t] - first_b[t]) for t in shared) < 0.15
