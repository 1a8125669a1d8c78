"""benchmarks/attention_prefill.py at tiny sizes in Triton's interpreter (`--device cpu --quick`), so the
script the H200 session runs does not rot: every kernel runs, agrees with SDPA, and the FLOPs are counted."""

import importlib.util
import json
from pathlib import Path

import torch

from engine.kernels.attention import prefill

ROOT = Path(__file__).resolve().parents[3]


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "attention_prefill", ROOT / "benchmarks" / "attention_prefill.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_causal_flops_count_the_visible_keys():
    bench = load_bench()
    for n, ctx in ((5, 0), (3, 7)):
        visible = (torch.arange(ctx + n)[None, :] <= ctx + torch.arange(n)[:, None]).sum().item()
        assert bench.causal_flops(n, ctx, hq=16, d=256) == 4 * 256 * 16 * visible
    assert bench.parse_cases("8192,8192@131072") == [(8192, 0), (8192, 131072)]


def test_quick_cpu_run_with_a_sweep(tmp_path):
    bench = load_bench()
    path = tmp_path / "out.json"
    bench.main(["--device", "cpu", "--quick", "--cases", "24@40", "--sweep", "--json", str(path)])
    report = json.loads(path.read_text())
    rows = report["results"]
    kernels = [r["kernel"] for r in rows]
    assert kernels.count("sdpa") == 1 and kernels.count("rows") == 1
    assert (
        kernels.count("packed") == len(prefill.SWEEP_TILES) + 1
    )  # the fp32 default, then every sweep tiling
    for r in rows:
        assert "error" not in r, r
        assert r["max_err"] < 1e-5 and r["flops"] == bench.causal_flops(24, 40, 16, 16)
    assert tuple(report["best"]["overall"]) in {tuple(r["config"]) for r in rows if r["kernel"] == "packed"}


def test_quick_cpu_run_over_an_fp8_cache(tmp_path):
    # --kv-cache-dtype fp8: the kernels read e4m3 caches with scales; SDPA attends over what they hold
    # (dequantised), so the bf16-product kernels agree to fp32 rounding and the e4m3 products to e4m3's
    bench = load_bench()
    path = tmp_path / "out.json"
    argv = ["--device", "cpu", "--quick", "--cases", "24@40", "--kv-cache-dtype", "fp8"]
    bench.main([*argv, "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["shape"]["kv_cache_dtype"] == "fp8"
    errors = {r["kernel"]: r["max_err"] for r in report["results"] if "error" not in r}
    assert set(errors) == {"sdpa", "rows", "rows-fp8", "packed", "packed-fp8"}
    assert errors["rows"] < 1e-5 and errors["packed"] < 1e-5
    for kernel in ("rows-fp8", "packed-fp8"):  # e4m3 keeps 3 mantissa bits: visibly off, not wrong
        assert 1e-4 < errors[kernel] < 0.25, (kernel, errors[kernel])
