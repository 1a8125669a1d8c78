"""Parse job parameters: strings from `--param key=value` or the typed values of a signed manifest.

Parameters are values, never paths the service resolves: a client reads `--param key=@file` itself with
`resolve_file_params` and sends the file's text. Errors name the parameter and the rule, never the value
(parameters are plaintext and the worker stores its reasons in clear).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from jobs.bounded_json import json_type

MAX_STRING_PARAM = 1_000_000  # characters of one text parameter (instructions, a JSON Schema...)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a 64-bit generator seed can hold
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_LIST_ITEMS = 256  # items of one list parameter (the globs of include, say)
MAX_LIST_ITEM = 1024  # characters of one item
_MAX_LIST_TEXT = MAX_LIST_ITEMS * (MAX_LIST_ITEM + 1)
_INTEGER = re.compile(r"[+-]?[0-9]{1,40}")
# A git revision as `git rev-parse` takes it: no whitespace or control characters, never an option.
_REVISION = re.compile(r"[^\s\x00-\x1f\x7f-][^\s\x00-\x1f\x7f]{0,255}")


class JobParamError(ValueError):
    """A bad parameter; the one-line message names the parameter and the rule, never the value."""


def _got(value: Any) -> str:
    if isinstance(value, str):
        return f"a {len(value)}-character string"
    return json_type(value)


def take_int(
    params: dict[str, Any],
    name: str,
    default: int | None,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    """Pop `name` from `params` as an integer within [minimum, maximum] (or `default` when absent)."""
    value = params.pop(name, None)
    if value is None:
        return default
    if isinstance(value, str):
        text = value.strip()
        if not _INTEGER.fullmatch(text):
            raise JobParamError(f"{name} must be an integer (got {_got(value)})")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise JobParamError(f"{name} must be an integer (got {_got(value)})")
    if minimum is not None and value < minimum:
        raise JobParamError(f"{name} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise JobParamError(f"{name} must be at most {maximum}")
    return value


def take_float(
    params: dict[str, Any],
    name: str,
    default: float | None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> float | None:
    """Pop `name` as a finite number within [minimum, maximum] (and > `above` when given)."""
    value = params.pop(name, None)
    if value is None:
        return default
    if isinstance(value, str) and len(value) <= 64:
        try:
            value = float(value.strip())
        except ValueError:
            raise JobParamError(f"{name} must be a number (got {_got(value)})") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise JobParamError(f"{name} must be a number (got {_got(value)})")
    try:
        value = float(value)  # an int past 1e308 overflows
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise JobParamError(f"{name} must be a finite number")
    if minimum is not None and value < minimum:
        raise JobParamError(f"{name} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise JobParamError(f"{name} must be at most {maximum}")
    if above is not None and value <= above:
        raise JobParamError(f"{name} must be greater than {above}")
    return value


def take_str(params: dict[str, Any], name: str, default: str | None = None) -> str | None:
    """Pop `name` as a non-empty string (surrounding whitespace removed) of at most MAX_STRING_PARAM."""
    value = params.pop(name, None)
    if value is None:
        return default
    if not isinstance(value, str):
        raise JobParamError(f"{name} must be a string (got {_got(value)})")
    if len(value) > MAX_STRING_PARAM:
        raise JobParamError(f"{name} is {len(value)} characters; the limit is {MAX_STRING_PARAM}")
    value = value.strip()
    if not value:
        raise JobParamError(f"{name} must not be empty")
    return value


def take_list(params: dict[str, Any], name: str) -> list[str] | None:
    """Pop `name` as a list of non-empty strings: comma-separated text (the command line) or a JSON list of
    strings (a manifest); surrounding whitespace is removed. None when absent."""
    value = params.pop(name, None)
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > _MAX_LIST_TEXT:
            raise JobParamError(f"{name} is {len(value)} characters; the limit is {_MAX_LIST_TEXT}")
        value = value.split(",")
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise JobParamError(f"{name} must be comma-separated text or a list of strings (got {_got(value)})")
    items = [item.strip() for item in value if item.strip()]
    if not items:
        raise JobParamError(f"{name} must name at least one item")
    if len(items) > MAX_LIST_ITEMS:
        raise JobParamError(f"{name} has {len(items)} items; the limit is {MAX_LIST_ITEMS}")
    if (longest := max(len(item) for item in items)) > MAX_LIST_ITEM:
        raise JobParamError(f"{name} has an item of {longest} characters; the limit is {MAX_LIST_ITEM}")
    return items


def take_globs(params: dict[str, Any], name: str) -> list[str] | None:
    """Pop `name` as gitignore-style patterns (each as one line of a .gitignore: `*.py` matches at any
    depth, `docs/` a folder, `/setup.py` the root only, `**` any folders, `!` re-includes), comma-separated
    (a pattern cannot hold a comma). None when absent."""
    from pathspec import GitIgnoreSpec

    patterns = take_list(params, name)
    for index, pattern in enumerate(patterns or []):
        try:
            GitIgnoreSpec.from_lines([pattern])
        except ValueError:  # pathspec's pattern error (`!` or `\\` alone) is a ValueError
            raise JobParamError(f"{name}: pattern {index + 1} is not a gitignore-style pattern") from None
    return patterns


def take_choices(
    params: dict[str, Any], name: str, allowed: tuple[str, ...], default: tuple[str, ...]
) -> list[str]:
    """Pop `name` as a subset of `allowed` (comma-separated, or "none" for the empty set), sorted; `default`
    when absent."""
    value = params.get(name)
    if value == [] or (isinstance(value, str) and value.strip().lower() == "none"):
        params.pop(name)
        return []
    items = take_list(params, name)
    if items is None:
        return sorted(default)
    if any(item not in allowed for item in items):
        raise JobParamError(f"{name} must be none or a comma-separated list of: {', '.join(allowed)}")
    return sorted(set(items))


def take_revision(params: dict[str, Any], name: str) -> str | None:
    """Pop `name` as a git revision (a SHA, branch, tag, or an expression such as HEAD~2): no whitespace or
    control characters, not starting with - (so it never reads as an option of git)."""
    value = take_str(params, name)
    if value is not None and not _REVISION.fullmatch(value):
        raise JobParamError(
            f"{name} must be a git revision such as a SHA, a branch or a tag (at most 256 characters, no "
            "spaces, not starting with -)"
        )
    return value


def take_sampling(params: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """Pop the common sampling parameters: max_tokens, temperature (default 0: greedy), top_p, seed."""
    sampling = {
        "max_tokens": take_int(params, "max_tokens", default_max_tokens, minimum=1, maximum=MAX_TOKENS_LIMIT),
        "temperature": take_float(params, "temperature", 0.0, minimum=0.0),
        "top_p": take_float(params, "top_p", 1.0, maximum=1.0, above=0.0),
        "seed": take_seed(params),
    }
    return {key: value for key, value in sampling.items() if value is not None}


def take_seed(params: dict[str, Any]) -> int | None:
    """Pop `seed`: an integer that fits a 64-bit generator."""
    seed = take_int(params, "seed", None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise JobParamError("seed must be an integer that fits in 64 bits")
    return seed


def resolve_file_params(params: dict[str, str]) -> dict[str, str]:
    """On the client: each `key=@path` value replaced by the text of the file at `path` (`@@` keeps a
    literal leading @), so the service receives values, never paths to resolve on its host."""
    resolved = {}
    for key, value in params.items():
        if isinstance(value, str) and value.startswith("@@"):
            value = value[1:]
        elif isinstance(value, str) and value.startswith("@"):
            try:
                value = Path(value[1:]).expanduser().read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise JobParamError(f"the file given for {key} with @ is not UTF-8 text") from None
            except OSError as exc:
                reason = exc.strerror or type(exc).__name__
                raise JobParamError(f"the file given for {key} with @ cannot be read: {reason}") from None
        resolved[key] = value
    return resolved
