"""Reasoning blocks: the split of an output at `</think>` (vLLM's qwen3 parser, plus an open block left by
the prompt), and the engine with a Qwen-like template: constraints and stop strings apply to the answer."""

from __future__ import annotations

import json

import pytest

from engine import Engine, SamplingParams
from engine.constraints import Constraint
from engine.reasoning import ReasoningSplit, ThinkTokens
from tests.qwen_like import write_qwen_like_model

THINK = ThinkTokens(start=3, end=4)


@pytest.mark.parametrize(
    ("output", "opened", "expected"),
    [
        ([10, 11, 4, 12, 13], True, ReasoningSplit([10, 11], [12, 13], True)),  # the prompt opened it
        ([3, 10, 4, 12], False, ReasoningSplit([10], [12], True)),  # the output opened it
        ([4, 12], True, ReasoningSplit([], [12], True)),  # an empty block
        ([10, 11], True, ReasoningSplit([10, 11], [], False)),  # cut inside the block
        ([3, 10], False, ReasoningSplit([10], [], False)),
        ([12, 13], False, ReasoningSplit(None, [12, 13], True)),  # thinking off: all answer
        ([12, 4, 13], False, ReasoningSplit([12], [13], True)),  # a stray end: split, as vLLM's parser
    ],
)
def test_split(output, opened, expected):
    assert THINK.split(output, opened) == expected


def test_opens_reads_the_last_tags_of_the_prompt():
    assert THINK.opens([1, 5, 3, 6])
    assert not THINK.opens([1, 5, 3, 6, 4, 6])  # thinking off: an empty closed block
    assert THINK.opens([3, 7, 4, 1, 3])  # an earlier turn's block closed, the new one open
    assert not THINK.opens([1, 2])


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory):
    path = write_qwen_like_model(tmp_path_factory.mktemp("qwen-like"))
    with Engine.from_pretrained(path, device="cpu", dtype="float32") as e:
        yield e


MESSAGES = [
    {"role": "system", "content": "Reply in JSON."},
    {"role": "user", "content": "The patient is 64."},
]
SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "sex": {"enum": ["f", "m"]}},
    "required": ["age", "sex"],
    "additionalProperties": False,
}


def test_budget_spent_inside_reasoning_is_reported(qwen_engine):
    prompt = qwen_engine.apply_chat_template(MESSAGES, enable_thinking=True)
    params = SamplingParams(
        max_tokens=12, temperature=0.0, split_reasoning=True, constraint=Constraint.json_schema(SCHEMA)
    )
    out = qwen_engine.submit(prompt, params, add_special_tokens=False).result()
    assert out.finish_reason == "length" and not out.reasoning_finished
    assert out.text == "" and out.reasoning_tokens == 12
    # The grammar waits for the answer: the reasoning is free text, not a JSON prefix.
    assert out.reasoning and not out.reasoning.startswith("{")


def test_constraint_applies_after_the_block(qwen_engine):
    think = qwen_engine.think
    prompt = qwen_engine.apply_chat_template(MESSAGES, enable_thinking=True)
    constraint = Constraint.json_schema(SCHEMA)
    # A bias makes the model close its block at once; the grammar then masks `</think>` out of the answer.
    params = SamplingParams(
        max_tokens=60,
        temperature=0.0,
        split_reasoning=True,
        constraint=constraint,
        logit_bias={think.end: 100},
    )
    out = qwen_engine.submit(prompt, params, add_special_tokens=False).result()
    assert out.token_ids[0] == think.end and out.reasoning == "" and out.reasoning_finished
    assert out.finish_reason == "stop" and json.loads(out.text).keys() == {"age", "sex"}


def test_thinking_off_is_all_answer(qwen_engine):
    prompt = qwen_engine.apply_chat_template(MESSAGES, enable_thinking=False)
    params = SamplingParams(max_tokens=60, temperature=0.0, split_reasoning=True)
    out = qwen_engine.submit(prompt, params, add_special_tokens=False).result()
    plain = qwen_engine.submit(
        prompt, SamplingParams(max_tokens=60, temperature=0.0), add_special_tokens=False
    )
    assert out.reasoning is None and out.reasoning_tokens == 0
    assert out.token_ids == plain.result().token_ids and out.text == plain.result().text
