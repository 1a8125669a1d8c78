"""A long prompt end to end on the reference path: prefilled in many chunks it equals the whole prompt.

The tiny checkpoint uses YaRN (factor 4 over 1,024 positions) and a prompt of 3,000 tokens, so the prompt
runs well past the native window, across hundreds of KV blocks, and its chunks take every path of the
reference kernels: short (at most SHORT_QUERY tokens: decode-style batched attention, token-by-token delta
rule and conv) and long (SDPA over gathered blocks, the chunked delta rule) with and without earlier context.
"""

import itertools

import pytest
import torch

from engine import Engine, SamplingParams
from engine.kernels.layout import SHORT_QUERY
from tests.engine.factories import save_text_model, single_cache

PROMPT_LEN = 3000
NEW = 8
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
}
# Chunk lengths in turn: short ones (<= SHORT_QUERY) and long ones on either side of the delta rule's
# 64-token chunks.
CHUNKS = (1, SHORT_QUERY, SHORT_QUERY + 1, 63, 64, 65, 3, 129, 700)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("long-ckpt")
    reference = save_text_model(path, seed=5, max_position_embeddings=1024, rope_parameters=dict(YARN))
    return path, reference


@pytest.fixture(scope="module")
def prompt(ckpt):
    vocab = ckpt[1].config.vocab_size
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()


def chunk_lengths(total: int) -> list[int]:
    lengths, done = [], 0
    for n in itertools.cycle(CHUNKS):
        n = min(n, total - done)
        lengths.append(n)
        done += n
        if done == total:
            return lengths


@torch.no_grad()
def prefill_then_decode(model, ids: list[int], lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Hidden states [len(ids), H] of the prompt prefilled in chunks of `lengths`, then NEW greedy tokens
    decoded one step at a time."""
    cache, layout = single_cache(model.config, len(ids) + NEW)
    hidden, done = [], 0
    for n in lengths:
        hidden.append(model(torch.tensor(ids[done : done + n]), layout(n, done), cache))
        done += n
    hidden = torch.cat(hidden)
    tokens = [int(model.logits(model.final_norm(hidden[-1:])).argmax())]
    for _ in range(NEW - 1):
        h = model(torch.tensor(tokens[-1:]), layout(1, done), cache)
        done += 1
        tokens.append(int(model.logits(model.final_norm(h)).argmax()))
    return hidden, tokens


def test_chunked_long_prompt_equals_the_whole_prompt(ckpt, prompt):
    path, reference = ckpt
    with Engine.from_pretrained(path, device="cpu", dtype="float32") as engine:
        model = engine.model
        assert engine.max_model_len == 4096  # YaRN: 4 x 1,024
        lengths = chunk_lengths(PROMPT_LEN)
        assert len(lengths) > 10 and min(lengths) == 1 and max(lengths) > 64
        whole, whole_tokens = prefill_then_decode(model, prompt, [PROMPT_LEN])
        chunked, chunked_tokens = prefill_then_decode(model, prompt, lengths)
        # fp32, each position's error relative to its hidden state's norm (~30): the chunked and per-token
        # delta rules, and attention over split keys, sum in other orders than the whole prompt (~5e-4 seen).
        error = (chunked - whole).norm(dim=-1) / whole.norm(dim=-1)
        assert error.max() < 2e-3, f"position {int(error.argmax())}: relative error {float(error.max()):.2e}"
        last = model.logits(model.final_norm(whole[-1:]))[0]
        torch.testing.assert_close(
            model.logits(model.final_norm(chunked[-1:]))[0], last, rtol=1e-3, atol=1e-3
        )
        assert chunked_tokens == whole_tokens
    # And the whole prompt against transformers' (eager, fp32) on the same weights and YaRN.
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(last, theirs, rtol=1e-3, atol=1e-3)


def test_a_lone_long_prompt_in_larger_chunks_equals_small_chunks(ckpt, prompt):
    path, _ = ckpt
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, options in {
        "small": {"max_num_batched_tokens": 256},
        "large": {"max_num_batched_tokens": 256, "long_prefill_chunk": 2048},
    }.items():
        with Engine.from_pretrained(path, device="cpu", dtype="float32", **options) as engine:
            runs[name] = (engine.generate([prompt], greedy)[0].token_ids, engine.stats().steps)
            # As served: unset is off on the CPU (the step budget itself).
            assert engine.options.serving.long_prefill_chunk == options.get("long_prefill_chunk", 256)
    assert runs["large"][0] == runs["small"][0] and len(runs["small"][0]) == NEW
    # 3,000 tokens: 12 chunks of at most 256, or 2 of at most 2,048; then NEW - 1 decode steps.
    assert runs["small"][1] == 12 + NEW - 1 and runs["large"][1] == 2 + NEW - 1
