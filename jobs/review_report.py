"""The Markdown report of a code-review job, built on the client from decrypted results."""

from __future__ import annotations

from collections import Counter
from typing import Any

from jobs.findings import SEVERITIES


def build_report(
    results: list[tuple[str, dict[str, Any]]],
    skipped: list[tuple[str, str]] | None = None,
    title: str = "Code review",
) -> str:
    """Markdown: a summary table, then one section per file (sorted by path) with its findings or the
    reason it failed, then the skipped files.

    `results` holds (path, record) with record = {"status": "done" | "failed", "output": ..., "error": ...}.
    """
    ordered = sorted(results, key=lambda item: item[0])
    done = [(path, record) for path, record in ordered if record.get("status") == "done"]
    failed = len(ordered) - len(done)
    counts = Counter(f["severity"] for _, record in done for f in _findings(record))
    header = ["Files reviewed", "Failed", "Skipped", *(s.capitalize() for s in SEVERITIES)]
    cells = [len(done), failed, len(skipped or []), *(counts.get(s, 0) for s in SEVERITIES)]
    lines = [f"# {_inline(title)}", "", _row(header), _row(["---"] * len(header)), _row(cells), ""]
    for path, record in ordered:
        lines += _file_section(path, record)
    if skipped:
        lines += ["## Skipped", ""]
        lines += [f"- `{_code(path)}`: {_inline(reason)}" for path, reason in sorted(skipped)]
        lines.append("")
    return "\n".join(lines)


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
    return path.replace("`", "'")
