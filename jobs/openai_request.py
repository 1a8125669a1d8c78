"""OpenAI request bodies of a batch line, as pydantic models: every parameter Enclave honours is a field,
anything else is refused (`extra="forbid"`), so no parameter is ever silently ignored.

Honoured: messages (text parts), model (the response names the served model instead), max_tokens and
max_completion_tokens (reasoning included), temperature, top_p, n, stop, seed, logprobs and top_logprobs,
presence_penalty, frequency_penalty, logit_bias, tools (function tools, Qwen's tool-call format parsed back
into `tool_calls`), tool_choice "auto" or "none", response_format (text, json_object, json_schema),
reasoning_effort ("none" turns thinking off, any other effort on: Qwen has no levels) and
chat_template_kwargs (e.g. enable_thinking), stream false. Refused with a 400 naming the parameter:
anything else (stream true, echo, suffix, best_of, audio, modalities, parallel_tool_calls, ...).

`parse_request` turns a `ValidationError` into a `RequestRefused`: one content-free line naming the JSON
path, with OpenAI's `param` and an error code.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jobs.base import INVALID_REQUEST, DocumentError
from jobs.params import SEED_RANGE

UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VALUE = "unsupported_value"
INVALID_VALUE = "invalid_value"
MISSING_PARAMETER = "missing_required_parameter"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class RequestRefused(DocumentError):
    """An OpenAI 400 for one batch line: `param` is the offending parameter's path, `code` OpenAI's code."""

    def __init__(self, reason: str, param: str | None, code: str, detail: str | None = None) -> None:
        super().__init__(reason, code=code, detail=detail)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Sampling(_Strict):
    """The parameters both endpoints share."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: Literal[False] | None = None

    @field_validator("stop")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if value == "":
            raise ValueError("must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and not all(key.isdigit() and len(key) <= 10 for key in value):
            raise ValueError("keys must be token ids")
        return value

    def stops(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and RESERVED_TEMPLATE_KWARGS & set(value):
            raise ValueError("may not set messages, tools or add_generation_prompt")
        return value

    def budget(self) -> tuple[str, int | None]:
        """(name, value) of the output limit: max_completion_tokens, else the older max_tokens."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def thinking(self) -> bool | None:
        """enable_thinking from chat_template_kwargs, else from reasoning_effort, else None (the
        template's default)."""
        kwargs = self.chat_template_kwargs or {}
        if isinstance(kwargs.get("enable_thinking"), bool):
            return kwargs["enable_thinking"]
        if self.reasoning_effort is not None:
            return self.reasoning_effort != "none"
        return None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | TokenIds
        | list[Annotated[str, Field(min_length=1)]]
        | list[TokenIds]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError("must be one prompt: Enclave runs one prompt per batch line")
            return value[0]
        return value


def parse_request(model: type[_Strict], body: dict[str, Any]) -> Any:
    """The body as `model`; `RequestRefused` for the first problem, naming its path."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _refusal(exc) from None


def _refusal(exc: ValidationError) -> RequestRefused:
    """The first problem as a content-free reason (stored in clear), with a `detail` that quotes the value
    the line gave (sealed to the submitter only, as every failure's full reason is)."""
    refused = _reason(exc)
    errors = exc.errors(include_url=False)
    error = max(errors, key=lambda e: len([p for p in e["loc"] if not _branch(p)]))
    if "input" in error and error["type"] != "missing":
        given = json.dumps(error["input"], ensure_ascii=False, default=repr)
        refused.detail = f"{refused.reason}; the line gave {given[:MAX_DETAIL_QUOTE]}"
    return refused


MAX_DETAIL_QUOTE = 2000  # characters of the refused value quoted in the sealed detail


def _reason(exc: ValidationError) -> RequestRefused:
    errors = exc.errors(include_url=False, include_input=False)
    # Of a union's failed branches, the deepest error says most (`content[0].type`, not `content`).
    error = max(errors, key=lambda e: len([p for p in e["loc"] if not _branch(p)]))
    param = ""
    for part in error["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _branch(part):
            param += f".{part}" if param else part
    param = param or None
    path = "body." + param if param else "body"
    kind = error["type"]
    if kind == "extra_forbidden":
        reason = f"{path} is not supported by Enclave (the line is refused rather than the parameter ignored)"
        return RequestRefused(reason, param, UNSUPPORTED_PARAMETER)
    if kind == "missing":
        return RequestRefused(f"{path} is required", param, MISSING_PARAMETER)
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return RequestRefused(f"{path} must be {expected}"[:200], param, UNSUPPORTED_VALUE)
    message = error["msg"].removeprefix("Value error, ")
    return RequestRefused(f"{path}: {message}"[:200], param, INVALID_VALUE)


# pydantic names union branches in locations ("str", "list[...]", "function-after[...]"): not parameters.
_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "constrained-str"}


def _branch(part: str | int) -> bool:
    return isinstance(part, str) and ("[" in part or part in _BRANCHES)


def invalid(reason: str, param: str | None = None, code: str = INVALID_REQUEST, detail: str | None = None):
    """A refusal found after parsing (a prompt too long, a template that refuses the conversation)."""
    return RequestRefused(reason, param, code, detail)
