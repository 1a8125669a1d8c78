"""What a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timings (time.monotonic seconds) and counts of one request."""

    prompt_tokens: int
    arrival_time: float
    generated_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_prefix_tokens: int = 0  # prompt tokens taken from a shared prefix instead of computed
    num_preemptions: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted at each verify step
    num_draft_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first token."""
        if self.first_token_time is None or self.finish_time is None or self.generated_tokens < 2:
            return None
        spent = self.finish_time - self.first_token_time
        return (self.generated_tokens - 1) / spent if spent > 0 else None

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_lengths)


@dataclass
class EngineStats:
    """A snapshot of the engine loop, as plain data."""

    steps: int
    prompt_tokens: int  # computed (prefill) tokens since start
    generated_tokens: int
    tokens_per_s: float  # prefill + generated tokens over the loop's busy time
    generated_tokens_per_s: float
    num_running: int
    num_waiting: int
    slots_used: int
    slots_total: int
    blocks_used: int
    blocks_total: int
    prefix_entries: int
    num_preemptions: int
    draft_tokens: int
    accepted_tokens: int
    graphs_captured: int = 0  # CUDA graphs captured, at start-up and on first use
    graph_capture_s: float = 0.0  # seconds spent capturing them (their kernels' compilation included)
    # kernel op -> the implementation it last ran in this process (`engine.kernels.dispatch.usage()`)
    kernels: dict[str, str] = field(default_factory=dict)
    batch_size: int = 0  # sequences in the last step (prompt chunks and decodes)
    aborted_requests: int = 0  # requests dropped before they finished (Engine.abort)
    # The host's seconds launching steps ("graph": replayed from CUDA graphs; "eager": prefill chunks, mixed
    # steps and whatever no graph fits), and how many steps of each
    launch_s: dict[str, float] = field(default_factory=dict)
    launch_steps: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """One request's result.

    `token_ids` are the generated ids (the stop or EOS token that ended generation included, as in vLLM);
    `text` is their decoding with stop strings and the ending stop token cut off, or None without a tokenizer.
    `finish_reason` is "stop" (EOS, a stop id, a stop string or a completed grammar) or "length" (max_tokens
    or the context limit).

    With a reasoning block (`<think>`, opened by the prompt or by the output) `text` is the answer only and
    `reasoning` the block's text; `reasoning_tokens` counts the tokens before the answer (tags included) and
    `reasoning_finished` is False when generation stopped inside the block, before any answer. `model` is
    the served model's name; `token_texts` decodes each token id of `token_ids` and `logprobs`, when
    log-probabilities were asked for.
    """

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics | None = None
    reasoning: str | None = None
    reasoning_tokens: int = 0
    reasoning_finished: bool = True
    model: str | None = None
    token_texts: dict[int, str] | None = None
    prompt_token_count: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_token_count = len(self.prompt_token_ids)
