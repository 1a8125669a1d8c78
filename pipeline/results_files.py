"""Write opened results on the client: results.jsonl always, report.md and report.sarif (SARIF 2.1.0) for
code review, output.jsonl (the OpenAI batch output format) for OpenAI batches. Files are created 0600: they
hold plaintext."""

from __future__ import annotations

import json
import os
from pathlib import Path

from jobs.code_review import build_report
from jobs.openai_batch import output_line
from jobs.sarif import build_sarif
from jobs.scan_record import ScanRecord

REFUSED_CODE = "result_refused"  # the result did not carry the service's valid signature


def write_results(
    out_dir: Path, kind: str, records: list[dict], scan: ScanRecord | None = None
) -> list[Path]:
    """Write the records; a record's `detail` (the full reason of a failure, possibly quoting the document)
    goes into the files too, since they are the submitter's plaintext. `scan` is a code-review job's scan
    record (`pipeline.scan_records`), for the reports' header and skipped files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        {"document": r["document"], "status": r["status"], "output": r["output"], "error": r["error"]}
        | {key: r[key] for key in ("detail", "raw", "reasoning") if key in r}
        for r in records
    ]
    files = [
        _write(out_dir / "results.jsonl", "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    ]
    if kind == "code-review":
        reviewed = [(r["document"], r) for r in records]
        files.append(_write(out_dir / "report.md", build_report(reviewed, scan)))
        sarif = json.dumps(build_sarif(reviewed, scan), ensure_ascii=False, indent=1)
        files.append(_write(out_dir / "report.sarif", sarif + "\n"))
    if kind == "chat":
        batch = [output_line(r["document"], _batch_record(r)) for r in records]
        files.append(
            _write(out_dir / "output.jsonl", "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in batch))
        )
    return files


def _batch_record(record: dict) -> dict:
    """The record as OpenAI's output line reads it: a refused result gets its own code."""
    if record["status"] == "refused":
        return record | {"output": {"code": REFUSED_CODE}}
    return record


def _write(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # backslashreplace: a lone surrogate in a sealed record is written as its JSON escape, not a crash
    with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(text)
    return path
