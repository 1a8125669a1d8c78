"""Parse job parameters: strings from `--param key=value` or the typed values of a signed manifest."""

from __future__ import annotations

import math
from typing import Any


class JobParamError(ValueError):
    """A bad `--param` value; the one-line message names the parameter."""


def take_int(
    params: dict[str, Any], name: str, default: int | None, minimum: int | None = None
) -> int | None:
    """Pop `name` from `params` as an integer (or `default` when absent)."""
    value = params.pop(name, None)
    if value is None:
        return default
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise JobParamError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise JobParamError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise JobParamError(f"{name} must be at least {minimum}, got {value}")
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
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise JobParamError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise JobParamError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if minimum is not None and value < minimum:
        raise JobParamError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise JobParamError(f"{name} must be at most {maximum}, got {value}")
    if above is not None and value <= above:
        raise JobParamError(f"{name} must be greater than {above}, got {value}")
    return value


def take_str(params: dict[str, Any], name: str, default: str | None = None) -> str | None:
    """Pop `name` as a non-empty string (surrounding whitespace removed)."""
    value = params.pop(name, None)
    if value is None:
        return default
    if not isinstance(value, str):
        raise JobParamError(f"{name} must be a string, got {type(value).__name__}")
    value = value.strip()
    if not value:
        raise JobParamError(f"{name} must not be empty")
    return value


def take_sampling(params: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """Pop the common sampling parameters: max_tokens, temperature (default 0: greedy), top_p, seed."""
    sampling = {
        "max_tokens": take_int(params, "max_tokens", default_max_tokens, minimum=1),
        "temperature": take_float(params, "temperature", 0.0, minimum=0.0),
        "top_p": take_float(params, "top_p", 1.0, maximum=1.0, above=0.0),
        "seed": take_int(params, "seed", None),
    }
    return {key: value for key, value in sampling.items() if value is not None}
