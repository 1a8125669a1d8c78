"""benchmarks/h200_session.sh on the CPU, running no benchmark: a device call must not lose its minutes to a
flag a script does not take, an import error or a script that needs PYTHONPATH.

Each step (each arm of the script's `case`) runs under bash with stand-ins for python, nvidia-smi,
timeout and ncu first on PATH, so the script's own control flow records every python command line it would
run.
Then this file, run as a driver (`python tests/engine/test_session_script.py JOBS RESULTS`), checks each line
as the GPU machine would run it: from the repository root, with sys.path[0] the script's folder (the root
for `-m`), no editable install, no PYTHONPATH, no sqlalchemy (nor llguidance unless the step installed it).
A script parses its recorded arguments for real and stops there; a pytest line collects its tests.
The driver imports torch once and forks a child per line, so each line imports the project afresh.
"""

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import tomllib
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "benchmarks" / "h200_session.sh"
BENCH_ARGS = ("--quick", "--workloads", "a,b")  # the script's documented `STEPS="bench" ... "$@"` usage
PARSED, IMPORTED = 77, 78  # a child's exit codes: its arguments parsed; a script taking none imported
JOB_SECONDS = 120  # a child that neither parses nor fails by then is doing work: SIGALRM ends it
# Missing from the GPU image; llguidance comes on PYTHONPATH from the constrained step's wheel.
GPU_IMAGE_LACKS = ("sqlalchemy", "llguidance")

RECORDER = r"""
import json, os, re, sys

name, argv = sys.argv[1], sys.argv[2:]


def record(**entry):
    with open(os.environ["SESSION_RECORD"], "a") as f:
        f.write(json.dumps(entry) + "\n")


if name == "nvidia-smi":
    print("NVIDIA H200, 143771 MiB, 570.00")
elif name == "timeout":
    if len(argv) < 2 or not re.fullmatch(r"\d+(\.\d+)?[smhd]?", argv[0]):
        print(f"timeout: invalid time interval or no command: {argv}", file=sys.stderr)
        sys.exit(125)
    os.execvp(argv[1], argv[1:])
elif name == "ncu":  # the profiler runs the command after its options
    command = next((i for i, a in enumerate(argv) if a in ("python", "python3")), None)
    if command is None:
        print(f"ncu: no python command in {argv}", file=sys.stderr)
        sys.exit(1)
    os.execvp(argv[command], argv[command:])
else:
    env = {
        k: v
        for k, v in os.environ.items()
        if (k.startswith("ENCLAVE_") and k != "ENCLAVE_COMMIT") or k == "PYTHONPATH"
    }
    record(argv=argv, env=env)
    if argv[:1] == ["-c"] and "sqlalchemy" in argv[1]:
        sys.exit(1)  # the GPU image has no sqlalchemy
"""


def session_steps(text: str) -> list[str]:
    """The step names: the arms of the script's `case $step in ... esac`."""
    block = text.split("case $step in", 1)[1].split("esac", 1)[0]
    return re.findall(r"^\s*(\w+)\)", block, flags=re.MULTILINE)


STEPS = session_steps(SESSION.read_text())
CASES = [pytest.param(step, (), id=step) for step in STEPS]
CASES.append(pytest.param("bench", BENCH_ARGS, id="bench-with-args"))


def write_stand_ins(folder: Path) -> Path:
    recorder = folder / "recorder.py"
    recorder.write_text(RECORDER)
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3", "nvidia-smi", "timeout", "ncu"):
        path = bin_dir / name
        path.write_text(
            f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(recorder))} {name} "$@"\n'
        )
        path.chmod(0o755)
    return bin_dir


def run_step(bin_dir: Path, out: Path, step: str, args: tuple[str, ...]) -> dict:
    """One step under the stand-ins: bash's result, the `run` outputs whose rc is not 0, its python lines."""
    record = out / f"record_{step}_{len(args)}.jsonl"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(out),
        "OUT": str(out),
        "ENCLAVE_COMMIT": "0123456789abcdef0123456789abcdef01234567",
        "STEPS": step,
        "SESSION_RECORD": str(record),
    }
    for txt in out.glob("*.txt"):
        txt.unlink()
    done = subprocess.run(
        ["bash", str(SESSION), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    failed = {}  # `run`'s output files whose command did not exit 0 under the stand-ins
    for txt in out.glob("*.txt"):
        text = txt.read_text()
        if any(rc != "0" for rc in re.findall(r"^rc=(\d+)$", text, re.M)):
            failed[txt.stem] = text[-1000:]
    lines = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return {"bash": done, "failed": failed, "lines": lines}


def job_for(line: dict) -> dict | None:
    """What the driver checks for a recorded python line; None for lines checked here or not at all."""
    argv = line["argv"]
    absent = [m for m in GPU_IMAGE_LACKS if not (m == "llguidance" and line["env"].get("PYTHONPATH"))]
    env = {k: v for k, v in line["env"].items() if k != "PYTHONPATH"}
    if argv[:1] == ["-c"] or argv[:2] == ["-m", "pip"]:
        return None
    if argv[:2] == ["-m", "pytest"]:
        return {"kind": "pytest", "target": "pytest", "args": argv[2:], "env": env, "absent": absent}
    if argv[:1] == ["-m"]:
        return {"kind": "module", "target": argv[1], "args": argv[2:], "env": env, "absent": absent}
    return {"kind": "script", "target": argv[0], "args": argv[1:], "env": env, "absent": absent}


def registered_markers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {m.split(":")[0].strip() for m in config.get("markers", [])}


def static_problems(argv: list[str]) -> list[str]:
    """Problems seen without running: `-c` code that does not compile, `-m` markers pytest does not know
    (the device's `--confcutdir` keeps the root conftest out: pyproject must register them)."""
    if argv[:1] == ["-c"]:
        try:
            compile(argv[1], "<-c>", "exec")
        except SyntaxError as e:
            return [f"its -c code does not compile: {e}"]
    if argv[:2] == ["-m", "pytest"]:
        expressions = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"][1:]
        names = {n for e in expressions for n in re.findall(r"[A-Za-z_]\w*", e)} - {"and", "or", "not"}
        if unknown := names - registered_markers():
            return [f"marker(s) {sorted(unknown)} are not registered in pyproject.toml"]
    return []


def verdict(job: dict, result: dict) -> str | None:
    """None when the driver's child ended as it should; otherwise what went wrong, with its output."""
    code, output = result["code"], result["output"].strip()
    if job["kind"] == "pytest":
        if code == 0:
            return None
        problem = "selects no test" if code == 5 else f"does not collect (pytest exit {code})"
    elif code in (PARSED, IMPORTED):
        return None
    elif code == 2:
        problem = "rejects its arguments"
    elif code == -signal.SIGALRM:
        problem = f"neither parsed its arguments nor failed within {JOB_SECONDS} s"
    elif code == 0:
        problem = "ended without parsing its arguments"
    else:
        problem = f"fails before its work starts (exit {code})"
        if "None in sys.modules" in output:
            problem += f"; the GPU image lacks {', '.join(job['absent'])}"
    return f"{problem}:\n{output[-2500:]}"


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> dict:
    """Every case's bash run, and the driver's result for each distinct python line they recorded."""
    folder = tmp_path_factory.mktemp("session")
    bin_dir = write_stand_ins(folder)
    out = folder / "out"
    out.mkdir()
    runs = {(step, args): run_step(bin_dir, out, step, args) for step, args in (c.values for c in CASES)}
    jobs = {}
    for run in runs.values():
        for line in run["lines"]:
            if (job := job_for(line)) is not None:
                jobs.setdefault(json.dumps(job, sort_keys=True), job)
    jobs_path, results_path = folder / "jobs.json", folder / "results.json"
    jobs_path.write_text(json.dumps(list(jobs.values())))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ENCLAVE_", "TRITON_", "PYTHON")) and k != "CUDA_VISIBLE_DEVICES"
    }
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(jobs_path), str(results_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"the driver failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    results = dict(zip(jobs, json.loads(results_path.read_text()), strict=True))
    return {"runs": runs, "jobs": jobs, "results": results}


def test_steps_come_from_the_case_arms():
    """The default STEPS and every step the header's usage names are arms of the case."""
    text = SESSION.read_text()
    default = re.search(r"STEPS=\$\{STEPS:-([^}]*)\}", text).group(1).split()
    documented = [s for m in re.findall(r'STEPS="([^"]*)"', text) for s in m.split()]
    assert {"kernels", "bench"} <= set(STEPS)
    assert not (missing := set(default + documented) - set(STEPS)), f"no case arm for steps {missing}"


def test_a_misspelt_step_runs_nothing(tmp_path):
    """A step that is no case arm is refused before the first step runs, so no device call is spent on it."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(), out.mkdir()
    result = run_step(write_stand_ins(bin_dir), out, "kernels verfy", ())
    assert result["bash"].returncode == 2 and "unknown step: verfy" in result["bash"].stderr
    assert result["lines"] == [] and not list(out.glob("*.txt"))


@pytest.mark.parametrize(("step", "args"), CASES)
def test_every_command_line_of_the_step_starts(session, step, args):
    run = session["runs"][(step, args)]
    bash = run["bash"]
    assert bash.returncode == 0 and not bash.stderr, (
        f"step {step}: bash exit {bash.returncode}\n{bash.stderr}"
    )
    failed = "\n".join(f"$OUT/{name}.txt:\n{text}" for name, text in run["failed"].items())
    assert not failed, f"step {step}: commands failed under the stand-ins:\n{failed}"
    commands = [line for line in run["lines"] if line["argv"][:1] != ["-c"]]
    assert commands, f"step {step} runs no python command"
    if args:
        tails = [line["argv"][-len(args) :] for line in commands]
        assert list(args) in tails, f"step {step} does not forward its arguments {args}: {commands}"
    problems = []
    for line in run["lines"]:
        shown = " ".join(["python", *map(shlex.quote, line["argv"])])
        env = " ".join(f"{k}={v}" for k, v in sorted(line["env"].items()))
        for problem in static_problems(line["argv"]):
            problems.append(f"{env} {shown}\n  {problem}")
        if (job := job_for(line)) is not None:
            key = json.dumps(job, sort_keys=True)
            if (problem := verdict(job, session["results"][key])) is not None:
                problems.append(f"{env} {shown}\n  {problem}")
    assert not problems, f"step {step}:\n" + "\n\n".join(problems)


# The driver: run as a script by the `session` fixture, in a fresh interpreter.


def imitate_device_imports() -> None:
    """Leave the project importable only as on the GPU machine: through a sys.path entry the script or
    `python -m` gives it. The editable install's finders go, and so do entries naming the root."""

    def editable(x) -> bool:
        return "__editable__" in (getattr(x, "__module__", None) or "")

    sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
    sys.path_importer_cache.clear()
    sys.path[1:] = [
        p for p in sys.path[1:] if not p.startswith("__editable__") and Path(p or ".").resolve() != ROOT
    ]
    import importlib.util

    if importlib.util.find_spec("engine") is not None:
        raise SystemExit(
            "engine is importable without the repository root on sys.path (installed into site-packages?): "
            "this check imitates the GPU machine, where it is not; install the project editable"
        )


def stop_after_parsing() -> None:
    """The outermost parse of any ArgumentParser parses for real, then exits with PARSED."""
    depth = 0

    def wrap(method):
        def parse(self, *args, **kwargs):
            nonlocal depth
            depth += 1
            try:
                result = method(self, *args, **kwargs)
            finally:
                depth -= 1
            if depth == 0:
                raise SystemExit(PARSED)
            return result

        return parse

    for name in ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args"):
        setattr(argparse.ArgumentParser, name, wrap(getattr(argparse.ArgumentParser, name)))


def takes_arguments(path: Path) -> bool:
    """A file run as __main__ that neither parses (argparse, sys.argv) nor hands over to an imported main
    takes no arguments: the driver imports it rather than run it, since nothing would stop its work."""
    source = path.read_text()
    return any(s in source for s in ("argparse", "sys.argv", "import main"))


def check_in_child(job: dict) -> int:
    import runpy
    from importlib.util import find_spec

    os.environ.update(job["env"])
    for name in job["absent"]:
        sys.modules[name] = None  # `import name` raises ImportError, as on the GPU image
    if job["kind"] == "pytest":
        sys.path[0] = str(ROOT)
        return int(pytest.main([*job["args"], "--collect-only"]))
    if job["kind"] == "script":
        path = Path(job["target"])
        sys.path[0] = str(path.resolve().parent)
    else:
        sys.path[0] = str(ROOT)
        spec = find_spec(job["target"])
        if spec is None:
            print(f"No module named {job['target']}")
            return 1
        if spec.submodule_search_locations:  # a package runs its __main__
            spec = find_spec(f"{job['target']}.__main__")
        path = Path(spec.origin)
    sys.argv = [job["target"], *job["args"]]
    if not takes_arguments(path):
        if job["args"]:
            print(f"{path} takes no arguments (no argparse, no sys.argv), but is given {job['args']}")
            return 1
        run_name = "__session_check__"
    else:
        run_name = "__main__"
        stop_after_parsing()
    if job["kind"] == "module" and run_name == "__main__":
        runpy.run_module(job["target"], run_name=run_name, alter_sys=True)
    else:
        runpy.run_path(str(path), run_name=run_name)
    return IMPORTED if run_name != "__main__" else 0


def run_forked(job: dict) -> dict:
    with tempfile.TemporaryFile() as log:
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                signal.alarm(JOB_SECONDS)
                code = check_in_child(job)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        log.seek(0)
        return {"code": os.waitstatus_to_exitcode(status), "output": log.read().decode(errors="replace")}


def drive(jobs_path: str, results_path: str) -> None:
    imitate_device_imports()
    import torch  # noqa: F401  every line imports it: once here, before the forks

    jobs = json.loads(Path(jobs_path).read_text())
    Path(results_path).write_text(json.dumps([run_forked(job) for job in jobs]))


if __name__ == "__main__":
    drive(*sys.argv[1:])
