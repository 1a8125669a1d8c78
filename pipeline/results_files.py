"""Write opened results on the client: results.jsonl always, report.md and report.sarif (SARIF 2.1.0) for
code review, output.jsonl (the OpenAI batch output format) for OpenAI batches. Files are created 0600: they
hold plaintext. Records are written as they come (a page of results at a time), so a large job is never held
whole; only the code-review reports, which sort their findings, keep its records."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from jobs.code_review import build_report
from jobs.openai_batch import output_line
from jobs.sarif import build_sarif
from jobs.scan_record import ScanRecord

REFUSED_CODE = "result_refused"  # the result did not carry the service's valid signature


def write_results(
    out_dir: Path, kind: str, records: Iterable[dict], scan: ScanRecord | None = None
) -> list[Path]:
    """Write the records; a record's `detail` (the full reason of a failure, possibly quoting the document)
    goes into the files too, since they are the submitter's plaintext. `scan` is a code-review job's scan
    record (`pipeline.scan_records`), for the reports' header and skipped files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "results.jsonl"] + ([out_dir / "output.jsonl"] if kind == "chat" else [])
    reviewed: list[tuple[str, dict]] = []
    handles = [_open(path) for path in files]
    try:
        for r in records:
            line = {
                "document": r["document"],
                "status": r["status"],
                "output": r["output"],
                "error": r["error"],
            }
            line |= {key: r[key] for key in ("detail", "raw", "reasoning") if key in r}
            handles[0].write(json.dumps(line, ensure_ascii=False) + "\n")
            if kind == "chat":
                batch = output_line(r["document"], _batch_record(r))
                handles[1].write(json.dumps(batch, ensure_ascii=False) + "\n")
            if kind == "code-review":
                reviewed.append((r["document"], r))
    finally:
        for handle in handles:
            handle.close()
    if kind == "code-review":
        report = _open(out_dir / "report.md")
        with report:
            report.write(build_report(reviewed, scan))
        sarif = _open(out_dir / "report.sarif")
        with sarif:
            sarif.write(json.dumps(build_sarif(reviewed, scan), ensure_ascii=False, indent=1) + "\n")
        files[1:1] = [out_dir / "report.md", out_dir / "report.sarif"]
    return files


def _batch_record(record: dict) -> dict:
    """The record as OpenAI's output line reads it: a refused result gets its own code."""
    if record["status"] == "refused":
        return record | {"output": {"code": REFUSED_CODE}}
    return record


def _open(path: Path) -> TextIO:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # backslashreplace: a lone surrogate in a sealed record is written as its JSON escape, not a crash
    return os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace")
