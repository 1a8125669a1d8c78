"""`make demo` for the engine: write the random demo checkpoint, load it and print a few generations.

python -m engine.demo [--model DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from engine import Engine, EngineError, SamplingParams
from engine.demo_model import LABEL, write_demo_model

CONVERSATIONS = [
    [{"role": "user", "content": "Summarise the discharge note for the referring physician."}],
    [
        {"role": "system", "content": "Return JSON only."},
        {"role": "user", "content": "Extract: name, diagnosis."},
    ],
    [{"role": "user", "content": "Review this code for bugs: def main(argv): return 1"}],
]


def run(model_dir: str) -> None:
    start = time.perf_counter()
    engine = Engine.from_pretrained(model_dir, device="cpu", dtype="float32")
    print(
        f"loaded {model_dir} in {time.perf_counter() - start:.2f}s: {engine.config.model_type}, "
        f"{engine.config.num_hidden_layers} layers {list(engine.config.layer_types)}, "
        f"{engine.config.num_experts} experts, MTP head: {'yes' if engine.has_mtp else 'no'}"
    )
    settings = [
        ("greedy", SamplingParams(max_tokens=24, temperature=0.0)),
        ("T=0.8 top-p 0.9 seed 7", SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)),
    ]
    for name, params in settings:
        start = time.perf_counter()
        outs = engine.chat(CONVERSATIONS, params)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.token_ids) for o in outs)
        print(
            f"\n{name}: {len(outs)} prompts batched, {generated} tokens in {elapsed:.2f}s "
            f"({generated / elapsed:.0f} tokens/s on CPU)"
        )
        print(f"  {'#':<2} {'prompt':>6} {'out':>4} {'finish':<7} text")
        for o in outs:
            text = (o.text or "")[:60]
            print(
                f"  {o.index:<2} {o.prompt_token_count:>6} {len(o.token_ids):>4} "
                f"{o.finish_reason:<7} {text!r}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate with the engine on the random demo checkpoint.")
    parser.add_argument("--model", help="checkpoint directory (default: write the demo model to a temp dir)")
    args = parser.parse_args(argv)
    print(f"Enclave engine demo. {LABEL}.")
    try:
        if args.model:
            run(args.model)
        else:
            with tempfile.TemporaryDirectory(prefix="enclave-demo-model-") as tmp:
                write_demo_model(tmp)
                run(tmp)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
