"""Whether a kernel change leaves the compiled code alone: the sm_90 PTX and TTGIR of every recorded launch
whose name matches a pattern, at a git revision and in the working tree, compared launch by launch.

    python -m tests.engine.kernels.launch_diff REV PATTERN [--target=sm_90] [--keep=DIR]

Both sides record their launches as `test_compile_sm90` does (`launches.record`: the calls of
`launch_calls*.py` on a simulated GPU), keep those whose `Launch.name` matches the regular expression PATTERN,
in first-seen order, and compile them. The i-th match of one side is compared with the i-th of the other, so
a refactor that renames kernels or moves them between modules still pairs up (say two forked FP8 kernels
merged into the bf16 ones: `'^moe(\\.fp8)? (fp8_)?(gate_up|down) '`). Compared: PTX without its debug and line
information, comments and the kernel's name; TTGIR without locations, its SSA names (and so the argument
names) numbered in order of appearance. Prints one line per pair and exits 1 if any differs; `--keep` writes
both sides' files and unified diffs there. REV is read with `git archive` (its engine/ and tests/ only) into a
temporary directory; run from the repository root, without TRITON_INTERPRET.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def normal_ptx(text: str, kernel: str) -> str:
    text = text.split("\t.section\t.debug", 1)[0]  # the DWARF sections at the end
    lines = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith((".loc", ".file")) or re.fullmatch(r"\$L__tmp\d+:", s):
            continue
        line = re.sub(r"\s*//.*$", "", line).replace(kernel, "KERNEL")
        if line.strip():
            lines.append(line)
    return "\n".join(lines) + "\n"


def normal_mlir(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith("#loc"):
            continue
        line = re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", line)
        if line.strip():
            lines.append(line)
    names: dict[str, str] = {}
    text = "\n".join(lines) + "\n"
    text = re.sub(r"@\w+", "@KERNEL", text, count=1)  # tt.func public @name
    return re.sub(r"%[A-Za-z_]\w*|%\d+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)


def _dump(pattern: str, target_name: str) -> None:
    """This checkout's side: one JSON line per matching launch, with its normalised PTX and TTGIR."""
    from tests.engine.kernels.launches import TARGETS, compile_launch, record

    target = TARGETS[target_name]
    for launch in record(target):
        if re.search(pattern, launch.name):
            kernel = compile_launch(launch, target)
            ptx, ttgir = normal_ptx(kernel.asm["ptx"], launch.kernel), normal_mlir(kernel.asm["ttgir"])
            print(json.dumps(dict(name=launch.name, ptx=ptx, ttgir=ttgir)), flush=True)


def _side(root: Path, pattern: str, target: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    # This file as a script: REV may predate it; the imports resolve in `root`.
    argv = [sys.executable, __file__, "--dump", pattern, f"--target={target}"]
    out = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"recording in {root} failed:\n{out.stderr[-4000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str]) -> int:
    opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--") and "=" in a}
    rev, pattern = [a for a in argv if not a.startswith("--")]
    target = opts.get("--target", "sm_90")
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", rev, "engine", "tests"], cwd=ROOT, capture_output=True)
        if archive.returncode:
            raise SystemExit(archive.stderr.decode())
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        before = _side(Path(tmp), pattern, target)
    after = _side(ROOT, pattern, target)
    keep = Path(opts["--keep"]) if "--keep" in opts else None
    differ = 0
    print(f"{len(before)} launches at {rev}, {len(after)} in the working tree")
    for i, (a, b) in enumerate(zip(before, after, strict=False)):  # the counts are checked below
        same = [a[k] == b[k] for k in ("ptx", "ttgir")]
        differ += not all(same)
        ptx, ttgir = ("same" if x else "DIFFERS" for x in same)
        verdict = "identical" if all(same) else f"PTX {ptx}, TTGIR {ttgir}"
        print(f"{i:3d} {verdict:36s} {a['name']}\n    {'':36s} {b['name']}")
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for k in ("ptx", "ttgir"):
                (keep / f"{i:03d}.before.{k}").write_text(a[k])
                (keep / f"{i:03d}.after.{k}").write_text(b[k])
                diff = difflib.unified_diff(a[k].splitlines(), b[k].splitlines(), lineterm="", n=2)
                (keep / f"{i:03d}.{k}.diff").write_text("\n".join(diff) + "\n")
    if len(before) != len(after):
        print("the two sides launch different numbers of matching kernels")
        return 1
    print(f"{len(before) - differ} identical, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    if "--dump" in sys.argv:
        args = [a for a in sys.argv[1:] if a != "--dump" and not a.startswith("--target=")]
        target = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--target=")), "sm_90")
        _dump(args[0], target)
    else:
        sys.exit(main(sys.argv[1:]))
