"""Enclave's inference engine for the Qwen3.5/3.6-MoE family: Gated DeltaNet, gated attention, MoE, MTP.

The names below are imported on first use (PEP 562), so `import engine.options` or `engine.errors` does not
import torch: the pipeline's settings read the engine's options without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.errors import CheckpointError, ConfigError, EngineError, RequestAborted, RequestError
    from engine.options import EngineOptions, OptionError
    from engine.outputs import RequestOutput
    from engine.sampling import SamplingParams

_EXPORTS = {
    "CheckpointError": "engine.errors",
    "ConfigError": "engine.errors",
    "Engine": "engine.engine",
    "EngineError": "engine.errors",
    "EngineOptions": "engine.options",
    "OptionError": "engine.options",
    "RequestAborted": "engine.errors",
    "RequestError": "engine.errors",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling",
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Engine",
    "EngineError",
    "EngineOptions",
    "OptionError",
    "RequestAborted",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
