"""The engine's options: one frozen dataclass per concern, checked when made, each option documented once.

`EngineOptions` groups them: `load` (device, dtype, quantization: how `Engine.from_pretrained` loads the
weights), `serving` (batch limits, context length, asynchronous scheduling), `cache` (its memory, block size,
shared prefixes, KV dtype), `kernels` (CUDA graphs) and `speculation` (MTP drafts). Each field carries its
meaning in `metadata["doc"]`: the help of enclave.toml's `[engine]` table and of command lines. Option
names are unique across concerns, so a flat view exists too: `flat_fields()` lists them, `from_flat` builds
options from flat keys (values may be strings, as from the environment). A bad value raises `OptionError`,
one line naming the option, or where it came from.

Options left unset (None) are worked out when the engine starts: from the device, the checkpoint, the cache
budget, or an `ENCLAVE_*` switch (`engine/env.py`) where one exists. This module imports nothing that
imports torch: the pipeline's settings are built from it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.errors import EngineError

MAX_SPECULATIVE_TOKENS = 4
MTP_HIDDEN = ("normed", "raw")
DRAFT_HEADS = ("model", "fp8")
QUANTIZATIONS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
STATE_DTYPES = ("auto", "float32", "bfloat16")
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
AUTO = "auto"  # the spelling of an unset (None) option in text


class OptionError(EngineError, ValueError):
    """An engine option is unknown or its value is bad; the message is one line naming it."""

    def __init__(self, message: str, option: str = "", expected: str = "", value: Any = None) -> None:
        super().__init__(message)
        self.option, self.expected, self.value = option, expected, value


def _option(kind: str, default: Any, doc: str, **checks: Any) -> Any:
    """A field of kind `whole`, `number`, `switch`, `choice` or `device`, with its meaning and bounds."""
    return field(default=default, metadata={"doc": doc, "kind": kind, **checks})


class _Concern:
    """Checks every field against its metadata after construction (`OptionError` names the first bad one)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = _check(f, value)
            if checked is not value:  # a normalised spelling (`FP8` -> `fp8`)
                object.__setattr__(self, f.name, checked)


@dataclass(frozen=True)
class LoadOptions(_Concern):
    """How `Engine.from_pretrained` loads the checkpoint."""

    device: str | None = _option(
        "device", None, "torch device to run on (cuda, cuda:1, cpu); unset: cuda when available, else cpu"
    )
    dtype: str = _option(
        "choice",
        "auto",
        "dtype of the weights and activations; auto: bfloat16 on cuda, float32 elsewhere",
        choices=DTYPE_NAMES,
    )
    quantization: str = _option(
        "choice",
        "none",
        "fp8: dense projections and routed experts as block-FP8 (W8A8) GEMMs, an FP8 release's weights as "
        "stored and others quantised at load; none: the weights in `dtype` (an FP8 release dequantised)",
        choices=QUANTIZATIONS,
    )


@dataclass(frozen=True)
class ServingOptions(_Concern):
    """How many requests and tokens a step takes, how long sequences may grow, and when tokens are read."""

    max_num_seqs: int | None = _option(
        "whole",
        None,
        "most requests running at once; unset: on cuda as many as the cache budget affords (at most 1,024), "
        "64 elsewhere",
        low=1,
        high=4096,
    )
    max_num_batched_tokens: int = _option(
        "whole",
        8192,
        "most tokens one step computes: prefill chunks, decoded tokens and drafts together",
        low=1,
        high=1 << 20,
    )
    long_prefill_chunk: int | None = _option(
        "whole",
        None,
        "most tokens a step computes when it holds one prompt being prefilled and no other request runs or "
        "waits: fewer, larger steps spread each step's weight reads and launches over more tokens (the "
        "cache budget leaves room for its activations); unset: 32,768 on cuda, max_num_batched_tokens "
        "elsewhere; at most max_num_batched_tokens: off",
        low=1,
        high=1 << 20,
    )
    max_model_len: int | None = _option(
        "whole",
        None,
        "longest sequence, prompt and output, in tokens; unset: the checkpoint's context (never above it)",
        low=1,
    )
    async_scheduling: bool | None = _option(
        "switch",
        None,
        "plan and launch each step before the previous step's tokens are read; unset: on cuda unless "
        "ENCLAVE_ASYNC_SCHEDULING=0; true forces it (on the cpu too); never with a fixed speculative k",
    )


@dataclass(frozen=True)
class CacheOptions(_Concern):
    """The memory of the state slots and KV blocks, and the prompt prefixes kept in it."""

    kv_cache_memory: int | None = _option(
        "whole",
        None,
        "bytes for the state slots and KV blocks; unset: on cuda the memory free after loading times "
        "gpu_memory_utilization, less one step's activations; 2 GiB elsewhere",
        low=1,
        high=1 << 42,
    )
    gpu_memory_utilization: float = _option(
        "number",
        0.9,
        "share of the device's memory the engine may fill when kv_cache_memory is unset",
        low=0.01,
        high=1.0,
    )
    block_size: int | None = _option(
        "whole",
        None,
        "positions per KV block; unset: 64 on cuda (the prefill attention kernel then reads each 64-key "
        "tile from one page), 16 elsewhere",
        low=1,
        high=1024,
    )
    max_prefixes: int = _option(
        "whole", 4, "shared prompt prefixes kept in the cache (a state slot each); 0: none", low=0, high=1024
    )
    kv_cache_dtype: str = _option(
        "choice",
        "auto",
        "dtype of the attention layers' KV blocks: auto, the model's dtype; fp8, float8 e4m3 with an fp32 "
        "scale per position and kv head (about twice the positions in the same memory)",
        choices=KV_CACHE_DTYPES,
    )
    state_dtype: str = _option(
        "choice",
        "auto",
        "dtype of the Gated DeltaNet layers' recurrent states: auto, the checkpoint's mamba_ssm_dtype "
        "(float32 for Qwen3.5/3.6, and where it names none, as transformers keeps them); bfloat16 halves "
        "their bytes, which decode reads and writes every step (at batch 256 about 30 GB a step in float32), "
        "at some accuracy: rounded after every token",
        choices=STATE_DTYPES,
    )


@dataclass(frozen=True)
class KernelOptions(_Concern):
    """How the model's kernels are launched."""

    cuda_graphs: bool | None = _option(
        "switch",
        None,
        "replay decode and verify steps as CUDA graphs (cuda with the Triton kernels only); unset: on unless "
        "ENCLAVE_CUDA_GRAPHS=0",
    )
    graph_capture_len: int = _option(
        "whole",
        8192,
        "contexts up to which every batch size's decode graph is captured when the engine starts, so no step "
        "waits for a capture or its kernels' compilation (longer ones are captured on first use); 0: all on "
        "first use",
        low=0,
    )
    warm_up: bool | None = _option(
        "switch",
        None,
        "before serving, run synthetic prefill and mixed steps at every tuned token count, so their kernels "
        "compile at start rather than in the first requests' steps; unset: on where decode graphs are "
        "captured at start (cuda)",
    )


@dataclass(frozen=True)
class SpeculationOptions(_Concern):
    """Speculative decoding with the checkpoint's MTP head."""

    num_speculative_tokens: int | None = _option(
        "whole",
        None,
        "drafts the MTP head proposes and each step verifies (needs a checkpoint with an MTP head); a number "
        "forces that k (0: off); unset: adaptive on cuda when the checkpoint has an MTP head (k chosen per "
        "step from the measured acceptance and the batch, at most 3, 0 when speculating does not pay), "
        "else off",
        low=0,
        high=MAX_SPECULATIVE_TOKENS,
    )
    mtp_hidden: str = _option(
        "choice",
        "normed",
        "the main model's hidden state the MTP head reads: normed (after the final norm, as vLLM) or raw",
        choices=MTP_HIDDEN,
    )
    draft_head: str = _option(
        "choice",
        "model",
        "the lm_head MTP drafts are scored with: model (the checkpoint's) or fp8 (a block-scaled e4m3 copy, "
        "half the bytes a draft reads, at 1 byte per weight more memory; verification stays exact)",
        choices=DRAFT_HEADS,
    )
    draft_vocab: int | None = _option(
        "whole",
        None,
        "score MTP drafts over the first N token ids only (FR-Spec's restricted draft vocabulary, the "
        "tokenizer's order standing in for frequency: byte-level BPE numbers its merges by how often they "
        "were seen): N/V of the bytes the draft head reads; a token past N is never drafted, verification "
        "stays exact; unset: the whole vocabulary",
        low=1,
    )


class OptionField(NamedTuple):
    """One option in the flat view: its name, the values it takes, its default and its meaning."""

    name: str
    type: str
    default: Any
    doc: str


@dataclass(frozen=True)
class EngineOptions:
    """Every engine option, by concern. `from_flat`, `with_flat` and `to_flat` use the flat names."""

    load: LoadOptions = field(default_factory=LoadOptions)
    serving: ServingOptions = field(default_factory=ServingOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    kernels: KernelOptions = field(default_factory=KernelOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), _CONCERNS[f.name]):
                raise OptionError(f"engine options' {f.name} must be a {_CONCERNS[f.name].__name__}")

    @classmethod
    def from_flat(
        cls, values: Mapping[str, object], source: Callable[[str], str] | None = None
    ) -> EngineOptions:
        """Options from flat keys (`max_num_seqs`, `cuda_graphs`, `quantization`, ...), the rest defaults.

        Values may be text, as from the environment: "64", "0.9", "true"/"false"/"1"/"0", a choice in any
        case, "auto" for unset. `source(key)` says where a key came from (a variable, a file's key), for
        the one-line `OptionError` on an unknown key or a bad value; without it the key is named."""
        return cls().with_flat(values, source)

    def with_flat(
        self, values: Mapping[str, object], source: Callable[[str], str] | None = None
    ) -> EngineOptions:
        """These options with the flat keys in `values` replaced (see `from_flat`)."""
        where = source or (lambda name: name)
        changes: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            if name not in _FLAT:
                known = ", ".join(_FLAT)
                raise OptionError(f"unknown engine option {where(name)} (known: {known})", name)
            concern, f = _FLAT[name]
            changes.setdefault(concern, {})[name] = _parse(f, value)
        made = {}
        for concern, fields_ in changes.items():
            try:
                made[concern] = dataclasses.replace(getattr(self, concern), **fields_)
            except OptionError as exc:
                given = values.get(exc.option, exc.value)  # as written: text from a file or a variable
                raise OptionError(
                    _message(where(exc.option), exc.expected, given), exc.option, exc.expected, given
                ) from None
        return dataclasses.replace(self, **made)

    def to_flat(self) -> dict[str, Any]:
        """Every option by its flat name."""
        return {name: getattr(getattr(self, concern), name) for name, (concern, _) in _FLAT.items()}

    @staticmethod
    def flat_fields() -> tuple[OptionField, ...]:
        """Every option: flat name, the values it takes, default and doc (help for settings and CLIs)."""
        return tuple(
            OptionField(name, _expected(f), f.default, f.metadata["doc"]) for name, (_, f) in _FLAT.items()
        )


_CONCERNS: dict[str, type] = {
    "load": LoadOptions,
    "serving": ServingOptions,
    "cache": CacheOptions,
    "kernels": KernelOptions,
    "speculation": SpeculationOptions,
}
# flat name -> (its concern's field in EngineOptions, its dataclass field)
_FLAT: dict[str, tuple[str, dataclasses.Field]] = {
    f.name: (concern, f) for concern, cls in _CONCERNS.items() for f in dataclasses.fields(cls)
}
assert len(_FLAT) == sum(len(dataclasses.fields(c)) for c in _CONCERNS.values()), "names must be unique"

_WHOLE = re.compile(r"[+-]?\d{1,19}")
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,15}(:\d{1,3})?")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parse(f: dataclasses.Field, value: object) -> object:
    """A text value converted to the field's kind; anything else, or text that does not convert, is returned
    as is for `_check` to refuse with the field's name."""
    if not isinstance(value, str):
        return value
    kind, text = f.metadata["kind"], value.strip()
    if f.default is None and text.lower() == AUTO:
        return None
    if kind == "whole" and _WHOLE.fullmatch(text):
        return int(text)
    if kind == "number":
        try:
            return float(text)
        except ValueError:
            return value
    if kind == "switch" and text.lower() in _TRUE + _FALSE:
        return text.lower() in _TRUE
    if kind in ("choice", "device"):
        return text.lower()
    return value


def _check(f: dataclasses.Field, value: Any) -> Any:
    """`value` if it is one the field takes (a choice normalised to lower case), else `OptionError`."""
    m = f.metadata
    kind = m["kind"]
    ok = False
    if value is None:
        ok = f.default is None
    elif kind == "whole":
        ok = isinstance(value, int) and not isinstance(value, bool) and _within(value, m)
    elif kind == "number":
        number = isinstance(value, int | float) and not isinstance(value, bool)
        ok = number and math.isfinite(value) and _within(value, m)
    elif kind == "switch":
        ok = isinstance(value, bool)
    elif kind == "choice" and isinstance(value, str):
        value = value.strip().lower()
        ok = value in m["choices"]
    elif kind == "device" and isinstance(value, str):
        value = value.strip().lower()
        ok = _DEVICE.fullmatch(value) is not None
    if not ok:
        expected = _expected(f)
        raise OptionError(_message(f.name, expected, value), f.name, expected, value)
    return value


def _within(value: float, m: Mapping[str, Any]) -> bool:
    low, high = m.get("low"), m.get("high")
    return (low is None or value >= low) and (high is None or value <= high)


def _expected(f: dataclasses.Field) -> str:
    """The values a field takes, in words: its error messages and its help say the same."""
    m = f.metadata
    kind = m["kind"]
    low, high = m.get("low"), m.get("high")
    if kind in ("whole", "number"):
        noun = "a whole number" if kind == "whole" else "a number"
        text = f"{noun} between {_plain(low)} and {_plain(high)}" if high is not None else f"{noun} >= {low}"
    elif kind == "switch":
        text = "true or false"
    elif kind == "choice":
        text = "one of " + ", ".join(m["choices"])
    else:
        text = "a device such as cuda, cuda:1 or cpu"
    return text + (", or auto" if f.default is None else "")


def _plain(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else str(number)


def _message(where: str, expected: str, value: Any) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{where} must be {expected}, got {shown}"
