"""Enclave's inference engine for the Qwen3.5/3.6-MoE family: Gated DeltaNet, gated attention, MoE, MTP."""

from engine.engine import Engine
from engine.errors import CheckpointError, ConfigError, EngineError, RequestError
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Engine",
    "EngineError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
