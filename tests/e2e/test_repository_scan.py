"""Issue 16 acceptance 5: a planted git repository reviewed through the CLI and a real worker. Only what is
committed is sent; each planted case is skipped with its reason; report.md counts and lists them under a
header naming the repository, commit, model and date; report.sarif validates against SARIF 2.1.0."""

import json
import re
from collections import Counter

from tests.git_repo import REVIEWED, SECRET, SKIPPED, planted_repository
from tests.jobs.sarif_schema import validate_sarif


def plain_folder(root):
    """A folder in no git work tree: walked with .gitignore honoured, and the same skip rules."""
    for path, text in [
        ("app.py", "x = 1\n"),
        (".gitignore", "*.log\n"),
        ("debug.log", "x\n"),
        ("yarn.lock", "#\n"),
    ]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def documents(out) -> dict[str, dict]:
    return {r["document"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def test_a_planted_repository_is_reviewed_as_committed(embedded, demo_model, tmp_path):
    repo, first = planted_repository(tmp_path / "planted")
    common = ["--kind", "code-review", "--param", "max_tokens=8", "--json"]
    tree = embedded.json("submit", str(repo.root), *common, "--param", "exclude=docs/")
    assert {(s["document"], s["reason"]) for s in tree["skipped"]} == SKIPPED
    assert tree["documents"] == len(REVIEWED)
    repo.write("src/app.py", "def add(a, b):\n    return a + b\n")
    repo.commit("fix add")
    params = ["--param", f"commit={first[:12]}", "--param", "include=src/,/*.md"]
    at_first = embedded.json("submit", str(repo.root), *common, *params)
    plain = embedded.json("submit", str(plain_folder(tmp_path / "plain")), *common)
    embedded.work()

    out = tmp_path / "out-tree"
    embedded.run("results", tree["job_id"], "--out", str(out))
    assert set(documents(out)) == REVIEWED  # no .env, nothing .git/info/exclude or .gitignore hides
    written = b"".join(path.read_bytes() for path in out.iterdir())
    assert SECRET.encode() not in written
    report = (out / "report.md").read_text()
    head = report.split("\n\n| Files reviewed")[0]
    assert head.startswith("# Code review of planted\n\n- Repository: `planted`\n")
    assert (
        f"- Commit: `{first}` (the tracked files as in the working tree; 1 changed since this commit)" in head
    )
    assert f"- Model: `{demo_model.name}`" in head  # the served model's name, from the worker
    assert re.search(r"- Date: scanned \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, report written ", head)
    done = sum(r["status"] == "done" for r in documents(out).values())
    assert f"| {done} | {len(REVIEWED) - done} | {len(SKIPPED)} |" in report
    skipped_section = report.split("## Skipped\n\n")[1]
    counts = Counter(reason for _, reason in SKIPPED)  # binary 1, excluded 1, and 2 of each default skip
    assert all(f"| {reason} | {count} |" in skipped_section for reason, count in counts.items())
    for path, reason in SKIPPED:
        assert f"- `{path}`: {reason}\n" in skipped_section
    sarif = json.loads((out / "report.sarif").read_text())
    validate_sarif(sarif)
    run = sarif["runs"][0]
    assert run["tool"]["driver"]["name"] == "Enclave code-review"
    assert run["properties"]["sources"][0]["commit"] == first
    assert sum(run["properties"]["skipped"].values()) == len(SKIPPED)
    findings = sum(len(r["output"]["findings"]) for r in documents(out).values() if r["status"] == "done")
    assert len(run["results"]) == findings

    out = tmp_path / "out-commit"
    embedded.run("results", at_first["job_id"], "--out", str(out))
    assert set(documents(out)) == {"README.md", "src/app.py", "src/util.py"}
    report = (out / "report.md").read_text()
    assert f"- Commit: `{first}` (the files of this commit, read from git)" in report
    assert "- `uv.lock`: not included\n" in report and "- `docs/guide.md`: not included\n" in report
    validate_sarif(json.loads((out / "report.sarif").read_text()))

    out = tmp_path / "out-plain"
    embedded.run("results", plain["job_id"], "--out", str(out))
    assert set(documents(out)) == {"app.py", ".gitignore"}
    report = (out / "report.md").read_text()
    assert "- Commit: none (not a git work tree: the folder was walked, .gitignore honoured)" in report
    assert "- `yarn.lock`: lockfile\n" in report
