"""Engine behaviour: batching invariance, chunked prefill, prompt validation, token-id-only checkpoints."""

import pytest

from engine import Engine, EngineError, RequestError, SamplingParams

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, *list(range(100, 180))], [7]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_batch_equals_one_at_a_time(demo_engine):
    together = demo_engine.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, together, strict=True):
        assert demo_engine.generate([prompt], GREEDY)[0].token_ids == out.token_ids


def test_chunked_prefill_and_small_groups_equal_whole(demo_dir, demo_engine):
    whole = [o.token_ids for o in demo_engine.generate(PROMPTS, GREEDY)]
    small = Engine.from_pretrained(
        demo_dir, device="cpu", dtype="float32", max_num_batched_tokens=7, max_num_seqs=2
    )
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY)] == whole


def test_stats_time_the_host_launching_each_kind_of_step(demo_engine, monkeypatch):
    # Off CUDA no step replays a graph: every launched step counts as eager, with its launch time. A step
    # counted as replayed when the runner says so.
    demo_engine.core.reset_counters()
    demo_engine.generate(PROMPTS[:2], GREEDY)
    stats = demo_engine.stats()
    assert stats.launch_steps == {"graph": 0, "eager": stats.steps} and stats.steps > 0
    assert stats.launch_s["graph"] == 0.0 < stats.launch_s["eager"]
    runner = demo_engine.core.runner
    launch = runner.launch

    def replayed(*args, **kwargs):
        launched = launch(*args, **kwargs)
        runner.last_graphed = True
        return launched

    monkeypatch.setattr(runner, "launch", replayed)
    demo_engine.core.reset_counters()
    demo_engine.generate(PROMPTS[:1], GREEDY)
    stats = demo_engine.stats()
    assert stats.launch_steps == {"graph": stats.steps, "eager": 0} and stats.launch_s["graph"] > 0


def test_max_num_seqs_left_to_the_engine_is_fixed_off_cuda(demo_engine):
    # On CUDA it is sized from the cache plan (planner.affordable_seqs); on the CPU it stays 64.
    assert demo_engine.max_num_seqs == demo_engine.core.scheduler.max_num_seqs == 64


def test_text_prompts_and_chat(demo_engine):
    text = demo_engine.generate("Summarise the note.", SamplingParams(max_tokens=5, temperature=0))[0]
    assert text.prompt == "Summarise the note." and text.prompt_token_ids == demo_engine.tokenizer.encode(
        text.prompt
    )
    assert isinstance(text.text, str)
    chat = demo_engine.chat(
        [{"role": "user", "content": "hello"}], SamplingParams(max_tokens=5, temperature=0)
    )[0]
    assert chat.prompt.startswith("<|im_start|>user\nhello<|im_end|>")
    params = [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)]
    assert [len(o.token_ids) for o in demo_engine.generate(["a", "b"], params)] == [2, 3]


@pytest.mark.parametrize(
    ("prompts", "needle"),
    [
        ([[]], "prompt 0 is empty"),
        ([[1, 2], [5, 10**6]], "prompt 1 has token id 1000000 outside the vocabulary"),
        ([[1, -3]], "outside the vocabulary"),
        ([3.5], "prompt 0 must be"),
        ([[1] * 9000], "context is 8192"),
    ],
)
def test_bad_prompts_are_rejected(demo_engine, prompts, needle):
    with pytest.raises(RequestError) as info:
        demo_engine.generate(prompts, GREEDY)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_bad_engine_options(demo_dir):
    with pytest.raises(EngineError, match="dtype"):
        Engine.from_pretrained(demo_dir, device="cpu", dtype="int8")
    with pytest.raises(RequestError, match="one per prompt"):
        Engine.from_pretrained(demo_dir, device="cpu").generate([[1], [2]], [GREEDY])


def test_checkpoint_without_tokenizer_takes_token_ids(demo_dir, tmp_path):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((demo_dir / f).read_bytes())
    engine = Engine.from_pretrained(tmp_path, device="cpu")
    assert engine.tokenizer is None
    out = engine.generate([[1, 2, 3]], GREEDY)[0]
    assert out.text is None and len(out.token_ids) == 16
    with pytest.raises(RequestError, match="tokenizer"):
        engine.generate(["text needs a tokenizer"], GREEDY)
    with pytest.raises(RequestError, match="tokenizer"):
        engine.generate([[1, 2]], SamplingParams(stop=["x"]))


def test_max_tokens_none_runs_to_the_context_limit(tmp_path):
    from tests.engine.factories import save_text_model

    save_text_model(tmp_path, seed=1, max_position_embeddings=40)
    engine = Engine.from_pretrained(tmp_path, device="cpu")
    out = engine.generate(
        [list(range(1, 31))], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10 and out.prompt_token_count == 30


def test_chat_does_not_add_special_tokens_twice(demo_dir, tmp_path):
    """With a tokenizer that prepends BOS, plain text gets it once and a rendered chat template none extra."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    for f in demo_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    engine = Engine.from_pretrained(tmp_path, device="cpu")
    plain = engine.generate("hello", SamplingParams(max_tokens=1))[0]
    assert plain.prompt_token_ids[0] == bos and plain.prompt_token_ids.count(bos) == 1
    chat = engine.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=1))[0]
    assert bos not in chat.prompt_token_ids
