"""Parse untrusted JSON within bounds, with errors that never quote the text.

`json.loads` recurses once per nesting level, so `[[[[...` 100,000 deep raises RecursionError; a number of
more than 4,300 digits raises a ValueError that is no JSONDecodeError; `1e400` becomes infinity. `loads`
measures nesting with a flat scan before parsing and turns each of these into `JSONInputError`, whose
one-line message holds only offsets, sizes and fixed words.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64  # arrays and objects inside one another; ample for requests, manifests and JSON Schemas

# A whole string (skipped, so brackets inside it do not count) or one bracket.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_SPACE = re.compile(r"[ \t\n\r]*")


class JSONInputError(ValueError):
    """Untrusted JSON that cannot be accepted; the message is one line and content-free."""


@dataclass(frozen=True)
class TooDeep:
    """Stands for a member of a top-level object nested deeper than allowed (see `load_members`)."""

    depth: int


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("non-finite number")
    return value


def _constant(name: str) -> Any:
    raise ValueError("NaN and Infinity are not JSON")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_constant)


def nesting_depth(text: str, start: int = 0, one_value: bool = False) -> tuple[int, int]:
    """(end, depth): the deepest nesting of brackets outside strings from `start`, without recursion.

    With `one_value`, the scan stops where the value opening at `start` closes and `end` is just after it;
    otherwise (or when it never closes) `end` is len(text). Brackets are counted, not matched.
    """
    depth = deepest = 0
    for match in _TOKENS.finditer(text, start):
        char = match.group()[0]
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
            if one_value and depth <= 0:
                return match.end(), deepest
    return len(text), deepest


def as_text(data: str | bytes, what: str, max_bytes: int | None = None) -> str:
    """`data` as text: UTF-8 bytes decoded, a size limit applied; `JSONInputError` otherwise."""
    if isinstance(data, bytes | bytearray | memoryview):
        if max_bytes is not None and len(data) > max_bytes:
            raise JSONInputError(f"{what} is {len(data)} bytes; the limit is {max_bytes}")
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONInputError(
                f"{what} is not valid UTF-8 (first bad byte at offset {exc.start})"
            ) from None
    if not isinstance(data, str):
        raise JSONInputError(f"{what} must be text, not {type(data).__name__}")
    if max_bytes is not None and len(data) > max_bytes:
        raise JSONInputError(f"{what} is {len(data)} characters; the limit is {max_bytes}")
    return data


def loads(
    data: str | bytes,
    what: str = "JSON",
    max_depth: int = MAX_DEPTH,
    max_bytes: int | None = None,
    check_unicode: bool = True,
) -> Any:
    """Parse `data` (text or UTF-8 bytes) nested at most `max_depth` deep, without NaN or infinities.

    `what` names the input in error messages ("line", "manifest"...).
    """
    text = as_text(data, what, max_bytes)
    if text.count("[") + text.count("{") > max_depth:
        _, depth = nesting_depth(text)
        if depth > max_depth:
            raise JSONInputError(f"{what} is nested more than {max_depth} levels deep")
    try:
        value, end = _DECODER.raw_decode(text, _SPACE.match(text).end())
    except ValueError as exc:
        raise _decode_error(what, exc) from None
    except RecursionError:  # cannot happen within max_depth; kept so that no input escapes as one
        raise JSONInputError(f"{what} is nested too deeply") from None
    if _SPACE.match(text, end).end() != len(text):
        raise JSONInputError(f"{what} is not valid JSON (extra data at offset {end})")
    if check_unicode:
        _check_unicode(text, value, what)
    return value


def _check_unicode(text: str, value: Any, what: str) -> None:
    """Refuse lone surrogates (a "\\ud800" escape): no UTF-8 encoder, tokenizer or seal accepts them."""
    if "\\u" not in text and text.isascii():
        return
    try:
        json.dumps(value, ensure_ascii=False, default=lambda _: None).encode("utf-8")
    except UnicodeEncodeError:
        raise JSONInputError(
            f"{what} holds a lone surrogate (a \\ud800-style escape), not Unicode text"
        ) from None


def load_members(
    data: str | bytes,
    what: str = "JSON",
    max_depth: int = MAX_DEPTH,
    max_bytes: int | None = None,
    check_unicode: bool = True,
) -> dict[str, Any]:
    """The members of a top-level JSON object; a member nested deeper than the limit becomes `TooDeep`.

    So a batch line whose body is 100,000 levels deep still yields its custom_id and fails alone. Without
    `check_unicode`, lone surrogates are left for the caller to find member by member (`has_lone_surrogate`).
    """
    text = as_text(data, what, max_bytes)
    if text.count("[") + text.count("{") <= max_depth or nesting_depth(text)[1] <= max_depth:
        value = loads(text, what, max_depth, check_unicode=check_unicode)
        if not isinstance(value, dict):
            raise JSONInputError(f"{what} must be a JSON object, not {json_type(value)}")
        return value
    if not text.lstrip(" \t\n\r").startswith("{"):
        raise JSONInputError(f"{what} is nested more than {max_depth} levels deep")
    try:
        members = _walk_members(text, max_depth)
    except ValueError as exc:
        raise _decode_error(what, exc) from None
    if check_unicode:
        _check_unicode(text, members, what)
    return members


def has_lone_surrogate(value: Any) -> bool:
    """Whether a parsed value (keys included) holds a lone surrogate, which no UTF-8 encoder accepts."""
    try:
        json.dumps(value, ensure_ascii=False, default=lambda _: None).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _walk_members(text: str, max_depth: int) -> dict[str, Any]:
    """Read a top-level object member by member, skipping (with a flat scan) members that are too deep."""
    pos = _SPACE.match(text).end()
    if not text.startswith("{", pos):
        raise json.JSONDecodeError("Expecting an object", text, pos)
    members: dict[str, Any] = {}
    pos = _SPACE.match(text, pos + 1).end()
    if text.startswith("}", pos):
        pos += 1
    else:
        while True:
            if not text.startswith('"', pos):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _SPACE.match(text, pos).end()
            if not text.startswith(":", pos):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
            pos = _SPACE.match(text, pos + 1).end()
            end, depth = (
                nesting_depth(text, pos, one_value=True) if text[pos : pos + 1] in ("[", "{") else (0, 0)
            )
            if depth >= max_depth:  # the member sits one level down already
                members[key], pos = TooDeep(depth), end
            else:
                members[key], pos = _DECODER.raw_decode(text, pos)
            pos = _SPACE.match(text, pos).end()
            if text.startswith(",", pos):
                pos = _SPACE.match(text, pos + 1).end()
                continue
            if not text.startswith("}", pos):
                raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
            pos += 1
            break
    if _SPACE.match(text, pos).end() != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)
    return members


def _decode_error(what: str, exc: ValueError) -> JSONInputError:
    if isinstance(exc, json.JSONDecodeError):  # its msg is a fixed phrase of the json module
        return JSONInputError(f"{what} is not valid JSON ({exc.msg} at offset {exc.pos})")
    # int() past 4,300 digits, or one of our hooks: NaN, Infinity, a float that overflows
    return JSONInputError(f"{what} holds a number JSON cannot carry here (NaN, infinite or over 4300 digits)")


def json_type(value: Any) -> str:
    """The JSON type name of a parsed value, for messages that must not quote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, TooDeep):
        return "value nested too deeply"
    return type(value).__name__
