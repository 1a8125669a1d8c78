"""Factories for job-kind tests: a word-counting ModelInfo, hand-built outputs, a worker-like shard run."""

from __future__ import annotations

from engine import Engine, RequestOutput
from jobs.base import Document, DocumentError, DocumentResult, EngineModel, JobKind


class FakeModel:
    """ModelInfo with one token per whitespace-separated word and a plain-text chat template."""

    name = "fake-model"

    def __init__(self, max_model_len: int = 4096) -> None:
        self.max_model_len = max_model_len
        self.rendered: list[list[dict]] = []
        self.template_kwargs: list[dict] = []

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        self.rendered.append(messages)
        self.template_kwargs.append(template_kwargs)
        return "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages) + "<assistant>\n"


def make_output(
    text: str, finish_reason: str = "stop", prompt_tokens: int = 10, completion_tokens: int = 5
) -> RequestOutput:
    return RequestOutput(
        index=0,
        prompt=None,
        prompt_token_ids=list(range(prompt_tokens)),
        token_ids=list(range(completion_tokens)),
        text=text,
        finish_reason=finish_reason,
    )


def doc(text: str | bytes, path: str = "notes/a.txt") -> Document:
    return Document(path, text.encode() if isinstance(text, str) else text)


def run_shard(kind: JobKind, docs: list[Document], engine: Engine) -> list[DocumentResult]:
    """What the worker does with one shard: all requests of all documents in one generate call."""
    model = EngineModel(engine)
    plans: list[DocumentResult | slice] = []
    prompts, params = [], []
    for document in docs:
        try:
            requests = kind.requests(document, model)
        except DocumentError as error:
            plans.append(kind.failure(error))
            continue
        plans.append(slice(len(prompts), len(prompts) + len(requests)))
        prompts += [r.prompt for r in requests]
        params += [r.sampling for r in requests]
    outputs = engine.generate(prompts, params) if prompts else []
    return [
        plan if isinstance(plan, DocumentResult) else kind.result(document, outputs[plan])
        for plan, document in zip(plans, docs, strict=True)
    ]
