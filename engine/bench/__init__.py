"""GPU benchmark of the engine against the memory roofline: `python -m engine.bench` (see `cli` for usage).

settings (sizes, serving settings), presets (geometries, random weights, expert load), traffic (bytes per
step, the roofline), device (bandwidth, matrix rate, timing), measure (one guarded measurement), harness
(driving an engine core), workloads (a-f), speculation (end to end with controlled acceptance), serving
((d) and the vLLM-shaped h-j through Engine.submit), transformers_ref (g), report (table, JSON), cli
(arguments, the run)."""

from engine.bench.cli import main
from engine.bench.presets import PRESETS, ROUTER_LOGIT_STD, expert_load, random_model
from engine.bench.traffic import ParamCounts, StepBytes, expected_experts, param_counts, step_bytes

__all__ = [
    "PRESETS",
    "ROUTER_LOGIT_STD",
    "ParamCounts",
    "StepBytes",
    "expected_experts",
    "expert_load",
    "main",
    "param_counts",
    "random_model",
    "step_bytes",
]
