"""Kind "chat": OpenAI Batch API requests, one batch line per document (path = custom_id, data = the line).

Supported urls: /v1/chat/completions (messages through the chat template) and /v1/completions (one prompt,
text or token ids). Body fields read: max_completion_tokens or max_tokens (default: the kind's max_tokens
parameter, 256, lowered to what the context leaves), temperature (default 1, as OpenAI), top_p, seed, stop,
n (must be 1), model (echoed; default "enclave"). Others are ignored.

A failed document's result carries its machine code in `output`: `{"code": "invalid_request_error"}` for
bad request content or an unsupported url, `{"code": "processing_error"}` otherwise; `output_line` reads
it. Reasons name JSON paths (`body.messages[0].content`) and types, never what the line says; the full
message goes into the sealed `detail`.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from jobs.base import (
    INVALID_REQUEST,
    Document,
    DocumentError,
    DocumentResult,
    EngineRequest,
    JobKind,
    ModelInfo,
    one_output,
    usage_of,
)
from jobs.bounded_json import has_lone_surrogate, json_type
from jobs.openai_batch import BadLine, parse_line
from jobs.params import MAX_TOKENS_LIMIT, SEED_RANGE, take_int

if TYPE_CHECKING:
    from engine import RequestOutput, SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
DEFAULT_MAX_TOKENS = 256
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Chat(JobKind):
    """Params: max_tokens (default 256): the output limit of requests whose body sets none."""

    name = "chat"
    param_names = ("max_tokens",)

    def parse_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return {
            "max_tokens": take_int(
                params, "max_tokens", DEFAULT_MAX_TOKENS, minimum=1, maximum=MAX_TOKENS_LIMIT
            )
        }

    def requests(self, doc: Document, model: ModelInfo) -> list[EngineRequest]:
        url, body = _request(doc)
        if not (body.get("n") is None or (type(body["n"]) is int and body["n"] == 1)):
            raise _invalid("body.n must be 1: Enclave returns one choice per request")
        if url == CHAT_URL:
            prompt: str | list[int] = _render(body.get("messages"), model)
            prompt_tokens = model.count_tokens(prompt)
        else:
            prompt = _completion_prompt(body.get("prompt"))
            prompt_tokens = model.count_tokens(prompt) if isinstance(prompt, str) else len(prompt)
        max_tokens = self._max_tokens(body, prompt_tokens, model.max_model_len)
        raw_completion = url == COMPLETIONS_URL and isinstance(prompt, str)
        return [EngineRequest(prompt, _sampling(body, max_tokens), add_special_tokens=raw_completion)]

    def result(self, doc: Document, outputs: list[RequestOutput]) -> DocumentResult:
        url, body = _request(doc)
        out, usage = one_output(outputs), usage_of(outputs)
        text = out.text or ""
        name = body.get("model") if isinstance(body.get("model"), str) else "enclave"
        if not name.isascii() and has_lone_surrogate(name):
            name = "enclave"
        choice: dict[str, Any] = {"index": 0}
        if url == CHAT_URL:
            response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
            choice["message"] = {"role": "assistant", "content": text}
        else:
            response = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
            choice["text"] = text
        choice |= {"finish_reason": out.finish_reason, "logprobs": None}
        response |= {"created": int(time.time()), "model": name, "choices": [choice], "usage": usage}
        return DocumentResult(status="done", output=response, usage=usage)

    def failure(self, error: DocumentError) -> DocumentResult:
        return DocumentResult(
            status="failed", output={"code": error.code}, error=error.reason, detail=error.detail
        )

    def _max_tokens(self, body: dict[str, Any], prompt_tokens: int, context: int) -> int:
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        asked = body.get(key)
        room = context - prompt_tokens
        if asked is None:
            if room < 1:
                raise _invalid(f"prompt has {prompt_tokens} tokens; the model's context is {context}")
            return min(self._params["max_tokens"], room)
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            raise _invalid(f"body.{key} must be a positive integer, not {_what(asked)}")
        if asked > room:
            raise _invalid(
                f"prompt has {prompt_tokens} tokens; with body.{key} it needs more than the model's "
                f"context of {context}",
                detail=f"{key}={asked} with a prompt of {prompt_tokens} tokens needs {prompt_tokens + asked}",
            )
        return asked


def _invalid(reason: str, detail: str | None = None) -> DocumentError:
    return DocumentError(reason, code=INVALID_REQUEST, detail=detail)


def _what(value: Any) -> str:
    """A content-free description of a JSON value: its type, and its length for a string."""
    if isinstance(value, str):
        return f"a {len(value)}-character string"
    return json_type(value)


def _request(doc: Document) -> tuple[str, dict[str, Any]]:
    """The url and body of a batch line (checked by `read_batch_file` on the client, and again here)."""
    line = parse_line(doc.data)
    if isinstance(line, BadLine):
        raise _invalid(f"the request is not a valid batch line: {line.problem}")
    if line.url not in (CHAT_URL, COMPLETIONS_URL):
        raise _invalid(
            f"unsupported url, a {len(line.url)}-character string (supported: {CHAT_URL}, {COMPLETIONS_URL})",
            detail=f"unsupported url {line.url!r}",
        )
    return line.url, line.body


def _render(messages: Any, model: ModelInfo) -> str:
    if not isinstance(messages, list) or not messages:
        raise _invalid(f"body.messages must be a non-empty list, not {_what(messages)}")
    conversation = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not (isinstance(role, str) and role in _ROLES):
            raise _invalid(f"body.messages[{i}] must be an object with a role ({', '.join(_ROLES)})")
        conversation.append({"role": _ROLES[role], "content": _content(message.get("content"), i)})
    try:
        return model.render_chat(conversation)
    except ValueError:  # the engine's RequestError: a template that refuses this conversation
        raise _invalid("body.messages could not be rendered with the model's chat template") from None


def _content(content: Any, index: int) -> str:
    path = f"body.messages[{index}].content"
    if content is None or isinstance(content, str):
        return _text(content or "", path)
    if not isinstance(content, list):
        raise _invalid(f"{path} must be a string or a list of text parts, not {_what(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise _invalid(
                f"{path}[{j}] is not a text part (its type is {_what(kind)}); only text is supported",
                detail=f"{path}[{j}] has type {kind!r}" if isinstance(kind, str) else None,
            )
        if not isinstance(part.get("text"), str):
            raise _invalid(f"{path}[{j}].text must be a string, not {_what(part.get('text'))}")
        texts.append(_text(part["text"], f"{path}[{j}].text"))
    return "".join(texts)


def _text(text: str, path: str) -> str:
    """`text`, refused when it holds a lone surrogate (a \ud800 escape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _invalid(f"{path} holds a lone surrogate at offset {exc.start}") from None
    return text


def _completion_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return _text(prompt, "body.prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**31 for t in prompt):
        return prompt
    raise _invalid("body.prompt must be one non-empty string or list of token ids")


def _sampling(body: dict[str, Any], max_tokens: int) -> SamplingParams:
    from engine.sampling import SamplingParams  # lazy: torch is for workers, not the CLI

    temperature, top_p, seed, stop = (body.get(k) for k in ("temperature", "top_p", "seed", "stop"))
    if not _number(temperature, 0.0, 2.0):
        raise _invalid("body.temperature must be a number from 0 to 2")
    if not _number(top_p, 0.0, 1.0) or top_p == 0:
        raise _invalid("body.top_p must be a number above 0 and at most 1")
    if seed is not None and (type(seed) is not int or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise _invalid("body.seed must be an integer that fits in 64 bits")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and not (
        isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)
    ):
        raise _invalid("body.stop must be a non-empty string or a list of up to 4 of them")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        seed=seed,
        stop=[_text(s, "body.stop") for s in stops] if stops else None,
    )


def _number(value: Any, low: float, high: float) -> bool:
    if value is None:
        return True
    return not isinstance(value, bool) and isinstance(value, int | float) and low <= value <= high
