"""Sampling parameters of one request, validated when built (the names follow vLLM and OpenAI)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.constraints import Constraint
from engine.errors import RequestError

MAX_LOGPROBS = 20
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for presence and frequency penalties
BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range for a logit bias
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `max_tokens` None generates until a stop or the context limit. temperature 0 means greedy; top_k 0
    or -1 and top_p 1 disable those filters. `seed` makes a sampled request reproducible whatever else is
    in its batch. `stop` strings end generation and are cut from the text; `stop_token_ids` (and the
    model's EOS ids unless `ignore_eos`) end it too. `logprobs` k returns the k most likely tokens'
    log-probabilities (raw model distribution), plus the chosen token's, at each generated position.
    `presence_penalty` and `frequency_penalty` (-2..2) lower a token's logit once if it was generated
    before, and per time it was; `logit_bias` adds to chosen tokens' logits (-100..100), as OpenAI's.
    `constraint` restricts the output to a grammar (`engine.constraints.Constraint`). `split_reasoning`
    splits a reasoning block (`<think>`...`</think>`, opened by the prompt or the output) from the answer:
    the output's `text` is the answer and `reasoning` the block, and the constraint and stop strings apply
    to the answer only (from the block's end).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    constraint: Constraint | None = None
    split_reasoning: bool = False
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if self.max_tokens is not None:  # None: until EOS, a stop, or the model's context limit
            self.max_tokens = _int("max_tokens", self.max_tokens, minimum=1)
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, minimum=-1)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strings = tuple(stop)
        ids = list(self.stop_token_ids or [])
        self.stop_token_ids = [_int("stop_token_ids entry", t, minimum=0) for t in ids]
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise RequestError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise RequestError(f"{name} must be between -2 and 2, got {value}")
            setattr(self, name, value)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise RequestError("constraint must be an engine.constraints.Constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _logit_bias(value: object) -> dict[int, float]:
    if not isinstance(value, dict):
        raise RequestError("logit_bias must map token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    bias = {}
    for token, amount in value.items():
        token = _int("logit_bias token id", token, minimum=0)
        amount = _float("logit_bias value", amount)
        if not BIAS_RANGE[0] <= amount <= BIAS_RANGE[1]:
            raise RequestError(f"logit_bias values must be between -100 and 100, got {amount}")
        bias[token] = amount
    return bias


def _int(name: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise RequestError(f"{name} must be >= {minimum}, got {value}")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)
