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
    ("body", "url", "message"),
    [
        (
            CHAT,
            "/v1/embeddings",
            r"^unsupported url '/v1/embeddings' \(supported: /v1/chat/completions, /v1/completions\)$",
        ),
        (CHAT | {"n": 2}, "/v1/chat/completions", "body.n must be 1"),
        ({"messages": []}, "/v1/chat/completions", "body.messages must be a non-empty list"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "/v1/chat/completions",
            r"body.messages\[0\] must be",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "/v1/chat/completions",
            "'image_url' content",
        ),
        (CHAT | {"temperature": 3}, "/v1/chat/completions", "body.temperature must be a number from 0 to 2"),
        (CHAT | {"max_tokens": "many"}, "/v1/chat/completions", "body.max_tokens must be a positive integer"),
        (CHAT | {"stop": ["a", ""]}, "/v1/chat/completions", "body.stop must be"),
        (
            CHAT | {"max_tokens": 4095},
            "/v1/chat/completions",
            r"with max_tokens=4095 it needs \d+, the model's context is 4096",
        ),
        ({"prompt": ["a", "b"]}, "/v1/completions", "body.prompt must be one non-empty string"),
    ],
)
def test_bad_requests_fail_alone_as_invalid_request(model, body, url, message):
    kind = make_kind("chat", {})
    with pytest.raises(DocumentError, match=message) as caught:
        kind.requests(request(body, url), model)
    result = kind.failure(caught.value)
    assert (result.status, result.output) == ("failed", {"code": "invalid_request"})
    line = output_line("req-1", {"status": result.status, "output": result.output, "error": result.error})
    assert line["error"]["code"] == "invalid_request" and line["response"] is None


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
    assert caught.value.code == "invalid_request"


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
