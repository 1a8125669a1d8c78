"""Thinking, per the model's own chat template: the `enable_thinking` and `include_reasoning` job parameters,
and turning an output that may hold a reasoning block into an answer.

Qwen3.5's template opens a `<think>` block at the generation prompt unless `enable_thinking` is false; the
engine splits the block from the answer (`SamplingParams.split_reasoning`), so `RequestOutput.text` is the
answer and `reasoning` the block. `max_tokens` covers both, as OpenAI's `max_completion_tokens` does: a run
that spends it all inside the block has no answer, and is reported as such rather than parsed.

Per-kind defaults (a template without the switch, like the demo's plain ChatML, ignores it):

| kind | default | why |
|---|---|---|
| summarize | off | a summary restates the document; reasoning would spend the budget for little gain |
| extract | off | the schema holds the answer (constrained decoding); finding values is lookup |
| code-review | on | finding bugs is reasoning; its default max_tokens (2048, 384 before) leaves room for it |
| chat | the line's (`chat_template_kwargs`, `reasoning_effort`), else the template's (on for Qwen3.5) |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobs.params import JobParamError

if TYPE_CHECKING:
    from engine import RequestOutput

THINKING_PARAMS = ("enable_thinking", "include_reasoning")
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def take_bool(params: dict[str, Any], name: str, default: bool) -> bool:
    """Pop `name` as a boolean: true/false (also 1/0, yes/no, on/off from the command line)."""
    value = params.pop(name, None)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise JobParamError(f"{name} must be true or false")


def take_thinking(params: dict[str, Any], default: bool) -> dict[str, bool]:
    """Pop `enable_thinking` (default per kind) and `include_reasoning` (default false: the reasoning is
    dropped; true keeps it in the result as its own sealed field)."""
    return {
        "enable_thinking": take_bool(params, "enable_thinking", default),
        "include_reasoning": take_bool(params, "include_reasoning", False),
    }


def reasoning_cut_off(out: RequestOutput) -> str | None:
    """The content-free reason when `out` stopped inside its reasoning block (no answer), else None."""
    if out.reasoning_finished:
        return None
    return (
        f"the output budget ran out during reasoning ({out.reasoning_tokens} tokens), before any answer; "
        "raise max_tokens or set enable_thinking=false"
    )


def joined_reasoning(outputs: list[RequestOutput]) -> str | None:
    """The reasoning of a document's outputs, in order (None when none had any)."""
    parts = [out.reasoning for out in outputs if out.reasoning]
    return "\n\n".join(parts) if parts else None
