"""Kind "code-review": findings per file of a repository; files too long for the context are split."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobs.base import (
    Document,
    DocumentError,
    DocumentResult,
    EngineRequest,
    JobKind,
    ModelInfo,
    decode_text,
    usage_of,
)
from jobs.findings import FINDINGS_SCHEMA, MAX_FINDINGS, parse_findings
from jobs.params import take_sampling, take_str
from jobs.repository import language_of
from jobs.review_report import build_report
from jobs.scan_rules import SCAN_PARAMS, take_scan
from jobs.thinking import THINKING_PARAMS, reasoning_cut_off, take_thinking

if TYPE_CHECKING:
    from engine import RequestOutput

__all__ = ["CodeReview", "build_report"]

INSTRUCTIONS = (
    "You are a careful senior code reviewer. Review the code for bugs, security problems and fragile or "
    "unclear code{focus}. Lines are numbered. Reply with a JSON list only, one object per finding: "
    '[{{"line": <line number>, "severity": "high" | "medium" | "low", "issue": "<one or two sentences>"}}], '
    f"at most {MAX_FINDINGS} findings, the most important first. Reply [] when there is nothing worth "
    "reporting."
)
_MARGIN = 8  # tokens kept spare when packing lines: counts of joined lines can exceed the sum of parts


class CodeReview(JobKind):
    """Params: max_tokens (default 2048: reasoning and answer), temperature, top_p, seed, focus (e.g.
    "security"), enable_thinking (default on, `jobs.thinking`), include_reasoning; and the scan's include,
    exclude, max_file_bytes, skip and commit (`jobs.scan_rules.take_scan`), which the client applies.

    Each file is a document; output `{"path", "language", "chunks", "model", "findings"}`, `model` being
    the served model's name (the report names it). The answer is held to `FINDINGS_SCHEMA` by constrained
    decoding. Review is advisory: text without parsable findings (cut at max_tokens) is kept as one "note"
    finding and the file is still done; a chunk whose budget ran out inside its reasoning fails the file
    with that reason.
    """

    name = "code-review"
    param_names = ("focus", "max_tokens", "seed", "temperature", "top_p", *THINKING_PARAMS, *SCAN_PARAMS)

    def parse_params(self, params: dict[str, Any]) -> dict[str, Any]:
        parsed = take_sampling(params, default_max_tokens=2048) | take_thinking(params, default=True)
        if (focus := take_str(params, "focus")) is not None:
            parsed["focus"] = focus
        return parsed | take_scan(params)

    def requests(self, doc: Document, model: ModelInfo) -> list[EngineRequest]:
        lines = decode_text(doc).split("\n")
        if lines[-1] == "":
            lines.pop()
        lines = [line.removesuffix("\r") for line in lines]
        from engine.constraints import Constraint

        sampling = self.sampling(Constraint.json_schema(FINDINGS_SCHEMA))
        return [EngineRequest(prompt, sampling) for prompt in self._chunk_prompts(doc.path, lines, model)]

    def result(self, doc: Document, outputs: list[RequestOutput]) -> DocumentResult:
        usage, reasoning = usage_of(outputs), self.reasoning_of(outputs)
        if cut := next((reason for out in outputs if (reason := reasoning_cut_off(out))), None):
            return DocumentResult("failed", None, error=cut, usage=usage, reasoning=reasoning)
        findings = [finding for out in outputs for finding in parse_findings(out.text or "")]
        findings.sort(key=lambda f: (f["line"] is None, f["line"] or 0))
        output = {"path": doc.path, "language": language_of(doc.path), "chunks": len(outputs)}
        output["model"] = next((out.model for out in outputs if out.model), None)
        output["findings"] = findings
        return DocumentResult(status="done", output=output, usage=usage, reasoning=reasoning)

    def _chunk_prompts(self, path: str, lines: list[str], model: ModelInfo) -> list[str]:
        """Prompts over runs of whole lines, each fitting the context with max_tokens of output."""
        limit = model.max_model_len - self._params["max_tokens"]
        whole = self._prompt(path, lines, 0, len(lines), model)
        if model.count_tokens(whole) <= limit:
            return [whole]
        budget = limit - model.count_tokens(self._prompt(path, lines, 0, 0, model)) - _MARGIN
        if budget < 1:
            raise DocumentError(
                f"the instructions and {self._params['max_tokens']} output tokens leave no room for code in "
                f"the model's context of {model.max_model_len} tokens; lower max_tokens"
            )
        width = len(str(len(lines)))
        costs = [model.count_tokens(_numbered(i, line, width)) + 1 for i, line in enumerate(lines)]
        prompts, start = [], 0
        while start < len(lines):
            end, used = start, 0
            while end < len(lines) and used + costs[end] <= budget:
                used += costs[end]
                end += 1
            prompt = self._prompt(path, lines, start, end, model) if end > start else ""
            while end > start and model.count_tokens(prompt) > limit:
                end = start + (end - start) * 9 // 10
                prompt = self._prompt(path, lines, start, end, model) if end > start else ""
            if end == start:
                raise DocumentError(
                    f"line {start + 1} is too long to review: with the instructions and "
                    f"{self._params['max_tokens']} output tokens it exceeds the model's context of "
                    f"{model.max_model_len} tokens"
                )
            prompts.append(prompt)
            start = end
        return prompts

    def _prompt(self, path: str, lines: list[str], start: int, end: int, model: ModelInfo) -> str:
        """The chat prompt for lines[start:end] (0-based, end exclusive) of the file at `path`."""
        focus = f", with particular attention to {self._params['focus']}" if "focus" in self._params else ""
        width = len(str(len(lines)))
        code = "\n".join(_numbered(i, lines[i], width) for i in range(start, end))
        language = language_of(path)
        user = f"File: {path} ({language}), lines {start + 1}-{end} of {len(lines)}\n```\n{code}\n```"
        return self.render(
            model,
            [
                {"role": "system", "content": INSTRUCTIONS.format(focus=focus)},
                {"role": "user", "content": user},
            ],
        )


def _numbered(index: int, line: str, width: int) -> str:
    return f"{index + 1:>{width}} | {line}"
