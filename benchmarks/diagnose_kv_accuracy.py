"""Diagnostic (not a benchmark): where `engine.bench.kv_accuracy` goes non-finite or diverges on a GPU.

    python benchmarks/diagnose_kv_accuracy.py        (CUDA; about a minute on an H200)

On the H200 at a83eb24 the demo model's bf16 baseline in `kv_accuracy` (direct model calls outside `Engine`)
gave NaN logits, and the 35B random preset's FP8 cache agreed with the bf16 one on 30.5% of tokens. This
prints, for the demo model (built by an `Engine`, then called directly) and a fresh random model of its
geometry, whether each decoder layer's output is finite over a 4 x 256 prefill and a decode step, then
`measure` with the model-dtype cache against itself (the noise floor: any error there is a read of memory
no step wrote) and with the FP8 cache; then the same for the 35B preset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from any directory

from engine import Engine
from engine.bench.kv_accuracy import _Run, measure
from engine.bench.presets import PRESETS, random_model
from engine.config import config_from_dict
from engine.demo_model import write_demo_model


def finite_layers(model, prompts: torch.Tensor) -> None:
    seen: list[tuple[int, bool]] = []

    def hook(index: int):
        def record(module, inputs, output):
            out = output if torch.is_tensor(output) else output[0]
            seen.append((index, bool(torch.isfinite(out).all())))

        return record

    hooks = [layer.register_forward_hook(hook(j)) for j, layer in enumerate(model.model.layers)]
    run = _Run(model, prompts.shape[0], prompts.shape[1] + 8, model.model.embed_tokens.weight.dtype)
    first = run.step(prompts)
    second = run.step(first.argmax(-1)[:, None])
    for h in hooks:
        h.remove()
    bad = [i for i, ok in seen if not ok]
    finite = [bool(torch.isfinite(t).all()) for t in (first, second)]
    print(f"  logits finite: prefill {finite[0]}, decode {finite[1]}")
    print(f"  first non-finite layer outputs (call order): {bad[:5] or 'none'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="demo model decode steps (the gpu test: 256)")
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    with Engine.from_pretrained(write_demo_model("/tmp/demo-kv"), device="cuda", dtype="bfloat16") as e:
        demo = e.model
    prompts = torch.randint(0, demo.config.vocab_size, (4, 256), generator=g).to(device)
    print("demo model (from an Engine)")
    finite_layers(demo, prompts)
    for kv in ("auto", "fp8"):
        print(f"  {kv}: {measure(demo, prompts, tokens=args.tokens, kv=kv)}", flush=True)
    fresh = random_model(demo.config, device, torch.bfloat16, 0)
    print("random model of the demo's geometry (no Engine)")
    finite_layers(fresh, prompts)
    del demo, fresh
    config = config_from_dict(PRESETS["qwen3.5-35b-a3b"]())
    big = random_model(config, device, torch.bfloat16, 0)
    prompts = torch.randint(0, config.vocab_size, (4, 256), generator=g).to(device)
    print("qwen3.5-35b-a3b preset")
    finite_layers(big, prompts)
    for kv in ("auto", "auto", "fp8"):
        print(f"  {kv}: {measure(big, prompts, tokens=24, kv=kv)}", flush=True)


if __name__ == "__main__":
    main()
