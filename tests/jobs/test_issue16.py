"""Issue 16's acceptance on the random demo model with the Qwen-like template (tests/qwen_like.py):
thinking on and off (1), constrained outputs that validate, every one (2), and an OpenAI batch file using
every listed parameter, checked field by field with the `openai` package's own types (4)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from engine import Engine, SamplingParams
from jobs import make_kind
from jobs.base import Document
from jobs.findings import FINDINGS_SCHEMA
from jobs.openai_batch import output_line, parse_batch_file
from tests.jobs.factories import run_shard
from tests.qwen_like import write_qwen_like_model

EXTRACT_SCHEMA = {
    "type": "object",
    "properties": {
        "patient": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "sex": {"enum": ["female", "male", "unknown"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "sex", "age"],
            "additionalProperties": False,
        },
        "diagnoses": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
                    "severity": {"enum": ["mild", "moderate", "severe"]},
                },
                "required": ["code", "severity"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "admitted": {"type": "boolean"},
    },
    "required": ["patient", "diagnoses", "admitted"],
    "additionalProperties": False,
}
NOTES = [f"Note {i}: patient aged {40 + i}, chest pain, troponin negative." for i in range(6)]
SOURCE = "def add(a, b):\n    return a - b\n\n\ndef main(argv):\n    return add(*argv)\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_qwen_like_model(tmp_path_factory.mktemp("qwen-like-model"))
    with Engine.from_pretrained(path, device="cpu", dtype="float32") as e:
        yield e


def docs(texts, suffix=".txt"):
    return [Document(f"doc{i}{suffix}", text.encode()) for i, text in enumerate(texts)]


# Acceptance 1: thinking on and off give clean answers; a budget spent inside reasoning is reported.


def test_thinking_off_gives_the_answer_alone(engine):
    kind = make_kind("extract", {"schema": EXTRACT_SCHEMA, "max_tokens": 200})
    assert kind.params["enable_thinking"] is False  # extract's default
    results = run_shard(kind, docs(NOTES), engine)
    for result in results:
        assert result.status == "done", result.error
        jsonschema.validate(result.output, EXTRACT_SCHEMA)
        assert result.reasoning is None


def test_thinking_on_keeps_reasoning_apart_when_asked(engine):
    think_end = engine.think.end
    kind = make_kind("summarize", {"enable_thinking": "true", "include_reasoning": "true", "max_tokens": 40})
    # The random model rarely closes its block by itself: a bias on `</think>` makes it close after two
    # reasoning tokens (a larger bias closes it at once).
    [request] = kind.requests(docs(NOTES[:1])[0], _model(engine))
    assert request.prompt.endswith("<think>\n")  # the template opened the block
    params = request.sampling
    params.logit_bias = {think_end: 10.0}
    params.__post_init__()
    out = engine.submit(request.prompt, params, add_special_tokens=False).result()
    result = kind.result(docs(NOTES[:1])[0], [out])
    assert out.reasoning_finished and out.reasoning and out.reasoning_tokens == 3  # 2 tokens and `</think>`
    assert result.status == "done" and result.output == out.text.strip()
    assert result.reasoning == out.reasoning and out.reasoning not in result.output


def test_budget_spent_inside_reasoning_is_reported(engine):
    for kind in (
        make_kind("summarize", {"enable_thinking": True, "include_reasoning": True, "max_tokens": 8}),
        make_kind("extract", {"schema": EXTRACT_SCHEMA, "enable_thinking": True, "max_tokens": 8}),
        make_kind("code-review", {"max_tokens": 8}),  # thinking is on by default here
    ):
        [result] = run_shard(kind, docs(NOTES[:1], ".py"), engine)
        assert result.status == "failed"
        assert result.error.startswith("the output budget ran out during reasoning (8 tokens)")
        assert (result.reasoning is not None) == bool(kind.params["include_reasoning"])


def _model(engine):
    from jobs.base import EngineModel

    return EngineModel(engine)


# Acceptance 2: constrained decoding on the random model; every output parses and validates.


def test_extract_outputs_all_validate(engine):
    results = run_shard(make_kind("extract", {"schema": json.dumps(EXTRACT_SCHEMA)}), docs(NOTES), engine)
    assert len(results) == len(NOTES)
    for result in results:
        assert result.status == "done", result.error
        jsonschema.validate(result.output, EXTRACT_SCHEMA)


def test_findings_all_validate(engine):
    kind = make_kind("code-review", {"enable_thinking": False, "max_tokens": 1500})
    files = [Document(f"src/m{i}.py", (SOURCE * (i + 1)).encode()) for i in range(4)]
    engine_requests = [r for f in files for r in kind.requests(f, _model(engine))]
    outs = engine.generate([r.prompt for r in engine_requests], [r.sampling for r in engine_requests])
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), FINDINGS_SCHEMA)
    for result in run_shard(kind, files, engine):
        assert result.status == "done" and all(f["severity"] != "note" for f in result.output["findings"])


# Acceptance 4 (and 2's OpenAI json_schema line): every listed parameter honoured, or refused per line.

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
PLAIN = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
BASE = PLAIN | {"reasoning_effort": "none"}  # thinking off; the template's default is on
LINES = {
    "logprobs": BASE | {"logprobs": True, "top_logprobs": 3, "max_completion_tokens": 6},
    "penalties": BASE | {"presence_penalty": 1.0, "frequency_penalty": 0.5, "max_tokens": 6},
    "bias": BASE | {"logit_bias": {"77": 100}, "max_tokens": 3},
    "n": BASE | {"n": 3, "temperature": 1.0, "seed": 5, "max_tokens": 5},
    "tools": BASE | {"tools": TOOLS, "tool_choice": "auto", "max_tokens": 5},
    "schema": BASE
    | {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": EXTRACT_SCHEMA, "strict": True},
        },
        "max_tokens": 300,
    },
    "effort_none": BASE | {"reasoning_effort": "none", "max_tokens": 6},
    "effort_high": BASE | {"reasoning_effort": "high", "max_tokens": 6},
    "template_kwargs": PLAIN | {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 6},
    "stream": BASE | {"stream": True},
    "echo": {"prompt": "Once", "echo": True},
    "suffix": {"prompt": "Once", "suffix": "end"},
    "best_of": {"prompt": "Once", "best_of": 2},
    "completion_logprobs": {"prompt": "Once upon", "logprobs": 2, "max_tokens": 4, "temperature": 0},
}


@pytest.fixture(scope="module")
def batch(engine):
    urls = {k: "/v1/completions" if "prompt" in body else "/v1/chat/completions" for k, body in LINES.items()}
    raw = b"\n".join(
        json.dumps({"custom_id": k, "method": "POST", "url": urls[k], "body": body}).encode()
        for k, body in LINES.items()
    )
    lines = parse_batch_file(raw)
    results = run_shard(make_kind("chat", {}), [Document(x.custom_id, x.raw) for x in lines], engine)
    return {
        line.custom_id: output_line(line.custom_id, vars(r)) for line, r in zip(lines, results, strict=True)
    }


def body(batch, key):
    line = batch[key]
    assert line["error"] is None and line["response"]["status_code"] == 200, line
    return line["response"]["body"]


def test_refused_parameters_are_openai_400s_naming_them(batch):
    for key, param in (("stream", "stream"), ("echo", "echo"), ("suffix", "suffix"), ("best_of", "best_of")):
        response = batch[key]["response"]
        assert response["status_code"] == 400 and batch[key]["error"] is None
        error = response["body"]["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert error["code"] in ("unsupported_parameter", "unsupported_value")


def test_responses_are_openai_types_naming_the_served_model(batch, engine):
    for key, value in LINES.items():
        if key in ("stream", "echo", "suffix", "best_of"):
            continue
        response = body(batch, key)
        parsed = (Completion if "prompt" in value else ChatCompletion).model_validate(response)
        assert parsed.model == engine.model_name != "gpt-4o-mini"


def test_logprobs_match_the_engines_own(batch, engine):
    choice = ChatCompletion.model_validate(body(batch, "logprobs")).choices[0]
    prompt = engine.apply_chat_template(BASE["messages"], enable_thinking=False)  # reasoning_effort none
    own = engine.submit(
        prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=3, split_reasoning=True),
        add_special_tokens=False,
    ).result()  # fmt: skip
    answer = own.token_ids[own.reasoning_tokens :]
    assert len(choice.logprobs.content) == len(answer) - (own.finish_reason == "stop")
    entries = own.logprobs[own.reasoning_tokens :]
    # 1e-4: the batch ran the line beside others, whose fp32 reductions round in another order.
    for item, token, entry in zip(choice.logprobs.content, answer, entries, strict=False):
        assert item.token == own.token_texts[token] and item.logprob == pytest.approx(entry[token], abs=1e-4)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:3]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)
        assert [t.token for t in item.top_logprobs] == [own.token_texts[t] for t, _ in top]
    completion = Completion.model_validate(body(batch, "completion_logprobs")).choices[0]
    assert len(completion.logprobs.tokens) == len(completion.logprobs.top_logprobs) == 4
    assert all(len(top) == 2 for top in completion.logprobs.top_logprobs)


def test_penalties_bias_and_n_are_applied(batch, engine):
    assert body(batch, "penalties")["usage"]["completion_tokens"] <= 6
    biased = ChatCompletion.model_validate(body(batch, "bias")).choices[0]
    assert biased.message.content == engine.tokenizer.decode([77] * 3)  # the bias chose every token
    n = ChatCompletion.model_validate(body(batch, "n"))
    assert [c.index for c in n.choices] == [0, 1, 2]
    assert len({c.message.content for c in n.choices}) > 1  # seeded draws per choice, not copies


def test_json_schema_line_validates_and_thinking_follows_effort(batch):
    content = ChatCompletion.model_validate(body(batch, "schema")).choices[0].message.content
    jsonschema.validate(json.loads(content), EXTRACT_SCHEMA)
    for key in ("effort_none", "template_kwargs"):  # thinking off: no reasoning block
        message = body(batch, key)["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"]
    high = body(batch, "effort_high")  # on: the budget is spent in reasoning, reported as such
    assert (
        high["choices"][0]["finish_reason"] == "length" and high["choices"][0]["message"]["content"] is None
    )
    assert high["choices"][0]["message"]["reasoning_content"]
    assert high["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


def test_tool_calls_are_parsed_from_qwens_format():
    from jobs.chat import _chat_choice
    from jobs.openai_request import ChatRequest
    from tests.jobs.factories import make_output

    text = (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    chat = ChatRequest.model_validate(LINES["tools"])
    choice = _chat_choice(0, make_output(text), chat, TOOLS)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ChatCompletion.model_validate(
        {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    )
