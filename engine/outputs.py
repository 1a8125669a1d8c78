"""What a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One request's result.

    `token_ids` are the generated ids (the stop or EOS token that ended generation included, as in vLLM);
    `text` is their decoding with stop strings and the ending stop token cut off, or None without a tokenizer.
    `finish_reason` is "stop" (EOS, a stop id or a stop string) or "length" (max_tokens or the context limit).
    """

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_token_count: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_token_count = len(self.prompt_token_ids)
