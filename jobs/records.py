"""Records as documents: each row of a CSV, JSONL or Parquet file becomes one document, named by its key.

A row's document is its fields as text, one `name: value` line each (a record export reads to a model as a
short note), in column order. Its key is the value of the `key` column when one is named (it must be
non-empty and unique), else `row N` (1-based, data rows only). A row that cannot be read (a CSV row with
the wrong number of fields or bytes that are not UTF-8, a JSONL line that is not a JSON object, a missing
or repeated key) is a `Record` with an `error` and no data, so that it fails alone; the others go on.
Errors are content-free: row numbers, counts and column positions, never a value.

`enclave submit FILE --records [--key COLUMN]` sends them (`pipeline.client.submit_records`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.bounded_json import JSONInputError, json_type
from jobs.bounded_json import loads as load_json

FORMATS = ("csv", "jsonl", "parquet")
MAX_FIELD_CHARS = 10_000_000  # csv's own limit is 131,072: a clinical note in one cell is longer


class RecordsError(ValueError):
    """A records file that cannot be read at all (unknown format, no header, unreadable Parquet)."""


@dataclass(frozen=True)
class Record:
    """One row: `key` names it; `data` is its document (UTF-8 text), or None with `error` saying why."""

    key: str
    data: bytes | None
    error: str | None = None


def records_format(path: Path, declared: str | None = None) -> str:
    """The file's format: `declared`, else from its extension (.csv, .jsonl/.ndjson, .parquet)."""
    name = (declared or path.suffix.lstrip(".")).lower()
    name = {"ndjson": "jsonl", "pq": "parquet"}.get(name, name)
    if name not in FORMATS:
        raise RecordsError(
            f"{path.name}: records must be one of {', '.join(FORMATS)} (by extension or format)"
        )
    return name


def read_records(path: Path, key: str | None = None, declared: str | None = None) -> Iterator[Record]:
    """Every row of the file at `path` as a `Record`, in order, one at a time."""
    rows = {"csv": _csv_rows, "jsonl": _jsonl_rows, "parquet": _parquet_rows}[records_format(path, declared)]
    seen: dict[str, int] = {}
    for number, fields, problem in rows(path):
        name = f"row {number}"
        if problem is None and key is not None:
            value = fields.get(key)
            if value is None or not str(value).strip():
                problem = "the key column is missing or empty"
            elif str(value) in seen:
                problem = f"the key repeats row {seen[str(value)]}'s"
            else:
                name = str(value)
                seen[name] = number
        if problem is not None:
            yield Record(name, None, f"row {number}: {problem}")
        else:
            yield Record(name, _document(fields))


def _document(fields: dict[str, Any]) -> bytes:
    lines = []
    for name, value in fields.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        lines.append(f"{name}: {text}")
    return ("\n".join(lines) + "\n").encode("utf-8")


Row = tuple[int, dict[str, Any], str | None]  # (1-based row number, fields, problem or None)


def _csv_rows(path: Path) -> Iterator[Row]:
    csv.field_size_limit(MAX_FIELD_CHARS)
    # Undecodable bytes become lone surrogates, found per row, so that one bad row does not stop the file.
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as file:
        reader = csv.reader(file)
        header = next(reader, None)
        if not header:
            raise RecordsError(f"{path.name} has no header row")
        for number, cells in enumerate(reader, start=1):
            if not cells:
                continue
            if len(cells) != len(header):
                yield number, {}, f"has {len(cells)} fields; the header has {len(header)}"
            elif (bad := next((i for i, c in enumerate(cells) if _not_utf8(c)), None)) is not None:
                yield number, {}, f"field {bad + 1} is not valid UTF-8"
            else:
                yield number, dict(zip(header, cells, strict=True)), None


def _not_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _jsonl_rows(path: Path) -> Iterator[Row]:
    number = 0
    with open(path, "rb") as file:
        for raw in file:
            if not raw.strip():
                continue
            number += 1
            try:
                value = load_json(raw.removeprefix(b"\xef\xbb\xbf"), "the line")
            except JSONInputError as exc:
                yield number, {}, str(exc)
                continue
            if isinstance(value, dict):
                yield number, value, None
            else:
                yield number, {}, f"is {json_type(value)}, not a JSON object"


def _parquet_rows(path: Path) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecordsError("reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise RecordsError(f"{path.name} is not a readable Parquet file ({type(exc).__name__})") from None
    number = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for fields in batch.to_pylist():
            number += 1
            yield number, fields, None
