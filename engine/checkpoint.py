"""Read tensors from a safetensors checkpoint directory: single file or sharded, memory-mapped.

Names are normalised to the text-only layout (`model.layers...`, `lm_head...`, `mtp...`): the
vision-language release's `model.language_model.` prefix is dropped and `model.visual.*` is ignored.
Block-FP8 weights are dequantised on read with their `weight_scale_inv` (`get`), or handed over as stored
(`get_fp8`) for the native FP8 projections.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine import kernels
from engine.errors import CheckpointError

log = logging.getLogger(__name__)

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
}
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_IGNORED = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
SCALE_SUFFIX = "_scale_inv"


def normalise_name(raw: str) -> str | None:
    """The text-model name of a checkpoint tensor, or None when the tensor is not the text model's."""
    if raw.startswith(_IGNORED) or raw.endswith("rotary_emb.inv_freq"):
        return None
    for old, new in _RENAMES:
        if raw.startswith(old):
            return new + raw[len(old) :]
    return raw


class CheckpointReader:
    """Tensors of one checkpoint directory by normalised name."""

    def __init__(self, path: str | Path, fp8_block: tuple[int, int] = (128, 128)) -> None:
        self.path = Path(path)
        self.fp8_block = fp8_block
        self._handles: dict[Path, object] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        self._scales: dict[str, tuple[Path, str]] = {}
        self.used: set[str] = set()
        self.uses_language_model_prefix = False
        for file in self._files():
            handle = self._open(file)
            for raw in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                name = normalise_name(raw)
                if name is None:
                    continue
                self.uses_language_model_prefix |= raw != name and not raw.startswith("mtp.")
                table = self._scales if name.endswith(SCALE_SUFFIX) else self._where
                table[name] = (file, raw)
        if not self._where:
            raise CheckpointError(f"checkpoint {self.path} holds no text-model tensors")

    def _files(self) -> list[Path]:
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint {self.path} is not a directory")
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"checkpoint index {index} is unreadable: {exc}") from None
            files = sorted({self.path / f for f in weight_map.values()})
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"checkpoint index {index} names missing file {f.name}")
            return files
        single = self.path / "model.safetensors"
        if single.exists():
            return [single]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"checkpoint {self.path} has no model.safetensors or *.safetensors files")
        return files

    def _open(self, file: Path):
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint file {file} is corrupt or truncated: {exc}") from None
        self._handles[file] = handle
        return handle

    def display(self, name: str) -> str:
        """The name a tensor has (or would have) in this checkpoint's own layout, for messages."""
        if name in self._where:
            return self._where[name][1]
        if self.uses_language_model_prefix and name.startswith("model."):
            return "model.language_model." + name[len("model.") :]
        return name

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        file, raw = self._locate(name)
        return tuple(self._handles[file].get_slice(raw).get_shape())

    def get(self, name: str, dtype: torch.dtype, expected: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read tensor `name` as `dtype` (dequantising FP8), checking its shape against `expected`."""
        tensor = self._get(name, expected)
        if tensor.dtype == torch.float8_e4m3fn:
            return kernels.dequantize_block_fp8(tensor, self._scale(name, tensor), self.fp8_block, dtype)
        return tensor.to(dtype)

    def is_fp8(self, name: str) -> bool:
        """Whether tensor `name` is stored as block-scaled e4m3."""
        file, raw = self._locate(name)
        return self._handles[file].get_slice(raw).get_dtype() == "F8_E4M3"

    def has_fp8(self) -> bool:
        """Whether the checkpoint holds block-FP8 weights (an FP8 release)."""
        return bool(self._scales)

    def get_fp8(
        self, name: str, expected: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 tensor `name` as stored: (e4m3 weight, its `weight_scale_inv` as fp32, one per block)."""
        weight = self._get(name, expected)
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"checkpoint {self.path}: tensor {self.display(name)} is not fp8")
        return weight, self._scale(name, weight).float()

    def _get(self, name: str, expected: tuple[int, ...] | None) -> torch.Tensor:
        file, raw = self._locate(name)
        handle = self._handles[file]
        kind = handle.get_slice(raw).get_dtype()
        if kind not in _DTYPES:
            raise CheckpointError(f"checkpoint file {file.name}: tensor {raw} has unsupported dtype {kind}")
        shape = tuple(handle.get_slice(raw).get_shape())
        if expected is not None and shape != tuple(expected):
            raise CheckpointError(
                f"checkpoint file {file.name}: tensor {raw} has shape {list(shape)}, "
                f"expected {list(expected)}"
            )
        tensor = self._read(handle, file, raw)
        self.used.add(name)
        return tensor

    def _read(self, handle, file: Path, raw: str) -> torch.Tensor:
        try:
            return handle.get_tensor(raw)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint file {file.name}: tensor {raw} is unreadable: {exc}") from None

    def _scale(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        # The `weight_scale_inv` of FP8 weight `name`: one multiplier per block, shape checked.
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self._scales:
            file, raw = self._where[name]
            raise CheckpointError(f"checkpoint file {file.name}: fp8 tensor {raw} has no {raw}{SCALE_SUFFIX}")
        file, raw = self._scales[scale_name]
        scale = self._read(self._handles[file], file, raw)
        bn, bk = self.fp8_block
        rows, cols = weight.shape[-2:]
        expected = (*weight.shape[:-2], -(-rows // bn), -(-cols // bk))
        if tuple(scale.shape) != expected:
            raise CheckpointError(
                f"checkpoint file {file.name}: tensor {raw} has shape {list(scale.shape)}, "
                f"expected {list(expected)} "
                f"for {bn}x{bk} blocks"
            )
        self.used.add(scale_name)
        return scale

    def _locate(self, name: str) -> tuple[Path, str]:
        if name not in self._where:
            raise CheckpointError(f"checkpoint {self.path} is missing tensor {self.display(name)}")
        return self._where[name]

    def unused(self) -> list[str]:
        """Text-model tensors nothing asked for (reported, not fatal)."""
        return sorted(self._where.keys() - self.used)
