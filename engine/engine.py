"""The engine's public face: load a checkpoint once, then generate for batches of prompts."""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from engine.async_core import build_core
from engine.config import ModelConfig, load_config
from engine.core import StepFailed
from engine.errors import EngineError, RequestAborted, RequestError
from engine.grammar import GrammarCompiler, GrammarState
from engine.loader import load_model, quantization_mode
from engine.model.model import CausalLM
from engine.options import MAX_SPECULATIVE_TOKENS as MAX_SPECULATIVE_TOKENS  # re-exported: its old home
from engine.options import EngineOptions
from engine.outputs import EngineStats, RequestOutput
from engine.planner import plan_for, step_tokens
from engine.reasoning import ThinkTokens
from engine.runner import Drafter
from engine.sampling import SamplingParams
from engine.sequence import PrefixSpec, Sequence
from engine.spec_policy import speculation_mode
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
_BUSY: set[Engine] = set()  # engines with requests in flight: kept alive even if their owner let go


class Engine:
    """A loaded model with its tokenizer, served by one background loop.

    `submit` queues one prompt and returns a `concurrent.futures.Future` of its `RequestOutput`; it is
    thread-safe, so many threads feed one continuously batched loop. `generate` submits a list of prompts
    and waits for all of them, returning outputs in order.
    """

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        tokenizer: Tokenizer | None,
        device: torch.device,
        dtype: torch.dtype,
        options: EngineOptions | None = None,
        *,
        drafter: Drafter | None = None,
        name: str = "enclave",
    ) -> None:
        """Serve `model` (already on `device` in `dtype`) with `options` (their `load` part is
        `from_pretrained`'s); `drafter` stands in for the MTP head (tests, benchmarks); `name` is the served
        model's name that outputs carry (`from_pretrained`: the checkpoint directory's)."""
        options = options or EngineOptions()
        has_drafter = model.mtp is not None or drafter is not None
        mode = speculation_mode(options.speculation, has_drafter, device, model)
        if mode.k and model.mtp is None and drafter is None:
            raise EngineError(
                "num_speculative_tokens needs an MTP head, and this checkpoint has none (no mtp.* tensors)"
            )
        k = mode.k
        options = options.with_flat({"num_speculative_tokens": k})  # worked out: the planner sizes for it
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.num_speculative_tokens = k  # the most drafts a step verifies
        self.adaptive_speculation = mode.adaptive  # whether each step's k is chosen (`engine/spec_policy.py`)
        self.max_model_len = min(options.serving.max_model_len or config.max_model_len, config.max_model_len)
        eos = set(config.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.eos_token_ids = frozenset(eos)
        self.model_name = name
        self.think = ThinkTokens.of(tokenizer)  # a request may split reasoning from its answer with these
        self._grammars: GrammarCompiler | None = None
        num_mtp = len(model.mtp.layers) if model.mtp is not None and k else 0
        if k:
            model.prepare_draft_head_(options.speculation)  # before the plan, which sizes the cache from the
            # memory left (an FP8 copy takes some)
        self.max_num_seqs, self.plan = plan_for(
            config,
            dtype,
            device,
            options,
            max_model_len=self.max_model_len,
            num_mtp_layers=num_mtp,
            verify_seqs=mode.verify_seqs,
        )
        # The options as served: what was left unset, worked out.
        self.options = options.with_flat(
            {
                "device": str(device),
                "dtype": str(dtype).removeprefix("torch."),
                "max_num_seqs": self.max_num_seqs,
                "max_model_len": self.max_model_len,
                "long_prefill_chunk": step_tokens(options, device),
            }
        )
        self.core = build_core(model, self.plan, self.options, drafter, mode)
        self._cond = threading.Condition()
        self._inbox: list[tuple[Sequence, Future]] = []
        self._futures: dict[int, Future] = {}  # id(seq) -> its future, for requests the core holds
        self._held: dict[Future, Sequence] = {}  # the same requests, by future (Engine.abort)
        self._aborts: set[Future] = set()  # asked for by abort(), applied by the loop thread
        self._arrivals = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        options: EngineOptions | None = None,
        *,
        drafter: Drafter | None = None,
        **flat: Any,
    ) -> Engine:
        """Load the checkpoint directory `path` (config.json, safetensors, optional tokenizer files).

        `options` (default: `EngineOptions()`), with any option replaced by its flat name in `flat`, e.g.
        `device="cpu", dtype="float32", max_num_seqs=8, quantization="fp8"`; `EngineOptions.flat_fields()`
        lists every option with its meaning. `device` and `dtype` may also be a torch.device and a
        torch.dtype, and `dtype=None` or `quantization=None` mean auto and none.
        """
        if options is not None and not isinstance(options, EngineOptions):
            raise EngineError("from_pretrained(path, options, **flat): name device= and dtype= as keywords")
        options = (options or EngineOptions()).with_flat(_flat_load(flat))
        device = _device(options.load.device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # Triton launches and graph captures use the current device
        auto = torch.bfloat16 if device.type == "cuda" else torch.float32
        dtype = _DTYPES.get(options.load.dtype, auto)
        quantization = quantization_mode(options.load.quantization)
        config = load_config(path)
        tokenizer = Tokenizer.from_dir(path)
        model = load_model(path, config, device, dtype, quantization)
        fp8 = ", projections and experts in fp8" if quantization else ""
        log.info("loaded %s (%s) on %s as %s%s", path, config.model_type, device, dtype, fp8)
        name = Path(path).resolve().name or "enclave"
        return cls(model, config, tokenizer, device, dtype, options, drafter=drafter, name=name)

    @property
    def has_mtp(self) -> bool:
        return self.model.mtp is not None

    # ---- requests

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        prefix: Prompt | None = None,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> Future:
        """Queue one request; the future's result is its `RequestOutput`.

        `prefix`, text or token ids the prompt starts with (a job's instructions), is computed once and
        shared by every request naming it; the output is the same as without it. Lower `priority` values
        are served first. Invalid requests raise `RequestError` here, not in the future.
        """
        if self._closed:
            raise EngineError("the engine is closed")
        seq = self._sequence(0, prompt, sampling or SamplingParams(), add_special_tokens, priority, prefix)
        return self._enqueue([seq])[0]

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
        return [f.result() for f in self._enqueue(seqs)]

    def abort(self, futures: Iterable[Future]) -> int:
        """Stop the requests behind `futures` (from `submit`) before their next step: each releases its
        slot and KV blocks and its future fails with `RequestAborted`. Requests already finished are left
        alone. Thread-safe, like `submit`; returns how many of them were still unfinished."""
        with self._cond:
            wanted = {f for f in futures if not f.done()}
            kept = []
            for seq, future in self._inbox:  # not yet in the core: dropped here
                if future in wanted:
                    wanted.discard(future)
                    future.set_exception(RequestAborted("the request was aborted"))
                else:
                    kept.append((seq, future))
            count = len(self._inbox) - len(kept) + len(wanted)
            self._inbox = kept
            self._aborts |= wanted
            self._cond.notify_all()
        return count

    def stats(self) -> EngineStats:
        """A snapshot of the loop's counters (read without stopping it, so approximate while busy)."""
        return self.core.stats()

    def close(self) -> None:
        """Stop the loop; requests not finished fail with EngineError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        _BUSY.discard(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the loop

    def _enqueue(self, seqs: list[Sequence]) -> list[Future]:
        futures = [Future() for _ in seqs]
        with self._cond:
            _BUSY.add(self)  # held strongly until its loop runs out of work
            for seq, future in zip(seqs, futures, strict=True):
                seq.arrival = next(self._arrivals)
                future.set_running_or_notify_cancel()
                self._inbox.append((seq, future))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_serve,
                    args=(weakref.ref(self), self._cond, self.device),
                    name="enclave-engine",
                    daemon=True,
                )
                self._thread.start()
            self._cond.notify_all()
        return futures

    def _serve_once(self) -> bool:
        """Take new requests and run one step; False once the engine is closed. Loop thread only."""
        with self._cond:
            if self._closed:
                self._fail_all(EngineError("the engine was closed before this request finished"))
                _BUSY.discard(self)
                return False
            arrived, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for seq, future in arrived:
            self._futures[id(seq)] = future
            self._held[future] = seq
            self.core.add(seq)
        for future in aborts:
            self._abort(future)
        if not self.core.has_work():  # everything asked for was aborted
            return True
        try:
            finished = self.core.step()
        except StepFailed as exc:
            log.exception("engine step failed")
            for seq in exc.seqs:
                self._release(seq).set_exception(exc.cause)
            return True
        except Exception as exc:  # a bug outside the model: fail everything rather than hang
            log.exception("engine loop failed")
            with self._cond:
                self._fail_all(exc)
            return True
        for seq in finished:
            output = seq.to_output()
            output.model = self.model_name
            self._release(seq).set_result(output)
        return True

    def _release(self, seq: Sequence) -> Future:
        """Forget a request the core no longer holds; its future. Loop thread only."""
        future = self._futures.pop(id(seq))
        del self._held[future]
        return future

    def _abort(self, future: Future) -> None:
        """Drop the request behind `future` from the core (freeing its slot and blocks). Loop thread only."""
        seq = self._held.get(future)
        if seq is None:  # finished (or failed) before the abort was applied
            return
        self.core.abort(seq)
        self._release(seq).set_exception(RequestAborted("the request was aborted"))

    def _idle(self) -> bool:
        return not self._inbox and not self._aborts and not self.core.has_work() and not self._closed

    def _fail_all(self, exc: BaseException) -> None:
        pending = [s for s, _ in self._inbox] + self.core.scheduler.waiting + self.core.scheduler.running
        for seq in pending:
            if seq.compute_target is None:
                self.core.abort(seq)
        for future in list(self._futures.values()) + [f for _, f in self._inbox]:
            if not future.done():
                future.set_exception(exc)
        self._futures.clear()
        self._held.clear()
        self._aborts.clear()
        self._inbox.clear()

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
        self,
        index: int,
        prompt: Prompt,
        params: SamplingParams,
        add_special_tokens: bool,
        priority: int = 0,
        prefix: Prompt | None = None,
    ) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling must be a SamplingParams")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestError(f"priority must be an integer, got {priority!r}")
        text = prompt if isinstance(prompt, str) else None
        ids = self._token_ids(index, prompt, add_special_tokens)
        vocab = self.config.vocab_size
        if not ids:
            raise RequestError(f"prompt {index} is empty")
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise RequestError(
                f"prompt {index} has token id {bad[0]} outside the vocabulary (0..{vocab - 1})"
            )
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt {index} has {len(ids)} tokens; the context is {self.max_model_len}")
        blocks = -(-(len(ids) + 1 + 2 * self.num_speculative_tokens) // self.plan.block_size)
        if blocks > self.plan.num_blocks:
            raise RequestError(
                f"prompt {index} has {len(ids)} tokens, more than the KV cache holds "
                f"({self.plan.num_blocks * self.plan.block_size} positions); raise the cache memory"
            )
        if params.stop_strings:
            self._require_tokenizer("stop strings")
        if bad := [t for t in params.stop_token_ids if t >= vocab]:
            raise RequestError(f"stop token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if bad := [t for t in params.logit_bias or () if t >= vocab]:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return Sequence(
            index,
            ids,
            params,
            text,
            stop_ids,
            self.tokenizer,
            self.max_model_len,
            self.device,
            priority=priority,
            prefix=self._prefix(prefix, ids, add_special_tokens),
            grammar=self._grammar(params),
            think=self.think if params.split_reasoning else None,
        )

    def _grammar(self, params: SamplingParams) -> GrammarState | None:
        """A matcher for the request's constraint (compiled here, in the submitting thread, and cached)."""
        if params.constraint is None:
            return None
        tokenizer = self._require_tokenizer("constrained output")
        with self._cond:
            if self._grammars is None:
                eos = sorted(self.eos_token_ids)
                self._grammars = GrammarCompiler(tokenizer, self.config.vocab_size, eos)
        return self._grammars.state(params.constraint)

    def _token_ids(self, index: int, prompt: Prompt, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            tokenizer = self._require_tokenizer("text prompts")
            return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        raise RequestError(f"prompt {index} must be a string or a list of token ids")

    def _prefix(self, prefix: Prompt | None, ids: list[int], add_special_tokens: bool) -> PrefixSpec | None:
        """The shared prefix to declare: token ids the prompt starts with.

        Token ids must be a prefix of the prompt's, or nothing is shared. Text is tokenised on its own,
        and its last token may merge with what follows it in the prompt, so the prompt's tokens are
        shared as far as they agree with the prefix's. Either way the output equals the unshared one.
        """
        if prefix is None or self.plan.num_slots <= self.max_num_seqs:
            return None
        key = self._token_ids(0, prefix, add_special_tokens)
        if isinstance(prefix, str):
            common = 0
            for a, b in zip(key, ids, strict=False):
                if a != b:
                    break
                common += 1
            key = key[:common]
        elif ids[: len(key)] != key:
            key = []
        if len(key) < 2:
            log.debug("prefix is not a token prefix of the prompt; not shared")
            return None
        return PrefixSpec(tuple(key))

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(
                f"{what} need a tokenizer, and this checkpoint has no tokenizer.json; pass token ids"
            )
        return self.tokenizer


def _serve(ref: weakref.ref[Engine], cond: threading.Condition, device: torch.device) -> None:
    """The loop thread. Only this thread touches the engine's core; the lock guards the inbox, so
    submit() never waits for a step. While idle it holds the engine weakly, so an engine nobody uses any
    more is collected (freeing its caches) and the thread ends."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the current device is per thread: cuda:1 must not launch on 0
    while True:
        with cond:
            engine = ref()
            if engine is None:
                return
            if engine._idle():
                _BUSY.discard(engine)
                engine = None
                cond.wait(timeout=1.0)
                continue
        if not engine._serve_once():
            return
        engine = None


def _flat_load(flat: dict[str, Any]) -> dict[str, Any]:
    """`from_pretrained`'s keywords as option values: a torch.device or torch.dtype by name, None as the
    default dtype and quantization, and a quantization checked by the loader (its own one-line error)."""
    flat = dict(flat)
    if isinstance(flat.get("device"), torch.device):
        flat["device"] = str(flat["device"])
    if isinstance(flat.get("dtype"), torch.dtype):
        dtype = flat["dtype"]
        if dtype not in _DTYPES.values():
            raise EngineError(f"unsupported dtype {dtype} (use float32, bfloat16 or float16)")
        flat["dtype"] = str(dtype).removeprefix("torch.")
    elif "dtype" in flat and flat["dtype"] is None:
        flat["dtype"] = "auto"
    if "quantization" in flat:
        flat["quantization"] = quantization_mode(flat["quantization"]) or "none"
    return flat


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise EngineError(f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device cuda was asked for, but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise EngineError(
            f"device {device} was asked for, but this machine has {torch.cuda.device_count()} CUDA devices"
        )
    return device
