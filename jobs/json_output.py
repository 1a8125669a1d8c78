"""Find JSON in model text, and describe JSON Schema failures without quoting the instance or the schema.

Model text is untrusted too (a document can instruct the model): values are decoded within
`jobs.bounded_json` bounds, and a value nested too deeply, or holding a number or string that cannot be
carried on, is skipped like any other text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from jsonschema import ValidationError

from jobs.bounded_json import MAX_DEPTH, nesting_depth

_DECODER = json.JSONDecoder()
_BOUNDS = {
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
}
_TYPES = {"array", "boolean", "integer", "null", "number", "object", "string"}


def json_values(text: str, openers: str = "{[") -> Iterator[tuple[Any, int]]:
    """Each JSON value that starts at one of `openers` in `text`, in order, with its end offset.

    Scanning resumes after a decoded value, so prose, ```json fences and JSON lines are all tolerated. A
    value nested deeper than MAX_DEPTH is skipped whole (found with a flat scan, never decoded).
    """
    pos = 0
    while True:
        starts = [i for i in (text.find(c, pos) for c in openers) if i >= 0]
        if not starts:
            return
        start = min(starts)
        end, depth = nesting_depth(text, start, one_value=True)
        if depth > MAX_DEPTH:
            pos = end
            continue
        try:
            value, end = _DECODER.raw_decode(text, start)
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (ValueError, RecursionError):  # not JSON; NaN; 4,300+ digits; a lone surrogate (\ud800)
            pos = start + 1
            continue
        yield value, end
        pos = end


def first_object(text: str) -> dict[str, Any] | None:
    """The first JSON object in `text` (a balanced {...} that parses), or None."""
    return next((value for value, _ in json_values(text, "{") if isinstance(value, dict)), None)


def describe_error(error: ValidationError) -> tuple[str, str]:
    """(reason, detail) for a schema failure. The reason is content-free: the path with every property name
    masked (names come from the schema, a job parameter) and the keyword, never a value; the detail names
    the path and quotes jsonschema's message, which quotes the instance: it goes only into the sealed
    result."""
    path, named = "$", "$"
    for part in error.absolute_path:
        if isinstance(part, int):
            path += f"[{part}]"
            named += f"[{part}]"
        else:
            path += ".*"
            named += f".{part}" if str(part).isidentifier() else f"[{json.dumps(part)}]"
    keyword, expected = error.validator, error.validator_value
    if keyword == "type":
        types = [expected] if isinstance(expected, str) else list(expected)
        known = all(isinstance(t, str) and t in _TYPES for t in types)
        what = f"expected {' or '.join(types)}" if known and types else "has the wrong type"
    elif keyword == "required":
        present = error.instance if isinstance(error.instance, dict) else {}
        missing = [name for name in expected if name not in present]
        what = f"missing {len(missing) or 'a'} required propert{'ies' if len(missing) > 1 else 'y'}"
    elif keyword == "enum":
        what = f"expected one of {len(expected)} values" if isinstance(expected, list) else "fails 'enum'"
    elif keyword == "const":
        what = "expected the schema's constant"
    elif keyword in _BOUNDS:
        what = f"violates {keyword}"
    elif keyword == "additionalProperties":
        what = "has properties the schema does not allow"
    else:
        what = f"fails '{keyword}'" if str(keyword).isidentifier() and len(str(keyword)) <= 40 else "fails"
    prefix = "model output does not match the schema at"
    return f"{prefix} {path}: {what}", f"{prefix} {named}: {error.message}"
