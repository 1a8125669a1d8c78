"""OpenAI Batch API files: read an input JSONL file, write lines of the output file.

Input lines are `{"custom_id", "method": "POST", "url", "body"}`. `read_batch_file` gives every line, good
(`BatchLine`) or bad (`BadLine`, with a content-free problem), so that a bad line can fail alone;
`parse_batch_file` refuses a file with any bad line, naming each. A well-formed line for an unsupported url
is not a bad line here: it fails alone when run. Parsing is bounded (`jobs.bounded_json`): no line can
raise anything but these types, and no message quotes a line.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jobs.base import INVALID_REQUEST, PROCESSING_ERROR, one_line
from jobs.bounded_json import MAX_DEPTH, JSONInputError, TooDeep, has_lone_surrogate, json_type, load_members

_FIELDS = ("custom_id", "method", "url", "body")
MAX_LINE_BYTES = 64 * 2**20  # far above any document limit: a bound on parsing, not a quota
MAX_CUSTOM_ID = 512  # characters
MAX_MESSAGE = 300  # characters of a BatchFileError message
_LEGACY_CODES = {"invalid_request": INVALID_REQUEST}  # results sealed before the codes followed OpenAI


class BatchFileError(ValueError):
    """A batch file that cannot be accepted; `errors` has one entry per problem ("line 3: not valid JSON").

    The message is one line of at most MAX_MESSAGE characters: the count, then as many problems as fit.
    """

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        count = len(errors)
        head = f"the batch file has {count} problem{'s' * (count != 1)}: "
        super().__init__(head + join_bounded(errors, MAX_MESSAGE - len(head)))


def join_bounded(items: list[str], limit: int) -> str:
    """`items` joined with "; ", as many as fit in `limit` characters, then "(N more)"."""
    text = ""
    for shown, item in enumerate(items):
        left = len(items) - shown - 1
        candidate = f"{text}; {item}" if text else item
        if len(candidate) + (len(f"; ({left} more)") if left else 0) > limit:
            if not text:  # not even the first fits: cut it
                tail = f"; ({left} more)" if left else ""
                return one_line(item, limit - len(tail)) + tail
            return f"{text}; ({left + 1} more)"
        text = candidate
    return text


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch file; `raw` is the line as given, without its line ending."""

    line_no: int
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]
    raw: bytes


@dataclass(frozen=True)
class BadLine:
    """A line that cannot be run: `problem` is content-free; `custom_id` is None when the line has no usable,
    unique one; `duplicate` when its custom_id is that of an earlier line."""

    line_no: int
    custom_id: str | None
    problem: str
    raw: bytes
    duplicate: bool = False


def read_batch_file(data: bytes) -> list[BatchLine | BadLine]:
    """Every non-blank line of a batch file, in order, as a `BatchLine` or a `BadLine`; a later line with
    the custom_id of an earlier one is a `BadLine` without custom_id."""
    lines: list[BatchLine | BadLine] = []
    first_seen: dict[str, int] = {}
    for number, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").split(b"\n"), start=1):
        raw = raw.removesuffix(b"\r")
        if not raw.strip():
            continue
        line = parse_line(raw, number)
        if line.custom_id is not None:
            if line.custom_id in first_seen:
                first = first_seen[line.custom_id]
                line = BadLine(number, None, f"duplicate custom_id (first on line {first})", raw, True)
            else:
                first_seen[line.custom_id] = number
        lines.append(line)
    return lines


def parse_batch_file(data: bytes) -> list[BatchLine]:
    """The requests of a batch file, in order; `BatchFileError` listing every bad line. Blank lines are
    skipped."""
    lines = read_batch_file(data)
    errors = [f"line {line.line_no}: {line.problem}" for line in lines if isinstance(line, BadLine)]
    if errors:
        raise BatchFileError(errors)
    if not lines:
        raise BatchFileError(["the file has no requests"])
    return [line for line in lines if isinstance(line, BatchLine)]


def parse_line(raw: bytes, line_no: int = 1) -> BatchLine | BadLine:
    """One line of a batch file (also what the worker reads back as a chat document)."""
    try:
        value = load_members(raw, "the line", MAX_DEPTH, MAX_LINE_BYTES, check_unicode=False)
    except JSONInputError as exc:
        return BadLine(line_no, None, str(exc).removeprefix("the line "), raw)
    # Lone surrogates (a "\ud800" escape) are looked for member by member, so the custom_id survives one
    # in the body; a member named otherwise is not named here (its name is content).
    lone = [name for name, member in value.items() if has_lone_surrogate({name: member})]
    custom_id = value.get("custom_id")
    usable_id = isinstance(custom_id, str) and 0 < len(custom_id) <= MAX_CUSTOM_ID and "custom_id" not in lone
    problems = [f"missing field '{name}'" for name in _FIELDS if name not in value]
    problems += [
        f"{name} holds a lone surrogate (a \\ud800-style escape)" for name in _FIELDS if name in lone
    ]
    if any(name not in _FIELDS for name in lone):
        problems.append("a member holds a lone surrogate (a \\ud800-style escape)")
    method, url, body = (value.get(name) for name in _FIELDS[1:])
    if "custom_id" in value and not usable_id:
        problems.append(f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters")
    if "method" in value and method != "POST":
        problems.append("method must be POST")
    if "url" in value and not isinstance(url, str):
        problems.append(f"url must be a string, not {json_type(url)}")
    if isinstance(body, TooDeep):
        problems.append(f"body is nested more than {MAX_DEPTH - 1} levels deep")
    elif "body" in value and not isinstance(body, dict):
        problems.append(f"body must be an object, not {json_type(body)}")
    if problems:
        return BadLine(line_no, custom_id if usable_id else None, "; ".join(problems), raw)
    return BatchLine(line_no, custom_id, method, url, body, raw)


def output_line(custom_id: str, record: dict[str, Any]) -> dict[str, Any]:
    """One line of OpenAI's batch output file from a result record {"status", "output", "error", "detail"}.

    A failed record's code is read from its output `{"code": ...}` (as the chat kind writes it); without
    one it is "processing_error". A request the chat kind refused (`"status_code": 400` in its output) is
    written as OpenAI writes one: a 400 response whose body is `{"error": {message, type, param, code}}`.
    Other failures go into the line's `error`. The message is the sealed `detail` when there is one, else
    the reason.
    """
    line: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id}
    if record.get("status") == "done":
        response = {"status_code": 200, "request_id": uuid.uuid4().hex, "body": record.get("output")}
        return line | {"response": response, "error": None}
    output = record.get("output")
    code = output.get("code") if isinstance(output, dict) else None
    if not (isinstance(code, str) and code):
        code = PROCESSING_ERROR
    message = record.get("detail") or record.get("error") or "the request failed"
    if isinstance(output, dict) and output.get("status_code") == 400:  # the request itself was refused
        error = {"message": message, "type": output.get("type") or INVALID_REQUEST}
        error |= {"param": output.get("param"), "code": code}
        response = {"status_code": 400, "request_id": uuid.uuid4().hex, "body": {"error": error}}
        return line | {"response": response, "error": None}
    return line | {"response": None, "error": {"code": _LEGACY_CODES.get(code, code), "message": message}}


def output_file(records: Iterable[tuple[str, dict[str, Any]]]) -> bytes:
    """The output file (JSONL) for (custom_id, record) pairs."""
    return b"".join(json.dumps(output_line(cid, rec)).encode() + b"\n" for cid, rec in records)
