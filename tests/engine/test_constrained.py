"""Constrained decoding on the random demo model: every output matches its constraint, checked with
independent validators (jsonschema, Python's re), and the engine's invariants hold with masks on."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import Engine, RequestError, SamplingParams
from engine.constraints import Constraint
from engine.grammar import apply_bitmask
from engine.options import EngineOptions

# Nested objects, enums, arrays, bounded strings and numbers: free text from a random model must still end.
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "status": {"enum": ["active", "closed", "pending"]},
        "patient": {
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "sex": {"enum": ["female", "male", "unknown"]},
                "allergies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            },
            "required": ["age", "sex", "allergies"],
            "additionalProperties": False,
        },
        "codes": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
            "minItems": 1,
            "maxItems": 3,
        },
        "urgent": {"type": "boolean"},
    },
    "required": ["name", "status", "patient", "codes", "urgent"],
    "additionalProperties": False,
}
PATTERN = r"[A-Z]{2}-[0-9]{3}(/[a-z]{1,4})?"
CHOICES = ["yes", "no", 'it "depends"', "ünïcode ✓"]
PROMPTS = ["Extract the record.", "The patient is 64.", "def main(): pass", "Numbers 0 1 2", "Hello there"]


def engine(demo_dir, **options) -> Engine:
    return Engine.from_pretrained(demo_dir, device="cpu", dtype="float32", **options)


def params(constraint: Constraint, **extra) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 160, "temperature": 0.0, "constraint": constraint, **extra})


def check(constraint: Constraint, text: str) -> None:
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), constraint.spec)
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.spec, text), text
    else:
        assert text in constraint.spec


CONSTRAINTS = [Constraint.json_schema(RECORD), Constraint.regex(PATTERN), Constraint.choice(CHOICES)]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_every_output_matches_greedy_and_sampled(demo_engine, constraint):
    greedy = demo_engine.generate(PROMPTS, params(constraint))
    sampled = demo_engine.generate(
        PROMPTS, [params(constraint, temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    )
    for out in greedy + sampled:
        assert out.finish_reason == "stop", out.text
        check(constraint, out.text)


def test_json_object_outputs_are_objects_or_cut_at_max_tokens(demo_engine):
    # Free keys and strings have no bound, so a random model may still be writing when max_tokens ends.
    outs = demo_engine.generate(PROMPTS, params(Constraint.json_object(), max_tokens=60))
    for out in outs:
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 60


def test_unconstrained_output_would_not_match(demo_engine):
    # The constraint is what makes the outputs valid: the same model free-running produces no JSON.
    free = demo_engine.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0))
    for out in free:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_batched_equals_one_at_a_time(demo_dir):
    constraint = Constraint.json_schema(RECORD)
    with engine(demo_dir) as e:
        batched = [o.token_ids for o in e.generate(PROMPTS, params(constraint))]
    with engine(demo_dir) as e:
        alone = [e.generate([p], params(constraint))[0].token_ids for p in PROMPTS]
    assert batched == alone


def test_speculative_equals_plain_and_rejects_drafts_outside_the_grammar(demo_dir):
    constraint = Constraint.json_schema(RECORD)
    with engine(demo_dir) as e:
        plain = [o.token_ids for o in e.generate(PROMPTS, params(constraint))]
        free = {
            tuple(e.tokenizer.encode(p)): o.token_ids
            for p, o in zip(
                PROMPTS, e.generate(PROMPTS, SamplingParams(max_tokens=200, temperature=0.0)), strict=True
            )
        }

    def unconstrained_drafter(seq, count):
        # The free-running continuation: mostly tokens the grammar refuses.
        ahead = free[tuple(seq.prompt_ids)][len(seq.output_ids) :]
        return (ahead + [0] * count)[:count]

    with engine(demo_dir, num_speculative_tokens=3, drafter=unconstrained_drafter) as e:
        spec = [o.token_ids for o in e.generate(PROMPTS, params(constraint))]
        assert e.stats().draft_tokens > 0
    with engine(demo_dir, num_speculative_tokens=2) as e:  # the demo checkpoint's own MTP head
        mtp = [o.token_ids for o in e.generate(PROMPTS, params(constraint))]
    assert spec == plain
    assert mtp == plain


def test_oracle_drafts_are_accepted_under_the_grammar(demo_dir):
    constraint = Constraint.regex(PATTERN)
    with engine(demo_dir) as e:
        truth = {
            tuple(e.tokenizer.encode(p)): o.token_ids
            for p, o in zip(PROMPTS, e.generate(PROMPTS, params(constraint)), strict=True)
        }

    def oracle(seq, count):
        ahead = truth[tuple(seq.prompt_ids)][len(seq.output_ids) :]
        return (ahead + [0] * count)[:count]

    with engine(demo_dir, num_speculative_tokens=3, drafter=oracle) as e:
        outs = e.generate(PROMPTS, params(constraint))
        stats = e.stats()
    assert [o.token_ids for o in outs] == list(truth.values())
    assert stats.accepted_tokens > 0  # drafts inside the grammar are kept


def test_prefix_sharing_and_async_scheduling_give_the_same_outputs(demo_dir):
    constraint = Constraint.json_schema(RECORD)
    shared = "You extract records. Reply with JSON only. " * 4
    prompts = [shared + p for p in PROMPTS]
    with engine(demo_dir) as e:
        expected = [o.token_ids for o in e.generate(prompts, params(constraint))]
    with engine(demo_dir, max_num_seqs=8) as e:
        futures = [e.submit(p, params(constraint), prefix=shared, add_special_tokens=True) for p in prompts]
        assert [f.result().token_ids for f in futures] == expected
        assert e.stats().prefix_entries >= 1
    options = EngineOptions.from_flat({"device": "cpu", "dtype": "float32", "async_scheduling": True})
    with Engine.from_pretrained(demo_dir, options) as e:
        assert e.core.async_scheduling
        mixed = [
            params(constraint) if i % 2 else SamplingParams(max_tokens=12, temperature=0.0) for i in range(5)
        ]
        outs = e.generate(prompts, mixed)
    assert [o.token_ids for i, o in enumerate(outs) if i % 2] == [t for i, t in enumerate(expected) if i % 2]


def test_logprobs_stay_the_models_own(demo_dir):
    # Log-probabilities report the raw distribution (as vLLM's default), not the masked one.
    constraint = Constraint.choice(CHOICES)
    with engine(demo_dir) as e:
        out = e.generate(["Hello there"], params(constraint, logprobs=5))[0]
        first = e.generate(["Hello there"], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
    assert out.logprobs[0].keys() >= first.logprobs[0].keys() - {first.token_ids[0]}
    for token, value in first.logprobs[0].items():
        assert out.logprobs[0].get(token, value) == pytest.approx(value, abs=1e-5)
    assert out.token_texts[out.token_ids[0]] == e.tokenizer.decode(
        [out.token_ids[0]], skip_special_tokens=False
    )


def test_bad_constraints_are_refused_at_submit(demo_engine):
    with pytest.raises(RequestError, match="regex constraint cannot be compiled"):
        demo_engine.submit("x", params(Constraint.regex("(unclosed")))
    with pytest.raises(RequestError, match="choice constraint needs"):
        Constraint.choice([])
    with pytest.raises(RequestError, match="constraint kind"):
        Constraint("grammar", "root ::= x")


def test_apply_bitmask_masks_exactly_the_zero_bits():
    import torch

    logits = torch.zeros(3, 70)
    bitmask = torch.full((3, 3), -1, dtype=torch.int32)
    bitmask[1, 0] = 0b101  # row 1: tokens 0 and 2 of the first word allowed
    bitmask[1, 2] = 0  # and nothing of the third word (tokens 64-69)
    apply_bitmask(logits, bitmask, [1])
    allowed = torch.isfinite(logits)
    assert allowed[0].all() and allowed[2].all()  # rows not listed are untouched
    assert allowed[1].nonzero().flatten().tolist() == [0, 2, *range(32, 64)]


def test_a_model_without_an_end_token_is_refused_in_one_line(demo_engine):
    from engine.grammar import GrammarCompiler

    with pytest.raises(RequestError, match="end-of-sequence token"):
        GrammarCompiler(demo_engine.tokenizer, demo_engine.config.vocab_size, [])


@pytest.mark.parametrize(
    "pool, threads, groups",
    [("llguidance", 2, None), ("python", 3, None), ("python", 3, 1), ("python", 2, 4)],
)
def test_each_fill_pool_fills_what_one_matcher_at_a_time_does(pool, threads, groups):
    # 12 rows (a pool from PARALLEL_FILL_ROWS) at different places of a schema: the pooled fill's masks equal
    # the row-by-row fill's, bit for bit, in rows given out of order; with a lexer group per thread (None),
    # one shared lexer (1: rows dealt out to the threads) and more groups than threads
    from engine.bench.constrained import SCHEMA, synthetic_tokenizer
    from engine.grammar import PARALLEL_FILL_ROWS, GrammarCompiler, allocate_bitmask

    vocab = 4096
    tokenizer = synthetic_tokenizer(vocab)
    compiler = GrammarCompiler(tokenizer, vocab, [vocab - 1], threads=threads, pool=pool, groups=groups)
    text = '{"patient_id": "AB123456", "age": 42, "sex": "other", "diagnoses": [{"code": "X1'
    ids = tokenizer.backend.encode(text).ids
    states = [compiler.state(Constraint.json_schema(SCHEMA)) for _ in range(12)]
    for i, state in enumerate(states):
        assert all(state.accept(t) for t in ids[: i * len(ids) // 12])
    rows = [13, 2, 7, 0, 11, 4, 9, 1, 12, 6, 3, 8]
    pooled = allocate_bitmask(14, vocab, pin=False)
    compiler.fill(states, pooled, rows)
    one = allocate_bitmask(14, vocab, pin=False)
    for state, row in zip(states, rows, strict=True):
        compiler.fill([state], one, [row])
    assert len(states) >= PARALLEL_FILL_ROWS and torch.equal(pooled, one)
    assert len({tuple(pooled[r].tolist()) for r in rows}) > 3  # the rows' masks differ
    assert compiler.fill_stats.calls == 1 + len(states)


def test_requests_take_the_lexer_groups_in_turn_each_compiled_on_its_own():
    # llguidance's deep_copy shares the copied matcher's lexer (one mutex per mask): each fill thread's group
    # has its own compiled matcher, so matchers of different groups never wait on one another
    from engine.bench.constrained import SCHEMA, synthetic_tokenizer
    from engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(synthetic_tokenizer(4096), 4096, [4095], threads=3)
    constraint = Constraint.json_schema(SCHEMA)
    states = [compiler.state(constraint) for _ in range(7)]
    assert [s.group for s in states] == [0, 1, 2, 0, 1, 2, 0]
    templates = [compiler._compile(constraint, group) for group in range(3)]
    assert len({id(t) for t in templates}) == 3  # three compilations, not one shared
    assert compiler._compile(constraint, 1) is templates[1]  # and each kept
    assert all(s.matcher is not templates[s.group] for s in states)  # requests hold copies


def test_an_unknown_fill_pool_is_refused():
    from engine.bench.constrained import synthetic_tokenizer
    from engine.grammar import GrammarCompiler

    with pytest.raises(ValueError, match="fill pool"):
        GrammarCompiler(synthetic_tokenizer(300), 300, [299], pool="rayon")
