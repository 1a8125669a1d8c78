"""The engine against transformers' Qwen3_5MoeForCausalLM / ForConditionalGeneration on the same weights."""

import pytest
import torch

from engine import Engine, SamplingParams
from tests.engine.factories import reference_logprobs, save_text_model, save_vl_model

# fp32 end to end: the two implementations differ only in summation order (chunked vs. token-by-token delta
# rule, fused vs. separate projections), which stays far under 1e-3 in log-probability.
LOGPROB_TOL = 1e-3
PROMPTS = [
    [5, 17, 33, 2, 90, 11, 60, 70, 3],
    [1, 2],
    list(range(10, 80)),  # 70 tokens: more than one 64-token DeltaNet chunk
    [42],
    [7, 7, 7, 7, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
]

CONFIGS = {
    "text-4-layers": dict(kind="text"),
    "vision-language-layout": dict(kind="vl"),
    "odd-5-layers-uneven-heads": dict(
        kind="text",
        num_hidden_layers=5,  # [l, l, l, f, l]: the pattern cut mid-group
        hidden_size=40,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=24,
        linear_num_key_heads=3,
        linear_num_value_heads=6,
        linear_key_head_dim=10,
        linear_value_head_dim=6,
        num_experts=7,
        num_experts_per_tok=3,
        moe_intermediate_size=13,
        shared_expert_intermediate_size=9,
        vocab_size=101,
    ),
    "tied-embeddings": dict(kind="text", tie_word_embeddings=True),
    "explicit-layer-types-rope-theta": dict(
        kind="text",
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        num_experts_per_tok=1,
    ),
}


def build(name, tmp_path, seed=3):
    spec = dict(CONFIGS[name])
    kind = spec.pop("kind")
    if kind == "vl":
        ref = save_vl_model(tmp_path, seed=seed, **spec)
        return ref, ref.model.language_model, ref.lm_head
    return save_text_model(tmp_path, seed=seed, **spec), None, None


def check_against_reference(ref, outs, prompts, vocab):
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) >= 12
        ref_lp = reference_logprobs(ref, prompt, out.token_ids)
        for pos, (token, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert token == int(ref_lp[pos].argmax()), f"greedy token differs at position {pos}"
            assert len(top) == 5
            expected = ref_lp[pos].topk(5)
            assert set(top) == set(expected.indices.tolist())
            for tok, value in top.items():
                assert abs(value - ref_lp[pos, tok].item()) < LOGPROB_TOL
            assert 0 <= token < vocab


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_batch_matches_reference(name, tmp_path):
    ref, _, _ = build(name, tmp_path)
    engine = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=14, temperature=0.0, logprobs=5))
    vocab = engine.config.vocab_size
    if name == "vision-language-layout":
        check_against_reference(_VLText(ref), outs, PROMPTS, vocab)
    else:
        check_against_reference(ref, outs, PROMPTS, vocab)


def test_reference_generate_agrees_token_for_token(tmp_path):
    """transformers' own cached greedy decoding gives the same tokens as the engine's batch."""
    ref, _, _ = build("odd-5-layers-uneven-heads", tmp_path)
    engine = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
    outs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, out in zip(PROMPTS[:3], outs, strict=True):
        generated = ref.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
        )
        assert generated[0, len(prompt) :].tolist() == out.token_ids


def test_chunked_prefill_matches_reference(tmp_path):
    """Prompts prefilled 16 tokens at a time (state carried across rounds) still match the reference."""
    ref, _, _ = build("text-4-layers", tmp_path)
    engine = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32", max_num_batched_tokens=16)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, logprobs=5))
    check_against_reference(ref, outs, PROMPTS, engine.config.vocab_size)


class _VLText:
    """The text path of a ForConditionalGeneration model, called like a causal LM."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids):
        return self.model(input_ids=input_ids)
