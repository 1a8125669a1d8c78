"""Benchmark: the recurrent gated delta kernel's launch choices (dv tile BV, warps) for decode batches, with
fp32 and bf16 recurrent states (`state_dtype`), at Qwen3.5-35B-A3B's DeltaNet shape (16 key heads, 32 value
heads, dk = dv = 128).

    python benchmarks/recurrent_tiles.py [--batches 64,256,512] [--json PATH] [--once]

One decode token per sequence; each (batch, state dtype, BV, warps) timed with triton.testing.do_bench
(median), against the state bytes read and written (the step's floor). The launcher's own choice
(`_launch_config`) is marked. `--once` runs only the launcher's choice, once per batch and state dtype,
untimed: for `ncu --clock-control none --kernel-name regex:_recurrent_kernel python
benchmarks/recurrent_tiles.py --batches 256 --once`. Needs CUDA. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import SeqLayout
from engine.kernels.gated_delta import triton as gd

HK, HV, DK, DV = 16, 32, 128, 128


def measure(batch: int, state_dtype: torch.dtype, bv: int, warps: int, once: bool = False) -> float:
    """Seconds per call at (bv, warps); `once`: one untimed call (0.0)."""
    import triton.testing

    dev = "cuda"
    layout = SeqLayout((1,) * batch, (5,) * batch, tuple(range(batch)))
    q, k = (torch.randn(batch, HK, DK, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, HV, DV, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(batch, HV, device=dev)
    beta = torch.rand(batch, HV, device=dev, dtype=torch.bfloat16)
    state = (0.1 * torch.randn(batch, HV, DK, DV, device=dev)).to(state_dtype)
    real = gd._launch_config
    gd._launch_config = lambda heads, dv, state_bytes=4: (bv, warps)
    try:
        if once:
            gd.gated_delta_rule(q, k, v, g, beta, state, layout)
            torch.cuda.synchronize()
            return 0.0
        return triton.testing.do_bench(lambda: gd.gated_delta_rule(q, k, v, g, beta, state, layout)) * 1e-3
    finally:
        gd._launch_config = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256,512")
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--once", action="store_true", help="the launcher's choice only, one untimed call each"
    )
    args = parser.parse_args()
    rows = []
    print(f"{'batch':>5} {'state':>8} {'BV':>4} {'warps':>5} {'us':>8} {'TB/s':>6}  choice")
    for batch in map(int, args.batches.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            state_bytes = 2 * batch * HV * DK * DV * dtype.itemsize  # read and written once
            chosen = gd._launch_config(batch * HV, DV, dtype.itemsize)
            if args.once:
                measure(batch, dtype, *chosen, once=True)
                print(
                    f"{batch:>5} {str(dtype).removeprefix('torch.'):>8} {chosen[0]:>4} {chosen[1]:>5}  once"
                )
                continue
            for bv in (16, 32, 64, 128):
                for warps in (1, 2, 4, 8):
                    s = measure(batch, dtype, bv, warps)
                    mark = "<- launcher" if (bv, warps) == chosen else ""
                    name = str(dtype).removeprefix("torch.")
                    tbs = state_bytes / s / 1e12
                    print(f"{batch:>5} {name:>8} {bv:>4} {warps:>5} {s * 1e6:>8.1f} {tbs:>6.2f}  {mark}")
                    rows.append(dict(batch=batch, state=name, bv=bv, warps=warps, s=s, launcher=bool(mark)))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
