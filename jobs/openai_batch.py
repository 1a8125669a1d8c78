"""OpenAI Batch API files: read an input JSONL file, write lines of the output file.

Input lines are `{"custom_id", "method": "POST", "url", "body"}`. A malformed file is refused whole, naming
every bad line; a well-formed line for an unsupported url is not a file error (it fails alone when run).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jobs.base import PROCESSING_ERROR

_FIELDS = ("custom_id", "method", "url", "body")


class BatchFileError(ValueError):
    """A batch file that cannot be accepted; `errors` has one entry per problem ("line 3: not valid JSON")."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        count = len(errors)
        super().__init__(f"the batch file has {count} problem{'s' * (count != 1)}: " + "; ".join(errors))


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch file; `raw` is the line as given, without its line ending."""

    line_no: int
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]
    raw: bytes


def parse_batch_file(data: bytes) -> list[BatchLine]:
    """The requests of a batch file, in order; `BatchFileError` listing every bad line. Blank lines are
    skipped."""
    lines, errors = [], []
    first_seen: dict[str, int] = {}
    for number, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").split(b"\n"), start=1):
        raw = raw.removesuffix(b"\r")
        if not raw.strip():
            continue
        line, problems = _parse_line(number, raw)
        errors += [f"line {number}: {problem}" for problem in problems]
        if line is None:
            continue
        if line.custom_id in first_seen:
            first = first_seen[line.custom_id]
            errors.append(f"line {number}: duplicate custom_id {line.custom_id!r} (first on line {first})")
            continue
        first_seen[line.custom_id] = number
        lines.append(line)
    if errors:
        raise BatchFileError(errors)
    if not lines:
        raise BatchFileError(["the file has no requests"])
    return lines


def _parse_line(number: int, raw: bytes) -> tuple[BatchLine | None, list[str]]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, [f"not valid UTF-8 (first bad byte at offset {exc.start} of the line)"]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [f"not valid JSON ({exc.msg} at column {exc.colno})"]
    if not isinstance(value, dict):
        return None, ["must be a JSON object"]
    problems = [f"missing field '{name}'" for name in _FIELDS if name not in value]
    custom_id, method, url, body = (value.get(name) for name in _FIELDS)
    if "custom_id" in value and not (isinstance(custom_id, str) and custom_id):
        problems.append("custom_id must be a non-empty string")
    if "method" in value and method != "POST":
        problems.append("method must be POST")
    if "url" in value and not isinstance(url, str):
        problems.append("url must be a string")
    if "body" in value and not isinstance(body, dict):
        problems.append("body must be an object")
    if problems:
        return None, problems
    return BatchLine(number, custom_id, method, url, body, raw), []


def output_line(custom_id: str, record: dict[str, Any]) -> dict[str, Any]:
    """One line of OpenAI's batch output file from a result record {"status", "output", "error"}.

    A failed record's code is read from its output `{"code": ...}` (as the chat kind writes it); without
    one it is "processing_error".
    """
    line: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id}
    if record.get("status") == "done":
        response = {"status_code": 200, "request_id": uuid.uuid4().hex, "body": record.get("output")}
        return line | {"response": response, "error": None}
    output = record.get("output")
    code = output.get("code") if isinstance(output, dict) else None
    if not (isinstance(code, str) and code):
        code = PROCESSING_ERROR
    message = record.get("error") or "the request failed"
    return line | {"response": None, "error": {"code": code, "message": message}}


def output_file(records: Iterable[tuple[str, dict[str, Any]]]) -> bytes:
    """The output file (JSONL) for (custom_id, record) pairs."""
    return b"".join(json.dumps(output_line(cid, rec)).encode() + b"\n" for cid, rec in records)
