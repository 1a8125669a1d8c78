"""The Markdown report of a code-review job, built on the client from decrypted results and the job's scan
record: a header naming the repository, commit, model and dates, a summary table, one section per file,
then what was skipped and why."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from typing import Any

from jobs.findings import SEVERITIES
from jobs.scan_record import FOLDER_WALK, GIT_COMMIT, ScanRecord, ScanSource

NO_RECORD = (
    "this home holds no scan record of the job (it was submitted from another home, or before scans were "
    "recorded), so its repository, commit and skipped files are not known"
)


def build_report(
    results: list[tuple[str, dict[str, Any]]],
    scan: ScanRecord | None = None,
    title: str | None = None,
    now: datetime | None = None,
) -> str:
    """Markdown: the header, a summary table, one section per file (sorted by path) with its findings or
    the reason it failed, then the skipped files counted by reason and listed.

    `results` holds (path, record) with record = {"status": "done" | "failed", "output": ..., "error": ...};
    `scan` is the job's scan record (None when this home has none); `now` dates the report (default: now).
    """
    ordered = sorted(results, key=lambda item: item[0])
    done = [(path, record) for path, record in ordered if record.get("status") == "done"]
    failed = len(ordered) - len(done)
    counts = Counter(f["severity"] for _, record in done for f in _findings(record))
    header = ["Files reviewed", "Failed", "Skipped", *(s.capitalize() for s in SEVERITIES)]
    skipped = len(scan.skipped) if scan is not None else "unknown"
    cells = [len(done), failed, skipped, *(counts.get(s, 0) for s in SEVERITIES)]
    lines = [f"# {_inline(title or _title(scan))}", "", *_header(scan, done, now or datetime.now(UTC)), ""]
    lines += [_row(header), _row(["---"] * len(header)), _row(cells), ""]
    for path, record in ordered:
        lines += _file_section(path, record)
    if scan is not None and scan.skipped:
        lines += _skipped_section(scan.skipped)
    return "\n".join(lines)


def models_of(results: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The served models' names that reviewed the done files, sorted (the worker puts it in each output)."""
    outputs = [record.get("output") for _, record in results if record.get("status") == "done"]
    return sorted({o["model"] for o in outputs if isinstance(o, dict) and isinstance(o.get("model"), str)})


def _title(scan: ScanRecord | None) -> str:
    names = sorted({source.repository for source in scan.sources}) if scan is not None else []
    return f"Code review of {', '.join(names)}" if names else "Code review"


def _header(scan: ScanRecord | None, done: list[tuple[str, dict[str, Any]]], now: datetime) -> list[str]:
    """The bullets naming the repository, commit, model and dates."""
    lines = []
    if scan is None:
        lines.append(f"- Repository: unknown: {NO_RECORD}")
    for source in scan.sources if scan is not None else []:
        lines += _source_lines(source, several=len(scan.sources) > 1)
    models = models_of(done)
    lines.append(f"- Model: {', '.join(f'`{_code(m)}`' for m in models) or 'unknown (no result names it)'}")
    scanned = f"scanned {_date(scan.scanned_at)}, " if scan is not None else ""
    lines.append(f"- Date: {scanned}report written {_date(now)}")
    return lines


def _source_lines(source: ScanSource, several: bool) -> list[str]:
    where = f", folder `{_code(source.path_in_repository)}`" if source.path_in_repository else ""
    names = f" (documents named `{_code(source.name_prefix)}...`)" if several and source.name_prefix else ""
    lines = [f"- Repository: `{_code(source.repository)}`{where}{names}"]
    if source.method == FOLDER_WALK:
        return [*lines, "- Commit: none (not a git work tree: the folder was walked, .gitignore honoured)"]
    if source.commit is None:
        return [*lines, "- Commit: none yet (the tracked files of a repository without commits)"]
    if source.method == GIT_COMMIT:
        how = "the files of this commit, read from git"
    else:
        changed = f"; {source.changed} changed since this commit" if source.changed else ""
        how = f"the tracked files as in the working tree{changed}"
    return [*lines, f"- Commit: `{source.commit}` ({how})"]


def _skipped_section(skipped: list[tuple[str, str]]) -> list[str]:
    reasons = Counter(reason for _, reason in skipped)
    lines = ["## Skipped", "", _row(["Reason", "Files"]), _row(["---", "---"])]
    lines += [_row([_inline(reason), count]) for reason, count in sorted(reasons.items())]
    lines.append("")
    lines += [f"- `{_code(path)}`: {_inline(reason)}" for path, reason in sorted(skipped)]
    return [*lines, ""]


def _date(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _file_section(path: str, record: dict[str, Any]) -> list[str]:
    lines = [f"## `{_code(path)}`", ""]
    if record.get("status") != "done":
        return [*lines, f"**Failed:** {_inline(record.get('error') or 'unknown error')}", ""]
    output = record.get("output") if isinstance(record.get("output"), dict) else {}
    chunks = output.get("chunks", 1)
    about = output.get("language", "text") + (f", reviewed in {chunks} parts" if chunks > 1 else "")
    lines += [f"_{_inline(about)}_", ""]
    findings = _findings(record)
    if not findings:
        return [*lines, "No findings.", ""]
    for finding in findings:
        where = f"line {finding['line']}" if finding.get("line") else "file"
        if finding["severity"] == "note":
            lines.append(f"- **note** ({where}):")
            lines += ["", *(f"  > {text}" for text in str(finding["issue"]).splitlines()), ""]
        else:
            lines.append(f"- **{finding['severity']}** ({where}): {_inline(finding['issue'])}")
    return [*lines, ""]


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _findings(record: dict[str, Any]) -> list[dict[str, Any]]:
    output = record.get("output")
    findings = output.get("findings", []) if isinstance(output, dict) else []
    return [f for f in findings if isinstance(f, dict) and f.get("severity") in SEVERITIES]


def _inline(text: Any) -> str:
    """One line of Markdown text: newlines folded, table pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(path: str) -> str:
    """Text for a code span on one line: backticks become quotes, line breaks spaces."""
    return path.replace("`", "'").replace("\r", " ").replace("\n", " ")
