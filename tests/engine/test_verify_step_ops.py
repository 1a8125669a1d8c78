"""benchmarks/verify_step_ops.py on the simulated H200 (a subprocess: the recorder needs kernel modules
imported without TRITON_INTERPRET): a verify step of 2-4 positions runs the plain decode step's kernels, its
fused DeltaNet step, GEMV experts and decode attention, with the dense projections on cuBLAS the one switch,
and a rejected draft's commit is two launches."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECTIONS = ("2048->12352", "4096->2048", "2048->9216")  # in_proj (fused), out_proj and o_proj, qkv_proj


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("verify") / "ops.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    script = ROOT / "benchmarks" / "verify_step_ops.py"
    argv = [sys.executable, str(script), "--positions", "2,4", "--json", str(path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "verify step less plain step" in done.stdout
    return json.loads(path.read_text())


def graph_kernels(ops: list[dict]) -> Counter:
    return Counter(op["name"] for op in ops if op["part"] == "graph")


@pytest.mark.parametrize("positions", ["2", "4"])
def test_verify_keeps_the_plain_steps_kernels_but_the_dense_projections(report, positions):
    plain, verify = graph_kernels(report["steps"]["1"]), graph_kernels(report["steps"][positions])
    assert sum(plain.values()) == sum(verify.values())  # the same launches in the graph
    for name in PROJECTIONS:
        assert plain[f"linear linear {name}"] == verify[f"aten linear (cuBLAS) {name}"] > 0
        del plain[f"linear linear {name}"], verify[f"aten linear (cuBLAS) {name}"]
    assert plain == verify  # fused DeltaNet step, GEMV experts, decode attention: as many, no other kernel
    for name in ("deltanet_step deltanet_step", "moe.gemv gate_up", "attention paged_attention"):
        assert verify[name] > 0


def test_a_rejected_drafts_commit_is_two_copies_without_an_upload(report):
    ops = report["steps"]["2"]
    now = [op["name"] for op in ops if op["part"] == "commit"]
    assert now == ["aten copy_", "aten copy_"]
    assert len([op for op in ops if op["part"] == "commit before 49459db"]) == 122  # 2 uploads, 2 x 60
    row = report["breakdown"]["2"]
    assert row["fixed_now_ms"] < row["fixed_at_49459db_ms"] < row["fixed_before_49459db_ms"]
    assert row["measured_extra_ms"] > row["predicted_extra_now_ms"] > row["graph_bytes_ms"] > 0
