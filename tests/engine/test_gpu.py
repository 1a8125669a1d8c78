"""On a CUDA device: the engine computes what it computes on the CPU (run with `pytest -m gpu`)."""

import pytest
import torch

from engine import Engine, SamplingParams
from tests.engine.factories import save_text_model
from tests.engine.numerics import bf16_report
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
