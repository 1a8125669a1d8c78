"""One measurement at a time: progress lines on stderr, and a failure recorded as the measurement's result."""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from engine.core import StepFailed

log = logging.getLogger(__name__)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def describe(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, StepFailed) else exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"[:300]


def guarded(label: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one measurement; a failure (often out of memory on the reference path) becomes its result."""
    say(f"  {label} ...")
    try:
        point = measure()
    except Exception as exc:
        log.warning("benchmark point %r failed", label, exc_info=True)
        point = {"error": describe(exc)}
    say(f"    {point.get('error') or point.get('note') or point.get('skipped') or 'done'}")
    gc.collect()
    torch.cuda.empty_cache()  # a no-op unless CUDA was used
    return {"label": label, **point}
