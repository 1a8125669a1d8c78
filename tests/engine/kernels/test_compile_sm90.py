"""Every Triton kernel compiles for an H200 (sm_90), without a GPU, for each launch its own launcher makes.

CI runs the kernels in Triton's interpreter, which accepts code the compiler rejects (a variable re-bound to
another shape under a run-time `if`, integer masks, ...). This test records the launches of every kernel op at
Qwen3.5-35B-A3B's shapes from the launchers themselves (`launches.py` runs the calls of `launch_calls*.py` on
a simulated H200: bf16 and fp32, decode to prefill batch sizes, the tuned MoE table's tiles, PDL, FP8), then
lowers each distinct launch all the way to a cubin for `GPUTarget("cuda", 90, 32)` (ptxas ships with the
Triton wheel) and checks that it fits an H200's shared memory. It also checks that every `*_kernel` of
engine/kernels was launched by some call.

`@triton.jit` returns an uncompilable InterpretedFunction when TRITON_INTERPRET is set (conftest.py sets it
on CPU-only machines, and other tests here import the kernel modules under it), so recording and compiling
run in subprocesses without it: one records, then two compile (on two cores, each every other launch).
`python -m tests.engine.kernels.test_compile_sm90 [--target=sm_90] [substring ...]` records and compiles by
hand, printing one line per compiled launch (name, error, shared memory, registers and stack bytes per thread
(spills) as cuobjdump reports them, seconds). Launches that differ only
in the divisibility of an int (a token count of 8 or 64) compile once. Another GPU (sm_100, sm_120): add its
`Target` to `launches.TARGETS` (its docstring says how) and the test runs for it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from tests.engine.kernels.launches import SM90, TARGETS, Launch, Target

ROOT = Path(__file__).resolve().parents[3]
MODULE = "tests.engine.kernels.test_compile_sm90"
RESULT, SKIP, LAUNCH, UNLAUNCHED = "COMPILE-RESULT ", "COMPILE-SKIP ", "LAUNCH ", "UNLAUNCHED "


@pytest.mark.slow  # sm_90: about a minute on 2 cores with a cold Triton cache, ~5 s of it recording
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_kernels_compile(target, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    recorded = subprocess.run(
        [sys.executable, "-m", MODULE, "--record", f"--target={target}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = recorded.stdout.splitlines()
    skip = [line[len(SKIP) :] for line in lines if line.startswith(SKIP)]
    if skip:
        pytest.skip(f"no offline CUDA backend in this Triton: {skip[0]}")
    assert recorded.returncode == 0, f"recording the launches failed:\n{recorded.stderr[-8000:]}"
    unlaunched = [line[len(UNLAUNCHED) :] for line in lines if line.startswith(UNLAUNCHED)]
    assert not unlaunched, f"no call in launch_calls*.py launches {', '.join(unlaunched)}: add one"
    launches = [Launch.from_json(line[len(LAUNCH) :]) for line in lines if line.startswith(LAUNCH)]
    path = tmp_path / "launches.jsonl"
    path.write_text("".join(launch.to_json() + "\n" for launch in launches))

    # One subprocess per core (at most two), each compiling every n-th launch.
    n = max(1, min(2, os.cpu_count() or 1))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", MODULE, f"--shard={i}/{n}", f"--launches={path}", f"--target={target}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    try:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"compile subprocess failed (rc {proc.returncode}):\n{stderr[-8000:]}"
    results = [
        json.loads(line[len(RESULT) :])
        for out, _ in outputs
        for line in out.splitlines()
        if line.startswith(RESULT)
    ]
    assert sorted(r["name"] for r in results) == sorted(x.name for x in launches), "launches went unreported"
    failed = [r for r in results if r["error"]]
    report = "\n\n".join(f"=== {r['name']}\n{r['error']}" for r in failed)
    assert not failed, (
        f"{len(failed)} of {len(results)} kernel launches do not compile for {target}:\n\n{report}"
    )


# ---------------------------------------------------------------------------------------------------------
# The subprocess side (no TRITON_INTERPRET).


def _probe(target: Target) -> str | None:
    """Why this Triton cannot compile for `target` offline, or None when a trivial kernel compiles."""
    try:
        import triton
        import triton.language as tl

        if os.environ.get("TRITON_INTERPRET"):
            return "TRITON_INTERPRET is set"

        @triton.jit
        def _probe_kernel(x, n, BLOCK: tl.constexpr):
            o = tl.arange(0, BLOCK)
            tl.store(x + o, tl.load(x + o, mask=o < n) + 1.0, mask=o < n)

        from triton.compiler import ASTSource

        source = ASTSource(_probe_kernel, {"x": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {(2,): 128})
        triton.compile(source, target=target.gpu_target(), options={"num_warps": 1})
    except Exception as e:  # any failure here: no usable backend, reported as a skip
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return None


def _error(launch: Launch, e: Exception) -> str:
    """The compiler's message, with the kernel's file and `def` line (a CompilationError's "at R:C" counts
    rows from that line)."""
    import importlib
    import inspect

    fn = getattr(importlib.import_module(launch.module), launch.kernel)
    path = launch.module.replace(".", "/") + ".py"
    line = getattr(fn, "def_file_line_number", None) or inspect.getsourcelines(fn.fn)[1]
    where = f"{type(e).__name__} in {path}, {launch.kernel} (def at line {line})"
    node = getattr(e, "node", None)
    if getattr(node, "lineno", None):
        where += f", error at line {line + node.lineno - 1}"
    text = str(e)
    if not hasattr(e, "node"):  # not a front-end error: where in the pipeline it failed
        text += "\n" + "".join(traceback.format_exception(e)[-4:])
    return f"{where}:\n{text}"


def _compile(launches: list[Launch], target: Target) -> None:
    """Compile each launch for `target`, printing one RESULT line per launch."""
    from tests.engine.kernels.launches import compile_launch, resource_usage

    for launch in launches:
        start, error, shared, resources = time.perf_counter(), "", None, {}
        try:
            kernel = compile_launch(launch, target)
            shared, resources = kernel.metadata.shared, resource_usage(kernel)
            if shared > target.max_shared:
                error = (
                    f"needs {shared} bytes of shared memory, a {target.name} block has {target.max_shared}"
                )
        except Exception as e:  # report every launch's failure, not just the first
            error = _error(launch, e)
        out = dict(
            name=launch.name,
            error=error,
            shared=shared,
            **resources,
            seconds=round(time.perf_counter() - start, 2),
        )
        print(RESULT + json.dumps(out), flush=True)


def _main(argv: list[str]) -> None:
    from tests.engine.kernels.launches import record, unlaunched

    shard, shards, path, target, filters = 0, 1, None, SM90, []
    for arg in argv:
        if arg.startswith("--shard="):
            shard, shards = map(int, arg.removeprefix("--shard=").split("/"))
        elif arg.startswith("--launches="):
            path = arg.removeprefix("--launches=")
        elif arg.startswith("--target="):
            target = TARGETS[arg.removeprefix("--target=")]
        elif arg != "--record":
            filters.append(arg)
    why = _probe(target)
    if why is not None:
        print(SKIP + why, flush=True)
        return
    if "--record" in argv:
        launches = record(target)
        for launch in launches:
            print(LAUNCH + launch.to_json())
        for name in unlaunched(launches):
            print(UNLAUNCHED + name)
        return
    if path is not None:
        launches = [Launch.from_json(line) for line in Path(path).read_text().splitlines()]
    else:
        launches = record(target)
    chosen = [x for x in launches if not filters or any(f in x.name for f in filters)]
    _compile(chosen[shard::shards], target)


if __name__ == "__main__":
    _main(sys.argv[1:])
