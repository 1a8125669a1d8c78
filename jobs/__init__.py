"""Job kinds (summarize, extract, code-review, chat): documents into engine requests, outputs into results.

`make_kind(name, params)` builds a kind with validated parameters; `jobs.base` describes the contract a
worker drives. Nothing here touches the database, the broker or keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jobs.base import (
    Document,
    DocumentError,
    DocumentResult,
    EngineModel,
    EngineRequest,
    JobKind,
    JobParamError,
    ModelInfo,
)
from jobs.chat import Chat
from jobs.code_review import CodeReview
from jobs.extract import Extract
from jobs.summarize import Summarize

KINDS: dict[str, type[JobKind]] = {kind.name: kind for kind in (Chat, CodeReview, Extract, Summarize)}

__all__ = [
    "KINDS",
    "Document",
    "DocumentError",
    "DocumentResult",
    "EngineModel",
    "EngineRequest",
    "JobKind",
    "JobParamError",
    "ModelInfo",
    "make_kind",
]


def make_kind(name: str, params: Mapping[str, Any] | None = None) -> JobKind:
    """The job kind `name` with its parameters validated; `JobParamError` for an unknown kind or parameter."""
    if name not in KINDS:
        raise JobParamError(f"unknown kind {name!r} (known: {', '.join(sorted(KINDS))})")
    return KINDS[name](params)
