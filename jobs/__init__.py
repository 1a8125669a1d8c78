"""Job kinds (summarize, extract, code-review, chat): documents into engine requests, outputs into results.

`make_kind(name, params)` builds a kind with validated parameters; `jobs.base` describes the contract a
worker drives. Nothing here touches the database, the broker or keys.
"""

from __future__ import annotations

import difflib
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
    """The job kind `name` with its parameters validated; `JobParamError` (content-free: it never quotes a
    name or value it was given) for an unknown kind or a bad parameter."""
    if not isinstance(name, str) or name not in KINDS:
        guess = difflib.get_close_matches(name, KINDS, 1) if isinstance(name, str) else []
        hint = f"did you mean '{guess[0]}'? " if guess else ""
        raise JobParamError(f"unknown kind ({hint}known: {', '.join(sorted(KINDS))})")
    return KINDS[name](params)
