"""Build the model from a checkpoint directory: map each of our parameters to the checkpoint's tensors.

Handles Qwen3.5's separate `in_proj_qkv`/`z`/`b`/`a` and Qwen3-Next's interleaved `in_proj_qkvz`/`in_proj_ba`,
per-expert (`mlp.experts.{e}.*`) or fused (`mlp.experts.gate_up_proj`) expert tensors, and `mtp.*`.
With `quantization="fp8"` the dense projections become `Fp8Linear`s (see `fill_fp8`) and the routed experts
e4m3 buffers with block scales (see `fill_fp8_experts`).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from engine import kernels
from engine.checkpoint import CheckpointReader
from engine.config import ModelConfig
from engine.errors import CheckpointError, EngineError
from engine.model.fp8_linear import (
    Fp8Linear,
    fp8_expert_blocks,
    is_fp8_projection,
    quantize_gate_up,
    use_fp8_experts_,
    use_fp8_linears_,
)
from engine.model.model import CausalLM

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "fp8")


def quantization_mode(value: str | None) -> str | None:
    """None (the checkpoint's weights in the model dtype, FP8 ones dequantised) or "fp8" (FP8 projections and
    routed experts)."""
    mode = str(value or "none").strip().lower()
    if mode not in QUANTIZATIONS:
        raise EngineError(
            f"unknown quantization {value!r} (use fp8 to run the projections and experts in FP8, or none)"
        )
    return None if mode == "none" else mode


def load_model(
    path: str | Path,
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    quantization: str | None = None,
) -> CausalLM:
    """Read the checkpoint at `path` into a `CausalLM` on `device` with floating weights in `dtype`.

    `quantization="fp8"` keeps the dense projections (attention, DeltaNet in/out, shared expert, dense MLP)
    and the routed experts in 128x128 block FP8: an FP8 checkpoint's as stored, a bf16/fp32 checkpoint's
    quantised here. Without it, FP8 weights are dequantised to `dtype`.
    """
    mode = quantization_mode(quantization)
    block = config.quantization.block if config.quantization else (128, 128)
    reader = CheckpointReader(path, fp8_block=block)
    num_mtp = count_mtp_layers(reader)
    with torch.device("meta"):
        model = CausalLM(config, num_mtp_layers=num_mtp)
    model.to(dtype)  # cast while on meta: materialising fp32 first would need twice the memory
    mapper = _Mapper(reader, config, dtype, block)
    fp8 = mapper.fp8_projections(model) if mode == "fp8" else []
    use_fp8_linears_(model, fp8, block)  # after the cast: Module.to(dtype) would cast e4m3 buffers too
    experts = fp8_expert_blocks(model) if mode == "fp8" else []
    use_fp8_experts_(model, experts, block)  # w13, w2: no longer parameters, filled below
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            mapper.fill(name, param)
        kinds = Counter(mapper.fill_fp8(name, model.get_submodule(name)) for name in fp8)
        expert_kinds = Counter(how for name in experts for how in mapper.fill_fp8_experts(name, model))
    model.reset_buffers()
    model.eval()
    if fp8:
        log.info(
            "fp8 dense projections: %d as stored, %d requantised, %d quantised at load",
            kinds["stored"],
            kinds["requantised"],
            kinds["quantised"],
        )
    if experts:
        log.info(
            "fp8 routed experts (checkpoint tensors): %d as stored, %d requantised, %d quantised at load",
            expert_kinds["stored"],
            expert_kinds["requantised"],
            expert_kinds["quantised"],
        )
    unused = reader.unused()
    if unused:
        log.warning("checkpoint %s: %d tensors not used, e.g. %s", path, len(unused), ", ".join(unused[:3]))
    return model


def count_mtp_layers(reader: CheckpointReader) -> int:
    """Number of MTP decoder layers whose tensors the checkpoint holds (0 when it has no usable head)."""
    if not reader.has("mtp.fc.weight"):
        return 0
    indices = {int(m.group(1)) for n in reader.names() if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    return max(indices) + 1 if indices else 0


class _Mapper:
    def __init__(
        self, reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype, block: tuple[int, int]
    ) -> None:
        self.reader = reader
        self.config = config
        self.dtype = dtype
        self.block = block
        self._read: Callable[[str, tuple[int, ...]], torch.Tensor] = self._read_as_dtype
        self._seen: list[str] = []  # checkpoint tensors read since the last _reading()

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._read(name, shape)

    def _read_as_dtype(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.reader.get(name, self.dtype, expected=shape)

    def _read_meta(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        self._seen.append(name)
        return torch.empty(shape, device="meta")

    def _read_rows(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # [rows, K + KB] fp32: each weight row, then its scale per K block (1 for a bf16/fp32 source). e4m3
        # values are exact in fp32, and the row operations of `value` (cat, de-interleave) carry each row's
        # scales along with it.
        self._seen.append(name)
        bn, bk = self.block
        if self.reader.is_fp8(name):
            weight, scale = self.reader.get_fp8(name, expected=shape)
            return torch.cat([weight.float(), scale.repeat_interleave(bn, dim=0)[: shape[0]]], dim=1)
        ones = torch.ones(shape[0], -(-shape[1] // bk))
        return torch.cat([self.reader.get(name, torch.float32, expected=shape), ones], dim=1)

    @contextmanager
    def _reading(self, read: Callable[[str, tuple[int, ...]], torch.Tensor]) -> Iterator[None]:
        self._read, self._seen = read, []
        try:
            yield
        finally:
            self._read = self._read_as_dtype

    def fill(self, name: str, param: torch.Tensor) -> None:
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("w13", "w2"):
            self._experts(prefix + ".", leaf, param)
            return
        param.copy_(self.value(name, tuple(param.shape)))

    def fp8_projections(self, model: nn.Module) -> list[str]:
        """The dense projections to run in FP8: all of them for a bf16/fp32 checkpoint (quantised at load);
        for an FP8 checkpoint, those it stores in FP8 (what it keeps in bf16, its `modules_to_not_convert`,
        stays in the model dtype)."""
        names = [n for n, m in model.named_modules() if is_fp8_projection(n, m)]
        if not self.reader.has_fp8():
            return names
        chosen = []
        for name in names:
            with self._reading(self._read_meta):
                self.value(name + ".weight", tuple(model.get_submodule(name).weight.shape))
            if any(self.reader.is_fp8(source) for source in self._seen):
                chosen.append(name)
        return chosen

    def fill_fp8(self, name: str, module: Fp8Linear) -> str:
        """Fill `module`'s e4m3 weight and block scales. Returns "stored" (the checkpoint's FP8 blocks as they
        are), "requantised" or "quantised" (from a bf16/fp32 checkpoint).

        A fused weight (e.g. `in_proj_qkvz` = [qkv | z]) keeps its parts' blocks only if every part before
        the last has a multiple of 128 rows (true at Qwen3.5's real sizes); otherwise a 128-row block would
        need two scales, so the fused weight is dequantised and quantised again (tiny test configs): correct,
        with one more rounding.
        """
        n, k = module.weight.shape
        bn, bk = self.block
        with self._reading(self._read_rows):
            rows = self.value(name + ".weight", (n, k)).to(module.weight.device)  # [N, K + KB]
        fp8 = [self.reader.is_fp8(source) for source in self._seen]
        values, row_scales = rows[:, :k], rows[:, k:]
        scale = row_scales[::bn]  # [NB, KB]: the first row's scales in each block of bn rows
        if all(fp8) and torch.equal(row_scales, scale.repeat_interleave(bn, dim=0)[:n]):
            weight, how = values.to(torch.float8_e4m3fn), "stored"
        else:
            full = values * row_scales.repeat_interleave(bk, dim=1)[:, :k]
            weight, scale = kernels.quantize_block_fp8_weight(full, self.block)
            how = "requantised" if any(fp8) else "quantised"
        module.weight.copy_(weight)
        module.weight_scale_inv.copy_(scale)
        return how

    def fill_fp8_experts(self, name: str, model: nn.Module) -> list[str]:
        """Fill the e4m3 experts of SparseMoe `name` (after `use_fp8_experts_`) and their block scales.
        Returns, per checkpoint tensor read, "stored" (its FP8 blocks as they are), "requantised" or
        "quantised".

        Per-expert gate_proj and up_proj scales stack into the gate-then-up layout as they are, for any I. A
        fused FP8 `gate_up_proj` keeps its blocks when bn divides I (Qwen3.5's 512); otherwise one block holds
        gate and up rows, so it is dequantised and each half quantised again (tiny test configs).
        """
        moe = model.get_submodule(name)
        base = name + ".experts."
        e, two_i, h = moe.w13.shape
        i = two_i // 2
        hows = []
        if self.reader.has(base + "gate_up_proj"):
            hows.append(self._fused_gate_up(base + "gate_up_proj", moe.w13, moe.w13_scale_inv))
        else:
            for x in range(e):
                gate = self._fp8_tensor(f"{base}{x}.gate_proj.weight", (i, h), moe.w13.device)
                up = self._fp8_tensor(f"{base}{x}.up_proj.weight", (i, h), moe.w13.device)
                moe.w13[x] = torch.cat([gate[0], up[0]])
                moe.w13_scale_inv[x] = torch.cat([gate[1], up[1]])
                hows += [gate[2], up[2]]
        if self.reader.has(base + "down_proj"):
            stacked = self._fp8_tensor(base + "down_proj", tuple(moe.w2.shape), moe.w2.device, stack=True)
            moe.w2.copy_(stacked[0])
            moe.w2_scale_inv.copy_(stacked[1])
            hows.append(stacked[2])
        else:
            for x in range(e):
                moe.w2[x], moe.w2_scale_inv[x], how = self._fp8_tensor(
                    f"{base}{x}.down_proj.weight", (h, i), moe.w2.device
                )
                hows.append(how)
        return hows

    def _fp8_tensor(
        self, name: str, shape: tuple[int, ...], device: torch.device, stack: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, str]:
        # (e4m3 weight, fp32 block scales, how): FP8 as stored, else quantised on `device` (a stacked [E, ...]
        # tensor one expert at a time, so the fp32 temporaries stay one expert's size).
        if self.reader.is_fp8(name):
            weight, scale = self.reader.get_fp8(name, expected=shape)
            return weight.to(device), scale.to(device), "stored"
        full = self.reader.get(name, torch.float32, expected=shape)
        if not stack:
            return (*kernels.quantize_block_fp8_weight(full.to(device), self.block), "quantised")
        parts = [kernels.quantize_block_fp8_weight(w.to(device), self.block) for w in full]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]), "quantised"

    def _fused_gate_up(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> str:
        # experts.gate_up_proj [E, 2I, H] into e4m3 `weight` and gate-then-up `scale` (see fill_fp8_experts).
        bn = self.block[0]
        inter = weight.shape[1] // 2
        if self.reader.is_fp8(name):
            stored, stored_scale = self.reader.get_fp8(name, expected=tuple(weight.shape))
            if inter % bn == 0:  # the halves' block rows are the stacked weight's
                weight.copy_(stored)
                scale.copy_(stored_scale)
                return "stored"
            full = kernels.dequantize_block_fp8(stored, stored_scale, self.block, torch.float32)
            how = "requantised"
        else:
            full, how = self.reader.get(name, torch.float32, expected=tuple(weight.shape)), "quantised"
        for x in range(weight.shape[0]):
            weight[x], scale[x] = quantize_gate_up(full[x].to(weight.device), self.block)
        return how

    def value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Our tensor `name` of `shape`, from the checkpoint's tensors (concatenated or de-interleaved)."""
        prefix, _, leaf = name.rpartition(".")
        prefix += "."
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            return self._qkvz(prefix.removesuffix("in_proj_qkvz."), shape)
        if name.endswith("linear_attn.in_proj_ba.weight"):
            return self._ba(prefix.removesuffix("in_proj_ba."), shape)
        if leaf == "conv1d_weight":
            return self._conv(prefix + "conv1d.weight", shape)
        if leaf == "norm_weight":
            return self.read(prefix + "norm.weight", shape)
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            base = prefix.removesuffix("qkv_proj.")
            c = self.config
            rows = (
                2 * c.num_attention_heads * c.head_dim,
                c.num_key_value_heads * c.head_dim,
                c.num_key_value_heads * c.head_dim,
            )
            return self._cat([f"{base}{p}.{leaf}" for p in ("q_proj", "k_proj", "v_proj")], rows, shape)
        if name.endswith("gate_up_proj.weight"):
            base = prefix.removesuffix("gate_up_proj.")
            return self._cat(
                [base + "gate_proj.weight", base + "up_proj.weight"], (shape[0] // 2,) * 2, shape
            )
        return self.read(name, shape)

    def _cat(self, names: list[str], rows: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([self.read(n, (r, *shape[1:])) for n, r in zip(names, rows, strict=True)], dim=0)

    def _qkvz(self, base: str, shape: tuple[int, ...]) -> torch.Tensor:
        c = self.config
        if self.reader.has(base + "in_proj_qkvz.weight"):
            # Qwen3-Next: per key head group [q (dk) | k (dk) | v (r*dv) | z (r*dv)], r = Hv / Hk.
            fused = self.read(base + "in_proj_qkvz.weight", shape)
            r = c.linear_num_value_heads // c.linear_num_key_heads
            dk, dv, width = c.linear_key_head_dim, c.linear_value_head_dim, fused.shape[1]  # width: K (+ KB)
            groups = fused.view(c.linear_num_key_heads, 2 * dk + 2 * r * dv, width)
            q, k, v, z = groups.split((dk, dk, r * dv, r * dv), dim=1)
            return torch.cat([x.reshape(-1, width) for x in (q, k, v, z)], dim=0)
        return self._cat(
            [base + "in_proj_qkv.weight", base + "in_proj_z.weight"],
            (c.linear_conv_dim, c.linear_value_dim),
            shape,
        )

    def _ba(self, base: str, shape: tuple[int, ...]) -> torch.Tensor:
        c = self.config
        hv = c.linear_num_value_heads
        if self.reader.has(base + "in_proj_ba.weight"):
            # Qwen3-Next: per key head group [b (r) | a (r)].
            fused = self.read(base + "in_proj_ba.weight", shape)
            r = hv // c.linear_num_key_heads
            groups = fused.view(c.linear_num_key_heads, 2 * r, shape[1])
            b, a = groups.split((r, r), dim=1)
            return torch.cat([b.reshape(hv, -1), a.reshape(hv, -1)], dim=0)
        return self._cat([base + "in_proj_b.weight", base + "in_proj_a.weight"], (hv, hv), shape)

    def _conv(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # Stored as nn.Conv1d's [C, 1, K]; some exports squeeze it to [C, K].
        if self.reader.has(name) and len(self.reader.shape(name)) == 2:
            return self.read(name, shape)
        return self.read(name, (shape[0], 1, shape[1]))[:, 0]

    def _experts(self, prefix: str, leaf: str, param: torch.Tensor) -> None:
        num, *rest = param.shape
        base = prefix + "experts."
        fused = base + ("gate_up_proj" if leaf == "w13" else "down_proj")
        if self.reader.has(fused):
            param.copy_(self.read(fused, tuple(param.shape)))
            return
        for e in range(num):
            if leaf == "w13":
                inter = rest[0] // 2
                names = [f"{base}{e}.gate_proj.weight", f"{base}{e}.up_proj.weight"]
                param[e].copy_(self._cat(names, (inter, inter), tuple(rest)))
            else:
                param[e].copy_(self.read(f"{base}{e}.down_proj.weight", tuple(rest)))


__all__ = ["CheckpointError", "count_mtp_layers", "load_model", "quantization_mode"]
