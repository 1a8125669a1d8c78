"""What a grammar mask costs on the host: llguidance filling a step's bitmasks, per schema, batch and thread
count, over the model's full vocabulary (the bench's synthetic byte-level tokenizer, 248,320 tokens).

    python benchmarks/grammar_fill.py [--batches 1,64,256] [--threads 1,8] [--pools llguidance,python]
        [--groups auto,1] [--steps 24] [--json F]

Each row starts at the schema's beginning and is advanced by tokens drawn from what its mask allows
(preferring tokens that keep a string or an array open, so rows stay inside the long fields): first up to
`spread` tokens alone (row r by r * 37 % spread), so the rows sit at different places of the schema as in a
running batch, then `warm` steps all together, then `steps` steps are timed: the fill of every row's mask
(`GrammarCompiler.fill`, from 8 rows in the pool `--pools` names: llguidance's or Python threads) and the
matchers' advance by one token each (`accept`, what the engine does when it reads a step's tokens).
`--groups` sets the compiler's lexer groups (auto: one per thread, the engine's; 1: every matcher a copy of
one compiled matcher, sharing its lexer and its mutex, as the engine filled before 2026-12-05).
Schemas: `k`, bench (k)'s mid-size schema; `fixed_4096`, the same with its last field a string of exactly
4,096 characters (what (k) used before 2026-12-05); `free_string`, the same with one unbounded string. No GPU
is needed: on the H200's host this measures that host's cores. Prints one table and writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench.constrained import SCHEMA, synthetic_tokenizer
from engine.constraints import Constraint
from engine.grammar import FILL_POOL, FILL_POOLS, GrammarCompiler, allocate_bitmask

VOCAB = 248_320
CLOSERS = ('"', "]", "}")  # tokens holding one of these may end a string, an array or the object


def schemas() -> dict[str, dict]:
    fixed = copy.deepcopy(SCHEMA)
    fixed["properties"]["notes"] = {"type": "string", "minLength": 4096, "maxLength": 4096}
    free = copy.deepcopy(SCHEMA)
    free["properties"]["notes"] = {"type": "string"}
    return {"k": SCHEMA, "fixed_4096": fixed, "free_string": free}


def allowed_tokens(bitmask: torch.Tensor, row: int) -> torch.Tensor:
    bits = (bitmask[row].view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.flatten()[:VOCAB].nonzero().flatten()


def pick(allowed: torch.Tensor, texts: list[str], g: torch.Generator) -> int:
    """A random allowed token, one without a closer when any of 16 draws has none."""
    draws = allowed[torch.randint(len(allowed), (16,), generator=g)].tolist()
    return next((t for t in draws if not any(c in texts[t] for c in CLOSERS)), draws[0])


def measure(
    name, schema, batch, threads, steps, warm, spread, texts, tok, pool=FILL_POOL, groups=None
) -> dict:
    compiler = GrammarCompiler(tok, VOCAB, [VOCAB - 1], threads=threads, pool=pool, groups=groups)
    states = [compiler.state(Constraint.json_schema(schema)) for _ in range(batch)]
    bitmask = allocate_bitmask(batch, VOCAB, pin=False)
    rows = list(range(batch))
    g = torch.Generator().manual_seed(batch)
    for r, state in enumerate(states):
        for _ in range(r * 37 % spread if spread else 0):
            compiler.fill([state], bitmask, [r])
            state.accept(pick(allowed_tokens(bitmask, r), texts, g))
    fills, accepts = [], []
    for step in range(warm + steps):
        start = time.perf_counter()
        compiler.fill(states, bitmask, rows)
        filled = time.perf_counter()
        chosen = [pick(allowed_tokens(bitmask, r), texts, g) for r in rows]
        begin = time.perf_counter()
        for state, token in zip(states, chosen, strict=True):
            if not state.done:
                state.accept(token)
        if step >= warm:
            fills.append(filled - start)
            accepts.append(time.perf_counter() - begin)
    fill_ms = 1e3 * statistics.median(fills)
    return {
        "schema": name,
        "batch": batch,
        "spread": spread,
        "threads": threads,
        "pool": pool,
        "lexer_groups": compiler.groups,
        "fill_ms": fill_ms,
        "fill_p90_ms": 1e3 * sorted(fills)[int(0.9 * (len(fills) - 1))],
        "us_per_mask": 1e3 * fill_ms / batch,
        "accept_ms": 1e3 * statistics.median(accepts),
        "finished_rows": sum(s.done for s in states),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--threads", default=f"1,{min(8, os.cpu_count() or 1)}")
    parser.add_argument("--schemas", default="k,fixed_4096,free_string")
    parser.add_argument("--pools", default=FILL_POOL, help=f"fill pools to time, of {','.join(FILL_POOLS)}")
    parser.add_argument(
        "--groups",
        default="auto",
        help="lexer groups per run, comma-separated: auto (one per thread, the engine's) or a number; 1 is "
        "every matcher sharing one lexer, as the engine filled before 2026-12-05",
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--spread", type=int, default=80, help="row r first advances r * 37 %% spread tokens")
    parser.add_argument("--warm", type=int, default=8, help="untimed steps of every row, before the timed")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    tok = synthetic_tokenizer(VOCAB)
    texts = [tok.backend.decode([t]) for t in range(VOCAB)]
    table = schemas()
    results = []
    head = (
        f"{'schema':<12} {'batch':>5} {'pool':>10} {'threads':>7} {'groups':>6} {'fill ms':>8} {'p90 ms':>7}"
    )
    print(f"{head} {'us/mask':>8} {'accept ms':>9}")
    pools = args.pools.split(",")
    if not set(pools) <= set(FILL_POOLS):
        parser.error(f"--pools takes {', '.join(FILL_POOLS)}")
    try:
        groupings = [None if g == "auto" else int(g) for g in args.groups.split(",")]
    except ValueError:
        parser.error("--groups takes auto or whole numbers, comma-separated")
    if any(g is not None and g < 1 for g in groupings):
        parser.error("--groups must be positive")
    for name in args.schemas.split(","):
        for batch in map(int, args.batches.split(",")):
            for pool in pools:
                for threads in sorted(set(map(int, args.threads.split(",")))):
                    for groups in groupings:
                        sizes = (args.steps, args.warm, args.spread)
                        r = measure(name, table[name], batch, threads, *sizes, texts, tok, pool, groups)
                        results.append(r)
                        print(
                            f"{name:<12} {batch:>5} {pool:>10} {threads:>7} {r['lexer_groups']:>6} "
                            f"{r['fill_ms']:>8.2f} {r['fill_p90_ms']:>7.2f} {r['us_per_mask']:>8.1f} "
                            f"{r['accept_ms']:>9.2f}",
                            flush=True,
                        )
    if args.json:
        info = {"cpu_count": os.cpu_count(), "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"host": info, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
