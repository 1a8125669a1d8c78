"""How far a narrower cache moves the model's outputs from the full one: an FP8 KV cache (issue 19, item 2),
or bf16 recurrent states rather than fp32 ones (issue 13).

    python -m engine.bench.kv_accuracy [--preset tiny | --preset qwen3.5-35b-a3b | --model PATH]
        [--seqs 8] [--prompt-len 512] [--tokens 256] [--device cuda] [--dtype bfloat16] [--json PATH]
        [--kv-cache-dtype fp8|auto] [--state-dtype auto|float32|bfloat16]

Three runs step in lockstep over the same random prompts, each with its own cache: the baseline (KV in the
model's dtype, fp32 recurrent states) decodes greedily; a teacher-forced run with the cache under test
(default: FP8 KV, fp32 states) is fed the baseline's tokens, so at every step both see the same inputs and
their logits compare directly (max and mean absolute error, and whether the top-1 token agrees:
`greedy_agreement`); a free-running run with that cache decodes its own tokens, and `first_divergence` says
how many of them matched the baseline's before the first difference. Each step's
largest error is kept too: its median and 99th percentile show the typical step, while the max is often
one step where the perturbation flipped a token's top-k experts (an O(1) jump, as any perturbation can
cause; measured on the demo model, issue 19). The model is called directly (prefill of every prompt, then
one decode step per token, no CUDA graphs), so the kernels are the ones `ENCLAVE_KERNELS` picks: the torch
reference on the CPU, Triton on CUDA (with ENCLAVE_FP8_ATTENTION=1 the FP8 runs' prefill uses e4m3
products too).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.cache import ModelCache, kv_cache_dtype, state_dtype
from engine.kernels import SeqLayout
from engine.model.model import CausalLM

BLOCK_SIZE = 16


@dataclass(frozen=True)
class KvAccuracy:
    """The cache under test against the baseline cache over `seqs` sequences of `tokens` greedy steps."""

    seqs: int
    prompt_len: int
    tokens: int
    greedy_agreement: float  # teacher-forced: share of steps whose top-1 token equals the baseline's
    free_run_agreement: float  # free-running: mean share of tokens before the first difference
    first_divergence: list[int]  # per sequence: tokens equal to the baseline's before the first difference
    max_logit_error: float  # teacher-forced, over every step and vocabulary entry
    step_error_median: float  # of each step's max |logit error| (over sequences and vocabulary)
    step_error_p99: float
    mean_logit_error: float
    logit_std: float  # of the baseline's logits: the scale the errors compare to
    max_top1_logit_error: float  # at the baseline's chosen token, the one that matters for greedy
    # Steps whose baseline logits hold a NaN or an infinity (any one makes the errors and the std NaN), and
    # the first of them (None: every step finite).
    nonfinite_steps: int = 0
    first_nonfinite_step: int | None = None


class _Run:
    """One cache and its sequences' positions, stepped by `step`."""

    def __init__(
        self,
        model: CausalLM,
        seqs: int,
        capacity: int,
        kv_dtype: torch.dtype,
        states: torch.dtype = torch.float32,
    ) -> None:
        per_seq = -(-capacity // BLOCK_SIZE)
        dtype = model.model.embed_tokens.weight.dtype
        device = model.inv_freq.device
        self.model = model
        self.cache = ModelCache(
            model.config, seqs, seqs * per_seq, BLOCK_SIZE, device, dtype, 0, kv_dtype, states
        )
        self.tables = tuple(tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs))
        self.context = 0

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, n] (the next n tokens of every sequence) -> [B, V] fp32 logits of each one's last."""
        b, n = ids.shape
        layout = SeqLayout((n,) * b, (self.context,) * b, tuple(range(b)), self.tables, BLOCK_SIZE)
        hidden = self.model(ids.flatten(), layout, self.cache)
        self.context += n
        last = hidden.view(b, n, -1)[:, -1]
        return self.model.logits(self.model.final_norm(last))


def measure(
    model: CausalLM, prompts: torch.Tensor, tokens: int, kv: str = "fp8", state: str = "auto"
) -> KvAccuracy:
    """Compare the cache of option values `kv` (`kv_cache_dtype`) and `state` (`state_dtype`) with KV in the
    model's dtype and fp32 states over `tokens` greedy steps after the prompts [B, P] (token ids on the
    model's device)."""
    dtype = model.model.embed_tokens.weight.dtype
    seqs, prompt_len = prompts.shape
    capacity = prompt_len + tokens
    test = (kv_cache_dtype(kv, dtype), state_dtype(state, model.config))
    base = _Run(model, seqs, capacity, dtype)
    forced, free = (_Run(model, seqs, capacity, *test) for _ in range(2))
    ref, got, own = base.step(prompts), forced.step(prompts), free.step(prompts)
    agree = torch.zeros(seqs, dtype=torch.long, device=prompts.device)
    diverged = torch.full((seqs,), tokens, dtype=torch.long, device=prompts.device)
    mean_err = top1_err = var = 0.0
    step_errors: list[float] = []
    nonfinite: list[int] = []
    for i in range(tokens):
        if not torch.isfinite(ref).all():
            nonfinite.append(i)
        chosen = ref.argmax(-1)  # [B]
        err = (got - ref).abs()
        step_errors.append(err.max().item())
        mean_err += err.mean().item() / tokens
        top1_err = max(top1_err, err.gather(1, chosen[:, None]).max().item())
        var += ref.var(-1).mean().item() / tokens
        agree += got.argmax(-1) == chosen
        mine = own.argmax(-1)
        first = (mine != chosen) & (diverged == tokens)
        diverged[first] = i
        if i + 1 < tokens:
            ref, got = base.step(chosen[:, None]), forced.step(chosen[:, None])
            own = free.step(mine[:, None])
    divergence = diverged.tolist()
    return KvAccuracy(
        seqs=seqs,
        prompt_len=prompt_len,
        tokens=tokens,
        greedy_agreement=agree.sum().item() / (seqs * tokens),
        free_run_agreement=sum(divergence) / (seqs * tokens),
        first_divergence=divergence,
        max_logit_error=max(step_errors),
        step_error_median=_quantile(step_errors, 0.5),
        step_error_p99=_quantile(step_errors, 0.99),
        mean_logit_error=mean_err,
        logit_std=var**0.5,
        max_top1_logit_error=top1_err,
        nonfinite_steps=len(nonfinite),
        first_nonfinite_step=nonfinite[0] if nonfinite else None,
    )


def _quantile(values: list[float], q: float) -> float:
    return torch.tensor(values, dtype=torch.float64).quantile(q).item()


def table(result: KvAccuracy) -> str:
    rows = [
        ("sequences x tokens", f"{result.seqs} x {result.tokens} (prompts of {result.prompt_len})"),
        ("greedy agreement (teacher-forced)", f"{100 * result.greedy_agreement:.2f}%"),
        ("greedy agreement (free run, to first difference)", f"{100 * result.free_run_agreement:.2f}%"),
        ("first divergence per sequence", ", ".join(map(str, result.first_divergence))),
        ("max |logit error|", f"{result.max_logit_error:.4g}"),
        (
            "each step's max |logit error|: median, p99",
            f"{result.step_error_median:.4g}, {result.step_error_p99:.4g}",
        ),
        ("mean |logit error|", f"{result.mean_logit_error:.4g}"),
        ("max |logit error| at the chosen token", f"{result.max_top1_logit_error:.4g}"),
        ("baseline logit std", f"{result.logit_std:.4g}"),
        (
            "baseline steps with non-finite logits (first)",
            f"{result.nonfinite_steps} ({result.first_nonfinite_step})",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine.bench.presets import PRESETS
    from engine.bench.settings import DTYPES
    from engine.options import KV_CACHE_DTYPES, STATE_DTYPES

    parser = argparse.ArgumentParser(
        prog="python -m engine.bench.kv_accuracy", description=__doc__.split("\n")[0]
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    source.add_argument("--model", help="a checkpoint directory instead of a preset")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--device", help="default: cuda when available")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, else float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="fp8", help="of the cache under test"
    )
    parser.add_argument(
        "--state-dtype",
        choices=STATE_DTYPES,
        default="auto",
        help="of the cache under test's recurrent states (the baseline's are fp32)",
    )
    parser.add_argument("--json", default="", help="write the result here as JSON")
    args = parser.parse_args(argv)
    args.quantization = "none"
    args.long_prompt = None  # `cli.load` reads these: one window, no long-prompt lengths
    args.workloads = ""
    return args


def main(argv: list[str] | None = None) -> int:
    from engine.bench.cli import load
    from engine.bench.settings import DTYPES

    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model, config, _ = load(args, device, dtype)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, config.vocab_size, (args.seqs, args.prompt_len), generator=g).to(device)
    result = measure(model, prompts, args.tokens, args.kv_cache_dtype, args.state_dtype)
    print(table(result))
    if args.json:
        source = args.model or f"preset {args.preset} (random weights, seed {args.seed})"
        tested = {"kv_cache_dtype": args.kv_cache_dtype, "state_dtype": args.state_dtype}
        report = {"source": source, "device": str(device), "dtype": str(dtype), **tested, **asdict(result)}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
