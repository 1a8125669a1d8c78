"""bf16 accuracy measured the only fair way: against the reference's own bf16 error on the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import Engine
from tests.engine.factories import single_cache


@dataclass
class Bf16Report:
    ours_rel_err: float  # mean over positions of ||logits - fp32 reference|| / ||fp32 reference||
    reference_rel_err: float  # the same for transformers in bf16
    ours_argmax_agree: float  # fraction of positions whose argmax equals the fp32 reference's
    reference_argmax_agree: float


@torch.no_grad()
def all_position_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    cache, layout = single_cache(engine.config, n, engine.device, engine.dtype)
    hidden = engine.model(torch.tensor(ids, device=engine.device), layout(n), cache)
    return engine.model.logits(engine.model.final_norm(hidden)).cpu()


@torch.no_grad()
def bf16_report(path, device: str, prompts: list[list[int]]) -> Bf16Report:
    from transformers import AutoModelForCausalLM

    def load(dtype):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager")
        return model.to(device).eval()

    ref32, ref16 = load(torch.float32), load(torch.bfloat16)
    ours = Engine.from_pretrained(path, device=device, dtype="bfloat16")
    errs, ref_errs, agree, ref_agree = [], [], [], []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        a = ref32(input_ids=x).logits[0].float().cpu()
        b = ref16(input_ids=x).logits[0].float().cpu()
        o = all_position_logits(ours, ids)
        errs.append((o - a).norm(dim=-1) / a.norm(dim=-1))
        ref_errs.append((b - a).norm(dim=-1) / a.norm(dim=-1))
        agree.append((o.argmax(-1) == a.argmax(-1)).float())
        ref_agree.append((b.argmax(-1) == a.argmax(-1)).float())
    return Bf16Report(*(torch.cat(xs).mean().item() for xs in (errs, ref_errs, agree, ref_agree)))
