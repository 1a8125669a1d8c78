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

if TYPE_CHECKING:
    from engine import RequestOutput

INSTRUCTIONS = (
    "Summarise the document for a professional reader. Keep the facts, figures, names and dates that "
    "matter; do not add anything the document does not say. Write plain prose, without a preamble."
)


class Summarize(JobKind):
    """Params: max_tokens (default 256), temperature (default 0), top_p, seed, instructions (extra text
    appended to the fixed instructions). The output is the summary text; an empty one fails the document."""

    name = "summarize"
    param_names = ("instructions", "max_tokens", "seed", "temperature", "top_p")

    def parse_params(self, params: dict[str, Any]) -> dict[str, Any]:
        parsed = take_sampling(params, default_max_tokens=256)
        if (instructions := take_str(params, "instructions")) is not None:
            parsed["instructions"] = instructions
        return parsed

    def requests(self, doc: Document, model: ModelInfo) -> list[EngineRequest]:
        return [self.instructed_request(model, INSTRUCTIONS, decode_text(doc))]

    def result(self, doc: Document, outputs: list[RequestOutput]) -> DocumentResult:
        out = one_output(outputs)
        summary = (out.text or "").strip()
        usage = usage_of(outputs)
        if not summary:
            return DocumentResult(
                status="failed", output=None, error="model returned an empty summary", usage=usage
            )
        return DocumentResult(status="done", output=summary, usage=usage)
