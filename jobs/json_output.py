"""Find JSON in model text, and describe JSON Schema failures without quoting the instance."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from jsonschema import ValidationError

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


def json_values(text: str, openers: str = "{[") -> Iterator[tuple[Any, int]]:
    """Each JSON value that starts at one of `openers` in `text`, in order, with its end offset.

    Scanning resumes after a decoded value, so prose, ```json fences and JSON lines are all tolerated.
    """
    pos = 0
    while True:
        starts = [i for i in (text.find(c, pos) for c in openers) if i >= 0]
        if not starts:
            return
        start = min(starts)
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            pos = start + 1
            continue
        yield value, end
        pos = end


def first_object(text: str) -> dict[str, Any] | None:
    """The first JSON object in `text` (a balanced {...} that parses), or None."""
    return next((value for value, _ in json_values(text, "{") if isinstance(value, dict)), None)


def schema_names(schema: Any) -> set[str]:
    """Every property name a schema mentions (under properties, required, dependentRequired...)."""
    names: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in ("properties", "dependentRequired", "dependentSchemas") and isinstance(value, dict):
                names.update(value)
            elif key == "required" and isinstance(value, list):
                names.update(v for v in value if isinstance(v, str))
            names |= schema_names(value)
    elif isinstance(schema, list):
        for item in schema:
            names |= schema_names(item)
    return names


def describe_error(error: ValidationError, known_names: set[str]) -> str:
    """A content-free message: the path (with keys the schema does not name masked) and the keyword.

    jsonschema's own messages quote the instance, which is model output about a private document.
    """
    path = "$"
    for part in error.absolute_path:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in known_names and part.isidentifier():
            path += f".{part}"
        elif part in known_names:
            path += f"[{json.dumps(part)}]"
        else:
            path += ".*"
    keyword, expected = error.validator, error.validator_value
    if keyword == "type":
        types = [expected] if isinstance(expected, str) else list(expected)
        detail = f"expected {' or '.join(types)}"
    elif keyword == "required":
        present = error.instance if isinstance(error.instance, dict) else {}
        missing = [name for name in expected if name not in present]
        detail = f"missing required property '{missing[0]}'" if missing else "missing a required property"
    elif keyword == "enum":
        detail = f"expected one of {_short(expected)}"
    elif keyword == "const":
        detail = f"expected {_short(expected)}"
    elif keyword in _BOUNDS:
        detail = f"violates {keyword} {expected}"
    elif keyword == "format":
        detail = f"expected format {expected}"
    elif keyword == "additionalProperties":
        detail = "has properties the schema does not allow"
    else:
        detail = f"fails '{keyword}'"
    return f"model output does not match the schema at {path}: {detail}"


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
