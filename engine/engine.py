"""The engine's public face: load a checkpoint once, then generate for batches of prompts."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig, load_config
from engine.errors import EngineError, RequestError
from engine.loader import load_model
from engine.model.model import CausalLM
from engine.outputs import RequestOutput
from engine.runner import StaticBatchRunner
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

Prompt = str | list[int]


class Engine:
    """A loaded model with its tokenizer.

    `generate` runs a list of prompts (text or token ids) together, sharing each forward pass, and returns
    one `RequestOutput` per prompt in order.
    """

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        tokenizer: Tokenizer | None,
        device: torch.device,
        dtype: torch.dtype,
        max_num_seqs: int = 64,
        prefill_chunk: int = 8192,
    ) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.runner = StaticBatchRunner(model, device, dtype, prefill_chunk=prefill_chunk)
        eos = set(config.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_num_seqs: int = 64,
        prefill_chunk: int = 8192,
    ) -> Engine:
        """Load the checkpoint directory `path` (config.json, safetensors, optional tokenizer files).

        `device` defaults to CUDA when available, else CPU; `dtype` to bfloat16 on CUDA, else float32.
        """
        device = _device(device)
        dtype = _dtype(dtype, device)
        if max_num_seqs < 1 or prefill_chunk < 1:
            raise EngineError("max_num_seqs and prefill_chunk must be at least 1")
        config = load_config(path)
        tokenizer = Tokenizer.from_dir(path)
        model = load_model(path, config, device, dtype)
        log.info("loaded %s (%s) on %s as %s", path, config.model_type, device, dtype)
        return cls(model, config, tokenizer, device, dtype, max_num_seqs, prefill_chunk)

    @property
    def has_mtp(self) -> bool:
        return self.model.mtp is not None

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; `sampling` is one SamplingParams for all or one per prompt."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return self._generate(list(prompts), sampling, add_special_tokens=True)

    def _generate(self, prompts: list[Prompt], sampling, add_special_tokens: bool) -> list[RequestOutput]:
        params = self._params(sampling, len(prompts))
        seqs = [
            self._sequence(i, p, sp, add_special_tokens)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        for start in range(0, len(seqs), self.max_num_seqs):
            self.runner.run(seqs[start : start + self.max_num_seqs])
        return [s.to_output() for s in seqs]

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (lists of {"role", "content"} messages) via the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        kwargs = chat_template_kwargs or {}
        prompts = [self.apply_chat_template(c, add_generation_prompt, **kwargs) for c in conversations]
        # The rendered template already holds its special tokens: encode it without adding more.
        return self._generate(prompts, sampling, add_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        return self._require_tokenizer("chat").apply_chat_template(messages, add_generation_prompt, **kwargs)

    def _params(self, sampling, count: int) -> list[SamplingParams]:
        if sampling is None:
            sampling = SamplingParams()
        if isinstance(sampling, SamplingParams):
            return [sampling] * count
        sampling = list(sampling)
        if len(sampling) != count or not all(isinstance(s, SamplingParams) for s in sampling):
            raise RequestError(f"need one SamplingParams or a list of {count}, one per prompt")
        return sampling

    def _sequence(
        self, index: int, prompt: Prompt, params: SamplingParams, add_special_tokens: bool
    ) -> Sequence:
        text = None
        if isinstance(prompt, str):
            text = prompt
            tokenizer = self._require_tokenizer("text prompts")
            ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
        else:
            raise RequestError(f"prompt {index} must be a string or a list of token ids")
        vocab = self.config.vocab_size
        if not ids:
            raise RequestError(f"prompt {index} is empty")
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise RequestError(
                f"prompt {index} has token id {bad[0]} outside the vocabulary (0..{vocab - 1})"
            )
        if len(ids) >= self.config.max_model_len:
            raise RequestError(
                f"prompt {index} has {len(ids)} tokens; the model's context is {self.config.max_model_len}"
            )
        if params.stop_strings:
            self._require_tokenizer("stop strings")
        if bad := [t for t in params.stop_token_ids if t >= vocab]:
            raise RequestError(f"stop token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return Sequence(
            index, ids, params, text, stop_ids, self.tokenizer, self.config.max_model_len, self.device
        )

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(
                f"{what} need a tokenizer, and this checkpoint has no tokenizer.json; pass token ids"
            )
        return self.tokenizer


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise EngineError(f"unknown device {device!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device cuda was asked for, but CUDA is not available on this machine")
    return device


def _dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise EngineError(f"unsupported dtype {dtype} (use float32, bfloat16 or float16)")
        return dtype
    if dtype not in _DTYPES:
        raise EngineError(f"unsupported dtype {dtype!r} (use float32, bfloat16 or float16)")
    return _DTYPES[dtype]
