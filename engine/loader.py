"""Build the model from a checkpoint directory: map each of our parameters to the checkpoint's tensors.

Handles Qwen3.5's separate `in_proj_qkv`/`z`/`b`/`a` and Qwen3-Next's interleaved `in_proj_qkvz`/`in_proj_ba`,
per-expert (`mlp.experts.{e}.*`) or fused (`mlp.experts.gate_up_proj`) expert tensors, and `mtp.*`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from engine.checkpoint import CheckpointReader
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.model.model import CausalLM

log = logging.getLogger(__name__)


def load_model(
    path: str | Path, config: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> CausalLM:
    """Read the checkpoint at `path` into a `CausalLM` on `device` with floating weights in `dtype`."""
    block = config.quantization.block if config.quantization else (128, 128)
    reader = CheckpointReader(path, fp8_block=block)
    num_mtp = count_mtp_layers(reader)
    with torch.device("meta"):
        model = CausalLM(config, num_mtp_layers=num_mtp)
    model.to(dtype)  # cast while on meta: materialising fp32 first would need twice the memory
    model.to_empty(device=device)
    mapper = _Mapper(reader, config, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            mapper.fill(name, param)
    model.reset_buffers()
    model.eval()
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
    def __init__(self, reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype) -> None:
        self.reader = reader
        self.config = config
        self.dtype = dtype

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.reader.get(name, self.dtype, expected=shape)

    def fill(self, name: str, param: torch.Tensor) -> None:
        shape = tuple(param.shape)
        prefix, _, leaf = name.rpartition(".")
        prefix += "."
        if leaf in ("w13", "w2"):
            self._experts(prefix, leaf, param)
            return
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            value = self._qkvz(prefix.removesuffix("in_proj_qkvz."), shape)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            value = self._ba(prefix.removesuffix("in_proj_ba."), shape)
        elif leaf == "conv1d_weight":
            value = self._conv(prefix + "conv1d.weight", shape)
        elif leaf == "norm_weight":
            value = self.read(prefix + "norm.weight", shape)
        elif name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            base = prefix.removesuffix("qkv_proj.")
            c = self.config
            rows = (
                2 * c.num_attention_heads * c.head_dim,
                c.num_key_value_heads * c.head_dim,
                c.num_key_value_heads * c.head_dim,
            )
            value = self._cat([f"{base}{p}.{leaf}" for p in ("q_proj", "k_proj", "v_proj")], rows, shape)
        elif name.endswith("gate_up_proj.weight"):
            base = prefix.removesuffix("gate_up_proj.")
            value = self._cat(
                [base + "gate_proj.weight", base + "up_proj.weight"], (shape[0] // 2,) * 2, shape
            )
        else:
            value = self.read(name, shape)
        param.copy_(value)

    def _cat(self, names: list[str], rows: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([self.read(n, (r, *shape[1:])) for n, r in zip(names, rows, strict=True)], dim=0)

    def _qkvz(self, base: str, shape: tuple[int, ...]) -> torch.Tensor:
        c = self.config
        if self.reader.has(base + "in_proj_qkvz.weight"):
            # Qwen3-Next: per key head group [q (dk) | k (dk) | v (r*dv) | z (r*dv)], r = Hv / Hk.
            fused = self.read(base + "in_proj_qkvz.weight", shape)
            r = c.linear_num_value_heads // c.linear_num_key_heads
            dk, dv, hidden = c.linear_key_head_dim, c.linear_value_head_dim, shape[1]
            groups = fused.view(c.linear_num_key_heads, 2 * dk + 2 * r * dv, hidden)
            q, k, v, z = groups.split((dk, dk, r * dv, r * dv), dim=1)
            return torch.cat([x.reshape(-1, hidden) for x in (q, k, v, z)], dim=0)
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


__all__ = ["CheckpointError", "count_mtp_layers", "load_model"]
