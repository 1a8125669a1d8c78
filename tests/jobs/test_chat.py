import json

import pytest

from jobs import make_kind
from jobs.base import Document, DocumentError
from jobs.openai_batch import output_line
from tests.jobs.factories import FakeModel, make_output


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
    ("body", "url", "reason", "detail"),
    [
        (
            CHAT,
            "/v1/embeddings",
            r"^unsupported url, a 14-character string \(supported: /v1/chat/completions, /v1/completions\)$",
            "unsupported url '/v1/embeddings'",
        ),
        (CHAT | {"n": 2}, "/v1/chat/completions", "body.n must be 1", None),
        (
            {"messages": []},
            "/v1/chat/completions",
            "^body.messages must be a non-empty list, not array$",
            None,
        ),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "/v1/chat/completions",
            r"body.messages\[0\] must be",
            None,
        ),
        (
            {"messages": [{"role": ["user"], "content": "x"}]},
            "/v1/chat/completions",
            r"body.messages\[0\] must be",
            None,
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "/v1/chat/completions",
            r"^body.messages\[0\].content\[0\] is not a text part \(its type is a 9-character string\)",
            "body.messages[0].content[0] has type 'image_url'",
        ),
        (
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "/v1/chat/completions",
            r"^the request is not a valid batch line: body holds a lone surrogate",
            None,
        ),
        (
            CHAT | {"temperature": 3},
            "/v1/chat/completions",
            "body.temperature must be a number from 0 to 2",
            None,
        ),
        (
            CHAT | {"max_tokens": "many"},
            "/v1/chat/completions",
            "^body.max_tokens must be a positive integer, not a 4-character string$",
            None,
        ),
        (CHAT | {"stop": ["a", ""]}, "/v1/chat/completions", "body.stop must be", None),
        (
            CHAT | {"max_tokens": 4095},
            "/v1/chat/completions",
            r"^prompt has \d+ tokens; with body.max_tokens it needs more than the model's context of 4096$",
            "max_tokens=4095 with a prompt of",
        ),
        (
            CHAT | {"seed": 2**70},
            "/v1/chat/completions",
            "^body.seed must be an integer that fits in 64 bits$",
            None,
        ),
        (CHAT | {"seed": 1.0}, "/v1/chat/completions", "^body.seed must be an integer", None),
        ({"prompt": ["a", "b"]}, "/v1/completions", "body.prompt must be one non-empty string", None),
        ({"prompt": [1, -2]}, "/v1/completions", "body.prompt must be one non-empty string", None),
    ],
)
def test_bad_requests_fail_alone_as_invalid_request(model, body, url, reason, detail):
    kind = make_kind("chat", {})
    with pytest.raises(DocumentError, match=reason) as caught:
        kind.requests(request(body, url), model)
    result = kind.failure(caught.value)
    assert (result.status, result.output) == ("failed", {"code": "invalid_request_error"})
    assert result.error == caught.value.reason == str(caught.value)
    assert result.detail == caught.value.detail
    if detail is not None:
        assert detail in result.detail
    record = {
        "status": result.status,
        "output": result.output,
        "error": result.error,
        "detail": result.detail,
    }
    line = output_line("req-1", record)
    assert line["error"] == {"code": "invalid_request_error", "message": result.detail or result.error}
    assert line["response"] is None


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
    assert isinstance(body["created"], int) and body["model"] == "qwen"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!"},
            "finish_reason": "length",
            "logprobs": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}


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
