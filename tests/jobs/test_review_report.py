"""report.md's header (repository, commit, model, dates) and its skipped section, from the scan record."""

from datetime import UTC, datetime

from jobs.review_report import NO_RECORD, build_report
from jobs.scan_record import FOLDER_WALK, GIT_COMMIT, GIT_WORKING_TREE, ScanRecord, ScanSource

NOW = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
SCANNED = datetime(2026, 3, 4, 5, 0, 0, tzinfo=UTC)
SHA = "0123456789abcdef0123456789abcdef01234567"


def done(path: str, model: str | None = "Qwen3.6-35B-A3B") -> tuple[str, dict]:
    output = {"path": path, "language": "Python", "chunks": 1, "model": model, "findings": []}
    return path, {"status": "done", "output": output, "error": None}


def header(report: str) -> list[str]:
    return report.split("\n\n")[1].split("\n")


def test_header_names_repository_commit_model_and_dates():
    source = ScanSource(repository="itsdangerous", method=GIT_WORKING_TREE, commit=SHA, changed=2)
    scan = ScanRecord(scanned_at=SCANNED, sources=[source], skipped=[("uv.lock", "lockfile")])
    report = build_report([done("a.py"), done("b.py")], scan, now=NOW)
    assert report.startswith("# Code review of itsdangerous\n\n")
    assert header(report) == [
        "- Repository: `itsdangerous`",
        f"- Commit: `{SHA}` (the tracked files as in the working tree; 2 changed since this commit)",
        "- Model: `Qwen3.6-35B-A3B`",
        "- Date: scanned 2026-03-04 05:00:00 UTC, report written 2026-03-04 05:06:07 UTC",
    ]
    assert "| 2 | 0 | 1 | 0 | 0 | 0 | 0 |" in report
    assert report.endswith(
        "## Skipped\n\n| Reason | Files |\n| --- | --- |\n| lockfile | 1 |\n\n- `uv.lock`: lockfile\n"
    )


def test_header_for_a_commit_a_sub_folder_and_a_folder_walk():
    at_commit = ScanSource(
        repository="r", method=GIT_COMMIT, commit=SHA, path_in_repository="src/", name_prefix="r/"
    )
    walked = ScanSource(repository="notes", method=FOLDER_WALK, name_prefix="notes/")
    scan = ScanRecord(scanned_at=SCANNED, sources=[at_commit, walked])
    lines = header(build_report([done("r/a.py", model=None)], scan, now=NOW))
    assert lines[:4] == [
        "- Repository: `r`, folder `src/` (documents named `r/...`)",
        f"- Commit: `{SHA}` (the files of this commit, read from git)",
        "- Repository: `notes` (documents named `notes/...`)",
        "- Commit: none (not a git work tree: the folder was walked, .gitignore honoured)",
    ]
    assert lines[4] == "- Model: unknown (no result names it)"


def test_without_a_scan_record_the_report_says_what_it_cannot_know():
    report = build_report([done("a.py")], None, now=NOW)
    assert report.startswith("# Code review\n\n")
    assert header(report)[0] == f"- Repository: unknown: {NO_RECORD}"
    assert "| 1 | 0 | unknown | 0 | 0 | 0 | 0 |" in report and "## Skipped" not in report
