"""Kind "chat": OpenAI Batch API requests, one batch line per document (path = custom_id, data = the line).

Supported urls: /v1/chat/completions (messages through the chat template) and /v1/completions (one prompt,
text or token ids). The body is parsed by the pydantic models of `jobs.openai_request`: every parameter is
honoured or the line is refused with an OpenAI-shaped 400 naming it. `n` choices are `n` engine requests
(seeded `seed + i` when a seed is given). The response's `model` is the served model's name. Thinking
follows `chat_template_kwargs.enable_thinking`, else `reasoning_effort`, else the template; the reasoning is
returned as the message's `reasoning_content` and counted in `usage.completion_tokens_details`.

A failed document's result carries OpenAI's error in `output`: `{"code", "param", "type", "status_code"}`
(`output_line` writes a 400 response for it); reasons name JSON paths, never what the line says.
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
)
from jobs.openai_batch import BadLine, parse_line
from jobs.openai_request import (
    CONTEXT_LENGTH_EXCEEDED,
    ChatRequest,
    CompletionRequest,
    RequestRefused,
    invalid,
    parse_request,
)
from jobs.params import MAX_TOKENS_LIMIT, take_int
from jobs.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from engine import RequestOutput, SamplingParams
    from engine.constraints import Constraint

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
        if url == CHAT_URL:
            chat: ChatRequest = parse_request(ChatRequest, body)
            prompt: str | list[int] = _render(chat, model)
            prompt_tokens = model.count_tokens(prompt)
            budget = chat.budget()
            constraint = _constraint(chat)
            logprobs = (chat.top_logprobs or 0) if chat.logprobs else None
            raw = False
        else:
            request: CompletionRequest = parse_request(CompletionRequest, body)
            prompt = request.prompt
            prompt_tokens = model.count_tokens(prompt) if isinstance(prompt, str) else len(prompt)
            budget, constraint, logprobs = ("max_tokens", request.max_tokens), None, request.logprobs
            raw, chat = isinstance(prompt, str), request
        max_tokens = self._max_tokens(budget, prompt_tokens, model.max_model_len)
        return [
            EngineRequest(
                prompt, _sampling(chat, max_tokens, i, constraint, logprobs), add_special_tokens=raw
            )
            for i in range(chat.n or 1)
        ]

    def result(self, doc: Document, outputs: list[RequestOutput]) -> DocumentResult:
        url, body = _request(doc)
        model = next((out.model for out in outputs if out.model), None) or "enclave"
        if url == CHAT_URL:
            chat = ChatRequest.model_validate(body)
            tools = (
                [t.model_dump(by_alias=True) for t in chat.tools or []] if chat.tool_choice != "none" else []
            )
            choices = [_chat_choice(i, out, chat, tools) for i, out in enumerate(outputs)]
            response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
        else:
            top = CompletionRequest.model_validate(body).logprobs or 0
            choices = [_text_choice(i, out, top) for i, out in enumerate(outputs)]
            response = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
        usage = _usage(outputs)
        response |= {"created": int(time.time()), "model": model, "choices": choices, "usage": usage}
        flat = {key: usage[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return DocumentResult(status="done", output=response, usage=flat)

    def failure(self, error: DocumentError) -> DocumentResult:
        output = {"code": error.code}
        if isinstance(error, RequestRefused):
            output |= {"status_code": 400, "type": INVALID_REQUEST, "param": error.param}
        return DocumentResult(status="failed", output=output, error=error.reason, detail=error.detail)

    def _max_tokens(self, budget: tuple[str, int | None], prompt_tokens: int, context: int) -> int:
        key, asked = budget
        room = context - prompt_tokens
        if asked is None:
            if room < 1:
                reason = f"prompt has {prompt_tokens} tokens; the model's context is {context}"
                raise invalid(reason, "messages", CONTEXT_LENGTH_EXCEEDED)
            return min(self._params["max_tokens"], room)
        if asked > room:
            raise invalid(
                f"prompt has {prompt_tokens} tokens; with body.{key} it needs more than the model's "
                f"context of {context}",
                key,
                CONTEXT_LENGTH_EXCEEDED,
                detail=f"{key}={asked} with a prompt of {prompt_tokens} tokens needs {prompt_tokens + asked}",
            )
        return asked


def _request(doc: Document) -> tuple[str, dict[str, Any]]:
    """The url and body of a batch line (checked by `read_batch_file` on the client, and again here)."""
    line = parse_line(doc.data)
    if isinstance(line, BadLine):
        raise DocumentError(f"the request is not a valid batch line: {line.problem}", code=INVALID_REQUEST)
    if line.url not in (CHAT_URL, COMPLETIONS_URL):
        raise DocumentError(
            f"unsupported url, a {len(line.url)}-character string (supported: {CHAT_URL}, {COMPLETIONS_URL})",
            code=INVALID_REQUEST,
            detail=f"unsupported url {line.url!r}",
        )
    return line.url, line.body


def _render(chat: ChatRequest, model: ModelInfo) -> str:
    conversation = []
    for i, message in enumerate(chat.messages):
        text = message.text()
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(
                f"body.messages[{i}].content holds a lone surrogate at offset {exc.start}"
            ) from None
        entry: dict[str, Any] = {"role": _ROLES[message.role], "content": text}
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        conversation.append(entry)
    kwargs = dict(chat.chat_template_kwargs or {})
    if (thinking := chat.thinking()) is not None:
        kwargs["enable_thinking"] = thinking
    if chat.tools and chat.tool_choice != "none":
        kwargs["tools"] = [tool.model_dump(by_alias=True, exclude_none=True) for tool in chat.tools]
    try:
        return model.render_chat(conversation, **kwargs)
    except ValueError:  # the engine's RequestError: a template that refuses this conversation
        raise invalid(
            "body.messages could not be rendered with the model's chat template", "messages"
        ) from None


def _constraint(chat: ChatRequest) -> Constraint | None:
    """response_format as a constraint on the answer (strict or not, the schema is enforced)."""
    form = chat.response_format
    if form is None or form.type == "text":
        return None
    from engine.constraints import Constraint
    from engine.errors import RequestError

    if form.type == "json_object":
        return Constraint.json_object()
    if form.json_schema is None or form.json_schema.schema_ is None:
        raise invalid("body.response_format.json_schema.schema is required", "response_format.json_schema")
    try:
        return Constraint.json_schema(form.json_schema.schema_)
    except RequestError as exc:
        raise invalid(f"body.response_format.json_schema: {exc}", "response_format.json_schema") from None


def _sampling(
    request: ChatRequest | CompletionRequest,
    max_tokens: int,
    choice: int,
    constraint: Constraint | None,
    logprobs: int | None,
) -> SamplingParams:
    from engine.sampling import SamplingParams  # lazy: torch is for workers, not the CLI

    seed = request.seed
    if seed is not None and choice:  # n > 1: distinct, reproducible draws per choice
        seed = (seed + choice) % 2**63
    for text in request.stops() or []:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("body.stop holds a lone surrogate", "stop") from None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=seed,
        stop=request.stops(),
        logprobs=logprobs,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias={int(t): b for t, b in request.logit_bias.items()} if request.logit_bias else None,
        constraint=constraint,
        split_reasoning=isinstance(request, ChatRequest),
    )


def _answer_positions(out: RequestOutput) -> range:
    """Indices into `out.token_ids` of the answer: after the reasoning, without the stop token."""
    end = len(out.token_ids) - (1 if isinstance(out.stop_reason, int) else 0)
    return range(min(out.reasoning_tokens, end), end)


def _chat_choice(index: int, out: RequestOutput, chat: ChatRequest, tools: list[dict]) -> dict[str, Any]:
    content: str | None = out.text or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if out.reasoning is not None:
        message["reasoning_content"] = out.reasoning
    finish = out.finish_reason
    if tools and content:
        content, calls = parse_tool_calls(content, tools)
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls"
    if not out.reasoning_finished:
        message["content"] = None  # the budget ran out inside the reasoning: no answer (finish "length")
    logprobs = _chat_logprobs(out, chat.top_logprobs or 0) if chat.logprobs else None
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def _entry(out: RequestOutput, token: int, logprob: float) -> dict[str, Any]:
    text = (out.token_texts or {}).get(token, "")
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(out: RequestOutput, top: int) -> dict[str, Any]:
    content = []
    for i in _answer_positions(out):
        token, entry = out.token_ids[i], (out.logprobs or [])[i]
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
        content.append(
            _entry(out, token, entry[token]) | {"top_logprobs": [_entry(out, t, v) for t, v in ranked]}
        )
    return {"content": content, "refusal": None}


def _text_choice(index: int, out: RequestOutput, top: int) -> dict[str, Any]:
    logprobs = None
    if out.logprobs is not None:
        texts, tokens, chosen, tops, offsets, at = out.token_texts or {}, [], [], [], [], 0
        for i in _answer_positions(out):
            token, entry = out.token_ids[i], out.logprobs[i]
            tokens.append(texts.get(token, ""))
            chosen.append(entry[token])
            ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
            tops.append({texts.get(t, ""): v for t, v in ranked})
            offsets.append(at)
            at += len(tokens[-1])
        logprobs = {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}
    return {"index": index, "text": out.text or "", "finish_reason": out.finish_reason, "logprobs": logprobs}


def _usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage: the prompt counted once for n choices, reasoning tokens detailed."""
    prompt = outputs[0].prompt_token_count if outputs else 0
    completion = sum(len(out.token_ids) for out in outputs)
    reasoning = sum(out.reasoning_tokens for out in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }
