import json

import pytest

from jobs import make_kind
from jobs.base import Document, DocumentError
from jobs.openai_batch import output_line
from tests.jobs.factories import FakeModel, make_output

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


def request(body: dict, url: str = "/v1/chat/completions", custom_id: str = "req-1") -> Document:
    line = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return Document(custom_id, json.dumps(line).encode())


CHAT = {
    "model": "qwen",
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ],
}


def test_chat_request_goes_through_the_template(model):
    body = CHAT | {"max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "END"}
    [req] = make_kind("chat", {}).requests(request(body), model)
    assert model.rendered[0] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert req.prompt == "<system>\nBe brief.\n<user>\nHi there\n<assistant>\n"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop_strings) == (20, 0.5, 0.9, 3, ("END",))


def test_openai_defaults(model):
    [req] = make_kind("chat", {}).requests(request(CHAT), model)
    assert (req.sampling.max_tokens, req.sampling.temperature) == (256, 1.0)
    [req] = make_kind("chat", {"max_tokens": "1000"}).requests(request(CHAT), FakeModel(max_model_len=100))
    assert req.sampling.max_tokens == 100 - FakeModel().count_tokens(req.prompt)  # lowered to what is left


@pytest.mark.parametrize("prompt", ["Once upon", ["Once upon"], [5, 6, 7], [[5, 6, 7]]])
def test_completions_prompt(model, prompt):
    [req] = make_kind("chat", {}).requests(
        request({"prompt": prompt, "max_tokens": 8}, "/v1/completions"), model
    )
    assert req.prompt == ("Once upon" if "Once upon" in json.dumps(prompt) else [5, 6, 7])
    assert req.sampling.max_tokens == 8


@pytest.mark.parametrize(
    ("body", "url", "param", "code", "reason"),
    [
        (
            CHAT | {"n": 0},
            CHAT_URL,
            "n",
            "invalid_value",
            "^body.n: Input should be greater than or equal to 1$",
        ),
        (
            {"messages": []},
            CHAT_URL,
            "messages",
            "invalid_value",
            "^body.messages: List should have at least",
        ),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            CHAT_URL,
            "messages[0].role",
            "unsupported_value",
            r"^body.messages\[0\].role must be 'system', 'developer', 'user', 'assistant' or 'tool'$",
        ),
        (
            {"messages": [{"role": ["user"], "content": "x"}]},
            CHAT_URL,
            "messages[0].role",
            "unsupported_value",
            r"^body.messages\[0\].role must be",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            CHAT_URL,
            "messages[0].content[0].type",
            "unsupported_value",
            r"^body.messages\[0\].content\[0\].type must be 'text'",
        ),
        (
            CHAT | {"temperature": 3},
            CHAT_URL,
            "temperature",
            "invalid_value",
            "^body.temperature: Input should be",
        ),
        (
            CHAT | {"max_tokens": "many"},
            CHAT_URL,
            "max_tokens",
            "invalid_value",
            "^body.max_tokens: Input should be a valid",
        ),
        (
            CHAT | {"stop": ["a", ""]},
            CHAT_URL,
            "stop[1]",
            "invalid_value",
            r"^body.stop\[1\]: String should have",
        ),
        (
            CHAT | {"max_tokens": 4095},
            CHAT_URL,
            "max_tokens",
            "context_length_exceeded",
            r"^prompt has \d+ tokens; with body.max_tokens it needs more than the model's context of 4096$",
        ),
        (CHAT | {"seed": 2**70}, CHAT_URL, "seed", "invalid_value", "^body.seed: Input should be less than"),
        (
            CHAT | {"seed": 1.0},
            CHAT_URL,
            "seed",
            "invalid_value",
            "^body.seed: Input should be a valid integer",
        ),
        (CHAT | {"stream": True}, CHAT_URL, "stream", "unsupported_value", "^body.stream must be False$"),
        (
            CHAT | {"tool_choice": "required"},
            CHAT_URL,
            "tool_choice",
            "unsupported_value",
            "^body.tool_choice must be",
        ),
        (
            CHAT | {"audio": {}},
            CHAT_URL,
            "audio",
            "unsupported_parameter",
            "^body.audio is not supported by Enclave",
        ),
        (
            CHAT | {"parallel_tool_calls": False},
            CHAT_URL,
            "parallel_tool_calls",
            "unsupported_parameter",
            "not supported",
        ),
        ({"prompt": ["a", "b"]}, COMPLETIONS_URL, "prompt", "invalid_value", "must be one prompt"),
        ({"prompt": [1, -2]}, COMPLETIONS_URL, "prompt[1]", "invalid_value", "^body.prompt"),
        (
            {"prompt": "x", "echo": True},
            COMPLETIONS_URL,
            "echo",
            "unsupported_parameter",
            "^body.echo is not supported",
        ),
        (
            {"prompt": "x", "suffix": "y"},
            COMPLETIONS_URL,
            "suffix",
            "unsupported_parameter",
            "^body.suffix is not",
        ),
        (
            {"prompt": "x", "best_of": 2},
            COMPLETIONS_URL,
            "best_of",
            "unsupported_parameter",
            "^body.best_of is not",
        ),
    ],
)
def test_bad_requests_fail_alone_as_openai_400s(model, body, url, param, code, reason):
    kind = make_kind("chat", {})
    with pytest.raises(DocumentError, match=reason) as caught:
        kind.requests(request(body, url), model)
    result = kind.failure(caught.value)
    expected = {"code": code, "status_code": 400, "type": "invalid_request_error", "param": param}
    assert (result.status, result.output) == ("failed", expected)
    assert result.error == caught.value.reason == str(caught.value)
    record = {
        "status": result.status,
        "output": result.output,
        "error": result.error,
        "detail": result.detail,
    }
    line = output_line("req-1", record)
    assert line["error"] is None and line["response"]["status_code"] == 400
    error = line["response"]["body"]["error"]
    assert error == {
        "message": result.detail or result.error,
        "type": "invalid_request_error",
        "param": param,
        "code": code,
    }


def test_an_unsupported_url_fails_in_the_lines_error(model):
    kind = make_kind("chat", {})
    with pytest.raises(DocumentError, match=r"^unsupported url, a 14-character string") as caught:
        kind.requests(request(CHAT, "/v1/embeddings"), model)
    assert caught.value.detail == "unsupported url '/v1/embeddings'"
    result = kind.failure(caught.value)
    line = output_line("req-1", {"status": "failed", "output": result.output, "error": result.error})
    assert line["response"] is None and line["error"]["code"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (
            b"not json",
            r"^the request is not a valid batch line: is not valid JSON \(Expecting value at offset 0\)$",
        ),
        (b"\xff", r"^the request is not a valid batch line: is not valid UTF-8"),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}",
            r"^the request is not a valid batch line: body is nested more than 63 levels deep$",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"seed": 1e400}}',
            r"^the request is not a valid batch line: holds a number JSON cannot carry",
        ),
    ],
)
def test_unreadable_lines_fail_alone_with_a_content_free_reason(model, line, reason):
    with pytest.raises(DocumentError, match=reason) as caught:
        make_kind("chat", {}).requests(Document("a", line), model)
    assert caught.value.code == "invalid_request_error"


def test_long_unsupported_urls_give_a_short_reason_and_a_full_detail(model):
    url = "/v1/embeddings/" + "CANARY" * 100
    with pytest.raises(DocumentError) as caught:
        make_kind("chat", {}).requests(request(CHAT, url), model)
    assert "CANARY" not in caught.value.reason and len(caught.value.reason) <= 200
    assert url in caught.value.detail


def test_chat_result_is_a_chat_completion():
    result = make_kind("chat", {}).result(request(CHAT), [make_output("Hello!", "length", 12, 3)])
    body = result.output
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and body["model"] == "enclave"  # the served model, not the line's
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!"},
            "finish_reason": "length",
            "logprobs": None,
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "total_tokens": 15,
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_completion_result_is_a_text_completion():
    doc = request({"prompt": "Once"}, "/v1/completions")
    body = make_kind("chat", {}).result(doc, [make_output(" upon", "stop")]).output
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "enclave"
    assert body["choices"] == [{"index": 0, "text": " upon", "finish_reason": "stop", "logprobs": None}]


def test_a_conversation_the_template_refuses_is_invalid():
    class StrictModel(FakeModel):
        def render_chat(self, messages, **template_kwargs):
            raise ValueError("conversations must alternate user/assistant")

    with pytest.raises(DocumentError, match="could not be rendered with the model's chat template") as caught:
        make_kind("chat", {}).requests(request(CHAT), StrictModel())
    assert caught.value.code == "invalid_request_error"


def test_only_raw_completion_text_gets_the_tokenizers_special_tokens(model):
    chat = make_kind("chat", {})
    (rendered,) = chat.requests(request({"messages": [{"role": "user", "content": "hi"}]}), model)
    (raw,) = chat.requests(request({"prompt": "Once"}, url="/v1/completions"), model)
    (ids,) = chat.requests(request({"prompt": [1, 2, 3]}, url="/v1/completions"), model)
    assert not rendered.add_special_tokens  # the chat template already wrote them
    assert raw.add_special_tokens and not ids.add_special_tokens
    for kind, params in (("summarize", {}), ("extract", {"fields": "a"}), ("code-review", {})):
        (req, *_) = make_kind(kind, params).requests(Document("a.py", b"x = 1\n"), model)
        assert not req.add_special_tokens
