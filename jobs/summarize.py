"""Kind "summarize": one summary string per document."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobs.base import (
    Document,
    DocumentResult,
    EngineRequest,
    JobKind,
    ModelInfo,
    decode_text,
    one_output,
    usage_of,
)
from jobs.params import take_sampling, take_str
from jobs.thinking import THINKING_PARAMS, reasoning_cut_off, take_thinking

if TYPE_CHECKING:
    from engine import RequestOutput

INSTRUCTIONS = (
    "Summarise the document for a professional reader. Keep the facts, figures, names and dates that "
    "matter; do not add anything the document does not say. Write plain prose, without a preamble."
)


class Summarize(JobKind):
    """Params: max_tokens (default 256), temperature (default 0), top_p, seed, instructions (extra text
    appended to the fixed instructions), enable_thinking (default off, `jobs.thinking`), include_reasoning.
    The output is the summary text; an empty one, or a run cut off inside its reasoning, fails the
    document."""

    name = "summarize"
    param_names = ("instructions", "max_tokens", "seed", "temperature", "top_p", *THINKING_PARAMS)

    def parse_params(self, params: dict[str, Any]) -> dict[str, Any]:
        parsed = take_sampling(params, default_max_tokens=256) | take_thinking(params, default=False)
        if (instructions := take_str(params, "instructions")) is not None:
            parsed["instructions"] = instructions
        return parsed

    def requests(self, doc: Document, model: ModelInfo) -> list[EngineRequest]:
        return [self.instructed_request(model, INSTRUCTIONS, decode_text(doc))]

    def result(self, doc: Document, outputs: list[RequestOutput]) -> DocumentResult:
        out = one_output(outputs)
        summary = (out.text or "").strip()
        usage, reasoning = usage_of(outputs), self.reasoning_of(outputs)
        error = reasoning_cut_off(out) or (None if summary else "model returned an empty summary")
        if error:
            return DocumentResult("failed", None, error=error, usage=usage, reasoning=reasoning)
        return DocumentResult(status="done", output=summary, usage=usage, reasoning=reasoning)
