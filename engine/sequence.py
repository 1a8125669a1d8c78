"""A request while it generates: its tokens so far and the stop checks after each new one."""

from __future__ import annotations

import secrets

import torch

from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer


class Sequence:
    def __init__(
        self,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        stop_ids: set[int],
        tokenizer: Tokenizer | None,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.index = index
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.stop_ids = stop_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.output_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text: str | None = None
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, token: int, logprobs: dict[int, float] | None) -> None:
        """Record a generated token and decide whether the request is done."""
        self.output_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if token in self.stop_ids:
            self._finish("stop", token)
        elif self.params.stop_strings and self._hit_stop_string():
            pass
        elif self.num_tokens >= self.max_model_len or len(self.output_ids) >= (
            self.params.max_tokens or self.max_model_len
        ):
            self._finish("length", None)

    def _hit_stop_string(self) -> bool:
        text = self._decode(self.output_ids)
        longest = max(len(s) for s in self.params.stop_strings)
        # Only the tail can hold a newly completed stop string; the earliest match in it wins.
        tail_start = max(0, len(text) - longest - 8)
        hits = [(i, s) for s in self.params.stop_strings if (i := text.find(s, tail_start)) >= 0]
        if not hits:
            return False
        cut, which = min(hits)
        self.text = text[:cut]
        self.finish_reason, self.stop_reason = "stop", which
        return True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        ids = self.output_ids[:-1] if reason == "stop" else self.output_ids
        self.text = self._decode(ids)

    def _decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            index=self.index,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.text,
            finish_reason=self.finish_reason or "length",
            stop_reason=self.stop_reason,
            logprobs=self.logprobs if self.params.logprobs is not None else None,
        )
