"""The FP8 draft head (option `draft_head="fp8"`): MTP drafts scored with a block-scaled e4m3 copy of the
lm_head, verification with the checkpoint's own. Greedy output stays plain decoding's token for token; the
copy's logits are the head's within e4m3's rounding."""

import pytest
import torch

import engine.runner as engine_runner
from engine import Engine, SamplingParams
from engine.kernels.fp8.reference import dequantize_block_fp8

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def engine(path, **options):
    return Engine.from_pretrained(path, device="cpu", dtype="float32", **options)


def prompts(vocab, count=6):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 40, 3, 17, 64, 1)[:count]]


@pytest.mark.parametrize("which", ["factory", "demo"])
def test_greedy_output_stays_plain_decodings(mtp_dir, demo_dir, which):
    path = mtp_dir if which == "factory" else demo_dir
    with engine(path) as e:
        asks = prompts(e.config.vocab_size)
        keys = set(e.model.state_dict())
        expected = [o.token_ids for o in e.generate(asks, GREEDY)]
        assert e.model.draft_head is None
    with engine(path, num_speculative_tokens=2, draft_head="fp8") as e:
        assert e.model.draft_head is not None and e.model.draft_head.weight.dtype == torch.float8_e4m3fn
        assert set(e.model.state_dict()) == keys  # the copy is not a parameter of the checkpoint
        assert [o.token_ids for o in e.generate(asks, GREEDY)] == expected
        assert e.stats().draft_tokens > 0


def test_plain_decoding_makes_no_copy(mtp_dir):
    with engine(mtp_dir, num_speculative_tokens=0, draft_head="fp8") as e:
        assert e.model.draft_head is None


def test_the_copys_logits_are_the_heads_within_e4m3_rounding(mtp_dir):
    """Against the checkpoint's head in fp32 over the model's own normed states: the copy's weight is the
    head's to e4m3's 3 mantissa bits (relative 2^-4 per weight at most), activations are quantised per 128
    channels the same way, so each logit moves by a few percent of the logits' spread; the argmax (what a
    greedy draft is) stays on the head's almost everywhere."""
    with engine(mtp_dir) as e:
        model = e.model
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, e.config.vocab_size, (1, 96), generator=g)
        with torch.no_grad():
            normed = model.final_norm(model.model.embed_tokens(ids[0]) * 3.0)
            model.use_fp8_draft_head_()
            head, draft = model.logits(normed), model.draft_logits(normed)
            w = model._head_weight()
            dequant = dequantize_block_fp8(
                model.draft_head.weight, model.draft_head.weight_scale_inv, (128, 128), w.dtype
            )
    assert (
        dequant - w
    ).abs().max() <= w.abs().max() / 16  # e4m3: at most half a step of 2^-3 of the block max
    spread = head.std().item()
    assert (draft - head).abs().mean().item() < 0.05 * spread
    assert (draft.argmax(-1) == head.argmax(-1)).float().mean().item() >= 0.9


def test_the_cost_model_counts_the_copys_bytes_per_draft(mtp_dir):
    from engine.spec_cost import ModelBytes

    with engine(mtp_dir) as e:
        model = e.model
        before = ModelBytes.of(model, 4, 0)
        model.use_fp8_draft_head_()
        after = ModelBytes.of(model, 4, 0)
    v, h = model._head_weight().shape
    scales = -(-v // 128) * -(-h // 128) * 4
    assert before.draft_head == before.lm_head == v * h * 4  # fp32 here
    assert after.draft_head == v * h + scales and after.lm_head == before.lm_head


@pytest.mark.parametrize("head", ["model", "fp8"])
def test_a_limited_draft_vocabulary_drafts_its_tokens_only_and_keeps_greedy(mtp_dir, head, monkeypatch):
    """`draft_vocab=N`: drafts are scored over the first N token ids (a view of the head's rows, or the FP8
    copy of those rows only), so no draft is N or more; verification keeps greedy output plain decoding's."""
    with engine(mtp_dir) as e:
        asks = prompts(e.config.vocab_size)
        expected = [o.token_ids for o in e.generate(asks, GREEDY)]
    n = 48
    drafted: list[int] = []
    pick = engine_runner.ModelRunner._pick_drafts

    def recording(seqs, logits, probs, vocab):
        assert logits.shape[-1] == n and vocab == e.model.vocab_rows
        tokens = pick(seqs, logits, probs, vocab)
        drafted.extend(tokens.tolist())
        return tokens

    monkeypatch.setattr(engine_runner.ModelRunner, "_pick_drafts", staticmethod(recording))
    with engine(mtp_dir, num_speculative_tokens=2, draft_head=head, draft_vocab=n) as e:
        assert e.model.draft_vocab == n
        if head == "fp8":
            assert e.model.draft_head.weight.shape[0] == n  # the copy holds the limited rows only
        assert [o.token_ids for o in e.generate(asks, GREEDY)] == expected
        stats = e.stats()
    assert drafted and max(drafted) < n and stats.draft_tokens > 0


def test_a_draft_vocabulary_at_least_the_heads_is_the_whole_head(mtp_dir):
    with engine(mtp_dir, num_speculative_tokens=2, draft_vocab=10**6) as e:
        assert e.model.draft_vocab is None and e.model.draft_weight().shape[0] == e.model.vocab_rows


def test_the_cost_model_counts_a_limited_draft_vocabulary(mtp_dir):
    from engine.spec_cost import ModelBytes

    with engine(mtp_dir) as e:
        model = e.model
        model.limit_draft_vocab_(32)
        costs = ModelBytes.of(model, 4, 0)
    v, h = model._head_weight().shape
    assert costs.lm_head == v * h * 4 and costs.draft_head == 32 * h * 4
