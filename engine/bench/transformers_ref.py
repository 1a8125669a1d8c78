"""Workload (g): transformers' Qwen3_5MoeForCausalLM with the same geometry and random weights, timed
through `generate`, against our decode rates."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.bench.device import free, wall_time
from engine.bench.harness import Bench
from engine.bench.measure import describe, guarded
from engine.bench.presets import init_parameter_
from engine.bench.traffic import roofline, step_bytes

log = logging.getLogger(__name__)


def transformers_comparison(
    b: Bench, raw: dict[str, Any], ours: dict[str, Any]
) -> list[dict[str, Any]] | dict:
    """(g) Qwen3_5MoeForCausalLM with the same geometry and random weights through `generate`, for (a) and
    (b, 64), and our decode tok/s over theirs. Run after our model was freed (`b.model` is None)."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed"}
    if b.config.model_type == "qwen3_next":
        return {"skipped": "the transformers comparison is built for qwen3_5_moe geometries"}
    try:
        model = _transformers_model(raw, b.device, b.dtype, b.settings.seed)
    except Exception as exc:  # out of memory, or a transformers version without the class
        log.warning("building the transformers model failed", exc_info=True)
        return {"error": describe(exc), "transformers": transformers.__version__}
    points = _transformers_points(b, model)
    del model
    free(b.device)
    mine = [_point_rate(ours.get("a"), "1 x"), _point_rate(ours.get("b"), "batch 64")]
    for point, our_rate in zip(points, mine, strict=True):
        point["transformers"] = transformers.__version__
        rate = point.get("tokens_per_s")
        if rate:
            bytes_ = step_bytes(
                b.counts, b.config, b.dtype, seqs=point["batch"], context=point["mean_context"]
            )
            point |= roofline(bytes_, point["batch"], rate, b.bandwidth)
            point["ours_over_transformers"] = our_rate / rate if our_rate else None
            ratio = f"; ours/transformers {point['ours_over_transformers']:.2f}x" if our_rate else ""
            point["note"] = f"{point['ms_per_step']:.1f} ms/step{ratio}"
    return points


def _transformers_points(b: Bench, model) -> list[dict[str, Any]]:
    s = b.sizes
    implementation = {
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    single = guarded("a: single stream", lambda: _hf_point(b, model, 1, s.single_prompt, s.single_new))
    batch = guarded("b: batch 64", lambda: _hf_point(b, model, 64, s.batch_prompt, s.batch_steps + 1))
    return [single | implementation, batch | implementation]


def _transformers_model(raw: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    skip = ("model_type", "architectures", "dtype", "torch_dtype", "mtp_num_hidden_layers", "eos_token_id")
    hf_config = Qwen3_5MoeTextConfig(**{k: v for k, v in raw.items() if k not in skip})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        init_parameter_(name, p, g)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def _hf_point(b: Bench, model, batch: int, prompt_len: int, new: int) -> dict[str, Any]:
    """Decode tok/s from two greedy `generate` calls: one new token (the prefill) and `new` tokens."""
    device = b.device
    g = torch.Generator().manual_seed(b.settings.seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def generate(count: int, max_time: float | None = None) -> torch.Tensor:
        kwargs = {"max_time": max_time} if max_time else {}
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=count, do_sample=False, pad_token_id=0, **kwargs
        )

    generate(2)  # warm-up
    first = wall_time(lambda: generate(1), device)
    out: list[torch.Tensor] = []
    total = wall_time(lambda: out.append(generate(new, max_time=b.settings.max_seconds)), device)
    made = out[0].shape[1] - prompt_len
    decode_s = total - first
    tokens_per_s = batch * (made - 1) / decode_s if made > 1 and decode_s > 0 else None
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": made,
        "prefill_s": first,
        "decode_s": decode_s,
        "tokens_per_s": tokens_per_s,
        "ms_per_step": 1e3 * decode_s / (made - 1) if made > 1 else None,
        "mean_context": prompt_len + made / 2,
        "capped": made < new,
    }


def _point_rate(points: list[dict[str, Any]] | None, label: str) -> float | None:
    for point in points or []:
        if point.get("label", "").startswith(label):
            return point.get("tokens_per_s")
    return None
