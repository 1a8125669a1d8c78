"""What every job kind shares: documents, engine requests, results, and the `JobKind` contract.

A worker drives a kind per shard: `requests(doc, model)` for each document (a `DocumentError` fails that
document alone, recorded with `failure(error)`), every request of the shard submitted to the engine
(`engine.submit`), then `result(doc, outputs)` with each document's outputs in request order.

Reasons are content-free by construction: a `DocumentResult.error` (stored in clear, in the audit log too)
is built from codes, JSON paths, offsets, sizes and counts only; the full message, which may quote the
document, is `detail` and goes only into the result sealed to the submitter.

The engine is imported lazily (it loads torch): the CLI validates parameters and batch files with `jobs`
without paying for it.
"""

from __future__ import annotations

import copy
import difflib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from jobs.bounded_json import has_lone_surrogate, json_type
from jobs.params import JobParamError

if TYPE_CHECKING:
    from engine import Engine, RequestOutput, SamplingParams
    from engine.constraints import Constraint

__all__ = [
    "INVALID_REQUEST",
    "MAX_REASON",
    "PROCESSING_ERROR",
    "Document",
    "DocumentError",
    "DocumentResult",
    "EngineModel",
    "EngineRequest",
    "JobKind",
    "JobParamError",
    "ModelInfo",
    "decode_text",
    "ensure_fits",
    "one_line",
    "one_output",
    "usage_of",
]

# Machine codes, as in OpenAI's error objects: bad request content, or anything else about a document.
INVALID_REQUEST = "invalid_request_error"
PROCESSING_ERROR = "processing_error"
MAX_REASON = 200  # characters of a stored reason: it fits the audit log's string limit


@dataclass(frozen=True)
class Document:
    """An opened document: `path` relative to what was submitted (or an OpenAI batch line's custom_id)."""

    path: str
    data: bytes


@dataclass(frozen=True)
class EngineRequest:
    """One prompt for the engine: text or token ids.

    Text rendered through the chat template already holds its special tokens, so it is encoded without
    adding any (`add_special_tokens` False); a raw completion prompt is encoded as the tokenizer would by
    default (True), as vLLM does.
    """

    prompt: str | list[int]
    sampling: SamplingParams
    add_special_tokens: bool = False
    # The start of `prompt` every document of the job shares (the rendered instructions): the engine
    # computes it once and starts each document's request from a copy of its state.
    prefix: str | None = None


@dataclass
class DocumentResult:
    """A document's outcome. `output` is JSON-serialisable; `error` is the content-free reason (stored in
    clear); `detail` the full message and `raw` the model text that could not be parsed, both sealed only."""

    status: str  # "done" | "failed"
    output: Any
    error: str | None = None
    raw: str | None = None
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, total_tokens
    detail: str | None = None
    reasoning: str | None = None  # the model's reasoning, kept when the job asked for it (sealed only)


class ModelInfo(Protocol):
    """What kinds may ask of the model."""

    max_model_len: int
    name: str  # the served model's name

    def count_tokens(self, text: str) -> int: ...

    def render_chat(self, messages: list[dict], **template_kwargs: Any) -> str: ...


class EngineModel:
    """`ModelInfo` over a loaded `Engine` (which must have a tokenizer)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_model_len = engine.config.max_model_len
        self.name = engine.model_name

    def count_tokens(self, text: str) -> int:
        return len(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: list[dict], **template_kwargs: Any) -> str:
        return self.engine.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)


class DocumentError(Exception):
    """A document cannot be processed.

    `reason` (also `str(error)`) is content-free: codes, JSON paths, offsets, sizes, counts and JSON type
    names only, never a substring of the input; it is made one line of at most `MAX_REASON` characters.
    `code` is the machine code (`INVALID_REQUEST` for bad request content, else `PROCESSING_ERROR`), used by
    the OpenAI batch output. `detail` is the full message, which may quote content: it is sealed only.
    """

    def __init__(self, reason: str, code: str = PROCESSING_ERROR, *, detail: str | None = None) -> None:
        self.reason = one_line(reason, MAX_REASON)
        super().__init__(self.reason)
        self.code = code
        self.detail = detail


class JobKind(ABC):
    """A kind of job: validates its parameters, turns documents into requests and outputs into results."""

    name: ClassVar[str]
    param_names: ClassVar[tuple[str, ...]]

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        if params is not None and not isinstance(params, Mapping):
            raise JobParamError(f"parameters must be an object, not {json_type(params)}")
        given = {key: value for key, value in (params or {}).items() if value is not None}
        known = ", ".join(sorted(self.param_names))
        for key in given:
            if not isinstance(key, str) or key not in self.param_names:
                guess = difflib.get_close_matches(key, self.param_names, 1) if isinstance(key, str) else []
                hint = f"did you mean '{guess[0]}'? " if guess else ""
                raise JobParamError(f"unknown parameter for kind '{self.name}' ({hint}known: {known})")
        for key, value in given.items():
            if has_lone_surrogate(value):  # the parameters could not be sealed as UTF-8
                raise JobParamError(f"parameter {key} is not valid Unicode text (it holds a lone surrogate)")
        self._params = self.parse_params(given)

    @abstractmethod
    def parse_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Validate `params` (strings from the CLI or manifest values) into normalised, JSON-ready values."""

    @property
    def params(self) -> dict[str, Any]:
        """The normalised parameters (they go into the signed manifest; `make_kind` accepts them back)."""
        return copy.deepcopy(self._params)

    @abstractmethod
    def requests(self, doc: Document, model: ModelInfo) -> list[EngineRequest]:
        """The engine requests for one document; raises `DocumentError` when it cannot be processed."""

    @abstractmethod
    def result(self, doc: Document, outputs: list[RequestOutput]) -> DocumentResult:
        """The document's result from the outputs of its requests, in request order."""

    def failure(self, error: DocumentError) -> DocumentResult:
        """The result recorded for a document whose `requests` raised `error`: its reason in clear, its
        detail sealed."""
        return DocumentResult(status="failed", output=None, error=error.reason, detail=error.detail)

    def instructed_request(
        self, model: ModelInfo, instructions: str, text: str, constraint: Constraint | None = None
    ) -> EngineRequest:
        """The one-prompt request of most kinds: `instructions` (plus the job's optional `instructions`
        parameter) as the system message, the document text as the user message, checked to fit; the answer
        held to `constraint` when given."""
        if extra := self._params.get("instructions"):
            instructions += "\n\n" + extra
        messages = [{"role": "system", "content": instructions}, {"role": "user", "content": text}]
        prompt = self.render(model, messages)
        ensure_fits(model, prompt, text, self._params["max_tokens"])
        at = prompt.rfind(text) if text else -1
        return EngineRequest(prompt, self.sampling(constraint), prefix=prompt[:at] if at > 0 else None)

    def render(self, model: ModelInfo, messages: list[dict]) -> str:
        """The conversation through the model's chat template, with the job's `enable_thinking`."""
        if "enable_thinking" in self._params:
            return model.render_chat(messages, enable_thinking=self._params["enable_thinking"])
        return model.render_chat(messages)

    def sampling(self, constraint: Constraint | None = None) -> SamplingParams:
        """SamplingParams from the normalised parameters (max_tokens, temperature, top_p, seed); the
        reasoning block split from the answer, which `constraint` (if any) holds to its grammar."""
        from engine.sampling import SamplingParams  # lazy: torch is for workers, not the CLI

        keys = ("max_tokens", "temperature", "top_p", "seed")
        values = {key: self._params[key] for key in keys if key in self._params}
        return SamplingParams(**values, split_reasoning=True, constraint=constraint)

    def reasoning_of(self, outputs: list[RequestOutput]) -> str | None:
        """The outputs' reasoning when the job asked to keep it (`include_reasoning`), else None."""
        from jobs.thinking import joined_reasoning

        return joined_reasoning(outputs) if self._params.get("include_reasoning") else None


def one_line(text: str, limit: int) -> str:
    """`text` on one line (whitespace runs become one space), cut to at most `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decode_text(doc: Document) -> str:
    """The document as text, a leading byte-order mark dropped; `DocumentError` when it is not UTF-8 or
    holds nothing but whitespace."""
    try:
        text = doc.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"document is not valid UTF-8 (first bad byte at offset {exc.start})") from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise DocumentError("document is empty")
    return text


def ensure_fits(model: ModelInfo, prompt: str, document: str, max_tokens: int) -> int:
    """The prompt's token count; `DocumentError` when it plus `max_tokens` exceeds the model's context."""
    needed = model.count_tokens(prompt) + max_tokens
    if needed > model.max_model_len:
        raise DocumentError(
            f"document has {model.count_tokens(document)} tokens; with the instructions and {max_tokens} "
            f"output tokens it needs {needed}, the model's context is {model.max_model_len}"
        )
    return needed - max_tokens


def one_output(outputs: list[RequestOutput]) -> RequestOutput:
    """The single output of a one-request document."""
    if len(outputs) != 1:
        raise ValueError(f"expected one output for the document, got {len(outputs)}")
    return outputs[0]


def usage_of(outputs: list[RequestOutput]) -> dict[str, int]:
    """OpenAI-style token usage summed over a document's outputs."""
    prompt = sum(out.prompt_token_count for out in outputs)
    completion = sum(len(out.token_ids) for out in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
